"""Weights over NCCL, checked without a GPU: buckets live on the device the sender / receiver declares (NCCL takes
CUDA tensors only, on the group's GPU), waits synchronise the group's own stream (never the learner's training
stream), a send waits for its packing by event, and a learner that shares a GPU with an inference server never gets
NCCL (auto: disk; forced: a config error)."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from arl.config import ConfigError, ExperimentConfig, parse_overrides, weights_settings
from arl.weights import group as bc
from arl.weights import sender as sender_mod
from arl.weights.group import Group, WeightTransferError
from arl.weights.plan import Packed, make_plan
from arl.weights.sender import WeightSender
from arl.weights.channel import BroadcastLoader, WeightPublisher

BROADCAST = ["weights.transport=broadcast"]


def cfg(*overrides: str) -> ExperimentConfig:
    return parse_overrides(ExperimentConfig, [*BROADCAST, *overrides])


def recording_allocate(seen: list) -> Any:
    """`Packed.allocate` that records the device asked for and allocates on the CPU (no GPU here)."""
    def allocate(cls: Any, plan: Any, device: Any = "cpu") -> Packed:
        seen.append(torch.device(device))
        return Packed(plan, [torch.empty(plan.bucket_nbytes(k), dtype=torch.uint8) for k in range(len(plan.buckets))])
    return classmethod(allocate)


def test_an_nccl_sender_packs_its_buckets_on_its_gpu(monkeypatch):
    """The publisher packed into CPU buffers whenever the sender had no explicit device: NCCL refuses them."""
    seen: list = []
    monkeypatch.setattr(Packed, "allocate", recording_allocate(seen))
    sender = WeightSender("127.0.0.1", 0, backend="nccl", timeout_s=5)
    try:
        WeightPublisher(sender)._pack({"a": torch.ones(3)})
    finally:
        sender.close()
    assert seen == [torch.device("cuda")]
    with pytest.raises(ValueError, match="CUDA"):
        WeightSender("127.0.0.1", 0, backend="nccl", device="cpu")


def test_the_learner_sender_packs_on_the_engines_device(monkeypatch):
    """run_learner built its WeightSender without a device: the learner's GPU must reach the sender."""
    from arl.weights.strategy import make_transport

    def publisher(c: ExperimentConfig, device: torch.device) -> WeightPublisher:
        side = make_transport(weights_settings(c)).learner(weights_dir="", keep_versions=1, host="127.0.0.1",
                                                           secret=None, device=device, skip_names=set)
        return side.publisher  # type: ignore[attr-defined]

    seen: list = []
    monkeypatch.setattr(Packed, "allocate", recording_allocate(seen))
    pub = publisher(cfg("weights.backend=nccl", "inference.device=cuda:1"), torch.device("cuda:0"))
    try:
        assert pub.sender.backend == "nccl" and pub.sender.device == torch.device("cuda:0")
        pub._pack({"a": torch.ones(3)})
        assert seen == [torch.device("cuda:0")]
    finally:
        pub.close()
    pub = publisher(cfg("weights.backend=gloo"), torch.device("cuda:0"))
    try:  # gloo: CPU buckets whatever the engine's device
        assert pub.sender.device == torch.device("cpu")
    finally:
        pub.close()


@pytest.mark.asyncio
async def test_an_nccl_receiver_receives_on_the_engines_gpu(monkeypatch):
    """The inference side built its WeightReceiver without a device: NCCL would receive on the current GPU, not
    the engine's."""
    made: list = []

    class Recorder:
        def __init__(self, spec: Any, **kw: Any) -> None:
            made.append(kw)

        def join(self) -> None:
            pass

        def close(self) -> None:
            pass

    monkeypatch.setattr("arl.weights.channel.WeightReceiver", Recorder)
    engine = SimpleNamespace(device=torch.device("cuda:1"), update_weights_from_tensors=None)
    loader = BroadcastLoader(engine, timeout_s=5)
    await loader.join(bc.GroupSpec("127.0.0.1", 1, "g", backend="nccl"))
    await loader.join(bc.GroupSpec("127.0.0.1", 1, "g2", backend="gloo"))
    await loader.close()
    assert [kw["device"] for kw in made] == [torch.device("cuda:1"), None]


def _pair(name: str = "g") -> tuple[WeightSender, Group, Group]:
    """A gloo group of two in this process: the sender's group and a receiver's."""
    sender = WeightSender("127.0.0.1", 0, timeout_s=20, gloo_host="127.0.0.1")
    rx: dict[str, Group] = {}
    t = threading.Thread(target=lambda: rx.setdefault("g", Group(bc.store_client("127.0.0.1", sender.port, 20), name,
                                                                 1, 2, timeout_s=20, gloo_host="127.0.0.1")))
    t.start()
    sender.open_group(name, 2)
    t.join(30)
    return sender, sender._groups[name].group, rx["g"]


def test_a_tensor_on_another_device_than_the_groups_is_refused_by_name():
    sender, g, r = _pair()
    try:
        with pytest.raises(WeightTransferError, match="tensor is on meta, the group's gloo backend was set up for cpu"):
            g.broadcast_async(torch.empty(4, dtype=torch.uint8, device="meta"))
        with pytest.raises(WeightTransferError, match="on meta"):
            r.allreduce_async(torch.empty(2, dtype=torch.int32, device="meta"))
    finally:
        r.close()
        sender.close()


class FakeStream:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def synchronize(self) -> None:
        self.calls.append(("synchronize", None))

    def wait_event(self, ev: Any) -> None:
        self.calls.append(("wait_event", ev))


def test_waits_synchronise_the_groups_stream_never_the_callers(monkeypatch):
    """A sender thread synchronised `current_stream()`: on the learner that is the training stream, so the step
    after a publish waited for the broadcast. The group's own stream is synchronised instead."""
    g = object.__new__(Group)
    g.name, g.rank, g.backend, g.timeout_s = "g", 0, "nccl", 1.0
    g.device, g.stream = torch.device("cuda", 0), FakeStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: pytest.fail("synchronised the caller's stream"))
    g._wait(SimpleNamespace(wait=lambda *a: True), "a bucket")
    assert g.stream.calls == [("synchronize", None)]


def test_a_send_waits_for_its_packing_event_before_each_broadcast():
    """Packing only queues copies on the training stream; each group's stream waits for the event recorded after
    them (on the GPU), then broadcasts."""
    order: list[tuple[str, Any]] = []

    class FakeGroup:
        name, size, rank, device = "g", 2, 0, torch.device("cpu")
        store = SimpleNamespace(set=lambda k, v: None, delete_key=lambda k: None)

        def flags(self, mine: bool = False) -> torch.Tensor:
            return torch.zeros(2, dtype=torch.int32)

        def allreduce_async(self, t: torch.Tensor) -> str:
            return "work"

        def _wait(self, work: Any, what: str) -> None:
            pass

        def after(self, ev: Any) -> None:
            order.append(("after", ev))

        def broadcast_async(self, t: torch.Tensor) -> str:
            order.append(("broadcast", t.numel()))
            return "work"

    sd = {"a": torch.ones(8), "b": torch.ones(8)}
    plan = make_plan(sd, bucket_bytes=32)
    packed = Packed.allocate(plan).fill(sd)
    packed.ready = "packed-event"
    sender = object.__new__(WeightSender)
    sender.secret, sender.timeout_s, sender.device = None, 1.0, torch.device("cpu")
    sender._lock, sender._groups = threading.Lock(), {}
    sender._send(1, packed, plan, {"g": sender_mod._SenderGroup(FakeGroup(), "arl")})  # type: ignore[arg-type]
    assert order == [("after", "packed-event"), ("broadcast", 32), ("after", "packed-event"), ("broadcast", 32)]


# ----------------------------------------------------------------------------------- which runs may use NCCL

def test_shared_gpu_is_found_for_each_placement():
    from arl.config import shared_gpu

    assert shared_gpu(cfg("inference.device=cpu")) is None
    assert "GPU 0" in shared_gpu(cfg("inference.device=cuda"))
    assert shared_gpu(cfg("inference.device=cuda:1")) is None
    sg = ["inference.backend=sglang", "inference.device=cuda"]
    assert "SGLang server 0 runs on GPU 0" in shared_gpu(cfg(*sg))
    assert shared_gpu(cfg(*sg, "inference.sglang.first_gpu=1")) is None
    ray = ["launcher=ray", "inference.device=cuda"]
    assert "whole GPUs" in shared_gpu(cfg(*ray, "ray.gpus_per_inference=0.5", "ray.gpus_per_learner_rank=1"))
    assert shared_gpu(cfg(*ray, "ray.gpus_per_inference=1", "ray.gpus_per_learner_rank=1")) is None


def test_auto_sends_weights_by_disk_when_learner_and_inference_share_a_gpu_and_forced_nccl_is_refused():
    from arl.config import resolve_weights

    c, note = resolve_weights(cfg("inference.device=cuda"))
    assert c.weights.transport == "disk" and "NCCL cannot" in note and "GPU 0" in note
    c, note = resolve_weights(cfg("inference.device=cuda:1"))  # GPUs of their own: NCCL broadcast
    assert c.weights.transport == "broadcast" and note is None
    c, note = resolve_weights(cfg("inference.device=cpu"))
    assert c.weights.transport == "broadcast" and note is None
    with pytest.raises(ConfigError, match="Duplicate GPU detected"):
        cfg("inference.device=cuda", "weights.backend=nccl")
    assert cfg("inference.device=cuda", "weights.backend=gloo").weights.backend == "gloo"
