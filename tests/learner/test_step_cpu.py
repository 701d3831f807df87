"""The learner's step record says what the step cost in CPU, apart from the rest of the process."""

from __future__ import annotations

import asyncio
import time

import pytest

from arl.api.staleness import StalenessPolicy
from arl.config import PPOConfig, SimLearnerConfig
from arl.learner.actor import PPOActor
from arl.learner.sim_learner import SimLearner
from arl.learner.worker import LearnerWorker

from ..typed_control import typed
from .test_stale_groups import GROUPS, V


def burn(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU (a CPU clock, not the wall clock)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@pytest.mark.asyncio
async def test_step_record_has_the_steps_cpu_the_process_cpu_and_the_batch_tokens(tmp_path):
    actor = PPOActor(SimLearner(SimLearnerConfig(s_per_token=0.0, step_base_s=0.0), version=V), PPOConfig(),
                     staleness=StalenessPolicy())
    update = actor.ppo_update

    def slow_update(batch):  # the step's CPU, spent in the phase's worker thread
        burn(0.2)
        return update(batch)

    actor.ppo_update = slow_update  # type: ignore[method-assign]
    sent: list = []

    async def send(msg_type: str, payload: dict) -> None:
        sent.append((msg_type, payload))

    worker = LearnerWorker(actor=actor, pull=None, send_control=typed(send), batch_size=2, total_steps=V + 1,
                           weights_dir=str(tmp_path), staleness=actor.staleness)
    worker.buffer.extend([GROUPS["fresh"], GROUPS["empty_answer"]])
    c0 = time.process_time()
    await asyncio.wait_for(worker.train(), 60)
    spent = time.process_time() - c0
    m = next(p["metrics"] for t, p in sent if t == "weights_published")
    assert 0.2 <= m["learner_step_cpu_seconds"] <= m["learner_cpu_seconds"]
    assert m["learner_step_cpu_seconds"] <= spent  # the phases' threads only, not the other threads' CPU
    phases = m["learner_phase_seconds"]  # wall seconds per phase: where a slow step's time went
    assert set(phases) == {"prepare", "logp", "advantages", "update", "export"}
    assert phases["update"] >= 0.2 and sum(phases.values()) <= m["learner_step_seconds"]
    assert m["batch_tokens"] == sum(len(t.input_ids) for g in (GROUPS["fresh"], GROUPS["empty_answer"]) for t in g)
