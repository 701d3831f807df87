"""A server's routing reports: subscriptions, deltas of its served prefixes, flushes, load, refusals."""

from __future__ import annotations

import numpy as np

from arl.api.types import GenerateRequest, GenerateResponse, GenerationConfig, SampleOutput
from arl.inference.routing_feed import SUBSCRIPTION_S, RoutingFeed
from arl.utils.prefix_hash import as_hashes, prefix_hashes


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def feed(cache_tokens: int = 1024) -> tuple[RoutingFeed, list, Clock]:
    sent: list = []
    clock = Clock()
    f = RoutingFeed(index=3, send=lambda ids, t, p: sent.extend((i, t, p) for i in ids), block_tokens=4,
                    cache_tokens=cache_tokens, clock=clock)
    return f, sent, clock


def req(ids) -> GenerateRequest:
    return GenerateRequest(qid="q", input_ids=np.array(ids), gconfig=GenerationConfig(max_new_tokens=8))


def answer(ids) -> GenerateResponse:
    n = len(ids)
    return GenerateResponse(qid="q", samples=[SampleOutput(output_ids=np.array(ids), output_logprobs=np.zeros(n),
                                                            output_versions=np.zeros(n), finish_reason="stop")])


def test_subscriber_gets_the_summary_then_deltas_with_load():
    f, sent, clock = feed()
    r = req(range(8))
    epoch = f.request_started(r)  # cached from its arrival: 2 blocks
    f.subscribe(b"w1", {"block": 4})
    (ident, t, full), = sent
    assert ident == b"w1" and t == "route_stats" and full["full"] and full["i"] == 3 and full["reqs"] == 1
    assert sorted(as_hashes(full["add"]).tolist()) == sorted(prefix_hashes(range(8), 4).tolist())
    f.request_done(r, answer([9, 9, 9, 9]), epoch)  # its sequence (prompt + answer) now: one block more
    f._publish()
    delta = sent[-1][2]
    assert not delta["full"] and delta["seq"] == full["seq"] + 1 and delta["reqs"] == 0 and delta["work"] == 0
    assert as_hashes(delta["add"]).tolist() == [prefix_hashes(list(range(8)) + [9] * 4, 4)[-1]]
    n = len(sent)
    f._publish()  # nothing changed: no report (the sequence continues with the next one)
    assert len(sent) == n
    f.subscribe(b"w1", {"block": 4})  # a renewal: no summary again
    assert len(sent) == n
    f.subscribe(b"w1", {"block": 4, "full": True})  # a subscriber that missed one asks for it
    assert sent[-1][2]["full"] and len(as_hashes(sent[-1][2]["add"])) == 3


def test_new_weights_empty_the_summary_and_old_sequences_are_not_cached():
    f, sent, clock = feed()
    r = req(range(8))
    epoch = f.request_started(r)
    f.subscribe(b"w1", {"block": 4})
    f.weights_loaded()  # the engine flushed its cache: one empty summary, not every block dropped
    assert sent[-1][2]["full"] and sent[-1][2]["add"] == b"" and len(f.cache) == 0
    f.request_done(r, answer([1, 2, 3, 4]), epoch)  # computed partly under the old weights: not cached
    assert len(f.cache) == 0


def test_block_mismatch_is_refused_and_silent_subscribers_expire():
    f, sent, clock = feed()
    f.subscribe(b"w1", {"block": 16})
    assert not sent and f.stats["route_sub_refused"] == 1
    f.subscribe(b"w2", {"block": 4})
    f.request_started(req(range(4)))
    clock.t = SUBSCRIPTION_S + 1
    n = len(sent)
    f._publish()  # w2 never renewed: forgotten, nothing sent
    assert len(sent) == n and not f._subs


def test_load_only_without_a_cache():
    f, sent, _ = feed(cache_tokens=0)
    assert f.cache is None
    f.request_started(req(range(8)))
    f.subscribe(b"w", {"block": 4})
    assert sent[-1][2]["cache"] is False and sent[-1][2]["add"] == b"" and sent[-1][2]["reqs"] == 1
