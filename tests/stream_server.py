"""A tiny streaming LLM server for tests: SGLang native `/generate` and OpenAI `/v1/completions`.

It streams a known token schedule: the first event (`first` tokens) `ttft_s` after the request
arrives, then one event of `per_event` tokens every `gap_s` (the last event may be smaller),
until `max_new_tokens` / `max_tokens`. Each event after the first counts as one speculative
verify round (`spec_verify_ct`). Sleeps target absolute times, so gaps do not drift.

It records how many requests are in flight (the count drops before the final bytes are sent,
so a client cannot start its next request before the drop) and can inject faults by arrival
number (1-based): 'http500', 'reset' (TCP RST after the first event), 'malformed' (a broken
JSON event), 'hang' (sleeps `hang_s`, then gives up). Listens on 127.0.0.1 only.
"""
from __future__ import annotations

import json
import socket
import struct
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
        srv: TestServer = self.server.owner
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        t0 = time.perf_counter()
        native = self.path == "/generate"
        if self.path not in ("/generate", "/v1/completions"):
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
            out = body["sampling_params"]["max_new_tokens"] if native else body["max_tokens"]
            prompt = body.get("input_ids") or body.get("text") or body.get("prompt")
            n_prompt = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            sent, rounds, due = 0, 0, t0 + sch.ttft_s
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
                    ev = {"id": str(arrival), "object": "text_completion", "model": "test-model",
                          "choices": [{"index": 0, "text": " tok" * n,
                                       "finish_reason": "length" if sent == out else None}]}
                    if sch.usage == "continuous":
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
                due += sch.gap_s
            if not native and sch.usage == "final":
                self._event({"id": str(arrival), "object": "text_completion", "choices": [],
                             "usage": {"prompt_tokens": n_prompt, "completion_tokens": out,
                                       "total_tokens": n_prompt + out}})
            self._event("[DONE]")
            self._chunk(b"")
        finally:
            leave()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):  # a client that hung up: not our problem
        pass


class TestServer:
    """Start with `with TestServer(Schedule(...)) as s:`; `s.url`, `s.max_in_flight`, `s.bodies`."""

    __test__ = False  # not a pytest class

    def __init__(self, schedule: Schedule | None = None):
        self.schedule = schedule or Schedule()
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        self.arrivals = 0
        self.bodies: list[dict] = []
        self.httpd = _Server(("127.0.0.1", 0), _Handler)
        self.httpd.owner = self
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

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

    def __enter__(self):
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)
        return False


def free_port() -> int:
    """A port nothing listens on (bound and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
