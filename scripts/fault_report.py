"""Run the fault tests (tests/faults) and print what they injected and what every run's accounting says.

    python scripts/fault_report.py                      # runs pytest tests/faults, then prints the report
    python scripts/fault_report.py --results FILE       # only prints the report of an earlier run's results file
    python scripts/fault_report.py -k fuzz              # extra arguments go to pytest

Each fault test appends one JSON line to $ARL_FAULT_RESULTS with the figures of its run (see
tests/faults/harness.py). Trajectories are followed end to end: accepted by the controller (a rollout worker's
group_done) -> received by the learner -> trained, dropped as stale, or still buffered at the end. "lost" is
accepted but never received; "trained twice" is a group id the learner trained in two steps. Both must be 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_tests(results: str, pytest_args: list[str]) -> int:
    env = {**os.environ, "ARL_FAULT_RESULTS": results}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/faults", *pytest_args]
    print("$", " ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=ROOT, env=env)


def load(results: str) -> list[dict]:
    if not os.path.exists(results):
        return []
    with open(results) as f:
        return [json.loads(line) for line in f if line.strip()]


def _n(x) -> int:
    return int(x or 0)


def report(rows: list[dict], pytest_code: int | None = None) -> str:
    lines = []
    head = (f"{'test':34} {'faults':>8} {'finished':>8} {'acc g/t':>9} {'recv g/t':>9} {'trained g/t':>11} "
            f"{'stale g/t':>9} {'buf g/t':>7} {'lost':>4} {'twice':>5} {'fuzzed':>7} {'crash':>5}")
    lines += [head, "-" * len(head)]
    tot = {"injected": 0, "finished": 0, "acc_t": 0, "trained_t": 0, "stale_t": 0, "buf_t": 0, "recv_t": 0,
           "lost": 0, "twice": 0, "fuzzed": 0, "crashes": 0, "balance_bad": 0}
    for r in rows:
        le = r.get("learner") or {}
        acc_g, acc_t = _n(r.get("accepted_groups")), _n(r.get("accepted_trajectories"))
        recv_g, recv_t = _n(le.get("groups_received")), _n(le.get("trajectories_received"))
        tr_g, tr_t = _n(le.get("trained_groups")), _n(le.get("trained_trajectories"))
        st_g, st_t = _n(le.get("stale_groups_dropped")), _n(le.get("stale_trajectories_dropped"))
        bu_g, bu_t = _n(le.get("buffered_groups")), _n(le.get("buffered_trajectories"))
        finished = bool(r.get("finished"))
        # a run stopped on purpose (a fatal fault, as configured) has groups in flight when it stops: only
        # finished runs must account for every accepted group
        lost = max(0, acc_g - recv_g) if finished else 0
        twice = _n(le.get("trained_twice"))
        fuzzed = _n(r.get("frames_fuzzed"))
        crashes = _n(r.get("crashes"))
        faults = max(0, _n(r.get("injected")) - fuzzed)  # events other than fuzzed frames (kills, hangs, stops)
        lines.append(f"{r['test'][:34]:34} {faults:>8} {('yes' if finished else 'stopped'):>8} "
                     f"{acc_g:>4}/{acc_t:<4} {recv_g:>4}/{recv_t:<4} {tr_g:>5}/{tr_t:<5} {st_g:>4}/{st_t:<4} "
                     f"{bu_g:>3}/{bu_t:<3} {lost:>4} {twice:>5} {fuzzed:>7} {crashes:>5}")
        lines.append(f"  {r.get('fault', '')}")
        tot["injected"] += faults
        tot["finished"] += finished
        tot["acc_t"] += acc_t
        tot["recv_t"] += recv_t
        tot["trained_t"] += tr_t
        tot["stale_t"] += st_t
        tot["buf_t"] += bu_t
        tot["lost"] += lost
        tot["twice"] += twice
        tot["fuzzed"] += fuzzed
        tot["crashes"] += crashes
        tot["balance_bad"] += finished and _n(r.get("learner_balance")) != 0
    lines.append("")
    lines.append(f"faults injected:            {tot['injected']}  (kills, stops, hangs, timeouts; frames below)")
    lines.append(f"runs that finished:         {tot['finished']} of {len(rows)} "
                 f"(the others were configured to stop; see 'stopped')")
    lines.append(f"trajectories accepted:      {tot['acc_t']}  (received by the learner {tot['recv_t']})")
    lines.append(f"trajectories trained:       {tot['trained_t']}  + dropped stale {tot['stale_t']} "
                 f"+ buffered at the end {tot['buf_t']}")
    lines.append(f"accepted groups lost:       {tot['lost']}")
    lines.append(f"groups trained twice:       {tot['twice']}")
    lines.append(f"learner balance errors:     {tot['balance_bad']}  (finished runs where received != trained + stale "
                 f"+ buffered + in a step)")
    lines.append(f"frames fuzzed:              {tot['fuzzed']}")
    lines.append(f"crashes:                    {tot['crashes']}")
    if pytest_code is not None:
        lines.append(f"pytest exit status:         {pytest_code}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", help="read this results file instead of running the tests")
    args, pytest_args = ap.parse_known_args(argv)
    code = None
    if args.results:
        results = args.results
    else:
        fd, results = tempfile.mkstemp(prefix="arl-faults-", suffix=".jsonl")
        os.close(fd)
        code = run_tests(results, pytest_args)
    rows = load(results)
    if not rows:
        print(f"no fault results in {results}")
        return 1
    print()
    print(report(rows, code))
    bad = any((r.get("finished") and (_n(r.get("lost_accepted_groups")) or _n(r.get("learner_balance"))))
              or _n((r.get("learner") or {}).get("trained_twice")) or _n(r.get("crashes")) for r in rows)
    return 1 if bad or code else 0


if __name__ == "__main__":
    sys.exit(main())
