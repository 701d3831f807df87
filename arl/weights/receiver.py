"""An inference worker's side of a broadcast to a torch engine: `WeightReceiver` joins a group and receives each
transfer (`arl.weights.sender` describes the steps; this side refuses a plan that does not fit its model before any
byte moves, and reports whether it applied the weights)."""

from __future__ import annotations

import logging
from typing import Callable, Mapping, Optional, Sequence, Union

import torch
from torch._C._distributed_c10d import TCPStore

from arl.weights.adapter import adapter_expected, is_adapter
from arl.weights.group import Group, GroupSpec, WeightTransferError, store_client, wait_announced
from arl.weights.plan import DTYPES, TransferPlan, dtype_name, record_event, unpack_bucket

logger = logging.getLogger("arl.weights.broadcast")

__all__ = ["Target", "WeightReceiver", "check_plan"]

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
            nonlocal ref
            if ref is not None and is_adapter(m.name for m in p.tensors):  # LoRA: the adapters of ref's weights
                ref, problems = adapter_expected(ref, {m.name: m.shape for m in p.tensors})
                if problems:
                    return "; ".join(problems[:5])
                return check_plan(p, ref, expected_names=expected_names, allow_missing=True)
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
            g.after(record_event(g.device))
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
