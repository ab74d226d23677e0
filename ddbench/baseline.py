"""`ddbench baseline`: measure a live SGLang (or OpenAI-compatible) server at concurrency N.

An asyncio + httpx streaming client keeps exactly N requests in flight (N workers, each
sending its next request as soon as its previous one ends) or, with a request rate, sends
requests at Poisson arrival times with at most N in flight (bench_serving's
`--request-rate` with `--max-concurrency`), and measures every request with SGLang
bench_serving's definitions:

- TTFT: request sent -> first stream event that carries a token.
- E2E latency: request sent -> last event of the stream (`data: [DONE]`, or the finish /
  usage event of a server that ends its stream without `[DONE]`).
- TPOT = (latency - TTFT) / (completion_tokens - 1), for requests with more than one token.
- ITL: the gap between two token-bearing events, split evenly over the tokens the later
  event carries (a speculative server sends several tokens per event).
- throughputs = successful requests / tokens over the level's wall time (first request sent
  -> last request ended); token counts come from the server (`meta_info` on the native
  `/generate`, `usage` on `/v1/completions` and `/v1/chat/completions`), never from
  counting chunks.
- accept length = sum completion_tokens / sum spec_verify_ct over this run's own requests.
- prompt tokens: the server's count (`prompt_tokens`), else the prompt's nominal length.

An OpenAI server that rejects the non-standard fields (`ignore_eos`,
`continuous_usage_stats`) with HTTP 400/422 gets each such request again with standard
fields only, and every later request is sent that way.

Outputs: a per-request CSV (kind `baseline_requests`) with a JSONL beside it that keeps
each request's ITL list, a summary CSV with one row per concurrency level (kind
`baseline`), and JSON sidecars that carry the server's own info
(`/get_server_info`, `/v1/models`). `import_bench_serving` turns a bench_serving
`--output-file` JSONL into the same summary format (ddbench/plots.py draws them).
"""
from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import gc
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from ddbench import UserError

APIS = ("sglang", "openai", "openai-chat")
STATS = ("mean", "median", "std", "p90", "p95", "p99")
# a level with more failed requests than this fraction gets a warning line
WARN_FAILED_FRACTION = 0.05
METRICS = ("ttft", "tpot", "itl", "e2e_latency")

# One row per concurrency level; measured, imported and reference rows share these columns.
SUMMARY_COLUMNS = [
    "label", "source", "api", "concurrency", "request_rate", "num_prompts", "completed", "failed",
    "input_len", "output_len", "duration_s", "total_input_tokens", "total_output_tokens",
    "req_per_s", "input_tok_per_s", "output_tok_per_s", "total_tok_per_s",
    *[f"{s}_{m}_ms" for m in METRICS for s in STATS],
    "accept_length", "spec_verify_ct", "measured_concurrency",
]
REQUEST_COLUMNS = [
    "label", "concurrency", "index", "ok", "error", "prompt_tokens", "completion_tokens",
    "tokens_from", "ttft_ms", "tpot_ms", "e2e_latency_ms", "itl_mean_ms", "itl_max_ms",
    "events", "spec_verify_ct", "accept_length", "server_e2e_latency_ms", "start_s",
]

# random token ids stay inside every modern tokenizer's ordinary range (K2.6 vocab: 163840)
RANDOM_ID_RANGE = (1000, 100000)
WORDS = ("the of and to in is was for on are with as by at from that this be or an it "
         "which not have has but they their one all were we can more time there been new "
         "would about some other into only its also after first two may over such most").split()


# ---------------------------------------------------------------------------------------
# dataset
# ---------------------------------------------------------------------------------------

@dataclass
class Prompt:
    prompt: str | list[int]
    prompt_len: int  # nominal length: token ids, or words of random text
    output_len: int


def _where(out, kind: str, when, tag: str | None = None) -> dict:
    """ResultWriter's out/kind/name for this run's `kind` file: out/<gpu>/baseline/<stamp>[_tag]
    (`results.run_location`), one stamp for all the run's files."""
    from ddbench.results import run_location

    where, name = run_location(out, kind, tag, when=when)
    return dict(out=where, kind=kind, name=name)


def read_jsonl(path: Path):
    """Yield (line number, parsed value) for each non-blank line; UserError on bad JSON."""
    for no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield no, json.loads(line)
        except ValueError:
            raise UserError(f"{path}:{no}: not valid JSON") from None


def make_prompts(dataset: str, n: int, input_len: int, output_len: int, api: str,
                 seed: int = 0) -> list[Prompt]:
    """`random`: random token ids (sglang) or random words (openai); else a JSONL file.

    File lines: {"prompt": str} or {"input_ids": [int, ...]} (optionally "output_len"),
    or a bare JSON string. Lines are reused in order until there are `n` prompts.
    """
    if dataset == "random":
        rng = random.Random(seed)
        if api == "sglang":
            return [Prompt([rng.randrange(*RANDOM_ID_RANGE) for _ in range(input_len)],
                           input_len, output_len) for _ in range(n)]
        return [Prompt(" ".join(rng.choice(WORDS) for _ in range(input_len)), input_len, output_len)
                for _ in range(n)]
    path = Path(dataset)
    if not path.is_file():
        raise UserError(f"--dataset {dataset!r}: not 'random' and no such file")
    rows = []
    for no, d in read_jsonl(path):
        if isinstance(d, str):
            d = {"prompt": d}
        p = d.get("prompt", d.get("text", d.get("input_ids"))) if isinstance(d, dict) else None
        ok_ids = isinstance(p, list) and p and all(isinstance(t, int) for t in p)
        if not (isinstance(p, str) and p) and not ok_ids:
            raise UserError(f"{path}:{no}: needs a non-empty 'prompt' string or 'input_ids' list")
        out = d.get("output_len", output_len)
        if not isinstance(out, int) or out < 1:
            raise UserError(f"{path}:{no}: output_len must be a positive integer")
        rows.append(Prompt(p, len(p) if ok_ids else len(p.split()), out))
    if not rows:
        raise UserError(f"{path}: no prompts")
    return [rows[i % len(rows)] for i in range(n)]


# ---------------------------------------------------------------------------------------
# one streamed request
# ---------------------------------------------------------------------------------------

class StreamError(Exception):
    """The server's stream broke the protocol or reported an error."""


class AllFailed(Exception):
    """Every request of a concurrency level failed (the CSVs are written all the same)."""


def error_kind(error: str) -> str:
    """'HTTP 500: {...}' -> 'HTTP 500', 'connection error: ReadError: ...' -> 'connection error'."""
    return error.split(":", 1)[0].strip() or "unknown error"


def error_summary(outcomes) -> str:
    """'3x connection error, 1x HTTP 500' over the failed outcomes, most frequent first."""
    from collections import Counter

    kinds = Counter(error_kind(o.error) for o in outcomes if not o.ok)
    return ", ".join(f"{n}x {k}" for k, n in kinds.most_common())


@dataclass
class Fields:
    """Whether OpenAI requests carry only standard fields; shared by every request of a run,
    so that once a strict server answered a plain retry, every later request is plain."""
    plain: bool = False


@dataclass
class Outcome:
    """What one request measured; times in seconds from `perf_counter`."""
    index: int
    output_len: int
    ok: bool = False
    error: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    tokens_from: str = "server"  # 'server', or 'requested' when the server sent no counts
    usage_seen: bool = False
    finished: bool = False  # a finish reason or a final usage event was seen
    ttft: float | None = None
    latency: float | None = None
    itl: list[float] = field(default_factory=list)
    events: int = 0  # token-bearing stream events
    spec_verify_ct: int | None = None
    server_e2e_latency: float | None = None
    start: float = 0.0
    last: float = 0.0
    unknown_gaps: list[float] = field(default_factory=list)  # gaps whose token count is unknown

    def tokens(self, now: float, new: int | None) -> None:
        """A token-bearing event with `new` tokens (None: the server did not say how many)."""
        if self.ttft is None:
            self.ttft = now - self.start
        elif new:
            self.itl.extend([(now - self.last) / new] * new)
        elif new is None:
            self.unknown_gaps.append(now - self.last)
        self.last = now
        self.events += 1

    def finish(self) -> None:
        """Split gaps of unknown size assuming equal tokens per event (no per-chunk usage)."""
        if self.unknown_gaps and self.completion_tokens > 0 and self.events:
            per_event = self.completion_tokens / self.events
            self.itl.extend(g / per_event for g in self.unknown_gaps)
        self.unknown_gaps = []

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.completion_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.completion_tokens - 1)


def _payload(api: str, p: Prompt, model: str | None, plain: bool = False) -> tuple[str, dict]:
    """Endpoint and body. `plain` (openai*): only standard OpenAI fields, for servers that
    reject `ignore_eos` / `continuous_usage_stats`."""
    if api == "sglang":
        key = "text" if isinstance(p.prompt, str) else "input_ids"
        return "/generate", {key: p.prompt, "stream": True, "sampling_params": {
            "temperature": 0.0, "max_new_tokens": p.output_len, "ignore_eos": True}}
    body = {"model": model or "default", "max_tokens": p.output_len,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if api == "openai-chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": p.prompt}]
    else:
        path, body["prompt"] = "/v1/completions", p.prompt
    if not plain:
        body["ignore_eos"] = True
        body["stream_options"]["continuous_usage_stats"] = True
    return path, body


def _int(value) -> int | None:
    return None if value is None else int(value)


def _on_sglang_event(o: Outcome, d: dict, now: float) -> None:
    """Native /generate event: `text` plus cumulative `meta_info` counts."""
    meta = d.get("meta_info")
    if not isinstance(meta, dict) or meta.get("completion_tokens") is None:
        raise StreamError("malformed event: no meta_info.completion_tokens")
    n = int(meta["completion_tokens"])
    if n > o.completion_tokens:
        o.tokens(now, n - o.completion_tokens)
        o.completion_tokens = n
    o.prompt_tokens = _int(meta.get("prompt_tokens", o.prompt_tokens))
    o.spec_verify_ct = _int(meta.get("spec_verify_ct", o.spec_verify_ct))
    if meta.get("e2e_latency") is not None:
        o.server_e2e_latency = float(meta["e2e_latency"])
    finish = meta.get("finish_reason")
    if isinstance(finish, dict) and finish.get("type") == "abort":
        raise StreamError(f"server aborted the request: {finish.get('message', '')}"[:200])
    o.finished = o.finished or finish is not None


def _choice_text(choice: dict) -> str:
    """A completions choice's `text`, or a chat chunk's `delta` content (reasoning included)."""
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


def _on_openai_event(o: Outcome, d: dict, now: float) -> None:
    """/v1/completions or /v1/chat/completions event: choices[0].text or .delta.content;
    `usage` per chunk (continuous) or in a final event with no choices."""
    choices = d.get("choices")
    if not isinstance(choices, list):
        raise StreamError("malformed event: no choices list")
    usage = d.get("usage") or {}
    total = _int(usage.get("completion_tokens"))
    if usage.get("prompt_tokens") is not None:
        o.prompt_tokens = int(usage["prompt_tokens"])
    if not choices and total is not None:
        o.finished = True  # the include_usage event that ends an OpenAI stream
    if choices:
        finish = choices[0].get("finish_reason")
        if finish == "abort":
            raise StreamError("server aborted the request (finish_reason abort)")
        o.finished = o.finished or finish is not None
        text = _choice_text(choices[0])
        if total is not None and total > o.completion_tokens:
            o.tokens(now, total - o.completion_tokens)
        elif text and total is None:
            o.tokens(now, None)
    if total is not None:
        o.completion_tokens = max(o.completion_tokens, total)
        o.usage_seen = True


async def within(coro, timeout: float):
    """`await coro`, asyncio.TimeoutError after `timeout` s. Unlike asyncio.wait_for (Python <=
    3.11), a cancellation of the caller (Ctrl-C) is never lost when coro finishes at the same
    moment: wait_for then returns coro's result and the run went on to its last request."""
    task = asyncio.ensure_future(coro)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        await asyncio.wait({task})   # the request closes its stream before the next starts, as with wait_for
        raise asyncio.TimeoutError
    return task.result()


async def request_once(client, api: str, base: str, p: Prompt, index: int, timeout: float,
                       model: str | None = None, fields: Fields | None = None) -> Outcome:
    """Send one streaming request and measure it; never raises (errors land in `error`).

    OpenAI APIs: a request with the non-standard fields that the server rejects (HTTP 400 or
    422) is sent again at once with standard fields only; when that one succeeds,
    `fields.plain` is set and every later request of the run is sent plain."""
    fields = fields if fields is not None else Fields()
    o = await _request(client, api, base, p, index, timeout, model, fields.plain)
    if api != "sglang" and not fields.plain and o.error.startswith(("HTTP 400", "HTTP 422")):
        o = await _request(client, api, base, p, index, timeout, model, plain=True)
        fields.plain = fields.plain or o.ok
    return o


async def _request(client, api: str, base: str, p: Prompt, index: int, timeout: float,
                   model: str | None, plain: bool) -> Outcome:
    o = Outcome(index=index, output_len=p.output_len)
    path, body = _payload(api, p, model, plain)
    on_event = _on_sglang_event if api == "sglang" else _on_openai_event

    async def stream():
        done = False
        async with client.stream("POST", base + path, json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace").strip().replace("\n", " ")
                raise StreamError(f"HTTP {r.status_code}: {text[:200]}")
            async for line in r.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments, event: lines
                data = line[5:].strip()
                now = time.perf_counter()
                o.latency = now - o.start
                if data == "[DONE]":
                    done = True
                    continue
                try:
                    d = json.loads(data)
                except ValueError:
                    raise StreamError(f"malformed event: {data[:80]!r}") from None
                if not isinstance(d, dict):
                    raise StreamError(f"malformed event: {data[:80]!r}")
                if "error" in d:
                    raise StreamError(f"server error: {str(d['error'])[:200]}")
                on_event(o, d, now)
        if not (done or o.finished):  # a clean end after a finish reason or usage is complete
            raise StreamError("stream ended without data: [DONE], a finish reason or usage")
        if o.ttft is None:
            raise StreamError("stream carried no tokens")

    import httpx

    o.start = time.perf_counter()
    try:
        await within(stream(), timeout)
        if api != "sglang" and not o.usage_seen:
            o.completion_tokens = p.output_len  # the server sent no usage: ignore_eos length
            o.tokens_from = "requested"
        if o.prompt_tokens is None:
            o.prompt_tokens = p.prompt_len  # no server count: the prompt's nominal length
        o.finish()
        o.ok = True
    except (asyncio.TimeoutError, httpx.TimeoutException):
        o.error = f"timeout after {timeout:g} s"
    except StreamError as e:
        o.error = str(e)
    except httpx.HTTPError as e:
        o.error = f"connection error: {type(e).__name__}: {e}"[:300]
    except (ValueError, TypeError, AttributeError) as e:  # odd field types in an event
        o.error = f"malformed event: {type(e).__name__}: {e}"[:300]
    if not o.ok:
        o.latency = time.perf_counter() - o.start
    return o


@contextlib.contextmanager
def _heap_frozen():
    """What is alive now (torch, the prompts) moved out of the collector's reach: a full
    collection over it stalls the event loop for tens of ms, which would delay timed arrivals."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


async def run_level(client, api: str, base: str, prompts: list[Prompt], n: int, timeout: float,
                    model: str | None = None, on_done=None, fields: Fields | None = None,
                    rate: float = math.inf, seed: int = 0) -> tuple[list[Outcome], float]:
    """Send every prompt with at most `n` in flight; returns (outcomes, wall time in s).

    `rate` infinite: exactly `n` in flight (each of n workers sends its next request when its
    previous one ends). Finite: requests arrive as a Poisson process of `rate` per second
    (exponential gaps drawn from `seed`, as bench_serving's `--request-rate`); an arrival
    waits while `n` are in flight (`--max-concurrency`)."""
    fields = fields if fields is not None else Fields()
    outcomes: list[Outcome] = []

    async def send(i, p):
        o = await request_once(client, api, base, p, i, timeout, model, fields)
        o.start -= t0  # relative to the level's start
        outcomes.append(o)
        if on_done is not None:
            on_done(o)

    with _heap_frozen():
        t0 = time.perf_counter()
        if math.isinf(rate):
            todo = iter(enumerate(prompts))  # shared: each worker takes the next prompt

            async def worker():
                for i, p in todo:
                    await send(i, p)

            await asyncio.gather(*(worker() for _ in range(min(n, len(prompts)))))
        else:
            rng, slots, due, tasks = random.Random(seed), asyncio.Semaphore(n), t0, []

            async def arrival(i, p):
                async with slots:
                    await send(i, p)

            try:
                for i, p in enumerate(prompts):
                    if i:  # absolute arrival times: the sleeps do not drift
                        due += rng.expovariate(rate)
                        await asyncio.sleep(max(0.0, due - time.perf_counter()))
                    tasks.append(asyncio.ensure_future(arrival(i, p)))
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
        wall = time.perf_counter() - t0
    return sorted(outcomes, key=lambda o: o.index), wall


# ---------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------

def _stats(values, name: str) -> dict:
    """mean/median/std/p90/p95/p99 in ms of `values` in seconds (empty -> None); std is the
    population standard deviation, as numpy's (and bench_serving's) default."""
    import numpy as np

    v = np.asarray([x for x in values if x is not None], dtype=float) * 1e3
    if v.size == 0:
        return {f"{s}_{name}_ms": None for s in STATS}
    return {f"mean_{name}_ms": float(v.mean()), f"median_{name}_ms": float(np.median(v)),
            f"std_{name}_ms": float(v.std()), f"p90_{name}_ms": float(np.percentile(v, 90)),
            f"p95_{name}_ms": float(np.percentile(v, 95)), f"p99_{name}_ms": float(np.percentile(v, 99))}


def summarize(outcomes: list[Outcome], wall: float) -> dict:
    """One summary row's metrics from a level's outcomes and wall time (bench_serving rules)."""
    ok = [o for o in outcomes if o.ok]
    out_tok = sum(o.completion_tokens for o in ok)
    in_tok = sum(o.prompt_tokens or 0 for o in ok)
    verified = [o for o in ok if o.spec_verify_ct]
    row = {
        "num_prompts": len(outcomes), "completed": len(ok), "failed": len(outcomes) - len(ok),
        "duration_s": wall, "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "req_per_s": len(ok) / wall, "input_tok_per_s": in_tok / wall,
        "output_tok_per_s": out_tok / wall, "total_tok_per_s": (in_tok + out_tok) / wall,
        **_stats([o.ttft for o in ok], "ttft"),
        **_stats([o.tpot for o in ok], "tpot"),
        **_stats([x for o in ok for x in o.itl], "itl"),
        **_stats([o.latency for o in ok], "e2e_latency"),
        "accept_length": None, "spec_verify_ct": None,
        "measured_concurrency": sum(o.latency for o in ok) / wall,
    }
    if verified:
        ct = sum(o.spec_verify_ct for o in verified)
        row["spec_verify_ct"] = ct
        row["accept_length"] = sum(o.completion_tokens for o in verified) / ct
    return row


def _ms(x):
    return None if x is None else x * 1e3


def request_row(o: Outcome, label: str, concurrency: int) -> dict:
    return {
        "label": label, "concurrency": concurrency, "index": o.index, "ok": int(o.ok),
        "error": o.error, "prompt_tokens": o.prompt_tokens,
        "completion_tokens": o.completion_tokens if o.ok else None,
        "tokens_from": o.tokens_from if o.ok else None,
        "ttft_ms": _ms(o.ttft), "tpot_ms": _ms(o.tpot), "e2e_latency_ms": _ms(o.latency),
        "itl_mean_ms": _ms(sum(o.itl) / len(o.itl)) if o.itl else None,
        "itl_max_ms": _ms(max(o.itl)) if o.itl else None, "events": o.events,
        "spec_verify_ct": o.spec_verify_ct,
        "accept_length": o.completion_tokens / o.spec_verify_ct if o.ok and o.spec_verify_ct else None,
        "server_e2e_latency_ms": _ms(o.server_e2e_latency), "start_s": o.start,
    }


def request_record(o: Outcome, label: str, concurrency: int, rate: float) -> dict:
    """One JSONL line: the CSV row's fields plus the request's ITL list (ms, one per token
    after the first) and the level's request rate (null when unthrottled)."""
    return {**request_row(o, label, concurrency), "request_rate": None if math.isinf(rate) else rate,
            "itl_ms": [x * 1e3 for x in o.itl]}


# ---------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------

def check_url(url: str) -> str:
    """Base URL without a trailing endpoint path; UserError if it is not http(s)://host:port."""
    parts = urlsplit(url or "")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"--url {url!r}: expected http://HOST:PORT")
    try:
        parts.port
    except ValueError:
        raise UserError(f"--url {url!r}: bad port") from None
    base = url.rstrip("/")
    for suffix in ("/generate", "/v1/completions", "/v1"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
    return base


def server_info(base: str, api: str, timeout: float) -> dict:
    """GET /get_server_info (sglang) and /v1/models; UserError when the host cannot be reached.

    Like bench_serving (aiohttp), the clients ignore HTTP(S)_PROXY: benchmark traffic goes
    straight to the server.
    """
    import httpx

    info = {}
    paths = ["/get_server_info", "/v1/models"] if api == "sglang" else ["/v1/models"]
    with httpx.Client(timeout=min(timeout, 10.0), trust_env=False) as c:
        for path in paths:
            try:
                r = c.get(base + path)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.UnsupportedProtocol) as e:
                raise UserError(f"cannot reach {base}: {type(e).__name__}: {e}") from None
            except httpx.TimeoutException:
                raise UserError(f"cannot reach {base}: no answer to GET {path} within "
                                f"{min(timeout, 10.0):g} s") from None
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                try:
                    info[path] = r.json()
                except ValueError:
                    pass
    return info


def _model_id(info: dict) -> str | None:
    try:
        return info["/v1/models"]["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        return None


def _server_accept_length(info: dict) -> float | None:
    """SGLang's server-wide avg_spec_accept_length (since the server started), if reported."""
    try:
        si = info["/get_server_info"]
        si = si["decode"][0] if "decode" in si else si
        return si["internal_states"][0].get("avg_spec_accept_length")
    except (KeyError, IndexError, TypeError, AttributeError):
        return None


def default_num_prompts(concurrency: int) -> int:
    return max(8, 4 * concurrency)


def run(url: str, api: str, concurrency: list[int], num_prompts: int | None, input_len: int,
        output_len: int, dataset: str = "random", warmup: int = 1, timeout: float = 300.0,
        model: str | None = None, label: str | None = None, seed: int = 0,
        out: Path = Path("results"), quiet: bool = False, request_rate: float = math.inf
        ) -> tuple[Path, Path]:
    """Measure the server at each concurrency level; returns (summary CSV, per-request CSV).

    Raises AllFailed, after writing every file, when every request of some level failed."""
    import httpx
    from rich.console import Console
    from rich.progress import Progress

    from ddbench.results import ResultWriter, run_metadata

    if api not in APIS:
        raise UserError(f"--api {api!r}: choose one of {', '.join(APIS)}")
    if not concurrency or min(concurrency) <= 0:
        raise UserError(f"--concurrency must be positive integers, got {concurrency}")
    for name, v in (("--num-prompts", num_prompts), ("--input-len", input_len),
                    ("--output-len", output_len)):
        if v is not None and v < 1:
            raise UserError(f"{name} must be >= 1, got {v}")
    if warmup < 0:
        raise UserError(f"--warmup must be >= 0, got {warmup}")
    if not timeout > 0:
        raise UserError(f"--timeout must be > 0, got {timeout}")
    if not request_rate > 0:
        raise UserError(f"--request-rate must be > 0 (inf: no throttle), got {request_rate}")
    base = check_url(url)
    # the warmup and every level get prompts of their own, so no level is served from a
    # prefix cache warmed by another; a dataset file shorter than that is reused cyclically
    counts = [num_prompts or default_num_prompts(c) for c in concurrency]
    prompts = make_prompts(dataset, warmup + sum(counts), input_len, output_len, api, seed)
    if api == "openai-chat" and not all(isinstance(p.prompt, str) for p in prompts):
        raise UserError(f"--dataset {dataset}: --api openai-chat needs text prompts, not input_ids")
    starts = [warmup + sum(counts[:i]) for i in range(len(counts))]
    info = server_info(base, api, timeout)
    model = model or _model_id(info)
    label = label or f"{api}@{urlsplit(base).netloc}"
    console = Console(stderr=True, quiet=quiet)
    rate = None if math.isinf(request_rate) else request_rate

    stamp = dt.datetime.now(dt.timezone.utc)   # one stamp for the run's files
    common = dict(url=base, api=api, model=model, label=label, dataset=dataset, seed=seed,
                  concurrency=concurrency, num_prompts=num_prompts, input_len=input_len,
                  output_len=output_len, warmup=warmup, timeout_s=timeout, request_rate=rate,
                  server_info=info, source="measured")
    fields = Fields()
    failures = []  # one line per level whose every request failed

    def note_plain():
        if fields.plain and not common.get("plain_openai"):
            common["plain_openai"] = True
            console.print("warning: the server rejected ignore_eos/continuous_usage_stats; "
                          "sending standard OpenAI fields only (outputs may end early)")

    async def main():
        limits = httpx.Limits(max_connections=max(concurrency) + warmup + 4,
                              max_keepalive_connections=max(concurrency) + warmup + 4)
        tmo = httpx.Timeout(timeout, connect=min(timeout, 10.0))
        async with httpx.AsyncClient(timeout=tmo, limits=limits, trust_env=False) as client:
            if warmup:  # all at once; also opens that many connections
                short = [Prompt(p.prompt, p.prompt_len, min(p.output_len, 16)) for p in prompts[:warmup]]
                outs, _ = await run_level(client, api, base, short, warmup, timeout, model, fields=fields)
                note_plain()
                if not any(o.ok for o in outs):
                    raise UserError(f"all {warmup} warmup request(s) to {base} failed: {outs[0].error}")
            with ResultWriter(**_where(out, "baseline_requests", stamp), meta=run_metadata("baseline_requests", **common)) as req_w, \
                 ResultWriter(**_where(out, "baseline", stamp), meta=run_metadata("baseline", **common)) as sum_w, \
                 open(req_w.out / f"{req_w.name}.jsonl", "w") as jsonl, \
                 Progress(console=console, transient=True) as bar:
                sum_w.meta["requests_csv"] = req_w.path.name
                sum_w.meta["requests_jsonl"] = req_w.meta["requests_jsonl"] = Path(jsonl.name).name
                for c, n, start in zip(concurrency, counts, starts):
                    todo = prompts[start:start + n]
                    task = bar.add_task(f"concurrency {c}", total=len(todo))

                    def done(o, c=c, task=task):
                        req_w.write(request_row(o, label, c))
                        jsonl.write(json.dumps(request_record(o, label, c, request_rate)) + "\n")
                        jsonl.flush()
                        bar.advance(task)

                    outs, wall = await run_level(client, api, base, todo, c, timeout, model, done,
                                                 fields, request_rate, seed + start)
                    note_plain()
                    row = summarize(outs, wall)
                    sum_w.write({**dict.fromkeys(SUMMARY_COLUMNS), **row,
                                 "label": label, "source": "measured", "api": api, "concurrency": c,
                                 "request_rate": rate,
                                 "input_len": input_len if dataset == "random" else None,
                                 "output_len": output_len})
                    if not row["completed"]:
                        failures.append(f"concurrency {c}: all {n} requests failed ({error_summary(outs)})")
                    elif row["failed"] > WARN_FAILED_FRACTION * n:
                        console.print(f"warning: concurrency {c}: {row['failed']} of {n} requests "
                                      f"failed ({error_summary(outs)})")
                sum_w.meta["plain_openai"] = req_w.meta["plain_openai"] = fields.plain
                if api == "sglang":  # SGLang's own running average, beside ours
                    try:
                        r = await client.get(base + "/get_server_info", timeout=min(timeout, 10.0))
                        after = {"/get_server_info": r.json()} if r.status_code == 200 else {}
                    except (httpx.HTTPError, ValueError):
                        after = {}
                    sum_w.meta["server_avg_spec_accept_length_after"] = _server_accept_length(after)
        return sum_w, req_w

    sum_w, req_w = asyncio.run(main())
    stdout = Console(quiet=quiet)
    print_summary(sum_w.rows, stdout)
    stdout.print(f"wrote {sum_w.path} and {req_w.path}")
    if failures:
        raise AllFailed("; ".join(failures))
    return sum_w.path, req_w.path


def print_summary(rows: list[dict], console=None) -> None:
    """A short table of the summary rows (medians), on stdout."""
    from rich.console import Console
    from rich.table import Table

    def f(x, fmt="{:.1f}"):
        return "" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)

    labels = sorted({str(r["label"]) for r in rows})
    t = Table(title=f"baseline {', '.join(labels)} (medians, bench_serving definitions)")
    for col in ("conc", "ok", "failed", "out tok/s", "TTFT ms", "TPOT ms", "ITL ms", "E2E ms", "accept"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["concurrency"]), str(r["completed"]), str(r["failed"]), f(r["output_tok_per_s"]),
                  f(r["median_ttft_ms"]), f(r["median_tpot_ms"], "{:.2f}"), f(r["median_itl_ms"], "{:.2f}"),
                  f(r["median_e2e_latency_ms"]), f(r["accept_length"], "{:.2f}"))
    (console or Console()).print(t)


# ---------------------------------------------------------------------------------------
# import of SGLang bench_serving --output-file results
# ---------------------------------------------------------------------------------------

def import_bench_serving(path: Path, out: Path, label: str | None = None) -> tuple[Path, Path | None]:
    """bench_serving `--output-file` JSONL (one result per line) -> summary CSV (+ per-request
    CSV when the lines carry `--output-details` lists). Returns (summary, requests or None)."""
    from ddbench.results import ResultWriter, run_metadata

    path = Path(path)
    if not path.is_file():
        raise UserError(f"--import {path}: no such file")
    results = []
    for no, d in read_jsonl(path):
        if not isinstance(d, dict) or "output_throughput" not in d:
            raise UserError(f"{path}:{no}: not a bench_serving result (no output_throughput)")
        results.append(d)
    if not results:
        raise UserError(f"{path}: no results")
    stamp = dt.datetime.now(dt.timezone.utc)   # one stamp for the run's files
    meta = dict(source="import", imported_from=str(path), label=label,
                note="bench_serving fields mapped to ddbench columns; per-request latency is "
                     "reconstructed as ttft + sum(itl) (bench_serving does not store it)")
    detailed = any("ttfts" in d for d in results)
    req_w = (ResultWriter(**_where(out, "baseline_requests", stamp, "import"), meta=run_metadata("baseline_requests", **meta)) if detailed else None)
    with ResultWriter(**_where(out, "baseline", stamp, "import"), meta=run_metadata("baseline", **meta)) as sum_w, (req_w or contextlib.nullcontext()):
        for no, d in enumerate(results, 1):
            row = _import_row(d, label or f"bench_serving {d.get('backend', '')}".strip(), no, path)
            sum_w.write(row)
            if req_w is not None and "ttfts" in d:
                for r in _import_requests(d, row["label"], row["concurrency"]):
                    req_w.write(r)
    return sum_w.path, (req_w.path if req_w is not None else None)


def _finite(x) -> float | None:
    """A finite number, else None (bench_serving writes an unthrottled rate as Infinity)."""
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def _import_row(d: dict, label: str, no: int, path: Path) -> dict:
    import numpy as np

    conc = d.get("max_concurrency") or d.get("max_concurrent_requests")
    if conc is None and d.get("concurrency") is not None:
        conc = max(1, round(d["concurrency"]))
    if conc is None:
        raise UserError(f"{path}:{no}: no max_concurrency or concurrency field")
    errors = d.get("errors")
    failed = sum(1 for e in errors if e) if isinstance(errors, list) else None
    dur = d.get("duration")
    tin, tout = d.get("total_input_tokens"), d.get("total_output_tokens")
    total = d.get("total_throughput")
    if total is None and dur and tin is not None and tout is not None:
        total = (tin + tout) / dur
    row = {**dict.fromkeys(SUMMARY_COLUMNS),
           "label": label, "source": "import", "api": d.get("backend"), "concurrency": int(conc),
           "num_prompts": (d.get("completed", 0) + failed) if failed is not None else None,
           "completed": d.get("completed"), "failed": failed,
           "input_len": d.get("random_input_len"), "output_len": d.get("random_output_len"),
           "duration_s": dur, "total_input_tokens": tin, "total_output_tokens": tout,
           "req_per_s": d.get("request_throughput"), "input_tok_per_s": d.get("input_throughput"),
           "output_tok_per_s": d.get("output_throughput"), "total_tok_per_s": total,
           "accept_length": d.get("accept_length"), "measured_concurrency": d.get("concurrency"),
           "request_rate": _finite(d.get("request_rate"))}
    for m in METRICS:
        for s in STATS:
            row[f"{s}_{m}_ms"] = d.get(f"{s}_{m}_ms")
    # older bench_serving versions lack p90: compute it from the details where present
    ttfts = d.get("ttfts") if isinstance(d.get("ttfts"), list) else []
    ok = [i for i in range(len(ttfts)) if not (isinstance(errors, list) and errors[i])]
    if row["p90_ttft_ms"] is None and ok:
        row["p90_ttft_ms"] = float(np.percentile([ttfts[i] for i in ok], 90) * 1e3)
    if row["p90_itl_ms"] is None and isinstance(d.get("itls"), list) and ok:
        flat = [x for i in ok for x in d["itls"][i]]
        if flat:
            row["p90_itl_ms"] = float(np.percentile(flat, 90) * 1e3)
    return row


def _import_requests(d: dict, label: str, conc: int):
    n = len(d["ttfts"])
    errors = d.get("errors") or [""] * n
    itls = d.get("itls") or [[]] * n
    outs = d.get("output_lens") or [None] * n
    ins = d.get("input_lens") or [None] * n
    for i in range(n):
        ok = not errors[i]
        itl = itls[i] or []
        ttft = d["ttfts"][i] if ok else None
        lat = ttft + sum(itl) if ok else None
        out = outs[i] if ok else None
        yield {**dict.fromkeys(REQUEST_COLUMNS),
               "label": label, "concurrency": conc, "index": i, "ok": int(ok),
               "error": (errors[i] or "").strip().splitlines()[-1][:300] if errors[i] else "",
               "prompt_tokens": ins[i], "completion_tokens": out, "tokens_from": "server" if ok else None,
               "ttft_ms": _ms(ttft), "e2e_latency_ms": _ms(lat),
               "tpot_ms": _ms((lat - ttft) / (out - 1)) if ok and out and out > 1 else None,
               "itl_mean_ms": _ms(sum(itl) / len(itl)) if ok and itl else None,
               "itl_max_ms": _ms(max(itl)) if ok and itl else None}
