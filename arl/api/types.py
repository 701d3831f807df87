"""Data contracts exchanged between roles.

Token arrays are numpy arrays (int32 ids, float32 logprobs) so the transport can ship them as raw bytes and
nobody is tempted to decode and re-encode text.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from typing import Any, Optional, Sequence

import numpy as np

FINISH_REASONS = ("stop", "length", "abort")


def as_int32(x: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, dtype=np.int32).reshape(-1))


def as_float32(x: Sequence[float] | np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32).reshape(-1))


def _reward_number(x: Any, finite: bool = True) -> float:
    """One reward value: a number (int, float, bool, numpy/torch scalar); not a string, not a sequence."""
    if isinstance(x, (str, bytes)) or isinstance(x, (list, tuple, dict, set)) or getattr(x, "ndim", 0) > 0:
        raise ValueError(f"a reward must be a number, got {type(x).__name__} {x!r:.60}")
    try:
        v = float(x)
    except (TypeError, ValueError):
        raise ValueError(f"a reward must be a number, got {type(x).__name__} {x!r:.60}") from None
    if finite and not math.isfinite(v):
        raise ValueError(f"a reward must be finite, got {v!r}")
    return v


def _reward_items(value: Any) -> Optional[list[Any]]:
    """The items of a flat reward sequence (list, tuple, 1-D array), or None if `value` is not a sequence."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, np.ndarray) and value.ndim == 1:
        return value.tolist()
    return None


def one_reward(value: Any, what: str = "reward") -> float:
    """One answer's reward as a trajectory holds it: a number or a one-element sequence of one (a per-answer
    list), non-finite values kept (the learner's validation refuses them). ValueError otherwise."""
    items = _reward_items(value)
    if items is not None and len(items) != 1:
        raise ValueError(f"{what} must be one number (this trajectory's answer), got {len(items)} values "
                         f"{value!r:.60}")
    return _reward_number(items[0] if items is not None else value, finite=False)


def checked_turn_discount(value: Any) -> Optional[float]:
    """`Trajectory.turn_discount` as the learner takes it: None, or a number in [0, 1]. ValueError otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"Trajectory.turn_discount must be a number in [0, 1] or None, got {value!r:.60}")
    gamma = float(value)
    if not 0.0 <= gamma <= 1.0:  # NaN fails this too
        raise ValueError(f"Trajectory.turn_discount must be in [0, 1], got {gamma}")
    return gamma


# a named policy (`GenerateRequest.policy`, `policies:`): it names an SGLang adapter and its folder
POLICY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def checked_policy_spans(spans: Any, n: int) -> list[tuple[str, int, int]]:
    """`Trajectory.policy_spans` as the learner takes them: ``(policy, start, end)`` with a non-empty name and
    ``0 <= start < end <= n``, in order and not overlapping. ValueError otherwise."""
    out: list[tuple[str, int, int]] = []
    if not isinstance(spans, (list, tuple)):
        raise ValueError(f"Trajectory.policy_spans must be a list of (policy, start, end), got {spans!r:.60}")
    for span in spans:
        if not isinstance(span, (list, tuple)) or len(span) != 3:
            raise ValueError(f"Trajectory.policy_spans: each span is (policy, start, end), got {span!r:.60}")
        name, start, end = span
        if not isinstance(name, str) or not name:
            raise ValueError(f"Trajectory.policy_spans: a span's policy must be a non-empty name, got {name!r:.60}")
        if any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) for x in (start, end)):
            raise ValueError(f"Trajectory.policy_spans: start and end must be integers, got {span!r:.60}")
        start, end = int(start), int(end)
        if not 0 <= start < end <= n or (out and start < out[-1][2]):
            raise ValueError(f"Trajectory.policy_spans: span ({name!r}, {start}, {end}) is outside the {n} tokens, "
                             "empty, or overlaps or precedes the span before it")
        out.append((name, start, end))
    return out


def checked_policy_rewards(rewards: Any) -> dict[str, float]:
    """`Trajectory.policy_rewards`: policy name -> one reward (`one_reward`'s rules). ValueError otherwise."""
    if not isinstance(rewards, dict):
        raise ValueError(f"Trajectory.policy_rewards must be a dict of policy name -> reward, got {rewards!r:.60}")
    out = {}
    for name, r in rewards.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"Trajectory.policy_rewards: keys are policy names, got {name!r:.60}")
        try:
            out[name] = one_reward(r, f"Trajectory.policy_rewards[{name!r}]")
        except ValueError as e:
            raise ValueError(f"Trajectory.policy_rewards[{name!r}]: {e}") from None
    return out


def check_reward(value: Any) -> float | list[float]:
    """An environment's reward as `step` may return it: one finite number, or (AReaL's stateless envs, whose
    ``step((qid, answers))`` rewards every answer) a non-empty flat sequence of finite numbers, one per answer.
    Raises ValueError for anything else (NaN, infinity, strings, nested or empty sequences)."""
    items = _reward_items(value)
    if items is None:
        return _reward_number(value)
    if not items:
        raise ValueError("a reward sequence must hold one number per answer, got an empty one")
    return [_reward_number(x) for x in items]


def scalar_reward(value: Any) -> float:
    """The reward of one answer: a finite number, or a one-element sequence of one (a per-answer list from an env
    that was sent one answer). Raises ValueError otherwise."""
    r = check_reward(value)
    if isinstance(r, list):
        if len(r) != 1:
            raise ValueError(f"expected the reward of one answer, got {len(r)} rewards {r!r:.60}")
        return r[0]
    return r


@dataclasses.dataclass
class GenerationConfig:
    """Sampling parameters of one request. `greedy=True` overrides temperature/top-p/top-k."""

    n: int = 1
    max_new_tokens: int = 16
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    greedy: bool = False
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field (bad input must not reach the engine)."""
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"GenerationConfig.n must be an int >= 1, got {self.n!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"GenerationConfig.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.min_new_tokens, int) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"GenerationConfig.min_new_tokens must be in [0, max_new_tokens], got "
                             f"{self.min_new_tokens!r}")
        finite_temperature = isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
        if not finite_temperature or (self.temperature <= 0 and not self.greedy):
            raise ValueError(f"GenerationConfig.temperature must be > 0 (or greedy=True), got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"GenerationConfig.top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"GenerationConfig.top_k must be an int >= 0, got {self.top_k!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"GenerationConfig.stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")

    def new(self, **kwargs: Any) -> "GenerationConfig":
        return dataclasses.replace(self, **kwargs)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GenerationConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown GenerationConfig fields {sorted(unknown)}; known: {sorted(names)}")
        g = cls(**d)
        g.stop_token_ids = [int(t) for t in g.stop_token_ids]
        return g


@dataclasses.dataclass
class GenerateRequest:
    """One prompt to complete. `session_id` keeps the turns of one multi-turn chat on one worker; `policy` names
    the policy that answers (None: the engine's own weights; a LoRA policy it serves beside them by its name)."""

    qid: str
    input_ids: np.ndarray
    gconfig: GenerationConfig = dataclasses.field(default_factory=GenerationConfig)
    session_id: Optional[str] = None
    policy: Optional[str] = None

    def __post_init__(self) -> None:
        self.input_ids = as_int32(self.input_ids)


@dataclasses.dataclass
class SampleOutput:
    output_ids: np.ndarray
    output_logprobs: np.ndarray
    output_versions: np.ndarray  # policy version that produced each token
    finish_reason: str  # one of FINISH_REASONS

    def __post_init__(self) -> None:
        self.output_ids = as_int32(self.output_ids)
        self.output_logprobs = as_float32(self.output_logprobs)
        self.output_versions = as_int32(self.output_versions)
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")
        if not len(self.output_ids) == len(self.output_logprobs) == len(self.output_versions):
            raise ValueError("output_ids, output_logprobs and output_versions must have equal lengths")


@dataclasses.dataclass
class GenerateResponse:
    """The answer to one GenerateRequest: `n` samples, or an `error` if the request was refused."""

    qid: str
    samples: list[SampleOutput] = dataclasses.field(default_factory=list)
    error: Optional[str] = None

    @property
    def output_ids(self) -> list[np.ndarray]:
        return [s.output_ids for s in self.samples]


@dataclasses.dataclass
class Trajectory:
    """One sequence the learner trains on, tokens exactly as generated or inserted.

    `logprobs` and `versions` are defined where `loss_mask` is 1 (elsewhere 0 and -1).

    `turn_discount` is the agent's word on how its `turn_rewards` credit its turns: each turn's tokens get the
    reward-to-go ``G_t = r_t + turn_discount * G_{t+1}`` (0: each turn by its own reward, for turns that are each a
    whole answer judged on its own; near 1: env steps toward a final reward). None: every token shares `reward`.
    `learner.ppo.turn_discount`, when set, overrides it for every trajectory.

    Several policies (`docs/multi_policy.md`): `policy_spans` says which tokens a named policy generated,
    ``(policy, start, end)`` each; generated tokens outside every span are the run's own policy's. The learner of a
    policy trains only its own tokens (the others' are context). `policy_rewards` gives a policy a reward of its
    own for this trajectory (a zero-sum game: ``{"white": 1.0, "black": -1.0}``); a policy it does not name gets
    `reward`.
    """

    input_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    reward: float
    group_id: str
    turn_rewards: list[float] = dataclasses.field(default_factory=list)
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    turn_discount: Optional[float] = None
    policy_spans: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)
    policy_rewards: dict[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.input_ids = as_int32(self.input_ids)
        self.loss_mask = np.ascontiguousarray(np.asarray(self.loss_mask, dtype=np.int8).reshape(-1))
        self.logprobs = as_float32(self.logprobs)
        self.versions = as_int32(self.versions)
        n = len(self.input_ids)
        if not (len(self.loss_mask) == len(self.logprobs) == len(self.versions) == n):
            raise ValueError(
                f"Trajectory arrays must share one length: input_ids={n} loss_mask={len(self.loss_mask)} "
                f"logprobs={len(self.logprobs)} versions={len(self.versions)}"
            )
        # one number per trajectory (a one-element per-answer list is that number); non-finite values are left
        # for the learner's validation to refuse with the trajectory's index. A turn's reward is taken the same way.
        self.reward = one_reward(self.reward, "Trajectory.reward")
        self.turn_rewards = [one_reward(r, "Trajectory.turn_rewards") for r in self.turn_rewards]
        self.turn_discount = checked_turn_discount(self.turn_discount)
        self.policy_spans = checked_policy_spans(self.policy_spans, n)
        self.policy_rewards = checked_policy_rewards(self.policy_rewards)

    def owned_by(self, policy: Optional[str]) -> np.ndarray:
        """Boolean mask of the tokens `policy` generated (None: the run's own policy, every generated token outside
        the named spans)."""
        generated = self.loss_mask.astype(bool)
        if not self.policy_spans:  # one policy's trajectory (every run's today): all of it or none
            return generated if policy is None else np.zeros_like(generated)
        named = np.zeros(len(self.input_ids), bool)
        mine = np.zeros(len(self.input_ids), bool)
        for name, start, end in self.policy_spans:
            named[start:end] = True
            if name == policy:
                mine[start:end] = True
        return generated & (mine if policy is not None else ~named)

    def reward_of(self, policy: Optional[str]) -> float:
        """This trajectory's reward for `policy`: its own in `policy_rewards`, else `reward`."""
        return self.policy_rewards.get(policy, self.reward) if policy is not None else self.reward

    @property
    def num_generated(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def has_void_turn(self) -> bool:
        """The agent reported a void turn (`metadata["void_turns"]`): the rollout filter drops it, traces say so."""
        return int(self.metadata.get("void_turns", 0) or 0) > 0


class TrajectoryBuilder:
    """Accumulates prompt, generated and inserted tokens with their masks, so agents never re-tokenise."""

    def __init__(self, prompt_ids: Sequence[int] | np.ndarray) -> None:
        self._ids: list[np.ndarray] = []
        self._mask: list[np.ndarray] = []
        self._logp: list[np.ndarray] = []
        self._ver: list[np.ndarray] = []
        self._ledger: list[list[Any]] = []  # [source, start, end]: where every token came from (token ledger)
        self._spans: list[tuple[str, int, int]] = []  # (policy, start, end) of named policies' samples
        self._len = 0
        self.add_context(prompt_ids, source="prompt")

    def _record(self, source: str, n: int) -> None:
        self._ledger.append([source, self._len, self._len + n])
        self._len += n

    def add_context(self, ids: Sequence[int] | np.ndarray, source: str = "context") -> None:
        """Tokens the model did not generate (prompt, template, feedback, tool output): loss_mask 0. `source`
        names where they came from in the trajectory's token ledger (`metadata["token_ledger"]`)."""
        if not isinstance(source, str) or not source or source == "engine":
            raise ValueError(f"add_context: source must be a non-empty name other than 'engine', got {source!r}")
        ids = as_int32(ids)
        self._ids.append(ids)
        self._mask.append(np.zeros(len(ids), np.int8))
        self._logp.append(np.zeros(len(ids), np.float32))
        self._ver.append(np.full(len(ids), -1, np.int32))
        self._record(source, len(ids))

    def add_generated(self, sample: SampleOutput, policy: Optional[str] = None) -> None:
        """A sample exactly as the engine returned it: loss_mask 1, source "engine" in the token ledger. `policy`:
        the named policy that generated it (its request's `GenerateRequest.policy`; None: the run's own)."""
        if policy is not None and len(sample.output_ids):
            self._spans.append((policy, self._len, self._len + len(sample.output_ids)))
        self._ids.append(sample.output_ids)
        self._mask.append(np.ones(len(sample.output_ids), np.int8))
        self._logp.append(sample.output_logprobs)
        self._ver.append(sample.output_versions)
        self._record("engine", len(sample.output_ids))

    def copy(self) -> "TrajectoryBuilder":
        """An independent builder with the same tokens so far (branching rollouts share a prefix)."""
        other = copy.copy(self)  # the token arrays are shared: nothing writes into them
        other._ids, other._mask, other._logp, other._ver = map(list, (self._ids, self._mask, self._logp, self._ver))
        other._ledger = self.ledger
        other._spans = list(self._spans)
        return other

    @property
    def ledger(self) -> list[list[Any]]:
        return [list(e) for e in self._ledger]

    @property
    def input_ids(self) -> np.ndarray:
        return np.concatenate(self._ids) if self._ids else np.zeros(0, np.int32)

    def __len__(self) -> int:
        return self._len

    def build(self, reward: float, group_id: str, **kw: Any) -> Trajectory:
        kw["metadata"] = {**(kw.get("metadata") or {}), "token_ledger": self.ledger}
        if self._spans:
            kw.setdefault("policy_spans", list(self._spans))
        return Trajectory(input_ids=self.input_ids, loss_mask=np.concatenate(self._mask),
                          logprobs=np.concatenate(self._logp), versions=np.concatenate(self._ver), reward=reward,
                          group_id=group_id, **kw)
