"""The OpenAI-compatible endpoint of a rollout worker: `POST /v1/chat/completions`, `POST /v1/completions`,
`POST /v1/responses` (OpenAI's Responses API), `POST /v1/messages` (Anthropic's Messages API) and `GET /v1/models`,
so that agents written against the OpenAI or Anthropic SDKs (or a framework on top of them) run unmodified.

Why aiohttp: it is already a dependency of the project (the SGLang backend's HTTP client), it serves from the
rollout worker's own event loop (no second loop, no thread, no ASGI stack between the request and the inference
client). FastAPI/uvicorn would add a server loop of its own and two packages to the default install for nothing
this endpoint needs. Every request goes through `dispatch(method, path, headers, body)`, which knows no HTTP
library: the aiohttp server is one caller of it.

A request names its session in the URL path (`/sessions/<key>/v1/...`) or by its API key alone, which must be that
session's own bearer token (random, minted when the session opens, dead when it ends): a token opens one session's
URLs and nothing else, and the run's secret (which signs every ZMQ frame) never reaches the endpoint, an agent or
an HTTP header. Each request becomes one `GenerateRequest` sent through
the session's `generate` (the group's obs queue: the inference client with its least-load routing, sticky
sessions, deadlines, aborts; the group was admitted by the staleness gate before any session existed), and the
token bookkeeping is `arl.rollout.sessions.Session`'s (token-exact concat mode): the Responses and Messages
dialects are translated into chat messages first (`arl.rollout.dialects`), so all of them continue by the same
code. `stream=true` is answered as server-sent events after the whole answer was generated (the engine answers a
request at once).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import hmac
import itertools
import json
import logging
import re
import secrets
import time
import weakref
from typing import Any, Awaitable, Callable, Mapping, Optional, Sequence

import numpy as np
from aiohttp import web

from arl.api.types import GenerateRequest, GenerateResponse, GenerationConfig, SampleOutput
from arl.rollout.dialects import anthropic, responses
from arl.rollout.dialects.common import Answer, ChatCall, RequestError, new_id, sse
from arl.rollout.inprocess import in_process_http_client
from arl.rollout.episodes import EpisodeBoard, reward_payload
from arl.rollout.session_slots import SessionSlots
from arl.rollout.sessions import Choice, Session, SessionEnded, message_key
from arl.tools.parsers import get_parser

logger = logging.getLogger("arl.rollout.endpoint")

__all__ = ["EndpointServer", "SessionHandle", "RequestError", "Reply"]

Generate = Callable[[GenerateRequest], Awaitable[GenerateResponse]]

# accepted and ignored: they do not change what is generated
_IGNORED = ("model", "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")
_CHAT_FIELDS = {"messages", "tools", "tool_choice", "parallel_tool_calls", "temperature", "top_p", "max_tokens",
                "max_completion_tokens", "stop", "n", "seed", "logprobs", "top_logprobs", "stream", "stream_options",
                "frequency_penalty", "presence_penalty", "response_format", *_IGNORED}
_COMPLETION_FIELDS = {"prompt", "temperature", "top_p", "max_tokens", "stop", "n", "seed", "logprobs", "stream",
                      "stream_options", "frequency_penalty", "presence_penalty", "echo", "best_of", "suffix",
                      *_IGNORED}


_PATH = re.compile(r"^(?:/sessions/(?P<session>[^/]+))?/v1/"
                   r"(?P<route>chat/completions|completions|responses|messages|models)/?$")
_TASKS = re.compile(r"^/rl/v1/episodes(?:/(?P<episode>[^/]+)/reward)?/?$")
_SSE = "text/event-stream"


@dataclasses.dataclass
class Reply:
    """What `dispatch` answers, whatever carries it: status, body (JSON, or a whole event stream) and its type."""

    status: int
    body: bytes
    content_type: str = "application/json"

    @classmethod
    def json(cls, obj: Any, status: int = 200) -> "Reply":
        return cls(status, json.dumps(obj, ensure_ascii=False).encode("utf-8"))


@dataclasses.dataclass(eq=False)
class SessionHandle:
    """One open session: its key, the `Session` bookkeeping, how its requests reach the engine, and whether it
    runs greedy (evaluation: the request's sampling fields are overridden)."""

    key: str
    session: Session
    generate: Generate
    greedy: bool = False
    late_calls: int = 0  # calls after the session ended (the agent's group is dropped for them)
    calls: int = 0
    token: str = dataclasses.field(default="", repr=False)  # the API key that opens this session (and no other)
    # Responses API: a response id -> its conversation in chat form (what `previous_response_id` continues)
    responses: dict[str, list[dict]] = dataclasses.field(default_factory=dict, repr=False)


def _bytes(token: str) -> bytes:
    return token.encode("utf-8", "replace")  # a header may carry anything: compared as bytes, never raises


def _api_key(headers: Mapping[str, str]) -> str:
    """The key a request presents: `Authorization: Bearer <key>` (OpenAI's SDKs) or `x-api-key` (Anthropic's)."""
    auth = headers.get("Authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else headers.get("x-api-key", "")


def _digest(token: str) -> bytes:
    """What an ended session keeps of its token: enough to tell its late calls from anyone else's."""
    return hashlib.sha256(_bytes(token)).digest()


def _number(body: dict, name: str, lo: float, hi: float, lo_open: bool = False) -> Optional[float]:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (lo < v if lo_open else lo <= v) or v > hi:
        raise RequestError(f"{name} must be a number in {'(' if lo_open else '['}{lo}, {hi}], got {v!r}", name)
    return float(v)


def _int(body: dict, name: str, lo: int, hi: int) -> Optional[int]:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise RequestError(f"{name} must be an integer in [{lo}, {hi}], got {v!r}", name)
    return v


class EndpointServer:
    """The HTTP server of one rollout worker and its open sessions.

    Args:
        tokenizer: the policy's tokenizer (chat template, decoding).
        gconfig: the run's sampling settings (eos among its stop ids); a request's fields override them.
        max_context_len: prompt + new tokens of one request at most (400 context_length_exceeded beyond).
        host, port: where to listen (port 0: a free one).
        parser: the tool-call parser (a name in `arl.tools.parsers.PARSERS`).
        model_name: the model id `/v1/models` lists (with no `policies`, any model name is accepted in requests).
        policies: the named policies the run serves beside its own (`policies:`, docs/multi_policy.md): a request
            whose `model` names one is generated by it (its turns recorded as that policy's); with any, a `model`
            that is neither one of them nor `model_name` is a 404 `model_not_found` in the dialect's shape.
        vocab_size: token ids of a `/v1/completions` prompt must be below it (400 otherwise, not the engine's
            refusal); None: the tokenizer's length.
        max_ended: ended sessions remembered (~360 bytes each) so that a late call is told `session_ended` and
            counted; an older one's late call is a 404 `session_not_found`, refused all the same. 10,000 keeps a
            long run's worker flat (at 100,000 the memory grew for the first 50,000 groups of 2: 36 MB).
        in_process: the clients this server hands to agents in the worker (`openai_client`, `anthropic_client`)
            call `dispatch` without a socket; False: they go through the HTTP server like any other caller.
        max_sessions: agent sessions that run at once (`SessionSlots`; 0: no cap).
        task_key: the key of the task API (`/rl/v1/episodes`, agents outside the run: `arl.rollout.episodes`);
            empty: the task API is off.
    """

    def __init__(self, tokenizer: Any, gconfig: GenerationConfig, max_context_len: int, host: str = "127.0.0.1",
                 port: int = 0, parser: str = "hermes",
                 model_name: str = "arl-policy", max_ended: int = 10_000, vocab_size: Optional[int] = None,
                 in_process: bool = True, max_sessions: int = 0, task_key: str = "",
                 policies: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.policies = frozenset(policies)
        self.vocab_size = int(vocab_size) if vocab_size else len(tokenizer)
        self.gconfig = gconfig
        self.max_context_len = int(max_context_len)
        self.host, self.port = host, int(port)
        self.parser = get_parser(parser)
        self.model_name = model_name
        self.sessions: dict[str, SessionHandle] = {}
        # an ended session's key -> its token's digest and a weak reference to its handle: enough to answer and count
        # an authenticated late call (on the handle too while its agent still holds it) without keeping every
        # turn's ids, samples and group client
        self._ended: collections.OrderedDict[str, tuple[bytes, weakref.ref[SessionHandle]]] = \
            collections.OrderedDict()
        self._max_ended = max_ended
        self._runner: Optional[web.AppRunner] = None
        self._starting: Optional[asyncio.Task] = None
        self._ids = itertools.count()
        self.in_process = in_process
        self._handlers: dict[str, Callable[[SessionHandle, bytes], Awaitable[Reply]]] = {
            "chat/completions": self._chat, "completions": self._completions, "responses": self._responses,
            "messages": self._messages, "models": self._models}  # the routes of `dispatch`
        self.slots = SessionSlots(max_sessions)
        self.task_key = task_key
        self.board = EpisodeBoard()
        self._openai: Any = None
        self._anthropic: Any = None
        self.stats: collections.Counter = collections.Counter()
        eos = getattr(tokenizer, "eos_token_id", None)
        self._eos = int(eos) if eos is not None else None

    # -- lifecycle -------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """Base URL without `/v1` (the server must be started)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> "EndpointServer":
        """Start listening (idempotent; concurrent callers wait for the one start)."""
        if self._runner is not None:
            return self
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())
        await asyncio.shield(self._starting)
        return self

    async def _start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._web)  # every route is dispatch's
        # a caller that hangs up cancels its handler, so the inference client aborts the request (gen_abort)
        runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        await site.start()
        self.port = int(runner.addresses[0][1])
        self._runner = runner
        logger.info("OpenAI-compatible endpoint listening on %s/v1", self.url)

    async def close(self) -> None:
        for name in ("_openai", "_anthropic"):
            client = getattr(self, name)
            setattr(self, name, None)
            if client is None:
                continue
            try:
                await asyncio.wait_for(client.close(), 5.0)
            except Exception:  # noqa: BLE001 - closing: nothing left to do
                pass
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await asyncio.wait_for(runner.cleanup(), 10.0)

    def openai_client(self) -> Any:
        """One `openai.AsyncOpenAI` for this worker (sessions get `with_options` copies that share its HTTP client:
        a fresh one per session costs ~50 ms). With `in_process` its transport calls `dispatch` directly (no socket,
        no HTTP parsing: `arl.rollout.inprocess`). `openai` is imported here, only for such agents."""
        if self._openai is None:
            import openai

            # the SDK's HTTP client logs every request at INFO: one line per turn in the worker's log (and its CPU)
            for name in ("httpx", "httpx2", "httpcore", "httpcore2"):
                if logging.getLogger(name).level == logging.NOTSET:
                    logging.getLogger(name).setLevel(logging.WARNING)

            # one timeout for every phase: the SDK's default 5 s to connect is too short for a loaded worker whose
            # event loop accepts connections between other work (the trajectory deadline bounds the whole call)
            # its own key opens nothing: each session's copy carries that session's token
            http = in_process_http_client(self.dispatch, openai.DefaultAsyncHttpxClient) if self.in_process else None
            self._openai = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0,
                                              timeout=600.0, http_client=http)
        return self._openai

    def anthropic_client(self) -> Any:
        """One `anthropic.AsyncAnthropic` for this worker, as `openai_client` (imported only for such agents)."""
        if self._anthropic is None:
            import anthropic

            http = in_process_http_client(self.dispatch, anthropic.DefaultAsyncHttpxClient) \
                if self.in_process else None
            self._anthropic = anthropic.AsyncAnthropic(base_url=self.url, api_key="none", max_retries=0,
                                                       timeout=600.0, http_client=http)
        return self._anthropic

    # -- sessions ----------------------------------------------------------------------------------------------
    def open_session(self, generate: Generate, greedy: bool = False) -> SessionHandle:
        key = secrets.token_hex(12)  # not secret: trajectories and the inference servers' sticky routing carry it
        h = SessionHandle(key, Session(key, self.tokenizer), generate, greedy,
                          token=f"{key}.{secrets.token_urlsafe(32)}")  # 256 random bits after the key it names
        self.sessions[key] = h
        self.stats["sessions"] += 1
        return h

    def end_session(self, key: str) -> None:
        h = self.sessions.pop(key, None)
        if h is None:
            return
        h.session.ended = True
        self._ended[key] = (_digest(h.token), weakref.ref(h))
        while len(self._ended) > self._max_ended:
            self._ended.popitem(last=False)

    def heartbeat_stats(self) -> dict:
        """The counters, and the sessions running and waiting for a slot now."""
        out = {**self.stats, "sessions_running": self.slots.running, "sessions_waiting": self.slots.waiting}
        if self.task_key:
            out["episodes"] = {**self.board.stats, "open": self.board.open}
        return out

    def session_url(self, h: SessionHandle) -> str:
        """The OpenAI SDK's base URL for a session (it appends `/chat/completions`, `/responses`)."""
        return f"{self.url}/sessions/{h.key}/v1"

    def session_root(self, h: SessionHandle) -> str:
        """The Anthropic SDK's base URL for a session (it appends `/v1/messages`)."""
        return f"{self.url}/sessions/{h.key}"

    def api_key(self, h: SessionHandle) -> str:
        return h.token

    def _refused(self) -> RequestError:
        self.stats["refused_auth"] += 1
        return RequestError("invalid API key: it must be the token of the session (the api_key its agent was given)",
                            status=401, code="invalid_api_key")

    def _session(self, in_path: Optional[str], headers: Mapping[str, str]) -> SessionHandle:
        """The session in the path, else the one the API key (Bearer or x-api-key) names; the key must be that
        session's token (401), compared in constant time. An ended session's token gets 404 `session_ended`."""
        token = _api_key(headers)
        key = in_path or token.partition(".")[0]
        h = self.sessions.get(key)
        if h is not None:
            if not hmac.compare_digest(_bytes(token), _bytes(h.token)):
                raise self._refused()
            return h
        if key in self._ended:
            digest, ref = self._ended[key]
            if not hmac.compare_digest(_digest(token), digest):
                raise self._refused()
            ended = ref()
            if ended is not None:  # its agent still holds it: the group is dropped for the late call
                ended.late_calls += 1
            self.stats["late_calls"] += 1
            raise RequestError(f"session {key} has ended", status=404, code="session_ended")
        if not in_path:  # the key names no session: it is no key of this endpoint
            raise self._refused()
        self.stats["unknown_session"] += 1
        raise RequestError("unknown session", status=404, code="session_not_found")

    # -- dispatch ----------------------------------------------------------------------------------------------
    async def _web(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()  # over client_max_size: aiohttp's 413
        r = await self.dispatch(request.method, request.path, request.headers, raw)
        headers = {"Cache-Control": "no-cache"} if r.content_type == _SSE else None
        return web.Response(status=r.status, body=r.body, content_type=r.content_type, headers=headers)

    async def dispatch(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> Reply:
        """Answer one request: the route, the session its key opens, then the dialect's handler. Every refusal
        is an error in the dialect's shape (Anthropic's for `/v1/messages`, OpenAI's otherwise)."""
        task = _TASKS.match(path)
        if task is not None:
            return await self._task_api(method, task["episode"], headers, body)
        m = _PATH.match(path)
        route = m["route"] if m else ""
        try:
            if m is None:
                raise RequestError(f"no such route: {method} {path}", status=404, code="not_found")
            want = "GET" if route == "models" else "POST"
            if method != want:
                raise RequestError(f"{method} is not allowed on /v1/{route} (use {want})", status=405,
                                   code="method_not_allowed")
            h = self._session(m["session"], headers)
            return await self._handlers[route](h, body)
        except RequestError as e:
            self.stats[f"http_{e.status}"] += 1
            err = anthropic.error_body(e) if route == "messages" else e.openai_body()
            return Reply.json(err, e.status)

    # -- the task API (agents outside the run) ----------------------------------------------------------------
    async def _task_api(self, method: str, episode: Optional[str], headers: Mapping[str, str], body: bytes) -> Reply:
        """`POST /rl/v1/episodes` ({"wait_s": <= 60}: long-poll) -> an episode or 204; `POST
        /rl/v1/episodes/{id}/reward` -> 200, 404 unknown, 409 ended / never handed out / already rewarded."""
        try:
            if not self.task_key:
                raise RequestError("the task API is off (it serves agent.name=external)", status=404,
                                   code="not_found")
            if not hmac.compare_digest(_bytes(_api_key(headers)), _bytes(self.task_key)):
                self.stats["task_refused_auth"] += 1
                raise RequestError("invalid task API key", status=401, code="invalid_api_key")
            if method != "POST":
                raise RequestError(f"{method} is not allowed (use POST)", status=405, code="method_not_allowed")
            args = self._body(body or b"{}", {"wait_s", "reward"})
            if episode is not None:
                self.board.reward(episode, reward_payload(args))
                return Reply.json({"episode_id": episode, "status": "rewarded"})
            wait = _number(args, "wait_s", 0.0, 60.0)
            ep = await self.board.take(20.0 if wait is None else wait)
            if ep is None:
                return Reply(204, b"")
            h = ep.handle
            return Reply.json({"episode_id": ep.id, "prompt": ep.prompt, "observation": ep.observation,
                               "base_url": self.session_url(h), "anthropic_base_url": self.session_root(h),
                               "api_key": h.token, "model": self.model_name, "deadline": ep.deadline,
                               "deadline_s": max(0.0, ep.deadline - time.time())})
        except RequestError as e:
            self.stats[f"task_http_{e.status}"] += 1
            return Reply.json(e.openai_body(), e.status)

    # -- handlers ----------------------------------------------------------------------------------------------
    async def _models(self, h: SessionHandle, raw: bytes) -> Reply:
        """The run's model, then its named policies (each a model a request may name)."""
        names = [self.model_name, *sorted(self.policies)]
        data = [{"id": n, "object": "model", "created": 0, "owned_by": "arl",  # OpenAI's fields
                 "type": "model", "display_name": n, "created_at": "1970-01-01T00:00:00Z"} for n in names]  # Anthropic's
        return Reply.json({"object": "list", "data": data, "has_more": False, "first_id": names[0],
                           "last_id": names[-1]})

    def _body(self, raw: bytes, allowed: set[str]) -> dict:
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
            raise RequestError(f"the body is not valid JSON: {e}") from None
        except RecursionError:  # the parser's own limit (~1000 levels): a hostile body, not a server fault
            raise RequestError("the body's JSON is nested too deeply") from None
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise RequestError(f"unsupported field {unknown[0]!r} (this endpoint serves the policy being trained "
                               f"and cannot honour it)", unknown[0])
        for name in ("frequency_penalty", "presence_penalty"):
            if body.get(name) not in (None, 0, 0.0):
                raise RequestError(f"{name} is not supported (only 0)", name)
        if body.get("seed") is not None:
            raise RequestError("seed is not supported: an inference server samples all requests from one generator",
                               "seed")
        if not isinstance(body.get("model", ""), str):
            raise RequestError("model must be a string", "model")
        return body

    def _model_body(self, raw: bytes, allowed: set[str]) -> tuple[dict, Optional[str]]:
        """A generation request's body (`_body`) and the named policy its `model` selects (None: the run's own
        policy), an unknown model refused before anything else is done. Without named policies any model name is
        the run's own (agents send whatever their framework defaults to)."""
        body = self._body(raw, allowed)
        model = body.get("model") or ""
        if not self.policies or model in ("", self.model_name):
            return body, None
        if model in self.policies:
            return body, model
        raise RequestError(f"The model '{model}' does not exist: this run serves {self.model_name!r} (the policy "
                           f"being trained) and {sorted(self.policies)}", "model", status=404,
                           code="model_not_found")

    def _gconfig(self, body: dict, names: dict[str, str], h: SessionHandle, prompt_len: int,
                 stop_ids: list[int]) -> GenerationConfig:
        """The request's sampling fields (`names`: canonical name -> the dialect's) over the run's settings."""
        def name(canonical: str) -> str:
            return names.get(canonical, canonical)

        changes: dict[str, Any] = {}
        temperature = _number(body, name("temperature"), 0.0, 2.0)
        top_p = _number(body, name("top_p"), 0.0, 1.0, lo_open=True)
        if temperature == 0:
            changes["greedy"] = True
        elif temperature is not None:
            changes.update(temperature=temperature, greedy=False)
        if top_p is not None:
            changes["top_p"] = top_p
        if "top_k" in names:
            top_k = _int(body, names["top_k"], 0, 1 << 20)
            if top_k is not None:
                changes["top_k"] = top_k
        changes["n"] = _int(body, name("n"), 1, 64) or 1
        field = name("max_tokens")
        max_new = _int(body, field, 1, 1 << 30)
        room = self.max_context_len - prompt_len
        if max_new is not None and max_new > room:
            raise RequestError(f"this model's maximum context length is {self.max_context_len} tokens; the prompt "
                               f"has {prompt_len} and {field} asks for {max_new}", field, code="context_length_exceeded")
        if max_new is None and room < 1:
            raise RequestError(f"this model's maximum context length is {self.max_context_len} tokens; the prompt "
                               f"has {prompt_len}", name("messages"), code="context_length_exceeded")
        changes["max_new_tokens"] = max_new or min(self.gconfig.max_new_tokens, room)
        changes["min_new_tokens"] = min(self.gconfig.min_new_tokens, changes["max_new_tokens"])
        if stop_ids:
            changes["stop_token_ids"] = list(dict.fromkeys([*self.gconfig.stop_token_ids, *stop_ids]))
        if h.greedy:
            changes["greedy"] = True
        g = self.gconfig.new(**changes)
        try:
            g.validate()
        except ValueError as e:
            raise RequestError(str(e)) from None
        return g

    @staticmethod
    def _stop_list(stop: Any) -> list[str]:
        """Chat's and completions' `stop`: a string or a list of at most 4."""
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, list) or len(items) > 4 or not all(isinstance(s, str) and s for s in items):
            raise RequestError("stop must be a string or a list of at most 4 non-empty strings", "stop")
        return items

    def _stops(self, items: list[str], param: str) -> list[int]:
        """Stop strings as token ids: each must be one token (the engine stops on token ids; cutting text
        afterwards would train on tokens the agent never saw)."""
        ids = []
        for s in items:
            enc = list(self.tokenizer.encode(s, add_special_tokens=False))
            if len(enc) != 1:
                raise RequestError(f"{param} {s!r} is {len(enc)} tokens; only stop strings of one token are "
                                   "supported (the engine stops on token ids)", param)
            ids.append(int(enc[0]))
        return ids

    async def _generate(self, h: SessionHandle, ids: np.ndarray, g: GenerationConfig,
                        policy: Optional[str] = None) -> GenerateResponse:
        req = GenerateRequest(qid=f"ep{next(self._ids)}", input_ids=ids, gconfig=g, session_id=h.key, policy=policy)
        h.calls += 1
        self.stats["requests"] += 1
        resp = await h.generate(req)
        if resp.error is not None or not resp.samples:
            self.stats["engine_errors"] += 1
            raise RequestError(f"generation failed: {resp.error or 'no samples'}", status=500, kind="server_error",
                               code="engine_error")
        return resp

    def _text(self, sample: SampleOutput, stop_texts: list[str], stop_ids: list[int]) -> tuple[str, Optional[str]]:
        """The answer's text, and the stop string that ended it (left out of the text, as the APIs do)."""
        ids = sample.output_ids
        text = self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)
        last = int(ids[-1]) if len(ids) and sample.finish_reason == "stop" else None
        for s, t in zip(stop_texts, stop_ids):
            if last == t:
                return (text[:-len(s)] if text.endswith(s) else text), s
        return text, None

    def _token_logprobs(self, sample: Any) -> list[dict]:
        out = []
        for t, lp in zip(sample.output_ids.tolist(), sample.output_logprobs.tolist()):
            tok = self.tokenizer.decode([t])
            out.append({"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")), "top_logprobs": []})
        return out

    async def _answers(self, h: SessionHandle, call: ChatCall, id_prefix: str,
                       policy: Optional[str] = None) -> tuple[np.ndarray, list[Answer], list[dict]]:
        """One chat turn of any dialect: the session's prompt ids, the engine's samples, their tool calls parsed,
        the turn recorded. Returns the prompt ids, the answers and each answer as a chat message (with the call
        ids the dialect will show)."""
        param = call.names.get("messages", "messages")
        try:
            ids, history, parent = h.session.chat_prompt(call.messages, call.tools)
        except Exception as e:  # noqa: BLE001 - unreadable messages, or the chat template refused them
            raise RequestError(f"{param}: {type(e).__name__}: {e}", param) from None
        stop_ids = self._stops(call.stop, call.stop_param)
        g = self._gconfig(call.sampling, call.names, h, len(ids), stop_ids)
        resp = await self._generate(h, ids, g, policy)
        answers, msgs, choices = [], [], []
        for s in resp.samples:
            text, stop = self._text(s, call.stop, stop_ids)
            content, calls = text, []
            if call.parse_tools:
                parsed = self.parser.parse(text)
                if parsed.calls and not parsed.errors:
                    content, calls = parsed.content, parsed.calls
            a = Answer(s, text, content, calls, s.finish_reason, stop)
            msg = a.message([new_id(id_prefix) for _ in calls])
            answers.append(a)
            msgs.append(msg)
            choices.append(Choice(s, message_key(msg), tool_calls=len(calls), policy=policy))
        self._record(h, ids, history, parent, choices)
        self.stats["tool_calls"] += sum(len(a.calls) for a in answers)
        return ids, answers, msgs

    async def _chat(self, h: SessionHandle, raw: bytes) -> Reply:
        t0 = time.perf_counter()
        body, policy = self._model_body(raw, _CHAT_FIELDS)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list", "messages")
        tools = body.get("tools")
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise RequestError("tools must be a list of objects", "tools")
        choice_mode = body.get("tool_choice")
        if choice_mode not in (None, "auto", "none"):
            raise RequestError("tool_choice must be 'auto' or 'none' (a forced tool cannot be honoured by "
                               "sampling)", "tool_choice")
        if body.get("parallel_tool_calls") is False:
            raise RequestError("parallel_tool_calls=false is not supported (the model may write several calls)",
                               "parallel_tool_calls")
        rf = body.get("response_format")
        if rf is not None and (not isinstance(rf, dict) or rf.get("type") != "text"):
            raise RequestError("response_format: only {'type': 'text'} is supported", "response_format")
        if body.get("top_logprobs") not in (None, 0):
            raise RequestError("top_logprobs is not supported (the engine returns the sampled token's logprob "
                               "only; use logprobs=true)", "top_logprobs")
        stream = self._stream_flag(body)
        limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        call = ChatCall(messages, tools, bool(tools) and choice_mode != "none", body, {"max_tokens": limit},
                        stop=self._stop_list(body.get("stop")), stream=stream)
        ids, answers, msgs = await self._answers(h, call, "call_", policy)
        out = []
        for i, (a, msg) in enumerate(zip(answers, msgs)):
            finish = "tool_calls" if a.calls and a.finish == "stop" else a.finish
            c: dict[str, Any] = {"index": i, "message": msg, "finish_reason": finish, "logprobs": None,
                                 "arl": {"token_ids": a.sample.output_ids.tolist(),
                                         "versions": a.sample.output_versions.tolist()}}
            if body.get("logprobs"):
                c["logprobs"] = {"content": self._token_logprobs(a.sample)}
            out.append(c)
        n_out = sum(len(a.sample.output_ids) for a in answers)
        result = {"id": f"chatcmpl-{secrets.token_hex(8)}", "object": "chat.completion", "created": int(time.time()),
                  "model": body.get("model") or self.model_name, "choices": out,
                  "usage": {"prompt_tokens": len(ids), "completion_tokens": n_out, "total_tokens": len(ids) + n_out}}
        self.stats["chat_ms"] += int((time.perf_counter() - t0) * 1000)
        if stream:
            return Reply(200, sse(self._chat_events(result, body), done=True), _SSE)
        return Reply.json(result)

    async def _responses(self, h: SessionHandle, raw: bytes) -> Reply:
        body, policy = self._model_body(raw, responses.FIELDS)
        call, conversation = responses.chat_call(body, h.responses.get)
        ids, answers, msgs = await self._answers(h, call, "call_", policy)
        logprobs = None
        if "message.output_text.logprobs" in (body.get("include") or []):
            logprobs = self._token_logprobs(answers[0].sample)
        result = responses.response(answers[0], msgs[0], body, len(ids), body.get("model") or self.model_name,
                                    logprobs)
        h.responses[result["id"]] = conversation + [msgs[0]]
        self.stats["responses_calls"] += 1
        if call.stream:
            return Reply(200, sse(responses.events(result), done=False), _SSE)
        return Reply.json(result)

    async def _messages(self, h: SessionHandle, raw: bytes) -> Reply:
        body, policy = self._model_body(raw, anthropic.FIELDS)
        call = anthropic.chat_call(body)
        ids, answers, msgs = await self._answers(h, call, "toolu_", policy)
        result = anthropic.message(answers[0], msgs[0], len(ids), body["model"])
        self.stats["messages_calls"] += 1
        if call.stream:
            return Reply(200, sse(anthropic.events(result), done=False), _SSE)
        return Reply.json(result)

    def _record(self, h: SessionHandle, ids: np.ndarray, history: Any, parent: Any, choices: list[Choice]) -> None:
        before = h.session.mismatches
        try:
            h.session.record(ids, history, parent, choices)
        except SessionEnded:
            h.late_calls += 1
            self.stats["late_calls"] += 1
            raise RequestError(f"session {h.key} has ended", status=404, code="session_ended") from None
        if h.session.mismatches > before:
            self.stats["endpoint_prefix_mismatch"] += 1

    @staticmethod
    def _stream_flag(body: dict) -> bool:
        stream = body.get("stream", False)
        if not isinstance(stream, bool) and stream is not None:
            raise RequestError("stream must be a boolean", "stream")
        opts = body.get("stream_options")
        if opts is not None and not isinstance(opts, dict):
            raise RequestError("stream_options must be an object", "stream_options")
        return bool(stream)

    @staticmethod
    def _chat_events(result: dict, body: dict) -> list[tuple[Optional[str], dict]]:
        """The whole answer as chunks: per choice its role, content, tool calls, then its finish reason."""
        head = {k: result[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
        events: list[tuple[Optional[str], dict]] = []
        for c in result["choices"]:
            m, i = c["message"], c["index"]
            events.append((None, head | {"choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                      "finish_reason": None}]}))
            if m.get("content"):
                events.append((None, head | {"choices": [{"index": i, "delta": {"content": m["content"]},
                                                          "logprobs": c["logprobs"], "finish_reason": None}]}))
            if m.get("tool_calls"):
                delta = {"tool_calls": [{"index": k, **tc} for k, tc in enumerate(m["tool_calls"])]}
                events.append((None, head | {"choices": [{"index": i, "delta": delta, "finish_reason": None}]}))
            events.append((None, head | {"choices": [{"index": i, "delta": {}, "finish_reason": c["finish_reason"],
                                                      "arl": c["arl"]}]}))
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append((None, head | {"choices": [], "usage": result["usage"]}))
        return events

    async def _completions(self, h: SessionHandle, raw: bytes) -> Reply:
        body, policy = self._model_body(raw, _COMPLETION_FIELDS)
        for name in ("echo", "suffix"):
            if body.get(name):
                raise RequestError(f"{name} is not supported", name)
        if body.get("best_of") not in (None, 1):
            raise RequestError("best_of is not supported", "best_of")
        if body.get("logprobs") not in (None, 0):
            raise RequestError("logprobs: only 0 (the sampled tokens' logprobs) is supported", "logprobs")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        ok_ids = isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        if not (isinstance(prompt, str) and prompt) and not ok_ids:
            raise RequestError("prompt must be a non-empty string or list of token ids (one prompt)", "prompt")
        if ok_ids:  # before they become int32 (2**31 would overflow) or reach the engine (which refuses them)
            bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise RequestError(f"prompt token ids must be in [0, {self.vocab_size}) (the model's "
                                   f"vocabulary), got {bad}", "prompt")
        stream = self._stream_flag(body)
        ids, history, parent = h.session.completion_prompt(prompt)
        stop_texts = self._stop_list(body.get("stop"))
        stop_ids = self._stops(stop_texts, "stop")
        g = self._gconfig(body, {"messages": "prompt"}, h, len(ids), stop_ids)
        resp = await self._generate(h, ids, g, policy)
        choices, out = [], []
        for i, s in enumerate(resp.samples):
            text, _ = self._text(s, stop_texts, stop_ids)
            choices.append(Choice(s, text, policy=policy))
            c: dict[str, Any] = {"index": i, "text": text, "finish_reason": s.finish_reason,
                                 "logprobs": None, "arl": {"token_ids": s.output_ids.tolist(),
                                                           "versions": s.output_versions.tolist()}}
            if body.get("logprobs") == 0:
                toks = self._token_logprobs(s)
                c["logprobs"] = {"tokens": [t["token"] for t in toks],
                                 "token_logprobs": [t["logprob"] for t in toks], "top_logprobs": None,
                                 "text_offset": list(itertools.accumulate([0] + [len(t["token"])
                                                                                 for t in toks[:-1]]))}
            out.append(c)
        self._record(h, ids, history, parent, choices)
        n_out = sum(len(s.output_ids) for s in resp.samples)
        result = {"id": f"cmpl-{secrets.token_hex(8)}", "object": "text_completion", "created": int(time.time()),
                  "model": body.get("model") or self.model_name, "choices": out,
                  "usage": {"prompt_tokens": len(ids), "completion_tokens": n_out, "total_tokens": len(ids) + n_out}}
        if stream:
            events = [result | {"choices": [c]} for c in out]
            if (body.get("stream_options") or {}).get("include_usage"):
                events.append(result | {"choices": []})
            for e in events[:len(out)]:
                e.pop("usage", None)
            return Reply(200, sse([(None, e) for e in events], done=True), _SSE)
        return Reply.json(result)
