"""Weights transports: how each new policy version travels from the learner to the inference servers.

A transport is a strategy registered by name (`TRANSPORTS`: ``disk``, ``broadcast``; a user's registers the same
way, in a module passed via ``imports=[...]``). It has three sides, each built from plain values:

- the learner's (`LearnerSide`): `export` a version before the controller hears of it, `publish` it after,
  `prune` what no server reads again, plus the control commands it takes and the coroutines it runs;
- an inference server's (`InferenceSide`): `load` the version an ``update_weights`` names, plus its commands;
- the controller's (`ControllerSide`): what to send when a role registers, and `WeightSync`'s `Send` actions
  (``arl.controller.weight_sync``, which decides who gets which version whatever the transport) as messages.

The entries and the controller pick the transport by name (`make_transport`) and call it; nothing outside
`arl/weights/` branches on which one it is. No module here imports the control protocol (`arl.transport`);
this one imports no torch either: the config validates through it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Awaitable, Callable, Iterable, Optional, Protocol, Sequence

from arl.api.registry import Registry

__all__ = ["ControllerSide", "Export", "InferenceSide", "LearnerSide", "RunFacts", "TRANSPORTS", "Transport",
           "WeightsSettings", "make_transport", "weights_problems"]

Key = tuple[str, int]  # (role, index) of the role a message goes to
# control messages to send, in order: (role, index), type, payload (`arl.transport.messages`; the controller sends
# them typed, so this package needs no control protocol of its own)
Outgoing = list[tuple[Key, str, dict[str, Any]]]


@dataclasses.dataclass(frozen=True)
class WeightsSettings:
    """A run's choice of transport and its knobs (the config's ``weights`` section, resolved)."""

    transport: str = "disk"
    backend: str = "gloo"  # broadcast: the groups' backend, gloo or nccl
    bucket_bytes: int = 64 << 20  # broadcast: tensors travel in buckets of at most this size
    timeout_s: float = 120.0  # broadcast: longest wait of one group step
    receivers: str = "arl"  # what loads the weights on inference: 'arl' (a torch engine) or 'sglang' (its server)


@dataclasses.dataclass(frozen=True)
class RunFacts:
    """What a transport's checks may ask of the rest of the run (plain values the config fills in)."""

    inference_backend: str
    learner_trains: bool  # the learner trains a model (not the simulated one)
    servers_per_process: int
    backend_setting: str = "auto"  # weights.backend as configured, before 'auto' is resolved
    shared_gpu: Optional[str] = None  # why learner rank 0 and an inference server would share a GPU, if they would


@dataclasses.dataclass(frozen=True)
class Export:
    """One version as the learner exported it: `path` goes in ``weights_published`` (empty when the weights do not
    travel as a file), `weights` (a file path or a state dict) is what the final export is written from."""

    path: str
    weights: Any


class LearnerSide(Protocol):
    stats: dict[str, Any]  # merged into the learner's heartbeat
    activity: str  # what `export` does, for the heartbeat's waiting_on ("exporting weights")

    @property
    def handlers(self) -> dict[str, Callable[[Any], Any]]:
        """Control commands it takes besides ``prune_weights`` (type -> handler of the typed message)."""

    @property
    def registration(self) -> dict[str, Any]:
        """Fields it adds to the learner's ``register``."""

    async def export(self, version: int, engine: Any) -> Export:
        """`engine`'s weights as `version`, before the controller hears of it."""

    async def publish(self, version: int, export: Export) -> None:
        """`version` may go to inference now (the controller has been told, or it is a checkpoint's at resume)."""

    def prune(self, below: int) -> None:
        """No inference server reads a version below `below` again."""

    def coroutines(self) -> list[Awaitable[None]]:
        """What runs beside the learner's loop."""

    async def close(self) -> None: ...


class InferenceSide(Protocol):
    @property
    def handlers(self) -> dict[str, Callable[[Any], Awaitable[None]]]:
        """Control commands for this server (each names it by its ``index``), besides ``update_weights``."""

    def source(self, path: str) -> str:
        """Where a load of `path` reads from, for the log."""

    async def load(self, version: int, path: str) -> int:
        """Load `version` (at `path`, if it travels as a file) into the engine; returns the version now loaded."""

    async def close(self) -> None: ...


class SendLike(Protocol):  # `arl.controller.weight_sync.Send`
    server: int
    version: int
    path: str
    rollback: bool  # load it even though the server has a newer version (the learner restarted from a checkpoint)


class ControllerSide(Protocol):
    #: (optional, default False) servers may join the run after the learner started (`arl.ctl scale`)
    def on_register(self, msg: Any, registered: Callable[[Key], bool]) -> Outgoing:
        """Role `msg.role` / `msg.index` registered (`msg`, a ``Register``; `registered` says which roles are):
        what to send. Called after its ack."""

    def updates(self, sends: Sequence[SendLike], registered: Callable[[Key], bool]) -> Outgoing:
        """`WeightSync`'s `Send` actions as messages."""

    def resume_path(self, version: int) -> str:
        """The path ``update_weights`` carries for the checkpoint's weights a resumed learner published."""


class Transport:
    """One way weights travel, configured by `settings`: its checks and the builders of its three sides. A
    subclass registered under its `name` overrides what it needs."""

    name = ""
    # each version reaches the inference servers as a folder they load by path (SGLang loads a LoRA adapter only
    # so, /load_lora_adapter); a transport that streams tensors leaves it False
    carries_folders = False

    def __init__(self, settings: WeightsSettings) -> None:
        self.settings = settings

    def problems(self, run: RunFacts) -> list[str]:
        """Why this transport cannot serve `run` (config errors), none when it can."""
        return []

    def fallback(self, run: RunFacts) -> Optional[tuple[str, str]]:
        """Another transport `run` uses instead, and why (None: this one)."""
        return None

    def learner(self, *, weights_dir: str, keep_versions: int, host: str, secret: Optional[bytes], device: Any,
                skip_names: Callable[[], Iterable[str]]) -> LearnerSide:
        """Learner rank 0's side. `weights_dir`: the run's weights folder; `keep_versions`: files kept whatever
        the controller says; `host`: this machine's address on the run's interface; `device`: the engine's;
        `skip_names`: names of tied copies a state dict may leave out."""
        raise NotImplementedError

    def inference(self, engine: Any, *, host: str, secret: Optional[bytes]) -> InferenceSide:
        """The side of the inference server that serves `engine`."""
        raise NotImplementedError

    def controller(self, *, weights_dir: str, num_servers: int, secret: Optional[bytes]) -> ControllerSide:
        """The controller's side for `num_servers` inference servers."""
        raise NotImplementedError


TRANSPORTS: Registry[type[Transport]] = Registry("weights transport",
                                                 "arl.weights.strategy.TRANSPORTS.register(name, cls)")
# the built-ins, imported when first used (their modules import this one)
TRANSPORTS.register_lazy("disk", "arl.weights.disk:DiskTransport")
TRANSPORTS.register_lazy("broadcast", "arl.weights.broadcast:BroadcastTransport")


def make_transport(settings: WeightsSettings) -> Transport:
    """The transport `settings` names, configured by them; raises `RegistryError` listing the known names."""
    return TRANSPORTS.get(settings.transport)(settings)


def weights_problems(settings: WeightsSettings, run: RunFacts) -> list[str]:
    """Config errors of the chosen transport: an unknown name, or what the transport itself refuses."""
    if settings.transport not in TRANSPORTS:
        return [f"weights.transport: {TRANSPORTS.unknown(settings.transport)}"]
    return make_transport(settings).problems(run)
