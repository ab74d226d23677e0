"""The `ddbench` command line: one subcommand per routine, heavy imports inside each.

Every command takes `--out DIR` (default `results/`) and a seed where it draws random
data; bad input prints one line to stderr and exits with code 2.
"""
from __future__ import annotations

import functools
import inspect
import sys
from pathlib import Path
from typing import List, Optional

import typer

from ddbench import UserError
from ddbench.args import parse_int_list, parse_kernels  # noqa: F401 - parse_int_list: also `ddbench.cli.parse_int_list`

app = typer.Typer(
    help="ddbench: benchmark and profile a Kimi K2.6 DDTree speculative engine "
         "(INT4 MoE GEMM, NCCL all-reduce, tree kernels, end-to-end decoding) "
         "and compare it with a live SGLang service.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)

OUT = typer.Option(Path("results"), "--out", help="Folder for results (CSV + JSON sidecar).")
SEED = typer.Option(0, "--seed", help="Random seed.")
PRESET = typer.Option("k2.6", "--preset", help="Model preset: k2.6, k2.6-tp8-rank or tiny.")
# shared by the engine commands (decode, e2e)
ENGINE_PRESET = typer.Option(None, "--preset", help="Model preset: k2.6, k2.6-tp8-rank or tiny "
                             "(default k2.6 on a GPU, tiny on a CPU).")
ENGINE_TP = typer.Option(1, "--tp", help="Tensor-parallel degree of the model.")
SIMULATE_RANK = typer.Option(None, "--simulate-rank", help="Run only this rank's shard on one device; "
                             "all-reduces are modelled (--allreduce-model).")
GPUS = typer.Option(None, "--gpus", help="Processes/GPUs for a real TP run (= --tp).")
CONCURRENCY = typer.Option("1,10", "--concurrency", help="Streams decoded together: '1,10' or '1-4'.")
OVERRIDE = typer.Option(None, "--override", "-o", help="Config field override FIELD=VALUE (repeatable).")
KERNELS = typer.Option("default", "--kernels",
                       help="Kernel choice FIELD=VALUE,..: moe=auto|marlin|triton|gemv|torch, attn=auto|cluster|split, "
                            "pdl=on|wait|off, route=fused|separate, gemv=none|rope+add+.. (of linear, head, add, "
                            "rope, norm), skinny=ROWS (0: off), stream=on|off; unnamed fields keep their defaults "
                            "(`ddbench env` prints them). Recorded, resolved, in the sidecar.")


def _version(value: bool) -> None:
    if value:
        from ddbench import __version__

        typer.echo(f"ddbench {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")):
    pass


def fail(message: str) -> None:
    """Print a one-line error and exit with code 2."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


def user_errors(fn):
    """Turn UserError/ConfigError (and a Ctrl-C) into a one-line message and exit code."""
    from ddbench.engine.config import ConfigError

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (UserError, ConfigError) as e:
            fail(str(e))
        except KeyboardInterrupt:
            typer.echo("interrupted: rows written so far are kept", err=True)
            raise typer.Exit(code=130) from None
    return wrapper


def check_output(out: Path, name: Optional[str] = None) -> None:
    """The shared output check every command runs before its first expensive step: --name is
    a plain file name, --out is writable, and NAME is free (UserError otherwise)."""
    from ddbench.results import check_output as check

    check(out, name)


@app.command()
@user_errors
def env(json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the facts to this JSON file."),
        kernels: str = KERNELS):
    """GPU(s), driver, CUDA, torch, triton, NCCL, clocks, memory, interconnect, and the kernels --kernels picks here."""
    from ddbench.envinfo import run
    from ddbench.results import ensure_out_dir

    choice = parse_kernels(kernels)
    if json_out is not None:
        if json_out.is_dir():
            raise UserError(f"--json {json_out} is a folder; give a file name, e.g. {json_out / 'env.json'}")
        ensure_out_dir(json_out.parent, what="--json folder")
    run(json_out, choice)


@app.command()
@user_errors
def pack(
    preset: Optional[str] = typer.Option(None, "--preset", help="Model preset: k2.6, k2.6-tp8-rank or tiny "
                                         "(default k2.6 on a GPU, tiny on a CPU)."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel degree: each expert's intermediate dim is split tp ways."),
    rank: int = typer.Option(0, "--rank", help="Which TP rank's shard to repack."),
    layers: str = typer.Option("1", "--layers", help="MoE layers: '1', '1-3', '1,5' or 'all'."),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="INT4 group size (default: the preset's, 32)."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda or auto."),
    verify: bool = typer.Option(False, "--verify", help="Unpack everything and compare with the logical weights."),
    save_checkpoint: bool = typer.Option(False, "--save-checkpoint",
                                         help="Also write the compressed-tensors checkpoint tensors (K2.6 names)."),
    hf_dir: Optional[Path] = typer.Option(None, "--hf-dir",
                                          help="Instead, write the whole random model as a Hugging Face "
                                               "K2.6-layout checkpoint directory (config.json, index, "
                                               "shards) that `ddbench decode --checkpoint` loads."),
    seed: int = SEED, out: Path = OUT,
    override: Optional[List[str]] = OVERRIDE,
):
    """Build random-but-valid K2.6-shaped INT4 routed-expert weights and repack them to Marlin.

    logical int4 + group scales -> compressed-tensors checkpoint tensors -> Marlin layout
    (w13 gate|up fused, w2), written as safetensors with a manifest of shapes, bytes,
    seed and checksums.
    """
    from ddbench.pack import run

    run(preset=preset, tp=tp, rank=rank, layers=layers, group_size=group_size, device=device,
        verify=verify, save_checkpoint=save_checkpoint, seed=seed, out=out, override=override, hf_dir=hf_dir)


@app.command()
@user_errors
def report(
    paths: Optional[List[Path]] = typer.Argument(None, help="Result CSVs or folders (default: results/)."),
    out: Path = typer.Option(Path("results/report"), "--out", help="Folder for plots and report.md."),
    fmt: str = typer.Option("png", "--format", help="Plot format: png or svg."),
    runs: Optional[str] = typer.Option(None, "--runs", help="Runs to report: 'all', or a comma list of "
                                       "run names (parts of file names) to compare (default: the latest "
                                       "run of each command on each GPU)."),
    results_md: Optional[Path] = typer.Option(None, "--results-md", help="Also write the tables (no plots) "
                                              "to this Markdown file, e.g. docs/RESULTS.md; in a git work tree, from committed runs only."),
):
    """Report the latest run of each command on each GPU (tables + plots) in OUT/report.md."""
    from ddbench.report import run

    run(paths or [Path("results")], out, fmt, runs=runs, results_md=results_md)


# Subcommands added by later routines register below, one block each.
# --- moe-sweep ---
@app.command("moe-sweep")
@user_errors
def moe_sweep(
    preset: Optional[str] = typer.Option(None, "--preset", help="Model preset (default: k2.6 on a GPU, tiny on the CPU)."),
    tp: int = typer.Option(8, "--tp", help="Tensor-parallel degree: 8 = one rank's shard, 1 = the whole layer."),
    tokens: Optional[str] = typer.Option(None, "--tokens", help="Token counts, e.g. '1,16,256' or '1-8' "
                                         "(default 1,2,4,...,4096)."),
    routing: str = typer.Option("uniform", "--routing", help="Comma list of uniform, skewed, balanced, router "
                                "(K2.6's router on a random router weight)."),
    backends: Optional[str] = typer.Option(None, "--backends", help="Comma list of torch (reference), triton "
                                           "(default: both on a GPU, torch on the CPU)."),
    graphs: bool = typer.Option(True, "--graphs/--no-graphs", help="Also time the triton backend in CUDA graphs."),
    check: bool = typer.Option(False, "--check", help="Compare each backend with the fp32 reference first (rel_err)."),
    reps: int = typer.Option(20, "--reps", help="Timed repeats per point (the torch reference uses a quarter)."),
    warmup: int = typer.Option(3, "--warmup", help="Untimed calls first."),
    torch_max_tokens: Optional[int] = typer.Option(None, "--torch-max-tokens",
                                                   help="Skip the slow torch reference above this T "
                                                        "(default: all at tp>=8 or on the CPU, 256 at tp<8 on a GPU)."),
    tiles: Optional[Path] = typer.Option(None, "--tiles", help="JSON tile table for the triton backend "
                                         "(list of {max_per_expert, block_m, ...}); default: the built-in one."),
    hot: int = typer.Option(16, "--hot", help="skewed routing: number of hot experts."),
    hot_share: float = typer.Option(0.5, "--hot-share", help="skewed routing: probability mass of the hot experts."),
    kernel: str = typer.Option("auto", "--kernel", help="GPU MoE kernel of the triton backend: auto (the "
                               "measured rule, kernels.moe.resolve_moe_kernel), decode, marlin, wide, triton or gemv."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda or auto."),
    name: Optional[str] = typer.Option(None, "--name", help="Output name (default moe_sweep_tp{tp}_{timestamp})."),
    seed: int = SEED, out: Path = OUT,
    override: Optional[List[str]] = OVERRIDE,
):
    """Sweep token counts through the INT4 MoE GEMM (w13 -> SiLU*up -> w2 -> weighted sum).

    Random Marlin-packed experts at the preset's shapes (one TP rank's shard with --tp 8),
    a routing per token count, and each backend timed for the whole layer and for each
    GEMM, with roofline columns against the copy bandwidth and bf16 GEMM rate measured in
    the same run. Without a GPU it runs the tiny preset on the CPU (torch backend; triton
    under the interpreter when asked with --backends triton).
    """
    from ddbench.engine.config import parse_overrides, preset as make_preset
    from ddbench.moe_sweep import run
    from ddbench.timing import pick_device

    default = "k2.6" if pick_device(device).type == "cuda" else "tiny"
    n_experts = make_preset(preset or default, tp=tp, rank=0, **parse_overrides(override)).n_experts
    if not 1 <= hot <= n_experts:
        raise UserError(f"--hot {hot}: must be between 1 and the preset's {n_experts} experts")
    if not 0 < hot_share < 1:
        raise UserError(f"--hot-share {hot_share} must be in (0, 1)")
    check_output(out, name)
    run(preset=preset, tp=tp, tokens=tokens, routing=routing, backends=backends, graphs=graphs, check=check,
        reps=reps, warmup=warmup, torch_max_tokens=torch_max_tokens, tiles=tiles, hot=hot, hot_share=hot_share,
        kernel=kernel, device=device, name=name, seed=seed, out=out, override=override)


# --- allreduce ---
@app.command()
@user_errors
def allreduce(
    gpus: Optional[int] = typer.Option(None, "--gpus", help="Ranks to start: one per GPU with nccl (default: all "
                                       "visible), N CPU processes with gloo (default 2). Under torchrun: "
                                       "WORLD_SIZE decides."),
    backend: str = typer.Option("auto", "--backend", help="nccl, gloo (CPU processes) or auto (nccl when a "
                                "CUDA GPU is visible)."),
    min_bytes: str = typer.Option("8", "--min-bytes", help="Smallest message of the doubling sweep (8, 64K, 1M, ...)."),
    max_bytes: Optional[str] = typer.Option(None, "--max-bytes", help="Largest message of the sweep "
                                            "(default 1G with nccl, 1M with gloo)."),
    tokens: str = typer.Option("1,16,160", "--tokens", help="Also time TP decode messages of T x hidden "
                               "values for these token counts ('none' to skip)."),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16, fp16 or fp32."),
    op: str = typer.Option("sum", "--op", help="Reduction: sum, max or min."),
    mode: str = typer.Option("both", "--mode", help="eager, graph (a CUDA graph of --graph-ops all-reduces, "
                             "time per op) or both; graph is skipped with gloo."),
    warmup: int = typer.Option(5, "--warmup", help="Untimed all-reduces before each size."),
    reps: int = typer.Option(20, "--reps", help="Timed samples per size (median, p20, p80)."),
    graph_ops: int = typer.Option(10, "--graph-ops", help="All-reduces captured in one CUDA graph."),
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds allowed for process-group setup and for "
                                  "any one collective."),
    model: bool = typer.Option(False, "--model", help="Fit the latency + bandwidth model to the measured rows "
                               "and print its TP decode-step predictions (also written to the sidecar)."),
    predict: Optional[str] = typer.Option(None, "--predict", help="Measure nothing: print the model's "
                                          "predictions for SPEC = a result CSV, nvlink-h200, pcie or "
                                          "'lat_us=..,busbw_gbps=..[,n_ranks=..]'."),
    name: Optional[str] = typer.Option(None, "--name", help="Result file name (default allreduce_TIMESTAMP)."),
    preset: str = PRESET, override: Optional[List[str]] = OVERRIDE, out: Path = OUT,
):
    """Time all-reduce over message sizes with nccl-tests' columns, eager and in a CUDA graph.

    Starts one process per GPU (or runs as one rank under torchrun), checks every result
    against known values (`wrong`), and writes size_bytes, count, dtype, redop, in_place,
    time_us (median, p20, p80), algbw_gbps, busbw_gbps = algbw x 2(n-1)/n, wrong, n_ranks,
    cuda_graph, mode, backend, tokens. --tokens adds the exact TP decode messages
    (T x hidden x dtype bytes; a TP decode step does 2 per layer). NCCL_NVLS_ENABLE=0
    unless set. Example: ddbench allreduce --gpus 8 --model
    """
    from ddbench.allreduce import predict as predict_model, run
    from ddbench.engine.config import parse_overrides, preset as make_preset

    cfg = make_preset(preset, **parse_overrides(override))
    token_list = [] if tokens.strip().lower() in ("", "none") else parse_int_list(tokens, "--tokens")
    if predict is not None:
        predict_model(predict, token_list or [1, 16, 160], cfg.hidden, cfg.n_layers, dtype)
        return
    run(gpus=gpus, backend=backend, min_bytes=min_bytes, max_bytes=max_bytes, tokens=token_list,
        dtype=dtype, op=op, mode=mode, warmup=warmup, reps=reps, graph_ops=graph_ops, timeout=timeout,
        out=out, name=name, model=model, hidden=cfg.hidden, n_layers=cfg.n_layers)


# --- tree-bench ---
@app.command("tree-bench")
@user_errors
def tree_bench(
    budgets: str = typer.Option("16,32,64,128,256,512,1024", "--budgets", help="Tree budgets (nodes besides the root)."),
    streams: str = typer.Option("1,10,32", "--streams", help="Concurrent streams (one tree each)."),
    prefixes: str = typer.Option("1024,8192,32768", "--prefixes", help="Cached prefix lengths for attention."),
    heads: str = typer.Option("8,64", "--heads", help="Attention heads per rank: 8 (TP 8) and 64 (TP 1)."),
    topk: int = typer.Option(32, "--topk", help="Top-K tokens kept per drafter position."),
    positions: int = typer.Option(15, "--positions", help="Drafter positions (block 16 - 1)."),
    dtype: str = typer.Option("bf16", "--dtype", help="Cache, query and logits dtype: bf16, fp16 or fp32."),
    kernels: str = typer.Option("topk,build,attn,accept,commit", "--kernels",
                                help="Subset of topk,build,attn,accept,commit (accept adds accept_commit rows)."),
    max_attn_gflop: float = typer.Option(3000.0, "--max-attn-gflop",
                                         help="Skip attention configs above this many GFLOP per call."),
    reps: int = typer.Option(20, "--reps", help="Timed repeats per row (median, p20, p80)."),
    layers: int = typer.Option(61, "--layers", help="Layers folded into one commit call (engine-style) for the "
                               "second commit row."),
    tune: bool = typer.Option(False, "--tune", help="GPU only: instead of the sweep, time knob variants of the "
                              "attention (10 streams x 8k, bf16) and the builder's warps; rows carry `variant`."),
    name: Optional[str] = typer.Option(None, "--name", help="Result file name (default tree_bench_TIMESTAMP)."),
    preset: str = PRESET, override: Optional[List[str]] = OVERRIDE, seed: int = SEED, out: Path = OUT,
):
    """Time the DDTree kernels: top-K, tree builder, tree-verify MLA attention, greedy accept, KV commit.

    Sweeps budgets x streams (builder, accept, commit), and streams x prefix x heads x
    T (T = 1 decode and T = budget + 1 tree verify) for attention, whose rows carry the KV
    bytes, GB/s and % of the copy bandwidth measured in the same run, plus TFLOP/s.
    Small kernels are timed as CUDA-graph replays, attention with CUDA events after an L2
    flush. Without a GPU a tiny preset runs under the Triton interpreter (and says so).
    Example: ddbench tree-bench --streams 10 --prefixes 8192 --heads 8
    """
    from ddbench.tree_bench import run, run_tune

    if not max_attn_gflop > 0:
        raise UserError(f"--max-attn-gflop {max_attn_gflop}: must be positive")
    check_output(out, name)
    if tune:
        run_tune(topk=topk, positions=positions, reps=reps, seed=seed, out=out, name=name)
        return
    run(budgets=parse_int_list(budgets, "--budgets"), streams=parse_int_list(streams, "--streams"),
        prefixes=parse_int_list(prefixes, "--prefixes"), heads=parse_int_list(heads, "--heads"),
        topk=topk, positions=positions, dtype=dtype,
        kernels=[k.strip() for k in kernels.split(",") if k.strip()], max_attn_gflop=max_attn_gflop,
        reps=reps, layers=layers, preset=preset, override=override, seed=seed, out=out, name=name)


# --- baseline ---
@app.command()
@user_errors
def baseline(
    url: Optional[str] = typer.Option(None, "--url", help="Server base URL, e.g. http://127.0.0.1:30000."),
    api: str = typer.Option("sglang", "--api",
                            help="sglang: native /generate (meta_info counts, spec_verify_ct); "
                                 "openai: /v1/completions SSE (usage counts); "
                                 "openai-chat: /v1/chat/completions SSE (usage counts)."),
    concurrency: str = typer.Option("1,10", "--concurrency", "-c",
                                    help="Requests kept in flight: '1,10', '1-4' ..."),
    num_prompts: Optional[int] = typer.Option(None, "--num-prompts",
                                              help="Requests per concurrency level (default: 4 x concurrency, at least 8)."),
    input_len: int = typer.Option(1024, "--input-len", help="Prompt length of the random dataset (tokens / words)."),
    output_len: int = typer.Option(256, "--output-len", help="Output tokens per request (ignore_eos: fixed length)."),
    dataset: str = typer.Option("random", "--dataset",
                                help="'random' (token ids for sglang, words for openai) or a JSONL file of "
                                     "{\"prompt\": ...} / {\"input_ids\": [...]} lines."),
    warmup: int = typer.Option(1, "--warmup", help="Warmup requests sent (all at once) before measuring."),
    timeout: float = typer.Option(300.0, "--timeout", help="Per-request time limit in seconds (also connect/read)."),
    model: Optional[str] = typer.Option(None, "--model", help="Model name for --api openai (default: first of /v1/models)."),
    label: Optional[str] = typer.Option(None, "--label", help="Name of this run in CSVs and plots (default: API@host:port)."),
    import_file: Optional[Path] = typer.Option(None, "--import",
                                               help="Convert an SGLang bench_serving --output-file JSONL into "
                                                    "the baseline summary CSV instead of measuring."),
    request_rate: float = typer.Option(float("inf"), "--request-rate",
                                       help="Requests per second as Poisson arrivals, at most --concurrency in "
                                            "flight (bench_serving --request-rate with --max-concurrency); "
                                            "inf: exactly --concurrency in flight."),
    seed: int = SEED, out: Path = OUT,
):
    """Measure a live SGLang (or OpenAI-compatible) server at concurrency N.

    Keeps exactly N streaming requests in flight and reports, per level, SGLang
    bench_serving's metrics: request/output/total throughput, TTFT,
    TPOT = (latency - TTFT)/(out - 1), ITL (a multi-token chunk's gap split
    over its tokens), E2E latency (mean/median/p90/p99), accept length
    (completion tokens / spec_verify_ct) and failed requests.
    Writes baseline_*.csv (summary, with std and p95 too), baseline_requests_*.csv
    (per request), baseline_requests_*.jsonl (per request, with its ITL list) and JSON
    sidecars with the server's own info. Exit code 1, with a one-line count of error
    kinds, when every request of a level failed.
    """
    from ddbench import baseline as bl

    check_output(out)
    if import_file is not None:
        summary, requests = bl.import_bench_serving(import_file, out, label)
        typer.echo(f"wrote {summary}" + (f" and {requests}" if requests else ""))
        return
    if not url:
        raise UserError("--url is required (or --import FILE.jsonl)")
    levels = parse_int_list(concurrency, "--concurrency")
    try:
        bl.run(url=url, api=api, concurrency=levels, num_prompts=num_prompts, input_len=input_len,
               output_len=output_len, dataset=dataset, warmup=warmup, timeout=timeout, model=model,
               label=label, seed=seed, out=out, request_rate=request_rate)
    except bl.AllFailed as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=1) from None


# --- decode ---
@app.command()
@user_errors
def decode(
    preset: Optional[str] = ENGINE_PRESET,
    tp: int = ENGINE_TP,
    simulate_rank: Optional[int] = SIMULATE_RANK,
    gpus: Optional[int] = GPUS,
    concurrency: str = CONCURRENCY,
    prompt_len: int = typer.Option(128, "--prompt-len", help="Random prompt tokens per stream."),
    new_tokens: int = typer.Option(64, "--new-tokens", help="Tokens generated per stream (timed steps = this - 1)."),
    checkpoint: Optional[Path] = typer.Option(None, "--checkpoint",
                                              help="Hugging Face K2.6-layout checkpoint directory "
                                                   "(default: random weights)."),
    allreduce_model: Optional[str] = typer.Option(None, "--allreduce-model",
                                                  help="All-reduce model for --simulate-rank: nvlink-h200 "
                                                       "(default), pcie, lat_us=..,busbw_gbps=.. or an "
                                                       "allreduce CSV."),
    moe_backend: str = typer.Option("auto", "--moe-backend", help="auto, torch or triton."),
    attn_backend: str = typer.Option("auto", "--attn-backend", help="auto, torch or triton."),
    graph: bool = typer.Option(True, "--graph/--no-graph", help="CUDA graph for the decode step (GPU)."),
    init: str = typer.Option("auto", "--init", help="Random init: auto, exact (full tensors, sliced) or "
                                                    "shard (only this rank's, on the device)."),
    kernels: str = KERNELS,
    name: Optional[str] = typer.Option(None, "--name", help="Result file name (default decode_<time>)."),
    seed: int = SEED, out: Path = OUT,
    override: Optional[List[str]] = OVERRIDE,
    routing: Optional[str] = typer.Option(None, "--routing", help="uniform (draws after the router; default with "
                                          "random weights) or model (the router's choice; default with "
                                          "--checkpoint)."),
):
    """Greedy autoregressive decoding of the K2.6 engine: tok/s and per-phase step time.

    Prefills random prompts, then times each decode step (a CUDA-graph replay on GPU) and
    one eager step per phase (attention, MoE, dense/shared MLP, communication, lm_head).
    With --tp N --simulate-rank R one rank's shard runs on one GPU and communication is
    modelled; with --tp N alone, N processes run the real thing (NCCL, or gloo on CPU).
    Writes a tidy CSV (kind 'decode') with the bytes floor: (weight + KV bytes read per
    step) / measured copy bandwidth.
    """
    from ddbench.decode import run

    levels, choice = parse_int_list(concurrency, "--concurrency"), parse_kernels(kernels)
    check_output(out, name)
    run(preset=preset, tp=tp, simulate_rank=simulate_rank, gpus=gpus,
        concurrency=levels, prompt_len=prompt_len,
        new_tokens=new_tokens, checkpoint=checkpoint, allreduce_model=allreduce_model,
        moe_backend=moe_backend, attn_backend=attn_backend, graph=graph, init=init, seed=seed, out=out,
        override=override, name=name, kernels=choice, routing=routing)


# --- e2e ---
@app.command()
@user_errors
def e2e(
    preset: Optional[str] = ENGINE_PRESET,
    tp: Optional[int] = typer.Option(None, "--tp", help="Tensor-parallel degree (default 1 where the model fits, "
                                                        "else one rank of TP-8: --tp 8 --simulate-rank 0)."),
    simulate_rank: Optional[int] = SIMULATE_RANK,
    gpus: Optional[int] = GPUS,
    concurrency: Optional[str] = typer.Option(None, "--concurrency", help="Streams decoded together: '1,10' or "
                                              "'1-4' (default 1,10 on a GPU, 1,2 on a CPU)."),
    budget: Optional[str] = typer.Option(None, "--budget", help="Tree budgets (nodes per stream and step), with "
                                         "'auto' (alone or in the list): fit the cost model over the budgets "
                                         "(default 8,32,128) and measure the best predicted one (default "
                                         "8,32,128,auto on a GPU, 4,16 on a CPU)."),
    acceptance: Optional[str] = typer.Option(None, "--acceptance",
                                   help="Comma list of: real (true greedy walk, lossless; default with "
                                        "--checkpoint), synthetic:TAU "
                                        "(accepted length drawn with mean TAU, bonus included), "
                                        "profile:FILE (per-depth acceptance probabilities), rank:PROFILE "
                                        "(per-depth drafter-rank probabilities: a shipped name such as "
                                        "dflash-k25-gsm8k-paper, or a JSON file). Default with random weights: "
                                        "rank:dflash-k25-gsm8k-paper,rank:dflash-k25-mtbench-small."),
    routing: Optional[str] = typer.Option(None, "--routing", help="uniform (draws after the router; default with "
                                          "random weights), model (the router's choice; default with "
                                          "--checkpoint) or overlap:F (a tree node keeps each parent expert "
                                          "with probability F)."),
    save_profile: Optional[Path] = typer.Option(None, "--save-profile", help="Write the real runs' drafter "
                                                "ranks of the target's tokens as a rank profile (JSON) for "
                                                "--acceptance rank:FILE."),
    prompt_len: str = typer.Option("128", "--prompt-len", help="Random prompt tokens per stream; a list "
                                                               "('100,300') is cycled over the streams."),
    new_tokens: Optional[int] = typer.Option(None, "--new-tokens", help="Tokens generated per stream (first one "
                                             "from prefill; default 64 on a GPU, 8 on a CPU)."),
    checkpoint: Optional[Path] = typer.Option(None, "--checkpoint",
                                              help="Hugging Face K2.6-layout checkpoint directory for the "
                                                   "target (default: random weights; the drafter is random)."),
    allreduce_model: Optional[str] = typer.Option(None, "--allreduce-model",
                                                  help="All-reduce model for --simulate-rank: nvlink-h200 "
                                                       "(default), pcie, lat_us=..,busbw_gbps=.. or an "
                                                       "allreduce CSV."),
    topk: Optional[int] = typer.Option(None, "--topk", help="Drafter top-K per position for the tree "
                                                             "(default min(budget, 16))."),
    moe_backend: str = typer.Option("auto", "--moe-backend", help="auto, torch or triton."),
    attn_backend: str = typer.Option("auto", "--attn-backend", help="auto, torch or triton."),
    graph: bool = typer.Option(True, "--graph/--no-graph", help="CUDA graphs per phase (GPU)."),
    init: str = typer.Option("auto", "--init", help="Random init: auto, exact or shard."),
    kernels: str = KERNELS,
    baseline: Optional[Path] = typer.Option(None, "--baseline",
                                            help="Folder with baseline CSVs (kind 'baseline') shown beside the "
                                                 "engine (default results/baseline, when it exists)."),
    name: Optional[str] = typer.Option(None, "--name", help="Result file name (default e2e_<time>)."),
    seed: int = SEED, out: Path = OUT,
    override: Optional[List[str]] = OVERRIDE,
):
    """The DDTree speculative engine end to end: tok/s, accepted length and per-phase step time.

    At each concurrency: prefill random prompts once, then plain greedy decoding (AR) and
    DDTree speculative decoding at every budget x acceptance mode from the same state.
    A step = draft -> top-K + tree build -> verify (one target forward over every
    stream's tree) -> greedy accept + KV commit -> drafter context update, each phase a
    CUDA graph on GPU. Reports output tok/s, steps/s, mean accepted length (bonus
    included) and the per-step breakdown (draft, tree, verify attention / MoE / other,
    comm, accept, host), with --tp N --simulate-rank R the projected TP-n numbers (measured
    rank compute + modelled communication; --tp N alone runs N real processes, NCCL or
    gloo), the bytes floor, and whether real acceptance reproduced AR's tokens. Tidy CSV
    (kind 'e2e'); on a GPU the table puts the SGLang baseline (from --baseline) beside the
    engine (a CPU run is a labelled toy, without it). Routing, rank profiles, --budget auto:
    see ddbench/e2e.py.
    """
    from ddbench.e2e import run

    if baseline is not None and not baseline.exists():
        raise UserError(f"--baseline {baseline}: no such file or folder")
    from ddbench.e2e import parse_budgets

    levels = parse_int_list(concurrency, "--concurrency") if concurrency is not None else None
    budgets, auto = parse_budgets(budget)
    choice = parse_kernels(kernels)
    check_output(out, name)
    run(preset=preset, tp=tp, simulate_rank=simulate_rank, gpus=gpus,
        concurrency=levels, budgets=budgets, budget_auto=auto, routing=routing, save_profile=save_profile,
        acceptance=acceptance.split(",") if acceptance is not None else None, prompt_len=prompt_len,
        new_tokens=new_tokens, checkpoint=checkpoint,
        allreduce_model=allreduce_model, moe_backend=moe_backend, attn_backend=attn_backend, graph=graph,
        init=init, topk=topk, seed=seed, out=out, override=override,
        baseline=baseline or Path("results/baseline"), name=name, kernel_choice=choice)


def reflow(doc: str) -> str:
    """A docstring's paragraphs each on one line (rich help keeps the source's line breaks, which
    break mid-sentence in a terminal narrower or wider than the source)."""
    paragraphs = inspect.cleandoc(doc).split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in par.splitlines()) for par in paragraphs)


for _command in app.registered_commands:
    _command.help = reflow(_command.help or _command.callback.__doc__ or "")


def main():
    from ddbench.results import stop_on_signals

    stop_on_signals()  # SIGTERM/SIGHUP finish files like Ctrl-C: rows kept, sidecar says incomplete
    app(prog_name="ddbench")


if __name__ == "__main__":
    sys.exit(main())
