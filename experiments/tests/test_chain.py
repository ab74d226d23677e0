"""experiments.chain: a chain of dependent GEMVs, one phase a launch (CPU interpreter) and in one
persistent launch with grid barriers (GPU), against the fp32 torch chain."""
import pytest
import torch

from experiments import chain
from ddbench.kernels.device import sm_count

# phase (n, k, src): ragged n and k (tiles and K splits with tails), inputs from the input,
# the previous phase and an older one
SHAPES = [(64, 96, -1), (48, 64, 0), (100, 48, 1), (40, 96, 2), (72, 40, 2)]
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _check(c, mode, runs=2):
    ref = chain.reference(c)
    for _ in range(runs):   # the second run checks the zeroing and (barriers) the counter reset
        out = chain.run(c, mode)
        assert ((out - ref).norm() / ref.norm()).item() < 1e-5, mode


@pytest.mark.parametrize("mode", ["launch", "preload"])
def test_chain_one_phase_a_launch_matches_torch(mode):
    _check(chain.build(SHAPES, DEV, programs=3, bn=16, bk=32), mode)


def test_splits_give_the_busiest_program_the_fewest_bytes():
    assert chain.splits_for(2112, 7168, 16, 256, 132) == (1, 7168)       # 132 row blocks: one each
    s, kper = chain.splits_for(384, 7168, 16, 256, 132)                  # 24 row blocks: split K
    assert s > 1 and kper % 256 == 0 and s * kper >= 7168 and 24 * s <= 132


def test_chain_rejects_bad_inputs():
    with pytest.raises(ValueError, match="does not have"):
        chain.build([(32, 64, -1), (16, 64, 0)], "cpu", programs=2)
    with pytest.raises(ValueError, match="last phase"):
        chain.build([(64, 64, -1), (64, 64, 0)], "cpu", programs=2)
    with pytest.raises(ValueError, match="mode"):
        chain.run(chain.build(SHAPES, "cpu", programs=2, bk=32), "fast")
    with pytest.raises(ValueError, match="GPU"):
        chain.run(chain.build(SHAPES, "cpu", programs=2, bk=32), "barrier")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", chain.MODES)
def test_gpu_chain_matches_torch(mode):
    dev = torch.device("cuda")
    _check(chain.build(SHAPES * 3 + [(96, 64, 4)], dev, programs=sm_count(dev), bn=16, bk=32), mode, runs=3)
    big = [(2112, 7168, -1), (1536, 1536, 0), (7168, 1024, 1), (384, 7168, 2), (512, 7168, 2), (7168, 256, 4)]
    _check(chain.build(big, dev, programs=chain.MAX_RESIDENT_PER_SM * sm_count(dev), bk=256), mode)


@pytest.mark.gpu
def test_gpu_chain_refuses_more_programs_than_stay_resident():
    dev = torch.device("cuda")
    c = chain.build(SHAPES, dev, programs=(chain.MAX_RESIDENT_PER_SM + 1) * sm_count(dev), bn=16, bk=32)
    with pytest.raises(ValueError, match="resident"):
        chain.run(c, "barrier")


@pytest.mark.gpu
def test_gpu_chain_with_barriers_replays_in_a_cuda_graph():
    dev = torch.device("cuda")
    c = chain.build(SHAPES, dev, programs=sm_count(dev), bn=16, bk=32)
    ref = chain.reference(c)
    chain.run(c, "prefetch")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = chain.run(c, "prefetch")
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5


def test_layers_chains_the_dense_gemvs_of_each_layer_to_the_one_before():
    from ddbench.engine.config import preset
    dense = preset("k2.6", tp=8).dense_shapes()
    shapes = chain.layers(dense, 2)
    assert [(n, k) for n, k, _ in shapes[:6]] == [dense[name] for name in chain.LAYER_SRC]
    assert [src for _, _, src in shapes] == [-1, 0, 1, 2, 2, 4, 5, 6, 7, 8, 8, 10]   # layer 2 reads layer 1's last
    assert [src for _, _, src in chain.layers(dense, 2, free=True)] == [-1] * 12
    chain.build(shapes, "cpu", programs=8)                                             # a valid chain
