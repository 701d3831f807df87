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

For scale, the same run first measures the machine's floor: a bare blocking pyzmq DEALER/ROUTER ping-pong
between two processes with a frame of the same size (no asyncio, no codec, no ARL), and the summary prints how
much ARL's round trip adds to it. ``--transport ipc`` runs both over a Unix socket instead of loopback TCP;
``--busy-poll-us N`` makes both sides' event loops poll N microseconds before sleeping (config ``busy_poll_us``).

``--baseline-tree PATH`` compares two checkouts side by side: it runs this script (no floor) alternately with
this tree's ``arl`` and with PATH's (environment variable ``ARL_BENCH_TREE``, both processes) for ``--rounds``
rounds, prints each run's best rate and CPU per round trip, and as the last line the medians' ratios
this/baseline. The machine's load changes both alike, so the ratio (CPU above all) is what to read on a shared
machine.
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

# ARL_BENCH_TREE: import `arl` from another checkout (--baseline-tree runs this same script against it)
sys.path.insert(0, os.environ.get("ARL_BENCH_TREE") or os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from arl.api.types import GenerateRequest, GenerateResponse, GenerationConfig, SampleOutput  # noqa: E402
from arl.transport.loop import run as run_loop  # noqa: E402


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


def latency_percentiles(seconds: list[float]) -> dict[str, float]:
    us = np.array(seconds) * 1e6
    return {f"p{q}_us": float(np.percentile(us, q)) if len(us) else float("nan") for q in (50, 99)}


def serve_bare(address: str) -> int:
    """Reference server: a blocking ROUTER that answers each request with a frame of the size it asks for (no
    asyncio, no codec) until told 'q'."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    print(sock.getsockopt(zmq.LAST_ENDPOINT).decode(), flush=True)
    replies: dict[bytes, bytes] = {}
    while True:
        parts = sock.recv_multipart()  # [identity, request frame, reply size]
        if parts[1] == b"q":
            return 0
        reply = replies.get(parts[2])
        if reply is None:
            reply = replies[parts[2]] = bytes(int(parts[2]))
        sock.send_multipart([parts[0], reply])


def bare_pingpong(sock: Any, frame: bytes, reply_size: int, seconds: float) -> dict[str, float]:
    """Blocking DEALER side of the reference ping-pong: `frame` out, `reply_size` bytes back, one at a time."""
    lat = []
    size = str(reply_size).encode()
    t_end = time.perf_counter() + 0.2 + seconds
    t_measure = t_end - seconds
    while True:
        t0 = time.perf_counter()
        if t0 >= t_end:
            break
        sock.send_multipart([frame, size])
        sock.recv()
        if t0 >= t_measure:
            lat.append(time.perf_counter() - t0)
    return {**latency_percentiles(lat), "n": len(lat), "rt_per_s": len(lat) / seconds}


def serve(bind: str = "", busy_poll_us: float = 0.0) -> int:
    """Server process: print the ROUTER address, answer until stdin closes (the parent went away)."""
    from arl.inference.worker import InferenceWorker
    from arl.transport.sockets import Router

    async def main() -> None:
        router = Router()
        address = router.bind(bind) if bind else router.bind_random()
        async def no_control(msg: Any) -> None:  # a typed control message (weights_loaded): nobody listens
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

    run_loop(main(), busy_poll_us)
    return 0


def start_server(*args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    address = proc.stdout.readline().strip()
    if not address.startswith(("tcp://", "ipc://")):
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
    return {"rt_per_s": count[0] / elapsed, "client_cpu_us": client_us, "server_cpu_us": server_us,
            **latency_percentiles(latencies), "n": count[0]}


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


def wire_sizes(payload: int) -> tuple[bytes, int]:
    """ARL's request frame for `payload` tokens, and the size of its reply frame (what the reference sends)."""
    from arl.transport.codec import encode

    req = make_request(payload)
    n = req.gconfig.max_new_tokens
    reply = GenerateResponse(qid="0", samples=[SampleOutput(np.zeros(n, np.int32), np.zeros(n, np.float32),
                                                            np.zeros(n, np.int32), finish_reason="length")])
    return encode("gen_req", req), len(encode("gen_resp", reply))


def measure_floor(address: str, payloads: list[int], seconds: float) -> dict[int, dict]:
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)  # a reference server that died fails the run instead of hanging it
    sock.connect(address)
    out = {}
    try:
        for payload in payloads:
            frame, reply_size = wire_sizes(payload)
            out[payload] = r = bare_pingpong(sock, frame, reply_size, seconds)
            print(f"  payload {payload:5d}  bare pyzmq ping-pong (the machine's floor): {r['rt_per_s']:9.0f} rt/s  "
                  f"p50 {r['p50_us']:7.0f} us  p99 {r['p99_us']:7.0f} us", flush=True)
        sock.send_multipart([b"q", b"0"])
    finally:
        sock.close()
    return out


def summarise(rows: list[dict], floor: dict[int, dict]) -> list[str]:
    lines = []
    for payload in sorted({r["payload"] for r in rows}):
        for level in ("client", "agent"):
            sel = [r for r in rows if r["payload"] == payload and r["level"] == level]
            if not sel:
                continue
            best = max(sel, key=lambda r: r["rt_per_s"])
            one = min(sel, key=lambda r: r["concurrency"])
            cpu = max(best["client_cpu_us"], best["server_cpu_us"])
            base = floor.get(payload)
            added = (f" = bare pyzmq's {base['p50_us']:.0f} us + {one['p50_us'] - base['p50_us']:.0f} us of ARL"
                     if base else "")
            lines.append(f"payload {payload:5d} tokens, {level:6s}: {best['rt_per_s']:8.0f} rt/s per rollout worker "
                         f"({best['concurrency']} in flight); overhead at {one['concurrency']} in flight: "
                         f"p50 {one['p50_us']:.0f} us{added}, p99 {one['p99_us']:.0f} us; CPU per round trip: "
                         f"client {best['client_cpu_us']:.0f} us, server {best['server_cpu_us']:.0f} us "
                         f"(-> {1e6 / cpu:.0f} rt/s if each side had a core to itself)")
    return lines


def _stop(proc: subprocess.Popen) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def compare_trees(baseline: str, bench_args: list[str], rounds: int) -> int:
    """Run this tree's bench and `baseline`'s alternately (order flipped each round); print the medians' ratios."""
    import tempfile

    trees = {"this": os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
             "baseline": os.path.abspath(baseline)}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    keys = ("rt_per_s", "client_cpu_us", "server_cpu_us")
    with tempfile.TemporaryDirectory(prefix="arl-bench-ab-") as tmp:
        for r in range(rounds):
            for name in (("this", "baseline") if r % 2 == 0 else ("baseline", "this")):
                out = os.path.join(tmp, f"{name}{r}.json")
                env = {**os.environ, "PYTHONPATH": trees[name], "ARL_BENCH_TREE": trees[name]}
                subprocess.run([sys.executable, os.path.abspath(__file__), *bench_args, "--no-floor", "--json", out],
                               env=env, stdout=subprocess.DEVNULL, check=True, timeout=600)
                with open(out) as f:
                    best = max(json.load(f)["rows"], key=lambda row: row["rt_per_s"])
                runs[name].append(best)
                print(f"round {r} {name:8s}: {best['rt_per_s']:8.0f} rt/s ({best['payload']} tokens, {best['level']}, "
                      f"{best['concurrency']} in flight); CPU per rt: client {best['client_cpu_us']:5.1f} us, "
                      f"server {best['server_cpu_us']:5.1f} us", flush=True)
    med = {name: {k: float(np.median([row[k] for row in rows])) for k in keys} for name, rows in runs.items()}
    for name in trees:
        print(f"median {name:8s}: {med[name]['rt_per_s']:8.0f} rt/s; CPU per rt: client "
              f"{med[name]['client_cpu_us']:5.1f} us, server {med[name]['server_cpu_us']:5.1f} us  ({trees[name]})")
    print("this/baseline: " + ", ".join(f"{k} {med['this'][k] / med['baseline'][k]:.3f}" for k in keys))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--serve-bare", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--payloads", type=int, nargs="+", default=[16, 4096], help="tokens per request and response")
    ap.add_argument("--levels", nargs="+", default=["client", "agent"], choices=["client", "agent"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256], help="requests in flight")
    ap.add_argument("--seconds", type=float, default=2.0, help="measurement time per point")
    ap.add_argument("--transport", choices=["tcp", "ipc"], default="tcp", help="loopback TCP or a Unix socket")
    ap.add_argument("--no-floor", action="store_true", help="skip the bare pyzmq reference")
    ap.add_argument("--busy-poll-us", type=float, default=0.0,
                    help="both sides' event loops poll this long before sleeping (config busy_poll_us)")
    ap.add_argument("--json", default="", help="also write the rows to this file")
    ap.add_argument("--baseline-tree", default="", help="another checkout: run both benches alternately, print ratios")
    ap.add_argument("--rounds", type=int, default=4, help="with --baseline-tree: runs of each tree")
    args = ap.parse_args(argv)
    if args.baseline_tree:
        return compare_trees(args.baseline_tree, [
            "--payloads", *map(str, args.payloads), "--levels", *args.levels,
            "--concurrency", *map(str, args.concurrency), "--seconds", str(args.seconds), "--transport", args.transport,
            "--busy-poll-us", str(args.busy_poll_us)],
            args.rounds)
    if args.serve is not None:
        return serve(args.serve, args.busy_poll_us)
    if args.serve_bare is not None:
        return serve_bare(args.serve_bare)
    import platform
    import tempfile

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; "
          f"python {platform.python_version()}; transport {args.transport}; busy poll {args.busy_poll_us:g} us",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="arl-bench-") as tmp:
        def address(name: str) -> str:
            return f"ipc://{tmp}/{name}" if args.transport == "ipc" else "tcp://127.0.0.1:*"

        floor: dict[int, dict] = {}
        if not args.no_floor:
            bare, bare_address = start_server("--serve-bare", address("bare"))
            try:
                floor = measure_floor(bare_address, args.payloads, args.seconds)
            finally:
                _stop(bare)
        proc, server_address = start_server("--serve", address("arl"), "--busy-poll-us", str(args.busy_poll_us))
        try:
            rows = run_loop(run_client(server_address, proc.pid, args.payloads, args.levels, args.concurrency,
                                       args.seconds), args.busy_poll_us)
        finally:
            _stop(proc)
    print("\nsummary")
    for line in summarise(rows, floor):
        print("  " + line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"floor": floor, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
