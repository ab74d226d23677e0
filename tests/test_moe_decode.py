"""kernels.moe_decode (CUDA, one decode token's routed experts in one launch): on the CPU its
launch shape and torch references; on an sm_90 GPU the kernel's rows against the references on
fresh random experts (several shapes and group sizes), the layer against the fp32 MoE reference
for every routing at K2.6 shapes, bitwise run to run, with PDL in a replayed CUDA graph, and the
counters it waits on back at zero after each launch."""
from types import SimpleNamespace

import pytest
import torch

from ddbench.kernels import moe_decode as md
from ddbench.kernels import ticket
from ddbench.kernels.moe import (ROUTINGS, fused_moe, fused_moe_ref, random_marlin_moe, random_router,
                                 resolve_moe_kernel, route, synthetic_routing, takes_rows)

STATIC_SHARED = 10768   # the kernel's static shared memory at I = 256 (ptxas -v, nvcc 13.0, sm_90)


def test_k26_launch_shape_fits_the_gpu():
    w = SimpleNamespace(hidden=7168, inter=256)
    assert md.programs(8, w) == 128                                      # <= 132 SMs: all resident at once
    assert md.programs(1, w) == 7168 // 64                               # the w2 role sets the grid
    for group in (32, 64, 128):
        assert md.shared_bytes(7168, 256, group) + STATIC_SHARED <= 227 * 1024   # one program an SM
    # a w13 ring stage a warp: one scale group of G = 32 rows, G/16 x 2 x 32 word vectors + 16 of scales
    ring_stage = (md.THREADS // 32) * (32 // 16 * 2 * 32 + 16) * 16
    assert md.shared_bytes(7168, 256, 32, stages=7) - md.shared_bytes(7168, 256, 32) == 3 * ring_stage
    assert md.shared_bytes(7168, 256, 128, stages=2) == md.shared_bytes(7168, 256, 128)


def test_references_make_the_moe():
    w = random_marlin_moe(16, 256, 64, 32, top_k=4, chunk=8)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 256, generator=g)
    ids, tw = synthetic_routing("uniform", 1, 16, 4, seed=2)
    act = md.reference_w13(x, ids.reshape(-1), tw.reshape(-1), w)
    y = md.reference_w2(act, ids.reshape(-1), w).sum(0, keepdim=True)
    want = fused_moe_ref(x, ids, tw, w)
    assert (y - want).norm() < 1e-4 * want.norm()


def test_cpu_takes_no_decode_kernel():
    w = random_marlin_moe(16, 256, 64, 32, top_k=4, chunk=8)
    x = torch.randn(1, 256).bfloat16()
    assert not md.fits(x, 4, w)
    assert resolve_moe_kernel(1, 4, w, "cpu")[0] == "gemv"
    assert takes_rows(1, 4, w, "cpu")
    with pytest.raises(ValueError, match="decode"):
        resolve_moe_kernel(1, 4, w, "cpu", "decode")


# ---------------------------------------------------------------- GPU

K26 = dict(n_experts=384, hidden=7168, inter=256, group_size=32)
SHAPES = [(64, 1024, 128, 32, 5), (32, 512, 64, 32, 1), (48, 2048, 256, 64, 8), (32, 1024, 256, 128, 3),
          (384, 7168, 256, 32, 8)]


def _gpu():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs an sm_90 GPU")
    return torch.device("cuda")


@pytest.fixture(scope="module")
def k26():
    return random_marlin_moe(**K26, top_k=8, device=_gpu(), seed=6)


def _token(w, routing, seed, k=8):
    dev = torch.device("cuda")
    x = torch.randn(1, w.hidden, device=dev, generator=torch.Generator(dev).manual_seed(seed)).bfloat16()
    if routing == "router":
        gw, bias = random_router(w.hidden, w.n_experts, device=dev, seed=seed)
        ids, tw = route(x, gw, bias, k, 2.5)
    else:
        ids, tw = synthetic_routing(routing, 1, w.n_experts, k, device=dev, seed=seed)
    return x, ids, tw


def _rel(y, want):
    return ((y.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("e,h,inter,group,n", SHAPES)
def test_gpu_rows_match_the_references(e, h, inter, group, n):
    dev = _gpu()
    w = random_marlin_moe(e, h, inter, group, top_k=n, device=dev, seed=inter + n)
    x, ids, tw = _token(w, "uniform", seed=n, k=n)
    assert md.fits(x, n, w)
    rows = md.fused_moe_decode(x, ids, tw, w, sum_k=False, pdl_mode=0)
    act = md.reference_w13(x, ids.reshape(-1), tw.reshape(-1), w)
    want = md.reference_w2(act.half(), ids.reshape(-1), w)               # the kernel's act is fp16
    assert rows.shape == (n, h) and rows.dtype == torch.float32 and _rel(rows, want) < 2e-3, _rel(rows, want)
    assert torch.equal(md.fused_moe_decode(x.half(), ids, tw, w, sum_k=False, pdl_mode=0), rows)   # fp16 x: same
    out = md.fused_moe_decode(x, ids, tw, w, pdl_mode=0)
    assert out.dtype == torch.bfloat16 and _rel(out, want.sum(0, keepdim=True)) < 5e-3
    assert not ticket.counters(dev, "moe_decode", 2).any()               # ready for the next launch


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ROUTINGS)
def test_gpu_layer_matches_reference_bitwise_run_to_run(k26, routing):
    x, ids, tw = _token(k26, routing, seed=11)
    assert resolve_moe_kernel(1, 8, k26, x.device)[0] == "decode"
    y = fused_moe(x, ids, tw, k26, "triton")
    err = _rel(y, fused_moe_ref(x.float(), ids, tw, k26))
    assert err <= 1e-2, err
    assert torch.equal(y, fused_moe(x, ids, tw, k26, "triton"))
    rows = fused_moe(x, ids, tw, k26, "triton", sum_k=False)              # the engine's decode option
    assert rows.shape == (8, k26.hidden) and _rel(rows.sum(0, keepdim=True), y) < 1e-2


@pytest.mark.gpu
def test_gpu_with_pdl_in_a_replayed_graph(k26):
    """As in the decode step: a kernel writes x and the routing, then the MoE runs as its PDL
    dependent, twice in a row (the second waits on the first); captured once, replayed with
    new tokens and experts."""
    x, ids, tw = _token(k26, "uniform", seed=1)
    src = [x.clone(), ids.clone(), tw.clone()]

    def step():
        x.copy_(src[0])
        ids.copy_(src[1])
        tw.copy_(src[2])
        a = fused_moe(x, ids, tw, k26, "triton", kernel="decode")
        return a, fused_moe(a, ids, tw, k26, "triton", kernel="decode")

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y1, y2 = step()
    for seed in (2, 3, 4):
        nx, nids, ntw = _token(k26, "skewed", seed=seed)
        src[0].copy_(nx)
        src[1].copy_(nids)
        src[2].copy_(ntw)
        graph.replay()
        torch.cuda.synchronize()
        want = fused_moe(nx, nids, ntw, k26, "triton", kernel="decode")
        assert torch.equal(y1, want) and torch.equal(y2, fused_moe(want, nids, ntw, k26, "triton", kernel="decode"))
        assert _rel(y1, fused_moe_ref(nx.float(), nids, ntw, k26)) <= 1e-2
