"""Weight groups: process groups of their own on the sender's store, and the signed keys a transfer leaves there.

The sender hosts a TCPStore (multi-tenant, on its own port) and every group lives on it under its own name, with the
key layout of ``sglang.srt.utils.init_custom_process_group`` + torch's ``_new_process_group_helper``
(``PrefixStore(name)`` -> ``PrefixStore(name + "/")`` -> ``PrefixStore("cpu/" | "cuda/")``), so an SGLang server
joins a group with ``/init_weights_update_group`` (``rank_offset``) and meets the sender. Unlike those helpers, the
backend (``ProcessGroupGloo`` / ``ProcessGroupNCCL``) is built directly and never registered in torch's global
``_world``: the learner's default (DeepSpeed) group, its names and its NCCL communicator splitting are untouched,
and a group name can be reused in another store. A group is rank 0 (the sender) + ``world_size - 1`` receivers;
one group per receiver lets a worker die and rejoin (a fresh group name) without disturbing the others.

The store has no access control: values a peer acts on are signed with the run's secret (`sign_value`), and the
members of an ARL group prove the secret over the group itself (`Group._prove`). Every wait has a timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import time
from datetime import timedelta
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
from torch._C._distributed_c10d import AllreduceOptions, BroadcastOptions, PrefixStore, ReduceOp, Store, TCPStore

from arl.weights.plan import TransferPlan

logger = logging.getLogger("arl.weights.broadcast")

__all__ = ["Group", "GroupSpec", "RankNotProven", "WeightTransferError", "arl_store", "delete_keys", "get_signed",
           "get_str", "resolve_device", "sign_value", "store_client", "verify_value", "wait_announced"]


class WeightTransferError(RuntimeError):
    """A transfer or a group failed. `failures` maps group name -> reason; `ok` lists the groups that got it."""

    def __init__(self, message: str, failures: Optional[Mapping[str, str]] = None,
                 ok: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})
        self.ok = list(ok)


class RankNotProven(WeightTransferError):
    """A member of a weight group could not prove the run's secret (`ranks`); the group is closed."""

    def __init__(self, message: str, ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.ranks = list(ranks)


def resolve_device(device: Optional[Union[str, torch.device]], backend: str) -> torch.device:
    """The device a group's tensors live on: `device`, else the CPU for gloo and the current CUDA device for
    NCCL (with its index, so tensors can be compared with it). NCCL takes CUDA tensors only."""
    dev = torch.device(device if device is not None else ("cpu" if backend == "gloo" else "cuda"))
    if backend == "nccl" and dev.type != "cuda":
        raise ValueError(f"an NCCL weight group needs a CUDA device, got {dev}")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """What a receiver needs to join a group (JSON-able, for a control message)."""

    master_address: str
    master_port: int
    group_name: str
    world_size: int = 2
    rank: int = 1
    backend: str = "gloo"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "GroupSpec":
        return cls(str(d["master_address"]), int(d["master_port"]), str(d["group_name"]), int(d["world_size"]),
                   int(d["rank"]), str(d["backend"]))

    def sglang_init_request(self) -> dict[str, Any]:
        """The body of SGLang's ``/init_weights_update_group`` (a server of TP size 1 joins as rank `rank`)."""
        return {"master_address": self.master_address, "master_port": self.master_port, "rank_offset": self.rank,
                "world_size": self.world_size, "group_name": self.group_name, "backend": self.backend}


def as_timedelta(seconds: float) -> timedelta:
    return timedelta(seconds=float(seconds))


def store_client(address: str, port: int, timeout_s: float) -> TCPStore:
    """A client of the sender's store (retries the connection until `timeout_s`)."""
    return TCPStore(address, port, None, False, as_timedelta(timeout_s))


def arl_store(base: Store, group_name: str) -> PrefixStore:
    """The store namespace of one group, as ``init_custom_process_group`` makes it (the ARL keys live under it)."""
    return PrefixStore(group_name, base)


class Group:
    """One process group on a shared store; its collectives wait at most `timeout_s` and raise
    `WeightTransferError` naming the step. Not registered in torch.distributed's global state."""

    def __init__(self, base: Store, name: str, rank: int, size: int, *, backend: str = "gloo",
                 timeout_s: float = 60.0, gloo_host: Optional[str] = None,
                 device: Optional[Union[str, torch.device]] = None, secret: Optional[bytes] = None) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside world size {size}")
        self.name, self.rank, self.size, self.backend, self.timeout_s = name, rank, size, backend, timeout_s
        self.store = arl_store(base, name)
        dev = "cpu" if backend == "gloo" else "cuda"
        self.device = resolve_device(device, backend)
        # CUDA: collectives run on a stream of the group's own, and waits synchronise that stream only: a sender
        # thread must not make the learner's training stream wait for a broadcast (nor an inference receiver
        # the engine's decode stream), which synchronising the thread's current stream would do.
        self.stream: Optional[Any] = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # _new_process_group_helper's prefixes under the group's store: f"{group_name}/", then the device
        pg_store = PrefixStore(f"{dev}/", PrefixStore(f"{name}/", self.store))
        t0 = time.monotonic()
        try:
            if backend == "gloo":
                from torch.distributed import ProcessGroupGloo

                if gloo_host is None:
                    self.pg: Any = ProcessGroupGloo(pg_store, rank, size, as_timedelta(timeout_s))
                else:
                    opts = ProcessGroupGloo._Options()
                    opts._timeout = as_timedelta(timeout_s)
                    opts._devices = [ProcessGroupGloo.create_device(hostname=gloo_host)]
                    self.pg = ProcessGroupGloo(pg_store, rank, size, opts)
            elif backend == "nccl":
                from torch.distributed import ProcessGroupNCCL

                opts = ProcessGroupNCCL.Options()
                opts._timeout = as_timedelta(timeout_s)
                opts.is_high_priority_stream = False
                self.pg = ProcessGroupNCCL(pg_store, rank, size, opts)
            else:
                raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
            self.pg._set_sequence_number_for_group()  # what _new_process_group_helper does: both sides must
        except WeightTransferError:
            raise
        except Exception as e:  # noqa: BLE001 - rendezvous timeouts and refusals come as RuntimeError subclasses
            raise WeightTransferError(f"group {name!r}: rank {rank} of {size} could not form the group within "
                                      f"{timeout_s:g}s ({time.monotonic() - t0:.1f}s): {e}") from e
        self.closed = False
        if secret is not None:
            try:
                self._prove(secret)
            except WeightTransferError:
                self.close()
                raise

    def _prove(self, secret: bytes) -> None:
        """Every rank proves it holds the run's secret, over the group itself (not the store, where anyone who
        reaches it can read and write): each rank adds a fresh nonce, then an HMAC of its rank over all of them.
        A peer that took a rank's place in the rendezvous (it can: the store has no access control) cannot
        answer, and the group is refused before any weight moves. Raises `RankNotProven` naming the ranks."""
        n = 16
        mine = torch.zeros(self.size * n, dtype=torch.int32)
        mine[self.rank * n:(self.rank + 1) * n] = torch.tensor(list(os.urandom(n)), dtype=torch.int32)
        with self.on_stream():  # the copy to the GPU goes on the stream the all-reduce reads on
            nonces = mine.to(self.device)
        self._wait(self.allreduce_async(nonces), "the secret handshake (nonces)")
        challenge = bytes(int(x) for x in nonces.cpu().tolist())

        def proof(r: int) -> bytes:
            return hmac.new(secret, b"arl-weight-rank|%s|%d|%d|" % (self.name.encode(), r, self.size) + challenge,
                            hashlib.sha256).digest()

        mine = torch.zeros(self.size * 32, dtype=torch.int32)
        mine[self.rank * 32:(self.rank + 1) * 32] = torch.tensor(list(proof(self.rank)), dtype=torch.int32)
        with self.on_stream():
            proofs = mine.to(self.device)
        self._wait(self.allreduce_async(proofs), "the secret handshake (proofs)")
        got = proofs.cpu().tolist()
        bad = [r for r in range(self.size) if r != self.rank and
               not hmac.compare_digest(bytes(int(x) & 0xFF for x in got[r * 32:(r + 1) * 32]), proof(r))]
        if bad:
            raise RankNotProven(f"group {self.name!r}: rank(s) {bad} could not prove the run's secret; the group "
                                f"is refused before any weight moves", bad)

    def _wait(self, work: Any, what: str) -> None:
        try:
            if self.backend == "gloo":
                work.wait()  # the op carries the timeout (opts.timeout); wait(timeout) polls, ~2.5 ms per op here
            else:
                work.wait(as_timedelta(self.timeout_s))
        except Exception as e:  # noqa: BLE001
            raise WeightTransferError(f"group {self.name!r} rank {self.rank}: {what} failed or timed out "
                                      f"({self.timeout_s:g}s): {e}") from e
        if self.stream is not None:
            self.stream.synchronize()

    def on_stream(self) -> Any:
        """Context: the group's CUDA stream is current (no-op off CUDA); collectives and their buffers go there."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def after(self, event: Optional[Any]) -> None:
        """The group's stream waits (on the GPU, not the CPU) for `event`, e.g. the packing of a send."""
        if self.stream is not None and event is not None:
            self.stream.wait_event(event)

    def _check(self, t: torch.Tensor, what: str) -> None:
        """Refuse a tensor on another device than the group's, as NCCL would, but saying which devices."""
        if t.device != self.device:
            raise WeightTransferError(f"group {self.name!r}: {what} tensor is on {t.device}, the group's "
                                      f"{self.backend} backend was set up for {self.device}")

    def broadcast_async(self, t: torch.Tensor) -> Any:
        self._check(t, "broadcast")
        opts = BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        opts.timeout = as_timedelta(self.timeout_s)
        with self.on_stream():
            return self.pg.broadcast([t], opts)

    def broadcast(self, t: torch.Tensor, what: str) -> None:
        self._wait(self.broadcast_async(t), what)

    def allreduce_async(self, t: torch.Tensor) -> Any:
        self._check(t, "all-reduce")
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        opts.timeout = as_timedelta(self.timeout_s)
        with self.on_stream():
            return self.pg.allreduce([t], opts)

    def flags(self, mine: bool = False) -> torch.Tensor:
        """A per-rank vector for the refusal / failure all-reduces: 1 at this rank if `mine`, else zeros."""
        with self.on_stream():
            t = torch.zeros(self.size, dtype=torch.int32, device=self.device)
            if mine:
                t[self.rank] = 1
            return t

    def close(self) -> None:
        """Drop the group (idempotent); its peers' next collective fails at once or after their timeout."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.backend == "nccl":
                self.pg.abort()
            else:
                self.pg.shutdown()
        except Exception as e:  # noqa: BLE001 - teardown of a broken group may complain; it is gone either way
            logger.debug("group %s: teardown: %s", self.name, e)
        self.pg = None


def wait_announced(store: Store, group_name: str, seq: int, wait_s: float, secret: Optional[bytes] = None,
                   on_forged: Optional[Callable[[str], None]] = None) -> tuple[int, TransferPlan]:
    """The version and plan the sender announced for transfer `seq` of a group, waiting at most `wait_s` (outside
    any collective, so it can be long): the one wait both a torch receiver and an SGLang server's client make.
    With `secret`, only an announcement signed with it counts (anyone who reaches the store can write keys): a
    forged one is reported to `on_forged` and ignored, and the wait goes on for the sender's."""
    try:
        raw = json.loads(get_signed(store, group_name, f"arl/xfer/{seq}", wait_s, secret, on_forged))
    except Exception as e:  # noqa: BLE001
        raise WeightTransferError(f"group {group_name!r}: no transfer #{seq} announced within {wait_s:g}s: "
                                  f"{e}") from e
    return int(raw["version"]), TransferPlan.from_json(raw["plan"])


def get_str(store: Store, key: str, timeout_s: float) -> str:
    store.wait([key], as_timedelta(timeout_s))
    return store.get(key).decode()


def sign_value(secret: Optional[bytes], group_name: str, key: str, value: str) -> str:
    """`value` as stored under `key` of a group: with `secret`, prefixed by an HMAC over the group, key and value
    (so it cannot be moved to another key or group either)."""
    if secret is None:
        return value
    tag = hmac.new(secret, f"{group_name}|{key}|".encode() + value.encode(), hashlib.sha256).hexdigest()
    return f"{tag} {value}"


def verify_value(secret: Optional[bytes], group_name: str, key: str, stored: str) -> Optional[str]:
    """The value `sign_value` stored, or None when its tag does not verify."""
    if secret is None:
        return stored
    tag, _, value = stored.partition(" ")
    good = hmac.new(secret, f"{group_name}|{key}|".encode() + value.encode(), hashlib.sha256).hexdigest()
    return value if hmac.compare_digest(tag.encode(), good.encode()) else None


def get_signed(store: Store, group_name: str, key: str, timeout_s: float, secret: Optional[bytes],
                on_forged: Optional[Callable[[str], None]] = None) -> str:
    """`key`'s value once it carries a valid tag (`sign_value`), waiting at most `timeout_s`; a forged value is
    reported and waited out (the signer's own write replaces it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no validly signed {key!r} within {timeout_s:g}s")
        value = verify_value(secret, group_name, key, get_str(store, key, left))
        if value is not None:
            return value
        logger.warning("group %s: ignored a value under %s that is not signed with the run's secret", group_name, key)
        if on_forged is not None:
            on_forged(key)
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


def delete_keys(store: Store, *keys: str) -> None:
    for k in keys:
        try:
            store.delete_key(k)
        except Exception:  # noqa: BLE001 - a store without delete keeps a few bytes per transfer
            pass
