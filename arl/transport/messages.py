"""Typed control messages between the controller and the roles.

On the wire they stay plain maps (``arl.transport.codec`` checks only that a control payload is a map), so the
transport and the fault/fuzz tests see the same frames as before. ``parse`` turns a received map into one of the
dataclasses below and raises ``ValueError`` for a missing or mistyped field: a peer's mistake must be counted and
dropped by the receiver, never crash it. Unknown keys are ignored (a newer peer may send more), except by
messages with an ``extra`` field, which keep them (an evaluation's result is free-form beyond its fixed fields).
No zmq here: the state machines and their tests use these types without sockets.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any, Awaitable, Callable, ClassVar, Literal, NewType, Optional, Union

Role = Literal["inference", "learner", "rollout", "env", "judge"]
ROLES: tuple[str, ...] = typing.get_args(Role)
Count = NewType("Count", int)  # an int that must not be negative

_SIMPLE: dict[Any, Callable[[Any], bool]] = {
    int: lambda v: type(v) is int, Count: lambda v: type(v) is int and v >= 0,
    float: lambda v: type(v) in (int, float), str: lambda v: type(v) is str,
    bool: lambda v: type(v) is bool, dict: lambda v: isinstance(v, dict), list: lambda v: isinstance(v, list),
    Any: lambda v: True,
}


def _checker(tp: Any) -> Callable[[Any], bool]:
    """A test for values of field type `tp` (int, Count, float, str, bool, dict, Any, list[...], Optional[...],
    Literal[...])."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return lambda v: v in args
    if origin is Union:
        inner = _checker(next(a for a in args if a is not type(None)))
        return lambda v: v is None or inner(v)
    if origin is list and args:
        item = _checker(args[0])
        return lambda v: isinstance(v, list) and all(item(x) for x in v)
    return _SIMPLE[origin or tp]


MESSAGES: dict[str, type["ControlMessage"]] = {}


@typing.dataclass_transform()
class ControlMessage:
    """Base of every control message: a subclass is a dataclass, registered in MESSAGES under its `TYPE`, the
    class name in snake case (GateAcquire: 'gate_acquire'), which names it on the wire; fields are its payload."""

    TYPE: ClassVar[str] = ""
    _SPEC: ClassVar[list[tuple[str, Callable[[Any], bool], bool, str]]] = []  # name, check, required, type name
    _EXTRA: ClassVar[bool] = False  # keeps unknown keys in its `extra` field

    def __init_subclass__(cls) -> None:
        dataclasses.dataclass(cls)
        hints = typing.get_type_hints(cls)
        cls._SPEC = [(f.name, _checker(hints[f.name]),
                      f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
                      str(hints[f.name]).replace("typing.", ""))
                     for f in dataclasses.fields(cls) if f.name != "extra"]
        cls._EXTRA = "extra" in hints
        cls.TYPE = re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower()
        MESSAGES[cls.TYPE] = cls

    @classmethod
    def from_payload(cls, payload: Any) -> "ControlMessage":
        if not isinstance(payload, dict):
            raise ValueError(f"{cls.TYPE}: payload is {type(payload).__name__}, not a map")
        kwargs: dict[str, Any] = {}
        for name, check, required, tp in cls._SPEC:
            if name not in payload:
                if required:
                    raise ValueError(f"{cls.TYPE}: missing field {name!r}")
            elif not check(payload[name]):
                raise ValueError(f"{cls.TYPE}.{name}: expected {tp}, got {payload[name]!r:.40}")
            else:
                kwargs[name] = payload[name]
        if cls._EXTRA:
            kwargs["extra"] = {k: v for k, v in payload.items() if k not in kwargs and k != "extra"}
        return cls(**kwargs)

    def to_payload(self) -> dict:
        fields = {name: getattr(self, name) for name, *_ in self._SPEC if getattr(self, name) is not None}
        return fields | getattr(self, "extra", {})


class Register(ControlMessage):
    role: Role
    index: int = 0
    address: Optional[str] = None
    pid: Optional[int] = None
    weights_store: Optional[str] = None  # learner, `broadcast` weight transport: its sender's store, "host:port"
    # a restarted learner: the checkpoint it resumed from (version, groups_consumed, data_position, groups_settled,
    # trajectories_settled; `arl.learner.worker.LearnerWorker.resume_after_loss`)
    resumed: Optional[dict] = None
    # what it runs: digests of the config it read and the model it loaded (`arl.utils.fingerprint`); one that is
    # not the run's is refused, named
    fingerprint: Optional[dict] = None


class Ack(ControlMessage):
    ok: bool = True
    message: Optional[str] = None  # a refusal's reason (ok=False): the process exits naming it
    # rollout: where its prompt streams continue ({stream id: `DataPosition` state}; `arl.rollout.prompts`)
    prompt_position: Any = None


class Heartbeat(ControlMessage):
    role: Role
    index: int = 0
    stats: dict = dataclasses.field(default_factory=dict)


class Lookup(ControlMessage):
    role: Optional[str] = None
    index: Optional[int] = None


class Addresses(ControlMessage):
    inference: list[Optional[str]]
    learner: Optional[str]
    env: Optional[list[Optional[str]]] = None  # env servers (env.servers > 0)
    judge: Optional[list[Optional[str]]] = None  # judge workers (judge.model.path set)
    retired: Optional[list[int]] = None  # inference servers scaled out of the run (`arl.ctl scale`): route none
    retired_env: Optional[list[int]] = None  # env servers scaled out of the run: open no session there
    # trainable listed policies' learners (`learner<k>`, k = 1..): each gets every group too (it trains its tokens)
    policy_learners: Optional[list[Optional[str]]] = None


class GateAcquire(ControlMessage):
    want: Count
    incarnation: Optional[str] = None  # the rollout worker process's id, which its group ids carry


class GateGrant(ControlMessage):
    n: int


class GroupDone(ControlMessage):
    accepted: bool
    reason: Optional[str] = None
    n_traj: int = 0
    reward_sum: float = 0.0
    seconds: float = 0.0
    traj_stats: Optional[dict] = None  # sums of numeric trajectory metadata, before filters
    n_traj_raw: Optional[float] = None
    traces: Optional[list[dict]] = None  # sampled or forced trajectory traces (arl.report.traces), for traces.jsonl
    error: Optional[str] = None  # a dropped group's error: message and innermost frames (arl.utils.errors)
    group_id: Optional[str] = None  # settles the group once, whichever of this and the learner's receipt is first
    size_bytes: Optional[int] = None  # reason 'too_large': the size of the group's frame


class GroupReceived(ControlMessage):
    """Learner -> controller: group `group_id` (of `n_traj` trajectories) is in the learner's buffer; this settles
    it as accepted even if its rollout worker dies before its group_done."""

    group_id: str
    n_traj: Count = Count(0)


class GroupsDropped(ControlMessage):
    n: Count
    reason: str = "learner"
    group_ids: Optional[list[str]] = None  # groups dropped on arrival, never reported received (settled first)


class WeightsPublished(ControlMessage):
    version: int
    path: str
    metrics: dict = dataclasses.field(default_factory=dict)


class UpdateWeights(ControlMessage):
    version: int
    path: str
    rollback: Optional[bool] = None  # load it even if a newer version is loaded (the learner went back)
    policy: Optional[str] = None  # a trainable listed policy's adapter (its own versions); None: the run's weights
    index: Optional[int] = None  # with `policy`: the one server it is for (several may share a process)


class WeightsLoaded(ControlMessage):
    version: int
    index: int
    ms: Optional[float] = None
    error: Optional[str] = None  # the load of `version` failed (the server keeps the weights it had)
    policy: Optional[str] = None  # the version is of this trainable listed policy (`UpdateWeights.policy`)


class JoinWeightGroup(ControlMessage):
    """Controller -> inference worker (the `broadcast` weight transport): join this group of the learner's weight sender
    (`arl.weights.group.GroupSpec` as a map); later `update_weights` (empty path) arrive through it. A fresh
    group name per worker incarnation, so a restarted worker never meets its dead predecessor's group."""

    index: int
    spec: dict


class OpenWeightGroup(ControlMessage):
    """Controller -> learner (broadcast): form group `name` with inference server `server` (closing that server's
    previous group, if any)."""

    name: str
    server: int


class SendWeights(ControlMessage):
    """Controller -> learner (broadcast): send the weights of at least `version` (the newest held) to the groups of
    `servers`, which were told `update_weights` for it."""

    version: int
    servers: list[int]


class PruneWeights(ControlMessage):
    """Controller -> learner, after the live version advanced: no inference server will read a weights file of a
    version below `below` again (every live one acked a newer version; a restarted one is sent the newest)."""

    below: Count


class GenAbort(ControlMessage):
    """Rollout worker -> inference worker, on the request socket: stop generating the request with wire id `qid`
    (sent by this peer) and send no answer; the client re-sent it elsewhere or gave up on it."""

    qid: str


class Eval(ControlMessage):
    version: int
    max_prompts: int = 0


class EvalDone(ControlMessage):
    version: int
    n: int
    first_acc: float
    solved_acc: float
    seconds: float = 0.0
    extra: dict = dataclasses.field(default_factory=dict)  # mean_turns, traj_means, errors, token_versions...


class Error(ControlMessage):
    message: Any = ""  # said as it came: a role's error text is only logged


class WorkerLost(ControlMessage):
    role: str
    indices: list[int]


class WorkerBack(ControlMessage):
    role: str
    index: int
    address: str


class WorkerDraining(ControlMessage):
    """Controller -> rollout worker: server `index` of `role` is leaving the run (scaled down, or its preemption
    notice): send it nothing new; what it has in flight finishes there (a `worker_lost` follows once it is gone)."""

    role: str
    index: int


class Drain(ControlMessage):
    """Controller -> rollout worker: it leaves the run (scaled down, or its preemption notice): ask the gate for no
    new groups and finish the running ones; the controller stops it once its heartbeat says none runs."""


class AdoptStreams(ControlMessage):
    """Controller -> rollout worker: draw the prompt streams of a worker that left too, from `streams` ({stream id:
    `DataPosition` state}, its last heartbeat's): what it had not finished is drawn again, then fresh prompts."""

    streams: dict


class Leaving(ControlMessage):
    """Inference process or rollout worker -> controller: it got a preemption notice (SIGTERM) and will stop within
    `grace_s`: drain it now (nothing new to its servers, whose unfinished requests the rollout workers re-send; a
    rollout worker finishes its groups and its prompt streams go on elsewhere)."""

    grace_s: float = 0.0


class Scale(ControlMessage):
    """`python -m arl.ctl <run> scale ...` -> controller: change the fleet by `changes` (role -> +n / -n);
    `token`: the run's control key (run_dir/control.key, readable by its owner only)."""

    token: str
    changes: dict


class Scaled(ControlMessage):
    """Controller -> `arl.ctl`: what the scale did (`ok`, `message`: the new fleet, or why nothing changed)."""

    ok: bool
    message: str = ""
    extra: dict = dataclasses.field(default_factory=dict)


class PromptSettled(ControlMessage):
    """Rollout worker -> learner, on the trajectory push socket: the group of `position` of prompt stream `worker` (a
    rollout worker's own stream has its index; `arl.rollout.prompts`) was dropped by a counted rule (`reason`), so
    the learner's checkpoint books the prompt as settled (`arl.data.position`) and a resume does not draw it
    again."""

    worker: int
    position: int
    reason: str = ""


class LearnerRestarted(ControlMessage):
    """Controller -> rollout worker: the lost learner is back at `address`, resumed from checkpoint `version`.
    Groups holding tokens of a later (lost) version are dropped; `position`: the checkpoint's data position entry
    for this worker (opaque here; `RolloutWorker.rewind_prompts`), None when it has none."""

    address: str
    version: Count
    position: Any = None
    policy_learner: Optional[int] = None  # k >= 1: the learner of the k-th trainable listed policy (no rewind)


class Shutdown(ControlMessage):
    reason: str = ""


class Metrics(ControlMessage):
    extra: dict = dataclasses.field(default_factory=dict)


SendControl = Callable[[ControlMessage], Awaitable[None]]  # how a role sends: `ControlChannel.post`, typed only


def parse(msg_type: str, payload: Any) -> ControlMessage:
    """The typed message for a received (type, map); ValueError for an unknown type or a bad payload."""
    cls = MESSAGES.get(msg_type)
    if cls is None:
        raise ValueError(f"unknown control message type {msg_type!r}")
    return cls.from_payload(payload)
