"""`ddbench e2e`: the DDTree speculative engine at concurrency N, beside AR and SGLang.

For each concurrency c: random prompts, one prefill (shared by every run at that c), then
plain greedy autoregressive decoding (AR) and DDTree speculative decoding at every
`--budget` x `--acceptance`, each from the same post-prefill state. One CSV row per run
(kind `e2e`).

How a run is timed (engine/spec.py has the loop):

- each step is five phases (draft, tree = top-K + build, verify, accept = greedy accept +
  KV commit + outputs, context = drafter context update); on a GPU each phase is one
  CUDA graph per (c, budget) and a CUDA event sits between phases, so every phase time is
  measured on the GPU timeline (launch gaps included). `step_us` = their sum per step.
  An AR row's step is two such phases: verify, the AR decode step `ddbench decode` times
  (`decode_forward` of engine/decode.py, one token per stream), and accept (outputs).
- the verify phase is split into attention / MoE / other by the proportions of the
  target's phases (`engine.phases.PhaseTimer`) in a separate CUDA graph of the verify
  with timing events as graph nodes (`verify_split_method` graph), or else of one eager
  verify after a GPU head start (eager), as `ddbench decode` does.
- `host_us` = wall-clock per step minus `step_us` (host time the GPU did not hide).
- `comm_us`: with `--simulate-rank`, the modelled all-reduce / all-gather time of one
  step (the stand-ins in the measured step do no communication); 0 at tp=1.
- `step_total_us` = step + host + comm; `output_tok_per_s` = new tokens / (steps x
  step_total): for a simulated rank this is the projected TP-n throughput of the fixed
  batch, which runs until its slowest stream is done (the last steps carry finished
  streams). `steady_tok_per_s` = c x `steady_accepted` / step_total over the
  `steady_steps` at which every stream still generates: the rate a server that refills
  finished streams keeps up, and what the cost model predicts.
- routing (`--routing`, engine/routing.py): `uniform` (default with random weights: each
  token's experts drawn uniformly after the router ran), `model` (the router's choice;
  default with a checkpoint) or `overlap:F`. `experts_measured` = mean distinct experts
  per MoE layer and forward of the timed run, counted on the device; `experts_uniform`
  the formula for independent uniform top-k of the same tokens.
- bytes floor: weights a step must read (dense, routed experts: the MEASURED distinct
  count, lm_head twice for spec, drafter) + KV and drafter context read, / the copy
  bandwidth measured in the run. `floor_ratio` = step_total / (floor + comm).
- `step_us_p20` / `_p80`: spread of the per-step device time (after a warm-up run when
  the step is not a CUDA graph).
- `--budget auto` (engine/cost_model.py): each phase's cost fitted by least squares over
  the measured grid, the budget with the best predicted tok/s per concurrency and drawn
  acceptance measured again (`budget_auto` True); `predicted_tok_per_s` (= c x
  `predicted_accepted` / `predicted_step_us`) beside measured; `steady_accepted_se` is the
  standard error of the drawn acceptance over the steady steps.

Acceptance: `real` (the true greedy walk), `synthetic:TAU`, `profile:FILE`, `rank:PROFILE`
(engine/spec.py, engine/acceptance.py); `expected_accepted` is the analytic mean tokens per
step of the built trees in the drawn modes. Every row carries `acceptance`; AR rows say
`none`. Real rows report `mismatches_tied` / `mismatches_real`: streams whose output left
AR's at a token chosen from an exact top-2 logit tie (bf16 breaks those differently in a
batch) or elsewhere.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from ddbench import UserError
from ddbench.engine.config import ConfigError

PHASE_COLS = ("draft", "tree", "verify_attention", "verify_moe", "verify_other", "accept", "comm", "host")


def parse_prompt_lens(text: str) -> list[int]:
    """'128' or '100,300' (cycled over streams) -> list of prompt lengths."""
    from ddbench.args import parse_int_list

    lens = parse_int_list(text, "--prompt-len")
    if min(lens) < 1:
        raise UserError("--prompt-len values must be >= 1")
    return lens


def verify_split(profile: dict, verify_us: float, real_comm: bool = False) -> dict:
    """Split the measured verify time by the profile's proportions: attention, MoE, other,
    and (real_comm: a DistComm run, whose collectives are timed) communication."""
    attn, moe = profile.get("attention", 0.0), profile.get("moe", 0.0)
    comm = profile.get("comm", 0.0) if real_comm else 0.0
    total = sum(v for k, v in profile.items() if k != "end") or 1.0
    return {"verify_attention": verify_us * attn / total, "verify_moe": verify_us * moe / total,
            "verify_comm": verify_us * comm / total,
            "verify_other": verify_us * (total - attn - moe - comm) / total}


def step_floor_bytes(model, drafter, c: int, budget: int, context: float, max_len: int,
                     experts: float | None = None) -> dict:
    """Bytes one step must read at least (budget 0: an AR step, no drafter); `experts`: the
    measured distinct experts per MoE layer (else the uniform-routing formula's)."""
    from ddbench.engine.decode import step_bytes

    cfg = model.cfg
    tokens = c * (budget + 1)
    b = step_bytes(model, tokens, 0.0)
    if experts is not None and b["experts_touched"]:
        b["weight_bytes"] = b["dense_bytes"] + b["routed_bytes"] * experts / b["experts_touched"]
        b["experts_touched"] = experts
    per_tok = cfg.kv_values_per_token * model.dtype.itemsize
    kv = c * (context + budget + 1) * per_tok
    draft = 0
    if budget > 0:
        dc = drafter.dc
        head = model.head.weight
        draft = (drafter.weight_bytes() + head.numel() * head.element_size()
                 + dc.n_layers * c * max_len * dc.n_local_kv_heads * dc.head_dim * 2 * drafter.ctx_k.element_size())
    return {"weight_bytes": b["weight_bytes"], "kv_bytes": kv, "draft_bytes": draft,
            "experts_touched": b["experts_touched"], "total": b["weight_bytes"] + kv + draft}


def _fmt(x, nd=2):
    return None if x is None else round(float(x), nd)


def measure_config(sess, stepper, label: str, base: dict, c: int, budget: int, acc, copy_bw, prompt_lens,
                   new_tokens: int, seed: int) -> dict:
    """Time the verify's phases (one eager step, then a graph of the verify when graphs are
    on), run the decode from the post-prefill state (after a warm-up run when the step is
    eager), and return the CSV row."""
    import numpy as np

    from ddbench.kernels.moe import expected_experts_touched

    comm = sess.model.comm
    ranks = getattr(stepper, "ranks", None)
    kept = ranks.counts.clone() if ranks is not None else None    # only the timed run's steps count
    sess.restore()
    if hasattr(comm, "reset"):
        comm.reset()
    prof = stepper.profile_verify()
    simulated, real_comm = getattr(comm, "simulated", False), comm.tp > 1 and not getattr(comm, "simulated", False)
    comm_us = comm.modelled_us if simulated else 0.0
    split_method = "eager"
    if stepper.graphs is not None:
        try:
            prof, split_method = stepper.graph_verify_phases(), "graph"
        except Exception as e:  # noqa: BLE001 - older torch or capture trouble: keep the eager split
            print(f"note: verify phases inside a CUDA graph failed ({type(e).__name__}: {e}); eager split")
    if stepper.graphs is None:            # eager (CPU): one short warm-up run first
        sess.restore()
        stepper.run(max_steps=1)
    sess.restore()
    routing = sess.routing
    expected = None
    if budget and acc.mode != "real":     # analytic E[tokens per step] of the trees built from this state
        stepper.step()
        expected = float(stepper.expected_tokens().mean())
        sess.restore()
    torch.manual_seed(seed)
    if routing is not None:
        routing.reset()
    if ranks is not None:
        ranks.counts.copy_(kept)
    st = stepper.run()
    experts = routing.mean_touched(budget + 1) if routing is not None else None
    p20, p80 = (np.percentile(st.step_us, [20, 80]).tolist() if st.step_us else (None, None))
    steps = max(st.steps, 1)
    ph = {k: v / steps for k, v in st.phase_us.items()}
    step_us = st.device_us / steps
    host_us = max(0.0, st.wall_us / steps - step_us)
    total_us = step_us + host_us + comm_us       # a real TP run's collectives are inside step_us
    split = verify_split(prof, ph["verify"], real_comm)
    if real_comm:
        comm_us = split["verify_comm"]             # measured, verify forward only
    context = sum(prompt_lens) / len(prompt_lens) + new_tokens / 2
    fb = step_floor_bytes(sess.model, sess.drafter, c, budget, context, sess.max_len, experts)
    floor = fb["total"] / (copy_bw * 1e3) if copy_bw else None
    tau = getattr(acc, "tau", None)
    return {
        **base, "label": label, "decoder": "ddtree" if budget else "ar",
        "acceptance": acc.label if budget else "none", "acceptance_mode": acc.mode if budget else "none",
        "tau_target": _fmt(tau, 3) if budget else None,
        "concurrency": c, "budget": budget, "budget_auto": False, "topk": getattr(stepper, "topk", 0),
        "routing": routing.label if routing is not None else "model",
        "expected_accepted": _fmt(expected, 3), "predicted_tok_per_s": None, "context": _fmt(context),
        "prompt_len": " ".join(map(str, sorted(set(prompt_lens)))), "new_tokens": new_tokens,
        "cuda_graph": st.cuda_graph, "graph_error": stepper.graph_error or "",
        "steps": st.steps, "tokens": st.tokens, "mean_accepted": _fmt(st.mean_accepted, 3),
        "step_us": _fmt(step_us), "step_us_p20": _fmt(p20), "step_us_p80": _fmt(p80),
        "host_us": _fmt(host_us), "comm_us": _fmt(comm_us),
        "comm_source": "modelled" if simulated else ("measured in verify" if real_comm else "none"),
        "step_total_us": _fmt(total_us),
        "steps_per_s": _fmt(1e6 / total_us), "output_tok_per_s": _fmt(st.tokens / (steps * total_us) * 1e6),
        "steady_tok_per_s": _fmt(c * st.steady_accepted / (st.full_step_us / st.full_steps + total_us - step_us) * 1e6)
        if st.full_steps else None,
        "steady_steps": st.full_steps, "steady_accepted": _fmt(st.steady_accepted, 3),
        "steady_accepted_se": _fmt(st.full_accepted_se, 3),
        "measured_tok_per_s": _fmt(st.tokens / st.wall_us * 1e6) if st.wall_us else None,
        "draft_us": _fmt(ph.get("draft", 0.0) + ph.get("context", 0.0)),
        "draft_forward_us": _fmt(ph.get("draft", 0.0)), "context_us": _fmt(ph.get("context", 0.0)),
        "tree_us": _fmt(ph.get("tree", 0.0)), "verify_us": _fmt(ph["verify"]),
        **{f"{k}_us": _fmt(v) for k, v in split.items() if k != "verify_comm"},
        "accept_us": _fmt(ph["accept"]), "verify_split_method": split_method,
        "weight_bytes": int(fb["weight_bytes"]), "kv_bytes": int(fb["kv_bytes"]), "draft_bytes": int(fb["draft_bytes"]),
        "experts_measured": _fmt(experts), "experts_uniform": _fmt(expected_experts_touched(
            c * (budget + 1), sess.model.cfg.n_experts, sess.model.cfg.top_k)),
        "copy_bw_gbps": _fmt(copy_bw),
        "floor_us": _fmt(floor), "floor_plus_comm_us": _fmt(floor + comm_us) if floor else None,
        "floor_ratio": _fmt(total_us / (floor + comm_us), 3) if floor else None,
    }


def run_concurrency(model, drafter, c: int, budgets: list[int], accs: list, prompt_lens: list[int],
                    new_tokens: int, topk: int | None, graph: bool, copy_bw, base: dict, seed: int,
                    on_row, kernels: str = "auto", errors: list | None = None, routing=None, ranks=None,
                    ar: bool = True) -> None:
    """Prefill c streams once, then AR (unless `ar` is False) and every budget x acceptance
    from that state. `routing`: the model's `engine.routing.Routing`; `ranks`: an
    `engine.acceptance.RankCounter` that real-acceptance runs add to.

    With an `errors` list, a budget whose run raises is reported (traceback on stderr, a
    line in `errors`) and the next budget runs; without one the exception propagates (a
    real TP run must fail on every rank alike)."""
    from ddbench.engine.spec import ARStep, Session, SpecStep

    g = torch.Generator().manual_seed(seed + c)
    lens = [prompt_lens[b % len(prompt_lens)] for b in range(c)]
    prompts = [torch.randint(0, model.cfg.vocab, (n,), generator=g).tolist() for n in lens]
    sess = Session(model, drafter, c, max_prompt=max(lens), max_new=new_tokens, max_budget=max(budgets))
    sess.routing = routing
    cuda = model.device.type == "cuda"
    t0 = time.perf_counter()
    sess.prefill(prompts, new_tokens)
    if cuda:
        torch.cuda.synchronize(model.device)
    prefill_s = time.perf_counter() - t0
    use_graph = graph and cuda and model.moe_backend != "torch"    # the torch MoE reference syncs
    base = {**base, "prefill_s": round(prefill_s, 3)}

    ar_out, ar_tied = [], []

    def go(stepper, budget, acc, label):
        if use_graph and stepper.graphs is None and stepper.graph_error is None:
            stepper.capture()
        row = measure_config(sess, stepper, label, base, c, budget, acc, copy_bw, lens, new_tokens, seed)
        out = sess.outputs()
        if not budget:
            ar_out[:], ar_tied[:] = out, sess.tie_flags()
        # lossless check: real acceptance must reproduce greedy decoding token for token
        real = bool(budget) and acc.mode == "real" and bool(ar_out)
        row["matches_ar"] = (out == ar_out) if real else None
        tied, other = mismatches(out, sess.tie_flags(), ar_out, ar_tied) if real else (None, None)
        row["mismatches_tied"], row["mismatches_real"] = tied, other
        row["first_tokens"] = " ".join(map(str, out[0][:8]))
        on_row(row)

    if ar:
        step = ARStep(sess)
        go(step, 0, None, "engine AR")
        del step
    for budget in budgets:
        real = [a for a in accs if a.mode == "real"]
        drawn = [a for a in accs if a.mode != "real"]
        for group in (real, drawn):
            if not group:
                continue
            step = None
            try:
                step = SpecStep(sess, budget, topk, group[0], kernels=kernels)
                if group[0].mode == "real":
                    step.ranks, step.tied_out = ranks, True
                for acc in group:
                    step.set_acceptance(acc)
                    go(step, budget, acc, f"engine DDTree {acc.label}")
            except Exception as e:  # noqa: BLE001 - keep measuring the other budgets, fail at the end
                if errors is None:
                    raise
                import traceback
                traceback.print_exc()
                errors.append(f"c={c} budget={budget} {'/'.join(a.label for a in group)}: {type(e).__name__}: {e}")
            del step
            if cuda:
                torch.cuda.empty_cache()


def mismatches(out, tied, ar_out, ar_tied) -> tuple[int, int]:
    """(streams whose output first leaves AR's at a token either run chose from an exact
    top-2 tie, streams that leave it elsewhere)."""
    at_tie = other = 0
    for o, t, a, at in zip(out, tied, ar_out, ar_tied):
        if o == a:
            continue
        i = next((j for j, (x, y) in enumerate(zip(o, a)) if x != y), min(len(o), len(a)))
        if (i < len(t) and t[i]) or (i < len(at) and at[i]):
            at_tie += 1
        else:
            other += 1
    return at_tie, other


def auto_budgets(rows: list[dict], accs: list, depth: int, topk: int | None, grid: list[int], on_row, measure,
                 say) -> None:
    """`--budget auto`: fit the cost model to the grid's DDTree rows, write the grid rows with
    their prediction, then per concurrency and drawn acceptance measure the budget with the
    best predicted tok/s (in the grid's range) and write it with its prediction."""
    from ddbench.engine.cost_model import CostModel

    spec = [r for r in rows if r["decoder"] == "ddtree" and r.get("experts_measured") is not None]
    if not spec:
        for r in rows:
            on_row(r)
        say("note: --budget auto needs measured DDTree rows with an expert count; nothing to fit")
        return
    model = CostModel.fit([{**r, "experts": r["experts_measured"],
                            **{f"{p}_us": r[f"{p}_us"] or 0.0 for p in PHASE_COLS}} for r in spec])
    k = topk or 16
    curves = {a.label: a.expected_curve(depth, k, max(grid)) for a in accs if a.mode != "real"}
    def prediction(c, b, label, context=None) -> dict:
        step = model.step_us(c, b, context=context, acceptance=label)
        e = curves[label][b]
        return {"predicted_tok_per_s": _fmt(c * e / step * 1e6), "predicted_step_us": _fmt(step),
                "predicted_accepted": _fmt(e, 3)}

    for r in rows:
        if r["decoder"] == "ddtree" and r["acceptance"] in curves:
            r.update(prediction(r["concurrency"], r["budget"], r["acceptance"], r["context"]))
        on_row(r)
    for c in sorted({r["concurrency"] for r in spec}):
        for acc in [a for a in accs if a.mode != "real"]:
            b, pred = model.best_budget(c, curves[acc.label], min(grid), max(grid), acceptance=acc.label)
            say(f"budget auto: c={c} {acc.label}: budget {b}, predicted {pred:.1f} tok/s")

            def put(row, b=b, label=acc.label, c=c):
                on_row({**row, "budget_auto": True, **prediction(c, b, label), "label": row["label"] + " (auto budget)"})
            measure(c, b, [acc], put)


def _rank_worker(rank: int, tp: int, port: int, report, kw: dict) -> None:
    """One process of a real TP run (see `ddbench.ranks`); every rank runs the same sequence
    (same seeds, so the same prompts, draws and decisions) and rank 0 reports the rows."""
    from ddbench.ranks import init_rank
    from ddbench.engine.build import build_engine
    from ddbench.engine.parallel import DistComm

    device = init_rank(rank, tp, port, kw["device"], 300)
    cfg = _config(kw["preset"], kw["checkpoint"], tp, rank, kw["overrides"])
    model, drafter, used = build_engine(cfg, DistComm(), kw["checkpoint"], kw["moe"], kw["attn"], kw["seed"],
                                        device, kw["init"], kw["kernel_choice"])
    from ddbench.engine.routing import install

    routing = install(model, kw["routing"], kw["seed"])
    copy_bw = None
    if device.type == "cuda":
        from ddbench.timing import copy_bandwidth_gbps
        copy_bw = copy_bandwidth_gbps(device)
    for c in kw["concurrency"]:
        run_concurrency(model, drafter, c, kw["budgets"], kw["accs"], kw["lens"], kw["new_tokens"], kw["topk"],
                        kw["graph"], copy_bw, {**kw["base"], "init": used}, kw["seed"], report, routing=routing)


def _config(preset: str, checkpoint, tp: int, rank: int, overrides: dict):
    from ddbench.engine.config import preset as make_preset

    if checkpoint is not None:
        from ddbench.engine.checkpoint import read_config
        return read_config(checkpoint, tp, rank)
    return make_preset(preset, tp=tp, rank=rank, **overrides)


def baseline_rows(paths=(Path("results/baseline"),)) -> list[dict]:
    """SGLang (or other) baseline summary rows (kind 'baseline') found under `paths`."""
    from ddbench.results import read_results

    rows = []
    for p in paths:
        if not Path(p).exists():
            continue
        import pandas as pd

        for csv_path, meta in read_results([p]):
            if meta.get("kind") != "baseline":
                continue
            try:
                df = pd.read_csv(csv_path)
            except (ValueError, OSError):
                continue
            for _, r in df.iterrows():
                if str(r.get("output_tok_per_s")) not in ("", "nan"):
                    rows.append({"label": str(r.get("label", meta.get("label", "baseline"))),
                                 "concurrency": int(r["concurrency"]),
                                 "output_tok_per_s": float(r["output_tok_per_s"])})
    return rows


def print_table(console, rows: list[dict], baseline: list[dict]) -> None:
    """The run's rows (and the SGLang rows beside them on a GPU) fitted to the terminal: the
    key columns always show, the phase columns while they fit; every column is in the CSV."""
    from ddbench.table import print_table as fit

    toy = any(str(r.get("device", "")).startswith("cpu") for r in rows)
    ar = {r["concurrency"]: r.get("steady_tok_per_s") for r in rows if r["decoder"] == "ar"}
    out = []
    for c in sorted({r["concurrency"] for r in rows}):
        for r in [r for r in rows if r["concurrency"] == c]:
            ok = {True: "yes", False: "NO", None: "-"}[r.get("matches_ar")]
            if r.get("matches_ar") is False:
                ok += f" ({r.get('mismatches_tied')} tie/{r.get('mismatches_real')} real)"
            out.append({"c": c, "decoder": r["decoder"],
                        "budget": str(r["budget"] or "-") + (" auto" if r.get("budget_auto") else ""),
                        "acceptance": r["acceptance"], "tok/s": r["output_tok_per_s"],
                        "steady": r.get("steady_tok_per_s"),
                        "x AR": r["steady_tok_per_s"] / ar[c] if ar.get(c) and r.get("steady_tok_per_s") else None,
                        "acc len": r["mean_accepted"], "pred": r.get("predicted_tok_per_s"),
                        "experts": r.get("experts_measured"), "lossless": ok,
                        "total us": r["step_total_us"], "x floor": r["floor_ratio"],
                        **{p: r[f"{p}_us"] for p in PHASE_COLS}, "graph": r["cuda_graph"]})
        out += [{"c": c, "decoder": "baseline", "acceptance": _short(b["label"]), "tok/s": b["output_tok_per_s"]}
                for b in baseline if b["concurrency"] == c]
    long = [lb for lb in dict.fromkeys(b["label"] for b in baseline) if _short(lb) != lb]
    fit(out, key=("c", "decoder", "budget", "acceptance", "tok/s", "steady", "x AR"), console=console,
        title=("CPU TOY RUN (tiny model, host timings: not comparable with GPU numbers) " if toy else "")
        + "ddbench e2e: tok/s projected (step + host (+ modelled comm when simulated)) for the batch "
          "until its last stream is done; steady = while all c streams generate (a server refilling "
          "streams; pred and x AR are steady); acc len = mean accepted; experts = measured distinct "
          "per MoE layer; phases in us" + "".join(f"; baseline {_short(lb)!r} = {lb}" for lb in long))


BASELINE_LABEL = 24   # the most characters of a baseline label in the table's acceptance column


def _short(label: str) -> str:
    """A baseline label cut to BASELINE_LABEL characters, so that a long one (the SGLang
    reference's) does not widen the key columns past an 80-column terminal; the title then
    gives it in full."""
    from ddbench.table import clip

    return clip(label, BASELINE_LABEL)


AUTO_GRID = [8, 32, 128]      # --budget auto alone: the fit grid
# no --budget: on a GPU the fit grid and the best predicted budget (auto); on a CPU two budgets
GPU_DEFAULTS = dict(concurrency=[1, 10], budgets=AUTO_GRID, auto=True, new_tokens=64)
CPU_DEFAULTS = dict(concurrency=[1, 2], budgets=[4, 16], auto=False, new_tokens=8)    # the tiny preset: seconds
# no --acceptance with random weights (whose drafter accepts nothing real): two named rank
# profiles that bracket the published figures (DFlash's drafter for K2.5 on its best task
# with the DDTree paper's tree gain, on its worst task with a small tree gain); with a
# checkpoint the true greedy walk
DEFAULT_ACCEPTANCE = ["rank:dflash-k25-gsm8k-paper", "rank:dflash-k25-mtbench-small"]


def default_acceptance(acceptance: list[str] | None, checkpoint) -> list[str]:
    """`--acceptance` unset: `real` with a checkpoint, else DEFAULT_ACCEPTANCE."""
    if acceptance is not None:
        return acceptance
    return ["real"] if checkpoint is not None else list(DEFAULT_ACCEPTANCE)


def parse_budgets(text: str | None) -> tuple[list[int] | None, bool]:
    """'16,32' | '8,32,auto' | 'auto' -> (budgets or None, auto)."""
    from ddbench.args import parse_int_list

    if text is None:
        return None, False
    parts = [p.strip() for p in text.split(",") if p.strip()]
    auto = "auto" in parts
    nums = ",".join(p for p in parts if p != "auto")
    return (parse_int_list(nums, "--budget") if nums else None), auto


def resolve_layout(cfg_for, tp: int | None, simulate_rank: int | None, checkpoint, device, n_streams: int,
                   max_len: int, say) -> tuple[int, int | None]:
    """--tp unset: tp=1 where the model fits, else one rank of TP-8 (said in one line). An
    explicit layout that cannot fit fails here, before anything is allocated."""
    from ddbench.engine.build import check_fits

    if tp is None:
        tp = 1
        if device.type == "cuda" and checkpoint is None and simulate_rank is None:
            try:
                check_fits(cfg_for(1, 0), device, n_streams, max_len)
            except ConfigError:
                say("note: the model does not fit on this device at tp=1, so one rank of TP-8 "
                    "(--tp 8 --simulate-rank 0; pass --tp to choose)")
                return 8, 0
    return tp, simulate_rank


def run(*, preset: str | None, tp: int | None, simulate_rank: int | None, gpus: int | None,
        concurrency: list[int] | None, budgets: list[int] | None, acceptance: list[str] | None, prompt_len: str,
        new_tokens: int | None, checkpoint: Path | None, allreduce_model: str | None, moe_backend: str,
        attn_backend: str, graph: bool, init: str, topk: int | None, seed: int, out: Path,
        override: list[str] | None, baseline: Path = Path("results/baseline"), name: str | None = None,
        kernel_choice=None, routing: str | None = None, budget_auto: bool = False,
        save_profile: Path | None = None) -> Path:
    from rich.console import Console
    from rich.progress import Progress

    from ddbench.engine.build import build_engine, kernel_record, pick_backends
    from ddbench.engine.comm_model import predictor as allreduce_predictor
    from ddbench.kernels.select import KernelChoice, resolve
    from ddbench.ranks import check_layout
    from ddbench.results import ResultWriter, run_metadata
    from ddbench.engine.config import parse_overrides
    from ddbench.engine.drafter import drafter_config
    from ddbench.engine.parallel import LocalComm, SimComm
    from ddbench.engine.spec import parse_acceptance

    from ddbench.engine.acceptance import RankCounter, save_profile as write_profile
    from ddbench.engine.routing import default_routing, install, parse_routing

    console = Console()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    defaults = GPU_DEFAULTS if cuda else CPU_DEFAULTS
    concurrency = concurrency or defaults["concurrency"]
    if budgets is None:
        budgets = AUTO_GRID if budget_auto else defaults["budgets"]
        budget_auto = budget_auto or defaults["auto"]
    acceptance = default_acceptance(acceptance, checkpoint)
    new_tokens = new_tokens if new_tokens is not None else defaults["new_tokens"]
    routing = default_routing(routing, checkpoint)
    parse_routing(routing)
    if not cuda:     # CPU timings: a fixed thread count
        torch.set_num_threads(min(4, os.cpu_count() or 1))
    if preset is None:
        preset = "k2.6" if cuda else "tiny"
        if not cuda and checkpoint is None:
            console.print("note: no GPU, so the tiny preset and a short run (pass --preset etc. to choose); "
                          "CPU numbers are a toy, not comparable with a GPU service")
    overrides = parse_overrides(override)
    max_len = max(parse_prompt_lens(prompt_len)) + new_tokens + 2 * max(budgets) + 64   # Session's, rounded up
    if tp is None:
        tp, simulate_rank = resolve_layout(lambda t, r: _config(preset, checkpoint, t, r, overrides), tp,
                                           simulate_rank, checkpoint, device, max(concurrency), max_len,
                                           console.print)
    distributed = check_layout(tp, gpus, simulate_rank, cuda)
    if new_tokens < 2:
        raise UserError("--new-tokens must be >= 2")
    if any(c < 1 for c in concurrency):
        raise UserError("--concurrency values must be >= 1")
    if any(not 1 <= b <= 1024 for b in budgets):
        raise UserError("--budget values must be in 1..1024")
    if topk is not None and topk < 1:
        raise UserError("--topk must be >= 1")
    if init not in ("auto", "exact", "shard"):
        raise UserError(f"--init {init!r}: choose auto, exact or shard")
    if checkpoint is not None and not Path(checkpoint).is_dir():
        raise UserError(f"--checkpoint {checkpoint}: no such directory")
    lens = parse_prompt_lens(prompt_len)
    rank = simulate_rank or 0
    cfg = _config(preset, checkpoint, tp, rank, overrides)
    if not distributed:          # an explicit layout that cannot fit fails before allocating
        from ddbench.engine.build import check_fits
        check_fits(cfg, device, max(concurrency), max_len)
    dc = drafter_config(cfg)
    accs = [parse_acceptance(a.strip(), dc.depth) for a in acceptance if a.strip()]
    if not accs:
        raise UserError("--acceptance: give at least one of real, synthetic:TAU, profile:FILE, rank:PROFILE")
    if save_profile is not None and not any(a.mode == "real" for a in accs):
        raise UserError("--save-profile records real acceptance: add 'real' to --acceptance")
    moe, attn = pick_backends(device, moe_backend, attn_backend)
    kernel_choice = kernel_choice or KernelChoice()
    predict, model_desc = (None, None)
    if tp > 1 and not distributed:
        predict, model_desc = allreduce_predictor(allreduce_model, tp)
    mode = "distributed" if distributed else ("simulated" if tp > 1 else "single")
    base = {"preset": cfg.name, "tp": tp, "rank": "all" if distributed else rank, "mode": mode, "moe_backend": moe, "attn_backend": attn,
            "kernels": str(kernel_choice), "device": str(device), "routing": routing, "checkpoint": str(checkpoint) if checkpoint else "",
            "drafter": f"{dc.n_layers}L {dc.n_heads}q/{dc.n_kv_heads}kv block {dc.block}"}
    meta = run_metadata("e2e", preset=cfg.name, seed=seed, tp=tp, simulate_rank=simulate_rank, mode=mode,
                        allreduce_model=model_desc, config=cfg.to_dict(), drafter=dict(vars(dc)),
                        moe_backend=moe, attn_backend=attn, kernels=resolve(kernel_choice, device),
                        acceptance=[a.label for a in accs], routing=routing,
                        torch_threads=torch.get_num_threads(), budget_auto=budget_auto,
                        method=__doc__.split("How a run is timed (engine/spec.py has the loop):")[1].strip())
    n_rows = len(concurrency) * (1 + len(budgets) * len(accs))
    errors: list[str] = []
    with ResultWriter(out, "e2e", meta, name=name) as writer, Progress(console=console) as progress:
        task = progress.add_task(f"init {cfg.name} tp={tp} {mode}", total=n_rows)

        def on_row(row):
            writer.write(row)
            progress.advance(task)
        if distributed:
            kw = dict(device=device.type, preset=preset, overrides=overrides, checkpoint=checkpoint, moe=moe,
                      attn=attn, kernel_choice=kernel_choice, seed=seed, init=init, concurrency=concurrency,
                      budgets=budgets, accs=accs,
                      lens=lens, new_tokens=new_tokens, topk=topk, graph=graph, base=base, routing=routing)
            progress.update(task, description=f"e2e {cfg.name} tp={tp} distributed ({tp} processes)")
            from ddbench.ranks import run_ranks

            run_ranks(_rank_worker, tp, kw, on_row, "e2e")
        else:
            comm = SimComm(tp, rank, predict) if tp > 1 else LocalComm()
            t0 = time.perf_counter()
            try:
                model, drafter, used = build_engine(cfg, comm, checkpoint, moe, attn, seed, device, init,
                                                    kernel_choice)
            except torch.cuda.OutOfMemoryError as e:
                raise UserError(f"out of GPU memory building {cfg.name} tp={tp} rank {rank}: {e}") from None
            writer.meta.update(init=used, init_s=round(time.perf_counter() - t0, 2),
                               drafter_weight_bytes=drafter.weight_bytes(),
                               kernels=kernel_record(model, [c * (b + 1) for c in concurrency for b in [0, *budgets]]))
            copy_bw = None
            if cuda:
                from ddbench.timing import copy_bandwidth_gbps
                copy_bw = copy_bandwidth_gbps(device)
                writer.meta["gpu_mem_allocated_gib"] = round(torch.cuda.memory_allocated(device) / 2**30, 2)
            route = install(model, routing, seed)
            ranks = RankCounter(dc.depth, device) if save_profile is not None else None
            held: list[dict] = []          # --budget auto: grid rows wait for their prediction
            try:
                for c in concurrency:
                    progress.update(task, description=f"e2e {cfg.name} tp={tp} c={c}")
                    try:
                        run_concurrency(model, drafter, c, budgets, accs, lens, new_tokens, topk, graph, copy_bw,
                                        {**base, "init": used}, seed, held.append if budget_auto else on_row,
                                        errors=errors, routing=route, ranks=ranks)
                    except torch.cuda.OutOfMemoryError as e:
                        raise UserError(f"out of GPU memory at concurrency {c}: {e}") from None
            except BaseException:
                for r in held:          # stopped before the fit: the measured grid rows are kept
                    on_row(r)
                raise
            if budget_auto:
                auto_budgets(held, accs, dc.depth, topk, budgets, on_row, lambda c, b, accs_c, on: run_concurrency(
                    model, drafter, c, [b], accs_c, lens, new_tokens, topk, graph, copy_bw,
                    {**base, "init": used}, seed, on, errors=errors, routing=route, ar=False), console.print)
            if ranks is not None:
                prof = write_profile(save_profile, ranks.counts,
                                     f"measured by ddbench e2e --acceptance real: {cfg.name} tp={tp}, drafter "
                                     f"{base['drafter']}, init {used}, concurrency {concurrency}, budgets {budgets}")
                writer.meta["saved_profile"] = str(save_profile)
                console.print(f"wrote rank profile {save_profile} ({prof.params['observations']} observations)")
            if cuda:
                writer.meta["gpu_mem_peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        writer.meta["errors"] = errors
    print_table(console, writer.rows, baseline_rows([baseline]) if cuda else [])
    for line in model_check(writer.rows):
        console.print(line)
    console.print(f"wrote {writer.path}")
    if errors:
        for e in errors:
            console.print(f"FAILED {e}", style="red")
        raise SystemExit(1)
    return writer.path


def model_check(rows: list[dict], tol: float = 0.10) -> list[str]:
    """The cost model against the measured rows, per concurrency: its step time, its tok/s
    against the steady rate, and for rows off by more than `tol` how far the drawn acceptance
    was from its expectation (in standard errors of the run's steps: a short run's sampling, not
    the model's error); then each `--budget auto` row against the best measured budget of its
    concurrency and acceptance (steady tok/s)."""
    def tps(r):
        return r.get("steady_tok_per_s")
    spec = [r for r in rows if r["decoder"] == "ddtree" and tps(r)]
    out = []
    for c in sorted({r["concurrency"] for r in spec}):
        pr = [r for r in spec if r["concurrency"] == c and r.get("predicted_tok_per_s")]
        if pr:
            err = {id(r): r["predicted_tok_per_s"] / tps(r) - 1 for r in pr}
            w = max(pr, key=lambda r: abs(err[id(r)]))
            line = (f"cost model, c={c}: tok/s vs steady worst {err[id(w)]:+.1%} ({w['acceptance']} budget "
                    f"{w['budget']}), {sum(abs(e) <= tol for e in err.values())} of {len(pr)} rows within {tol:.0%}")
            st = [r for r in pr if r.get("predicted_step_us")]
            if st:
                ws = max(st, key=lambda r: abs(r["predicted_step_us"] / r["step_total_us"] - 1))
                line += f"; step time worst {ws['predicted_step_us'] / ws['step_total_us'] - 1:+.1%}"
            out.append(line)
            off = [r for r in pr if abs(err[id(r)]) > tol and r.get("predicted_accepted") and r.get("steady_accepted_se")]
            if off:
                z = [(r["predicted_accepted"] - r["steady_accepted"]) / r["steady_accepted_se"] for r in off]
                out.append(f"  rows off by more than {tol:.0%}: drawn acceptance {min(z):.1f} to {max(z):.1f} standard "
                           f"errors below its expectation ({sum(v > 2 for v in z)} of {len(off)} beyond 2)")
        for a in [r for r in spec if r["concurrency"] == c and r.get("budget_auto")]:
            peers = [r for r in spec if r["concurrency"] == c and r["acceptance"] == a["acceptance"]]
            best = max(peers, key=tps)
            out.append(f"budget auto, c={c} {a['acceptance']}: budget {a['budget']} {tps(a):.0f} tok/s, best measured "
                       f"budget {best['budget']} {tps(best):.0f} ({tps(a) / tps(best) - 1:+.1%})")
    return out


TARGETS = {1: 700.0, 10: 2000.0}      # issue 10: projected TP-8 tok/s at TAU = 6
FLOOR_TARGET = 1.3


def summary(paths) -> None:
    """Print, per concurrency: AR, the best DDTree budget per acceptance, and the issue's
    targets (TAU=6: >= 700 tok/s at c=1, >= 2000 at c=10; step <= 1.3x floor + comm)."""
    import pandas as pd

    df = pd.concat([pd.read_csv(p) for p in paths], ignore_index=True)
    for c, g in df.groupby("concurrency"):
        ar = g[g.decoder == "ar"]
        if len(ar):
            r = ar.iloc[0]
            print(f"c={c:<3} AR: {r.output_tok_per_s:8.1f} tok/s  step {r.step_total_us:8.0f} us "
                  f"(comm {r.comm_us:.0f})  x floor {r.floor_ratio}  graph={r.cuda_graph}")
        for acc, h in g[g.decoder == "ddtree"].groupby("acceptance"):
            best = h.loc[h.output_tok_per_s.idxmax()]
            line = (f"c={c:<3} {acc:<14} best budget {int(best.budget):4d}: {best.output_tok_per_s:8.1f} tok/s, "
                    f"acc len {best.mean_accepted:.2f}, step {best.step_total_us:8.0f} us, x floor {best.floor_ratio}, "
                    f"graph={best.cuda_graph}"
                    + (f", lossless vs AR: {bool(h.matches_ar.eq(True).all())}" if acc == "real" else "")
                    + "; by budget: "
                    + " ".join(f"{int(b)}:{t:.0f}" for b, t in zip(h.budget, h.output_tok_per_s)))
            print(line)
            if acc == "synthetic:6" and int(c) in TARGETS:
                ok = best.output_tok_per_s >= TARGETS[int(c)]
                fl = best.floor_ratio
                print(f"   target c={c} TAU=6: {best.output_tok_per_s:.0f} vs >= {TARGETS[int(c)]:.0f} tok/s -> "
                      f"{'MET' if ok else 'MISSED'}; step / (floor + comm) = {fl} vs <= {FLOOR_TARGET} -> "
                      f"{'MET' if fl == fl and fl is not None and fl <= FLOOR_TARGET else 'MISSED'}")
