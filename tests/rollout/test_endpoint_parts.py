"""How a rollout worker builds its agents: a registered async function gets the endpoint, an Agent class does not,
and the default run imports neither `openai` nor the endpoint."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHECK = textwrap.dedent('''
    import sys
    from arl.builtin import load_builtins
    from arl.config import ExperimentConfig
    from arl.models.tiny import build_char_tokenizer
    from arl.rollout.entry import agent_parts
    import experiments.async_ppo_math, experiments.openai_math  # the CLI imports every built-in experiment

    load_builtins()
    build_char_tokenizer().save_pretrained(sys.argv[1])
    cfg = ExperimentConfig()
    cfg.model.path = sys.argv[1]
    parts = agent_parts(cfg)
    assert parts.endpoint is None
    parts.make_agent(), parts.make_eval_agent()
    leaked = [m for m in ("openai", "arl.rollout.endpoint", "arl.rollout.openai_agent") if m in sys.modules]
    assert not leaked, leaked
    cfg.agent.name, cfg.agent.args = "openai-math", {"filter_uniform_groups": True}
    parts = agent_parts(cfg)
    agent = parts.make_agent()
    assert parts.endpoint is not None and agent.server is parts.endpoint and agent.group_size == 8
    assert agent.filter_uniform_groups and parts.make_eval_agent().greedy
    assert parts.endpoint.host == "127.0.0.1" and not hasattr(parts.endpoint, "secret")
    assert "openai" not in sys.modules  # imported when a session's client is first made
    cfg.agent.name, cfg.agent.args = "external", {}
    parts = agent_parts(cfg)
    assert type(parts.make_agent()).__name__ == "ExternalAgent" and parts.make_eval_agent().greedy
    assert parts.endpoint.task_key == cfg.rollout.task_api_key and parts.endpoint.slots.limit == 0
    # an agent naming `held_out` gets the held-out rows (a proposer must never write one), others do not
    cfg.agent.name, cfg.agent.args = "proposer-solver", {}
    parts = agent_parts(cfg)
    want = {r["id"] for r in parts.test_rows}
    assert len(want) == 200 and parts.make_agent().held_out == want == parts.make_eval_agent().held_out
    print("ok")
''')


def test_function_agents_get_the_endpoint_and_the_default_run_imports_none_of_it(tmp_path):
    out = subprocess.run([sys.executable, "-c", CHECK, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_the_openai_experiments_load_and_validate():
    import inspect

    from arl.agents.math_multi_turn import MathMultiTurnAgent
    from arl.api.registry import AGENTS
    from arl.cli import load_config
    from experiments import MODULES

    default = load_config([], MODULES)
    assert default.agent.name == "math-multi-turn" and "num_turns" not in default.agent.args
    default_turns = inspect.signature(MathMultiTurnAgent).parameters["num_turns"].default
    for name, agent, steps, module in [("openai-math", "openai-math", 500, "openai_math"),
                                       ("openai-tool-calc", "openai-tool-calc", 30, "openai_tool_calc"),
                                       ("openai-framework", "openai-framework", 20, "openai_framework"),
                                       ("responses-framework", "openai-framework", 20, "openai_framework"),
                                       ("anthropic-math", "anthropic-math", 500, "anthropic_math")]:
        cfg = load_config([f"experiment={name}"], MODULES)
        assert cfg.agent.name == agent and cfg.total_train_steps == steps and cfg.rollout.endpoint_port == 0
        assert cfg.imports[0] == "experiments." + module
        if name.endswith("-math"):  # the default run through an SDK: the same prompts, chains and turns a step
            assert (cfg.agent.group_size, cfg.learner.batch_size) == (default.agent.group_size,
                                                                      default.learner.batch_size) == (4, 32)
            fn = AGENTS.get(agent)  # the SDK agent function answers as often as the default's agent
            assert inspect.signature(fn).parameters["num_turns"].default == default_turns == 2
