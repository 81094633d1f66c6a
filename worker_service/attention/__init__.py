"""worker_service/attention."""
