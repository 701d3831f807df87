"""The simulated engine: latency model bookkeeping, batch cap, long-tailed lengths, per-token versions, bad input."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from arl.api.engine import InferenceEngine
from arl.api.types import GenerateRequest, GenerationConfig
from arl.config import InferenceConfig, SimEngineConfig
from arl.inference.factory import build_engine
from arl.inference.sim_engine import ENGINE_CLOSED, SimEngine
from tests.waiting import await_until

FAST = dict(step_base_s=1e-3, step_per_token_s=1e-5, prefill_per_token_s=0.0, update_pause_s=0.0)


def req(qid="q", n=1, max_new=16, min_new=0, prompt=(1, 2, 3), session=None, **g) -> GenerateRequest:
    return GenerateRequest(qid=qid, input_ids=np.array(prompt, np.int32),
                           gconfig=GenerationConfig(n=n, max_new_tokens=max_new, min_new_tokens=min_new, **g),
                           session_id=session)


async def wait_for_steps(engine: SimEngine, steps: int) -> None:
    for _ in range(2000):
        if engine.stats()["decode_steps"] >= steps:
            return
        await asyncio.sleep(0.002)
    raise AssertionError("the simulated engine made no progress")


def test_implements_protocol_and_step_model():
    e = SimEngine(SimEngineConfig(step_base_s=0.01, step_per_token_s=0.001, time_scale=0.5))
    assert isinstance(e, InferenceEngine)
    assert e.step_seconds(10) == pytest.approx((0.01 + 0.01) * 0.5)


@pytest.mark.asyncio
async def test_lengths_fixed_then_cut_with_finish_reasons():
    e = SimEngine(SimEngineConfig(len_median=5, len_sigma=0.0, time_scale=0.01, **FAST))
    r = await e.agenerate(req(max_new=16))
    s = r.samples[0]
    assert r.error is None and len(s.output_ids) == 5 and s.finish_reason == "stop"
    assert len(s.output_logprobs) == 5 and (s.output_logprobs <= 0).all() and (s.output_versions == 0).all()
    r = await e.agenerate(req(max_new=3))
    assert len(r.samples[0].output_ids) == 3 and r.samples[0].finish_reason == "length"
    r = await e.agenerate(req(max_new=16, min_new=9))
    assert len(r.samples[0].output_ids) == 9
    st = e.stats()
    assert st["requests_done"] == 3 and st["tokens_generated"] == 17 and st["decode_steps"] >= 9
    await e.close()


@pytest.mark.asyncio
async def test_long_tailed_lengths_and_stop_token():
    e = SimEngine(SimEngineConfig(len_median=20, len_sigma=1.0, time_scale=1e-4, vocab_size=50, **FAST), eos_token_id=7)
    resps = await asyncio.gather(*(e.agenerate(req(qid=str(i), n=4, max_new=10_000)) for i in range(50)))
    lengths = np.array([len(s.output_ids) for r in resps for s in r.samples])
    assert 14 <= np.median(lengths) <= 28
    assert lengths.max() > 4 * np.median(lengths)  # long tail
    for r in resps:
        for s in r.samples:
            assert s.output_ids[-1] == 7 and 7 not in s.output_ids[:-1].tolist()
    await e.close()


@pytest.mark.asyncio
async def test_keyed_draws_repeat_across_engines():
    a = SimEngine(SimEngineConfig(time_scale=1e-4, **FAST), seed=1, workload_seed=5)
    b = SimEngine(SimEngineConfig(time_scale=1e-4, **FAST), seed=2, workload_seed=5)
    ra = await a.agenerate(req(session="chat/0", max_new=4000))
    rb = await b.agenerate(req(session="chat/0", max_new=4000))
    rc = await b.agenerate(req(session="chat/1", max_new=4000))
    assert np.array_equal(ra.samples[0].output_ids, rb.samples[0].output_ids)
    assert not np.array_equal(ra.samples[0].output_ids, rc.samples[0].output_ids)
    await a.close()
    await b.close()


@pytest.mark.asyncio
async def test_batch_cap_queues_and_cancel_frees_rows():
    e = SimEngine(SimEngineConfig(len_median=10_000, len_sigma=0.0, time_scale=1.0, **FAST), max_batch_size=2)
    t1 = asyncio.create_task(e.agenerate(req("a", max_new=100_000)))
    t2 = asyncio.create_task(e.agenerate(req("b", max_new=100_000)))
    t3 = asyncio.create_task(e.agenerate(req("c", max_new=100_000)))
    await await_until(lambda: e.stats()["running"] + e.stats()["waiting"] == 3, 30, "the three requests to arrive")
    st = e.stats()
    assert st["running"] == 2 and st["waiting"] == 1
    t1.cancel()
    await asyncio.gather(t1, return_exceptions=True)
    st = e.stats()
    assert st["running"] == 2 and st["waiting"] == 0
    await e.close()
    r2, r3 = await t2, await t3
    assert r2.error == ENGINE_CLOSED and r2.samples[0].finish_reason == "abort"
    assert r3.error == ENGINE_CLOSED


@pytest.mark.asyncio
async def test_update_mid_request_stamps_new_version(tmp_path):
    weights = tmp_path / "v1.safetensors"
    weights.write_bytes(b"x")
    e = SimEngine(SimEngineConfig(len_median=20_000, len_sigma=0.0, time_scale=1.0, step_base_s=5e-4,
                                  step_per_token_s=0.0, prefill_per_token_s=0.0, update_pause_s=0.0))
    task = asyncio.create_task(e.agenerate(req(max_new=100_000)))
    await wait_for_steps(e, 3)
    await e.pause()  # freeze the clock so the update lands mid-request whatever the machine's load
    assert not task.done() and e.stats()["decode_steps"] < 20_000
    await e.update_weights(str(weights), 1)
    e.config.time_scale = 1e-3  # finish the remaining steps quickly
    await e.resume()
    assert e.version == 1
    v = (await task).samples[0].output_versions
    assert v[0] == 0 and v[-1] == 1 and (np.diff(v) >= 0).all()
    with pytest.raises(FileNotFoundError):
        await e.update_weights(str(tmp_path / "missing"), 2)
    assert e.version == 1
    await e.close()


@pytest.mark.asyncio
async def test_many_updates_keep_a_running_sample_stamped_and_the_update_list_short(tmp_path):
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"x")
    e = SimEngine(SimEngineConfig(len_median=20_000, len_sigma=0.0, time_scale=1.0, step_base_s=5e-4,
                                  step_per_token_s=0.0, prefill_per_token_s=0.0, update_pause_s=0.0))
    task = asyncio.create_task(e.agenerate(req(max_new=100_000)))
    await wait_for_steps(e, 3)
    await e.pause()
    await e.update_weights(str(weights), 1)  # the running sample started before it: versions 0, then 1
    await e.resume()
    await wait_for_steps(e, 6)
    await e.pause()
    for v in range(2, 600):  # updates between two decode steps: only the last one stamps tokens
        await e.update_weights(str(weights), v)
    assert len(e._upd_clock) == 3  # -inf (version 0), version 1's step, version 599's
    e.config.time_scale = 1e-3
    await e.resume()
    v = (await task).samples[0].output_versions
    assert v[0] == 0 and 1 in v and v[-1] == 599 and (np.diff(v) >= 0).all()
    e.config.time_scale = 1.0
    for v in range(600, 900):  # one update per decode step, nothing running: old points are forgotten
        await e.update_weights(str(weights), v)
        await asyncio.sleep(0.001)
    assert len(e._upd_clock) <= 257 and e._upd_version[-1] == 899
    await e.close()


@pytest.mark.asyncio
async def test_update_pause_counts_and_stalls(tmp_path):
    weights = tmp_path / "w"
    weights.write_bytes(b"x")
    e = SimEngine(SimEngineConfig(update_pause_s=0.02, time_scale=1.0, len_median=3, len_sigma=0.0, step_base_s=1e-4,
                                  step_per_token_s=0.0, prefill_per_token_s=0.0))
    await e.update_weights(str(weights), 3)
    st = e.stats()
    assert st["weight_updates"] == 1 and st["version"] == 3 and st["last_update_s"] > 0
    r = await e.agenerate(req())
    assert (r.samples[0].output_versions == 3).all()
    await e.close()


@pytest.mark.asyncio
async def test_bad_input_answers_with_an_error():
    e = SimEngine(SimEngineConfig(vocab_size=10, time_scale=1e-4, **FAST), max_batch_size=4, max_context_len=8)
    bad = [
        req(prompt=()),
        req(prompt=tuple(range(8))),
        req(prompt=(1, 11)),
        req(prompt=(-1,)),
        req(n=5),
        GenerateRequest(qid="g", input_ids=np.array([1], np.int32), gconfig=GenerationConfig(temperature=-1.0)),
        "not a request",
    ]
    for b in bad:
        r = await e.agenerate(b)  # type: ignore[arg-type]
        assert r.error and not r.samples
    assert e.stats()["requests_refused"] == len(bad)
    r = await e.agenerate(req(prompt=(1, 2, 3, 4, 5, 6), max_new=100))
    assert len(r.samples[0].output_ids) == 2  # cut by the context window
    await e.close()
    r = await e.agenerate(req())
    assert r.error == ENGINE_CLOSED


@pytest.mark.asyncio
async def test_prefix_cache_charges_only_new_tokens(tmp_path):
    e = SimEngine(SimEngineConfig(len_median=4, len_sigma=0.0, time_scale=1e-4, cache_block_tokens=2, **FAST))
    first = tuple(range(1, 11))
    r = await e.agenerate(req(prompt=first, session="s"))
    assert e.stats()["prefill_tokens"] == 10
    nxt = first + tuple(int(t) for t in r.samples[0].output_ids) + (5, 6, 7, 8, 9, 10)  # the next turn
    await e.agenerate(req(prompt=nxt, session="s"))  # 10 prompt + 4 generated cached: 6 new
    assert e.stats()["prefill_tokens"] == 16
    await e.agenerate(req(prompt=first[:8] + (99, 98), session="other"))  # a shared prefix hits whatever the session
    st = e.stats()
    assert st["prefill_tokens"] == 18 and st["prefix_hit_tokens"] == 14 + 8 and st["prompt_tokens"] == 10 + 20 + 10
    (tmp_path / "w").write_text("x")
    await e.update_weights(str(tmp_path / "w"), 1)  # new weights: nothing cached is reused
    await e.agenerate(req(prompt=nxt, session="s"))
    assert e.stats()["prefill_tokens"] == 18 + 20 and e.stats()["cache_flushes"] == 1
    await e.close()


@pytest.mark.asyncio
async def test_prefix_cache_is_bounded_least_recent_out():
    e = SimEngine(SimEngineConfig(len_median=1, len_sigma=0.0, time_scale=1e-4, cache_block_tokens=2,
                                  cache_tokens=8, **FAST))
    a, b = (1, 2, 3, 4, 5, 6), (7, 8, 9, 10, 11, 12)
    await e.agenerate(req(prompt=a))
    await e.agenerate(req(prompt=b))  # 3 blocks each (+ none for the 1 generated token): a's oldest go
    assert e.stats()["cache_blocks"] == 4
    await e.agenerate(req(prompt=b))
    await e.agenerate(req(prompt=a))
    st = e.stats()
    # b hit whole; a's deeper blocks were evicted first, its first block (the shallow end, most recent) is left
    assert st["prefix_hit_tokens"] == 6 + 2 and st["prefill_tokens"] == 6 + 6 + 0 + 4
    await e.close()


@pytest.mark.asyncio
async def test_factory_builds_sim_backend():
    ic = InferenceConfig(backend="sim", max_batch_size=8, max_context_len=64,
                         sim=SimEngineConfig(time_scale=1e-4, len_median=3.0, len_sigma=0.0))
    e = build_engine("", ic, seed=3, index=2)
    assert isinstance(e, SimEngine) and e.max_batch_size == 8 and e.config is ic.sim
    assert e.name == "inference2" and e.workload_seed == 3
    r = await e.agenerate(req())
    assert len(r.samples[0].output_ids) == 3
    await e.close()


def test_config_selects_sim_backends():
    from arl.config import ConfigError, ExperimentConfig, parse_overrides

    cfg = parse_overrides(ExperimentConfig, ["inference.backend=sim", "learner.backend=sim",
                                             "inference.servers_per_process=16", "inference.sim.time_scale=0.1"])
    assert cfg.inference.backend == "sim" and cfg.learner.backend == "sim" and cfg.inference.sim.time_scale == 0.1
    with pytest.raises(ConfigError, match="learner.backend"):
        parse_overrides(ExperimentConfig, ["learner.backend=bogus"])
    with pytest.raises(ConfigError, match=r"inference.backend: unknown inference backend 'bogus'; registered "
                                          r"inference backends: \['sglang', 'sim', 'torch'\]"):
        parse_overrides(ExperimentConfig, ["inference.backend=bogus"])
    with pytest.raises(ConfigError, match="servers_per_process"):
        parse_overrides(ExperimentConfig, ["inference.servers_per_process=0"])
