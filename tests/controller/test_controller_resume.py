"""The controller resumes from a learner checkpoint's state: gate version and budget, prompt positions."""

from __future__ import annotations

from arl.api.staleness import StalenessPolicy
from arl.controller.shell import Controller
from arl.controller.supervision import Supervisor

from .fakes import FakeLauncher


def _controller(tmp_path, **kw):
    return Controller(run_dir=str(tmp_path), supervisor=Supervisor(num_inference=1, num_rollout=2, startup_timeout=30),
                      batch_size=4, staleness=StalenessPolicy(2), max_concurrent_rollouts=8, total_train_steps=10,
                      eval_every=0, eval_max_prompts=4, progress=False, launcher=FakeLauncher(), **kw)


def test_fresh_start(tmp_path):
    c = _controller(tmp_path)
    assert c.start_version == 0 and c.gate.version == 0 and c.gate.accepted == 0
    assert c.gate.capacity() == 8  # (0 + 2 + 1) * 4 = 12 by staleness, 8 by concurrency
    c.reporter.close()


def test_resume_sets_gate_and_prompt_positions(tmp_path):
    c = _controller(tmp_path, resume={"version": 3, "groups_consumed": 12, "data_position": {"0": 17, "1": 9}})
    assert c.start_version == 3 and c.gate.version == 3 and c.gate.accepted == 12
    # (3 + 2 + 1) * 4 - 12 = 12 by staleness, 8 by concurrency; the run ends after 10 * 4 groups
    assert c.gate.capacity() == 8 and c.gate.max_groups == 40
    assert c._prompt_positions == {0: 17, 1: 9}
    c.reporter.close()
