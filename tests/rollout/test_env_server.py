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
