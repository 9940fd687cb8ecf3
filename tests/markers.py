"""Skip markers that several test packages share."""

from __future__ import annotations

import pytest

from pagedserve.engine.attention.prefill_op import prefill_op_preferred

needs_prefill_op = pytest.mark.skipif(
    not prefill_op_preferred(), reason="prefills use the CPU prefill op only where cpu_features.own_kernels_preferred")
"""For tests of prefills through the C++ prefill op (built, and preferred on this CPU)."""
