"""`ddbench baseline` against a real OpenAI-compatible server that no one here wrote:
Hugging Face's `transformers serve` (the `serve` extra), on 127.0.0.1, serving a tiny random
Llama and a word-level tokenizer that the test builds locally (nothing is downloaded).

That server ends its streams after the usage chunk without `data: [DONE]` and rejects
`ignore_eos` (HTTP 422), so these tests cover the stream-end rule and the standard-fields
fallback on both endpoints, at concurrency 1 and 4, a server killed mid-run, and the
client's timings against a timestamping TCP relay between client and server.

The model never ends early: channel 0 of its residual stream is a constant > 0 and only the
end-of-sequence row of the output head reads it, with a large negative weight, so every
request yields exactly max_tokens tokens and the server's counts can be checked exactly.
Every process (builder, servers) runs with a temporary folder as its working directory.
"""
import contextlib
import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

import httpx
import pytest

from ddbench import baseline as bl

sys.path.insert(0, str(Path(__file__).parent))
from stream_server import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MISSING = [m for m in ("transformers", "fastapi", "uvicorn") if find_spec(m) is None]
pytestmark = [
    pytest.mark.server, pytest.mark.slow,
    pytest.mark.skipif(bool(MISSING), reason=f"needs the serve extra ({', '.join(MISSING)} missing): "
                                             "pip install -e '.[serve]'"),
]
START_S = 180  # a loaded 2-core box needs ~30 s to import transformers and load the model

BUILD = r'''
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

out, words, seed = Path(sys.argv[1]), sys.argv[2].split(), int(sys.argv[3])
vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>"] + sorted(set(words)))}
tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tok.decoder = decoders.WordPiece()
fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
fast.save_pretrained(out)
torch.manual_seed(seed)
cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
model = LlamaForCausalLM(cfg)
with torch.no_grad():  # never end early (see the module docstring)
    model.model.embed_tokens.weight[:, 0] = 4.0
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight[0] = 0
        layer.mlp.down_proj.weight[0] = 0
    model.model.norm.weight[0] = 1.0
    model.lm_head.weight[:, 0] = 0
    model.lm_head.weight[2] = 0
    model.lm_head.weight[2, 0] = -100.0
model.save_pretrained(out)
'''


def _env():
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    work = tmp_path_factory.mktemp("tiny_llama")
    seed = int.from_bytes(os.urandom(2), "little")  # fresh random weights each run
    subprocess.run([sys.executable, "-c", BUILD, str(work / "model"), " ".join(bl.WORDS), str(seed)],
                   cwd=work, env=_env(), check=True, capture_output=True, timeout=120)
    return work / "model"


class Serve:
    """`transformers serve MODEL` on a free loopback port, in its own process group."""

    def __init__(self, model: Path, cwd: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(cwd / f"serve_{self.port}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from transformers.cli.transformers import main; main()", "serve",
             str(model), "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu",
             "--log-level", "warning"],
            cwd=cwd, env=_env(), stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.kill()
        raise RuntimeError(f"transformers serve did not start: {(cwd / self.log.name).read_text()[-2000:]}")

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the group is this server
        self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture(scope="module")
def server(model_dir):
    s = Serve(model_dir, model_dir.parent)
    yield s
    s.kill()


def rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("api", ["openai", "openai-chat"])
def test_both_endpoints_at_concurrency_1_and_4(server, tmp_path, api):
    n_out, n_in, n = 12, 8, 6
    summary, requests = bl.run(url=server.url, api=api, concurrency=[1, 4], num_prompts=n, input_len=n_in,
                               output_len=n_out, warmup=1, timeout=60.0, out=tmp_path, quiet=True, seed=5)
    got, reqs = rows(summary), rows(requests)
    assert [r["concurrency"] for r in got] == ["1", "4"]
    for r in got:
        assert (r["completed"], r["failed"]) == (str(n), "0")
        assert float(r["total_output_tokens"]) == n * n_out  # the server's usage counts, exact
        ttft, e2e = float(r["median_ttft_ms"]), float(r["median_e2e_latency_ms"])
        assert 0 < ttft < e2e and float(r["median_itl_ms"]) > 0 and float(r["p95_itl_ms"]) > 0
        assert 0.5 < float(r["measured_concurrency"]) <= int(r["concurrency"]) + 0.01
    assert all(q["ok"] == "1" and q["tokens_from"] == "server" and q["completion_tokens"] == str(n_out)
               for q in reqs)
    if api == "openai":  # one word-level token per word, no BOS: the prompt is counted exactly
        assert {q["prompt_tokens"] for q in reqs} == {str(n_in)}
    meta = json.loads(summary.with_suffix(".json").read_text())
    assert meta["plain_openai"] is True and meta["model"] == str(server_model(server))
    for line in requests.with_suffix(".jsonl").read_text().splitlines():
        # no per-chunk counts on this server: one ITL per gap between token-bearing events,
        # each gap split over the request's mean tokens per event
        x = json.loads(line)
        per_event = n_out / x["events"]
        assert 2 <= x["events"] <= n_out and len(x["itl_ms"]) == x["events"] - 1
        assert all(v > 0 for v in x["itl_ms"])
        last_token = x["ttft_ms"] + per_event * sum(x["itl_ms"])
        assert last_token <= x["e2e_latency_ms"] + 1e-6  # E2E also waits for finish and usage events
        assert last_token == pytest.approx(x["e2e_latency_ms"], rel=0.2, abs=20)


class Proxy:
    """A TCP relay on 127.0.0.1 that timestamps every read on either side: an independent
    clock for the client's TTFT and E2E (one connection at a time is enough at concurrency 1)."""

    def __init__(self, target_port: int):
        import socket
        import threading

        self.reads = []  # (perf_counter, 'up' | 'down', bytes)
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.target = target_port

        def pump(src, dst, side):
            try:
                while data := src.recv(65536):
                    with self.lock:
                        self.reads.append((time.perf_counter(), side, data))
                    dst.sendall(data)
            except OSError:
                pass
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

        def accept():
            while True:
                try:
                    client, _ = self.listener.accept()
                except OSError:
                    return
                client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                up = socket.create_connection(("127.0.0.1", self.target))
                up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                threading.Thread(target=pump, args=(client, up, "up"), daemon=True).start()
                threading.Thread(target=pump, args=(up, client, "down"), daemon=True).start()

        threading.Thread(target=accept, daemon=True).start()

    def streams(self):
        """[(ttft s, last usage event s)] of each POST answered with a token stream, in order."""
        out, cur = [], None
        for t, side, data in sorted(self.reads, key=lambda r: r[0]):
            if side == "up" and data.startswith(b"POST "):
                cur = {"t0": t, "first": None, "usage": None}
                out.append(cur)
            elif side == "down" and cur is not None:
                if cur["first"] is None and re.search(rb'"(text|content)":"[^"]', data):
                    cur["first"] = t
                if b'"usage"' in data:
                    cur["usage"] = t
        return [(c["first"] - c["t0"], c["usage"] - c["t0"]) for c in out if c["first"] is not None]

    def close(self):
        self.listener.close()


def test_timings_match_an_independent_relay(server, tmp_path):
    # concurrency 1 through a timestamping relay: per request, ddbench's TTFT and E2E (taken
    # in its own process) agree with the relay's within 5 ms (median; measured ~1.5 ms on the
    # 2-core box) against E2E of ~1 s; the 422-rejected first attempt
    # of the warmup carries no stream and the warmup is dropped
    proxy = Proxy(server.port)
    try:
        p = subprocess.run(
            [sys.executable, "-m", "ddbench", "baseline", "--url", proxy.url, "--api", "openai", "-c", "1",
             "--num-prompts", "6", "--input-len", "8", "--output-len", "16", "--timeout", "60",
             "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
        proxy.close()
    assert p.returncode == 0, p.stderr
    [requests] = tmp_path.glob("*/baseline/*_requests.csv")
    got = sorted(rows(requests), key=lambda r: int(r["index"]))
    seen = proxy.streams()
    assert len(seen) == 1 + len(got)  # the warmup, then the level
    diffs = []
    for r, (ttft, e2e) in zip(got, seen[1:]):
        diffs += [float(r["ttft_ms"]) - 1e3 * ttft, float(r["e2e_latency_ms"]) - 1e3 * e2e]
    diffs.sort()
    assert abs(diffs[len(diffs) // 2]) < 5 and max(map(abs, diffs)) < 20, diffs


def server_model(server):
    return httpx.get(server.url + "/v1/models", timeout=5, trust_env=False).json()["data"][0]["id"]


def test_server_killed_mid_run(model_dir, tmp_path):
    # level 1 (c=1) loses the server after its second request: the rest fail (a warning);
    # level 2 (c=2) finds nothing listening: every request fails -> exit 1, one line of kinds
    s = Serve(model_dir, tmp_path)
    jsonl = None
    try:
        p = subprocess.Popen(
            [sys.executable, "-m", "ddbench", "baseline", "--url", s.url, "--api", "openai", "-c", "1,2",
             "--num-prompts", "5", "--input-len", "8", "--output-len", "40", "--timeout", "20",
             "--out", str(tmp_path / "out")],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and p.poll() is None:
            found = list((tmp_path / "out").glob("*/baseline/*_requests.jsonl"))
            if found and len(found[0].read_text().splitlines()) >= 2:
                jsonl = found[0]
                break
            time.sleep(0.02)
    finally:
        s.kill()
    out, err = p.communicate(timeout=120)
    assert jsonl is not None, err
    assert p.returncode == 1, err
    lines = err.strip().splitlines()
    assert lines[-1] == "error: concurrency 2: all 5 requests failed (5x connection error)", err
    assert any(x.startswith("warning: concurrency 1: ") and "connection error" in x for x in lines), err
    [summary] = (tmp_path / "out").glob("*/baseline/2*[0-9].csv")
    first, second = rows(summary)
    assert int(first["completed"]) >= 2 and int(first["failed"]) >= 1
    assert int(first["completed"]) + int(first["failed"]) == 5 and second["completed"] == "0"
    assert float(first["total_output_tokens"]) == 40 * int(first["completed"])
