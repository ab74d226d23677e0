"""experiments.moe_wgmma: its fragment and swizzle mappings and its shared-memory budget on the
CPU (the sm_90a compile is in test_compile.py); the CUDA kernels against the fp32 reference, run
to run and in CUDA graphs on an H100/H200."""
import pytest
import torch

from ddbench.kernels import marlin
from ddbench.kernels.moe import ROUTINGS, fused_moe_ref, random_marlin_moe, random_router, route, synthetic_routing
from experiments import moe_wgmma as mg


@pytest.mark.parametrize("seed", [0, 1])
def test_a_fragment_is_the_tile_transposed(seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (32, 128), generator=g)                    # [K, N]
    packed = marlin.pack(q)
    for kt in range(2):
        for nb in range(2):
            for tile in range(4):
                words = packed[kt, nb * 128 + torch.arange(32) * 4 + tile]
                want = q[16 * kt:16 * kt + 16, 64 * nb + 16 * tile:64 * nb + 16 * tile + 16].T
                assert torch.equal(mg.a_fragment(words), want.long())


def test_b_offset_is_the_128_byte_swizzle():
    seen = set()
    for row in range(128):
        for k in range(64):
            plain = row * 128 + 2 * k
            off = mg.b_offset(row, k)
            assert off == plain ^ (((plain >> 7) & 7) << 4)                 # address bits 4-6 ^= bits 7-9
            assert row * 128 <= off < row * 128 + 128
            seen.add(off)
    assert len(seen) == 128 * 64


def test_shared_memory_and_sizes():
    assert mg.shared_bytes(4) == 1024 + 4 * 21504 + 32768 + 32768 + 2048 + 64
    assert mg.shared_bytes(8, (16, 32, 48)) == 1024 + 8 * (6144 + 5120) + 12288 + 12288 + 768 + 128
    for ch in range(16, 129, 16):
        assert mg.stage_bytes(ch) % 1024 == 0                           # every slot's token tile 1024-aligned
    mg.check_config(7, mg.SIZES)
    mg.check_config(12, (16, 32, 48))
    for stages, sizes in [(8, mg.SIZES), (1, mg.SIZES), (4, (48, 96)), (4, (40, 96, 128)), (4, (96, 48, 128)),
                          (4, (48, 96, 144))]:
        with pytest.raises(ValueError):
            mg.check_config(stages, sizes)


# ---------------------------------------------------------------- GPU (sm_90 only: wgmma)

@pytest.fixture(scope="module")
def k26():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    return random_marlin_moe(384, 7168, 256, 32, top_k=8, device=torch.device("cuda"), seed=5)


def _case(routing, tokens, w, seed):
    dev = torch.device("cuda")
    x = torch.randn(tokens, w.hidden, device=dev, generator=torch.Generator(dev).manual_seed(seed)).bfloat16()
    if routing == "router":
        gw, bias = random_router(w.hidden, w.n_experts, device=dev, seed=seed)
        ids, tw = route(x, gw, bias, 8, 2.5)
    else:
        ids, tw = synthetic_routing(routing, tokens, w.n_experts, 8, device=dev, seed=seed)
    return x, ids, tw


def _err(y, want):
    return ((y.float() - want).norm() / want.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("tokens", [1, 33, 512, 1024, 4096])
def test_wgmma_matches_reference(k26, routing, tokens):
    """Blocks of every default N (48, 96, 128 rows) and of 1 row; bitwise run to run."""
    x, ids, tw = _case(routing, tokens, k26, seed=tokens + 3)
    want = fused_moe_ref(x.float(), ids, tw, k26).float()
    y = mg.fused_moe_wgmma(x, ids, tw, k26)
    assert _err(y, want) <= 1e-2
    assert torch.equal(y, mg.fused_moe_wgmma(x, ids, tw, k26))


@pytest.mark.gpu
@pytest.mark.parametrize("stages, sizes, tokens", [(2, mg.SIZES, 2000), (3, mg.SIZES, 2000), (6, mg.SIZES, 2000),
                                                   (8, (16, 32, 48), 300), (12, (16, 32, 48), 2000)])
def test_wgmma_stages_sizes_and_graph_replay(k26, stages, sizes, tokens):
    """Skewed routing: blocks of every size class; eager = graph replay."""
    x, ids, tw = _case("skewed", tokens, k26, seed=stages)
    eager = mg.fused_moe_wgmma(x, ids, tw, k26, stages, sizes)
    assert _err(eager, fused_moe_ref(x.float(), ids, tw, k26).float()) <= 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = mg.fused_moe_wgmma(x, ids, tw, k26, stages, sizes)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [64, 128])
def test_wgmma_other_groups_and_sizes(group):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    dev = torch.device("cuda")
    w = random_marlin_moe(16, 1024, 512, group, top_k=4, device=dev, seed=group)
    x = torch.randn(300, 1024, device=dev, generator=torch.Generator(dev).manual_seed(group)).bfloat16()
    ids, tw = synthetic_routing("uniform", 300, 16, 4, device=dev, seed=group)
    assert _err(mg.fused_moe_wgmma(x, ids, tw, w), fused_moe_ref(x.float(), ids, tw, w).float()) <= 1e-2
