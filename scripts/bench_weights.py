"""New weights to every inference worker: `weights.transport=disk` vs `broadcast`, beside a bare broadcast.

    python scripts/bench_weights.py [--models tiny,0.5b] [--workers 1,4] [--repeat 3] [--vocab-05b 32768]
        [--bucket-mb 64] [--gen-requests 2] [--json out.json]
    python scripts/bench_weights.py --quick        # the smoke test: tiny model, 1 worker, 1 repeat
    python scripts/bench_weights.py --lora-rank 0  # full weights only (default: LoRA rows too, rank 16)

Why: issue 15 asks what a version costs to reach every inference server with each transport, against the limit of
the path on this machine (a bare ``torch.distributed`` broadcast of the same bytes), and whether generation stalls
longer with one than the other.

Per model x number of workers, every worker is its own process holding its own model in a real `TorchEngine`
behind a real `InferenceWorker` (its ``weights_loaded`` ack comes back over a pipe instead of the controller's
socket); the parent is learner rank 0 holding the model. A version's clock runs from the moment the learner starts
publishing it to the moment the last worker acked (= every engine swapped it in):

* ``disk``: the DeepSpeed engine's ``export_weights`` (its ``full_state_dict`` + safetensors ``save_file``, atomic
  rename; run on a stand-in holding the model, no DeepSpeed built), then ``update_weights(version, path)`` to every
  worker (``TorchEngine.update_weights``: ``load_file`` and a copy out of its mapping, check, swap). On one host the
  file is read back from the page cache, which a cluster's shared filesystem does not give: it is reported beside,
  it is not the bar.
* ``broadcast``: ``full_state_dict(copy=False)`` minus the tied aliases (the learner's ``_state_dict``: its live
  parameters), then ``WeightPublisher.set_newest`` (packs them into the buckets, into buffers kept across versions)
  + ``request`` (groups opened as in a run, one per server, gloo) while every worker runs ``update_weights`` through
  its ``BroadcastLoader`` (receive into the buffers of the weights its engine served before, check,
  ``update_weights_from_tensors``). Parts: the gather, the pack, then until all acked; ``WeightSender.send`` is the
  sender's own share of the latter (it returns once every receiver holds the tensors, before the engines swapped
  them in).
* ``bare``: one ``torch.distributed.broadcast`` of the same bytes as one flat uint8 tensor to as many receiver
  processes in a plain ``init_process_group`` world (buffers allocated beforehand, nothing checked or applied).

GB/s = payload bytes per worker / time (disk: the file, which also carries the tied ``lm_head`` copy; broadcast and
bare: the unique parameters). Each figure is the median of ``--repeat`` updates (after one untimed warm-up) made
with the workers idle. In-flight pause: ``--repeat`` more updates per path made while every worker generates
(``--gen-requests`` requests kept running); a hook on the engine's decode step records when each step ends, and the
pause is the longest gap between two step ends that overlaps the update (the worker's ``update_weights`` call),
beside the median gap before it (a normal step on a machine this busy); both are the worst worker's, median over
repeats. ``swap`` is the engine's own time pointing its parameters at the new tensors (its lock held).

The models are made on the spot (random init, nothing downloaded): ``tiny`` is `build_qwen2_tiny_dir`'s Qwen2
(vocab 1024, hidden 192, 2 layers); ``0.5b`` is Qwen2-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 kv heads,
intermediate 4864, tied embeddings) with the vocabulary ``--vocab-05b`` (default 32768: 0.39B parameters, 1.55 GB
fp32; Qwen's own 151936 makes 0.49B / 1.98 GB). Memory: the learner's model, its export (a copy, plus safetensors'
bytes of it) and per worker two copies during a load, about 18.5 GB for 0.5b with 4 workers (with 151936: 23 GB,
more than a 24 GiB machine has). A case whose estimate exceeds the memory available is skipped, and said so; every
process gives freed memory back after each version (`release`). Everything runs on CPU, one torch thread per
process. The last line is ``broadcast: NN% of bare broadcast`` (bare time / broadcast time) for the largest case
run (0.5b with 4 workers in a full run); the goal is >= 80%, with the in-flight pause unchanged.

LoRA rows (issue 27; ``--lora-rank R``, default 16, 0: none): the same model wrapped with peft adapters of rank R on
q/k/v/o (random, non-zero B), the learner publishing only the adapter payload (`arl.weights.adapter`: the
``full_state_dict`` of a LoRA engine), each worker merging it into its own copies of those weights (paths
``lora-disk`` and ``lora-bcast``, same clock: publish start -> every worker acked). Then the line
``lora update: Nx fewer bytes, Mx faster than full`` for the largest case (bytes and time of the default transport,
disk; the broadcast's on the line before it); the goal is >= 20x fewer bytes and >= 5x faster.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from arl.utils.net import free_port  # noqa: E402
from arl.utils.proc import trim_memory  # noqa: E402

GB = 1e9
LOOPBACK = "127.0.0.1"


def release() -> None:
    """Give freed memory back to the OS. glibc keeps freed blocks in the arena of the thread that allocated them
    (one per thread, up to 8 per core), and tensors under 32 MB come from those arenas: what one executor thread
    allocated and freed is neither reused by the next thread nor given back, and without this a process grew by a
    few model copies
    over a few versions (measured: 0.84 -> 2.85 GB RSS over 8 exports of a 0.47 GB model through
    ``asyncio.to_thread``; flat with ``malloc_trim`` or ``MALLOC_ARENA_MAX=1``). The trim is the one the torch
    engine does after each weight swap (`trim_memory`)."""
    import gc

    gc.collect()
    trim_memory()


# -------------------------------------------------------------------------------------------------------- models

def model_shape(name: str, vocab_05b: int) -> dict[str, int]:
    if name == "tiny":  # build_qwen2_tiny_dir's defaults
        return dict(vocab_size=1024, hidden_size=192, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=576)
    if name == "0.5b":  # Qwen2-0.5B's layers
        return dict(vocab_size=vocab_05b, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                    intermediate_size=4864)
    raise ValueError(f"unknown model {name!r} (tiny, 0.5b)")


def make_model_dir(name: str, vocab_05b: int, path: str) -> Any:
    """The learner's model (random init), saved to `path` for the workers' initial weights."""
    from arl.models.qwen2_tiny import build_qwen2_model

    shape = model_shape(name, vocab_05b)
    model = build_qwen2_model(shape.pop("vocab_size"), **shape, max_position_embeddings=1024)
    model.save_pretrained(path, safe_serialization=True)
    return model


def wrap_lora(model: Any, rank: int) -> Any:
    """`model` with peft adapters of `rank` on q/k/v/o (in place), B random so every update merges something."""
    from arl.config import LoraConfig
    from arl.learner.lora import wrap_lora as wrap

    model = wrap(model, LoraConfig(rank=rank, alpha=2.0 * rank))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.01)
    return model


class Learner:
    """The DeepSpeed engine's export path (its ``full_state_dict`` and ``export_weights``, the run's functions) on a
    stand-in that holds `model`: rank 0 of 1, ZeRO stage 0. Building DeepSpeed would add nothing to the transfer."""

    def __init__(self, model: Any, lora: bool = False) -> None:
        from arl.learner.deepspeed_engine import DeepSpeedEngine

        self.cfg = SimpleNamespace(zero_stage=0)
        self.model_engine = SimpleNamespace(module=model)
        self.rank, self.world_size, self.version = 0, 1, 0
        self.lora = lora  # a peft-wrapped model: the engine exports the adapter payload
        self._impl = DeepSpeedEngine

    def full_state_dict(self, copy: bool = True) -> Optional[dict[str, torch.Tensor]]:
        return self._impl.full_state_dict(self, copy)  # type: ignore[arg-type]

    def export_weights(self, path: str) -> None:
        self._impl.export_weights(self, path)  # type: ignore[arg-type]

    def _barrier(self) -> None:
        self._impl._barrier(self)  # type: ignore[arg-type]


# -------------------------------------------------------------------------------------------------------- worker

def quiet() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def worker_main(index: int, model_dir: str, conn: Any, timeout_s: float, gen_requests: int) -> None:
    torch.set_num_threads(1)
    quiet()
    asyncio.run(_worker(index, model_dir, conn, timeout_s, gen_requests))


async def _worker(index: int, model_dir: str, conn: Any, timeout_s: float, gen_requests: int) -> None:
    """One inference server: a TorchEngine behind an InferenceWorker per transport, driven by the parent's pipe."""
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(16))  # a thread stays blocked on the pipe
    import numpy as np
    from transformers import AutoModelForCausalLM

    from arl.api.types import GenerateRequest, GenerationConfig
    from arl.inference.torch_engine import TorchEngine
    from arl.inference.worker import InferenceWorker
    from arl.weights.group import GroupSpec
    from arl.weights.channel import BroadcastLoader

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine = TorchEngine(model, pad_token_id=0, eos_token_id=None, max_batch_size=8, max_context_len=256,
                         device="cpu", name=f"inference{index}")
    engine.start()
    step_ends: list[float] = []
    step = engine._step  # the hook: when each decode step ends (the decode thread looks it up on every step)

    def timed_step(newcomers: list) -> None:
        step(newcomers)
        step_ends.append(time.monotonic())

    engine._step = timed_step  # type: ignore[method-assign]

    window = [0.0, 0.0]  # the last update: its update_weights call .. its ack

    async def ack(msg: Any) -> None:  # the worker's typed weights_loaded
        window[1] = time.monotonic()
        conn.send(("ack", msg.to_payload()))

    loader = BroadcastLoader(engine, timeout_s=timeout_s, gloo_host=LOOPBACK)
    workers = {"disk": InferenceWorker(index=index, engine=engine, router=None, send_control=ack),
               "broadcast": InferenceWorker(index=index, engine=engine, router=None, send_control=ack,
                                            weights=loader)}
    gen: list[asyncio.Task] = []
    tasks: set[asyncio.Task] = set()

    async def generate(k: int) -> None:
        n = 0
        while True:
            n += 1
            ids = np.arange(8, dtype=np.int32) + k
            await engine.agenerate(GenerateRequest(f"w{index}-{k}-{n}", ids, GenerationConfig(max_new_tokens=200)))

    async def update(mode: str, version: int, path: str) -> None:
        window[0] = time.monotonic()
        await workers[mode].update_weights(version, path)

    async def reported(coro: Any) -> None:
        try:
            await coro
        except Exception as e:  # noqa: BLE001 - the parent fails now instead of at its timeout
            conn.send(("error", {"error": f"{type(e).__name__}: {e}"}))

    async def until_steps(n: int) -> None:
        target = len(step_ends) + n
        while len(step_ends) < target:
            await asyncio.sleep(0.005)

    def spawn(coro: Any) -> None:
        t = asyncio.create_task(coro)
        tasks.add(t)
        t.add_done_callback(tasks.discard)

    conn.send(("ready", {"index": index}))
    while True:
        cmd, arg = await asyncio.to_thread(conn.recv)
        if cmd == "join":
            spawn(reported(loader.join(GroupSpec.from_dict(arg))))
        elif cmd == "update":
            spawn(reported(update(*arg)))
        elif cmd == "gen_start":
            step_ends.clear()
            gen[:] = [asyncio.create_task(generate(k)) for k in range(gen_requests)]
            await until_steps(6)
            conn.send(("gen_ready", {}))
        elif cmd == "gen_stop":
            await until_steps(2)  # the first step after the swap has ended
            for t in gen:
                t.cancel()
            await asyncio.gather(*gen, return_exceptions=True)
            t0, t1 = window
            ends = list(step_ends)
            gaps = [(a, b) for a, b in zip(ends, ends[1:])]
            during = [b - a for a, b in gaps if b > t0 and a < t1]
            before = [b - a for a, b in gaps if b <= t0]
            conn.send(("pause", {"pause_s": max(during) if during else t1 - t0,
                                 "step_s": statistics.median(before) if before else float("nan"),
                                 "swap_s": engine.stats()["last_update_s"], "steps_during": len(during)}))
        elif cmd == "trim":
            release()
            conn.send(("trimmed", {}))
        elif cmd == "stop":
            await loader.close()
            await engine.close()
            conn.send(("stopped", {}))
            return


# -------------------------------------------------------------------------------------------------------- parent

class Fleet:
    """The parent's side of N worker processes: commands out, replies into one queue per worker."""

    def __init__(self, n: int, model_dir: str, a: argparse.Namespace) -> None:
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for i in range(n):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(i, model_dir, theirs, a.timeout, a.gen_requests), daemon=True)
            p.start()
            self.conns.append(mine)
            self.procs.append(p)
        self.queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(n)]
        self.readers = [asyncio.create_task(self._read(i)) for i in range(n)]

    async def _read(self, i: int) -> None:
        while True:
            try:
                msg = await asyncio.to_thread(self.conns[i].recv)
            except EOFError:
                await self.queues[i].put(("died", {}))
                return
            await self.queues[i].put(msg)
            if msg[0] == "stopped":
                return

    def send(self, cmd: str, arg: Any = None, to: Optional[int] = None) -> None:
        for i, c in enumerate(self.conns):
            if to is None or i == to:
                c.send((cmd, arg))

    async def replies(self, kind: str, timeout: float) -> list[dict]:
        """One `kind` reply from every worker."""
        async def one(i: int) -> dict:
            got, payload = await self.queues[i].get()
            if got != kind:
                raise RuntimeError(f"worker {i}: expected {kind!r}, got {got!r} {payload}")
            return payload

        return list(await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(len(self.conns)))), timeout))

    async def stop(self) -> None:
        self.send("stop")
        try:
            await self.replies("stopped", 120)
        finally:
            for p in self.procs:
                await asyncio.to_thread(p.join, 30)
                if p.is_alive():
                    p.kill()
            for r in self.readers:
                r.cancel()


async def bench_transports(a: argparse.Namespace, learner: Learner, model_dir: str, weights_dir: str,
                           n: int) -> dict[str, Any]:
    """disk and broadcast to `n` worker processes: idle timings, then the in-flight pause while they generate."""
    from arl.learner.export import tied_aliases
    from arl.weights.sender import WeightSender
    from arl.weights.channel import WeightPublisher

    fleet = Fleet(n, model_dir, a)
    sender = WeightSender(LOOPBACK, 0, backend="gloo", timeout_s=a.timeout, gloo_host=LOOPBACK)
    pub = WeightPublisher(sender, protocol="arl", bucket_bytes=int(a.bucket_mb) << 20)
    run = asyncio.create_task(pub.run())
    skip = tied_aliases(model_dir)
    out: dict[str, Any] = {}
    try:
        await fleet.replies("ready", a.timeout)
        names = [f"arl-weights-s{i}-1" for i in range(n)]  # the controller's names: one group per server
        for i, name in enumerate(names):
            fleet.send("join", sender.spec(name).to_dict(), to=i)
        await asyncio.gather(*(pub.open_group(name, i) for i, name in enumerate(names)))
        if sorted(sender.groups) != sorted(names):
            raise RuntimeError(f"groups formed: {sender.groups}, wanted {names}")
        old_file: list[str] = []

        async def disk() -> dict[str, float]:
            learner.version += 1
            v = learner.version
            path = os.path.join(weights_dir, f"v{v}.safetensors")
            t0 = time.monotonic()
            await asyncio.to_thread(learner.export_weights, path)
            t1 = time.monotonic()
            fleet.send("update", ("disk", v, path))
            acks = await fleet.replies("ack", a.timeout)
            t2 = time.monotonic()
            assert all(x["version"] == v for x in acks), acks
            for f in old_file:  # what the learner prunes once no server reads it again
                os.unlink(f)
            old_file[:] = [path]
            return {"s": t2 - t0, "write_s": t1 - t0, "load_s": t2 - t1, "bytes": os.path.getsize(path)}

        async def broadcast() -> dict[str, float]:
            learner.version += 1
            v = learner.version
            t0 = time.monotonic()
            sd = await asyncio.to_thread(learner.full_state_dict, False)  # live parameters, no copy ...
            sd = {k: t for k, t in sd.items() if k not in skip}  # ... without tied aliases (LearnerWorker._state_dict)
            t1 = time.monotonic()
            fleet.send("update", ("broadcast", v, ""))  # the controller's UpdateWeights (empty path) ...
            await pub.set_newest(v, sd)  # ... the learner packs after weights_published, before its next step ...
            t_pack = time.monotonic()
            pub.request(v, list(range(n)))  # ... and the controller's SendWeights
            del sd
            acks = await fleet.replies("ack", a.timeout)
            t2 = time.monotonic()
            assert all(x["version"] == v for x in acks), acks
            bytes_ = pub.newest[1].plan.total_bytes if pub.newest else 0
            if pub.stats["weight_send_failures"]:
                raise RuntimeError(f"broadcast failed: {pub.stats}")
            return {"s": t2 - t0, "gather_s": t1 - t0, "pack_s": t_pack - t1, "send_s": t2 - t_pack,
                    "bytes": bytes_, "sender_s": pub.stats["weight_send_s_last"]}

        async def timed(fn: Any) -> dict[str, float]:
            """One version, then every process gives freed memory back (outside the clock): tensors freed on
            another thread than the one that allocated them stay in that thread's glibc arena otherwise, and a
            copy of the model per version piles up (see `release`)."""
            r = await fn()
            release()
            fleet.send("trim")
            await fleet.replies("trimmed", a.timeout)
            return r

        for mode, fn in (("disk", disk), ("broadcast", broadcast)):
            await timed(fn)  # warm-up: first allocations, first file
            idle = [await timed(fn) for _ in range(a.repeat)]
            busy = []
            for _ in range(a.repeat):
                fleet.send("gen_start")
                await fleet.replies("gen_ready", a.timeout)
                t = await timed(fn)
                fleet.send("gen_stop")
                p = await fleet.replies("pause", a.timeout)
                busy.append({**t, "pause_s": max(x["pause_s"] for x in p), "step_s": max(x["step_s"] for x in p),
                             "swap_s": max(x["swap_s"] for x in p)})
            out[mode] = summarize(idle, busy)
        for f in old_file:
            os.unlink(f)
    finally:
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        await fleet.stop()
        pub.close()
    return out


def summarize(idle: list[dict], busy: list[dict]) -> dict[str, Any]:
    med = {k: statistics.median(r[k] for r in idle) for k in idle[0]}
    res = {**med, "gbps": med["bytes"] / med["s"] / GB, "times": [r["s"] for r in idle]}
    for k in ("pause_s", "step_s", "swap_s"):
        res[k] = statistics.median(r[k] for r in busy)
    res["busy_s"] = statistics.median(r["s"] for r in busy)
    return res


def bare_receiver(port: int, rank: int, world: int, nbytes: int, repeat: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{LOOPBACK}:{port}", rank=rank, world_size=world)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(repeat + 1):
        dist.broadcast(buf, src=0)
    dist.destroy_process_group()


def bench_bare(n: int, nbytes: int, repeat: int) -> dict[str, Any]:
    """One torch.distributed.broadcast of `nbytes` from this process to `n` receiver processes."""
    import torch.distributed as dist

    port, world = free_port(), n + 1
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=bare_receiver, args=(port, r, world, nbytes, repeat)) for r in range(1, world)]
    for p in procs:
        p.start()
    dist.init_process_group("gloo", init_method=f"tcp://{LOOPBACK}:{port}", rank=0, world_size=world)
    buf = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dist.broadcast(buf, src=0)  # warm-up: connections
    times = []
    for _ in range(repeat):
        t0 = time.monotonic()
        dist.broadcast(buf, src=0)
        times.append(time.monotonic() - t0)
    for p in procs:
        p.join()
    dist.destroy_process_group()
    s = statistics.median(times)
    return {"s": s, "bytes": nbytes, "gbps": nbytes / s / GB, "times": times}


def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def fits(model_bytes: int, n: int) -> tuple[bool, float, float]:
    """Whether a case fits beside the learner's model: its export (a copy, and safetensors' bytes of it) + per
    worker its model and a second one during a load, 0.5 GB per process and 1 GB to spare."""
    import psutil

    need = model_bytes * (2 + 2 * n) + n * 0.5e9 + 1e9
    have = psutil.virtual_memory().available
    return need < have, need / GB, have / GB


# -------------------------------------------------------------------------------------------------------- report

def fmt_row(model: str, n: int, path: str, r: dict[str, Any]) -> str:
    if path in ("disk", "lora-disk"):
        parts = f"write {r['write_s']:.3f} + load {r['load_s']:.3f}"
    elif path in ("broadcast", "lora-bcast"):
        parts = (f"gather {r['gather_s']:.3f} + pack {r['pack_s']:.3f} + send {r['send_s']:.3f} "
                 f"(WeightSender.send {r['sender_s']:.3f})")
    else:
        parts = ""
    pause = (f"{r['pause_s'] * 1e3:9.1f} {r['step_s'] * 1e3:8.1f} {r['swap_s'] * 1e3:7.1f}" if "pause_s" in r
             else f"{'':9} {'':8} {'':7}")
    return (f"{model:6} {n:3} {path:10} {r['bytes'] / 2**20:9.1f} {r['s']:9.3f} {r['gbps']:7.3f}   {pause}   "
            f"{parts}")


HEADER = (f"{'model':6} {'wk':>3} {'path':10} {'MiB/wk':>9} {'s':>9} {'GB/s':>7}   {'pause ms':>9} {'step ms':>8} "
          f"{'swap ms':>7}   parts (s)")


async def amain(a: argparse.Namespace) -> dict[str, Any]:
    import platform

    torch.set_num_threads(1)
    quiet()
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(32))  # a thread per worker stays on its pipe
    import safetensors

    print(f"# {platform.machine()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, torch "
          f"{torch.__version__}, safetensors {safetensors.__version__}, gloo over {LOOPBACK}, bucket {a.bucket_mb} "
          f"MiB, median of {a.repeat}", flush=True)
    print("# s: publish start -> every worker acked (idle workers); pause: longest gap between decode steps "
          "overlapping an update while generating; step: median gap before it; swap: the engine's swap", flush=True)
    print(HEADER, flush=True)
    results: dict[str, Any] = {"args": vars(a), "cases": []}
    with tempfile.TemporaryDirectory(prefix="arl-bench-weights-", dir=a.dir) as tmp:
        for name in a.models:
            model_dir = os.path.join(tmp, f"model-{name}")
            model = make_model_dir(name, a.vocab_05b, model_dir)
            learner = Learner(model)
            params = sum(p.numel() for p in model.parameters())
            model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            print(f"# {name}: {params / 1e6:.1f}M parameters, {model_bytes / 2**20:.1f} MiB fp32 "
                  f"({model_shape(name, a.vocab_05b)})", flush=True)
            for n in a.workers:
                release()
                ok, need, have = fits(model_bytes, n)
                case: dict[str, Any] = {"model": name, "workers": n, "params": params}
                if not ok:
                    print(f"# {name} x {n}: skipped, needs ~{need:.1f} GB, {have:.1f} GB available (this process: "
                          f"{rss() / GB:.1f} GB)", flush=True)
                    case["skipped"] = f"memory: needs ~{need:.1f} GB, {have:.1f} GB available"
                    results["cases"].append(case)
                    continue
                weights_dir = os.path.join(tmp, "weights")
                os.makedirs(weights_dir, exist_ok=True)
                case.update(await bench_transports(a, learner, model_dir, weights_dir, n))
                case["bare"] = await asyncio.to_thread(bench_bare, n, int(case["broadcast"]["bytes"]), a.repeat)
                for path in ("disk", "broadcast", "bare"):
                    print(fmt_row(name, n, path, case[path]), flush=True)
                results["cases"].append(case)
            if a.lora_rank > 0:  # the same model, adapters on q/k/v/o: only they travel
                model = wrap_lora(model, a.lora_rank)
                learner = Learner(model, lora=True)
                for case in results["cases"]:
                    if case["model"] != name or "bare" not in case:
                        continue
                    weights_dir = os.path.join(tmp, "weights")
                    lora = await bench_transports(a, learner, model_dir, weights_dir, case["workers"])
                    case["lora-disk"], case["lora-bcast"] = lora["disk"], lora["broadcast"]
                    for path in ("lora-disk", "lora-bcast"):
                        print(fmt_row(name, case["workers"], path, case[path]), flush=True)
            del learner, model
            release()
    dump(a, results)
    done = [c for c in results["cases"] if "bare" in c]
    if not done:
        print("broadcast: n/a (every case skipped)")
        return results
    head = max(done, key=lambda c: (c["params"], c["workers"]))
    ratio = head["bare"]["s"] / head["broadcast"]["s"]
    disk = head["bare"]["s"] / head["disk"]["s"] * head["disk"]["bytes"] / head["bare"]["bytes"]
    results["headline"] = {"model": head["model"], "workers": head["workers"], "broadcast_of_bare": ratio,
                           "disk_of_bare": disk}
    print(f"# {head['model']}, {head['workers']} workers: in-flight pause disk {head['disk']['pause_s'] * 1e3:.1f} ms, "
          f"broadcast {head['broadcast']['pause_s'] * 1e3:.1f} ms (median step {head['broadcast']['step_s'] * 1e3:.1f}"
          f" ms); disk (page cache, not the bar): {disk * 100:.0f}% of bare broadcast GB/s")
    dump(a, results)
    print(f"broadcast: {ratio * 100:.0f}% of bare broadcast", flush=True)
    if "lora-disk" in head:
        lora = {k: (head[full]["bytes"] / head[k]["bytes"], head[full]["s"] / head[k]["s"])
                for k, full in (("lora-disk", "disk"), ("lora-bcast", "broadcast"))}
        results["headline"]["lora"] = lora
        dump(a, results)
        print(f"# {head['model']}, {head['workers']} workers, rank {a.lora_rank} on q/k/v/o: broadcast "
              f"{lora['lora-bcast'][0]:.0f}x fewer bytes, {lora['lora-bcast'][1]:.1f}x faster than full")
        print(f"lora update: {lora['lora-disk'][0]:.0f}x fewer bytes, {lora['lora-disk'][1]:.1f}x faster than full",
              flush=True)
    return results


def dump(a: argparse.Namespace, results: dict[str, Any]) -> None:
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,0.5b", help="comma-separated: tiny, 0.5b")
    ap.add_argument("--workers", default="1,4", help="comma-separated numbers of inference worker processes")
    ap.add_argument("--repeat", type=int, default=3, help="timed updates per path (median), and as many for the pause")
    ap.add_argument("--quick", action="store_true", help="tiny model, 1 worker, 1 repeat (the smoke test)")
    ap.add_argument("--vocab-05b", type=int, default=32768, help="vocabulary of the 0.5b model (Qwen's: 151936)")
    ap.add_argument("--bucket-mb", type=int, default=64, help="weights.bucket_mb")
    ap.add_argument("--gen-requests", type=int, default=2, help="requests each worker keeps generating for the pause")
    ap.add_argument("--timeout", type=float, default=600.0, help="weights.timeout_s, and every wait here")
    ap.add_argument("--dir", default=None, help="where the weight files go (default: the system temp folder)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--lora-rank", type=int, default=16, help="LoRA rows: adapters of this rank on q/k/v/o (0: none)")
    a = ap.parse_args()
    if a.quick:
        a.models, a.workers, a.repeat = "tiny", "1", 1
    a.models = [m.strip() for m in a.models.split(",") if m.strip()]
    a.workers = [int(w) for w in a.workers.split(",")]
    for m in a.models:
        model_shape(m, a.vocab_05b)
    asyncio.run(amain(a))


if __name__ == "__main__":
    main()
