"""Kernel tests run the Triton kernels in the interpreter when there is no GPU.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is decorated, so it
must be set before the kernel modules are imported; any kernel module imported
earlier (e.g. by another test directory) is reloaded so it picks the mode up.
"""

import importlib
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in ("pagedserve_kernels._alibi", "pagedserve_kernels.kv_cache_write", "pagedserve_kernels.decode_attention",
                  "pagedserve_kernels.prefill_attention"):
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])
