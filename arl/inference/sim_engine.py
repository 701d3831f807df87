"""Simulated inference engine (``inference.backend=sim``): a decode-time model instead of a model.

Why it exists: to measure the control plane (staleness gate, routing, transport, controller) and the asynchronous
speed-up at the scale of a GPU cluster on a machine that has none. It speaks the same ``InferenceEngine`` protocol
as the torch engine, so the same inference worker serves it over the same ZMQ protocol.

Latency model (continuous batching). While ``B`` samples are in the running batch one decode step takes

    step_s(B) = step_base_s + step_per_token_s * B          (B <= max_batch_size; further requests wait, FIFO)

and every running sample gets one token per step. Admitting a request first costs a prefill stall of
``prefill_per_token_s`` per prompt token not already cached (n samples share one prefill). The cache is modelled
as a prefix cache of ``cache_tokens`` tokens in blocks of ``cache_block_tokens`` (``arl.utils.prefix_hash``): a
request's prompt blocks are cached from its admission (a request that shares a prefix with a running one reuses
it, as a radix cache does), its whole sequence once it finishes, least recently used evicted first, and the whole
cache is flushed by a weight update (``flush_cache_on_update``, as SGLang and the torch engine do). So shared
prefixes (a system prompt, a group's task) hit wherever they were computed, and a session's turns hit only on a
server that still holds its history: what routing decides. A weight update stalls decoding for
``update_pause_s``. Every duration is multiplied by ``time_scale`` (< 1 runs faster than real time).

Defaults are a linear fit to published H100 figures for a 7B Llama (rough, on purpose: the benchmarks need the
right shape and order of magnitude, not a faithful GPU model):

* NVIDIA NeMo Framework inference table, Llama-2-7B, 1x H100 80GB, 128 input / 20 output tokens: 153.8 ms at
  batch 1 and 199.2 ms at batch 8 -> ~7.5 ms per decode step at batch 1 (``step_base_s``).
* TensorRT-LLM performance overview (v0.9), LLaMA 7B on 1x H100: 6,944 output tok/s at batch 120 with
  128 input / 2,048 output tokens -> 17.3 ms per step at B = 120 -> ``step_per_token_s`` = (17.3 - 7.5) / 119
  ~= 0.08 ms per running sample (long contexts, which is what agent trajectories have).
* Same table, batch 84 with 2,048 input / 128 output tokens: 2,163 tok/s; after the decode steps the model above
  predicts, the rest is ~0.018 ms per prompt token (``prefill_per_token_s``).
* ``max_batch_size`` 256: a typical running-request cap for a 7B model on one 80 GB GPU.
* ``update_pause_s`` 1 s: order of a 14 GB bf16 broadcast/load; an assumption, set it to what you measure.

Outputs: lengths are long-tailed (log-normal with median ``len_median`` and shape ``len_sigma``), at least
``min_new_tokens``, cut at ``max_new_tokens`` (finish "length") and at ``max_context_len``; otherwise the sample
ends with a stop token (finish "stop"). Token ids and logprobs are random. Draws are seeded: a request with a
``session_id`` draws from a generator keyed by (``workload_seed``, session id, prompt bytes), so the same
workload gets the same outputs whichever server serves it and in whatever order; other requests use the
engine's own seeded stream.

Per-token versions are exact: a weight update is recorded at the current point of the step clock, and a token
whose decode step started after it carries the new version (in-flight requests keep going, as with the real
engine). The engine is event-driven: it does no work per decode step, only per request and per weight update,
so one process can host dozens of simulated servers.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import logging
import math
import os
import zlib
from typing import Any, Optional

import numpy as np

from arl.api.types import GenerateRequest, GenerateResponse, SampleOutput
from arl.config import SimEngineConfig
from arl.inference.requests import ENGINE_CLOSED, check_limits, check_request, refusal
from arl.utils.prefix_hash import BlockLRU, prefix_hashes

logger = logging.getLogger("arl.inference")

_EPS = 1e-6  # step-clock tolerance when a timer fires a hair early


class _SimRequest:
    __slots__ = ("qid", "n", "prompt_len", "session", "lengths", "finish", "rng", "future", "samples",
                 "remaining", "starts", "cancelled", "stops", "ids", "hashes", "epoch")

    def __init__(self, req: GenerateRequest, future: asyncio.Future, rng: np.random.Generator,
                 lengths: list[int], finish: list[str], stops: list[int]) -> None:
        self.qid = req.qid
        self.n = req.gconfig.n
        self.prompt_len = len(req.input_ids)
        self.session = req.session_id
        self.lengths = lengths
        self.finish = finish
        self.rng = rng
        self.future = future
        self.samples: list[Optional[SampleOutput]] = [None] * self.n
        self.remaining = self.n
        self.starts: list[float] = [0.0] * self.n
        self.cancelled = False
        self.stops = stops
        self.ids = req.input_ids
        self.hashes: Optional[np.ndarray] = None  # its prompt's block hashes, at admission
        self.epoch = -1  # the cache flushes before its admission


class SimEngine:
    """Event-driven simulated continuous-batching engine (implements ``InferenceEngine``); see the module doc."""

    def __init__(self, config: Optional[SimEngineConfig] = None, *, max_batch_size: int = 256,
                 max_context_len: int = 32768, eos_token_id: Optional[int] = None, version: int = 0, seed: int = 0,
                 workload_seed: int = 0, name: str = "sim") -> None:
        """`config`: the latency, output-length and cache model (`inference.sim`); the rest is per run and per
        server."""
        self.config = config if config is not None else SimEngineConfig()
        check_limits(max_batch_size, max_context_len)  # the config section checked itself (SimEngineConfig)
        self.name = name
        self.max_batch_size = int(max_batch_size)
        self.max_context_len = int(max_context_len)
        self.eos_token_id = eos_token_id
        self.workload_seed = int(workload_seed)
        self._version = int(version)
        self._rng = np.random.default_rng(seed)
        self._block = self.config.cache_block_tokens
        self._cache = BlockLRU(self.config.cache_tokens // self._block)

        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._waiting: collections.deque[_SimRequest] = collections.deque()
        self._heap: list[tuple[float, int, _SimRequest, int]] = []  # (finish clock, tiebreak, request, sample)
        self._tiebreak = itertools.count()
        self._rows = 0  # live samples in the running batch
        self._clock = 0.0  # decode steps done so far (fractional between events)
        self._t = 0.0  # loop time up to which the clock is accounted
        self._stall = 0.0  # seconds of prefill still to run before the clock moves again
        self._hold_until = 0.0  # no decoding before this loop time (weight update in progress)
        self._paused = False
        self._closed = False
        self._timer: Optional[asyncio.TimerHandle] = None
        self._update_lock: Optional[asyncio.Lock] = None
        self._upd_clock = np.array([-math.inf])  # step-clock points of weight updates ...
        self._upd_version = np.array([self._version], np.int32)  # ... and the version in force from each

        # counters, under the names stats() reports them by
        self._n: dict[str, Any] = {**dict.fromkeys(("tokens_generated", "prefill_tokens", "prompt_tokens",
                                                   "prefix_hit_tokens", "requests_done", "requests_refused",
                                                   "weight_updates", "cache_flushes"), 0),
                                   "busy_s": 0.0, "last_update_s": 0.0}

    # ------------------------------------------------------------------ public API

    @property
    def version(self) -> int:
        return self._version

    async def agenerate(self, req: GenerateRequest) -> GenerateResponse:
        """Answer after the simulated decode time. Never raises for bad input: returns a response with ``error``."""
        err = check_request(req, max_context_len=self.max_context_len, vocab_size=self.config.vocab_size,
                            max_batch_size=self.max_batch_size)
        if err is None and self._closed:
            err = ENGINE_CLOSED
        if err is not None:
            self._n["requests_refused"] += 1
            return refusal(req, err)
        loop = self._bind_loop()
        fut: asyncio.Future = loop.create_future()
        state = self._new_request(req, fut)
        now = loop.time()
        self._advance(now)
        self._waiting.append(state)
        self._admit()
        self._reschedule(now)
        try:
            return await fut
        except asyncio.CancelledError:
            self._cancel(state)
            raise

    async def update_weights(self, source: str, version: int) -> None:
        """Check `source` exists (the weight path still runs), stall decoding for ``update_pause_s`` and set the
        version. Requests in flight continue; tokens decoded after this point carry `version`."""
        if self._closed:
            raise RuntimeError(f"{self.name}: {ENGINE_CLOSED}")
        if not os.path.exists(source):
            raise FileNotFoundError(f"{self.name}: weights {source!r} not found")
        loop = self._bind_loop()
        assert self._update_lock is not None
        async with self._update_lock:
            t0 = loop.time()
            pause = self.config.update_pause_s * self.config.time_scale
            self._advance(t0)
            if self._upd_clock[-1] == self._clock:  # updates between two steps: only the last one stamps tokens
                self._upd_version[-1] = version
            else:
                self._upd_clock = np.append(self._upd_clock, self._clock)
                self._upd_version = np.append(self._upd_version, np.int32(version))
            if len(self._upd_clock) > 256:  # forget updates before the oldest running sample's start
                self._forget_old_updates()
            self._hold_until = max(self._hold_until, t0 + pause)
            if self.config.flush_cache_on_update and len(self._cache):
                self._cache.clear()  # KV of the old weights is never reused
                self._n["cache_flushes"] += 1
            self._reschedule(t0)
            if pause > 0:
                await asyncio.sleep(pause)
            self._version = int(version)
            self._n["weight_updates"] += 1
            self._n["last_update_s"] = loop.time() - t0

    async def pause(self) -> None:
        """Stop decoding (the step clock stands still); requests wait, none is dropped."""
        loop = self._bind_loop()
        self._advance(loop.time())
        self._paused = True
        self._reschedule(loop.time())

    async def resume(self) -> None:
        loop = self._bind_loop()
        if self._paused:
            self._t = loop.time()
            self._paused = False
            self._admit()
            self._reschedule(self._t)

    async def close(self) -> None:
        """Answer everything pending with ``error="engine closed"`` (finished samples kept, the others cut with
        finish_reason "abort"). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._reschedule(0.0)  # cancels the timer (and sets no new one: closed)
        if self._loop is not None:
            self._advance(self._loop.time())
        while self._waiting:
            r = self._waiting.popleft()
            if not r.future.done():
                r.future.set_result(GenerateResponse(qid=r.qid, samples=[], error=ENGINE_CLOSED))
        pending = {id(r): r for _, _, r, _ in self._heap if not r.cancelled}
        for r in pending.values():
            for i in range(r.n):
                if r.samples[i] is None:
                    done = int(min(r.lengths[i], max(0.0, math.floor(self._clock - r.starts[i] + _EPS))))
                    r.samples[i] = self._sample(r, i, done, "abort")
            if not r.future.done():
                r.future.set_result(GenerateResponse(qid=r.qid, samples=list(r.samples), error=ENGINE_CLOSED))
        self._heap.clear()
        self._rows = 0

    def stats(self) -> dict[str, Any]:
        if self._loop is not None and not self._closed:
            self._advance(self._loop.time())
        return {"name": self.name, "backend": "sim", "version": self._version, "decode_steps": int(self._clock),
                **self._n, "cache_blocks": len(self._cache), "running": self._rows, "waiting": len(self._waiting),
                "paused": self._paused, "closed": self._closed}

    def step_seconds(self, batch: int) -> float:
        """Wall seconds of one decode step with `batch` running samples (time scale applied)."""
        return (self.config.step_base_s + self.config.step_per_token_s * batch) * self.config.time_scale

    # ------------------------------------------------------------------ request intake

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            self._t = loop.time()
            self._update_lock = asyncio.Lock()
        elif self._loop is not loop:
            raise RuntimeError(f"{self.name}: the sim engine is bound to another event loop")
        return loop

    def _new_request(self, req: GenerateRequest, fut: asyncio.Future) -> _SimRequest:
        g = req.gconfig
        if req.session_id is not None:
            key = [self.workload_seed, zlib.crc32(str(req.session_id).encode()),
                   zlib.crc32(memoryview(req.input_ids).cast("B"))]
            rng = np.random.default_rng(key)
        else:
            rng = np.random.default_rng(self._rng.integers(1 << 63))
        stops = [int(t) for t in g.stop_token_ids if 0 <= t < self.config.vocab_size]
        if self.eos_token_id is not None and self.eos_token_id not in stops:
            stops.append(int(self.eos_token_id))
        room = self.max_context_len - len(req.input_ids)
        cap = min(g.max_new_tokens, room)
        c = self.config
        draws = rng.lognormal(math.log(c.len_median), c.len_sigma, size=g.n) if c.len_sigma > 0 else \
            np.full(g.n, c.len_median)
        lengths = [min(max(int(math.ceil(d)), g.min_new_tokens, 1), cap) for d in draws]
        finish = ["length" if n >= cap else "stop" for n in lengths]  # cut by max_new_tokens or the context window
        return _SimRequest(req, fut, rng, lengths, finish, stops)

    # ------------------------------------------------------------------ the simulated batch

    def _advance(self, now: float) -> None:
        """Move the step clock to loop time `now` (no work per step: the batch is constant between events)."""
        t_from = max(self._t, self._hold_until)
        self._t = max(self._t, now)
        if now <= t_from or self._paused or self._rows == 0:
            return
        dt = now - t_from
        self._n["busy_s"] += dt
        if self._stall > 0:
            used = min(dt, self._stall)
            self._stall -= used
            dt -= used
        if dt > 0:
            self._clock += dt / self.step_seconds(self._rows)

    def _admit(self) -> None:
        """FIFO admission while the batch has room (a request takes n rows); charge their prefill."""
        if self._paused or self._closed:
            return
        while self._waiting:
            r = self._waiting[0]
            if r.cancelled:
                self._waiting.popleft()
                continue
            if self._rows + r.n > self.max_batch_size:
                break
            self._waiting.popleft()
            r.hashes = prefix_hashes(r.ids, self._block)
            r.epoch = self._n["cache_flushes"]
            cached = min(self._cache.match(r.hashes) * self._block, r.prompt_len)
            self._cache.touch(r.hashes)  # its KV is there from now on: a request sharing the prefix reuses it
            fresh = r.prompt_len - cached
            self._n["prefill_tokens"] += fresh
            self._n["prompt_tokens"] += r.prompt_len
            self._n["prefix_hit_tokens"] += cached
            self._stall += fresh * self.config.prefill_per_token_s * self.config.time_scale
            for i in range(r.n):
                r.starts[i] = self._clock
                heapq.heappush(self._heap, (self._clock + r.lengths[i], next(self._tiebreak), r, i))
            self._rows += r.n

    def _reschedule(self, now: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._closed or self._paused or not self._heap or self._loop is None:
            return
        steps = max(0.0, self._heap[0][0] - self._clock)
        rows = max(1, self._rows)
        delay = max(0.0, self._hold_until - now) + self._stall + steps * self.step_seconds(rows)
        self._timer = self._loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self._closed or self._loop is None:
            return
        now = self._loop.time()
        self._advance(now)
        try:
            self._finish_due()
        except Exception:  # noqa: BLE001 - never let one bad sample stop the timer chain
            logger.exception("%s: failed to finish a request", self.name)
        self._admit()
        self._reschedule(now)

    def _finish_due(self) -> None:
        while self._heap and self._heap[0][0] <= self._clock + _EPS:
            _, _, r, i = heapq.heappop(self._heap)
            if r.cancelled:
                continue
            self._rows -= 1
            r.samples[i] = self._sample(r, i, r.lengths[i], r.finish[i])
            r.remaining -= 1
            if r.remaining == 0:
                self._n["requests_done"] += 1
                self._cache_sequences(r)
                if not r.future.done():
                    r.future.set_result(GenerateResponse(qid=r.qid, samples=list(r.samples)))

    def _cache_sequences(self, r: _SimRequest) -> None:
        """A finished request's sequences (prompt + each sample) stay cached (if their blocks are still current:
        a flush since admission leaves only what was computed after it, modelled as nothing)."""
        if r.epoch != self._n["cache_flushes"]:
            return
        for s in r.samples:
            if s is not None and len(s.output_ids):
                self._cache.touch(prefix_hashes(np.concatenate([r.ids, s.output_ids]), self._block, r.hashes))

    def _forget_old_updates(self) -> None:
        """Keep the update points a running sample may still be stamped from (the last one at or before its start,
        and every later one): the list would otherwise grow by one per weight update for the whole run."""
        oldest = min((r.starts[i] for _, _, r, i in self._heap if not r.cancelled), default=self._clock)
        keep = max(0, int(np.searchsorted(self._upd_clock, oldest + _EPS, side="right")) - 1)
        self._upd_clock, self._upd_version = self._upd_clock[keep:], self._upd_version[keep:]

    def _sample(self, r: _SimRequest, i: int, length: int, finish: str) -> SampleOutput:
        rng = r.rng
        ids = rng.integers(0, self.config.vocab_size, size=length, dtype=np.int32)
        if r.stops:
            ids[np.isin(ids, r.stops)] = next(t for t in range(self.config.vocab_size) if t not in r.stops)
            if finish == "stop" and length:
                ids[-1] = r.stops[0]
        logps = -rng.exponential(1.0, size=length).astype(np.float32)
        step_starts = r.starts[i] + np.arange(length, dtype=np.float64)
        versions = self._upd_version[np.searchsorted(self._upd_clock, step_starts + _EPS, side="right") - 1]
        self._n["tokens_generated"] += length
        return SampleOutput(output_ids=ids, output_logprobs=logps, output_versions=versions, finish_reason=finish)

    def _cancel(self, r: _SimRequest) -> None:
        """The caller gave up: free the request's rows now (their heap entries are skipped when they come up)."""
        if r.cancelled or self._closed or self._loop is None:
            return
        now = self._loop.time()
        self._advance(now)
        r.cancelled = True
        if any(entry[2] is r for entry in self._heap):  # in the batch: its unfinished samples leave it
            self._rows -= sum(s is None for s in r.samples)
        self._admit()
        self._reschedule(now)
