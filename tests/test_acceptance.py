"""engine.acceptance: the rank-profile walk against a brute-force expectation on small
trees, sampling against the analytic expectation, the profile fit and the shipped
profiles, the rank counter and the save/load round trip."""
import itertools
import json

import pytest
import torch

from ddbench.engine.acceptance import (DFLASH_K25, SIBLING_GAIN, RankCounter, RankProfile, chain_tokens,
                                       draw_ranks, expected_curve, family, fit_family, load_profile,
                                       matched_path, profile_dir, save_profile, shipped_profile,
                                       tree_expectation)
from ddbench.engine.config import ConfigError
from ddbench.engine.spec import parse_acceptance
from ddbench.kernels import ddtree


def random_profile(depth, k, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(depth, k + 1, generator=g, dtype=torch.float64)
    p = p / p.sum(-1, keepdim=True)
    return p[:, :k].sort(-1, descending=True).values                         # [L, K], rest: miss


def build(p, budget, n=1):
    depth, k = p.shape
    logp = p.clamp(min=1e-9).log().float().expand(n, depth, k).contiguous()
    ids = torch.arange(depth * k).view(1, depth, k).expand(n, depth, k).contiguous()
    return ddtree.build_tree_ref(logp, ids, budget)


@pytest.mark.parametrize("budget", [1, 3, 6, 11])
def test_walk_matches_brute_force_expectation(budget):
    depth, k = 3, 2
    p = random_profile(depth, k, budget)
    t = build(p, budget)
    brute = 0.0
    for ranks in itertools.product(range(k + 1), repeat=depth):               # every target draw
        prob = 1.0
        for d, r in enumerate(ranks):
            prob *= float(p[d, r]) if r < k else 1 - float(p[d].sum())
        acc = matched_path(t.parent.long(), t.rank.long(), t.depth.long(), torch.tensor([ranks]), depth)
        brute += prob * int((acc >= 0).sum())
    assert float(tree_expectation(t.parent, t.rank, t.depth, p)[0]) == pytest.approx(brute, abs=1e-9)
    assert expected_curve(p.log(), p, budget)[budget] == pytest.approx(brute, abs=1e-9)


def test_sampled_length_matches_analytic_and_grows_with_budget():
    p = load_profile("dflash-k25-gsm8k-paper").table(7, 8)
    cdf = p.cumsum(-1).float()
    n, means = 6000, []
    g = torch.Generator().manual_seed(0)
    for budget in (4, 16, 64):
        t = build(p, budget)
        par, rk, dp = (x.expand(n, -1) for x in (t.parent.long(), t.rank.long(), t.depth.long()))
        acc = matched_path(par, rk, dp, draw_ranks(torch.rand(n, 7, generator=g), cdf), 7)
        length = (acc >= 0).sum(-1).double()
        want = float(tree_expectation(t.parent, t.rank, t.depth, p)[0])
        assert abs(length.mean().item() - want) < 4 * length.std().item() / n ** 0.5 + 1e-9
        means.append(want)
    assert means[0] < means[1] < means[2]


def test_fit_reproduces_the_chain_and_gain():
    a, h = fit_family(4.2, 7, 8, 1.2, 64, 0.5)
    p = torch.tensor(family(a, h, 0.5, 7, 8), dtype=torch.float64)
    assert chain_tokens(p[:, 0].tolist()) == pytest.approx(4.2, abs=1e-6)
    assert expected_curve(p.log(), p, 64)[64] == pytest.approx(1.2 * 4.2, rel=1e-4)
    with pytest.raises(ConfigError):
        fit_family(7.5, 7, 8, 1.5, 64, 0.5)                  # beyond depth + 1


@pytest.mark.parametrize("setting", list(SIBLING_GAIN))
@pytest.mark.parametrize("dataset", ["gsm8k", "mtbench"])
def test_shipped_profiles_are_the_fit(dataset, setting):
    prof = load_profile(f"dflash-k25-{dataset}-{setting}")
    assert prof.chain_tokens() == pytest.approx(DFLASH_K25[dataset], abs=1e-6)
    assert torch.allclose(torch.tensor(prof.probs), torch.tensor(shipped_profile(dataset, setting).probs),
                          atol=1e-12, rtol=0)
    assert "z-lab/Kimi-K2.5-DFlash" in prof.source
    acc = parse_acceptance(f"rank:{prof.name}", 7)
    curve = acc.expected_curve(7, 16, 256)
    assert curve[7] == pytest.approx(DFLASH_K25[dataset], abs=1e-6)        # budget = depth: the chain
    assert curve[256] == pytest.approx(DFLASH_K25[dataset] * SIBLING_GAIN[setting]["gain"], rel=1e-3)
    assert len(list(profile_dir().glob("dflash-k25-*.json"))) == 2 * len(DFLASH_K25)


def test_rank_counter_and_round_trip(tmp_path):
    g = torch.Generator().manual_seed(5)
    n, depth, vocab = 6, 4, 50
    logits = torch.randn(n, depth, vocab, generator=g)
    target = torch.randint(0, vocab, (n, depth), generator=g)
    valid = torch.rand(n, depth, generator=g) < 0.7
    rc = RankCounter(depth, "cpu", k=5)
    rc.add(logits, target, valid)
    want = torch.zeros(depth, 6, dtype=torch.long)
    for b in range(n):
        for d in range(depth):
            if valid[b, d]:
                order = logits[b, d].argsort(descending=True).tolist()
                want[d, min(order.index(int(target[b, d])), 5)] += 1
    assert torch.equal(rc.counts, want)
    prof = save_profile(tmp_path / "m.json", rc.counts, "test")
    back = load_profile(str(tmp_path / "m.json"))
    assert back.probs == prof.probs and back.counts == want.tolist()
    for d in range(depth):
        tot = int(want[d].sum())
        assert back.probs[d] == pytest.approx((want[d, :5].double() / max(tot, 1)).tolist())
    assert parse_acceptance(f"rank:{tmp_path / 'm.json'}", depth).mode == "rank"


def test_bad_profiles(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps({"probs": [[0.8, 0.5]]}))
    for spec in (str(tmp_path / "bad.json"), "no-such-profile"):
        with pytest.raises(ConfigError):
            load_profile(spec)
    with pytest.raises(ConfigError):
        RankProfile("x", [[0.5], [0.2, 0.1]])
