"""Synthetic routings, the experts-touched formula, random Marlin weights and the staged reference."""
import pytest
import torch

from ddbench.kernels import marlin
from ddbench.kernels.moe import (MarlinMoE, expected_experts_touched, fused_moe_ref, moe_ref_w13, moe_ref_w2,
                         random_marlin_moe, random_router, route, synthetic_routing)


@pytest.mark.parametrize("kind", ["uniform", "skewed", "balanced"])
def test_synthetic_routing_distinct_and_normalised(kind):
    ids, w = synthetic_routing(kind, 50, 24, 6, seed=3)
    assert ids.shape == (50, 6) and ids.dtype == torch.int32
    assert all(len(set(r)) == 6 for r in ids.tolist())
    assert bool((ids >= 0).all() and (ids < 24).all())
    assert torch.allclose(w.sum(-1), torch.ones(50))


def test_skewed_routing_concentrates_on_hot_experts():
    ids, _ = synthetic_routing("skewed", 400, 64, 4, seed=1, hot=4, hot_share=0.6)
    hot_frac = (ids < 4).float().mean().item()
    assert hot_frac > 0.3  # uniform would give 4/64
    assert torch.unique(synthetic_routing("balanced", 16, 64, 4)[0]).numel() == 64


@pytest.mark.parametrize("tokens", [1, 16, 64, 160])
def test_expected_experts_touched_matches_measured(tokens):
    e, k = 384, 8
    measured = [torch.unique(synthetic_routing("uniform", tokens, e, k, seed=s)[0]).numel() for s in range(40)]
    mean = sum(measured) / len(measured)
    want = expected_experts_touched(tokens, e, k)
    assert abs(mean - want) < max(0.5, 0.03 * want), (mean, want)
    assert abs(expected_experts_touched(16, 384, 8) - 110) < 2  # DESIGN §6


def test_router_ids_distinct_weights_scaled():
    x = torch.randn(9, 64)
    gw, bias = random_router(64, 16, seed=2)
    ids, w = route(x, gw, bias, 4, 2.827)
    assert all(len(set(r)) == 4 for r in ids.tolist())
    assert torch.allclose(w.sum(-1), torch.full((9,), 2.827))


def test_random_marlin_moe_shapes_and_round_trip():
    w = random_marlin_moe(5, 128, 64, 32, top_k=2, seed=0, chunk=2)
    assert isinstance(w, MarlinMoE)
    assert w.w13.shape == (5, 8, 256) and w.w2.shape == (5, 4, 256)
    assert w.w13_scale.shape == (5, 4, 128) and w.w2_scale.shape == (5, 2, 128)
    q = marlin.unpack(w.w13, 128, 128)
    assert int(q.max()) <= 15 and q.float().std() > 3  # uniform nibbles, not zeros
    w2 = marlin.dequantize(w.w2, w.w2_scale, 64, 128, 32)
    assert abs(w2.std().item() * (64 ** 0.5) - 2 ** -0.5) < 0.15  # gain 1/sqrt(top_k)


def test_staged_reference_equals_fused_reference():
    w = random_marlin_moe(6, 128, 32, 32, top_k=3, seed=1)
    x = torch.randn(7, 128)
    ids, tw = synthetic_routing("uniform", 7, 6, 3, seed=2)
    staged = moe_ref_w2(moe_ref_w13(x, ids, w), ids, tw, w)
    assert torch.allclose(staged, fused_moe_ref(x, ids, tw, w), atol=1e-5, rtol=1e-5)


def test_router_bias_selects_but_does_not_weight():
    """noaux_tc: the correction bias pulls an expert into the top-k, but its weight is the
    plain sigmoid score renormalised over the chosen experts (times the scaling)."""
    from ddbench.kernels.moe import route

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(5, 32, generator=gen)
    gate = torch.randn(16, 32, generator=gen)
    scores = torch.sigmoid(x @ gate.t())
    weakest = int(scores[0].argmin())
    bias = torch.zeros(16)
    bias[weakest] = 10.0
    ids, w = route(x, gate, bias, top_k=4, routed_scaling=2.5)
    assert (ids == weakest).any(dim=1).all()                    # selected for every token
    for t in range(5):
        chosen = ids[t].long()
        want = scores[t, chosen] / scores[t, chosen].sum() * 2.5  # no bias in the weights
        torch.testing.assert_close(w[t], want)
        others = torch.topk(scores[t] + bias, 4).indices
        assert set(chosen.tolist()) == set(others.tolist())
