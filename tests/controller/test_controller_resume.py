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
    assert c.roster.positions == {0: 17, 1: 9}
    c.reporter.close()


def test_resumed_run_loads_the_checkpoint_weights_then_evaluates_then_opens(tmp_path):
    """All roles registered: the checkpoint's weights go to every server first; once they are live everywhere the
    start version is evaluated (the gate stays where it is), and its result opens admission."""
    import asyncio

    from .fakes import FakeRouter

    async def go() -> None:
        c = _controller(tmp_path, resume={"version": 3, "groups_consumed": 12})
        c.router = FakeRouter()
        c.spawn_roles()
        await c._dispatch(b"i0", "register", {"role": "inference", "index": 0, "address": "tcp://i:0"})
        await c._dispatch(b"L", "register", {"role": "learner", "index": 0, "address": "tcp://l:0"})
        for r in (0, 1):
            await c._dispatch(f"r{r}".encode(), "register", {"role": "rollout", "index": r})
        path = str(tmp_path / "weights" / "v3.safetensors")
        assert c.router.sent[-1] == (b"i0", "update_weights", {"version": 3, "path": path})
        assert [s for s in c.router.sent if s[1] == "eval"] == []
        await c._dispatch(b"r0", "gate_acquire", {"want": 2})
        await c._dispatch(b"i0", "weights_loaded", {"version": 3, "index": 0})
        assert c.router.sent[-2:] == [(b"L", "prune_weights", {"below": 3}),
                                      (b"r0", "eval", {"version": 3, "max_prompts": 4})]
        assert c.gate.version == 3 and not c.admission.is_open
        await c._dispatch(b"r0", "eval_done", {"version": 3, "n": 1, "first_acc": 0.0, "solved_acc": 0.0})
        assert c.admission.is_open and c.router.sent[-1] == (b"r0", "gate_grant", {"n": 2})
        await c._dispatch(b"r0", "eval_done", {"version": 3, "n": 1, "first_acc": 0.0, "solved_acc": 0.0})
        assert [s for s in c.router.sent if s[1] == "eval"] == [(b"r0", "eval", {"version": 3, "max_prompts": 4})]
        assert not c._done.is_set()
        c.reporter.close()

    asyncio.run(go())
