"""Turn a list of `Trajectory` into micro-batches of right-padded tensors bounded by a token budget.

Two steps with separate boundaries, so a packed (padding-free, ``cu_seqlens``) layout can replace the padded one
later without touching the learner loop:

1. `split_by_token_budget(lengths, max_tokens_per_mb)` -> groups of sequence indices;
2. `collate_padded(trajs, indices, advantages)` -> one `MicroBatch`.

`build_micro_batches` runs both. The packed layout (no padding at all, ``packed=True``) is `pack_by_token_budget` +
`collate_packed`: each micro-batch is one row ``[1, T]`` holding several sequences
back to back, ``position_ids`` restarting at 0 for each and ``cu_seqlens`` marking their boundaries, so attention
can be kept inside each sequence (see `arl.learner.packing`).

Alignment (the same as `arl.api.types.Trajectory` and `arl.learner.ppo`): every per-token tensor is indexed by the
position of the token it describes. ``logprobs[b, t]`` is the behaviour log-probability of ``input_ids[b, t]``
given ``input_ids[b, :t]`` -- i.e. it was produced from the logits at position ``t-1``. `ppo.token_logprobs` returns
the learner's logprobs in the same layout, so the two are compared element-wise with no further shifting. Position
0 has no prefix; a trajectory whose ``loss_mask[0]`` is set (an empty prompt) gets that position dropped from the
loss (there is nothing to condition on, so no logprob can be recomputed for it).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np
import torch

from arl.api.types import Trajectory

__all__ = ["PER_TOKEN", "MicroBatch", "split_by_token_budget", "collate_padded", "build_micro_batches",
           "pack_by_token_budget", "collate_packed", "build_packed_micro_batches", "prefix_tree", "group_members", "pack_groups",
           "scored_view"]


PER_TOKEN = ("token_weights", "prox_logp", "ref_logp")  # optional float per-token fields of a MicroBatch
TREE_FIELDS = ("node_ids", "node_position_ids", "node_index", "node_owned")  # a packed row's prefix tree


@dataclasses.dataclass
class MicroBatch:
    """Right-padded tensors of ``B`` sequences, padded length ``L``.

    input_ids: long [B, L] (pad id ``pad_token_id``); attention_mask: long [B, L] (1 on real tokens);
    loss_mask: bool [B, L] (model-generated tokens, never position 0, never padding);
    logprobs: float32 [B, L] behaviour logprobs (0 off the loss mask); versions: long [B, L] (-1 off the loss mask);
    advantages: float32 [B, L] (0 off the loss mask); seq_lens: long [B]; indices: positions of these sequences in
    the list given to `build_micro_batches`.

    Packed micro-batches (`collate_packed`) have ``B = 1``, ``L = sum(seq_lens)``, ``attention_mask = None``,
    ``position_ids`` long [1, L] restarting at 0 per sequence and ``cu_seqlens`` int32 [n_seqs + 1] (cumulative
    lengths, the flash-attention varlen convention). Optional float32 per-token tensors (same shape as
    ``loss_mask``, 0 off it; `PER_TOKEN`): ``token_weights`` (loss multipliers: sequence-level aggregation,
    staleness down-weighting), ``prox_logp`` and ``ref_logp`` (proximal and reference logprobs).

    Packed rows with shared prefixes (``collate_packed(..., share_prefixes=True)``) also carry the row's prefix
    tree: the model runs on its ``N`` nodes (``node_ids``, ``node_position_ids`` long [1, N]: each distinct prefix
    once, at its depth), ``node_index`` long [L] maps every row position to its node (logits are gathered back to
    the row layout, so the loss reads them as for a plain packed row) and ``node_owned`` long [n_seqs] counts the
    nodes each sequence adds (the last ``node_owned[i]`` of its path, in node order; see `prefix_tree`).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    logprobs: torch.Tensor
    versions: torch.Tensor
    advantages: torch.Tensor
    seq_lens: torch.Tensor
    indices: list[int]
    position_ids: Optional[torch.Tensor] = None
    cu_seqlens: Optional[torch.Tensor] = None
    token_weights: Optional[torch.Tensor] = None
    prox_logp: Optional[torch.Tensor] = None
    ref_logp: Optional[torch.Tensor] = None
    node_ids: Optional[torch.Tensor] = None
    node_position_ids: Optional[torch.Tensor] = None
    node_index: Optional[torch.Tensor] = None
    node_owned: Optional[torch.Tensor] = None

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def shares_prefixes(self) -> bool:
        return self.node_ids is not None

    @property
    def computed_tokens(self) -> int:
        """Positions the model runs on: the prefix tree's nodes, or every (padded) position."""
        return int(self.node_ids.shape[1]) if self.node_ids is not None else self.padded_tokens

    @property
    def real_tokens(self) -> int:
        return int(self.seq_lens.sum())

    def empty_like(self) -> "MicroBatch":
        """A one-sequence micro-batch with no loss tokens (a rank with fewer micro-batches runs these so every rank
        does the same number of backward passes)."""
        n = int(self.seq_lens[0])
        cut = (lambda x: x[:, :n]) if self.packed else (lambda x: x[:1])
        # the first sequence, as a plain row
        rows = {f.name: cut(v) for f in dataclasses.fields(self) if f.name not in ("seq_lens", "indices", "cu_seqlens")
                and f.name not in TREE_FIELDS and (v := getattr(self, f.name)) is not None}
        rows["loss_mask"] = torch.zeros_like(rows["loss_mask"])
        return dataclasses.replace(self, **rows, **dict.fromkeys(TREE_FIELDS), seq_lens=self.seq_lens[:1], indices=[],
                                   cu_seqlens=None if self.cu_seqlens is None else self.cu_seqlens[:2])

    @property
    def n_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def seq_index(self) -> torch.Tensor:
        """Per position (the shape of ``loss_mask``), the index of the sequence it belongs to in this micro-batch:
        what sequence-level corrections sum and average over."""
        dev = self.loss_mask.device
        if self.packed:
            n = self.loss_mask.shape[-1]
            own = torch.repeat_interleave(torch.arange(len(self.seq_lens), device=dev), self.seq_lens.to(dev))
            return torch.nn.functional.pad(own, (0, n - own.numel()), value=len(self.seq_lens)).view(1, n)
        return torch.arange(self.loss_mask.shape[0], device=dev).view(-1, 1).expand_as(self.loss_mask)

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.numel())

    def to(self, device: torch.device | str) -> "MicroBatch":
        return dataclasses.replace(self, **{f.name: v.to(device) for f in dataclasses.fields(self)
                                            if isinstance(v := getattr(self, f.name), torch.Tensor)})


def scored_view(mb: MicroBatch) -> tuple[MicroBatch, torch.Tensor]:
    """The positions of a packed row that a loss reads, as a packed micro-batch of their own, and those positions.

    A loss reads the logits at every scored token's predecessor (they predict it) and the token's own fields, so
    the view keeps each scored token and the position before it (a run of scored tokens and the one before the run):
    `ppo.token_logprobs` on the view pairs every scored token with its predecessor's logits, as on the whole row.
    Unscored positions stay in the forward (they are context) but need no logits, log-softmax or gradient there.
    The view is packed (``seq_lens``: the kept positions per sequence, possibly 0) with no prefix tree; a row with
    nothing scored keeps its first position, so an empty micro-batch still runs a (zero) loss."""
    assert mb.packed and mb.input_ids.shape[0] == 1, "a view of a packed row"
    scored = mb.loss_mask[0]
    keep = scored.clone()
    keep[:-1] |= scored[1:]
    if not bool(keep.any()):
        keep[0] = True
    pos = keep.nonzero().squeeze(1)
    seq = torch.repeat_interleave(torch.arange(len(mb.seq_lens), device=pos.device), mb.seq_lens.to(pos.device))
    lens = torch.bincount(seq[pos], minlength=len(mb.seq_lens)).to(mb.seq_lens.dtype)
    cu = torch.zeros(len(lens) + 1, dtype=mb.cu_seqlens.dtype, device=mb.cu_seqlens.device)
    cu[1:] = lens.cumsum(0)
    rows = {f.name: v[:, pos] for f in dataclasses.fields(mb) if f.name not in TREE_FIELDS
            and isinstance(v := getattr(mb, f.name), torch.Tensor) and v.shape == mb.loss_mask.shape}
    return dataclasses.replace(mb, **rows, **dict.fromkeys(TREE_FIELDS), seq_lens=lens, cu_seqlens=cu), pos


def split_by_token_budget(lengths: Sequence[int], max_tokens_per_mb: int) -> list[list[int]]:
    """Group sequence indices so each group's *padded* size (``len(group) * max length in group``) stays within
    ``max_tokens_per_mb``, with as few groups as filling them longest first takes and, among those, the fewest
    padded tokens.

    Groups are runs of the sequences sorted longest first (ties: lower index first). Filling greedily puts the
    next shorter sequences beside a long one up to the budget, padding them all to its length: with a long tail
    (or a PPO minibatch holding a quarter of a batch, a few long sequences among short ones) that is most of the
    padding. The split points are chosen instead by dynamic programming over the sorted run, for the fewest padded
    tokens in the greedy fill's number of groups, so the count of forward passes never grows. A sequence longer than the budget gets a group of its own (never dropped). Every index
    appears exactly once. Within a group, indices are sorted ascending (stable, original order).
    """
    if max_tokens_per_mb < 1:
        raise ValueError(f"max_tokens_per_mb must be >= 1, got {max_tokens_per_mb}")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    size = [max(int(lengths[i]), 1) for i in order]  # descending: a run's padded length is that of its first
    n = len(size)
    cap = [max(1, min(n - i, max_tokens_per_mb // s)) for i, s in enumerate(size)]  # most in a run starting at i
    n_groups, i = 0, 0  # the greedy fill's number of groups, the number to match
    while i < n:
        i += cap[i]
        n_groups += 1
    # best[j]: fewest padded tokens of the first j sequences in g groups (g = the loop's pass), cut[g][j]: where the
    # last of those groups starts.
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    cut = [np.zeros(n + 1, np.int64)]
    for _ in range(n_groups):
        nxt, at = np.full(n + 1, np.inf), np.zeros(n + 1, np.int64)
        for i in np.flatnonzero(np.isfinite(best[:n])).tolist():
            cost = best[i] + size[i] * np.arange(1, cap[i] + 1)
            end = slice(i + 1, i + 1 + cap[i])
            better = cost < nxt[end]
            nxt[end] = np.where(better, cost, nxt[end])
            at[end] = np.where(better, i, at[end])
        best = nxt
        cut.append(at)
    groups: list[list[int]] = []
    j = n
    for g in range(n_groups, 0, -1):
        i = int(cut[g][j])
        groups.append(sorted(order[i:j]))
        j = i
    return groups[::-1]


def pack_by_token_budget(lengths: Sequence[int], max_tokens_per_mb: int) -> list[list[int]]:
    """Bin-pack sequence indices so each bin's *total* length stays within ``max_tokens_per_mb`` (first-fit
    decreasing: no padding, so only the sum matters). A sequence longer than the budget gets a bin of its own.
    Every index appears exactly once; indices within a bin are ascending."""
    if max_tokens_per_mb < 1:
        raise ValueError(f"max_tokens_per_mb must be >= 1, got {max_tokens_per_mb}")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = max(int(lengths[i]), 1)
        for b, r in enumerate(room):
            if n <= r:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(max_tokens_per_mb - n)
    return [sorted(b) for b in bins]


def group_members(groups: Sequence[object]) -> list[list[int]]:
    """The indices of each group id in ``groups``, groups in order of first appearance, indices ascending."""
    members: dict[object, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    return list(members.values())


def pack_groups(lengths: Sequence[int], groups: Sequence[object], max_tokens_per_mb: int) -> list[list[int]]:
    """`pack_by_token_budget` over whole groups (``lengths[i]`` summed per ``groups[i]``): the sequences that share
    prefixes (a prompt's chains) land in one row, where `prefix_tree` computes their common prefixes once. A group
    over the budget is packed sequence by sequence. Same guarantees: every index once, ascending within a bin."""
    whole: list[list[int]] = []
    split: list[list[int]] = []
    for m in group_members(groups):
        if sum(max(int(lengths[i]), 1) for i in m) <= max_tokens_per_mb:
            whole.append(m)
        else:
            split.extend([i] for i in m)
    units = whole + split
    sizes = [sum(max(int(lengths[i]), 1) for i in u) for u in units]
    return [sorted(i for u in b for i in units[u]) for b in pack_by_token_budget(sizes, max_tokens_per_mb)]


def prefix_tree(seqs: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The prefix tree of ``seqs``, nodes numbered in the order sequences first reach them.

    Returns ``(node_ids, node_depth, node_index, owned)``: the token and depth of every node, the node of every
    position of the concatenated sequences, and how many nodes each sequence adds. A sequence's new nodes are the
    last ``owned[i]`` of its path (once it leaves the tree, every later prefix is new) and are numbered
    consecutively, so the sequences' own nodes, in order, are all the nodes in order."""
    children: dict[tuple[int, int], int] = {}
    tokens: list[int] = []
    index = np.empty(sum(len(s) for s in seqs), np.int64)
    owned = np.zeros(len(seqs), np.int64)
    at = 0
    for i, seq in enumerate(seqs):
        node, before = -1, len(tokens)
        for tok in seq.tolist():
            nxt = children.get((node, tok))
            if nxt is None:
                nxt = children[(node, tok)] = len(tokens)
                tokens.append(tok)
            index[at] = node = nxt
            at += 1
        owned[i] = len(tokens) - before
    depth = np.concatenate([np.arange(len(s)) for s in seqs]) if len(seqs) else np.zeros(0, np.int64)
    node_depth = np.zeros(len(tokens), np.int64)
    node_depth[index] = depth
    return np.array(tokens, np.int64), node_depth, index, owned


def _columns(
    trajs: Sequence[Trajectory],
    idx: list[int],
    advantages: Sequence[float | np.ndarray],
    per_token: dict[str, Optional[Sequence[float | np.ndarray]]],
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Per `MicroBatch` field, the values of the sequences of ``idx`` concatenated, and their lengths: position 0 of
    each leaves the loss mask (no prefix to condition on, and in a packed row the logits before it belong to the
    previous sequence); values off the loss mask are zeroed (versions: -1). Whole-array operations on the
    concatenation rather than a few per sequence: a batch has hundreds of short sequences."""
    if not idx:
        raise ValueError("a micro-batch needs at least one sequence")
    sel = [trajs[i] for i in idx]
    lens = np.fromiter((len(t.input_ids) for t in sel), np.int64, len(sel))
    m = np.concatenate([t.loss_mask for t in sel]).astype(bool)
    m[(np.cumsum(lens) - lens)[lens > 0]] = False
    cols = {"input_ids": np.concatenate([t.input_ids for t in sel]).astype(np.int64), "loss_mask": m,
            "logprobs": np.where(m, np.concatenate([t.logprobs for t in sel]), 0.0).astype(np.float32),
            "versions": np.where(m, np.concatenate([t.versions for t in sel]), -1).astype(np.int64)}
    values = {"advantages": advantages, **{k: v for k, v in per_token.items() if v is not None}}
    for k, v in values.items():
        vals = [np.asarray(v[i], dtype=np.float32) for i in idx]  # a scalar (broadcast) or one value per token
        if all(a.ndim == 0 for a in vals):
            flat = np.repeat(np.array(vals, np.float32), lens)
        else:
            for a, n in zip(vals, lens):
                if a.ndim and a.shape != (n,):
                    raise ValueError(f"per-token values have shape {a.shape}, trajectory has {n} tokens")
            flat = np.concatenate([np.broadcast_to(a, (n,)) for a, n in zip(vals, lens)])
        cols[k] = np.where(m, flat, 0.0).astype(np.float32)
    return cols, lens


def collate_padded(
    trajs: Sequence[Trajectory],
    indices: Sequence[int],
    advantages: Sequence[float | np.ndarray],
    *,
    pad_token_id: int = 0,
    **per_token: Optional[Sequence[float | np.ndarray]],
) -> MicroBatch:
    """Right-pad ``trajs[i] for i in indices`` into one `MicroBatch`.

    ``advantages[i]`` is either a scalar (broadcast to the trajectory's loss-mask tokens, the GRPO case) or a
    per-token array aligned with ``trajs[i].input_ids``. Values off the loss mask are zeroed. ``per_token``
    (optional `PER_TOKEN` fields, e.g. ``token_weights``, same convention) fill the micro-batch's tensors.
    """
    idx = list(indices)
    cols, lens = _columns(trajs, idx, advantages, per_token)
    shape = (len(idx), max(int(lens.max()), 1))
    inside = np.arange(shape[1]) < lens[:, None]  # True on each row's first len tokens
    fill = {"input_ids": pad_token_id, "versions": -1}

    def pad(key: str) -> torch.Tensor:
        out = np.full(shape, fill.get(key, 0), cols[key].dtype)
        out[inside] = cols[key]  # row-major: the concatenation's order
        return torch.from_numpy(out)

    return MicroBatch(**{k: pad(k) for k in cols}, attention_mask=torch.from_numpy(inside.astype(np.int64)),
                      seq_lens=torch.from_numpy(lens), indices=idx)


def collate_packed(
    trajs: Sequence[Trajectory],
    indices: Sequence[int],
    advantages: Sequence[float | np.ndarray],
    *,
    share_prefixes: bool = False,
    **per_token: Optional[Sequence[float | np.ndarray]],
) -> MicroBatch:
    """Concatenate ``trajs[i] for i in indices`` into one padding-free row (see `MicroBatch`). Per-token values
    follow `collate_padded`; the first token of every sequence is out of the loss. ``share_prefixes``: attach the
    row's prefix tree (`prefix_tree`), when it has fewer nodes than the row has tokens."""
    idx = list(indices)
    cols, lens = _columns(trajs, idx, advantages, per_token)
    if lens.min() < 1:
        raise ValueError("packing needs non-empty sequences")
    cu = np.zeros(len(lens) + 1, np.int32)
    cu[1:] = np.cumsum(lens)
    cols["position_ids"] = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1].astype(np.int64), lens)
    tree: dict[str, torch.Tensor] = {}
    if share_prefixes and len(idx) > 1:
        ids, depth, index, owned = prefix_tree(np.split(cols["input_ids"], cu[1:-1]))
        if len(ids) < len(index):
            tree = {"node_ids": torch.from_numpy(ids).unsqueeze(0), "node_position_ids": torch.from_numpy(depth).unsqueeze(0),
                    "node_index": torch.from_numpy(index), "node_owned": torch.from_numpy(owned)}
    return MicroBatch(**{k: torch.from_numpy(v).unsqueeze(0) for k, v in cols.items()}, **tree,
                      attention_mask=None, seq_lens=torch.from_numpy(lens), indices=idx, cu_seqlens=torch.from_numpy(cu))


def build_micro_batches(
    trajs: Sequence[Trajectory],
    max_tokens_per_mb: int,
    advantages: Optional[Sequence[float | np.ndarray]] = None,
    *,
    packed: bool = False,
    share_prefixes: bool = False,
    pad_token_id: int = 0,
    **per_token: Optional[Sequence[float | np.ndarray]],
) -> list[MicroBatch]:
    """Split ``trajs`` by token budget and collate each group (see module doc), right-padded or, with ``packed``,
    bin-packed into padding-free rows. ``advantages`` defaults to 0. ``share_prefixes`` (packed only): a group's
    sequences (``group_id``) go into one row, with the row's prefix tree (`collate_packed`)."""
    if advantages is None:
        advantages = [0.0] * len(trajs)
    for k, v in {"advantages": advantages, **per_token}.items():
        if k != "advantages" and k not in PER_TOKEN:
            raise ValueError(f"unknown per-token field {k!r} (known: {PER_TOKEN})")
        if v is not None and len(v) != len(trajs):
            raise ValueError(f"{len(v)} {k} entries for {len(trajs)} trajectories")
    lengths = [len(t.input_ids) for t in trajs]
    if packed and share_prefixes:
        return [collate_packed(trajs, b, advantages, share_prefixes=True, **per_token)
                for b in pack_groups(lengths, [t.group_id for t in trajs], max_tokens_per_mb)]
    if packed:
        return [collate_packed(trajs, b, advantages, **per_token)
                for b in pack_by_token_budget(lengths, max_tokens_per_mb)]
    return [collate_padded(trajs, g, advantages, pad_token_id=pad_token_id, **per_token)
            for g in split_by_token_budget(lengths, max_tokens_per_mb)]


def build_packed_micro_batches(
    trajs: Sequence[Trajectory],
    max_tokens_per_mb: int,
    advantages: Optional[Sequence[float | np.ndarray]] = None,
    **per_token: Optional[Sequence[float | np.ndarray]],
) -> list[MicroBatch]:
    """`build_micro_batches` with ``packed=True``: bin-packed, padding-free rows."""
    return build_micro_batches(trajs, max_tokens_per_mb, advantages, packed=True, **per_token)
