"""ALiBi (Press et al., 2022, §3) in the Triton kernels and backend against the dense reference
(masked softmax with the bias): ragged batches, shuffled block tables, GQA, Flash-Decoding splits."""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import DEVICE

from pagedserve_kernels.decode_attention import paged_decode_attention
from pagedserve_kernels.prefill_attention import paged_prefill_attention
from pagedserve.engine.attention import TritonAttentionBackend
from pagedserve.engine.attention.alibi import alibi_slopes
from tests.worker.test_alibi_attention import dense_reference, make_batch as make_batch_on_cpu

DECODES = [(9, 1), (70, 1), (0, 1), (17, 1)]
MIXED = [(5, 1), (40, 1), (0, 12), (16, 16), (13, 9), (3, 1)]


def make_batch(*args):
    """tests/worker's ALiBi batch on the kernels' device (CUDA where there is one)."""
    return make_batch_on_cpu(*args, device=DEVICE)


def slopes_for(heads: int) -> torch.Tensor:
    return alibi_slopes(heads).to(DEVICE)


@pytest.mark.parametrize("heads,kv_heads,num_splits", [(4, 4, None), (6, 2, 3), (8, 1, 2)])
def test_decode_kernel_alibi(heads, kv_heads, num_splits):
    md, q, _, _, k_cache, v_cache = make_batch(5, DECODES, 16, heads, kv_heads, 16)
    slopes = slopes_for(heads) * 4
    got = paged_decode_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens, 0.25,
                                 num_splits=num_splits, alibi_slopes=slopes)
    torch.testing.assert_close(got, dense_reference(md, q, k_cache, v_cache, slopes), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,block_size", [(4, 4, 8), (6, 2, 4), (8, 1, 16)])
def test_prefill_kernel_alibi(heads, kv_heads, block_size):
    md, q, _, _, k_cache, v_cache = make_batch(6, MIXED, block_size, heads, kv_heads, 16)
    slopes = slopes_for(heads) * 4
    got = paged_prefill_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, 0.25,
                                  md.max_query_len, alibi_slopes=slopes)
    torch.testing.assert_close(got, dense_reference(md, q, k_cache, v_cache, slopes), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seqs", [DECODES, MIXED])
def test_triton_backend_alibi(seqs):
    md, q, k, v, k_cache, v_cache = make_batch(7, seqs, 8, 6, 2, 16)
    slopes = slopes_for(6)
    got = TritonAttentionBackend().attend(q, k, v, k_cache, v_cache, md, 0.25, alibi_slopes=slopes)
    torch.testing.assert_close(got, dense_reference(md, q, k_cache, v_cache, slopes), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seqs", [DECODES, MIXED, [(300, 1), (120, 20)]])
def test_falcon_bf16_form_kernels(seqs):
    """``alibi_bf16`` (transformers' Falcon form) in both kernels through the backend, 12 heads."""
    md, q, k, v, k_cache, v_cache = make_batch(10, seqs, 8, 12, 4, 16)
    slopes = slopes_for(12).bfloat16().float() * 8
    got = TritonAttentionBackend().attend(q, k, v, k_cache, v_cache, md, 0.25, alibi_slopes=slopes, alibi_bf16=True)
    want = dense_reference(md, q, k_cache, v_cache, slopes, bf16=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=5e-5)  # absolute biases of ~700: float32 ulp 6e-5


def test_bad_slopes_refused():
    md, q, _, _, k_cache, v_cache = make_batch(8, DECODES, 16, 4, 2, 16)
    with pytest.raises(ValueError, match="alibi_slopes has shape"):
        paged_decode_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens, 0.25, alibi_slopes=slopes_for(2))
    with pytest.raises(TypeError, match="alibi_slopes has dtype"):
        paged_decode_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens, 0.25,
                               alibi_slopes=slopes_for(4).double())


def test_falcon_alibi_logits_with_triton_backend(tmp_path):
    """Falcon-rw (ALiBi) logits with the Triton backend equal transformers' on a ragged prefill, a
    prefill over cached context and a decode batch."""
    from pagedserve.engine.weight_loader import load_model
    from tests.worker.test_falcon_alibi import RW
    from tests.worker.tiny_models import forward_step, hf_logits, hf_model, make_cache, relative_errors, \
        save_tiny_model

    folder = save_tiny_model(tmp_path, "falcon", **RW)
    ours, ref = load_model(folder, device=DEVICE), hf_model(folder)
    seqs = [[(7 * i + 3 * n) % 90 + 1 for i in range(n)] for n in (14, 11)]
    refs = [hf_logits(ref, s) for s in seqs]
    cache, backend, tables = make_cache(ours, 16, 4, DEVICE), TritonAttentionBackend(), [[5, 0, 12, 9], [3, 14, 1, 7]]
    for (a0, b0), (a1, b1) in (((0, 6), (0, 9)), ((6, 13), (9, 10)), ((13, 14), (10, 11))):
        got = forward_step(ours, cache, backend, [seqs[0][a0:b0], seqs[1][a1:b1]], [a0, a1], tables)
        want = torch.cat([refs[0][a0:b0], refs[1][a1:b1]])                # (T, vocab)
        rel, rel_max = relative_errors(got.cpu(), want)
        assert rel < 1e-4 and rel_max < 1e-4, ((a0, a1), rel, rel_max)
