"""A synchronous call in an agent blocks the rollout worker's event loop (its groups, its inference client and its
OpenAI endpoint): the loop watchdog notices it from a thread, names the agent and where the loop thread is, counts it
in the heartbeat, and the controller's message for a worker that went silent says so."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import types

import pytest

from arl.controller.diagnosis import investigate_silence
from arl.rollout.loop_watchdog import BLOCKED, RESUMED, LoopWatchdog, blocked_loop_note

from arl.rollout.worker import PromptStream, RolloutWorker

from ..typed_control import typed
from .test_guards import FakeClient, OneShotAgent, ScriptedEnv, run_groups

pytestmark = pytest.mark.timeout(60)


class SleepyAgent(OneShotAgent):
    """Blocks the loop the way a synchronous client does."""

    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        time.sleep(1.5)
        return await super().collect_trajectory(prompt, env, obs_queue, act_queue)


@pytest.mark.asyncio
async def test_an_agent_that_blocks_the_loop_is_detected_named_and_counted(caplog):
    caplog.set_level(logging.WARNING, logger="arl.rollout")
    sent = []

    async def send(msg_type, payload):
        sent.append((msg_type, payload))

    async def push(group):
        pass

    rows = [{"id": "p", "mode": "ok"}]
    worker = RolloutWorker(index=0, make_agent=SleepyAgent, make_eval_agent=SleepyAgent, make_env=ScriptedEnv,
                           prompts=PromptStream(rows, seed=0), test_rows=rows, client=FakeClient(),
                           send_control=typed(send), push_group=push, capacity=1, trajectory_timeout=10.0,
                           agent_name="'sleepy' (tests.rollout.test_loop_watchdog.SleepyAgent)")
    worker.start_watchdog()  # the acquire loop starts it in a run
    try:
        await run_groups(worker, 1)
        await asyncio.sleep(0.6)  # a beat after the block: its length is measured
        stats = worker.heartbeat_stats()
    finally:
        await worker.close()
    assert [p["reason"] for t, p in sent if t == "group_done"] == ["accepted"]  # the group itself is fine
    warnings = [r.getMessage() for r in caplog.records if BLOCKED in r.getMessage()]
    assert len(warnings) == 1, warnings
    w = warnings[0]
    assert "rollout0" in w and "'sleepy' (tests.rollout.test_loop_watchdog.SleepyAgent)" in w
    assert "test_loop_watchdog.py" in w and "in collect_trajectory" in w  # where the loop thread was
    assert "openai.AsyncOpenAI" in w and "time.sleep" in w  # what is likely wrong
    assert "time.sleep(1.5)" in w  # the blocked stack, down to the line
    assert any(RESUMED in r.getMessage() for r in caplog.records)
    loop = stats["loop_watchdog"]
    assert loop["blocks"] == 1 and loop["max_s"] > 1.0 and "collect_trajectory" in loop["last"]
    assert "event loop was blocked 1 time" in stats["waiting_on"]
    assert not any(t.name.startswith("loop-watchdog") for t in threading.enumerate())  # stopped on close


@pytest.mark.asyncio
async def test_a_busy_but_unblocked_loop_is_not_reported(caplog):
    caplog.set_level(logging.WARNING, logger="arl.rollout")
    dog = LoopWatchdog(threshold_s=1.0, label="rollout0")
    dog.start()
    try:
        for _ in range(40):  # short steps, the loop runs between them
            time.sleep(0.02)
            await asyncio.sleep(0.03)
    finally:
        dog.close()
    assert dog.stats()["blocks"] == 0 and not [r for r in caplog.records if BLOCKED in r.getMessage()]


def test_the_watchdog_refuses_a_nonpositive_threshold():
    with pytest.raises(ValueError, match="threshold_s"):
        LoopWatchdog(threshold_s=0)


@pytest.mark.asyncio
async def test_the_controller_says_a_silent_worker_had_its_loop_blocked(tmp_path):
    log = tmp_path / "rollout0.log"
    log.write_text(f"x\n2024 WARNING arl.rollout: rollout0: {BLOCKED} for 1.2s (threshold 1s) running agent 'a', "
                   "at agent.py:3 in run; likely a synchronous call\n  File \"agent.py\", line 3\n")
    faults = []
    sup = types.SimpleNamespace(process_of=lambda role, index: f"{role}{index}", heartbeat_timeouts={"rollout": 120})
    launcher = types.SimpleNamespace(alive=lambda name: False, log_path=lambda name: str(log))
    reporter = types.SimpleNamespace(fault=lambda kind, **kw: faults.append((kind, kw)))
    why = await investigate_silence(("rollout", 0), 130.0, sup=sup, launcher=launcher,
                                    role_stats={("rollout", 0): {"waiting_on": "1 groups running"}}, reporter=reporter,
                                    stack_dump_wait=0.1)
    assert f"{BLOCKED} for 1.2s" in why and "agent.py:3 in run" in why, why
    assert faults[0][1]["loop_blocked"].startswith(BLOCKED)
    with log.open("a") as f:  # the loop ran again afterwards: the silence is something else
        f.write(f"2024 WARNING arl.rollout: rollout0: {RESUMED} after 1.3s\n")
    assert blocked_loop_note(str(log)) == ""
    why = await investigate_silence(("rollout", 0), 130.0, sup=sup, launcher=launcher, role_stats={},
                                    reporter=reporter, stack_dump_wait=0.1)
    assert BLOCKED not in why


async def sync_client_agent(base_url: str, api_key: str, prompt: dict) -> float:
    """The mistake the watchdog is for: the synchronous SDK client, calling the endpoint its own loop serves."""
    import openai

    with openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=1.5) as c:
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt["prompt"]}])
    return 1.0


@pytest.mark.asyncio
async def test_a_synchronous_openai_client_in_an_agent_function_is_named(caplog):
    """It waits for an answer the blocked loop cannot give until its own timeout; the watchdog says where."""
    import openai

    from arl.api import GenerationConfig
    from arl.models.tiny import build_char_tokenizer
    from arl.rollout.endpoint import EndpointServer
    from arl.rollout.openai_agent import EndpointAgent
    from arl.rollout.worker import run_agent

    caplog.set_level(logging.WARNING, logger="arl.rollout")
    tok = build_char_tokenizer()
    server = EndpointServer(tok, GenerationConfig(max_new_tokens=4, stop_token_ids=[tok.eos_token_id]), 256)
    dog = LoopWatchdog(threshold_s=0.5, label="rollout3", agent="'sync' (test.sync_client_agent)")
    dog.start()
    try:
        with pytest.raises(openai.APITimeoutError):
            await run_agent(EndpointAgent(sync_client_agent, server), {"id": "p", "prompt": "1+1="}, None,
                            FakeClient(), timeout=20.0)
    finally:
        dog.close()
        await server.close()
    (w,) = [r.getMessage() for r in caplog.records if BLOCKED in r.getMessage()]
    assert "rollout3" in w and "'sync' (test.sync_client_agent)" in w and "in sync_client_agent" in w, w
    assert "c.chat.completions.create" in w  # the agent's own line, in the blocked stack
