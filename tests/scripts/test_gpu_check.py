"""scripts/gpu_check.py's arithmetic and summary, and scripts/gpu_wheels.py's offline parts (the whole check runs
in .ci/run: `bash scripts/gpu_check.sh --device cpu`, `python scripts/gpu_wheels.py --check`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import zipfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import gpu_check  # noqa: E402
import gpu_wheels  # noqa: E402


def test_forward_flops_match_torch_flop_counter():
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**gpu_check.TINY_QWEN2, attn_implementation="eager")).eval()
    L = 32
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=torch.randint(0, 1024, (1, L)), use_cache=False)
    cfg = model.config
    want = gpu_check.forward_flops(gpu_check.linear_params(model), cfg.num_hidden_layers, cfg.hidden_size, [L],
                                   causal=False)  # eager attention computes the whole square
    assert counter.get_total_flops() == pytest.approx(want, rel=1e-3)  # rotary's tiny product aside


def test_ppo_step_flops_and_peak():
    # 1 token-matrix weight, 1 layer, hidden 1: forward = 2 * tokens + causal attention 2 * L^2 per sequence
    assert gpu_check.forward_flops(1, 1, 1, [3, 1]) == 2 * 4 + 2 * (9 + 1)
    assert gpu_check.ppo_step_flops(10, 2, 8, [5]) == 4 * (2 * 10 * 5 + 2 * 2 * 8 * 25)
    assert gpu_check.peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert gpu_check.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert gpu_check.peak_tflops("NVIDIA H200") == 989.4
    assert gpu_check.peak_tflops("cpu") is None


def test_figures_and_summary():
    text = "noise\nFIGURE a. one\n  FIGURE not at the start\nFIGURE a. two  \n"
    assert gpu_check.figures(text) == ["a. one", "a. two"]
    results = [{"part": "a", "rc": 0, "seconds": 12.3, "figures": ["a. one"]},
               {"part": "b", "rc": 1, "seconds": 4.0, "figures": []},
               {"part": "c", "rc": -15, "timed_out": True, "seconds": 120.0, "figures": ["c. partial"]}]
    lines = gpu_check.summary(results, "device cpu")
    assert lines[0] == "==== GPU check summary: device cpu ===="
    assert lines[1:] == ["[a] ok, 12 s", "    a. one", "[b] FAILED (exit 1), 4 s", "    (no figure)",
                         "[c] TIMED OUT, 120 s", "    c. partial", "==== GPU check: 1/3 parts passed ===="]


def test_driver_reports_a_failing_part_and_exits_nonzero(monkeypatch, capsys):
    calls = []

    def fake_run_part(part, dev, timeout_s, out_dir):
        calls.append((part, dev))
        return {"part": part, "rc": 0 if part == "a" else 2, "seconds": 1.0, "figures": [f"{part}. x"]}

    monkeypatch.setattr(gpu_check, "run_part", fake_run_part)
    monkeypatch.setattr(gpu_check, "describe", lambda dev: f"device {dev}")
    assert gpu_check.main(["--device", "cpu", "--parts", "ab"]) == 1
    assert calls == [("a", "cpu"), ("b", "cpu")]
    out = capsys.readouterr().out
    assert "[b] FAILED (exit 2), 1 s" in out and out.rstrip().endswith("1/2 parts passed ====")


def test_run_part_ends_a_part_that_overruns(tmp_path):
    """A part past its time is ended with what it started (its own session) and reported as timed out; the part
    exits through Python, so its `finally` blocks run (a JIT-build lock held then is released)."""
    script = tmp_path / "slow.py"
    pid_file, cleaned = tmp_path / "grandchild.pid", tmp_path / "cleaned"
    script.write_text(f"""import subprocess, sys, time
sys.path.insert(0, {os.path.join(ROOT, 'scripts')!r})
import gpu_check, types
sys.modules['torch'] = types.SimpleNamespace(manual_seed=lambda s: None, set_num_threads=lambda n: None)  # fast

def part_z(dev, sz, out_dir):
    print('FIGURE z. started', flush=True)
    p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
    open({str(pid_file)!r}, 'w').write(str(p.pid))
    try:
        time.sleep(60)
    finally:
        open({str(cleaned)!r}, 'w').write('yes')

gpu_check.part_z = part_z
sys.exit(gpu_check.main())
""")
    r = gpu_check.run_part("z", "cpu", timeout_s=8, out_dir="", script=str(script))
    assert r["timed_out"] and r["rc"] != 0 and r["figures"] == ["z. started"] and r["seconds"] < 30
    assert cleaned.exists(), "the part was killed without running its finally blocks"
    import psutil

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while alive(pid):
        assert time.monotonic() < deadline, "the part's own child outlived the timeout"
        time.sleep(0.1)


# ------------------------------------------------------------------------------------------------ wheels

def test_wheel_helpers(tmp_path):
    assert gpu_wheels.wheel_key("pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.whl") == ("pydantic-core",
                                                                                                "2.50.5")
    assert gpu_wheels.duplicates(["a-1-py3-none-any.whl", "a-2-py3-none-any.whl", "b-1-py3-none-any.whl"]) == ["a"]
    reqs = gpu_wheels.project_requirements()
    assert any(r.startswith("deepspeed") for r in reqs) and any(r.startswith("pyzmq") for r in reqs)
    names = dict(gpu_wheels.device_packages())
    assert names["torch"] == "2.11.0" and "transformers" in names and "pyzmq" not in names
    whl = gpu_wheels.stub_wheel(str(tmp_path), "py-cpuinfo", "9.0.0")
    with zipfile.ZipFile(whl) as z:
        assert "Name: py-cpuinfo\nVersion: 9.0.0" in z.read("py_cpuinfo-9.0.0.dist-info/METADATA").decode()
    carried = {gpu_wheels.norm(r.split("==")[0]) for r in gpu_wheels.CARRY}
    assert not carried & set(names) - {"typing-extensions"}, "carry only what the image lacks (or an exception)"


def _fake_carry(folder, skip: str = "") -> None:
    for req in gpu_wheels.CARRY:
        name, version = req.split("==")
        if gpu_wheels.norm(name) != skip:
            gpu_wheels.stub_wheel(str(folder), gpu_wheels.norm(name), version)


def test_check_resolves_offline_and_fails_on_a_missing_wheel(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_wheels, "find_python312", lambda: None)
    good = tmp_path / "good"
    good.mkdir()
    _fake_carry(good)
    gpu_wheels.check(str(good))  # stand-ins for the carried wheels: the resolver finds every requirement
    bad = tmp_path / "bad"
    bad.mkdir()
    _fake_carry(bad, skip="pyzmq")
    with pytest.raises(subprocess.CalledProcessError):
        gpu_wheels.check(str(bad))
    gpu_wheels.stub_wheel(str(good), "pyzmq", "26.0.0")
    with pytest.raises(SystemExit, match="several versions"):
        gpu_wheels.check(str(good))


def test_part_f_batches_are_shaped_like_the_default_runs():
    groups = gpu_check.default_like_groups(16, 8, version=5, tag="x")
    assert len(groups) == 16 and all(len(g) == 8 for g in groups)
    for g in groups:
        assert len({t.group_id for t in g}) == 1
        assert len({tuple(t.input_ids[:7]) for t in g}) == 1  # the group shares its prompt
        for t in g:
            gen = t.loss_mask > 0
            assert gen.any() and not gen[:7].any()
            assert (t.versions[gen] == 5).all() and (t.versions[~gen] == -1).all()
            assert 7 + 21 <= len(t.input_ids) <= 7 + 3 * 23
