"""Tensor and pipeline parallelism inside one worker (Megatron-LM sharding, Shoeybi et al., 2019,
§3; consecutive-layer stages, Huang et al., 2019, with vLLM's virtual engines).

``group``: the process group and its collectives; ``sharding``: which slice of each checkpoint
tensor a rank holds, read with safetensors' ``get_slice``; ``rank``: one rank's runner(s);
``pipeline``: stage layouts and a stage's forward; ``spawn``: starting, readying and stopping
helper ranks; ``launch``: rank 0 in this process driving spawned helper ranks
(``pipeline_runner`` when there are stages). This package module imports nothing.
"""
