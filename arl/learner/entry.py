"""The learner role's process: rank 0's worker (receive, train, publish) and its control handlers."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import Any, Optional

from arl.config import ExperimentConfig, WeightTransport, weights_backend
from arl.transport.control import SOCKET_OPTIONS, ControlChannel, RoleParts, aclose, bind, host_address, make_socket
from arl.transport.sockets import Pull

logger = logging.getLogger("arl.worker")

def learner_actor(cfg: ExperimentConfig) -> tuple[Any, Any]:
    """This rank's PPO actor on the configured backend's engine, and the backend's entry."""
    from arl.learner.actor import PPOActor
    from arl.learner.backends import LEARNER_BACKENDS

    backend = LEARNER_BACKENDS.get(cfg.learner.backend)
    actor = PPOActor(backend.build(cfg), cfg.learner.ppo, temperature=cfg.gen.temperature,
                     eta=cfg.max_head_offpolicyness)
    return actor, backend


def weight_publisher(cfg: ExperimentConfig, device: Any) -> Any:
    """Learner rank 0's `WeightPublisher` (weights.transport=broadcast). Over NCCL its buckets live on `device`,
    the GPU the engine trains on (NCCL takes CUDA tensors only); over gloo on the CPU."""
    from arl.weights.sender import WeightSender
    from arl.weights.channel import WeightPublisher

    host, backend = host_address(cfg.bind_host), weights_backend(cfg)
    sender = WeightSender(host, 0, backend=backend, timeout_s=cfg.weights.timeout_s, gloo_host=host,
                          device=device if backend == "nccl" else None, secret=SOCKET_OPTIONS.get("secret"))
    return WeightPublisher(sender, protocol="sglang" if cfg.inference.backend == "sglang" else "arl",
                           bucket_bytes=cfg.weights.bucket_mb << 20)


async def run_learner(cfg: ExperimentConfig, ctl: ControlChannel, index: int, run_dir: str) -> RoleParts:
    from arl.learner.ranks import RankLeader
    from arl.learner.worker import LearnerWorker

    lc = cfg.learner
    actor, backend = learner_actor(cfg)
    # learner.num_ranks > 1: the other ranks follow (see `main`); rank 0 drives them all
    leader = RankLeader(actor) if actor.engine.world_size > 1 else None
    pull = make_socket(Pull)
    address = bind(pull, cfg.bind_host)
    real = backend.trains_model  # the simulated backend neither checkpoints nor checks token ids
    publisher, skip = None, set()
    if cfg.weights.transport == WeightTransport.broadcast:  # rank 0 sends the weights; no file is written
        from arl.learner.export import tied_aliases

        publisher = weight_publisher(cfg, getattr(actor.engine, "device", None))
        skip = tied_aliases(cfg.model.path)

    def write_final(weights: Any, version: int) -> None:
        """Writes ``<run>/final/`` (see `arl.learner.export`) from the last step's weights (file or state dict)."""
        from arl.learner.export import export_final

        out = export_final(weights, cfg.model.path, os.path.join(run_dir, "final"), gen=dataclasses.asdict(cfg.gen),
                           version=version)
        logger.info("final model written to %s", out)

    worker = LearnerWorker(
        actor=leader or actor,
        engine=leader or actor.engine,
        pull=pull,
        send_control=ctl.dealer.send,
        batch_size=lc.batch_size,
        total_steps=cfg.total_train_steps,
        weights_dir=os.path.join(run_dir, "weights"),
        keep_versions=lc.keep_weight_versions,
        max_head_offpolicyness=cfg.max_head_offpolicyness,
        stale_tokens=str(lc.ppo.stale_tokens),
        checkpoint_dir=os.path.join(run_dir, "checkpoints") if real else None,
        checkpoint_every=lc.checkpoint_every,
        keep_checkpoints=lc.keep_checkpoints,
        vocab_size=vocab_size(cfg) if real else None,
        export_final=write_final if real else None,
        publisher=publisher,
        skip_names=skip,
    )

    # the controller's prune_weights: no server reads versions below msg.below again
    ctl.handlers["prune_weights"] = lambda msg: worker.prune_below(msg.below)
    if publisher is not None:
        ctl.handlers.update(open_weight_group=lambda msg: publisher.open_group(msg.name, msg.server),
                            send_weights=lambda msg: publisher.request(msg.version, msg.servers))
    if cfg.recover == "auto":
        await worker.resume()  # before registering: the controller sends the exported weights to inference
    store = f"{publisher.sender.address}:{publisher.sender.port}" if publisher is not None else None
    await ctl.register(cfg.startup_timeout, address=address, weights_store=store)
    coros = [worker.receive(), worker.train(), ctl.heartbeat(worker.heartbeat_stats)]
    cleanups = [aclose(pull)]
    if publisher is not None:
        coros.append(publisher.run())
        cleanups.append(asyncio.to_thread(publisher.close))
    if leader is not None:
        cleanups.append(asyncio.to_thread(leader.stop))  # release the follower ranks
    return coros, cleanups




def vocab_size(cfg: ExperimentConfig) -> Optional[int]:
    """The model's vocabulary size (from its config.json): token ids the learner accepts are below it."""
    import json

    try:
        with open(os.path.join(cfg.model.path, "config.json")) as f:
            return int(json.load(f)["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


