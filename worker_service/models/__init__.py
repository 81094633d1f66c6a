"""worker_service/models."""
