"""The engine core: block accounting, scheduling, the model runner and everything it runs.

Imports no service (no gRPC, no Redis): the services in ``pagedserve/services/`` are shells around it, and
``pagedserve.llm`` runs it in one process.
"""
