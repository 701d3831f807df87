"""The layout of one weight transfer: which tensors, in which wire dtype and order, packed into which buckets.

Both sides agree on a `TransferPlan` before any byte moves (the sender announces it, a receiver checks it against
its model). A bucket is its tensors cast to their wire dtypes, flattened to bytes and concatenated: the layout of
SGLang's ``FlattenedTensorBucket``, so one broadcast per bucket serves a torch receiver and an SGLang server alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence, Union

import torch

__all__ = ["DEFAULT_BUCKET_BYTES", "DTYPES", "Packed", "TensorMeta", "TransferPlan", "dedup_tied", "dtype_name",
           "make_plan", "pack_bucket", "record_event", "unpack_bucket"]

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
        self.ready = record_event(self.buckets[0].device) if self.buckets else None
        return self


def record_event(device: torch.device) -> Optional[Any]:
    """A CUDA event recorded on `device`'s current stream (None off CUDA)."""
    if device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    return ev


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
