"""Smoke tests: every benchmark script runs end to end at tiny sizes (figures are not checked: no wall-clock
thresholds in tests; the scripts' own numbers live in docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(ROOT, "scripts")

pytestmark = pytest.mark.slow


def run_script(name: str, args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, name), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{name} exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_bench_transport_smoke(tmp_path, transport):
    out = tmp_path / "rows.json"
    proc = run_script("bench_transport.py", ["--payloads", "16", "256", "--concurrency", "1", "4", "--seconds", "0.2",
                                             "--transport", transport, "--json", str(out)])
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert {(r["payload"], r["level"], r["concurrency"]) for r in rows} == {
        (p, lv, c) for p in (16, 256) for lv in ("client", "agent") for c in (1, 4)}
    assert all(r["n"] > 0 and r["rt_per_s"] > 0 for r in rows)
    assert sorted(res["floor"]) == ["16", "256"] and all(f["n"] > 0 for f in res["floor"].values())
    assert "of ARL" in proc.stdout  # the summary sets ARL's latency against the bare pyzmq floor


def test_bench_transport_baseline_tree():
    """--baseline-tree alternates this tree with another checkout (here: this tree again) and ends on the ratios."""
    proc = run_script("bench_transport.py", ["--payloads", "16", "--levels", "agent", "--concurrency", "4",
                                             "--seconds", "0.2", "--baseline-tree", ROOT, "--rounds", "2"])
    lines = proc.stdout.strip().splitlines()
    assert sum(line.startswith("round ") for line in lines) == 4
    assert re.fullmatch(r"this/baseline: rt_per_s [0-9.]+, client_cpu_us [0-9.]+, server_cpu_us [0-9.]+", lines[-1])


SIM_TINY = ["--servers", "4", "--servers-per-process", "2", "--rollout-workers", "1", "--steps", "2", "--batch", "2",
            "--group-size", "2", "--time-scale", "0.01", "--len-median", "30", "--max-new-tokens", "300",
            "--tool-latency", "0.2"]


def test_bench_async_sim_smoke(tmp_path):
    out = tmp_path / "async.json"
    proc = run_script("bench_async.py", ["--engine", "sim", *SIM_TINY, "--out", str(tmp_path / "runs"),
                                         "--json", str(out)])
    assert "async/sync throughput" in proc.stdout
    res = json.loads(out.read_text())["runs"]["4"]
    assert res["sync"]["steps"] == res["async"]["steps"] == 2
    assert res["sync"]["max_staleness"] == 0 and res["async"]["max_staleness"] <= 4
    assert res["ratio"] > 0


def test_bench_async_torch_smoke(tmp_path):
    out = tmp_path / "async.json"
    run_script("bench_async.py", ["--engine", "torch", "--steps", "1", "--batch", "1", "--group-size", "2",
                                  "--max-turns", "2",
                                  "--out", str(tmp_path / "runs"), "--json", str(out)], timeout=900)
    res = json.loads(out.read_text())["runs"]["1"]
    assert res["sync"]["steps"] == res["async"]["steps"] == 1 and res["ratio"] > 0


def test_scale_run_smoke(tmp_path):
    out = tmp_path / "scale.json"
    run_script("scale_run.py", ["--duration", "3", "--warmup", "0", "--groups", "8", "--group-size", "2",
                                "--rollout-workers", "2", "--servers", "4", "--servers-per-process", "2",
                                "--batch", "2", "--time-scale", "0.02", "--out", str(tmp_path / "runs"),
                                "--json", str(out)])
    res = json.loads(out.read_text())
    assert not res["error"]
    assert {"controller", "inference0", "inference1", "learner", "rollout0", "rollout1"} <= set(res["procs"])
    assert 0 <= res["servers_busy"] <= 1 and res["controller_cpu_share"] >= 0


def test_bench_routing_smoke(tmp_path):
    """Both routing modes through the real launcher (sim servers): the servers' reports reach the rollout workers'
    view only with global_view, and it keeps a group's chats (one prompt) where the prompt is cached."""
    out = tmp_path / "routing.json"
    proc = run_script("bench_routing.py", ["--duration", "4", "--warmup", "1", "--servers", "4",
                                           "--servers-per-process", "4", "--rollout-workers", "2", "--groups", "8",
                                           "--group-size", "4", "--system-tokens", "64", "--prompt-tokens", "1024",
                                           "--turns-max", "1",
                                           "--cache-tokens", "20000", "--time-scale", "0.05", "--out",
                                           str(tmp_path / "runs"), "--json", str(out)])
    assert "global routing:" in proc.stdout
    runs = json.loads(out.read_text())["runs"]
    g, p = runs["global_view"][0], runs["per_worker"][0]
    assert not g["error"] and not p["error"]
    assert g["route_reports"] > 0 and p["route_reports"] == 0
    assert g["hit_rate"] > p["hit_rate"]


def test_bench_autoscale_smoke(tmp_path):
    """The three runs (fixed minimum, fixed maximum, autoscale) through the real launcher at a tiny size."""
    out = tmp_path / "autoscale.json"
    proc = run_script("bench_autoscale.py", ["--steps", "2", "--batch", "2", "--concurrency", "4",
                                             "--min-servers", "1", "--max-servers", "2", "--time-scale", "0.05",
                                             "--out", str(tmp_path / "runs"), "--json", str(out)])
    assert "autoscale:" in proc.stdout
    runs = json.loads(out.read_text())["runs"]
    assert all(r["steps"] == 2 and not r["error"] and r["server_s"] > 0 for r in runs.values())


def test_bench_fleet_smoke(tmp_path):
    """One run whose fleet goes 1 -> 2 -> 1 servers through `arl.ctl`, at a tiny size: every phase measured, the
    changes answered, nothing accepted lost."""
    out = tmp_path / "fleet.json"
    proc = run_script("bench_fleet.py", ["--fleet", "1,2,1", "--phase-s", "2", "--warmup-s", "1", "--concurrency",
                                         "8", "--rollout-workers", "1", "--batch", "2", "--time-scale", "0.05",
                                         "--out", str(tmp_path / "runs"), "--json", str(out)])
    assert "lost accepted groups: 0" in proc.stdout, proc.stdout
    res = json.loads(out.read_text())
    assert [p["size"] for p in res["phases"]] == [1, 2, 1] and [p["servers"] for p in res["phases"]] == [1, 2, 1]
    assert all(p.get("ctl_exit", 0) == 0 for p in res["phases"]) and res["phases"][1]["tokens_per_s"] > 0


def test_scale_run_smoke_through_ray(tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "scale.json"
    run_script("scale_run.py", ["--launcher", "ray", "--duration", "3", "--warmup", "0", "--groups", "8",
                                "--group-size", "2", "--rollout-workers", "2", "--servers", "4",
                                "--servers-per-process", "2", "--batch", "2", "--time-scale", "0.02",
                                "--out", str(tmp_path / "runs"), "--json", str(out)])
    res = json.loads(out.read_text())
    assert not res["error"]
    # the processes alternate between the two nodes; the learner is on node_a
    assert res["placed"]["node_a"] == ["inference0", "learner", "rollout0"], res["placed"]
    assert res["placed"]["node_b"] == ["inference1", "rollout1"], res["placed"]
    assert {"controller", "inference0", "inference1", "learner", "rollout0", "rollout1"} <= set(res["procs"])
    assert 0 <= res["servers_busy"] <= 1


def test_bench_weights_smoke(tmp_path):
    out = tmp_path / "weights.json"
    proc = run_script("bench_weights.py", ["--quick", "--json", str(out)])
    lines = proc.stdout.strip().splitlines()
    assert re.fullmatch(r"broadcast: \d+% of bare broadcast", lines[-3]), lines[-3]
    assert re.fullmatch(r"lora update: \d+x fewer bytes, [\d.]+x faster than full", lines[-1]), lines[-1]
    rows = {}
    for line in lines:  # the table: model, workers, path, MiB/worker, s, GB/s, ...
        f = line.split()
        if len(f) >= 6 and f[0] == "tiny" and f[2] in ("disk", "broadcast", "bare", "lora-disk", "lora-bcast"):
            assert f[1] == "1"
            rows[f[2]] = [float(x) for x in f[3:6]]
    assert sorted(rows) == ["bare", "broadcast", "disk", "lora-bcast", "lora-disk"]
    assert rows["lora-disk"][0] * 5 < rows["disk"][0] and rows["lora-bcast"][0] * 5 < rows["broadcast"][0]
    assert all(mib > 0 and s > 0 and gbps > 0 for mib, s, gbps in rows.values())
    assert rows["broadcast"][0] == rows["bare"][0]  # the same bytes
    case = json.loads(out.read_text())["cases"][0]
    assert (case["model"], case["workers"]) == ("tiny", 1)
    for path in ("disk", "broadcast"):  # the pause was measured while the worker generated
        r = case[path]
        assert r["pause_s"] > 0 and r["step_s"] > 0 and r["swap_s"] >= 0 and len(r["times"]) == 1
    head = json.loads(out.read_text())["headline"]
    assert head["broadcast_of_bare"] > 0 and f"{head['broadcast_of_bare'] * 100:.0f}%" in lines[-3]
    assert f"{head['lora']['lora-disk'][0]:.0f}x fewer bytes" in lines[-1]


def test_bench_envs_smoke():
    proc = run_script("bench_envs.py", ["--sessions", "1", "4", "--steps", "20"])
    rows = [line for line in proc.stdout.splitlines() if "sessions" in line]
    assert len(rows) == 3 * 2, proc.stdout  # cheap, noop, sleep10 x 2 session counts
    assert re.fullmatch(r"env server: \d+% of in-process steps/s \(cheap env\)", proc.stdout.strip().splitlines()[-1])


def test_bench_endpoint_smoke():
    proc = run_script("bench_endpoint.py", ["--groups", "2", "--group-size", "2", "--turns", "2", "--rounds", "1"])
    last = proc.stdout.strip().splitlines()[-4:]
    assert re.fullmatch(r"endpoint: \d+% of queue throughput", last[0]), proc.stdout
    for line, path in zip(last[1:], ("socket", "responses", "messages")):
        assert re.fullmatch(rf"endpoint \({path}\): \d+% of queue throughput", line), proc.stdout
    assert "round trips/s" in proc.stdout and "p50 latency" in proc.stdout


def test_ablate_staleness_smoke_with_a_correction_and_auto_eta(tmp_path):
    """Two tiny whole runs (icepop at eta 2, auto up to eta 2), the table and the doc section with its plot."""
    doc = tmp_path / "bench.md"
    doc.write_text("# Benchmarks\n\n## Other\nkept\n")
    proc = run_script("ablate_staleness.py", ["--etas", "2", "--variants", "icepop", "auto", "--seeds", "1", "--steps",
                                              "3", "--run-root", str(tmp_path / "runs"), "--doc", str(doc),
                                              "--plot", str(tmp_path / "img" / "a.png"), "--section", "## Mine",
                                              "eval.max_prompts=20", "learner.batch_size=2"], timeout=900)
    res = json.loads((tmp_path / "runs" / "results.json").read_text())
    assert [(r["eta"], r["objective"]) for r in res] == [(2, "icepop"), ("auto", "auto")]
    assert all(r["steps"] == 3 and r["groups_per_s"] > 0 and r["mismatch_kl"] is not None for r in res)
    assert res[1]["eta_mean"] is not None and res[0]["eta_mean"] is None  # only auto records its admitted eta
    text = doc.read_text()
    assert "## Other\nkept" in text and "## Mine" in text and "| auto (mean" in text and "| 2 | icepop |" in text
    if (tmp_path / "img" / "a.png").exists():  # matplotlib installed
        assert "![ablation](img/a.png)" in text
    assert "collapse at" in proc.stdout


def test_ablate_staleness_collapse_step_is_the_first_eval_far_below_the_best_before_it():
    collapse_step = _ablation_module().collapse_step
    assert collapse_step([(0, 0.3), (25, 0.6), (50, 0.5), (75, 0.44), (100, 0.7)], 0.15) == 75
    assert collapse_step([(0, 0.3), (25, 0.6), (50, 0.5)], 0.15) is None
    assert collapse_step([], 0.15) is None


def _ablation_module():
    sys.path.insert(0, SCRIPTS)
    try:
        import ablate_staleness
    finally:
        sys.path.remove(SCRIPTS)
    return ablate_staleness


def test_ablate_staleness_budget_interrupts_a_run_and_keeps_it(tmp_path):
    """Past its budget a run gets SIGINT (the launcher's clean stop) and counts as cut, not as a failure; without a
    budget the timeout still raises."""
    mod = _ablation_module()
    child = ("import signal, sys, time\n"
             "signal.signal(signal.SIGINT, lambda *a: (print('stopping', flush=True), sys.exit(0)))\n"
             "print('started', flush=True)\n"
             "time.sleep(60)\n")
    log = str(tmp_path / "run.out")
    t0 = time.monotonic()
    assert mod.run_with_budget([sys.executable, "-c", child], log, timeout=60, budget=1.5) == (0, True)
    assert time.monotonic() - t0 < 30
    assert open(log).read().split() == ["started", "stopping"]
    assert mod.run_with_budget([sys.executable, "-c", "pass"], log, timeout=60, budget=30) == (0, False)
    with pytest.raises(subprocess.TimeoutExpired):
        mod.run_with_budget([sys.executable, "-c", child], log, timeout=1.5)


def test_ablate_staleness_adds_to_an_earlier_ablation_in_its_folder(tmp_path, monkeypatch, capsys):
    """A second invocation with the same --run-root runs only what is missing and tables both."""
    mod = _ablation_module()
    calls = []

    def fake(eta, variant, seed, steps, run_root, extra, timeout, collapse_drop, budget):
        calls.append((eta, variant, seed, budget))
        return {"eta": "auto" if variant == "auto" else eta, "objective": variant, "seed": seed, "acc": 0.5,
                "acc0": 0.3, "best_acc": 0.5, "collapse_step": None, "head_mean": 1.0, "head_max": 2,
                "capped_frac": 0.0, "clip_frac": 0.0, "mismatch_kl": 1e-4, "groups_per_s": 9.0, "wall_s": 10.0,
                "steps": 100, "last_step": 60 if variant == "cispo" else 100, "cut": variant == "cispo",
                "eta_mean": None, "name": f"{variant}{eta}s{seed}"}

    monkeypatch.setattr(mod, "run_one", fake)
    root = str(tmp_path / "abl")
    os.makedirs(root)
    with open(os.path.join(root, "results.json"), "w") as f:
        json.dump([fake(1, "tis", 1, None, root, [], 1, 0.15, None)], f)
    calls.clear()
    assert mod.main(["--etas", "1", "4", "--variants", "tis", "cispo", "--seeds", "1", "--run-root", root,
                     "--no-doc", "--run-budget", "240"]) == 0
    assert calls == [(1, "cispo", 1, 240.0), (4, "tis", 1, 240.0), (4, "cispo", 1, 240.0)]
    assert len(json.load(open(os.path.join(root, "results.json")))) == 4
    out = capsys.readouterr().out
    assert "| 1 | tis | 0.500 |" in out and "| 4 | cispo | 0.500 (cut at step 60) |" in out
