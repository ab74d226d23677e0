"""One eager decode step under Nsight Compute: what limits each kernel (H200, K2.6 TP-8 rank-0 shard).

python3 -m experiments.scripts.decode_ncu run [CONCURRENCY] [LAYERS]: builds the rank-0 shard with
random weights (LAYERS blocks, default 3: the dense layer and two MoE layers), prefills 128
tokens, runs two eager steps, then one step between cudaProfilerStart/Stop (without PDL, so
each kernel's time is its own). Run under `ncu --profile-from-start off --page raw --csv`
(`bash experiments/scripts/ncu.sh decode experiments.scripts.decode_ncu run 1 3`).
python3 -m experiments.scripts.decode_ncu summary NCU_CSV OUT_CSV: per kernel of the profiled step, in
launch order (the last MoE layer's kernels are the ones to read: no first-call effects):
duration, DRAM rate and share of peak, achieved occupancy, issue-slot use, warp instructions,
registers, grid, and the two largest warp stall reasons, as a table and OUT_CSV.
"""
import io
import sys

import pandas as pd
import torch


COLUMNS = {  # short name -> ncu raw metric
    "us": "gpu__time_duration.sum",
    "dram_TBps": "dram__bytes.sum.per_second",
    "dram_pct": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "dram_rd_MB": "dram__bytes_read.sum",
    "dram_wr_MB": "dram__bytes_write.sum",
    "l2_hit_pct": "lts__t_sector_hit_rate.pct",
    "occ_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "issue_pct": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "inst_M": "inst_executed",
    "regs": "launch__registers_per_thread",
    "grid": "launch__grid_size",
    "block": "launch__block_size",
}
STALL = "smsp__average_warps_issue_stalled_"   # + reason + _per_issue_active.ratio


def run(conc: int, layers: int) -> None:
    from ddbench.engine.build import build_model
    from ddbench.engine.config import preset
    from ddbench.engine.decode import Decoder
    from ddbench.engine.parallel import SimComm
    from ddbench.kernels import pdl

    pdl.ENABLED = False
    dev = torch.device("cuda")
    cfg = preset("k2.6", tp=8, rank=0, n_layers=layers)
    model, _ = build_model(cfg, SimComm(8, 0, lambda n: 0.0), None, "triton", "triton", 0, dev, "auto")
    dec = Decoder(model, conc, 256, use_graph=False)
    dec.prefill(torch.randint(0, cfg.vocab, (conc, 128), device=dev))
    for _ in range(2):
        dec.advance()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    dec.advance()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def _num(s: pd.Series) -> pd.Series:
    return pd.to_numeric(s.astype(str).str.replace(",", ""), errors="coerce")


def summary(src: str, dst: str) -> None:
    lines = [ln for ln in open(src) if not ln.startswith("==")]             # ncu's own messages
    df = pd.read_csv(io.StringIO("".join(lines)), skiprows=[1], low_memory=False)   # row 1: units
    out = pd.DataFrame({"kernel": df["Kernel Name"].str.slice(0, 40)})
    for short, metric in COLUMNS.items():
        out[short] = _num(df[metric]) if metric in df else float("nan")
    out["us"] /= 1e3                                                        # ns -> us
    out["dram_TBps"] /= 1e12 if out["dram_TBps"].max() > 1e9 else 1e3   # bytes or GB per second
    out["inst_M"] /= 1e6
    units = pd.read_csv(io.StringIO("".join(lines)), nrows=1, low_memory=False).iloc[0]   # the units row
    for col in ("dram_rd_MB", "dram_wr_MB"):                                # -> MB, whatever unit ncu chose
        out[col] *= {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}.get(str(units.get(COLUMNS[col])), 1.0)
    end = "_per_issue_active.ratio"
    stalls = {c[len(STALL):-len(end)]: _num(df[c]) for c in df
              if c.startswith(STALL) and c.endswith(end) and not c.endswith(("selected" + end, "not_selected" + end))}
    if stalls:
        st = pd.DataFrame(stalls)
        top = st.apply(lambda r: r.nlargest(2), axis=1)
        out["stalls"] = [", ".join(f"{k} {v:.1f}" for k, v in row.dropna().items()) for _, row in top.iterrows()]
    out.to_csv(dst, index=False)
    pd.set_option("display.width", 250)
    pd.set_option("display.max_colwidth", 60)
    print(out.round(2).to_string())


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(int(sys.argv[2]) if len(sys.argv) > 2 else 1, int(sys.argv[3]) if len(sys.argv) > 3 else 3)
    else:
        summary(sys.argv[2], sys.argv[3])
