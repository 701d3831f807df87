"""SGLang backend (`inference.backend=sglang`): the inference worker launches, supervises and drives an SGLang server.

Why it is built this way (schema and semantics read from SGLang 0.5.23's `http_server.py` / `io_struct.py`):

* **Token-in, token-out.** `POST /generate` with `input_ids`, `sampling_params` and `return_logprob: true`; the
  answer's `output_ids` and `meta_info.output_token_logprobs` (`[[logprob, token_id, text|null], ...]`) are the
  sample; `meta_info.finish_reason.type` is `stop` | `length` | `abort`. Text is never decoded and re-encoded.
  One HTTP request per sample (n samples of one prompt share its prefix through SGLang's radix cache).
* **Behaviour logprobs.** SGLang 0.5.23's `output_token_logprobs` are `log(softmax(logits' / T))` of the drawn
  token (`srt/layers/sampler.py`: T = 1 for greedy), where `logits'` already has the penalizers applied
  (`apply_logits_bias`: min_new_tokens masks the stop ids) but NOT top-k / top-p truncation (the sampling kernels
  read `probs` without changing it). The embedded engine reports the logprob of the distribution it sampled from
  (temperature, mask, truncation, renormalised); the two agree exactly when nothing is truncated. So this backend
  refuses a sampled request with `top_p < 1` or `top_k > 0` (`TRUNCATION_REFUSED`): its logprobs would claim a
  lower behaviour probability than the token really had, and the learner's importance weights would be wrong.
  (SGLang 0.5.23's `return_sampling_mask` can report truncated behaviour logprobs, but only with a server-side cap
  on the support size, `--sampling-mask-max-tokens`, and with top-k and top-p applied jointly to the full
  distribution, which is not the embedded engine's top-k-then-top-p order.)
* **Per-token versions come from SGLang itself.** `/update_weights_from_disk` takes a `weight_version` string; every
  answer carries `meta_info.weight_versions`, spans `{version, start, end}` over the output tokens that say which
  weights made each token (a request that spans an update has two spans). The version SGLang starts with is
  "default" and maps to this engine's initial version.
* **Weight updates without dropping a request** (`pause_mode`):
  - `retract` (default): `/pause_generation {"mode": "retract"}` stops the scheduler at a step boundary and moves
    in-flight requests (with their tokens so far) back to the waiting queue, freeing their KV;
    `/update_weights_from_disk` loads the new weights and flushes the radix cache (allowed while paused);
    `/continue_generation` resumes and the requests are re-prefilled (prompt + tokens so far) under the new
    weights: KV RECOMPUTED, and no later request can reuse a prefix cached under the old weights.
  - `in_place`: the requests stay in the running batch and keep their KV (computed by the old weights, like the
    embedded engine): the cheapest pause. The update must not flush (SGLang refuses a flush while requests sit in
    the batch), so prefixes cached under the old weights stay in the radix cache and later requests sharing them
    reuse old-weight KV until they are evicted or `/flush_cache` runs on an idle server.
  - `abort` (fallback for servers without the modes above): every in-flight request is aborted and comes back with
    its tokens so far; the engine re-submits prompt + those tokens for the remaining budget once the new weights
    are in. Nothing is lost or restarted from scratch; the prefix is re-prefilled (KV recomputed).
  New requests that arrive during an update are held by SGLang until `/continue_generation`.
* **Weights from the learner's export.** SGLang loads a directory; the learner writes one safetensors file per
  version. The engine builds `weights_dir/v<version>/` with the file hard-linked (or symlinked) as
  `model.safetensors` next to links to the base model's config and tokenizer files, and keeps the last two.
* **Supervision.** `SGLangServer` starts `python -m sglang.launch_server ...` in its own process group with
  PR_SET_PDEATHSIG (a `kill -9` of the worker takes the server with it; SGLang's own children die with their
  parent), waits for `/health`, and stops the group on close. A health watcher polls `/health` (not during an
  update: a paused server does not answer it) and the process; when the server is gone, in-flight requests get an
  error and `wait_failed()` returns, so the inference worker exits and the controller fails over.
* Bad input gets a `GenerateResponse` with `error`, never an exception; every HTTP call has a timeout.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional, Sequence

import numpy as np

from arl.api.types import POLICY_NAME, GenerateRequest, GenerateResponse, GenerationConfig, SampleOutput
from arl.config import PauseMode, SGLangConfig
from arl.inference.requests import ENGINE_CLOSED, check_request, refusal
from arl.utils.net import free_port
from arl.utils.proc import die_with_parent_preexec, signal_group, tail

logger = logging.getLogger("arl.inference")

_Adapter = tuple[Optional[str], int]  # (LoRA policy: None for the run's own, version)

# files of the base model directory linked into every per-version weights directory
_MODEL_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                     "special_tokens_map.json", "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt")
# flags that make sglang 0.5.x run on a CPU (see DESIGN.md): torch-native attention, no CUDA graphs
CPU_SERVER_ARGS = ("--attention-backend", "torch_native", "--disable-cuda-graph", "--skip-server-warmup",
                   "--mem-fraction-static", "0.1", "--max-total-tokens", "65536")


TRUNCATION_REFUSED = (
    "the sglang backend cannot report behaviour logprobs of top-p/top-k truncated sampling (SGLang's "
    "output_token_logprobs are those of the untruncated distribution); set gen.top_p=1.0 and gen.top_k=0, or use "
    "inference.backend=torch")


def truncation_error(g: GenerationConfig) -> Optional[str]:
    """Why SGLang cannot serve `g` with honest logprobs (a truncating sampled request), or None."""
    if g.greedy or (g.top_p >= 1.0 and g.top_k <= 0):
        return None
    return f"{TRUNCATION_REFUSED} (got top_p={g.top_p}, top_k={g.top_k})"


class SGLangError(RuntimeError):
    """An SGLang call that failed (HTTP status, transport error, or a malformed answer)."""


def server_command(*, model_path: str, host: str, port: int, device: str, seed: int, python: str = "",
                   max_running_requests: int = 0, extra_args: Sequence[str] = ()) -> list[str]:
    """The `sglang.launch_server` command line for one server (CPU flags added when `device` is cpu)."""
    cmd = [python or sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host,
           "--port", str(port), "--device", device, "--random-seed", str(seed)]
    if max_running_requests > 0:
        cmd += ["--max-running-requests", str(max_running_requests)]
    if device == "cpu":
        cmd += list(CPU_SERVER_ARGS)
    return cmd + list(extra_args)


def server_gpus(index: int, gpus_per_server: int, first_gpu: int = 0, visible: str = "") -> str:
    """CUDA_VISIBLE_DEVICES of server `index`: GPUs first + index*g .. first + index*g + g - 1, counted within
    `visible` (the launcher's own CUDA_VISIBLE_DEVICES) when that is set."""
    slots = [first_gpu + index * gpus_per_server + k for k in range(gpus_per_server)]
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if ids and max(slots) >= len(ids):
        raise ValueError(f"sglang server {index} needs GPUs {slots}, but CUDA_VISIBLE_DEVICES={visible!r} has only "
                         f"{len(ids)}")
    return ",".join(ids[k] if ids else str(k) for k in slots)


class SGLangServer:
    """An SGLang server process owned by this worker: started, health-checked, and stopped with it."""

    def __init__(self, cmd: Sequence[str], *, base_url: str, log_path: str, env: dict[str, str]) -> None:
        """Spawn the server (call from the main thread: PR_SET_PDEATHSIG is tied to the spawning thread)."""
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        with open(log_path, "ab", buffering=0) as log:
            self.proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={"PYTHONUNBUFFERED": "1", **os.environ, **env}, start_new_session=True,
                                         preexec_fn=die_with_parent_preexec())
        self.base_url = base_url
        self.log_path = log_path
        logger.info("started sglang server (pid %d) on %s, log %s", self.proc.pid, base_url, log_path)

    def exit_code(self) -> Optional[int]:
        return self.proc.poll()

    def wait_ready(self, timeout: float) -> None:
        """Block until GET /health answers 200; raises with the log tail if the server exits or times out."""
        deadline = time.monotonic() + timeout
        while True:
            code = self.exit_code()
            if code is not None:
                raise SGLangError(f"sglang server exited with code {code} while starting; last lines of "
                                  f"{self.log_path}:\n{tail(self.log_path, 30)}")
            with contextlib.suppress(urllib.error.URLError, OSError, ValueError):
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            if time.monotonic() > deadline:  # the caller stops the server
                raise SGLangError(f"sglang server not healthy within {timeout:.0f}s; last lines of "
                                  f"{self.log_path}:\n{tail(self.log_path, 30)}")
            time.sleep(0.5)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after `grace` seconds. Idempotent."""
        if self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            signal_group(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


def _version_of(tag: Any, initial: int) -> int:
    """SGLang's weight_version string -> our int version ("default", SGLang's start-up tag, is the initial one)."""
    try:
        return int(str(tag))
    except (TypeError, ValueError):
        return initial


class SGLangEngine:
    """`InferenceEngine` over an SGLang HTTP server (see the module docstring for the protocol).

    Args:
        base_url: the server, e.g. http://127.0.0.1:30000.
        model_path: the base HF model directory (config and tokenizer files for per-version weight dirs).
        version: policy version of the weights the server starts with.
        server: the supervised server process, if this engine owns one (stopped on close, watched for exit).
        pause_mode: "retract" (KV recomputed), "in_place" (KV kept) or "abort" (abort + resubmit the prefix).
        weights_dir: where per-version weight directories are built (default: a `sglang-weights` folder next
            to the learner's file).
        max_context_len: prompts at least this long are refused (0: leave it to the server).
        request_timeout: seconds one /generate call may take; control_timeout: for pause/update/continue.
        health_interval / max_health_failures: the watcher polls /health every interval; this many failures in a
            row (or the server process exiting) mark the engine failed.
        empty_device_cache: pass `torch_empty_cache` on resume (GPU servers).
        adapters_keep: LoRA (``learner.lora``; the server runs with ``--enable-lora``): a weight update that is an
            adapter payload (`arl.weights.adapter`) is loaded as the adapter ``arl-v{N}`` (`/load_lora_adapter`,
            no pause: requests in flight keep theirs), each request carries the adapter of the version it was
            admitted at (``lora_path``), and adapters of versions older than the newest minus ``adapters_keep - 1``
            (eta + 1: the oldest a consumed token may come from) are unloaded once no request uses them, so the
            server's adapter memory stays bounded. 0: full weights only. The same holds per named LoRA policy
            served beside (``update_weights(..., policy=name)``: adapters ``arl-{name}-v{N}``; a request names its
            policy, `GenerateRequest.policy`), SGLang's multi-LoRA batching serving them together.
    """

    def __init__(self, base_url: str, *, model_path: str = "", version: int = 0, name: str = "sglang",
                 server: Optional[SGLangServer] = None, pause_mode: str = PauseMode.retract.value,
                 weights_dir: str = "", max_context_len: int = 0, request_timeout: float = 3600.0,
                 control_timeout: float = 600.0, health_interval: float = 5.0, max_health_failures: int = 3,
                 empty_device_cache: bool = False, adapters_keep: int = 0) -> None:
        self.base_url = base_url.rstrip("/")
        self.model_path = model_path
        self.name = name
        self.server = server
        self.pause_mode: str = PauseMode(pause_mode).value  # plain str: it goes into JSON bodies and heartbeat stats
        self.weights_dir = weights_dir
        self.max_context_len = int(max_context_len)
        self.request_timeout = float(request_timeout)
        self.control_timeout = float(control_timeout)
        self.health_interval = float(health_interval)
        self.max_health_failures = int(max_health_failures)
        self.empty_device_cache = bool(empty_device_cache)
        self._initial_version = int(version)
        self._version = int(version)
        self._session: Any = None
        self._health_task: Optional[asyncio.Task] = None
        self._update_lock = asyncio.Lock()  # asyncio primitives bind to the loop that first waits on them
        self._failed: Optional[str] = None
        self._failed_event = asyncio.Event()
        self._closed = False
        self._updating = False
        self._abort_epoch = 0  # bumped by each abort-mode update: an abort seen after it is resubmitted
        self._built_dirs: list[str] = []
        self._inflight = 0
        self._counters = {"requests": 0, "samples": 0, "tokens_generated": 0, "requests_refused": 0,
                          "requests_failed": 0, "resubmits": 0, "weight_updates": 0, "health_failures": 0}
        self._last_update_s = 0.0
        self._busy_s = 0.0
        self._busy_since: Optional[float] = None
        self.adapters_keep = int(adapters_keep)
        # (policy, version) -> loaded adapter's directory; policy None: the run's own policy, a name: one served beside
        self._adapters: dict[_Adapter, str] = {}
        self._adapter_users: collections.Counter[_Adapter] = collections.Counter()  # -> samples in flight on it
        self._adapter_version: Optional[int] = None  # the adapter new requests get (None: the base weights)
        self._policy_versions: dict[str, int] = {}  # a named policy -> the version of its newest adapter

    # ------------------------------------------------------------------ public API

    @property
    def version(self) -> int:
        return self._version

    async def start(self) -> None:
        """Open the HTTP session and start the health watcher (done implicitly by the first call)."""
        await self._ensure_session()

    async def agenerate(self, req: GenerateRequest) -> GenerateResponse:
        """`req.gconfig.n` samples of `req.input_ids`. Never raises: failures come back as `error`."""
        err = (check_request(req, max_context_len=self.max_context_len, policies=self._policy_versions)
               or truncation_error(req.gconfig)
               or (ENGINE_CLOSED if self._closed else None)
               or (f"sglang server failed: {self._failed}" if self._failed else None))
        if err is not None:
            self._counters["requests_refused"] += 1
            return refusal(req, err)
        await self._ensure_session()
        self._counters["requests"] += 1
        if self._inflight == 0:
            self._busy_since = time.monotonic()
        self._inflight += 1
        try:
            results = await asyncio.gather(*(self._sample(req) for _ in range(req.gconfig.n)), return_exceptions=True)
        finally:
            self._inflight -= 1
            if self._inflight == 0 and self._busy_since is not None:
                self._busy_s += time.monotonic() - self._busy_since
                self._busy_since = None
        for r in results:
            if isinstance(r, asyncio.CancelledError):
                raise r
        samples = [r for r in results if isinstance(r, SampleOutput)]
        errors = [str(r) if isinstance(r, SGLangError) else f"{type(r).__name__}: {r}" for r in results
                  if not isinstance(r, SampleOutput)]
        if errors:
            self._counters["requests_failed"] += 1
            return GenerateResponse(qid=req.qid, samples=samples, error=f"sglang: {errors[0]}")
        self._counters["samples"] += len(samples)
        return GenerateResponse(qid=req.qid, samples=samples)

    async def update_weights(self, source: str, version: int, policy: Optional[str] = None) -> None:
        """Pause the server (per `pause_mode`), load `source` as `version`, resume. Raises (old weights and
        version kept) if SGLang refuses the update; generation is resumed either way. An adapter payload (with
        `adapters_keep`) is loaded as an adapter instead (`_load_adapter`); so is a named LoRA `policy`'s."""
        await self._ensure_session()
        if policy is not None:
            if not self.adapters_keep:
                raise ValueError(f"{self.name}: policy {policy!r}: this server serves no LoRA policies (it runs "
                                 "without --enable-lora: adapters_keep=0)")
            if not POLICY_NAME.fullmatch(policy):
                raise ValueError(f"{self.name}: policy name {policy!r}: letters, digits, '_', '.', '-' only")
            if not await asyncio.to_thread(_is_adapter_file, str(source)):
                raise ValueError(f"{self.name}: policy {policy!r}: a LoRA policy is served from an adapter "
                                 f"payload; {source} holds full weights")
            await self._load_adapter(str(source), int(version), policy)
            return
        if self.adapters_keep and await asyncio.to_thread(_is_adapter_file, str(source)):
            await self._load_adapter(str(source), int(version))
            return
        async with self._update_lock:
            path = await asyncio.to_thread(self._weights_path, str(source), int(version))

            async def load() -> int:
                body = {"model_path": path, "weight_version": str(int(version)),
                        "flush_cache": self.pause_mode != "in_place"}
                data = await self._post("/update_weights_from_disk", body, self.control_timeout, accept=(200, 400))
                if not isinstance(data, dict) or not data.get("success"):
                    msg = data.get("message") if isinstance(data, dict) else data
                    raise SGLangError(f"update_weights_from_disk({path}) failed: {msg}")
                return int(version)

            await self._paused_update(load, path)
            while len(self._built_dirs) > 2:  # keep the last two
                shutil.rmtree(self._built_dirs.pop(0), ignore_errors=True)

    async def _load_adapter(self, source: str, version: int, policy: Optional[str] = None) -> None:
        """`source` (an adapter payload file) as the adapter ``arl-v{version}`` (``arl-{policy}-v{version}``): a
        peft folder per version, then ``/load_lora_adapter``; no pause (requests in flight keep the adapter they
        were admitted with). New requests (of that policy) get it from now on; its adapters too old for any
        admissible token are unloaded (`_unload_old`)."""
        async with self._update_lock:
            t0 = time.perf_counter()
            path = await asyncio.to_thread(self._adapter_dir, source, version, policy)
            name = adapter_name(version, policy)
            data = await self._post("/load_lora_adapter", {"lora_name": name, "lora_path": path},
                                    self.control_timeout, accept=(200, 400))
            if not isinstance(data, dict) or not data.get("success"):
                shutil.rmtree(path, ignore_errors=True)
                msg = data.get("error_message") if isinstance(data, dict) else data
                raise SGLangError(f"load_lora_adapter({name}, {path}) failed: {msg}")
            self._adapters[(policy, version)] = path
            if policy is None:
                self._adapter_version = self._version = version
            else:
                self._policy_versions[policy] = version
            self._last_update_s = time.perf_counter() - t0
            self._counters["weight_updates"] += 1
            logger.info("%s: loaded adapter %s from %s in %.3fs", self.name, name, source, self._last_update_s)
            await self._unload_old(policy)

    async def _unload_old(self, policy: Optional[str] = None) -> None:
        """Unload `policy`'s adapters of versions below ``newest - (adapters_keep - 1)`` that no request in flight
        uses (one still in use goes at a later update, once its requests are done): at most `adapters_keep`
        adapters of each policy stay loaded, plus those that requests still run on."""
        if policy is None:
            newest = self._adapter_version if self._adapter_version is not None else self._version
        else:
            newest = self._policy_versions[policy]
        for key in sorted(k for k in self._adapters if k[0] == policy):
            v = key[1]
            if v >= newest - (self.adapters_keep - 1) or self._adapter_users[key] > 0:
                continue
            name = adapter_name(v, policy)
            data = await self._post("/unload_lora_adapter", {"lora_name": name}, self.control_timeout,
                                    accept=(200, 400))
            if isinstance(data, dict) and data.get("success"):
                shutil.rmtree(self._adapters.pop(key), ignore_errors=True)
                self._counters["adapters_unloaded"] = self._counters.get("adapters_unloaded", 0) + 1
            else:
                logger.warning("%s: unload_lora_adapter(%s) failed: %s", self.name, name, data)

    def _adapter_dir(self, source: str, version: int, policy: Optional[str] = None) -> str:
        """A peft folder of the adapter payload file `source`, ``<weights_dir>/lora/v{version}`` (a named policy's:
        ``lora/<policy>/v{version}``)."""
        from safetensors.torch import load_file

        from arl.weights.adapter import write_peft_folder

        root = Path(self.weights_dir) if self.weights_dir else Path(source).resolve().parent / "sglang-weights"
        d = root / "lora" / (policy or "") / f"v{version}"
        if d.exists():
            shutil.rmtree(d)
        return write_peft_folder(load_file(source), str(d), base_model=self.model_path)

    @property
    def adapters_loaded(self) -> list[int]:
        """Versions whose adapter (of the run's own policy) the server holds now."""
        return sorted(v for p, v in self._adapters if p is None)

    def policy_adapters_loaded(self, policy: str) -> list[int]:
        """Versions whose adapter of the named LoRA `policy` the server holds now."""
        return sorted(v for p, v in self._adapters if p == policy)

    async def update_weights_from_distributed(self, client: Any, wait_s: Optional[float] = None) -> int:
        """Load the next transfer of the learner's weight broadcast (the `broadcast` weight transport) through
        `client`, an `arl.weights.sglang.SGLangWeightClient` whose group this server joined: wait for the learner
        to announce it (generation goes on), then pause (per `pause_mode`), have the server receive it, resume.
        Returns the version loaded (the newest the learner held, which may be newer than the one asked for)."""
        await self._ensure_session()
        async with self._update_lock:
            version, plan = await asyncio.to_thread(client.next_transfer, wait_s)

            async def load() -> int:
                try:
                    return int(await asyncio.to_thread(client.load, version, plan))
                except Exception as e:  # noqa: BLE001 - the same error type as a refused disk update
                    raise SGLangError(f"update_weights_from_distributed (v{version}) failed: {e}") from e

            return await self._paused_update(load, f"broadcast group {client.spec.group_name}")

    async def _paused_update(self, load: Callable[[], Awaitable[int]], what: str) -> int:
        """Pause, `load()` (returns the version now served), resume (always); the caller holds the update lock."""
        t0 = time.perf_counter()
        self._updating = True
        try:
            if self.pause_mode == "abort":
                self._abort_epoch += 1
            await self.pause()
            try:
                self._version = await load()
            finally:
                await self.resume()
        finally:
            self._updating = False
        self._last_update_s = time.perf_counter() - t0
        self._counters["weight_updates"] += 1
        logger.info("%s: loaded %s as version %d in %.3fs (pause mode %s)", self.name, what, self._version,
                    self._last_update_s, self.pause_mode)
        return self._version

    async def pause(self) -> None:
        await self._ensure_session()
        await self._post("/pause_generation", {"mode": self.pause_mode}, self.control_timeout)

    async def resume(self) -> None:
        await self._ensure_session()
        await self._post("/continue_generation", {"torch_empty_cache": self.empty_device_cache},
                         self.control_timeout)

    async def wait_failed(self) -> str:
        """Returns (with the reason) once the server is gone for good; the worker then exits and is failed over."""
        await self._ensure_session()
        await self._failed_event.wait()
        return self._failed or "unknown"

    async def close(self) -> None:
        """Stop the health watcher, close the HTTP session, stop the owned server. Idempotent."""
        self._closed = True
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
            self._health_task = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)

    def stats(self) -> dict[str, Any]:
        busy = self._busy_s + (time.monotonic() - self._busy_since if self._busy_since is not None else 0.0)
        return {"name": self.name, "backend": "sglang", "version": self._version, **self._counters,
                "running_requests": self._inflight, "busy_s": busy, "last_update_s": self._last_update_s,
                "pause_mode": self.pause_mode, "failed": self._failed, "closed": self._closed}

    # ------------------------------------------------------------------ requests

    @staticmethod
    def sampling_params(g: GenerationConfig, done: int = 0, max_new: int = 0) -> dict[str, Any]:
        """SGLang `sampling_params` for the rest of a sample that already has `done` tokens (of `max_new`)."""
        p: dict[str, Any] = {"max_new_tokens": (max_new or g.max_new_tokens) - done,
                             "min_new_tokens": max(0, g.min_new_tokens - done)}
        if g.greedy:
            p["temperature"] = 0.0  # SGLang: temperature < 1e-6 means top_k = 1 (greedy)
        else:
            p.update(temperature=float(g.temperature), top_p=float(g.top_p), top_k=g.top_k if g.top_k > 0 else -1)
        if g.stop_token_ids:
            p["stop_token_ids"] = [int(t) for t in g.stop_token_ids]
        return p

    async def _sample(self, req: GenerateRequest) -> SampleOutput:
        prompt = [int(t) for t in req.input_ids]
        g = req.gconfig
        ids: list[int] = []
        logps: list[float] = []
        versions: list[int] = []
        max_new = g.max_new_tokens  # like the embedded engine: prompt + output stop at max_context_len ("length")
        if self.max_context_len:
            max_new = min(max_new, self.max_context_len - len(prompt))
        # LoRA: the adapter (policy, version) this sample was admitted at, throughout
        if req.policy is not None:
            adapter: Optional[_Adapter] = (req.policy, self._policy_versions[req.policy])
        else:
            adapter = (None, self._adapter_version) if self._adapter_version is not None else None
        if adapter is not None:
            self._adapter_users[adapter] += 1  # not unloaded while this sample runs on it
        try:
            return await self._sample_on(req, prompt, ids, logps, versions, max_new, adapter)
        finally:
            if adapter is not None:
                self._adapter_users[adapter] -= 1
                if not self._adapter_users[adapter]:  # one key per version served: none kept once unused
                    del self._adapter_users[adapter]

    async def _sample_on(self, req: GenerateRequest, prompt: list[int], ids: list[int], logps: list[float],
                         versions: list[int], max_new: int, adapter: Optional[_Adapter]) -> SampleOutput:
        g = req.gconfig
        while True:
            epoch = self._abort_epoch
            body = {"rid": f"{self.name}-{uuid.uuid4().hex}", "input_ids": prompt + ids,
                    "sampling_params": self.sampling_params(g, len(ids), max_new), "return_logprob": True}
            if adapter is not None:
                body["lora_path"] = adapter_name(adapter[1], adapter[0])
            submitted_version = self._version if adapter is None else adapter[1]
            data = await self._post("/generate", body, self.request_timeout)
            out_ids, out_lp, out_v, finish = self._parse_generate(data, submitted_version)
            if adapter is not None:  # the server's weight version is the base's: every token is the adapter's
                out_v = [adapter[1]] * len(out_ids)
            ids += out_ids
            logps += out_lp
            versions += out_v
            self._counters["tokens_generated"] += len(out_ids)
            if finish == "abort" and len(ids) < max_new and (epoch != self._abort_epoch or self._updating):
                self._counters["resubmits"] += 1  # aborted for a weight update: go on from the prefix
                continue
            return SampleOutput(output_ids=np.asarray(ids, np.int32), output_logprobs=np.asarray(logps, np.float32),
                                output_versions=np.asarray(versions, np.int32), finish_reason=finish)

    def _parse_generate(self, data: Any, submitted_version: int) -> tuple[list[int], list[float], list[int], str]:
        """output ids, logprobs, per-token versions and finish reason of one /generate answer."""
        if isinstance(data, list) and len(data) == 1:
            data = data[0]
        if not isinstance(data, dict) or not isinstance(data.get("meta_info"), dict):
            raise SGLangError(f"malformed /generate answer: {str(data)[:200]}")
        meta = data["meta_info"]
        ids = [int(t) for t in data.get("output_ids") or []]
        lp_rows = meta.get("output_token_logprobs") or []
        if len(lp_rows) != len(ids):
            raise SGLangError(f"/generate answer has {len(ids)} output_ids but {len(lp_rows)} logprobs")
        logps = [float(row[0]) for row in lp_rows]
        if any(int(row[1]) != t for row, t in zip(lp_rows, ids)):
            raise SGLangError("/generate answer's logprob token ids differ from its output_ids")
        fr = meta.get("finish_reason")
        kind = fr.get("type") if isinstance(fr, dict) else fr
        finish = kind if kind in ("stop", "length", "abort") else ("length" if kind is None else "abort")
        versions = self._token_versions(meta, len(ids), submitted_version)
        return ids, logps, versions, finish

    def _token_versions(self, meta: dict, n: int, submitted_version: int) -> list[int]:
        """Per-token policy versions from the answer's version spans. Without spans the answer's single
        `weight_version` is the server's version at the end, which a mid-request update makes newer than the
        early tokens: those tokens are stamped with the version the request was submitted under instead (erring
        toward staler, so the learner's eta bound still holds)."""
        spans = meta.get("weight_versions")
        if isinstance(spans, list) and spans:
            out = [submitted_version] * n
            for s in spans:
                v = _version_of(s.get("version"), self._initial_version)
                for k in range(max(0, int(s.get("start", 0))), min(n, int(s.get("end", n)))):
                    out[k] = v
            return out
        tag = meta.get("weight_version")
        v = submitted_version if tag is None else min(_version_of(tag, self._initial_version), submitted_version)
        return [v] * n

    # ------------------------------------------------------------------ weights

    def _weights_path(self, source: str, version: int) -> str:
        """A directory SGLang can load for `source`: itself if it is one, else a per-version dir around the file."""
        src = Path(source)
        if src.is_dir():
            return str(src.resolve())
        if not src.is_file():
            raise FileNotFoundError(f"weights source {source} does not exist")
        root = Path(self.weights_dir) if self.weights_dir else src.resolve().parent / "sglang-weights"
        d = root / f"v{version}"
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        target = d / "model.safetensors"
        try:
            os.link(src.resolve(), target)  # a hard link survives the learner pruning its file
        except OSError:
            target.symlink_to(src.resolve())
        if self.model_path:
            for name in _MODEL_SIDE_FILES:
                f = Path(self.model_path) / name
                if f.is_file():
                    (d / name).symlink_to(f.resolve())
        self._built_dirs.append(str(d))
        return str(d)

    # ------------------------------------------------------------------ HTTP

    async def _ensure_session(self) -> None:
        """Open the HTTP session on the running event loop, the one the engine is driven from from now on."""
        if self._session is not None:
            return
        import aiohttp

        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024))
        if self.health_interval > 0:
            self._health_task = asyncio.create_task(self._watch_health())

    async def _post(self, path: str, body: dict, timeout: float, accept: tuple[int, ...] = (200,)) -> Any:
        import aiohttp

        try:
            async with self._session.post(self.base_url + path, json=body,
                                          timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                text = await r.text()
                if r.status not in accept:
                    raise SGLangError(f"POST {path} -> HTTP {r.status}: {text[:300]}")
                try:
                    return json.loads(text) if text else {}
                except json.JSONDecodeError:
                    return {"text": text}
        except asyncio.TimeoutError:
            raise SGLangError(f"POST {path}: no answer from {self.base_url} in {timeout:.0f}s") from None
        except aiohttp.ClientError as e:
            raise SGLangError(f"POST {path}: {type(e).__name__}: {e}") from None

    async def _health_ok(self) -> bool:
        import aiohttp

        try:
            async with self._session.get(self.base_url + "/health",
                                         timeout=aiohttp.ClientTimeout(total=max(5.0, self.health_interval))) as r:
                return r.status == 200
        except (asyncio.TimeoutError, aiohttp.ClientError):
            return False

    async def _watch_health(self) -> None:
        failures = 0
        while not self._closed:
            await asyncio.sleep(self.health_interval)
            if self.server is not None and self.server.exit_code() is not None:
                self._fail(f"sglang server exited with code {self.server.exit_code()}")
                return
            if self._updating:  # a paused server does not answer /health
                continue
            if await self._health_ok():
                failures = 0
                continue
            failures += 1
            self._counters["health_failures"] += 1
            logger.warning("%s: /health failed (%d in a row)", self.name, failures)
            if failures >= self.max_health_failures:
                self._fail(f"/health failed {failures} times in a row")
                return

    def _fail(self, reason: str) -> None:
        if self._failed is None:
            logger.error("%s: %s", self.name, reason)
            self._failed = reason
        self._failed_event.set()


def adapter_name(version: int, policy: Optional[str] = None) -> str:
    """The SGLang adapter name of version `version` of the run's policy (`arl-v3`) or of a named one
    (`arl-solver-v3`)."""
    from arl.weights.adapter import ADAPTER_NAME_PREFIX

    if policy is None:
        return f"{ADAPTER_NAME_PREFIX}{int(version)}"
    return f"{ADAPTER_NAME_PREFIX[:-1]}{policy}-v{int(version)}"


def _is_adapter_file(source: str) -> bool:
    """Whether `source` is an adapter payload file (`arl.weights.adapter`), by its tensor names."""
    if not os.path.isfile(source):
        return False
    from safetensors import safe_open

    from arl.weights.adapter import is_adapter

    with safe_open(source, framework="pt") as f:
        return is_adapter(f.keys())


def lora_server_args(rank: int, target_modules: Sequence[str], keep: int, extra: int = 0) -> list[str]:
    """The launch_server flags that let a server load `keep` adapters of rank `rank` on `target_modules` (plus
    headroom for adapters requests still run on), and `extra` more: named policies served beside the run's own."""
    n = str(keep + 2 + int(extra))
    return ["--enable-lora", "--max-lora-rank", str(int(rank)), "--lora-target-modules", *target_modules,
            "--max-loaded-loras", n, "--max-loras-per-batch", n]


def launch_sglang_engine(config: SGLangConfig, *, model_path: str, device: str, seed: int, name: str, index: int = 0,
                         run_dir: str = "", max_batch_size: int = 0, max_context_len: int = 0,
                         health_interval: float = 5.0, host: str = "127.0.0.1", lora_rank: int = 0,
                         lora_targets: Sequence[str] = (), adapters_keep: int = 0,
                         extra_adapters: int = 0) -> SGLangEngine:
    """Start this worker's SGLang server (blocking until /health answers) and return an engine driving it.

    GPU servers get CUDA_VISIBLE_DEVICES = the `config.gpus_per_server` GPUs of this worker's group (first_gpu +
    index * g ..., counted within CUDA_VISIBLE_DEVICES when it is set); pass `--tp-size g` in `config.args` to
    shard one server over them.
    """
    port = free_port(host)
    extra = list(config.args) + (lora_server_args(lora_rank, lora_targets, adapters_keep, extra_adapters)
                                 if lora_rank else [])
    cmd = server_command(model_path=model_path, host=host, port=port, device=device, seed=seed,
                         python=config.python, max_running_requests=max_batch_size, extra_args=extra)
    env: dict[str, str] = {}
    if device == "cpu":
        env.update(SGLANG_USE_CPU_ENGINE="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    elif config.gpus_per_server > 0:
        env["CUDA_VISIBLE_DEVICES"] = server_gpus(index, config.gpus_per_server, config.first_gpu,
                                                  os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    log_dir = os.path.join(run_dir, "logs") if run_dir else os.path.join(os.getcwd(), "sglang-logs")
    server = SGLangServer(cmd, base_url=f"http://{host}:{port}", log_path=os.path.join(log_dir, f"{name}-sglang.log"),
                          env=env)
    try:
        server.wait_ready(config.startup_timeout)
    except BaseException:
        server.stop()
        raise
    weights_dir = os.path.join(run_dir, "sglang-weights", name) if run_dir else ""
    return SGLangEngine(server.base_url, model_path=model_path, version=0, name=name, server=server,
                        pause_mode=config.pause_mode, weights_dir=weights_dir, max_context_len=max_context_len,
                        request_timeout=config.request_timeout, health_interval=health_interval,
                        empty_device_cache=device.startswith("cuda"), adapters_keep=adapters_keep if lora_rank else 0)
