"""kernels.moe_w2 (CUDA, a decode token's routed w2 with its weights loaded before the PDL
wait, optionally with the shared expert's down projection and the sum over the rows): on CPU
its torch references against the Triton launches they replace (interpreter); on the GPU the
kernel against those references on fresh random experts and acts, with PDL in a replayed
CUDA graph after the w13 GEMV that writes its act (the shared act from a second stream), and
inside the MoE."""
import pytest
import torch

from kernels import moe_gemv, moe_w2
from kernels.moe import fused_moe_ref, random_marlin_moe, synthetic_routing
from kernels.moe_triton import MoeTritonConfig


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


def _shared(h, i_s, device, seed):
    """The shared expert's act bf16 `[1, Is]` and down projection bf16 `[H, Is]`."""
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(1, i_s, generator=g, device=device).bfloat16(),
            (torch.randn(h, i_s, generator=g, device=device) * i_s ** -0.5).bfloat16())


def test_shared_reference_equals_the_skinny_down_gemm_over_the_rows():
    """reference_shared is what the launches it replaces compute: kernels.skinny's down GEMM
    with the k rows summed in its epilogue (fp32 here: the interpreter)."""
    from kernels import skinny
    act, ids, w = _case(16, 128, 64, 8, "cpu", seed=5)
    sact, wsd = _shared(128, 32, "cpu", seed=6)
    rows = moe_w2.reference(act, ids, w)
    want = skinny.skinny_linear(sact.float(), wsd.float(), add=rows, add_rows=8)
    got = moe_w2.reference_shared(act, ids, w, sact, wsd)
    assert got.shape == (1, 128) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    assert not moe_w2.fits(act, w, (sact, wsd))                          # CPU


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


def _check_shared(y, act, ids, w, sact, wsd):
    want = moe_w2.reference_shared(act, ids, w, sact, wsd).float()
    assert y.shape == want.shape and y.dtype == torch.bfloat16
    assert (y.float() - want).norm() < 1e-2 * want.norm(), ((y.float() - want).norm() / want.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("e,h,inter,i_s,n", [(384, 7168, 256, 256, 8), (64, 1024, 128, 72, 5), (32, 512, 64, 264, 1)])
def test_gpu_with_the_shared_expert_matches_reference(e, h, inter, i_s, n):
    act, ids, w = _case(e, h, inter, n, "cuda", seed=inter + n)
    sact, wsd = _shared(h, i_s, "cuda", seed=i_s)
    assert moe_w2.fits(act, w, (sact, wsd))
    _check_shared(moe_w2.moe_w2(act, ids, w, pdl=False, shared=(sact, wsd)), act, ids, w, sact, wsd)


@pytest.mark.gpu
def test_gpu_refuses_a_shared_expert_it_cannot_take():
    act, ids, w = _case(32, 512, 64, 2, "cuda", seed=2)
    sact, wsd = _shared(512, 64, "cuda", seed=3)
    assert moe_w2.fits(act, w, (sact, wsd))
    assert not moe_w2.fits(act, w, (sact[:, :60], wsd[:, :60].contiguous()))      # Is not a multiple of 8
    assert not moe_w2.fits(act, w, (sact, wsd[:256]))                              # H rows wanted
    assert not moe_w2.fits(act, w, (sact.half(), wsd))                             # bf16 act
    big = _shared(512, 2048, "cuda", seed=4)                                       # 256 KB of rows a program
    assert not moe_w2.fits(act, w, big)
    with pytest.raises(ValueError, match="shared expert"):
        moe_w2.moe_w2(act, ids, w, shared=big)


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
def test_gpu_with_the_shared_expert_from_a_side_stream_in_a_replayed_graph():
    """As in the decode step: the shared expert's gate/up on a second stream (its act joined by
    an event just before w2), the routed w13 GEMV, then the kernel as its PDL dependent with the
    shared down projection; captured once, replayed with new tokens and experts."""
    from kernels import skinny
    e, h, inter, i_s = 64, 1024, 128, 128
    w = random_marlin_moe(e, h, inter, top_k=8, device="cuda", seed=9)
    cfg = MoeTritonConfig(gemv=True, block_m=1, block_n13=64, block_n2=64)
    x = torch.randn(1, h, device="cuda").bfloat16()
    gate_up = (torch.randn(2 * i_s, h, device="cuda") * h ** -0.5).bfloat16()   # the shared expert's w13
    wsd = _shared(h, i_s, "cuda", seed=6)[1]
    ids, tw = synthetic_routing("uniform", 1, e, 8, device="cuda", seed=1)
    side = torch.cuda.Stream()

    def step():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            sact = skinny.skinny_linear(x, gate_up, glu=True)                     # [1, Is]
        act = moe_gemv.gemv_w13(x, ids, None, w, cfg, topk_weights=tw)
        y = moe_gemv.gemv_w2(act, ids, tw, None, w, cfg, x.dtype, shared=(sact, wsd, side.record_event()))
        return y, act, sact

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, act, sact = step()
    for seed in (2, 3):
        new_ids, new_tw = synthetic_routing("uniform", 1, e, 8, device="cuda", seed=seed)
        ids.copy_(new_ids)
        tw.copy_(new_tw)
        x.copy_(torch.randn(1, h, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        _check_shared(y, act, ids.reshape(-1), w, sact, wsd)


@pytest.mark.gpu
def test_gpu_moe_of_one_token_with_the_shared_expert_takes_one_launch(monkeypatch):
    """fused_moe(shared=) at one token runs the kernel with the shared expert (no skinny down
    GEMM) and equals the launches it replaces (SHARED_IN_W2 off) and the reference."""
    from kernels import skinny
    from kernels.moe import fused_moe
    e, h, inter = 64, 1024, 128
    w = random_marlin_moe(e, h, inter, top_k=8, device="cuda", seed=4)
    x = torch.randn(1, h, device="cuda").bfloat16()
    sact, wsd = _shared(h, 192, "cuda", seed=8)
    ids, tw = synthetic_routing("skewed", 1, e, 8, device="cuda", seed=4)
    calls = []
    launch = skinny.skinny_linear
    monkeypatch.setattr(skinny, "skinny_linear", lambda *a, **k: calls.append(1) or launch(*a, **k))
    y = fused_moe(x, ids, tw, w, "triton", x_half=x.half(), shared=(sact, wsd, None))
    assert calls == [] and y.shape == (1, h) and y.dtype == torch.bfloat16
    want = fused_moe_ref(x.float(), ids, tw, w) + sact.float() @ wsd.float().T
    assert (y.float() - want).norm() < 1e-2 * want.norm()
    monkeypatch.setattr(moe_gemv, "SHARED_IN_W2", False)
    two = fused_moe(x, ids, tw, w, "triton", x_half=x.half(), shared=(sact, wsd, None))
    assert calls == [1] and (two.float() - y.float()).abs().max() < 1e-2 * want.abs().max()


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
