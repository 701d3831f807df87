"""The learner role's process: rank 0's worker (receive, train, publish) and its control handlers."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import Any, Optional

from arl.config import ExperimentConfig, policy_learner_config, staleness_policy, trainable_policies, weights_settings
from arl.learner.checkpoint import RESTART_ENV
from arl.transport.control import SOCKET_OPTIONS, ControlChannel, RoleParts, aclose, bind, host_address, make_socket
from arl.transport.sockets import Pull

logger = logging.getLogger("arl.worker")

def learner_actor(cfg: ExperimentConfig, policy: Optional[str] = None) -> tuple[Any, Any]:
    """This rank's PPO actor on the configured backend's engine, and the backend's entry; `policy`: the trainable
    listed policy it trains (None: the run's own)."""
    from arl.learner.actor import PPOActor
    from arl.learner.backends import LEARNER_BACKENDS

    backend = LEARNER_BACKENDS.get(cfg.learner.backend)
    actor = PPOActor(backend.build(cfg), cfg.learner.ppo, temperature=cfg.gen.temperature,
                     staleness=staleness_policy(cfg), policy=policy)
    return actor, backend


def policy_learner(cfg: ExperimentConfig, index: int) -> tuple[ExperimentConfig, Optional[str], tuple[str, ...]]:
    """Learner `index`'s view of the run: (the config it trains by, the policy it trains, the subfolder of the
    run's weights and checkpoints it writes: none, or policies/<name>). Index 0 is the run's own policy's
    learner; index k >= 1 trains the k-th trainable listed policy (`docs/multi_policy.md`) with its learner
    section, its own seed."""
    if index == 0:
        return cfg, None, ()
    policies = trainable_policies(cfg)
    if not 1 <= index <= len(policies):
        raise ValueError(f"learner {index}: the run trains {len(policies)} listed policies")
    p = policies[index - 1]
    pcfg = dataclasses.replace(cfg, learner=policy_learner_config(cfg, p), seed=cfg.seed + 1000 * index)
    return pcfg, p.name, ("policies", p.name)


def learner_weights(cfg: ExperimentConfig, run_dir: str, device: Any, sub: tuple[str, ...] = ()) -> Any:
    """Learner rank 0's side of the configured weight transport (`arl.weights.strategy`); `device`: the
    engine's; `sub`: a trainable listed policy's subfolder of the run's weights."""
    from arl.learner.export import tied_aliases
    from arl.weights.strategy import make_transport

    return make_transport(weights_settings(cfg)).learner(
        weights_dir=os.path.join(run_dir, "weights", *sub), keep_versions=cfg.learner.keep_weight_versions,
        host=host_address(cfg.bind_host), secret=SOCKET_OPTIONS.get("secret"), device=device,
        skip_names=lambda: tied_aliases(cfg.model.path))


async def run_learner(cfg: ExperimentConfig, ctl: ControlChannel, index: int, run_dir: str) -> RoleParts:
    from arl.learner.ranks import RankLeader
    from arl.learner.worker import LearnerWorker

    cfg, policy, sub = policy_learner(cfg, index)
    lc = cfg.learner
    actor, backend = learner_actor(cfg, policy)
    # learner.num_ranks > 1: the other ranks follow (see `main`); rank 0 drives them all
    leader = RankLeader(actor) if actor.engine.world_size > 1 else None
    pull = make_socket(Pull)
    address = bind(pull, cfg.bind_host)
    real = backend.trains_model  # the simulated backend checks no token ids and writes no final model
    weights_side = learner_weights(cfg, run_dir, getattr(actor.engine, "device", None), sub)  # rank 0 sends them

    def write_final(weights: Any, version: int) -> None:
        """Writes ``<run>/final/`` (see `arl.learner.export`) from the last step's weights (file or state dict)."""
        from arl.learner.export import export_final, export_final_lora

        # a listed policy's beside the run's (final/ is replaced whole when written): final-<name>/
        out_dir, gen = os.path.join(run_dir, f"final-{policy}" if policy else "final"), dataclasses.asdict(cfg.gen)
        if lc.lora.enabled:  # the adapter as a peft folder (+ final/merged/ with export.merge_lora)
            out = export_final_lora(weights, cfg.model.path, out_dir, gen=gen, version=version,
                                    merge=cfg.export.merge_lora)
        else:
            out = export_final(weights, cfg.model.path, out_dir, gen=gen, version=version)
        logger.info("final model written to %s", out)

    worker = LearnerWorker(
        actor=leader or actor,
        engine=leader or actor.engine,
        pull=pull,
        send_control=ctl.post,
        batch_size=lc.batch_size,
        prompt_shards=cfg.rollout.num_workers,
        total_steps=cfg.total_train_steps,
        weights=weights_side,
        staleness=actor.staleness,  # the actor's own: one rule for the group drop and the token mask
        checkpoint_dir=os.path.join(run_dir, "checkpoints", *sub),
        checkpoint_every=lc.checkpoint_every,
        keep_checkpoints=lc.keep_checkpoints,
        vocab_size=vocab_size(cfg) if real else None,
        export_final=write_final if real else None,
        recorder=batch_recorder(cfg, run_dir) if lc.record_batches and policy is None else None,
        books_groups=policy is None,  # the run's learner settles groups; a listed policy's keeps its own books
    )

    # the controller's prune_weights: no server reads versions below msg.below again
    ctl.handlers["prune_weights"] = lambda msg: weights_side.prune(msg.below)
    ctl.handlers.update(weights_side.handlers)  # the transport's own commands
    resumed = None
    if os.environ.get(RESTART_ENV) == "1":  # the controller restarted it after a loss: it rolls back to where this is
        resumed = await worker.resume_after_loss()
    elif cfg.recover == "auto":
        await worker.resume()  # before registering: the controller sends the exported weights to inference
    await ctl.register(cfg.startup_timeout, address=address, resumed=resumed, **weights_side.registration)
    coros = [worker.receive(), worker.train(), ctl.heartbeat(worker.heartbeat_stats),
             *weights_side.coroutines()]
    cleanups = [aclose(pull), weights_side.close()]
    if worker.recorder is not None:
        cleanups.append(asyncio.to_thread(worker.recorder.close))
    if leader is not None:
        cleanups.append(asyncio.to_thread(leader.stop))  # release the follower ranks
    return coros, cleanups


def batch_recorder(cfg: ExperimentConfig, run_dir: str) -> Any:
    """`learner.record_batches`: the writer of ``<run>/batches`` (`arl.learner.record`), with the settings a replay
    must match and this process's torch thread count (a CPU replay needs the same)."""
    import torch

    from arl.learner.record import BATCHES_SUBDIR, BatchRecorder, replay_settings

    return BatchRecorder(os.path.join(run_dir, BATCHES_SUBDIR), replay_settings(cfg), torch.get_num_threads())


def vocab_size(cfg: ExperimentConfig) -> Optional[int]:
    """The model's vocabulary size (from its config.json): token ids the learner accepts are below it."""
    import json

    try:
        with open(os.path.join(cfg.model.path, "config.json")) as f:
            return int(json.load(f)["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


