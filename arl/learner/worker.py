"""The learner worker: buffers finished groups, trains on B groups per step, publishes weights, checkpoints.

`LearnerWorker.train` is the learner's loop, written down once: next batch -> drop what is too stale -> proximal
logprobs -> advantages -> PPO update (minibatches) -> publish -> checkpoint. The algorithm is the `PPOActor`'s
(`arl.learner.actor`), the mechanics the engine's (`arl.learner.deepspeed_engine`, `arl.learner.sim_learner`);
several ranks put a `arl.learner.ranks.RankLeader` in front of both.

Checkpoint and resume. Every ``checkpoint_every`` steps (and after the last one) the engine saves weights,
optimizer, LR scheduler and RNG, plus `checkpoint_state()`: groups consumed, the data position and the staleness
counters. The data position is exact (`arl.data.position.DataPosition`, per rollout worker): the prompt-stream
positions whose groups were trained, or dropped by a counted rule (stale or invalid here, filtered or failed at the
rollout worker, which tells the learner with a `prompt_settled` notice on the trajectory socket). Rollout workers
stamp ``metadata["prompt_pos"] = [worker, position]`` on every trajectory. On resume the learner loads the
checkpoint, the controller's gate starts at its version with ``version * B`` groups accepted, and each rollout
worker's prompt stream draws again every position the checkpoint did not settle (groups in flight, buffered here,
or trained by steps after the checkpoint), then goes on: no prompt skipped, none trained twice. A group whose
prompt is already settled or buffered here (a restarted rollout worker's re-draw racing its predecessor's push) is
received and then dropped as ``duplicate_prompt`` (like a stale group: counted, its budget returned).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any, Callable, Optional

from arl.api.engine import TrainEngine
from arl.api.staleness import StalenessPolicy
from arl.api.types import Trajectory
from arl.data.position import DataPosition
from arl.learner.record import BatchRecorder
from arl.learner.validation import group_problem
from arl.transport.messages import Count, GroupReceived, GroupsDropped, PromptSettled, SendControl, WeightsPublished
from arl.utils.idset import CounterIdSet
from arl.utils.timer import PhaseTimer
from arl.weights.disk import DiskLearner
from arl.weights.strategy import Export, LearnerSide

logger = logging.getLogger("arl.learner")


def staleness_counts(batch: list[Trajectory], version: int, policy: Optional[str] = None) -> dict[int, int]:
    """Generated tokens of `batch` (`policy`'s own, in a run of several) by staleness (`version` minus the version
    that produced them): the per-token histogram the benchmarks report (metrics keys `stale_tokens_<k>`)."""
    import numpy as np

    gen = np.concatenate([t.versions[t.owned_by(policy)] for t in batch] or [np.zeros(0)]).astype(np.int64)
    return {k: int(n) for k, n in enumerate(np.bincount(np.maximum(version - gen, 0))) if n}


def _group_ids(trajs: list[Trajectory]) -> set[str]:
    """The rollout workers' ids of the groups `trajs` come from (each trajectory's group_id before the ':')."""
    return {str(t.group_id).split(":", 1)[0] for t in trajs}


def _group_of(group: list[Trajectory]) -> str:
    """The rollout worker's id of one group."""
    return str(group[0].group_id).split(":", 1)[0]


def _prompt_of(group: list[Trajectory]) -> Optional[tuple[str, int]]:
    """(rollout worker, prompt-stream position) a group was drawn at, from its ``prompt_pos`` stamp (None: none)."""
    pos = group[0].metadata.get("prompt_pos") if group else None
    if isinstance(pos, (list, tuple)) and len(pos) == 2:
        try:
            w, p = int(pos[0]), int(pos[1])
        except (TypeError, ValueError):
            return None
        return (str(w), p) if w >= 0 and p >= 0 else None
    return None


class LearnerWorker:
    def __init__(
        self,
        *,
        actor: Any,
        pull: Any,
        send_control: SendControl,
        batch_size: int,
        total_steps: int,
        weights: Optional[LearnerSide] = None,
        weights_dir: str = "",
        keep_versions: int = 3,
        staleness: StalenessPolicy = StalenessPolicy(),
        checkpoint_dir: Optional[str] = None,
        checkpoint_every: int = 0,
        keep_checkpoints: int = 2,
        vocab_size: Optional[int] = None,
        engine: Optional[TrainEngine] = None,
        export_final: Optional[Callable[[Any, int], Any]] = None,
        recorder: Optional[BatchRecorder] = None,
        prompt_shards: int = 1,
        books_groups: bool = True,
    ) -> None:
        """`staleness`: the run's rule, the one the actor masks tokens by (the default has no bound): buffered
        groups it calls stale are dropped before a batch is taken. `weights`: how each version reaches inference, the
        learner's side of a transport (`arl.weights.strategy.LearnerSide`); without one, files under `weights_dir`
        (`arl.weights.disk`), the newest `keep_versions` always kept. `recorder`: writes every batch as the actor
        gets it (`learner.record_batches`, `arl.learner.record`), so the run can be replayed. `prompt_shards`: the
        run's `rollout.num_workers`, which defines its prompt streams (`arl.rollout.prompts`): kept in checkpoints,
        so a resume with another count knows the positions are of other streams. `books_groups`: this learner's
        receipts and drops settle groups at the controller (the run's learner); False for a trainable listed
        policy's learner (`docs/multi_policy.md`), which gets every group too, trains those with tokens of its
        policy and keeps its counts to itself (its heartbeat)."""
        self.actor = actor  # prepare / compute_logp / compute_advantages / ppo_update (`PPOActor`, `RankLeader`)
        self.policy: Optional[str] = getattr(actor, "policy", None)  # whose tokens count (several policies)
        self.engine: Any = engine if engine is not None else actor.engine  # version, save / load / export_weights
        self.pull = pull
        self._send = send_control
        self.books_groups = books_groups
        self.batch_size = batch_size
        self.prompt_shards = prompt_shards
        self.total_steps = total_steps
        self.weights = weights if weights is not None else DiskLearner(weights_dir, keep_versions)
        self.staleness = staleness
        self.buffer: collections.deque[list[Trajectory]] = collections.deque()
        self._arrived = asyncio.Event()
        # accounting: every received group ends up trained, dropped as stale or invalid, or still buffered
        self.stats = {"groups_received": 0, "trajectories_received": 0, "steps": 0, "idle_seconds": 0.0,
                      "train_seconds": 0.0, "staleness_violations": 0, "stale_groups_dropped": 0,
                      "trained_groups": 0, "trained_trajectories": 0, "stale_trajectories_dropped": 0,
                      "invalid_groups": 0, "trained_twice": 0, "replayed_groups": 0,
                      "duplicate_prompts": 0, "duplicate_trajectories": 0, "prompts_settled_by_rollout": 0,
                      "groups_without_policy": 0}
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_every = max(0, int(checkpoint_every))
        self.keep_checkpoints = max(1, int(keep_checkpoints))
        self.groups_consumed = 0
        self.data_position: dict[str, DataPosition] = {}  # rollout worker index -> its settled prompt positions
        self._buffered_pos: dict[str, set[int]] = {}  # prompt positions of the buffered groups
        self.vocab_size = vocab_size
        self._trained_ids = CounterIdSet()
        # every group id ever received (checkpointed): a replayed `traj` is refused, even after a restart; a bit a
        # group (CounterIdSet), not a string: the sets of a run of days stay small, and so does its checkpoint
        self._received_ids = CounterIdSet()
        self._last_replay_log = -1e9
        self._in_step = 0  # groups of the step being trained (taken from the buffer, not yet counted as trained)
        self._last_invalid_log = -1e9
        self.waiting_on = "starting"  # reported in heartbeats; the controller logs it if this role goes silent
        self.timer = PhaseTimer()  # this step's 'wait' (for a batch) and 'step' (train and export) seconds
        # CPU seconds: the actor's phases of this step (their threads' own clocks) and the whole process since the
        # last step's record, so a run tells the step's cost from everything else the process does
        self._step_cpu = 0.0
        self._phase_wall: dict[str, float] = {}  # this step's wall seconds per phase (prepare .. export)
        self._process_cpu = time.process_time()
        self.export_final = export_final  # called with the last step's weights (file or state dict) and version
        self.recorder = recorder
        self.resumed_path = ""  # where the weights of the last resume are (a restarted learner's `Register`)

    async def receive(self) -> None:
        while True:
            msg_type, group = await self.pull.recv()
            if msg_type == "prompt_settled":
                self._rollout_settled(group)
                continue
            if msg_type != "traj" or not group:
                continue
            ids = _group_ids(group)
            seen = self._received_ids.intersection(ids)
            if seen:  # a replay (or a sender's bug): never trained, no budget returned
                self.stats["replayed_groups"] += 1
                if time.monotonic() - self._last_replay_log >= 1.0:
                    self._last_replay_log = time.monotonic()
                    logger.warning("refused a group whose id was received before (%s); %d so far",
                                   sorted(seen)[:3], self.stats["replayed_groups"])
                continue
            self._received_ids.update(ids)
            if not self.books_groups and not any(t.owned_by(self.policy).any() for t in group):
                self.stats["groups_without_policy"] += 1  # none of its tokens: another policy's group
                await self._send(GroupsDropped(n=Count(1), reason="no_policy_tokens"))  # its budget back
                continue
            problem = group_problem(group, vocab_size=self.vocab_size, version=self.engine.version,
                                    policy=self.policy)
            if problem is not None:  # never train on it; give its budget back like a stale drop
                self.stats["invalid_groups"] += 1
                if time.monotonic() - self._last_invalid_log >= 1.0:
                    self._last_invalid_log = time.monotonic()
                    logger.warning("dropped an invalid trajectory group (%s); %d so far", problem,
                                   self.stats["invalid_groups"])
                self._settle(_prompt_of(group))
                await self._book(GroupsDropped(n=Count(1), reason="invalid", group_ids=[_group_of(group)]))
                continue
            prompt = _prompt_of(group)
            duplicate = prompt is not None and self._prompt_taken(*prompt)  # its prompt ended once already
            if duplicate:
                self.stats["duplicate_prompts"] += 1
                self.stats["duplicate_trajectories"] += len(group)
            else:
                if prompt is not None:
                    self._buffered_pos.setdefault(prompt[0], set()).add(prompt[1])
                self.buffer.append(group)
                self._arrived.set()
            self.stats["groups_received"] += 1
            self.stats["trajectories_received"] += len(group)
            # the receipt settles the group at the controller, even if its rollout worker dies before group_done
            await self._book(GroupReceived(group_id=_group_of(group), n_traj=Count(len(group))))
            if duplicate:  # received, then dropped like a stale group: its budget goes back, nothing is lost
                logger.warning("dropped a group of prompt %s of rollout worker %s: that prompt was settled or is "
                               "buffered already (%d so far)", prompt[1], prompt[0], self.stats["duplicate_prompts"])
                await self._book(GroupsDropped(n=Count(1), reason="duplicate_prompt"))

    async def _book(self, msg: Any) -> None:
        """A group's receipt settles it at the controller: only the run's learner's (a listed policy's learner's
        drops only give its own staleness budget back)."""
        if self.books_groups or not isinstance(msg, GroupReceived):
            await self._send(msg)

    async def next_batch(self) -> list[Trajectory]:
        """Wait for B fresh-enough groups (FIFO); returns the flattened batch."""
        while True:
            stale = [self.staleness.group_is_stale(g, self.engine.version, self.policy) for g in self.buffer]
            if any(stale):
                gone = [g for g, s in zip(self.buffer, stale) if s]
                dropped = len(gone)
                for g in gone:
                    self._settle(_prompt_of(g))  # dropped by rule: a resume does not draw it again
                self.stats["stale_groups_dropped"] += dropped
                self.stats["stale_trajectories_dropped"] += sum(map(len, gone))
                self.buffer = collections.deque(g for g, s in zip(self.buffer, stale) if not s)
                logger.info("dropped %d groups staler than eta=%s; their budget goes back", dropped,
                            self.staleness.eta)
                await self._book(GroupsDropped(n=Count(dropped), reason="stale"))
            if len(self.buffer) >= self.batch_size:
                break
            self.waiting_on = f"waiting for a batch ({len(self.buffer)}/{self.batch_size} groups buffered)"
            self._arrived.clear()
            await self._arrived.wait()
        groups = [self.buffer.popleft() for _ in range(self.batch_size)]
        for g in groups:
            self._note_consumed(g)
        return [t for g in groups for t in g]

    def _note_consumed(self, group: list[Trajectory]) -> None:
        self.groups_consumed += 1
        self._settle(_prompt_of(group))

    def _settle(self, prompt: Optional[tuple[str, int]]) -> bool:
        """Book prompt (worker, position) as settled: trained, or dropped by a counted rule; False if it was."""
        if prompt is None:
            return False
        w, p = prompt
        self._buffered_pos.get(w, set()).discard(p)
        return self.data_position.setdefault(w, DataPosition()).settle(p)

    def _prompt_taken(self, worker: str, position: int) -> bool:
        return position in self.data_position.get(worker, ()) or position in self._buffered_pos.get(worker, ())

    def _rollout_settled(self, payload: Any) -> None:
        """A rollout worker dropped a group by a counted rule (`PromptSettled`): its prompt is settled."""
        try:
            msg = PromptSettled.from_payload(payload)
        except ValueError as e:
            logger.warning("ignored a bad prompt_settled notice: %s", e)
            return
        if msg.worker >= 0 and msg.position >= 0 and self._settle((str(msg.worker), msg.position)):
            self.stats["prompts_settled_by_rollout"] += 1  # a prompt the learner's book holds as dropped

    # -- checkpoints ---------------------------------------------------------------------------------------
    def checkpoint_state(self) -> dict:
        """What a resume needs besides the engine's own state (JSON-safe)."""
        counters = {k: v for k, v in self.stats.items() if isinstance(v, (int, float))}  # staleness, accounting
        positions = {w: d.to_state() for w, d in self.data_position.items()}
        return {"groups_consumed": self.groups_consumed, "data_position": positions,
                "prompt_shards": self.prompt_shards, "batch_size": self.batch_size, "counters": counters,
                "received_group_ids": self._received_ids.to_state()}

    def restore(self, state: dict) -> None:
        """Take back `checkpoint_state()` after the engine loaded its checkpoint."""
        self.groups_consumed = int(state.get("groups_consumed", 0))
        self.data_position = {str(k): DataPosition.from_state(v)
                              for k, v in dict(state.get("data_position", {})).items()}
        self._buffered_pos = {}
        self.stats.update({k: v for k, v in dict(state.get("counters", {})).items() if k in self.stats})
        self._received_ids = CounterIdSet.from_state(state.get("received_group_ids"))

    async def resume(self) -> Optional[int]:
        """Load the latest checkpoint under ``checkpoint_dir`` (engine state, then `restore`) and publish its
        weights for the inference workers; returns the version, or None (and changes nothing) when there is no
        checkpoint."""
        from arl.learner.checkpoint import latest_checkpoint

        if not self.checkpoint_dir or latest_checkpoint(self.checkpoint_dir) is None:
            return None
        state = await asyncio.to_thread(self.engine.load, self.checkpoint_dir)
        self.restore(state or {})
        v = self.engine.version
        if self.recorder is not None:  # a crashed incarnation's batches past the checkpoint are trained afresh
            self.recorder.forget_after(v)
        await self._publish_resumed(v)  # a restarted run's inference workers get these
        logger.info("resumed from checkpoint v%d (%d groups consumed, data position %s)", v, self.groups_consumed,
                    self.data_position)
        return v

    async def resume_after_loss(self) -> dict:
        """This learner replaces a lost one (the controller restarted it): resume from the newest checkpoint, or
        start over at version 0 without one, and export those weights either way (the inference servers may hold
        later versions of the lost process and go back to these). Groups the checkpoint counted as received but
        had not trained (its buffer) were lost with that process: they leave the counts, as the controller's
        accepted groups beyond the checkpoint leave its. Returns what the controller's rollback needs
        (`Register.resumed`); `data_position` as the checkpoint holds it."""
        from arl.learner.checkpoint import read_checkpoint_state

        v = await self.resume()
        if v is None:
            v = self.engine.version
            await self._publish_resumed(v)
            logger.info("restarted without a checkpoint: starting over at version %d", v)
        st = self.stats
        st["groups_received"] = st["trained_groups"] + st["stale_groups_dropped"] + st["duplicate_prompts"]
        st["trajectories_received"] = (st["trained_trajectories"] + st["stale_trajectories_dropped"]
                                       + st["duplicate_trajectories"])
        saved = (read_checkpoint_state(self.checkpoint_dir) if self.checkpoint_dir else None) or {}
        return {"version": v, "path": self.resumed_path, "groups_consumed": self.groups_consumed,
                "data_position": dict(saved.get("data_position") or {}), "groups_settled": st["groups_received"],
                "trajectories_settled": st["trajectories_received"]}

    async def _publish_resumed(self, version: int) -> None:
        """Export and publish the weights a resume starts from; `resumed_path` says where they are."""
        export = await self._export()
        await self.weights.publish(version, export)
        self.resumed_path = export.path

    async def maybe_checkpoint(self, force: bool = False) -> Optional[str]:
        v = self.engine.version
        if not self.checkpoint_dir or not self.checkpoint_every or (not force and v % self.checkpoint_every):
            return None
        timer = PhaseTimer()
        with timer.phase("checkpoint"):
            path = await asyncio.to_thread(self.engine.save, self.checkpoint_dir, self.checkpoint_state(),
                                           self.keep_checkpoints)
        logger.info("checkpoint v%d written to %s in %.2fs", v, path, timer.seconds["checkpoint"])
        return path

    async def train(self) -> None:
        """The learner loop: one policy version per batch of B prompt groups, until ``total_steps``."""
        while self.engine.version < self.total_steps:
            self.timer.start("wait")
            trajs = await self.next_batch()  # B groups, FIFO; too stale groups were dropped
            self.timer.start("step")  # until the weights are out: the step's metrics
            stale_tokens = staleness_counts(trajs, self.engine.version, self.policy)
            self.waiting_on = f"train step {self.engine.version + 1} ({len(trajs)} trajectories)"
            self._in_step = len(_group_ids(trajs))
            self._step_cpu = 0.0
            self._phase_wall = {}
            if self.recorder is not None:  # as the actor gets it; encoded and written by the recorder's thread
                await asyncio.to_thread(self.recorder.record, self.engine.version, trajs)
            batch = await self._phase("prepare", self.actor.prepare, trajs)  # per-token staleness, minibatches
            await self._phase("logp", self.actor.compute_logp, batch)  # proximal logprobs, before any update
            await self._phase("advantages", self.actor.compute_advantages, batch)  # group-normalised rewards
            metrics = await self._phase("update", self.actor.ppo_update, batch)  # a step per minibatch; version + 1
            self._count_trained(trajs)
            export = await self._export()  # the new weights, for the inference workers
            metrics = self._step_metrics(metrics, trajs, self.timer.pop(), stale_tokens)
            await self.maybe_checkpoint(force=self.engine.version >= self.total_steps)
            if self.recorder is not None and self.engine.version >= self.total_steps:  # the last batch on disk
                await asyncio.to_thread(self.recorder.flush)
            if self.export_final is not None and self.engine.version >= self.total_steps:  # before the run can end
                await asyncio.to_thread(self.export_final, export.weights, self.engine.version)
            # publish: the controller sends the weights to inference, reopens the gate and schedules evaluation
            await self._send(WeightsPublished(version=self.engine.version, path=export.path, metrics=metrics))
            await self.weights.publish(self.engine.version, export)  # only now: the controller has seen it

    async def _phase(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in a worker thread (the event loop keeps receiving), its thread CPU added to the step's and
        its wall time recorded as phase `name` (`learner_phase_seconds`: where a slow step's time went)."""
        def run() -> Any:
            c0 = time.thread_time()
            try:
                return fn(*args)
            finally:
                self._step_cpu += time.thread_time() - c0

        t0 = time.perf_counter()
        try:
            return await asyncio.to_thread(run)
        finally:
            self._phase_wall[name] = time.perf_counter() - t0

    async def _export(self) -> Export:
        self.waiting_on = f"{self.weights.activity} v{self.engine.version}"
        t0 = time.perf_counter()
        try:
            return await self.weights.export(self.engine.version, self.engine)
        finally:
            self._phase_wall["export"] = time.perf_counter() - t0

    def _step_metrics(self, metrics: dict, batch: list[Trajectory], seconds: dict[str, float],
                      stale_tokens: dict[int, int]) -> dict[str, Any]:
        """The step's record: the actor's statistics plus the worker's timing (`seconds` of the phases 'wait' and
        'step') and staleness counters."""
        waited, train_s = seconds["wait"], seconds["step"]
        self.stats["train_seconds"] += train_s
        self.stats["idle_seconds"] += waited
        self.stats["steps"] += 1
        head = metrics.get("head_offpolicyness")  # as received
        if head is not None and self.staleness.exceeded(head):
            self.stats["staleness_violations"] += 1
            logger.error("batch head off-policyness %s exceeds eta=%d", head, self.staleness.eta)
        out = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        cpu = time.process_time()
        out.update(learner_step_cpu_seconds=self._step_cpu, learner_cpu_seconds=cpu - self._process_cpu,
                   batch_tokens=float(sum(len(t.input_ids) for t in batch)),
                   learner_phase_seconds=dict(self._phase_wall))
        self._process_cpu = cpu
        out.update(learner_wait_seconds=waited, learner_step_seconds=train_s,
                   samples_per_s=len(batch) / max(train_s + waited, 1e-9), buffered_groups=len(self.buffer),
                   staleness_violations=self.stats["staleness_violations"],
                   stale_groups_dropped=self.stats["stale_groups_dropped"])
        out.update({f"stale_tokens_{k}": float(n) for k, n in stale_tokens.items()})
        return out

    def _count_trained(self, batch: list[Trajectory]) -> None:
        """Count what a finished step trained on; a group id seen in an earlier step counts as trained twice."""
        ids = _group_ids(batch)
        twice = len(self._trained_ids.intersection(ids))
        if twice:
            logger.error("%d groups of this batch were trained on before", twice)
        self._trained_ids.update(ids)
        self._in_step = 0
        self.stats["trained_twice"] += twice
        self.stats["trained_groups"] += len(ids)
        self.stats["trained_trajectories"] += len(batch)

    def heartbeat_stats(self) -> dict:
        waiting = self.waiting_on if self.engine.version < self.total_steps else (
            f"nothing: all {self.total_steps} steps done")
        return {**self.stats, "buffered_groups": len(self.buffer), "version": self.engine.version,
                "buffered_trajectories": sum(len(g) for g in self.buffer), "waiting_on": waiting,
                "in_step_groups": self._in_step, **self.weights.stats,
                "transport": dict(getattr(self.pull, "stats", {}))}
