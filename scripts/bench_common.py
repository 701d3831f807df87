"""Shared by the benchmark scripts: run an experiment through the real launcher (the Controller spawning every role
as its own process) while sampling the controller's view of the roles and every process's CPU and memory.

Why not `run_experiment`: the benchmarks need a measurement window (from the moment the staleness gate opens to
the last training step, or a fixed duration) and the roles' counters at its edges, which only the controller
object holds. Everything else is the launcher's own code path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import platform
import sys
import time
from typing import Any, Awaitable, Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from arl.config import ExperimentConfig, to_yaml  # noqa: E402


def machine() -> str:
    load = os.getloadavg()
    return (f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores, Python "
            f"{platform.python_version()}, load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} at start")


def tokenizer_dir(root: str) -> str:
    """A model directory holding only the tiny char tokenizer: what the sim roles need (no weights)."""
    path = os.path.join(root, "sim-tokenizer")
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        from arl.models.tiny import build_char_tokenizer

        build_char_tokenizer().save_pretrained(path)
    return path


def make_config(overrides: list[str]) -> ExperimentConfig:
    """The config `python training/main_async_ppo.py *overrides` would run (same experiments, same imports)."""
    from arl.cli import load_config
    from experiments import MODULES

    return load_config(overrides, MODULES)


@dataclasses.dataclass
class RunRecord:
    run_dir: str
    metrics: list[dict]
    samples: list[dict]
    t_open: Optional[float]  # monotonic time the gate first admitted a group
    t_end: float
    summary: dict
    error: str = ""

    def train(self) -> list[dict]:
        return [m for m in self.metrics if m.get("type") == "train"]


def _role_pids(launcher: Any) -> dict[str, int]:
    """Role process -> pid: a local launcher's children, or (launcher=ray on this host) each role's process as
    its Ray actor reports it (asked once per incarnation)."""
    if hasattr(launcher, "children"):
        return {name: child.proc.pid for name, child in list(launcher.children.items())}
    import ray

    cache = launcher.__dict__.setdefault("_bench_pids", {})
    out = {}
    for role in list(launcher.roles.values()):
        for h in role.hosts:
            if h.finished:
                continue
            if id(h) not in cache:
                try:
                    cache[id(h)] = ray.get(h.actor.pid.remote(), timeout=10)
                except Exception:  # noqa: BLE001 - not started yet or gone: sampled next time
                    continue
            out[h.name] = cache[id(h)]
    return out


def _proc_stats(ctl: Any) -> dict[str, dict]:
    import psutil

    out = {}
    me = psutil.Process()
    ct = me.cpu_times()
    out["controller"] = {"cpu": ct.user + ct.system, "rss": me.memory_info().rss}
    for name, pid in _role_pids(ctl.launcher).items():
        try:
            p = psutil.Process(pid)
            ct = p.cpu_times()
            out[name] = {"cpu": ct.user + ct.system, "rss": p.memory_info().rss}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def _snapshot(ctl: Any, with_procs: bool) -> dict:
    roles = {}
    for (role, idx), st in list(ctl.role_stats.items()):
        keep = {k: st[k] for k in ("busy_s", "uptime", "running", "tokens_generated", "requests_done", "decode_steps",
                                   "admission_hist", "idle_seconds", "train_seconds", "steps", "prompt_tokens",
                                   "prefix_hit_tokens", "prefill_tokens", "cache_flushes", "client") if k in st}
        roles[f"{role}{idx}"] = keep
    snap = {"t": time.monotonic(), "started": ctl.gate.started, "accepted": ctl.gate.accepted,
            "version": ctl.gate.version, "running": ctl.gate.running, "roles": roles}
    if with_procs:
        snap["procs"] = _proc_stats(ctl)
    return snap


async def run_monitored(cfg: ExperimentConfig, run_dir: str, *, sample_every: float = 0.5,
                        proc_every: float = 2.0, duration: Optional[float] = None,
                        timeout: float = 3600.0, during: Optional[Callable[[Any], Awaitable[None]]] = None
                        ) -> RunRecord:
    """Run `cfg` through the Controller; with `duration`, stop that many seconds after the gate opened. `during(ctl)`:
    a coroutine started once the gate opened (e.g. `arl.ctl scale` calls); when it returns, the run ends as a
    finished one does (its summary record written)."""
    from arl.launch.run import close_launcher, make_controller

    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        f.write(to_yaml(cfg))
    ctl = make_controller(cfg, run_dir, progress=False)
    ctl.bind()
    samples: list[dict] = []
    state: dict[str, Any] = {"t_open": None}
    opened = asyncio.Event()

    async def sampler() -> None:
        last_procs = -math.inf
        while True:
            now = time.monotonic()
            with_procs = now - last_procs >= proc_every
            if with_procs:
                last_procs = now
            snap = _snapshot(ctl, with_procs)
            samples.append(snap)
            if state["t_open"] is None and snap["started"] > 0:
                state["t_open"] = snap["t"]
                opened.set()
            await asyncio.sleep(sample_every)

    error = ""
    summary: dict = {}
    ctl.spawn_roles()
    run_task = asyncio.create_task(ctl.run())
    sample_task = asyncio.create_task(sampler())

    async def driver() -> None:
        await opened.wait()
        await during(ctl)
        ctl._done.set()

    drive_task = asyncio.create_task(driver()) if during is not None else None
    try:
        if duration is None:
            summary = await asyncio.wait_for(run_task, timeout)
        else:
            waiter = asyncio.create_task(opened.wait())
            done, _ = await asyncio.wait({run_task, waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if waiter in done:
                done, _ = await asyncio.wait({run_task}, timeout=duration)
            waiter.cancel()
            if run_task in done:
                summary = run_task.result()
            else:
                run_task.cancel()
                await asyncio.gather(run_task, return_exceptions=True)
    except Exception as e:  # noqa: BLE001 - report it with whatever was measured
        error = f"{type(e).__name__}: {e}"
    finally:
        samples.append(_snapshot(ctl, True))
        t_end = time.monotonic()
        for t in (sample_task, drive_task):
            if t is not None:
                t.cancel()
                await asyncio.gather(t, return_exceptions=True)
        if not run_task.done():
            run_task.cancel()
            await asyncio.gather(run_task, return_exceptions=True)
        await ctl.shutdown(grace=5.0)
        await asyncio.to_thread(close_launcher, ctl.launcher)  # launcher=ray: actors, groups, the log thread
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f if line.strip()]
    return RunRecord(run_dir=run_dir, metrics=metrics, samples=samples, t_open=state["t_open"], t_end=t_end,
                     summary=summary, error=error)


def nearest(samples: list[dict], t: float, key: str = "roles") -> dict:
    """The sample closest to monotonic time `t` that has `key`."""
    have = [s for s in samples if key in s]
    return min(have, key=lambda s: abs(s["t"] - t)) if have else {}


def inference_busy(rec: RunRecord, t0: float, t1: float) -> tuple[float, float]:
    """Mean busy fraction of the inference servers over [t0, t1] (from their heartbeats' busy_s and uptime) and
    the mean batch (tokens generated per decode step, where the engine reports decode steps)."""
    a, b = nearest(rec.samples, t0), nearest(rec.samples, t1)
    fracs, tokens, steps = [], 0.0, 0.0
    for name, st in b.get("roles", {}).items():
        if not name.startswith("inference") or "busy_s" not in st:
            continue
        st0 = a.get("roles", {}).get(name)
        if not st0 or st["uptime"] <= st0["uptime"]:
            continue
        fracs.append(min(1.0, (st["busy_s"] - st0["busy_s"]) / (st["uptime"] - st0["uptime"])))
        tokens += st.get("tokens_generated", 0) - st0.get("tokens_generated", 0)
        steps += st.get("decode_steps", 0) - st0.get("decode_steps", 0)
    return (sum(fracs) / len(fracs) if fracs else math.nan), (tokens / steps if steps else math.nan)


def fmt_bytes(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"
