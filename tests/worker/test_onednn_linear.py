"""The opt-in oneDNN linear layers: same products as F.linear to float32 rounding, on every layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.engine.models.layers import Linear
from pagedserve.engine.models.onednn import OneDnnLinear, pack_linear_layers

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")


@pytest.mark.parametrize("num_tokens", [1, 5, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_matches_f_linear(num_tokens, bias):
    g = torch.Generator().manual_seed(num_tokens)
    weight = torch.randn(96, 80, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(num_tokens, 80, generator=g)
    got = OneDnnLinear(weight, b)(x)
    assert got.shape == (num_tokens, 96) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_pack_replaces_every_linear_and_adds_a_tied_lm_head(default_model):
    from pagedserve.engine.weight_loader import load_model

    model = load_model(default_model)
    assert model.lm_head is None  # SmolLM2 ties its LM head to the embeddings
    linears = sum(isinstance(m, Linear) for m in model.modules())
    x = torch.randn(7, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    layer = model.layers[3]
    before = (layer.mlp(x), model.compute_logits(x))
    assert pack_linear_layers(model) == linears + 1 == 4 * model.config.num_layers + 1
    assert not any(isinstance(m, Linear) for m in model.modules())
    assert isinstance(model.lm_head, OneDnnLinear)
    after = (layer.mlp(x), model.compute_logits(x))
    for got, want in zip(after, before):  # float32 rounding of sums over 576..1536 products
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))
    assert after[1].dtype == torch.float32 and model.embed_tokens.weight.shape[0] == after[1].shape[1]
