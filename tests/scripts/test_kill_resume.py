"""scripts/kill_resume.py at a small size: everything is killed (kill -9) at a random step, the run resumes with
recover=auto, and no prompt is skipped or trained twice against a straight run of the same config (simulated
engines; the full size, 3 seeds x 3 kills, is in docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_kill_everything_and_resume_loses_no_prompt(tmp_path):
    out = tmp_path / "result.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "kill_resume.py"), "--seeds", "1", "--kills",
                        "1", "--steps", "6", "--out", str(tmp_path / "runs"), "--json", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (res,) = json.loads(out.read_text())
    assert res["killed"][0]["end"].startswith("killed") and res["killed"][-1]["end"] == "exit 0"
    assert res["trained_twice"] == 0 and res["gaps"] <= res["rule_drops"]["killed"] and res["differ_within_drops"]
    assert res["book_off_by"] == {"straight": 0, "killed": 0}  # every settled prompt trained once or rule-dropped
    assert res["trained_groups"]["killed"] == res["trained_groups"]["straight"] == 6 * 4
    assert min(res["compared_below"].values()) > 0  # something was compared
