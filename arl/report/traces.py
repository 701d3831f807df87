"""Trajectory traces: what the agent actually did, one JSON object per trajectory in run_dir/traces.jsonl.

A trace holds the turns decoded with their roles (which tokens the model generated and which were context, from
the trajectory's token ledger), the reward(s), the termination, the policy versions of the generated tokens, and
per-turn timings from the rollout worker's request timeline: when each request went out, how long the inference
round trip took (queueing at the server plus generation plus transport: the server does not report the split),
which inference worker answered after how many attempts, and the agent-side time until the next request of the
same trajectory (tool calls, environment steps, encoding). The group's wait for admission by the staleness gate
and its outcome (accepted, or which filter or error dropped it) come with every trajectory of the group.

Groups are sampled at a rate (`TraceSampler`), and every group that an error or a filter touched is traced.
A group whose agent returned no trajectory (it filtered the group itself, raised or ran out of time) is traced
from its requests alone (`request_traces`): the token history each chat sent, with the generated parts marked
and no reward.

Traces travel to the controller with the group's `group_done` message and the controller appends them
(`TraceWriter`), so they land in the run directory even when rollout workers run on other machines.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import random
import time
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import numpy as np

from arl.api.types import GenerateRequest, GenerateResponse, Trajectory

# share of groups traced at random (on top of every group an error or a filter touched)
DEFAULT_TRACE_RATE = 0.05

__all__ = ["DEFAULT_TRACE_RATE", "RequestRecord", "GroupTimeline", "TraceSampler", "TraceWriter", "role_of", "trace_record",
           "request_traces", "group_traces", "read_jsonl"]


@dataclasses.dataclass
class RequestRecord:
    """One generation request of a group, with when it went out and came back and who answered it."""

    qid: str
    session: Optional[str]
    input_ids: np.ndarray
    t_sent: float
    t_done: float = math.nan
    worker: int = -1
    attempts: int = 0
    error: Optional[str] = None
    outputs: list[np.ndarray] = dataclasses.field(default_factory=list)
    versions: list[np.ndarray] = dataclasses.field(default_factory=list)
    finish: list[str] = dataclasses.field(default_factory=list)


class GroupTimeline:
    """Every request one prompt group made, in the order they were sent (the rollout worker's queue bridge records
    them; nothing is copied: token arrays are the request's and the response's own)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.t0 = clock()
        self.requests: list[RequestRecord] = []

    def now(self) -> float:
        return self._clock()

    def start(self, req: GenerateRequest) -> RequestRecord:
        rec = RequestRecord(qid=req.qid, session=req.session_id, input_ids=req.input_ids, t_sent=self._clock())
        self.requests.append(rec)
        return rec

    def done(self, rec: RequestRecord, resp: GenerateResponse, worker: int = -1, attempts: int = 0) -> None:
        rec.t_done = self._clock()
        rec.worker, rec.attempts, rec.error = int(worker), int(attempts), resp.error
        for s in resp.samples:
            rec.outputs.append(s.output_ids)
            rec.versions.append(s.output_versions)
            rec.finish.append(s.finish_reason)


class TraceSampler:
    """Which groups to trace: each with probability `rate` (seeded, so a run's sample is reproducible), and always
    the forced ones (an error or a filter touched them)."""

    def __init__(self, rate: float, seed: int = 0) -> None:
        if not (isinstance(rate, (int, float)) and 0.0 <= rate <= 1.0):
            raise ValueError(f"trace rate must be in [0, 1], got {rate!r}")
        self.rate = float(rate)
        self._rng = random.Random(f"traces:{seed}")

    def want(self, forced: bool) -> Optional[str]:
        """"forced", "sampled", or None (not traced). Draws for every group, so forcing does not shift the
        sample."""
        hit = self._rng.random() < self.rate
        return "forced" if forced else ("sampled" if hit else None)


def role_of(source: str) -> str:
    """The chat role of a token-ledger source: the model's tokens are the assistant's, tool observations the
    tool's, feedback the user's; the prompt keeps its own name (it holds system and user turns)."""
    if source == "engine":
        return "assistant"
    if source.startswith("observation"):
        return "tool"
    if source in ("feedback", "user"):
        return "user"
    return source


def _decode(tokenizer: Any, ids: np.ndarray) -> str:
    try:
        return str(tokenizer.decode([int(t) for t in ids], skip_special_tokens=False))
    except Exception as e:  # noqa: BLE001 - a trace must never fail a group
        return f"<could not decode {len(ids)} tokens: {type(e).__name__}>"


def _vrange(v: np.ndarray) -> list[int]:
    return [int(v.min()), int(v.max())] if len(v) else []


def _round(x: Optional[float]) -> Optional[float]:
    return None if x is None or not math.isfinite(x) else round(float(x), 6)


def _scalars(meta: dict) -> dict[str, Any]:
    return {k: v for k, v in meta.items() if isinstance(v, (bool, int, float, str)) and k != "prompt_pos"}


def _turn_timings(matched: list[Optional[tuple[RequestRecord, int]]], t0: float) -> list[dict]:
    """Per generated turn: sent at (s after the group started), inference round trip, worker, attempts, finish
    reason, and the agent-side time until the next turn's request (None after the last turn)."""
    turns = []
    for k, m in enumerate(matched):
        if m is None:
            turns.append({"turn": k})
            continue
        rec, i = m
        nxt = next((x for x in matched[k + 1:] if x is not None), None)
        turns.append({
            "turn": k,
            "t_sent": _round(rec.t_sent - t0),
            "inference_s": _round(rec.t_done - rec.t_sent),
            "worker": rec.worker,
            "attempts": rec.attempts,
            "finish": rec.finish[i] if i < len(rec.finish) else None,
            "n": int(len(rec.outputs[i])) if i < len(rec.outputs) else 0,
            "env_tool_s": _round(nxt[0].t_sent - rec.t_done) if nxt is not None else None,
        })
    return turns


def _segments(tokenizer: Any, ledger: Sequence[Sequence[Any]], ids: np.ndarray, versions: np.ndarray,
              match: Callable[[int, np.ndarray], Optional[tuple[RequestRecord, int]]]
              ) -> tuple[list[dict[str, Any]], list[Optional[tuple[RequestRecord, int]]]]:
    """The decoded segments of a token ledger (role, generated or context, and the policy versions of generated
    ones), and per generated segment the request and sample `match(start, tokens)` finds for it (or None)."""
    segments: list[dict[str, Any]] = []
    matched: list[Optional[tuple[RequestRecord, int]]] = []
    for source, a, b in ledger:
        a, b = int(a), int(b)
        gen = source == "engine"
        seg: dict[str, Any] = {"role": role_of(str(source)), "source": str(source), "gen": gen,
                               "text": _decode(tokenizer, ids[a:b]), "n": b - a}
        if gen:
            seg["v"] = _vrange(versions[a:b])
            seg["turn"] = len(matched)
            matched.append(match(a, ids[a:b]))
        segments.append(seg)
    return segments, matched


def trace_record(traj: Trajectory, tokenizer: Any, timeline: Optional[GroupTimeline] = None,
                 **fields: Any) -> dict[str, Any]:
    """One trajectory as a trace: segments from its token ledger (decoded, with role, generated or context, and
    the policy versions of generated ones), reward(s), termination, metadata scalars, and per-turn timings when
    `timeline` holds the group's requests. `fields` (step, outcome, ...) are added as they are."""
    ledger = traj.metadata.get("token_ledger") or [["context", 0, len(traj.input_ids)]]
    by_key: dict[tuple[int, bytes], tuple[RequestRecord, int]] = {}
    if timeline is not None:
        for rec in timeline.requests:
            for i, out in enumerate(rec.outputs):
                by_key.setdefault((len(rec.input_ids), out.tobytes()), (rec, i))
    segments, matched = _segments(tokenizer, ledger, traj.input_ids, traj.versions,
                                  lambda a, ids: by_key.get((a, ids.tobytes())))
    meta = traj.metadata
    return {
        **fields,
        "group": traj.group_id,
        "prompt_id": meta.get("prompt_id"),
        "reward": float(traj.reward),
        "turn_rewards": [float(r) for r in traj.turn_rewards],
        "termination": meta.get("termination"),
        "versions": _vrange(traj.versions[traj.loss_mask.astype(bool)]),
        "n_tokens": int(len(traj.input_ids)),
        "n_generated": int(traj.num_generated),
        "metadata": _scalars(meta),
        "segments": segments,
        "turns": _turn_timings(matched, timeline.t0) if timeline is not None else [],
    }


def request_traces(timeline: GroupTimeline, tokenizer: Any, **fields: Any) -> list[dict[str, Any]]:
    """Traces of a group that left no trajectory, rebuilt from its requests: per chat (session) and final sample,
    the token history it sent with the outputs of its earlier requests marked as generated. No reward is known."""
    sessions: dict[str, list[RequestRecord]] = {}
    for i, rec in enumerate(timeline.requests):
        sessions.setdefault(rec.session if rec.session is not None else f"#{i}", []).append(rec)
    out = []
    for sid, recs in sessions.items():
        last = recs[-1]
        finals = list(range(len(last.outputs))) or [-1]
        for j in finals:
            final_out = last.outputs[j] if j >= 0 else np.zeros(0, np.int32)
            seq = np.concatenate([last.input_ids, final_out])
            pieces: dict[int, tuple[int, tuple[RequestRecord, int]]] = {}  # generated spans: start -> (end, source)
            pos = 0
            for rec in recs[:-1]:
                a = len(rec.input_ids)
                if a < pos or not np.array_equal(rec.input_ids, seq[:a]):
                    continue
                hit = next((i for i, o in enumerate(rec.outputs)
                            if len(o) and np.array_equal(o, seq[a:a + len(o)])), None)
                if hit is None:
                    continue
                pos = a + len(rec.outputs[hit])
                pieces[a] = (pos, (rec, hit))
            if j >= 0:
                pieces[len(last.input_ids)] = (len(seq), (last, j))
            ledger, versions, gen, pos = [], np.zeros(len(seq), np.int32), np.zeros(len(seq), bool), 0
            for a, (b, (rec, i)) in pieces.items():  # context before each generated span, and after the last
                ledger += [("context", pos, a)] if a > pos else []
                ledger.append(("engine", a, b))
                versions[a:b], gen[a:b], pos = rec.versions[i], True, b
            ledger += [("context", pos, len(seq))] if pos < len(seq) else []
            segments, matched = _segments(tokenizer, ledger, seq, versions, lambda a, _ids: pieces[a][1])
            out.append({
                **fields,
                "group": sid,
                "reconstructed": True,
                "reward": None,
                "turn_rewards": [],
                # the agent's termination is not known; a refused last request is (its finish is in "turns")
                "termination": f"request error: {last.error}" if last.error else None,
                "versions": _vrange(versions[gen]),
                "n_tokens": int(len(seq)),
                "n_generated": int(gen.sum()),
                "metadata": {},
                "segments": segments,
                "turns": _turn_timings(matched, timeline.t0),
            })
    return out


def group_traces(trajs: Sequence[Trajectory], tokenizer: Any, timeline: Optional[GroupTimeline], *, outcome: str,
                 why: str, step: int, rollout: int, admission_s: Optional[float], seconds: float,
                 void_filter: bool = False, group_id: str = "", prompt_id: Any = None) -> list[dict]:
    """The traces of one group: each trajectory the agent returned (before filters; `filtered` names the filter
    that removed it), or, when it returned none, what its requests show. `void_filter`: the void-turn filter was
    on (it removes single trajectories; the other filters and errors drop the whole group, see `outcome`).
    `group_id` and `prompt_id` name a group rebuilt from its requests."""
    fields = {"step": int(step), "rollout": int(rollout), "outcome": outcome, "why": why,
              "admission_s": _round(admission_s), "group_seconds": _round(seconds)}
    if not trajs:
        if timeline is None:
            return []
        traces = request_traces(timeline, tokenizer, **fields)
        for t in traces:
            t["group"] = f"{group_id}:{t['group']}" if group_id else t["group"]
            t["prompt_id"] = prompt_id
        return traces
    group_filter = outcome.split(":", 1)[1] if outcome.startswith("filtered:") else None
    out = []
    for t in trajs:
        filt = "void_turns" if void_filter and t.has_void_turn else group_filter
        out.append(trace_record(t, tokenizer, timeline, **fields, filtered=filt))
    return out


class TraceWriter:
    """run_dir/traces.jsonl, appended by the controller: one whole line per trace, flushed at once (opened
    lazily, so a run that traces nothing leaves no file)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._f: Any = None
        self.written = 0

    def write(self, traces: Iterable[dict]) -> None:
        """Append `traces`; anything that is not a list of maps (a peer's malformed message) is skipped."""
        if not isinstance(traces, (list, tuple)):
            return
        lines = "".join(json.dumps(t, default=float) + "\n" for t in traces if isinstance(t, dict))
        if not lines:
            return
        if self._f is None:
            self._f = open(self.path, "a", buffering=1)
        self._f.write(lines)
        self._f.flush()
        self.written += lines.count("\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _records(lines: Iterable[Union[str, bytes]]) -> list[dict]:
    """The map records among jsonl `lines`; a torn line (a crash or a write in progress) or a non-map is skipped."""
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def tail_jsonl(path: str, last: int) -> tuple[list[dict], int]:
    """The records among the `last` non-blank lines of a jsonl file (all when `last` <= 0) and how many such lines
    it has, holding only those lines: the report is rebuilt at every evaluation, and parsing all of a run's
    traces.jsonl each time made the controller's memory grow with the file (~5x its size at each build)."""
    if not os.path.exists(path):
        return [], 0
    lines: collections.deque[bytes] = collections.deque(maxlen=last if last > 0 else None)
    n = 0
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                n += 1
                lines.append(line)
    return _records(lines), n


def read_jsonl(path: str, last: int = 0) -> list[dict]:
    """The records of a jsonl file the run appends to (metrics.jsonl, traces.jsonl): the `last` ones when > 0; a
    missing file is empty, and a torn line (a crash or a write in progress) or a non-map line is skipped."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        out = _records(f)
    return out[-last:] if last > 0 else out
