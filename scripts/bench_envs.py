"""Env steps per second through an env server (`env.servers`) vs in-process, same env, one run.

    python scripts/bench_envs.py                       # cheap env and a 10 ms env, 32 sessions, ~20 s
    python scripts/bench_envs.py --sessions 1 64 --steps 200

Three envs: `cheap` (the default run's MathEnv: its check runs in a thread, tens of microseconds), `noop` (a step
returns at once: in-process it is a coroutine call, so the ratio is the wire's and the server's whole cost per
step) and `sleep10` (a step awaits 10 ms: with enough sessions at once the server should lose nothing). In-process, S sessions each
step their own env K times concurrently on this event loop (what a rollout worker does with env.servers=0);
through a server, the same S sessions are `RemoteEnv`s on one `EnvServer` in another process (the real codec,
HMAC with a secret, loopback TCP). Printed per env and S: steps/s both ways and this process's CPU per step. On
a shared machine wall-clock rates mostly measure the other tenants: compare runs on one quiet machine.
The last line: `env server: NN% of in-process steps/s (cheap env)` at the largest S.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from arl.api import EnvironmentService  # noqa: E402

SECRET = b"bench-envs-secret-0123456789abcd"


class NoopEnv(EnvironmentService):
    async def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        return "ok", 1.0, False, False, {}


class SleepEnv(EnvironmentService):
    async def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        await asyncio.sleep(0.010)
        return "ok", 1.0, False, False, {}


ENVS = {"cheap": None, "noop": NoopEnv, "sleep10": SleepEnv}


def make_env(name: str, **args: Any) -> EnvironmentService:
    if name == "cheap":
        from arl.envs.math import MathEnv

        return MathEnv()
    return ENVS[name](**args)


def _server(conn: Any) -> None:
    """The env server process: one EnvServer on a random loopback port; sends its address, serves until killed."""
    from arl.rollout.env_server import EnvServer
    from arl.transport.sockets import Router

    async def main() -> None:
        router = Router(secret=SECRET)
        conn.send(router.bind_random("127.0.0.1"))
        await EnvServer(index=0, router=router, make_env=make_env, call_timeout=30.0, lease_s=600.0).serve()

    asyncio.run(main())


async def _drive(envs: list[EnvironmentService], steps: int) -> tuple[float, float]:
    """(seconds, CPU seconds of this process) for every env to reset once and step `steps` times concurrently."""
    for e in envs:
        await e.reset(seed=0, options={"answer": "7"})

    async def one(e: EnvironmentService) -> None:
        for _ in range(steps):
            await e.step("7")

    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(one(e) for e in envs))
    return time.perf_counter() - t0, time.process_time() - c0


async def measure(address: str, name: str, sessions: int, steps: int) -> dict[str, float]:
    from arl.rollout.env_server import EnvServerClient, RemoteEnv
    from arl.transport.sockets import Dealer

    wall_in, cpu_in = await _drive([make_env(name) for _ in range(sessions)], steps)
    client = EnvServerClient([Dealer(secret=SECRET).connect(address)], timeout=60.0)
    client.start()
    remote = [RemoteEnv(client, name) for _ in range(sessions)]
    wall_srv, cpu_srv = await _drive(remote, steps)  # type: ignore[arg-type]
    for e in remote:
        await e.close()
    await client.close()
    n = sessions * steps
    return {"in_process": n / wall_in, "server": n / wall_srv, "cpu_us_in": 1e6 * cpu_in / n,
            "cpu_us_srv": 1e6 * cpu_srv / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=100, help="steps per session")
    args = ap.parse_args()
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_server, args=(child,), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise SystemExit("the env server process did not start within 60 s")
        address = parent.recv()
        ratio = float("nan")
        for name in ENVS:
            for s in args.sessions:
                steps = args.steps if name != "sleep10" else max(10, args.steps // 5)
                r = asyncio.run(measure(address, name, s, steps))
                print(f"{name:8s} sessions {s:4d}: in-process {r['in_process']:10.0f} steps/s "
                      f"({r['cpu_us_in']:7.1f} us CPU/step), env server {r['server']:10.0f} steps/s "
                      f"({r['cpu_us_srv']:7.1f} us CPU/step here): {100 * r['server'] / r['in_process']:5.1f}%",
                      flush=True)
                if name == "cheap" and s == max(args.sessions):
                    ratio = r["server"] / r["in_process"]
        print(f"env server: {100 * ratio:.0f}% of in-process steps/s (cheap env)")
    finally:
        proc.kill()
        proc.join(5)


if __name__ == "__main__":
    main()
