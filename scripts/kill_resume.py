"""Kill every process of a run at random points, resume it with `recover=auto`, and check that no prompt was
skipped or trained twice, against an uninterrupted run of the same config.

Why: a resume that skips the prompts in flight (or trains one twice) biases a run of days in a way no loss curve
shows. The data position a checkpoint keeps is exact (`arl.data.position`): on resume every prompt whose group had
not settled (in flight, buffered at the learner, trained after the checkpoint) is drawn again.

Each seed runs the config twice through `training/main_async_ppo.py`, on the simulated engines (the whole control
and data plane, no model): once straight, once with `--kills` kill -9's of the controller and every role process
at random steps (and a random fraction of a second into the step), each followed by a `recover=auto` run, until
the last one finishes. Trained prompts are read from the recorded batches (`learner.record_batches`: the final
lineage only, a resume forgets the batches after its checkpoint); per rollout worker:

- trained twice: a prompt position in two trained groups (must be 0);
- gaps: positions below the final front (every position below it settled) that no step trained: dropped by a
  counted rule (the run's drop counts are printed next to them; this config drops nothing by rule, so 0);
- equal: the trained positions below both runs' fronts are the same (the positions map to prompts by the seed).

    python scripts/kill_resume.py --seeds 3 --kills 3
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from bench_common import machine, tokenizer_dir  # noqa: E402


def overrides(a: argparse.Namespace, seed: int, run_root: str, name: str, tok: str, vocab: int) -> list[str]:
    return [
        # decode steps of 7.5 ms and long-tailed lengths (2..60 tokens): groups finish out of the order they were
        # drawn in, so at a checkpoint some prompts behind the newest consumed one are still in flight
        "inference.backend=sim", "inference.num_workers=1", "inference.sim.time_scale=1",
        "inference.sim.len_median=10", "inference.sim.len_sigma=1.0", f"inference.sim.vocab_size={vocab}",
        "learner.backend=sim", "learner.sim.time_scale=1", "learner.sim.step_base_s=0.3", "learner.sim.s_per_token=0",
        f"learner.batch_size={a.batch}", "agent.group_size=2", "gen.max_new_tokens=60",
        f"rollout.num_workers={a.rollout_workers}", f"rollout.max_concurrent_rollouts={a.concurrency}",
        f"max_head_offpolicyness={a.eta}", f"total_train_steps={a.steps}", "eval.every_n_steps=0",
        "eval.max_prompts=1", "agent.args.filter_uniform_groups=false", "learner.record_batches=true",
        f"learner.checkpoint_every={a.checkpoint_every}", "learner.keep_checkpoints=2", "progress=false",
        f"seed={seed}", f"run_dir={run_root}", f"run_name={name}", f"model.path={tok}",
    ]


def default_overrides(a: argparse.Namespace, seed: int, run_root: str, name: str, tok: str,
                      vocab: int) -> list[str]:
    """`--default`: the default run (its tiny model and task), nothing recorded: what a user runs."""
    return [f"seed={seed}", f"run_dir={run_root}", f"run_name={name}", "progress=false"]


def final_accuracy(run_dir: str) -> float | None:
    """The last evaluation's held-out first-answer accuracy."""
    acc = None
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            for line in f:
                if '"eval"' in line:
                    r = json.loads(line)
                    if r.get("type") == "eval":
                        acc = r.get("first_acc")
    except (OSError, ValueError):
        pass
    return acc


def _tree(pid: int) -> list[Any]:
    import psutil

    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _sigkill(procs: list[Any]) -> int:
    """SIGKILL `procs` all at once and wait for them; returns how many."""
    import psutil

    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)
    return len(procs)


def kill_everything(proc: subprocess.Popen) -> int:
    """kill -9 the controller and every process it started (roles run in sessions of their own), all at once."""
    n = _sigkill(_tree(proc.pid))
    proc.wait(timeout=30)
    return n


def kill_learner(proc: subprocess.Popen) -> int:
    """kill -9 the learner process(es) only (`--role learner`); the controller restarts it in place."""
    import psutil

    victims = []
    for p in _tree(proc.pid)[1:]:
        try:
            cmd = p.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "--role" in cmd and cmd[cmd.index("--role") + 1:][:1] == ["learner"]:
            victims.append(p)
    return _sigkill(victims)


def trained_steps(run_dir: str) -> int:
    """Steps the run's metrics say were trained (the newest train record's step)."""
    step = 0
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            for line in f:
                if '"train"' in line:
                    try:
                        r = json.loads(line)
                    except ValueError:
                        continue
                    if r.get("type") == "train":
                        step = max(step, int(r.get("step", 0)))
    except OSError:
        pass
    return step


def run_once(argv: list[str], log: str, kill_at: int | None, delay: float, run_dir: str,
             timeout: float, learner_at: tuple[int, ...] = ()) -> tuple[str, float]:
    """Run `argv`; with `kill_at`, kill everything `delay` seconds after the run trained step `kill_at`; at each
    step of `learner_at`, kill the learner alone (`delay` seconds after it) and let the run go on.
    Returns (how it ended, seconds)."""
    t0 = time.monotonic()
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    try:
        while proc.poll() is None:
            if time.monotonic() - t0 > timeout:
                kill_everything(proc)
                return "timeout", time.monotonic() - t0
            if learner_at and trained_steps(run_dir) >= learner_at[0] and time.monotonic() - t0 > 1.0:
                time.sleep(delay)
                kill_learner(proc)
                learner_at = learner_at[1:]
                time.sleep(1.0)  # metrics may still say the old step: the restart rolls back to the checkpoint
            if kill_at is not None and trained_steps(run_dir) >= kill_at:
                time.sleep(delay)
                n = kill_everything(proc)
                return f"killed {n} processes after step {kill_at} + {delay:.2f}s", time.monotonic() - t0
            time.sleep(0.05)
        return f"exit {proc.returncode}", time.monotonic() - t0
    finally:
        if proc.poll() is None:
            kill_everything(proc)


def read_trained(run_dir: str, steps: int) -> tuple[dict[int, list[int]], list[int]]:
    """Per rollout worker, the prompt positions of the trained groups (with repeats), from the recorded batches of
    versions 1..steps; and the versions whose batch is missing."""
    from arl.learner.record import BATCHES_SUBDIR, batch_path, read_batch

    out: dict[int, list[int]] = collections.defaultdict(list)
    missing = []
    for v in range(1, steps + 1):
        path = batch_path(os.path.join(run_dir, BATCHES_SUBDIR), v)
        if not os.path.exists(path):
            missing.append(v)
            continue
        seen = set()
        for t in read_batch(path).trajs:
            gid = str(t.group_id).split(":", 1)[0]
            pos = t.metadata.get("prompt_pos")
            if gid in seen or pos is None:
                continue
            seen.add(gid)
            out[int(pos[0])].append(int(pos[1]))
    return out, missing


def final_book(run_dir: str) -> tuple[dict[int, Any], int]:
    """The final checkpoint's data position per rollout worker, and the groups its lineage dropped by a counted
    rule (stale or invalid at the learner, told by a rollout worker): its counters come back with every resume, so
    they count exactly the drops its settled positions hold."""
    from arl.data.position import DataPosition
    from arl.learner.checkpoint import CHECKPOINT_SUBDIR, read_checkpoint_state

    state = read_checkpoint_state(os.path.join(run_dir, CHECKPOINT_SUBDIR)) or {}
    c = dict(state.get("counters", {}))
    rule = int(c.get("stale_groups_dropped", 0)) + int(c.get("invalid_groups", 0)) + int(
        c.get("prompts_settled_by_rollout", 0))
    return {int(k): DataPosition.from_state(v) for k, v in dict(state.get("data_position", {})).items()}, rule


# outcomes that are no rule drop: trained, or lost with a learner (their prompts are drawn again)
NOT_RULE_DROPS = ("accepted", "lost_learner_restart", "lost_version", "learner_lost")


def drops(run_dir: str) -> dict[str, int]:
    """Groups dropped by a counted rule, by reason, summed over the summaries of the incarnations that ended
    (one killed with everything writes none: its drops, if any, show as gaps)."""
    total: collections.Counter = collections.Counter()
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            for line in f:
                if '"summary"' not in line:
                    continue
                r = json.loads(line)
                if r.get("type") == "summary":
                    for k, v in dict(r.get("groups") or {}).items():
                        if k not in NOT_RULE_DROPS:
                            total[k] += int(v)
    except (OSError, ValueError):
        pass
    return dict(total)


def restarts(run_dir: str) -> dict[str, Any]:
    """The last summary's learner restarts and lost accepted groups."""
    out: dict[str, Any] = {}
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            for line in f:
                if '"summary"' in line:
                    r = json.loads(line)
                    out = {k: r.get(k) for k in ("learner_restarts", "lost_accepted_groups")}
    except (OSError, ValueError):
        pass
    return out


def compare(straight: dict[int, list[int]], killed: dict[int, list[int]], book_s: tuple[dict[int, Any], int],
            book_k: tuple[dict[int, Any], int]) -> dict[str, Any]:
    (pos_s, rule_s), (pos_k, rule_k) = book_s, book_k
    f_straight = {w: d.low for w, d in pos_s.items()}
    f_killed = {w: d.low for w, d in pos_k.items()}
    twice = {w: sorted(p for p, n in collections.Counter(ps).items() if n > 1) for w, ps in killed.items()}
    gaps = {w: sorted(set(range(f_killed.get(w, 0))) - set(killed.get(w, []))) for w in f_killed}
    only_s, only_k, unequal = 0, 0, {}
    for w in set(straight) | set(killed):
        below = min(f_straight.get(w, 0), f_killed.get(w, 0))
        a = {p for p in straight.get(w, []) if p < below}
        b = {p for p in killed.get(w, []) if p < below}
        if a != b:
            only_s, only_k = only_s + len(a - b), only_k + len(b - a)
            unequal[w] = {"straight_only": sorted(a - b)[:20], "killed_only": sorted(b - a)[:20]}
    # the book: every settled position was trained once, or dropped by a counted rule
    runs = (("straight", pos_s, straight, rule_s), ("killed", pos_k, killed, rule_k))
    books = {name: sum(map(len, pos.values())) - sum(map(len, trained.values())) - rule
             for name, pos, trained, rule in runs}
    return {"trained_twice": sum(map(len, twice.values())), "twice": {w: v[:20] for w, v in twice.items() if v},
            "gaps": sum(map(len, gaps.values())), "gap_positions": {w: v[:20] for w, v in gaps.items() if v},
            "rule_drops": {"straight": rule_s, "killed": rule_k}, "unequal": unequal,
            # a prompt one run trained and the other dropped by a rule: at most the other run's rule drops
            "differ_within_drops": only_k <= rule_s and only_s <= rule_k, "book_off_by": books,
            "compared_below": {w: min(f_straight.get(w, 0), f_killed.get(w, 0))
                               for w in set(f_straight) | set(f_killed)}}


def one_seed(a: argparse.Namespace, seed: int, root: str, tok: str, vocab: int) -> dict[str, Any]:
    rng = random.Random(seed)
    cmd = [sys.executable, os.path.join(ROOT, "training", "main_async_ppo.py")]
    ov = default_overrides if a.default else overrides
    res: dict[str, Any] = {"seed": seed}
    straight_dir = os.path.join(root, f"straight-{seed}")
    how, secs = run_once(cmd + ov(a, seed, root, f"straight-{seed}", tok, vocab),
                         os.path.join(root, f"straight-{seed}.log"), None, 0.0, straight_dir, a.timeout)
    res["straight"] = {"end": how, "seconds": round(secs, 1)}
    killed_dir = os.path.join(root, f"killed-{seed}")
    points = sorted(rng.sample(range(1, a.steps), min(a.kills, a.steps - 1)))
    runs = []
    if a.target == "learner":  # one run: the controller restarts the learner in place after each kill
        how, secs = run_once(cmd + ov(a, seed, root, f"killed-{seed}", tok, vocab),
                             os.path.join(root, f"killed-{seed}.log"), None, rng.uniform(0.0, 1.0), killed_dir,
                             a.timeout, tuple(points))
        runs = [{"kill_after_step": k, "end": "learner killed"} for k in points]
        points = []
        runs.append({"kill_after_step": None, "end": how, "seconds": round(secs, 1)})
    for i, k in enumerate(points + [None] if points or not runs else []):
        extra = ["recover=auto"] if i else []
        delay = rng.uniform(0.0, 1.0)
        how, secs = run_once(cmd + ov(a, seed, root, f"killed-{seed}", tok, vocab) + extra,
                             os.path.join(root, f"killed-{seed}.log"), k, delay, killed_dir, a.timeout)
        runs.append({"kill_after_step": k, "end": how, "seconds": round(secs, 1)})
    res["killed"] = runs
    res["summary"] = restarts(killed_dir)
    res["final_acc"] = {"straight": final_accuracy(straight_dir), "killed": final_accuracy(killed_dir)}
    if a.default:  # nothing recorded: the run's end, its accounting and its accuracy
        res["ok"] = (not res["summary"].get("lost_accepted_groups") and res["straight"]["end"] == "exit 0"
                     and runs[-1]["end"] == "exit 0")
        return res
    s_trained, s_missing = read_trained(straight_dir, a.steps)
    k_trained, k_missing = read_trained(killed_dir, a.steps)
    res.update(compare(s_trained, k_trained, final_book(straight_dir), final_book(killed_dir)))
    res["missing_batches"] = {"straight": s_missing, "killed": k_missing}
    res["drops"] = {"straight": drops(straight_dir), "killed": drops(killed_dir)}
    res["trained_groups"] = {"straight": sum(map(len, s_trained.values())),
                             "killed": sum(map(len, k_trained.values()))}
    res["ok"] = (res["trained_twice"] == 0 and not res["summary"].get("lost_accepted_groups")
                 and res["gaps"] <= res["rule_drops"]["killed"] and res["differ_within_drops"]
                 and res["book_off_by"] == {"straight": 0, "killed": 0} and not s_missing and not k_missing
                 and res["straight"]["end"] == "exit 0" and runs[-1]["end"] == "exit 0")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--kills", type=int, default=3, help="kill -9's per seed, at random steps")
    ap.add_argument("--target", choices=["all", "learner"], default="all",
                    help="all: every process, then recover=auto; learner: the learner alone, restarted in place")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--eta", type=int, default=2, help="staleness bound: groups in flight behind the front")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rollout-workers", type=int, default=2)
    ap.add_argument("--checkpoint-every", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=0.0,
                    help="seconds per run before it counts as hung (0: 300, with --default 1800)")
    ap.add_argument("--default", action="store_true",
                    help="the default run instead (tiny model, --steps must be its total_train_steps): final "
                         "accuracy and accounting, no prompt check (nothing recorded)")
    ap.add_argument("--out", default="", help="folder for the runs (default: a temporary one)")
    ap.add_argument("--json", default="", help="write the results here")
    a = ap.parse_args(argv)
    a.timeout = a.timeout or (1800.0 if a.default else 300.0)
    root = a.out or tempfile.mkdtemp(prefix="arl-kill-resume-")
    os.makedirs(root, exist_ok=True)
    print(f"kill_resume: {machine()}; runs in {root}", flush=True)
    tok = tokenizer_dir(root)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tok))
    results = []
    for seed in range(a.seeds):
        r = one_seed(a, seed, root, tok, vocab)
        results.append(r)
        if a.default:
            print(f"seed {seed}: default run, {a.target} killed after steps "
                  f"{[x['kill_after_step'] for x in r['killed'][:-1]]}; final accuracy {r['final_acc']['killed']} "
                  f"(straight {r['final_acc']['straight']}); seconds {r['killed'][-1].get('seconds')} (straight "
                  f"{r['straight']['seconds']}); {r['summary']} -> {'ok' if r['ok'] else 'FAILED'}", flush=True)
            continue
        kills = ", ".join(f"{x['kill_after_step']}" for x in r["killed"][:-1])
        same = ("equal" if not r["unequal"] else "equal apart from rule drops" if r["differ_within_drops"]
                else "DIFFERENT")
        print(f"seed {seed}: {a.target} killed after steps [{kills}]; trained groups {r['trained_groups']['killed']} "
              f"(straight {r['trained_groups']['straight']}); trained twice {r['trained_twice']}, gaps {r['gaps']} "
              f"(rule drops {r['rule_drops']['killed']}, straight {r['rule_drops']['straight']}); below the fronts "
              f"{r['compared_below']} {same}; book off by {r['book_off_by']}; {r['summary']} -> "
              f"{'ok' if r['ok'] else 'FAILED'}", flush=True)
        if not r["ok"]:
            print(json.dumps(r, indent=1, default=str), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    ok = all(r["ok"] for r in results)
    print(f"kill_resume: {sum(r['ok'] for r in results)}/{len(results)} seeds ok, "
          f"{sum(len(r['killed']) - 1 for r in results)} kills in all", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
