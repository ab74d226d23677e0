"""Greedy autoregressive decoding of N streams with a CUDA-graph decode step.

`decode_forward` is the one autoregressive (AR) decode step of the engine: one target
forward of one token per stream at the position after its cached prefix, and the greedy
pick. Both commands run it: `Decoder` here (`ddbench decode`) and `engine.spec.ARStep`
(the AR rows of `ddbench e2e`, over a `Session`'s buffers; it also names the tokens to the
routing hook and records exact top-2 ties).

`Decoder` owns the static state of a batch: the KV cache, `prefix_len` (tokens cached per
stream), the current token of each stream and the decode-step visibility mask. `prefill`
runs each prompt as one causal forward; `step` decodes one token per stream from those
static buffers without host syncs (`decode_forward`, then the token and `prefix_len`
advance), so on a GPU it is captured once in a CUDA graph and replayed. The generated
tokens are identical with and without the graph.

How a step is timed (`measure_decode`):

- step time: the CUDA graph is replayed once per generated token, each replay bracketed
  by CUDA events (no host sync between replays); median and p20/p80 over the decode.
  On CPU (or without a graph) a host clock brackets each eager step.
- phase breakdown: `engine.phases.PhaseTimer` marks phase boundaries (attention, moe,
  mlp, comm, lm_head; the rest is "other"). On GPU a second CUDA graph of the step is
  captured with timing events as event-record nodes at those boundaries
  (`torch.cuda.Event(external=True)`) and replayed 5 times; the median per phase is
  reported ("graph" method), so the phases are graph-mode times without launch gaps and
  `phases_sum_us` is close to the step time (the event nodes add a little). Where that is
  not possible (CPU, no graph, older torch) one eager step is timed per phase instead
  ("eager"), on GPU after a head start (`torch.cuda._sleep`) so the host queues work
  ahead of the GPU. The batch state is saved before and restored after every timing
  pass (and the graph's warm-up), so timing does not change the output.
- communication: for `SimComm`, the all-reduce/all-gather times of one step are modelled
  (`comm.modelled_us` summed over the Python pass of the phase-timed step, i.e. the
  capture of the timing graph or the eager step) and are not in the measured step (the
  stand-ins do no communication); for `DistComm` they are measured like any other phase
  and are part of the graph's step time.
"""
from __future__ import annotations

import statistics
import time

import torch

from ddbench.engine.model import Transformer, causal_visible
from ddbench.engine.phases import PhaseTimer
from ddbench.engine.routing import keyed

PHASES = ("attention", "moe", "mlp", "comm", "lm_head", "other")
HEAD_START_CYCLES = 200_000_000   # ~0.1 s of GPU spin before an eager phase-timed step or verify


def decode_forward(model: Transformer, tok: torch.Tensor, prefix_len: torch.Tensor, cache, visible: torch.Tensor,
                   routing=None, keys: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The AR decode step's work on the target (capturable: no host syncs): token `tok[b]`
    (long `[B, 1]`) of every stream at position `prefix_len[b]` (int `[B]`, tokens cached
    before it; its KV is written there), seeing its cached prefix and itself (`visible`
    bool `[B, 1, 1]`, all True) -> (logits fp32 `[B, 1, vocab]`, greedy next token long
    `[B, 1]`). The caller advances its own state. `routing` (an `engine.routing.Routing`):
    the forward's tokens are named to it by `keys` (long `[B, 1]`, `engine.routing.PrefixKeys`;
    keyed draws) and the key cleared after, as `ARStep` does; None leaves the model's hook as
    it is (`Decoder`: unkeyed draws)."""
    b = tok.shape[0]
    pos = prefix_len.long().view(b, 1)                                          # [B, 1] rope positions
    with keyed(routing, keys):
        logits, _ = model(tok, pos, cache, prefix_len, visible)                 # [B, 1, V]
    return logits, logits.argmax(-1)


class Decoder:
    """Greedy decoding state for `n_streams` streams of up to `max_len` tokens."""

    def __init__(self, model: Transformer, n_streams: int, max_len: int, use_graph: bool | None = None):
        dev = model.device
        self.model, self.n_streams, self.max_len = model, n_streams, max_len
        self.cache = model.new_cache(n_streams, max_len)
        self.prefix_len = torch.zeros(n_streams, dtype=torch.int32, device=dev)
        self.tok = torch.zeros(n_streams, 1, dtype=torch.long, device=dev)       # [B, 1]
        self.visible = torch.ones(n_streams, 1, 1, dtype=torch.bool, device=dev)  # [B, 1, 1]
        if use_graph is None:  # the torch MoE reference syncs the host (expert loop), so no graph
            use_graph = dev.type == "cuda" and model.moe_backend != "torch"
        self.use_graph = use_graph
        self.graph = None

    @torch.no_grad()
    def prefill(self, prompts: torch.Tensor) -> torch.Tensor:
        """prompts long `[B, P]` -> each stream's first generated token `[B]`; resets the batch."""
        b, p = prompts.shape
        if p + 1 > self.max_len:
            raise ValueError(f"prompt of {p} tokens does not fit max_len={self.max_len}")
        dev = self.prefix_len.device
        self.prefix_len.zero_()
        pos = torch.arange(p, device=dev).expand(b, p)                          # [B, P]
        logits, _ = self.model(prompts.to(dev), pos, self.cache, self.prefix_len, causal_visible(b, p, dev))
        self.tok.copy_(logits[:, -1:].argmax(-1))                               # [B, 1]
        self.prefix_len += p
        return self.tok[:, 0].clone()

    def _step(self) -> None:
        """One decode step from the static buffers (capturable: no host syncs)."""
        _, nxt = decode_forward(self.model, self.tok, self.prefix_len, self.cache, self.visible)
        self.tok.copy_(nxt)                                                      # [B, 1]
        self.prefix_len.add_(1)

    def _save(self):
        return self.prefix_len.clone(), self.tok.clone()

    def _restore(self, state) -> None:
        self.prefix_len.copy_(state[0])
        self.tok.copy_(state[1])

    @torch.no_grad()
    def capture(self) -> None:
        """Record the decode step in a CUDA graph (warm-up on a side stream first)."""
        state = self._save()
        side = torch.cuda.Stream(self.prefix_len.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        self._restore(state)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self._step()
            torch.cuda.synchronize()
        finally:
            self._restore(state)
        self.graph = graph

    @torch.no_grad()
    def advance(self) -> None:
        """Decode one token per stream into `self.tok` (graph replay when captured)."""
        if self.use_graph and self.graph is None:
            self.capture()
        if self.graph is not None:
            self.graph.replay()
        else:
            self._step()

    def step(self) -> torch.Tensor:
        """Decode one token per stream -> `[B]` (a copy, safe to keep)."""
        self.advance()
        return self.tok[:, 0].clone()

    @torch.no_grad()
    def timed_phases(self, reps: int = 5) -> tuple[dict[str, float], str]:
        """Per-phase time of one decode step (state restored after) -> (phase -> us, method).

        With a graph: a second graph of the step with timing events at the phase boundaries
        (`PhaseTimer(external=True)`), replayed `reps` times, median per phase ("graph").
        Otherwise, or if that fails: one eager step with events after a GPU head start
        ("eager"). The comm stand-ins of a SimComm model exactly one step's collectives.
        """
        if self.graph is not None:
            try:
                return self._graph_phases(reps), "graph"
            except Exception as e:  # noqa: BLE001 - older torch: fall back, say so
                print(f"note: phase timing inside a CUDA graph failed ({type(e).__name__}: {e}); "
                      "timing phases on an eager step")
        return self._eager_phases(), "eager"

    def _reset_comm(self) -> None:
        if hasattr(self.model.comm, "reset"):
            self.model.comm.reset()

    def _graph_phases(self, reps: int) -> dict[str, float]:
        state = self._save()
        timer = PhaseTimer(self.prefix_len.device, external=True, merge=True)
        self._reset_comm()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            with timer.active():
                self._step()
        runs = []
        for _ in range(reps):
            self._restore(state)
            graph.replay()
            runs.append(timer.totals_us())
        self._restore(state)
        del graph
        return {p: statistics.median(r.get(p, 0.0) for r in runs) for p in runs[0] if p != "end"}

    def _eager_phases(self) -> dict[str, float]:
        state = self._save()
        self._step()  # warm (shapes differ from the prefill's)
        self._restore(state)
        self._reset_comm()
        timer = PhaseTimer(self.prefix_len.device, merge=True)
        if timer.cuda:
            torch.cuda.synchronize()
            torch.cuda._sleep(HEAD_START_CYCLES)
        with timer.active():
            self._step()
        out = timer.totals_us()
        out.pop("end", None)
        self._restore(state)
        return out

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, n_new: int) -> torch.Tensor:
        """Greedy continuation: prompts `[B, P]` -> new tokens `[B, n_new]`."""
        if prompts.shape[1] + n_new > self.max_len:
            raise ValueError(f"{prompts.shape[1]} + {n_new} tokens do not fit max_len={self.max_len}")
        out = [self.prefill(prompts)]
        for _ in range(n_new - 1):
            out.append(self.step())
        return torch.stack(out, dim=1)


def step_bytes(model: Transformer, n_streams: int, context: float) -> dict[str, float]:
    """Bytes a decode step must read at least: weights (dense all, routed experts touched by
    `n_streams` tokens under uniform top-k routing, embedding rows) and KV of `context` cached
    tokens per stream."""
    cfg = model.cfg
    dense = sum(t.numel() * t.element_size() for name, (t, _) in model.hf_weights().items()
                if name != "model.embed_tokens.weight")
    dense += n_streams * cfg.hidden * model.dtype.itemsize
    moes = list(model.moe_blocks().values())
    expert = moes[0].experts().expert_bytes() if moes else 0
    touched = cfg.n_experts * (1 - (1 - cfg.top_k / cfg.n_experts) ** n_streams)
    routed = len(moes) * touched * expert
    kv = n_streams * context * cfg.kv_values_per_token * model.dtype.itemsize
    return {"weight_bytes": dense + routed, "dense_bytes": dense, "routed_bytes": routed,
            "experts_touched": touched, "kv_bytes": kv}


def measure_decode(model: Transformer, n_streams: int, prompt_len: int, new_tokens: int, seed: int = 0,
                   use_graph: bool | None = None) -> dict:
    """Prefill random prompts, time `new_tokens` greedy steps and one phase-timed step.

    Returns a dict: tokens `[B, new_tokens]` (CPU), step_us/_p20/_p80 (per step, graph replay
    on GPU), phases_us (phase -> us), phase_method ('graph' or 'eager'), comm_modelled_us
    (SimComm, per step, else 0), prefill_s, cuda_graph, mean_context.
    """
    dev = model.device
    cuda = dev.type == "cuda"
    if new_tokens < 2:
        raise ValueError("new_tokens must be at least 2 (one prefill token + timed steps)")
    dec = Decoder(model, n_streams, prompt_len + new_tokens + 4, use_graph)
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, model.cfg.vocab, (n_streams, prompt_len), generator=g)

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    sync()
    t0 = time.perf_counter()
    out = [dec.prefill(prompts)]
    sync()
    prefill_s = time.perf_counter() - t0

    if dec.use_graph:
        try:
            dec.capture()
        except Exception as e:  # noqa: BLE001 - report and time eager steps instead
            print(f"note: CUDA-graph capture of the decode step failed ({type(e).__name__}: {e}); "
                  "timing eager steps (cuda_graph = False)")
            dec.use_graph, dec.graph = False, None
    comm = model.comm
    phases, phase_method = dec.timed_phases()
    comm_modelled = getattr(comm, "modelled_us", 0.0)

    samples = []
    if cuda:
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
               for _ in range(new_tokens - 1)]
        for s, e in evs:
            s.record()
            dec.advance()
            e.record()
            out.append(dec.tok[:, 0].clone())
        sync()
        samples = [s.elapsed_time(e) * 1e3 for s, e in evs]
    else:
        for _ in range(new_tokens - 1):
            t = time.perf_counter()
            dec.advance()
            samples.append((time.perf_counter() - t) * 1e6)
            out.append(dec.tok[:, 0].clone())
    q = statistics.quantiles(samples, n=5, method="inclusive") if len(samples) > 1 else [samples[0]] * 4
    return {
        "tokens": torch.stack(out, 1).cpu(),
        "step_us": statistics.median(samples), "step_us_p20": q[0], "step_us_p80": q[3],
        "phases_us": {p: phases.get(p, 0.0) for p in PHASES},
        "comm_modelled_us": comm_modelled if getattr(comm, "simulated", False) else 0.0,
        "prefill_s": prefill_s, "cuda_graph": dec.graph is not None, "phase_method": phase_method,
        "mean_context": prompt_len + new_tokens / 2,
    }
