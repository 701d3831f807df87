"""What the controller reports: metric records to sinks (metrics.jsonl and any experiment tracker), the progress
bar, and the run's accounting of where every group went. No sockets; the controller feeds it events.
"""

from __future__ import annotations

import collections
import json
import logging
import sys
import time
from typing import Any, Callable, Optional, Protocol

from arl.report.page import ReportBuilder
from arl.report.traces import TraceWriter
from arl.utils.proc import rss_mib

logger = logging.getLogger("arl.controller")

def format_result(p: dict) -> str:
    """The line the controller logs for each evaluation of a run (and scripts/evaluate.py prints)."""
    return (f"eval v{p['version']}: first-answer acc {p['first_acc']:.3f}, solved within all turns "
            f"{p['solved_acc']:.3f} ({p['n']} prompts, {p.get('seconds', 0):.1f}s)")


class MetricsSink(Protocol):
    """Where metric records go. `step` is the policy version the record belongs to (trackers plot against it)."""

    def log(self, record: dict, step: int) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Appends one JSON object per line to metrics.jsonl (flushed at once, so a crash keeps the history)."""

    def __init__(self, path: str) -> None:
        self._f = open(path, "a", buffering=1)

    def log(self, record: dict, step: int) -> None:
        self._f.write(json.dumps({"time": time.time(), **record}, default=float) + "\n")

    def close(self) -> None:
        self._f.close()


# drop reasons of groups whose rewards are all equal (no group advantage): the agent's own filter returns no
# trajectories ('filtered'), rollout.filter_uniform_groups drops the group; not a fault of the system
UNIFORM_REASONS = frozenset({"filtered", "filtered:uniform_reward"})
UNIFORM_TEXT = "every group has equal rewards: the task is solved or too hard at this setting"
MAX_ERROR_CHARS = 2000  # what one kept error may hold (the rollout worker bounds it too)


class ProgressWatch:
    """Is the run getting anywhere? Pure: events and the time come from the caller (the controller).

    Progress is a group accepted or a learner step. Time counts only while the watch is not held (the controller
    holds it while admission is closed, i.e. before the first evaluation, and while an evaluation runs): a
    warm-up or an evaluation is not "no progress". Drops are every other outcome of a group, by reason (a rollout
    drop such as 'timeout', 'error:ValueError', 'env_error', a filter such as 'filtered:uniform_reward', or the
    learner's 'learner_stale' / 'learner_invalid'); a filtered group makes no progress either, so it counts, under
    its name. A dropped group may come with its error (message and innermost frames): the newest per reason is
    kept and said when the run stops for that reason.

    `check` says 'warn' when no learner step happened for `warn_after_s` (again every `warn_after_s`); 'stop'
    when the last `max_consecutive_drops` groups were all dropped for the same reason (groups filtered as uniform
    make no streak: equal rewards are the task's state, not a fault), or when no group was accepted and no step
    made for `max_no_progress_s` while groups kept being dropped; 'stall' when that time passed with no group
    finishing at all (leaked slots, a stuck learner, a lost push: the caller adds what each role is doing).
    0 turns a limit off.
    """

    def __init__(self, *, max_no_progress_s: float = 0.0, max_consecutive_drops: int = 0,
                 warn_after_s: Optional[float] = 0.0) -> None:
        """`warn_after_s` None: a fifth of the stop budget, at most a minute (a minute without one)."""
        self.max_no_progress_s = float(max_no_progress_s)
        self.max_consecutive_drops = int(max_consecutive_drops)
        if warn_after_s is None:
            warn_after_s = min(60.0, max_no_progress_s / 5) if max_no_progress_s else 60.0
        self.warn_after_s = float(warn_after_s)
        self.drops: collections.Counter = collections.Counter()  # every drop of the run, by reason
        self._recent: collections.Counter = collections.Counter()  # drops since the last accepted group or step
        self.streak, self.streak_reason = 0, ""  # consecutive drops for one reason (an accepted group ends it)
        self.since_progress = self.since_step = 0.0  # un-held seconds since the last progress / learner step
        self.errors: dict[str, str] = {}  # the newest error per drop reason (at most 32 reasons, newest last)
        self._warned_at = 0.0  # since_step when the last warning was given
        self._held = True  # until the controller opens admission
        self._last: Optional[float] = None

    def _tick(self, now: float) -> None:
        if self._last is not None and not self._held:
            dt = max(0.0, now - self._last)
            self.since_progress += dt
            self.since_step += dt
        self._last = now

    def hold(self, held: bool, now: float) -> None:
        """Held (warm-up, admission closed, an evaluation): the time from now on does not count."""
        self._tick(now)
        self._held = held

    def accepted(self, now: float) -> None:
        self._tick(now)
        self.since_progress = 0.0
        self._recent.clear()
        self.streak, self.streak_reason = 0, ""

    def stepped(self, now: float) -> None:
        self._tick(now)
        self.since_progress = self.since_step = self._warned_at = 0.0
        self._recent.clear()

    def dropped(self, reason: str, now: float, n: int = 1, streak: bool = True, error: Optional[str] = None) -> None:
        """`streak=False`: counted, but it neither extends nor ends the run of same-reason drops (the learner's
        drops: a peer that floods the learner with malformed groups must not be able to stop the run; and groups
        filtered as uniform). `error`: what the group failed with."""
        self._tick(now)
        if n <= 0:
            return
        self.drops[reason] += n
        self._recent[reason] += n
        if error:
            self.errors.pop(reason, None)
            self.errors[reason] = str(error)[:MAX_ERROR_CHARS]
            while len(self.errors) > 32:
                del self.errors[next(iter(self.errors))]
        if streak and reason not in UNIFORM_REASONS:
            self.streak = self.streak + n if reason == self.streak_reason else n
            self.streak_reason = reason

    def top_reason(self) -> tuple[str, int]:
        """The most frequent drop reason since the last progress (else of the whole run) and its count."""
        counts = self._recent or self.drops
        return counts.most_common(1)[0] if counts else ("none", 0)

    def _error_of(self, reason: str) -> str:
        """'; newest error: ...' for `reason` (else the newest of any reason), or ''."""
        if reason in self.errors:
            return f"; its newest error:\n{self.errors[reason]}"
        if self.errors:
            other = next(reversed(self.errors))
            return f"; the newest error (for '{other}'):\n{self.errors[other]}"
        return ""

    def check(self, now: float) -> Optional[tuple[str, str]]:
        """None, ('warn', text), ('stop', reason to stop the run with) or ('stall', the same, for a run where
        nothing finished: the caller says what each role is doing)."""
        self._tick(now)
        if self.max_consecutive_drops and self.streak >= self.max_consecutive_drops:
            return "stop", (f"the last {self.streak} prompt groups were all dropped for '{self.streak_reason}' "
                            f"(rollout.max_consecutive_drops={self.max_consecutive_drops}); see logs/rollout*.log"
                            + self._error_of(self.streak_reason))
        if self.max_no_progress_s and self.since_progress >= self.max_no_progress_s:
            limit = f"rollout.max_no_progress_s={self.max_no_progress_s:g}"
            if not self._recent:
                return "stall", (f"no prompt group accepted and no learner step for {self.since_progress:.0f}s, and no "
                                 f"group dropped either: something is stuck ({limit})")
            if self._uniform():
                return "stop", (f"no prompt group accepted for {self.since_progress:.0f}s: {UNIFORM_TEXT} "
                                f"({sum(self._recent.values())} groups filtered as uniform: "
                                f"{format_drops(self._recent)}; {limit})")
            reason, n = self.top_reason()
            return "stop", (f"no prompt group accepted for {self.since_progress:.0f}s while "
                            f"{sum(self._recent.values())} were dropped, most for '{reason}' ({n}) "
                            f"({limit}); see logs/rollout*.log" + self._error_of(reason))
        if self.warn_after_s and self.since_step - self._warned_at >= self.warn_after_s:
            self._warned_at = self.since_step
            reason, n = self.top_reason()
            text = (f"no learner step for {self.since_step:.0f}s; groups dropped by reason: "
                    f"{format_drops(self._recent or self.drops) or 'none'}")
            if self._uniform():
                text += f": {UNIFORM_TEXT}"
            elif n:
                text += f"; top reason '{reason}'"
            return "warn", text
        return None

    def _uniform(self) -> bool:
        """Every group dropped since the last progress was filtered for equal rewards."""
        return bool(self._recent) and all(r in UNIFORM_REASONS for r in self._recent)


def format_drops(counts: Any, top: int = 3) -> str:
    """'timeout 12, error:ValueError 3' for the `top` most frequent reasons (those beyond: '+k more')."""
    items = [(str(k), int(v)) for k, v in collections.Counter(counts).most_common() if v > 0]
    text = ", ".join(f"{k} {v}" for k, v in items[:top])
    return text + (f", +{len(items) - top} more" if len(items) > top else "")


LEARNER_KEYS = ("groups_received", "trajectories_received", "trained_groups", "trained_trajectories",
              "stale_groups_dropped", "stale_trajectories_dropped", "invalid_groups", "buffered_groups",
              "buffered_trajectories", "in_step_groups", "trained_twice", "duplicate_prompts")


# the inference client's counters the accounting sums over rollout workers (arl.rollout.client)
REQUEST_KEYS = ("sent", "received", "resent_timeout", "resent_lost", "timeout", "aborted_resent",
                "aborted_abandoned", "aborted_superseded", "late")


def _env_counts(rollout_stats: dict) -> dict:
    """A rollout worker's env counters from its heartbeat, less the gauge of calls in flight."""
    return {k: v for k, v in dict(rollout_stats.get("env") or {}).items() if k != "env_calls_in_flight"}


class MemoryTrack:
    """Each role's resident memory (the `rss_mib` of its heartbeats, and the controller's own) at a few points of the
    run: the first step, the first step past a quarter of the run (after warm-up: caches and pools are full by
    then), the newest, and the largest seen. O(roles), whatever the run's length: a record per step would itself
    grow. The growth from the quarter to the end is what a leak shows as."""

    def __init__(self, total_steps: int) -> None:
        self.quarter_step = max(1, total_steps // 4)
        self.roles: dict[str, dict[str, float]] = {}
        self.largest = ""

    def note(self, step: int, role_stats: dict) -> dict[str, float]:
        now: dict[str, float] = {}
        own = rss_mib()
        if own is not None:
            now["controller"] = own
        for (role, index), st in sorted(role_stats.items()):
            v = st.get("rss_mib")
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                now[f"{role}{index}"] = float(v)
        for name, v in now.items():
            r = self.roles.setdefault(name, {"first": v, "first_step": step, "max": v})
            if "quarter" not in r and step >= self.quarter_step:
                r["quarter"], r["quarter_step"] = v, step
            r["end"], r["end_step"], r["max"] = v, step, max(r["max"], v)
        if now:
            name = max(now, key=lambda k: now[k])
            self.largest = f"{name} {now[name]:.0f}M"
        return now

    def summary(self) -> dict[str, dict[str, float]]:
        """Per role: MiB at the first step, at a quarter, at the end, the max, and `growth_pct` (end over quarter)."""
        out = {}
        for name, r in sorted(self.roles.items()):
            row = dict(r)
            if r.get("quarter"):
                row["growth_pct"] = round(100.0 * (r["end"] / r["quarter"] - 1.0), 1)
            out[name] = row
        return out


class Reporter:
    """Counts of the run (groups by outcome, faults) and the records written about it."""

    def __init__(self, sinks: list[MetricsSink], *, total_steps: int, progress: bool = False,
                 clock: Callable[[], float] = time.monotonic, traces: Optional[TraceWriter] = None,
                 page: Optional[ReportBuilder] = None) -> None:
        self.sinks = sinks
        self.traces, self.page = traces, page  # traces.jsonl and report.html, when the run keeps them
        self.total_steps = total_steps
        self.progress = progress
        self.clock = clock
        self.t_start = clock()
        self.step = 0
        self.group_reasons: collections.Counter = collections.Counter()
        self.accepted_groups = self.accepted_trajectories = self.lost_groups = 0
        self.faults: list[dict] = []
        self.env_of_restarted: collections.Counter = collections.Counter()  # env counts of dead incarnations
        self.evals: dict[int, dict] = {}
        self._traj_sums: collections.Counter = collections.Counter()  # trajectory metadata since the last step
        self._infer_busy_prev: dict[int, tuple[float, float]] = {}
        self._bar: Any = None
        self._postfix: dict = {}
        self._warned: set[str] = set()  # rollout workers' warnings already said
        self._session_text = ""  # endpoint agents' sessions running / waiting, for the progress line
        self._drops_text = ""
        self._drops_shown_at = -1e9
        self.memory = MemoryTrack(total_steps)

    def elapsed(self) -> float:
        return self.clock() - self.t_start

    def write(self, record: dict, step: Optional[int] = None) -> None:
        for sink in self.sinks:
            sink.log(record, self.step if step is None else step)

    def event(self, record_type: str, /, **fields: Any) -> None:
        self.write({"type": record_type, "elapsed": self.elapsed(), **fields})

    def fault(self, kind: str, record_type: str = "fault", /, **fields: Any) -> None:
        """A fault handled: kept for the accounting and written as a record."""
        fault = {"kind": kind, **fields}
        self.faults.append(fault)
        self.event(record_type, **fault)

    # -- groups ----------------------------------------------------------------------------------------------
    def group_done(self, accepted: bool, reason: Optional[str], n_traj: int, traj_stats: Any, n_raw: Any,
                   traces: Optional[list[dict]] = None) -> None:
        self.group_reasons[str(reason)] += 1
        if traces and self.traces is not None:
            self.traces.write(traces)
        if accepted:
            self.accepted_groups += 1
            self.accepted_trajectories += n_traj
        self._note_traj_stats(traj_stats, n_raw)

    def learner_rollback(self, groups_settled: int, trajectories_settled: int) -> int:
        """The learner restarted from a checkpoint that accounts for `groups_settled` groups: the groups accepted
        beyond them were lost with the dead process (their budget is back in the gate); returns how many."""
        lost = max(0, self.accepted_groups - groups_settled)
        self.accepted_groups -= lost
        self.accepted_trajectories = min(self.accepted_trajectories, trajectories_settled)
        if lost:
            self.group_reasons["lost_learner_restart"] += lost
        return lost

    def groups_lost(self, n: int) -> None:
        if n:
            self.lost_groups += n
            self.group_reasons["lost_worker_died"] += n

    def _note_traj_stats(self, stats: Any, n: Any) -> None:
        """Sum the numeric trajectory metadata a group_done carries (before filters: tool calls, void turns,
        rewards...) until the next train record reports their per-trajectory means."""
        if not isinstance(stats, dict) or not isinstance(n, (int, float)) or n <= 0:
            return
        for k, v in stats.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self._traj_sums[str(k)] += float(v)
        self._traj_sums["__n"] += float(n)

    def take_traj_means(self) -> dict:
        sums, self._traj_sums = self._traj_sums, collections.Counter()
        n = sums.pop("__n", 0.0)
        if not n:
            return {}
        return {"n_traj": int(n), **{k: v / n for k, v in sorted(sums.items())}}

    # -- steps and evaluations -------------------------------------------------------------------------------
    def train(self, version: int, metrics: dict, role_stats: dict, admitted_eta: Optional[int] = None) -> None:
        """The learner published `version`: one train record, and the progress bar moves. `admitted_eta`: the
        eta its groups were admitted at, when it steers itself (`max_head_offpolicyness=auto`)."""
        self.step = version
        if admitted_eta is not None:
            metrics = {**metrics, "admitted_eta": admitted_eta}
        rss = self.memory.note(version, role_stats)
        self.write({"type": "train", "step": version, "version": version, "elapsed": self.elapsed(),
                    "inference_idle_frac": self.inference_idle_fraction(role_stats),
                    "groups": dict(self.group_reasons), **metrics, "rollout": self.take_traj_means(),
                    "rss_mib": rss}, version)
        envs = [st for (role, _), st in role_stats.items() if role == "env"]
        self._env_text = f"{len(envs)} up, {sum(int(st.get('sessions', 0)) for st in envs)} sessions" if envs else ""
        self._rollout_notes(role_stats)
        self._update_progress(version, metrics)

    def _rollout_notes(self, role_stats: dict) -> None:
        """Endpoint agents' sessions running / waiting for the progress line, and each rollout worker's warning
        (a saturated machine) said once on the console and recorded."""
        endpoints = [(i, st) for (role, i), st in role_stats.items() if role == "rollout"]
        eps = [st["endpoint"] for _, st in endpoints if isinstance(st.get("endpoint"), dict)]
        self._session_text = (f"{sum(int(e.get('sessions_running', 0)) for e in eps)} running, "
                              f"{sum(int(e.get('sessions_waiting', 0)) for e in eps)} waiting") if eps else ""
        for i, st in endpoints:
            text = st.get("warning")
            if isinstance(text, str) and text not in self._warned:
                self._warned.add(text)
                self.event("role_warning", role=f"rollout{i}", text=text)
                if not self.say(f"warning: rollout{i}: {text}"):
                    logger.warning("rollout%s: %s", i, text)

    def staleness_change(self, change: Any) -> None:
        """The steered eta moved (a `StalenessChange`): a record and a line on the console."""
        self.event("staleness_change", **change.record())
        if not self.say(change.line()):
            logger.info("%s", change.line())

    def inference_idle_fraction(self, role_stats: dict) -> Optional[float]:
        """Mean share of time the inference servers were idle since the previous call (from heartbeat busy_s)."""
        fracs = []
        for (role, idx), st in role_stats.items():
            if role != "inference" or "busy_s" not in st:
                continue
            busy, at = float(st["busy_s"]), float(st.get("uptime", 0.0))
            prev = self._infer_busy_prev.get(idx)
            self._infer_busy_prev[idx] = (busy, at)
            if prev and at > prev[1]:
                fracs.append(1.0 - min(1.0, (busy - prev[0]) / (at - prev[1])))
        return sum(fracs) / len(fracs) if fracs else None

    def eval_done(self, version: int, result: dict, role_stats: dict) -> str:
        """Record an evaluation's result (with every role's latest stats); returns the line to show."""
        self.evals[version] = result
        roles = {f"{r}{i}": st for (r, i), st in sorted(role_stats.items())}
        self.write({"type": "eval", "step": version, "elapsed": self.elapsed(), **result, "roles": roles}, version)
        msg = format_result({**result, "version": version})
        if self._bar is not None:
            self._bar.write(msg)
        if self.page is not None:
            self.page.request()  # rebuilt in a thread: the controller's loop goes on
        return msg

    def _ensure_bar(self) -> Any:
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total_steps, desc="train", dynamic_ncols=True, file=sys.stderr)
        return self._bar

    def _update_progress(self, version: int, metrics: dict) -> None:
        if not self.progress:
            return
        bar = self._ensure_bar()
        acc = next((e["first_acc"] for _, e in sorted(self.evals.items(), reverse=True) if e), float("nan"))  # newest
        self._postfix = dict(v=version, reward=f"{metrics.get('reward_mean', float('nan')):.3f}",
                             acc=f"{acc:.3f}", stale=metrics.get("head_offpolicyness"))
        if metrics.get("admitted_eta") is not None:  # max_head_offpolicyness=auto: the eta admitted at now
            self._postfix["eta"] = metrics["admitted_eta"]
        if self.memory.largest:  # the role holding the most memory now: a leak shows as a number that climbs
            self._postfix["rss"] = self.memory.largest
        if getattr(self, "_env_text", ""):  # env servers (env.servers > 0)
            self._postfix["envs"] = self._env_text
        if self._session_text:  # endpoint agents' sessions
            self._postfix["sessions"] = self._session_text
        bar.set_postfix(**self._postfix, **({"dropped": self._drops_text} if self._drops_text else {}),
                        refresh=False)
        bar.update(version - bar.n)

    def show_drops(self, drops: Any) -> None:
        """Dropped groups by reason in the progress line (the controller calls this periodically, so a run that
        drops everything shows why before its first step)."""
        text = format_drops(drops)
        if not self.progress or not text or text == self._drops_text:
            return
        self._drops_text = text
        self._ensure_bar().set_postfix(**self._postfix, dropped=text)

    def watch(self, watch: ProgressWatch, now: float, describe_stall: Callable[[], str]) -> Optional[str]:
        """Show `watch`'s drops by reason (at most once a second) and its verdict: a warning when no learner step
        happened for a while; the reason to stop the run when no group gets through (with `describe_stall()`, what
        each role is doing, when nothing finished at all), else None."""
        if watch.drops and now - self._drops_shown_at >= 1.0:
            self._drops_shown_at = now
            self.show_drops(watch.drops)
        verdict = watch.check(now)
        if verdict is None:
            return None
        self.show_drops(watch.drops)
        kind, text = verdict
        if kind == "warn":
            if not self.say(f"warning: {text}"):  # no progress bar to print above: the log (stderr)
                logger.warning("%s", text)
            self.event("no_progress_warning", text=text, drops=dict(watch.drops))
            return None
        if kind == "stall":
            text += "\n" + describe_stall()
        self.event("no_progress", reason=text, drops=dict(watch.drops))
        return f"the run is making no progress: {text}"

    def say(self, text: str) -> bool:
        """A line for the console (stderr) above the progress bar; False (nothing written) without a bar."""
        if self._bar is None:
            return False
        self._bar.write(text, file=sys.stderr)
        return True

    # -- the end -----------------------------------------------------------------------------------------------
    def accounting(self, *, role_stats: dict, steps: int, running_groups: int, failure: Optional[str],
                   rollout_restarts: int, inference_restarts: int, transport: dict, env_restarts: int = 0,
                   learner_restarts: int = 0) -> dict:
        """Where every accepted group went: the controller's counts next to the learner's latest snapshot, plus
        faults handled and malformed input dropped. `lost_accepted_groups` and `trained_twice` must stay 0."""
        ls = role_stats.get(("learner", 0), {})
        transport = dict(transport)
        env = collections.Counter(self.env_of_restarted)
        requests: collections.Counter = collections.Counter()  # re-sends and aborts: no silent double work
        env_servers: dict[str, dict] = {}
        judge: collections.Counter = collections.Counter()  # judge calls, failures by reason, ms (judge env)
        for (role, index), st in sorted(role_stats.items()):
            if isinstance(st.get("transport"), dict):
                transport[f"{role}{index}"] = st["transport"]
            if role == "rollout":
                env.update(_env_counts(st))
                requests.update({k: int(v) for k, v in dict(st.get("client") or {}).items() if k in REQUEST_KEYS})
                judge.update({k: v for k, v in dict(st.get("judge") or {}).items() if isinstance(v, (int, float))})
            elif role == "inference":
                requests["aborted_by_inference"] += int(st.get("aborted", 0) or 0)
            elif role == "env":  # env servers: their sessions and calls, by server
                env_servers[f"env{index}"] = {k: v for k, v in st.items() if isinstance(v, (int, float))}
        out = {"finished": failure is None and steps >= self.total_steps, "failure": (failure or "")[:2000],
               "steps": steps, "groups": dict(self.group_reasons), "accepted_groups": self.accepted_groups,
               "accepted_trajectories": self.accepted_trajectories, "lost_in_flight_groups": self.lost_groups,
               "running_groups": running_groups, "rollout_restarts": rollout_restarts,
               "inference_restarts": inference_restarts, "learner_restarts": learner_restarts,
               "learner": {k: ls.get(k) for k in LEARNER_KEYS},
               "env": dict(env), "requests": dict(requests), "transport": transport, "faults": list(self.faults),
               "memory": self.memory.summary()}
        if env_servers or env_restarts:
            out["env_servers"], out["env_restarts"] = env_servers, env_restarts
        if judge:
            out["judge"] = dict(judge)
        if ls:
            received = int(ls.get("groups_received") or 0)
            out["lost_accepted_groups"] = max(0, self.accepted_groups - received)
            out["learner_balance"] = received - sum(int(ls.get(k) or 0) for k in (
                "trained_groups", "stale_groups_dropped", "duplicate_prompts", "buffered_groups",
                "in_step_groups"))  # invalid: not received
        return out

    def learner_caught_up(self, learner_stats: dict, version: int) -> bool:
        """The learner's latest heartbeat counts every group accepted so far and `version`, with no step under way
        (so the final accounting compares counts taken at nearly the same time)."""
        st = learner_stats
        return (int(st.get("groups_received", -1)) >= self.accepted_groups and int(st.get("version", -1)) >= version
                and not st.get("in_step_groups"))

    def keep_env_counts(self, old_stats: dict) -> None:
        """A restarted rollout worker's counters start over: keep the dead incarnation's env counts."""
        self.env_of_restarted.update(_env_counts(old_stats))

    def rollout_lost(self, orphans: Any, lost: int, old_stats: dict) -> None:
        """A rollout worker died: groups the learner had (`orphans`, their n_traj) are accepted, `lost` in-flight
        groups are lost; `old_stats`: its last heartbeat's."""
        for n_traj in orphans:
            self.group_done(True, "accepted", n_traj, None, None)
        self.groups_lost(lost)
        self.keep_env_counts(old_stats)

    def summary(self, *, run_dir: str, steps: int, lost_inference: Any, learner_restarts: int = 0) -> dict:
        """What `run_experiment` returns: steps, evaluation accuracies, groups by outcome."""
        return {
            "run_dir": run_dir,
            "steps": steps,
            "learner_restarts": learner_restarts,
            "evals": {v: (e["first_acc"], e["solved_acc"]) for v, e in sorted(self.evals.items()) if e},
            "groups": dict(self.group_reasons),
            "lost_inference": sorted(lost_inference),
            "seconds": self.elapsed(),
            "memory": self.memory.summary(),
        }

    def final_report(self) -> None:
        """The run is over: the report page (and curves.png) once more, with the summary."""
        if self.page is not None:
            self.page.build()

    def close(self) -> None:
        if self.traces is not None:
            self.traces.close()
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        for sink in self.sinks:
            sink.close()
