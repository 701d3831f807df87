"""Several learner ranks behind one learner role: rank 0 talks to the controller, the others follow.

The learner role runs under ``torchrun --nproc_per_node R`` (``learner.num_ranks = R``). Every rank builds the same
`DeepSpeedLearner` (so DeepSpeed's collectives line up). Rank 0 runs the normal `LearnerWorker` with a
`RankLeader` as its engine; ranks > 0 run `follow`. Each engine call on rank 0 first sends a command to every rank
(over a gloo group of its own, so it works beside NCCL too), then runs the call locally; the followers run the
same call, so collectives (gradient all-reduce, ZeRO gathers, checkpoint barriers) meet:

- ``train``: the batch is cut into its prompt groups and group ``i`` goes to rank ``i % R`` (whole groups, as the
  advantages are normalised within a group); each rank trains on its share and DeepSpeed averages the gradients
  (the learner scales each rank's loss by the global token count, so the result equals one rank on the batch);
- ``export``, ``save``, ``load``: collective under ZeRO-3 (and barriers); rank 0 writes;
- ``stop``: the followers return.

Commands are serialised by a lock, so a shutdown cannot interleave with a step in flight.
"""

from __future__ import annotations

import datetime
import logging
import threading
from typing import Any, Optional, Sequence

from arl.api.types import Trajectory

logger = logging.getLogger("arl.learner")

__all__ = ["RankLeader", "follow", "split_groups_over_ranks", "command_group"]

# Followers wait for the next command while rank 0 waits for data (start-up evaluation, slow rollouts): allow long
# idle periods; a dead rank 0 is still noticed at once by torchrun, which stops the others.
_IDLE_TIMEOUT = datetime.timedelta(hours=24)


def command_group() -> Any:
    """A gloo process group for the command channel (collective: every rank calls it once, in the same order)."""
    import torch.distributed as tdist

    return tdist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)


def split_groups_over_ranks(batch: Sequence[Trajectory], world: int) -> list[list[Trajectory]]:
    """Cut ``batch`` into runs of equal ``group_id`` (the learner worker flattens whole groups in order) and deal
    them out: group ``i`` to rank ``i % world``. Raises if there are fewer groups than ranks (a rank would have
    nothing to train on)."""
    groups: list[list[Trajectory]] = []
    for t in batch:
        if groups and groups[-1][0].group_id == t.group_id:
            groups[-1].append(t)
        else:
            groups.append([t])
    if len(groups) < world:
        raise ValueError(f"a batch of {len(groups)} prompt groups cannot be shared by {world} learner ranks "
                         "(set learner.batch_size >= learner.num_ranks)")
    shares: list[list[Trajectory]] = [[] for _ in range(world)]
    for i, g in enumerate(groups):
        shares[i % world].extend(g)
    return shares


class RankLeader:
    """Rank 0's view of a multi-rank learner; implements `LearnerEngine` like the engine it wraps."""

    def __init__(self, engine: Any, group: Any = None) -> None:
        self.engine = engine
        self.world_size = int(engine.world_size)
        self.group = group if group is not None else command_group()
        self._lock = threading.Lock()
        self._stopped = False

    @property
    def version(self) -> int:
        return self.engine.version

    def _send(self, per_rank: list[tuple[str, Any]]) -> tuple[str, Any]:
        import torch.distributed as tdist

        out: list[Any] = [None]
        tdist.scatter_object_list(out, per_rank, src=0, group=self.group)
        return out[0]

    def _broadcast(self, cmd: str, arg: Any = None) -> None:
        self._send([(cmd, arg)] * self.world_size)

    def train_step(self, batch: Sequence[Trajectory]) -> dict[str, float]:
        shares = split_groups_over_ranks(batch, self.world_size)
        with self._lock:
            self._check()
            _, mine = self._send([("train", s) for s in shares])
            return self.engine.train_step(mine)

    def export_weights(self, path: str) -> None:
        with self._lock:
            self._check()
            self._broadcast("export", path)
            self.engine.export_weights(path)

    def save(self, path: str, client_state: Optional[dict] = None, keep_last: Optional[int] = None) -> str:
        with self._lock:
            self._check()
            self._broadcast("save", (path, client_state, keep_last))
            return self.engine.save(path, client_state=client_state, keep_last=keep_last)

    def load(self, path: str) -> dict:
        with self._lock:
            self._check()
            self._broadcast("load", path)
            return self.engine.load(path)

    def stop(self) -> None:
        """Release the followers (idempotent)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._broadcast("stop")

    def _check(self) -> None:
        if self._stopped:
            raise RuntimeError("the learner ranks were stopped")


def follow(engine: Any, group: Any = None) -> int:
    """Rank > 0: run rank 0's commands on ``engine`` until ``stop``; returns the number of train steps run."""
    import torch.distributed as tdist

    group = group if group is not None else command_group()
    steps = 0
    while True:
        out: list[Any] = [None]
        tdist.scatter_object_list(out, None, src=0, group=group)
        cmd, arg = out[0]
        if cmd == "train":
            engine.train_step(arg)
            steps += 1
        elif cmd == "export":
            engine.export_weights(arg)
        elif cmd == "save":
            path, client_state, keep_last = arg
            engine.save(path, client_state=client_state, keep_last=keep_last)
        elif cmd == "load":
            engine.load(arg)
        elif cmd == "stop":
            logger.info("rank %d: stop after %d steps", engine.rank, steps)
            return steps
        else:
            raise RuntimeError(f"unknown learner rank command {cmd!r}")
