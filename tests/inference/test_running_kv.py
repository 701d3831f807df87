"""`RunningKV` against a plain model of the batch: every row's tokens, right-aligned, under a mask of its length."""

import random

import torch
from transformers import DynamicCache

from arl.inference.running_kv import RunningKV

H, D, LAYERS = 2, 3, 2


def _prefill(rows: list[torch.Tensor]) -> tuple[DynamicCache, torch.Tensor]:
    """A left-padded batch of `rows` ([len, H, D] per-token values; keys = values + 0.5), as a prefill leaves it."""
    w = max(len(r) for r in rows)
    k = torch.zeros(len(rows), H, w, D)
    mask = torch.zeros(len(rows), w, dtype=torch.long)
    for i, r in enumerate(rows):
        k[i, :, w - len(r):] = r.permute(1, 0, 2)
        mask[i, w - len(r):] = 1
    return DynamicCache(ddp_cache_data=[(k + 0.5 + layer, k + layer) for layer in range(LAYERS)]), mask


def _check(kv: RunningKV, rows: list[torch.Tensor]) -> None:
    assert kv.rows == len(rows) and kv.mask.shape == (len(rows), kv.width)
    assert kv.width == max(len(r) for r in rows)  # no column is padding for every row
    for layer_idx, layer in enumerate(kv.cache.layers):
        assert layer.keys.shape == (len(rows), H, kv.width, D) == layer.values.shape
        for i, r in enumerate(rows):
            n = len(r)
            assert kv.mask[i].tolist() == [0] * (kv.width - n) + [1] * n
            want = r.permute(1, 0, 2) + layer_idx
            assert torch.equal(layer.values[i, :, kv.width - n:], want)
            assert torch.equal(layer.keys[i, :, kv.width - n:], want + 0.5)
            assert torch.isfinite(layer.keys[i]).all() and torch.isfinite(layer.values[i]).all()


def test_running_kv_follows_decode_join_and_select_through_reallocations() -> None:
    rng = random.Random(0)
    torch.manual_seed(0)
    counter = iter(range(1, 10**6))

    def tokens(n: int) -> torch.Tensor:
        return torch.stack([torch.full((H, D), float(next(counter))) for _ in range(n)])

    rows = [tokens(rng.randint(1, 9)) for _ in range(3)]
    kv = RunningKV(*_prefill(rows), slack=4, max_rows=40)
    _check(kv, rows)
    for step in range(300):
        op = rng.random()
        if op < 0.5:  # a decode step: the model's attention writes one column per layer through `update`
            new = tokens(1)
            mask = kv.decode_mask()
            for layer_idx, layer in enumerate(kv.cache.layers):
                v = torch.cat([new.permute(1, 0, 2)[None]] * len(rows)) + layer_idx
                k, _ = layer.update(v + 0.5, v)
                assert k.shape[2] == mask.shape[1]
            rows = [torch.cat([r, new]) for r in rows]
        elif op < 0.75 and len(rows) < 30:  # newcomers, sometimes longer than the running batch
            joined = [tokens(rng.randint(1, 12 if rng.random() < 0.8 else 40)) for _ in range(rng.randint(1, 5))]
            kv.join(*_prefill(joined))
            rows = rows + joined
        elif len(rows) > 1:  # some rows leave
            keep = sorted(rng.sample(range(len(rows)), rng.randint(1, len(rows) - 1)))
            order = kv.select(keep, max(len(rows[i]) for i in keep))
            assert sorted(order) == keep
            rows = [rows[i] for i in order]
        _check(kv, rows)
    assert kv._mask_buf.shape[0] <= 40


def test_update_without_room_raises_instead_of_writing_past_the_buffer() -> None:
    kv = RunningKV(*_prefill([torch.ones(2, H, D)]), slack=1)
    layer = kv.cache.layers[0]
    try:
        layer.update(torch.zeros(1, H, 5, D), torch.zeros(1, H, 5, D))
    except RuntimeError as e:
        assert "no room" in str(e)
    else:
        raise AssertionError("update past the buffer did not raise")
