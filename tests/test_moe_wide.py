"""kernels.moe_wide: the B-operand fragment mapping and the tile rule on the CPU; the CUDA
kernels against the fp32 reference, run to run and in CUDA graphs on a GPU."""
import pytest
import torch

from ddbench.kernels import marlin, moe_wide as mw
from ddbench.kernels.moe import ROUTINGS, fused_moe_ref, random_marlin_moe, resolve_moe_kernel
from moe_cases import k26, moe_case as _case  # noqa: F401 (k26: the GPU tests' fixture)


@pytest.mark.parametrize("seed", [0, 1])
def test_b_fragments_are_the_tile(seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (32, 128), generator=g)
    packed = marlin.pack(q)                                              # [2, 256]
    for kt in range(2):
        for nb in range(2):
            for tile in range(4):
                words = packed[kt, nb * 128 + torch.arange(32) * 4 + tile]
                want = q[16 * kt:16 * kt + 16, 64 * nb + 16 * tile:64 * nb + 16 * tile + 16]
                assert torch.equal(mw.emulate_b_fragments(words), want.long())


def test_tiles_and_shapes():
    assert mw.tiles_for(768, 8, 384, 256) == {"mt": 2, "stages": 4, "warps": 4, "w2_warps": 4, "minb": 1}   # 16
    assert mw.tiles_for(1024, 8, 384, 256)["mt"] == 2     # 21.3 an expert
    assert mw.tiles_for(1024, 8, 384, 2048)["mt"] == 2
    assert mw.tiles_for(2048, 8, 384, 256)["mt"] == 4     # 42.7
    capped = {"mt": 2, "stages": 4, "warps": 4, "w2_warps": 4, "minb": 4}
    assert mw.tiles_for(4096, 8, 384, 256) == capped     # 85.3 at the TP-8 shard's short w2 items
    for inter in (512, 2048):                            # longer w2 items: MT 4, uncapped
        assert mw.tiles_for(4096, 8, 384, inter) == capped | {"mt": 4, "minb": 1}
    assert mw.tiles_for(4096, 8, 384, 256, [(float("inf"), float("inf"), 1, 3, 8, 4, 1)]) == {
        "mt": 1, "stages": 3, "warps": 8, "w2_warps": 4, "minb": 1}
    assert mw.shared_bytes({"mt": 4, "stages": 4, "warps": 8}) == 4 * (256 + 576) * 16
    assert mw.shared_bytes({"mt": 4, "stages": 4, "warps": 8}, 4) == 4 * (256 + 288) * 16
    assert mw.tile_name({"mt": 4, "stages": 4, "warps": 8, "w2_warps": 8}) == "mt4s4w8"
    assert mw.tile_name({"mt": 4, "stages": 3, "warps": 8, "w2_warps": 4}) == "mt4s3w8v4"
    assert mw.tile_name({"mt": 2, "stages": 4, "warps": 4, "w2_warps": 4, "minb": 4}) == "mt2s4w4b4"
    shard = random_marlin_moe(4, 7168, 256, 32, top_k=2, chunk=4)
    assert mw.shapes_ok(shard)
    assert not mw.shapes_ok(random_marlin_moe(4, 7168, 128, 32, top_k=2, chunk=4))   # I not a multiple of 256
    assert mw.resolve_tiles(64, 8, shard, {"mt": 2, "warps": 4}) == {"mt": 2, "stages": 4, "warps": 4, "w2_warps": 4,
                                                                       "minb": 1}
    for bad in ({"mt": 3}, {"mt": 2, "warps": 6}, {"mt": 2, "w2_warps": 2}, {"mt": 2, "stages": 9}, {"mt": 2, "minb": 5}):
        with pytest.raises(ValueError):
            mw.resolve_tiles(64, 8, shard, bad)


def test_resolve_on_cpu_never_wide():
    w = random_marlin_moe(8, 512, 256, 32, top_k=2, chunk=8)
    assert resolve_moe_kernel(4096, 2, w, "cpu")[0] in ("gemv", "triton")
    with pytest.raises(ValueError):
        resolve_moe_kernel(4096, 2, w, "cpu", "wide")


# ---------------------------------------------------------------- GPU

def _err(y, want):
    return ((y.float() - want).norm() / want.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("tokens", [1, 8, 33, 512, 1024, 4096])
def test_wide_matches_reference(k26, routing, tokens):
    x, ids, tw = _case(routing, tokens, k26, seed=tokens + 1)
    want = fused_moe_ref(x.float(), ids, tw, k26).float()
    y = mw.fused_moe_wide(x, ids, tw, k26)
    assert _err(y, want) <= 1e-2
    assert torch.equal(y, mw.fused_moe_wide(x, ids, tw, k26))           # bitwise run to run


@pytest.mark.gpu
@pytest.mark.parametrize("mt,stages,warps,w2_warps", [(1, 3, 8, 8), (2, 4, 8, 8), (4, 4, 8, 8), (4, 6, 8, 8),
                                                      (1, 4, 4, 4), (2, 3, 8, 4), (4, 4, 4, 4), (4, 4, 8, 4)])
def test_wide_tiles_and_graph_replay(k26, mt, stages, warps, w2_warps):
    """Every MT and warp count, eager = graph replay, bitwise the same for 4 and 8 warps;
    skewed routing gives blocks of every count of valid 16-row tiles."""
    x, ids, tw = _case("skewed", 600, k26, seed=mt)
    tiles = mw.resolve_tiles(600, 8, k26, {"mt": mt, "stages": stages, "warps": warps, "w2_warps": w2_warps})
    eager = mw.fused_moe_wide(x, ids, tw, k26, tiles)
    assert _err(eager, fused_moe_ref(x.float(), ids, tw, k26).float()) <= 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mw.fused_moe_wide(x, ids, tw, k26, tiles)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    assert torch.equal(eager, mw.fused_moe_wide(x, ids, tw, k26, dict(tiles, stages=4, warps=8, w2_warps=8)))


@pytest.mark.gpu
@pytest.mark.parametrize("mt,minb", [(2, 4), (4, 3)])
def test_wide_register_caps_change_nothing(k26, mt, minb):
    """Registers capped for more programs an SM (MT 4 at 3 spills) give bitwise the uncapped
    result, eager and in a replayed graph."""
    x, ids, tw = _case("uniform", 1500, k26, seed=10 * mt + minb)
    base = mw.resolve_tiles(1500, 8, k26, {"mt": mt, "warps": 4})
    want = mw.fused_moe_wide(x, ids, tw, k26, base)
    assert _err(want, fused_moe_ref(x.float(), ids, tw, k26).float()) <= 1e-2
    tiles = dict(base, minb=minb)
    assert torch.equal(mw.fused_moe_wide(x, ids, tw, k26, tiles), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mw.fused_moe_wide(x, ids, tw, k26, tiles)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [64, 128])
def test_wide_tp1_shape_and_groups(group):
    """I = 2048 (K2.6 TP-1: 8 w13 chunks) and the larger scale groups."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs an sm_90 GPU")
    w = random_marlin_moe(16, 7168, 2048, group, top_k=8, device=torch.device("cuda"), seed=group)
    x, ids, tw = _case("uniform", 64, w, seed=group)
    want = fused_moe_ref(x.float(), ids, tw, w).float()
    assert _err(mw.fused_moe_wide(x, ids, tw, w), want) <= 1e-2
