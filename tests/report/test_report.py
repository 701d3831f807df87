"""The run report: the data embedded in report.html (curves from metrics.jsonl, traces), its self-containment,
curves.png, the controller's builder, and the Chromium check's PNG reader."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from arl.report.page import ReportBuilder, pick_traces, report_data, write_report
from arl.controller.reporting import JsonlSink
from arl.report.traces import TraceWriter

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from check_report_chromium import pixel_stats, read_png  # noqa: E402


def _trace(step: int, reward, why="sampled", termination="solved", outcome="accepted", text="12") -> dict:
    return {"step": step, "reward": reward, "why": why, "termination": termination, "outcome": outcome,
            "group": f"g{step}", "prompt_id": "1+1", "versions": [step, step], "n_tokens": 5, "n_generated": 2,
            "segments": [{"role": "prompt", "source": "prompt", "gen": False, "text": "1+1=", "n": 4},
                         {"role": "assistant", "source": "engine", "gen": True, "text": text, "n": 2,
                          "v": [step, step], "turn": 0}],
            "turns": [{"turn": 0, "t_sent": 0.1, "inference_s": 0.2, "worker": 0, "attempts": 1, "finish": "stop",
                       "n": 2, "env_tool_s": None}]}


def make_run(tmp_path) -> str:
    """A run directory as the controller leaves it: metrics.jsonl through the tracker fan-out, traces.jsonl."""
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    mt = JsonlSink(os.path.join(run_dir, "metrics.jsonl"))
    mt.log({"type": "eval", "step": 0, "first_acc": 0.25, "solved_acc": 0.3, "n": 8, "seconds": 1.0}, 0)
    for step in (1, 2, 3):
        mt.log({"type": "train", "step": step, "elapsed": 10.0 * step, "reward_mean": 0.1 * step,
                  "rollout": {"reward": 0.05 * step}, "head_offpolicyness": 2.0, "tail_offpolicyness": step - 1.0,
                  "tokens_per_s": 100.0 * step, "samples_per_s": 10.0, "inference_idle_frac": 0.25 if step > 1 else None,
                  "learner_wait_seconds": 1.0, "learner_step_seconds": 3.0, "mismatch_kl": 1e-6 * step,
                  "clip_frac": 0.01, "capped_frac": 0.0, "admitted_eta": 1 + step,
                  "rss_mib": {"controller": 100.0, "rollout0": 200.0 + step, **({"learner0": 900.0} if step > 1 else {})}},
               0)
    mt.log({"type": "fault", "kind": "rollout_exit"}, 0)
    mt.log({"type": "eval", "step": 3, "first_acc": 0.5, "solved_acc": 0.625, "n": 8, "seconds": 1.0}, 0)
    mt.log({"type": "summary", "finished": True, "failure": "", "steps": 3, "groups": {"accepted": 9}}, 0)
    mt.close()
    w = TraceWriter(os.path.join(run_dir, "traces.jsonl"))
    w.write([_trace(1, 1.0), _trace(2, 0.0, termination="max_turns"),
             _trace(3, None, why="forced", termination=None, outcome="filtered", text="</script><b>x</b>")])
    w.close()
    return run_dir


def embedded(path: str) -> dict:
    page = open(path, encoding="utf-8").read()
    m = re.search(r'<script id="arl-data" type="application/json">(.*?)</script>', page, re.S)
    assert m, "the page embeds its data"
    return json.loads(m.group(1))


def series(data: dict, chart: str) -> dict:
    (c,) = [c for c in data["charts"] if c["id"] == chart]
    return {s["label"]: s["points"] for s in c["series"]}


def test_report_page_embeds_curves_evals_and_traces(tmp_path) -> None:
    run_dir = make_run(tmp_path)
    path = write_report(run_dir, png=False)
    data = embedded(path)
    again = json.loads(json.dumps(report_data(run_dir)))
    assert {**data, "built": ""} == {**again, "built": ""}  # what the page shows is what report_data builds
    assert series(data, "accuracy") == {"first answer": [[0, 0.25], [3, 0.5]],
                                        "solved within all turns": [[0, 0.3], [3, 0.625]]}
    assert series(data, "reward")["trained batch"] == [[1, 0.1], [2, 0.2], [3, 0.3]]
    assert series(data, "reward")["all rollouts (before filters)"] == [[1, 0.05], [2, 0.1], [3, 0.15]]
    assert series(data, "staleness")["tail (oldest)"] == [[1, 0.0], [2, 1.0], [3, 2.0]]
    assert series(data, "throughput")["tokens/s"] == [[1, 100.0], [2, 200.0], [3, 300.0]]
    assert series(data, "busy") == {"busy": [[2, 0.75], [3, 0.75]]}  # 1 - idle; step 1 had no figure
    assert series(data, "learner_idle") == {"waiting for data": [[1, 0.25], [2, 0.25], [3, 0.25]]}
    assert series(data, "staleness")["admitted eta (auto)"] == [[1, 2.0], [2, 3.0], [3, 4.0]]
    assert series(data, "mismatch")["KL engine || learner (k3)"] == [[1, 1e-6], [2, 2e-6], [3, 3e-6]]
    assert series(data, "health")["clipped"] == [[1, 0.01], [2, 0.01], [3, 0.01]]
    assert series(data, "memory") == {"controller": [[1, 100.0], [2, 100.0], [3, 100.0]],  # a curve per role
                                      "learner0": [[2, 900.0], [3, 900.0]],
                                      "rollout0": [[1, 201.0], [2, 202.0], [3, 203.0]]}
    assert [e["step"] for e in data["evals"]] == [0, 3] and data["steps"] == 3 and data["faults"] == 1
    assert data["summary"]["finished"] is True
    assert [t["reward"] for t in data["traces"]] == [1.0, 0.0, None] and data["traces_total"] == 3
    assert data["traces"][2]["segments"][1]["text"] == "</script><b>x</b>"  # survives the embedding intact


def test_report_page_is_self_contained(tmp_path) -> None:
    page = open(write_report(make_run(tmp_path), png=False), encoding="utf-8").read()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page, re.I)
    assert "<link" not in page and "@import" not in page
    assert page.count("</script>") == 2  # the data block and the page's script: a trace cannot close either
    assert 'data-rendered' in page and 'data-js-error' in page  # what the Chromium check reads


def test_curves_png_is_written(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    run_dir = make_run(tmp_path)
    write_report(run_dir)
    from PIL import Image

    with Image.open(os.path.join(run_dir, "curves.png")) as im:
        assert im.format == "PNG" and im.width > 600 and im.height > 300
    ink, colours = pixel_stats(os.path.join(run_dir, "curves.png"))
    assert ink > 0.02 and colours > 8


def test_report_of_an_empty_run_still_renders(tmp_path) -> None:
    run_dir = str(tmp_path)
    open(os.path.join(run_dir, "metrics.jsonl"), "w").close()
    data = embedded(write_report(run_dir, png=False))
    assert all(c["series"] == [] for c in data["charts"]) and data["traces"] == [] and data["summary"] is None


def test_pick_traces_keeps_room_for_sampled_ones() -> None:
    traces = [{"i": i, "why": "forced"} for i in range(10)] + [{"i": 10 + i, "why": "sampled"} for i in range(3)]
    traces += [{"i": 13 + i, "why": "forced"} for i in range(10)]
    picked = pick_traces(traces, 6)
    assert [t["i"] for t in picked] == [10, 11, 12, 20, 21, 22]
    assert len(pick_traces(traces, 1)) == 1 and pick_traces(traces, 0) == traces
    assert [t["i"] for t in pick_traces(traces[:5], 20)] == [0, 1, 2, 3, 4]


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_builder_builds_in_a_thread_and_at_the_end(tmp_path) -> None:
    run_dir = make_run(tmp_path)
    b = ReportBuilder(run_dir)
    b.request()
    b.request()  # while one runs: one more after it, not one per request
    b.build()
    assert b.builds >= 2 and os.path.exists(os.path.join(run_dir, "report.html"))
    assert os.path.exists(os.path.join(run_dir, "curves.png")) == _has_matplotlib()  # the end-of-run build only
    ReportBuilder(str(tmp_path / "missing")).build()  # a failed build is logged, not raised


def test_report_script_rebuilds_any_run_dir(tmp_path) -> None:
    run_dir = make_run(tmp_path)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "report.py"), run_dir, "--no-png"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == os.path.join(run_dir, "report.html")
    assert embedded(os.path.join(run_dir, "report.html"))["steps"] == 3
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "report.py"), str(tmp_path / "nope")],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert bad.returncode == 2


def test_chromium_checks_png_reader_matches_pillow(tmp_path) -> None:
    Image = pytest.importorskip("PIL.Image")
    im = Image.new("RGB", (37, 23), "white")
    for x in range(37):
        im.putpixel((x, x % 23), (x * 7 % 256, 40, 200))
    for mode in ("RGB", "RGBA"):
        path = str(tmp_path / f"t_{mode}.png")
        im.convert(mode).save(path)
        width, height, rows = read_png(path)
        bpp = len(mode)
        assert (width, height) == (37, 23)
        conv = im.convert(mode)
        assert all(tuple(rows[y][x * bpp:(x + 1) * bpp]) == conv.getpixel((x, y))
                   for y in range(height) for x in range(width))
    blank = str(tmp_path / "blank.png")
    Image.new("RGB", (64, 64), "white").save(blank)
    assert pixel_stats(blank) == (0.0, 1)
    ink, colours = pixel_stats(path)
    assert 0 < ink < 0.2 and colours > 2
