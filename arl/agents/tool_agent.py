"""A tool-calling agent: the model writes tool calls, tools run (async, with timeouts), their observations go back
into the context through the chat template, until the model answers or a budget runs out.

Turn loop of one path (the token history is never decoded and re-encoded):

    context -> engine (n samples) -> parse each sample's text with the tool-call parser
      tool call(s)          -> run them; each result becomes a `tool` message rendered with the chat template
                               (with the generation prompt) and appended with loss_mask 0, source
                               "observation:<tool>"; malformed calls / unknown tools / bad arguments become
                               error observations
      an answer, no call    -> env.step(answer text) gives the reward; the path ends ("answered")
      neither (or it ends on EOS inside an unclosed call) -> a void turn; the path ends ("void_turn"), reward 0

Budgets, each with its own termination reason:
    max_new_tokens_per_turn   a turn cut by it                                   -> "turn_budget"
    max_total_tokens          no room left for a turn, or a turn cut by what was left -> "total_budget"
    max_turns                 the model still calls tools after the last turn      -> "max_turns"
    max_observation_tokens    one observation longer than this is truncated (metadata "obs_truncated")
    max_total_observation_tokens  observations of a path would exceed it          -> "observation_budget"
The engine aborting a request ends the path with "abort".

Rollout shapes (`rollout`):
    "chain": `group_size` independent chains per prompt (their first turn shares one request, n=group_size).
    "tree":  every node branches `tree_branching` ways at each turn while the node budget `tree_max_nodes`
             lasts (then paths continue one way); siblings share the prefix up to their branch point. Every
             leaf is a trajectory; all leaves of a prompt form one group for group advantages.

Each trajectory gets its own environment: `env.member(i)` when the rollout worker passes an env group (see
`arl.rollout.env_groups`), else the env itself (fine for stateless envs like MathEnv).

metadata: turns, tool_calls, tool_errors, tool_calls_<name>, void_turns, obs_tokens, obs_truncated,
termination, solved, first_correct (= solved), path (tree position, e.g. "0.1"), prompt_id, token_ledger.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import re
from typing import Any, Optional, Sequence

from arl.agents.common import (agent_gconfig, check_int, encode_chat, env_for, filter_uniform, generate, new_id,
                               row_messages)
from arl.api import (Agent, EnvironmentService, GenerateRequest, GenerationConfig, SampleOutput, Trajectory,
                     TrajectoryBuilder, register_agent, scalar_reward)
from arl.tools.base import ToolResult, ToolSet
from arl.tools.parsers import ParsedOutput, get_parser

_DUMMY_BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


class ObservationEncoder:
    """Token ids of tool messages as the chat template renders them after an assistant turn (with the generation
    prompt), by difference against a fixed dummy conversation. Text the template puts after the end-of-turn
    token (which the model does not generate, e.g. Qwen's newline after <|im_end|>) is kept."""

    def __init__(self, tokenizer: Any, eos_text: Optional[str] = None) -> None:
        self.tokenizer = tokenizer
        base = self._base = tokenizer.apply_chat_template(_DUMMY_BASE, tokenize=False, add_generation_prompt=False)
        eos_text = eos_text if eos_text is not None else getattr(tokenizer, "eos_token", None)
        self._post_eos = ""
        if eos_text and eos_text in base:
            self._post_eos = base[base.rfind(eos_text) + len(eos_text):]

    def text(self, messages: list[dict[str, str]]) -> str:
        full = self.tokenizer.apply_chat_template(_DUMMY_BASE + messages, tokenize=False, add_generation_prompt=True)
        if not full.startswith(self._base):
            raise ValueError("chat template: a conversation's rendering is not a prefix of its continuation")
        return self._post_eos + full[len(self._base):]

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        return list(self.tokenizer.encode(self.text(messages), add_special_tokens=False))

    def encode_truncated(self, role: str, contents: Sequence[str], max_tokens: int,
                         marker: str = "...") -> tuple[list[int], int]:
        """Encode one message per content; cut the longest contents until the whole block fits `max_tokens`.
        Returns (ids, number of contents cut)."""
        contents = list(contents)
        ids = self.encode([{"role": role, "content": c} for c in contents])
        cut = 0
        for _ in range(8):
            if len(ids) <= max_tokens:
                break
            over = len(ids) - max_tokens
            i = max(range(len(contents)), key=lambda k: len(contents[k]))
            toks = self.tokenizer.encode(contents[i], add_special_tokens=False)
            keep = max(0, len(toks) - over - len(self.tokenizer.encode(marker, add_special_tokens=False)) - 1)
            new = self.tokenizer.decode(toks[:keep], skip_special_tokens=True) + marker
            if new == contents[i]:
                break
            contents[i] = new
            cut += 1
            ids = self.encode([{"role": role, "content": c} for c in contents])
        return ids, cut


@dataclasses.dataclass
class _Path:
    """One partial trajectory: its tokens and counters."""

    builder: TrajectoryBuilder
    path: str
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    void_turns: int = 0
    obs_tokens: int = 0
    obs_truncated: int = 0
    by_tool: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    turn_kinds: list[str] = dataclasses.field(default_factory=list)

    def fork(self, suffix: str) -> "_Path":
        path = f"{self.path}.{suffix}" if self.path else suffix
        return dataclasses.replace(self, builder=self.builder.copy(), path=path,
                                   by_tool=collections.Counter(self.by_tool), turn_kinds=list(self.turn_kinds))


class ToolAgent(Agent):
    def __init__(self, tokenizer: Any, gconfig: GenerationConfig, group_size: int = 8,
                 tools: Sequence[Any] = ("calculator", "python"), parser: Any = "hermes", max_turns: int = 4,
                 max_new_tokens_per_turn: Optional[int] = None, max_total_tokens: int = 1024,
                 max_observation_tokens: int = 128, max_total_observation_tokens: int = 0,
                 tool_timeout: Optional[float] = None, rollout: str = "chain", tree_branching: int = 2,
                 tree_max_nodes: int = 16, answer_regex: str = r"\S", tools_in_prompt: bool = True,
                 system_prompt: Optional[str] = None, filter_uniform_groups: bool = False,
                 tool_kwargs: Optional[dict[str, dict[str, Any]]] = None) -> None:
        check_int("group_size", group_size)
        check_int("max_turns", max_turns)
        if rollout not in ("chain", "tree"):
            raise ValueError(f"rollout must be 'chain' or 'tree', got {rollout!r}")
        if rollout == "tree" and (tree_branching < 1 or tree_max_nodes < tree_branching):
            raise ValueError(f"tree rollout needs tree_branching >= 1 and tree_max_nodes >= tree_branching, got "
                             f"{tree_branching}, {tree_max_nodes}")
        self.tokenizer = tokenizer
        self.group_size = group_size
        self.max_turns = max_turns
        self.per_turn = int(max_new_tokens_per_turn or gconfig.max_new_tokens)
        self.max_total_tokens = int(max_total_tokens)
        self.max_obs = int(max_observation_tokens)
        self.max_total_obs = int(max_total_observation_tokens)
        self.rollout = rollout if group_size > 1 else "chain"  # evaluation (one greedy sample) never branches
        self.k = int(tree_branching) if self.rollout == "tree" else 1
        self.max_nodes = int(tree_max_nodes)
        self.answer_re = re.compile(answer_regex)
        self.tools_in_prompt = tools_in_prompt
        self.system_prompt = system_prompt
        self.filter_uniform_groups = filter_uniform_groups
        tool_kwargs = tool_kwargs or {}
        specs = [{"name": t, **tool_kwargs[t]} if isinstance(t, str) and t in tool_kwargs else t for t in tools]
        self.toolset = ToolSet(specs, default_timeout=tool_timeout)
        self.parser = get_parser(parser)
        self.gconfig = agent_gconfig(gconfig, tokenizer, n=1, max_new_tokens=self.per_turn)
        self.eos_id = tokenizer.eos_token_id
        self.obs_encoder = ObservationEncoder(tokenizer)

    # -------------------------------------------------------------------------------------------- prompt
    def prompt_ids(self, prompt: dict[str, Any]) -> list[int]:
        messages = row_messages(prompt)
        if self.system_prompt and not any(m.get("role") == "system" for m in messages):
            messages = [{"role": "system", "content": self.system_prompt}] + messages
        kw: dict[str, Any] = {}
        if self.tools_in_prompt and self.toolset.names():
            kw["tools"] = self.toolset.schemas()
        return encode_chat(self.tokenizer, messages, **kw)

    # ---------------------------------------------------------------------------------------------- turns
    async def _generate(self, p: _Path, n: int, session: str, obs_queue: asyncio.Queue,
                        act_queue: asyncio.Queue) -> tuple[list[SampleOutput], int]:
        max_new = min(self.per_turn, self.max_total_tokens - len(p.builder))
        req = GenerateRequest(qid=new_id(f"{session}/t{p.turns}"), input_ids=p.builder.input_ids,
                              gconfig=self.gconfig.new(n=n, max_new_tokens=max_new,
                                                       min_new_tokens=min(self.gconfig.min_new_tokens, max_new)),
                              session_id=session)
        return (await generate(obs_queue, act_queue, req)).samples, max_new

    def _observation(self, p: _Path, results: list[ToolResult], errors: list[str]) -> tuple[list[int], str]:
        contents = [r.content for r in results] + [f"Error: {e}" for e in errors]
        ids, cut = self.obs_encoder.encode_truncated("tool", contents, self.max_obs)
        p.obs_truncated += cut
        names = sorted({r.name for r in results}) + (["error"] if errors else [])
        return ids, "observation:" + ",".join(names)

    async def _after_turn(self, p: _Path, sample: SampleOutput, max_new: int,
                          ctx: dict[str, Any]) -> tuple[Optional[str], float, dict]:
        """Process one generated turn of path `p` (already appended). Returns (termination or None to go on,
        reward, info)."""
        p.turns += 1
        if sample.finish_reason == "abort":
            return "abort", 0.0, {}
        text = self.tokenizer.decode(sample.output_ids.tolist(), skip_special_tokens=True)
        parsed: ParsedOutput = self.parser.parse(text)
        ended_on_eos = len(sample.output_ids) > 0 and int(sample.output_ids[-1]) == self.eos_id
        if sample.finish_reason == "length" and not ended_on_eos:
            p.turn_kinds.append("cut")
            return ("total_budget" if max_new < self.per_turn else "turn_budget"), 0.0, {}
        if parsed.unclosed or not (parsed.attempted or self.answer_re.search(parsed.content)):
            p.void_turns += 1
            p.turn_kinds.append("void")
            return "void_turn", 0.0, {}
        if not parsed.attempted:  # an answer
            p.turn_kinds.append("answer")
            if self.rollout == "chain":  # chain i uses member i of an env group; tree leaves in answer order
                index = int(p.path.split(".")[0])
            else:
                index = ctx["next_env"]
                ctx["next_env"] += 1
            target = await env_for(ctx["env"], index)
            _, reward, _, _, info = await target.step(parsed.content)
            return "answered", scalar_reward(reward), dict(info or {})
        p.turn_kinds.append("tool")
        p.tool_calls += len(parsed.calls) + len(parsed.errors)
        p.tool_errors += len(parsed.errors)
        p.by_tool.update(c.name for c in parsed.calls)
        if p.turns >= self.max_turns:
            return "max_turns", 0.0, {}
        results = await self.toolset.call_all(parsed.calls)
        p.tool_errors += sum(r.error for r in results)
        obs_ids, source = self._observation(p, results, parsed.errors)
        if self.max_total_obs and p.obs_tokens + len(obs_ids) > self.max_total_obs:
            return "observation_budget", 0.0, {}
        if len(p.builder) + len(obs_ids) >= self.max_total_tokens:
            return "total_budget", 0.0, {}
        p.builder.add_context(obs_ids, source=source)
        p.obs_tokens += len(obs_ids)
        return None, 0.0, {}

    def _finish(self, p: _Path, termination: str, reward: float, info: dict, group_id: str, pid: str) -> Trajectory:
        solved = bool(info.get("correct", False)) if termination == "answered" else False
        meta: dict[str, Any] = {"turns": p.turns, "tool_calls": p.tool_calls, "tool_errors": p.tool_errors,
                                "void_turns": p.void_turns, "obs_tokens": p.obs_tokens,
                                "obs_truncated": p.obs_truncated, "termination": termination, "solved": solved,
                                "first_correct": solved, "path": p.path, "prompt_id": pid,
                                "turn_kinds": ",".join(p.turn_kinds)}
        meta.update({f"tool_calls_{name}": int(p.by_tool.get(name, 0)) for name in self.toolset.names()})
        if info.get("error"):
            meta["reward_error"] = str(info["error"])
        return p.builder.build(reward=reward, group_id=group_id, turn_rewards=[reward], metadata=meta)

    # ----------------------------------------------------------------------------------------- rollouts
    async def _expand(self, p: _Path, n: int, ctx: dict[str, Any]) -> list[Trajectory]:
        """Generate `n` continuations of path `p` (one request: they share the prefix) and follow each."""
        session = f"{ctx['group_id']}/{p.path or 'root'}"
        samples, max_new = await self._generate(p, n, session, ctx["obs_queue"], ctx["act_queue"])
        children = []
        for i, s in enumerate(samples[:n]):
            c = p if (n == 1 and p.path) else p.fork(str(i))  # a single continuation keeps its path
            c.builder.add_generated(s)
            children.append((c, s))
        return [t for ts in await asyncio.gather(*(self._follow(c, s, max_new, ctx) for c, s in children))
                for t in ts]

    async def _follow(self, p: _Path, sample: SampleOutput, max_new: int, ctx: dict[str, Any]) -> list[Trajectory]:
        term, reward, info = await self._after_turn(p, sample, max_new, ctx)
        if term is not None:
            return [self._finish(p, term, reward, info, ctx["group_id"], ctx["pid"])]
        if len(p.builder) >= self.max_total_tokens:
            return [self._finish(p, "total_budget", 0.0, {}, ctx["group_id"], ctx["pid"])]
        n = self.k if self.k > 1 and ctx["nodes"] + self.k <= self.max_nodes else 1
        ctx["nodes"] += n
        return await self._expand(p, n, ctx)

    async def collect_trajectory(self, prompt: dict[str, Any], env: EnvironmentService, obs_queue: asyncio.Queue,
                                 act_queue: asyncio.Queue) -> list[Trajectory]:
        pid = str(prompt.get("id", "prompt"))
        group_id = new_id(pid)
        await env.reset(options=dict(prompt))
        root = _Path(TrajectoryBuilder(self.prompt_ids(prompt)), path="")
        first = self.group_size if self.rollout == "chain" else self.k
        ctx = {"group_id": group_id, "pid": pid, "env": env, "obs_queue": obs_queue, "act_queue": act_queue,
               "nodes": first, "next_env": 0}
        if len(root.builder) >= self.max_total_tokens:
            raise ValueError(f"prompt {pid!r} has {len(root.builder)} tokens, max_total_tokens is "
                             f"{self.max_total_tokens}")
        return filter_uniform(await self._expand(root, first, ctx), self.filter_uniform_groups)


register_agent("tool-agent", ToolAgent)
