"""Transport benchmark: obs -> act round trips through the real ZMQ path against a null engine in another process.

    python scripts/bench_transport.py                         # 16- and 4096-token payloads, ~25 s
    python scripts/bench_transport.py --payloads 16 --seconds 1 --concurrency 1 64

The client side is what a rollout worker runs: ``InferenceClient`` over a ``Dealer`` (level ``client``), and the
same plus an agent's obs/act queue pair bridged by ``run_agent`` (level ``agent``: what a ``collect_trajectory``
sees). The server side is a real ``InferenceWorker`` behind a ``Router`` in its own process, with an engine that
answers at once with `payload` tokens (ids, logprobs and versions), so the time measured is the transport and
the client/worker plumbing alone. The request carries `payload` prompt tokens.

Printed per payload and level: round trips/s with C requests in flight (per rollout worker: one client
process), the latency p50/p99 at concurrency 1 (the overhead of one round trip, nothing queued), and the CPU
time per round trip of each process (user + system, all threads, ZMQ's I/O thread included). On a shared
machine the wall-clock rate mostly measures the other tenants; the CPU per round trip says what the code costs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any, Optional

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from arl.api.types import GenerateRequest, GenerateResponse, GenerationConfig, SampleOutput  # noqa: E402


class NullEngine:
    """Answers every request at once with `max_new_tokens` tokens (arrays cached per size)."""

    version = 0

    def __init__(self) -> None:
        self._cache: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.requests = 0

    async def agenerate(self, req: GenerateRequest) -> GenerateResponse:
        n = req.gconfig.max_new_tokens
        arrays = self._cache.get(n)
        if arrays is None:
            arrays = self._cache[n] = (np.arange(n, dtype=np.int32) % 1000, np.full(n, -0.5, np.float32),
                                       np.zeros(n, np.int32))
        self.requests += 1
        return GenerateResponse(qid=req.qid, samples=[SampleOutput(*arrays, finish_reason="length")])

    async def update_weights(self, source: str, version: int) -> None:  # pragma: no cover - protocol only
        return None

    async def pause(self) -> None:  # pragma: no cover
        return None

    async def resume(self) -> None:  # pragma: no cover
        return None

    async def close(self) -> None:
        return None


# -------------------------------------------------------------------------------------------------- server


def serve() -> int:
    """Server process: print the ROUTER address, answer until stdin closes (the parent went away)."""
    from arl.inference.worker import InferenceWorker
    from arl.transport.sockets import Router

    async def main() -> None:
        router = Router()
        address = router.bind_random()
        async def no_control(msg_type: str, payload: dict) -> None:
            return None
        worker = InferenceWorker(index=0, engine=NullEngine(), router=router, send_control=no_control)
        print(address, flush=True)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        threading.Thread(target=lambda: (sys.stdin.read(), loop.call_soon_threadsafe(stop.set)), daemon=True).start()
        task = asyncio.create_task(worker.serve())
        await stop.wait()
        task.cancel()
        router.close()

    asyncio.run(main())
    return 0


def start_server() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    address = proc.stdout.readline().strip()
    if not address.startswith("tcp://"):
        proc.kill()
        raise RuntimeError(f"server did not start (got {address!r})")
    return proc, address


# -------------------------------------------------------------------------------------------------- client


def make_request(payload: int, i: int = 0) -> GenerateRequest:
    return GenerateRequest(qid=f"r{i}", input_ids=np.arange(payload, dtype=np.int32) % 1000,
                           gconfig=GenerationConfig(n=1, max_new_tokens=payload))


def _cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of process `pid` (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(client: Any, payload: int, concurrency: int, seconds: float, level: str, server_pid: int,
                  warmup: float = 0.2) -> dict[str, float]:
    """Run `concurrency` loops of round trips for `seconds` (after `warmup`); rate and latency percentiles."""
    from arl.agents.common import generate
    from arl.api import Agent
    from arl.rollout.worker import run_agent

    latencies: list[float] = []
    count = [0]
    cpu = [0.0, 0.0]
    t_start = time.perf_counter()
    t_measure = t_start + warmup
    t_end = t_measure + seconds
    req = make_request(payload)

    async def client_loop() -> None:
        while True:
            t0 = time.perf_counter()
            if t0 >= t_end:
                return
            resp = await client.generate(req)
            t1 = time.perf_counter()
            if resp.error:
                raise RuntimeError(resp.error)
            if t0 >= t_measure:
                latencies.append(t1 - t0)
                count[0] += 1

    async def cpu_marks() -> None:
        await asyncio.sleep(max(0.0, t_measure - time.perf_counter()))
        cpu[0] = _cpu_seconds(server_pid)
        cpu[1] = time.process_time()

    class LoopAgent(Agent):
        async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
            k = 0
            while True:
                t0 = time.perf_counter()
                if t0 >= t_end:
                    return []
                await generate(obs_queue, act_queue, GenerateRequest(qid=f"q{k}", input_ids=req.input_ids,
                                                                     gconfig=req.gconfig))
                t1 = time.perf_counter()
                k += 1
                if t0 >= t_measure:
                    latencies.append(t1 - t0)
                    count[0] += 1

    marks = asyncio.create_task(cpu_marks())
    if level == "client":
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    else:
        await asyncio.gather(*(run_agent(LoopAgent(), {}, None, client, timeout=seconds + warmup + 30)  # type: ignore[arg-type]
                               for _ in range(concurrency)))
    elapsed = time.perf_counter() - t_measure
    await marks
    n = max(count[0], 1)
    server_us = (_cpu_seconds(server_pid) - cpu[0]) / n * 1e6
    client_us = (time.process_time() - cpu[1]) / n * 1e6
    lat = np.array(latencies) * 1e6
    return {"rt_per_s": count[0] / elapsed, "client_cpu_us": client_us, "server_cpu_us": server_us, "p50_us": float(np.percentile(lat, 50)) if len(lat) else float("nan"),
            "p99_us": float(np.percentile(lat, 99)) if len(lat) else float("nan"), "n": count[0]}


async def run_client(address: str, server_pid: int, payloads: list[int], levels: list[str], concurrency: list[int],
                     seconds: float) -> list[dict]:
    from arl.rollout.client import InferenceClient
    from arl.transport.sockets import Dealer

    client = InferenceClient([Dealer().connect(address)], request_timeout=30.0)
    client.start()
    rows = []
    try:
        await client.generate(make_request(16))  # connect
        for payload in payloads:
            for level in levels:
                for c in concurrency:
                    r = await measure(client, payload, c, seconds, level, server_pid)
                    rows.append({"payload": payload, "level": level, "concurrency": c, **r})
                    print(f"  payload {payload:5d}  {level:6s}  in flight {c:4d}: {r['rt_per_s']:9.0f} rt/s  "
                          f"p50 {r['p50_us']:7.0f} us  p99 {r['p99_us']:7.0f} us  CPU per rt: client "
                          f"{r['client_cpu_us']:5.1f} us, server {r['server_cpu_us']:5.1f} us", flush=True)
    finally:
        await client.close()
    return rows


def summarise(rows: list[dict]) -> list[str]:
    lines = []
    for payload in sorted({r["payload"] for r in rows}):
        for level in ("client", "agent"):
            sel = [r for r in rows if r["payload"] == payload and r["level"] == level]
            if not sel:
                continue
            best = max(sel, key=lambda r: r["rt_per_s"])
            one = min(sel, key=lambda r: r["concurrency"])
            cpu = max(best["client_cpu_us"], best["server_cpu_us"])
            lines.append(f"payload {payload:5d} tokens, {level:6s}: {best['rt_per_s']:8.0f} rt/s per rollout worker "
                         f"({best['concurrency']} in flight); overhead at {one['concurrency']} in flight: "
                         f"p50 {one['p50_us']:.0f} us, p99 {one['p99_us']:.0f} us; CPU per round trip: client "
                         f"{best['client_cpu_us']:.0f} us, server {best['server_cpu_us']:.0f} us "
                         f"(-> {1e6 / cpu:.0f} rt/s if each side had a core to itself)")
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--payloads", type=int, nargs="+", default=[16, 4096], help="tokens per request and response")
    ap.add_argument("--levels", nargs="+", default=["client", "agent"], choices=["client", "agent"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64], help="requests in flight")
    ap.add_argument("--seconds", type=float, default=2.0, help="measurement time per point")
    ap.add_argument("--json", default="", help="also write the rows to this file")
    args = ap.parse_args(argv)
    if args.serve:
        return serve()
    import platform

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; "
          f"python {platform.python_version()}", flush=True)
    proc, address = start_server()
    try:
        rows = asyncio.run(run_client(address, proc.pid, args.payloads, args.levels, args.concurrency, args.seconds))
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
    print("\nsummary")
    for line in summarise(rows):
        print("  " + line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
