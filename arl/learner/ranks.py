"""Several learner ranks behind one learner role: rank 0 talks to the controller, the others follow.

The learner role runs under ``torchrun --nproc_per_node R`` (``learner.num_ranks = R``). Every rank builds the same
engine and `PPOActor` (so DeepSpeed's collectives line up). Rank 0 runs the normal `LearnerWorker` with a
`RankLeader` as its actor and engine; ranks > 0 run `follow`. Each call on rank 0 first sends a command to every
rank (over a gloo group of its own, so it works beside NCCL too), then runs the call locally; the followers run the
same call, so collectives (gradient all-reduce, ZeRO gathers, statistics, checkpoint barriers) meet:

- ``prepare``: the batch is cut into its prompt groups and group ``i`` goes to rank ``i % R`` (whole groups, as the
  advantages are normalised within a group); each rank keeps its share as its current batch;
- ``compute_logp``, ``compute_advantages``, ``ppo_update``: every rank runs the phase on its current batch;
  DeepSpeed averages the gradients (the loss is scaled by the global token count, so the result equals one rank
  on the batch) and the statistics are reduced over the ranks;
- ``export_weights``, ``save``, ``load``: collective under ZeRO-3 (and barriers); rank 0 writes;
- ``stop``: the followers return.

Commands are serialised by a lock, so a shutdown cannot interleave with a call in flight.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import threading
from typing import Any, Callable, Optional, Sequence

from arl.api.types import Trajectory

logger = logging.getLogger("arl.learner")

__all__ = ["RankLeader", "follow", "split_groups_over_ranks", "command_group"]

# Followers wait for the next command while rank 0 waits for data (start-up evaluation, slow rollouts): allow long
# idle periods; a dead rank 0 is still noticed at once by torchrun, which stops the others.
_IDLE_TIMEOUT = datetime.timedelta(hours=24)
_PHASES = ("compute_logp", "compute_advantages", "ppo_update")  # run on each rank's current batch
_ENGINE_CALLS = ("export_weights", "save", "load", "full_state_dict")


def command_group() -> Any:
    """A gloo process group for the command channel (collective: every rank calls it once, in the same order)."""
    import torch.distributed as tdist

    return tdist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)


def split_groups_over_ranks(batch: Sequence[Trajectory], world: int) -> list[list[Trajectory]]:
    """Cut ``batch`` into runs of equal ``group_id`` (the learner worker flattens whole groups in order) and deal
    them out: group ``i`` to rank ``i % world``. Raises if there are fewer groups than ranks (a rank would have
    nothing to train on)."""
    groups = [list(g) for _, g in itertools.groupby(batch, key=lambda t: t.group_id)]
    if len(groups) < world:
        raise ValueError(f"a batch of {len(groups)} prompt groups cannot be shared by {world} learner ranks "
                         "(set learner.batch_size >= learner.num_ranks)")
    shares: list[list[Trajectory]] = [[] for _ in range(world)]
    for i, g in enumerate(groups):
        shares[i % world].extend(g)
    return shares


class RankLeader:
    """Rank 0's view of a multi-rank learner: the actor's phases and the engine's checkpoint/export calls, each
    run on every rank."""

    def __init__(self, actor: Any, group: Any = None) -> None:
        self.actor = actor
        self.world_size = int(actor.engine.world_size)
        self.group = group if group is not None else command_group()
        self._lock = threading.Lock()
        self._stopped = False

    @property
    def version(self) -> int:
        return self.actor.version

    @property
    def policy(self) -> Optional[str]:
        return getattr(self.actor, "policy", None)

    def _send(self, per_rank: list[tuple[str, Any]]) -> Any:
        import torch.distributed as tdist

        out: list[Any] = [None]
        tdist.scatter_object_list(out, per_rank, src=0, group=self.group)
        return out[0][1]

    def _run(self, cmd: str, per_rank: list[Any], local: Callable[[Any], Any]) -> Any:
        """Send ``(cmd, per_rank[r])`` to every rank r, then run ``local`` on rank 0's own argument."""
        with self._lock:
            if self._stopped:
                raise RuntimeError("the learner ranks were stopped")
            return local(self._send([(cmd, a) for a in per_rank]))

    def prepare(self, trajs: Sequence[Trajectory]) -> Any:
        return self._run("prepare", split_groups_over_ranks(trajs, self.world_size), self.actor.prepare)

    def compute_logp(self, batch: Any) -> None:
        self._run("compute_logp", [None] * self.world_size, lambda _: self.actor.compute_logp(batch))

    def compute_advantages(self, batch: Any) -> None:
        self._run("compute_advantages", [None] * self.world_size, lambda _: self.actor.compute_advantages(batch))

    def ppo_update(self, batch: Any) -> dict[str, float]:
        return self._run("ppo_update", [None] * self.world_size, lambda _: self.actor.ppo_update(batch))

    def export_weights(self, path: str) -> None:
        self._run("export_weights", [path] * self.world_size, self.actor.engine.export_weights)

    def full_state_dict(self, copy: bool = True) -> Optional[dict]:
        """Rank 0's full state dict (collective under ZeRO-3), for the `broadcast` weight transport."""
        return self._run("full_state_dict", [()] * self.world_size,
                         lambda _: self.actor.engine.full_state_dict(copy=copy))

    def save(self, path: str, client_state: Optional[dict] = None, keep_last: Optional[int] = None) -> str:
        return self._run("save", [(path, client_state, keep_last)] * self.world_size,
                         lambda a: self.actor.engine.save(*a))

    def load(self, path: str) -> dict:
        return self._run("load", [path] * self.world_size, self.actor.engine.load)

    def stop(self) -> None:
        """Release the followers (idempotent)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._send([("stop", None)] * self.world_size)


def follow(actor: Any, group: Any = None) -> int:
    """Rank > 0: run rank 0's commands on ``actor`` (and its engine) until ``stop``; returns the number of
    updates run."""
    import torch.distributed as tdist

    group = group if group is not None else command_group()
    steps, batch = 0, None
    while True:
        out: list[Any] = [None]
        tdist.scatter_object_list(out, None, src=0, group=group)
        cmd, arg = out[0]
        if cmd == "prepare":
            batch = actor.prepare(arg)
        elif cmd in _PHASES:
            getattr(actor, cmd)(batch)
            steps += cmd == "ppo_update"
        elif cmd in _ENGINE_CALLS:
            getattr(actor.engine, cmd)(*(arg if cmd in ("save", "full_state_dict") else (arg,)))
        elif cmd == "stop":
            logger.info("rank %d: stop after %d steps", actor.engine.rank, steps)
            return steps
        else:
            raise RuntimeError(f"unknown learner rank command {cmd!r}")
