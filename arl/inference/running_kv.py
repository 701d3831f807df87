"""The torch engine's running batch: its KV cache and attention mask, kept in buffers with spare rows and columns.

Why it is built this way: the batch changes at almost every step of a short-answer workload (rows finish, newcomers
join) and grows by one column at every decode step. Kept as exact-size tensors, each of those rebuilt the whole
cache (a decode step concatenated every layer's keys and values, a join padded and concatenated both batches, an
exit index-selected every remaining row): two or three copies of the whole KV per engine step. Here the KV lives
in per-layer buffers `[rows_cap, heads, cols_cap, head_dim]`; the batch is the view `[:rows, :, lo:hi]`, each row's
tokens right-aligned at column `hi` (left padding, as a batched prefill lays them out) and masked off to the left.

* A decode step writes its column in place at `hi` (`SlackLayer.update`, called by the model's attention).
* A join writes the newcomers into the rows after the last one, right-aligned at `hi`.
* An exit moves the last rows into the holes the leaving rows open (so the row order changes: `select` returns
  the new order) and narrows `lo` to the longest remaining row.
* The buffers are reallocated (copying the live view once) only when rows or columns run out: every `slack`
  decode steps at most, and when a joining row is longer than the room to the left of `hi`.

Columns to the left of a row's first token hold stale but finite values (zeros, or KV of an earlier row): the mask
keeps them out of attention, exactly as left padding.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class SlackLayer(DynamicLayer):
    """One layer's KV of the running batch: `keys`/`values` are views of larger buffers, and `update` (one call per
    forward, from the layer's attention) writes the new columns in place at `hi` instead of concatenating."""

    def __init__(self, k_buf: torch.Tensor, v_buf: torch.Tensor, rows: int, lo: int, hi: int) -> None:
        super().__init__()
        self.is_initialized = True
        self.device, self.dtype = k_buf.device, k_buf.dtype
        self.k_buf, self.v_buf = k_buf, v_buf
        self.place(rows, lo, hi)

    def place(self, rows: int, lo: int, hi: int) -> None:
        self.rows, self.lo, self.hi = rows, lo, hi
        self.keys = self.k_buf[:rows, :, lo:hi]
        self.values = self.v_buf[:rows, :, lo:hi]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        s = key_states.shape[-2]
        if key_states.shape[0] != self.rows or self.hi + s > self.k_buf.shape[2]:
            raise RuntimeError(f"running KV: no room for {key_states.shape[0]} x {s} new columns "
                               f"({self.rows} rows, columns {self.lo}..{self.hi} of {self.k_buf.shape[2]})")
        self.k_buf[:self.rows, :, self.hi:self.hi + s] = key_states
        self.v_buf[:self.rows, :, self.hi:self.hi + s] = value_states
        self.place(self.rows, self.lo, self.hi + s)
        return self.keys, self.values


class RunningKV:
    """The running batch's cache (`cache`, to pass to the model) and mask (`mask`, `[rows, hi - lo]`, 1 = real).

    Start it from a prefilled batch (`__init__`), then per engine step: `decode_mask` before a decode forward
    (which appends one column through the layers), `select` when rows leave, `join` when rows arrive."""

    def __init__(self, cache: DynamicCache, mask: torch.Tensor, slack: int = 32, max_rows: int = 0) -> None:
        self.slack = max(1, int(slack))
        self.max_rows = int(max_rows)
        self.rows, self.lo, self.hi = 0, 0, 0
        self.cache = DynamicCache()
        self._mask_buf = mask.new_zeros((0, 0))
        self.cache.layers = [SlackLayer(_empty_like(x.keys), _empty_like(x.values), 0, 0, 0) for x in cache.layers]
        self.join(cache, mask)

    @property
    def mask(self) -> torch.Tensor:
        return self._mask_buf[:self.rows, self.lo:self.hi]

    @property
    def width(self) -> int:
        return self.hi - self.lo

    def decode_mask(self) -> torch.Tensor:
        """Make room for one more column, mark it real for every row and return the mask of the forward that
        writes it (the layers' `hi` moves by one during that forward; the mask's here)."""
        self._reserve(self.rows, 0, 1)
        self._mask_buf[:self.rows, self.hi] = 1
        self.hi += 1
        return self.mask

    def join(self, cache: DynamicCache, mask: torch.Tensor) -> None:
        """Append the rows of a prefilled batch (`cache` and `mask` left-padded to `mask.shape[1]` columns), their
        last column aligned with the running batch's."""
        n, w = mask.shape
        self._reserve(self.rows + n, w, 0)
        r0, r1, c0 = self.rows, self.rows + n, self.hi - w
        for layer, new in zip(self.cache.layers, cache.layers):
            layer.k_buf[r0:r1, :, c0:self.hi] = new.keys
            layer.v_buf[r0:r1, :, c0:self.hi] = new.values
        self._mask_buf[r0:r1, :c0] = 0
        self._mask_buf[r0:r1, c0:self.hi] = mask
        self.rows, self.lo = r1, min(self.lo, c0) if r0 else c0
        self._place()

    def select(self, keep: Sequence[int], width: int) -> list[int]:
        """Keep rows `keep` (ascending) and the last `width` columns (the longest kept row); returns the kept rows'
        old indices in their new order (the last kept rows fill the holes of the leaving ones)."""
        n = len(keep)
        kept = set(keep)
        holes = [i for i in range(n) if i not in kept]
        movers = [i for i in keep if i >= n]
        order = list(range(n))
        if holes:
            src = torch.tensor(movers, dtype=torch.long, device=self._mask_buf.device)
            dst = torch.tensor(holes, dtype=torch.long, device=self._mask_buf.device)
            for layer in self.cache.layers:
                layer.k_buf.index_copy_(0, dst, layer.k_buf.index_select(0, src))
                layer.v_buf.index_copy_(0, dst, layer.v_buf.index_select(0, src))
            self._mask_buf.index_copy_(0, dst, self._mask_buf.index_select(0, src))
            for hole, mover in zip(holes, movers):
                order[hole] = mover
        self.rows, self.lo = n, self.hi - int(width)
        self._place()
        return order

    def _place(self) -> None:
        for layer in self.cache.layers:
            layer.place(self.rows, self.lo, self.hi)

    def _reserve(self, rows: int, left: int, right: int) -> None:
        """Reallocate unless the buffers hold `rows` rows, `left` columns before `hi` and `right` after it. The live
        view is copied once into buffers with room to spare (x1.5 rows up to `max_rows`, half the width in columns);
        nothing is assigned until every new buffer is built, so a failure leaves the batch as it was."""
        cap_rows, cap_cols = self._mask_buf.shape
        if rows <= cap_rows and left <= self.hi and self.hi + right <= cap_cols:
            return
        new_rows = cap_rows if rows <= cap_rows else max(rows, cap_rows + cap_rows // 2, 8)
        if self.max_rows:
            new_rows = max(rows, min(new_rows, self.max_rows))
        live = self.hi - self.lo
        hi = max(live, left)
        cols = hi + right + max(self.slack, live // 2)

        def moved(old: torch.Tensor) -> torch.Tensor:
            """`old` ([rows, heads, cols, head_dim] KV, or the [rows, cols] mask) in a new buffer, live view copied."""
            if old.dim() == 4:
                buf = old.new_zeros((new_rows, old.shape[1], cols, old.shape[3]))
                buf[:self.rows, :, hi - live:hi] = old[:self.rows, :, self.lo:self.hi]
            else:
                buf = old.new_zeros((new_rows, cols))
                buf[:self.rows, hi - live:hi] = old[:self.rows, self.lo:self.hi]
            return buf

        bufs = [(moved(layer.k_buf), moved(layer.v_buf)) for layer in self.cache.layers]
        mask = moved(self._mask_buf)
        for layer, (k, v) in zip(self.cache.layers, bufs):
            layer.k_buf, layer.v_buf = k, v
        self._mask_buf = mask
        self.lo, self.hi = hi - live, hi
        self._place()


def _empty_like(x: torch.Tensor) -> torch.Tensor:
    """A [0, heads, 0, head_dim] buffer of `x`'s dtype and device."""
    return x.new_zeros((0, x.shape[1], 0, x.shape[3]))
