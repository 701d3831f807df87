import asyncio
import logging
import os
import re

import msgpack
import numpy as np
import pytest
import zmq

from arl.api.types import GenerateRequest, GenerateResponse, GenerationConfig, SampleOutput, Trajectory
from arl.transport import codec
from arl.transport.sockets import Dealer, Pull, Push, Router, SocketClosed, bind_random, context

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

T = 5.0  # per-recv timeout: a hang fails fast instead of eating the suite's budget


def _traj(n: int, gid: str) -> Trajectory:
    return Trajectory(np.arange(n), np.ones(n, np.int8), np.full(n, -0.25), np.full(n, 2), 1.0, gid,
                      metadata={"turns": 1})


async def _serve_echo(router: Router, n: int) -> None:
    """Answer n gen_req with one sample that echoes the prompt."""
    for _ in range(n):
        ident, msg_type, req = await router.recv(timeout=T)
        assert msg_type == "gen_req"
        k = len(req.input_ids)
        sample = SampleOutput(req.input_ids[::-1], np.full(k, -1.0), np.full(k, 7), "stop")
        await router.send(ident, "gen_resp", GenerateResponse(req.qid, [sample] * req.gconfig.n))


async def test_bind_random_loopback():
    r = Router()
    try:
        addr = bind_random(r)
        assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", addr)
        assert r.addresses == [addr]
    finally:
        r.close()


async def test_dealer_router_request_response():
    router, dealer = Router(), Dealer(identity=b"rollout-0")
    try:
        dealer.connect(router.bind_random())
        server = asyncio.create_task(_serve_echo(router, 20))
        for i in range(20):
            req = GenerateRequest(f"q{i}", np.arange(i), GenerationConfig(n=1 + i % 3))
            await dealer.send("gen_req", req)
            msg_type, resp = await dealer.recv(timeout=T)
            assert msg_type == "gen_resp" and resp.qid == f"q{i}" and len(resp.samples) == 1 + i % 3
            np.testing.assert_array_equal(resp.samples[0].output_ids, np.arange(i)[::-1])
            assert resp.samples[0].output_versions.dtype == np.int32
        await server
        # control messages, and the identity the Router saw
        await dealer.send("heartbeat", {"role": "rollout", "index": 0})
        ident, msg_type, payload = await router.recv(timeout=T)
        assert (ident, msg_type, payload) == (b"rollout-0", "heartbeat", {"role": "rollout", "index": 0})
        await router.send(ident, "ack", None)
        assert await dealer.recv(timeout=T) == ("ack", {})
        assert dealer.stats == {"received": 21, "sent": 21, "malformed": 0}
        assert router.stats == {"received": 21, "sent": 21, "malformed": 0, "dropped": 0}
    finally:
        router.close()
        dealer.close()


async def test_pipelined_requests_many_dealers():
    router = Router()
    dealers = [Dealer() for _ in range(3)]
    try:
        addr = router.bind_random()
        for d in dealers:
            d.connect(addr)
        server = asyncio.create_task(_serve_echo(router, 3 * 50))

        async def client(d: Dealer, c: int) -> None:
            for i in range(50):
                await d.send("gen_req", GenerateRequest(f"{c}-{i}", [c, i], GenerationConfig()))
            got = [(await d.recv(timeout=T))[1].qid for _ in range(50)]
            assert got == [f"{c}-{i}" for i in range(50)]

        await asyncio.gather(*(client(d, c) for c, d in enumerate(dealers)))
        await server
    finally:
        router.close()
        for d in dealers:
            d.close()


async def test_push_pull():
    pull = Pull()
    pushes = [Push(), Push()]
    try:
        addr = pull.bind_random()
        for p in pushes:
            p.connect(addr)
        for k, p in enumerate(pushes):
            for g in range(3):
                await p.send("traj", [_traj(5 + g, f"p{k}g{g}"), _traj(0, f"p{k}g{g}")])
        seen = set()
        for _ in range(6):
            msg_type, group = await pull.recv(timeout=T)
            assert msg_type == "traj" and len(group) == 2 and isinstance(group[0], Trajectory)
            assert group[0].group_id == group[1].group_id and group[0].metadata == {"turns": 1}
            seen.add(group[0].group_id)
        assert len(seen) == 6 and pull.stats["received"] == 6
    finally:
        pull.close()
        for p in pushes:
            p.close()


async def test_router_survives_garbage(caplog):
    router = Router(max_bytes=4096)
    raw = context().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    dealer = Dealer()
    try:
        addr = router.bind_random()
        raw.connect(addr)
        dealer.connect(addr)
        good = codec.encode("gen_req", GenerateRequest("good", [1, 2, 3], GenerationConfig()))
        garbage = [
            [os.urandom(64)],  # random bytes
            [good[:-7]],  # truncated msgpack
            [msgpack.packb({"type": "ack", "v": codec.PROTOCOL_VERSION + 1, "payload": {}})],  # wrong version
            [msgpack.packb({"type": "rm -rf", "v": codec.PROTOCOL_VERSION, "payload": {}})],  # unknown type
            [codec.encode("heartbeat", {"pad": "x" * 5000})],  # over the Router's max_bytes
            [good, b"b"],  # a batch [identity, good, b] with a bad frame: dropped whole, both frames counted
            [b""],  # empty frame
        ]
        with caplog.at_level(logging.WARNING, logger="arl.transport"):
            for parts in garbage:
                await raw.send_multipart(parts)
            await raw.send(good)  # same pipe, so it arrives after all the garbage
            ident, msg_type, req = await router.recv(timeout=T)
        assert msg_type == "gen_req" and req.qid == "good"
        assert router.stats["malformed"] == len(garbage) + 1 and router.stats["received"] == 1
        warnings = [r for r in caplog.records if r.name == "arl.transport"]
        assert 1 <= len(warnings) < len(garbage)  # logged, but rate-limited

        # a raw peer can still be answered, and a well-behaved Dealer too
        await router.send(ident, "ack", {"ok": True})
        assert codec.decode(await asyncio.wait_for(raw.recv(), T)) == ("ack", {"ok": True})
        server = asyncio.create_task(_serve_echo(router, 1))
        await dealer.send("gen_req", GenerateRequest("after", [4, 5], GenerationConfig()))
        msg_type, resp = await dealer.recv(timeout=T)
        assert msg_type == "gen_resp" and resp.qid == "after"
        await server
    finally:
        raw.close(linger=0)
        router.close()
        dealer.close()


def _raw_router_and_dealer() -> tuple[zmq.Socket, Dealer]:
    """A plain zmq ROUTER (to see and send exact multipart messages) and one of our Dealers connected to it."""
    raw = context().socket(zmq.ROUTER)
    raw.setsockopt(zmq.LINGER, 0)
    dealer = Dealer(identity=b"d1")
    dealer.connect(f"tcp://127.0.0.1:{raw.bind_to_random_port('tcp://127.0.0.1')}")
    return raw, dealer


async def test_dealer_drops_garbage_and_any_batch_with_a_bad_frame():
    raw, dealer = _raw_router_and_dealer()
    try:
        await dealer.send("register", {"role": "x"})
        ident, frame = await asyncio.wait_for(raw.recv_multipart(), T)
        assert ident == b"d1" and codec.decode(frame) == ("register", {"role": "x"})
        await raw.send_multipart([ident, b"junk"])
        await raw.send_multipart([ident, codec.encode("ack"), b"bad frame", codec.encode("ack", {"n": 2})])
        await raw.send_multipart([ident, codec.encode("ack", {"n": 1}), codec.encode("ack", {"n": 3})])
        assert await dealer.recv(timeout=T) == ("ack", {"n": 1})
        assert await dealer.recv(timeout=T) == ("ack", {"n": 3})
        assert dealer.stats["malformed"] == 4 and dealer.stats["received"] == 2
    finally:
        raw.close(linger=0)
        dealer.close()


async def test_hmac_over_sockets():
    router = Router(secret=b"k1")
    good, bad = Dealer(secret=b"k1"), Dealer(secret=b"k2")
    try:
        addr = router.bind_random()
        good.connect(addr)
        bad.connect(addr)
        await bad.send("heartbeat", {"who": "bad"})
        await asyncio.sleep(0.05)
        await good.send("heartbeat", {"who": "good"})
        ident, msg_type, payload = await router.recv(timeout=T)
        assert payload == {"who": "good"}
        await router.send(ident, "ack", {})
        assert await good.recv(timeout=T) == ("ack", {})
        for _ in range(100):  # the forged one may be fair-queued after the good one
            if router.stats["malformed"]:
                break
            with pytest.raises(asyncio.TimeoutError):
                await router.recv(timeout=0.01)
        assert router.stats["malformed"] == 1
    finally:
        router.close()
        good.close()
        bad.close()


async def test_recv_timeout_and_close():
    router = Router()
    pull = Pull()
    try:
        router.bind_random()
        pull.bind_random()
        with pytest.raises(asyncio.TimeoutError):
            await router.recv(timeout=0.05)
        # a recv that is waiting when its socket is closed ends with SocketClosed, not a hang
        waiter = asyncio.create_task(pull.recv())
        await asyncio.sleep(0.02)
        pull.close()
        with pytest.raises(SocketClosed):
            await asyncio.wait_for(waiter, T)
        with pytest.raises(SocketClosed):
            await pull.recv()
        pull.close()  # idempotent
    finally:
        router.close()
        pull.close()


async def test_router_reply_to_unknown_peer_is_dropped_not_raised():
    router = Router()
    try:
        router.bind_random()
        await router.send(b"nobody", "ack", {})
        await asyncio.sleep(0)  # the batch is flushed at the end of the loop iteration
        assert router.stats["dropped"] == 1 and router.stats["sent"] == 0
    finally:
        router.close()


async def test_send_rejects_oversize_and_bad_objects():
    push = Push(max_bytes=1024)
    try:
        push.bind_random()
        with pytest.raises(ValueError, match="max_bytes"):
            await push.send("traj", [_traj(1000, "g")])
        with pytest.raises(TypeError):
            await push.send("traj", _traj(3, "g"))
        assert push.stats["sent"] == 0
    finally:
        push.close()


async def test_concurrent_handlers_and_readers():
    """The way roles use it: a Router recv loop spawning handler tasks that reply out of order, and Dealers with a
    reader task while many coroutines send (exercises the fast paths next to pending async recvs)."""
    router = Router()
    dealers = [Dealer() for _ in range(3)]
    n_per = 150
    try:
        addr = router.bind_random()

        async def handle(ident: bytes, req: GenerateRequest) -> None:
            if int(req.qid.split("-")[1]) % 3 == 0:
                await asyncio.sleep(0.001)
            await router.send(ident, "gen_resp", GenerateResponse(req.qid, [SampleOutput([1], [0.0], [0], "stop")]))

        async def serve() -> None:
            tasks = set()
            while True:
                ident, _, req = await router.recv()
                t = asyncio.create_task(handle(ident, req))
                tasks.add(t)
                t.add_done_callback(tasks.discard)

        server = asyncio.create_task(serve())

        async def client(c: int, d: Dealer) -> None:
            d.connect(addr)
            loop = asyncio.get_running_loop()
            pending: dict[str, asyncio.Future] = {}

            async def reader() -> None:
                while True:
                    _, resp = await d.recv()
                    pending.pop(resp.qid).set_result(resp)

            rt = asyncio.create_task(reader())

            async def one(i: int) -> None:
                qid = f"{c}-{i}"
                fut = pending[qid] = loop.create_future()
                await d.send("gen_req", GenerateRequest(qid, [i], GenerationConfig()))
                assert (await asyncio.wait_for(fut, T)).qid == qid

            await asyncio.gather(*(one(i) for i in range(n_per)))
            rt.cancel()

        await asyncio.gather(*(client(c, d) for c, d in enumerate(dealers)))
        assert router.stats["received"] == router.stats["sent"] == 3 * n_per
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
    finally:
        router.close()
        for d in dealers:
            d.close()


async def test_blocked_send_ends_on_close():
    push = Push(hwm=1)
    push.bind_random()  # no puller: a send waits (backpressure) until one connects
    await push.send("heartbeat", {})  # queued in the socket's batch, which finds no room when flushed
    sender = asyncio.create_task(push.send("heartbeat", {}))
    await asyncio.sleep(0.02)
    assert not sender.done()
    push.close()
    with pytest.raises(SocketClosed):
        await asyncio.wait_for(sender, T)
    with pytest.raises(SocketClosed):
        await push.send("heartbeat", {})


async def test_sends_of_one_iteration_go_as_one_message_of_at_most_max_batch_frames():
    from arl.transport.sockets import _MAX_BATCH

    raw, dealer = _raw_router_and_dealer()
    try:
        n = 2 * _MAX_BATCH + 3
        for i in range(n):  # no await suspends here: all in one event-loop iteration
            await dealer.send("heartbeat", {"i": i})
        sizes, got = [], []
        while len(got) < n:
            ident, *frames = await asyncio.wait_for(raw.recv_multipart(), T)
            assert ident == b"d1"
            sizes.append(len(frames))
            got += [codec.decode(f)[1]["i"] for f in frames]
        assert sizes == [_MAX_BATCH, _MAX_BATCH, 3] and got == list(range(n))
        assert dealer.stats["sent"] == n
    finally:
        raw.close(linger=0)
        dealer.close()


async def test_router_batches_replies_per_peer_and_counts_each_message():
    router, a, b = Router(), Dealer(identity=b"a"), Dealer(identity=b"b")
    try:
        addr = router.bind_random()
        for d in (a, b):
            d.connect(addr)
            await d.send("register", {})
            await router.recv(timeout=T)
        for i in range(5):  # interleaved, one iteration: one message to each peer
            await router.send(b"a" if i % 2 else b"b", "ack", {"i": i})
        await router.send(b"gone", "ack", {"i": -1})
        got_b = [(await b.recv(timeout=T))[1]["i"] for _ in range(3)]
        got_a = [(await a.recv(timeout=T))[1]["i"] for _ in range(2)]
        assert got_b == [0, 2, 4] and got_a == [1, 3]
        assert router.stats["sent"] == 5 and router.stats["dropped"] == 1
        assert a.stats["received"] == 2 and b.stats["received"] == 3
    finally:
        for s in (router, a, b):
            s.close()


async def test_send_nowait_from_a_callback_and_flush_hands_the_batch_to_zmq_at_once():
    """Dealer/Router.send_nowait (env servers' batches, sent from callbacks): no coroutine; `flush=True` sends the
    queue now (with what was queued before it, in order) instead of at the end of the iteration."""
    router, dealer = Router(), Dealer(identity=b"d")
    try:
        dealer.connect(router.bind_random())
        dealer.send_nowait("heartbeat", {"i": 0})
        assert dealer.stats["sent"] == 0  # queued until the iteration ends
        dealer.send_nowait("heartbeat", {"i": 1}, flush=True)
        assert dealer.stats["sent"] == 2  # both, now
        got = [(await router.recv(timeout=T))[2]["i"] for _ in range(2)]
        assert got == [0, 1]
        router.send_nowait(b"d", "ack", {"i": 2}, flush=True)
        assert router.stats["sent"] == 1
        assert (await dealer.recv(timeout=T))[1]["i"] == 2
    finally:
        router.close()
        dealer.close()


async def test_a_batch_too_big_for_the_peer_queue_waits_and_keeps_order():
    """Backpressure with batching: a flush that finds the peer's queue full keeps the batch, later sends wait,
    and everything arrives once, in order, when the reader catches up."""
    push, pull = Push(hwm=1), Pull(hwm=1)
    try:
        pull.connect(push.bind_random())
        n = 200
        sender = asyncio.create_task(_send_all(push, n))
        got = []
        while len(got) < n:
            msg_type, payload = await pull.recv(timeout=T)
            got.append(payload["i"])
            if len(got) % 50 == 0:
                await asyncio.sleep(0.01)  # a slow reader: the sender must wait, not drop or reorder
        await asyncio.wait_for(sender, T)
        assert got == list(range(n)) and push.stats["sent"] == n
    finally:
        push.close()
        pull.close()


async def _send_all(sock: Push, n: int) -> None:
    for i in range(n):
        await sock.send("heartbeat", {"i": i})
        if i % 7 == 0:
            await asyncio.sleep(0)

