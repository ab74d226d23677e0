"""`ddbench report`: the latest run of each command, as tables and plots.

By default every folder given is searched for runs (`ddbench.runs.list_runs`) and the
newest run of each command on each GPU is reported, with the runs a script made beside it,
such as one process per concurrency (a newer run on one card does not hide another card's
figures; where runs of several cards are reported, each table row names its card and the
engine-vs-SGLang table has a row a card); `--runs all` reports every run, `--runs A,B` the
runs whose file name contains A or B (to compare them: plot series are labelled by what differs
between their command lines). A CSV given by path is always reported. Each command gets a
table of its key numbers, naming the run (file, date, GPU, command line) and marking an
interrupted run, then its plots. `--results-md` also writes the tables alone, with no
plots, as a Markdown file (docs/RESULTS.md is generated this way from results/); inside a git
work tree it then reports committed runs only.
"""
from __future__ import annotations

from pathlib import Path

from ddbench import UserError
from ddbench.results import atomic_write_text, ensure_out_dir
from ddbench.runs import MAIN_KIND, Run, differing_args, list_runs, session, several_cards

ORDER = ("e2e", "decode", "moe-sweep", "allreduce", "tree-bench", "baseline")
KEY_CONCURRENCY = (1, 10)


# ----------------------------------------------------------------------------- selection
def committed(path: Path) -> set[Path] | None:
    """The files under `path` that git tracks (resolved), or None outside a git work tree."""
    import subprocess

    path = Path(path)
    where, what = (path, ".") if path.is_dir() else (path.parent, path.name)
    try:
        out = subprocess.run(["git", "-C", str(where), "ls-files", "-z", "--", what],
                             capture_output=True, check=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return {(where / f).resolve() for f in out.split("\0") if f}


def select(paths, runs_opt: str | None, committed_only: bool = False) -> tuple[list[Run], list[Run]]:
    """-> (every run found, the runs to report); with `committed_only`, inside a git work tree,
    only runs whose CSV git tracks (a local run never becomes a documented figure)."""
    found: list[Run] = []
    explicit: list[Run] = []
    for p in paths:
        p = Path(p)
        rs = list_runs(p)
        tracked = committed(p) if committed_only else None
        if tracked is not None:
            left = [r for r in rs if r.csv.resolve() not in tracked]
            if left:
                print(f"note: {len(left)} run(s) under {p} not committed to git left out, e.g. {left[-1].csv}")
            rs = [r for r in rs if r.csv.resolve() in tracked]
        found += rs
        if p.is_file():
            if not rs:
                raise UserError(f"{p} is not a ddbench result CSV (no sidecar kind and not under "
                                "results/<gpu>/<command>/)")
            explicit += rs
    seen = {}
    for r in found:
        seen.setdefault(r.csv.resolve(), r)
    found = sorted(seen.values(), key=lambda r: (*_key(r), str(r.csv)))
    if runs_opt:
        if runs_opt == "all":
            chosen = list(found)
        else:
            wanted = [w.strip() for w in runs_opt.split(",") if w.strip()]
            chosen = [r for r in found if any(w in r.name or w in str(r.csv) for w in wanted)]
            missing = [w for w in wanted if not any(w in r.name or w in str(r.csv) for r in found)]
            if missing:
                raise UserError(f"--runs: no run matches {', '.join(missing)}")
    elif explicit:
        chosen = explicit
    else:
        chosen = []
        for r in latest_runs_of(found).values():
            chosen += session(found, r)
    keep = {r.csv.resolve() for r in chosen}
    return found, [r for r in found if r.csv.resolve() in keep]


def latest_runs_of(runs: list[Run]) -> dict[tuple[str, str], Run]:
    """{(command, gpu): its newest run} over an already-listed set of runs (several folders)."""
    latest = {}
    for r in runs:
        at = (r.command, r.gpu)
        if r.kind == MAIN_KIND[r.command] and (at not in latest or _key(r) >= _key(latest[at])):
            latest[at] = r
    return latest


def _key(r: Run):
    return (r.started is not None, r.started.timestamp() if r.started else 0.0)


def load(run: Run):
    import pandas as pd

    try:
        return pd.read_csv(run.csv)
    except (ValueError, OSError):
        return None  # an empty or unreadable CSV (a run stopped before its first row)


# ----------------------------------------------------------------------------- tables
def md_table(header: list[str], rows: list[list]) -> list[str]:
    def cell(v):
        if v is None:
            return ""
        if isinstance(v, float):
            if v != v:
                return ""
            return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}" if abs(v) < 1 else f"{v:.1f}"
        return str(v).replace("|", "\\|")

    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return out + [""]


def run_name(name: str, gpu: str, several: bool) -> str:
    """A table's name for a run: its file name, after its GPU where the table holds several cards."""
    return f"{gpu}/{name}" if several else name


def run_header(r: Run) -> list[str]:
    gpu = r.meta.get("gpu_name") or r.meta.get("hardware") or r.gpu
    state = " **INCOMPLETE (interrupted or unfinished run)**" if r.incomplete else ""
    commit = f", commit {r.meta['git_commit']}" if r.meta.get("git_commit") else ""
    if r.meta.get("source_sha"):
        commit += f", source {r.meta['source_sha']}"
    lines = [f"- Run `{r.csv}`: {r.date if r.started else 'date not recorded'}, {gpu}{commit}{state}"]
    if r.meta.get("provenance"):
        lines.append(f"  - provenance: {r.meta['provenance']}")
    if r.command_line:
        lines.append(f"  - command: `{r.command_line}`")
    if r.meta.get("error"):
        lines.append(f"  - stopped by: {r.meta['error']}")
    return lines


def _f(v):
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return None if v != v else v


def table_moe(runs) -> list[str]:
    from ddbench.plots import num, truthy

    rows, several = [], several_cards(r for r, _ in runs)
    for run, df in runs:
        if "stage" not in df:
            continue
        lay = df[df["stage"] == "layer"]
        if "cuda_graph" in lay and truthy(lay["cuda_graph"]).any():
            lay = lay[truthy(lay["cuda_graph"])]
        for _, r in lay.sort_values(["backend", "routing"]).assign(t=num(lay, "tokens")).sort_values("t").iterrows():
            rows.append([run_name(run.name, run.gpu, several) if len(runs) > 1 else None, r.get("backend"), r.get("routing"), int(r["t"]),
                         _f(r.get("time_us")), _f(r.get("floor_bytes_us")), _f(r.get("pct_of_copy_bw")),
                         _f(r.get("tflops"))])
    if not rows:
        return ["No MoE layer rows.", ""]
    head = ["backend", "routing", "T", "time (us)", "bytes floor (us)", "% of copy BW", "TFLOP/s"]
    if len(runs) > 1:
        return md_table(["run"] + head, rows)
    return md_table(head, [r[1:] for r in rows])


def table_allreduce(runs) -> list[str]:
    from ddbench.plots import num

    rows, several = [], several_cards(r for r, _ in runs)
    for run, df in runs:
        if "size_bytes" not in df:
            continue
        for mode, d in df.groupby("mode"):
            d = d.assign(s=num(d, "size_bytes")).sort_values("s")
            sizes = sorted(d["s"].unique())
            pick = [s for i, s in enumerate(sizes) if i % 4 == 0 or s == sizes[-1]]
            for _, r in d[d["s"].isin(pick)].iterrows():
                n = int(_f(r.get("n_ranks")) or 1)
                rows.append([run_name(run.name, run.gpu, several), mode, n, _size(r["s"]), _f(r.get("time_us")), _f(r.get("algbw_gbps")),
                             _f(r.get("busbw_gbps")) if n > 1 else "n/a (1 GPU)"])
    if not rows:
        return ["No all-reduce rows.", ""]
    return md_table(["run", "mode", "GPUs", "size", "time (us)", "algbw (GB/s)", "busbw (GB/s)"], rows)


def _size(b) -> str:
    b = float(b)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if b < 1024 or unit == "GiB":
            return f"{b:g} {unit}"
        b /= 1024
    return str(b)


def table_tree(runs) -> list[str]:
    rows, several = [], several_cards(r for r, _ in runs)
    for run, df in runs:
        if "kernel" not in df:
            continue
        d = df[df["variant"].isna()] if "variant" in df else df
        for _, r in d.iterrows():
            rows.append([run_name(run.name, run.gpu, several) if len(runs) > 1 else None, r["kernel"], _i(r.get("streams")), _i(r.get("budget")),
                         _i(r.get("t")), _i(r.get("prefix")), _i(r.get("heads")), _i(r.get("layers")),
                         _f(r.get("time_us")), _f(r.get("pct_copy_bw")), _f(r.get("tflops"))])
    if not rows:
        return ["No tree-bench rows (a --tune run only).", ""]
    head = ["kernel", "streams", "budget", "T", "prefix", "heads", "layers", "time (us)", "% of copy BW", "TFLOP/s"]
    if len(runs) > 1:
        return md_table(["run"] + head, rows)
    return md_table(head, [r[1:] for r in rows])


def _i(v):
    v = _f(v)
    return None if v is None else int(v)


def table_decode(runs) -> list[str]:
    rows, several = [], several_cards(r for r, _ in runs)
    for run, df in runs:
        if "concurrency" not in df:
            continue
        for _, r in df.iterrows():
            rows.append([run_name(run.name, run.gpu, several), _i(r.get("concurrency")), _f(r.get("step_us")), _f(r.get("comm_us")),
                         _f(r.get("step_total_us")), _f(r.get("output_tok_per_s")), _f(r.get("floor_us")),
                         _f(r.get("floor_ratio")),
                         *(_f(r.get(f"{p}_us")) for p in ("attention", "moe", "mlp", "lm_head", "other"))])
    if not rows:
        return ["No decode rows.", ""]
    return md_table(["run", "c", "step (us)", "comm (us)", "total (us)", "tok/s", "bytes floor (us)", "x floor",
                     "attention", "moe", "mlp", "lm_head", "other"], rows)


def honest_routing(row) -> bool:
    """Whether an e2e row's experts are what a real model would run: independent draws
    (`uniform`, `overlap:F`) or a checkpoint's router; rows from before the routing column
    ran the random-weight router."""
    routing, ckpt = row.get("routing"), row.get("checkpoint")
    if not isinstance(routing, str) or not routing:
        return False
    return routing != "model" or (isinstance(ckpt, str) and bool(ckpt))


def table_e2e(runs, reference: dict) -> list[str]:
    from ddbench.plots import E2E_PHASES, SERIES, e2e_frame, first_col, num

    df = e2e_frame(runs, differing_args([r for r, _ in runs]))
    if df.empty:
        return ["No e2e rows.", ""]
    pred = first_col(df, "predicted_tok_per_s")
    acc = first_col(df, "mean_accepted_len", "mean_accepted", "accepted_mean")
    experts = first_col(df, "experts_measured")   # the formula's experts_touched is no measurement
    routing = first_col(df, "routing")
    best = df.dropna(subset=["_tps"])
    best = best.loc[best.groupby(SERIES)["_tps"].idxmax()]
    rows, several = [], several_cards(r for r, _ in runs)
    for _, r in best.sort_values(["concurrency", "decoder", "_profile", "_routing"]).iterrows():
        c = _i(r["concurrency"])
        ref = max((t for _, t in reference.get(c, [])), default=None)
        tps = _f(r["_tps"])
        rows.append([run_name(r["_run"], r["_gpu"], several), c, r["decoder"], "" if r["decoder"] == "ar" else r["_profile"],
                     (r.get(routing) if routing and isinstance(r.get(routing), str) else "random-weight router"),
                     None if r["decoder"] == "ar" else _i(r.get("budget")), tps, _f(r["output_tok_per_s"]),
                     _f(r.get(pred)) if pred else None, _f(r.get(acc)) if acc else None,
                     _f(r.get(experts)) if experts else None, _f(r.get("step_total_us")),
                     f"{tps / ref:.2f}x" if ref and tps else None])
    head = ["run", "c", "decoder", "profile", "routing", "best budget", "tok/s (steady)", "batch tok/s", "predicted tok/s",
            "mean accepted", "experts/layer", "step (us)", "vs SGLang"]
    keep = [i for i, h in enumerate(head) if any(row[i] not in (None, "") for row in rows)]
    lines = md_table([head[i] for i in keep], [[row[i] for i in keep] for row in rows])
    # the phases of those steps
    phases = [p for p in E2E_PHASES if f"{p}_us" in best and num(best, f"{p}_us").notna().any()]
    if phases:
        routed = best["_routing"].nunique() > 1
        prow = [[_i(r["concurrency"]), ("AR" if r["decoder"] == "ar" else f"{r['_profile']} b={_i(r['budget'])}")
                 + (f" ({r['_routing'] or 'random-weight router'})" if routed else ""),
                 *(_f(r.get(f"{p}_us")) for p in phases), _f(r.get("step_total_us"))]
                for _, r in best.sort_values(["concurrency", "decoder", "_profile", "_routing"]).iterrows()]
        lines += ["Step phases (us) at the best budget:", ""]
        lines += md_table(["c", "step"] + phases + ["total"], prow)
    return lines


def table_baseline(runs) -> list[str]:
    rows, several = [], several_cards(r for r, _ in runs)
    for run, df in runs:
        if run.kind != "baseline" or "output_tok_per_s" not in df:
            continue
        for _, r in df.iterrows():
            rows.append([run_name(run.name, run.gpu, several), r.get("label", run.name), _i(r.get("concurrency")), _f(r.get("output_tok_per_s")),
                         _f(r.get("median_ttft_ms")), _f(r.get("median_tpot_ms"))])
    if not rows:
        return ["No baseline rows.", ""]
    head = ["run", "label", "c", "output tok/s", "median TTFT (ms)", "median TPOT (ms)"]
    keep = [i for i, h in enumerate(head) if any(row[i] is not None for row in rows)]
    return md_table([head[i] for i in keep], [[row[i] for i in keep] for row in rows])


def reference_rows(found: list[Run], chosen: dict) -> dict[int, list[tuple[str, float]]]:
    """{concurrency: [(label, tok/s)]} from the SGLang reference CSVs (source 'reference')
    and the chosen baseline runs."""
    import pandas as pd

    ref: dict[int, list] = {}
    runs = [(r, load(r)) for r in found if r.kind == "baseline"]
    for r, df in runs:
        if df is None or not {"concurrency", "output_tok_per_s"} <= set(df.columns):
            continue
        is_ref = "source" in df and (df["source"].astype(str) == "reference").any()
        if not is_ref and r.csv.resolve() not in chosen:
            continue
        for _, row in df.iterrows():
            c, t = _i(row.get("concurrency")), _f(pd.to_numeric(row.get("output_tok_per_s"), errors="coerce"))
            if c is None or t is None:
                continue
            name = str(row.get("label", r.name))
            if (name, t) not in ref.setdefault(c, []):
                ref[c].append((name, t))
    return ref


def engine_best(by_cmd: dict) -> tuple[dict, bool]:
    """The engine's best tok/s at each concurrency, from the honest rows where any have them:
    {"decode" | "ar" | "ar_any" | "ddtree" | "ddtree_low": {c: (tok/s, setting, gpu)}} ("ar": e2e's
    AR rows; "ar_any": the better of those and decode's;
    "ddtree": the best row of a named rank profile where any honest row has one, "ddtree_low":
    the best row of the profile whose best is lowest, the other end of the acceptance bracket;
    setting: profile and budget), and whether the DDTree rows all ran the random-weight router."""
    import pandas as pd

    from ddbench.plots import e2e_frame, num

    def honest_first(d):
        """The rows with honest routing where any have it (AR rows too: the random-weight router
        sends a batch's tokens to fewer experts)."""
        h = d.assign(_honest=[honest_routing(r) for _, r in d.iterrows()])
        return h[h._honest] if h._honest.any() else h

    best = {"decode": {}, "ar": {}, "ddtree": {}}
    profiles = {}   # (c, profile) -> its best DDTree row

    def keep(into: dict, key, tps, setting, gpu):
        if tps > into.get(key, (0.0,))[0]:
            into[key] = (float(tps), setting, gpu)

    frames = [df.assign(_gpu=getattr(run, "gpu", "")) for run, df in by_cmd.get("decode", []) if "concurrency" in df]
    if frames:
        d = honest_first(pd.concat(frames, ignore_index=True))
        for c, t, gpu in zip(num(d, "concurrency"), num(d, "output_tok_per_s"), d["_gpu"]):
            if t == t:
                keep(best["decode"], int(c), t, "", gpu)
    df = e2e_frame(by_cmd.get("e2e", []))
    flattered = False
    if not df.empty:
        df = df.dropna(subset=["_tps"])
        df = df.assign(_honest=[honest_routing(r) for _, r in df.iterrows()])
        # the DDTree headline: honest routing and a named rank profile where any row has them
        dd = df[df.decoder == "ddtree"]
        for cond in (dd._honest & dd._profile.astype(str).str.startswith("rank:"), dd._honest):
            if cond.any():
                dd = dd[cond]
                break
        flattered = not dd.empty and not dd._honest.any()
        for _, r in pd.concat([honest_first(df[df.decoder != "ddtree"]), dd]).iterrows():
            tree = r["decoder"] == "ddtree"
            c, setting = int(r["concurrency"]), r["_profile"] + (f" b={int(r['budget'])}" if tree else "")
            keep(best["ddtree" if tree else "ar"], c, r["_tps"], setting, r["_gpu"])
            if tree:
                keep(profiles, (c, r["_profile"]), r["_tps"], setting, r["_gpu"])
    best["ar_any"] = dict(best["ar"])
    for c, v in best["decode"].items():
        keep(best["ar_any"], c, *v)
    best["ddtree_low"] = {}
    for (c, _), v in profiles.items():
        if v[0] < best["ddtree_low"].get(c, (float("inf"),))[0]:
            best["ddtree_low"][c] = v
    return best, flattered


def engine_best_by_gpu(by_cmd: dict) -> dict[str, tuple[dict, bool]]:
    """{gpu: `engine_best` of that card's engine runs (decode, e2e)}: the engine's figures are
    compared with SGLang one card at a time, never a row mixing cards."""
    gpus = sorted({str(getattr(r, "gpu", "")) for cmd in ("decode", "e2e") for r, _ in by_cmd.get(cmd, [])})
    return {g: engine_best({cmd: [(r, d) for r, d in by_cmd.get(cmd, []) if str(getattr(r, "gpu", "")) == g]
                            for cmd in ("decode", "e2e")}) for g in gpus}


def summary(by_cmd: dict, reference: dict) -> list[str]:
    """Engine vs SGLang at concurrency 1 and 10, a row for each concurrency and card."""
    by_gpu = engine_best_by_gpu(by_cmd) or {None: engine_best({})}
    flattered = any(flat for _, flat in by_gpu.values())
    rows = []
    for c in KEY_CONCURRENCY:
        ref = max((t for _, t in reference.get(c, [])), default=None)
        at_c = []
        for gpu, (best, _) in by_gpu.items():
            ar_best = best["ar_any"].get(c, (None,))[0]
            sp, setting = best["ddtree"].get(c, (None, ""))[:2]
            lo, lo_setting = best["ddtree_low"].get(c, (None, ""))[:2]
            ratio = None
            if ref and sp:
                ratio = f"{sp / ref:.2f}x" if lo == sp else f"{lo / ref:.2f}-{sp / ref:.2f}x"
            at_c.append([c, ref, best["decode"].get(c, (None,))[0], best["ar"].get(c, (None,))[0], sp, setting, lo,
                         lo_setting, f"{ar_best / ref:.2f}x" if ref and ar_best else None, ratio, gpu or None])
        # the cards with a figure at c; where none has one, the reference alone
        rows += [r for r in at_c if any(v is not None for v in r[2:5])] or [at_c[0][:2] + [None] * 9]
    if not any(any(v is not None for v in r[1:5]) for r in rows):
        return []
    notes = []
    modes = set()
    for cmd in ("decode", "e2e"):
        for _, d in by_cmd.get(cmd, []):
            if "mode" in d:
                modes |= set(d["mode"].dropna().astype(str))
    if "simulated" in modes:
        notes.append("engine rows with mode `simulated` ran one TP rank's shard on one GPU and add a modelled "
                     "all-reduce time: a projection of a TP-n node, not a measurement of one")
    if flattered:
        notes.append("the DDTree rows ran the random-weight router, which sends a stream's tree nodes to nearly "
                     "the same experts and so flatters the verify MoE (no run with `--routing uniform` yet)")
    if any(str(r[5]).startswith("synthetic") for r in rows):
        notes.append("DDTree rows with a `synthetic:N` profile assume that acceptance (mean accepted length set "
                     "by the profile) instead of a trained drafter's")
    text = ("Output tok/s of all streams at each concurrency c, from the runs named in the sections below "
            "(their command lines say what was measured). SGLang's figures are the reported reference. "
            "DDTree's acceptance is a profile's assumption, so its two columns are the profiles whose best "
            "budgets give the most and the least tok/s. Each row is one GPU's latest runs (the last column), "
            "so cards are never mixed in a row.")
    if notes:
        text += " Caveats: " + "; ".join(notes) + "."
    return ["## Engine vs SGLang", "", text, ""] + md_table(
        ["c", "SGLang reference", "engine decode (AR)", "engine e2e AR", "engine e2e DDTree (best profile)", "DDTree setting",
         "DDTree (weakest profile)", "its setting", "AR / SGLang", "DDTree / SGLang", "engine GPU"], rows)


TABLES = {"moe-sweep": table_moe, "allreduce": table_allreduce, "tree-bench": table_tree,
          "decode": table_decode, "baseline": table_baseline}
TITLES = {"e2e": "e2e: DDTree speculative decoding end to end", "decode": "decode: autoregressive step",
          "moe-sweep": "moe-sweep: one MoE layer", "allreduce": "allreduce", "tree-bench": "tree-bench: DDTree kernels",
          "baseline": "baseline: serving throughput"}


def sections(by_cmd: dict, reference: dict) -> dict[str, list[str]]:
    out = {}
    for cmd in ORDER:
        runs = by_cmd.get(cmd)
        if not runs:
            continue
        lines = [f"## {TITLES[cmd]}", ""]
        for r, _ in runs:
            lines += run_header(r)
        lines.append("")
        lines += table_e2e(runs, reference) if cmd == "e2e" else TABLES[cmd](runs)
        out[cmd] = lines
    return out


# ----------------------------------------------------------------------------- entry
def run(paths, out: Path, fmt: str = "png", runs: str | None = None, results_md: Path | None = None) -> Path:
    from ddbench import plots

    if fmt not in ("png", "svg"):
        raise UserError(f"--format {fmt!r}: choose png or svg")
    missing = [str(p) for p in paths if not Path(p).exists()]
    if missing:
        raise UserError(f"no such file or folder: {', '.join(missing)}")
    out = ensure_out_dir(out)
    found, chosen = select(paths, runs, committed_only=results_md is not None)
    by_cmd: dict[str, list] = {}
    for r in chosen:
        df = load(r)
        if df is None:
            print(f"warning: {r.csv} has no rows")
            continue
        by_cmd.setdefault(r.command, []).append((r, df))
    chosen_paths = {r.csv.resolve() for r in chosen}
    for r in found:  # the SGLang reference stays beside whichever baseline run is the latest
        if r.kind == "baseline" and r.meta.get("source") == "reference" and r.csv.resolve() not in chosen_paths:
            df = load(r)
            if df is not None:
                by_cmd.setdefault("baseline", []).append((r, df))
    reference = reference_rows(found, chosen_paths)
    secs = sections(by_cmd, reference)
    head = summary(by_cmd, reference)

    lines = ["# ddbench report", ""]
    if not by_cmd:
        lines.append("No ddbench runs were found (CSVs with a sidecar, or under results/<gpu>/<command>/).")
    lines += head
    for cmd in ORDER:
        if cmd not in secs:
            continue
        lines += secs[cmd]
        runs_ = by_cmd[cmd]
        labels = differing_args([r for r, _ in runs_])
        try:
            if cmd == "e2e":
                drawn = plots.e2e(runs_, labels, out, fmt, reference=reference)
            elif cmd == "baseline":
                drawn = plots.baseline(runs_, labels, out, fmt, engine=_engine_series(by_cmd))
            else:
                drawn = plots.PLOTS[cmd](runs_, labels, out, fmt)
        except (KeyError, ValueError, TypeError) as e:  # a CSV without the columns its command writes
            print(f"warning: could not draw the {cmd} plots: {type(e).__name__}: {e}")
            drawn = []
        for title, path in drawn:
            lines += [f"### {title}", "", f"![{title}]({Path(path).name})", ""]
    report = out / "report.md"
    atomic_write_text(report, "\n".join(lines) + "\n")
    print(f"wrote {report}")
    if results_md is not None:
        write_results_md(Path(results_md), head, secs, paths)
    return report


def _engine_series(by_cmd) -> list[tuple[str, dict, dict]]:
    """The plot's engine lines, from `engine_best`, for each card: AR (the better of decode and
    e2e's AR rows) and DDTree at its best and weakest profile, each named with its GPU,
    DDTree's points noted with their profile and budget."""
    series = []
    for gpu, (best, _) in engine_best_by_gpu(by_cmd).items():
        low = best["ddtree_low"] if best["ddtree_low"] != best["ddtree"] else {}  # one profile: one line
        for name, pts, noted in (("engine AR", best["ar_any"], False),
                                 ("engine DDTree, best profile" if low else "engine DDTree", best["ddtree"], True),
                                 ("engine DDTree, weakest profile", low, True)):
            if pts:
                series.append((f"{name} ({gpu})", {c: v[0] for c, v in pts.items()},
                               {c: v[1] for c, v in pts.items()} if noted else {}))
    return series


def write_results_md(path: Path, head: list[str], secs: dict, paths) -> None:
    where = ", ".join(str(p) for p in paths)
    lines = ["# Results", "",
             f"Generated by `ddbench report {where} --results-md {path}` from the latest committed run of each "
             "command on each GPU; do not edit by hand (rerun the command). Each section names its run: CSV path, date, "
             "GPU, command line. Plots: run `ddbench report` and open its report.md.", ""]
    lines += head
    for cmd in ORDER:
        if cmd in secs:
            lines += secs[cmd]
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "\n".join(lines) + "\n")
    print(f"wrote {path}")


