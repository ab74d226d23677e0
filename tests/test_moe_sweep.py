"""`ddbench moe-sweep` on the CPU: CSV columns, the triton backend under the interpreter,
bad input, and the report plots."""
import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from ddbench.cli import app

runner = CliRunner()
FAST = ["--reps", "1", "--warmup", "0"]


def only_csv(path):
    (csv,) = [p for p in path.rglob("*.csv")]
    return csv, json.loads(csv.with_suffix(".json").read_text())


def test_cpu_default_runs_tiny_torch(tmp_path):
    r = runner.invoke(app, ["moe-sweep", "--device", "cpu", "--tokens", "1,3,64", "--out", str(tmp_path),
                            "--routing", "uniform,balanced", *FAST])
    assert r.exit_code == 0, r.output
    assert "tiny preset on the CPU" in r.output
    csv, meta = only_csv(tmp_path)
    assert csv.name.endswith("_tp8.csv") and csv.parent.name == "moe-sweep" and meta["completed"] and meta["preset"] == "tiny"
    df = pd.read_csv(csv)
    for col in ("backend", "stage", "tp", "tokens", "routing", "experts_touched", "bytes_moved", "flops",
                "time_us", "time_us_p20", "time_us_p80", "achieved_gbps", "pct_of_copy_bw", "tflops",
                "pct_of_gemm_peak", "us_per_token", "cuda_graph", "floor_bytes_us", "floor_compute_us"):
        assert col in df, col
    assert set(df["stage"]) == {"layer", "w13", "w2"} and set(df["backend"]) == {"torch"}
    lay = df[(df.stage == "layer") & (df.routing == "uniform")].set_index("tokens")
    # bytes grow with experts touched; balanced routing touches at least as many
    assert lay.loc[64, "bytes_moved"] > lay.loc[1, "bytes_moved"]
    bal = df[(df.stage == "layer") & (df.routing == "balanced")].set_index("tokens")
    assert (bal["experts_touched"] >= lay["experts_touched"]).all()
    assert lay.loc[64, "flops"] == 2 * 64 * 4 * 3 * 256 * 32


def test_triton_backend_interpreter_with_check(tmp_path):
    # tiny narrowed for the interpreter (30-40 s -> about 10 s on 2 CPU cores): hidden 128, 8 experts,
    # top-2, so the same tokens a expert as tiny's 16 experts top-4 (the same three tile paths)
    small = ["-o", "hidden=128", "-o", "n_experts=8", "-o", "top_k=2"]
    r = runner.invoke(app, ["moe-sweep", "--device", "cpu", "--backends", "triton", "--tokens", "1,6,48",
                            "--tp", "8", "--check", "--routing", "skewed", "--hot", "4", "--name", "t1", "--out", str(tmp_path),
                            *small, *FAST])
    assert r.exit_code == 0, r.output
    assert "interpreter" in r.output
    df = pd.read_csv(tmp_path / "t1.csv")
    assert json.loads((tmp_path / "t1.json").read_text())["config"]["n_experts"] == 8
    lay = df[df.stage == "layer"].set_index("tokens")
    err = lay["rel_err"].astype(float)
    # 8 experts, top-2: T=1 one row a block, T=6 (1.5 a expert) 16-row sorted blocks, both
    # the CUDA-core kernels (fp16 activations); T=48 (12 a expert) the tl.dot kernel (fp32 here)
    assert len(lay) == 3 and err[1] < 2e-3 and err[6] < 2e-3 and err[48] < 1e-4
    assert lay.loc[1, "tile"].startswith("gemv-m1n") and lay.loc[6, "tile"].startswith("gemv-m16")
    assert lay.loc[48, "tile"].startswith("m32")
    assert list(lay["kernel"]) == ["gemv", "gemv", "triton"]
    assert "marlin" in json.loads((tmp_path / "t1.json").read_text())["kernel_rule"]
    assert set(df[df.tokens == 1].stage) >= {"layer", "w13", "w2"}


@pytest.mark.parametrize("args,message", [
    (["--tokens", "0"], "must be positive"),
    (["--tokens", "a,b"], "cannot read"),
    (["--backends", "cuda"], "unknown cuda"),
    (["--routing", "zipf"], "unknown zipf"),
    (["--preset", "tiny", "-o", "hidden=200"], "multiple of 16"),
    (["--preset", "tiny", "-o", "moe_inter=96"], "multiple of 64"),
    (["--preset", "nope"], "unknown preset"),
    (["--hot-share", "1.5"], "hot-share"),
    (["--kernel", "cutlass"], "unknown cutlass"),
    (["--kernel", "marlin,triton"], "--kernel takes one"),
])
def test_bad_input_one_line_exit_2(tmp_path, args, message):
    r = runner.invoke(app, ["moe-sweep", "--device", "cpu", "--out", str(tmp_path / "o"), *FAST, *args])
    assert r.exit_code == 2, r.output
    assert message in r.output and len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists() or not list((tmp_path / "o").rglob("*.csv"))


def test_tiles_file_and_report_plots(tmp_path):
    tiles = tmp_path / "tiles.json"
    tiles.write_text(json.dumps([{"max_per_expert": 1, "block_m": 16, "block_n13": 32, "block_n2": 64},
                                 {"max_per_expert": 99, "block_m": 32, "block_k2": 32}]))
    out = tmp_path / "res"
    r = runner.invoke(app, ["moe-sweep", "--device", "cpu", "--tokens", "1,2,8", "--tiles", str(tiles),
                            "--out", str(out), *FAST])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["report", str(out), "--out", str(tmp_path / "rep")])
    assert r.exit_code == 0, r.output
    names = sorted(p.name for p in (tmp_path / "rep").glob("*.png"))
    assert any(n.endswith("_time.png") for n in names)
    bad = tmp_path / "bad.json"
    bad.write_text('[{"max_per_expert": 1, "block_q": 3}]')
    r = runner.invoke(app, ["moe-sweep", "--device", "cpu", "--tiles", str(bad), "--out", str(out), *FAST])
    assert r.exit_code == 2 and "--tiles" in r.output
