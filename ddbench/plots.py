"""The plots of `ddbench report`, one function per CLI command.

Each takes `runs`, a list of `(Run, DataFrame)` (the latest run of the command, or the runs
chosen with `--runs`), `labels` ({run name: what differs between the runs}), the output
folder and format, and returns `[(title, path)]`. Every series is drawn once with one
legend entry; titles name the run (file, date, GPU) when one run is drawn.
"""
from __future__ import annotations

import itertools
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
matplotlib.rcParams.update({"axes.titlesize": 9, "figure.titlesize": 10})  # two-line titles naming runs

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from ddbench.table import clip  # noqa: E402

# the per-phase columns of a step (e2e) and of a decode step; absent ones are skipped
E2E_PHASES = ("draft", "tree", "verify_attention", "verify_moe", "verify_other", "accept", "comm", "host")
DECODE_PHASES = ("attention", "moe", "mlp", "lm_head", "other", "comm")
MAX_LEGEND = 12


def num(df: pd.DataFrame, col: str) -> pd.Series:
    if col not in df:
        return pd.Series(np.nan, index=df.index)
    return pd.to_numeric(df[col], errors="coerce")


def first_col(df: pd.DataFrame, *names: str) -> str | None:
    """The first of `names` that is a column of df with any value in it."""
    for n in names:
        if n in df and df[n].notna().any():
            return n
    return None


def truthy(s: pd.Series) -> pd.Series:
    return s.astype(str).str.lower().isin(("true", "1", "1.0"))


def save(fig, out: Path, name: str, fmt: str) -> Path:
    """Save a figure atomically as out/name.fmt and close it."""
    path = Path(out) / f"{name}.{fmt}"
    tmp = path.with_name(f".{path.name}.partial.{fmt}")
    if fig.get_layout_engine() is None:  # figures with a legend outside their panels lay out as they go
        fig.tight_layout()
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)
    return path


def run_title(runs, labels) -> str:
    """'<file>, <date>, <gpu>' for one run; 'n runs' otherwise."""
    rs = [r for r, _ in runs]
    if len(rs) > 3:
        return f"{len(rs)} runs"
    bad = ", INCOMPLETE" if any(r.incomplete for r in rs) else ""
    dates = sorted(r.started for r in rs if r.started)
    when = "undated"
    if dates:
        when = dates[0].strftime("%Y-%m-%d %H:%M")
        if dates[-1] != dates[0]:
            when += "-" + dates[-1].strftime("%H:%M" if dates[-1].date() == dates[0].date() else "%Y-%m-%d %H:%M")
        when += " UTC"
    return f"{', '.join(r.name for r in rs)} ({when}, {rs[0].gpu}{bad})"


def run_label(run, labels, runs) -> str:
    """'' when one run is drawn (the title names it), else what sets it apart."""
    if len(runs) == 1:
        return ""
    lab = labels.get(run.name, run.name)
    return clip(lab, 60)


def _put_legend(owner, handles, names, **kw):
    """`owner.legend` (an Axes or a Figure) of at most MAX_LEGEND entries, saying in red how many
    were left out rather than leave lines unexplained."""
    if handles:
        owner.legend(handles[:MAX_LEGEND], names[:MAX_LEGEND], fontsize=7, **kw)
    if len(handles) > MAX_LEGEND:
        where = owner.transAxes if hasattr(owner, "transAxes") else owner.transFigure
        owner.text(0.01, 0.01, f"{len(handles) - MAX_LEGEND} more series not in the legend: choose fewer with --runs",
                   transform=where, fontsize=7, color="red")


def _legend(ax, outside: bool = False, **kw):
    if outside:
        kw.update(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    _put_legend(ax, *ax.get_legend_handles_labels(), **kw)


def _fig_legend(fig, axes):
    """One legend below a row of panels that draw the same series (a constrained-layout figure),
    each name once, instead of a legend in every panel over its data."""
    seen = {}
    for ax in axes:
        for handle, name in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(name, handle)
    _put_legend(fig, list(seen.values()), list(seen), loc="outside lower center",
                ncol=min(3, max(len(seen), 1)))


def _wrap(name: str, width: int = 12) -> str:
    """A long series name over lines of about `width` characters, broken after '-' or ':'
    ('rank:dflash-k25-gsm8k-paper' -> 'rank:dflash-', 'k25-gsm8k-', 'paper'), for tick labels."""
    lines = [""]
    for part in re.split(r"(?<=[-:])", name):
        if lines[-1] and len(lines[-1]) + len(part) > width:
            lines.append("")
        lines[-1] += part
    return "\n".join(lines)


def _bytes(v, _pos=None) -> str:
    for unit in ("B", "K", "M", "G"):
        if v < 1024 or unit == "G":
            return f"{v:g}{unit}"
        v /= 1024
    return f"{v:g}"


def _log2_x(ax, sizes: bool = False):
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(LogLocator(base=2, numticks=12))
    ax.xaxis.set_major_formatter(FuncFormatter(_bytes if sizes else (lambda v, _pos=None: f"{v:g}")))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _join(*parts) -> str:
    return " ".join(p for p in parts if p)


# ----------------------------------------------------------------------------- moe-sweep
def moe_sweep(runs, labels, out, fmt):
    """Layer time vs T with the bytes and compute floors; % of copy bandwidth vs T."""
    curves = []  # (label, df sorted by tokens, floors by tokens)
    copies = set()
    for run, df in runs:
        if "stage" not in df or df.empty:
            continue
        lay = df[df["stage"] == "layer"].copy()
        for col in ("tokens", "time_us", "pct_of_copy_bw", "floor_bytes_us", "floor_compute_us", "copy_gbps"):
            lay[col] = num(lay, col)
        if "cuda_graph" in lay and truthy(lay["cuda_graph"]).any():
            lay = lay[truthy(lay["cuda_graph"])]
        floors = lay.groupby("tokens")[["floor_bytes_us", "floor_compute_us"]].min().sort_index()
        copies |= set(lay["copy_gbps"].dropna().round())
        rl = run_label(run, labels, runs)
        for (be, rt), g in lay.groupby(["backend", "routing"]):
            curves.append((_join(rl, f"{be} {rt}"), g.sort_values("tokens"), floors, rl))
    if not curves:
        return []
    tps = sorted({str(r.meta.get("tp", "")) for r, _ in runs})
    where = run_title(runs, labels)
    made = []
    fig, ax = plt.subplots(figsize=(8.5 if len(runs) > 1 else 7.5, 4.8))
    floored = set()
    for lab, g, floors, rl in curves:
        line, = ax.plot(g["tokens"], g["time_us"], "o-", ms=3, label=lab or "measured")
        if rl not in floored:  # each run's floors once, in its first curve's colour
            floored.add(rl)
            c = line.get_color() if len(runs) > 1 else "k"
            ax.plot(floors.index, floors["floor_bytes_us"], "--", color=c, lw=1,
                    label=_join(rl, "bytes floor (measured copy BW)"))
            ax.plot(floors.index, floors["floor_compute_us"], ":", color=c, lw=1,
                    label=_join(rl, "compute floor (bf16 GEMM)"))
    ax.set(xscale="log", yscale="log", xlabel="tokens T", ylabel="time per MoE layer (us)",
           title=f"MoE layer time, TP-{'/'.join(tps)}\n{where}")
    _log2_x(ax)
    ax.grid(True, which="both", alpha=0.3)
    _legend(ax)
    made.append(("MoE layer time vs tokens", save(fig, out, "moe_sweep_time", fmt)))

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for lab, g, _, _ in curves:
        ax.plot(g["tokens"], g["pct_of_copy_bw"], "o-", ms=3, label=lab or "measured")
    copy = f" ({'/'.join(f'{c:.0f}' for c in sorted(copies))} GB/s)" if copies else ""
    ax.axhline(100, color="k", ls="--", lw=1, label=f"measured copy bandwidth{copy}")
    ax.set(xlabel="tokens T", ylabel="% of copy bandwidth (bytes floor / time)", ylim=(0, 110),
           title=f"MoE layer: % of copy bandwidth, TP-{'/'.join(tps)}\n{where}")
    _log2_x(ax)
    ax.grid(True, which="both", alpha=0.3)
    _legend(ax)
    made.append(("MoE layer % of copy bandwidth vs tokens", save(fig, out, "moe_sweep_pct_copy", fmt)))
    return made


# ----------------------------------------------------------------------------- allreduce
def allreduce(runs, labels, out, fmt):
    """busbw vs size for world size > 1 only; time vs size with the latency + bandwidth model."""
    from ddbench.allreduce import fit_model
    from ddbench import UserError

    made = []
    series = []
    for run, df in runs:
        if "mode" not in df or df.empty:
            continue
        for mode, d in df.groupby("mode"):
            d = d.assign(**{c: num(d, c) for c in ("size_bytes", "time_us", "time_us_p20", "time_us_p80",
                                                      "busbw_gbps", "wrong", "n_ranks")})
            d = d.sort_values("size_bytes")
            n = int(d["n_ranks"].iloc[0])
            lab = _join(run_label(run, labels, runs), f"{mode}, {n} GPU{'s' if n > 1 else ''}")
            series.append((lab, n, d))
    if not series:
        return []
    where = run_title(runs, labels)
    multi = [s for s in series if s[1] > 1]
    if multi:
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        for lab, n, d in multi:
            ax.plot(d["size_bytes"], d["busbw_gbps"], "o-", ms=3, label=lab)
        ax.set(xlabel="message size (bytes)", ylabel="bus bandwidth (GB/s)",
               title=f"All-reduce bus bandwidth (algbw x 2(n-1)/n)\n{where}")
        _log2_x(ax, sizes=True)
        ax.grid(True, which="both", alpha=0.3)
        _legend(ax)
        made.append(("All-reduce bus bandwidth vs size", save(fig, out, "allreduce_busbw", fmt)))
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for lab, n, d in series:
        line, = ax.plot(d["size_bytes"], d["time_us"], "o", ms=3, label=lab)
        ax.fill_between(d["size_bytes"], d["time_us_p20"], d["time_us_p80"], color=line.get_color(), alpha=0.2)
        ok = d[d["wrong"] == 0]
        try:
            m = fit_model(zip(ok["size_bytes"], ok["time_us"]), n)
        except (UserError, ValueError):
            continue
        xs = np.geomspace(d["size_bytes"].min(), d["size_bytes"].max(), 100)
        ax.plot(xs, [m.predict_us(s) for s in xs], "--", color=line.get_color(), lw=1)
    ax.plot([], [], "k--", lw=1, label="fit: latency + size / bandwidth")
    ax.set(yscale="log", xlabel="message size (bytes)", ylabel="time per all-reduce (us)",
           title=f"All-reduce time (median, p20-p80 band)\n{where}")
    _log2_x(ax, sizes=True)
    ax.grid(True, which="both", alpha=0.3)
    _legend(ax)
    made.append(("All-reduce time vs size", save(fig, out, "allreduce_time", fmt)))
    return made


# ----------------------------------------------------------------------------- tree-bench
def tree_bench(runs, labels, out, fmt):
    """Tree builder and accept/commit time vs budget; attention % of copy and TFLOP/s vs T."""
    frames = []
    for run, df in runs:
        if "kernel" not in df:
            continue
        d = df[df["variant"].isna()] if "variant" in df else df  # --tune rows are not a sweep
        frames.append(d.assign(_run=run_label(run, labels, runs)))
    if not frames:
        return []
    df = pd.concat(frames, ignore_index=True)
    for c in ("streams", "budget", "t", "prefix", "heads", "layers", "time_us", "pct_copy_bw", "tflops"):
        df[c] = num(df, c)
    where = run_title(runs, labels)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ax = axes[0]
    small = df[df["kernel"].isin(["build", "accept", "accept_commit", "commit"])].copy()
    small["layers"] = small["layers"].fillna(1)
    for (rl, k, b, ly), g in small.groupby(["_run", "kernel", "streams", "layers"]):
        g = g.sort_values("budget")
        ax.plot(g["budget"], g["time_us"], "o-", ms=3,
                label=_join(rl, f"{k} B={int(b)}" + (f" x{int(ly)} layers" if ly > 1 else "")))
    ax.set(yscale="log", xlabel="budget (nodes per stream)", ylabel="time (us)",
           title="tree build, accept, commit")
    _log2_x(ax)
    ax.grid(True, which="both", alpha=0.3)
    _legend(ax)
    att = df[df["kernel"] == "attn"]
    # one series per (run, streams, heads, prefix) at most: the largest prefix of each shape
    if len(att):
        big = att.groupby(["_run", "streams", "heads"])["prefix"].transform("max")
        att = att[att["prefix"] == big]
    for ax, col, ylab in ((axes[1], "pct_copy_bw", "% of copy bandwidth (KV bytes)"),
                          (axes[2], "tflops", "TFLOP/s")):
        for (rl, b, h, p), g in att.groupby(["_run", "streams", "heads", "prefix"]):
            g = g.sort_values("t")
            ax.plot(g["t"], g[col], "o-", ms=3, label=_join(rl, f"B={int(b)} H={int(h)} prefix {int(p)}"))
        ax.set(xlabel="query tokens T (1 = decode, budget + 1 = tree)", ylabel=ylab,
               title=f"tree-verify MLA attention: {ylab.split(' (')[0]}")
        _log2_x(ax)
        ax.grid(True, which="both", alpha=0.3)
        _legend(ax)
    fig.suptitle(f"tree-bench: {where}", fontsize=10)
    return [("DDTree kernels (tree-bench)", save(fig, out, "tree_bench", fmt))]


# ----------------------------------------------------------------------------- decode
def _stack(ax, labels_x, rows: pd.DataFrame, phases, total_col, floor_col, total_label, floor_label):
    x = np.arange(len(labels_x))
    bottom = np.zeros(len(x))
    for p in phases:
        col = f"{p}_us"
        if col not in rows or not num(rows, col).notna().any():
            continue
        vals = num(rows, col).fillna(0).to_numpy()
        ax.bar(x, vals, bottom=bottom, label=p, width=0.6)
        bottom += vals
    if total_col in rows:
        ax.hlines(num(rows, total_col), x - 0.35, x + 0.35, color="black", lw=2, zorder=3, label=total_label)
    if floor_col and floor_col in rows:
        f = num(rows, floor_col)
        ax.scatter(x[f.notna().to_numpy()], f.dropna(), marker="x", color="red", zorder=3, label=floor_label)
    ax.set_xticks(x, labels_x, fontsize=8)


def decode(runs, labels, out, fmt):
    """Stacked per-phase step time per (run, concurrency), with the step total and bytes floor;
    with more than 3 runs, one panel per concurrency and one bar per run."""
    rows = []
    for run, df in runs:
        if "concurrency" not in df:
            continue
        for _, r in df.iterrows():
            rows.append({**r.to_dict(), "_run": run.name, "_rl": run_label(run, labels, runs)})
    if not rows:
        return []
    rows = pd.DataFrame(rows)
    preset = rows["preset"].iloc[0] if "preset" in rows else ""
    tp = rows["tp"].iloc[0] if "tp" in rows else "?"
    title = f"decode step, {preset} TP-{tp}: phases timed one by one (bars) vs the whole step"
    args = (DECODE_PHASES, "step_total_us", "floor_us", "step total (graph replay + modelled comm)", "bytes floor")
    nruns = rows["_run"].nunique()
    if nruns <= 3:
        fig, ax = plt.subplots(figsize=(min(16, max(8.5, 1.2 * len(rows) + 4)), 4.8))
        _stack(ax, [_join(rl, f"c={c}") for rl, c in zip(rows["_rl"], rows["concurrency"])], rows, *args)
        ax.set_ylabel("time per decode step (us)")
        ax.grid(axis="y", alpha=0.3)
        ax.set_title(f"{title}\n{run_title(runs, labels)}")
        _legend(ax, outside=True)
    else:
        concs = sorted(num(rows, "concurrency").dropna().unique())
        fig, axes = plt.subplots(len(concs), 1, figsize=(min(16, 0.45 * nruns + 5), 3.2 * len(concs) + 1.2),
                                 squeeze=False)
        for ax, c in zip(axes[:, 0], concs):
            sub = rows[num(rows, "concurrency") == c]
            _stack(ax, list(sub["_run"]), sub, *args)
            ax.tick_params(axis="x", labelrotation=60)
            ax.set(ylabel="us per step", title=f"c={int(c)}")
            ax.grid(axis="y", alpha=0.3)
        _legend(axes[0, 0], outside=True)
        fig.suptitle(f"{title}, {nruns} runs")
    return [("decode: per-phase step time", save(fig, out, "decode_phases", fmt))]


# ----------------------------------------------------------------------------- e2e
SERIES = ["decoder", "_profile", "_routing", "concurrency"]     # one e2e series: its best budget is a row


def e2e_frame(runs, labels=None) -> pd.DataFrame:
    """All e2e rows; `_profile` names the series: the acceptance profile, and the run (its GPU,
    or else what differs) where several runs measured the same profile at the same concurrency."""
    frames = [df.assign(_run=run.name, _rl=(labels or {}).get(run.name, run.name), _gpu=getattr(run, "gpu", "")) for run, df in runs
              if "decoder" in df]
    if not frames:
        return pd.DataFrame()
    df = pd.concat(frames, ignore_index=True)
    for c in ("concurrency", "budget", "output_tok_per_s", "step_total_us", "floor_plus_comm_us"):
        df[c] = num(df, c)
    # `_tps`: the steady rate (every stream generating) where the run measured it, else the batch's
    df["_tps"] = num(df, "steady_tok_per_s").fillna(df["output_tok_per_s"]) if "steady_tok_per_s" in df \
        else df["output_tok_per_s"]
    prof = pd.Series("", index=df.index, dtype=object)
    for col in ("acceptance", "profile"):  # the profile where given, else the --acceptance spec
        if col in df:
            prof = df[col].where(df[col].notna() & (df[col].astype(object) != ""), prof)
    df["_profile"] = prof.map(lambda v: "" if v is None or v != v else str(v))
    # `_routing`: a run with the router's choice and one with uniform draws are different series
    df["_routing"] = df["routing"].fillna("").astype(str) if "routing" in df else ""
    if len(df) and df.groupby(SERIES)["_run"].nunique().max() > 1:
        # the card where that alone tells the runs apart (the latest run of each GPU), else the label
        by_gpu = df.groupby(SERIES + ["_gpu"])["_run"].nunique().max() == 1
        tag = df["_gpu"].astype(str) if by_gpu else df["_rl"].astype(str).str.slice(0, 40)
        df["_profile"] = df["_profile"] + " [" + tag + "]"
    return df


def e2e(runs, labels, out, fmt, reference=None):
    """tok/s vs budget per concurrency (model line where predicted, measured points, AR and
    SGLang as horizontal lines); E[accepted] vs budget per profile; per-phase step stack."""
    df = e2e_frame(runs, labels)
    if df.empty:
        return []
    where = run_title(runs, labels)
    made = []
    pred = first_col(df, "predicted_tok_per_s")
    acc = first_col(df, "mean_accepted_len", "mean_accepted", "accepted_mean")
    spec = df[df["decoder"] == "ddtree"]
    ar = df[df["decoder"] == "ar"]
    concs = sorted(df["concurrency"].dropna().unique())
    if len(spec):
        fig, axes = plt.subplots(1, len(concs), figsize=(6.5 * len(concs), 5.6), squeeze=False, layout="constrained")
        for ax, c in zip(axes[0], concs):
            s = spec[spec["concurrency"] == c]
            for prof, g in s.groupby("_profile"):
                g = g.groupby("budget")[["_tps"] + ([pred] if pred else [])].mean().sort_index()
                line, = ax.plot(g.index, g["_tps"], "o" if pred else "o:", label=f"{prof} measured")
                if pred:
                    ax.plot(g.index, g[pred], "-", color=line.get_color(), label=f"{prof} model")
            a = ar[ar["concurrency"] == c]
            cards = sorted(a["_gpu"].astype(str).unique())
            for card, shade in zip(cards, itertools.cycle(("gray", "darkgray", "silver", "dimgray"))):  # a line a card
                ax.axhline(a[a["_gpu"].astype(str) == card]["_tps"].max(), color=shade, ls=":",
                           label=f"engine AR ({card})" if len(cards) > 1 else "engine AR")
            for name, tps in (reference or {}).get(int(c), []):
                ax.axhline(tps, color="black", ls="--", lw=1, label=name)
            _log2_x(ax)
            ax.set(xlabel="tree budget (nodes per stream)", ylabel="output tok/s (steady: every stream generating)", title=f"c={int(c)}")
            ax.grid(alpha=0.3)
        _fig_legend(fig, axes[0])
        fig.suptitle(f"e2e: tok/s vs budget\n{where}", fontsize=10)
        made.append(("e2e: tok/s vs budget", save(fig, out, "e2e_budget", fmt)))
    if acc and len(spec):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        styles = ("-", "--", ":", "-.")
        colors = {}
        for (prof, c), g in spec.groupby(["_profile", "concurrency"]):
            g = num(g, acc).groupby(g["budget"]).mean().sort_index()
            ls = styles[concs.index(c) % len(styles)]
            line, = ax.plot(g.index, g.values, marker="o", ls=ls, color=colors.get(prof),
                            label=prof + (f" c={int(c)}" if len(concs) > 1 else ""))
            colors[prof] = line.get_color()
        _log2_x(ax)
        ax.set(xlabel="tree budget (nodes per stream)", ylabel="mean tokens accepted a step",
               title=f"e2e: E[accepted] vs budget\n{where}")
        ax.grid(alpha=0.3)
        _legend(ax)
        made.append(("e2e: mean accepted length vs budget", save(fig, out, "e2e_accepted", fmt)))
    # the step of each (decoder/profile, concurrency) at its best budget
    best = df.dropna(subset=["_tps"])
    best = best.loc[best.groupby(SERIES)["_tps"].idxmax()]
    if len(best):
        xl = [("AR" if r["decoder"] == "ar" else _wrap(r["_profile"]))
              + f"\nc={int(r['concurrency'])}" + (f" b={int(r['budget'])}" if r["decoder"] != "ar" else "")
              for _, r in best.iterrows()]
        fig, ax = plt.subplots(figsize=(min(16, max(8.5, 1.1 * len(xl) + 4)), 4.8))
        _stack(ax, xl, best, E2E_PHASES, "step_total_us", "floor_plus_comm_us", "step total",
               "bytes floor + comm")
        ax.set_ylabel("time per step (us)")
        ax.set_title(f"e2e: per-phase step time at the best budget\n{where}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        _legend(ax, outside=True)
        made.append(("e2e: per-phase step time", save(fig, out, "e2e_phases", fmt)))
    return made


# ----------------------------------------------------------------------------- baseline
def baseline(runs, labels, out, fmt, engine=None):
    """Output tok/s vs concurrency: each baseline series, and the engine's best (`engine`:
    [(name, {concurrency: tok/s}, {concurrency: note printed under the value})])."""
    series = []
    for run, df in runs:
        if run.kind != "baseline" or not {"concurrency", "output_tok_per_s"} <= set(df.columns):
            continue
        d = df.assign(c=num(df, "concurrency"), t=num(df, "output_tok_per_s")).dropna(subset=["c", "t"])
        key = d["label"].astype(str) if "label" in d else pd.Series(run.name, index=d.index)
        for name, g in d.groupby(key):
            g = g.groupby("c")["t"].max().sort_index()
            series.append((name, "s--", g, {}))  # the label column names the server
    for name, pts, notes in engine or []:
        series.append((name, "o-", pd.Series(pts).sort_index(), notes))
    made = _latency_cdf(runs, labels, out, fmt)
    if not series:
        return made
    fig, ax = plt.subplots(figsize=(9, 4.5))
    allc = set()
    for name, style, g, notes in series:
        ax.plot(g.index, g.values, style, label=name)
        for c, t in g.items():
            text = f"{t:.0f}" + (f" ({notes[c]})" if notes.get(c) else "")
            ax.annotate(text, (c, t), textcoords="offset points", xytext=(6, -3), ha="left", fontsize=7)
        allc |= set(g.index)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(allc), [f"{c:g}" for c in sorted(allc)])
    ax.minorticks_off()
    ax.set(xlabel="concurrency (requests in flight)", ylabel="output tok/s (all requests)",
           title="Output throughput vs concurrency: SGLang reference and this engine")
    ax.grid(alpha=0.3)
    _legend(ax)
    return [("Output tok/s vs concurrency", save(fig, out, "baseline_throughput", fmt))] + made


def _latency_cdf(runs, labels, out, fmt):
    """TTFT and TPOT distributions (CDF) per (run, concurrency) of the per-request CSVs."""
    curves = []
    req = [(r, d) for r, d in runs if r.kind == "baseline_requests"]
    for run, df in req:
        if not {"ok", "ttft_ms", "tpot_ms", "concurrency"} <= set(df.columns):
            continue
        df = df[num(df, "ok") == 1]
        for c, g in df.groupby("concurrency"):
            curves.append((_join(run.name if len(req) > 1 else "", f"c={c}"), g))
    if not curves:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, col, what in zip(axes, ("ttft_ms", "tpot_ms"), ("TTFT", "TPOT")):
        for name, g in curves:
            v = np.sort(num(g, col).dropna().to_numpy())
            if len(v):
                ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=name)
        ax.set(xlabel=f"{what} (ms)", ylabel="fraction of requests", title=f"{what} distribution (CDF)")
        ax.grid(alpha=0.3)
    _legend(axes[0])
    fig.suptitle(run_title(req, labels), fontsize=10)
    return [("TTFT and TPOT distributions", save(fig, out, "baseline_latency_cdf", fmt))]


PLOTS = {"moe-sweep": moe_sweep, "allreduce": allreduce, "tree-bench": tree_bench, "decode": decode,
         "e2e": e2e, "baseline": baseline}
