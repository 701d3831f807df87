"""The learner's side of a broadcast: `WeightSender` hosts the store, forms groups and sends state dicts to them.

One transfer on a group, `seq` counting transfers on that group from 0:

1. the sender puts the plan (version, names, wire dtypes, shapes, buckets) under ``arl/xfer/<seq>`` in the store,
   signed: a receiver waits for it with its own idle timeout, not inside a collective;
2. the group's wire protocol checks the receivers are ready (`Wire.post_check` / `Wire.check`);
3. one broadcast per bucket (`arl.weights.plan`), to every group of the send at once;
4. the wire protocol learns every receiver applied the weights (`Wire.post_outcome` / `Wire.outcome`).

Two wire protocols, each in a class of its own: `ArlWire` (torch receivers in an inference worker,
`arl.weights.receiver`) adds an all-reduce of a per-rank refusal vector at step 2 (a receiver whose model does not
fit the plan refuses, its reason under ``arl/refusal/<seq>/<rank>``, and then nobody sends or receives a byte) and
one of a per-rank failure vector at step 4; `SGLangWire` (an SGLang server, driven by
`arl.weights.sglang.SGLangWeightClient` in the worker that owns it) has no step 2 and waits at step 4 for the
signed outcome the worker writes under ``arl/done/<seq>``. A group whose collective failed is closed (its peer must
rejoin under a new name); a refusal keeps it open.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import socket
import threading
import time
from typing import Any, Iterable, Mapping, Optional, Union

import torch
from torch._C._distributed_c10d import TCPStore

from arl.weights.group import (Group, GroupSpec, RankNotProven, WeightTransferError, as_timedelta, delete_keys,
                               get_signed, get_str, sign_value, verify_value)
from arl.weights.plan import Packed, TransferPlan, make_plan, pack_bucket, record_event

logger = logging.getLogger("arl.weights.broadcast")

__all__ = ["ArlWire", "SGLangWire", "TransferStats", "WIRES", "WeightSender", "Wire"]


class Wire:
    """What one wire protocol adds around the payload of a transfer (steps 2 and 4). `post_*` start a step on
    every group before any is waited for (`check`, `outcome`), so the groups of one send go at once."""

    def post_check(self, g: Group) -> Any:
        return None

    def check(self, sender: "WeightSender", g: Group, seq: int, version: int, posted: Any) -> Optional[str]:
        """Why the receivers refused `version` (the group stays open), or None. Raises `WeightTransferError`
        when the step itself failed (the group is closed)."""
        return None

    def post_outcome(self, g: Group) -> Any:
        return None

    def outcome(self, sender: "WeightSender", g: Group, seq: int, version: int,
                posted: Any) -> Optional[tuple[str, bool]]:
        """Why `version` was not applied and whether the group must close, or None when every receiver applied
        it. Raises `WeightTransferError` when the step itself failed (the group is closed)."""
        return None

    def explain(self, sender: "WeightSender", g: Group, seq: int, reason: str) -> str:
        """`reason` for a failed bucket, with what the receiving side said if it did."""
        return reason


class ArlWire(Wire):
    """Torch receivers: a refusal all-reduce before the payload, a failure all-reduce after it."""

    def post_check(self, g: Group) -> Any:
        flags = g.flags()
        return flags, g.allreduce_async(flags)

    def check(self, sender: "WeightSender", g: Group, seq: int, version: int, posted: Any) -> Optional[str]:
        flags, work = posted
        g._wait(work, f"the refusal all-reduce of v{version}")
        flags = flags.cpu()
        if not int(flags.sum()):
            return None
        reasons = []
        for r in range(g.size):
            if int(flags[r]):
                try:
                    reasons.append(f"rank {r}: {get_str(g.store, f'arl/refusal/{seq}/{r}', 5.0)}")
                except Exception:  # noqa: BLE001
                    reasons.append(f"rank {r}: (no reason left in the store)")
        return f"v{version} refused: " + "; ".join(reasons)

    def post_outcome(self, g: Group) -> Any:
        return self.post_check(g)

    def outcome(self, sender: "WeightSender", g: Group, seq: int, version: int,
                posted: Any) -> Optional[tuple[str, bool]]:
        flags, work = posted
        g._wait(work, f"the completion all-reduce of v{version}")
        flags = flags.cpu()
        bad = [r for r in range(g.size) if int(flags[r])]
        if not bad:
            return None
        msgs = [f"rank {r}: {get_str(g.store, f'arl/failed/{seq}/{r}', 5.0)}" for r in bad]
        return f"v{version} not applied: " + "; ".join(msgs), False


class SGLangWire(Wire):
    """An SGLang server: no check before the payload (the server posts each bucket's receive itself); after it,
    the outcome its worker signs under ``arl/done/<seq>``."""

    def outcome(self, sender: "WeightSender", g: Group, seq: int, version: int,
                posted: Any) -> Optional[tuple[str, bool]]:
        try:
            done = json.loads(get_signed(g.store, g.name, f"arl/done/{seq}", sender.timeout_s, sender.secret,
                                         sender._forged))
        except Exception as e:  # noqa: BLE001
            raise WeightTransferError(f"group {g.name!r}: no outcome from the SGLang worker for v{version} "
                                      f"within {sender.timeout_s:g}s: {e}") from e
        if not done.get("success"):  # bytes may be left in the pipe: the group is out of step
            return f"v{version} not loaded by the SGLang server: {done.get('message')}", True
        return None

    def explain(self, sender: "WeightSender", g: Group, seq: int, reason: str) -> str:
        """`reason`, plus what the SGLang worker reported if it did (why the server never took the bytes)."""
        key = f"arl/done/{seq}"
        try:
            if g.store.check([key]):
                said = verify_value(sender.secret, g.name, key, g.store.get(key).decode())
                if said is not None:
                    return f"{reason}; the SGLang worker says: {json.loads(said).get('message')}"
        except Exception:  # noqa: BLE001
            pass
        return reason


WIRES: dict[str, Wire] = {"arl": ArlWire(), "sglang": SGLangWire()}


@dataclasses.dataclass
class TransferStats:
    version: int
    bytes: int
    seconds: float
    groups: list[str]

    @property
    def gbps(self) -> float:
        """GB/s of payload per receiver group (each group got `bytes`)."""
        return self.bytes / max(self.seconds, 1e-9) / 1e9


@dataclasses.dataclass
class _SenderGroup:
    group: Group
    protocol: str  # a key of `WIRES`
    seq: int = 0


class WeightSender:
    """The learner side: hosts the store, forms groups with receivers, broadcasts state dicts to them.

    `open_group` blocks until every receiver of the group has joined (run it in a thread beside the receivers'
    joins, or the SGLang server's ``/init_weights_update_group``). `send` is thread-safe against `open_group` /
    `close_group` for other names, but transfers are serialised.

    Trust: the store listens on `host` only (not every interface, TCPStore's default). It has no access control:
    whoever reaches it can read and write keys. With `secret` (the run's), what a receiver acts on is signed
    (announcements; an SGLang worker's outcome is checked here), and every member of an ``arl`` group proves the
    secret over the group before any weight moves (`Group._prove`); `stats` counts what was refused."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, backend: str = "gloo", timeout_s: float = 60.0,
                 advertise_address: Optional[str] = None, gloo_host: Optional[str] = None,
                 device: Optional[Union[str, torch.device]] = None, secret: Optional[bytes] = None) -> None:
        self.backend, self.timeout_s, self.gloo_host = backend, timeout_s, gloo_host
        # where packed buckets must live: NCCL takes CUDA tensors only (the learner passes its engine's device)
        self.device = torch.device(device if device is not None else ("cpu" if backend == "gloo" else "cuda"))
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError(f"weights over NCCL need the sender's CUDA device, got {self.device}")
        self.secret = secret
        self.stats = {"ranks_refused": 0, "forged_values": 0}
        # TCPStore's server listens on every interface whatever its host says: bind the socket here, on `host`
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        listen = socket.socket(family, socket.SOCK_STREAM)
        try:
            listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listen.bind((host.strip("[]"), port))
            listen.listen(512)
            bound = listen.getsockname()[1]
        except BaseException:
            listen.close()
            raise
        # the store owns the socket from here on (it closes it when it goes)
        self._store = TCPStore(host.strip("[]"), bound, None, True, as_timedelta(timeout_s), wait_for_workers=False,
                               multi_tenant=True, master_listen_fd=listen.detach())
        self.address = advertise_address or host
        self.port = int(self._store.port)
        self._groups: dict[str, _SenderGroup] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()

    def spec(self, group_name: str, *, world_size: int = 2, rank: int = 1) -> GroupSpec:
        """The join instructions for receiver `rank` of group `group_name`."""
        return GroupSpec(self.address, self.port, group_name, world_size, rank, self.backend)

    @property
    def groups(self) -> list[str]:
        with self._lock:
            return list(self._groups)

    def open_group(self, name: str, world_size: int = 2, *, protocol: str = "arl") -> None:
        """Form group `name` as its rank 0 (blocks until all `world_size - 1` receivers join, at most
        `timeout_s`). `protocol` is ``arl`` (torch receivers) or ``sglang`` (an SGLang server + its worker)."""
        if protocol not in ("arl", "sglang"):
            raise ValueError(f"protocol must be arl or sglang, got {protocol!r}")
        with self._lock:
            if name in self._groups:
                raise ValueError(f"group {name!r} is open already")
        try:  # an SGLang server joins with SGLang's own code: it cannot prove the secret (see docs/reliability.md)
            g = Group(self._store, name, 0, world_size, backend=self.backend, timeout_s=self.timeout_s,
                      gloo_host=self.gloo_host, device=self.device, secret=self.secret if protocol == "arl" else None)
        except RankNotProven as e:
            self.stats["ranks_refused"] += len(e.ranks)
            logger.error("%s", e)
            raise
        with self._lock:
            self._groups[name] = _SenderGroup(g, protocol)

    def _forged(self, key: str) -> None:
        self.stats["forged_values"] += 1

    def close_group(self, name: str) -> None:
        with self._lock:
            sg = self._groups.pop(name, None)
        if sg is not None:
            sg.group.close()

    def close(self) -> None:
        for n in self.groups:
            self.close_group(n)

    def send(self, version: int, tensors: Union[Mapping[str, torch.Tensor], Packed], *,
             plan: Optional[TransferPlan] = None, groups: Optional[Iterable[str]] = None) -> TransferStats:
        """Send `tensors` (laid out by `plan`, default `make_plan(tensors)`; or already `Packed`) as `version` to
        `groups` (default: all open), at once. Each bucket is packed once and broadcast to every group
        concurrently. A group that fails is closed (or, if its receiver refused, left open) and the others carry
        on; then `WeightTransferError` lists the failures. Returns the payload bytes and time."""
        if isinstance(tensors, Packed):
            plan = tensors.plan
        plan = plan if plan is not None else make_plan(tensors)
        with self._send_lock:
            with self._lock:
                names = list(self._groups) if groups is None else list(groups)
                unknown = [n for n in names if n not in self._groups]
                if unknown:
                    raise WeightTransferError(f"no open group {unknown}", {n: "not open" for n in unknown})
                live = {n: self._groups[n] for n in names}
            return self._send(int(version), tensors, plan, live)

    def _send(self, version: int, tensors: Union[Mapping[str, torch.Tensor], Packed], plan: TransferPlan,
              live: dict[str, _SenderGroup]) -> TransferStats:
        """Steps 1-4 (see the module's docstring) on the groups `live`; a group that fails leaves `live`."""
        t0 = time.monotonic()
        failures: dict[str, str] = {}
        broken: set[str] = set()

        def fail(n: str, reason: str, *, close: bool) -> None:
            failures[n] = reason
            live.pop(n, None)
            if close:
                broken.add(n)
                self.close_group(n)

        # 1. the announcement
        seqs = {}
        announce = json.dumps({"version": version, "plan": plan.to_json()})
        for n, sg in live.items():
            seqs[n] = sg.seq
            sg.seq += 1
            key = f"arl/xfer/{seqs[n]}"
            sg.group.store.set(key, sign_value(self.secret, n, key, announce))
        # 2. the receivers are ready (or refuse)
        posted = {n: WIRES[sg.protocol].post_check(sg.group) for n, sg in live.items()}
        for n, sg in list(live.items()):
            try:
                reason = WIRES[sg.protocol].check(self, sg.group, seqs[n], version, posted[n])
            except WeightTransferError as e:
                fail(n, str(e), close=True)
                continue
            if reason:
                fail(n, reason, close=False)
        # 3. the payload
        self._payload(version, tensors, plan, live, seqs, fail)
        # 4. every receiver says it applied them
        posted = {n: WIRES[sg.protocol].post_outcome(sg.group) for n, sg in live.items()}
        for n, sg in list(live.items()):
            try:
                failed = WIRES[sg.protocol].outcome(self, sg.group, seqs[n], version, posted[n])
            except WeightTransferError as e:
                failed = str(e), True
            if failed:
                fail(n, failed[0], close=failed[1])
        for n, s in seqs.items():
            if n not in broken:
                with self._lock:
                    sg = self._groups.get(n)
                if sg is not None:
                    delete_keys(sg.group.store, f"arl/xfer/{s}", f"arl/done/{s}")
        stats = TransferStats(version, plan.total_bytes, time.monotonic() - t0, sorted(live))
        if failures:
            raise WeightTransferError(f"v{version} did not reach {sorted(failures)}: "
                                      + " | ".join(f"{n}: {r}" for n, r in failures.items()), failures, sorted(live))
        return stats

    def _payload(self, version: int, tensors: Union[Mapping[str, torch.Tensor], Packed], plan: TransferPlan,
                 live: dict[str, _SenderGroup], seqs: dict[str, int], fail: Any) -> None:
        """Bucket by bucket, to every live group at once. Packed: every bucket is posted at once (as the receiver
        posts its buffers), so no bucket waits for a round trip; else bucket k+1 is packed and queued while bucket
        k is on the wire."""
        nb = len(plan.buckets)
        depth = nb if isinstance(tensors, Packed) else 2
        posted: collections.deque[tuple[int, dict[str, Any], torch.Tensor]] = collections.deque()
        for k in range(nb + depth):
            if k < nb and live:
                if isinstance(tensors, Packed):
                    buf, packed = tensors.buckets[k], tensors.ready
                else:  # packed here, on this thread's current stream: the groups' streams wait for it
                    buf = pack_bucket(plan, k, tensors, self._device())
                    packed = record_event(buf.device)
                works = {}
                for n, sg in list(live.items()):
                    try:
                        sg.group.after(packed)
                        works[n] = sg.group.broadcast_async(buf)
                    except Exception as e:  # noqa: BLE001
                        fail(n, f"bucket {k}/{nb} of v{version}: {e}", close=True)
                posted.append((k, works, buf))
            if posted and (len(posted) >= depth or k >= nb - 1):
                kk, works, _ = posted.popleft()
                for n, w in works.items():
                    if n not in live:
                        continue
                    try:
                        live[n].group._wait(w, f"bucket {kk}/{nb} of v{version}")
                    except WeightTransferError as e:
                        sg = live[n]
                        fail(n, WIRES[sg.protocol].explain(self, sg.group, seqs[n], str(e)), close=True)

    def _device(self) -> torch.device:
        return self.device
