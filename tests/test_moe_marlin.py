"""kernels.moe_marlin: the A-operand fragment mapping and the planning on the CPU; the CUDA
kernel against the fp32 reference, run to run and in CUDA graphs on a GPU."""
import pytest
import torch

from ddbench.kernels import marlin, moe_marlin as mm
from ddbench.kernels.moe import ROUTINGS, fused_moe_ref, random_marlin_moe, resolve_moe_kernel, synthetic_routing
from moe_cases import k26, moe_case as _case  # noqa: F401 (k26: the GPU tests' fixture)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_fragment_is_the_tile_transposed(seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (32, 128), generator=g)
    packed = marlin.pack(q)                                              # [2, 256]
    for kt in range(2):
        for nb in range(2):
            for tile in range(4):
                words = packed[kt, nb * 128 + torch.arange(32) * 4 + tile]
                want = q[16 * kt:16 * kt + 16, 64 * nb + 16 * tile:64 * nb + 16 * tile + 16].t()
                assert torch.equal(mm.emulate_a_fragment(words), want.long())


@pytest.mark.parametrize("tokens,experts,k,ch", [(1, 16, 4, 8), (37, 24, 6, 8), (200, 64, 8, 16), (9, 8, 3, 32)])
def test_plan_ref_sorts_pads_and_bounds(tokens, experts, k, ch):
    ids, _ = synthetic_routing("skewed", tokens, experts, k, seed=tokens, hot=3)
    sorted_ids, block_expert, block_rows, n_blocks = mm.plan_ref(ids, experts, ch)
    flat = ids.reshape(-1)
    nb = int(n_blocks)
    assert nb <= block_expert.numel() == mm.max_blocks(flat.numel(), experts, ch)
    seen = []
    for b in range(nb):
        e, rows = int(block_expert[b]), int(block_rows[b])
        assert 1 <= rows <= ch
        got = sorted_ids[b * ch:(b + 1) * ch]
        assert bool((flat[got[:rows].long()] == e).all()) and bool((got[rows:] == -1).all())
        seen += got[:rows].tolist()
    assert sorted(seen) == list(range(flat.numel()))                   # every assignment exactly once
    assert bool((block_expert[nb:] == -1).all()) and bool((block_rows[nb:] == 0).all())
    assert block_expert[:nb].tolist() == sorted(block_expert[:nb].tolist())
    assert nb == sum(-(-int((flat == e).sum()) // ch) for e in range(experts))


def test_work_split_and_tiles():
    # T=1 at the K2.6 TP-8 shard: 8 experts x 4 row pairs, 2112 warps -> the cap
    assert mm.work_split(1, 8, 384, 256, 7168, 2112) == mm.MAX_SPLITS
    assert mm.work_split(8, 8, 384, 256, 7168, 2112) == 8
    assert mm.work_split(512, 8, 384, 256, 7168, 2112) == 1
    assert mm.tiles_for(1, 8, 384)["ng"] == 1 and mm.tiles_for(512, 8, 384)["ng"] == 2
    assert mm.tiles_for(8, 8, 384)["w2b"] == 1 and mm.tiles_for(64, 8, 384)["w2b"] == 2
    assert mm.tiles_for(4096, 8, 384)["ng"] == 2
    # 2 groups through 5 stages from 0.9 tokens an expert (T >= 44 at K2.6): H200 T = 40 / 48 / 64 / 96
    assert mm.tiles_for(40, 8, 384)["ng"] == 1 and mm.tiles_for(44, 8, 384) == mm.tiles_for(96, 8, 384)
    assert mm.tiles_for(44, 8, 384)["ng"] == 2 and mm.tiles_for(44, 8, 384)["stages"] == 5
    assert mm.tiles_for(256, 8, 384)["stages"] == 5 and mm.tiles_for(480, 8, 384)["stages"] == 5   # 10 an expert
    assert mm.tiles_for(512, 8, 384)["stages"] == 3
    assert "splits" not in mm.tiles_for(480, 8, 384) and mm.tiles_for(512, 8, 384)["splits"] == 2   # row's own count
    assert mm.shared_bytes({"ng": 1, "stages": 4, "warps": 4, "w2b": 2}) == 4 * 4 * (144 + 32) * 16
    assert mm.shared_bytes({"ng": 2, "stages": 3, "warps": 4, "w2b": 4}, "moe_w2") == 4 * 3 * (288 + 64) * 16


def test_resolve_on_cpu_never_marlin():
    w = random_marlin_moe(8, 128, 64, 32, top_k=2, chunk=8)
    assert resolve_moe_kernel(4, 2, w, "cpu", "torch") == ("torch", {})
    assert resolve_moe_kernel(4, 2, w, "cpu")[0] in ("gemv", "triton")
    with pytest.raises(ValueError):
        resolve_moe_kernel(4, 2, w, "cpu", "marlin")
    with pytest.raises(ValueError):
        resolve_moe_kernel(4, 2, w, "cpu", "nope")


# ---------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_plan_matches_ref(k26):
    for tokens, ch in [(1, 8), (77, 16), (4096, 32)]:
        _, ids, _ = _case("skewed", tokens, k26)
        got = mm.plan(ids, 384, ch)
        want = mm.plan_ref(ids, 384, ch)
        nb = int(want[3])
        assert int(got[3]) == nb
        assert torch.equal(got[1][:nb], want[1][:nb]) and torch.equal(got[2][:nb], want[2][:nb])
        for e in torch.unique(want[1][:nb]).tolist():   # an expert's rows, in any order over its blocks
            rows = [b * ch + r for b in range(nb) if int(want[1][b]) == e for r in range(int(want[2][b]))]
            assert sorted(got[0][rows].tolist()) == want[0][rows].tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("tokens", [1, 3, 8, 33, 128, 512, 1024, 4096])
def test_marlin_matches_reference(k26, routing, tokens):
    x, ids, tw = _case(routing, tokens, k26, seed=tokens)
    want = fused_moe_ref(x.float(), ids, tw, k26).float()
    y = mm.fused_moe_marlin(x, ids, tw, k26)
    err = ((y.float() - want).norm() / want.norm()).item()
    assert err <= 1e-2, err
    assert torch.equal(y, mm.fused_moe_marlin(x, ids, tw, k26))           # bitwise run to run


@pytest.mark.gpu
@pytest.mark.parametrize("ng,w2b,routing", [(1, 1, "uniform"), (2, 2, "uniform"), (2, 4, "uniform"), (4, 2, "uniform"),
                                             (4, 2, "skewed")])
def test_marlin_tiles_and_graph_replay(k26, ng, w2b, routing):
    """Every tile shape, eager = graph replay; skewed routing at NG 4 gives items of every count
    of valid 8-token groups, 1 to 4."""
    x, ids, tw = _case(routing, 200, k26, seed=ng)
    tiles = mm.resolve_tiles(200, 8, k26, x.device, {"ng": ng, "stages": 3, "warps": 4, "w2b": w2b})
    eager = mm.fused_moe_marlin(x, ids, tw, k26, tiles)
    want = fused_moe_ref(x.float(), ids, tw, k26).float()
    assert ((eager.float() - want).norm() / want.norm()).item() <= 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mm.fused_moe_marlin(x, ids, tw, k26, tiles)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
