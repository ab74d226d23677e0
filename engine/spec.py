"""The DDTree speculative decoding loop, batched over N streams (DESIGN §5).

One step, for every stream at once and without host syncs:

  draft   the drafter turns [bonus, MASK x (B-1)] into B-1 per-position distributions
  tree    top-K per position, best-first tree of `budget` nodes (root = the bonus token)
  verify  one target forward over [root + nodes] of every stream: positions start + depth,
          each node sees the cached prefix and its ancestors; target argmax at every node
  accept  greedy walk (or a synthetic draw, below) -> accepted path, next bonus token;
          the accepted nodes' KV moves to the contiguous positions after the prefix
  context the drafter's context cache takes the accepted tokens' hidden states; the
          stream's prefix, output and bonus advance (finished streams stand still)

Each phase is captured as its own CUDA graph per (concurrency, budget), so a step is five
graph replays with timing events between them and the phase times are measured, not
estimated. `ARStep` is plain greedy decoding over the same session, for the speed-up in
the same run and as the lossless reference: its verify phase is the AR decode step of
`engine.decode` (`decode_forward`), the one `ddbench decode` times.

Acceptance modes (`parse_acceptance`): `real` is the true greedy walk (lossless: the
output equals greedy decoding of the target). Random weights make a real drafter miss, so
the drawn modes keep every kernel on real shapes but decide the accepted path per stream
and step by a draw of the target's token rank at every depth (`engine.acceptance`):

- `rank:PROFILE`: the rank is drawn from a rank profile (p[d][r]: the target's token is
  the drafter's rank-r candidate); the tree is built from log p (a calibrated drafter),
  and the longest root path whose ranks match is accepted, so a wider tree accepts more
  as far as the profile's lower ranks carry mass;
- `synthetic:TAU` and `profile:FILE` walk the rank-0 chain only: depth d is accepted with
  probability a_d (given depth d-1 was), a constant a chosen so the mean tokens per step
  (bonus included) is TAU, or a_d read from a per-depth file; the tree is built from
  log-probs with rank 0 at log a_d and the rest sharing 1 - a_d.

In every drawn mode the tree holds the drafter's real top-K token ids; one captured graph
serves them all (the draw's tables are device buffers). Random weights alone give flat
distributions and a shallow, wide tree.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ddbench.engine.acceptance import (RankCounter, RankProfile, chain_tokens, draw_ranks, expected_curve, fit_top1,
                                       load_profile, matched_path)
from ddbench.engine.config import ConfigError
from ddbench.engine.decode import HEAD_START_CYCLES, decode_forward
from ddbench.engine.phases import PhaseTimer
from ddbench.engine.routing import PrefixKeys, keyed
from ddbench.kernels import ddtree

PHASES = ("draft", "tree", "verify", "accept", "context")


# --- acceptance modes ---------------------------------------------------------------

@dataclass
class Acceptance:
    """How accepted paths are decided: mode 'real', 'synthetic', 'profile' or 'rank'."""
    mode: str = "real"
    probs: tuple[float, ...] | None = None   # per-depth conditional acceptance a_1..a_L (chain modes)
    label: str = "real"
    profile: RankProfile | None = None       # rank mode

    @property
    def tau(self) -> float | None:
        """Expected tokens per step of the rank-0 chain, bonus included (None for 'real')."""
        if self.profile is not None:
            return self.profile.chain_tokens()
        return None if self.probs is None else chain_tokens(self.probs)

    def tables(self, depth: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tree log-probs `[L, K]` sorted descending, match probabilities `[L, K]`) of a drawn mode."""
        if self.profile is not None:
            p = self.profile.table(depth, k)
            return p.clamp(min=1e-9).log().float(), p
        match = torch.zeros(depth, k, dtype=torch.float64)
        match[:, 0] = torch.tensor(self.probs, dtype=torch.float64)
        return profile_logp(self.probs, k), match

    def expected_curve(self, depth: int, k: int, max_budget: int) -> list[float] | None:
        """E[tokens per step] for budgets 0..max_budget (None for 'real')."""
        if self.mode == "real":
            return None
        return expected_curve(*self.tables(depth, k), max_budget)


def tau_probs(tau: float, depth: int) -> tuple[float, ...]:
    """Constant per-depth acceptance a with 1 + a + .. + a^depth = tau."""
    if not 1.0 <= tau <= depth + 1:
        raise ConfigError(f"synthetic TAU={tau} must be in 1..{depth + 1} (block depth {depth} + bonus)")
    return tuple([fit_top1(tau, depth)] * depth)


def read_profile(path: Path, depth: int) -> tuple[float, ...]:
    """Per-depth acceptance probabilities from a file: a JSON list (or {"accept_prob": [..]}),
    or text/CSV with one number per line (a header line and '#' comments are skipped).
    Shorter profiles are padded with 0 (nothing accepted deeper), longer ones cut."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"acceptance profile {path} does not exist")
    text = path.read_text()
    try:
        data = json.loads(text)
        vals = data["accept_prob"] if isinstance(data, dict) else data
        vals = [float(v) for v in vals]
    except (ValueError, KeyError, TypeError):
        vals = []
        for line in text.splitlines():
            line = line.split("#")[0].strip().split(",")[-1].strip()
            if not line:
                continue
            try:
                vals.append(float(line))
            except ValueError:
                if vals:
                    raise ConfigError(f"acceptance profile {path}: cannot read {line!r} as a number") from None
    if not vals:
        raise ConfigError(f"acceptance profile {path} holds no numbers")
    if any(not 0.0 <= v <= 1.0 for v in vals):
        raise ConfigError(f"acceptance profile {path}: probabilities must be in [0, 1]")
    return tuple((vals + [0.0] * depth)[:depth])


def parse_acceptance(text: str, depth: int) -> Acceptance:
    """'real' | 'synthetic:TAU' | 'profile:FILE' | 'rank:PROFILE' -> Acceptance for a drafter
    of `depth` (PROFILE: a shipped profile's name or a JSON file)."""
    kind, _, arg = text.partition(":")
    if kind == "real" and not arg:
        return Acceptance()
    if kind == "synthetic" and arg:
        try:
            tau = float(arg)
        except ValueError:
            raise ConfigError(f"--acceptance {text!r}: TAU must be a number") from None
        return Acceptance("synthetic", tau_probs(tau, depth), f"synthetic:{tau:g}")
    if kind == "profile" and arg:
        return Acceptance("profile", read_profile(Path(arg), depth), f"profile:{Path(arg).name}")
    if kind == "rank" and arg:
        prof = load_profile(arg)
        return Acceptance("rank", None, f"rank:{prof.name}", prof)
    raise ConfigError(f"--acceptance {text!r}: use real, synthetic:TAU, profile:FILE or rank:PROFILE")


def profile_logp(probs, k: int) -> torch.Tensor:
    """Tree log-probs `[L, K]` (sorted descending) for a drafter with per-depth acceptance
    `probs`: rank 0 gets a_d, ranks 1.. share 1 - a_d geometrically (halving)."""
    a = torch.tensor(probs, dtype=torch.float64).clamp(1e-9, 1 - 1e-9)           # [L]
    rest = 0.5 ** torch.arange(1, k, dtype=torch.float64)                       # [K-1]
    rest = rest / rest.sum() if k > 1 else rest
    p = torch.cat([a[:, None], (1 - a)[:, None] * rest[None, :]], dim=1)         # [L, K]
    return p.log().sort(dim=-1, descending=True).values.float()


# --- the session: streams, caches, prefill ----------------------------------------

class Session:
    """N streams over one target model (and optionally a drafter): the target KV cache,
    the drafter context cache and each stream's progress, all on the model's device.

    prefix_len `[N]` committed tokens (= the bonus token's position), bonus `[N]` the next
    token to verify (already an output), out `[N, W]` generated tokens (n_out `[N]` valid),
    limit `[N]` tokens to generate, done `[N]`; keys (`engine.routing.PrefixKeys`) each
    stream's committed prefix hash, which names every forward's tokens to `routing`.
    """

    def __init__(self, model, drafter=None, n_streams: int = 1, max_prompt: int = 256, max_new: int = 64,
                 max_budget: int = 0):
        self.model, self.drafter, self.n = model, drafter, n_streams
        self.device = model.device
        # a step writes at most max(budget + 1, block) positions past the committed prefix,
        # and the last step of a stream may overshoot its limit by up to block - 1 tokens
        block = drafter.block if drafter is not None else 1
        self.reach = max(max_budget + 1, block)
        self.max_prompt, self.max_new = max_prompt, max_new
        self.max_len = max_len = max_prompt + max_new + block + self.reach
        self.cache = model.new_cache(n_streams, max_len)
        if drafter is not None:
            drafter.alloc(n_streams, max_len)
        depth = drafter.dc.depth if drafter is not None else 0
        dev, n = self.device, n_streams
        self.width = max_new + 2 * (depth + 2)        # room for one step's overshoot
        self.prefix_len = torch.zeros(n, dtype=torch.long, device=dev)
        self.bonus = torch.zeros(n, dtype=torch.long, device=dev)
        self.out = torch.zeros(n, self.width, dtype=torch.long, device=dev)
        self.tied = torch.zeros(n, self.width, dtype=torch.bool, device=dev)   # output came from a top-2 tie
        self.routing = None            # engine.routing.Routing of the model: told each verify's tree
        self.keys = PrefixKeys(n, max_len, dev)
        self.n_out = torch.zeros(n, dtype=torch.long, device=dev)
        self.limit = torch.zeros(n, dtype=torch.long, device=dev)
        self.done = torch.zeros(n, dtype=torch.bool, device=dev)
        self.prompt_lens: list[int] = []
        self._snap = None

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return self.drafter.target_layers if self.drafter is not None else ()

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], new_tokens, chunk: int = 256) -> None:
        """Run every prompt through the target (chunked, padded to the longest prompt),
        take each stream's first token, fill the drafter context, and snapshot the state.
        `new_tokens`: one int for all streams or one per stream (first token included)."""
        n, dev = self.n, self.device
        if len(prompts) != n:
            raise ConfigError(f"{len(prompts)} prompts for {n} streams")
        lens = [len(p) for p in prompts]
        limits = [new_tokens] * n if isinstance(new_tokens, int) else list(new_tokens)
        if min(lens) < 1 or min(limits) < 1 or max(limits) > self.max_new:
            raise ConfigError(f"prompts need >= 1 token and new tokens must be in 1..{self.max_new}")
        if max(lens) > self.max_prompt:
            raise ConfigError(f"prompt of {max(lens)} tokens is longer than the session's {self.max_prompt}")
        vocab = self.model.cfg.vocab
        tokens = torch.zeros(n, max(lens), dtype=torch.long)
        for b, p in enumerate(prompts):
            if min(p) < 0 or max(p) >= vocab:
                raise ConfigError(f"prompt {b} has token ids outside 0..{vocab - 1}")
            tokens[b, :len(p)] = torch.tensor(p)
        tokens = tokens.to(dev)
        lens_t = torch.tensor(lens, dtype=torch.long, device=dev)
        first = torch.zeros(n, dtype=torch.long, device=dev)
        for c0 in range(0, max(lens), chunk):
            c1 = min(c0 + chunk, max(lens))
            t = c1 - c0
            pos = torch.arange(c0, c1, device=dev).expand(n, t)                     # [N, t]
            vis = torch.ones(t, t, dtype=torch.bool, device=dev).tril().expand(n, t, t)
            start = torch.full((n,), c0, dtype=torch.long, device=dev)
            keys = self.keys.prompt(tokens[:, c0:c1], pos, pos < lens_t.view(n, 1))
            with keyed(self.routing, keys):
                logits, hid = self.model(tokens[:, c0:c1], pos, self.cache, start, vis, self.hidden_layers)
            last = (lens_t - 1 - c0).clamp(0, t - 1)                                 # [N]
            pick = logits.gather(1, last.view(n, 1, 1).expand(n, 1, logits.shape[-1])).squeeze(1).argmax(-1)
            first = torch.where((lens_t - 1 >= c0) & (lens_t - 1 < c1), pick, first)
            if self.drafter is not None:
                self.drafter.update(hid, start)
        self.prompt_lens = lens
        self.prefix_len.copy_(lens_t)
        self.bonus.copy_(first)
        self.out.zero_()
        self.tied.zero_()
        self.out[:, 0] = first
        self.n_out.fill_(1)
        self.limit.copy_(torch.tensor(limits, dtype=torch.long))
        self.done.copy_(self.n_out >= self.limit)
        self._snap = [t.clone() for t in self._state()]

    def _state(self) -> tuple[torch.Tensor, ...]:
        return self.prefix_len, self.bonus, self.out, self.n_out, self.done, self.tied, self.keys.prefix

    def restore(self) -> None:
        """Back to the state right after prefill (the caches past each prefix are scratch,
        so only the small per-stream tensors need restoring)."""
        for t, s in zip(self._state(), self._snap):
            t.copy_(s)

    def outputs(self) -> list[list[int]]:
        """Generated tokens per stream (host copy; syncs)."""
        n_out = torch.minimum(self.n_out, self.limit).tolist()
        out = self.out.cpu()
        return [out[b, :n_out[b]].tolist() for b in range(self.n)]

    def tie_flags(self) -> list[list[bool]]:
        """Per stream, whether each output token was an exact top-2 tie of the target's
        logits where it was chosen (recorded by steppers that pass `tied`; host copy)."""
        n_out = torch.minimum(self.n_out, self.limit).tolist()
        tied = self.tied.cpu()
        return [tied[b, :n_out[b]].tolist() for b in range(self.n)]

    def emit(self, tokens: torch.Tensor, count: torch.Tensor, tied: torch.Tensor | None = None) -> None:
        """Append tokens `[N, A]` (first `count[b]` valid; `tied` bool `[N, A]` beside them)
        to each stream's output; rows past the count land beyond n_out and are overwritten
        next time (no sync)."""
        n, a = tokens.shape
        cols = (self.n_out.view(n, 1) + torch.arange(a, device=self.device)).clamp(max=self.width - 1)
        self.out.scatter_(1, cols, tokens)
        if tied is not None:
            self.tied.scatter_(1, cols, tied)
        self.n_out += count
        self.done |= self.n_out >= self.limit


# --- steppers ----------------------------------------------------------------------

class _RefKernels:
    """The torch/Python references of kernels.ddtree (host loops: CPU runs without Triton)."""
    topk_from_logits = staticmethod(ddtree.topk_from_logits)
    build_tree = staticmethod(ddtree.build_tree_ref)
    greedy_accept = staticmethod(ddtree.greedy_accept_ref)


def tree_kernels(which: str, device):
    """'triton' (kernels.ddtree: GPU, or CPU under TRITON_INTERPRET=1), 'ref', or 'auto'
    (triton on a GPU or under the interpreter, else ref)."""
    if which == "auto":
        interp = os.environ.get("TRITON_INTERPRET") == "1"
        which = "triton" if torch.device(device).type == "cuda" or interp else "ref"
    if which == "triton":
        return ddtree
    if which == "ref":
        return _RefKernels
    raise ConfigError(f"unknown tree kernels {which!r}; choose auto, triton or ref")


@dataclass
class RunStats:
    """One decoding run: steps, tokens, time per phase (summed over steps, microseconds)."""
    steps: int = 0
    tokens: int = 0                    # new output tokens (capped at each stream's limit)
    stream_steps: int = 0              # sum over steps of active streams
    accepted: int = 0                  # tokens gained incl. bonus, uncapped
    phase_us: dict = field(default_factory=dict)
    step_us: list = field(default_factory=list)   # device time of each step
    wall_us: float = 0.0
    cuda_graph: bool = False
    full_steps: int = 0                # steps at which every stream was still generating
    full_stream_steps: int = 0         # streams x those steps
    full_accepted: int = 0             # tokens those steps gained (uncapped)
    full_step_us: float = 0.0          # their device time
    full_accepted_se: float | None = None   # standard error of steady_accepted (spread of those steps)

    @property
    def steady_accepted(self) -> float | None:
        """Tokens per stream and step while every stream generates (the rate a server that
        refills finished streams keeps up); None when no step had every stream active."""
        return None if not self.full_steps else self.full_accepted / self.full_stream_steps

    @property
    def device_us(self) -> float:
        return sum(self.phase_us.values())

    @property
    def mean_accepted(self) -> float:
        """Tokens per stream and step, bonus included."""
        return self.accepted / max(self.stream_steps, 1)


class _Stepper:
    """Runs a step as a sequence of phase functions, eager or as one CUDA graph per phase."""
    phases: tuple[str, ...] = ()

    def __init__(self, sess: Session):
        self.sess = sess
        self.graphs: dict[str, torch.cuda.CUDAGraph] | None = None
        self.graph_error: str | None = None
        self.active_n = torch.zeros(sess.max_new + 8, dtype=torch.long, device=sess.device)   # per step
        self.tokens_n = torch.zeros_like(self.active_n)                    # capped at the limits
        self.accepted_n = torch.zeros_like(self.active_n)
        self.step_i = torch.zeros((), dtype=torch.long, device=sess.device)

    def _fn(self, name):
        return getattr(self, "_" + name)

    def _record(self, active: torch.Tensor, count: torch.Tensor) -> None:
        """Per-step counters (before `emit`): active streams, tokens gained, new outputs."""
        s = self.sess
        i = self.step_i.clamp(max=self.active_n.shape[0] - 1)
        self.active_n.index_put_((i,), active.long().sum())
        self.accepted_n.index_put_((i,), count.sum())
        self.tokens_n.index_put_((i,), torch.minimum(count, (s.limit - s.n_out).clamp(min=0)).sum())
        self.step_i += 1

    def step(self) -> None:
        for name in self.phases:
            self._run(name)

    def _run(self, name):
        if self.graphs is not None:
            self.graphs[name].replay()
        else:
            self._fn(name)()

    @torch.no_grad()
    def capture(self) -> bool:
        """Warm up and capture one CUDA graph per phase (shared pool). Restores the
        session after. Returns False (and keeps eager mode) when capture is impossible."""
        sess = self.sess
        if sess.device.type != "cuda":
            return False
        try:
            side = torch.cuda.Stream(sess.device)
            side.wait_stream(torch.cuda.current_stream(sess.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.step()
            torch.cuda.current_stream(sess.device).wait_stream(side)
            torch.cuda.synchronize(sess.device)
            pool = torch.cuda.graph_pool_handle()
            graphs = {}
            for name in self.phases:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self._fn(name)()
                graphs[name] = g
            self.graphs = graphs
        except Exception as e:  # noqa: BLE001 - any capture failure: report and stay eager
            self.graphs = None
            self.graph_error = f"{type(e).__name__}: {e}"
            torch.cuda.synchronize(sess.device)
        sess.restore()
        self.reset_counters()
        return self.graphs is not None

    def reset_counters(self) -> None:
        self.active_n.zero_()
        self.tokens_n.zero_()
        self.accepted_n.zero_()
        self.step_i.zero_()

    @torch.no_grad()
    def run(self, max_steps: int | None = None, check_every: int = 8) -> RunStats:
        """Step until every stream is done (checked every `check_every` steps, the only
        host sync) and time each phase of each step."""
        sess = self.sess
        cuda = sess.device.type == "cuda"
        max_steps = min(max_steps or sess.max_new, self.active_n.shape[0] - 1)
        self.reset_counters()
        marks: list[list] = []
        t0 = time.perf_counter()
        steps = 0
        while steps < max_steps:
            for _ in range(min(check_every, max_steps - steps)):
                m = [self._stamp(cuda)]
                for name in self.phases:
                    self._run(name)
                    m.append(self._stamp(cuda))
                marks.append(m)
                steps += 1
            if bool(sess.done.all()):
                break
        if cuda:
            torch.cuda.synchronize(sess.device)
        wall = (time.perf_counter() - t0) * 1e6
        active = self.active_n[:steps].tolist()
        tokens = self.tokens_n[:steps].tolist()
        accepted = self.accepted_n[:steps].tolist()
        used = max([i + 1 for i, a in enumerate(active) if a > 0], default=0)   # drop idle tail steps
        phase_us = {p: 0.0 for p in self.phases}
        per_step = []
        for m in marks[:used]:
            per_step.append(0.0)
            for p, a, b in zip(self.phases, m, m[1:]):
                us = a.elapsed_time(b) * 1e3 if cuda else (b - a) * 1e6
                phase_us[p] += us
                per_step[-1] += us
        full = [i for i in range(used) if active[i] == sess.n]
        return RunStats(steps=used, tokens=int(sum(tokens[:used])), stream_steps=int(sum(active[:used])),
                        accepted=int(sum(accepted[:used])),
                        phase_us=phase_us, step_us=per_step, wall_us=wall * used / max(steps, 1), cuda_graph=self.graphs is not None,
                        full_steps=len(full), full_stream_steps=int(sum(active[i] for i in full)), full_accepted=int(sum(accepted[i] for i in full)),
                        full_step_us=sum(per_step[i] for i in full),
                        full_accepted_se=float(torch.tensor([accepted[i] / active[i] for i in full],
                                                            dtype=torch.float64).std() / len(full) ** 0.5)
                        if len(full) > 1 else None)

    @staticmethod
    def _stamp(cuda):
        if cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    @torch.no_grad()
    def profile_verify(self) -> dict[str, float]:
        """One eager step with the target's phases timed inside the verify forward
        (attention, moe, mlp, comm, lm_head, other; us), after a GPU head start so the
        events see GPU time. Restores the session (the tree it built stays in place)."""
        timer = PhaseTimer(self.sess.device)
        for name in self.phases:
            if name == "verify":
                if timer.cuda:   # GPU head start: the host queues the forward ahead of the GPU
                    torch.cuda.synchronize(self.sess.device)
                    torch.cuda._sleep(HEAD_START_CYCLES)
                with timer.active():
                    self._verify()
            else:
                self._fn(name)()
        self.sess.restore()
        out = timer.totals_us()
        out.pop("end", None)
        return out

    @torch.no_grad()
    def graph_verify_phases(self, reps: int = 3) -> dict[str, float]:
        """The verify forward's phases in graph mode: a separate CUDA graph of the verify
        with timing events as graph nodes (`PhaseTimer(external=True)`), replayed `reps`
        times over the tree left by `profile_verify`; median per phase (us). The step's
        own graphs and the session state are untouched (only cache scratch is written)."""
        import statistics

        keep = {k: v for k, v in self.__dict__.items() if k in ("argmax", "hid", "next")}
        timer = PhaseTimer(self.sess.device, external=True, merge=True)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                with timer.active():
                    self._verify()
            runs = []
            for _ in range(reps):
                graph.replay()
                runs.append(timer.totals_us())     # the same event nodes, re-recorded
        finally:
            self.__dict__.update(keep)
            del graph
        return {p: statistics.median(r.get(p, 0.0) for r in runs) for p in runs[0] if p != "end"}


def top2_tied(logits: torch.Tensor) -> torch.Tensor:
    """bool `[..]`: the two largest logits are exactly equal (argmax is then a tie-break)."""
    top = logits.topk(2, dim=-1).values
    return top[..., 0] == top[..., 1]


class ARStep(_Stepper):
    """Greedy autoregressive decoding over the session: the engine's one AR decode step
    (`engine.decode.decode_forward`, the step `ddbench decode` times) as the verify phase,
    keyed for the routing hook and with its exact top-2 ties recorded; accept advances the
    streams that are not done and appends the token to their outputs."""
    phases = ("verify", "accept")

    def __init__(self, sess: Session):
        super().__init__(sess)
        n, dev = sess.n, sess.device
        self.vis = torch.ones(n, 1, 1, dtype=torch.bool, device=dev)
        self.next = torch.zeros(n, dtype=torch.long, device=dev)

    def _verify(self):
        s = self.sess
        self.keys = None if s.routing is None else s.keys.tree(s.bonus.view(-1, 1), s.prefix_len.view(-1, 1), self.vis)
        logits, nxt = decode_forward(s.model, s.bonus.view(-1, 1), s.prefix_len, s.cache, self.vis, s.routing,
                                     self.keys)
        self.next = nxt[:, 0]                                                 # [N]
        self.tie = top2_tied(logits[:, 0])

    def _accept(self):
        s = self.sess
        active = ~s.done
        count = active.long()
        self._record(active, count)
        if self.keys is not None:
            s.keys.commit(self.keys, None, active)
        s.prefix_len += count
        s.bonus.copy_(torch.where(active, self.next, s.bonus))
        s.emit(self.next.view(-1, 1), count, self.tie.view(-1, 1))


class SpecStep(_Stepper):
    """One DDTree speculative step over every stream of `sess` (which needs a drafter)."""
    phases = PHASES

    def __init__(self, sess: Session, budget: int, topk: int | None = None,
                 acceptance: Acceptance | None = None, kernels: str = "auto"):
        super().__init__(sess)
        self.kern = tree_kernels(kernels, sess.device)
        if sess.drafter is None:
            raise ConfigError("speculative decoding needs a drafter")
        if not 1 <= budget <= 1024:
            raise ConfigError(f"--budget {budget} must be in 1..1024")
        if budget + 1 > sess.reach:
            raise ConfigError(f"budget {budget} exceeds the session's max_budget {sess.reach - 1}")
        dc = sess.drafter.dc
        self.budget, self.depth = budget, dc.depth
        self.topk = topk or min(budget, 16)
        if not 1 <= self.topk <= sess.model.cfg.vocab:
            raise ConfigError(f"top-K {self.topk} must be in 1..vocab")
        dev = sess.device
        self.acc_cdf = torch.zeros(self.depth, self.topk, device=dev)         # [L, K] cumulative rank probs
        self.acc_logp = torch.zeros(self.depth, self.topk, device=dev)        # [L, K]
        self.ranks: RankCounter | None = None     # real mode: set to count the target's drafter ranks
        self.tied_out = False                     # real mode: record exact top-2 ties of the verify
        self.set_acceptance(acceptance or Acceptance())

    def set_acceptance(self, acc: Acceptance) -> None:
        """Switch the acceptance mode; the drawn modes' tables live in device buffers, so the
        captured graphs stay valid."""
        if acc.mode not in ("real", "synthetic", "profile", "rank"):
            raise ConfigError(f"unknown acceptance mode {acc.mode!r}")
        if self.graphs is not None and (acc.mode == "real") != (self.acceptance.mode == "real"):
            raise ConfigError("switching between real and drawn acceptance needs a fresh SpecStep")
        self.acceptance = acc
        if acc.probs is not None and len(acc.probs) != self.depth:
            raise ConfigError(f"acceptance profile has {len(acc.probs)} depths, drafter drafts {self.depth}")
        if acc.mode != "real":
            logp, match = acc.tables(self.depth, self.topk)
            self.acc_logp.copy_(logp)
            self.acc_cdf.copy_(match.cumsum(-1).float())

    def expected_tokens(self) -> torch.Tensor:
        """`[N]` analytic E[tokens per step] of the trees the last step built (drawn modes)."""
        from ddbench.engine.acceptance import tree_expectation

        _, match = self.acceptance.tables(self.depth, self.topk)
        return tree_expectation(self.parent, self.rank, self.depth_of, match)

    # phases ------------------------------------------------------------------------
    def _draft(self):
        s = self.sess
        self.d_logits = s.drafter(s.bonus, s.prefix_len)                      # [N, L, vocab]

    def _tree(self):
        s = self.sess
        logp, ids = self.kern.topk_from_logits(self.d_logits, self.topk)         # [N, L, K] each
        self.ids = ids
        if self.acceptance.mode != "real":
            logp = self.acc_logp.expand_as(logp).contiguous()
        tree = self.kern.build_tree(logp, ids, self.budget)
        self.parent, self.depth_of, self.rank = tree.parent.long(), tree.depth.long(), tree.rank.long()
        self.visible = tree.visible                                            # [N, T, T] bool
        token = tree.token.long().clone()                                     # [N, T]
        token[:, 0] = s.bonus
        self.token = token

    def _verify(self):
        s = self.sess
        positions = s.prefix_len.view(-1, 1) + self.depth_of                  # [N, T]
        self.keys = None
        if s.routing is not None:                                   # keyed draws; overlap follows the tree
            self.keys = s.keys.tree(self.token, positions, self.visible)
        with keyed(s.routing, self.keys, (self.parent, self.depth_of, self.depth)):
            logits, self.hid = s.model(self.token, positions, s.cache, s.prefix_len, self.visible, s.hidden_layers)
        self.argmax = logits.argmax(-1)                                       # [N, T]
        self.tie = top2_tied(logits) if self.tied_out else None               # [N, T]

    def _accept(self):
        s = self.sess
        n = s.n
        if self.acceptance.mode == "real":
            acc, _, new_bonus = self.kern.greedy_accept(self.parent, self.token, self.argmax, self.depth)
            acc = acc.long()                                                  # [N, L+1]
        else:                     # the target's drafter rank at every depth, drawn; its matching path
            u = torch.rand(n, self.depth, device=self.acc_cdf.device)         # [N, L]
            acc = matched_path(self.parent, self.rank, self.depth_of, draw_ranks(u, self.acc_cdf), self.depth)
            new_bonus = None
        active = ~s.done
        acc = torch.where(active.view(n, 1), acc, -1)                        # [N, L+1]
        count = (acc >= 0).sum(-1)                                            # [N] tokens incl. bonus
        if self.ranks is not None:   # target token at depth d+1 = argmax at the path's depth-d node
            target = self.argmax.gather(1, acc[:, :self.depth].clamp(min=0))  # [N, L]
            seen = torch.arange(self.depth, device=acc.device).view(1, -1) < count.view(n, 1)
            self.ranks.add(self.d_logits, target, seen & active.view(n, 1))
        last = acc.gather(1, (count - 1).clamp(min=0).view(n, 1))              # [N, 1] last accepted node
        if new_bonus is None:
            new_bonus = self.argmax.gather(1, last.clamp(min=0)).squeeze(1)
        s.cache.commit(s.prefix_len, acc)
        if self.keys is not None:
            s.keys.commit(self.keys, last.squeeze(1), count > 0)
        # outputs: accepted nodes after the root, then the new bonus token
        toks = self.token.gather(1, acc.clamp(min=0))                        # [N, L+1]
        emit = torch.cat([toks[:, 1:], toks[:, :1]], 1)                       # [N, L+1]
        emit.scatter_(1, (count - 1).clamp(min=0).view(n, 1), new_bonus.long().view(n, 1))
        self._record(active, count)
        self.acc, self.count, self.new_bonus = acc, count, new_bonus.long()
        # output c came from the target's argmax at path node c (accepted or the new bonus)
        s.emit(emit, count, self.tie.gather(1, acc.clamp(min=0)) if self.tie is not None else None)

    def _context(self):
        s = self.sess
        n, a = self.acc.shape
        idx = self.acc.clamp(min=0).view(n, a, 1, 1).expand(n, a, *self.hid.shape[2:])
        s.drafter.update(self.hid.gather(1, idx), s.prefix_len)              # [N, L+1, nl, H]
        s.prefix_len += self.count
        s.bonus.copy_(torch.where(self.count > 0, self.new_bonus, s.bonus))
