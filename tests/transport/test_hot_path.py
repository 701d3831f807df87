"""Cost guard for the request path (issue 24: the transport got ~20% slower per round trip as small conveniences
piled up on it, unseen because wall-clock figures on a shared machine are noise).

Counts Python function calls per round trip through the real path in one process, 8 requests in flight:
InferenceClient -> Dealer -> Router -> InferenceWorker -> engine and back. Call counts are deterministic (no wall
clock: the test fails when the path gains work, not when the machine is busy). Measured with Python 3.11 and
pyzmq 27: 8c8151e 141 calls (67 in arl), f605d73 155 (79), after issue 24 105 (61). A budget that fails here
asks for a look at what the path gained (scripts/bench_transport.py, docs/benchmarks.md), not a bigger budget.
"""

from __future__ import annotations

import asyncio
import collections
import os
import sys

import numpy as np
import pytest

import arl
from arl.api.types import GenerateRequest, GenerateResponse, GenerationConfig, SampleOutput
from arl.inference.worker import InferenceWorker
from arl.rollout.client import InferenceClient
from arl.transport.sockets import Dealer, Router

from ..typed_control import typed

ARL_DIR = os.path.dirname(arl.__file__)
IN_FLIGHT, ROUND_TRIPS = 8, 100  # round trips per chain


class NullEngine:
    version = 0

    async def agenerate(self, req: GenerateRequest) -> GenerateResponse:
        n = req.gconfig.max_new_tokens
        return GenerateResponse(qid=req.qid, samples=[SampleOutput(np.zeros(n, np.int32), np.zeros(n, np.float32),
                                                                   np.zeros(n, np.int32), finish_reason="length")])


async def calls_per_round_trip() -> collections.Counter:
    router = Router()
    address = router.bind_random()

    async def no_control(msg_type: str, payload: dict) -> None:
        return None

    worker = InferenceWorker(index=0, engine=NullEngine(), router=router, send_control=typed(no_control))
    serving = asyncio.create_task(worker.serve())
    client = InferenceClient([Dealer().connect(address)], request_timeout=30.0)
    client.start()
    req = GenerateRequest(qid="q", input_ids=np.arange(16, dtype=np.int32),
                          gconfig=GenerationConfig(max_new_tokens=16))
    counts: collections.Counter = collections.Counter()

    def profile(frame, event, arg) -> None:
        if event == "call":
            counts["all"] += 1
            if frame.f_code.co_filename.startswith(ARL_DIR):
                counts["arl"] += 1

    async def chain() -> None:
        for _ in range(ROUND_TRIPS):
            resp = await client.generate(req)
            assert resp.error is None

    try:
        await asyncio.wait_for(client.generate(req), 30)  # connected, everything warm
        sys.setprofile(profile)
        try:
            await asyncio.wait_for(asyncio.gather(*(chain() for _ in range(IN_FLIGHT))), 120)
        finally:
            sys.setprofile(None)
    finally:
        serving.cancel()
        await client.close()
        router.close()
        await asyncio.gather(serving, return_exceptions=True)
    return collections.Counter({k: v / (IN_FLIGHT * ROUND_TRIPS) for k, v in counts.items()})


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="budgets measured on Python 3.11's asyncio")
@pytest.mark.asyncio
async def test_python_calls_per_round_trip_within_budget():
    per_rt = await calls_per_round_trip()
    assert per_rt["arl"] <= 66, f"arl calls per round trip: {per_rt['arl']:.1f} (was 61; 8c8151e: 67)"
    assert per_rt["all"] <= 125, f"Python calls per round trip: {per_rt['all']:.1f} (was 105; 8c8151e: 141)"
