"""The run's broadcast pieces in one process (threads stand in for the learner and the inference worker):
`WeightPublisher` sends the newest state dict to the servers asked, `BroadcastLoader` swaps it into a torch engine
between decode steps; a tied lm_head left out of the state dict stays tied."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from typing import Any, AsyncIterator

import pytest
import torch

from arl.weights.sender import WeightSender
from arl.weights.channel import BroadcastLoader, WeightPublisher
from tests.inference.test_torch_engine import greedy_reference, make_engine, make_model, prompt
from tests.waiting import await_until

from arl.api.types import GenerateRequest, GenerationConfig


@contextlib.asynccontextmanager
async def linked(model: torch.nn.Module, bucket_bytes: int = 64 << 20) -> AsyncIterator[tuple[Any, WeightPublisher,
                                                                                          BroadcastLoader]]:
    """A torch engine serving a copy of `model` and a publisher running, joined by one group (as a run forms it)."""
    engine = make_engine(copy.deepcopy(model))
    engine.start()
    sender = WeightSender("127.0.0.1", 0, timeout_s=30, gloo_host="127.0.0.1")
    publisher = WeightPublisher(sender, bucket_bytes=bucket_bytes)
    loader = BroadcastLoader(engine, timeout_s=30, gloo_host="127.0.0.1")
    runner = asyncio.create_task(publisher.run())
    try:
        await asyncio.gather(publisher.open_group("g0", 0), loader.join(sender.spec("g0")))
        yield engine, publisher, loader
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        await loader.close()
        publisher.close()
        await engine.close()


def state_without_lm_head(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}


@pytest.mark.asyncio
async def test_publisher_sends_the_newest_to_a_torch_engine_between_decode_steps():
    old, new1, new2 = make_model(0, tie=True), make_model(1, tie=True), make_model(2, tie=True)
    async with linked(old, bucket_bytes=16 << 10) as (engine, publisher, loader):  # several buckets
        # a request in flight across the update keeps going; tokens after it carry the new version. Until the
        # update lands each forward takes 2 ms more, so the request cannot finish first (120 steps, >= 240 ms)
        forward = engine._forward

        def slowed(*args, **kwargs):
            if engine.version < 2:
                time.sleep(0.002)
            return forward(*args, **kwargs)

        engine._forward = slowed
        ids = prompt(1, 6)
        gen = asyncio.create_task(engine.agenerate(GenerateRequest(
            qid="q", input_ids=ids, gconfig=GenerationConfig(n=1, max_new_tokens=120, greedy=True))))
        await publisher.set_newest(1, state_without_lm_head(new1))
        await publisher.set_newest(2, state_without_lm_head(new2))  # coalesced: asked for 1, the learner holds 2
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
        # the receiver can finish before the sender's thread returns and the publisher books the send
        await await_until(lambda: publisher.stats["weight_sends"] == 1, what="the send's outcome")
        assert publisher.stats["weight_send_failures"] == 0


@pytest.mark.asyncio
async def test_versions_in_a_row_reuse_the_buffers_on_both_sides_and_the_learner_may_change_its_tensors():
    """The publisher packs before `set_newest` returns (the learner's next step changes the live tensors in
    place); sender and receiver keep their buffers across versions (two each), and each version lands whole."""
    models = [make_model(i, tie=True) for i in range(5)]
    live = state_without_lm_head(models[0])  # the learner's parameters, changed in place step after step
    seen_rx: list[set[int]] = []
    async with linked(models[0], bucket_bytes=16 << 10) as (engine, publisher, loader):
        for v in range(1, 5):
            for k, t in state_without_lm_head(models[v]).items():
                live[k].copy_(t)
            await publisher.set_newest(v, live)
            for t in live.values():
                t.add_(1.0)  # the next step starts: must not reach what is sent
            publisher.request(v, [0])
            assert await loader.load() == v
            for k, t in models[v].state_dict().items():
                assert torch.equal(engine.model.state_dict()[k], t), (v, k)
            seen_rx.append({t.untyped_storage().data_ptr() for t in engine.model.parameters()})
        assert 1 <= len(publisher._pool) <= 2  # 2 when a send was still finishing as the next version was packed
        assert seen_rx[2] == seen_rx[0] and seen_rx[3] == seen_rx[1] and seen_rx[0] != seen_rx[1]
        await await_until(lambda: publisher.stats["weight_sends"] == 4, what="the last send's outcome")
        assert publisher.stats["weight_send_failures"] == 0


@pytest.mark.asyncio
async def test_a_plan_that_does_not_fit_is_refused_and_the_engine_keeps_its_weights():
    model = make_model(0, tie=True)
    async with linked(model) as (engine, publisher, loader):
        bad = state_without_lm_head(make_model(1, tie=True))
        bad["model.norm.weight"] = torch.ones(3)
        await publisher.set_newest(1, bad)
        publisher.request(1, [0])
        with pytest.raises(Exception, match="refused"):
            await loader.load()
        assert engine.version == 0
        for k, v in model.state_dict().items():
            assert torch.equal(engine.model.state_dict()[k], v), k


def test_an_engine_without_a_broadcast_path_is_refused():
    with pytest.raises(ValueError, match="cannot load broadcast weights"):
        BroadcastLoader(object())


def test_packing_never_writes_the_buffers_a_send_reads():
    """At most two packed buffers: the one being sent is never packed over; a newest not being sent is."""
    from types import SimpleNamespace

    from arl.weights.plan import unpack_bucket

    pub = WeightPublisher(SimpleNamespace(device=None), bucket_bytes=1 << 10)  # type: ignore[arg-type]
    sds = [{"a": torch.full((300,), float(i)), "b": torch.arange(7) + i} for i in range(4)]

    def values(p) -> dict[str, torch.Tensor]:
        return {n: t.clone() for k in range(len(p.plan.buckets)) for n, t in unpack_bucket(p.plan, k, p.buckets[k])}

    p1 = pub._pack(sds[0])
    pub.newest, pub._sending = (1, p1), p1  # v1 is on the wire
    p2 = pub._pack(sds[1])
    assert p2 is not p1
    pub.newest = (2, p2)
    p3 = pub._pack(sds[2])  # v1 still on the wire: v2, not sent yet, is superseded and packed over
    assert p3 is p2 and pub.newest is None and torch.equal(values(p1)["a"], sds[0]["a"])
    pub.newest, pub._sending = (3, p3), None
    p4 = pub._pack(sds[3])  # nothing on the wire: the free buffer, the newest kept until replaced
    assert p4 is p1 and pub.newest == (3, p3) and len(pub._pool) == 2
    assert all(torch.equal(values(p4)[k], sds[3][k]) and torch.equal(values(p3)[k], sds[2][k]) for k in "ab")
