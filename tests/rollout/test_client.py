"""InferenceClient routing: least outstanding work, sticky sessions reset on a new policy version, failover."""

from __future__ import annotations

import asyncio
from typing import Any, Optional

import numpy as np
import pytest
import pytest_asyncio

from arl.api.types import GenerateRequest, GenerateResponse, GenerationConfig, SampleOutput
from arl.rollout.client import InferenceClient


class FakeDealer:
    """In-memory stand-in for a DEALER to one inference worker; `answer()` replies to a request it received."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.sent: list[GenerateRequest] = []
        self.aborted: list[str] = []  # wire ids the client told this worker to stop generating
        self._inbox: asyncio.Queue = asyncio.Queue()
        self.got = asyncio.Event()

    async def send(self, msg_type: str, payload: Any) -> None:
        if msg_type == "gen_abort":
            self.aborted.append(payload["qid"])
            return
        assert msg_type == "gen_req"
        self.sent.append(payload)
        self.got.set()

    async def recv(self) -> tuple[str, Any]:
        return await self._inbox.get()

    def answer(self, req: GenerateRequest, version: int = 0, ntok: int = 2) -> None:
        sample = SampleOutput(output_ids=np.arange(ntok), output_logprobs=np.zeros(ntok),
                              output_versions=np.full(ntok, version), finish_reason="length")
        self._inbox.put_nowait(("gen_resp", GenerateResponse(qid=req.qid, samples=[sample])))


def gen(qid: str, session: Optional[str] = None, max_new: int = 4) -> GenerateRequest:
    return GenerateRequest(qid=qid, input_ids=np.array([1, 2, 3]), gconfig=GenerationConfig(max_new_tokens=max_new),
                           session_id=session)


async def until(cond, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.001)


@pytest_asyncio.fixture
async def setup():
    dealers = [FakeDealer(0), FakeDealer(1)]
    client = InferenceClient(dealers, request_timeout=5.0)
    client.start()
    yield client, dealers
    await client.close()


@pytest.mark.asyncio
async def test_least_load_and_sticky_sessions_reset_on_new_version(setup):
    client, (d0, d1) = setup
    t_a = asyncio.create_task(client.generate(gen("a", session="s1", max_new=100)))
    await until(lambda: len(d0.sent) == 1)
    t_b = asyncio.create_task(client.generate(gen("b", session="s2")))  # d0 is busier: goes to d1
    await until(lambda: len(d1.sent) == 1)
    d0.answer(d0.sent[0], version=0)
    d1.answer(d1.sent[0], version=0)
    assert (await t_a).qid == "a" and (await t_b).qid == "b"
    # same version: session s2 stays on d1 even though both are idle now
    t = asyncio.create_task(client.generate(gen("c", session="s2")))
    await until(lambda: len(d1.sent) == 2)
    d1.answer(d1.sent[1], version=0)
    await t
    # a response made by version 1: the sticky map is forgotten
    t = asyncio.create_task(client.generate(gen("d", session="s1")))
    await until(lambda: len(d0.sent) == 2)
    d0.answer(d0.sent[1], version=1)
    await t
    assert client.version == 1 and client.stats["sticky_resets"] == 1
    # s2 is routed afresh by load: d1 is loaded with a long request, so s2 goes to d0 now
    long = asyncio.create_task(client.generate(gen("e", max_new=1000)))
    await until(lambda: len(d0.sent) + len(d1.sent) == 5)
    busy = d0 if len(d0.sent) == 3 else d1
    idle = d1 if busy is d0 else d0
    n_idle = len(idle.sent)
    t = asyncio.create_task(client.generate(gen("f", session="s2")))
    await until(lambda: len(idle.sent) == n_idle + 1)
    idle.answer(idle.sent[-1], version=1)
    busy.answer(busy.sent[-1], version=1)
    await asyncio.gather(t, long)


@pytest.mark.asyncio
async def test_lost_worker_requests_are_resent_and_answered(setup):
    client, (d0, d1) = setup
    tasks = [asyncio.create_task(client.generate(gen(f"q{i}", session=f"s{i}"))) for i in range(6)]
    await until(lambda: len(d0.sent) + len(d1.sent) == 6)
    assert len(d0.sent) == 3 and len(d1.sent) == 3
    stranded = list(d1.sent)
    await client.worker_lost(1)
    await until(lambda: len(d0.sent) == 6)
    assert [r.qid for r in d0.sent[3:]] == [r.qid for r in stranded]  # same wire ids, now on worker 0
    for r in d0.sent:
        d0.answer(r)
    resps = await asyncio.gather(*tasks)
    assert [r.qid for r in resps] == [f"q{i}" for i in range(6)] and all(r.error is None for r in resps)
    assert client.stats["resent_lost"] == 3 and client.alive == [0]
    # a late answer from the lost worker is dropped; new requests (and its sessions) avoid it
    d1.answer(stranded[0])
    await until(lambda: client.stats["late"] == 1)
    t = asyncio.create_task(client.generate(gen("x", session="s1")))
    await until(lambda: len(d0.sent) == 7)
    d0.answer(d0.sent[-1])
    assert (await t).error is None and len(d1.sent) == 3
    await client.worker_lost(1)  # idempotent
    await client.worker_lost(0)
    r = await client.generate(gen("y"))  # none left: it waits one request deadline for one to come back
    assert r.error == "no inference worker left (none came back in 5s)"
    assert client.stats["waited_for_worker"] == 1 and len(d0.sent) == 7


@pytest.mark.asyncio
async def test_a_request_made_while_every_worker_is_lost_waits_for_one_to_come_back():
    """The only inference server was lost and is restarting: new requests wait for it (`worker_back`) instead of
    failing at once (every group of the run would be dropped while it restarts)."""
    d0 = FakeDealer(0)
    client = InferenceClient([d0], request_timeout=30.0)
    client.start()
    try:
        await client.worker_lost(0)
        t = asyncio.create_task(client.generate(gen("q", session="s")))
        await until(lambda: client.stats["waited_for_worker"] == 1)
        assert not t.done() and d0.sent == []
        back = FakeDealer(0)
        client.worker_back(0, back)
        await until(lambda: len(back.sent) == 1)
        back.answer(back.sent[0])
        r = await t
        assert r.error is None and r.qid == "q"
    finally:
        await client.close()


@pytest.mark.asyncio
async def test_timed_out_request_is_resent_to_another_worker():
    d0, d1 = FakeDealer(0), FakeDealer(1)
    client = InferenceClient([d0, d1], request_timeout=0.2, max_attempts=2)
    client.start()
    t = asyncio.create_task(client.generate(gen("slow")))
    await until(lambda: len(d0.sent) == 1)
    await until(lambda: len(d1.sent) == 1)  # no answer from 0 within the timeout: re-sent to 1 ...
    assert d0.aborted == [d0.sent[0].qid] and d1.aborted == []  # ... and aborted on 0: no double work
    d1.answer(d1.sent[0])
    r = await t
    assert r.error is None and client.stats["resent_timeout"] == 1 and client.stats["aborted_resent"] == 1
    # out of attempts: the caller gets an error, never a hang; the last attempt is aborted too
    t = asyncio.create_task(client.generate(gen("lost")))
    r = await t
    assert r.error is not None and "no response" in r.error and client.stats["timeout"] == 1
    wire = d1.sent[1].qid if len(d1.sent) > 1 else d0.sent[1].qid
    await until(lambda: client.stats["aborted_abandoned"] == 1)
    assert wire in d0.aborted + d1.aborted and client.stats["aborted_resent"] == 2
    await client.close()


@pytest.mark.asyncio
async def test_deadline_grows_with_the_generation_budget():
    d0, d1 = FakeDealer(0), FakeDealer(1)
    client = InferenceClient([d0, d1], request_timeout=0.05, timeout_per_token=0.001, max_attempts=2)
    assert client.deadline(gen("a", max_new=10)) == pytest.approx(0.06)
    assert client.deadline(gen("b", max_new=100_000)) == pytest.approx(100.05)
    client.start()
    long = asyncio.create_task(client.generate(gen("long", max_new=100_000)))
    await until(lambda: len(d0.sent) == 1)
    short = asyncio.create_task(client.generate(gen("short", max_new=10)))  # d0 is busier: goes to d1
    await until(lambda: len(d1.sent) == 1)
    await until(lambda: len(d0.sent) == 2)  # the short one timed out on 1 and went to 0; the long one waits on
    assert client.stats["resent_timeout"] == 1 and d1.aborted == [d1.sent[0].qid] and not long.done()
    d0.answer(d0.sent[1])
    d0.answer(d0.sent[0])
    assert (await short).error is None and (await long).error is None
    await client.close()


@pytest.mark.asyncio
async def test_a_cancelled_request_is_aborted_on_its_worker():
    d0, d1 = FakeDealer(0), FakeDealer(1)
    client = InferenceClient([d0, d1], request_timeout=30.0)
    client.start()
    t = asyncio.create_task(client.generate(gen("x")))  # say its trajectory hit the trajectory timeout
    await until(lambda: len(d0.sent) == 1)
    t.cancel()
    await until(lambda: d0.aborted == [d0.sent[0].qid])
    assert client.stats["aborted_abandoned"] == 1
    # an answered request is not aborted
    t = asyncio.create_task(client.generate(gen("y")))
    await until(lambda: len(d0.sent) + len(d1.sent) == 2)
    (d0 if len(d0.sent) == 2 else d1).answer((d0.sent + d1.sent)[-1])
    assert (await t).error is None
    await asyncio.sleep(0)
    assert client.stats["aborted_abandoned"] == 1 and len(d0.aborted + d1.aborted) == 1
    await client.close()


@pytest.mark.asyncio
async def test_a_resent_request_is_aborted_when_the_first_attempt_answers_first():
    d0, d1 = FakeDealer(0), FakeDealer(1)
    client = InferenceClient([d0, d1], request_timeout=0.2, max_attempts=2)
    client.start()
    t = asyncio.create_task(client.generate(gen("slow")))
    await until(lambda: len(d1.sent) == 1)  # timed out on 0, re-sent to 1 (and aborted on 0, too late)
    d0.answer(d0.sent[0])  # ... 0 had finished it anyway: its answer comes first
    r = await t
    assert r.error is None
    await until(lambda: d1.aborted == [d1.sent[0].qid])  # the re-sent attempt stops: no double work
    assert client.stats["aborted_superseded"] == 1 and client.stats["aborted_abandoned"] == 0
    d1.answer(d1.sent[0])
    await until(lambda: client.stats["late"] == 1)
    await client.close()


def test_deadlines_still_expire_after_the_client_moves_to_another_event_loop():
    """Deadlines are checked by one sweep timer per client: a sweep left scheduled on an event loop that closed
    must not leave the next loop's requests without a deadline (they would wait forever)."""
    d0 = FakeDealer(0)
    client = InferenceClient([d0], request_timeout=0.05, max_attempts=1)

    async def first_loop() -> None:
        client.start()
        asyncio.get_running_loop().create_task(client.generate(gen("x")))  # cancelled when this loop ends
        await until(lambda: len(d0.sent) == 1)

    async def second_loop() -> GenerateResponse:
        d0._inbox = asyncio.Queue()
        client.start()
        try:
            return await asyncio.wait_for(client.generate(gen("y")), 10)
        finally:
            await client.close()

    asyncio.run(first_loop())
    resp = asyncio.run(second_loop())
    assert resp.error is not None and "no response" in resp.error and client.stats["timeout"] == 1


@pytest.mark.asyncio
async def test_a_named_policys_versions_are_not_the_runs(setup):
    """A trained listed policy counts versions of its own: its answers never move the client's version (the run's
    policy's, which resets sticky sessions)."""
    client, (d0, d1) = setup
    req = gen("r", session="s1")
    req.policy = "rival"
    t = asyncio.create_task(client.generate(req))
    await until(lambda: len(d0.sent) + len(d1.sent) == 1)
    (d0 if d0.sent else d1).answer((d0.sent or d1.sent)[0], version=7)
    await t
    assert client.version == -1 and client.stats["sticky_resets"] == 0


@pytest.mark.asyncio
async def test_a_placed_policy_goes_only_to_its_servers():
    """`policies.<name>.servers`: a request of a placed policy goes only to its servers, even when another is idle
    or its session was sticky elsewhere; the run's own requests still go anywhere."""
    dealers = [FakeDealer(0), FakeDealer(1)]
    client = InferenceClient(dealers, request_timeout=5.0, placement={"rival": [1]})
    client.start()
    try:
        busy = asyncio.create_task(client.generate(gen("busy", max_new=1000)))  # d0 (both idle: the first)
        await until(lambda: len(dealers[0].sent) == 1)
        slow = asyncio.create_task(client.generate(gen("slow", max_new=2000)))  # to d1: d0 is busy
        await until(lambda: len(dealers[1].sent) == 1)
        for n, qid in enumerate(("r1", "r2"), 2):
            req = gen(qid, session="s")
            req.policy = "rival"
            t = asyncio.create_task(client.generate(req))
            await until(lambda: len(dealers[0].sent) + len(dealers[1].sent) == n + 1)
            assert dealers[1].sent[-1].policy == "rival"
            dealers[1].answer(dealers[1].sent[-1])
            await t
        assert len(dealers[0].sent) == 1 and len(dealers[1].sent) == 3  # d1 though d0 was less loaded
        dealers[0].answer(dealers[0].sent[0])
        dealers[1].answer(dealers[1].sent[0])
        await asyncio.gather(busy, slow)
    finally:
        await client.close()
