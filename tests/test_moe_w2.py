"""ddbench.kernels.moe_w2 (CUDA, a decode token's routed w2 with its weights loaded before the PDL
wait): on CPU its torch reference against the Triton GEMV it replaces (interpreter); on the
GPU the kernel against that reference on fresh random experts and acts, with PDL in a
replayed CUDA graph after the w13 GEMV that writes its act, and inside the MoE."""
import pytest
import torch

from ddbench.kernels import moe_gemv, moe_w2
from ddbench.kernels.moe import fused_moe_ref, random_marlin_moe, synthetic_routing
from ddbench.kernels.moe_triton import MoeTritonConfig


def _case(e, h, inter, n, device, seed):
    w = random_marlin_moe(e, h, inter, top_k=8, device=device, seed=seed)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    act = (torch.randn(n, inter, generator=g, device=device) * 0.5).half()
    ids = torch.randperm(e, generator=g, device=device)[:n].to(torch.int32)
    return act, ids, w


def test_reference_equals_the_triton_gemv():
    act, ids, w = _case(16, 128, 64, 8, "cpu", seed=3)
    cfg = MoeTritonConfig(gemv=True, block_m=1, block_n13=64, block_n2=64)
    tri = moe_gemv.gemv(act, w.w2, w.w2_scale, w.group_size, ids, None, 8, 1, cfg, cfg.block_n2, 1)[0]
    want = moe_w2.reference(act, ids, w)
    assert (tri - want).norm() < 2e-3 * want.norm()                      # fp16 products in the GEMV
    assert not moe_w2.fits(act, w)                                       # CPU


def _check(y, act, ids, w):
    want = moe_w2.reference(act, ids, w)
    assert y.shape == want.shape and y.dtype == torch.float32
    assert (y - want).norm() < 2e-3 * want.norm(), ((y - want).norm() / want.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("e,h,inter,n", [(384, 7168, 256, 8), (64, 1024, 128, 5), (32, 512, 64, 1)])
def test_gpu_matches_reference(e, h, inter, n):
    act, ids, w = _case(e, h, inter, n, "cuda", seed=inter + n)
    assert moe_w2.fits(act, w)
    _check(moe_w2.moe_w2(act, ids, w, pdl=False), act, ids, w)


@pytest.mark.gpu
def test_gpu_refuses_per_channel_scales():
    act, ids, w = _case(32, 512, 32, 1, "cuda", seed=1)                  # I = 32: one group
    assert not moe_w2.fits(act, w)


@pytest.mark.gpu
def test_gpu_with_pdl_in_a_replayed_graph():
    """As in the decode step: the routing is written, the w13 GEMV (Triton, PDL) writes the
    act, then the kernel runs as its PDL dependent and reads the ids before its wait;
    captured once, replayed with new tokens and experts."""
    e, h, inter = 64, 1024, 128
    w = random_marlin_moe(e, h, inter, top_k=8, device="cuda", seed=9)
    cfg = MoeTritonConfig(gemv=True, block_m=1, block_n13=64, block_n2=64)
    x = torch.randn(1, h, device="cuda").bfloat16()
    ids, tw = synthetic_routing("uniform", 1, e, 8, device="cuda", seed=1)

    def step():
        act = moe_gemv.gemv_w13(x, ids, None, w, cfg, topk_weights=tw)
        return moe_w2.moe_w2(act, ids.reshape(-1), w, pdl=True), act

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, act = step()
    for seed in (2, 3):
        new_ids, new_tw = synthetic_routing("uniform", 1, e, 8, device="cuda", seed=seed)
        ids.copy_(new_ids)
        tw.copy_(new_tw)
        x.copy_(torch.randn(1, h, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        _check(y, act, ids.reshape(-1), w)


@pytest.mark.gpu
def test_gpu_moe_of_one_token_takes_it_and_matches_the_reference(monkeypatch):
    e, h, inter = 64, 1024, 128
    w = random_marlin_moe(e, h, inter, top_k=8, device="cuda", seed=4)
    cfg = MoeTritonConfig(gemv=True, block_m=1, block_n13=64, block_n2=64)
    x = torch.randn(1, h, device="cuda").bfloat16()
    ids, tw = synthetic_routing("skewed", 1, e, 8, device="cuda", seed=4)
    calls = []
    launch = moe_w2.moe_w2
    monkeypatch.setattr(moe_w2, "moe_w2", lambda *a, **k: calls.append(1) or launch(*a, **k))
    y = moe_gemv.fused_moe_gemv(x, ids, tw, w, cfg)
    assert calls == [1]
    want = fused_moe_ref(x.float(), ids, tw, w)
    assert (y.float() - want).norm() < 1e-2 * want.norm()
    monkeypatch.setattr(moe_w2, "ENABLED", False)
    assert (moe_gemv.fused_moe_gemv(x, ids, tw, w, cfg).float() - y.float()).abs().max() < 1e-2 * want.abs().max()
