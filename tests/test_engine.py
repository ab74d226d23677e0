"""Engine core on the tiny preset: model, KV cache, TP, weights, checkpoints (CPU)."""
from __future__ import annotations

import pytest
import torch

from ddbench.engine.config import preset
from ddbench.engine.kv_cache import KVCache
from ddbench.engine.model import Transformer, causal_visible
from ddbench.engine.parallel import SimComm
from ddbench.engine.weights import init_random


def tiny_model(tp=1, rank=0, comm=None, seed=0, **over):
    cfg = preset("tiny", tp=tp, rank=rank, **over)
    m = Transformer(cfg, comm, dtype=torch.float32)
    init_random(m, seed, mode="exact")
    return m


def run(model, tokens, max_len=32):
    b, t = tokens.shape
    dev = tokens.device
    cache = model.new_cache(b, max_len)
    pos = torch.arange(t, device=dev).expand(b, t)
    with torch.no_grad():
        return model(tokens, pos, cache, torch.zeros(b, dtype=torch.int32, device=dev),
                     causal_visible(b, t, dev))[0]


def test_one_by_one_equals_causal_forward():
    m = tiny_model()
    b, t = 2, 6
    tok = torch.randint(0, m.cfg.vocab, (b, t), generator=torch.Generator().manual_seed(1))
    full = run(m, tok)
    cache = m.new_cache(b, 16)
    plen = torch.zeros(b, dtype=torch.int32)
    steps = []
    with torch.no_grad():
        for j in range(t):
            lg, _ = m(tok[:, j:j + 1], plen.long().view(b, 1), cache, plen, torch.ones(b, 1, 1, dtype=torch.bool))
            steps.append(lg)
            plen += 1
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)
    assert full.isfinite().all() and 0.3 < full.std() < 3


def test_hidden_layers_are_block_outputs():
    m = tiny_model()
    tok = torch.randint(0, m.cfg.vocab, (1, 4))
    cache = m.new_cache(1, 8)
    vis = causal_visible(1, 4)
    pos = torch.arange(4).view(1, 4)
    with torch.no_grad():
        lg, hid = m(tok, pos, cache, torch.zeros(1, dtype=torch.int32), vis, hidden_layers=(2, 0))
        assert hid.shape == (1, 4, 2, m.cfg.hidden)
        # the last block's output through the head gives the logits
        torch.testing.assert_close(m.logits(hid[:, :, 0]), lg)


def test_deep_random_model_stays_sane():
    """61 layers of random weights: finite logits of unit-ish size (weights docstring)."""
    m = tiny_model(n_layers=61, n_experts=8, top_k=2)
    cache = m.new_cache(1, 4)
    with torch.no_grad():
        lg, hid = m(torch.randint(0, m.cfg.vocab, (1, 2)), torch.arange(2).view(1, 2), cache,
                    torch.zeros(1, dtype=torch.int32), causal_visible(1, 2), hidden_layers=(0, 60))
    assert lg.isfinite().all() and 0.3 < lg.std() < 3
    rms = hid.pow(2).mean(-1).sqrt().mean((0, 1))   # residual RMS after blocks 0 and 60
    assert 0.8 < rms[0] < 1.2 and rms[0] < rms[1] < 2.0, rms


def test_kv_commit_moves_accepted_nodes_in_every_layer():
    cfg = preset("tiny")
    c = KVCache(cfg, 2, 12, dtype=torch.float32)
    c.ckv.normal_()
    c.kpe.normal_()
    ckv0, kpe0 = c.ckv.clone(), c.kpe.clone()
    plen = torch.tensor([3, 5])
    acc = torch.tensor([[0, 2, 5], [0, 1, -1]])
    c.commit(plen, acc)
    for layer in range(cfg.n_layers):
        for b, (p, nodes) in enumerate(zip(plen.tolist(), acc.tolist())):
            for i, j in enumerate(nodes):
                src = j if j >= 0 else i  # padded entries keep their old value
                torch.testing.assert_close(c.ckv[layer, b, p + i], ckv0[layer, b, p + src])
                torch.testing.assert_close(c.kpe[layer, b, p + i], kpe0[layer, b, p + src])
            torch.testing.assert_close(c.ckv[layer, b, :p], ckv0[layer, b, :p])


def test_simulated_rank_runs_and_models_comm():
    calls = []
    comm = SimComm(2, 0, lambda n: calls.append(n) or 5.0)
    m = tiny_model(tp=2, rank=0, comm=comm)
    lg = run(m, torch.randint(0, 1024, (2, 3)))
    assert lg.shape == (2, 3, 1024) and lg.isfinite().all()
    # embedding + 2 per layer + logits gather
    assert comm.calls == 2 + 2 * m.cfg.n_layers
    assert comm.modelled_us == pytest.approx(5.0 * (comm.calls - 1) + 2.5)


def test_shard_init_replicates_what_is_replicated():
    a, b = (tiny_model(tp=2, rank=r, comm=SimComm(2, r, lambda n: 0.0)) for r in (0, 1))
    for r, m in enumerate((a, b)):
        init_random(m, 0, mode="shard")
    wa, wb = a.hf_weights(), b.hf_weights()
    for name, (t, split) in wa.items():
        same = torch.equal(t, wb[name][0])
        assert same == (split is None), name
    for moe_a, moe_b in zip(a.moe_blocks().values(), b.moe_blocks().values()):
        assert not torch.equal(moe_a.w13, moe_b.w13)


# ---- tensor parallelism over gloo ------------------------------------------------------

def _tp_worker(rank, tp, port, tokens, out_path):
    import datetime
    import os

    import torch.distributed as dist

    from ddbench.engine.parallel import DistComm

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=tp, timeout=datetime.timedelta(seconds=60))
    try:
        m = tiny_model(tp=tp, rank=rank, comm=DistComm())
        logits = run(m, tokens)
        if rank == 0:
            torch.save(logits, out_path)
    finally:
        dist.destroy_process_group()


def test_tp2_gloo_equals_tp1(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tokens = torch.randint(0, 1024, (2, 5), generator=torch.Generator().manual_seed(2))
    out = tmp_path / "tp2.pt"
    mp.spawn(_tp_worker, args=(2, port, tokens, str(out)), nprocs=2, join=True)
    torch.testing.assert_close(torch.load(out), run(tiny_model(), tokens), rtol=1e-4, atol=1e-4)


# ---- MoE backends ----------------------------------------------------------------------

def test_triton_moe_path_equals_reference():
    pytest.importorskip("ddbench.kernels.moe_triton")
    ref = tiny_model()
    tri = Transformer(ref.cfg, moe_backend="triton", dtype=torch.float32)
    tri.load_state_dict(ref.state_dict())
    tokens = torch.randint(0, 1024, (1, 3), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(run(tri, tokens), run(ref, tokens), rtol=2e-3, atol=2e-3)


def test_fused_triton_ops_model_equals_torch_ops():
    """The GPU path's fused kernels (kernels.fused_ops, interpreted here) give the same logits."""
    ref = tiny_model()
    if torch.cuda.is_available():  # real Triton needs GPU tensors (the interpreter runs on CPU)
        ref = ref.cuda()
    tri = Transformer(ref.cfg, dtype=torch.float32, fused="triton", device=ref.device)
    tri.load_state_dict(ref.state_dict())
    b, t = 2, 3
    tokens = torch.randint(0, 1024, (b, t), generator=torch.Generator().manual_seed(6)).to(ref.device)
    torch.testing.assert_close(run(tri, tokens), run(ref, tokens), rtol=1e-4, atol=1e-4)
    # and a decode step on top of a prefix (positions and cache offsets != 0)
    caches = [m.new_cache(b, 8) for m in (ref, tri)]
    plen = torch.tensor([3, 5], dtype=torch.int32, device=ref.device)
    outs = []
    with torch.no_grad():
        for m, c in zip((ref, tri), caches):
            c.ckv.copy_(torch.randn(c.ckv.shape, generator=torch.Generator().manual_seed(7)))
            c.kpe.copy_(torch.randn(c.kpe.shape, generator=torch.Generator().manual_seed(8)))
            vis = torch.ones(b, 1, 1, dtype=torch.bool, device=ref.device)
            outs.append(m(tokens[:, :1], plen.long().view(b, 1), c, plen, vis)[0])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(caches[1].ckv, caches[0].ckv)


# ---- checkpoints -----------------------------------------------------------------------

from typer.testing import CliRunner  # noqa: E402

from ddbench.cli import app  # noqa: E402

runner = CliRunner()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt") / "tiny-hf"
    r = runner.invoke(app, ["pack", "--preset", "tiny", "--hf-dir", str(d), "--seed", "5"])
    assert r.exit_code == 0, r.output
    return d


def test_packed_checkpoint_loads_to_identical_logits(hf_dir):
    from ddbench.engine.checkpoint import load_checkpoint

    tokens = torch.randint(0, 1024, (2, 4), generator=torch.Generator().manual_seed(3))
    loaded = load_checkpoint(hf_dir, dtype=torch.float32)
    assert torch.equal(run(loaded, tokens), run(tiny_model(seed=5), tokens))
    # rank 1 of 2 loads the same slice the random init gives it
    comm = SimComm(2, 1, lambda n: 0.0)
    a = load_checkpoint(hf_dir, tp=2, rank=1, comm=comm, dtype=torch.float32)
    b = tiny_model(tp=2, rank=1, comm=comm, seed=5)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k


def test_nested_config_and_rope_parameters(hf_dir, tmp_path):
    """K2.6's multimodal config nests the text model under text_config; newer tools write
    rope_parameters instead of rope_scaling."""
    import json
    import shutil

    from ddbench.engine.checkpoint import read_config

    d = tmp_path / "nested"
    shutil.copytree(hf_dir, d)
    hf = json.loads((d / "config.json").read_text())
    rope = hf.pop("rope_scaling")
    text = {**hf, "rope_parameters": {"rope_type": "yarn", "rope_theta": hf.pop("rope_theta"),
                                      **{k: v for k, v in rope.items() if k != "type"}}}
    (d / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": text,
                                               "quantization_config": hf["quantization_config"]}))
    a, b = read_config(d), read_config(hf_dir)
    assert {**a.to_dict(), "name": 0} == {**b.to_dict(), "name": 0}


def _corrupt(src, dst, tensor=None, fn=None, config=None):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if tensor is not None:
        idx = json.loads((dst / "model.safetensors.index.json").read_text())
        f = dst / idx["weight_map"][tensor]
        ts = load_file(str(f))
        new = fn(ts.pop(tensor))
        if new is not None:
            ts[tensor] = new
        save_file(ts, str(f))
    if config is not None:
        hf = json.loads((dst / "config.json").read_text())
        hf.update(config)
        (dst / "config.json").write_text(json.dumps(hf))
    return dst


@pytest.mark.parametrize("case, tensor, fn, config, needle", [
    ("missing", "model.layers.1.self_attn.kv_b_proj.weight", lambda t: None, None,
     "missing tensor model.layers.1.self_attn.kv_b_proj.weight"),
    ("shape", "model.layers.2.mlp.shared_experts.down_proj.weight", lambda t: t[:, :-16].contiguous(), None,
     "model.layers.2.mlp.shared_experts.down_proj.weight: shape"),
    ("dtype", "model.layers.0.self_attn.q_a_proj.weight", lambda t: t.float(), None,
     "model.layers.0.self_attn.q_a_proj.weight: dtype F32"),
    ("expert", "model.layers.1.mlp.experts.3.up_proj.weight_packed", lambda t: t.to(torch.int64), None,
     "model.layers.1.mlp.experts.3.up_proj.weight_packed: dtype I64"),
    ("config", None, None, {"q_lora_rank": 128}, "model.layers.0.self_attn.q_a_proj.weight: shape"),
    ("experts", None, None, {"n_routed_experts": 32}, "model.layers.1.mlp.gate.weight: shape [16, 256]"),
    ("expert-missing", "model.layers.2.mlp.experts.7.down_proj.weight_scale", lambda t: None, None,
     "missing tensor model.layers.2.mlp.experts.7.down_proj.weight_scale"),
    ("weight-shape", "model.layers.1.mlp.experts.0.gate_proj.weight_shape", lambda t: t * 2, None,
     "model.layers.1.mlp.experts.0.gate_proj.weight_shape: [512, 512]"),
])
def test_corrupt_checkpoint_is_one_line_error(hf_dir, tmp_path, case, tensor, fn, config, needle):
    bad = _corrupt(hf_dir, tmp_path / case, tensor, fn, config)
    r = runner.invoke(app, ["decode", "--checkpoint", str(bad), "--concurrency", "1", "--prompt-len", "2",
                            "--new-tokens", "2", "--out", str(tmp_path / "out")])
    assert r.exit_code == 2, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], r.output


# ---- decoding --------------------------------------------------------------------------

def test_decoder_greedy_matches_forward_argmax():
    from ddbench.engine.decode import Decoder, measure_decode

    m = tiny_model()
    prompts = torch.randint(0, 1024, (2, 4), generator=torch.Generator().manual_seed(0))
    got = Decoder(m, 2, 16).generate(prompts, 4)
    seq = prompts
    for _ in range(4):  # full recompute each token
        nxt = run(m, seq)[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    assert torch.equal(got, seq[:, 4:])
    # the timing passes (phase-timed eager step) do not change the output
    assert torch.equal(measure_decode(m, 2, 4, 4, seed=0)["tokens"], got)


def test_decode_cli_writes_tidy_csv_and_plot(tmp_path):
    import pandas as pd

    from ddbench.report import run as report

    r = runner.invoke(app, ["decode", "--preset", "tiny", "--tp", "2", "--simulate-rank", "1",
                            "--concurrency", "1,3", "--prompt-len", "3", "--new-tokens", "3",
                            "--allreduce-model", "lat_us=10,busbw_gbps=100", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    df = pd.read_csv(next(tmp_path.glob("*/decode/*.csv")))
    assert list(df.concurrency) == [1, 3] and (df["mode"] == "simulated").all()
    for col in ("output_tok_per_s", "step_us", "attention_us", "moe_us", "mlp_us", "comm_us", "lm_head_us",
                "weight_bytes", "kv_bytes"):
        assert (df[col] >= 0).all(), col
    assert (df.comm_us > 2 * 3 * 10).all()  # >= 2 all-reduces per layer of >= 10 us each
    assert (df.step_total_us > df.step_us).all()
    report([tmp_path], tmp_path / "rep", "png")
    assert (tmp_path / "rep" / "decode_phases.png").exists()


def test_decode_cli_bad_input(tmp_path):
    for args, msg in [(["--tp", "2", "--simulate-rank", "2"], "--simulate-rank"),
                      (["--new-tokens", "1"], "--new-tokens"),
                      (["--checkpoint", str(tmp_path / "nope")], "no such directory"),
                      (["--override", "hidden=65536", "--override", "n_layers=64"], "GB free")]:
        r = runner.invoke(app, ["decode", "--preset", "tiny", *args, "--out", str(tmp_path)])
        assert r.exit_code == 2 and msg in r.output, r.output


# ---- GPU ---------------------------------------------------------------------------------

def gpu_model(batch_dtype=torch.bfloat16, kernels=None, **over):
    cfg = preset("tiny", **over)
    m = Transformer(cfg, moe_backend="triton", attn_backend="triton", device="cuda", dtype=batch_dtype,
                    kernels=kernels)
    init_random(m, 0)
    return m


@pytest.mark.gpu
def test_gpu_graph_decode_equals_eager_and_times_phases():
    from ddbench.engine.decode import Decoder, measure_decode

    m = gpu_model(torch.float32)  # fp32: split-K atomics cannot flip a token between runs
    assert m.ops.kind == "triton"
    prompts = torch.randint(0, 1024, (3, 5), generator=torch.Generator().manual_seed(0))
    eager = Decoder(m, 3, 32, use_graph=False).generate(prompts, 8)
    graph_dec = Decoder(m, 3, 32, use_graph=True)
    graph = graph_dec.generate(prompts, 8)
    assert graph_dec.graph is not None and torch.equal(eager, graph)
    r = measure_decode(m, 3, 5, 8, seed=0)
    assert r["cuda_graph"] and torch.equal(r["tokens"], graph.cpu())
    assert r["phase_method"] == "graph", r
    total = sum(r["phases_us"].values())
    assert 0.3 * r["step_us"] < total < 3 * r["step_us"], (total, r)


@pytest.mark.gpu
def test_gpu_side_stream_gives_the_same_logits(monkeypatch):
    """The shared expert's gate/up GEMM on a side stream (the kernel choice's stream=on, skinny
    path: bf16, few rows) changes the schedule, not the maths: the same logits bit for bit
    as on one stream (stream=off, same weights), and the same graph-decoded tokens."""
    from ddbench.engine.decode import Decoder
    from ddbench.kernels.select import KernelChoice

    m = gpu_model()
    asked = []
    side_stream = m.ops.side_stream
    monkeypatch.setattr(m.ops, "side_stream", lambda x: asked.append(x.shape) or side_stream(x))
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 1024, (1, 1), generator=gen).cuda()   # 1 row: skinny + CUDA-core MoE
    prompts = torch.randint(0, 1024, (1, 5), generator=gen)
    on = run(m, tokens)
    assert asked, "the MoE never asked for the side stream"
    on_tokens = Decoder(m, 1, 32, use_graph=True).generate(prompts, 6)
    one = gpu_model(kernels=KernelChoice(stream="off"))
    assert one.ops.side_stream(tokens.float()) is None
    assert torch.equal(run(one, tokens), on)
    assert torch.equal(Decoder(one, 1, 32, use_graph=True).generate(prompts, 6), on_tokens)


@pytest.mark.gpu
def test_gpu_bf16_model_close_to_fp32_reference():
    """The GPU path (bf16, Triton MoE/attention/fused ops) against the fp32 torch path."""
    ref = tiny_model()
    m = gpu_model()
    m.load_state_dict({k: v.to(m.state_dict()[k].dtype) for k, v in ref.state_dict().items()})
    tokens = torch.randint(0, 1024, (2, 6), generator=torch.Generator().manual_seed(1))
    a = run(ref, tokens)
    b = run(m, tokens.cuda()).cpu()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8
    assert (a - b).abs().max() < 0.2 * a.abs().max()


@pytest.mark.gpu
def test_gpu_simulated_rank_decode_cli(tmp_path):
    import pandas as pd

    r = runner.invoke(app, ["decode", "--preset", "tiny", "--tp", "2", "--simulate-rank", "0",
                            "--concurrency", "1,4", "--prompt-len", "8", "--new-tokens", "8", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    df = pd.read_csv(next(tmp_path.glob("*/decode/*.csv")))
    assert df.cuda_graph.all() and (df.phase_method == "graph").all() and (df.floor_us > 0).all()


def test_prefixed_checkpoint_names_load(hf_dir, tmp_path):
    """Multimodal K2.x checkpoints keep the text model under a prefix (language_model.)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from ddbench.engine.checkpoint import load_checkpoint

    d = tmp_path / "prefixed"
    shutil.copytree(hf_dir, d)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    for f in set(idx["weight_map"].values()):
        save_file({"language_model." + k: v for k, v in load_file(str(d / f)).items()}, str(d / f))
    idx["weight_map"] = {"language_model." + k: v for k, v in idx["weight_map"].items()}
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    tokens = torch.randint(0, 1024, (1, 3))
    assert torch.equal(run(load_checkpoint(d, dtype=torch.float32), tokens), run(tiny_model(seed=5), tokens))


def test_phase_timer_attributes_nested_and_merged_phases():
    import time

    from ddbench.engine.phases import PhaseTimer, phase

    for merge in (False, True):
        t = PhaseTimer("cpu", merge=merge)
        with t.active():
            with phase("a"):
                time.sleep(0.02)
                with phase("comm"):
                    time.sleep(0.03)
                time.sleep(0.01)
            with phase("b"):
                time.sleep(0.02)
        us = t.totals_us()
        assert 25e3 < us["a"] < 45e3 and 25e3 < us["comm"] < 45e3 and 15e3 < us["b"] < 35e3, us
        assert us.get("other", 0) < 5e3
        assert len(t.marks) == (6 if merge else 8)
