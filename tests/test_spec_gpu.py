"""The DDTree loop on a GPU (tiny preset): lossless with the native Triton tree kernels,
and the per-phase CUDA graphs replay exactly what the eager step computes."""
import pytest
import torch

from ddbench.engine.config import preset
from ddbench.engine.drafter import Drafter, drafter_config
from ddbench.engine.model import Transformer
from ddbench.engine.spec import ARStep, Session, SpecStep, parse_acceptance
from ddbench.engine.weights import init_random
from ddbench.kernels.select import KernelChoice

pytestmark = pytest.mark.gpu


def build(dtype, moe, attn, kernels=None):
    cfg = preset("tiny")
    target = Transformer(cfg, moe_backend=moe, attn_backend=attn, device="cuda", dtype=dtype, kernels=kernels)
    init_random(target, 3)
    drafter = Drafter(drafter_config(cfg), target, target.comm, device="cuda", dtype=dtype)
    drafter.init_random(4)
    return cfg, target, drafter


def prompts(cfg, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab, (n,), generator=g).tolist() for n in lens]


def decode(target, drafter, ps, limits, budget=None, graph=False, acceptance=None, routing=None):
    s = Session(target, drafter, len(ps), max_prompt=max(map(len, ps)), max_new=max(limits),
                max_budget=budget or 0)
    s.routing = routing
    s.prefill(ps, limits)
    step = ARStep(s) if budget is None else SpecStep(s, budget, acceptance=acceptance, kernels="triton")
    if graph:
        assert step.capture(), step.graph_error
    torch.manual_seed(0)
    stats = step.run()
    return s.outputs(), stats


@pytest.mark.parametrize("budget", [4, 32])
def test_lossless_on_gpu_fp32(budget):
    cfg, target, drafter = build(torch.float32, "torch", "torch")
    ps = prompts(cfg, [6, 13, 9])
    limits = [16, 7, 16]
    ref, _ = decode(target, None, ps, limits)
    got, _ = decode(target, drafter, ps, limits, budget)
    assert got == ref


@pytest.mark.parametrize("acc", ["real", "synthetic:4"])
def test_graphs_replay_the_eager_step(acc):
    """bf16 with the Triton MoE and attention: graph replays give the eager step's output."""
    cfg, target, drafter = build(torch.bfloat16, "triton", "triton")
    ps = prompts(cfg, [6, 13, 9], seed=1)
    limits = [20, 9, 20]
    a = parse_acceptance(acc, drafter.dc.depth)
    eager, st_e = decode(target, drafter, ps, limits, 16, graph=False, acceptance=a)
    graphed, st_g = decode(target, drafter, ps, limits, 16, graph=True, acceptance=a)
    assert st_g.cuda_graph and not st_e.cuda_graph
    if acc == "real":
        assert graphed == eager
        ar, _ = decode(target, None, ps, limits, graph=True)
        # AR steps have <= 4 rows, so their linears run kernels.skinny, which sums in another
        # order than the verify's cuBLAS: bf16 greedy paths then drift apart after a few tokens
        assert all(x[:3] == y[:3] for x, y in zip(ar, graphed)), "AR and tree verify differ at once"
        plain = build(torch.bfloat16, "triton", "triton", KernelChoice(skinny=0))[1]    # same weights
        ar, _ = decode(plain, None, ps, limits, graph=True)    # same GEMMs in both: they must agree
        same = sum(x == y for x, y in zip(ar, graphed))
        assert same >= 2, "bf16 tree verify and AR disagree on most streams"
    else:
        assert [len(o) for o in graphed] == limits and st_g.mean_accepted > 2.0


def test_ar_rows_and_decode_run_one_step():
    """e2e's AR rows (ARStep: a graph per phase) and `ddbench decode` (Decoder: a graph per
    step) run the one AR step, engine.decode.decode_forward: fp32, the same tokens."""
    from ddbench.engine.decode import Decoder

    cfg, target, _ = build(torch.float32, "triton", "triton")
    ps = prompts(cfg, [6, 6, 6], seed=3)
    ar, st = decode(target, None, ps, [10] * 3, graph=True)
    dec = Decoder(target, 3, 16, use_graph=True)
    want = dec.generate(torch.tensor(ps), 10)
    assert st.cuda_graph and dec.graph is not None
    assert ar == want.tolist()


def test_phase_timing_in_graphs():
    """Per-phase events between the step's graphs, and the verify split from a graph of the
    verify with event nodes (what `ddbench e2e` reports)."""
    cfg, target, drafter = build(torch.bfloat16, "triton", "triton")
    ps = prompts(cfg, [8, 8], seed=2)
    s = Session(target, drafter, 2, max_prompt=8, max_new=16, max_budget=16)
    s.prefill(ps, 16)
    step = SpecStep(s, 16, acceptance=parse_acceptance("synthetic:3", drafter.dc.depth), kernels="triton")
    assert step.capture(), step.graph_error
    eager = step.profile_verify()
    graphed = step.graph_verify_phases()
    for prof in (eager, graphed):
        assert prof.get("attention", 0) > 0 and prof.get("moe", 0) > 0
    s.restore()
    stats = step.run()
    assert stats.cuda_graph and stats.steps > 0
    assert all(stats.phase_us[p] > 0 for p in ("draft", "tree", "verify", "accept", "context"))
    assert stats.wall_us > 0.5 * stats.device_us


@pytest.mark.parametrize("spec", ["uniform", "overlap:0.5"])
def test_routing_in_graphs(spec):
    """The routing hook captures into the phase graphs: keyed uniform draws replay the
    eager output exactly (real acceptance), overlap runs; the expert counter fills."""
    from ddbench.engine.routing import install, set_routing

    cfg, target, drafter = build(torch.bfloat16, "triton", "triton")
    r = install(target, spec, 0)
    try:
        ps = prompts(cfg, [6, 13, 9], seed=2)
        limits = [12, 9, 12]
        a = parse_acceptance("real" if spec == "uniform" else "rank:dflash-k25-gsm8k-paper", drafter.dc.depth)
        eager, _ = decode(target, drafter, ps, limits, 8, graph=False, acceptance=a, routing=r)
        r.reset()
        graphed, st = decode(target, drafter, ps, limits, 8, graph=True, acceptance=a, routing=r)
        assert st.cuda_graph
        if spec == "uniform":
            assert graphed == eager
        assert cfg.top_k <= r.mean_touched(9) <= cfg.n_experts
    finally:
        set_routing(target, None)
