"""Weight transports are strategies picked by name: an unknown name is refused naming the registered ones, and a
transport registered here (a pigeon post: no file, no group) plugs into the config, the controller, both role
entries and the learner's loop without any other file knowing it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, Awaitable, Callable, Iterable, Optional, Sequence

import pytest

from arl.api.registry import RegistryError
from arl.api.types import Trajectory
from arl.config import ConfigError, ExperimentConfig, parse_overrides, resolve_weights
from arl.transport import messages as m
from arl.weights.strategy import TRANSPORTS, Export, Key, Outgoing, Transport, WeightsSettings, make_transport

from ..controller.test_controller_faults import make_controller

NAME = "pigeon-test"


class PigeonLearner:
    activity = "feeding pigeons"

    def __init__(self) -> None:
        self.stats = {"pigeons_sent": 0}
        self.published: list[tuple[int, Any]] = []
        self.asked: list[Any] = []
        self.pruned: list[int] = []

    @property
    def handlers(self) -> dict[str, Callable[[Any], Any]]:
        return {"send_weights": self.asked.append}

    @property
    def registration(self) -> dict[str, Any]:
        return {"weights_store": "loft:1"}

    async def export(self, version: int, engine: Any) -> Export:
        return Export(f"pigeon:{version}", {"version": version})

    async def publish(self, version: int, export: Export) -> None:
        self.published.append((version, export.weights))
        self.stats["pigeons_sent"] += 1

    def prune(self, below: int) -> None:
        self.pruned.append(below)

    async def fly(self) -> None:
        await asyncio.Event().wait()

    def coroutines(self) -> list[Awaitable[None]]:
        return [self.fly()]

    async def close(self) -> None:
        pass


class PigeonLoader:
    def __init__(self, engine: Any) -> None:
        self.engine, self.joined, self.loaded, self.closed = engine, [], [], False

    @property
    def handlers(self) -> dict[str, Callable[[Any], Awaitable[None]]]:
        async def join(msg: Any) -> None:
            self.joined.append(msg.spec)
        return {"join_weight_group": join}

    def source(self, path: str) -> str:
        return f"a pigeon ({path})"

    async def load(self, version: int, path: str) -> int:
        self.loaded.append((version, path))
        return version

    async def close(self) -> None:
        self.closed = True


class PigeonLink:
    def on_register(self, msg: Any, registered: Callable[[Key], bool]) -> Outgoing:
        if msg.role != "inference":
            return []
        return [(("inference", msg.index), "join_weight_group", {"index": msg.index, "spec": {"loft": "north"}})]

    def updates(self, sends: Sequence[Any], registered: Callable[[Key], bool]) -> Outgoing:
        out: Outgoing = [(("inference", s.server), "update_weights", {"version": s.version, "path": s.path})
                         for s in sends]
        if sends:
            out.append((("learner", 0), "send_weights", {"version": sends[0].version,
                                                         "servers": [s.server for s in sends]}))
        return out

    def resume_path(self, version: int) -> str:
        return f"pigeon:{version}"


class Pigeon(Transport):
    name = NAME
    built: list[Any] = []

    def learner(self, *, weights_dir: str, keep_versions: int, host: str, secret: Optional[bytes], device: Any,
                skip_names: Callable[[], Iterable[str]]) -> PigeonLearner:
        Pigeon.built.append(side := PigeonLearner())
        return side

    def inference(self, engine: Any, *, host: str, secret: Optional[bytes]) -> PigeonLoader:
        Pigeon.built.append(side := PigeonLoader(engine))
        return side

    def controller(self, *, weights_dir: str, num_servers: int, secret: Optional[bytes]) -> PigeonLink:
        return PigeonLink()


TRANSPORTS.register(NAME, Pigeon)
SIM = [f"weights.transport={NAME}", "inference.backend=sim", "learner.backend=sim"]


def test_an_unknown_transport_is_refused_naming_the_registered_ones():
    with pytest.raises(RegistryError, match=r"unknown weights transport 'carrier'; registered weights transports: "
                                            r"\[.*'broadcast', 'disk'.*\]"):
        make_transport(WeightsSettings("carrier"))
    with pytest.raises(ConfigError, match=r"weights.transport: unknown weights transport 'carrier'.*'broadcast', "
                                          r"'disk'"):
        parse_overrides(ExperimentConfig, ["weights.transport=carrier"])


def test_the_built_in_transports_are_registered_under_their_names():
    assert make_transport(WeightsSettings("disk")).name == "disk"
    assert make_transport(WeightsSettings("broadcast", backend="nccl")).settings.backend == "nccl"


@pytest.mark.asyncio
async def test_a_registered_transport_plugs_into_the_config_and_the_controller(tmp_path):
    cfg = parse_overrides(ExperimentConfig, SIM)
    assert resolve_weights(cfg) == (cfg, None) and cfg.weights.transport == NAME
    ctl = make_controller(tmp_path, weights_settings=WeightsSettings(NAME))
    await ctl._dispatch(b"L", "register", {"role": "learner", "address": "tcp://l:1", "weights_store": "loft:1"})
    await ctl._dispatch(b"i0", "register", {"role": "inference", "index": 0, "address": "tcp://i:0"})
    ours = ("join_weight_group", "update_weights", "send_weights")
    assert [(i, t, p) for i, t, p in ctl.router.sent if t in ours] == [
        (b"i0", "join_weight_group", {"index": 0, "spec": {"loft": "north"}})]
    ctl.router.sent.clear()
    await ctl._dispatch(b"L", "weights_published", {"version": 1, "path": "pigeon:1"})
    assert [(i, t, p) for i, t, p in ctl.router.sent if t in ours] == [
        (b"i0", "update_weights", {"version": 1, "path": "pigeon:1"}),
        (b"L", "send_weights", {"version": 1, "servers": [0]})]
    ctl.reporter.close()


class FakeChannel:
    """The role's side of the control channel, without a controller: records what the entry set up."""

    def __init__(self) -> None:
        self.handlers: dict[str, Callable[[Any], Any]] = {}
        self.registered: list[dict] = []
        self.sent: list[tuple[str, dict]] = []

    async def post(self, msg: Any) -> None:  # typed control messages only (tests/typed_control.py)
        self.sent.append((msg.TYPE, msg.to_payload()))

    async def register(self, timeout: float, **fields: Any) -> dict:
        self.registered.append(fields)
        return {"ok": True}

    async def heartbeat(self, stats: Callable[[], dict], index: Optional[int] = None) -> None:
        await asyncio.Event().wait()


async def finish(coros: list, cleanups: list) -> None:
    for c in coros:
        c.close()
    await asyncio.gather(*cleanups)


@pytest.mark.asyncio
async def test_a_registered_transport_plugs_into_the_role_entries(tmp_path):
    from arl.inference.entry import run_inference
    from arl.learner.entry import run_learner

    cfg = parse_overrides(ExperimentConfig, SIM)
    Pigeon.built.clear()
    ctl = FakeChannel()
    coros, cleanups = await run_inference(cfg, ctl, 0, str(tmp_path))  # type: ignore[arg-type]
    try:
        [loader] = Pigeon.built
        assert isinstance(loader, PigeonLoader) and loader.engine is not None
        await ctl.handlers["join_weight_group"](m.JoinWeightGroup(index=0, spec={"loft": "north"}))
        await ctl.handlers["update_weights"](m.UpdateWeights(version=1, path="pigeon:1"))
        assert loader.joined == [{"loft": "north"}] and loader.loaded == [(1, "pigeon:1")]
        assert [(t, p["version"]) for t, p in ctl.sent if t == "weights_loaded"] == [("weights_loaded", 1)]
    finally:
        await finish(coros, cleanups)
    assert loader.closed

    Pigeon.built.clear()
    ctl = FakeChannel()
    coros, cleanups = await run_learner(cfg, ctl, 0, str(tmp_path))  # type: ignore[arg-type]
    try:
        [side] = Pigeon.built
        assert ctl.registered[0]["weights_store"] == "loft:1"
        ctl.handlers["send_weights"]("asked")
        ctl.handlers["prune_weights"](m.PruneWeights(below=3))
        assert side.asked == ["asked"] and side.pruned == [3]
        assert any(getattr(c, "__name__", "") == "fly" for c in coros)
    finally:
        await finish(coros, cleanups)


@pytest.mark.asyncio
async def test_the_learner_loop_publishes_through_the_transport():
    from arl.learner.worker import LearnerWorker

    engine = SimpleNamespace(version=0)

    def ppo_update(batch: Any) -> dict:
        engine.version += 1
        return {}

    actor = SimpleNamespace(engine=engine, prepare=lambda t: t, compute_logp=lambda b: None,
                            compute_advantages=lambda b: None, ppo_update=ppo_update)
    groups = [[Trajectory(input_ids=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1], logprobs=[0, 0, -1.0, -1.0],
                          versions=[-1, -1, 0, 0], reward=float(j), group_id=f"w0.g{g}:{j}") for j in range(2)]
              for g in range(2)]
    sent: list = []

    async def send(msg: Any) -> None:  # typed control messages, as the role's channel takes them
        sent.append((msg.TYPE, msg.to_payload()))

    side = PigeonLearner()
    w = LearnerWorker(actor=actor, pull=None, send_control=send, batch_size=1, total_steps=2, weights=side)
    w.buffer.extend(groups)
    await asyncio.wait_for(w.train(), 30)
    assert [p["path"] for t, p in sent if t == "weights_published"] == ["pigeon:1", "pigeon:2"]
    assert side.published == [(1, {"version": 1}), (2, {"version": 2})]
    assert w.heartbeat_stats()["pigeons_sent"] == 2


class FolderPigeon(Pigeon):
    """A pigeon that carries each version as a folder the server loads by path."""

    name = f"{NAME}-folders"
    carries_folders = True


TRANSPORTS.register(FolderPigeon.name, FolderPigeon)


def test_lora_with_sglang_asks_the_transport_whether_it_carries_folders():
    """SGLang loads each version's LoRA adapter from a folder: the config asks the transport whether it delivers
    one (`Transport.carries_folders`), not which transport it is, so a registered one that does is accepted."""
    lora = ["inference.backend=sglang", "learner.lora.rank=8", "learner.backend=deepspeed"]
    assert make_transport(WeightsSettings("disk")).carries_folders
    assert not make_transport(WeightsSettings("broadcast")).carries_folders
    assert parse_overrides(ExperimentConfig, [*lora, f"weights.transport={FolderPigeon.name}"]).learner.lora.rank == 8
    for name in (NAME, "broadcast"):
        with pytest.raises(ConfigError, match=rf"inference.backend=sglang needs a weights.transport that carries each "
                                              rf"version as a folder.*weights.transport={name} does not.*disk"):
            parse_overrides(ExperimentConfig, [*lora, f"weights.transport={name}"])
    assert parse_overrides(ExperimentConfig, [*lora, "weights.transport=disk"]).weights.transport == "disk"
