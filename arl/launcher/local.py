"""Run one experiment on this machine: prepare the run directory and model, then hand over to the controller."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys
import time
from typing import Any

from arl.config import ExperimentConfig, to_yaml
from arl.launcher.controller import Controller, RunFailed

logger = logging.getLogger("arl.launcher")


def check_names(cfg: ExperimentConfig) -> None:
    """Fail before any process starts if the agent or env name is unknown (the error lists the registered ones)."""
    from arl.api.registry import AGENTS, ENVS

    AGENTS.get(cfg.agent.name)
    ENVS.get(cfg.env.name)


def make_run_dir(cfg: ExperimentConfig) -> str:
    name = cfg.run_name or f"{cfg.experiment}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    run_dir = os.path.abspath(os.path.join(os.path.expanduser(cfg.run_dir), name))
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    return run_dir


def prepare_model(cfg: ExperimentConfig) -> str:
    """The model directory every role loads: the configured one, or the cached warm tiny model."""
    if cfg.model.path:
        if not os.path.isdir(cfg.model.path):
            raise FileNotFoundError(f"model.path {cfg.model.path!r} is not a directory")
        return os.path.abspath(cfg.model.path)
    from arl.models.warmup import get_warm_model

    return get_warm_model(
        os.path.expanduser(cfg.model.cache_dir),
        seed=0,
        target_acc=cfg.model.warmup_target_acc,
        max_steps=cfg.model.warmup_max_steps,
        max_operand=cfg.dataset.max_operand,
        test_size=cfg.dataset.test_size,
        num_threads=1,  # more threads than free cores slows torch 10-40x when the machine is busy (DESIGN.md)
    )


async def _run(cfg: ExperimentConfig, run_dir: str) -> dict:
    ctl = Controller(
        run_dir=run_dir,
        num_inference=cfg.inference.num_workers,
        num_rollout=cfg.rollout.num_workers,
        batch_size=cfg.learner.batch_size,
        max_head_offpolicyness=cfg.max_head_offpolicyness,
        max_concurrent_rollouts=cfg.rollout.max_concurrent_rollouts,
        total_train_steps=cfg.total_train_steps,
        eval_every=cfg.eval.every_n_steps,
        eval_max_prompts=cfg.eval.max_prompts,
        startup_timeout=cfg.startup_timeout,
        progress=cfg.progress,
    )
    ctl.bind()
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    interrupted = False

    def on_signal() -> None:
        nonlocal interrupted
        interrupted = True
        logger.warning("interrupted: stopping every role")
        if main_task is not None:
            main_task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        ctl.spawn_roles()
        return await ctl.run()
    except asyncio.CancelledError:
        if interrupted:
            raise KeyboardInterrupt from None
        raise
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await ctl.shutdown(grace=5.0)


def run_experiment(cfg: ExperimentConfig) -> dict[str, Any]:
    """Run to completion; raises RunFailed (with the failing role's log tail) or KeyboardInterrupt."""
    check_names(cfg)
    run_dir = make_run_dir(cfg)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=prepare_model(cfg)))
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        f.write(to_yaml(cfg))
    print(f"run directory: {run_dir}", file=sys.stderr, flush=True)
    return asyncio.run(_run(cfg, run_dir))


__all__ = ["run_experiment", "RunFailed", "check_names"]
