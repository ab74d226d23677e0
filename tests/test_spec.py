"""The DDTree speculative loop on the tiny preset (CPU): lossless against plain greedy
decoding, with a random drafter and with an oracle drafter that proposes the target's own
greedy continuation; mixed prompt lengths; streams finishing mid-batch; acceptance modes."""
import json

import pytest
import torch

from ddbench.engine.config import ConfigError, preset
from ddbench.engine.drafter import Drafter, drafter_config
from ddbench.engine.model import Transformer
from ddbench.engine.acceptance import draw_ranks, matched_path
from ddbench.engine.acceptance import chain_tokens as expected_tokens
from ddbench.engine.spec import ARStep, Session, SpecStep, parse_acceptance, read_profile, tau_probs
from ddbench.engine.weights import init_random
from ddbench.kernels import ddtree
from ddbench.kernels.moe import expected_experts_touched

from test_routing import prefix_hash

NEW = 14


@pytest.fixture(scope="module")
def models():
    cfg = preset("tiny")
    target = Transformer(cfg, dtype=torch.float32)
    init_random(target, 3)
    drafter = Drafter(drafter_config(cfg), target, target.comm, dtype=torch.float32)
    drafter.init_random(4)
    return cfg, target, drafter


def prompts_for(cfg, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab, (n,), generator=g).tolist() for n in lens]


def greedy(target, prompts, limits):
    """Plain greedy decoding of the target, one token per forward (no drafter)."""
    s = Session(target, None, len(prompts), max_prompt=max(map(len, prompts)), max_new=max(limits))
    s.prefill(prompts, limits)
    ARStep(s).run()
    return s.outputs()


@pytest.fixture(scope="module")
def reference(models):
    cfg, target, _ = models
    cases = {}
    for name, lens, limits in [("c1", [7], [NEW]), ("c3", [4, 11, 6], [NEW, 5, NEW])]:
        prompts = prompts_for(cfg, lens, seed=len(lens))
        cases[name] = (prompts, limits, greedy(target, prompts, limits))
    return cases


class OracleDrafter(Drafter):
    """Proposes the target's greedy continuation (from a table of the reference output),
    with every `miss_every`-th drafted position wrong, so long paths are accepted and
    committed and partial paths happen too. Context updates run as in the real drafter."""

    def set_table(self, prompts, outputs, miss_every=0):
        rows = [p + o for p, o in zip(prompts, outputs)]
        width = self.ctx_k.shape[2] + self.block + 1
        self.table = torch.zeros(len(rows), width, dtype=torch.long)
        for b, r in enumerate(rows):
            self.table[b, :len(r)] = torch.tensor(r)
        self.miss_every = miss_every

    def forward(self, bonus, start):
        n, depth = bonus.shape[0], self.dc.depth
        pos = start.view(n, 1) + 1 + torch.arange(depth)                           # [N, L]
        tok = self.table.gather(1, pos)
        if self.miss_every:
            wrong = (pos % self.miss_every) == 0
            tok = torch.where(wrong, (tok + 1) % self.target[0].cfg.vocab, tok)
        vocab = self.target[0].cfg.vocab
        logits = torch.randn(n, depth, vocab, generator=torch.Generator().manual_seed(0))
        return logits.scatter(2, tok.unsqueeze(-1), 20.0)


def spec_run(target, drafter, prompts, limits, budget, kernels="ref", acceptance=None):
    s = Session(target, drafter, len(prompts), max_prompt=max(map(len, prompts)), max_new=max(limits),
                max_budget=budget)
    s.prefill(prompts, limits)
    stats = SpecStep(s, budget, acceptance=acceptance, kernels=kernels).run()
    return s, stats


@pytest.mark.parametrize("case,budget", [("c1", 1), ("c1", 6), ("c3", 5), ("c3", 24)])
def test_random_drafter_is_lossless(models, reference, case, budget):
    _, target, drafter = models
    prompts, limits, ref = reference[case]
    s, stats = spec_run(target, drafter, prompts, limits, budget)
    assert s.outputs() == ref
    assert stats.tokens == sum(limits) - len(limits)      # first token comes from prefill


@pytest.mark.parametrize("case,budget,miss,kernels", [("c1", 8, 0, "ref"), ("c3", 7, 0, "ref"),
                                                     ("c3", 20, 5, "ref"), ("c3", 7, 0, "triton")])
def test_oracle_drafter_accepts_long_paths_losslessly(models, reference, case, budget, miss, kernels):
    cfg, target, drafter = models
    prompts, limits, ref = reference[case]
    oracle = OracleDrafter(drafter.dc, target, target.comm, dtype=torch.float32)
    oracle.load_state_dict(drafter.state_dict())
    s = Session(target, oracle, len(prompts), max_prompt=max(map(len, prompts)), max_new=max(limits),
                max_budget=budget)
    oracle.set_table(prompts, ref, miss)
    s.prefill(prompts, limits)
    stats = SpecStep(s, budget, kernels=kernels).run()  # triton: accept + commit of long paths
    assert s.outputs() == ref
    # a chain of depth L = 7 fits in any budget >= 7: whole blocks are accepted
    assert stats.mean_accepted > (3.0 if miss else 5.0)
    assert stats.steps < max(limits) // 2


def test_triton_tree_kernels_in_the_loop(models, reference):
    """The loop with kernels.ddtree's Triton kernels (interpreted on the CPU)."""
    _, target, drafter = models
    prompts, limits, ref = reference["c3"]
    s, _ = spec_run(target, drafter, prompts, limits, 6, kernels="triton")
    assert s.outputs() == ref


def test_finished_streams_stand_still(models, reference):
    """Stream 1 stops after 5 tokens while the others go on: its prefix, output and KV
    stay put, and a restore replays the same run."""
    _, target, drafter = models
    prompts, limits, ref = reference["c3"]
    s = Session(target, drafter, 3, max_prompt=11, max_new=NEW, max_budget=8)
    s.prefill(prompts, limits)
    step = SpecStep(s, 8, kernels="ref")
    while not bool(s.done[1]):
        step.step()
    plen, kv = int(s.prefix_len[1]), s.cache.ckv[:, 1, :int(s.prefix_len[1])].clone()
    step.run()
    assert int(s.prefix_len[1]) == plen and torch.equal(s.cache.ckv[:, 1, :plen], kv)
    assert s.outputs() == ref and len(ref[1]) == 5
    s.restore()
    step.run()
    assert s.outputs() == ref


def test_ar_rows_run_the_decode_step(models, monkeypatch):
    """e2e's AR rows (ARStep over a Session) and `ddbench decode` (Decoder) run one AR step,
    engine.decode.decode_forward: the same greedy tokens from the same prompts. ARStep names
    each forward's tokens to the routing hook (keyed draws) and clears the key after; the
    Decoder leaves the hook unkeyed, as before."""
    from ddbench.engine import decode, spec
    from ddbench.engine.routing import install, set_routing

    cfg, target, _ = models
    prompts = prompts_for(cfg, [6, 6, 6], seed=5)
    want = decode.Decoder(target, 3, 6 + NEW).generate(torch.tensor(prompts), NEW)
    calls = []
    monkeypatch.setattr(spec, "decode_forward", lambda *a: calls.append(a) or decode.decode_forward(*a))
    assert greedy(target, prompts, [NEW] * 3) == want.tolist()
    assert len(calls) >= NEW - 1 and all(a[-1] is None for a in calls)      # no routing installed

    r = install(target, "uniform", 0)
    seen = []
    forward = target.forward
    target.forward = lambda tok, pos, *a: seen.append((r.key, tok.clone(), pos.clone())) or forward(tok, pos, *a)
    try:
        s = Session(target, None, 3, max_prompt=6, max_new=4)
        s.routing = r
        s.prefill(prompts, 4)
        ARStep(s).run()
        assert r.key is None and seen and seen[0][1].shape[1] == 6            # prefill, then the steps
        rows = [p + o for p, o in zip(prompts, s.outputs())]
        for key, tok, pos in seen:                                            # the hash of the whole prefix
            assert key is not None and key.shape == tok.shape
            for b, j in zip(*torch.nonzero(pos < len(rows[0]) - 1, as_tuple=True)):
                p = int(pos[b, j])
                assert int(tok[b, j]) == rows[b][p] and int(key[b, j]) == prefix_hash(rows[b][:p + 1])
        seen.clear()
        decode.Decoder(target, 3, 6 + 4).generate(torch.tensor(prompts), 4)
        assert [k for k, _, _ in seen] == [None] * 4
    finally:
        del target.forward
        set_routing(target, None)


@pytest.fixture(scope="module")
def many_experts():
    """The tiny preset with 256 experts, top-8 (the tiny 16 are all touched by a few tokens)."""
    cfg = preset("tiny", n_experts=256, top_k=8)
    target = Transformer(cfg, dtype=torch.float32)
    init_random(target, 3)
    drafter = Drafter(drafter_config(cfg), target, target.comm, dtype=torch.float32)
    drafter.init_random(4)
    return cfg, target, drafter


def test_uniform_routing_draws_tree_nodes_independently(many_experts):
    """Uniform routing keyed by each token's whole prefix: a verify of c x (budget + 1) tokens
    touches the distinct experts of as many independent tokens (keyed by token and position,
    the nodes that share a drafted token at one depth drew the same experts: 154.5 of 226.4
    here), and DDTree stays lossless against AR under the same routing, with long paths
    accepted (an oracle drafter of that AR output)."""
    from ddbench.engine.routing import install, set_routing

    cfg, target, drafter = many_experts
    r = install(target, "uniform", 0)
    try:
        prompts = prompts_for(cfg, [12] * 4, seed=4)
        s = Session(target, drafter, 4, max_prompt=12, max_new=24, max_budget=16)
        s.routing = r
        s.prefill(prompts, 24)
        step = SpecStep(s, 16, acceptance=parse_acceptance("rank:dflash-k25-gsm8k-paper", drafter.dc.depth))
        r.reset()
        step.run()
        assert r.mean_touched(17) == pytest.approx(expected_experts_touched(4 * 17, 256, 8), rel=0.03)

        prompts = prompts_for(cfg, [4, 11, 6], seed=3)
        limits = [NEW, 5, NEW]
        ar = Session(target, None, 3, max_prompt=11, max_new=NEW)
        ar.routing = r
        ar.prefill(prompts, limits)
        ARStep(ar).run()
        ref = ar.outputs()
        oracle = OracleDrafter(drafter.dc, target, target.comm, dtype=torch.float32)
        oracle.load_state_dict(drafter.state_dict())
        s = Session(target, oracle, 3, max_prompt=11, max_new=NEW, max_budget=8)
        oracle.set_table(prompts, ref)
        s.routing = r
        s.prefill(prompts, limits)
        stats = SpecStep(s, 8).run()
        assert s.outputs() == ref and stats.mean_accepted > 5.0
    finally:
        set_routing(target, None)


def test_synthetic_acceptance_runs_real_shapes(models):
    cfg, target, drafter = models
    prompts = prompts_for(cfg, [5, 9], seed=9)
    acc = parse_acceptance("synthetic:4", drafter.dc.depth)
    torch.manual_seed(0)
    s, stats = spec_run(target, drafter, prompts, [30, 30], 10, acceptance=acc)
    assert stats.tokens == 58
    assert 2.3 < stats.mean_accepted < 6.0
    assert all(len(o) == 30 for o in s.outputs())


# --- acceptance maths -----------------------------------------------------------------

@pytest.mark.parametrize("tau,depth", [(1.0, 7), (3.0, 15), (6.0, 15), (9.0, 15), (16.0, 15)])
def test_tau_probs_hit_the_mean(tau, depth):
    probs = tau_probs(tau, depth)
    assert len(probs) == depth and abs(expected_tokens(probs) - tau) < 1e-6


def test_chain_draws_mean_and_rank0_walk():
    """A chain mode's rank draws (rank 0 with a_d, else a miss) give TAU tokens per step on
    a full chain; the matched path follows the rank-0 chain of a real tree, matches a
    Python walk, and is cut where the tree's chain ends."""
    depth, k, n = 7, 4, 4000
    acc_mode = parse_acceptance("synthetic:3.5", depth)
    logp, match = acc_mode.tables(depth, k)
    cdf = match.cumsum(-1).float()
    g = torch.Generator().manual_seed(0)
    ranks = draw_ranks(torch.rand(n, depth, generator=g), cdf)                  # 0 or k
    assert set(ranks.unique().tolist()) <= {0, k}
    want = 1 + (ranks == 0).long().cumprod(-1).sum(-1)
    assert abs(want.float().mean().item() - 3.5) < 0.1
    logp = logp.expand(3, depth, k).contiguous()
    ids = torch.randint(0, 100, (3, depth, k), generator=g)
    for budget in (3, 12, 40):
        tree = ddtree.build_tree_ref(logp, ids, budget)
        target = torch.tensor([[k] * depth, [0, 0, 0] + [k] * (depth - 3), [0] * depth])   # want 1, 4, depth + 1
        acc = matched_path(tree.parent.long(), tree.rank.long(), tree.depth.long(), target, depth)
        for b, w in enumerate((1, 4, depth + 1)):
            path, cur = [0], 0
            while len(path) < w:
                kids = [j for j in range(budget + 1) if tree.parent[b, j] == cur and tree.rank[b, j] == 0]
                if not kids:
                    break
                cur = kids[0]
                path.append(cur)
            assert acc[b].tolist() == path + [-1] * (depth + 1 - len(path))


def test_profile_files(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps([0.9, 0.8, 0.5]))
    assert read_profile(tmp_path / "p.json", 4) == (0.9, 0.8, 0.5, 0.0)
    (tmp_path / "p.csv").write_text("depth,accept_prob\n1,0.9\n2,0.7\n# done\n")
    assert read_profile(tmp_path / "p.csv", 2) == (0.9, 0.7)
    acc = parse_acceptance(f"profile:{tmp_path / 'p.json'}", 3)
    assert acc.mode == "profile" and abs(acc.tau - (1 + 0.9 + 0.72 + 0.36)) < 1e-9
    (tmp_path / "bad.json").write_text("[1.5]")
    for text in (f"profile:{tmp_path / 'bad.json'}", f"profile:{tmp_path / 'none.json'}", "synthetic:x",
                 "synthetic:30", "greedy"):
        with pytest.raises(ConfigError):
            parse_acceptance(text, 7)


def test_steady_counts_only_steps_with_every_stream_generating(models, reference):
    """c3 with limits (14, 5, 14): stream 1 is done after its 4 new tokens, so the steady
    window is the steps before that (each of the 3 streams gains 1 token an AR step), and
    the batch keeps stepping for the others."""
    _, target, drafter = models
    prompts, limits, _ = reference["c3"]
    s = Session(target, None, 3, max_prompt=11, max_new=NEW)
    s.prefill(prompts, limits)
    st = ARStep(s).run()
    assert st.steps == NEW - 1 and st.full_steps == 5 - 1
    assert st.full_accepted == 3 * st.full_steps and st.steady_accepted == 1.0
    assert st.full_step_us == pytest.approx(sum(st.step_us[:st.full_steps]))
    # a SpecStep run: the steady window is a strict prefix, at least one token a stream and step
    s2, sp = spec_run(target, drafter, prompts, limits, 6)
    assert 0 < sp.full_steps < sp.steps and sp.steady_accepted >= 1.0
    assert sp.full_accepted <= sp.accepted
