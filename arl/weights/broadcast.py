"""The ``broadcast`` transport: no weight file; learner rank 0 sends each version over a torch.distributed group of
its own to each inference server (gloo on CPU, NCCL on GPU).

The controller's side names one group per inference server and incarnation, once the learner (whose sender's store
address comes in its ``register``) and the server have both registered: ``open_weight_group`` to the learner,
``join_weight_group`` to the server. A `Send` becomes ``update_weights`` with an empty path to the server and one
``send_weights {version, servers}`` per version to the learner. The learner's side hands each version's state dict
to a `arl.weights.channel.WeightPublisher`; a server's side is a `arl.weights.channel.BroadcastLoader`. The wire:
`arl.weights.plan`, `group`, `sender`, `receiver`, `sglang`. This module imports no torch (the config checks
through it); the sides' modules are imported when built.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import os
from typing import Any, Awaitable, Callable, Iterable, Optional, Sequence

from arl.weights.strategy import Export, Key, Outgoing, RunFacts, SendLike, Transport

__all__ = ["BroadcastLearner", "BroadcastLink", "BroadcastTransport"]


class BroadcastLearner:
    """Learner rank 0's side: each version's state dict (live parameters where the engine can give them, without
    the tied copies) goes to the `publisher`, which packs it before the next step and sends it off the training
    thread to the servers the controller names."""

    activity = "gathering weights"

    def __init__(self, publisher: Any, skip_names: Iterable[str] = ()) -> None:
        self.publisher = publisher
        self.skip_names = set(skip_names)

    @property
    def stats(self) -> dict[str, Any]:
        return self.publisher.stats

    @property
    def handlers(self) -> dict[str, Callable[[Any], Any]]:
        p = self.publisher
        return {"open_weight_group": lambda msg: p.open_group(msg.name, msg.server),
                "send_weights": lambda msg: p.request(msg.version, msg.servers)}

    @property
    def registration(self) -> dict[str, Any]:
        return {"weights_store": f"{self.publisher.sender.address}:{self.publisher.sender.port}"}

    async def export(self, version: int, engine: Any) -> Export:
        """The full state dict (collective over the ranks): valid until the next step, packed before it."""
        sd = await asyncio.to_thread(engine.full_state_dict, False)
        return Export("", {k: v for k, v in sd.items() if k not in self.skip_names})

    async def publish(self, version: int, export: Export) -> None:
        # only now: a send never carries a version the controller has not seen
        await self.publisher.set_newest(version, export.weights)

    def prune(self, below: int) -> None:
        pass  # the publisher keeps the newest version only

    def coroutines(self) -> list[Awaitable[None]]:
        return [self.publisher.run()]

    async def close(self) -> None:
        await asyncio.to_thread(self.publisher.close)


class BroadcastLink:
    """The controller's side: group names and the sends, for `num_servers` servers. `secret`: the run's."""

    def __init__(self, *, num_servers: int, backend: str, secret: Optional[bytes]) -> None:
        self.num_servers, self.backend, self.secret = num_servers, backend, secret
        self.store: Optional[tuple[str, int]] = None  # the learner's sender, from its registration
        self._numbers = itertools.count(1)  # names a fresh group per server incarnation
        self._nonce = os.urandom(16)

    def on_register(self, msg: Any, registered: Callable[[Key], bool]) -> Outgoing:
        """A group for each inference server once it and the learner registered (a server's is formed before it is
        sent anything to load)."""
        if msg.role == "learner" and getattr(msg, "weights_store", None):
            host, _, port = msg.weights_store.rpartition(":")
            self.store = (host, int(port))
        if msg.role not in ("learner", "inference"):  # rollout workers, env servers, judge workers: no group
            return []
        out: Outgoing = []
        for server in range(self.num_servers) if msg.role == "learner" else [msg.index]:
            out += self._form_group(server, registered)
        return out

    def _form_group(self, server: int, registered: Callable[[Key], bool]) -> Outgoing:
        """A new group between the learner and server `server` (its new incarnation); the learner closes the
        server's previous group."""
        if self.store is None or not registered(("inference", server)):
            return []
        # unguessable (the store has no access control): a tag derived from the run's secret and a nonce of this
        # controller, so a peer that reaches the store cannot name a group it was not told (docs/reliability.md)
        base = f"arl-weights-s{server}-{next(self._numbers)}"
        tag = hmac.new(self.secret or self._nonce, self._nonce + base.encode(), hashlib.sha256)
        name = f"{base}-{tag.hexdigest()[:32]}"
        host, port = self.store
        spec = {"master_address": host, "master_port": port, "group_name": name, "world_size": 2, "rank": 1,
                "backend": self.backend}  # arl.weights.group.GroupSpec (no torch import here)
        return [(("learner", 0), "open_weight_group", {"name": name, "server": server}),
                (("inference", server), "join_weight_group", {"index": server, "spec": spec})]

    def updates(self, sends: Sequence[SendLike], registered: Callable[[Key], bool]) -> Outgoing:
        """``update_weights`` (empty path) to each server, then per version one ``send_weights`` to the learner
        naming the registered ones."""
        out: Outgoing = []
        servers: dict[int, list[int]] = {}  # version -> servers the learner sends it to
        for s in sends:
            if registered(("inference", s.server)):
                servers.setdefault(s.version, []).append(s.server)
            out.append((("inference", s.server), "update_weights",
                        {"version": s.version, "path": s.path, **({"rollback": True} if s.rollback else {})}))
        out += [(("learner", 0), "send_weights", {"version": v, "servers": ss}) for v, ss in servers.items()]
        return out

    def resume_path(self, version: int) -> str:
        return ""


class BroadcastTransport(Transport):
    name = "broadcast"

    def problems(self, run: RunFacts) -> list[str]:
        out = []
        if run.inference_backend not in ("torch", "sglang") or not run.learner_trains or run.servers_per_process != 1:
            out.append("weights.transport=broadcast needs inference.backend torch or sglang, a learner that trains "
                       "a model (not sim) and inference.servers_per_process=1")
        if run.backend_setting == "nccl" and run.shared_gpu is not None:
            out.append(f"weights.backend=nccl: {run.shared_gpu}; NCCL cannot put two ranks of one group on one GPU "
                       "('Duplicate GPU detected'). Give them GPUs of their own, or use weights.backend=auto "
                       "(weights then go by disk) or gloo")
        return out

    def fallback(self, run: RunFacts) -> Optional[tuple[str, str]]:
        """With ``weights.backend=auto``, a learner and inference that share a GPU get disk (NCCL cannot)."""
        if run.backend_setting != "auto" or self.settings.backend != "nccl" or run.shared_gpu is None:
            return None
        return "disk", (f"weights.transport=broadcast with weights.backend=auto: {run.shared_gpu}; NCCL cannot, so "
                        "weights go by disk")

    def learner(self, *, weights_dir: str, keep_versions: int, host: str, secret: Optional[bytes], device: Any,
                skip_names: Callable[[], Iterable[str]]) -> BroadcastLearner:
        """Over NCCL the publisher's buckets live on `device`, the GPU the engine trains on (NCCL takes CUDA
        tensors only); over gloo on the CPU."""
        from arl.weights.channel import WeightPublisher
        from arl.weights.sender import WeightSender

        s = self.settings
        sender = WeightSender(host, 0, backend=s.backend, timeout_s=s.timeout_s, gloo_host=host,
                              device=device if s.backend == "nccl" else None, secret=secret)
        return BroadcastLearner(WeightPublisher(sender, protocol=s.receivers, bucket_bytes=s.bucket_bytes),
                                skip_names())

    def inference(self, engine: Any, *, host: str, secret: Optional[bytes]) -> Any:
        from arl.weights.channel import BroadcastLoader

        return BroadcastLoader(engine, timeout_s=self.settings.timeout_s, gloo_host=host, secret=secret)

    def controller(self, *, weights_dir: str, num_servers: int, secret: Optional[bytes]) -> BroadcastLink:
        return BroadcastLink(num_servers=num_servers, backend=self.settings.backend, secret=secret)

