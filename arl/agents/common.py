"""Helpers shared by agents: chat encoding and qid-matched request/response over the agent's queue pair."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
import weakref
from typing import Any, Callable, Optional

from arl.api import GenerateRequest, GenerateResponse, GenerationConfig, Trajectory

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------- chat encoding


def row_messages(prompt: dict[str, Any]) -> list[dict[str, str]]:
    """Chat messages of a dataset row: its `messages`, or one user message with its `prompt`."""
    if prompt.get("messages") is not None:
        return [dict(m) for m in prompt["messages"]]
    if prompt.get("prompt") is not None:
        return [{"role": "user", "content": str(prompt["prompt"])}]
    raise ValueError(f"prompt row {prompt.get('id')!r} has neither 'prompt' nor 'messages' (keys: {sorted(prompt)})")


def encode_chat(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                **template_kw: Any) -> list[int]:
    """Render `messages` with the tokenizer's chat template (`template_kw`, e.g. ``tools``, go to it) and
    tokenize the text once (no extra BOS)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                         **template_kw)
    return list(tokenizer.encode(text, add_special_tokens=False))


def check_int(name: str, value: Any, minimum: int = 1) -> None:
    if not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def agent_gconfig(gconfig: GenerationConfig, tokenizer: Any, **changes: Any) -> GenerationConfig:
    """`gconfig` with `changes` that also stops on the tokenizer's eos, validated."""
    g = gconfig.new(**changes)
    eos = tokenizer.eos_token_id
    g = g.new(stop_token_ids=list(g.stop_token_ids) + ([int(eos)] if eos is not None and int(eos) not in
                                                        g.stop_token_ids else []))
    g.validate()
    return g


def filter_uniform(trajs: list[Trajectory], enabled: bool) -> list[Trajectory]:
    """[] when `enabled` and every trajectory got the same reward (no group-relative signal); a group of one
    (evaluation) is kept."""
    uniform = len(trajs) > 1 and all(t.reward == trajs[0].reward for t in trajs)
    return [] if enabled and uniform else trajs


async def gather_or_cancel(coros: Any) -> list[Any]:
    """Run `coros` concurrently; when one fails (or the caller is cancelled), cancel the others and wait for them
    instead of leaking them."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def new_id(prefix: str) -> str:
    return f"{prefix}#{uuid.uuid4().hex[:12]}"


async def start_prompt(tokenizer: Any, prompt: dict[str, Any], env: Any) -> tuple[str, str, list[int]]:
    """The opening every single-prompt math agent shares: reset `env` with the row (its answer included: MathEnv
    reads it, reasoning-gym reads the rest) and encode the row's
    chat. Returns (prompt id, a fresh group id, prompt token ids)."""
    pid = str(prompt.get("id", "prompt"))
    prompt_ids = encode_chat(tokenizer, row_messages(prompt), add_generation_prompt=True)
    await env.reset(options={**prompt, "answer": prompt.get("answer")})  # the whole row: an env may score with more
    return pid, new_id(pid), prompt_ids


# ------------------------------------------------------------------------------------------- request/response


class QueueClient:
    """Sends `GenerateRequest`s on `obs_queue` and hands each `GenerateResponse` from `act_queue` to the request
    with the same qid, so several concurrent chains can share one queue pair and responses may come back in any
    order. A reader task runs only while requests are pending (it is stopped one event-loop iteration after the
    last answer, so an agent that sends its next request straight away keeps it). Responses for unknown qids are
    logged and dropped.
    """

    def __init__(self, obs_queue: asyncio.Queue, act_queue: asyncio.Queue, *, weak: bool = False) -> None:
        # `weak`: the client does not keep its queues alive, so a cache keyed by the queue (`queue_client`) lets go
        # of it with the group; each call holds its queues for as long as it runs.
        self._obs: Callable[[], Optional[asyncio.Queue]] = weakref.ref(obs_queue) if weak else (lambda: obs_queue)
        self._act: Callable[[], Optional[asyncio.Queue]] = weakref.ref(act_queue) if weak else (lambda: act_queue)
        self._pending: dict[str, asyncio.Future] = {}
        self._reader: Optional[asyncio.Task] = None
        self._idle: Optional[asyncio.Handle] = None  # the scheduled stop of an idle reader

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        if not isinstance(req, GenerateRequest):
            raise TypeError(f"generate() takes a GenerateRequest, got {type(req).__name__}")
        if req.qid in self._pending:
            raise ValueError(f"qid {req.qid!r} is already in flight on this queue pair; qids must be unique")
        obs, act = self.obs_queue, self.act_queue  # held for the call (a weak client's queues may go otherwise)
        if obs is None or act is None:
            raise RuntimeError("this QueueClient's queue pair no longer exists")
        direct = getattr(obs, "generate", None)
        if direct is not None:  # the rollout worker's queue answers directly (arl.api.agent.Agent)
            return await direct(req)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._pending[req.qid] = fut
        try:
            await obs.put(req)
            if self._idle is not None:
                self._idle.cancel()
                self._idle = None
            if self._reader is None or self._reader.done():
                self._reader = loop.create_task(self._read(), name="arl-agent-act-reader")
            return await fut
        finally:
            self._pending.pop(req.qid, None)
            if not self._pending and self._reader is not None and self._idle is None:
                self._idle = loop.call_soon(self._stop_idle_reader)

    def _stop_idle_reader(self) -> None:
        self._idle = None
        if not self._pending and self._reader is not None:
            # Forget the reader now, not when its cancellation is processed: another chain may send a request
            # before that happens and must start a fresh reader (else its response is never read).
            self._reader.cancel()
            self._reader = None

    @property
    def obs_queue(self) -> Optional[asyncio.Queue]:
        return self._obs()

    @property
    def act_queue(self) -> Optional[asyncio.Queue]:
        return self._act()

    async def _read(self) -> None:
        act = self.act_queue  # a pending call holds it, so it is alive while there is anything to read
        while self._pending and act is not None:
            resp = await act.get()
            if not isinstance(resp, GenerateResponse):
                err = TypeError(f"act_queue delivered {type(resp).__name__}, expected GenerateResponse")
                for f in self._pending.values():
                    if not f.done():
                        f.set_exception(err)
                return
            fut = self._pending.get(resp.qid)
            if fut is None or fut.done():
                logger.warning("dropping a response for unknown qid %r (pending: %s)", resp.qid, list(self._pending))
                continue
            fut.set_result(resp)

    async def close(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader


# Weak both ways: the key is the act queue and the client holds its queues weakly, so an entry goes with its group's
# queue pair (a client holding them strongly once kept every group's queues, timeline and engine log alive).
_CLIENTS: "weakref.WeakKeyDictionary[asyncio.Queue, QueueClient]" = weakref.WeakKeyDictionary()


def queue_client(obs_queue: asyncio.Queue, act_queue: asyncio.Queue) -> QueueClient:
    """The one QueueClient of this queue pair (keyed by `act_queue`), shared by the chains that use the pair so one
    reader hands out their responses. The rollout worker's obs queue answers directly and needs no shared reader:
    its client is not cached."""
    if getattr(obs_queue, "generate", None) is not None:
        return QueueClient(obs_queue, act_queue)
    client = _CLIENTS.get(act_queue)
    if client is None or client.obs_queue is not obs_queue:
        client = QueueClient(obs_queue, act_queue, weak=True)
        _CLIENTS[act_queue] = client
    return client


def live_queue_clients() -> int:
    """Cached clients of plain queue pairs alive now (the rollout worker's heartbeat shows it: it must not grow)."""
    return len(_CLIENTS)


async def generate(obs_queue: asyncio.Queue, act_queue: asyncio.Queue, req: GenerateRequest) -> GenerateResponse:
    """Send `req` and await its response (matched by qid). Raises RuntimeError if the engine reports an error."""
    resp = await queue_client(obs_queue, act_queue).generate(req)
    if resp.error is not None:
        raise RuntimeError(f"generation request {req.qid!r} failed: {resp.error}")
    if not resp.samples:
        raise RuntimeError(f"generation request {req.qid!r} returned no samples")
    return resp


# ------------------------------------------------------------------------------------------- env per trajectory


async def env_for(env: Any, index: int) -> Any:
    """The environment of trajectory `index` of a group: its own member when `env` is an env group (anything with
    an async `member(i)`, see `arl.rollout.env_groups.EnvGroup`), else `env` itself (a plain env, e.g. in tests)."""
    member = getattr(env, "member", None)
    return env if member is None else await member(index)
