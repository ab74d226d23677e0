"""`ddbench baseline`: the streaming client against a local test server with a known schedule.

The server (tests/stream_server.py, 127.0.0.1, free port) streams tokens at known times, so
every metric has an exact expected value; tolerances cover loopback and scheduling overhead.
"""
import asyncio
import csv
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ddbench import UserError
from ddbench import baseline as bl

sys.path.insert(0, str(Path(__file__).parent))
from stream_server import Schedule, TestServer, free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REL = 0.05  # "within a few percent"


def rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def num(x):
    return None if x in ("", None) else float(x)


def measure(server, api, **kw):
    args = dict(url=server.url, api=api, concurrency=[4], num_prompts=8, input_len=16, output_len=17,
                timeout=10.0, quiet=True)
    args.update(kw)
    args.setdefault("warmup", max(args["concurrency"]))  # opens every connection before measuring
    summary, requests = bl.run(**args)
    return rows(summary), rows(requests), summary, requests


# The schedule tests use times long against what a localhost request itself costs on a
# small shared machine (7-14 ms to the first byte measured on the 2-core CPU box), so that
# cost stays inside REL: "within a few percent" is about the client's arithmetic.


def test_sglang_multi_token_events_match_schedule(tmp_path):
    # first event 1 token after 500 ms, then 4 tokens every 100 ms: 17 tokens = 1 + 4 x 4
    ttft, gap = 0.5, 0.1
    sch = Schedule(ttft_s=ttft, gap_s=gap, first=1, per_event=4)
    with TestServer(sch) as s:
        [row], reqs, summary, requests = measure(s, "sglang", out=tmp_path)
        stats = s.stats()
    body = stats["bodies"][-1]
    assert stats["max_in_flight"] == 4
    assert isinstance(body["input_ids"], list) and len(body["input_ids"]) == 16
    assert body["sampling_params"]["max_new_tokens"] == 17 and body["sampling_params"]["ignore_eos"] is True
    assert body["stream"] is True

    assert row["completed"] == "8" and row["failed"] == "0" and row["source"] == "measured"
    assert num(row["total_output_tokens"]) == 8 * 17 and num(row["total_input_tokens"]) == 8 * 16
    assert num(row["median_ttft_ms"]) == pytest.approx(1e3 * ttft, rel=REL)
    assert num(row["median_tpot_ms"]) == pytest.approx(1e3 * 4 * gap / 16, rel=REL)  # (latency - ttft)/(out - 1)
    assert num(row["median_itl_ms"]) == pytest.approx(1e3 * gap / 4, rel=REL)  # each 4-token gap split 4 ways
    assert num(row["mean_itl_ms"]) == pytest.approx(1e3 * gap / 4, rel=REL)
    assert num(row["median_e2e_latency_ms"]) == pytest.approx(1e3 * (ttft + 4 * gap), rel=REL)
    assert num(row["accept_length"]) == pytest.approx(17 / 4)  # completion / verify rounds, exact
    assert num(row["spec_verify_ct"]) == 8 * 4
    # two waves of 4 requests of ttft + 4 gaps each: the level cannot be shorter; on a loaded
    # 2-core CI box thread scheduling has added ~11% (one run: 2.01 s for 1.8), so the bound
    # above is loose and the rates are checked exactly against the measured duration
    ideal = 2 * (ttft + 4 * gap)
    dur = num(row["duration_s"])
    assert ideal * (1 - 0.01) <= dur <= ideal * 1.25
    assert num(row["output_tok_per_s"]) == pytest.approx(8 * 17 / dur)
    assert num(row["req_per_s"]) == pytest.approx(8 / dur)
    e2e_sum_s = sum(num(r["e2e_latency_ms"]) for r in reqs) / 1e3
    assert num(row["measured_concurrency"]) == pytest.approx(e2e_sum_s / dur)
    assert num(row["measured_concurrency"]) == pytest.approx(4, rel=0.2)
    assert num(row["total_tok_per_s"]) == pytest.approx(
        num(row["output_tok_per_s"]) + num(row["input_tok_per_s"]))

    assert len(reqs) == 8 and {r["ok"] for r in reqs} == {"1"}
    assert sorted(int(r["index"]) for r in reqs) == list(range(8))
    assert all(r["completion_tokens"] == "17" and num(r["accept_length"]) == 4.25 for r in reqs)
    assert all(r["events"] == "5" and num(r["server_e2e_latency_ms"]) > 0 for r in reqs)
    assert all(0 <= num(r["start_s"]) < 2 for r in reqs)  # seconds since the level started

    meta = json.loads(summary.with_suffix(".json").read_text())
    assert meta["kind"] == "baseline" and meta["completed"] is True and meta["api"] == "sglang"
    assert meta["server_info"]["/get_server_info"]["model_path"] == "test/model"
    assert meta["server_avg_spec_accept_length_after"] == 3.0
    assert meta["requests_csv"] == requests.name
    assert json.loads(requests.with_suffix(".json").read_text())["kind"] == "baseline_requests"


def test_openai_single_token_chunks_with_usage(tmp_path):
    ttft, gap, n = 0.5, 0.1, 8
    sch = Schedule(ttft_s=ttft, gap_s=gap, usage="continuous")
    with TestServer(sch) as s:
        [row], reqs, *_ = measure(s, "openai", concurrency=[3], num_prompts=6, output_len=n,
                                  out=tmp_path)
        stats = s.stats()
    body = stats["bodies"][-1]
    assert body["model"] == "test-model" and body["max_tokens"] == n and body["ignore_eos"] is True
    assert body["stream"] is True and len(body["prompt"].split()) == 16
    assert stats["max_in_flight"] == 3
    assert row["completed"] == "6" and num(row["total_output_tokens"]) == 6 * n
    assert num(row["median_ttft_ms"]) == pytest.approx(1e3 * ttft, rel=REL)
    assert num(row["median_tpot_ms"]) == pytest.approx(1e3 * gap, rel=REL)
    assert num(row["median_itl_ms"]) == pytest.approx(1e3 * gap, rel=REL)
    assert num(row["p90_itl_ms"]) == pytest.approx(1e3 * gap, rel=REL)
    assert num(row["median_e2e_latency_ms"]) == pytest.approx(1e3 * (ttft + (n - 1) * gap), rel=REL)
    ideal = 2 * (ttft + (n - 1) * gap)  # two waves; a loaded CI box adds to it (see above)
    assert ideal * (1 - 0.01) <= num(row["duration_s"]) <= ideal * 1.25
    assert num(row["output_tok_per_s"]) == pytest.approx(6 * n / num(row["duration_s"]))
    assert row["accept_length"] == ""  # no verify counts on this API
    assert all(r["tokens_from"] == "server" and r["prompt_tokens"] == "16" for r in reqs)


@pytest.mark.parametrize("usage,tokens_from", [("final", "server"), ("none", "requested")])
def test_openai_multi_token_chunks_without_per_chunk_usage(usage, tokens_from):
    # 3 tokens per event, counts only at the end (or never): gaps split by the mean tokens/event.
    # Times as long as the other schedule tests: with 50 ms gaps a loaded 2-core CI box added
    # 10 ms over 3 gaps (median TPOT 14.5 ms for 13.6), past REL.
    gap = 0.15
    sch = Schedule(ttft_s=0.1, gap_s=gap, first=3, per_event=3, usage=usage)
    prompts = bl.make_prompts("random", 4, 8, 12, "openai")

    async def go():
        async with httpx.AsyncClient(timeout=5) as client:
            return await bl.run_level(client, "openai", s.url, prompts, 2, 5.0, "m")

    with TestServer(sch) as s:
        outs, wall = asyncio.run(go())
    row = bl.summarize(outs, wall)
    assert row["completed"] == 4 and row["total_output_tokens"] == 4 * 12
    assert all(o.tokens_from == tokens_from and o.events == 4 and o.prompt_tokens == 8 for o in outs)
    assert row["median_itl_ms"] == pytest.approx(1e3 * gap / 3, rel=REL)
    assert row["median_tpot_ms"] == pytest.approx(1e3 * 3 * gap / 11, rel=REL)


def test_exactly_n_in_flight():
    # requests of ~0.2 s, so that a busy CI box's fixed costs (client, connections) stay small
    # next to the wall time of the two waves that measured_concurrency divides by
    sch = Schedule(ttft_s=0.1, gap_s=0.03)
    prompts = bl.make_prompts("random", 10, 4, 4, "sglang")

    async def go(n, ps):
        async with httpx.AsyncClient(timeout=5) as client:
            return await bl.run_level(client, "sglang", s.url, ps, n, 5.0)

    with TestServer(sch) as s:
        for n, ps, expect in ((1, prompts[:4], 1), (5, prompts, 5), (8, prompts[:3], 3)):
            s.reset_stats()
            outs, wall = asyncio.run(go(n, ps))
            assert s.max_in_flight == expect and s.arrivals == len(ps)
            assert all(o.ok for o in outs)
            if n == 5:  # two full waves: the pool stays at 5 the whole time
                assert bl.summarize(outs, wall)["measured_concurrency"] == pytest.approx(5, rel=0.15)


def test_errors_are_counted_and_the_run_finishes(tmp_path):
    faults = {2: "http500", 4: "reset", 6: "malformed", 8: "hang"}
    sch = Schedule(ttft_s=0.03, gap_s=0.01, faults=faults, hang_s=1.5)
    with TestServer(sch) as s:
        t0 = time.perf_counter()
        [row], reqs, *_ = measure(s, "sglang", concurrency=[3], num_prompts=10, output_len=6,
                                  warmup=0, timeout=0.6, out=tmp_path)
        elapsed = time.perf_counter() - t0
    assert elapsed < 8
    assert row["completed"] == "6" and row["failed"] == "4"
    assert num(row["total_output_tokens"]) == 6 * 6  # failed requests add no tokens
    assert len(reqs) == 10 and sorted(int(r["index"]) for r in reqs) == list(range(10))
    bad = sorted(r["error"] for r in reqs if r["ok"] == "0")
    assert len(bad) == 4
    assert any(e.startswith("HTTP 500") for e in bad)
    assert any(e.startswith("connection error") for e in bad)
    assert any(e.startswith("malformed event") for e in bad)
    assert any(e.startswith("timeout after 0.6") for e in bad)
    good = [r for r in reqs if r["ok"] == "1"]
    assert all(r["error"] == "" and r["completion_tokens"] == "6" for r in good)


def test_stream_without_done_or_tokens_is_an_error():
    o = bl.Outcome(index=0, output_len=4)
    with pytest.raises(bl.StreamError, match="malformed"):
        bl._on_sglang_event(o, {"text": "x"}, 1.0)
    with pytest.raises(bl.StreamError, match="abort"):
        bl._on_sglang_event(o, {"meta_info": {"completion_tokens": 0,
                                              "finish_reason": {"type": "abort", "message": "oom"}}}, 1.0)
    with pytest.raises(bl.StreamError, match="choices"):
        bl._on_openai_event(o, {"usage": None}, 1.0)
    with pytest.raises(bl.StreamError, match="abort"):
        bl._on_openai_event(o, {"choices": [{"text": "", "finish_reason": "abort"}]}, 1.0)


def test_within_keeps_a_cancel_that_meets_the_result():
    """Ctrl-C cancels the run's task; if a request finishes in the same loop turn, the cancel
    must still stop the run (asyncio.wait_for of Python 3.11 returned the result instead, and
    `ddbench baseline` went on to its last prompt). Also: results, errors and the timeout."""
    async def race(wrap):
        ev = asyncio.Event()

        async def inner():
            await ev.wait()
            return 1
        outer = asyncio.ensure_future(wrap(inner(), 10))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        ev.set()        # inner finishes in the next turn, before outer sees its cancel
        outer.cancel()
        try:
            return await outer
        except asyncio.CancelledError:
            return "cancelled"

    async def fails():
        raise bl.StreamError("x")
    assert asyncio.run(race(bl.within)) == "cancelled"
    assert asyncio.run(bl.within(asyncio.sleep(0, result=7), 1)) == 7
    with pytest.raises(bl.StreamError):
        asyncio.run(bl.within(fails(), 1))
    closed = []

    async def slow():   # a request past its timeout: its stream is closed before within returns
        try:
            await asyncio.sleep(5)
        finally:
            closed.append(True)

    async def timed_out():
        with pytest.raises(asyncio.TimeoutError):
            await bl.within(slow(), 0.05)
        return list(closed)
    assert asyncio.run(timed_out()) == [True]


def test_summary_maths_on_hand_made_outcomes():
    a = bl.Outcome(index=0, output_len=5, ok=True, completion_tokens=5, ttft=0.1, latency=0.5,
                   itl=[0.1] * 4, spec_verify_ct=2, prompt_tokens=10)
    b = bl.Outcome(index=1, output_len=5, ok=True, completion_tokens=3, ttft=0.3, latency=0.7,
                   itl=[0.2, 0.2], spec_verify_ct=2, prompt_tokens=10)
    c = bl.Outcome(index=2, output_len=5, error="HTTP 500: x", latency=0.01)
    r = bl.summarize([a, b, c], wall=2.0)
    assert (r["completed"], r["failed"], r["num_prompts"]) == (2, 1, 3)
    assert r["output_tok_per_s"] == 4.0 and r["req_per_s"] == 1.0 and r["total_tok_per_s"] == 14.0
    assert r["mean_ttft_ms"] == pytest.approx(200) and r["median_e2e_latency_ms"] == pytest.approx(600)
    assert r["mean_tpot_ms"] == pytest.approx((100 + 200) / 2)  # (0.4/4, 0.4/2)
    assert r["mean_itl_ms"] == pytest.approx(1000 * (0.4 + 0.4) / 6)
    assert r["accept_length"] == pytest.approx(8 / 4) and r["spec_verify_ct"] == 4
    assert r["measured_concurrency"] == pytest.approx(0.6)
    # std: population (numpy's default, as bench_serving); p95 by linear interpolation
    assert r["std_ttft_ms"] == pytest.approx(100) and r["p95_ttft_ms"] == pytest.approx(290)
    assert r["std_itl_ms"] == pytest.approx(1e3 * (0.02 / 9) ** 0.5)  # 4x 0.1, 2x 0.2: var 2/9 * 0.01
    assert r["p95_e2e_latency_ms"] == pytest.approx(690)


def cli(*args, timeout=30):
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "ddbench", "baseline", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    return p, time.perf_counter() - t0


@pytest.mark.parametrize("args,msg", [
    (["--url", "http://127.0.0.1:{port}", "-c", "0"], "--concurrency must be positive"),
    (["--url", "http://127.0.0.1:{port}", "-c", "2,-1"], "--concurrency must be positive"),
    (["--url", "http://127.0.0.1:{port}", "--api", "tgi"], "--api 'tgi'"),
    (["--url", "127.0.0.1:{port}"], "expected http://HOST:PORT"),
    (["--api", "sglang"], "--url is required"),
    (["--url", "http://127.0.0.1:{port}", "--timeout", "3"], "cannot reach"),
    (["--url", "http://127.0.0.1:{silent}", "--timeout", "1"], "no answer to GET"),
    (["--import", "/nonexistent/x.jsonl"], "no such file"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, args, msg):
    port = free_port()
    with socket.socket() as silent:  # accepts TCP connections (backlog) but never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        args = [a.format(port=port, silent=silent.getsockname()[1]) for a in args]
        p, elapsed = cli(*args, "--out", str(tmp_path))
    assert p.returncode == 2, p.stderr
    assert msg in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert elapsed < 6  # within the timeout (+ interpreter start)
    assert not list(tmp_path.rglob("*.csv"))


def test_failed_warmup_is_a_user_error(tmp_path):
    with TestServer(Schedule(faults={1: "http500"})) as s:
        with pytest.raises(UserError, match="warmup"):
            bl.run(url=s.url, api="sglang", concurrency=[1], num_prompts=2, input_len=4, output_len=4,
                   out=tmp_path, quiet=True)
    assert not list(tmp_path.iterdir())  # nothing written for a run that never started


def test_cli_end_to_end_and_ctrl_c_keeps_rows(tmp_path):
    with TestServer(Schedule(ttft_s=0.02, gap_s=0.01)) as s:
        p, _ = cli("--url", s.url + "/generate", "-c", "1,2", "--num-prompts", "3", "--input-len", "8",
                   "--output-len", "5", "--label", "local", "--out", str(tmp_path / "a"))
        assert p.returncode == 0, p.stderr
        [summary] = (tmp_path / "a").glob("*/baseline/2*[0-9].csv")
        got = rows(summary)
        assert [r["concurrency"] for r in got] == ["1", "2"] and {r["label"] for r in got} == {"local"}
        assert all(r["completed"] == "3" for r in got)
        [reqs] = (tmp_path / "a").glob("*/baseline/*_requests.csv")
        assert len(rows(reqs)) == 6

        # Ctrl-C mid-run: finished requests stay on disk, the sidecar says incomplete (500 prompts
        # take ~85 s, so the signal lands mid-run even if this loop is slow to see the rows)
        s.configure(gap_s=0.05)
        proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "ddbench", "baseline",
                                 "--url", s.url, "-c", "1", "--num-prompts", "500", "--input-len", "4",
                                 "--output-len", "4",
                                 "--warmup", "0", "--out", str(tmp_path / "b")], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                # a shell starts background jobs with SIGINT ignored, and a child
                                # inherits that: Python then never turns Ctrl-C into KeyboardInterrupt
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        partial = []
        deadline = time.time() + 20
        while time.time() < deadline and proc.poll() is None:
            partial = list((tmp_path / "b").glob("*/baseline/*_requests.csv.partial"))
            if partial and len(partial[0].read_text().splitlines()) >= 3:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=60)   # the exit itself takes 1-6 s, more on a loaded box
        except subprocess.TimeoutExpired:   # a hang: SIGABRT makes faulthandler print every thread's stack
            proc.send_signal(signal.SIGABRT)
            _, err = proc.communicate(timeout=30)
            pytest.fail(f"no exit 60 s after Ctrl-C ({len(partial)} partial file(s)); stacks:\n{err[-6000:]}")
    assert proc.returncode == 130, err
    [reqs] = (tmp_path / "b").glob("*/baseline/*_requests.csv")
    kept = rows(reqs)
    assert 2 <= len(kept) < 500 and all(r["ok"] == "1" for r in kept)
    meta = json.loads(reqs.with_suffix(".json").read_text())
    assert meta["completed"] is False


def test_dataset_file(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hello there world"}\n\n{"input_ids": [5, 6, 7], "output_len": 3}\n"bare"\n')
    ps = bl.make_prompts(str(f), 5, 99, 8, "sglang")
    assert [p.prompt for p in ps] == ["hello there world", [5, 6, 7], "bare", "hello there world", [5, 6, 7]]
    assert [p.output_len for p in ps] == [8, 3, 8, 8, 3] and ps[1].prompt_len == 3
    f.write_text('{"prompt": ""}\n')
    with pytest.raises(UserError, match=":1:"):
        bl.make_prompts(str(f), 1, 1, 1, "sglang")
    with pytest.raises(UserError, match="no such file"):
        bl.make_prompts(str(tmp_path / "nope.jsonl"), 1, 1, 1, "sglang")
    r1, r2 = bl.make_prompts("random", 2, 7, 3, "sglang", seed=1)
    assert len(r1.prompt) == 7 and r1.prompt != r2.prompt
    assert all(bl.RANDOM_ID_RANGE[0] <= t < bl.RANDOM_ID_RANGE[1] for t in r1.prompt)
    assert bl.make_prompts("random", 2, 7, 3, "sglang", seed=1)[0].prompt == r1.prompt


def bench_serving_lines():
    new = {"backend": "sglang", "dataset_name": "random", "request_rate": float("inf"), "max_concurrency": 10,
           "random_input_len": 1000, "random_output_len": 500, "duration": 20.0, "completed": 40,
           "total_input_tokens": 40000, "total_output_tokens": 20000, "request_throughput": 2.0,
           "input_throughput": 2000.0, "output_throughput": 1000.0, "total_throughput": 3000.0,
           "mean_ttft_ms": 100.0, "median_ttft_ms": 90.0, "p90_ttft_ms": 150.0, "p99_ttft_ms": 200.0,
           "mean_tpot_ms": 9.0, "median_tpot_ms": 8.5, "p90_tpot_ms": 11.0, "p99_tpot_ms": 12.0,
           "mean_itl_ms": 9.5, "median_itl_ms": 8.0, "p90_itl_ms": 15.0, "p99_itl_ms": 30.0,
           "mean_e2e_latency_ms": 4600.0, "median_e2e_latency_ms": 4500.0, "p90_e2e_latency_ms": 5000.0,
           "p99_e2e_latency_ms": 5500.0, "concurrency": 9.2, "accept_length": 3.1}
    # an older version: no p90, no total_throughput, with --output-details lists
    old = {"backend": "sglang-oai", "max_concurrency": None, "concurrency": 1.96, "duration": 2.0,
           "completed": 3, "total_input_tokens": 30, "total_output_tokens": 12, "request_throughput": 1.5,
           "input_throughput": 15.0, "output_throughput": 6.0, "mean_ttft_ms": 200.0, "median_ttft_ms": 200.0,
           "p99_ttft_ms": 300.0, "accept_length": None,
           "input_lens": [10, 10, 10, 10], "output_lens": [4, 4, 4, 0],
           "ttfts": [0.1, 0.2, 0.3, 0.0], "itls": [[0.1, 0.1, 0.1], [0.2, 0.2, 0.2], [0.1, 0.1, 0.1], []],
           "errors": ["", "", "", "Traceback ...\nReadError: reset"]}
    return [new, old]


def test_import_bench_serving(tmp_path):
    f = tmp_path / "bench.jsonl"
    f.write_text("\n".join(json.dumps(d) for d in bench_serving_lines()) + "\n")
    summary, requests = bl.import_bench_serving(f, tmp_path / "out")
    a, b = rows(summary)
    assert list(a) == bl.SUMMARY_COLUMNS
    assert (a["concurrency"], a["source"], a["label"]) == ("10", "import", "bench_serving sglang")
    assert num(a["output_tok_per_s"]) == 1000 and num(a["p90_itl_ms"]) == 15 and num(a["accept_length"]) == 3.1
    assert num(a["measured_concurrency"]) == 9.2 and a["failed"] == "" and num(a["total_tok_per_s"]) == 3000
    assert b["concurrency"] == "2" and b["failed"] == "1" and b["num_prompts"] == "4"
    assert num(b["total_tok_per_s"]) == pytest.approx(21.0)  # (30 + 12) / 2
    assert num(b["p90_ttft_ms"]) == pytest.approx(280)  # from the ttfts of the 3 successes
    assert num(b["p90_itl_ms"]) == pytest.approx(200)
    req = rows(requests)
    assert len(req) == 4 and [r["ok"] for r in req] == ["1", "1", "1", "0"]
    assert req[3]["error"] == "ReadError: reset"
    assert num(req[1]["e2e_latency_ms"]) == pytest.approx(800) and num(req[1]["tpot_ms"]) == pytest.approx(200)
    meta = json.loads(summary.with_suffix(".json").read_text())
    assert meta["kind"] == "baseline" and meta["source"] == "import"

    f.write_text('{"foo": 1}\n')
    with pytest.raises(UserError, match="not a bench_serving result"):
        bl.import_bench_serving(f, tmp_path / "out2")
    p, _ = cli("--import", str(f), "--out", str(tmp_path / "out3"))
    assert p.returncode == 2 and "bench.jsonl:1" in p.stderr


def test_reference_data():
    ref = ROOT / "results" / "baseline" / "sglang_reference.csv"
    got = rows(ref)
    cols = [c for c in bl.SUMMARY_COLUMNS if c in got[0]]  # columns added later stay empty there
    assert list(got[0]) == cols and len(cols) >= len(bl.SUMMARY_COLUMNS) - 12
    assert [(r["concurrency"], num(r["output_tok_per_s"])) for r in got] == [("1", 138.0), ("10", 517.0)]
    assert all(r["source"] == "reference" and r["mean_ttft_ms"] == "" for r in got)
    meta = json.loads(ref.with_suffix(".json").read_text())
    assert meta["kind"] == "baseline" and meta["measured_by_ddbench"] is False
    assert "not measured by ddbench" in meta["provenance"].lower()
    assert "RTX PRO 6000" in meta["hardware"] and meta["tensor_parallel"] == 8


@pytest.mark.parametrize("warmup", [1, 0])
def test_strict_openai_server_gets_standard_fields_only(tmp_path, warmup):
    # the fallback applies to every request, not only the warmup: without a warmup the first
    # request of each of the 2 workers is rejected, sent again plain, and the rest go plain
    with TestServer(Schedule(ttft_s=0.02, gap_s=0.01, strict=True)) as s:
        [row], reqs, summary, _ = measure(s, "openai", concurrency=[2], num_prompts=4, output_len=5,
                                          warmup=warmup, out=tmp_path)
        bodies = s.bodies
    assert "ignore_eos" not in bodies[-1] and bodies[-1]["stream_options"] == {"include_usage": True}
    rejected = [b for b in bodies if "ignore_eos" in b]
    assert 1 <= len(rejected) <= 2 and len(bodies) == warmup + 4 + len(rejected)
    assert row["completed"] == "4" and num(row["total_output_tokens"]) == 4 * 5
    assert all(r["tokens_from"] == "server" and r["error"] == "" for r in reqs)  # final usage chunk
    assert json.loads(summary.with_suffix(".json").read_text())["plain_openai"] is True


def level(s, api, prompts, n, **kw):
    async def go():
        async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
            return await bl.run_level(client, api, s.url, prompts, n, 5.0, "m", **kw)
    return asyncio.run(go())


@pytest.mark.parametrize("api,usage", [("sglang", "final"), ("openai", "final"), ("openai", "continuous"),
                                       ("openai", "none"), ("openai-chat", "final")])
def test_stream_that_ends_after_finish_or_usage_without_done_is_complete(api, usage):
    # transformers serve ends its streams after the usage chunk, with no data: [DONE]
    sch = Schedule(ttft_s=0.03, gap_s=0.01, first=2, per_event=2, usage=usage, done=False, faults={3: "cut"})
    prompts = bl.make_prompts("random", 4, 6, 7, api, seed=3)
    with TestServer(sch) as s:
        outs, _ = level(s, api, prompts, 1)
    good = [o for o in outs if o.index != 2]
    assert all(o.ok and o.error == "" and o.events == 4 for o in good)
    assert all(o.completion_tokens == 7 and o.prompt_tokens == 6 for o in good)
    assert [o.tokens_from for o in good] == ["requested" if usage == "none" else "server"] * 3
    cut = outs[2]  # ended cleanly after its first event, before any finish reason or usage
    assert not cut.ok and cut.error.startswith("stream ended without data: [DONE], a finish reason")


def test_chat_completions_match_schedule(tmp_path):
    ttft, gap, n = 0.3, 0.2, 6
    with TestServer(Schedule(ttft_s=ttft, gap_s=gap, usage="final")) as s:
        [row], reqs, summary, requests = measure(s, "openai-chat", concurrency=[2], num_prompts=4,
                                                 output_len=n, warmup=2, out=tmp_path)
        body = s.bodies[-1]
    assert body["messages"][0]["role"] == "user" and len(body["messages"][0]["content"].split()) == 16
    assert "prompt" not in body and body["max_tokens"] == n and body["ignore_eos"] is True
    assert row["api"] == "openai-chat" and row["completed"] == "4" and num(row["total_output_tokens"]) == 4 * n
    # the role-only first chunk carries no token: TTFT is the first content chunk
    assert num(row["median_ttft_ms"]) == pytest.approx(1e3 * ttft, rel=REL)
    assert num(row["median_itl_ms"]) == pytest.approx(1e3 * gap, rel=REL)
    assert num(row["p95_itl_ms"]) == pytest.approx(1e3 * gap, rel=0.25)
    assert 0 <= num(row["std_itl_ms"]) < 0.25 * 1e3 * gap
    assert all(r["events"] == str(n) and r["tokens_from"] == "server" for r in reqs)
    lines = [json.loads(x) for x in requests.with_suffix(".jsonl").read_text().splitlines()]
    assert sorted(x["index"] for x in lines) == [0, 1, 2, 3] and all(x["request_rate"] is None for x in lines)
    for x in lines:
        assert len(x["itl_ms"]) == n - 1 and x["itl_ms"] == pytest.approx([1e3 * gap] * (n - 1), rel=0.3)
        assert x["ttft_ms"] + sum(x["itl_ms"]) == pytest.approx(x["e2e_latency_ms"], rel=0.05)
    meta = json.loads(summary.with_suffix(".json").read_text())
    assert meta["requests_jsonl"] == requests.with_suffix(".jsonl").name


def test_request_rate_is_poisson_and_capped_by_concurrency():
    # 40 arrivals at 40/s from a seeded exponential draw: every request starts at its drawn time
    # (requests of 30 ms never fill 8 slots); then the same draw with 2 slots and 0.25 s
    # requests: at most 2 in flight, later arrivals wait for a slot
    import random

    rate, n, seed = 40.0, 40, 7
    rng = random.Random(seed)
    due = [0.0]
    for _ in range(n - 1):
        due.append(due[-1] + rng.expovariate(rate))
    prompts = bl.make_prompts("random", n, 4, 3, "sglang")
    with TestServer(Schedule(ttft_s=0.01, gap_s=0.01)) as s:
        outs, wall = level(s, "sglang", prompts, 8, rate=rate, seed=seed)
        free = s.max_in_flight
        s.configure(ttft_s=0.15, gap_s=0.05)
        s.reset_stats()
        capped, _ = level(s, "sglang", prompts[:10], 2, rate=rate, seed=seed)
        stats = s.stats()
    assert all(o.ok for o in outs) and free <= 8
    starts = [o.start for o in outs]
    assert starts == pytest.approx(due, abs=0.03)
    assert wall == pytest.approx(due[-1] + 0.03, abs=0.05)
    assert stats["max_in_flight"] == 2 and stats["arrivals"] == 10 and all(o.ok for o in capped)
    assert capped[-1].start > due[9] + 0.3  # 10 requests of 0.25 s through 2 slots: >= 1.25 s


def test_all_failed_level_exits_1_with_error_kinds(tmp_path):
    # arrival 1 is the warmup; level 1 (c=1, arrivals 2-5): 2 of 4 fail -> a warning line;
    # level 2 (c=2, arrivals 6-9): every connection is reset -> exit 1 with one line that
    # counts the error kinds; every file is still written
    faults = {3: "http500", 4: "http500", **{i: "reset" for i in range(6, 10)}}
    with TestServer(Schedule(ttft_s=0.01, gap_s=0.01, faults=faults)) as s:
        p, _ = cli("--url", s.url, "--api", "sglang", "-c", "1,2", "--num-prompts", "4", "--input-len", "4",
                   "--output-len", "3", "--timeout", "3", "--out", str(tmp_path))
    assert p.returncode == 1, p.stderr
    lines = p.stderr.strip().splitlines()
    assert "warning: concurrency 1: 2 of 4 requests failed (2x HTTP 500)" in lines
    assert lines[-1] == "error: concurrency 2: all 4 requests failed (4x connection error)"
    [summary] = tmp_path.glob("*/baseline/2*[0-9].csv")
    got = rows(summary)
    assert [(r["completed"], r["failed"]) for r in got] == [("2", "2"), ("0", "4")]

    assert bl.error_summary([bl.Outcome(0, 1, error="timeout after 3 s"), bl.Outcome(1, 1, ok=True),
                             bl.Outcome(2, 1, error="HTTP 503: busy"),
                             bl.Outcome(3, 1, error="HTTP 503: x")]) == "2x HTTP 503, 1x timeout after 3 s"


def test_request_rate_and_chat_input_checks(tmp_path):
    f = tmp_path / "ids.jsonl"
    f.write_text('{"input_ids": [5, 6, 7]}\n')
    with TestServer() as s:
        for kw, msg in ((dict(request_rate=0.0), "--request-rate must be > 0"),
                        (dict(request_rate=float("nan")), "--request-rate must be > 0"),
                        (dict(api="openai-chat", dataset=str(f)), "needs text prompts")):
            with pytest.raises(UserError, match=msg):
                measure(s, kw.pop("api", "openai"), out=tmp_path / "o", **kw)
    assert not (tmp_path / "o").exists()
