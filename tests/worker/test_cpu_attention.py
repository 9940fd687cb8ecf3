"""The compiled C++ paged-attention op for CPU against the reference, and its fallback."""

from __future__ import annotations

import logging
import os
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve_kernels.reference import paged_attention_ref
from pagedserve.engine.attention import (CpuAttentionBackend, TorchAttentionBackend, build_attention_metadata,
                                         compute_positions, make_attention_backend)
from pagedserve.engine.attention import cpu_op
from pagedserve.engine.attention import cpu_backend
from pagedserve.engine.attention.prefill_op import IN_PLACE_MAX_TOKENS, prefill_attention, prefill_attention_paged
from tests.markers import needs_prefill_op

OP = cpu_op.load_cpu_attention_op()
needs_op = pytest.mark.skipif(OP is None, reason="the C++ op could not be built here (see the warning)")


def _batch(seed: int, seqs: list[tuple[int, int]], block_size: int, heads: int, kv_heads: int, dim: int,
           dtype: torch.dtype = torch.float32):
    """A cache with random contents, shuffled block tables (one spare block each) and new q/k/v for
    ``(context_len, query_len)`` sequences; the new K/V already written."""
    g = torch.Generator().manual_seed(seed)
    need = sum(-(-(c + q) // block_size) + 1 for c, q in seqs)
    k_cache = torch.randn(need + 3, block_size, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(need + 3, block_size, kv_heads, dim, generator=g).to(dtype)
    free = list(range(need + 3))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + q) // block_size) + 1)] for c, q in seqs]
    query_lens, context_lens = [q for _, q in seqs], [c for c, _ in seqs]
    md = build_attention_metadata(query_lens, context_lens, tables, compute_positions(query_lens, context_lens),
                                  block_size, dtype=dtype)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, heads, dim, generator=g).to(dtype)
    k = torch.randn(num_tokens, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(num_tokens, kv_heads, dim, generator=g).to(dtype)
    TorchAttentionBackend().write_kv(k, v, k_cache, v_cache, md)
    return md, q, k, v, k_cache, v_cache


@needs_op
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (16, 2), (8, 1), (12, 2)])  # GQA groups 1, 3, 8, 8, 6
@pytest.mark.parametrize("seqs,block_size", [
    ([(9, 1), (30, 1), (0, 1), (17, 1)], 16),                    # decodes (one a one-token prompt)
    ([(0, 7), (0, 33), (5, 1)], 4),                              # fresh prefills, a decode last
    ([(5, 1), (40, 1), (0, 12), (16, 16), (13, 9), (3, 1)], 8),  # mixed, lengths not multiples of the block
    ([(700, 1), (1, 1), (250, 20)], 32),                         # long context, key tiles across blocks
])
def test_op_matches_reference_on_ragged_batches(heads, kv_heads, seqs, block_size):
    md, q, _, _, k_cache, v_cache = _batch(len(seqs), seqs, block_size, heads, kv_heads, dim=32)
    out = torch.full_like(q, float("nan"))  # every output position must be written
    OP(out, q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, 32 ** -0.5)
    want = paged_attention_ref(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, 32 ** -0.5)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@needs_op
@settings(max_examples=25, deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(0, 80), st.integers(1, 20)), min_size=1, max_size=6),
       block_size=st.sampled_from([1, 2, 4, 16, 32]), group=st.sampled_from([1, 3, 8]),
       dim=st.sampled_from([16, 64]))
def test_op_matches_reference_on_any_batch(seqs, block_size, group, dim):
    md, q, _, _, k_cache, v_cache = _batch(3, seqs, block_size, 2 * group, 2, dim)
    out = torch.full_like(q, float("nan"))
    OP(out, q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, 0.3)
    want = paged_attention_ref(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, 0.3)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@needs_op
def test_op_in_bfloat16_accumulates_in_float32():
    md, q, _, _, k_cache, v_cache = _batch(5, [(60, 1), (10, 1), (3, 9)], 16, 9, 3, 64, torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    OP(out, q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, 0.125)
    want = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), md.block_tables, md.seq_lens,
                               md.query_start_loc, 0.125)
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)


def _poison_unused_slots(md, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """NaN in every cache slot no sequence reads (other blocks and the tails of the last ones): a key tile
    that reads a slot past its sequence leaks NaN into the output."""
    used = torch.zeros(k_cache.shape[0] * k_cache.shape[1], dtype=torch.bool)
    bs = k_cache.shape[1]
    for table, length in zip(md.block_tables.tolist(), md.seq_lens.tolist()):
        for pos in range(length):
            used[table[pos // bs] * bs + pos % bs] = True
    for cache in (k_cache, v_cache):
        cache.view(-1, *cache.shape[2:])[~used] = float("nan")


@needs_op
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (16, 2), (4, 4), (12, 2), (10, 2)])  # groups 3, 8, 1, 6, 5
@pytest.mark.parametrize("dim", [32, 64, 128, 48, 80])  # 48, 80: chunks not all paired
@pytest.mark.parametrize("seqs,block_size", [
    ([(9, 1), (300, 1), (0, 1), (17, 1), (15, 1)], 16),  # decodes: tails of blocks, a one-token prompt
    ([(0, 40), (31, 3), (5, 1)], 32),                     # prefills across key tiles, a decode
    ([(40, 1), (0, 12), (13, 9)], 8),                     # blocks shorter than a key tile
])
def test_op_in_bfloat16_matches_a_float64_reference(heads, kv_heads, dim, seqs, block_size):
    """A bfloat16 query over bfloat16 K/V (read 32 channels at a time as even and odd halves, in
    whole groups of 64 channels; the rest 16 at a time) against float64 attention of the same bfloat16
    values. Every product is exact and sums are float32, so the error is the output's rounding to
    bfloat16 (half a unit in the last place: at most 2^-8 relative) plus float32 summation (~1e-6)."""
    md, q, _, _, k_cache, v_cache = _batch(7, seqs, block_size, heads, kv_heads, dim, torch.bfloat16)
    _poison_unused_slots(md, k_cache, v_cache)
    out = torch.full_like(q, float("nan"))
    OP(out, q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, dim ** -0.5)
    want = paged_attention_ref(q.double(), k_cache.double(), v_cache.double(), md.block_tables, md.seq_lens,
                               md.query_start_loc, dim ** -0.5)
    torch.testing.assert_close(out.double(), want, rtol=2 ** -8, atol=1e-5)


@needs_op
@needs_prefill_op
def test_backend_uses_the_paged_op_for_decodes_and_the_prefill_op_for_prefills():
    seqs = [(40, 1), (17, 1), (3, 1), (0, 12), (16, 16), (13, 9)]
    md, q, k, v, k_cache, v_cache = _batch(9, seqs, 8, 9, 3, 64)
    assert md.num_decode_seqs == 3
    backend = make_attention_backend("cpu", "cpu")
    assert isinstance(backend, CpuAttentionBackend)
    got = backend.attend(q, k, v, k_cache, v_cache, md, 0.125)
    want = TorchAttentionBackend().attend(q, k, v, k_cache, v_cache, md, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    fresh = prefill_attention(q[3:15], k[3:15], v[3:15], 0.125)  # (0, 12): tokens 3..14
    assert torch.equal(got[3:15], fresh)
    cached = torch.cat([k_cache[i] for i in md.block_tables[4, :4].tolist()])  # (16, 16): 4 blocks of 8
    values = torch.cat([v_cache[i] for i in md.block_tables[4, :4].tolist()])
    assert torch.equal(got[15:31], prefill_attention(q[15:31], cached, values, 0.125))


@needs_op
@needs_prefill_op
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e5m2])
def test_bfloat16_prefills_run_the_op_on_widened_rows_and_round_once(kv_dtype):
    """A bfloat16 model's prefills (fresh, over cached context in a gathered copy): the float32 op over
    the rows widened as the cache stores them, rounded to bfloat16 once; near torch's bfloat16 SDPA (which
    rounds its probabilities to bfloat16 before P V: within 2 of its units, 2^-7)."""
    seqs = [(7, 1), (0, 12), (16, 16), (5, IN_PLACE_MAX_TOKENS + 2)]
    md, q, k, v, k_cache, v_cache = _batch(5, seqs, 8, 9, 3, 64, dtype=torch.bfloat16)
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    got = make_attention_backend("cpu", "cpu").attend(q, k, v, k_cache, v_cache, md, 0.125)
    assert got.dtype == torch.bfloat16
    widen = torch.float32
    stored = [(x.to(kv_dtype).to(widen)) for x in (k, v)]
    assert torch.equal(got[1:13], prefill_attention(q[1:13].to(widen), stored[0][1:13], stored[1][1:13],
                                                    0.125).to(torch.bfloat16))
    for row, (start, end, context) in enumerate([(13, 29, 16), (29, 29 + IN_PLACE_MAX_TOKENS + 2, 5)], start=2):
        blocks = md.block_tables[row, :-(-(context + end - start) // 8)].tolist()
        keys, values = (torch.cat([cache[b] for b in blocks])[:context + end - start].to(widen)
                        for cache in (k_cache, v_cache))
        assert torch.equal(got[start:end], prefill_attention(q[start:end].to(widen), keys, values,
                                                             0.125).to(torch.bfloat16))
    want = TorchAttentionBackend().attend(q, k, v, k_cache, v_cache, md, 0.125)
    torch.testing.assert_close(got[1:].float(), want[1:].float(), rtol=0, atol=2 ** -6)


@needs_op
@needs_prefill_op
def test_short_context_prefills_read_a_float32_cache_in_place_and_long_ones_a_gathered_copy(monkeypatch):
    """16 new tokens over 20 cached: in place; IN_PLACE_MAX_TOKENS + 2 over 20: gathered; the same bits as
    the op over gathered copies either way."""
    long = IN_PLACE_MAX_TOKENS + 2
    md, q, k, v, k_cache, v_cache = _batch(4, [(20, 16), (20, long)], 8, 9, 3, 64)
    in_place, gathered = [], []

    def recorded(calls: list[int], op):
        def call(query, *args):
            calls.append(len(query))
            return op(query, *args)
        return call

    monkeypatch.setattr(cpu_backend, "prefill_attention_paged", recorded(in_place, prefill_attention_paged))
    monkeypatch.setattr(cpu_backend, "prefill_attention", recorded(gathered, prefill_attention))
    got = make_attention_backend("cpu", "cpu").attend(q, k, v, k_cache, v_cache, md, 0.125)
    assert (in_place, gathered) == ([16], [long])
    for row, (start, end) in enumerate([(0, 16), (16, 16 + long)]):
        blocks = md.block_tables[row, :-(-(20 + end - start) // 8)].tolist()
        keys, values = (torch.cat([cache[b] for b in blocks])[:20 + end - start] for cache in (k_cache, v_cache))
        assert torch.equal(got[start:end], prefill_attention(q[start:end], keys, values, 0.125))


@needs_op
def test_op_refuses_block_ids_outside_the_cache():
    md, q, _, _, k_cache, v_cache = _batch(1, [(20, 1)], 8, 4, 2, 16)
    tables = md.block_tables.clone()
    tables[0, 1] = k_cache.shape[0]  # one past the last block
    with pytest.raises(RuntimeError, match="outside the cache"):
        OP(torch.empty_like(q), q, k_cache, v_cache, tables, md.seq_lens, md.query_start_loc, 0.25)


def test_a_failed_build_falls_back_to_torch_with_a_warning(tmp_path, monkeypatch, caplog):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    with caplog.at_level(logging.WARNING, logger=cpu_op.__name__):
        assert cpu_op.load_cpu_attention_op(broken, build_dir=tmp_path / "build") is None
    assert "could not be built" in caplog.text and "torch attention backend" in caplog.text
    monkeypatch.setattr(cpu_op, "SOURCE", broken)
    for name in ("auto", "cpu"):
        assert isinstance(make_attention_backend(name, "cpu"), TorchAttentionBackend)


def test_a_built_op_loads_without_the_build_lock_and_a_stale_lock_is_removed(tmp_path, monkeypatch):
    """A worker killed while building leaves ``lock`` behind; the next start must not wait for it:
    a built op is loaded directly (no lock), and a build removes a lock older than STALE_LOCK_S."""
    import time

    from torch.utils import cpp_extension

    digest = cpu_op._source_digest(cpu_op.SOURCE, cpu_op.kernel_defines())
    name = f"pagedserve_cpu_attention_{digest}_{cpu_op._cpu_fingerprint()}"
    folder = tmp_path / name
    folder.mkdir()
    (folder / f"{name}.so").touch()
    (folder / "lock").touch()  # a build in progress elsewhere, or one just killed
    loaded, built = [], []
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: built.append((folder / "lock").exists()))
    monkeypatch.setattr(cpu_op, "_loaded", {})
    cpu_op.load_cpu_attention_op(build_dir=tmp_path)
    assert loaded == [str(folder / f"{name}.so")] and built == []
    (folder / f"{name}.so").unlink()
    old = time.time() - cpu_op.STALE_LOCK_S - 1
    os.utime(folder / "lock", (old, old))
    monkeypatch.setattr(cpu_op, "_loaded", {})
    cpu_op.load_cpu_attention_op(build_dir=tmp_path)
    assert built == [False]  # the stale lock was removed before building



@pytest.fixture
def read_only_dir(tmp_path):
    """A folder nothing can be created in: a read-only tmpfs mount as root (whom file modes do not
    stop), else a folder of mode 0555."""
    import subprocess

    folder = tmp_path / "read-only"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs as root here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_read_only_cache_folder_falls_back_to_torch_instead_of_killing_the_worker(read_only_dir, monkeypatch,
                                                                                    caplog):
    """A worker whose cache folder holds no matching build and cannot be written (a read-only
    volume filled by an older image) must start with the torch backend, not die on ``mkdir``."""
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(read_only_dir / "cache"))
    monkeypatch.setattr(cpu_op, "_loaded", {})
    with caplog.at_level(logging.WARNING, logger=cpu_op.__name__):
        assert isinstance(make_attention_backend("auto", "cpu"), TorchAttentionBackend)
    assert "cannot be created" in caplog.text and "torch attention backend" in caplog.text
    assert "PAGEDSERVE_CACHE_DIR" in caplog.text


def test_a_builds_defines_reach_the_compiler_and_name_a_build_of_their_own(tmp_path, monkeypatch):
    """The decode op's per-CPU choice (``PAGEDSERVE_PREFETCH_TO_L2``) is a -D flag: a build with it must not be
    loaded where the choice differs, so the defines are part of the build folder's name."""
    from torch.utils import cpp_extension

    calls = []
    monkeypatch.setattr(torch.ops, "load_library", lambda path: None)
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(cpu_op, "_loaded", {})
    for defines in ((), ("PAGEDSERVE_PREFETCH_TO_L2",)):  # loaded once per source and defines
        assert cpu_op.load_cpu_library(cpu_op.SOURCE, "t", "the op", "nothing", tmp_path, defines)
    assert [c["extra_cflags"][3:] for c in calls] == [[], ["-DPAGEDSERVE_PREFETCH_TO_L2"]]
    assert calls[0]["name"] != calls[1]["name"] and len(list(tmp_path.iterdir())) == 2
