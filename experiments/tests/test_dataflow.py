"""experiments.dataflow (a chain of GEMVs in one persistent CUDA launch, its weight stream running
ahead of the dependencies): its tiling on CPU; on the GPU the kernel against the chain's fp32
reference on fresh random weights, three times in a row (the counters reset; the third on a
new input), in a replayed CUDA graph, with phases that read the input or an earlier phase
than the one before."""
import pytest
import torch

from experiments import chain, dataflow

SHAPES = [(2112, 7168, -1), (1536, 1536, 0), (7168, 1024, 1), (384, 7168, 2), (512, 7168, 2), (7168, 256, 4),
          (100, 56, -1), (3000, 7168, 5)]   # the K2.6 TP-8 dense chain, a phase off the input, an uneven one


def test_plan_cuts_phases_into_whole_rows_that_fit_a_slot():
    c = chain.build(SHAPES, "cpu", programs=8)
    pl = dataflow.plan(c, spread=False)
    bn = [r[6] for r in pl.rows]
    assert bn == [1, 6, 10, 1, 1, 40, 182, 1]             # rows of 2 K bytes in 20 KB
    tiles = [r[7] for r in pl.rows]
    assert tiles == [2112, 256, 717, 384, 512, 180, 1, 3000]
    assert [r[8] for r in pl.rows] == [sum(tiles[:p]) for p in range(len(SHAPES))] and pl.total == sum(tiles)
    assert all(r[1:3] == [n, k] and r[5] == src for r, (n, k, src) in zip(pl.rows, SHAPES))
    assert pl.kmax == 7168 and pl.table.shape == (len(SHAPES), dataflow.COLS)
    with pytest.raises(ValueError, match="does not fit"):
        dataflow.plan(chain.build([(4, 10240 + 8, -1)], "cpu", programs=8))


def test_plan_spreads_a_small_phase_over_every_team():
    pl = dataflow.plan(chain.build(SHAPES, "cpu", programs=132))    # 132 programs x 8 teams
    assert [r[6] for r in pl.rows] == [1, 2, 7, 1, 1, 7, 1, 1]     # ceil(N / 1056), at most a slot
    assert [r[7] for r in pl.rows] == [2112, 768, 1024, 384, 512, 1024, 100, 3000]


@pytest.mark.gpu
@pytest.mark.parametrize("split, publisher, rb, vecs", [(1, False, 4, 4), (2, False, 4, 4), (2, True, 4, 4),
                                                       (2, True, 2, 8), (1, True, 8, 4), (2, True, 3, 6)])
def test_gpu_matches_the_reference_twice_and_in_a_graph(split, publisher, rb, vecs):
    c = chain.build(SHAPES, "cuda", programs=132, seed=3)
    pl = dataflow.plan(c)
    ref = chain.reference(c)
    for i in range(3):
        if i == 2:   # a new input: nothing of the launch before may be taken for this one's
            c.input().copy_(torch.randn_like(c.input()))
            ref = chain.reference(c)
        got = dataflow.run(pl, split=split, rb=rb, vecs=vecs, publisher=publisher)
        torch.cuda.synchronize()
        assert not dataflow.gave_up(pl)
        assert (got - ref).norm() < 1e-3 * ref.norm(), ((got - ref).norm() / ref.norm()).item()
    first = [c.output(p).clone() for p in range(len(SHAPES))]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dataflow.run(pl, split=split, rb=rb, vecs=vecs, publisher=publisher)
    for _ in range(3):
        c.act[c.rows[0][chain.Y_OFF]:].zero_()                              # every output written again
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(c.output(p), first[p]) for p in range(len(SHAPES)))   # no atomics: bit-exact
    assert not dataflow.gave_up(pl)


@pytest.mark.gpu
def test_gpu_marks_build_gives_the_same_outputs_and_its_spans():
    c = chain.build(SHAPES, "cuda", programs=132, seed=5)
    pl = dataflow.plan(c)
    plain = dataflow.run(pl).clone()
    marks = torch.zeros(132, len(SHAPES), len(dataflow.MARKS), dtype=torch.int64, device="cuda")
    got = dataflow.run(pl, marks=marks)
    torch.cuda.synchronize()
    assert torch.equal(got, plain) and not dataflow.gave_up(pl)
    tiles = marks[:, :, -1]
    assert tiles.sum(0).tolist() == [r[7] for r in pl.rows]            # every tile multiplied once
    assert tiles.max(0).values.tolist() == [-(-r[7] // 132) for r in pl.rows]   # dealt round robin
    assert (marks >= 0).all() and (marks[:, 1:, 0][tiles[:, 1:] > 0] > 0).all()   # a wait costs cycles
    with pytest.raises(ValueError, match="marks"):
        dataflow.run(pl, marks=marks[:, :, :-1])
