"""`weights.transport=broadcast` in a run: the learner's publisher and the inference worker's loader.

The controller keeps deciding who gets which version (`arl.controller.weight_sync.WeightSync`, unchanged): a `Send`
becomes ``update_weights`` with an empty path to the inference worker and ``send_weights`` to the learner. Groups
are one per inference server and incarnation (``open_weight_group`` to the learner, ``join_weight_group`` to the
worker, a fresh name each time), so a restarted worker gets the newest weights through a group of its own while the
others carry on.

Coalescing. After each step's ``weights_published`` the learner hands its live parameters to `set_newest`, which
packs them into the plan's buckets (one copy into buffers kept across versions) before training goes on; only the
newest version is kept. `WeightPublisher.run` serves every server asked since its last send in one
`WeightSender.send` of that newest version (each bucket broadcast to all their groups at once), off the training
thread. The inference side receives into the buffers of the weights its engine served before (`swapped`). A server asked
for version v while the learner already holds v+k gets v+k and acks it; WeightSync takes an ack newer than what it
sent as it takes any ack (a server's version only goes up).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Awaitable, Callable, Mapping, Optional

import torch

from arl.weights.group import GroupSpec, WeightTransferError
from arl.weights.plan import Packed, make_plan
from arl.weights.receiver import WeightReceiver
from arl.weights.sender import WeightSender

logger = logging.getLogger("arl.weights")

__all__ = ["WeightPublisher", "BroadcastLoader"]


class WeightPublisher:
    """Learner rank 0: one group per inference server as the controller asks (`open_group`), the newest weights
    (`set_newest`), and sends to the servers the controller names (`request`), run by `run()` in worker threads.
    `protocol` is ``arl`` (torch engines receive) or ``sglang`` (SGLang servers receive)."""

    def __init__(self, sender: WeightSender, *, protocol: str = "arl", bucket_bytes: int = 64 << 20) -> None:
        self.sender, self.protocol, self.bucket_bytes = sender, protocol, bucket_bytes
        self.newest: Optional[tuple[int, Packed]] = None
        # Packed buffers reused across versions: at most two, the one a send reads and the one packed next (a
        # newest that is not being sent is packed over: a newer version supersedes it). `_lock` guards these
        # three fields between the packing thread and `run`.
        self._pool: list[Packed] = []
        self._sending: Optional[Packed] = None
        self._lock = threading.Lock()
        self._groups: dict[int, str] = {}  # server -> its open group
        self._wanted: dict[int, int] = {}  # server -> the version it was told to load (at least)
        self._wake = asyncio.Event()
        self.stats = {"weight_sends": 0, "weight_send_failures": 0, "weight_send_s_last": 0.0,
                      "weight_bytes_sent": 0, "weight_groups": 0, "weight_pack_s_last": 0.0}

    async def set_newest(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """The weights of `version`: packed (in a thread) before this returns, so the learner may change
        `tensors` (its live parameters) afterwards; every later send carries them."""
        t0 = time.monotonic()
        packed = await asyncio.to_thread(self._pack, tensors)
        self.stats["weight_pack_s_last"] = time.monotonic() - t0
        with self._lock:
            self.newest = (int(version), packed)
        self._wake.set()

    def _pack(self, tensors: Mapping[str, torch.Tensor]) -> Packed:
        plan = make_plan(tensors, bucket_bytes=self.bucket_bytes)
        with self._lock:
            newest = self.newest[1] if self.newest is not None else None
            self._pool = [p for p in self._pool if p.plan == plan or p is self._sending]
            free = [p for p in self._pool if p is not self._sending and p is not newest]
            if free:
                target = free[0]
            elif newest is not None and newest is not self._sending and newest.plan == plan:
                target, self.newest = newest, None  # superseded; `run` cannot start sending it meanwhile
            else:
                target = Packed.allocate(plan, self.sender.device)  # NCCL: on the learner's GPU
                self._pool.append(target)
        return target.fill(tensors)

    async def open_group(self, name: str, server: int) -> None:
        """Form group `name` with inference server `server` (its previous group is closed first); returns once
        the server joined, or (logged) when it did not within the sender's timeout."""
        old = self._groups.pop(server, None)
        if old is not None:
            await asyncio.to_thread(self.sender.close_group, old)
        try:
            await asyncio.to_thread(self.sender.open_group, name, 2, protocol=self.protocol)
        except WeightTransferError as e:  # the worker's join fails too: the controller restarts it, a new group
            logger.error("weight group %s with inference server %d did not form: %s", name, server, e)
            self.stats.update(getattr(self.sender, "stats", {}))  # ranks_refused: in the learner's heartbeat
            return
        self._groups[server] = name
        self.stats["weight_groups"] = len(self._groups)
        logger.info("weight group %s formed with inference server %d", name, server)
        self._wake.set()

    def request(self, version: int, servers: list[int]) -> None:
        """Servers `servers` were told to load `version`: the next send includes them."""
        for s in servers:
            self._wanted[s] = max(self._wanted.get(s, -1), int(version))
        self._wake.set()

    async def run(self) -> None:
        """Serve requests until cancelled: every server whose group is open and whose asked version the learner
        holds is sent the newest weights, all of them in one send."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            with self._lock:
                if self.newest is None:
                    continue
                version, packed = self.newest
                ready = sorted(s for s, v in self._wanted.items() if s in self._groups and v <= version)
                if not ready:
                    continue
                self._sending = packed
            for s in ready:
                del self._wanted[s]
            groups = {self._groups[s]: s for s in ready}
            t0 = time.monotonic()
            try:
                st = await asyncio.to_thread(self.sender.send, version, packed, groups=list(groups))
                self.stats["weight_bytes_sent"] += st.bytes * len(st.groups)
            except WeightTransferError as e:  # the worker fails too and is restarted with a new group
                self.stats["weight_send_failures"] += 1
                logger.error("weights v%d did not reach every inference server: %s", version, e)
                for name in e.failures:
                    if name not in self.sender.groups and self._groups.get(groups.get(name, -1)) == name:
                        del self._groups[groups[name]]
            finally:
                with self._lock:
                    self._sending = None
            self.stats["weight_sends"] += 1
            self.stats.update(getattr(self.sender, "stats", {}))  # forged SGLang outcomes ignored (forged_values)
            self.stats["weight_send_s_last"] = time.monotonic() - t0
            logger.info("sent weights v%d to servers %s in %.3fs", version, ready, time.monotonic() - t0)
            if self._wanted:
                self._wake.set()  # asked meanwhile: go round again (waits for the group or the version if need be)

    def close(self) -> None:
        self.sender.close()


class BroadcastLoader:
    """An inference server's side: joins the group the controller names (`join`), then `load` receives the next
    transfer of the learner into the engine. A torch engine receives the tensors in this process (`WeightReceiver`)
    and swaps them in between decode steps; an SGLang engine's server receives them itself (`SGLangWeightClient`)."""

    def __init__(self, engine: Any, *, timeout_s: float = 120.0, gloo_host: Optional[str] = None,
                 secret: Optional[bytes] = None) -> None:
        self.engine, self.timeout_s, self.gloo_host, self.secret = engine, timeout_s, gloo_host, secret
        self.sglang = hasattr(engine, "update_weights_from_distributed")
        if not self.sglang and not hasattr(engine, "update_weights_from_tensors"):
            raise ValueError(f"engine {type(engine).__name__} cannot load broadcast weights (weights.transport="
                             "broadcast needs the torch or sglang backend)")
        self._member: Any = None
        self._joined: Optional[asyncio.Task] = None

    async def join(self, spec: GroupSpec) -> None:
        """Leave the previous group (if any) and join `spec`'s (blocks until the learner formed it)."""
        await self.close()
        if self.sglang:
            from arl.weights.sglang import SGLangWeightClient

            member: Any = SGLangWeightClient(self.engine.base_url, spec, timeout_s=self.timeout_s,
                                             flush_cache=getattr(self.engine, "pause_mode", "") != "in_place",
                                             secret=self.secret)
        else:
            # NCCL: receive on the engine's own GPU (the group's default, the current CUDA device, may be another)
            device = getattr(self.engine, "device", None) if spec.backend == "nccl" else None
            member = WeightReceiver(spec, timeout_s=self.timeout_s, gloo_host=self.gloo_host, device=device,
                                    secret=self.secret)
        self._member = member
        self._joined = asyncio.create_task(asyncio.to_thread(member.join))
        await self._joined
        logger.info("joined weight group %s as rank %d", spec.group_name, spec.rank)

    @property
    def handlers(self) -> dict[str, Callable[[Any], Awaitable[None]]]:
        """``join_weight_group``: the group later updates come through."""
        return {"join_weight_group": lambda msg: self.join(GroupSpec.from_dict(msg.spec))}

    def source(self, path: str) -> str:
        return "the learner's broadcast"

    async def load(self, version: int = -1, path: str = "") -> int:
        """Receive the learner's next transfer into the engine; returns its version (the newest the learner held
        when it sent, at least `version`; there is no `path`). Raises when no group was joined or the transfer
        failed."""
        if self._joined is None:
            raise WeightTransferError("no weight group joined yet (join_weight_group never came)")
        await self._joined
        wait = 3 * self.timeout_s  # the learner may be sending to others first
        if self.sglang:
            return int(await self.engine.update_weights_from_distributed(self._member, wait))
        rx: WeightReceiver = self._member
        version, tensors = await asyncio.to_thread(rx.receive, self.engine.model, wait_s=wait)
        await self.engine.update_weights_from_tensors(tensors, version, source=f"broadcast group {rx.spec.group_name}")
        rx.swapped()
        return version

    async def close(self) -> None:
        member, joined = self._member, self._joined
        self._member = self._joined = None
        if joined is not None and not joined.done():
            joined.cancel()
        if member is not None:
            await asyncio.to_thread(member.close)
