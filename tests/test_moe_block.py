"""kernels.moe_block (CUDA, one launch for the MoE block of a decode token): its shape rules;
on CPU its torch reference against the engine's own references (router, Marlin MoE, shared
MLP); on the GPU the kernel against that reference on fresh random weights, eager, with PDL
and in a replayed CUDA graph (the grid barriers' counters must be ready for the next launch)."""
import pytest
import torch
import torch.nn.functional as F

from engine.config import preset
from kernels import moe_block
from kernels.moe import fused_moe_ref, random_marlin_moe, route


def test_config_fits_k26_tp8_on_an_h200_and_refuses_what_does_not_fit():
    cfg = preset("k2.6", tp=8)
    c = moe_block.config(cfg.hidden, cfg.n_experts, cfg.top_k, cfg.moe_inter_local, cfg.shared_inter_local,
                         cfg.group_size, 132)
    assert c["grid"] <= 132 and c["TOPK"] * (2 * c["I"] // 64) * c["KS"] <= c["grid"] and c["H"] // 64 <= c["grid"]
    assert 6 * c["H"] + c["SLOTS"] * c["SLOT"] + 128 * c["SI"] <= moe_block.SHARED_BYTES
    assert c["PK13"] * 576 <= c["SLOT"] and (c["H"] // 16 // c["KS"]) % c["PK13"] == 0
    with pytest.raises(ValueError, match="programs"):
        moe_block.config(cfg.hidden, cfg.n_experts, cfg.top_k, cfg.moe_inter_local, cfg.shared_inter_local, 32, 78)
    with pytest.raises(ValueError, match="outnumber"):            # TP 1: 8 x 64 w13 blocks
        moe_block.config(7168, 384, 8, 2048, 2048, 32, 132)


def _weights(h, e, k, inter, si, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device=device) * scale).to(torch.bfloat16)  # noqa: E731
    experts = random_marlin_moe(e, h, inter, top_k=k, device=device, seed=seed + 1)
    return dict(a=rnd(h), res=rnd(h), nw=(1 + 0.1 * torch.randn(h, generator=g, device=device)).to(torch.bfloat16),
                eps=1e-6, gate=rnd(e, h, scale=h ** -0.5), bias=0.1 * torch.randn(e, generator=g, device=device),
                top_k=k, scaling=2.827, sw13=rnd(2 * si, h, scale=h ** -0.5), sw2=rnd(h, si, scale=si ** -0.5),
                w=experts)


def test_reference_means_router_plus_experts_plus_shared_mlp():
    p = _weights(256, 16, 4, 64, 64, "cpu")
    y, h, ids, wts = moe_block.reference(**p)
    assert torch.equal(h, (p["a"].float() + p["res"].float()).bfloat16().view(1, -1))
    hf = h.float()
    xn = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + p["eps"]) * p["nw"].float()
    want_ids, want_w = route(xn, p["gate"], p["bias"], p["top_k"], p["scaling"])
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(wts, want_w)
    gu = xn @ p["sw13"].float().T
    shared = (F.silu(gu[:, :64]) * gu[:, 64:]) @ p["sw2"].float().T
    want = fused_moe_ref(xn, want_ids, want_w, p["w"]) + shared
    assert (y - want).norm() < 1e-2 * want.norm()                    # the kernel's roundings only


def _check(p, y, h, ids, wts):
    ry, rh, rids, rw = moe_block.reference(**p)
    assert torch.equal(h, rh) and torch.equal(ids, rids)
    torch.testing.assert_close(wts, rw, rtol=1e-5, atol=1e-6)
    assert y.dtype == torch.bfloat16 and (y.float() - ry).norm() < 5e-3 * ry.norm()


@pytest.fixture
def enabled(monkeypatch):
    monkeypatch.setattr(moe_block, "ENABLED", True)


@pytest.mark.gpu
@pytest.mark.parametrize("h,e,k,inter,si", [(7168, 384, 8, 256, 256), (1024, 64, 8, 128, 128), (2048, 96, 6, 128, 64)])
def test_gpu_moe_block_matches_reference(h, e, k, inter, si, enabled):
    p = _weights(h, e, k, inter, si, "cuda", seed=h + e)
    if not moe_block.fits(p["a"].view(1, -1), p["gate"], k, p["sw13"], p["w"]):
        pytest.skip("this GPU's SMs do not hold the block's programs")
    _check(p, *moe_block.moe_block(**p))
    _check(dict(p, res=None), *moe_block.moe_block(**dict(p, res=None)))


@pytest.mark.gpu
def test_gpu_moe_block_with_pdl_in_a_replayed_graph(enabled):
    """Three launches in a row with PDL, captured once and replayed with new inputs: each
    launch's barriers must find their counters reset by the one before."""
    p = _weights(1024, 64, 8, 128, 128, "cuda", seed=7)
    if not moe_block.fits(p["a"].view(1, -1), p["gate"], 8, p["sw13"], p["w"]):
        pytest.skip("this GPU's SMs do not hold the block's programs")

    def chain():
        outs, a = [], p["a"]
        for _ in range(3):
            out = moe_block.moe_block(**dict(p, a=a), pdl=True)
            outs.append(out)
            a = out[0].view(-1)
        return outs

    chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain()
    for seed in (1, 2):
        p["a"].copy_(torch.randn(1024, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        a = p["a"]
        for out in outs:
            _check(dict(p, a=a.clone()), *out)
            a = out[0].view(-1)


def test_tensor_map_refuses_what_tma_cannot_copy():
    from kernels.cuda import tensor_map_2d

    with pytest.raises(ValueError, match="contiguous 2/4-byte"):
        tensor_map_2d(torch.zeros(4, 8, dtype=torch.float64), 4, 8, 2, 8)
    with pytest.raises(ValueError, match="contiguous 2/4-byte"):
        tensor_map_2d(torch.zeros(8, 4, dtype=torch.int32).T, 4, 8, 2, 8)
    with pytest.raises(ValueError, match="contiguous 2/4-byte"):
        tensor_map_2d(torch.zeros(4, 8, dtype=torch.int32), 4, 16, 2, 8)
