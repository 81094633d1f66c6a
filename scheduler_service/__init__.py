"""scheduler_service: the scheduler in two rooms.

`engine/` is the seed's engine, synchronous and free of gRPC and asyncio: sequences, the block
manager, the iteration scheduler, step building, output processing, grammars and drafts.
`fleet/` is the control plane, asynchronous: the gRPC service, replicas, routing, membership,
moves of requests and of KV blocks, roles and shards. The fleet imports the engine; the
engine imports nothing from the fleet.
"""
