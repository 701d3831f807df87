"""Replay protection: with a secret every frame carries a stamp (sender id, sequence number) under its HMAC, and a
receiving socket refuses and counts (`replayed`) an authentic frame it has seen before, sent again from any
connection, or an old one from a sender it never heard. Frames are captured off the wire here by a tap between
the sockets, as an eavesdropper on the network would."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import zmq

from arl.api.types import GenerateRequest, GenerationConfig, Trajectory
from arl.transport.codec import MalformedMessage, ReplayedMessage, decode, encode
from arl.transport.replay import ReplayGuard, Stamper
from arl.transport.sockets import Dealer, Pull, Push, Router

SECRET = b"replay-test-secret-0123456789abcdef"


async def grab(sock: zmq.Socket, timeout: float = 10.0) -> list[bytes]:
    """The next message on a plain zmq socket (the tap), letting the event loop run (our sockets flush there)."""
    for _ in range(int(timeout / 0.01)):
        if sock.poll(0):
            return sock.recv_multipart()
        await asyncio.sleep(0.01)
    raise AssertionError("nothing reached the tap")


def traj(gid: str) -> list[Trajectory]:
    return [Trajectory(input_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0, -1.0, -1.0], versions=[-1, 0, 0],
                       reward=1.0, group_id=gid)]


def test_a_frame_is_taken_once_per_receiver():
    stamper, guard = Stamper(), ReplayGuard()
    f1 = encode("traj", traj("a"), secret=SECRET, stamp=stamper())
    f2 = encode("traj", traj("b"), secret=SECRET, stamp=stamper())
    assert decode(f1, secret=SECRET, guard=guard)[1][0].group_id == "a"
    with pytest.raises(ReplayedMessage, match="seen already"):
        decode(f1, secret=SECRET, guard=guard)
    assert decode(f2, secret=SECRET, guard=guard)[1][0].group_id == "b"
    with pytest.raises(ReplayedMessage):  # an older frame after a newer one: a replay too
        decode(f1, secret=SECRET, guard=guard)
    assert decode(f1, secret=SECRET, guard=ReplayGuard())[0] == "traj"  # another receiver never saw it
    assert issubclass(ReplayedMessage, MalformedMessage)  # whoever drops malformed frames drops these too
    bad = bytearray(f2)
    bad[-40] ^= 1  # the stamp is under the tag: changing the sequence number breaks the HMAC
    with pytest.raises(MalformedMessage, match="HMAC"):
        decode(bytes(bad), secret=SECRET, guard=ReplayGuard())


def test_sequence_numbers_follow_the_clock_and_only_go_up(monkeypatch):
    now = [5_000_000_000_000_000]
    monkeypatch.setattr("arl.transport.replay.time.time_ns", lambda: now[0])
    s = Stamper(b"x" * 16)
    seqs = []
    for step in (0, 0, -10**12, 10**9, 2 * 10**12):  # an instant twice, the clock back, a little on, far on
        now[0] += step
        seqs.append(int.from_bytes(s()[16:], "little"))
    t0 = 5 * 10**12  # microseconds
    assert seqs == [t0, t0 + 1, t0 + 2, t0 + 3, t0 + 10**9 + 10**6]
    guard = ReplayGuard(window_s=600)
    old = Stamper(b"o" * 16)
    now[0] -= 601 * 10**9
    stale = old()
    now[0] += 601 * 10**9
    assert "unknown sender stamped 601s ago" in guard.check(stale)  # captured in an earlier incarnation
    assert guard.check(Stamper(b"n" * 16)()) is None


@pytest.mark.asyncio
async def test_a_captured_trajectory_replayed_to_the_pull_is_refused_and_counted():
    ctx = zmq.Context.instance()
    tap_in, tap_out, replayer = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)
    pull = Pull(secret=SECRET)
    push = Push(secret=SECRET)
    try:
        addr = pull.bind_random()
        tap = tap_in.bind_to_random_port("tcp://127.0.0.1")
        tap_out.connect(addr)
        replayer.connect(addr)
        push.connect(f"tcp://127.0.0.1:{tap}")
        await push.send("traj", traj("g0"))
        captured = await grab(tap_in)
        tap_out.send_multipart(captured)  # delivered
        typ, got = await pull.recv(timeout=10)
        assert got[0].group_id == "g0"
        for _ in range(3):
            replayer.send_multipart(captured)  # the eavesdropper sends it again, from its own connection
        await push.send("traj", traj("g1"))  # the sender's next frame still gets in
        tap_out.send_multipart(await grab(tap_in))
        typ, got = await pull.recv(timeout=10)
        assert got[0].group_id == "g1"
        with pytest.raises(asyncio.TimeoutError):  # replays from another connection may come after it: none gets in
            await pull.recv(timeout=1.0)
        assert pull.stats["replayed"] == 3 and pull.stats["malformed"] == 0 and pull.stats["received"] == 2
    finally:
        for s in (tap_in, tap_out, replayer):
            s.close(0)
        push.close()
        pull.close()


@pytest.mark.asyncio
async def test_a_captured_register_replayed_to_the_router_is_refused_and_counted():
    ctx = zmq.Context.instance()
    router = Router(secret=SECRET)
    tap_in = ctx.socket(zmq.ROUTER)
    tap_out, replayer = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    dealer = Dealer(secret=SECRET)
    try:
        addr = router.bind_random()
        tap = tap_in.bind_to_random_port("tcp://127.0.0.1")
        tap_out.connect(addr)
        replayer.connect(addr)
        dealer.connect(f"tcp://127.0.0.1:{tap}")
        await dealer.send("register", {"role": "rollout", "index": 0, "pid": 1})
        frames = (await grab(tap_in))[1:]  # without the tap's routing id
        tap_out.send_multipart(frames)
        ident, typ, payload = await router.recv(timeout=10)
        assert typ == "register" and payload["role"] == "rollout"
        replayer.send_multipart(frames)
        with pytest.raises(asyncio.TimeoutError):
            await router.recv(timeout=0.5)
        assert router.stats["replayed"] == 1 and router.stats["received"] == 1
        # an untouched request made by the run's own code (encode without a socket) is still served
        other = encode("gen_req", GenerateRequest("q", np.arange(3), GenerationConfig()), secret=SECRET)
        replayer.send(other)
        assert (await router.recv(timeout=10))[1] == "gen_req"
    finally:
        for s in (tap_in, tap_out, replayer):
            s.close(0)
        dealer.close()
        router.close()
