"""ddbench.kernels.select: the one explicit kernel choice, its `--kernels` text, what it
resolves to on a machine, and that it reaches the model and the sidecars."""
import dataclasses
import json

import pytest
import torch
from typer.testing import CliRunner

from ddbench.cli import app
from ddbench.kernels import gemv, mla_attn, mla_decode, pdl, skinny
from ddbench.kernels.select import GEMV_CALLS, KernelChoice, KernelChoiceError, resolve

runner = CliRunner()


def test_defaults_are_the_measured_choice():
    k = KernelChoice()
    assert (k.moe, k.attn, k.pdl, k.route, k.gemv, k.skinny, k.stream) == (
        "auto", "auto", "on", "fused", frozenset({"rope"}), skinny.MAX_ROWS, "on")
    assert KernelChoice.parse("") == KernelChoice.parse("default") == k
    assert k.pdl_mode == 2 and k.fuse_route and k.side_stream and k.attn_streams() == mla_decode.MAX_STREAMS


@pytest.mark.parametrize("text", ["moe=gemv,attn=cluster,pdl=wait", "gemv=none,skinny=0,stream=off,route=separate",
                                  "gemv=norm+head+linear,attn=split,pdl=off,moe=marlin", "skinny=16"])
def test_text_round_trip(text):
    k = KernelChoice.parse(text)
    assert KernelChoice.parse(str(k)) == k
    for item in text.split(","):                       # every field given is the one in force
        key, _, value = item.partition("=")
        if key == "gemv":
            want = frozenset() if value == "none" else frozenset(value.split("+"))
        else:
            want = int(value) if key == "skinny" else value
        assert getattr(k, key) == want, (key, getattr(k, key), want)
    with pytest.raises(dataclasses.FrozenInstanceError):
        k.attn = "split"


def test_modes_and_streams():
    assert [KernelChoice(pdl=p).pdl_mode for p in ("on", "wait", "off")] == [2, 1, 0]
    assert KernelChoice(attn="cluster").attn_streams() is None and KernelChoice(attn="split").attn_streams() == 0
    assert not KernelChoice(route="separate").fuse_route and not KernelChoice(stream="off").side_stream


@pytest.mark.parametrize("text,message", [
    ("attn=foo", "attn='foo'"), ("moe=cutlass", "moe='cutlass'"), ("pdl=1", "pdl='1'"),
    ("gemv=rope+wq", "wq"), ("skinny=-1", "skinny=-1"), ("skinny=17", "skinny=17"), ("skinny=x", "row count"),
    ("speed=max", "FIELD=VALUE"), ("attn", "FIELD=VALUE"), ("pdl=on,pdl=off", "twice"), ("stream=yes", "stream"),
])
def test_bad_text_is_refused(text, message):
    with pytest.raises(KernelChoiceError, match=message.replace("+", r"\+")):
        KernelChoice.parse(text)


def test_resolve_on_cpu_falls_back_and_carries_the_tiles():
    k = KernelChoice.parse("attn=cluster,gemv=rope+add,pdl=wait")
    r = resolve(k, "cpu")
    assert r["requested"] == str(k) and r["device"] == "cpu"
    # no GPU: no PDL, no cluster attention, no CUDA GEMV, no skinny path (so no fused route, no side stream)
    assert (r["pdl"], r["attn"], r["gemv"], r["skinny_rows"], r["route"], r["stream"]) == (
        "off", "split", "none", 0, "separate", "off")
    t = r["tiles"]
    assert t["skinny"]["tile_values"] == skinny.TILE_VALUES and t["gemv"]["warps"] == gemv.WARPS
    assert t["mla_attn"]["max_chunks"] == mla_attn.MAX_CHUNKS and t["mla_decode"]["max_positions"] == mla_decode.MAX_POSITIONS
    json.dumps(r)                                       # goes into a JSON sidecar as it is


@pytest.mark.gpu
def test_gpu_resolve_keeps_what_the_gpu_runs():
    dev = torch.device("cuda")
    if not pdl.hopper(torch.empty(1, device=dev)):
        pytest.skip("needs sm_90+")
    r = resolve(KernelChoice.parse("gemv=rope+norm,attn=auto"), dev)
    assert (r["pdl"], r["gemv"], r["skinny_rows"], r["route"]) == ("on", "norm+rope", 4, "fused")
    assert r["attn"].startswith("cluster up to 1")
    assert resolve(KernelChoice(pdl="off", gemv=frozenset(GEMV_CALLS)), dev)["gemv"] == "none"


def test_the_model_hands_its_choice_to_every_layer():
    from ddbench.engine.config import preset
    from ddbench.engine.model import Transformer

    k = KernelChoice.parse("gemv=head,stream=off,attn=split")
    m = Transformer(preset("tiny"), device="meta", fused="torch", kernels=k)
    layers = [mod for mod in m.modules() if hasattr(mod, "kernels")]
    assert m.kernels is k and m.ops.kernels is k and len(layers) > 10 and all(mod.kernels is k for mod in layers)
    assert not any(blk.attn.one_launch for blk in m.layers)
    assert m.ops.side_stream(torch.empty(1)) is None
    assert Transformer(preset("tiny"), device="meta", fused="torch").kernels == KernelChoice()


def test_skinny_calls_off_the_gpu_ignore_gpu_only_choices():
    """On CPU `linear` is cuBLAS's meaning whatever the choice: kernels.gemv and the skinny
    path need a GPU (the choice decides only where they could run)."""
    g = torch.Generator().manual_seed(5)
    x, w, a = torch.randn(2, 64, generator=g), torch.randn(48, 64, generator=g), torch.randn(2, 48, generator=g)
    for kw in ({}, {"cuda_gemv": True, "pdl_mode": 2}, {"max_rows": 0}, {"max_rows": 16, "pdl_mode": 1}):
        torch.testing.assert_close(skinny.linear(x, w, **kw), x @ w.T)
        torch.testing.assert_close(skinny.linear(x, w, a, **kw), a + x @ w.T)
    assert not skinny.fits(x, w, max_rows=16)           # CPU tensors never fit


def test_cli_refuses_a_bad_choice_before_writing(tmp_path):
    for cmd in (["decode"], ["e2e"], ["env"]):
        r = runner.invoke(app, [*cmd, "--kernels", "attn=fast", *(["--out", str(tmp_path)] if cmd != ["env"] else [])])
        assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1 and "attn='fast'" in r.output, r.output
    assert list(tmp_path.iterdir()) == []


def test_env_prints_the_resolved_choice(tmp_path):
    r = runner.invoke(app, ["env", "--kernels", "gemv=none,skinny=2", "--json", str(tmp_path / "env.json")])
    assert r.exit_code == 0, r.output
    assert "kernel choice on" in r.output and "skinny=2" in r.output
    k = json.loads((tmp_path / "env.json").read_text())["kernels"]
    assert k["requested"] == str(KernelChoice(gemv=frozenset(), skinny=2)) and "tiles" in k


def test_decode_sidecar_and_rows_record_the_choice(tmp_path):
    text = "moe=torch,pdl=wait,gemv=rope+add"
    r = runner.invoke(app, ["decode", "--preset", "tiny", "--concurrency", "1,2", "--prompt-len", "4",
                            "--new-tokens", "2", "--no-graph", "--kernels", text, "--name", "k", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    meta = json.loads((tmp_path / "k.json").read_text())
    k = KernelChoice.parse(text)
    assert meta["kernels"]["requested"] == str(k) and meta["kernels"]["device"] == "cpu"
    assert meta["kernels"]["tiles"]["skinny"]["num_warps"] == skinny.NUM_WARPS
    assert meta["kernels"]["moe"] == "torch (reference backend)"    # the CPU's torch MoE backend
    import pandas as pd

    assert set(pd.read_csv(tmp_path / "k.csv")["kernels"]) == {str(k)}
