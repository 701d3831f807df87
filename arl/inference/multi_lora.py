"""Several LoRA policies served at once on one base model: each row of a batch decodes with its own adapter.

Why unmerged here, while one LoRA policy alone is merged into the weights (`TorchEngine._prepare_adapter`): a merged
weight serves one policy per forward; rows of several policies in one decode step need the base weight shared and
each row's low-rank delta added on its own,

    y_i = x_i W^T + (x_i A_{s_i}^T) B_{s_i}^T        (s_i: row i's adapter slot; slot 0 is the base, a zero adapter)

computed for the whole batch by one gather of the rows' A and B and two batched matmuls (`torch.bmm`), the batched
gather-matmul of Punica / S-LoRA, instead of one forward (or one batch) per adapter. A forward whose rows all use one
slot takes two plain matmuls (no gather); one whose rows are all on the base adds nothing.

The adapters live here, not in the model: its parameters and state_dict keep their names (a full weight update still
applies, and the adapters stay deltas on the new base), and each adapted `nn.Linear` gets a forward hook that adds
the delta. An adapter payload (`arl.weights.adapter`: A and B per weight, B already scaled) is padded to
`max_rank` with zeros, which changes nothing in the product.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch

from arl.weights.adapter import is_adapter, split_payload

__all__ = ["LoraSlots", "LoraUpdate"]


@dataclasses.dataclass
class LoraUpdate:
    """One policy's adapter, checked and cast off the decode thread; `apply` installs it between two steps (and
    chooses its slot then: two new policies prepared at once must not both take the slot that was free)."""

    policy: Optional[str]  # None: the engine's own policy's adapter
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module name -> (A [max_rank, in], B [out, max_rank])


class _Stack:
    """The adapters of one linear module, one per slot: A [slots, r, in], B [slots, out, r] (slot 0 stays zero)."""

    def __init__(self, linear: torch.nn.Linear, slots: int, rank: int) -> None:
        w = linear.weight
        self.a = torch.zeros((slots, rank, w.shape[1]), dtype=w.dtype, device=w.device)
        self.b = torch.zeros((slots, w.shape[0], rank), dtype=w.dtype, device=w.device)


class LoraSlots:
    """LoRA policies by name, each in a slot of every adapted module, applied per batch row (`rows`).

    Args:
        model: the served model (its `nn.Linear` modules are the ones an adapter may target).
        max_adapters: most policies served at once (their slots are 1..max_adapters).
        max_rank: most rank of an adapter (each is padded to it).
    """

    def __init__(self, model: torch.nn.Module, max_adapters: int, max_rank: int) -> None:
        if max_adapters < 1 or max_rank < 1:
            raise ValueError(f"max_adapters and max_rank must be >= 1, got {max_adapters}, {max_rank}")
        self.model = model
        self.max_adapters, self.max_rank = int(max_adapters), int(max_rank)
        self.slots: dict[Optional[str], int] = {}  # policy -> slot (None: the engine's own policy's adapter)
        self.versions: dict[int, int] = {}  # slot -> version of the adapter it holds (the base: the engine's own)
        self._stacks: dict[str, _Stack] = {}
        self._sel: Optional[int | torch.Tensor] = None  # the current forward's rows: None (base), a slot, or [B]

    def slot(self, policy: Optional[str]) -> int:
        """The slot serving `policy`; KeyError for a named policy not loaded. None: the engine's own policy, its
        adapter's slot once one was loaded (a LoRA-trained run beside frozen policies), else the base (0)."""
        return self.slots.get(None, 0) if policy is None else self.slots[policy]

    @property
    def names(self) -> list[str]:
        """The named policies served (the engine's own is not among them)."""
        return sorted(p for p in self.slots if p is not None)

    def prepare(self, policy: Optional[str], payload: Mapping[str, torch.Tensor]) -> LoraUpdate:
        """Any thread: `payload` checked against the model and cast to each weight's dtype and device. Raises
        ValueError, naming what does not fit (the served adapters are untouched)."""
        if not is_adapter(payload):
            raise ValueError(f"policy {policy!r}: a LoRA policy is served from an adapter payload (lora_A / lora_B "
                             f"tensors); got full weights ({len(payload)} tensors)")
        pairs, full = split_payload(payload)
        problems = [f"{k}: a LoRA policy served beside others cannot replace whole tensors (modules_to_save)"
                    for k in sorted(full)]
        modules = dict(self.model.named_modules())
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for weight, (a, b) in sorted(pairs.items()):
            name = weight[: -len(".weight")]
            linear = modules.get(name)
            if not isinstance(linear, torch.nn.Linear):
                problems.append(f"{weight}: the model has no linear module {name}")
                continue
            out_f, in_f = linear.weight.shape
            r = int(a.shape[0]) if a.dim() == 2 else -1
            if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (r, in_f) or tuple(b.shape) != (out_f, r):
                problems.append(f"{weight}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit a "
                                f"{out_f}x{in_f} weight")
            elif r > self.max_rank:
                problems.append(f"{weight}: rank {r} over the engine's max_lora_rank {self.max_rank}")
            else:
                w = linear.weight
                pa = torch.zeros((self.max_rank, in_f), dtype=w.dtype, device=w.device)
                pb = torch.zeros((out_f, self.max_rank), dtype=w.dtype, device=w.device)
                pa[:r] = a.to(device=w.device, dtype=w.dtype)
                pb[:, :r] = b.to(device=w.device, dtype=w.dtype)
                out[name] = (pa, pb)
        if policy not in self.slots and self._free_slot() is None:
            problems.append(self._full(policy))
        if problems:
            raise ValueError(f"policy {policy!r}: adapter does not fit: {'; '.join(problems[:10])}")
        return LoraUpdate(policy=policy, pairs=out)

    def _free_slot(self) -> Optional[int]:
        free = sorted(set(range(1, self.max_adapters + 1)) - set(self.slots.values()))
        return free[0] if free else None

    def _full(self, policy: Optional[str]) -> str:
        return (f"no free adapter slot for a new policy {policy!r}: the engine serves {self.names} "
                f"(max_loras={self.max_adapters})")

    def apply(self, update: LoraUpdate, version: int) -> int:
        """The decode thread, between two steps: `update` becomes its policy's slot's adapter (a new policy takes a
        free slot; modules it leaves out get a zero delta there), `version` its version; returns the slot."""
        slot = self.slots.get(update.policy)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                raise ValueError(f"policy {update.policy!r}: {self._full(update.policy)}")
        modules = dict(self.model.named_modules())
        for name in update.pairs:
            if name not in self._stacks:
                self._stacks[name] = _Stack(modules[name], self.max_adapters + 1, self.max_rank)
                modules[name].register_forward_hook(self._hook(name))  # lives as long as the engine's model
        for name, stack in self._stacks.items():
            a, b = update.pairs.get(name, (None, None))
            if a is None:
                stack.a[slot].zero_()
                stack.b[slot].zero_()
            else:
                stack.a[slot].copy_(a)
                stack.b[slot].copy_(b)
        self.slots[update.policy] = slot
        self.versions[slot] = int(version)
        return slot

    @contextlib.contextmanager
    def rows(self, slots: Sequence[int]) -> Iterator[None]:
        """Forwards inside use slot `slots[i]` for batch row i."""
        first = slots[0] if len(slots) else 0
        if all(s == first for s in slots):
            self._sel = None if first == 0 or not self._stacks else int(first)
        else:
            device = next(iter(self._stacks.values())).a.device if self._stacks else None
            self._sel = torch.tensor(list(slots), dtype=torch.long, device=device)
        try:
            yield
        finally:
            self._sel = None

    def _hook(self, name: str) -> Any:
        stack = self._stacks[name]

        def add_delta(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> Optional[torch.Tensor]:
            sel = self._sel
            if sel is None:
                return None
            x = args[0]
            if isinstance(sel, int):
                return out + (x @ stack.a[sel].T) @ stack.b[sel].T
            a, b = stack.a.index_select(0, sel), stack.b.index_select(0, sel)  # [B, r, in], [B, out, r]
            x3 = x.reshape(x.shape[0], -1, x.shape[-1])
            return out + torch.bmm(torch.bmm(x3, a.transpose(1, 2)), b.transpose(1, 2)).view_as(out)

        return add_delta
