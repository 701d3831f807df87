"""The shared routing view: reports (deltas, gaps, restarts), the score (cache vs load), sticky sessions that yield,
groups kept together, and the InferenceClient routing by it over its dealers."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from arl.api.types import GenerateRequest, GenerationConfig
from arl.rollout.client import InferenceClient
from arl.rollout.routing import RoutingView
from arl.utils.prefix_hash import prefix_hashes
from tests.rollout.test_client import FakeDealer, until


def report(i: int, *, add=(), drop=(), seq=1, epoch=7, reqs=0, full=False, block=4) -> dict:
    return {"i": i, "epoch": epoch, "seq": seq, "full": full, "reqs": reqs, "work": 0, "block": block, "cache": True,
            "add": np.asarray(list(add), np.uint64).tobytes(), "drop": np.asarray(list(drop), np.uint64).tobytes()}


PROMPT = np.arange(64, dtype=np.int32)  # 16 blocks of 4
H = prefix_hashes(PROMPT, 4)


def test_reports_apply_in_sequence_and_a_gap_asks_for_the_summary():
    v = RoutingView(2, block_tokens=4)
    assert v.report(0, report(0, add=H[:8], full=True, seq=5), own_requests=0)
    assert v.cached_blocks(0) == 8
    assert v.report(0, report(0, add=H[8:10], drop=H[6:8], seq=6), own_requests=0)
    assert v.cached_blocks(0) == 8
    assert not v.report(0, report(0, add=H[10:], seq=8), own_requests=0)  # seq 7 was missed
    assert not v.report(0, report(0, seq=7, epoch=8), own_requests=0)  # a restarted server: a new epoch
    assert v.report(0, report(0, add=H, full=True, seq=1, epoch=8), own_requests=0) and v.cached_blocks(0) == 16
    assert v.report(1, report(0), own_requests=0) and v.stats["route_bad_reports"] == 1  # names another server
    assert v.report(1, report(1, block=16, full=True), own_requests=0) and v.stats["route_bad_reports"] == 2
    assert v.report(1, {"i": 1, "block": 4}, own_requests=0) and v.stats["route_bad_reports"] == 3


def test_score_weighs_cached_prefill_against_load():
    v = RoutingView(3, block_tokens=4, load_weight=10.0, sticky_slack=2)
    v.report(1, report(1, add=H[:10], full=True, reqs=3), own_requests=0)  # 40 tokens cached, 3 requests there
    own = [0, 0, 0]
    assert v.choose(H, [0, 1, 2], own)[0] == 1  # 40 - 10 * 3 > 0
    v.report(1, report(1, seq=2, reqs=5), own_requests=0)  # now 50 more in load than saved: balance wins
    assert v.choose(H, [0, 1, 2], own)[0] in (0, 2)
    assert v.choose(H, [0, 2], own)[0] in (0, 2)  # a server not live is never chosen
    # the session's server keeps it while within the slack of the least loaded
    assert v.choose(H, [0, 1, 2], [1, 0, 0], sticky=0) == (0, -1)
    assert v.choose(H, [0, 1, 2], [2, 0, 0], sticky=0)[0] == 2  # 2 more than the least: the score decides


def test_requests_just_sent_count_as_cached_there():
    """The chats of a group start at once with one prompt: they follow the first to its server."""
    v = RoutingView(4, block_tokens=4, load_weight=1.0)
    own = [0, 0, 0, 0]
    first, known = v.choose(H, [0, 1, 2, 3], own)
    v.routed(first, H, known)
    own[first] += 1
    for _ in range(5):
        idx, known = v.choose(H, [0, 1, 2, 3], own)
        assert idx == first
        v.routed(idx, H, known)
        own[idx] += 1


@pytest.mark.asyncio
async def test_client_subscribes_and_routes_by_the_view():
    dealers = [FakeDealer(i) for i in range(3)]
    sent: list[tuple[int, str, dict]] = []
    for d in dealers:
        orig = d.send

        async def send(msg_type, payload, d=d, orig=orig):
            if msg_type == "route_sub":
                sent.append((d.index, msg_type, payload))
                return
            await orig(msg_type, payload)
        d.send = send
    view = RoutingView(3, block_tokens=4, load_weight=1.0)
    client = InferenceClient(dealers, request_timeout=5.0, view=view)
    client.start()
    try:
        await until(lambda: len(sent) == 3)
        assert {s[0] for s in sent} == {0, 1, 2} and all(s[2] == {"block": 4, "full": True} for s in sent)
        dealers[2]._inbox.put_nowait(("route_stats", report(2, add=H, full=True, reqs=4)))  # all cached on 2
        await until(lambda: view.cached_blocks(2) == 16)
        req = GenerateRequest(qid="a", input_ids=PROMPT, gconfig=GenerationConfig(max_new_tokens=4))
        task = asyncio.create_task(client.generate(req))
        await until(lambda: dealers[2].sent)
        dealers[2].answer(dealers[2].sent[0])
        assert (await task).samples and client.stats["route_cache_choice"] == 1
        dealers[2]._inbox.put_nowait(("route_stats", report(2, seq=3)))  # seq 2 missed: the summary again
        await until(lambda: len(sent) == 4)
        assert sent[-1] == (2, "route_sub", {"block": 4, "full": True})
        await client.worker_lost(2)
        assert view.cached_blocks(2) == 0
    finally:
        await client.close()
