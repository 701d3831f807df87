"""Token-exact sessions of the OpenAI-compatible endpoint (`arl.rollout.endpoint`): what one agent session sent
and what the policy generated, kept as token ids so that no turn is ever re-tokenised.

Concat mode: a request whose messages continue an earlier turn (that turn's messages, then one of the assistant
messages it was answered with, compared by role, content and tool calls) is sent to the engine as that turn's
prompt ids + the ids the policy generated for that answer (exactly, with their eos) + only the new messages,
rendered by the chat template after an assistant turn (`ObservationEncoder`). A request that continues nothing
(the agent summarised, truncated, edited or dropped history; also when it starts with a later request's messages
but not with one of that request's answers: the later answer was edited or dropped) is rendered whole as the root of a new segment,
trained as its own sequence, and counted in `mismatches` (`endpoint_prefix_mismatch`): it is never silently
re-tokenised into the old one. A request that repeats an earlier turn's messages exactly (a retry) reuses that
turn's prompt ids.

Each answer (a choice) that no later turn continued ends one trajectory: the chain of turns back to its root.
So one session is one trajectory when the agent just goes on, and one per branch or segment otherwise.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import weakref
from typing import Any, Optional, Sequence

import numpy as np

from arl.agents.common import encode_chat
from arl.agents.tool_agent import ObservationEncoder
from arl.api.types import SampleOutput, Trajectory, TrajectoryBuilder

__all__ = ["Choice", "Turn", "Session", "SessionEnded", "content_text", "message_key", "template_messages"]


class SessionEnded(RuntimeError):
    """A call on a session that has ended (its agent function returned, or its group is over)."""


def content_text(content: Any) -> str:
    """A message's content as text: a string, None (""), or OpenAI's list of parts (their texts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
                out.append(str(part.get("text", "")))
            elif isinstance(part, str):
                out.append(part)
            else:
                raise ValueError(f"message content parts must be text, got {part!r:.80}")
        return "".join(out)
    raise ValueError(f"message content must be a string, null or a list of text parts, got "
                     f"{type(content).__name__}")


def _arguments(args: Any) -> Any:
    """Tool-call arguments as an object: a JSON string is parsed (so `{"a": 1}` and `'{"a":1}'` compare equal)."""
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return args
    return args


def _tool_calls(message: dict) -> list[dict]:
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise ValueError("tool_calls must be a list")
    out = []
    for c in calls:
        if not isinstance(c, dict):
            raise ValueError(f"a tool call must be an object, got {c!r:.80}")
        fn = c.get("function") or {}
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError("a tool call needs function.name")
        out.append({"name": fn["name"], "arguments": _arguments(fn.get("arguments", {}))})
    return out


def message_key(message: dict) -> str:
    """What the prefix check compares of one message: its role, content and tool calls (name and arguments), as
    canonical JSON. Tool-call ids, names of speakers and other fields do not count."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"a message must be an object with a 'role', got {message!r:.80}")
    return json.dumps([message["role"], content_text(message.get("content")), _tool_calls(message)],
                      sort_keys=True, ensure_ascii=False)


def template_messages(messages: Sequence[dict]) -> list[dict]:
    """Messages as chat templates take them: content as text, tool-call arguments as objects."""
    out = []
    for m in messages:
        t = {k: v for k, v in m.items() if v is not None}
        t["content"] = content_text(m.get("content"))
        if m.get("tool_calls"):
            t["tool_calls"] = [{"id": c.get("id", ""), "type": "function",
                                "function": {"name": c["function"]["name"],
                                             "arguments": _arguments(c["function"].get("arguments", {}))}}
                               for c in m["tool_calls"]]
        out.append(t)
    return out


class Renderings:
    """The chat template's ids for a whole prompt or for messages after an assistant turn, remembered (LRU) per
    tokenizer: a group's sessions start from one prompt and an agent sends the same feedback again and again, and
    rendering + tokenising (~0.4 ms) is most of what the endpoint itself costs per call."""

    _by_tokenizer: "weakref.WeakKeyDictionary[Any, Renderings]" = weakref.WeakKeyDictionary()

    def __init__(self, tokenizer: Any, size: int = 4096) -> None:
        self.tokenizer, self.size = tokenizer, size
        self.encoder = ObservationEncoder(tokenizer)
        self._cache: collections.OrderedDict[tuple, list[int]] = collections.OrderedDict()

    @classmethod
    def of(cls, tokenizer: Any) -> "Renderings":
        try:
            r = cls._by_tokenizer.get(tokenizer)
        except TypeError:  # a tokenizer that cannot be weakly referenced: no sharing
            return cls(tokenizer)
        if r is None:
            r = cls._by_tokenizer[tokenizer] = cls(tokenizer)
        return r

    def _get(self, key: tuple, render: Any) -> np.ndarray:
        ids = self._cache.get(key)
        if ids is None:
            ids = self._cache[key] = list(render())
            if len(self._cache) > self.size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return np.asarray(ids, np.int32)

    def prompt(self, messages: list[dict], tools: Optional[list]) -> np.ndarray:
        kw = {"tools": tools} if tools else {}
        key = ("prompt", json.dumps([messages, tools], sort_keys=True, ensure_ascii=False, default=str))
        return self._get(key, lambda: encode_chat(self.tokenizer, messages, add_generation_prompt=True, **kw))

    def after_assistant(self, messages: list[dict]) -> np.ndarray:
        key = ("after", json.dumps(messages, sort_keys=True, ensure_ascii=False, default=str))
        return self._get(key, lambda: self.encoder.encode(messages))


@dataclasses.dataclass(eq=False)
class Choice:
    """One answer the policy generated for a turn: its sample (exact ids, logprobs, versions) and what the agent
    will send back to continue it (the assistant message's key for chat, the text for completions)."""

    sample: SampleOutput
    key: Any
    tool_calls: int = 0
    continued: bool = False
    policy: Optional[str] = None  # the named policy that generated it (the endpoint's `model`); None: the run's


@dataclasses.dataclass(eq=False)
class Turn:
    """One request: the ids the engine was given, what they render (`history`: message keys and the tools' JSON
    for chat, the prompt text for completions), the answers, and where it continues from (`parent`)."""

    prompt_ids: np.ndarray
    history: Any
    choices: list[Choice]
    parent: Optional[tuple["Turn", int]]
    mismatch: bool = False  # the root of a segment started because the agent's history continued nothing


class Session:
    """One agent session: the turns it made, in order. Pure bookkeeping (no I/O): the endpoint asks it for the
    prompt ids of a request (`chat_prompt` / `completion_prompt`), sends them, then `record`s the answers."""

    def __init__(self, key: str, tokenizer: Any) -> None:
        self.key = key
        self.tokenizer = tokenizer
        self._render = Renderings.of(tokenizer)
        self.turns: list[Turn] = []
        self.mismatches = 0
        self.ended = False

    # -- chat -----------------------------------------------------------------------------------------------
    def chat_prompt(self, messages: Sequence[dict], tools: Optional[list] = None) -> tuple[np.ndarray, Any, Any]:
        """(prompt ids, history, parent) of a chat request. Raises ValueError for messages that cannot be read."""
        keys = tuple(message_key(m) for m in messages)
        tools_key = json.dumps(tools or [], sort_keys=True)
        history = (tools_key, keys)
        best: Optional[tuple[Turn, int]] = None
        longest = 0  # the most messages of an earlier request that this one starts with
        for turn in reversed(self.turns):
            t_tools, t_keys = turn.history if isinstance(turn.history, tuple) else (None, None)
            if t_tools != tools_key or t_keys is None:
                continue
            n = len(t_keys)
            if keys == t_keys:  # the same request again (a retry): same ids, a sibling of that turn
                return turn.prompt_ids, history, turn.parent
            if len(keys) > n and keys[:n] == t_keys:
                longest = max(longest, n)
                if best is None or n > len(best[0].history[1]):
                    for i, c in enumerate(turn.choices):
                        if c.key == keys[n]:
                            best = (turn, i)
                            break
        # a later request it starts with, whose answer it does not carry on with: the agent edited or dropped that
        # answer (rewrote its history), so it continues nothing rather than an earlier turn with the edit slipped in
        if best is not None and longest <= len(best[0].history[1]):
            turn, i = best
            new = template_messages(messages[len(turn.history[1]) + 1:])
            ids = np.concatenate([turn.prompt_ids, turn.choices[i].sample.output_ids,
                                  self._render.after_assistant(new)])
            return ids, history, best
        return self._render.prompt(template_messages(messages), tools), history, None

    # -- completions ----------------------------------------------------------------------------------------
    def completion_prompt(self, prompt: str | list[int]) -> tuple[np.ndarray, Any, Any]:
        """(prompt ids, history, parent) of a completions request: text continues an earlier turn when it starts
        with that turn's prompt and answer text (ids: when they start with its prompt and answer ids)."""
        best: Optional[tuple[Turn, int, int]] = None  # turn, choice, length of the continued prefix
        if isinstance(prompt, str):
            for turn in self.turns:
                if turn.history == ("text", prompt):
                    return turn.prompt_ids, turn.history, turn.parent
                if not (isinstance(turn.history, tuple) and turn.history[0] == "text"):
                    continue
                for i, c in enumerate(turn.choices):
                    head = turn.history[1] + c.key
                    if prompt.startswith(head) and (best is None or len(head) > best[2]):
                        best = (turn, i, len(head))
            if best is not None:
                turn, i, n = best
                rest = list(self.tokenizer.encode(prompt[n:], add_special_tokens=False)) if prompt[n:] else []
                ids = np.concatenate([turn.prompt_ids, turn.choices[i].sample.output_ids, np.asarray(rest, np.int32)])
                return ids, ("text", prompt), (turn, i)
            ids = np.asarray(self.tokenizer.encode(prompt, add_special_tokens=False), np.int32)
            return ids, ("text", prompt), None
        ids = np.asarray(prompt, np.int32)
        for turn in self.turns:
            for i, c in enumerate(turn.choices):
                head = np.concatenate([turn.prompt_ids, c.sample.output_ids])
                if len(ids) >= len(head) and np.array_equal(ids[:len(head)], head) and \
                        (best is None or len(head) > best[2]):
                    best = (turn, i, len(head))
        history = ("ids", ids.tobytes())
        return ids, history, None if best is None else (best[0], best[1])

    # -- answers --------------------------------------------------------------------------------------------
    def record(self, prompt_ids: np.ndarray, history: Any, parent: Any, choices: list[Choice]) -> Turn:
        """Book one answered request. A request that continues nothing while the session already made turns starts
        a new segment and counts as a prefix mismatch."""
        if self.ended:
            raise SessionEnded(f"session {self.key} has ended")
        mismatch = parent is None and bool(self.turns) and not any(
            t.history == history and t.parent is None for t in self.turns)
        if mismatch:
            self.mismatches += 1
        if parent is not None:
            parent[0].choices[parent[1]].continued = True
        turn = Turn(np.asarray(prompt_ids, np.int32), history, choices, parent, mismatch)
        self.turns.append(turn)
        return turn

    def trajectories(self, reward: float, group_id: str, metadata: Optional[dict] = None) -> list[Trajectory]:
        """One trajectory per answer no turn continued: its chain of turns from the segment's root, every generated
        token exactly as the engine returned it (loss_mask 1), every template token between as context."""
        out = []
        for turn in self.turns:
            for i, c in enumerate(turn.choices):
                if not c.continued:
                    out.append(self._chain(turn, i, reward, group_id, metadata or {}))
        return out

    def _chain(self, leaf: Turn, index: int, reward: float, group_id: str, metadata: dict) -> Trajectory:
        chain: list[tuple[Turn, int]] = [(leaf, index)]
        while chain[-1][0].parent is not None:
            chain.append(chain[-1][0].parent)
        chain.reverse()
        root = chain[0][0]
        b = TrajectoryBuilder(root.prompt_ids)
        tool_calls = 0
        for k, (turn, i) in enumerate(chain):
            if k:  # the messages templated between the previous answer and this turn
                b.add_context(turn.prompt_ids[len(b):], source="messages")
            b.add_generated(turn.choices[i].sample, policy=turn.choices[i].policy)
            tool_calls += turn.choices[i].tool_calls
        meta = {**metadata, "turns": len(chain), "tool_calls": tool_calls,
                "endpoint_prefix_mismatch": int(root.mismatch), "session": self.key}
        return b.build(reward=reward, group_id=group_id, metadata=meta)
