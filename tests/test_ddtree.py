"""DDTree kernels against their references: builder, visibility, top-K, greedy accept, KV commit.

On CPU the Triton kernels run under the interpreter (conftest sets TRITON_INTERPRET=1), so
the shapes here are small; the GPU tests at the end use real sizes and bf16.
"""
import itertools

import numpy as np
import pytest
import torch

from ddbench.kernels.ddtree import (build_tree, build_tree_ref, commit_kv, commit_kv_ref, greedy_accept,
                            greedy_accept_ref, max_nodes, topk_from_logits)

FIELDS = ("parent", "depth", "rank", "token", "visible")


def random_topk(b, n_pos, k, gen, ties=False, device="cpu"):
    """Sorted-descending per-position log-probs and distinct token ids per position."""
    if ties:   # few distinct values: many equal path scores
        lp = torch.randint(-4, 1, (b, n_pos, k), generator=gen).float() * 0.5
    else:
        lp = -torch.rand(b, n_pos, k, generator=gen).pow(2) * 6
    lp = lp.sort(-1, descending=True).values
    ids = torch.stack([torch.randperm(1000, generator=gen)[:k] for _ in range(b * n_pos)]).view(b, n_pos, k)
    return lp.to(device), ids.to(device)


def assert_same_tree(a, b, what=""):
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert torch.equal(x.cpu(), y.cpu()), f"{what} field {f} differs:\n{x}\n{y}"


CASES = [  # (streams, positions, K, budget, ties)
    (3, 4, 5, 12, False), (2, 6, 3, 40, False), (2, 3, 2, 14, False),   # 14 = every prefix
    (4, 5, 4, 25, True), (2, 7, 2, 50, True), (3, 1, 6, 6, False), (2, 15, 8, 33, False),
    (1, 3, 1, 3, True),                                                # a single chain
]


@pytest.mark.parametrize("case", CASES, ids=[f"b{c[0]}l{c[1]}k{c[2]}n{c[3]}{'t' if c[4] else ''}" for c in CASES])
def test_builder_equals_heap_reference(case):
    b, n_pos, k, budget, ties = case
    gen = torch.Generator().manual_seed(hash(case) % 2**31)
    for _ in range(3):
        lp, ids = random_topk(b, n_pos, k, gen, ties)
        assert_same_tree(build_tree_ref(lp, ids, budget), build_tree(lp, ids, budget), str(case))


def test_builder_many_random_inputs():
    gen = torch.Generator().manual_seed(7)
    for i in range(12):
        n_pos, k = (int(x) for x in torch.randint(1, 6, (2,), generator=gen))
        budget = int(torch.randint(1, min(max_nodes(n_pos, k), 48) + 1, (1,), generator=gen))
        lp, ids = random_topk(2, n_pos, k, gen, ties=i % 2 == 1)
        assert_same_tree(build_tree_ref(lp, ids, budget), build_tree(lp, ids, budget), f"draw {i}")


def test_exact_float_ties_need_the_rank_rule():
    """All log-probs equal: same-depth candidates tie, so the tie rule alone orders each
    depth (lexicographic rank tuples); the result is breadth-first."""
    lp = torch.full((1, 3, 2), -1.0)
    ids = torch.arange(6).view(1, 3, 2)
    t = build_tree(lp, ids, 6)
    assert t.depth[0].tolist() == [0, 1, 1, 2, 2, 2, 2]
    assert t.parent[0].tolist() == [-1, 0, 0, 1, 1, 2, 2]
    assert t.rank[0].tolist() == [-1, 0, 1, 0, 1, 0, 1]
    assert_same_tree(build_tree_ref(lp, ids, 6), t)


def test_reference_is_the_top_budget_prefixes():
    """Independent check of the reference: its nodes in pop order are the best `budget` of all
    prefixes sorted by (float32 score descending, rank tuple ascending)."""
    gen = torch.Generator().manual_seed(3)
    for ties in (False, True):
        lp, ids = random_topk(1, 3, 3, gen, ties)
        lpn = lp[0].numpy()
        allp = []
        for d in range(1, 4):
            for ranks in itertools.product(range(3), repeat=d):
                sc = np.float32(0)
                for j, r in enumerate(ranks):
                    sc = np.float32(sc + lpn[j, r])
                allp.append((-float(sc), ranks))
        allp.sort()
        t = build_tree_ref(lp, ids, 20)
        got = []
        for i in range(1, 21):        # rank tuple of node i from its ancestors
            ranks, j = [], i
            while j > 0:
                ranks.append(int(t.rank[0, j]))
                j = int(t.parent[0, j])
            got.append(tuple(reversed(ranks)))
        assert got == [r for _, r in allp[:20]]


def test_tree_structure_and_visibility():
    gen = torch.Generator().manual_seed(11)
    lp, ids = random_topk(3, 5, 4, gen)
    t = build_tree(lp, ids, 30)
    b, n = t.parent.shape
    assert t.parent.dtype == torch.int32 and t.visible.dtype == torch.bool and t.visible.shape == (b, n, n)
    assert torch.equal(t.pos, t.depth)
    for s in range(b):
        par = t.parent[s].tolist()
        assert par[0] == -1 and t.token[s, 0] == -1 and t.rank[s, 0] == -1
        for i in range(1, n):
            assert 0 <= par[i] < i
            assert t.depth[s, i] == t.depth[s, par[i]] + 1
            assert t.token[s, i] == ids[s, t.depth[s, i] - 1, t.rank[s, i]]
        for i in range(n):       # visibility = ancestor-or-self, from an explicit chain walk
            chain, j = set(), i
            while j >= 0:
                chain.add(j)
                j = par[j]
            assert t.visible[s, i].nonzero().flatten().tolist() == sorted(chain)


def test_budget_checks():
    lp, ids = random_topk(1, 2, 2, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="exceeds"):
        build_tree(lp, ids, 7)          # only 2 + 4 prefixes
    with pytest.raises(ValueError, match="budget"):
        build_tree_ref(lp, ids, 0)


@pytest.mark.parametrize("dtype,chunk", [(torch.float32, 2048), (torch.float16, 2048), (torch.float32, 64)])
def test_topk_from_logits(dtype, chunk):
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(2, 3, 320, generator=gen) * 3).to(dtype)
    lp, ids = topk_from_logits(logits, 7, chunk=chunk)          # chunk 64: the two-stage path
    ref = torch.log_softmax(logits.float(), -1)
    assert lp.dtype == torch.float32 and ids.shape == (2, 3, 7)
    assert torch.all(lp[..., :-1] >= lp[..., 1:])
    torch.testing.assert_close(lp, ref.gather(-1, ids), atol=1e-5, rtol=0)
    torch.testing.assert_close(lp, ref.topk(7, -1).values, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------------------
# greedy accept + commit
# --------------------------------------------------------------------------------------

def plant_path(tree, s, leaf, am):
    """Make the target agree with the tree along root -> leaf; returns the path."""
    path, j = [], leaf
    while j >= 0:
        path.append(j)
        j = int(tree.parent[s, j])
    path.reverse()
    for a, c in zip(path, path[1:]):
        am[s, a] = tree.token[s, c]
    return path


def accept_case(seed, budget=24, b=4, n_pos=4, k=3):
    gen = torch.Generator().manual_seed(seed)
    lp, ids = random_topk(b, n_pos, k, gen)
    t = build_tree_ref(lp, ids, budget)
    am = torch.randint(1000, 2000, (b, budget + 1), generator=gen)    # matches no draft token
    paths = [[0]]                                                     # stream 0: nothing accepted
    deepest = int(t.depth[1].argmax())
    paths.append(plant_path(t, 1, deepest, am))                      # stream 1: a whole root-leaf path
    for s in range(2, b):                                             # others: a random node's path
        paths.append(plant_path(t, s, int(torch.randint(0, budget + 1, (1,), generator=gen)), am))
    return t, am, paths


@pytest.mark.parametrize("seed", range(4))
def test_greedy_accept_equals_reference(seed):
    t, am, paths = accept_case(seed)
    for max_depth in (None, 4):
        ref = greedy_accept_ref(t.parent, t.token, am, max_depth)
        got = greedy_accept(t.parent, t.token, am, max_depth)
        for x, y in zip(ref, got):
            assert torch.equal(x, y), (x, y)
        acc, n_acc, bonus = got
        assert acc.shape == (4, (max_depth or 24) + 1)
        for s, path in enumerate(paths):
            # the planted path is accepted (it can only be extended by chance matches)
            assert acc[s, :len(path)].tolist() == path
            assert n_acc[s] >= len(path) and bonus[s] == am[s, acc[s, n_acc[s] - 1]]
        assert n_acc[0] == 1 and acc[0, 1:].eq(-1).all() and bonus[0] == am[0, 0]
        assert n_acc[1] == len(paths[1]) and n_acc[1] == int(t.depth[1].max()) + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_commit_equals_reference(dtype):
    t, am, paths = accept_case(1)
    acc, _, _ = greedy_accept(t.parent, t.token, am, max_depth=4)
    gen = torch.Generator().manual_seed(2)
    b, s_len = acc.shape[0], 64
    ckv = torch.randn(b, s_len, 32, generator=gen).to(dtype)
    kpe = torch.randn(b, s_len, 8, generator=gen).to(dtype)
    prefix = torch.tensor([0, 13, 30, 7])                      # node j at prefix + j (< 64 - 25)
    c1, k1 = ckv.clone(), kpe.clone()
    commit_kv_ref(c1, k1, prefix, acc)
    c2, k2 = ckv.clone(), kpe.clone()
    commit_kv(c2, k2, prefix, acc)
    assert torch.equal(c1, c2) and torch.equal(k1, k2)
    assert torch.equal(c2[0], ckv[0])                         # nothing accepted: untouched
    moved = 0
    for s in range(1, b):                                     # each accepted path now contiguous
        for i, node in enumerate(acc[s][acc[s] >= 0].tolist()):
            assert torch.equal(c2[s, prefix[s] + i], ckv[s, prefix[s] + node])
            moved += node != i
    assert moved > 0, "test draws should move some rows"


def test_commit_all_padding_and_full_chain():
    gen = torch.Generator().manual_seed(4)
    ckv, kpe = torch.randn(2, 20, 16, generator=gen), torch.randn(2, 20, 4, generator=gen)
    acc = torch.tensor([[-1, -1, -1, -1, -1], [0, 3, 7, 8, 12]], dtype=torch.int32)
    prefix = torch.tensor([5, 2], dtype=torch.int32)
    c1, k1, c2, k2 = ckv.clone(), kpe.clone(), ckv.clone(), kpe.clone()
    commit_kv_ref(c1, k1, prefix, acc)
    commit_kv(c2, k2, prefix, acc)
    assert torch.equal(c1, c2) and torch.equal(k1, k2) and torch.equal(c2[0], ckv[0])


# --------------------------------------------------------------------------------------
# GPU: real sizes, bf16 logits, CUDA graphs
# --------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("budget", [64, 512, 1024])
def test_gpu_builder_real_sizes(budget):
    gen = torch.Generator(device="cuda").manual_seed(budget)
    logits = (torch.randn(10, 15, 163840, device="cuda", generator=gen) * 4).bfloat16()
    lp, ids = topk_from_logits(logits, 32)
    assert_same_tree(build_tree_ref(lp, ids, budget), build_tree(lp, ids, budget), f"budget {budget}")
    lpq = (lp * 4).round() / 4                                    # many exact ties
    assert_same_tree(build_tree_ref(lpq, ids, budget), build_tree(lpq, ids, budget), "ties")


@pytest.mark.gpu
def test_gpu_step_in_cuda_graph():
    """topk -> build -> accept -> commit captured in one CUDA graph equals the eager references."""
    b, n_pos, k, budget, s_len = 10, 15, 16, 256, 2048
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(b, n_pos, 4096, device="cuda", generator=gen).bfloat16() * 3
    am = torch.randint(0, 4096, (b, budget + 1), device="cuda", generator=gen)
    ckv = torch.randn(b, s_len, 512, device="cuda", generator=gen).bfloat16()
    kpe = torch.randn(b, s_len, 64, device="cuda", generator=gen).bfloat16()
    prefix = torch.randint(0, s_len - budget - 1, (b,), device="cuda", generator=gen)
    ref_t = build_tree_ref(*topk_from_logits(logits, k), budget)
    for s in range(b):     # let the target follow the tree for a while on some streams
        plant_path(ref_t, s, int(ref_t.depth[s].argmax()) if s % 2 else s * 7, am)
    c0, k0 = ckv.clone(), kpe.clone()

    def step():
        t = build_tree(*topk_from_logits(logits, k), budget)
        acc, n_acc, bonus = greedy_accept(t.parent, t.token, am, n_pos)
        commit_kv(ckv, kpe, prefix, acc)
        return t, acc, n_acc, bonus

    step()
    ckv.copy_(c0), kpe.copy_(k0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    ckv.copy_(c0), kpe.copy_(k0)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = step()
    ckv.copy_(c0), kpe.copy_(k0)
    g.replay()
    torch.cuda.synchronize()
    t, acc, n_acc, bonus = outs
    assert_same_tree(ref_t, t, "graph")
    ra, rn, rb = greedy_accept_ref(ref_t.parent, ref_t.token, am, n_pos)
    assert torch.equal(ra, acc) and torch.equal(rn, n_acc) and torch.equal(rb, bonus)
    commit_kv_ref(c0, k0, prefix, ra)
    assert torch.equal(c0, ckv) and torch.equal(k0, kpe)


# --------------------------------------------------------------------------------------
# the tree-bench command (CPU: tiny preset under the interpreter)
# --------------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU tiny preset only runs without a GPU")
def test_tree_bench_cli_cpu(tmp_path, monkeypatch):
    import json

    import pandas as pd
    from typer.testing import CliRunner

    from ddbench import tree_bench
    from ddbench.cli import app
    from ddbench.tree_bench import COLUMNS, summary

    # fewer points of the CPU sweep (one budget, one prefix, 1 timed rep: 45 s -> about 6 s on 2 CPU
    # cores), still every kernel, 2 streams, decode and tree-verify attention against its reference
    for key, value in dict(budgets=[8], prefixes=[32], reps=1).items():
        monkeypatch.setitem(tree_bench.TINY, key, value)
    r = CliRunner().invoke(app, ["tree-bench", "--out", str(tmp_path), "--name", "tb"])
    assert r.exit_code == 0, r.output
    assert "tiny CPU preset" in r.output
    df = pd.read_csv(tmp_path / "tb.csv")
    assert list(df.columns) == COLUMNS
    assert set(df.kernel) == {"topk", "build", "accept", "accept_commit", "commit", "attn"}
    att = df[df.kernel == "attn"]
    assert (att.max_abs_err < 1e-4).all() and (att.kv_bytes > 0).all()
    assert sorted(att.t.unique()) == [1, 9] and sorted(df.streams.unique()) == [1, 2]
    meta = json.loads((tmp_path / "tb.json").read_text())
    assert meta["kind"] == "tree_bench" and meta["cpu_tiny"] and meta["completed"]
    summary(tmp_path / "tb.csv")
    bad = CliRunner().invoke(app, ["tree-bench", "--out", str(tmp_path), "--kernels", "nope"])
    assert bad.exit_code == 2 and "nope" in bad.output
