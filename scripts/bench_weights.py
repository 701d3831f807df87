"""Weights over broadcast: `WeightSender` -> N receivers vs a bare torch.distributed broadcast of the same bytes.

    python scripts/bench_weights.py [--mb 64] [--receivers 2] [--shared] [--bucket-mb 64] [--wire float16]
        [--backend gloo|nccl] [--repeat 3]

Each receiver is a process. ``arl``: the sender's full protocol (plan in the store, refusal and completion
all-reduces, buckets packed from a state dict of 1 MB tensors, received into a model-sized dict in place), to one
group per receiver (default) or one shared group. ``bare``: the same total bytes as one flat tensor, one
``torch.distributed.broadcast`` in a plain ``init_process_group`` world. GB/s = payload bytes per receiver / s.
With nccl, each receiver takes GPU ``rank % device_count`` (NCCL wants distinct GPUs per rank).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from arl.utils.net import free_port  # noqa: E402
from arl.weights.broadcast import GroupSpec, WeightReceiver, WeightSender, make_plan  # noqa: E402


def state_dict(mb: int, device: str) -> dict[str, torch.Tensor]:
    """`mb` MB of float32 in 1 MB tensors (a model's many parameters, not one blob)."""
    return {f"p{i}": torch.randn(1 << 18, device=device) for i in range(mb)}


def _device(backend: str, rank: int) -> str:
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return f"cuda:{rank % torch.cuda.device_count()}"
    return "cpu"


def arl_receiver(spec: dict, mb: int, repeat: int, backend: str) -> None:
    torch.set_num_threads(1)
    dev = _device(backend, spec["rank"])
    target = {k: torch.empty_like(v) for k, v in state_dict(mb, dev).items()}
    rx = WeightReceiver(GroupSpec.from_dict(spec), timeout_s=300, device=dev)
    rx.join()
    for _ in range(repeat):
        rx.receive_into(target)
    rx.close()


def bare_receiver(port: int, rank: int, world: int, nbytes: int, repeat: int, backend: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dev = _device(backend, rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    for _ in range(repeat + 1):
        dist.broadcast(buf, src=0)
    dist.destroy_process_group()


def bench_arl(a: argparse.Namespace) -> dict[str, Any]:
    dev = _device(a.backend, 0)
    sd = state_dict(a.mb, dev)
    plan = make_plan(sd, wire_dtype=a.wire, bucket_bytes=int(a.bucket_mb * (1 << 20)))
    sender = WeightSender("127.0.0.1", 0, backend=a.backend, timeout_s=300, device=dev)
    ctx = mp.get_context("spawn")
    if a.shared:
        groups = {"all": [sender.spec("all", world_size=a.receivers + 1, rank=r).to_dict()
                          for r in range(1, a.receivers + 1)]}
    else:
        groups = {f"w{i}": [sender.spec(f"w{i}").to_dict()] for i in range(a.receivers)}
    procs = [ctx.Process(target=arl_receiver, args=(s, a.mb, a.repeat, a.backend)) for ss in groups.values()
             for s in ss]
    for p in procs:
        p.start()
    for name, specs in groups.items():
        sender.open_group(name, len(specs) + 1)
    times = []
    for v in range(a.repeat):
        t0 = time.perf_counter()
        sender.send(v, sd, plan=plan)
        times.append(time.perf_counter() - t0)
    for p in procs:
        p.join()
    sender.close()
    best = min(times)
    return {"mode": "arl", "bytes": plan.total_bytes, "best_s": best, "gbps": plan.total_bytes / best / 1e9,
            "times": times}


def bench_bare(a: argparse.Namespace, nbytes: int) -> dict[str, Any]:
    import torch.distributed as dist

    port, world = free_port(), a.receivers + 1
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=bare_receiver, args=(port, r, world, nbytes, a.repeat, a.backend))
             for r in range(1, world)]
    for p in procs:
        p.start()
    dev = _device(a.backend, 0)
    dist.init_process_group(a.backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=world)
    buf = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
    dist.broadcast(buf, src=0)  # warm-up: connections
    times = []
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        dist.broadcast(buf, src=0)
        if a.backend == "nccl":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    for p in procs:
        p.join()
    dist.destroy_process_group()
    best = min(times)
    return {"mode": "bare", "bytes": nbytes, "best_s": best, "gbps": nbytes / best / 1e9, "times": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=64, help="MB of float32 weights")
    ap.add_argument("--receivers", type=int, default=2)
    ap.add_argument("--shared", action="store_true", help="one group for all receivers (default: one each)")
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--wire", default=None, help="wire dtype for floats, e.g. float16")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    arl = bench_arl(a)
    bare = bench_bare(a, arl["bytes"])
    print(json.dumps({"args": vars(a), "arl": arl, "bare": bare, "arl_over_bare": arl["gbps"] / bare["gbps"]},
                     indent=2))


if __name__ == "__main__":
    main()
