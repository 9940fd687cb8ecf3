"""Tensor parallelism inside one worker (Megatron-LM sharding, Shoeybi et al., 2019, §3).

``group``: the process group and its collectives; ``sharding``: which slice of each checkpoint
tensor a rank holds, read with safetensors' ``get_slice``; ``rank``: one rank's runner;
``launch``: rank 0 in this process driving spawned helper ranks. Kept free of imports here so
that the model classes can import ``sharding`` lazily without a cycle.
"""
