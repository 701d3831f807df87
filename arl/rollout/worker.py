"""The rollout (agent) worker: many `collect_trajectory` coroutines at once, gated by the controller.

Each prompt group gets its own obs/act queue pair and its own environment instance; a bridge task turns the
agent's requests into ZMQ round trips. A group that raises or overruns its deadline is dropped, its reason
counted, and its staleness budget returned to the controller; the worker goes on.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
import os
import time
from typing import Any, Awaitable, Callable, Optional, Sequence

import numpy as np

from arl.agents.common import live_queue_clients
from arl.data.position import DataPosition, stream_states
from arl.api.agent import Agent, EnvironmentService
from arl.api.types import GenerateResponse, Trajectory, checked_turn_discount, one_reward
from arl.rollout.client import InferenceClient, to_request
from arl.rollout.env_groups import EnvGroupSpec
from arl.rollout.filters import apply_filters
from arl.rollout.ledger import EngineLog, TokenLedgerError, verify_trajectory
from arl.rollout.loop_watchdog import LoopWatchdog
from arl.rollout.prompts import PromptStream, PromptStreams
from arl.rollout.guards import EnvCallError, GuardedEnv, call_with_deadline
from arl.rollout.staleness import make_group_id
from arl.transport.messages import Count, Error, GateAcquire, GroupDone, PromptSettled, SendControl
from arl.report.traces import GroupTimeline, TraceSampler, group_traces
from arl.utils.errors import describe_error, exception_text
from arl.utils.histogram import LogHistogram
from arl.utils.timer import PhaseTimer

logger = logging.getLogger("arl.rollout")


# drop reasons that settle no prompt: the group was lost with a learner (its policy version, or the learner itself
# did not come back in time), so its prompt is drawn again; every other drop is by a counted rule
REDRAWN = frozenset({"lost_version", "learner_lost"})


class _ObsQueue(asyncio.Queue):
    """The obs_queue of one collect_trajectory. A put starts the request at once (no task has to read the queue)
    and its answer goes to the act_queue; ``generate`` is the direct path (see ``arl.api.agent.Agent``), which
    skips the act_queue. Unbounded, as a plain queue would be."""

    def __init__(self, client: InferenceClient, act_queue: asyncio.Queue, engine_log: Optional[EngineLog],
                 timeline: Optional[GroupTimeline] = None) -> None:
        super().__init__()
        self._client = client
        self._act = act_queue
        self._log = engine_log
        self._timeline = timeline
        self.inflight: set[asyncio.Task] = set()

    async def generate(self, item: Any) -> GenerateResponse:
        try:
            req = to_request(item)
        except (TypeError, ValueError) as e:
            qid = item[0] if isinstance(item, tuple) and item else getattr(item, "qid", "?")
            return GenerateResponse(qid=str(qid), error=f"bad request: {e}")
        if self._timeline is None:
            resp = await self._client.generate(req)
        else:  # traced: when it went out and came back, which worker answered
            rec, info = self._timeline.start(req), {}
            resp = await self._client.generate(req, info)
            self._timeline.done(rec, resp, info.get("worker", -1), info.get("attempts", 0))
        if self._log is not None:
            self._log.add(req, resp)
        return resp

    async def _answer(self, item: Any) -> None:
        self._act.put_nowait(await self.generate(item))

    def put_nowait(self, item: Any) -> None:
        t = asyncio.get_running_loop().create_task(self._answer(item))
        self.inflight.add(t)
        t.add_done_callback(self.inflight.discard)


async def run_agent(
    agent: Agent,
    prompt: dict,
    env: EnvironmentService,
    client: InferenceClient,
    timeout: float,
    engine_log: Optional[EngineLog] = None,
    timeline: Optional[GroupTimeline] = None,
) -> list[Trajectory]:
    """Run one collect_trajectory with its own queues, bridged to the inference client, under a deadline.
    `engine_log` records every request/response pair (for the token ledger check), `timeline` every request's
    timing (for trajectory traces)."""
    act_q: asyncio.Queue = asyncio.Queue()
    obs_q = _ObsQueue(client, act_q, engine_log, timeline)
    try:
        # not asyncio.wait_for: an agent that swallows its cancellation must not hang the worker past its deadline
        trajs = await call_with_deadline(agent.collect_trajectory(prompt, env, obs_q, act_q), timeout)
    finally:
        for t in list(obs_q.inflight):
            t.cancel()
    trajs = [] if trajs is None else list(trajs)
    for t in trajs:
        if not isinstance(t, Trajectory):
            raise TypeError(f"collect_trajectory must return a list of Trajectory, got {type(t).__name__}")
    return trajs


def _failure_detail(env: Any) -> Optional[str]:
    """The message and frames of the env failure a group is dropped for (its first failed `GuardedEnv`)."""
    for m in getattr(env, "members", None) or ([env] if env is not None else []):
        if getattr(m, "failure", None):
            return getattr(m, "failure_detail", None)
    return None


def plain(obj: Any) -> Any:
    """`obj` with numpy scalars and arrays as Python numbers and lists, tuples as lists and dict subclasses as
    dicts (what the wire carries); anything else is left for the codec to refuse."""
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


def wire_ready(t: Trajectory) -> None:
    """Make what an agent may have put in `t` after building it sendable: turn rewards as `reward` takes them
    (a number or a one-element sequence), metadata without numpy types. ValueError/TypeError: the agent's bug."""
    t.reward = one_reward(t.reward, "Trajectory.reward")
    t.turn_rewards = [one_reward(r, "Trajectory.turn_rewards") for r in t.turn_rewards]
    t.turn_discount = checked_turn_discount(t.turn_discount)
    if not isinstance(t.metadata, dict):
        raise TypeError(f"Trajectory.metadata must be a dict, got {type(t.metadata).__name__}")
    t.metadata = plain(t.metadata)


def _reward_sum(trajs: Sequence[Trajectory]) -> float:
    """Sum of the rewards; 0.0 when one is not a number (that group was dropped for it)."""
    try:
        return float(sum(float(t.reward) for t in trajs))
    except (TypeError, ValueError):
        return 0.0


def trajectory_stats(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Sums over `trajs` of their numeric metadata (tool calls, turns, void turns, solved, ...) and rewards, so
    the controller can report per-trajectory means."""
    out: collections.Counter = collections.Counter()
    for t in trajs:
        out["reward"] += float(t.reward)
        out["length"] += len(t.input_ids)
        out["generated_tokens"] += int(t.num_generated)
        for k, v in t.metadata.items():
            if isinstance(v, (bool, int, float)) and k not in ("prompt_pos",):
                out[k] += float(v)
    return dict(out)


class RolloutWorker:
    def __init__(self, *, index: int, make_agent: Callable[[], Agent], make_eval_agent: Callable[[], Agent],
                 make_env: Callable[[], EnvironmentService], prompts: PromptStream | PromptStreams,
                 test_rows: Sequence[dict],
                 client: InferenceClient, send_control: SendControl,
                 push_group: Callable[[list[Trajectory]], Awaitable[None]], capacity: int, trajectory_timeout: float,
                 eval_concurrency: int = 64, seed: int = 0, env_timeout: Optional[float] = None,
                 env_groups: Optional[EnvGroupSpec] = None, filter_void_turns: bool = False,
                 filter_uniform_groups: bool = False, verify_token_ledger: bool = False, tokenizer: Any = None,
                 trace_rate: float = 0.0, agent_name: str = "", loop_block_s: float = 1.0,
                 learner_wait_s: float = 600.0,
                 push_settled: Optional[Callable[[PromptSettled], Awaitable[None]]] = None) -> None:
        """`learner_wait_s`: how long a finished group waits for a lost learner's restart (`learner_lost`) before
        it is dropped as `learner_lost`. `push_settled`: tells the learner (on the trajectory socket) that a group
        was dropped here by a counted rule, so its prompt is settled in the learner's checkpoint and a resume does
        not draw it again."""
        self.index = index
        # a thread that names the agent when the event loop (every group, the client, the endpoint) stops running
        # for more than loop_block_s (0: none); started with the acquire loop
        self._agent_name, self._loop_block_s = agent_name, loop_block_s
        self._watchdog: Optional[LoopWatchdog] = None
        self._make_agent, self._make_eval_agent, self._make_env = make_agent, make_eval_agent, make_env
        # the prompt streams this worker draws (its own, and those it adopted from workers that left)
        self._prompts = prompts if isinstance(prompts, PromptStreams) else PromptStreams.of(prompts, index)
        self._test_rows = list(test_rows)
        self._client = client
        self._send = send_control
        self._push = push_group
        self._push_settled = push_settled
        # prompt positions whose groups ended here (pushed or dropped): what a restart of this worker, sent it back
        # by the controller from the heartbeats, does not draw again; and the positions of the running groups
        self._ended: dict[int, DataPosition] = {sid: DataPosition() for sid in self._prompts.ids}  # per stream
        self._running_pos: dict[asyncio.Task, tuple[int, int]] = {}  # (stream, position)
        self.draining = False  # leaving the run: asks for no new groups, finishes the ones it has
        self._timeout = trajectory_timeout
        self._eval_concurrency = eval_concurrency
        self._seed = seed
        self._group_ids = itertools.count()
        # group ids stay unique across restarts of this worker (the learner normalises advantages per group id)
        self._incarnation = os.urandom(3).hex()
        self._env_timeout = env_timeout if env_timeout else trajectory_timeout
        self.env_stats: collections.Counter = collections.Counter()  # shared by every GuardedEnv of this worker
        # env groups: one env instance per trajectory, same seed within a group (pooled when configured)
        spec = env_groups or EnvGroupSpec({"env": make_env}, group_size=1)
        self._env_pool = spec.pool(wrap=lambda e: GuardedEnv(e, self._env_timeout, self.env_stats), base_seed=seed)
        if self._env_pool.capacity is not None:
            capacity = min(capacity, self._env_pool.capacity)
        self._filters = {"void_turns": filter_void_turns, "uniform_groups": filter_uniform_groups}
        self._verify_ledger = verify_token_ledger
        # trajectory traces (arl.report.traces): a `trace_rate` sample of groups plus every group an error or a
        # filter touched, decoded here (the tokenizer is needed) and sent to the controller with group_done
        self._tokenizer = tokenizer
        self._tracer = TraceSampler(trace_rate, seed=seed * 1000 + index) if tokenizer is not None else None
        self.traj_stats: collections.Counter = collections.Counter()  # numeric trajectory metadata, summed
        self._running: set[asyncio.Task] = set()
        self._wanted = 0  # acquire requests the controller has not granted yet
        self._wake = asyncio.Event()
        self._capacity = capacity
        self.stats: collections.Counter = collections.Counter()
        self.drop_reasons: collections.Counter = collections.Counter()
        # admission latency: gate_acquire sent -> gate_grant received, per admitted group (FIFO matching)
        self._acquires: collections.deque[list] = collections.deque()  # [time sent, groups not yet granted]
        self.admission = LogHistogram()
        # the learner's restarts: while it is lost, finished groups wait (pushed to the dead process they would be
        # lost after their group_done said accepted); each rollback (epoch, version) caps the token versions of the
        # groups that started before it
        self._learner_up = asyncio.Event()
        self._learner_up.set()
        self._learner_wait = learner_wait_s
        self._learner_epoch = 0
        self._rollbacks: list[tuple[int, int]] = []

    # -- controller commands -------------------------------------------------------------------------------
    def on_grant(self, n: int) -> None:
        self._wanted = max(0, self._wanted - n)
        now = time.monotonic()
        for _ in range(n):
            wait = None  # how long this group waited for admission (FIFO over the acquires sent)
            if self._acquires:
                entry = self._acquires[0]
                wait = now - entry[0]
                self.admission.add(wait)
                entry[1] -= 1
                if entry[1] == 0:
                    self._acquires.popleft()
            sid, pos, prompt = self._prompts.draw()
            t = asyncio.create_task(self._run_group(prompt, (sid, pos), wait))
            self._running.add(t)
            self._running_pos[t] = (sid, pos)
            t.add_done_callback(self._group_finished)

    def learner_lost(self) -> None:
        """The controller is restarting the learner: finished groups wait for `learner_back`."""
        self._learner_up.clear()

    def learner_back(self, version: int) -> None:
        """The restarted learner resumed at `version` (the caller already points the pushes at it): groups that
        started before now and hold tokens of a later version (a lost policy) are dropped as `lost_version`."""
        self._learner_epoch += 1
        self._rollbacks.append((self._learner_epoch, int(version)))
        self._learner_up.set()

    def rewind_prompts(self, state: Any) -> list[int]:
        """Continue the prompt streams from data position `state` (a resume's, a restart's, a rolled-back
        learner's checkpoint; per stream, `stream_states`; None: nothing to rewind): their unsettled positions are
        drawn again, except those of groups running here (a running group dropped as `lost_version` puts its
        prompt back, see `_settle`). A stream not drawn here yet is adopted. Returns the streams rewound; ValueError
        for a malformed state."""
        if state is None:
            return []
        states = stream_states(state, self._prompts.own)
        drawn: dict[int, list[int]] = collections.defaultdict(list)
        for sid, pos in self._running_pos.values():
            drawn[sid].append(pos)
        self._prompts.restore(states, drawn)
        for sid, st in states.items():
            self._ended[sid] = DataPosition.from_state(st)
        return sorted(states)

    def adopt_streams(self, state: Any) -> None:
        """Draw the streams of a worker that left the run too, from their data positions (`stream_states` form):
        what it had not finished is drawn again here, then fresh prompts of those streams in turn with ours."""
        adopted = self.rewind_prompts(state)
        logger.info("rollout%d: adopted prompt streams %s (drawing streams %s)", self.index, adopted,
                    self._prompts.ids)

    def drain(self) -> None:
        """Leave the run: ask the gate for nothing more; the groups running here finish (and are pushed)."""
        self.draining = True
        self._wake.set()
        logger.warning("rollout%d: leaving the run: asking for no new groups, finishing the %d running", self.index,
                       len(self._running))

    async def _learner_takes(self, trajs: Sequence[Trajectory], epoch: int) -> str:
        """'accepted' once a learner is up that may train `trajs` (a group started in learner `epoch`), else why
        not: 'learner_lost' (it did not come back within `learner_wait_s`), 'lost_version'."""
        if not self._learner_up.is_set():
            try:
                await asyncio.wait_for(self._learner_up.wait(), self._learner_wait)
            except asyncio.TimeoutError:
                return "learner_lost"
        ceiling = min((v for e, v in self._rollbacks if e > epoch), default=None)
        newest = max((int(np.max(t.versions)) for t in trajs if len(t.versions)), default=-1)
        return "lost_version" if ceiling is not None and newest > ceiling else "accepted"

    def _group_finished(self, t: asyncio.Task) -> None:
        self._running.discard(t)
        self._running_pos.pop(t, None)
        self._wake.set()

    def start_watchdog(self) -> None:
        """Start the loop watchdog on the running loop (idempotent; none when loop_block_s is 0)."""
        if self._watchdog is None and self._loop_block_s > 0:
            self._watchdog = LoopWatchdog(self._loop_block_s, label=f"rollout{self.index}", agent=self._agent_name)
            self._watchdog.start()

    async def acquire_loop(self) -> None:
        """Keep asking the controller's staleness gate for as many groups as this worker has room for."""
        self.start_watchdog()
        while True:
            want = self._capacity - len(self._running) - self._wanted
            if want > 0 and not self.draining:
                self._wanted += want
                self._acquires.append([time.monotonic(), want])
                await self._send(GateAcquire(want=Count(want), incarnation=self._incarnation))
            self._wake.clear()
            await self._wake.wait()

    # -- one prompt group ------------------------------------------------------------------------------------
    async def _run_group(self, prompt: dict, prompt_pos: tuple[int, int] = (-1, -1),
                         admission_s: Optional[float] = None) -> None:
        """`prompt_pos`: (stream, position) the prompt was drawn at ((-1, -1): none, e.g. a test's)."""
        gid = make_group_id(self.index, self._incarnation, next(self._group_ids))
        epoch = self._learner_epoch
        timer = PhaseTimer()
        timer.start("group")  # env, agent, filters, push: the group's `seconds`
        reason, trajs = "accepted", []
        error: Optional[str] = None  # a dropped group's error: its message and where it was raised (bounded)
        raw: list[Trajectory] = []  # what the agent returned, before filters (for traces)
        env: Any = None
        stats: dict[str, float] = {}
        n_raw = 0
        log = EngineLog() if self._verify_ledger else None
        timeline = GroupTimeline() if self._tracer is not None else None
        try:
            env = await self._env_pool.acquire(options=dict(prompt), timeout=self._env_timeout,
                                               seed=None if self._env_pool.pooled else self._seed)
            trajs = await run_agent(self._make_agent(), prompt, env, self._client, self._timeout, log, timeline)
            for t in trajs:
                wire_ready(t)
            raw = list(trajs)
            if env.failure is not None:  # the agent caught an env failure and went on: its rewards are made up
                reason, error = env.failure, _failure_detail(env)
            elif not trajs:
                reason = "filtered"
            else:
                if log is not None:
                    await self._check_ledger(trajs, log)
                stats, n_raw = trajectory_stats(trajs), len(trajs)
                trajs, dropped, counts = apply_filters(trajs, **self._filters)
                self.stats["void_trajectories_dropped"] += counts["void_trajectories"]
                stats["void_trajectories_dropped"] = counts["void_trajectories"]
                if dropped:
                    reason = dropped
        except EnvCallError as e:
            reason, error = e.reason, describe_error(str(e), e.__cause__)
            logger.warning("group %s (prompt %s) dropped: %s", gid, prompt.get("id"), e)
        except TokenLedgerError as e:
            reason, error = "error:TokenLedgerError", describe_error(exception_text(e))
        except asyncio.TimeoutError:
            reason = getattr(env, "failure", None) or "timeout"
            error = _failure_detail(env) or f"the agent took longer than {self._timeout:g}s (trajectory deadline)"
        except Exception as e:  # noqa: BLE001 - one bad trajectory must not take the worker down
            reason = getattr(env, "failure", None) or f"error:{type(e).__name__}"
            error = _failure_detail(env) or describe_error(exception_text(e), e)
            logger.warning("group %s (prompt %s) failed: %s: %s", gid, prompt.get("id"), type(e).__name__, e)
        finally:
            if env is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._env_pool.release(env), 5.0)
        self.traj_stats.update(stats)
        size: Optional[int] = None
        if reason == "accepted":  # a learner that may train it, and a policy that still exists
            reason = await self._learner_takes(trajs, epoch)
        if reason == "accepted":  # the push can fail too: the group still ends with its group_done
            try:
                for t in trajs:
                    t.group_id = f"{gid}:{t.group_id}"
                    t.metadata["prompt_pos"] = list(prompt_pos)  # the learner's checkpoint keeps data position
                await self._push(trajs)
                self.stats["trajectories"] += len(trajs)
            except Exception as e:  # noqa: BLE001 - e.g. metadata the wire cannot carry, a frame over the limit
                size = getattr(e, "size_bytes", None)  # arl.transport.sockets.FrameTooLarge
                reason = "too_large" if size is not None else f"error:{type(e).__name__}"
                error = describe_error(exception_text(e), e)
                logger.warning("group %s (prompt %s) could not be sent to the learner: %s: %s", gid, prompt.get("id"),
                               type(e).__name__, e)
        accepted = reason == "accepted"
        if not accepted:
            self.drop_reasons[reason] += 1
        await self._settle(prompt_pos, reason)
        self.stats["groups_" + ("accepted" if accepted else "dropped")] += 1
        done = GroupDone(accepted=accepted, reason=reason, group_id=gid, n_traj=len(trajs),
                         reward_sum=_reward_sum(trajs), seconds=timer.pop()["group"],
                         traj_stats=stats,  # sums of numeric trajectory metadata, before filters
                         n_traj_raw=n_raw, error=error if not accepted else None, size_bytes=size)
        traces = self._traces(raw, timeline, reason, admission_s, done.seconds, len(raw) != len(trajs), gid,
                              prompt.get("id"))
        done.traces = traces or None
        await self._report(done)

    async def _settle(self, prompt_pos: tuple[int, int], reason: str) -> None:
        """The group of `prompt_pos` (stream, position) ended (pushed or dropped): booked here, and a drop is told
        to the learner, whose checkpoint settles it (a pushed group is settled when the learner trains it)."""
        sid, pos = prompt_pos
        if pos < 0:
            return
        if reason in REDRAWN:  # no rule dropped it: the learner that would have trained it is gone
            self._prompts.put_back(sid, pos)
            return
        self._ended.setdefault(sid, DataPosition()).settle(pos)
        if reason == "accepted" or self._push_settled is None:
            return
        try:
            await self._push_settled(PromptSettled(worker=sid, position=pos, reason=reason[:100]))
        except Exception as e:  # noqa: BLE001 - the drop is still counted; a resume would draw the prompt again
            self.stats["settle_notice_errors"] += 1
            logger.warning("could not tell the learner that prompt %s was dropped: %s: %s", prompt_pos,
                           type(e).__name__, e)

    async def _report(self, done: GroupDone) -> None:
        """Send a group's group_done; if it cannot go as it is (traces or stats the wire cannot carry, a frame over
        the limit), without them: every admitted group must end with exactly one, or it holds its gate slot."""
        try:
            await self._send(done)
        except (TypeError, ValueError) as e:
            self.stats["group_done_trimmed"] += 1
            logger.warning("group %s: group_done sent without its traces and stats (%s: %s)", done.group_id,
                           type(e).__name__, e)
            await self._send(dataclasses.replace(done, reward_sum=0.0, traj_stats=None, n_traj_raw=None, traces=None,
                                                 error=None))

    def _traces(self, raw: list[Trajectory], timeline: Optional[GroupTimeline], reason: str,
                admission_s: Optional[float], seconds: float, some_dropped: bool, gid: str,
                prompt_id: Any) -> list[dict]:
        """This group's trajectory traces when it is sampled, or touched by an error or a filter (else [])."""
        if self._tracer is None:
            return []
        why = self._tracer.want(forced=reason != "accepted" or some_dropped)
        if why is None:
            return []
        try:
            step = max(0, int(getattr(self._client, "version", 0)))  # newest policy version this worker has seen
            return group_traces(raw, self._tokenizer, timeline, outcome=reason, why=why, step=step,
                                rollout=self.index, admission_s=admission_s, seconds=seconds,
                                void_filter=self._filters["void_turns"], group_id=gid, prompt_id=prompt_id)
        except Exception as e:  # noqa: BLE001 - a trace must never cost a group
            self.stats["trace_errors"] += 1
            logger.warning("could not build the traces of a group: %s: %s", type(e).__name__, e)
            return []

    async def _check_ledger(self, trajs: Sequence[Trajectory], log: EngineLog) -> None:
        """Token ledger check: a drift is a bug in the agent or the stack, so it stops the run (loudly)."""
        for t in trajs:
            try:
                verify_trajectory(t, log)
            except TokenLedgerError as e:
                self.stats["ledger_failures"] += 1
                logger.error("%s", e)
                await self._send(Error(message=f"rollout{self.index}: {e}"))
                raise
        self.stats["ledger_checked"] += len(trajs)

    # -- evaluation ----------------------------------------------------------------------------------------
    async def evaluate(self, version: int, max_prompts: int = 0) -> dict:
        """Greedy, one sample per prompt, over the held-out rows."""
        rows = self._test_rows[:max_prompts] if max_prompts else self._test_rows
        sem = asyncio.Semaphore(self._eval_concurrency)
        results: list[dict] = []
        errors = collections.Counter()
        versions: list[int] = []
        stats: collections.Counter = collections.Counter()

        async def one(row: dict) -> None:
            async with sem:
                env = GuardedEnv(self._make_env(), self._env_timeout, self.env_stats)
                try:
                    await env.reset(seed=self._seed, options=dict(row))
                    log = EngineLog() if self._verify_ledger else None
                    trajs = await run_agent(self._make_eval_agent(), row, env, self._client, self._timeout, log)
                    if trajs and log is not None:
                        await self._check_ledger(trajs[:1], log)
                    if trajs:
                        stats.update(trajectory_stats(trajs[:1]))
                        results.append(trajs[0].metadata)
                        versions.extend(int(v) for v in trajs[0].versions[trajs[0].loss_mask.astype(bool)])
                except Exception as e:  # noqa: BLE001
                    errors[getattr(e, "reason", None) or type(e).__name__] += 1
                finally:
                    await env.close()

        timer = PhaseTimer()
        with timer.phase("eval"):
            await asyncio.gather(*(one(r) for r in rows))
        n = len(rows)
        first = sum(bool(m.get("first_correct")) for m in results)
        solved = sum(bool(m.get("solved")) for m in results)
        turns = [m.get("turns", 1) for m in results]
        return {"version": version, "n": n, "first_acc": first / n if n else 0.0,
                "solved_acc": solved / n if n else 0.0, "mean_turns": sum(turns) / len(turns) if turns else 0.0,
                "traj_means": {k: v / len(results) for k, v in sorted(stats.items())} if results else {},
                "errors": dict(errors), "token_versions": [min(versions), max(versions)] if versions else [],
                "seconds": timer.seconds["eval"]}

    def heartbeat_stats(self) -> dict:
        return {
            # per stream: a restarted worker (or one adopting this one's streams) draws again what had not ended
            "prompt_position": {str(sid): d.to_state() for sid, d in sorted(self._ended.items())},
            "running": len(self._running),  # live groups: with queue_clients, flat in a long run (no leak)
            **({"draining": True} if self.draining else {}),  # leaving the run: stopped once nothing runs
            "queue_clients": live_queue_clients(),
            "wanted": self._wanted,
            **{k: int(v) for k, v in self.stats.items()},
            "drop_reasons": dict(self.drop_reasons),
            "traj_stats": dict(self.traj_stats),
            "client": dict(self._client.stats),
            "env": {k: int(v) for k, v in self.env_stats.items()},
            "waiting_on": self.waiting_on(),
            "admission_p99_ms": self.admission.quantile(0.99) * 1000 if self.admission.total else None,
            "admission_hist": self.admission.to_list(),
            **({"loop_watchdog": self._watchdog.stats()} if self._watchdog is not None else {}),
        }

    def waiting_on(self) -> str:
        """What this worker waits for, for the controller's log if it goes silent."""
        outstanding = len(getattr(self._client, "_pending", ()))
        blocked = self._watchdog.summary() if self._watchdog is not None else ""
        return (f"{len(self._running)} groups running ({outstanding} inference requests outstanding, "
                f"{self.env_stats['env_calls_in_flight']} env calls in flight); "
                f"{self._wanted} groups awaiting a gate grant" + (f"; {blocked}" if blocked else ""))

    async def close(self) -> None:
        for t in list(self._running):
            t.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._env_pool.close(), 5.0)
        if self._watchdog is not None:
            self._watchdog.close()
