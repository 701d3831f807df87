"""Tests of the embedded torch inference engine (continuous batching, sampling, weight updates, failures)."""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from arl.api.engine import InferenceEngine
from arl.api.types import GenerateRequest, GenerateResponse, GenerationConfig
from arl.inference.torch_engine import TorchEngine
from tests.waiting import await_until

torch.set_num_threads(1)

VOCAB = 32


def make_model(seed: int = 0, tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                      tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg).eval()


def make_engine(model: torch.nn.Module, **kw) -> TorchEngine:
    args = dict(pad_token_id=0, eos_token_id=None, max_batch_size=64, max_context_len=128, seed=0)
    args.update(kw)
    return TorchEngine(model, **args)


def prompt(seed: int, length: int) -> np.ndarray:
    return np.random.RandomState(seed).randint(1, VOCAB, size=length).astype(np.int32)


@torch.no_grad()
def greedy_reference(model: torch.nn.Module, ids: np.ndarray, n: int) -> list[int]:
    """No cache: full forward over the growing sequence, argmax of the last position."""
    seq = [int(t) for t in ids]
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


@torch.no_grad()
def recompute_logprobs(model: torch.nn.Module, ids: np.ndarray, out: np.ndarray, temperature: float) -> np.ndarray:
    full = torch.tensor([list(ids) + list(out)], dtype=torch.long)
    logits = model(full).logits[0, len(ids) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(out, dtype=torch.long)[:, None])[:, 0].numpy()


def sampled_logprobs(model: torch.nn.Module, ids: np.ndarray, out: np.ndarray, temperature: float, top_k: int = 0,
                     top_p: float = 1.0, masked: Optional[list[list[int]]] = None) -> np.ndarray:
    """Hand reference of the behaviour logprob, one position at a time in numpy: softmax(logits / T), the masked ids
    of that position set to 0, then top-k, renormalise, the smallest prefix (by probability) reaching top_p,
    renormalise; the drawn token must be in the kept set."""
    full = torch.tensor([list(ids) + list(out)], dtype=torch.long)
    with torch.no_grad():
        logits = (model(full).logits[0, len(ids) - 1:-1].double() / temperature).numpy()
    result = []
    for pos, (row, tok) in enumerate(zip(logits, out)):
        probs = np.exp(row - row.max())
        for j in (masked[pos] if masked else []):
            probs[j] = 0.0
        probs /= probs.sum()
        order = sorted(range(len(probs)), key=lambda j: -probs[j])
        kept = order[:top_k] if top_k else order
        mass = sum(probs[j] for j in kept)
        nucleus, cum = [], 0.0
        for j in kept:
            if nucleus and cum > top_p:
                break
            nucleus.append(j)
            cum += probs[j] / mass
        assert int(tok) in nucleus, f"token {tok} at position {pos} is outside the sampled set {nucleus}"
        result.append(np.log(probs[tok] / sum(probs[j] for j in nucleus)))
    return np.asarray(result)


async def wait_steps(engine: TorchEngine, steps: int, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while engine.stats()["steps"] < steps:
        assert loop.time() < deadline, "engine did not reach the expected step"
        await asyncio.sleep(0.001)


def req(qid: str, ids: np.ndarray, **g) -> GenerateRequest:
    return GenerateRequest(qid=qid, input_ids=ids, gconfig=GenerationConfig(**g))


def ok(resp: GenerateResponse) -> GenerateResponse:
    assert resp.error is None, resp.error
    return resp


@pytest.fixture
def model() -> LlamaForCausalLM:
    return make_model(0)


def test_implements_protocol(model):
    assert isinstance(make_engine(model), InferenceEngine)


def test_refuses_sliding_window_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, use_sliding_window=True, sliding_window=16,
                      max_window_layers=0)
    with pytest.raises(ValueError, match="sliding window"):
        make_engine(Qwen2ForCausalLM(cfg), max_context_len=128)
    make_engine(Qwen2ForCausalLM(cfg), max_context_len=16)  # the window never binds: fine


@pytest.mark.asyncio
async def test_greedy_batched_joining_matches_reference(model):
    ref_model = copy.deepcopy(model)
    engine = make_engine(model)
    engine.start()
    lengths = [3, 17, 1, 40, 8, 25]
    prompts = [prompt(i, n) for i, n in enumerate(lengths)]
    max_new = [20, 12, 30, 9, 16, 24]

    async def submit(i: int) -> GenerateResponse:
        await wait_steps(engine, 3 * i)  # join at different steps of a running batch
        return await engine.agenerate(req(f"q{i}", prompts[i], greedy=True, max_new_tokens=max_new[i]))

    responses = await asyncio.gather(*(submit(i) for i in range(len(prompts))))
    stats = engine.stats()
    await engine.close()
    for i, r in enumerate(responses):
        ok(r)
        assert r.qid == f"q{i}" and len(r.samples) == 1
        s = r.samples[0]
        assert s.finish_reason == "length"
        assert s.output_ids.tolist() == greedy_reference(ref_model, prompts[i], max_new[i]), f"request {i}"
        assert s.output_versions.tolist() == [0] * max_new[i]
    # the batch really overlapped: fewer steps than tokens generated
    assert stats["steps"] < sum(max_new)
    assert stats["requests_done"] == len(prompts) and stats["running"] == 0 and stats["waiting"] == 0


@pytest.mark.asyncio
async def test_qwen2_greedy_matches_reference():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = Qwen2ForCausalLM(cfg).eval()
    ref_model = copy.deepcopy(model)
    engine = make_engine(model)
    prompts = [prompt(40 + i, 2 + 9 * i) for i in range(4)]
    rs = await asyncio.gather(*(engine.agenerate(req(f"q{i}", p, greedy=True, max_new_tokens=10 + 3 * i))
                                for i, p in enumerate(prompts)))
    await engine.close()
    for i, (p, r) in enumerate(zip(prompts, rs)):
        assert ok(r).samples[0].output_ids.tolist() == greedy_reference(ref_model, p, 10 + 3 * i)


@pytest.mark.asyncio
async def test_alone_equals_batched(model):
    engine = make_engine(model)
    p = prompt(3, 11)
    alone = ok(await engine.agenerate(req("a", p, greedy=True, max_new_tokens=15))).samples[0]
    others = [engine.agenerate(req(f"o{i}", prompt(10 + i, 2 + 7 * i), greedy=True, max_new_tokens=15))
              for i in range(5)]
    batched = await asyncio.gather(engine.agenerate(req("b", p, greedy=True, max_new_tokens=15)), *others)
    await engine.close()
    b = ok(batched[0]).samples[0]
    assert b.output_ids.tolist() == alone.output_ids.tolist()
    np.testing.assert_allclose(b.output_logprobs, alone.output_logprobs, atol=1e-5)


@pytest.mark.asyncio
async def test_logprobs_match_full_forward(model):
    ref_model = copy.deepcopy(model)
    engine = make_engine(model)
    cases = [
        dict(greedy=True, max_new_tokens=16),
        dict(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=16),
        dict(temperature=1.3, max_new_tokens=16, n=3),
    ]
    prompts = [prompt(20 + i, 5 + 6 * i) for i in range(len(cases))]
    responses = await asyncio.gather(*(engine.agenerate(req(f"q{i}", prompts[i], **c))
                                       for i, c in enumerate(cases)))
    await engine.close()
    for p, c, r in zip(prompts, cases, responses):
        ok(r)
        t = 1.0 if c.get("greedy") else c["temperature"]
        for s in r.samples:
            assert s.output_logprobs.dtype == np.float32
            expected = sampled_logprobs(ref_model, p, s.output_ids, t, c.get("top_k", 0), c.get("top_p", 1.0))
            np.testing.assert_allclose(s.output_logprobs, expected, atol=1e-4)
            if "top_p" not in c:  # untruncated: exactly what the learner recomputes from a plain forward pass
                np.testing.assert_allclose(s.output_logprobs, recompute_logprobs(ref_model, p, s.output_ids, t),
                                           atol=1e-4)


@pytest.mark.asyncio
async def test_logprobs_are_those_of_the_truncated_distribution(model):
    """top_p = 0.5, top_k = 3: every reported logprob is log(p / mass kept) of the renormalised truncated
    distribution (hand computation in numpy), and is above the full softmax's (the learner's) logprob."""
    ref_model = copy.deepcopy(model)
    engine = make_engine(model)
    p = prompt(41, 8)
    r = ok(await engine.agenerate(req("tp", p, temperature=0.9, top_p=0.5, top_k=3, n=4, max_new_tokens=20)))
    await engine.close()
    for s in r.samples:
        expected = sampled_logprobs(ref_model, p, s.output_ids, 0.9, top_k=3, top_p=0.5)
        np.testing.assert_allclose(s.output_logprobs, expected, atol=1e-4)
        full = recompute_logprobs(ref_model, p, s.output_ids, 0.9)
        assert np.all(s.output_logprobs >= full - 1e-5) and np.any(s.output_logprobs > full + 1e-3)


def test_sample_logprob_by_hand():
    """One row with probabilities (0.4, 0.3, 0.2, 0.1) at T = 1, top_k = 3, top_p = 0.5: top-3 renormalised is
    (4/9, 3/9, 2/9); the nucleus is the first two (mass before the second is 4/9 <= 0.5, before the third
    7/9 > 0.5), renormalised (4/7, 3/7). Token 3 (stop) is masked by min_new_tokens in a second row: the
    remaining (0.4, 0.3, 0.2) renormalise to (4/9, 3/9, 2/9) with no truncation."""
    from arl.inference.torch_engine import _Request, _Row

    engine = TorchEngine(make_model(0), pad_token_id=0, eos_token_id=None, max_context_len=16)
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]]))
    def row(r: GenerateRequest) -> _Row:
        return _Row(_Request(r, None, None, (), VOCAB), 0)  # type: ignore[arg-type]  # no loop: never answered

    trunc = row(req("a", [1], top_k=3, top_p=0.5))
    masked = row(req("b", [1], min_new_tokens=2, max_new_tokens=4, stop_token_ids=[3]))
    seen: dict[int, set[tuple[int, float]]] = {0: set(), 1: set()}
    for _ in range(200):
        tokens, logps = engine._sample([trunc, masked], logits.clone())
        for i in (0, 1):
            seen[i].add((int(tokens[i]), round(float(logps[i]), 5)))
    assert seen[0] == {(0, round(np.log(4 / 7), 5)), (1, round(np.log(3 / 7), 5))}
    assert seen[1] == {(0, round(np.log(4 / 9), 5)), (1, round(np.log(3 / 9), 5)), (2, round(np.log(2 / 9), 5))}


@pytest.mark.asyncio
async def test_stop_tokens_and_finish_reasons(model):
    ref_model = copy.deepcopy(model)
    # a prompt whose greedy continuation has a token first seen after position 0 (tiny random models repeat)
    for seed in range(5, 100):
        p = prompt(seed, 6)
        ref = greedy_reference(ref_model, p, 24)
        firsts = [i for i in range(1, len(ref)) if ref[i] not in ref[:i]]
        if firsts and firsts[0] < 4:
            break
    j = firsts[0]
    stop = ref[j]

    engine = make_engine(model)
    r = ok(await engine.agenerate(req("stop", p, greedy=True, max_new_tokens=24, stop_token_ids=[stop]))).samples[0]
    assert r.finish_reason == "stop"
    assert r.output_ids.tolist() == ref[: j + 1]  # the stop token is included
    r = ok(await engine.agenerate(req("len", p, greedy=True, max_new_tokens=j))).samples[0]
    assert r.finish_reason == "length" and r.output_ids.tolist() == ref[:j]
    await engine.close()

    # eos_token_id ends samples too
    engine = make_engine(model, eos_token_id=stop)
    r = ok(await engine.agenerate(req("eos", p, greedy=True, max_new_tokens=24))).samples[0]
    assert r.finish_reason == "stop" and r.output_ids.tolist() == ref[: j + 1]
    await engine.close()

    # several eos ids (Qwen2.5-Instruct: <|im_end|> and <|endoftext|>): any of them ends a sample
    absent = next(t for t in range(VOCAB) if t not in ref)
    engine = make_engine(model, eos_token_id=[absent, stop])
    r = ok(await engine.agenerate(req("eos2", p, greedy=True, max_new_tokens=24))).samples[0]
    assert r.finish_reason == "stop" and r.output_ids.tolist() == ref[: j + 1]
    await engine.close()

    # the context limit (prompt + generated) ends a sample with "length"
    engine = make_engine(model, max_context_len=10, eos_token_id=None)
    r = ok(await engine.agenerate(req("ctx", p, greedy=True, max_new_tokens=24))).samples[0]
    assert r.finish_reason == "length" and len(p) + len(r.output_ids) == 10
    assert r.output_ids.tolist() == ref[:4]
    await engine.close()


@pytest.mark.asyncio
async def test_min_new_tokens(model):
    ref_model = copy.deepcopy(model)
    p = prompt(6, 7)
    ref = greedy_reference(ref_model, p, 1)
    stop = ref[0]  # greedy would stop at once
    engine = make_engine(model, eos_token_id=stop)
    r0 = ok(await engine.agenerate(req("a", p, greedy=True, max_new_tokens=12))).samples[0]
    assert r0.output_ids.tolist() == [stop] and r0.finish_reason == "stop"
    r = ok(await engine.agenerate(req("b", p, greedy=True, max_new_tokens=12, min_new_tokens=5))).samples[0]
    await engine.close()
    ids = r.output_ids.tolist()
    assert stop not in ids[:5] and len(ids) >= 5
    if r.finish_reason == "stop":
        assert ids[-1] == stop and len(ids) >= 6
    else:
        assert r.finish_reason == "length" and len(ids) == 12
    # logprobs are those of the distribution sampled: the stop id masked (renormalised) for the first 5 tokens
    expected = sampled_logprobs(ref_model, p, r.output_ids, 1.0, masked=[[stop]] * 5 + [[]] * (len(ids) - 5))
    np.testing.assert_allclose(r.output_logprobs, expected, atol=1e-4)
    full = recompute_logprobs(ref_model, p, r.output_ids, 1.0)
    assert np.all(r.output_logprobs[:5] > full[:5])
    np.testing.assert_allclose(r.output_logprobs[5:], full[5:], atol=1e-4)


@pytest.mark.asyncio
async def test_n_samples(model):
    engine = make_engine(model)
    r = ok(await engine.agenerate(req("n", prompt(7, 9), n=4, temperature=1.0, max_new_tokens=12)))
    await engine.close()
    assert len(r.samples) == 4
    for s in r.samples:
        assert s.output_ids.shape == s.output_logprobs.shape == s.output_versions.shape == (12,)
        assert s.output_ids.dtype == np.int32 and s.finish_reason == "length"
        assert ((s.output_ids >= 0) & (s.output_ids < VOCAB)).all()
    assert len({tuple(s.output_ids.tolist()) for s in r.samples}) > 1
    assert engine.stats()["prefill_forwards"] == 1  # the prompt was prefilled once


@pytest.mark.asyncio
async def test_top_k_1_equals_greedy(model):
    engine = make_engine(model)
    p = prompt(8, 10)
    g = ok(await engine.agenerate(req("g", p, greedy=True, max_new_tokens=16))).samples[0]
    k = ok(await engine.agenerate(req("k", p, temperature=0.8, top_k=1, max_new_tokens=16))).samples[0]
    tp = ok(await engine.agenerate(req("p", p, temperature=1.0, top_p=1e-6, max_new_tokens=16))).samples[0]
    await engine.close()
    assert k.output_ids.tolist() == g.output_ids.tolist()
    assert tp.output_ids.tolist() == g.output_ids.tolist()


@pytest.mark.asyncio
async def test_reproducible_with_seed(model):
    async def run(seed: int) -> list[list[int]]:
        engine = make_engine(copy.deepcopy(model), seed=seed)
        r = ok(await engine.agenerate(req("s", prompt(9, 8), n=3, temperature=1.0, max_new_tokens=16)))
        await engine.close()
        return [s.output_ids.tolist() for s in r.samples]

    a, b, c = await run(123), await run(123), await run(456)
    assert a == b
    assert a != c


@pytest.mark.asyncio
async def test_refused_requests_keep_engine_serving(model):
    engine = make_engine(model, max_context_len=32, max_batch_size=8)
    bad = [
        req("long", prompt(0, 32), greedy=True),
        req("temp", prompt(0, 4), temperature=0.0),
        req("n0", prompt(0, 4), n=0),
        req("minnew", prompt(0, 4), max_new_tokens=2, min_new_tokens=3),
        req("topp", prompt(0, 4), top_p=0.0),
        req("vocab", np.array([1, 2, VOCAB], np.int32)),
        req("neg", np.array([1, -1], np.int32)),
        req("empty", np.zeros(0, np.int32)),
        req("bign", prompt(0, 4), n=9),
    ]
    responses = await asyncio.gather(*(engine.agenerate(b) for b in bad))
    for b, r in zip(bad, responses):
        assert r.qid == b.qid and r.samples == [] and r.error, b.qid
    by = {r.qid: r.error for r in responses}
    assert "too long" in by["long"] and "temperature" in by["temp"] and "vocabulary" in by["vocab"]
    assert "empty" in by["empty"] and "max_batch_size" in by["bign"]
    # a request that is not a GenerateRequest at all
    weird = await engine.agenerate("not a request")  # type: ignore[arg-type]
    assert weird.error and weird.samples == []
    good = ok(await engine.agenerate(req("good", prompt(1, 5), greedy=True, max_new_tokens=4)))
    assert len(good.samples[0].output_ids) == 4
    stats = engine.stats()
    assert stats["requests_refused"] == len(bad) + 1 and stats["requests_done"] == 1
    await engine.close()


@pytest.mark.asyncio
async def test_update_weights_mid_flight(model, tmp_path: Path):
    old_ref = copy.deepcopy(model)
    new_model = make_model(seed=1)
    path = tmp_path / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in new_model.state_dict().items()}, str(path))

    engine = make_engine(model, max_batch_size=64, max_context_len=128)
    prompts = [prompt(100 + i, 2 + i % 7) for i in range(32)]
    max_new = 48
    tasks = [asyncio.ensure_future(engine.agenerate(req(f"q{i}", p, greedy=True, max_new_tokens=max_new)))
             for i, p in enumerate(prompts)]
    await wait_steps(engine, 4)
    await engine.update_weights(str(path), version=1)
    assert engine.version == 1
    responses = await asyncio.gather(*tasks)
    assert engine.stats()["weight_updates"] == 1

    seen_versions: set[int] = set()
    for p, r in zip(prompts, responses):
        ok(r)
        s = r.samples[0]
        assert len(s.output_ids) == max_new and s.finish_reason == "length"  # none lost or cut
        v = s.output_versions
        assert (np.diff(v) >= 0).all()
        seen_versions |= set(v.tolist())
        # tokens made before the update are the old policy's greedy tokens
        n_old = int((v == 0).sum())
        assert s.output_ids[:n_old].tolist() == greedy_reference(old_ref, p, n_old)
    assert seen_versions == {0, 1}

    # after the update, new requests follow the new weights exactly
    after = [prompt(200 + i, 3 + 4 * i) for i in range(3)]
    rs = await asyncio.gather(*(engine.agenerate(req(f"a{i}", p, greedy=True, max_new_tokens=12))
                                for i, p in enumerate(after)))
    await engine.close()
    for p, r in zip(after, rs):
        s = ok(r).samples[0]
        assert s.output_ids.tolist() == greedy_reference(new_model, p, 12)
        assert s.output_versions.tolist() == [1] * 12


@pytest.mark.asyncio
async def test_update_weights_from_save_pretrained_dir_and_bad_source(tmp_path: Path):
    model = make_model(0, tie=True)
    new_model = make_model(2, tie=True)
    new_model.save_pretrained(str(tmp_path / "ckpt"))  # tied lm_head is not in the file
    engine = make_engine(model)
    p = prompt(11, 6)
    with pytest.raises(FileNotFoundError):
        await engine.update_weights(str(tmp_path / "missing"), version=5)
    bad = tmp_path / "bad.safetensors"
    save_file({"not.a.weight": torch.zeros(2)}, str(bad))
    with pytest.raises(ValueError, match="do not match"):
        await engine.update_weights(str(bad), version=5)
    assert engine.version == 0
    await engine.update_weights(str(tmp_path / "ckpt"), version=3)
    assert engine.version == 3
    s = ok(await engine.agenerate(req("x", p, greedy=True, max_new_tokens=10))).samples[0]
    await engine.close()
    assert s.output_ids.tolist() == greedy_reference(new_model, p, 10)
    assert s.output_versions.tolist() == [3] * 10


@pytest.mark.asyncio
async def test_pause_resume(model):
    engine = make_engine(model)
    engine.start()
    await engine.pause()
    task = asyncio.ensure_future(engine.agenerate(req("p", prompt(12, 5), greedy=True, max_new_tokens=6)))
    await await_until(lambda: engine.stats()["waiting"] == 1, 30, "the request to be queued")
    assert not task.done()
    st = engine.stats()
    assert st["steps"] == 0 and st["waiting"] == 1 and st["paused"]

    # a request paused mid-generation keeps its tokens and continues
    await engine.resume()
    r = ok(await task)
    assert len(r.samples[0].output_ids) == 6
    long_task = asyncio.ensure_future(engine.agenerate(req("l", prompt(13, 5), greedy=True, max_new_tokens=40)))
    await wait_steps(engine, engine.stats()["steps"] + 3)
    await engine.pause()
    steps = engine.stats()["steps"]
    await asyncio.sleep(0.05)
    assert engine.stats()["steps"] == steps and not long_task.done()
    await engine.resume()
    r = ok(await long_task)
    assert len(r.samples[0].output_ids) == 40 and r.samples[0].finish_reason == "length"
    ref = greedy_reference(make_model(0), prompt(13, 5), 40)
    assert r.samples[0].output_ids.tolist() == ref
    await engine.close()


@pytest.mark.asyncio
async def test_close_fails_pending(model):
    engine = make_engine(model, max_batch_size=2)
    running = asyncio.ensure_future(engine.agenerate(req("run", prompt(14, 4), greedy=True, max_new_tokens=100)))
    await wait_steps(engine, 3)
    await engine.pause()
    waiting = [asyncio.ensure_future(engine.agenerate(req(f"w{i}", prompt(15, 4), n=2, max_new_tokens=8)))
               for i in range(2)]
    await await_until(lambda: engine.stats()["waiting"] == 2, 30, "both requests to be queued")
    await engine.close()
    r = await running
    assert r.error == "engine closed"
    assert len(r.samples) == 1 and r.samples[0].finish_reason == "abort" and 0 < len(r.samples[0].output_ids) < 100
    for w in waiting:
        rw = await w
        assert rw.error == "engine closed" and rw.samples == []
    after = await engine.agenerate(req("after", prompt(16, 4)))
    assert after.error == "engine closed"
    with pytest.raises(RuntimeError):
        await engine.update_weights("whatever", 1)
    await engine.close()  # idempotent


@pytest.mark.asyncio
async def test_close_before_start_fails_waiting(model):
    engine = make_engine(model)
    await engine.close()
    r = await engine.agenerate(req("x", prompt(1, 3)))
    assert r.error == "engine closed"


@pytest.mark.asyncio
async def test_batching_uses_fewer_steps_than_sequential(model):
    g = dict(greedy=True, max_new_tokens=10)
    seq_engine = make_engine(copy.deepcopy(model))
    ok(await seq_engine.agenerate(req("a", prompt(17, 5), **g)))
    ok(await seq_engine.agenerate(req("b", prompt(18, 9), **g)))
    sequential = seq_engine.stats()["steps"]
    await seq_engine.close()

    conc_engine = make_engine(model)
    await conc_engine.pause()  # both join the same step
    both = asyncio.gather(conc_engine.agenerate(req("a", prompt(17, 5), **g)),
                          conc_engine.agenerate(req("b", prompt(18, 9), **g)))
    await await_until(lambda: conc_engine.stats()["waiting"] == 2, 30, "both requests to be queued")
    await conc_engine.resume()
    for r in await both:
        ok(r)
    concurrent = conc_engine.stats()["steps"]
    await conc_engine.close()
    assert sequential == 20
    assert concurrent == 10


@pytest.mark.asyncio
async def test_step_exception_fails_requests_and_keeps_serving(model, caplog):
    engine = make_engine(model)
    real_forward = engine._forward  # the engine's one model call (the lean forward or the model's own)
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real_forward(*args, **kwargs)

    engine._forward = flaky  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="arl.inference"):
        r = await engine.agenerate(req("x", prompt(19, 4), greedy=True, max_new_tokens=8))
    assert r.samples == [] and r.error and "boom" in r.error
    assert any("decode step failed" in rec.getMessage() for rec in caplog.records)
    good = ok(await engine.agenerate(req("y", prompt(19, 4), greedy=True, max_new_tokens=8)))
    assert len(good.samples[0].output_ids) == 8
    assert engine.stats()["requests_failed"] == 1
    await engine.close()


@pytest.mark.asyncio
async def test_cancelled_request_is_dropped(model):
    engine = make_engine(model)
    task = asyncio.ensure_future(engine.agenerate(req("c", prompt(20, 4), greedy=True, max_new_tokens=120)))
    await wait_steps(engine, 3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    r = ok(await engine.agenerate(req("d", prompt(21, 4), greedy=True, max_new_tokens=5)))
    assert len(r.samples[0].output_ids) == 5
    assert engine.stats()["running"] == 0
    await engine.close()


def test_agenerate_from_another_thread_loop(model):
    """The engine serves callers whose event loops live in other threads."""
    import threading

    engine = make_engine(model)
    results: list[Optional[GenerateResponse]] = [None, None]

    def caller(i: int) -> None:
        results[i] = asyncio.run(engine.agenerate(req(f"t{i}", prompt(30 + i, 6), greedy=True, max_new_tokens=7)))

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    asyncio.run(engine.close())
    for r in results:
        assert r is not None and r.error is None and len(r.samples[0].output_ids) == 7


def test_length_groups_split_only_where_padding_costs_more_than_a_forward():
    from arl.inference.torch_engine import length_groups

    def cost(lengths, groups, fixed):
        return sum(fixed + len(g) * max(lengths[i] for i in g) for g in groups)

    assert length_groups([20] * 10, 128) == [list(range(10))]
    lengths = [20] * 12 + [50]  # one cache miss among feedback turns: 13 x 50 padded vs 12 x 20 + 50 in two
    groups = length_groups(lengths, 128)
    assert groups == [list(range(12)), [12]]
    assert length_groups(lengths, 10**6) == [list(range(13))]  # a forward dearer than any padding: one forward
    rng = np.random.default_rng(0)
    for _ in range(50):  # the split is the cheapest of all splits into runs of the sorted lengths
        lengths = rng.integers(1, 60, size=int(rng.integers(1, 9))).tolist()
        groups = length_groups(lengths, 40)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        best = min(cost(lengths, [order[a:b] for a, b in zip((0,) + cuts, cuts + (len(order),))], 40)
                   for k in range(len(order))
                   for cuts in itertools.combinations(range(1, len(order)), k))
        assert cost(lengths, groups, 40) == best
