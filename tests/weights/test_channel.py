"""The run's broadcast pieces in one process (threads stand in for the learner and the inference worker):
`WeightPublisher` sends the newest state dict to the servers asked, `BroadcastLoader` swaps it into a torch engine
between decode steps; a tied lm_head left out of the state dict stays tied."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from arl.weights.broadcast import WeightSender
from arl.weights.channel import BroadcastLoader, WeightPublisher
from tests.inference.test_torch_engine import greedy_reference, make_engine, make_model, prompt

from arl.api.types import GenerateRequest, GenerationConfig


def state_without_lm_head(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}


@pytest.mark.asyncio
async def test_publisher_sends_the_newest_to_a_torch_engine_between_decode_steps():
    old, new1, new2 = make_model(0, tie=True), make_model(1, tie=True), make_model(2, tie=True)
    engine = make_engine(copy.deepcopy(old))
    engine.start()
    sender = WeightSender("127.0.0.1", 0, timeout_s=30, gloo_host="127.0.0.1")
    publisher = WeightPublisher(sender, bucket_bytes=16 << 10)  # several buckets
    loader = BroadcastLoader(engine, timeout_s=30, gloo_host="127.0.0.1")
    runner = asyncio.create_task(publisher.run())
    try:
        await asyncio.gather(publisher.open_group("g0", 0), loader.join(sender.spec("g0")))
        # a request in flight across the update keeps going; tokens after it carry the new version
        ids = prompt(1, 6)
        gen = asyncio.create_task(engine.agenerate(GenerateRequest(
            qid="q", input_ids=ids, gconfig=GenerationConfig(n=1, max_new_tokens=40, greedy=True))))
        publisher.set_newest(1, state_without_lm_head(new1))
        publisher.set_newest(2, state_without_lm_head(new2))  # coalesced: asked for 1, the learner holds 2
        publisher.request(1, [0])
        version = await loader.load()
        assert version == 2 and engine.version == 2
        for k, v in new2.state_dict().items():
            assert torch.equal(engine.model.state_dict()[k], v), k
        assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight  # still tied
        resp = await gen
        assert resp.error is None and resp.samples[0].output_versions[-1] == 2
        ids2 = prompt(2, 5)
        out = await engine.agenerate(GenerateRequest(qid="q2", input_ids=ids2,
                                                     gconfig=GenerationConfig(n=1, max_new_tokens=8, greedy=True)))
        assert list(out.samples[0].output_ids) == greedy_reference(new2, ids2, 8)
        assert publisher.stats["weight_sends"] == 1 and publisher.stats["weight_send_failures"] == 0
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        await loader.close()
        publisher.close()
        await engine.close()


@pytest.mark.asyncio
async def test_a_plan_that_does_not_fit_is_refused_and_the_engine_keeps_its_weights():
    model = make_model(0, tie=True)
    engine = make_engine(copy.deepcopy(model))
    engine.start()
    sender = WeightSender("127.0.0.1", 0, timeout_s=30, gloo_host="127.0.0.1")
    publisher = WeightPublisher(sender)
    loader = BroadcastLoader(engine, timeout_s=30, gloo_host="127.0.0.1")
    runner = asyncio.create_task(publisher.run())
    try:
        await asyncio.gather(publisher.open_group("g0", 0), loader.join(sender.spec("g0")))
        bad = state_without_lm_head(make_model(1, tie=True))
        bad["model.norm.weight"] = torch.ones(3)
        publisher.set_newest(1, bad)
        publisher.request(1, [0])
        with pytest.raises(Exception, match="refused"):
            await loader.load()
        assert engine.version == 0
        for k, v in model.state_dict().items():
            assert torch.equal(engine.model.state_dict()[k], v), k
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        await loader.close()
        publisher.close()
        await engine.close()


def test_an_engine_without_a_broadcast_path_is_refused():
    with pytest.raises(ValueError, match="cannot load broadcast weights"):
        BroadcastLoader(object())
