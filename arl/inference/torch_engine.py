"""Embedded PyTorch inference engine: continuous batching over a Hugging Face causal LM, CPU or CUDA.

Why it is built this way:

* **One decode thread owns the model.** Every forward pass, weight load and KV-cache edit happens on a single
  background thread, so none of them needs a lock against another; callers (asyncio loops in any thread) only
  touch a small lock-protected queue and get their answer through ``loop.call_soon_threadsafe``. Torch releases
  the GIL inside its kernels, so the caller's event loop keeps running while a step computes.
* **Continuous batching with a padded, batched HF cache.** At every step the running sequences decode one token
  together; newcomers are prefilled together (left-padded, one forward) and their KV is then written into the
  running batch's spare rows, right-aligned with it. Finished sequences leave at once (the last rows move into
  their places, then the columns that are padding for every remaining row are dropped from the view). The running
  batch lives in `arl.inference.running_kv.RunningKV`: buffers with spare rows and columns, so a decode step writes
  its column in place and a join or an exit copies only the rows that arrive or move, not the whole cache. An
  attention mask marks padding and explicit ``position_ids`` give every row its own positions, so a sequence
  produces the same tokens alone or batched. This uses only the public model forward (``input_ids,
  attention_mask, position_ids, past_key_values``) with a cache layer of our own, so it works with any HF causal
  LM with full attention (Llama, Qwen2/3, Mistral without sliding window, ...) and needs no custom kernels. The
  cost is padding compute, acceptable for the small models and contexts this engine serves; large GPU
  deployments use the SGLang backend.
* **n samples share one prefill**: the prompt is run once and its KV rows are repeated n times.
* **A prefix KV cache** (``prefix_cache_tokens``, `arl.inference.prefix_cache`): a finished sequence's KV is kept
  (LRU, within a token budget), and a later request whose ids extend it (the next turn of a multi-turn chat: the
  history, the answer as generated, the feedback) prefills only its new tokens, the cached prefix as the past of
  that forward; requests of one step with the same ids share one prefill. The cache is cleared at every weight
  update, and a sequence that lived through one (its KV from two versions) is not stored: a KV is reused only
  under the weights that computed it, so outputs are those without the cache (up to float rounding).
* **Behaviour log-probs of the distribution actually sampled**: each token's logprob is taken under the
  distribution it was drawn from: ``logits / T``, then the min-new-tokens mask (stop ids at -inf), then top-k and
  top-p truncation, renormalised. The learner's importance weights divide by this behaviour probability, so it
  must be the real one (a truncated draw has a higher probability than the full softmax gives it). Greedy rows
  report ``log_softmax`` at T = 1 with the mask applied (no truncation), as SGLang does for greedy requests. With
  ``top_p = 1, top_k = 0`` and no active mask this is exactly the learner's ``log_softmax(logits / T)``.
* **Weight updates never stop a request.** ``update_weights`` reads and checks the safetensors in the caller's
  worker thread while decoding goes on, then the decode thread, between two steps, swaps the new tensors into the
  parameters (``param.data = new``: no copy, so the pause is ~1 ms even for a 0.5B model), bumps the version and
  goes on. The KV cache of in-flight
  requests is KEPT (it was computed under the old weights; the standard AReaL-style choice, no recompute) and so
  are their tokens so far; tokens produced after the update carry the new version in ``output_versions``.
* **Bad input never raises into the caller or kills the thread**: invalid requests get a ``GenerateResponse``
  with ``error`` set; an exception inside a step fails only the requests of that step and is logged to the
  ``arl.inference`` logger.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import DynamicCache

from arl.api.types import GenerateRequest, GenerateResponse, GenerationConfig, SampleOutput
from arl.inference.lean_forward import LeanForward, lean_forward_for
from arl.inference.multi_lora import LoraSlots, LoraUpdate
from arl.inference.prefix_cache import KV, Entry, PrefixCache, Storage
from arl.inference.running_kv import RunningKV
from arl.inference.requests import ENGINE_CLOSED, check_limits, check_request, refusal
from arl.utils.attention import avoid_per_shape_attention
from arl.utils.proc import trim_memory
from arl.weights.adapter import adapter_expected, is_adapter, merged_weight, split_payload

logger = logging.getLogger("arl.inference")

# (source, [(parameter, new tensor)]); a parameter's name instead: a tied weight that gets its own tensor (`_untie`);
# or (source, a LoRA policy's adapter for its slot)
_Prepared = tuple[str, list[tuple[torch.nn.Parameter | str, torch.Tensor]] | LoraUpdate]
_Command = tuple[_Prepared, int, asyncio.AbstractEventLoop, asyncio.Future]  # a weight update: (weights, version, ...)


def _post(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, result: Any = None,
          exc: Optional[BaseException] = None) -> None:
    """Resolve `fut` from any thread, unless the caller already gave up (cancelled); a closed loop (caller gone)
    is ignored."""
    def resolve() -> None:
        if not fut.done():
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

    with contextlib.suppress(RuntimeError):  # loop closed
        loop.call_soon_threadsafe(resolve)


class _Request:
    """One accepted GenerateRequest: its prompt, sampling parameters and the samples finished so far."""

    __slots__ = ("qid", "gconfig", "prompt", "prompt_len", "n", "loop", "future", "samples", "remaining",
                 "cancelled", "responded", "stop_set", "stop_list", "epoch", "source", "slot")

    def __init__(self, req: GenerateRequest, loop: asyncio.AbstractEventLoop, future: asyncio.Future,
                 eos_token_ids: Sequence[int], vocab_size: int) -> None:
        self.qid: str = req.qid
        self.gconfig: GenerationConfig = req.gconfig
        self.prompt: list[int] = req.input_ids.tolist()
        self.prompt_len: int = len(self.prompt)
        self.n: int = req.gconfig.n
        self.loop = loop
        self.future = future
        self.samples: list[Optional[SampleOutput]] = [None] * self.n
        self.remaining: int = self.n
        self.cancelled: bool = False
        self.responded: bool = False
        stops = {int(t) for t in req.gconfig.stop_token_ids} | set(eos_token_ids)
        self.stop_set: frozenset[int] = frozenset(stops)
        # ids that can actually be sampled (masked while min_new_tokens is not reached)
        self.stop_list: list[int] = sorted(t for t in stops if t < vocab_size)
        self.epoch = -1  # the engine's weights epoch at this request's prefill (its KV is reusable only under it)
        self.source: Optional[Entry] = None  # the prefix-cache entry it was prefilled from
        self.slot = 0  # the LoRA slot of its policy (0: the engine's own weights)


class _Row:
    """One sample being generated: a row of the batched KV cache."""

    __slots__ = ("owner", "index", "ids", "logps", "versions", "finish")

    def __init__(self, owner: _Request, index: int) -> None:
        self.owner = owner
        self.index = index
        self.ids: list[int] = []
        self.logps: list[float] = []
        self.versions: list[int] = []
        self.finish: Optional[str] = None

    @property
    def cached_len(self) -> int:
        """Real tokens held in the KV cache (the last sampled token is fed at the next step)."""
        return self.owner.prompt_len + len(self.ids) - 1

    def to_sample(self, finish_reason: str) -> SampleOutput:
        return SampleOutput(output_ids=np.asarray(self.ids, np.int32),
                            output_logprobs=np.asarray(self.logps, np.float32),
                            output_versions=np.asarray(self.versions, np.int32), finish_reason=finish_reason)


class TorchEngine:
    """Embedded continuous-batching inference engine for a HF causal LM (implements ``InferenceEngine``).

    Args:
        model: a transformers causal LM (``model(input_ids, attention_mask, position_ids, past_key_values)``
            returning ``.logits``). It is moved to `device` and put in eval mode; the engine owns it from now on.
        pad_token_id: id fed at left-padding positions (masked out, its value does not matter).
        eos_token_id: ends a sample (finish_reason "stop") in addition to each request's stop_token_ids; a list
            gives several (Qwen2.5-Instruct stops on <|im_end|> and <|endoftext|>, as its generation config says).
        max_batch_size: most samples (KV rows) decoded together; a request with n samples takes n rows.
        max_context_len: most tokens (prompt + generated) of one sample; longer prompts are refused, samples that
            reach it end with finish_reason "length".
        device: torch device of the model and the cache.
        version: initial policy version stamped on generated tokens.
        seed: seed of the sampling generator (runs with the same requests in the same order are reproducible).
        name: used in the decode thread's name and in log lines.
        prefix_cache_tokens: token budget of the prefix KV cache (`arl.inference.prefix_cache`): a request that
            extends a finished sequence of the current weights prefills only its new tokens, and requests of one
            step with the same ids share one prefill; 0 turns both off. Each LoRA policy has a cache of its own
            (its KV differs from the base's) of the same budget.
        max_loras: most LoRA policies served at once beside the engine's own weights (`arl.inference.multi_lora`:
            rows of different policies decode in one batch); 0: none. A request names its policy
            (`GenerateRequest.policy`); `update_weights(..., policy=name)` loads or updates one.
        max_lora_rank: most rank of such a policy's adapter.
        lean_forward: run Llama / Mistral / Qwen2 / Qwen3 models through `arl.inference.lean_forward` (the same
            arithmetic without HF's per-call machinery: ~1 ms less a decode forward on the tiny model); False, or
            another architecture: the model's own forward.
    """

    def __init__(self, model: torch.nn.Module, *, pad_token_id: int, eos_token_id: int | Sequence[int] | None,
                 max_batch_size: int = 64, max_context_len: int = 512, device: str = "cpu", version: int = 0,
                 seed: int = 0, name: str = "engine", prefix_cache_tokens: int = 0, max_loras: int = 0,
                 max_lora_rank: int = 16, lean_forward: bool = True) -> None:
        check_limits(max_batch_size, max_context_len)
        _check_attention_supported(getattr(model, "config", None), int(max_context_len))
        self.name = name
        self.device = torch.device(device)
        avoid_per_shape_attention(self.device)  # every decode step has new widths (arl/utils/attention.py)
        self.model = model.to(self.device).eval()
        self.vocab_size: int = int(self.model.get_input_embeddings().num_embeddings)
        if not 0 <= int(pad_token_id) < self.vocab_size:
            raise ValueError(f"pad_token_id {pad_token_id} is outside the vocabulary [0, {self.vocab_size})")
        self.pad_token_id = int(pad_token_id)
        eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(t) for t in eos))
        self.max_batch_size = int(max_batch_size)
        self.max_context_len = int(max_context_len)
        self.seed = int(seed)
        self._version = int(version)
        self._generator = torch.Generator(device=self.device).manual_seed(self.seed)
        try:
            self._has_logits_to_keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        except (TypeError, ValueError):
            self._has_logits_to_keep = False
        # the model's arithmetic without HF's per-call machinery, for the families it reproduces (else None)
        self._lean: Optional[LeanForward] = lean_forward_for(self.model) if lean_forward else None

        # Shared between callers and the decode thread, guarded by _cv's lock.
        self._cv = threading.Condition(threading.Lock())
        self._waiting: collections.deque[_Request] = collections.deque()
        self._commands: list[_Command] = []
        self._paused = False
        self._pause_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._closed = False
        self._thread: Optional[threading.Thread] = None

        # Batch state: touched only by the decode thread.
        self._rows: list[_Row] = []
        self._kv: Optional[RunningKV] = None  # the rows' KV and mask ([B, T] long, 1 = real token, 0 = left padding)
        self._prefix: Optional[PrefixCache] = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens > 0 else None
        self._loras: Optional[LoraSlots] = LoraSlots(self.model, max_loras, max_lora_rank) if max_loras > 0 else None
        self._lora_prefix: dict[int, PrefixCache] = {}  # a LoRA policy's slot -> its prefix cache
        self._weights_epoch = 0  # bumped by every weight update: KV of an older epoch is never reused
        # A prefill forward's own cost, in prompt tokens, for `length_groups`: ~2.5-3 ms of HF's Python per forward
        # against ~22 us a padded token for the tiny model on this CPU (DESIGN.md's machine); on a GPU a token costs
        # far less than a launch, so only gross padding (one long prompt among many short ones) is split there.
        self._prefill_fixed = 128 if self.device.type == "cpu" else 4096

        # LoRA (adapter payloads, `arl.weights.adapter`): the base tensor of every weight an adapter was merged
        # into, so each version merges into the base (not into the previous merge) and a full update un-merges
        self._lora_base: dict[str, torch.Tensor] = {}
        # a tied weight an adapter payload changed on one side (`modules_to_save=[lm_head]` on a model whose head is
        # its input embedding): that name -> a name it was tied to, which kept the base tensor (`_untie`)
        self._untied: dict[str, str] = {}

        # Answers produced during a step, posted once the step's counters are updated.
        self._outbox: list[tuple[asyncio.AbstractEventLoop, asyncio.Future, GenerateResponse]] = []

        # Counters (written by one thread, read by stats()), under the names stats() reports them by; "steps"
        # counts loop iterations that ran the model (a decode and/or a prefill).
        self._n: dict[str, Any] = {**dict.fromkeys(("steps", "decode_forwards", "prefill_forwards", "prefill_tokens",
                                                   "tokens_generated", "requests_done", "requests_refused",
                                                   "requests_failed", "weight_updates", "prefix_store_failed"), 0),
                                   "busy_s": 0.0, "last_update_s": 0.0}

    # ------------------------------------------------------------------ public API

    @property
    def version(self) -> int:
        return self._version

    def start(self) -> None:
        """Start the decode thread (idempotent). Called implicitly by agenerate/update_weights/pause.
        Raises RuntimeError after close()."""
        if not self._ensure_started():
            raise RuntimeError(f"{self.name}: {ENGINE_CLOSED}")

    def _ensure_started(self) -> bool:
        """Start the decode thread if needed; False if the engine is closed."""
        with self._cv:
            if self._closed:
                return False
            if self._thread is None:
                self._thread = threading.Thread(target=self._thread_main, name=f"{self.name}-decode", daemon=True)
                self._thread.start()
            return True

    async def agenerate(self, req: GenerateRequest) -> GenerateResponse:
        """Generate ``req.gconfig.n`` samples. Never raises for bad input: returns a response with ``error``."""
        err = check_request(req, max_context_len=self.max_context_len, vocab_size=self.vocab_size,
                            max_batch_size=self.max_batch_size,
                            policies=self._loras.names if self._loras is not None else ())
        if err is not None:
            with self._cv:
                self._n["requests_refused"] += 1
            return refusal(req, err)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        state = _Request(req, loop, fut, self.eos_token_ids, self.vocab_size)
        state.slot = self._loras.slot(req.policy) if self._loras is not None else 0
        with self._cv:
            if self._closed:
                self._n["requests_refused"] += 1
                return refusal(req, ENGINE_CLOSED)
            self._waiting.append(state)
            self._cv.notify_all()
        self._ensure_started()  # if close() won the race, it answers the queued request itself
        try:
            return await fut
        except asyncio.CancelledError:
            state.cancelled = True  # the decode thread drops its rows at the next step boundary
            with self._cv:
                self._cv.notify_all()
            raise

    async def update_weights(self, source: str, version: int, policy: Optional[str] = None) -> None:
        """Load weights at the next decode-step boundary, set `version`, and go on decoding.

        `source` is a ``.safetensors`` file whose keys match ``model.state_dict()``, or a directory holding
        ``model.safetensors`` (or a sharded ``model.safetensors.index.json``) as written by ``save_pretrained``;
        tied weights absent from the file (e.g. ``lm_head.weight``) are fine. The file is read and checked while
        decoding goes on; only the swap of the parameters' tensors waits for the step boundary.

        Requests in flight are neither stopped nor dropped: their KV cache is KEPT (it was computed under the old
        weights, the AReaL-style choice: no recompute) together with their tokens so far, and they continue under
        the new weights; every token records the version that produced it. Returns once the weights are loaded.
        Raises (and keeps the old weights and version) if the file is missing or does not match the model.

        `policy`: the LoRA policy (an adapter payload) this loads or updates, served beside the engine's own weights
        (needs `max_loras`); its requests' tokens record `version`, the others' are untouched.
        """
        self.start()
        # read + check off the decode thread (decoding goes on); only the swap happens at the step boundary
        await self._swap_in(await asyncio.to_thread(self._prepare_weights, str(source), policy), version)

    async def update_weights_from_tensors(self, tensors: dict[str, torch.Tensor], version: int,
                                          source: str = "tensors", policy: Optional[str] = None) -> None:
        """`update_weights` from tensors already in memory (received by the `broadcast` transport):
        checked and cast off the decode thread, swapped in at the next step boundary. `tensors` is consumed."""
        self.start()
        prepared = await asyncio.to_thread(self._prepare_tensors, tensors, source, policy)
        tensors.clear()
        await self._swap_in(prepared, version)

    async def _swap_in(self, prepared: _Prepared, version: int) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        with self._cv:
            if self._closed:
                raise RuntimeError(f"{self.name}: {ENGINE_CLOSED}")
            self._commands.append((prepared, int(version), loop, fut))
            self._cv.notify_all()
        del prepared
        retired = await fut

        def free() -> None:
            retired.clear()
            # the update emptied the prefix cache too: hand what the old weights and the cached KV held back to
            # the OS, or the decode and executor threads' arenas keep each one's high-water mark (RSS creeps)
            trim_memory()

        await asyncio.to_thread(free)  # off the decode thread

    async def pause(self) -> None:
        """Stop decoding at the next step boundary; returns once no step is running. Requests wait, none dropped."""
        self._ensure_started()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        with self._cv:
            if self._closed:
                return
            self._paused = True
            self._pause_waiters.append((loop, fut))
            self._cv.notify_all()
        await fut

    async def resume(self) -> None:
        """Resume decoding after pause() (no-op if not paused)."""
        with self._cv:
            self._paused = False
            self._ack_pause_locked()
            self._cv.notify_all()

    async def close(self) -> None:
        """Stop the decode thread. Waiting requests get ``error="engine closed"``; running ones get the same error
        with their partial samples (finish_reason "abort" for the samples that were cut). Idempotent."""
        with self._cv:
            self._closed = True
            thread = self._thread
            self._cv.notify_all()
        if thread is not None:
            await asyncio.to_thread(thread.join)  # the thread answers what is pending on its way out
        else:
            self._fail_all_closed()

    def stats(self) -> dict[str, Any]:
        with self._cv:
            waiting = len(self._waiting)
        rows = list(self._rows)
        prefix = self._prefix
        cache_stats = {} if prefix is None else {**prefix.stats, "prefix_cache_tokens": prefix.tokens,
                                                 "prefix_cache_entries": len(prefix),
                                                 "prefix_cache_budget": prefix.max_tokens}
        policies = ({p: self._loras.versions[self._loras.slots[p]] for p in self._loras.names}
                    if self._loras is not None else {})
        return {"name": self.name, "version": self._version, **self._n, **cache_stats,
                **({"policies": policies} if policies else {}),
                "decode_steps": self._n["steps"],
                "running": len(rows),  # samples (KV rows) in the batch
                "running_requests": len({id(r.owner) for r in rows}),
                "waiting": waiting,  # requests not yet admitted
                "paused": self._paused, "closed": self._closed}

    # ------------------------------------------------------------------ decode thread

    def _thread_main(self) -> None:
        try:
            with torch.inference_mode():
                while True:
                    cmds: list[_Command] = []
                    newcomers: list[_Request] = []
                    with self._cv:
                        while True:
                            if self._closed:
                                return
                            if self._commands:
                                cmds, self._commands = self._commands, []
                                break
                            if self._paused:
                                self._ack_pause_locked()
                                self._cv.wait()
                                continue
                            newcomers = self._admit_locked()
                            if newcomers or self._rows:
                                break
                            self._cv.wait()
                    if cmds:
                        for cmd in cmds:
                            self._run_command(cmd)
                        continue
                    self._step(newcomers)
        except BaseException:  # pragma: no cover - the step itself catches everything; this is a last resort
            logger.exception("%s: decode thread crashed", self.name)
        finally:
            self._fail_all_closed()

    def _ack_pause_locked(self) -> None:
        for loop, fut in self._pause_waiters:
            _post(loop, fut, None)
        self._pause_waiters = []

    def _admit_locked(self) -> list[_Request]:
        """FIFO admission while the batch has rows free (a request takes n rows); cancelled requests are dropped
        (an empty batch admits the head of the queue: no request has more samples than the batch has rows)."""
        if any(r.cancelled for r in self._waiting):
            self._waiting = collections.deque(r for r in self._waiting if not r.cancelled)
        free = self.max_batch_size - len(self._rows)
        admitted: list[_Request] = []
        while self._waiting and self._waiting[0].n <= free:
            r = self._waiting.popleft()
            admitted.append(r)
            free -= r.n
        return admitted

    def _run_command(self, cmd: _Command) -> None:
        """A weight update, between two steps."""
        prepared, version, loop, fut = cmd
        source = prepared[0]
        if isinstance(prepared[1], LoraUpdate):
            self._load_policy(prepared[1], version, source, loop, fut)
            return
        # Point every parameter at its new tensor (no copy; tied weights share one Parameter, so they stay tied).
        # The old tensors go back to the caller, so that freeing them (hundreds of ms for a GB of weights) happens
        # on the caller's side, not in the decode loop.
        retired: list[torch.Tensor] = []
        t0 = time.perf_counter()
        try:
            with torch.inference_mode(False), torch.no_grad():
                for param, new in prepared[1]:
                    if isinstance(param, str):
                        self._untie(param, new)
                        continue
                    retired.append(param.data)
                    param.data = new
        except Exception as e:  # noqa: BLE001 - reported to the caller of update_weights
            logger.exception("%s: weight update from %s failed", self.name, source)
            _post(loop, fut, exc=e)
            return
        self._version = version
        self._weights_epoch += 1  # rows in flight keep their KV, but none of it is cached for reuse any more
        if self._prefix is not None:
            self._prefix.clear()
        for cache in self._lora_prefix.values():  # a policy's adapter is a delta on the base: its KV changed too
            cache.clear()
        self._n["weight_updates"] += 1
        self._n["last_update_s"] = time.perf_counter() - t0
        logger.info("%s: loaded %d tensors from %s in %.3fs, version %d (%d rows kept in flight)",
                    self.name, len(prepared[1]), source, self._n["last_update_s"], version, len(self._rows))
        _post(loop, fut, retired)

    def _load_policy(self, update: LoraUpdate, version: int, source: str, loop: asyncio.AbstractEventLoop,
                     fut: asyncio.Future) -> None:
        """A LoRA policy's adapter into its slot, between two steps; the other policies' KV and caches stay."""
        assert self._loras is not None
        t0 = time.perf_counter()
        try:
            with torch.inference_mode(False), torch.no_grad():
                slot = self._loras.apply(update, version)
        except Exception as e:  # noqa: BLE001 - reported to the caller of update_weights
            logger.exception("%s: loading policy %s from %s failed", self.name, update.policy, source)
            _post(loop, fut, exc=e)
            return
        self._weights_epoch += 1  # no row in flight is stored for reuse (its policy may be this one)
        if update.policy is None:  # the engine's own policy: its version moves (requests without a policy use it)
            self._version = version
            if self._prefix is not None:  # the base's KV no longer answers a request of the engine's own policy
                self._prefix.clear()
        cache = self._lora_prefix.get(slot)
        if cache is not None:
            cache.clear()
        self._n["weight_updates"] += 1
        self._n["last_update_s"] = time.perf_counter() - t0
        logger.info("%s: loaded %s (slot %d) from %s in %.3fs, version %d", self.name,
                    f"policy {update.policy}" if update.policy is not None else "the engine's own adapter", slot,
                    source, self._n["last_update_s"], version)
        _post(loop, fut, [])

    def _untie(self, name: str, new: torch.Tensor) -> None:
        """Give the tied weight `name` its own parameter holding `new`; the names it was tied to keep the old one.

        Why: with `modules_to_save` (or an adapter) on one side of a tie, peft trains its own copy of that module
        while the other side (the input embedding for a saved `lm_head`) stays the base, so the learner's policy
        is untied; writing the shared parameter would change both sides here and serve another policy."""
        old = self.model.get_parameter(name)
        tied = [n for n, p in self.model.named_parameters(remove_duplicate=False) if p is old and n != name]
        owner, _, attr = name.rpartition(".")
        setattr(self.model.get_submodule(owner), attr, torch.nn.Parameter(new, requires_grad=old.requires_grad))
        if tied:
            self._untied[name] = tied[0]
        logger.info("%s: %s gets its own tensor (it was tied to %s): the payload changes it alone", self.name, name,
                    ", ".join(tied))

    def _step(self, newcomers: list[_Request]) -> None:
        """One decode step for the running rows, then the newcomers' prefill and join.

        An exception fails only the requests it touched (the running batch for a decode error, the newcomers for
        a prefill error); anything that leaves the batch state in doubt resets the batch, failing its requests.
        """
        t0 = time.perf_counter()
        try:
            if self._rows:
                try:
                    self._decode()
                except Exception as e:  # noqa: BLE001
                    self._fail("decode step failed", e, [r.owner for r in self._rows])
                    self._reset_batch()
                self._evict()
            if newcomers:
                try:
                    self._prefill_and_join(newcomers)
                except Exception as e:  # noqa: BLE001
                    self._fail("prefill failed", e, newcomers)
                self._evict()
        except Exception as e:  # noqa: BLE001 - batch bookkeeping failed: start over with an empty batch
            self._fail("engine step failed", e, [*(r.owner for r in self._rows), *newcomers])
            self._reset_batch()
        finally:
            self._n["steps"] += 1
            self._n["busy_s"] += time.perf_counter() - t0
            self._flush_outbox()

    def _flush_outbox(self) -> None:
        """Post the step's answers, after batch state and counters are updated (so callers see consistent stats)."""
        outbox, self._outbox = self._outbox, []
        for loop, fut, resp in outbox:
            _post(loop, fut, resp)

    # ---- model calls

    def _forward(self, input_ids: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor,
                 cache: DynamicCache, slots: Sequence[int]) -> torch.Tensor:
        """The last position's logits; row i with LoRA slot `slots[i]` (0: the engine's own weights)."""
        with self._loras.rows(slots) if self._loras is not None else contextlib.nullcontext():
            if self._lean is not None:
                return self._lean(input_ids, mask, position_ids, cache)
            kwargs: dict[str, Any] = dict(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                                          past_key_values=cache, use_cache=True)
            if self._has_logits_to_keep:
                kwargs["logits_to_keep"] = 1
            out = self.model(**kwargs)
        return out.logits[:, -1, :].float()

    def _decode(self) -> None:
        rows, kv = self._rows, self._kv
        assert kv is not None
        dev = self.device
        input_ids = torch.tensor([[r.ids[-1]] for r in rows], dtype=torch.long, device=dev)
        position_ids = torch.tensor([[r.cached_len] for r in rows], dtype=torch.long, device=dev)
        logits = self._forward(input_ids, kv.decode_mask(), position_ids, kv.cache, [r.owner.slot for r in rows])
        self._n["decode_forwards"] += 1
        self._emit(rows, logits)

    def _prefill_and_join(self, reqs: list[_Request]) -> None:
        # the prompts to prefill: with the prefix cache on, requests of this step with the same ids share one (as
        # the n samples of one request do), and each starts from the longest prefix the cache holds
        slot: list[int] = []
        uniq: list[_Request] = []
        if self._prefix is None:
            uniq, slot = reqs, list(range(len(reqs)))
            matches: list[tuple[Optional[Entry], int]] = [(None, 0)] * len(reqs)
        else:
            first: dict[tuple[int, tuple[int, ...]], int] = {}
            for r in reqs:
                j = first.setdefault((r.slot, tuple(r.prompt)), len(uniq))  # one policy's KV is not another's
                if j == len(uniq):
                    uniq.append(r)
                slot.append(j)
            matches = [self._cache_of(r.slot).lookup(r.prompt, r.prompt_len - 1) for r in uniq]
        for r, j in zip(reqs, slot):
            r.epoch, r.source = self._weights_epoch, matches[j][0]
        # one forward per run of similar lengths: a forward pads every row to its longest (a 50-token prompt that
        # missed the cache among 20-token feedback turns would make every row 50 wide)
        for group in length_groups([r.prompt_len - n for r, (_, n) in zip(uniq, matches)], self._prefill_fixed):
            local = {j: i for i, j in enumerate(group)}
            members = [(r, local[j]) for r, j in zip(reqs, slot) if j in local]
            self._prefill_group([uniq[j] for j in group], [matches[j] for j in group], members)

    def _prefill_group(self, uniq: list[_Request], matches: list[tuple[Optional[Entry], int]],
                       members: list[tuple[_Request, int]]) -> None:
        """One prefill forward over the distinct prompts `uniq` (each from its cached prefix, `matches`), then
        the rows of every request in `members` (request, index of its prompt in `uniq`) emitted and joined."""
        dev = self.device
        reqs = [r for r, _ in members]
        slot = [j for _, j in members]
        if any(n for _, n in matches):
            logits, cache, mask = self._prefill_suffixes(uniq, matches)
        else:
            lens = [r.prompt_len for r in uniq]
            ids, mask, position_ids = left_pad([r.prompt for r in uniq], self.pad_token_id, dev)
            cache = DynamicCache()
            logits = self._forward(ids, mask, position_ids, cache, [r.slot for r in uniq])
            if min(lens) < max(lens):  # keep padding KV finite (0 * NaN would leak through the masked attention)
                pad = ~mask.bool()[:, None, :, None]
                _map_kv(cache, lambda x: x.masked_fill(pad, 0))
        self._n["prefill_forwards"] += 1
        self._n["prefill_tokens"] += sum(r.prompt_len - n for r, (_, n) in zip(uniq, matches))
        # each request's n samples: KV rows of its prefilled prompt, repeated
        order = [j for r, j in zip(reqs, slot) for _ in range(r.n)]
        if order != list(range(len(uniq))):
            idx = torch.tensor(order, dtype=torch.long, device=dev)
            logits = logits.index_select(0, idx)
            mask = mask.index_select(0, idx)
            _map_kv(cache, lambda x: x.index_select(0, idx))
        rows = [_Row(r, j) for r in reqs for j in range(r.n)]
        self._emit(rows, logits)
        self._join(rows, cache, mask)

    def _prefill_suffixes(self, reqs: list[_Request], matches: list[tuple[Optional[Entry], int]]
                          ) -> tuple[torch.Tensor, DynamicCache, torch.Tensor]:
        """One forward over each request's ids past its cached prefix (`matches`: entry and prefix length, 0 for
        none), the prefixes' KV as the past; returns the last logits and the KV and mask in the batch's layout
        (each row's tokens contiguous at the right, left-padded)."""
        dev = self.device
        m = [n for _, n in matches]
        width_past = max(m)
        ids, suffix_mask, suffix_pos = left_pad([r.prompt[n:] for r, n in zip(reqs, m)], self.pad_token_id, dev)
        width_suffix = ids.shape[1]
        m_t = torch.tensor(m, dtype=torch.long, device=dev)[:, None]
        past_mask = (torch.arange(width_past, device=dev)[None, :] >= width_past - m_t).long()
        # the past: each row's cached prefix right-aligned in width_past columns, zeros before it
        some = next(e for e, _ in matches if e is not None).kv
        past: KV = []
        for layer, (k0, v0) in enumerate(some):
            keys = k0.new_zeros((len(reqs), k0.shape[1], width_past, k0.shape[3]))
            values = v0.new_zeros((len(reqs), v0.shape[1], width_past, v0.shape[3]))
            for i, (entry, n) in enumerate(matches):
                if entry is not None:
                    k, v = entry.kv[layer]
                    keys[i, :, width_past - n:] = k[0, :, :n]
                    values[i, :, width_past - n:] = v[0, :, :n]
            past.append((keys, values))
        cache = DynamicCache(ddp_cache_data=past)
        logits = self._forward(ids, torch.cat([past_mask, suffix_mask], dim=1), suffix_pos + m_t, cache,
                               [r.slot for r in reqs])
        # the batch's layout: row i's prefix (columns width_past - m_i ..) and suffix (the last s_i columns) made
        # contiguous at the right end of max(prompt_len) columns
        total = torch.tensor([r.prompt_len for r in reqs], dtype=torch.long, device=dev)[:, None]
        width = int(total.max())
        t = torch.arange(width, device=dev)[None, :] - (width - total)  # token index of each column (< 0: padding)
        src = torch.where(t < m_t, width_past - m_t + t, width_past + width_suffix - (total - m_t) + (t - m_t))
        real = t >= 0
        src = torch.where(real, src, 0)
        keep_real = real[:, None, :, None]

        def compact(x: torch.Tensor) -> torch.Tensor:
            index = src[:, None, :, None].expand(x.shape[0], x.shape[1], width, x.shape[3])
            return x.gather(2, index).masked_fill(~keep_real, 0)

        _map_kv(cache, compact)
        return logits, cache, real.long()

    def _cache_of(self, slot: int) -> PrefixCache:
        """The prefix cache of the policy in LoRA `slot` (0: the engine's own); only with the prefix cache on."""
        assert self._prefix is not None
        if slot == 0:
            return self._prefix
        cache = self._lora_prefix.get(slot)
        if cache is None:
            cache = self._lora_prefix[slot] = PrefixCache(self._prefix.max_tokens)
        return cache

    def _join(self, rows: list[_Row], cache: DynamicCache, mask: torch.Tensor) -> None:
        """Add the newcomers' KV rows to the running batch (`RunningKV`: written into its spare rows)."""
        if not self._rows or self._kv is None:
            self._rows, self._kv = rows, RunningKV(cache, mask, max_rows=self.max_batch_size)
            return
        self._kv.join(cache, mask)
        self._rows = self._rows + rows

    def _evict(self) -> None:
        """Remove finished, cancelled and failed rows from the batch; answer requests whose samples are all done."""
        rows = self._rows
        keep: list[int] = []
        done: list[_Request] = []
        finished: list[int] = []  # rows whose KV the prefix cache may keep
        for i, r in enumerate(rows):
            owner = r.owner
            if owner.cancelled or owner.responded:
                continue
            if r.finish is None:
                keep.append(i)
                continue
            if self._prefix is not None and owner.epoch == self._weights_epoch:
                finished.append(i)
            owner.samples[r.index] = r.to_sample(r.finish)
            owner.remaining -= 1
            if owner.remaining == 0:
                owner.responded = True
                done.append(owner)
        by_policy: dict[int, list[int]] = {}
        for i in finished:
            by_policy.setdefault(rows[i].owner.slot, []).append(i)
        for slot, some in by_policy.items():
            self._store(some, self._cache_of(slot))
        if len(keep) != len(rows):
            self._select_rows(keep)
        for owner in done:
            self._n["requests_done"] += 1
            self._outbox.append((owner.loop, owner.future,
                                 GenerateResponse(qid=owner.qid, samples=list(owner.samples))))

    def _store(self, finished: list[int], prefix: PrefixCache) -> None:
        """Keep the KV of the finished rows `finished` (all computed under the current weights) in the prefix
        cache: for those it does not cover yet, one gather per layer packs their real tokens end to end (no
        padding) into a storage of at most the budget, each entry a view of it. A failure here only loses the
        reuse, never a request.

        Why packed storages, not a copy per entry: a copy per entry costs 2 x layers copies per row (as much as
        the prefill it saves on a small model), a packed storage 2 x layers gathers per step; a storage over the
        budget would evict every entry and then itself, so a step whose rows together exceed it fills several."""
        kv = self._kv
        assert kv is not None
        cache = kv.cache
        try:
            rows = [(i, self._rows[i]) for i in finished]
            items = [(i, r, r.owner.prompt + r.ids[:-1]) for i, r in rows]
            items = [(i, r, ids) for i, r, ids in items if not prefix.covers(ids)]  # each fits the budget alone
            chunks: list[list[tuple[int, _Row, list[int]]]] = []
            size = prefix.max_tokens
            for item in items:
                if size + len(item[2]) > prefix.max_tokens:
                    chunks.append([])
                    size = 0
                chunks[-1].append(item)
                size += len(item[2])
            width = kv.width  # each row's real tokens are its last columns
            for chunk in chunks:
                total = sum(len(ids) for _, _, ids in chunk)
                lens = torch.tensor([len(ids) for _, _, ids in chunk], dtype=torch.long, device=self.device)
                row_idx = torch.tensor([i for i, _, _ in chunk], dtype=torch.long,
                                       device=self.device).repeat_interleave(lens, output_size=total)
                # token t of the packed storage: its row's column width - len + (t - the row's offset)
                shift = (width - lens.cumsum(0)).repeat_interleave(lens, output_size=total)
                col_idx = torch.arange(total, device=self.device) + shift
                # [tokens, heads, head_dim] per layer, seen as [1, heads, tokens, head_dim]
                block = [(layer.keys[row_idx, :, col_idx].permute(1, 0, 2)[None],
                          layer.values[row_idx, :, col_idx].permute(1, 0, 2)[None]) for layer in cache.layers]
                storage = Storage(total)
                off = 0
                for _, r, ids in chunk:
                    n = len(ids)
                    prefix.insert(ids, [(k[:, :, off:off + n], v[:, :, off:off + n]) for k, v in block],
                                  r.owner.source, storage)
                    off += n
        except Exception:  # noqa: BLE001
            logger.exception("%s: storing finished sequences in the prefix cache failed", self.name)
            self._n["prefix_store_failed"] += 1

    def _select_rows(self, keep: list[int]) -> None:
        """Keep only rows `keep` (the last rows move into the leaving rows' places) and drop the columns that are
        padding for every row left."""
        if not keep:
            self._reset_batch()
            return
        assert self._kv is not None
        rows = self._rows
        order = self._kv.select(keep, max(rows[i].cached_len for i in keep))
        self._rows = [rows[i] for i in order]

    def _reset_batch(self) -> None:
        self._rows, self._kv = [], None

    # ---- sampling

    def _emit(self, rows: list[_Row], logits: torch.Tensor) -> None:
        """Sample one token per row from `logits` [B, V], record it with its logprob and version, mark finishes."""
        tokens, logps = self._sample(rows, logits)
        version = self._version
        versions = self._loras.versions if self._loras is not None else {}  # a LoRA policy's rows: its version
        for r, t, lp in zip(rows, tokens.tolist(), logps.tolist()):
            r.ids.append(t)
            r.logps.append(lp)
            r.versions.append(versions[r.owner.slot] if r.owner.slot else version)
            g = r.owner.gconfig
            if t in r.owner.stop_set:
                r.finish = "stop"
            elif len(r.ids) >= g.max_new_tokens or r.owner.prompt_len + len(r.ids) >= self.max_context_len:
                r.finish = "length"
        self._n["tokens_generated"] += len(rows)

    def _sample(self, rows: list[_Row], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row and its logprob under the distribution it was drawn from (see the module doc)."""
        dev = logits.device
        gconfigs = [r.owner.gconfig for r in rows]
        temps = torch.tensor([1.0 if g.greedy else float(g.temperature) for g in gconfigs], dtype=logits.dtype,
                             device=dev)
        dist = logits / temps[:, None]  # the distribution each row's token comes from (sampled rows: truncated)

        # min_new_tokens: stop/eos ids cannot be drawn until reached
        mi: list[int] = []
        mj: list[int] = []
        for i, r in enumerate(rows):
            if r.owner.stop_list and len(r.ids) < r.owner.gconfig.min_new_tokens:
                mi.extend([i] * len(r.owner.stop_list))
                mj.extend(r.owner.stop_list)
        if mi:
            dist[torch.tensor(mi, device=dev), torch.tensor(mj, device=dev)] = float("-inf")

        sampled = [i for i, g in enumerate(gconfigs) if not g.greedy]
        every = len(sampled) == len(rows)
        tokens = None if every else dist.argmax(dim=-1)  # greedy rows: the most likely token
        if sampled:  # the others: a draw from the top-k/top-p truncated distribution (renormalised by the softmaxes)
            idx = None if every else torch.tensor(sampled, device=dev)
            sub = _truncate(dist if every else dist[idx], [gconfigs[i].top_k for i in sampled],
                            [float(gconfigs[i].top_p) for i in sampled])
            drawn = torch.multinomial(torch.softmax(sub, dim=-1), 1, generator=self._generator).squeeze(1)
            if every:
                tokens, dist = drawn, sub
            else:
                tokens[idx], dist[idx] = drawn, sub
        logps = torch.log_softmax(dist, dim=-1).gather(1, tokens[:, None]).squeeze(1)
        return tokens, logps

    # ---- failures and shutdown

    def _fail(self, what: str, e: Exception, owners: list[_Request]) -> None:
        """Log that `what` failed with `e` and answer every request of `owners` (once each) with the error."""
        logger.exception("%s: %s; failing %d requests", self.name, what, len({id(o) for o in owners}))
        error = f"{what}: {type(e).__name__}: {e}"
        for owner in owners:
            if not (owner.responded or owner.cancelled):
                owner.responded = True
                self._n["requests_failed"] += 1
                self._outbox.append((owner.loop, owner.future,
                                     GenerateResponse(qid=owner.qid, samples=[], error=error)))

    def _fail_all_closed(self) -> None:
        """After the thread stopped (or never started): answer everything still pending with 'engine closed'."""
        self._flush_outbox()
        with self._cv:
            self._closed = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            cmds, self._commands = self._commands, []
            self._ack_pause_locked()
            rows, self._rows = self._rows, []
            self._kv = None
        for r in rows:  # running requests keep their samples so far
            if not r.owner.responded:
                r.owner.samples[r.index] = r.to_sample(r.finish or "abort")
        for owner in [*waiting, *{id(r.owner): r.owner for r in rows}.values()]:
            if not owner.cancelled and not owner.responded:
                owner.responded = True
                samples = [s for s in owner.samples if s is not None]
                _post(owner.loop, owner.future, GenerateResponse(qid=owner.qid, samples=samples, error=ENGINE_CLOSED))
        for _, _, loop, fut in cmds:
            _post(loop, fut, exc=RuntimeError(f"{self.name}: {ENGINE_CLOSED}"))

    # ---- weights

    def _prepare_weights(self, source: str, policy: Optional[str] = None) -> _Prepared:
        """Any thread: read the safetensors of `source`, check them against model.state_dict() (names, shapes) and
        cast them to each parameter's dtype/device. Raises (the model is untouched) when they do not match."""
        loaded: dict[str, torch.Tensor] = {}
        with torch.inference_mode(False), torch.no_grad():
            for f in _safetensors_files(source):
                part = load_file(str(f), device=str(self.device))
                if self.device.type == "cpu":
                    # load_file maps the file: read it here, off the decode thread (whose steps after the swap
                    # would fault the pages in, from a shared filesystem in a cluster), and keep no mapping of a
                    # file the learner deletes once every worker moved on
                    part = {k: v.clone() for k, v in part.items()}
                loaded.update(part)
        return self._prepare_tensors(loaded, source, policy)

    def _prepare_tensors(self, loaded: dict[str, torch.Tensor], source: str,
                         policy: Optional[str] = None) -> _Prepared:
        """Any thread: check `loaded` against model.state_dict() (names, shapes; a tied alias may be absent) and
        cast each tensor to its parameter's dtype/device. Raises (the model is untouched) when they do not match.
        An adapter payload is merged instead (`_prepare_adapter`), or, for a LoRA `policy`, made its slot's."""
        if policy is not None:
            if self._loras is None:
                raise ValueError(f"{self.name}: policy {policy!r}: this engine serves no LoRA policies "
                                 f"(max_loras=0)")
            return source, self._loras.prepare(policy, loaded)
        # a named policy's adapter is a delta on the base: the engine's own adapter is not merged under it either,
        # but served from a slot of its own (the base stays the base)
        if is_adapter(loaded) and self._loras is not None:
            return source, self._loras.prepare(None, loaded)
        if is_adapter(loaded):
            return self._prepare_adapter(loaded, source)
        for name, tied in self._untied.items():  # a tied model's file may name one side; the other is an alias
            if name not in loaded and tied in loaded:
                loaded[name] = loaded[tied]
        with torch.inference_mode(False), torch.no_grad():
            params = self.model.state_dict(keep_vars=True)
            present = {t.data_ptr() for k, t in params.items() if k in loaded}  # a tied alias in the file counts
            missing = [k for k, t in params.items() if t.data_ptr() not in present]
            unexpected = [k for k in loaded if k not in params]
            bad_shape = [f"{k}: file {tuple(loaded[k].shape)} vs model {tuple(params[k].shape)}"
                         for k in loaded if k in params and loaded[k].shape != params[k].shape]
            if missing or unexpected or bad_shape:
                raise ValueError(
                    f"weights in {source} do not match the model: missing {missing[:10]}"
                    f"{' ...' if len(missing) > 10 else ''} ({len(missing)}), unexpected {unexpected[:10]}"
                    f"{' ...' if len(unexpected) > 10 else ''} ({len(unexpected)}), shape mismatch {bad_shape[:10]}"
                )
            pairs: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
            done: set[int] = set()
            for k, src in loaded.items():
                tgt = params[k]
                if id(tgt) in done:
                    continue
                done.add(id(tgt))
                pairs.append((tgt, src.to(device=tgt.device, dtype=tgt.dtype).contiguous()))
        # accepted: a full state dict is the new base (nothing left to un-merge); a refused one left the base kept,
        # so the next adapter still merges into the base, not onto the weights merged last
        self._lora_base = {}
        return source, pairs

    def _prepare_adapter(self, loaded: dict[str, torch.Tensor], source: str) -> _Prepared:
        """Any thread: an adapter payload as new tensors for the weights it adapts, each ``base + B @ A`` merged
        into a copy (decode then runs plain weights: no adapter kernels, the same speed), the base kept the first
        time a weight is adapted; ``modules_to_save`` tensors replace theirs. A weight tied to another (a tied
        ``lm_head``) gets its own tensor, the other keeping the base, as peft's copy leaves it on the learner.
        Raises (the model is untouched) when the payload does not fit the model."""
        with torch.inference_mode(False), torch.no_grad():
            params = self.model.state_dict(keep_vars=True)
            expected, problems = adapter_expected(params, {k: tuple(v.shape) for k, v in loaded.items()})
            problems += [f"{k}: {tuple(loaded[k].shape)} sent, {tuple(t.shape)} expected"
                         for k, t in expected.items() if tuple(loaded[k].shape) != tuple(t.shape)]
            if problems:
                raise ValueError(f"adapter in {source} does not fit the model: {'; '.join(problems[:10])}")
            adapters, full = split_payload(loaded)
            names_of: dict[int, int] = collections.Counter(id(t) for t in params.values())

            def target(name: str) -> torch.nn.Parameter | str:
                """A weight tied to another gets its own tensor (peft changes only the side it wraps)."""
                return name if names_of[id(params[name])] > 1 else params[name]

            pairs: list[tuple[torch.nn.Parameter | str, torch.Tensor]] = []
            for name, (a, b) in adapters.items():
                param = params[name]
                base = self._lora_base.get(name)
                if base is None:  # the weights served until now are the base: keep a copy to merge into
                    base = self._lora_base[name] = param.data.detach().clone()
                pairs.append((target(name), merged_weight(base, a, b)))
            for name, src in full.items():
                pairs.append((target(name), src.to(device=params[name].device, dtype=params[name].dtype).contiguous()))
        return source, pairs


def _map_kv(cache: DynamicCache, fn: Any) -> None:
    """Replace every layer's keys and values by `fn` of them."""
    for layer in cache.layers:
        layer.keys, layer.values = fn(layer.keys), fn(layer.values)


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int,
             device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of token sequences left-padded to the longest: ids, attention mask (1 = real token) and the
    position ids that give every row its own positions from 0 (the layout of a batched prefill)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.as_tensor(list(s), dtype=torch.long)
        mask[i, width - len(s):] = 1
    ids, mask = ids.to(device), mask.to(device)
    return ids, mask, (mask.cumsum(-1) - 1).clamp_(min=0)


def length_groups(lengths: Sequence[int], fixed: int) -> list[list[int]]:
    """Indices of `lengths` (prompt tokens to prefill) split into forwards that minimise the padded work: the sum
    over forwards of `fixed` (a forward's own cost, in tokens) plus rows x the longest row. Each forward takes a
    run of the sorted distinct lengths (the best split always does); dynamic programming over those runs."""
    by_len: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_len.setdefault(int(n), []).append(i)
    distinct = sorted(by_len)
    best = [0.0] + [float("inf")] * len(distinct)  # best[j]: cost of the j shortest distinct lengths
    cut = [0] * (len(distinct) + 1)
    for j in range(1, len(distinct) + 1):
        rows = 0
        for i in range(j, 0, -1):  # a forward over distinct lengths i..j, all padded to distinct[j - 1]
            rows += len(by_len[distinct[i - 1]])
            cost = best[i - 1] + fixed + rows * distinct[j - 1]
            if cost < best[j]:
                best[j], cut[j] = cost, i - 1
    groups: list[list[int]] = []
    j = len(distinct)
    while j > 0:
        groups.append([i for n in distinct[cut[j]:j] for i in by_len[n]])
        j = cut[j]
    return groups[::-1]


def _check_attention_supported(config: Any, max_context_len: int) -> None:
    """The left-padded batched cache assumes full attention in every layer; refuse models where that is wrong."""
    if config is None:
        return
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layer_types = getattr(cfg, "layer_types", None) or []
    odd = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if odd:
        raise ValueError(f"TorchEngine supports attention layers only; this model has layer types {odd}")
    window = getattr(cfg, "sliding_window", None)
    uses_window = "sliding_attention" in layer_types or (
        not layer_types and window is not None and getattr(cfg, "use_sliding_window", True)
    )
    if uses_window and window is not None and int(window) < max_context_len:
        raise ValueError(
            f"TorchEngine needs full attention over max_context_len={max_context_len} tokens, but the model uses a "
            f"sliding window of {window}; lower max_context_len to <= {window} or use the sglang backend"
        )


def _safetensors_files(source: str) -> list[Path]:
    p = Path(source)
    if p.is_file():
        return [p]
    if p.is_dir():
        single = p / "model.safetensors"
        if single.is_file():
            return [single]
        index = p / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return [p / f for f in sorted(set(weight_map.values()))]
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in directory {source}")
    raise FileNotFoundError(f"weights source {source} does not exist")


def _truncate(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Apply per-row top-k (0 = off) then top-p (1 = off) by setting dropped logits to -inf."""
    S, V = logits.shape
    if any(k > 0 for k in top_k):
        k_t = torch.tensor([k if 0 < k < V else V for k in top_k], dtype=torch.long, device=logits.device)
        kmax = int(k_t.max())
        kth = torch.topk(logits, kmax, dim=-1).values.gather(1, (k_t - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p < 1.0 for p in top_p):
        p_t = torch.tensor(top_p, dtype=logits.dtype, device=logits.device)
        sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        remove_sorted = mass_before > p_t[:, None]  # keep the smallest prefix whose mass reaches top_p
        remove_sorted[:, 0] = False
        remove = torch.zeros_like(remove_sorted).scatter(1, sorted_idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits
