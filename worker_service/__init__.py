"""worker_service."""
