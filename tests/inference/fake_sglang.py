"""A fake SGLang server for the default test suite: the HTTP schema of SGLang 0.5.23, a toy model behind it.

The endpoints, field names and answers follow SGLang's `srt/entrypoints/http_server.py` and
`srt/managers/io_struct.py` (GenerateReqInput, SamplingParams, PauseGenerationReqInput, ContinueGenerationReqInput,
UpdateWeightFromDiskReqInput, AbortReq) and what the real server returned on this machine:

    POST /generate {"rid"?, "input_ids": [int], "sampling_params": {...}, "return_logprob": bool, ...}
      -> {"text", "output_ids": [int], "meta_info": {"id", "finish_reason": {"type": "stop", "matched": id} |
          {"type": "length", "length": n} | {"type": "abort", "message"}, "prompt_tokens", "weight_version",
          "output_token_logprobs": [[logprob, id, null]], "completion_tokens", "cached_tokens",
          "weight_versions": [{"version", "start", "end"}], ...}}         (a list of n such dicts when n > 1)
    POST /pause_generation {"mode": "abort" | "retract" | "in_place"}   -> {"message", "status": "ok"}
    POST /continue_generation {"torch_empty_cache": bool}               -> {"message", "status": "ok"}
    POST /update_weights_from_disk {"model_path", "weight_version"?, "flush_cache"?, "abort_all_requests"?, ...}
      -> {"success", "message", "num_paused_requests"} (HTTP 400 when not successful)
    POST /abort_request {"rid", "abort_all"}, GET /health, GET /model_info, POST /flush_cache

and the distributed weight update (InitWeightsUpdateGroupReqInput, BeginWeightUpdateReqInput,
UpdateWeightsFromDistributedReqInput, EndWeightUpdateReqInput, DestroyWeightsUpdateGroupReqInput), each answering
{"success", "message"} (HTTP 400 when not successful):

    POST /init_weights_update_group {"master_address", "master_port", "rank_offset", "world_size", "group_name"?,
      "backend"?}      joins the trainer's group the way SGLang does (init_custom_process_group over tcp://)
    POST /begin_weight_update {"selector"?}  /  POST /end_weight_update {}      the session an update must sit in
    POST /update_weights_from_distributed {"names", "dtypes", "shapes", "group_name"?, "flush_cache"?,
      "weight_version"?, "load_format"?: null | "flattened_bucket", ...}   receives the broadcast, loads it
    POST /destroy_weights_update_group {"group_name"?}

and LoRA adapters (LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput -> LoRAUpdateOutput; the server runs with
--enable-lora --max-lora-rank R --lora-target-modules ... --max-loaded-loras K):

    POST /load_lora_adapter {"lora_name", "lora_path", "pinned"?, "lora_id"?}
      -> {"success", "error_message", "loaded_adapters": {name: path}} (HTTP 400 when not successful: a name
         loaded already, a folder without adapter_config.json, more than max_loaded_loras)
    POST /unload_lora_adapter {"lora_name", "lora_id"?}  -> the same
    /generate {"lora_path": name}: generates with that adapter (HTTP 400 when it is not loaded)

Unknown request fields are refused (HTTP 400), so a misspelt field in the client fails a test. Semantics copied:
a paused server holds new requests until continue; `in_place` keeps requests in the batch (a flush is refused while
any runs, which fails the update call), `retract` and `abort` empty it; an update while not paused waits until no
request runs (SGLang's writer lock).

The toy model: greedy next token = (3 * last + shift) % vocab, logprob -0.05 * shift; `shift` = 1 + (sum of every
tensor in the weights directory's *.safetensors, or of the tensors a distributed update received, rounded) % 7.
The tensors of the last distributed update are kept in `received` (name -> tensor), for tests to compare. Sampling (temperature > 0) adds 0 or 1 at random.
Run standalone: `python -m tests.inference.fake_sglang --model-path DIR --port P` (used to test supervision).
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import random
import uuid
from typing import Any, Optional

import numpy as np
from aiohttp import web

GENERATE_KEYS = {"rid", "session_id", "text", "input_ids", "input_embeds", "sampling_params", "return_logprob",
                 "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs", "stream",
                 "log_metrics", "return_hidden_states", "lora_path", "custom_logit_processor", "priority",
                 "extra_key", "routed_dp_rank", "bootstrap_host", "bootstrap_port", "bootstrap_room"}
SAMPLING_KEYS = {"max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
                 "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
                 "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
                 "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed",
                 "custom_params"}
UPDATE_KEYS = {"rid", "model_path", "load_format", "abort_all_requests", "weight_version", "is_async",
               "torch_empty_cache", "keep_pause", "recapture_cuda_graph", "token_step", "flush_cache", "manifest"}
PAUSE_KEYS = {"rid", "mode"}
CONTINUE_KEYS = {"rid", "torch_empty_cache"}
ABORT_KEYS = {"rid", "abort_all", "finished_reason", "abort_message", "weight_versions"}
INIT_GROUP_KEYS = {"rid", "http_worker_ipc", "master_address", "master_port", "rank_offset", "world_size",
                   "group_name", "backend"}
DESTROY_GROUP_KEYS = {"rid", "http_worker_ipc", "group_name"}
BEGIN_KEYS = {"rid", "http_worker_ipc", "selector"}
END_KEYS = {"rid", "http_worker_ipc"}
LOAD_LORA_KEYS = {"rid", "http_worker_ipc", "lora_name", "lora_path", "pinned", "lora_id"}
UNLOAD_LORA_KEYS = {"rid", "http_worker_ipc", "lora_name", "lora_id"}
DIST_UPDATE_KEYS = {"rid", "http_worker_ipc", "names", "dtypes", "shapes", "group_name", "flush_cache",
                    "abort_all_requests", "weight_version", "load_format", "selector", "torch_empty_cache"}


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout_s: float = 60.0) -> Any:
    """SGLang 0.5.23's `sglang.srt.utils.init_custom_process_group`, as the server calls it (tcp:// rendezvous,
    the store under a PrefixStore(group_name), torch's _new_process_group_helper): the fake meets a trainer exactly
    where the real server would."""
    from datetime import timedelta

    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper, _world,
                                                    rendezvous)

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      backend_options=None, timeout=timeout, device_id=None)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def shift_of(model_path: str) -> int:
    """The toy model's parameter, from the weights directory (raises if it holds no safetensors)."""
    from safetensors.numpy import load_file

    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_path}")
    total = 0.0
    for f in files:
        for v in load_file(f).values():
            total += float(np.asarray(v, dtype=np.float64).sum())
    return 1 + int(round(abs(total))) % 7


def toy_next(last: int, shift: int, vocab: int) -> int:
    return (3 * last + shift) % vocab


def toy_greedy(prompt: list[int], n: int, shift: int, vocab: int) -> list[int]:
    out, last = [], prompt[-1]
    for _ in range(n):
        last = toy_next(last, shift, vocab)
        out.append(last)
    return out


class _Req:
    def __init__(self, rid: str, prompt: list[int], params: dict[str, Any]) -> None:
        self.rid = rid
        self.prompt = prompt
        self.params = params
        self.ids: list[int] = []
        self.logps: list[float] = []
        self.versions: list[str] = []
        self.aborted = False
        self.retractions = 0


class FakeSGLang:
    def __init__(self, model_path: str, *, vocab: int = 64, step_s: float = 0.002, seed: int = 0) -> None:
        self.model_path = model_path
        self.vocab = vocab
        self.step_s = step_s
        self.shift = shift_of(model_path)
        self.weight_version = "default"
        self.paused = False
        self.pause_mode: Optional[str] = None
        self.healthy = True
        self.health_calls = 0  # GET /health answered (tests wait on it instead of sleeping)
        self.running: dict[str, _Req] = {}
        self.log: list[tuple[str, dict]] = []  # (path, body) of every POST, in order
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._rng = random.Random(seed)
        self._runner: Optional[web.AppRunner] = None
        self.base_url = ""
        self.groups: dict[str, Any] = {}  # group name -> torch process group (init_weights_update_group)
        self.session = False  # between begin_weight_update and end_weight_update
        self.received: dict[str, Any] = {}  # name -> torch tensor loaded in the last begin/end session
        self.group_timeout_s = 60.0
        self.adapters: dict[str, str] = {}  # LoRA adapter name -> folder (/load_lora_adapter)
        self.adapter_shift: dict[str, int] = {}  # the toy model's parameter under each adapter
        self.adapter_users: dict[str, int] = {}  # name -> requests running on it
        self.unloaded_in_use: list[str] = []  # adapters unloaded while a request ran on them (a client bug)
        self.max_loaded_loras = 8

    # ------------------------------------------------------------------ lifecycle
    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health)
        app.router.add_get("/model_info", self.model_info)
        app.router.add_route("*", "/generate", self.generate)
        app.router.add_post("/pause_generation", self.pause_generation)
        app.router.add_post("/continue_generation", self.continue_generation)
        app.router.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        app.router.add_post("/abort_request", self.abort_request)
        app.router.add_route("*", "/flush_cache", self.flush_cache)
        app.router.add_post("/init_weights_update_group", self.init_weights_update_group)
        app.router.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        app.router.add_post("/begin_weight_update", self.begin_weight_update)
        app.router.add_post("/end_weight_update", self.end_weight_update)
        app.router.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        app.router.add_post("/load_lora_adapter", self.load_lora_adapter)
        app.router.add_post("/unload_lora_adapter", self.unload_lora_adapter)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._runner = web.AppRunner(self.app())
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.base_url = f"http://{host}:{port}"
        return self.base_url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        for name in list(self.groups):
            self._destroy_group(name)

    def posts(self, path: str) -> list[dict]:
        return [b for p, b in self.log if p == path]

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _bad(msg: str, status: int = 400) -> web.Response:
        return web.json_response({"error": {"message": msg, "type": "invalid_request_error", "code": status}},
                                 status=status)

    async def _body(self, request: web.Request, allowed: set[str], path: str) -> tuple[Optional[dict], Any]:
        try:
            body = await request.json() if request.can_read_body else {}
        except ValueError:
            return None, self._bad("body is not JSON")
        if not isinstance(body, dict):
            return None, self._bad("body must be a JSON object")
        unknown = set(body) - allowed
        if unknown:
            return None, self._bad(f"unknown fields {sorted(unknown)}", 422)
        self.log.append((path, body))
        return body, None

    def _set_version(self, version: str) -> None:
        self.weight_version = version

    # ------------------------------------------------------------------ endpoints
    async def health(self, request: web.Request) -> web.Response:
        self.health_calls += 1
        return web.Response(status=200 if self.healthy and not self.paused else 503)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_path, "weight_version": self.weight_version,
                                  "is_generation": True})

    async def flush_cache(self, request: web.Request) -> web.Response:
        ok = not self.running
        return web.Response(text="Cache flushed." if ok else "Cache not flushed.", status=200 if ok else 400)

    async def generate(self, request: web.Request) -> web.Response:
        body, err = await self._body(request, GENERATE_KEYS, "/generate")
        if err is not None:
            return err
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            return self._bad("input_ids must be a non-empty list of ints")
        if any(not 0 <= t < self.vocab for t in ids):
            return self._bad(f"The input_ids {ids} contains values greater than the vocab size ({self.vocab}).")
        params = body.get("sampling_params") or {}
        unknown = set(params) - SAMPLING_KEYS
        if unknown:
            return self._bad(f"unknown sampling params {sorted(unknown)}", 422)
        lora = body.get("lora_path")
        if lora is not None and lora not in self.adapters:
            return self._bad(f"The following requested LoRA adapters are not loaded: {{{lora!r}}}")
        n = int(params.get("n", 1))
        rid = body.get("rid") or uuid.uuid4().hex
        outs = await asyncio.gather(*(self._run(f"{rid}-{k}" if n > 1 else rid, ids, params,
                                                bool(body.get("return_logprob")), lora) for k in range(n)))
        return web.json_response(outs if n > 1 else outs[0])

    async def _run(self, rid: str, prompt: list[int], p: dict, return_logprob: bool,
                   lora: Optional[str] = None) -> dict:
        if lora is not None:
            self.adapter_users[lora] = self.adapter_users.get(lora, 0) + 1
        try:
            return await self._run_on(rid, prompt, p, return_logprob, lora)
        finally:
            if lora is not None:
                self.adapter_users[lora] -= 1

    async def _run_on(self, rid: str, prompt: list[int], p: dict, return_logprob: bool, lora: Optional[str]) -> dict:
        await self._unpaused.wait()  # a paused server holds new requests (TokenizerManager.is_pause_cond)
        req = _Req(rid, prompt, p)
        self.running[rid] = req
        self._idle.clear()
        max_new = int(p.get("max_new_tokens", 128))
        min_new = int(p.get("min_new_tokens", 0))
        stops = set(p.get("stop_token_ids") or [])
        greedy = float(p.get("temperature", 1.0)) < 1e-6 or int(p.get("top_k", -1)) == 1
        finish: dict[str, Any] = {"type": "length", "length": max_new}
        try:
            while len(req.ids) < max_new:
                while self.paused and self.pause_mode in ("in_place", "retract") and not req.aborted:
                    await self._unpaused.wait()
                if req.aborted:
                    finish = {"type": "abort", "message": "Abort before prefill" if not req.ids else "Aborted"}
                    break
                await asyncio.sleep(self.step_s)
                if req.aborted:
                    finish = {"type": "abort", "message": "Aborted"}
                    break
                if self.paused and self.pause_mode in ("in_place", "retract"):
                    continue  # paused during the step: the token is made after continue_generation
                last = req.ids[-1] if req.ids else prompt[-1]
                shift = self.adapter_shift.get(lora, self.shift) if lora is not None else self.shift
                tok = toy_next(last, shift, self.vocab)
                if not greedy:
                    tok = (tok + self._rng.randint(0, 1)) % self.vocab
                req.ids.append(tok)
                req.logps.append(-0.05 * shift)
                req.versions.append(self.weight_version)
                if tok in stops and len(req.ids) >= min_new:
                    finish = {"type": "stop", "matched": tok}
                    break
        finally:
            self.running.pop(rid, None)
            if not self.running:
                self._idle.set()
        spans: list[dict[str, Any]] = []
        for k, v in enumerate(req.versions):
            if spans and spans[-1]["version"] == v:
                spans[-1]["end"] = k + 1
            else:
                spans.append({"version": v, "start": k, "end": k + 1})
        if not spans:
            spans = [{"version": self.weight_version, "start": 0, "end": 0}]
        meta: dict[str, Any] = {"id": rid, "finish_reason": finish, "prompt_tokens": len(prompt),
                                "weight_version": self.weight_version, "num_retractions": req.retractions,
                                "reasoning_tokens": 0, "completion_tokens": len(req.ids), "cached_tokens": 0,
                                "weight_versions": spans, "e2e_latency": 0.0}
        if return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.logps, req.ids)]
            meta["output_token_logprobs_length"] = len(req.ids)
        return {"text": "", "output_ids": list(req.ids), "meta_info": meta}

    def _abort_all(self) -> None:
        for r in self.running.values():
            r.aborted = True

    async def pause_generation(self, request: web.Request) -> web.Response:
        body, err = await self._body(request, PAUSE_KEYS, "/pause_generation")
        if err is not None:
            return err
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return self._bad(f"mode must be abort, retract or in_place, got {mode!r}", 422)
        self.paused, self.pause_mode = True, mode
        self._unpaused.clear()
        if mode == "abort":
            self._abort_all()
            await self._idle.wait()
        elif mode == "retract":
            for r in self.running.values():
                r.retractions += 1
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        body, err = await self._body(request, CONTINUE_KEYS, "/continue_generation")
        if err is not None:
            return err
        self.paused, self.pause_mode = False, None
        self._unpaused.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request: web.Request) -> web.Response:
        body, err = await self._body(request, ABORT_KEYS, "/abort_request")
        if err is not None:
            return err
        if body.get("abort_all"):
            self._abort_all()
        elif body.get("rid") in self.running:
            self.running[body["rid"]].aborted = True
        return web.Response(status=200)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body, err = await self._body(request, UPDATE_KEYS, "/update_weights_from_disk")
        if err is not None:
            return err
        if "model_path" not in body:
            return self._bad("model_path is required", 422)
        if body.get("abort_all_requests"):
            self._abort_all()
        if not self.paused:
            await self._idle.wait()  # SGLang takes its writer lock: waits for in-flight requests to finish
        try:
            shift = shift_of(str(body["model_path"]))
        except Exception as e:  # noqa: BLE001
            return web.json_response({"success": False, "message": f"Failed to get weights iterator: {e}.",
                                      "num_paused_requests": 0}, status=400)
        self.shift = shift
        self.model_path = str(body["model_path"])
        if body.get("weight_version") is not None:
            self._set_version(str(body["weight_version"]))
        if body.get("flush_cache", True) and self.running and self.pause_mode == "in_place":
            return web.json_response({"success": False, "num_paused_requests": 0, "message": (
                "Weights were updated, but the cache was not flushed because requests are still running or "
                "queued. Retract or finish them, then call /flush_cache.")}, status=400)
        return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": 0})

    # ------------------------------------------------------------------ distributed weight update
    @staticmethod
    def _result(success: bool, message: str) -> web.Response:
        return web.json_response({"success": success, "message": message}, status=200 if success else 400)

    def _missing(self, body: dict, *keys: str) -> Optional[web.Response]:
        absent = [k for k in keys if k not in body]
        return self._bad(f"missing required fields {absent}", 422) if absent else None

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body, err = await self._body(request, INIT_GROUP_KEYS, "/init_weights_update_group")
        if err is not None:
            return err
        err = self._missing(body, "master_address", "master_port", "rank_offset", "world_size")
        if err is not None:
            return err
        name = str(body.get("group_name", "weight_update_group"))
        if not name:
            return self._result(False, "Failed to initialize custom process group: Group name cannot be empty.")
        if name in self.groups:
            return self._result(False, "Failed to initialize custom process group: The specified group name has "
                                       "already been created, please use a different group name.")
        url = f"tcp://{body['master_address']}:{int(body['master_port'])}"
        try:
            pg = await asyncio.to_thread(init_custom_process_group, str(body.get("backend", "nccl")), url,
                                         int(body["world_size"]), int(body["rank_offset"]), name,
                                         self.group_timeout_s)
        except Exception as e:  # noqa: BLE001 - SGLang answers the error as its message
            return self._result(False, f"Failed to initialize custom process group: {e}.")
        self.groups[name] = pg
        return self._result(True, "Succeeded to initialize custom process group.")

    def _destroy_group(self, name: str) -> bool:
        import torch.distributed as dist

        pg = self.groups.pop(name, None)
        if pg is None:
            return False
        dist.destroy_process_group(pg)
        return True

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body, err = await self._body(request, DESTROY_GROUP_KEYS, "/destroy_weights_update_group")
        if err is not None:
            return err
        if self._destroy_group(str(body.get("group_name", "weight_update_group"))):
            return self._result(True, "Succeeded to destroy custom process group.")
        return self._result(False, "The group to be destroyed does not exist.")

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        body, err = await self._body(request, BEGIN_KEYS, "/begin_weight_update")
        if err is not None:
            return err
        if not self.paused:
            await self._idle.wait()  # the writer lock, as for the other weight updates
        if self.session:
            return self._result(False, "a weight-update session is already open; call end_weight_update() first")
        self.session = True
        self.received = {}
        return self._result(True, "Success")

    async def end_weight_update(self, request: web.Request) -> web.Response:
        body, err = await self._body(request, END_KEYS, "/end_weight_update")
        if err is not None:
            return err
        if not self.session:
            return self._result(False, "no weight-update session is open; call begin_weight_update() first")
        self.session = False
        return self._result(True, "Success")

    def _receive(self, names: list, dtypes: list, shapes: list, group_name: str, load_format: Optional[str]) -> list:
        """WeightUpdater.receive_weights_from_distributed: per-tensor broadcasts, or one flattened bucket."""
        import torch
        import torch.distributed as dist

        if group_name not in self.groups:
            raise AssertionError(f"Group {group_name} not in {list(self.groups)}. Please call "
                                 "`init_weights_update_group` first.")
        pg = self.groups[group_name]
        if load_format == "flattened_bucket":
            sizes, offset = [], 0
            for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
                dt = getattr(torch, dtype)
                if offset % dt.itemsize:
                    raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dt}")
                n = int(torch.Size(shape).numel()) * dt.itemsize
                sizes.append((name, dt, shape, offset, n))
                offset += n
            flat = torch.empty(offset, dtype=torch.uint8)
            dist.broadcast(flat, src=0, group=pg)
            return [(name, flat[o:o + n].view(dt).reshape(shape)) for name, dt, shape, o, n in sizes]
        out, handles = [], []
        for name, dtype, shape in zip(names, dtypes, shapes):
            w = torch.empty(shape, dtype=getattr(torch, dtype))
            handles.append(dist.broadcast(w, src=0, group=pg, async_op=True))
            out.append((name, w))
        for h in handles:
            h.wait()
        return out

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body, err = await self._body(request, DIST_UPDATE_KEYS, "/update_weights_from_distributed")
        if err is not None:
            return err
        err = self._missing(body, "names", "dtypes", "shapes")
        if err is not None:
            return err
        if body.get("abort_all_requests"):
            self._abort_all()
        if not self.paused:
            await self._idle.wait()
        if not self.session:
            return self._result(False, "update_weights_from_distributed must run between begin_weight_update() "
                                       "and end_weight_update()")
        try:
            weights = await asyncio.to_thread(self._receive, list(body["names"]), list(body["dtypes"]),
                                              list(body["shapes"]), str(body.get("group_name", "weight_update_group")),
                                              body.get("load_format"))
        except Exception as e:  # noqa: BLE001
            return self._result(False, f"Failed to receive weights: {e}")
        self.received.update((n, t.clone()) for n, t in weights)  # a session's buckets add up to the model
        total = sum(float(t.double().sum()) for t in self.received.values())
        self.shift = 1 + int(round(abs(total))) % 7
        if body.get("weight_version") is not None:
            self._set_version(str(body["weight_version"]))
        if body.get("flush_cache", True) and self.running and self.pause_mode == "in_place":
            return self._result(False, "Weights were updated, but the cache was not flushed because requests are "
                                       "still running or queued. Retract or finish them, then call /flush_cache.")
        msg = "Succeeded to update parameter online."
        if body.get("weight_version") is not None:
            msg += f" Weight version updated to {body['weight_version']}."
        return self._result(True, msg)


def _lora_result(fake: "FakeSGLang", success: bool, message: Optional[str]) -> web.Response:
    return web.json_response({"success": success, "error_message": message, "loaded_adapters": dict(fake.adapters)},
                             status=200 if success else 400)


async def _load_lora_adapter(self: "FakeSGLang", request: web.Request) -> web.Response:
    body, err = await self._body(request, LOAD_LORA_KEYS, "/load_lora_adapter")
    if err is not None:
        return err
    missing = self._missing(body, "lora_name", "lora_path")
    if missing is not None:
        return missing
    name, path = str(body["lora_name"]), str(body["lora_path"])
    if name in self.adapters:
        return _lora_result(self, False, f"The LoRA adapter {name} already exists.")
    if len(self.adapters) >= self.max_loaded_loras:
        return _lora_result(self, False, f"Cannot load LoRA adapter {name}: the maximum number of loaded adapters "
                                         f"({self.max_loaded_loras}) is reached.")
    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        return _lora_result(self, False, f"Failed to load LoRA adapter {name}: no adapter_config.json in {path}")
    self.adapters[name] = path
    self.adapter_shift[name] = shift_of(path)
    return _lora_result(self, True, None)


async def _unload_lora_adapter(self: "FakeSGLang", request: web.Request) -> web.Response:
    body, err = await self._body(request, UNLOAD_LORA_KEYS, "/unload_lora_adapter")
    if err is not None:
        return err
    missing = self._missing(body, "lora_name")
    if missing is not None:
        return missing
    name = str(body["lora_name"])
    if name not in self.adapters:
        return _lora_result(self, False, f"LoRA adapter {name} is not loaded.")
    if self.adapter_users.get(name, 0) > 0:
        self.unloaded_in_use.append(name)
    del self.adapters[name]
    return _lora_result(self, True, None)


FakeSGLang.load_lora_adapter = _load_lora_adapter  # type: ignore[attr-defined]
FakeSGLang.unload_lora_adapter = _unload_lora_adapter  # type: ignore[attr-defined]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--step-s", type=float, default=0.002)
    args, _ = ap.parse_known_args()
    vocab = 64
    try:  # the model's own vocabulary, so a run's token ids are in range (e2e runs with the tiny model)
        with open(os.path.join(args.model_path, "config.json")) as f:
            vocab = int(json.load(f)["vocab_size"])
    except (OSError, ValueError, KeyError):
        pass
    fake = FakeSGLang(args.model_path, vocab=vocab, step_s=args.step_s)
    web.run_app(fake.app(), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
