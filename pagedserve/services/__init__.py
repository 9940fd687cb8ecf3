"""The services, each a process shell around the engine (``pagedserve.engine``): ``gateway``, ``scheduler``,
``worker``, and what they share (``common``: protobuf stubs, auth, Redis keys, telemetry).
"""
