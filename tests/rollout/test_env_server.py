"""Env servers: an EnvServer and its clients over real sockets (loopback, with a secret): calls, the server's
timeout, what msgpack cannot carry, leases, a lost server, least-load spreading."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from arl.api import EnvironmentService
from arl.envs.math import MathEnv
from arl.rollout.env_server import EnvServer, EnvServerClient, EnvServerLost, RemoteEnv, RemoteEnvError
from arl.transport.sockets import Dealer, Router

SECRET = b"s" * 32


class SlowEnv(EnvironmentService):
    """step sleeps `delay` s (forever with None); info may carry something msgpack cannot."""

    def __init__(self, delay: float | None = 0.0, bad_info: bool = False) -> None:
        self.delay, self.bad_info, self.closed = delay, bad_info, False

    async def step(self, action):
        await asyncio.sleep(1e9 if self.delay is None else self.delay)
        return "obs", 1.0, True, False, {"arr": np.zeros(2)} if self.bad_info else {"n": 1}

    async def close(self):
        self.closed = True


def make_env(name: str, **args):
    return MathEnv() if name == "math" else SlowEnv(**args)


async def servers(n: int, call_timeout: float = 5.0, lease_s: float = 60.0):
    out, dealers = [], []
    for i in range(n):
        router = Router(secret=SECRET)
        address = router.bind_random("127.0.0.1")
        srv = EnvServer(index=i, router=router, make_env=make_env, call_timeout=call_timeout, lease_s=lease_s)
        srv.task = asyncio.create_task(srv.serve())
        out.append(srv)
        dealers.append(Dealer(secret=SECRET).connect(address))
    client = EnvServerClient(dealers, timeout=10.0)
    client.start()
    return out, client


async def stop(srvs, client):
    await client.close()
    for s in srvs:
        s.task.cancel()
        await s.close()
        s.router.close()


def test_a_remote_env_answers_as_the_env_in_process():
    async def go():
        srvs, client = await servers(1)
        env = RemoteEnv(client, "math")
        assert await env.reset(options={"answer": "19"}) == (None, {})
        assert (await env.step("19"))[:4] == (None, 1.0, True, False)
        assert (await env.step("3"))[1] == 0.0
        assert srvs[0].heartbeat_stats()["sessions"] == 1
        await env.close()
        assert srvs[0].heartbeat_stats()["sessions"] == 0
        await stop(srvs, client)
    asyncio.run(go())


def test_a_hanging_step_is_timed_out_at_the_server_and_its_session_closed():
    async def go():
        srvs, client = await servers(1, call_timeout=0.3)
        env = RemoteEnv(client, "slow", {"delay": None})
        await env.reset()
        with pytest.raises(RemoteEnvError) as e:
            await env.step("a")
        assert e.value.kind == "timeout" and "session was closed" in str(e.value)
        assert srvs[0].stats["timeouts"] == 1 and srvs[0].sessions == {}
        with pytest.raises(RemoteEnvError) as e:
            await env.step("a")  # its session is gone
        assert e.value.kind == "no_session"
        await stop(srvs, client)
    asyncio.run(go())


def test_what_msgpack_cannot_carry_is_refused_with_a_named_error():
    async def go():
        srvs, client = await servers(1)
        env = RemoteEnv(client, "slow", {"bad_info": True})
        await env.reset()
        with pytest.raises(RemoteEnvError) as e:
            await env.step("a")
        assert e.value.kind == "not_msgpack" and "ndarray" in str(e.value)
        assert srvs[0].stats["not_msgpack"] == 1
        await stop(srvs, client)
    asyncio.run(go())


def test_a_session_idle_past_its_lease_is_closed():
    async def go():
        srvs, client = await servers(1, lease_s=0.2)
        reaper = asyncio.create_task(srvs[0].reap(every=0.05))
        env = RemoteEnv(client, "slow")
        await env.reset()
        inner = next(iter(srvs[0].sessions.values())).env
        for _ in range(100):
            if not srvs[0].sessions and inner.closed:
                break
            await asyncio.sleep(0.05)
        assert srvs[0].sessions == {} and inner.closed and srvs[0].stats["lease_expired"] == 1
        reaper.cancel()
        await stop(srvs, client)
    asyncio.run(go())


def test_sessions_spread_by_least_load_and_a_lost_servers_calls_fail_at_once():
    async def go():
        srvs, client = await servers(2)
        envs = [RemoteEnv(client, "slow", {"delay": None}) for _ in range(4)]
        for e in envs:
            await e.reset()
        assert sorted(e.server for e in envs) == [0, 0, 1, 1]
        assert [len(s.sessions) for s in srvs] == [2, 2]
        hung = [asyncio.create_task(e.step("a")) for e in envs]
        await asyncio.sleep(0.2)
        client.server_lost(0)
        done, _ = await asyncio.wait(hung, timeout=2.0)
        lost = [t for t in done if isinstance(t.exception(), EnvServerLost)]
        assert len(lost) == 2  # at once, not after a timeout
        on0 = [e for e in envs if e.server == 0]
        with pytest.raises(EnvServerLost):
            await on0[0].step("a")
        await on0[0].reset()  # a new episode goes to a live server
        assert on0[0].server == 1
        for t in hung:
            t.cancel()
        await stop(srvs, client)
    asyncio.run(go())


def test_a_call_costs_the_server_one_task_and_the_client_none():
    """Per-call CPU (scripts/bench_envs.py): the server runs each env call as ONE task (no handler task, no
    call_with_deadline task) and the client waits on a plain future (no task, no wait_for)."""
    async def go():
        srvs, client = await servers(1)
        envs = [RemoteEnv(client, "slow") for _ in range(8)]
        for e in envs:
            await e.reset()
        created = []
        loop = asyncio.get_running_loop()

        def factory(loop, coro, **kw):
            created.append(getattr(coro, "__qualname__", type(coro).__name__))
            return asyncio.Task(coro, loop=loop, **kw)

        loop.set_task_factory(factory)
        try:
            for _ in range(3):
                results = await asyncio.gather(*(e.step("x") for e in envs))
                assert all(r[1] == 1.0 for r in results)
        finally:
            loop.set_task_factory(None)
        # gather wraps each e.step coroutine in a task (the test's own): 24; the server's env calls: 24
        assert len(created) == 2 * 3 * len(envs), created
        await stop(srvs, client)
    asyncio.run(go())


# ---------------------------------------------------------------- batches: one frame (one HMAC) per batch each way


def test_the_calls_of_one_iteration_go_as_one_frame_each_way():
    """Per-call CPU (scripts/bench_envs.py): a frame's HMAC, stamp and msgpack envelope cost more than a cheap env's
    step, so the calls made in one loop iteration go to a server as ONE frame and its replies come back batched."""
    async def go():
        srvs, client = await servers(1)
        envs = [RemoteEnv(client, "slow") for _ in range(8)]
        for e in envs:
            await e.reset()
        router, dealer = srvs[0].router, client.dealers[0]
        sent0, got0 = router.stats["received"], dealer.stats["received"]
        for _ in range(3):
            results = await asyncio.gather(*(e.step("x") for e in envs))
            assert all(r[1] == 1.0 for r in results)
        assert router.stats["received"] - sent0 == 3  # 24 calls in 3 frames
        assert dealer.stats["received"] - got0 <= 6  # 24 replies in a few frames
        await stop(srvs, client)
    asyncio.run(go())


def test_deadlines_cost_one_timer_per_side_not_one_per_call():
    async def go():
        srvs, client = await servers(1)
        envs = [RemoteEnv(client, "slow", {"delay": None}) for _ in range(8)]
        for e in envs:
            await e.reset()
        loop = asyncio.get_running_loop()
        timers = []
        call_at = loop.call_at

        def counting_call_at(when, callback, *args, **kw):
            if getattr(callback, "__module__", "") == "arl.rollout.env_server":
                timers.append(getattr(callback, "__qualname__", callback))
            return call_at(when, callback, *args, **kw)

        loop.call_at = counting_call_at
        try:
            hung = [asyncio.create_task(e.step("a")) for e in envs]
            for _ in range(200):
                if srvs[0].heartbeat_stats()["in_flight"] == 8:
                    break
                await asyncio.sleep(0.01)
            assert srvs[0].heartbeat_stats()["in_flight"] == 8
        finally:
            del loop.call_at
        assert len(timers) <= 2, timers  # the client's sweep and the server's sweep
        for t in hung:
            t.cancel()
        await stop(srvs, client)
    asyncio.run(go())


def test_timeouts_still_fire_per_call_at_each_calls_own_deadline():
    """The client's one sweep timer: a call made later times out later (not with the first), never early."""
    async def go():
        router = Router(secret=SECRET)  # a server that never answers
        address = router.bind_random("127.0.0.1")
        client = EnvServerClient([Dealer(secret=SECRET).connect(address)], timeout=1.0)
        client.start()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        a = asyncio.create_task(client.call(0, {"sid": "s", "op": "step", "action": "x"}))
        await asyncio.sleep(0.5)
        b = asyncio.create_task(client.call(0, {"sid": "s", "op": "step", "action": "y"}))
        with pytest.raises(TimeoutError):
            await a
        assert loop.time() - t0 >= 1.0
        assert not b.done()  # its own deadline is half a second later
        with pytest.raises(TimeoutError):
            await b
        assert loop.time() - t0 >= 1.5 and client.stats["timeouts"] == 2 and not client._pending
        await client.close()
        router.close()
    asyncio.run(go())


def test_server_timeouts_fire_per_call_and_a_quick_call_in_the_same_batch_is_answered():
    async def go():
        srvs, client = await servers(1, call_timeout=0.6)
        a_env, b_env, quick = (RemoteEnv(client, "slow", {"delay": None}), RemoteEnv(client, "slow", {"delay": None}),
                               RemoteEnv(client, "slow"))
        for e in (a_env, b_env, quick):
            await e.reset()
        a = asyncio.create_task(a_env.step("a"))
        await asyncio.sleep(0.3)
        b = asyncio.create_task(b_env.step("b"))
        assert (await quick.step("q"))[1] == 1.0
        with pytest.raises(RemoteEnvError) as e:
            await a
        assert e.value.kind == "timeout" and not b.done()
        with pytest.raises(RemoteEnvError) as e:
            await b
        assert e.value.kind == "timeout" and srvs[0].stats["timeouts"] == 2
        await stop(srvs, client)
    asyncio.run(go())


def test_one_bad_result_or_action_in_a_batch_fails_only_its_own_call():
    async def go():
        srvs, client = await servers(1)
        good, bad = [RemoteEnv(client, "slow") for _ in range(3)], RemoteEnv(client, "slow", {"bad_info": True})
        for e in (*good, bad):
            await e.reset()
        results = await asyncio.gather(*(e.step("x") for e in (*good, bad)), good[0].step(np.zeros(2)),
                                       return_exceptions=True)
        assert [r[1] for r in results[:3]] == [1.0, 1.0, 1.0]
        assert isinstance(results[3], RemoteEnvError) and results[3].kind == "not_msgpack"
        assert "ndarray" in str(results[3]) and srvs[0].stats["not_msgpack"] == 1
        assert isinstance(results[4], TypeError) and "ndarray" in str(results[4])  # refused here, never sent
        assert (await good[0].step("x"))[1] == 1.0
        await stop(srvs, client)
    asyncio.run(go())


async def _raw_dealer(address: str):
    """A plain zmq DEALER to send hand-made frames (forged, altered, replayed, badly shaped)."""
    import zmq

    from arl.transport.sockets import context

    sock = context().socket(zmq.DEALER)  # the process's zmq.asyncio context
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


async def _until(cond, what: str):
    for _ in range(300):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_forged_altered_and_replayed_batches_are_refused_and_run_nothing():
    from arl.transport.codec import decode, encode

    async def go():
        srvs, client = await servers(1)
        env = RemoteEnv(client, "slow")
        await env.reset()
        srv, router = srvs[0], srvs[0].router
        raw = await _raw_dealer(router.addresses[0])
        batch = {"calls": [{"rid": 1, "sid": env.sid, "op": "step", "action": "x"}]}
        calls0 = srv.stats["calls"]
        await raw.send(encode("env_calls", batch, secret=b"not-the-secret-0123456789abcdef"))  # forged
        await _until(lambda: router.stats["malformed"] == 1, "the forged frame to be refused")
        frame = bytearray(encode("env_calls", batch, secret=SECRET))
        frame[10] ^= 1  # altered in transit
        await raw.send(bytes(frame))
        await _until(lambda: router.stats["malformed"] == 2, "the altered frame to be refused")
        assert srv.stats["calls"] == calls0  # neither ran
        good = encode("env_calls", batch, secret=SECRET)
        await raw.send(good)
        kind, payload = decode(await asyncio.wait_for(raw.recv(), 10), secret=SECRET)
        assert kind == "env_replies" and payload["replies"][0]["rid"] == 1 and payload["replies"][0]["ok"]
        await raw.send(good)  # the same authentic frame again
        await _until(lambda: router.stats["replayed"] == 1, "the replayed frame to be refused")
        assert srv.stats["calls"] == calls0 + 1
        raw.close()
        await stop(srvs, client)
    asyncio.run(go())


def test_badly_shaped_calls_in_an_authentic_batch_are_answered_bad_request_and_the_rest_run():
    from arl.transport.codec import decode, encode

    async def go():
        srvs, client = await servers(1)
        env = RemoteEnv(client, "slow")
        await env.reset()
        srv, raw = srvs[0], await _raw_dealer(srvs[0].router.addresses[0])
        await raw.send(encode("env_calls", {"calls": "not a list"}, secret=SECRET))
        await _until(lambda: srv.stats["bad_request"] == 1, "a batch that is not a list to be counted")
        calls = [{"rid": 1, "sid": env.sid, "op": "step", "action": "x"}, "not a map",
                 {"rid": 3, "sid": env.sid, "op": "fly"}, {"rid": 4, "sid": 7, "op": "step"}]
        await raw.send(encode("env_calls", {"calls": calls}, secret=SECRET))
        replies = {}
        while len(replies) < 3:
            kind, payload = decode(await asyncio.wait_for(raw.recv(), 10), secret=SECRET)
            replies.update({r["rid"]: r for r in payload["replies"]})
        assert replies[1]["ok"] and replies[1]["value"][1] == 1.0
        assert replies[3]["kind"] == replies[4]["kind"] == "bad_request" and "'fly'" in replies[3]["error"]
        assert srv.stats["bad_request"] == 4
        raw.close()
        await stop(srvs, client)
    asyncio.run(go())


def test_a_server_that_joins_takes_new_sessions_and_one_draining_takes_none():
    async def go():
        srvs, client = await servers(2)
        router = Router(secret=SECRET)  # a third server joins the run as index 2
        address = router.bind_random("127.0.0.1")
        joined = EnvServer(index=2, router=router, make_env=make_env, call_timeout=5.0, lease_s=60.0)
        joined.task = asyncio.create_task(joined.serve())
        client.server_back(2, Dealer(secret=SECRET).connect(address))
        envs = [RemoteEnv(client, "slow") for _ in range(3)]
        for e in envs:
            await e.reset()
        assert sorted(e.server for e in envs) == [0, 1, 2] and len(client.dealers) == 3
        client.server_draining(0)  # leaving: its session goes on there, new ones go elsewhere
        assert (await envs[[e.server for e in envs].index(0)].step("a"))[2] is not None
        late = RemoteEnv(client, "slow")
        await late.reset()
        assert late.server in (1, 2)
        await stop(srvs + [joined], client)
    asyncio.run(go())
