"""Weights over torch.distributed: the learner's rank 0 broadcasts a state dict to inference workers.

Groups. The sender hosts a TCPStore (multi-tenant, on its own port) and every group lives on it under its own name,
with the key layout of ``sglang.srt.utils.init_custom_process_group`` + torch's ``_new_process_group_helper``
(``PrefixStore(name)`` -> ``PrefixStore(name + "/")`` -> ``PrefixStore("cpu/" | "cuda/")``), so an SGLang server
joins a group with ``/init_weights_update_group`` (``rank_offset``) and meets the sender. Unlike those helpers, the
backend (``ProcessGroupGloo`` / ``ProcessGroupNCCL``) is built directly and never registered in torch's global
``_world``: the learner's default (DeepSpeed) group, its names and its NCCL communicator splitting are untouched,
and a group name can be reused in another store. A group is rank 0 (the sender) + ``world_size - 1`` receivers;
one group per receiver lets a worker die and rejoin (a fresh group name) without disturbing the others.

One transfer on an ARL group (torch receivers), `seq` counting transfers on that group from 0:

1. the sender puts the plan (version, names, wire dtypes, shapes, buckets) under ``arl/xfer/<seq>`` in the store:
   a receiver waits for it with its own idle timeout, not inside a collective;
2. all-reduce of a per-rank refusal vector: a receiver whose model does not fit the plan refuses (its reason
   under ``arl/refusal/<seq>/<rank>``), and then nobody sends or receives a byte;
3. one broadcast per bucket (the tensors cast to the wire dtype, flattened to bytes and concatenated, the layout
   of SGLang's ``FlattenedTensorBucket``);
4. all-reduce of a per-rank failure vector: the sender learns that every receiver applied the weights.

An SGLang group (``protocol="sglang"``) gets steps 1 and 3 only; `arl.weights.sglang.SGLangWeightClient` (in the
worker that owns the server) reads the plan, posts it over HTTP, and writes the outcome under ``arl/done/<seq>``,
which the sender waits for. Every wait has a timeout; a group whose collective failed is closed (its peer must
rejoin under a new name), a refusal keeps it open.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch
from torch._C._distributed_c10d import AllreduceOptions, BroadcastOptions, PrefixStore, ReduceOp, Store, TCPStore

logger = logging.getLogger(__name__)

__all__ = ["DTYPES", "GroupSpec", "Group", "Packed", "RankNotProven", "TensorMeta", "TransferPlan", "TransferStats",
           "WeightReceiver", "WeightSender", "WeightTransferError", "dedup_tied", "make_plan", "pack_bucket",
           "sign_value", "unpack_bucket", "verify_value"]

DEFAULT_BUCKET_BYTES = 64 << 20
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The name SGLang's ``dtypes`` field uses (``getattr(torch, name)`` gives the dtype back)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype} cannot go over the wire (supported: {sorted(DTYPES)})")
    return name


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


# ---------------------------------------------------------------------------------------------------------- plan

@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """One tensor as it travels: the wire dtype, not necessarily the one either side holds."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * DTYPES[self.dtype].itemsize


@dataclasses.dataclass(frozen=True)
class TransferPlan:
    """The order, wire dtypes and shapes of a transfer, and its buckets (``[start, end)`` index ranges)."""

    tensors: tuple[TensorMeta, ...]
    buckets: tuple[tuple[int, int], ...]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def bucket(self, k: int) -> tuple[TensorMeta, ...]:
        a, b = self.buckets[k]
        return self.tensors[a:b]

    def bucket_nbytes(self, k: int) -> int:
        return sum(t.nbytes for t in self.bucket(k))

    def to_json(self) -> dict[str, Any]:
        return {"tensors": [[t.name, t.dtype, list(t.shape)] for t in self.tensors],
                "buckets": [list(b) for b in self.buckets]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "TransferPlan":
        tensors = tuple(TensorMeta(str(n), str(dt), tuple(int(x) for x in s)) for n, dt, s in d["tensors"])
        buckets = tuple((int(a), int(b)) for a, b in d["buckets"])
        for t in tensors:
            if t.dtype not in DTYPES:
                raise ValueError(f"tensor {t.name}: unknown wire dtype {t.dtype!r}")
        if [i for b in buckets for i in range(*b)] != list(range(len(tensors))):
            raise ValueError("buckets do not cover the tensors in order")
        return cls(tensors, buckets)

    def sglang_requests(self, group_name: str, weight_version: Optional[str] = None, *,
                        flush_cache: bool = True) -> list[dict[str, Any]]:
        """One ``/update_weights_from_distributed`` body per bucket (SGLang's ``flattened_bucket`` format: one
        broadcast of the bucket's bytes). The version and the cache flush ride on the last one only, so the
        server never reports a version whose weights are half loaded."""
        out = []
        for k in range(len(self.buckets)):
            last = k == len(self.buckets) - 1
            ts = self.bucket(k)
            body: dict[str, Any] = {"names": [t.name for t in ts], "dtypes": [t.dtype for t in ts],
                                    "shapes": [list(t.shape) for t in ts], "group_name": group_name,
                                    "load_format": "flattened_bucket", "flush_cache": bool(flush_cache and last)}
            if last and weight_version is not None:
                body["weight_version"] = str(weight_version)
            out.append(body)
        return out


def make_plan(tensors: Mapping[str, torch.Tensor], *, names: Optional[Sequence[str]] = None,
              wire_dtype: Optional[Union[str, torch.dtype]] = None,
              bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> TransferPlan:
    """The plan for sending `tensors` in `names` order (default: the mapping's order). Floating tensors travel in
    `wire_dtype` when given (the receiver casts back); others as they are. A bucket closes before it would exceed
    `bucket_bytes` (a bigger tensor gets a bucket of its own) or where the next tensor's byte offset would not be a
    multiple of its item size (SGLang refuses unaligned buckets)."""
    order = list(tensors) if names is None else list(names)
    missing = [n for n in order if n not in tensors]
    if missing:
        raise KeyError(f"no tensor named {missing[:5]}")
    if len(set(order)) != len(order):
        raise ValueError("names repeat")
    if not order:
        raise ValueError("nothing to send")
    wire = None if wire_dtype is None else (DTYPES[wire_dtype] if isinstance(wire_dtype, str) else wire_dtype)
    metas: list[TensorMeta] = []
    for n in order:
        t = tensors[n]
        dt = wire if wire is not None and t.is_floating_point() else t.dtype
        metas.append(TensorMeta(n, dtype_name(dt), tuple(int(x) for x in t.shape)))
    buckets: list[tuple[int, int]] = []
    start, size = 0, 0
    for i, m in enumerate(metas):
        if i > start and (size + m.nbytes > bucket_bytes or size % DTYPES[m.dtype].itemsize):
            buckets.append((start, i))
            start, size = i, 0
        size += m.nbytes
    buckets.append((start, len(metas)))
    return TransferPlan(tuple(metas), tuple(buckets))


def pack_bucket(plan: TransferPlan, k: int, tensors: Mapping[str, torch.Tensor],
                device: Union[str, torch.device] = "cpu", out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Bucket `k` as one uint8 tensor on `device` (or written into `out`): each tensor cast to its wire dtype,
    flattened, concatenated, in one copy."""
    buf = out if out is not None else torch.empty(plan.bucket_nbytes(k), dtype=torch.uint8, device=device)
    if buf.numel() != plan.bucket_nbytes(k):
        raise ValueError(f"bucket {k}: a buffer of {buf.numel()} bytes, the plan says {plan.bucket_nbytes(k)}")
    off = 0
    for m in plan.bucket(k):
        t = tensors[m.name].detach()
        if tuple(t.shape) != m.shape:
            raise ValueError(f"tensor {m.name}: shape {tuple(t.shape)} is not the plan's {m.shape}")
        buf[off:off + m.nbytes].view(DTYPES[m.dtype]).view(m.shape).copy_(t)
        off += m.nbytes
    return buf


@dataclasses.dataclass
class Packed:
    """A state dict packed into its plan's buckets: what a send puts on the wire. Packing into buffers kept from
    one version to the next is one memory copy; into fresh ones it is page faults too (~1 GB/s on CPU).

    On CUDA, `fill` only queues the copies on the packing thread's current stream (the training stream, so the
    next step cannot change the weights before they are copied) and records `ready` after them: a send waits for
    that event on its own stream, never for the training stream itself."""

    plan: TransferPlan
    buckets: list[torch.Tensor]
    ready: Optional[Any] = None  # torch.cuda.Event recorded after the last copy of `fill` (CUDA buffers only)

    @classmethod
    def allocate(cls, plan: TransferPlan, device: Union[str, torch.device] = "cpu") -> "Packed":
        return cls(plan, [torch.empty(plan.bucket_nbytes(k), dtype=torch.uint8, device=device)
                          for k in range(len(plan.buckets))])

    def fill(self, tensors: Mapping[str, torch.Tensor]) -> "Packed":
        for k, buf in enumerate(self.buckets):
            pack_bucket(self.plan, k, tensors, out=buf)
        self.ready = _record_event(self.buckets[0].device) if self.buckets else None
        return self


def _record_event(device: torch.device) -> Optional[Any]:
    """A CUDA event recorded on `device`'s current stream (None off CUDA)."""
    if device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    return ev


def resolve_device(device: Optional[Union[str, torch.device]], backend: str) -> torch.device:
    """The device a group's tensors live on: `device`, else the CPU for gloo and the current CUDA device for
    NCCL (with its index, so tensors can be compared with it). NCCL takes CUDA tensors only."""
    dev = torch.device(device if device is not None else ("cpu" if backend == "gloo" else "cuda"))
    if backend == "nccl" and dev.type != "cuda":
        raise ValueError(f"an NCCL weight group needs a CUDA device, got {dev}")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def unpack_bucket(plan: TransferPlan, k: int, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The tensors of bucket `k` as views of `buf` (no copy), in their wire dtypes and shapes."""
    out, off = [], 0
    for m in plan.bucket(k):
        out.append((m.name, buf[off:off + m.nbytes].view(DTYPES[m.dtype]).view(m.shape)))
        off += m.nbytes
    if off != buf.numel():
        raise ValueError(f"bucket {k}: {buf.numel()} bytes, the plan says {off}")
    return out


def dedup_tied(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` without the later names of a tensor shared by several (tied embeddings): SGLang wants each once."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    out: dict[str, torch.Tensor] = {}
    for n, t in tensors.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        out[n] = t
    return out


# --------------------------------------------------------------------------------------------------------- groups

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


def _td(seconds: float) -> timedelta:
    return timedelta(seconds=float(seconds))


def store_client(address: str, port: int, timeout_s: float) -> TCPStore:
    """A client of the sender's store (retries the connection until `timeout_s`)."""
    return TCPStore(address, port, None, False, _td(timeout_s))


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
                    self.pg: Any = ProcessGroupGloo(pg_store, rank, size, _td(timeout_s))
                else:
                    opts = ProcessGroupGloo._Options()
                    opts._timeout = _td(timeout_s)
                    opts._devices = [ProcessGroupGloo.create_device(hostname=gloo_host)]
                    self.pg = ProcessGroupGloo(pg_store, rank, size, opts)
            elif backend == "nccl":
                from torch.distributed import ProcessGroupNCCL

                opts = ProcessGroupNCCL.Options()
                opts._timeout = _td(timeout_s)
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
                work.wait(_td(self.timeout_s))
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
        opts.timeout = _td(self.timeout_s)
        with self.on_stream():
            return self.pg.broadcast([t], opts)

    def broadcast(self, t: torch.Tensor, what: str) -> None:
        self._wait(self.broadcast_async(t), what)

    def allreduce_async(self, t: torch.Tensor) -> Any:
        self._check(t, "all-reduce")
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        opts.timeout = _td(self.timeout_s)
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
        raw = json.loads(_get_signed(store, group_name, f"arl/xfer/{seq}", wait_s, secret, on_forged))
    except Exception as e:  # noqa: BLE001
        raise WeightTransferError(f"group {group_name!r}: no transfer #{seq} announced within {wait_s:g}s: "
                                  f"{e}") from e
    return int(raw["version"]), TransferPlan.from_json(raw["plan"])


def _get_str(store: Store, key: str, timeout_s: float) -> str:
    store.wait([key], _td(timeout_s))
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


def _get_signed(store: Store, group_name: str, key: str, timeout_s: float, secret: Optional[bytes],
                on_forged: Optional[Callable[[str], None]] = None) -> str:
    """`key`'s value once it carries a valid tag (`sign_value`), waiting at most `timeout_s`; a forged value is
    reported and waited out (the signer's own write replaces it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no validly signed {key!r} within {timeout_s:g}s")
        value = verify_value(secret, group_name, key, _get_str(store, key, left))
        if value is not None:
            return value
        logger.warning("group %s: ignored a value under %s that is not signed with the run's secret", group_name, key)
        if on_forged is not None:
            on_forged(key)
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


def _delete(store: Store, *keys: str) -> None:
    for k in keys:
        try:
            store.delete_key(k)
        except Exception:  # noqa: BLE001 - a store without delete keeps a few bytes per transfer
            pass


# ---------------------------------------------------------------------------------------------------------- sender

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
    protocol: str
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
        self._store = TCPStore(host.strip("[]"), bound, None, True, _td(timeout_s), wait_for_workers=False,
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
        t0 = time.monotonic()
        failures: dict[str, str] = {}
        broken: set[str] = set()

        def fail(n: str, reason: str, *, close: bool) -> None:
            failures[n] = reason
            live.pop(n, None)
            if close:
                broken.add(n)
                self.close_group(n)

        seqs = {}
        announce = json.dumps({"version": version, "plan": plan.to_json()})
        for n, sg in live.items():
            seqs[n] = sg.seq
            sg.seq += 1
            key = f"arl/xfer/{seqs[n]}"
            sg.group.store.set(key, sign_value(self.secret, n, key, announce))
        # 2. refusals (ARL groups)
        pending = {n: (sg.group.flags(),) for n, sg in live.items() if sg.protocol == "arl"}
        works = {}
        for n, (flags,) in pending.items():
            works[n] = live[n].group.allreduce_async(flags)
        for n, w in works.items():
            g = live[n].group
            try:
                g._wait(w, f"the refusal all-reduce of v{version}")
            except WeightTransferError as e:
                fail(n, str(e), close=True)
                continue
            flags = pending[n][0].cpu()
            if int(flags.sum()):
                reasons = []
                for r in range(g.size):
                    if int(flags[r]):
                        try:
                            reasons.append(f"rank {r}: {_get_str(g.store, f'arl/refusal/{seqs[n]}/{r}', 5.0)}")
                        except Exception:  # noqa: BLE001
                            reasons.append(f"rank {r}: (no reason left in the store)")
                fail(n, f"v{version} refused: " + "; ".join(reasons), close=False)
        # 3. the payload, bucket by bucket, to every live group at once. Packed: every bucket is posted at once (as
        # the receiver posts its buffers), so no bucket waits for a round trip; else bucket k+1 is packed and queued
        # while bucket k is on the wire.
        nb = len(plan.buckets)
        depth = nb if isinstance(tensors, Packed) else 2
        posted: collections.deque[tuple[int, dict[str, Any], torch.Tensor]] = collections.deque()
        for k in range(nb + depth):
            if k < nb and live:
                if isinstance(tensors, Packed):
                    buf, packed = tensors.buckets[k], tensors.ready
                else:  # packed here, on this thread's current stream: the groups' streams wait for it
                    buf = pack_bucket(plan, k, tensors, self._device())
                    packed = _record_event(buf.device)
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
                        fail(n, self._with_outcome(live[n], seqs[n], str(e)), close=True)
        # 4. every receiver says it applied them
        works = {}
        flags_of = {}
        for n, sg in list(live.items()):
            if sg.protocol == "arl":
                flags_of[n] = sg.group.flags()
                works[n] = sg.group.allreduce_async(flags_of[n])
        for n, sg in list(live.items()):
            g = sg.group
            try:
                if sg.protocol == "arl":
                    g._wait(works[n], f"the completion all-reduce of v{version}")
                    flags = flags_of[n].cpu()
                    bad = [r for r in range(g.size) if int(flags[r])]
                    if bad:
                        msgs = [f"rank {r}: {_get_str(g.store, f'arl/failed/{seqs[n]}/{r}', 5.0)}" for r in bad]
                        fail(n, f"v{version} not applied: " + "; ".join(msgs), close=False)
                else:
                    try:
                        done = json.loads(_get_signed(g.store, n, f"arl/done/{seqs[n]}", self.timeout_s, self.secret,
                                                      self._forged))
                    except Exception as e:  # noqa: BLE001
                        raise WeightTransferError(f"group {n!r}: no outcome from the SGLang worker for v{version} "
                                                  f"within {self.timeout_s:g}s: {e}") from e
                    if not done.get("success"):  # bytes may be left in the pipe: the group is out of step
                        fail(n, f"v{version} not loaded by the SGLang server: {done.get('message')}", close=True)
            except WeightTransferError as e:
                fail(n, str(e), close=True)
        for n, s in seqs.items():
            if n not in broken:
                with self._lock:
                    sg = self._groups.get(n)
                if sg is not None:
                    _delete(sg.group.store, f"arl/xfer/{s}", f"arl/done/{s}")
        stats = TransferStats(version, plan.total_bytes, time.monotonic() - t0, sorted(live))
        if failures:
            raise WeightTransferError(f"v{version} did not reach {sorted(failures)}: "
                                      + " | ".join(f"{n}: {r}" for n, r in failures.items()), failures, sorted(live))
        return stats

    def _with_outcome(self, sg: _SenderGroup, seq: int, reason: str) -> str:
        """`reason`, plus what the SGLang worker reported if it did (why the server never took the bytes)."""
        if sg.protocol != "sglang":
            return reason
        key = f"arl/done/{seq}"
        try:
            if sg.group.store.check([key]):
                said = verify_value(self.secret, sg.group.name, key, sg.group.store.get(key).decode())
                if said is not None:
                    return f"{reason}; the SGLang worker says: {json.loads(said).get('message')}"
        except Exception:  # noqa: BLE001
            pass
        return reason

    def _device(self) -> torch.device:
        return self.device


# -------------------------------------------------------------------------------------------------------- receiver

Target = Union[torch.nn.Module, Mapping[str, torch.Tensor]]


def _target_tensors(target: Target) -> dict[str, torch.Tensor]:
    if isinstance(target, torch.nn.Module):
        return dict(target.state_dict(keep_vars=True))
    return dict(target)


def check_plan(plan: TransferPlan, target: Mapping[str, torch.Tensor], *,
               expected_names: Optional[Sequence[str]] = None, allow_missing: bool = False) -> Optional[str]:
    """Why `plan` does not fit `target` (None when it does): names, order, shapes, dtypes that cannot cast.
    A target name absent from the plan is fine when it shares storage with one that is in it (tied weights)."""
    problems: list[str] = []
    names = [t.name for t in plan.tensors]
    if expected_names is not None and list(expected_names) != names:
        first = next((i for i, (a, b) in enumerate(zip(names, expected_names)) if a != b),
                     min(len(names), len(expected_names)))
        problems.append(f"order differs at tensor #{first}: sender sends "
                        f"{names[first] if first < len(names) else '(end)'!r}, receiver expects "
                        f"{expected_names[first] if first < len(expected_names) else '(end)'!r}")
    unexpected = [n for n in names if n not in target]
    if unexpected:
        problems.append(f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} ({len(unexpected)})")
    sent = set(names)
    sent_ptrs = {target[n].data_ptr() for n in names if n in target}
    missing = [n for n, t in target.items() if n not in sent and t.data_ptr() not in sent_ptrs]
    if missing and not allow_missing:
        problems.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''} ({len(missing)})")
    for m in plan.tensors:
        t = target.get(m.name)
        if t is None:
            continue
        if tuple(t.shape) != m.shape:
            problems.append(f"{m.name}: shape {list(m.shape)} sent, {list(t.shape)} here")
        wire = DTYPES[m.dtype]
        if wire != t.dtype and (wire.is_floating_point != t.dtype.is_floating_point or t.dtype == torch.bool
                                or wire == torch.bool):
            problems.append(f"{m.name}: dtype {m.dtype} sent, {dtype_name(t.dtype)} here")
    return "; ".join(problems) if problems else None


class WeightReceiver:
    """The torch-engine side of one group: join it, then `receive_into` a model (in place) or `receive` new
    tensors, once per transfer the sender makes, in the same order. Every wait has a timeout."""

    def __init__(self, spec: GroupSpec, *, timeout_s: float = 60.0, gloo_host: Optional[str] = None,
                 device: Optional[Union[str, torch.device]] = None, secret: Optional[bytes] = None) -> None:
        """`secret`: the run's; then the group's members prove it before anything moves, and only announcements
        signed with it are taken (`stats` counts the forged ones ignored)."""
        self.spec, self.timeout_s, self.gloo_host, self.device = spec, timeout_s, gloo_host, device
        self.secret = secret
        self.stats = {"forged_values": 0}
        self.group: Optional[Group] = None
        self._base: Optional[TCPStore] = None
        self.seq = 0
        self.version: Optional[int] = None
        # bucket buffers of `receive`: the last one's, the engine's current weights', and spare ones (the weights
        # the engine served before: received into again, not allocated anew; see `swapped`)
        self._bufs_last: list[torch.Tensor] = []
        self._bufs_live: list[torch.Tensor] = []
        self._bufs_spare: list[torch.Tensor] = []

    def join(self) -> None:
        """Join the group (blocks until every member has, at most `timeout_s`)."""
        s = self.spec
        try:
            self._base = store_client(s.master_address, s.master_port, self.timeout_s)
        except Exception as e:  # noqa: BLE001
            raise WeightTransferError(f"group {s.group_name!r}: cannot reach the sender's store at "
                                      f"{s.master_address}:{s.master_port} within {self.timeout_s:g}s: {e}") from e
        self.group = Group(self._base, s.group_name, s.rank, s.world_size, backend=s.backend,
                           timeout_s=self.timeout_s, gloo_host=self.gloo_host, device=self.device, secret=self.secret)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group, self._base = None, None

    def wait_plan(self, wait_s: Optional[float] = None) -> tuple[int, TransferPlan]:
        """The version and plan of the next transfer, waiting at most `wait_s` (default `timeout_s`) for the
        sender to announce it (this wait is outside any collective, so it can be long)."""
        g = self._joined()
        return wait_announced(g.store, g.name, self.seq, self.timeout_s if wait_s is None else wait_s, self.secret,
                              self._forged)

    def _forged(self, key: str) -> None:
        self.stats["forged_values"] += 1

    def receive_into(self, target: Target, *, wait_s: Optional[float] = None,
                     expected_names: Optional[Sequence[str]] = None, allow_missing: bool = False,
                     progress: Optional[Callable[[int, int], None]] = None) -> int:
        """Receive the next transfer into `target`'s tensors in place (cast to their dtypes); returns its version.
        The caller must keep the model idle meanwhile; a transfer that fails halfway leaves a mix of old and new
        tensors (reload or retry before using it). Refuses (raises, and the sender is told why) a plan that does
        not fit `target`."""
        tensors = _target_tensors(target)

        def apply(name: str, src: torch.Tensor) -> None:
            with torch.no_grad():
                tensors[name].copy_(src)

        return self._receive(lambda p: check_plan(p, tensors, expected_names=expected_names,
                                                  allow_missing=allow_missing), apply, wait_s, progress)

    def swapped(self) -> None:
        """The engine now serves the tensors of the last `receive` and dropped the ones it served before: their
        buffers take the next transfer (two model copies stay allocated, as during any transfer; no page faults)."""
        self._bufs_spare, self._bufs_live, self._bufs_last = self._bufs_live, self._bufs_last, []

    def _buffer(self, k: int, nbytes: int, device: torch.device) -> torch.Tensor:
        spare = self._bufs_spare[k] if k < len(self._bufs_spare) else None
        if spare is not None and spare.numel() == nbytes and spare.device == device:
            return spare
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def receive(self, expected: Optional[Target] = None, *, wait_s: Optional[float] = None,
                expected_names: Optional[Sequence[str]] = None, allow_missing: bool = False,
                progress: Optional[Callable[[int, int], None]] = None) -> tuple[int, dict[str, torch.Tensor]]:
        """Receive the next transfer as new tensors (cast to `expected`'s dtypes when given, else in the wire
        dtypes), checked against `expected`'s names and shapes; the model is untouched, so an engine can swap
        them in between two steps."""
        ref = _target_tensors(expected) if expected is not None else None
        out: dict[str, torch.Tensor] = {}
        if self._bufs_last:  # the last transfer was never swapped in: nothing serves from it
            self._bufs_spare, self._bufs_last = self._bufs_last, []

        def keep(name: str, src: torch.Tensor) -> None:
            out[name] = src if ref is None else src.to(dtype=ref[name].dtype)

        def check(p: TransferPlan) -> Optional[str]:
            if ref is not None:
                return check_plan(p, ref, expected_names=expected_names, allow_missing=allow_missing)
            if expected_names is not None:
                return check_plan(p, {m.name: torch.empty(m.shape, dtype=DTYPES[m.dtype], device="meta")
                                      for m in p.tensors}, expected_names=expected_names)
            return None

        version = self._receive(check, keep, wait_s, progress, reuse=True)
        return version, out

    def _receive(self, check: Callable[[TransferPlan], Optional[str]], sink: Callable[[str, torch.Tensor], None],
                 wait_s: Optional[float], progress: Optional[Callable[[int, int], None]], reuse: bool = False) -> int:
        """One transfer; with `reuse`, into the spare buffers (`swapped`), and the buffers are kept as the last."""
        g = self._joined()
        version, plan = self.wait_plan(wait_s)
        seq = self.seq
        self.seq += 1
        try:
            reason = check(plan)
        except Exception as e:  # noqa: BLE001 - a check that crashes is a refusal, not a hung sender
            reason = f"checking the plan raised {type(e).__name__}: {e}"
        if reason:
            g.store.set(f"arl/refusal/{seq}/{g.rank}", reason)
        flags = g.flags(bool(reason))
        try:
            g._wait(g.allreduce_async(flags), f"the refusal all-reduce of v{version}")
        except WeightTransferError:
            self.close()
            raise
        if int(flags.sum()):
            if reason:
                raise WeightTransferError(f"group {g.name!r}: refused v{version}: {reason}")
            raise WeightTransferError(f"group {g.name!r}: v{version} was refused by another receiver of the group")
        failure: Optional[str] = None
        n = len(plan.buckets)
        try:
            # CUDA: the group's stream first waits (on the GPU) for what the engine queued so far (it may still read
            # the spare buffers); buffers, receives and casts then go on that stream, never the engine's
            g.after(_record_event(g.device))
            with g.on_stream():
                # every bucket's buffer posted at once: the sender never waits for a receive to be posted
                bufs = [self._buffer(k, plan.bucket_nbytes(k), g.device) if reuse else
                        torch.empty(plan.bucket_nbytes(k), dtype=torch.uint8, device=g.device) for k in range(n)]
            works = [g.broadcast_async(buf) for buf in bufs]
            for k, (work, buf) in enumerate(zip(works, bufs)):
                g._wait(work, f"bucket {k}/{n} of v{version}")
                if failure is None:
                    try:
                        with g.on_stream():  # the completion all-reduce's wait synchronises it
                            for name, t in unpack_bucket(plan, k, buf):
                                sink(name, t)
                    except Exception as e:  # noqa: BLE001 - reported to the sender; the group stays in step
                        failure = f"applying bucket {k}: {type(e).__name__}: {e}"
                if progress is not None:
                    progress(k, n)
            if failure:
                g.store.set(f"arl/failed/{seq}/{g.rank}", failure)
            flags = g.flags(bool(failure))
            g._wait(g.allreduce_async(flags), f"the completion all-reduce of v{version}")
        except WeightTransferError:
            self.close()  # a collective failed: this group is out of step for good
            raise
        if failure:
            raise WeightTransferError(f"group {g.name!r}: v{version} received but not applied: {failure}")
        if reuse:
            self._bufs_last, self._bufs_spare = bufs, []
        self.version = version
        return version

    def _joined(self) -> Group:
        if self.group is None:
            raise WeightTransferError(f"group {self.spec.group_name!r}: not joined (or closed after a failure)")
        return self.group
