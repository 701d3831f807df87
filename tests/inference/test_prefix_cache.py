"""The torch engine's prefix KV cache: multi-turn chats prefill only their new tokens, with the same outputs as
without the cache, never reusing KV of older weights, within a token budget."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from arl.api.types import GenerateRequest, GenerationConfig
from arl.config import ConfigError, ExperimentConfig, parse_overrides
from arl.inference.prefix_cache import BLOCK, PrefixCache
from arl.inference.torch_engine import TorchEngine
from tests.inference.test_torch_engine import make_engine, make_model, ok, prompt
from tests.waiting import await_until

GREEDY = GenerationConfig(n=1, max_new_tokens=6, greedy=True)


async def chats(engine: TorchEngine, *, chains: int = 6, turns: int = 3, seed: int = 0,
                gconfig: GenerationConfig = GREEDY) -> list[list[tuple[list[int], np.ndarray]]]:
    """`chains` concurrent chats of `turns` turns: each turn sends the whole history (the previous turns' ids, the
    answer exactly as generated, then a 9-token "feedback"), as the multi-turn math agent does."""
    async def chain(i: int) -> list[tuple[list[int], np.ndarray]]:
        ids = prompt(seed + i, 20 + 3 * i).tolist()
        out = []
        for t in range(turns):
            r = ok(await engine.agenerate(GenerateRequest(qid=f"{i}/{t}", input_ids=np.asarray(ids, np.int32),
                                                          gconfig=gconfig, session_id=str(i))))
            s = r.samples[0]
            out.append((s.output_ids.tolist(), s.output_logprobs))
            ids += s.output_ids.tolist() + prompt(1000 + 10 * i + t, 9).tolist()
        return out

    return list(await asyncio.gather(*(chain(i) for i in range(chains))))


def assert_same(a: list, b: list) -> None:
    for chain_a, chain_b in zip(a, b, strict=True):
        for (ids_a, lp_a), (ids_b, lp_b) in zip(chain_a, chain_b, strict=True):
            assert ids_a == ids_b
            np.testing.assert_allclose(lp_a, lp_b, atol=1e-5, rtol=0)


async def same_chats_on_both(a: TorchEngine, b: TorchEngine) -> None:
    """The chats through engine `a`, then `b` (both closed after): the same tokens and logprobs."""
    try:
        out_a, out_b = await chats(a), await chats(b)
    finally:
        await a.close()
        await b.close()
    assert_same(out_a, out_b)


@pytest.mark.asyncio
async def test_multi_turn_outputs_identical_with_cache_on_and_off():
    off = make_engine(make_model(0))
    on = make_engine(make_model(0), prefix_cache_tokens=4096)
    await same_chats_on_both(off, on)
    s_on, s_off = on.stats(), off.stats()
    # every later turn reused its chain's previous turn: 2 of 3 turns per chain hit, the rest was prefilled
    assert s_on["prefix_hits"] == 6 * 2
    assert s_on["prefill_tokens"] + s_on["prefix_hit_tokens"] == s_off["prefill_tokens"]
    assert s_on["prefill_tokens"] < s_off["prefill_tokens"] / 2
    # a turn's entry replaced the one it extended: one entry per chain
    assert s_on["prefix_cache_entries"] == 6


@pytest.mark.asyncio
async def test_same_prompts_of_one_step_share_one_prefill():
    model = make_model(0)
    on = make_engine(model, prefix_cache_tokens=4096)
    off = make_engine(make_model(0))
    p = prompt(7, 30)
    reqs = [GenerateRequest(qid=f"g{i}", input_ids=p, gconfig=GREEDY) for i in range(8)]
    try:
        await on.pause()  # all eight wait, so they are admitted in one step
        futs = [asyncio.ensure_future(on.agenerate(r)) for r in reqs]
        await await_until(lambda: on.stats()["waiting"] == 8, what="eight waiting requests")
        await on.resume()
        got = [ok(r).samples[0] for r in await asyncio.gather(*futs)]
        want = ok(await off.agenerate(reqs[0])).samples[0]
    finally:
        await on.close()
        await off.close()
    assert on.stats()["prefill_forwards"] == 1 and on.stats()["prefill_tokens"] == 30
    for s in got:
        assert s.output_ids.tolist() == want.output_ids.tolist()
        np.testing.assert_allclose(s.output_logprobs, want.output_logprobs, atol=1e-5, rtol=0)


def weights_file(tmp_path: Path, seed: int) -> Path:
    path = tmp_path / f"weights{seed}.safetensors"
    save_file({k: v.contiguous() for k, v in make_model(seed).state_dict().items()}, str(path))
    return path


@pytest.mark.asyncio
async def test_weight_update_clears_the_cache(tmp_path: Path):
    """A turn after a weight update is exactly what the new weights give from scratch: the previous turn's KV
    (old weights) is not reused."""
    new = weights_file(tmp_path, seed=1)
    engine = make_engine(make_model(0), prefix_cache_tokens=4096)
    ref = make_engine(make_model(1))  # the new weights, no cache
    first = prompt(3, 40).tolist()
    try:
        s = ok(await engine.agenerate(GenerateRequest(qid="t0", input_ids=np.asarray(first, np.int32),
                                                      gconfig=GREEDY))).samples[0]
        assert engine.stats()["prefix_cache_entries"] == 1
        await engine.update_weights(str(new), version=1)
        assert engine.stats()["prefix_cache_entries"] == 0
        second = np.asarray(first + s.output_ids.tolist() + prompt(4, 9).tolist(), np.int32)
        got = ok(await engine.agenerate(GenerateRequest(qid="t1", input_ids=second, gconfig=GREEDY))).samples[0]
        want = ok(await ref.agenerate(GenerateRequest(qid="r", input_ids=second, gconfig=GREEDY))).samples[0]
    finally:
        await engine.close()
        await ref.close()
    assert engine.stats()["prefix_hits"] == 0
    assert got.output_ids.tolist() == want.output_ids.tolist()
    np.testing.assert_allclose(got.output_logprobs, want.output_logprobs, atol=1e-5, rtol=0)


@pytest.mark.asyncio
async def test_row_that_lived_through_an_update_is_not_cached(tmp_path: Path):
    """A sequence whose KV was partly computed under the old weights (kept in flight across the update) is not
    stored, so the next turn is prefilled under the new weights alone."""
    new = weights_file(tmp_path, seed=1)
    engine = make_engine(make_model(0), prefix_cache_tokens=4096)
    ref = make_engine(make_model(1))
    first = prompt(5, 30)
    long = GenerationConfig(n=1, max_new_tokens=40, greedy=True)
    try:
        fut = asyncio.ensure_future(engine.agenerate(GenerateRequest(qid="t0", input_ids=first, gconfig=long)))
        await await_until(lambda: engine.stats()["tokens_generated"] >= 3, what="three tokens")
        await engine.update_weights(str(new), version=1)
        s = ok(await fut).samples[0]
        assert set(s.output_versions.tolist()) == {0, 1}  # it did live through the update
        assert engine.stats()["prefix_cache_entries"] == 0
        second = np.asarray(first.tolist() + s.output_ids.tolist() + prompt(6, 9).tolist(), np.int32)
        got = ok(await engine.agenerate(GenerateRequest(qid="t1", input_ids=second, gconfig=GREEDY))).samples[0]
        want = ok(await ref.agenerate(GenerateRequest(qid="r", input_ids=second, gconfig=GREEDY))).samples[0]
    finally:
        await engine.close()
        await ref.close()
    assert got.output_ids.tolist() == want.output_ids.tolist()
    np.testing.assert_allclose(got.output_logprobs, want.output_logprobs, atol=1e-5, rtol=0)


@pytest.mark.asyncio
async def test_token_budget_bounds_the_cache_and_outputs_stay_the_same():
    budget = 250  # the first turns fit (6 rows x 40 columns), the later ones push them out
    on = make_engine(make_model(0), prefix_cache_tokens=budget)
    off = make_engine(make_model(0))
    try:
        out_on, out_off = await chats(on), await chats(off)
    finally:
        await on.close()
        await off.close()
    assert_same(out_off, out_on)
    st = on.stats()
    assert st["prefix_cache_tokens"] <= budget and st["prefix_evicted"] > 0 and st["prefix_hits"] > 0


def fake_kv(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.zeros(1, 1, n, 2), torch.zeros(1, 1, n, 2))]


def test_longest_prefix_by_ids_lru_and_dominated_entries():
    cache = PrefixCache(max_tokens=100)
    a = list(range(40))
    assert cache.insert(a, fake_kv(40))
    entry, n = cache.lookup(a + [7, 8], limit=41)
    assert entry is not None and n == 40
    entry, n = cache.lookup(a[:20] + [99] * 10, limit=29)  # diverges inside the second block
    assert entry is not None and n == 20
    assert cache.lookup([99] + a, limit=40) == (None, 0)  # nothing shared from the start
    assert cache.lookup(a[:BLOCK - 1] + [5], limit=BLOCK) == (None, 0)  # under one block: not looked up
    assert cache.lookup(a, limit=39)[1] == 39  # the limit leaves the last token to prefill

    assert not cache.insert(a[:30], fake_kv(30))  # covered by a: not stored
    b = a + [1, 2, 3]
    assert cache.insert(b, fake_kv(43), replaces=entry)  # extends a: a is dropped
    assert len(cache) == 1 and cache.tokens == 43

    c = [50 + i for i in range(40)]
    assert cache.insert(c, fake_kv(40))
    cache.lookup(b + [0], limit=43)  # b is now the most recently used
    d = [200 + i for i in range(30)]
    assert cache.insert(d, fake_kv(30))  # 113 > 100: the least recently used (c) goes
    assert cache.lookup(c + [0], limit=40) == (None, 0)
    assert cache.lookup(b + [0], limit=43)[1] == 43 and cache.tokens == 73
    assert not cache.insert(list(range(101)), fake_kv(101))  # over the whole budget
    cache.clear()
    assert len(cache) == 0 and cache.tokens == 0 and cache.lookup(b, limit=43) == (None, 0)


def test_config_key():
    assert ExperimentConfig().inference.torch.prefix_cache_tokens > 0  # on by default
    assert parse_overrides(ExperimentConfig, ["inference.torch.prefix_cache_tokens=0"]).inference.torch \
        .prefix_cache_tokens == 0
    with pytest.raises(ConfigError, match="prefix_cache_tokens"):
        parse_overrides(ExperimentConfig, ["inference.torch.prefix_cache_tokens=-1"])


@pytest.mark.asyncio
async def test_the_run_builds_its_engine_with_the_configured_budget(tmp_path: Path):
    from arl.inference.factory import build_engine
    from arl.models.tiny import build_char_tokenizer, build_tiny_model, save_model_dir

    tok = build_char_tokenizer()
    folder = save_model_dir(build_tiny_model(len(tok)), tok, str(tmp_path / "model"))
    inference = parse_overrides(ExperimentConfig, ["inference.torch.prefix_cache_tokens=777"]).inference
    engine = build_engine(folder, inference, seed=0)
    try:
        assert engine.stats()["prefix_cache_budget"] == 777
    finally:
        await engine.close()


def test_entries_sharing_a_storage_count_it_whole_while_one_lives():
    from arl.inference.prefix_cache import Storage

    cache = PrefixCache(max_tokens=100)
    shared = Storage(2 * 30)  # two sequences finished in one step, copied out together (30 columns each)
    a, b = [1] * 30, [2] * 25
    assert cache.insert(a, fake_kv(30), storage=shared) and cache.insert(b, fake_kv(25), storage=shared)
    assert cache.tokens == 60
    a2 = a + [3] * 10
    assert cache.insert(a2, fake_kv(40), replaces=cache.lookup(a2, limit=39)[0])  # a dropped, b still uses it
    assert len(cache) == 2 and cache.tokens == 100
    c = [4] * 10
    assert cache.insert(c, fake_kv(10))  # 110 > 100: the least recently used (b) goes, and with it the storage
    assert cache.lookup(b + [0], limit=25) == (None, 0)
    assert cache.tokens == 50 and len(cache) == 2


def test_a_storage_larger_than_the_budget_is_not_admitted_and_evicts_nothing():
    from arl.inference.prefix_cache import Storage

    cache = PrefixCache(max_tokens=100)
    kept = [5] * 20
    assert cache.insert(kept, fake_kv(20))
    wide = Storage(6 * 30)  # six rows of one step copied out padded to the widest: 180 > 100
    assert not cache.insert([6] * 25, fake_kv(25), storage=wide)
    assert len(cache) == 1 and cache.tokens == 20 and cache.lookup(kept + [0], limit=20)[1] == 20
    assert wide.live == 0


@pytest.mark.asyncio
async def test_rows_finishing_in_one_step_stay_cached_when_together_they_exceed_the_budget():
    """Six rows finish in one step, each fits the budget but not all of them together: the cache keeps some of
    them (within the budget), and their next turns reuse them with the outputs of the engine without a cache."""
    budget = 100
    on = make_engine(make_model(0), prefix_cache_tokens=budget)
    off = make_engine(make_model(0))
    gconfig = GenerationConfig(n=1, max_new_tokens=6, greedy=True)

    async def one_step(engine: TorchEngine, prompts: list[list[int]]) -> list:
        await engine.pause()  # every request joins in one step (so they finish in one step)
        tasks = [asyncio.create_task(engine.agenerate(GenerateRequest(
            qid=str(i), input_ids=np.asarray(p, np.int32), gconfig=gconfig))) for i, p in enumerate(prompts)]
        await await_until(lambda: engine.stats()["waiting"] == len(prompts))
        await engine.resume()
        return [ok(r).samples[0] for r in await asyncio.gather(*tasks)]

    first = [prompt(i, 20 + i).tolist() for i in range(6)]  # 20..25 tokens, + 5 generated: 25..30 cached
    try:
        outs = [await one_step(engine, first) for engine in (on, off)]
        st = on.stats()
        assert st["prefix_stored"] >= 1 and st["prefix_cache_entries"] >= 1, st
        assert 0 < st["prefix_cache_tokens"] <= budget
        nexts = [p + s.output_ids.tolist() + prompt(100 + i, 5).tolist()
                 for i, (p, s) in enumerate(zip(first, outs[0]))]
        got, want = await one_step(on, nexts), await one_step(off, nexts)
        assert on.stats()["prefix_hits"] >= 1
        for g, w in zip(got, want, strict=True):
            assert g.output_ids.tolist() == w.output_ids.tolist()
            np.testing.assert_allclose(g.output_logprobs, w.output_logprobs, atol=1e-5, rtol=0)
    finally:
        await on.close()
        await off.close()
