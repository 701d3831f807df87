"""Several LoRA policies served at once (`arl.inference.multi_lora`, `TorchEngine(max_loras=...)`): rows of different
policies decode in one batch, each as if its adapter were merged; versions, prefix caches and refusals per policy."""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
import torch

from arl.api.types import GenerateRequest, GenerationConfig
from arl.inference.multi_lora import LoraSlots
from arl.transport.codec import decode, encode
from arl.weights.adapter import LORA_A, LORA_B, merged_weight
from tests.inference.test_torch_engine import greedy_reference, make_engine, make_model, ok, prompt

torch.set_num_threads(1)

TARGETS = ("q_proj", "v_proj", "down_proj")


def payload(model: torch.nn.Module, seed: int, rank: int = 4, targets=TARGETS) -> dict[str, torch.Tensor]:
    """A random adapter payload (B already scaled) on `targets` of every layer of `model`."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            out[name + LORA_A] = torch.randn((rank, mod.in_features), generator=g) * 0.3
            out[name + LORA_B] = torch.randn((mod.out_features, rank), generator=g) * 0.3
    return out


def merged(model: torch.nn.Module, pay: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A copy of `model` with `pay` merged into its weights: what one policy alone is."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for k, a in pay.items():
            if k.endswith(LORA_A):
                w = m.get_parameter(k[: -len(LORA_A)] + ".weight")
                w.copy_(merged_weight(w, a, pay[k[: -len(LORA_A)] + LORA_B]))
    return m.eval()


def req(qid: str, ids: np.ndarray, policy=None, **g) -> GenerateRequest:
    return GenerateRequest(qid=qid, input_ids=ids, gconfig=GenerationConfig(**g), policy=policy)


@torch.no_grad()
def test_each_row_gets_its_own_adapter_in_one_forward():
    base = make_model(0)
    pays = {"a": payload(base, 1), "b": payload(base, 2, rank=2)}  # ranks differ: padded to max_rank
    slots = LoraSlots(base, max_adapters=2, max_rank=4)
    for v, (name, pay) in enumerate(pays.items(), start=3):
        slots.apply(slots.prepare(name, pay), version=v)
    assert slots.slots == {"a": 1, "b": 2} and slots.versions == {1: 3, 2: 4}
    ids = torch.tensor(np.stack([prompt(s, 9) for s in range(5)]), dtype=torch.long)
    want = {0: base(ids).logits, 1: merged(base, pays["a"])(ids).logits, 2: merged(base, pays["b"])(ids).logits}
    for rows in ([1, 2, 0, 2, 1], [1] * 5, [0] * 5, [2, 2, 2, 2, 0]):  # mixed (bmm), one adapter, none
        with slots.rows(rows):
            got = base(ids).logits
        for i, s in enumerate(rows):
            torch.testing.assert_close(got[i], want[s][i], rtol=1e-4, atol=1e-4)
    assert torch.equal(base(ids).logits, want[0])  # outside `rows` the model is the base


def test_adapters_that_do_not_fit_are_refused_by_name():
    base = make_model(0)
    slots = LoraSlots(base, max_adapters=1, max_rank=4)
    with pytest.raises(ValueError, match="rank 8 over the engine's max_lora_rank 4"):
        slots.prepare("a", payload(base, 1, rank=8))
    with pytest.raises(ValueError, match="cannot replace whole tensors"):
        slots.prepare("a", {**payload(base, 1), "lm_head.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="from an adapter payload"):
        slots.prepare("a", dict(base.state_dict()))
    bad = payload(base, 1)
    bad["model.layers.0.self_attn.q_proj" + LORA_A] = torch.zeros(4, 7)
    with pytest.raises(ValueError, match="do not fit a 64x64 weight"):
        slots.prepare("a", bad)
    slots.apply(slots.prepare("a", payload(base, 1)), 1)
    with pytest.raises(ValueError, match="no free adapter slot for a new policy 'b'"):
        slots.prepare("b", payload(base, 2))
    slots.apply(slots.prepare("a", payload(base, 3)), 2)  # a policy it serves is updated in its slot
    assert slots.slots == {"a": 1} and slots.versions == {1: 2}
    # two new policies prepared while one slot was free: the second to be applied finds it taken
    two = LoraSlots(base, max_adapters=1, max_rank=4)
    first, second = two.prepare("a", payload(base, 1)), two.prepare("b", payload(base, 2))
    assert two.apply(first, 1) == 1
    with pytest.raises(ValueError, match="no free adapter slot for a new policy 'b'"):
        two.apply(second, 1)
    assert two.slots == {"a": 1}


@pytest.mark.asyncio
async def test_the_engine_batches_requests_of_several_policies_each_as_if_alone():
    base = make_model(0)
    pays = {"a": payload(base, 1), "b": payload(base, 2)}
    refs = {None: base, **{k: merged(base, p) for k, p in pays.items()}}
    engine = make_engine(copy.deepcopy(base), max_loras=2, prefix_cache_tokens=4096, version=7)
    await engine.update_weights_from_tensors(dict(pays["a"]), version=1, policy="a")
    await engine.update_weights_from_tensors(dict(pays["b"]), version=5, policy="b")
    assert engine.stats()["policies"] == {"a": 1, "b": 5} and engine.version == 7
    # the same prompts under each policy, sent together (one batch of mixed rows; the same ids under two policies
    # are not one prefill), twice (the second round is served from each policy's own prefix cache)
    prompts = [prompt(s, 6 + s) for s in range(3)]
    for _ in range(2):
        jobs = [(p, i, engine.agenerate(req(f"{p}{i}", ids, policy=p, greedy=True, max_new_tokens=6)))
                for i, ids in enumerate(prompts) for p in (None, "a", "b")]
        answers = await asyncio.gather(*(j for _, _, j in jobs))
        for (p, i, _), resp in zip(jobs, answers):
            s = ok(resp).samples[0]
            assert s.output_ids.tolist() == greedy_reference(refs[p], prompts[i], 6), (p, i)
            assert s.output_versions.tolist() == [{None: 7, "a": 1, "b": 5}[p]] * 6  # each policy's version
    # the second round prefilled one token a request: each policy's own cache held the rest
    assert engine.stats()["prefill_tokens"] == 3 * sum(len(p) for p in prompts) + 9
    # a prompt finished under "a" is not reused for "b": its whole prompt is prefilled, and it answers as b
    fresh = prompt(11, 10)
    ok(await engine.agenerate(req("fa", fresh, policy="a", greedy=True, max_new_tokens=6)))
    before = engine.stats()["prefill_tokens"]
    s = ok(await engine.agenerate(req("fb", fresh, policy="b", greedy=True, max_new_tokens=6))).samples[0]
    assert engine.stats()["prefill_tokens"] - before == len(fresh)
    assert s.output_ids.tolist() == greedy_reference(refs["b"], fresh, 6)
    # an unknown policy is refused by name; the others go on
    bad = await engine.agenerate(req("x", prompts[0], policy="c", max_new_tokens=2))
    assert bad.error is not None and "unknown policy 'c'" in bad.error and "['a', 'b']" in bad.error
    # a policy's update leaves the other policies and the base as they were
    pays["a"] = payload(base, 9)
    await engine.update_weights_from_tensors(dict(pays["a"]), version=2, policy="a")
    for p, ref in ((None, base), ("a", merged(base, pays["a"])), ("b", refs["b"])):
        s = ok(await engine.agenerate(req(f"after-{p}", prompts[1], policy=p, greedy=True, max_new_tokens=6)))
        assert s.samples[0].output_ids.tolist() == greedy_reference(ref, prompts[1], 6), p
        assert s.samples[0].output_versions.tolist() == [{None: 7, "a": 2, "b": 5}[p]] * 6
    await engine.close()


@pytest.mark.asyncio
async def test_an_engine_without_lora_slots_refuses_policies():
    engine = make_engine(make_model(0))
    resp = await engine.agenerate(req("x", prompt(0, 5), policy="a", max_new_tokens=2))
    assert resp.error is not None and "unknown policy 'a'" in resp.error
    with pytest.raises(ValueError, match="serves no LoRA policies"):
        await engine.update_weights_from_tensors(payload(engine.model, 1), version=1, policy="a")
    await engine.close()


@pytest.mark.asyncio
async def test_the_engines_own_adapter_takes_a_slot_beside_frozen_policies():
    """A LoRA-trained run beside a frozen policy: the run's adapter is not merged (the frozen one is a delta on the
    base, which must stay the base) but served from a slot of its own; requests without a policy use it, its
    updates move the engine's version, and the frozen policy answers as before."""
    base = make_model(0)
    frozen, own1, own2 = payload(base, 1), payload(base, 2, rank=2), payload(base, 3, rank=2)
    engine = make_engine(copy.deepcopy(base), max_loras=2, prefix_cache_tokens=4096)
    await engine.update_weights_from_tensors(dict(frozen), version=0, policy="opponent")
    ids = prompt(4, 7)

    async def answer(policy):
        s = ok(await engine.agenerate(req(f"q-{policy}-{engine.version}", ids, policy=policy, greedy=True,
                                          max_new_tokens=6))).samples[0]
        return s.output_ids.tolist(), s.output_versions.tolist()

    assert await answer(None) == (greedy_reference(base, ids, 6), [0] * 6)  # no adapter of its own yet: the base
    for version, own in ((1, own1), (2, own2)):
        await engine.update_weights_from_tensors(dict(own), version=version)
        assert engine.version == version and engine.stats()["policies"] == {"opponent": 0}
        assert await answer(None) == (greedy_reference(merged(base, own), ids, 6), [version] * 6)
        assert await answer("opponent") == (greedy_reference(merged(base, frozen), ids, 6), [0] * 6)
    with pytest.raises(ValueError, match="modules_to_save"):  # whole tensors cannot sit beside a delta either
        await engine.update_weights_from_tensors({**own2, "lm_head.weight": base.lm_head.weight.clone()}, version=3)
    assert engine.version == 2
    await engine.close()


def test_the_policy_travels_with_the_request():
    r = req("q", prompt(0, 4), policy="solver", max_new_tokens=3)
    assert decode(encode("gen_req", r))[1].policy == "solver"
    assert decode(encode("gen_req", req("q", prompt(0, 4))))[1].policy is None


def test_every_engine_refuses_a_policy_it_does_not_serve():
    from arl.inference.requests import check_request

    assert "unknown policy 'a'" in check_request(req("q", prompt(0, 4), policy="a"))
    assert check_request(req("q", prompt(0, 4), policy="a"), policies=("a",)) is None
    assert check_request(req("q", prompt(0, 4))) is None
