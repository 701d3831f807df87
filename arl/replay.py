"""Replaying a run from its recorded batches (`learner.record_batches`, `arl.learner.record`).

Two questions a user asks of a run that diverged, answered from the run directory alone:

- `replay_steps`: does re-training the recorded batches from checkpoint ``v<a>`` give checkpoint ``v<b>`` bit for
  bit? The learner is built from the run's ``config.yaml`` by the learner role's own builder
  (`arl.learner.entry.learner_actor`), loads checkpoint a (weights, optimizer, LR scheduler, RNG), runs
  `PPOActor.step` on each recorded batch in order at the learner's torch thread count, then compares its weights
  with checkpoint b's. A difference means the step is not a function of its inputs (a nondeterministic kernel,
  another thread count or library version) or the files do not belong together.
- `rescore`: one trajectory's per-token logprobs as the engine reported them against the learner's forward under
  the weights of the version that generated each token (a checkpoint, a kept ``weights/v<N>.safetensors``, or the
  initial weights for version 0).

Bad input (no recorded batches, a checkpoint or batch that is gone, a config that differs from the recording, a
trajectory that was never trained) raises `ReplayError` with what is missing; nothing is trained then.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Optional

import numpy as np

from arl.learner.checkpoint import CHECKPOINT_STATE_FILE, CHECKPOINT_SUBDIR
from arl.learner.record import (
    BATCHES_SUBDIR,
    RecordedBatch,
    batch_path,
    read_batch,
    read_manifest,
    recorded_versions,
    replay_settings,
    settings_diff,
    settings_hash,
)

__all__ = ["ReplayError", "ReplayRun", "StepsResult", "TokenDiff", "RescoreResult", "replay_steps", "rescore",
           "parse_version"]


class ReplayError(RuntimeError):
    """Input a replay cannot use; the message names what is missing or differs."""


def parse_version(text: str) -> int:
    """``v12`` or ``12`` -> 12."""
    t = str(text).strip()
    t = t[1:] if t[:1] in ("v", "V") else t
    if not t.isdigit():
        raise ReplayError(f"a version is v<N> or N, got {text!r}")
    return int(t)


def _complete(tag_dir: str) -> bool:
    """A checkpoint folder with its state file and DeepSpeed's model states (a save cut short has only the first)."""
    try:
        names = os.listdir(tag_dir)
    except OSError:
        return False
    return CHECKPOINT_STATE_FILE in names and any(n.endswith("model_states.pt") for n in names)


@dataclasses.dataclass
class ReplayRun:
    """A run directory opened for replay: its config (the run's own config.yaml) checked against the recording."""

    run_dir: str
    cfg: Any
    manifest: dict
    config_hash: str

    @property
    def batches_dir(self) -> str:
        return os.path.join(self.run_dir, BATCHES_SUBDIR)

    @property
    def checkpoints_dir(self) -> str:
        return os.path.join(self.run_dir, CHECKPOINT_SUBDIR)

    @classmethod
    def open(cls, run_dir: str) -> "ReplayRun":
        from arl.launch.role import load_run_config

        if not os.path.isdir(run_dir):
            raise ReplayError(f"no run directory {run_dir!r}")
        path = os.path.join(run_dir, "config.yaml")
        if not os.path.isfile(path):
            raise ReplayError(f"{run_dir} has no config.yaml: not a run directory")
        cfg = load_run_config(path)
        if cfg.learner.backend == "sim":  # its batches say what it trained (scripts/kill_resume.py), nothing more
            raise ReplayError(f"{run_dir} ran learner.backend=sim, which trains no model: there is nothing to replay "
                              "or re-score")
        manifest = read_manifest(os.path.join(run_dir, BATCHES_SUBDIR))
        if manifest is None:
            raise ReplayError(
                f"{run_dir} has no recorded batches ({BATCHES_SUBDIR}/manifest.json is missing): the run trained "
                f"with learner.record_batches={str(cfg.learner.record_batches).lower()}; rerun it with "
                "learner.record_batches=true")
        return cls(run_dir, cfg, manifest, settings_hash(replay_settings(cfg)))

    # -- what is on disk ---------------------------------------------------------------------------------------
    def checkpoints(self) -> list[int]:
        """Versions with a complete checkpoint folder (its state file is written before DeepSpeed's files)."""
        try:
            names = os.listdir(self.checkpoints_dir)
        except OSError:
            return []
        return sorted(int(n[1:]) for n in names if n.startswith("v") and n[1:].isdigit() and _complete(
            os.path.join(self.checkpoints_dir, n)))

    def weight_files(self) -> list[int]:
        d = os.path.join(self.run_dir, "weights")
        try:
            names = os.listdir(d)
        except OSError:
            return []
        return sorted(int(n[1:-12]) for n in names
                      if n.startswith("v") and n.endswith(".safetensors") and n[1:-12].isdigit())

    def require_checkpoint(self, version: int, role: str) -> str:
        if version not in self.checkpoints():
            kept = ", ".join(f"v{v}" for v in self.checkpoints()) or "none"
            lc = self.cfg.learner
            raise ReplayError(
                f"checkpoint v{version} ({role}) is not in {self.checkpoints_dir} (kept: {kept}). The run writes one "
                f"every learner.checkpoint_every={lc.checkpoint_every} steps and keeps the newest "
                f"learner.keep_checkpoints={lc.keep_checkpoints}: a replay from v<a> to v<b> needs both kept "
                "(checkpoint_every=1 and a keep_checkpoints that covers the steps to replay)")
        return self.checkpoints_dir

    def batch(self, version: int) -> RecordedBatch:
        """The recorded batch that trained `version` - 1 into `version`, checked against this config."""
        path = batch_path(self.batches_dir, version)
        if not os.path.isfile(path):
            have = recorded_versions(self.batches_dir)
            span = f"v{have[0]}..v{have[-1]}" if have else "none"
            raise ReplayError(f"no recorded batch for step v{version - 1} -> v{version} ({path} is missing; "
                              f"recorded: {span})")
        b = read_batch(path)
        if b.version != version - 1:
            raise ReplayError(f"{path} holds the batch that starts from v{b.version}, not v{version - 1}")
        if b.config_hash != self.config_hash:
            recorded = self.manifest.get("configs", {}).get(b.config_hash)
            diff = settings_diff(recorded, replay_settings(self.cfg)) if recorded is not None else []
            what = "; ".join(diff) if diff else f"config hash {b.config_hash}, unknown to the manifest"
            raise ReplayError(f"{path} was recorded by a run of another config than {self.run_dir}/config.yaml "
                              f"(recorded -> now: {what})")
        return b


@dataclasses.dataclass
class StepsResult:
    start: int
    end: int
    equal: bool  # every weight tensor equal to checkpoint `end`, bit for bit
    n_tensors: int
    differing: list[tuple[str, float]]  # (name, max |difference|) of the tensors that differ
    threads: int


def _state(engine: Any) -> dict[str, Any]:
    sd = engine.full_state_dict()
    assert sd is not None  # one rank
    return sd


def replay_steps(run_dir: str, start: int, end: int, log: Callable[[str], None] = print) -> StepsResult:
    """Re-train the recorded batches v<start+1>..v<end> from checkpoint v<start>; compare with checkpoint v<end>."""
    import torch

    from arl.learner.entry import learner_actor

    if end <= start:
        raise ReplayError(f"--to v{end} must be after --from v{start}")
    run = ReplayRun.open(run_dir)
    if run.cfg.learner.num_ranks != 1:
        raise ReplayError(f"the run trained on learner.num_ranks={run.cfg.learner.num_ranks} ranks; a replay runs "
                          "one rank, whose gradient sums would differ from the run's (--trajectory works)")
    ckpt = run.require_checkpoint(start, "--from")
    run.require_checkpoint(end, "--to")
    batches = [run.batch(v) for v in range(start + 1, end + 1)]  # all of them read and checked before training
    threads = int(run.manifest.get("threads") or torch.get_num_threads())
    torch.set_num_threads(threads)  # float sums split over threads: the run's count, or other bits
    actor, backend = learner_actor(run.cfg)  # the learner role's own builder, from the run's config
    if not backend.trains_model:
        raise ReplayError(f"learner.backend={run.cfg.learner.backend} trains no model")
    engine = actor.engine
    engine.load(ckpt, tag=f"v{start}")
    if engine.version != start:
        raise ReplayError(f"checkpoint v{start} holds version {engine.version}")
    for b in batches:
        metrics = actor.step(b.trajs)
        log(f"replayed v{b.version} -> v{engine.version}: {len(b.trajs)} trajectories, "
            f"loss {metrics.get('loss', float('nan')):.6g}, grad_norm {metrics.get('grad_norm', float('nan')):.6g}")
    mine = {k: v.clone() for k, v in _state(engine).items()}
    engine.load(ckpt, tag=f"v{end}")  # the same engine: no second model in memory
    theirs = _state(engine)
    names = sorted(set(mine) | set(theirs))
    differing = []
    for k in names:
        a, b2 = mine.get(k), theirs.get(k)
        if a is None or b2 is None or a.shape != b2.shape or a.dtype != b2.dtype:
            differing.append((k, float("inf")))
        elif not torch.equal(a, b2):
            differing.append((k, float((a.double() - b2.double()).abs().max())))
    return StepsResult(start, end, not differing, len(names), differing, threads)


@dataclasses.dataclass
class TokenDiff:
    position: int
    token: int
    version: int
    engine_logprob: float
    learner_logprob: float

    @property
    def diff(self) -> float:
        return abs(self.engine_logprob - self.learner_logprob)


@dataclasses.dataclass
class RescoreResult:
    """One trajectory re-scored: its generated tokens' engine vs learner logprobs."""

    trajectory: str  # <group id>#<k>
    trained_in: int  # the recorded batch (version it produced) that holds it
    versions: list[int]  # the policy versions that generated its tokens
    tokens: list[TokenDiff]

    @property
    def max_diff(self) -> float:
        return max((t.diff for t in self.tokens), default=0.0)

    @property
    def mean_diff(self) -> float:
        return float(np.mean([t.diff for t in self.tokens])) if self.tokens else 0.0

    def worst(self, n: int = 5) -> list[TokenDiff]:
        return sorted(self.tokens, key=lambda t: -t.diff)[:n]


def _find(run: ReplayRun, group: str, start_at: int) -> tuple[int, list[Any]]:
    """The recorded batch holding trajectories of `group` (searched from version `start_at` on, then the rest)."""
    have = recorded_versions(run.batches_dir)
    for v in [x for x in have if x >= start_at] + [x for x in have if x < start_at]:
        b = read_batch(batch_path(run.batches_dir, v))
        hit = [t for t in b.trajs if t.group_id == group]
        if hit:
            return v, hit
    return -1, []


def _trace_of(run_dir: str, group: str) -> Optional[dict]:
    from arl.report.traces import read_jsonl

    return next((t for t in read_jsonl(os.path.join(run_dir, "traces.jsonl")) if t.get("group") == group), None)


def _load_version(run: ReplayRun, engine: Any, version: int, initial: bool) -> str:
    """Put the weights of `version` into `engine`; returns where they came from. `initial`: the engine still holds
    the weights it was built with (version 0's)."""
    from safetensors.torch import load_file

    if version in run.checkpoints():
        engine.load(run.checkpoints_dir, tag=f"v{version}")
        return f"checkpoint v{version}"
    if version == 0 and initial:
        return "the initial weights (model.path)"
    path = os.path.join(run.run_dir, "weights", f"v{version}.safetensors")
    if version in run.weight_files() and not run.cfg.learner.lora.enabled:  # a LoRA file is an adapter payload
        module = engine.module
        # tied names (lm_head.weight of a tied model) share their parameter: loading one loads both
        aliases: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        tied = {n for group in aliases.values() for n in group[1:]}
        missing, unexpected = module.load_state_dict(load_file(path, device=str(engine.device)), strict=False)
        if unexpected or set(missing) - tied:
            raise ReplayError(f"{path} does not fit the model (missing {sorted(set(missing) - tied)[:5]}, "
                              f"unexpected {sorted(unexpected)[:5]})")
        engine.version = version
        return f"weights/v{version}.safetensors"
    ckpts = ", ".join(f"v{v}" for v in run.checkpoints()) or "none"
    files = ", ".join(f"v{v}" for v in run.weight_files()) or "none"
    raise ReplayError(f"no weights of version v{version} are kept (checkpoints: {ckpts}; weights files: {files}"
                      f"{'; LoRA runs re-score from checkpoints only' if run.cfg.learner.lora.enabled else ''}); "
                      "keep them with learner.checkpoint_every=1 and a larger learner.keep_checkpoints")


def rescore(run_dir: str, trajectory: str, log: Callable[[str], None] = print) -> list[RescoreResult]:
    """Re-score `trajectory` (a trace's ``group``, optionally ``#k`` for the k-th trajectory of that group in the
    recorded batch; without it every trajectory of the group) under the weights that generated each token."""
    import torch

    from arl.api.engine import TrainBatch
    from arl.learner.entry import learner_actor

    run = ReplayRun.open(run_dir)
    # group ids hold '#' themselves (the rollout worker's do): the whole string is a group id first, then
    # <group>#<k>
    head, sep, tail = trajectory.rpartition("#")
    for group, index in [(trajectory, "")] + ([(head, tail)] if sep and tail.isdigit() else []):
        trace = _trace_of(run_dir, group)
        newest = (trace.get("versions") or [0, 0])[-1] if trace else 0
        trained_in, hits = _find(run, group, int(newest) + 1)  # trained in a step after its newest token's version
        if hits:
            break
    if not hits:
        seen = (f"traces.jsonl has it (outcome {trace.get('outcome')!r}) but no recorded batch trained it: only "
                "trained trajectories are recorded" if trace else "it is in no recorded batch and not in traces.jsonl")
        raise ReplayError(f"trajectory {group!r}: {seen}")
    run.batch(trained_in)  # recorded under this config (the temperature and the model decide the logprobs)
    picked = list(enumerate(hits))
    if index:
        if int(index) >= len(hits):
            raise ReplayError(f"group {group!r} has {len(hits)} trajectories in batch v{trained_in}; #{index} is "
                              "out of range")
        picked = [picked[int(index)]]
    trajs = [t for _, t in picked]
    gen_versions = sorted({int(v) for t in trajs for v in t.versions[t.loss_mask.astype(bool)]})
    threads = int(run.manifest.get("threads") or torch.get_num_threads())
    torch.set_num_threads(threads)
    actor, _backend = learner_actor(run.cfg)
    engine = actor.engine
    learner_lp: dict[int, list[np.ndarray]] = {}
    for k, v in enumerate(gen_versions):
        source = _load_version(run, engine, v, initial=k == 0)
        learner_lp[v] = engine.forward_logprobs(TrainBatch(trajs), actor.temperature)
        log(f"v{v}: {source}")
    out = []
    for j, (k, t) in enumerate(picked):
        tokens = []
        for pos in np.flatnonzero(t.loss_mask.astype(bool)):
            if pos == 0:
                continue  # no prefix: never scored
            v = int(t.versions[pos])
            tokens.append(TokenDiff(int(pos), int(t.input_ids[pos]), v, float(t.logprobs[pos]),
                                    float(learner_lp[v][j][pos])))
        out.append(RescoreResult(f"{group}#{k}", trained_in, sorted({x.version for x in tokens}), tokens))
    return out


def format_steps(r: StepsResult) -> str:
    if r.equal:
        return (f"replay v{r.start} -> v{r.end}: bit-exact (all {r.n_tensors} weight tensors equal checkpoint "
                f"v{r.end}; {r.threads} torch threads)")
    worst = ", ".join(f"{k} (max |diff| {d:.3g})" for k, d in sorted(r.differing, key=lambda x: -x[1])[:5])
    return (f"replay v{r.start} -> v{r.end}: NOT bit-exact: {len(r.differing)} of {r.n_tensors} weight tensors "
            f"differ from checkpoint v{r.end}: {worst}")


def format_rescore(r: RescoreResult, worst: int = 5) -> str:
    lines = [f"trajectory {r.trajectory} (trained in v{r.trained_in - 1} -> v{r.trained_in}), generated by "
             f"{', '.join(f'v{v}' for v in r.versions) or 'no version'}: {len(r.tokens)} tokens, "
             f"|engine - learner| logprob max {r.max_diff:.3g}, mean {r.mean_diff:.3g}"]
    for t in r.worst(worst):
        lines.append(f"  position {t.position} token {t.token} v{t.version}: engine {t.engine_logprob:.6f} "
                     f"learner {t.learner_logprob:.6f} |diff| {t.diff:.3g}")
    return "\n".join(lines)
