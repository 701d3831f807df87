"""Entry point of every role process: `python -m arl.launch.role --role R --index I --run-dir D --controller A`.

It reads the run's config.yaml, imports the user's modules (so their register_* calls happen here too), sets the
torch thread count, builds the role from its entry (`arl.inference.entry`, `arl.learner.entry`,
`arl.rollout.entry`) and runs it until the controller says stop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from typing import Awaitable, Optional

from arl.config import ExperimentConfig, import_user_modules, resolve_threads
from arl.inference.entry import run_inference, run_judge
from arl.learner.entry import learner_actor, run_learner
from arl.rollout.entry import run_rollout
from arl.rollout.env_server import run_env_server
from arl.transport.control import SOCKET_OPTIONS, ControlChannel
from arl.transport.loop import run as run_loop
from arl.transport.messages import Error, Leaving
from arl.transport.security import effective_bind_host, resolve_secret
from arl.utils.fingerprint import run_fingerprint
from arl.utils.forensics import install_stack_dump_handler

logger = logging.getLogger("arl.worker")


ROLES = {"inference": run_inference, "learner": run_learner, "rollout": run_rollout, "env": run_env_server,
         "judge": run_judge}


async def amain(cfg: ExperimentConfig, role: str, index: int, controller: str, run_dir: str) -> int:
    # what this process runs, for the controller to compare with the run's (`arl.utils.fingerprint`)
    ctl = ControlChannel(controller, role, index, run_fingerprint(os.path.join(run_dir, "config.yaml"),
                                                                  cfg.model.path))
    ctl_task = asyncio.create_task(ctl.loop())
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, ctl.stopped.set)
    if role in ("inference", "rollout"):  # a preemption notice: leave by being drained, not by dying (docs/routing.md)
        leaving: list[bool] = []

        def preempted() -> None:
            if ctl.stopped.is_set() or leaving:  # the run is ending, or a second notice: stop now
                ctl.stopped.set()
                return
            leaving.append(True)
            grace = cfg.inference.drain_timeout_s if role == "inference" else cfg.rollout.drain_timeout_s
            logger.warning("%s%d: SIGTERM: asking to be drained (stopping in %.0fs at the latest)", role, index, grace)
            loop.create_task(ctl.post(Leaving(grace_s=grace)))
            loop.call_later(grace + 5.0, ctl.stopped.set)

        loop.add_signal_handler(signal.SIGTERM, preempted)
    cleanups: list[Awaitable] = []
    tasks: list[asyncio.Task] = []
    try:
        coros, cleanups = await ROLES[role](cfg, ctl, index, run_dir)
        tasks = [asyncio.create_task(c) for c in coros]
        stop = asyncio.create_task(ctl.stopped.wait())
        done, _ = await asyncio.wait([*tasks, stop], return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if t is not stop and t.exception() is not None:
                raise t.exception()
        if stop not in done:  # a role task finished by itself (the learner's train loop): wait to be stopped
            await ctl.stopped.wait()
        return 0
    except Exception as e:
        logger.exception("%s%d failed", role, index)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(ctl.post(Error(message=f"{role}{index}: {type(e).__name__}: {e}")), 1.0)
        return 1
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in cleanups:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(c, 5.0)
        ctl_task.cancel()
        ctl.dealer.close()


def load_run_config(path: str) -> ExperimentConfig:
    """A run's config.yaml, as its experiment's config class, after the builtins and the modules it imports
    (the experiment's own module is one, see arl.cli) registered what they define."""
    from omegaconf import OmegaConf

    from arl.api.registry import EXPERIMENTS
    from arl.builtin import load_builtins

    raw = OmegaConf.load(path)
    load_builtins()
    import_user_modules(list(raw.get("imports", [])))
    cls = EXPERIMENTS.get(str(raw.get("experiment", "async-ppo-math")))
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), raw))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", required=True, choices=sorted(ROLES))
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--controller", required=True)
    args = ap.parse_args(argv)
    name = f"{args.role}{args.index}"
    ranked = args.role == "learner" and int(os.environ.get("WORLD_SIZE", "1")) > 1  # learner under torchrun
    if ranked:
        from arl.utils.proc import die_with_parent

        die_with_parent()  # torchrun starts each rank in a session of its own: die with torchrun
        name += f"-rank{os.environ.get('RANK', '?')}"
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
    cfg = load_run_config(os.path.join(args.run_dir, "config.yaml"))
    install_stack_dump_handler()  # SIGUSR1 -> every thread's stack in this role's log (the controller asks)
    SOCKET_OPTIONS.update(secret=resolve_secret(cfg.secret, effective_bind_host(cfg.bind_host)),
                          max_bytes=cfg.max_message_bytes)
    threads = resolve_threads(cfg, args.role)
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)
    logger.info("starting %s%d (pid %d, %d torch threads%s)", args.role, args.index, os.getpid(), threads,
                f", busy poll {cfg.busy_poll_us:g} us" if cfg.busy_poll_us > 0 else "")
    t0 = time.monotonic()
    if ranked and int(os.environ["RANK"]) > 0:
        # rank 0 runs the role; this rank builds the same engine and actor (DeepSpeed's collectives line up),
        # resumes like rank 0, then runs rank 0's commands until it says stop (see `arl.learner.ranks`)
        from arl.learner.ranks import follow

        actor, _ = learner_actor(cfg)
        logger.info("learner rank %d done after %d steps", actor.engine.rank, follow(actor))
        return 0
    code = run_loop(amain(cfg, args.role, args.index, args.controller, args.run_dir), cfg.busy_poll_us)
    logger.info("%s%d exiting with %d after %.1fs", args.role, args.index, code, time.monotonic() - t0)
    return code


if __name__ == "__main__":
    sys.exit(main())
