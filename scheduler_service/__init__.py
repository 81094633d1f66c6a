"""scheduler_service."""
