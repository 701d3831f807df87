"""Run one experiment on this machine: prepare the run directory and model, then hand over to the controller."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import os
import secrets
import signal
import sys
import time
from typing import Any, Optional

from arl.config import (ExperimentConfig, LauncherKind, auto_eta, judge_workers, resolve_weights, staleness_policy,
                        to_yaml, trainable_policies, weights_settings)
from arl.controller.autoscale import AutoscalePolicy
from arl.controller.shell import Controller, RunFailed
from arl.controller.steering import StalenessSteering
from arl.utils.errors import ConfigError
from arl.utils.fingerprint import run_fingerprint
from arl.launch.local import LocalLauncher
from arl.transport.security import SECRET_ENV, effective_bind_host, is_loopback, resolve_secret
from arl.controller.supervision import RoleLauncher, Supervisor
from arl.report.trackers import make_sinks

logger = logging.getLogger("arl.launch")


def check_names(cfg: ExperimentConfig) -> None:
    """Fail before any process starts if the agent or env name is unknown (the error lists the registered ones), or
    an env's args or the reasoning-gym task names are refused (an unknown gymnasium or GEM id, task name)."""
    from arl.api.registry import AGENTS, ENVS

    AGENTS.get(cfg.agent.name)
    if cfg.rollout.tool_parser != "auto":
        from arl.tools.parsers import PARSERS

        try:
            PARSERS.get(cfg.rollout.tool_parser)
        except KeyError as e:
            raise ConfigError(f"rollout.tool_parser: {e.args[0]}") from None
    envs = {cfg.env.name: dict(cfg.env.args)}
    for spec in dict(cfg.rollout.env_configs).values():  # env groups' tags: {name, args}
        if isinstance(spec, dict) and spec.get("name"):
            envs[str(spec["name"])] = dict(spec.get("args") or {})
    for name, args in envs.items():  # an env class's own static `check(**args)` refuses bad args (an unknown id)
        cls = ENVS.get(name)
        if isinstance(inspect.getattr_static(cls, "check", None), (staticmethod, classmethod)):
            check = getattr(cls, "check")
            try:
                check(**args)
            except (ValueError, ImportError) as e:
                raise ConfigError(f"env {name!r}: {e}") from None
    if cfg.dataset.name == "reasoning-gym":
        from arl.envs.reasoning_gym_env import check_tasks

        try:
            check_tasks(list(cfg.dataset.tasks))
        except (ValueError, ImportError) as e:
            raise ConfigError(f"dataset.tasks: {e}") from None
    if cfg.dataset.name == "verifiers":
        from arl.envs.verifiers_env import check_env

        try:
            check_env(cfg.dataset.verifiers_env, dict(cfg.dataset.verifiers_args))
        except (ValueError, ImportError) as e:
            raise ConfigError(f"dataset.verifiers_env: {e}") from None
    resolve_secret(cfg.secret, effective_bind_host(cfg.bind_host))  # a multi-host run without a secret: refuse
    if cfg.rollout.task_api_key and cfg.rollout.task_api_key == cfg.secret:
        raise ConfigError("rollout.task_api_key must not be the run's secret (which signs every ZMQ frame): an agent "
                          "holding it could forge any role's messages")


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
    extra: dict[str, Any] = {}
    if cfg.model.warmup:  # an experiment's own warm-up recipe ("module:function"), e.g. tool calling
        import importlib

        mod, _, fn = cfg.model.warmup.partition(":")
        try:
            build = getattr(importlib.import_module(mod), fn)
        except (ImportError, AttributeError, ValueError) as e:
            raise FileNotFoundError(f"model.warmup {cfg.model.warmup!r}: {e}") from None
    else:
        from arl.recipes.warmup_arith import get_warm_model as build

        extra = dict(max_operand=cfg.dataset.max_operand, test_size=cfg.dataset.test_size)
    return build(os.path.expanduser(cfg.model.cache_dir), seed=0, target_acc=cfg.model.warmup_target_acc,
                 max_steps=cfg.model.warmup_max_steps, num_threads=1, **extra)


def make_controller(cfg: ExperimentConfig, run_dir: str, **overrides: Any) -> Controller:
    """The run's Controller with every setting taken from `cfg` (`overrides` replace some: the benchmarks turn
    the progress bar off); the shared secret, if any, goes to the roles through their environment, never into
    config.yaml."""
    from arl.learner.backends import LEARNER_BACKENDS

    bind_host = effective_bind_host(cfg.bind_host)
    secret = given = resolve_secret(cfg.secret, bind_host)
    trains_model = LEARNER_BACKENDS.get(cfg.learner.backend).trains_model  # only a real model runs on several ranks
    resume = resume_state(cfg, run_dir)  # may refuse the run: before a launcher (Ray) is connected
    if cfg.launcher == LauncherKind.ray and "launcher" not in overrides:
        launcher, bind_host, secret = ray_launcher(cfg, run_dir, bind_host, secret,
                                                   cfg.learner.num_ranks if trains_model else 1)
        overrides = {**overrides, "launcher": launcher}
    try:
        return _controller(cfg, run_dir, bind_host, secret, resume, trains_model, overrides,
                           made_secret=secret is not None and given is None)
    except BaseException:
        close_launcher(overrides.get("launcher"))
        raise


def rollout_scaling_refusal(cfg: ExperimentConfig) -> str:
    """Why rollout workers cannot join this run mid-run ('' : they can): what is laid out per worker index at the
    start and would not cover a new one."""
    rc = cfg.rollout
    if rc.num_env_groups:
        return (f"rollout.num_env_groups={rc.num_env_groups} partitions the env groups over the first "
                f"rollout.num_workers={rc.num_workers} workers")
    if rc.endpoint_port:
        return f"rollout.endpoint_port={rc.endpoint_port} gives worker i the port endpoint_port + i (use 0)"
    return ""


def autoscale_policy(ic: Any) -> Optional[AutoscalePolicy]:
    """`inference.autoscale` as the controller's policy (None: off)."""
    fields = dataclasses.asdict(ic.autoscale)
    return AutoscalePolicy(**fields) if fields.pop("enabled") else None


def _controller(cfg: ExperimentConfig, run_dir: str, bind_host: str, secret: Optional[bytes],
                resume: Optional[dict], trains_model: bool, overrides: dict[str, Any],
                made_secret: bool = False) -> Controller:
    """`made_secret`: the run made its `secret` (Ray): it goes into the 0600 control file, for `arl.ctl`."""
    ic, rc = cfg.inference, cfg.rollout
    trained = {p.name: list(p.servers) for p in trainable_policies(cfg)}  # each with a learner of its own
    supervisor = Supervisor(
        num_inference=ic.num_workers,
        num_rollout=rc.num_workers,
        servers_per_process=ic.servers_per_process,
        startup_timeout=cfg.startup_timeout,
        heartbeat_timeouts={"inference": ic.heartbeat_timeout, "learner": cfg.learner.heartbeat_timeout,
                            "rollout": rc.heartbeat_timeout, "env": cfg.env.heartbeat_timeout,
                            "judge": cfg.judge.inference.heartbeat_timeout},
        tolerate_inference_loss=ic.tolerate_worker_loss,
        restart_rollout=rc.restart_on_failure,
        max_restarts=rc.max_restarts,
        restart_inference=ic.restart_on_failure and ic.tolerate_worker_loss,
        max_inference_restarts=ic.max_restarts,
        num_env=cfg.env.servers,
        max_env_restarts=cfg.env.max_restarts,
        num_judge=judge_workers(cfg),
        max_judge_restarts=cfg.judge.inference.max_restarts,
        max_learner_restarts=cfg.learner.max_restarts,
        num_policy_learners=len(trained),
    )
    kwargs: dict[str, Any] = dict(
        run_dir=run_dir,
        supervisor=supervisor,
        batch_size=cfg.learner.batch_size,
        staleness=staleness_policy(cfg),
        max_concurrent_rollouts=rc.max_concurrent_rollouts,
        total_train_steps=cfg.total_train_steps,
        eval_every=cfg.eval.every_n_steps,
        eval_max_prompts=cfg.eval.max_prompts,
        progress=cfg.progress,
        resume=resume,
        learner_ranks=cfg.learner.num_ranks if trains_model else 1,
        secret=secret,
        bind_host=bind_host,
        max_bytes=cfg.max_message_bytes,
        max_no_progress_s=rc.max_no_progress_s,
        max_consecutive_drops=rc.max_consecutive_drops,
        weights_settings=weights_settings(cfg),
        trained_policies=trained,
        fingerprint=run_fingerprint(os.path.join(run_dir, "config.yaml"), cfg.model.path),
        scaling=dict(drain_timeout_s=ic.drain_timeout_s, autoscale=autoscale_policy(ic),
                     rollout_drain_timeout_s=rc.drain_timeout_s, rollout_refusal=rollout_scaling_refusal(cfg),
                     env_drain_timeout_s=cfg.env.drain_timeout_s,
                     made_secret=secret.decode("utf-8") if made_secret and secret is not None else None),
        steering=StalenessSteering(**dataclasses.asdict(cfg.staleness_auto)) if auto_eta(cfg) else None,
        sinks=make_sinks(cfg.loggers, run_dir, dataclasses.asdict(dataclasses.replace(cfg, secret="")),
                         cfg.experiment),
    )
    kwargs.update(overrides)
    kwargs.setdefault("launcher", LocalLauncher())
    ctl = Controller(**kwargs)
    if secret is not None:
        ctl.launcher.env[SECRET_ENV] = secret.decode("utf-8")
    return ctl


def ray_launcher(cfg: ExperimentConfig, run_dir: str, bind_host: str, secret: Optional[bytes],
                 learner_ranks: int) -> tuple[Any, str, bytes]:
    """`launcher=ray`: the launcher (connected to Ray), the controller's bind host (this node's address as Ray
    knows it, unless one is configured) and the run's secret (a fresh one unless one is configured): roles on other
    nodes reach the controller off loopback, so every frame is signed. The secret travels to the roles through
    Ray, as their environment."""
    import secrets as _secrets

    from arl.launch.ray import RayLauncher

    k = max(1, cfg.inference.servers_per_process)
    launcher = RayLauncher(cfg.ray, startup_timeout=cfg.startup_timeout, learner_ranks=learner_ranks,
                           servers_per_process=k, run_dir=run_dir,
                           processes={"inference": -(-cfg.inference.num_workers // k),
                                      "rollout": cfg.rollout.num_workers,
                                      **({"env": cfg.env.servers} if cfg.env.servers else {}),
                                      **({"judge": judge_workers(cfg)} if judge_workers(cfg) else {})})
    if is_loopback(bind_host):
        try:
            bind_host = launcher.driver_address()
        except BaseException:
            close_launcher(launcher)
            raise
    return launcher, bind_host, secret or _secrets.token_urlsafe(32).encode("utf-8")


INTERRUPT_GRACE_S = 2.0


def close_launcher(launcher: Optional[RoleLauncher]) -> None:
    """Release what a launcher holds beyond its processes (the Ray launcher: actors, placement groups, Ray)."""
    if launcher is not None:
        launcher.close()


async def _spawn_roles(ctl: Controller) -> None:
    """Start every role in a thread, so that Ctrl-C is heard while a launcher waits for resources (Ray placement);
    on Ctrl-C the launcher aborts and the thread ends before anything is shut down, so no role starts after."""
    spawning = asyncio.ensure_future(asyncio.to_thread(ctl.spawn_roles))
    try:
        await asyncio.shield(spawning)
    except asyncio.CancelledError:
        ctl.launcher.abort()
        await asyncio.gather(spawning, return_exceptions=True)
        raise


async def _run(cfg: ExperimentConfig, run_dir: str) -> dict:
    ctl = make_controller(cfg, run_dir)
    try:
        ctl.bind()
    except BaseException:
        ctl.reporter.close()
        await asyncio.to_thread(close_launcher, ctl.launcher)
        raise
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
        await _spawn_roles(ctl)
        return await ctl.run()
    except asyncio.CancelledError:
        if interrupted:
            raise KeyboardInterrupt from None
        raise
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        try:  # Ctrl-C: the user is waiting, so roles get 2 s to exit cleanly (not 5) before SIGTERM, SIGKILL 3 s on
            await ctl.shutdown(grace=INTERRUPT_GRACE_S if interrupted else 5.0)
        finally:
            await asyncio.to_thread(close_launcher, ctl.launcher)


def resume_state(cfg: ExperimentConfig, run_dir: str) -> Optional[dict]:
    """With ``recover=auto``: the latest learner checkpoint's state in ``run_dir`` (None: none, start fresh)."""
    if cfg.recover != "auto":
        return None
    from arl.learner.checkpoint import CHECKPOINT_SUBDIR, read_checkpoint_state

    if not cfg.run_name:
        logger.warning("recover=auto without run_name: a new run directory has no checkpoint to resume from")
    try:
        state = read_checkpoint_state(os.path.join(run_dir, CHECKPOINT_SUBDIR))
    except RuntimeError as e:
        raise RunFailed(f"recover=auto: {e}") from None
    if state is None:
        logger.info("recover=auto: no checkpoint in %s, starting from version 0", run_dir)
        return None
    if int(state.get("batch_size", cfg.learner.batch_size)) != cfg.learner.batch_size:
        raise RunFailed(f"recover=auto: the checkpoint was trained with learner.batch_size="
                        f"{state['batch_size']}, this run has {cfg.learner.batch_size}")
    positions = dict(state.get("data_position", {}))
    from arl.data.position import DataPosition

    for k, p in positions.items():
        try:
            DataPosition.from_state(p)
        except ValueError as e:
            raise RunFailed(f"recover=auto: the checkpoint's data position of rollout worker {k}: {e}") from None
    # the streams are defined by the run's first rollout.num_workers (streams past it: workers that joined mid-run,
    # drawn again by the workers there are now); a checkpoint from before that was kept has one per worker
    shards = state.get("prompt_shards")
    if shards != cfg.rollout.num_workers and (shards is not None
                                              or any(int(k) >= cfg.rollout.num_workers for k in positions)):
        logger.warning("recover=auto: the checkpoint's prompt streams (%s of %s rollout workers) are not this "
                       "run's (%d rollout workers): prompt streams are sharded differently now and restart",
                       sorted(positions), shards if shards is not None else "?", cfg.rollout.num_workers)
        state["data_position"] = {}
    logger.info("recover=auto: resuming at version %d (data position %s)", state["version"],
                {k: DataPosition.from_state(p) for k, p in state.get("data_position", {}).items()})
    return state


def run_experiment(cfg: ExperimentConfig) -> dict[str, Any]:
    """Run to completion; raises RunFailed (with the failing role's log tail) or KeyboardInterrupt. The caller
    checks the names first (`check_names`, as arl.cli does, so a bad name is a config error, not a failed run)."""
    run_dir = make_run_dir(cfg)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=prepare_model(cfg)))
    cfg, note = resolve_weights(cfg)  # before config.yaml: every role reads the transport the run uses
    if note:
        logger.warning("%s", note)
        print(f"note: {note}", file=sys.stderr, flush=True)
    if cfg.agent.name == "external":  # agents outside the run: the task API's key (never the transport secret)
        if not cfg.rollout.task_api_key:
            cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout,
                                                                       task_api_key=secrets.token_urlsafe(24)))
        print(f"agent.name=external: agents outside the run take episodes from the task API; each rollout worker "
              f"writes its address and key to {os.path.join(run_dir, 'task_api')}/rollout<i>.json",
              file=sys.stderr, flush=True)
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        f.write(to_yaml(dataclasses.replace(cfg, secret="")))  # the secret reaches the roles by environment
    print(f"run directory: {run_dir}", file=sys.stderr, flush=True)
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 <pid>` prints the controller's stacks too, like every role's
        import faulthandler

        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    return asyncio.run(_run(cfg, run_dir))


__all__ = ["run_experiment", "RunFailed", "check_names"]
