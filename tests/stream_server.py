"""A tiny streaming LLM server for tests: SGLang native `/generate`, OpenAI `/v1/completions`
and `/v1/chat/completions`.

It streams a known token schedule: the first event (`first` tokens) `ttft_s` after the request
arrives, then one event of `per_event` tokens every `gap_s` (the last event may be smaller),
until `max_new_tokens` / `max_tokens`. Each event after the first counts as one speculative
verify round (`spec_verify_ct`). Sleeps target absolute times, so gaps do not drift.

It records how many requests are in flight (the count drops before the final bytes are sent,
so a client cannot start its next request before the drop) and can inject faults by arrival
number (1-based): 'http500', 'reset' (TCP RST after the first event), 'malformed' (a broken
JSON event), 'hang' (sleeps `hang_s`, then gives up), 'cut' (ends the stream cleanly after
the first event: no finish reason, no usage, no [DONE]). With `done=False` a stream ends
after its finish / usage event without `data: [DONE]`, as Hugging Face's `transformers serve`
does. Chat streams open with a role-only chunk that carries no token. Listens on 127.0.0.1 only.

`TestServer` runs it in a child process (so its threads never share a GIL with the client
being measured) and reads its counters over GET /stats; POST /reset clears them and
POST /config changes the schedule.
"""
from __future__ import annotations

import dataclasses
import json
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Schedule:
    ttft_s: float = 0.05
    gap_s: float = 0.02
    first: int = 1
    per_event: int = 1
    usage: str = "continuous"  # openai: 'continuous' (every chunk), 'final' (last chunk) or 'none'
    faults: dict = field(default_factory=dict)  # arrival number -> fault name
    hang_s: float = 1.5
    strict: bool = False  # openai: reject the non-standard ignore_eos / continuous_usage_stats (HTTP 400)
    done: bool = True  # end every stream with data: [DONE]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # like uvicorn: small SSE events go out at once

    def log_message(self, *args):  # quiet
        pass

    def _json(self, code: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/get_server_info":
            self._json(200, {"model_path": "test/model", "tp_size": 1,
                             "internal_states": [{"avg_spec_accept_length": 3.0}]})
        elif self.path == "/stats":
            srv = self.server.owner
            with srv.lock:
                self._json(200, {"max_in_flight": srv.max_in_flight, "in_flight": srv.in_flight,
                                 "arrivals": srv.arrivals, "bodies": srv.bodies})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "test-model", "object": "model"}]})
        else:
            self._json(404, {"error": "not found"})

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _event(self, obj) -> None:
        text = obj if isinstance(obj, str) else json.dumps(obj)
        self._chunk(f"data: {text}\n\n".encode())

    def do_POST(self):
        srv: _State = self.server.owner
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        t0 = time.perf_counter()
        if self.path == "/reset":
            srv.reset_stats()
            return self._json(200, {})
        if self.path == "/config":
            srv.schedule = dataclasses.replace(srv.schedule, **body)
            return self._json(200, {})
        native, chat = self.path == "/generate", self.path == "/v1/chat/completions"
        if self.path not in ("/generate", "/v1/completions", "/v1/chat/completions"):
            return self._json(404, {"error": f"no route {self.path}"})
        arrival = srv.arrive(body)
        left = [True]  # still counted in flight

        def leave():
            if left[0]:
                left[0] = False
                srv.leave()

        try:
            sch = srv.schedule
            fault = sch.faults.get(arrival)
            if fault == "http500":
                leave()
                return self._json(500, {"error": "injected failure"})
            if fault == "hang":
                time.sleep(sch.hang_s)
                leave()
                self.close_connection = True
                return
            if not native and sch.strict and ("ignore_eos" in body or "continuous_usage_stats" in
                                              (body.get("stream_options") or {})):
                leave()
                return self._json(400, {"error": "unrecognized request argument: ignore_eos"})
            out = body["sampling_params"]["max_new_tokens"] if native else body["max_tokens"]
            prompt = (body.get("input_ids") or body.get("text") or body.get("prompt")
                      or " ".join(m["content"] for m in body.get("messages", [])))
            n_prompt = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            sent, rounds, due = 0, 0, t0 + sch.ttft_s
            obj = "chat.completion.chunk" if chat else "text_completion"
            if chat:
                self._event({"id": str(arrival), "object": obj, "model": "test-model",
                             "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            while sent < out:
                n = min(sch.first if sent == 0 else sch.per_event, out - sent)
                time.sleep(max(0.0, due - time.perf_counter()))
                rounds += sent > 0
                sent += n
                if sent == out:
                    leave()  # before the last event: the client cannot start a new request earlier
                if native:
                    self._event({"text": "x" * sent, "meta_info": {
                        "id": str(arrival), "prompt_tokens": n_prompt, "completion_tokens": sent,
                        "spec_verify_ct": rounds, "e2e_latency": time.perf_counter() - t0,
                        "finish_reason": {"type": "length", "length": out} if sent == out else None}})
                else:
                    choice = {"index": 0, "finish_reason": "length" if sent == out else None}
                    if chat:
                        choice["delta"] = {"content": " tok" * n}
                    else:
                        choice["text"] = " tok" * n
                    ev = {"id": str(arrival), "object": obj, "model": "test-model", "choices": [choice]}
                    if sch.usage == "continuous" and (body.get("stream_options") or {}).get(
                            "continuous_usage_stats"):
                        ev["usage"] = {"prompt_tokens": n_prompt, "completion_tokens": sent,
                                       "total_tokens": n_prompt + sent}
                    self._event(ev)
                if fault == "reset":
                    leave()
                    self.wfile.flush()
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.wfile.close()
                    self.rfile.close()
                    self.connection.close()  # RST: the client sees a connection reset
                    self.close_connection = True
                    return
                if fault == "malformed":
                    leave()
                    self._event("{not json")
                    self._event("[DONE]")
                    self._chunk(b"")
                    return
                if fault == "cut":
                    leave()
                    self._chunk(b"")
                    return
                due += sch.gap_s
            if not native and (sch.usage == "final" or sch.usage == "continuous" and not (
                    body.get("stream_options") or {}).get("continuous_usage_stats")):
                self._event({"id": str(arrival), "object": obj, "choices": [],
                             "usage": {"prompt_tokens": n_prompt, "completion_tokens": out,
                                       "total_tokens": n_prompt + out}})
            if sch.done:
                self._event("[DONE]")
            self._chunk(b"")
        finally:
            leave()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):  # a client that hung up: not our problem
        pass


class _State:
    """Counters and schedule of the serving process."""

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        self.arrivals = 0
        self.bodies: list[dict] = []

    def arrive(self, body: dict) -> int:
        with self.lock:
            self.arrivals += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.bodies.append(body)
            return self.arrivals

    def leave(self) -> None:
        with self.lock:
            self.in_flight -= 1

    def reset_stats(self) -> None:
        with self.lock:
            self.max_in_flight = self.in_flight
            self.arrivals = 0
            self.bodies = []


def serve(schedule: Schedule) -> None:
    """Serve on a free loopback port; print the URL; stop when stdin closes."""
    httpd = _Server(("127.0.0.1", 0), _Handler)
    httpd.owner = _State(schedule)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    print(f"http://127.0.0.1:{httpd.server_address[1]}", flush=True)
    sys.stdin.read()  # the parent closes our stdin (or dies): stop
    httpd.shutdown()


class TestServer:
    """`with TestServer(Schedule(...)) as s:` -> `s.url`, `s.max_in_flight`, `s.bodies` ..."""

    __test__ = False  # not a pytest class

    def __init__(self, schedule: Schedule | None = None):
        self.schedule = schedule or Schedule()

    def __enter__(self):
        cfg = dataclasses.asdict(self.schedule)
        self.proc = subprocess.Popen([sys.executable, __file__, json.dumps(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.url = self.proc.stdout.readline().strip()
        if not self.url.startswith("http://"):
            self.__exit__()
            raise RuntimeError("test server did not start")
        return self

    def __exit__(self, *exc):
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        return False

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        import httpx

        r = httpx.request(method, self.url + path, json=body, timeout=5, trust_env=False)
        r.raise_for_status()
        return r.json()

    def stats(self) -> dict:
        return self._call("GET", "/stats")

    @property
    def max_in_flight(self) -> int:
        return self.stats()["max_in_flight"]

    @property
    def arrivals(self) -> int:
        return self.stats()["arrivals"]

    @property
    def bodies(self) -> list[dict]:
        return self.stats()["bodies"]

    def reset_stats(self) -> None:
        self._call("POST", "/reset", {})

    def configure(self, **fields) -> None:
        """Change the schedule of the running server (e.g. gap_s=0.05)."""
        self._call("POST", "/config", fields)


def free_port() -> int:
    """A port nothing listens on (bound and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    cfg = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    cfg["faults"] = {int(k): v for k, v in cfg.get("faults", {}).items()}
    serve(Schedule(**cfg))
