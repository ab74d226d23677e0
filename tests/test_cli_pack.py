"""`ddbench pack`, `env`, `report` and the shared CLI behaviour, through typer's runner."""
import json
import re

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from ddbench.cli import app
from ddbench.kernels import marlin

runner = CliRunner()


def test_help_lists_commands():
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0
    for cmd in ("env", "pack", "report"):
        assert cmd in r.output
    r = runner.invoke(app, ["pack", "--help"])
    assert r.exit_code == 0 and "--verify" in r.output


def test_pack_tiny_tp8_writes_verified_marlin(tmp_path):
    r = runner.invoke(app, ["pack", "--preset", "tiny", "--tp", "8", "--rank", "5", "--layers", "all",
                            "--verify", "--save-checkpoint", "--device", "cpu", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    (d,) = tmp_path.iterdir()
    manifest = json.loads((d / "manifest.json").read_text())
    assert manifest["tp"] == 8 and manifest["rank"] == 5 and set(manifest["layers"]) == {"1", "2"}
    assert all(L["verified"] for L in manifest["layers"].values())
    t = load_file(str(d / "layer01.marlin.safetensors"))
    w13 = t["model.layers.1.mlp.experts.w13"]
    assert tuple(w13.shape) == (16, 256 // 16, 4 * 32)
    # the Marlin shard holds rank 5's slice of the checkpoint's gate rows
    ck = load_file(str(d / "layer01.checkpoint.safetensors"))
    from ddbench.kernels import ctensors
    q_gate, _ = ctensors.from_checkpoint({k.split(".")[-1]: v for k, v in ck.items()
                                          if k.startswith("model.layers.1.mlp.experts.3.gate_proj.")})
    logical = marlin.unpack(w13[3], 256, 64)
    assert torch.equal(logical[:, :32], q_gate[5 * 32:6 * 32].t())
    assert not list(d.glob("*.partial"))


@pytest.mark.parametrize("args,message", [
    (["-o", "hidden=200"], "multiple of 16"),
    (["-o", "moe_inter=80"], "multiple of 64"),
    (["--group-size", "48"], "does not divide"),
    (["--preset", "nope"], "unknown preset"),
    (["--layers", "0"], "not MoE layers"),
])
def test_pack_bad_input_one_line_exit_2_no_files(tmp_path, args, message):
    out = tmp_path / "out"
    r = runner.invoke(app, ["pack", "--preset", "tiny", "--device", "cpu", "--out", str(out), *args])
    assert r.exit_code == 2
    assert message in r.output and len(r.output.strip().splitlines()) == 1
    assert not out.exists() or not any(out.iterdir())


def test_pack_unwritable_out(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = runner.invoke(app, ["pack", "--preset", "tiny", "--out", str(blocker / "sub")])
    assert r.exit_code == 2 and "cannot write" in r.output


def test_env_runs_and_says_no_gpu(tmp_path):
    r = runner.invoke(app, ["env", "--json", str(tmp_path / "env.json")])
    assert r.exit_code == 0
    facts = json.loads((tmp_path / "env.json").read_text())
    assert "torch" in facts
    if not torch.cuda.is_available():
        assert "No NVIDIA GPU" in r.output


def test_report_on_empty_folder(tmp_path):
    r = runner.invoke(app, ["report", str(tmp_path), "--out", str(tmp_path / "rep")])
    assert r.exit_code == 0, r.output
    assert re.search(r"No .* found", (tmp_path / "rep" / "report.md").read_text())
    r = runner.invoke(app, ["report", str(tmp_path / "missing")])
    assert r.exit_code == 2
