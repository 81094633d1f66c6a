"""The scheduler's control plane: the gRPC service, the fleet of replicas and what moves between
them. Asynchronous; it drives `scheduler_service.engine` and is imported by nothing below it."""
