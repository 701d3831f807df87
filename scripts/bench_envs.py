"""Env steps per second through an env server (`env.servers`) vs in-process, same env, one run.

    python scripts/bench_envs.py                       # cheap, noop and a 10 ms env, 1 and 32 sessions, ~1 min
    python scripts/bench_envs.py --sessions 1 64 --steps 200

Three envs: `cheap` (the default run's MathEnv: its check runs in a thread, tens of microseconds), `noop` (a step
returns at once: in-process it is a coroutine call, so the ratio is the wire's and the server's whole cost per
step) and `sleep10` (a step awaits 10 ms: with enough sessions at once the server should lose nothing). In-process, S sessions each
step their own env K times concurrently on this event loop (what a rollout worker does with env.servers=0);
through a server, the same S sessions are `RemoteEnv`s on one `EnvServer` in another process (the real codec,
HMAC with a secret, loopback TCP). Both ways are timed in `--rounds` alternating windows (in-process first in
even rounds, the server first in odd ones) and the medians printed, so that a burst of load from other tenants
lands on one window, not on one side: steps/s both ways, this process's CPU per step and the env server
process's (Linux /proc). On a shared machine wall-clock rates still move with the other tenants: compare CPU per
step, or runs on one quiet machine.
The last line: `env server: NN% of in-process steps/s (cheap env)` at the largest S (the median of the rounds'
ratios).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
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


def _cpu_of(pid: int) -> float:
    """CPU seconds (user + system, all threads) of process `pid` so far; nan where /proc is not there."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


async def _drive(envs: list[EnvironmentService], steps: int) -> tuple[float, float]:
    """(seconds, CPU seconds of this process) for every env to step `steps` times concurrently."""

    async def one(e: EnvironmentService) -> None:
        for _ in range(steps):
            await e.step("7")

    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(one(e) for e in envs))
    return time.perf_counter() - t0, time.process_time() - c0


async def measure(address: str, name: str, sessions: int, steps: int, rounds: int = 1,
                  server_pid: int = -1) -> dict[str, float]:
    """Medians over `rounds` alternating windows: steps/s in-process and through the server, their ratio, and CPU
    per step here (both ways) and at the server."""
    from arl.rollout.env_server import EnvServerClient, RemoteEnv
    from arl.transport.sockets import Dealer

    client = EnvServerClient([Dealer(secret=SECRET).connect(address)], timeout=60.0)
    client.start()
    local = [make_env(name) for _ in range(sessions)]
    remote = [RemoteEnv(client, name) for _ in range(sessions)]
    for e in (*local, *remote):
        await e.reset(seed=0, options={"answer": "7"})
    n = sessions * steps
    rows: list[dict[str, float]] = []
    for r in range(rounds):
        row: dict[str, float] = {}
        for side in (("in", "srv") if r % 2 == 0 else ("srv", "in")):
            s0 = _cpu_of(server_pid)
            wall, cpu = await _drive(local if side == "in" else remote, steps)  # type: ignore[arg-type]
            row[side], row[f"cpu_us_{side}"] = n / wall, 1e6 * cpu / n
            if side == "srv":
                row["cpu_us_server"] = 1e6 * (_cpu_of(server_pid) - s0) / n
        row["ratio"] = row["srv"] / row["in"]
        rows.append(row)
    for e in remote:
        await e.close()
    await client.close()
    med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    return {"in_process": med["in"], "server": med["srv"], "ratio": med["ratio"], "cpu_us_in": med["cpu_us_in"],
            "cpu_us_srv": med["cpu_us_srv"], "cpu_us_server": med["cpu_us_server"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=100, help="steps per session and window")
    ap.add_argument("--rounds", type=int, default=5, help="alternating windows per side (medians are printed)")
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
                r = asyncio.run(measure(address, name, s, steps, args.rounds, proc.pid))
                print(f"{name:8s} sessions {s:4d}: in-process {r['in_process']:10.0f} steps/s "
                      f"({r['cpu_us_in']:7.1f} us CPU/step), env server {r['server']:10.0f} steps/s "
                      f"({r['cpu_us_srv']:7.1f} us CPU/step here, {r['cpu_us_server']:7.1f} at the server): "
                      f"{100 * r['ratio']:5.1f}%", flush=True)
                if name == "cheap" and s == max(args.sessions):
                    ratio = r["ratio"]
        print(f"env server: {100 * ratio:.0f}% of in-process steps/s (cheap env)")
    finally:
        proc.kill()
        proc.join(5)


if __name__ == "__main__":
    main()
