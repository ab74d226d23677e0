"""kernels.moe_w13 (CUDA, a decode token's routed gate/up projection and act in clusters): on
CPU its torch reference against the Triton GEMV's fused act it replaces (interpreter) and its
launch shapes; on the GPU the kernel against that reference on fresh random experts and
tokens, with PDL in a replayed CUDA graph behind the router that writes its inputs and before
kernels.moe_w2, and inside the MoE."""
import pytest
import torch

from kernels import moe_gemv, moe_w2, moe_w13, skinny
from kernels.moe import fused_moe_ref, random_marlin_moe, synthetic_routing
from kernels.moe_triton import MoeTritonConfig

_config = moe_w13.config
CFG = MoeTritonConfig(gemv=True, block_m=1, block_n13=64, block_n2=64)


def _case(e, h, inter, n, device, seed):
    w = random_marlin_moe(e, h, inter, top_k=8, device=device, seed=seed)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.randn(1, h, generator=g, device=device).half()
    ids = torch.randperm(e, generator=g, device=device)[:n].to(torch.int32)
    tw = torch.rand(n, generator=g, device=device) + 0.1
    return x, ids, tw, w


def _err(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def test_reference_equals_the_triton_gemv_act():
    x, ids, tw, w = _case(16, 256, 64, 4, "cpu", seed=5)
    tri = moe_gemv.gemv(x, w.w13, w.w13_scale, w.group_size, ids, None, 4, 4, CFG, CFG.block_n13, 2, tw)
    want = moe_w13.reference(x, ids, tw, w)
    assert tri.shape == want.shape == (4, 64) and want.dtype == torch.float16
    assert _err(tri, want) < 3e-3                                        # fp16 products in the GEMV
    assert not moe_w13.fits(x, 4, w)                                     # CPU


def test_config_at_k26_tp8_and_where_it_refuses():
    cfg = moe_w13.config(7168, 256, 32, 8, 132)
    assert cfg == {"H": 7168, "I": 256, "G": 32, "CB": 1, "S": 4, "NCH": 7, "PPS": 1}   # 8 x 4 parts x 4 splits
    assert moe_w13.shared_bytes(cfg) == 112 * 2 * 512 + 56 * 2 * 128            # 126 KB: one program an SM
    assert moe_w13.parts(cfg) == 4
    uneven = moe_w13.config(7168, 256, 32, 8, 100)                              # 3 splits: 74, 75, 75 groups
    assert uneven["S"] == 3 and moe_w13.shared_bytes(uneven) == 150 * 2 * 512 + 75 * 2 * 128
    assert moe_w13.config(7168, 256, 32, 8, 90) is None                         # 207 KB a program at best
    assert moe_w13.config(1024, 128, 32, 8, 16)["S"] == 1                       # no K split: no ticket wait
    assert moe_w13.config(7168, 256, 32, 80, 132) is None                       # ten tokens: too many programs
    assert moe_w13.config(7168, 32, 32, 1, 132) is None                         # I not a multiple of 64
    assert moe_w13.config(256, 64, 256, 1, 132) is None                         # one scale group


@pytest.mark.gpu
@pytest.mark.parametrize("sms", [132, 100])                                # 4, 3 (uneven) splits at K2.6
@pytest.mark.parametrize("e,h,inter,n", [(384, 7168, 256, 8), (64, 1024, 128, 8), (32, 512, 64, 3)])
def test_gpu_matches_reference(e, h, inter, n, sms, monkeypatch):
    monkeypatch.setattr(moe_w13, "config", lambda *a: _config(*a[:4], sms))
    x, ids, tw, w = _case(e, h, inter, n, "cuda", seed=inter + n)
    assert moe_w13.fits(x, n, w)
    act = moe_w13.moe_w13(x, ids, tw, w, pdl=False)
    assert act.shape == (n, inter) and act.dtype == torch.float16 and torch.isfinite(act).all()
    assert _err(act, moe_w13.reference(x, ids, tw, w)) < 3e-3


@pytest.mark.gpu
def test_gpu_with_pdl_in_a_replayed_graph():
    """As in the decode step: the router (skinny norm + gate GEMM + top-k, PDL) writes the
    fp16 token, the ids and the weights, the kernel runs as its PDL dependent, then moe_w2 as
    the kernel's (it reads the router's ids before its wait); captured once, replayed with new
    inputs, each replay checked against the references."""
    e, h, inter = 64, 1024, 128
    w = random_marlin_moe(e, h, inter, top_k=8, device="cuda", seed=9)
    g = torch.Generator(device="cuda").manual_seed(3)
    gate = (torch.randn(e, h, generator=g, device="cuda") * h ** -0.5).bfloat16()
    bias = torch.randn(e, generator=g, device="cuda") * 0.1
    norm_w = torch.ones(h, device="cuda").bfloat16()
    a = torch.randn(1, h, device="cuda").bfloat16()
    res = torch.randn(1, h, device="cuda").bfloat16()

    def step():
        _, _, _, xh, ids, tw = skinny.norm_linear(a, norm_w, 1e-5, gate, res, out_xn=True, out_xh=True,
                                                  route=(bias, 8, 2.5))
        ids, tw = ids.reshape(-1), tw.reshape(-1)
        act = moe_w13.moe_w13(xh, ids, tw, w, pdl=True)
        return xh, ids, tw, act, moe_w2.moe_w2(act, ids, w, pdl=True)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        xh, ids, tw, act, y = step()
    for _ in range(3):
        a.copy_(torch.randn(1, h, device="cuda"))
        res.copy_(torch.randn(1, h, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert len(set(ids.tolist())) == 8
        want = moe_w13.reference(xh, ids, tw, w)
        assert _err(act, want) < 3e-3
        assert _err(y, moe_w2.reference(act, ids, w)) < 2e-3


@pytest.mark.gpu
def test_gpu_moe_of_one_token_takes_it_and_matches_the_reference(monkeypatch):
    e, h, inter = 64, 1024, 128
    w = random_marlin_moe(e, h, inter, top_k=8, device="cuda", seed=4)
    x = torch.randn(1, h, device="cuda").bfloat16()
    ids, tw = synthetic_routing("skewed", 1, e, 8, device="cuda", seed=4)
    calls = []
    launch = moe_w13.moe_w13
    monkeypatch.setattr(moe_w13, "moe_w13", lambda *a, **k: calls.append(1) or launch(*a, **k))
    y = moe_gemv.fused_moe_gemv(x, ids, tw, w, CFG)
    assert calls == [1]
    want = fused_moe_ref(x.float(), ids, tw, w)
    assert (y.float() - want).norm() < 1e-2 * want.norm()
    monkeypatch.setattr(moe_w13, "ENABLED", False)
    assert (moe_gemv.fused_moe_gemv(x, ids, tw, w, CFG).float() - y.float()).abs().max() < 1e-2 * want.abs().max()
    assert calls == [1]
