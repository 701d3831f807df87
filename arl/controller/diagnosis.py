"""What the controller says when a role goes silent, the run stalls or the learner is lost: the role's last
`waiting_on` and its Python stacks, what each role is doing, where the run can resume. Read-only over the state
machines; the only I/O is asking the launcher for a stack dump and reading the checkpoint directory.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from arl.controller.admission import Admission
from arl.controller.reporting import Reporter
from arl.controller.supervision import RoleLauncher, Supervisor
from arl.learner.checkpoint import CHECKPOINT_SUBDIR, latest_checkpoint
from arl.rollout.loop_watchdog import blocked_loop_note

logger = logging.getLogger("arl.controller")

Key = tuple[str, int]  # (role, index)


async def investigate_silence(key: Key, silent_s: float, *, sup: Supervisor, launcher: RoleLauncher,
                              role_stats: dict[Key, dict], reporter: Reporter, stack_dump_wait: float) -> str:
    """Log which role went silent and what it was last waiting on, and have it dump its Python stacks into its
    log; returns the reason to fail or restart with."""
    role, index = key
    name = sup.process_of(role, index)
    waiting = str(role_stats.get(key, {}).get("waiting_on") or "unknown (it never said)")
    why = (f"role {role}{index} sent no heartbeat for {silent_s:.0f}s "
           f"(timeout {sup.heartbeat_timeouts[role]:g}s); it was last waiting on: {waiting}")
    # a rollout worker whose event loop is blocked sends nothing that could say so; its loop watchdog's warning in
    # its log does (read before the stack dump below adds to the log)
    blocked = blocked_loop_note(launcher.log_path(name)) if role == "rollout" else ""
    if blocked:
        why += f"; its log says: {blocked}"
    logger.error("%s", why)
    state, dump = "?", ""
    if launcher.alive(name):
        state, dump = await asyncio.to_thread(launcher.stack_dump, name, stack_dump_wait)
        log = launcher.log_path(name)
        if dump:
            logger.error("Python stacks of %s (process state %s), from %s:\n%s", name, state, log, dump[-8000:])
            why += f"; its stacks are dumped in {log}"
        else:
            logger.error("%s (process state %s) wrote no stack dump within %gs", name, state, stack_dump_wait)
    reporter.fault("heartbeat_timeout", role=f"{role}{index}", process=name, silent_s=silent_s,
                   waiting_on=waiting, process_state=state, stacks_dumped=bool(dump), loop_blocked=blocked or None)
    return why


def resume_hint(name: str, run_dir: str) -> str:
    """A lost learner ends the run (its optimizer state is in no other process): say where it can resume."""
    if name != "learner":
        return ""
    ckpt = latest_checkpoint(os.path.join(run_dir, CHECKPOINT_SUBDIR))
    if ckpt is None:
        return " (no checkpoint written yet: learner.checkpoint_every)"
    parent, run = os.path.split(os.path.abspath(run_dir))
    return (f" (newest checkpoint {ckpt}: run again with recover=auto run_dir={parent} run_name={run} to resume "
            f"from it)")


def describe_stall(now: float, *, sup: Supervisor, admission: Admission, role_stats: dict[Key, dict],
                   last_messages: dict[str, dict[str, float]]) -> str:
    """`stall_report` of every role of the run, grouped by the process that hosts it."""
    processes: dict[str, list[Key]] = {}
    for key in ([("rollout", i) for i in sup.rollouts()] + [("learner", 0)]
                + [("inference", i) for i in range(sup.num_inference)] + [("env", i) for i in range(sup.num_env)]
                + [("judge", i) for i in range(sup.num_judge)]):
        processes.setdefault(sup.process_of(*key), []).append(key)
    return stall_report(now, gate=admission.gate, waiting=admission.waiting(), in_flight=dict(admission.held),
                        processes=processes, role_stats=role_stats, last_messages=last_messages)


def stall_report(now: float, *, gate: Any, waiting: int, in_flight: dict[int, int],
                 processes: dict[str, list[tuple[str, int]]], role_stats: dict[tuple[str, int], dict],
                 last_messages: dict[str, dict[str, float]]) -> str:
    """What each role is doing when nothing moves, one line each: the staleness gate; per rollout worker the groups
    in flight by the controller's count and by its own (a gap: leaked slots); the learner's buffer and what it
    waits on; each inference server's version; and when each process last sent each kind of message
    (`last_messages`: process name -> message type -> monotonic time). `processes`: name -> role keys it hosts."""
    lines = [f"  gate: version {gate.version}, {gate.accepted} groups accepted, {gate.running} in flight, room for "
             f"{gate.capacity()} more, {waiting} asked for and waiting"]
    for name, keys in processes.items():
        parts = []
        for role, index in keys:
            st = role_stats.get((role, index), {})
            if role == "rollout":
                own = (f"its own count: {st.get('running')} running, {st.get('wanted', 0)} awaiting a grant"
                       if "running" in st else "no heartbeat yet")
                parts.append(f"{in_flight.get(index, 0)} groups in flight ({own})")
            elif role == "learner":
                parts.append(f"version {st.get('version', '?')}, {st.get('buffered_groups', '?')} groups buffered "
                             f"({st.get('buffered_trajectories', '?')} trajectories), {st.get('in_step_groups', 0)} in "
                             f"a step, {st.get('groups_received', '?')} received, {st.get('trained_groups', '?')} "
                             f"trained")
            elif role == "env":
                parts.append(f"env server {index}: {st.get('sessions', '?')} sessions, {st.get('in_flight', '?')} "
                             f"calls in flight")
            else:
                parts.append(f"server {index} at version {st.get('version', '?')}")
            if st.get("waiting_on"):
                parts[-1] += f", waiting on: {st['waiting_on']}"
        heard = sorted((last_messages.get(name) or {}).items(), key=lambda kv: -kv[1])
        ages = ", ".join(f"{t} {now - at:.0f}s ago" if now - at >= 10 else f"{t} {now - at:.1f}s ago"
                         for t, at in heard)
        lines.append(f"  {name}: {'; '.join(parts)}; last messages: {ages or 'none'}")
    return "what each role is doing:\n" + "\n".join(lines)
