import pytest

from arl.config import ConfigError, ExperimentConfig, format_help, parse_overrides, resolve_threads, rollout_deadlines


def test_overrides_merge_nested_and_dict_args():
    c = parse_overrides(ExperimentConfig, ["learner.optimizer.lr=3e-4", "agent.args.num_turns=2", "imports=[a,b]"])
    assert c.learner.optimizer.lr == 3e-4 and c.agent.args == {"num_turns": 2} and c.imports == ["a", "b"]


def test_unknown_key_names_key_and_close_matches():
    with pytest.raises(ConfigError, match=r"unknown config key 'learner.lrr'.*learner.optimizer.lr"):
        parse_overrides(ExperimentConfig, ["learner.lrr=1"])
    with pytest.raises(ConfigError, match=r"'bogus.key'"):
        parse_overrides(ExperimentConfig, ["bogus.key=1"])


def test_wrong_type_names_key_and_type():
    with pytest.raises(ConfigError, match=r"'learner.batch_size': expected int"):
        parse_overrides(ExperimentConfig, ["learner.batch_size=many"])


def test_cross_field_validation():
    with pytest.raises(ConfigError, match="max_head_offpolicyness"):
        parse_overrides(ExperimentConfig, ["max_head_offpolicyness=-1"])
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(ExperimentConfig, ["learner.optimizer.lr"])
    with pytest.raises(ConfigError, match="busy_poll_us"):
        parse_overrides(ExperimentConfig, ["busy_poll_us=-1"])
    assert parse_overrides(ExperimentConfig, ["busy_poll_us=300"]).busy_poll_us == 300
    with pytest.raises(ConfigError, match="learner.max_restarts must be >= 0"):
        parse_overrides(ExperimentConfig, ["learner.max_restarts=-1"])
    assert parse_overrides(ExperimentConfig, []).learner.max_restarts == 3
    with pytest.raises(ConfigError, match=r"ray.env_vars: names must be .*\['1A'\]"):
        parse_overrides(ExperimentConfig, ["ray.env_vars={1A: x}"])
    c = parse_overrides(ExperimentConfig, ["ray.env_vars={HF_HOME: /data/hf, PYTHONPATH: '/a:/b', N: 3}"])
    assert c.ray.env_vars == {"HF_HOME": "/data/hf", "PYTHONPATH": "/a:/b", "N": "3"}


def test_help_lists_every_field_with_default():
    text = format_help()
    for key in ("learner.optimizer.lr", "max_head_offpolicyness", "agent.name", "inference.max_batch_size"):
        assert key in text
    assert "1e-04" in text or "0.0001" in text


def test_threads_split_between_heavy_roles(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    c = ExperimentConfig()
    assert resolve_threads(c, "inference") == 1 and resolve_threads(c, "learner") == 1
    c.learner.threads = 2
    assert resolve_threads(c, "learner") == 2


def test_library_does_not_import_experiments_and_roles_import_the_chosen_one():
    """The built-in experiments come from the entry point; the chosen one's module joins `imports`, which is what
    every role process imports before it reads config.yaml with that experiment's class."""
    import subprocess
    import sys

    code = ("import sys, arl.cli, arl.launch.role, arl.launch.run; from arl.builtin import load_builtins; "
            "load_builtins(); print(sorted(m for m in sys.modules if m.split('.')[0] == 'experiments'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

    from arl.cli import load_config
    from experiments import MODULES

    cfg = load_config(["experiment=tool-calc", "imports=[arl.envs.sim_tool]"], MODULES)
    assert type(cfg).__name__ == "ToolCalcConfig" and cfg.imports == ["experiments.tool_calc", "arl.envs.sim_tool"]
    assert load_config(["imports=[experiments.async_ppo_math]"], MODULES).imports == ["experiments.async_ppo_math"]


def test_experiment_field_reaches_agent_args_by_interpolation():
    """README's recipe: a new experiment field passed to the agent as `args={"my_param": "${my_param}"}`; the
    command line's `my_param=5.0` arrives in agent.args (resolved, typed), the default when not given."""
    import dataclasses

    from arl.config import AgentConfig, field

    @dataclasses.dataclass
    class MyConfig(ExperimentConfig):
        my_param: float = field(1.0, "A new command-line argument.")
        agent: AgentConfig = field(factory=lambda: AgentConfig(name="math-multi-turn",
                                                               args={"my_param": "${my_param}", "num_turns": 2}))

    c = parse_overrides(MyConfig, ["my_param=5.0"])
    assert c.my_param == 5.0 and c.agent.args == {"my_param": 5.0, "num_turns": 2}
    assert isinstance(c.agent.args["my_param"], float)
    assert parse_overrides(MyConfig, []).agent.args["my_param"] == 1.0
    # an explicit agent.args override still wins over the interpolation
    assert parse_overrides(MyConfig, ["my_param=5", "agent.args.my_param=7"]).agent.args["my_param"] == 7


def test_auto_deadlines_follow_the_generation_budget():
    from arl.builtin import load_builtins

    load_builtins()
    cfg = parse_overrides(ExperimentConfig, ["gen.max_new_tokens=1000", "rollout.env_timeout=30",
                                             "agent.args={num_turns: 1}"])
    base, per_token, traj = rollout_deadlines(cfg)
    assert (base, per_token) == (60.0, 0.1) and traj == pytest.approx(2 * (60 + 100) + 2 * 30)
    cfg = parse_overrides(ExperimentConfig, ["gen.max_new_tokens=1000", "rollout.env_timeout=30",
                                             "agent.args={num_turns: 3}"])
    assert rollout_deadlines(cfg)[2] == pytest.approx(3 * 380)  # per turn


def test_auto_trajectory_deadline_counts_the_agents_default_turns():
    """The default math agent takes 2 turns unless agent.args says otherwise: its budget is two turns'."""
    from arl.builtin import load_builtins

    load_builtins()
    cfg = parse_overrides(ExperimentConfig, ["gen.max_new_tokens=1000", "rollout.env_timeout=30"])
    assert cfg.agent.name == "math-multi-turn" and "num_turns" not in cfg.agent.args
    assert rollout_deadlines(cfg)[2] == pytest.approx(2 * 380)
    tool = parse_overrides(ExperimentConfig, ["agent.name=tool-agent", "gen.max_new_tokens=1000",
                                              "rollout.env_timeout=30"])
    assert rollout_deadlines(tool)[2] == pytest.approx(4 * 380)  # the tool agent's max_turns default
    single = parse_overrides(ExperimentConfig, ["agent.name=math-single-step", "gen.max_new_tokens=1000",
                                                "rollout.env_timeout=30"])
    assert rollout_deadlines(single)[2] == pytest.approx(380)
    cfg = parse_overrides(ExperimentConfig, ["rollout.request_timeout=45", "rollout.trajectory_timeout=90"])
    assert rollout_deadlines(cfg) == (45.0, 0.0, 90.0)  # set by hand: fixed
    with pytest.raises(ConfigError, match="request_timeout"):
        parse_overrides(ExperimentConfig, ["rollout.request_timeout=-1"])


def test_unknown_backend_and_logger_names_list_the_registered_ones():
    """The names are checked against arl.api.registry (config imports no role for it); the messages are the
    registries' own."""
    for override, message in [
        ("inference.backend=bogus", "inference.backend: unknown inference backend 'bogus'; registered inference "
                                    "backends: ['sglang', 'sim', 'torch'] (register one with "
                                    "arl.inference.factory.BACKENDS.register(name, builder) in a module passed via "
                                    "imports=[...])"),
        ("learner.backend=bogus", "learner.backend: unknown learner_backend 'bogus'; registered learner_backends: "
                                  "['deepspeed', 'sim'] (register one with LEARNER_BACKENDS.register(name, obj) in a "
                                  "module passed via imports=[...])"),
        ("loggers=[jsonl,neptune]", "loggers: unknown logger 'neptune'; registered loggers: ['mlflow', 'tensorboard', "
                                    "'wandb'] (register one with TRACKERS.register(name, TrackerEntry(make, package)) "
                                    "in a module passed via imports=[...])"),
    ]:
        with pytest.raises(ConfigError) as e:
            parse_overrides(ExperimentConfig, [override])
        assert str(e.value) == message


def test_env_server_timeouts_that_contradict_the_rollout_deadlines_are_refused_naming_both_keys():
    """An env session idle past env.session_lease_s is closed: a turn that waits on a long generation (two attempts
    of the request deadline, 60 s + 0.1 s x gen.max_new_tokens each) must not find it gone. A server call timeout
    past rollout.env_timeout lets the rollout worker give up while the server keeps working."""
    from arl.builtin import load_builtins

    load_builtins()
    with pytest.raises(ConfigError) as e:  # 2 x (60 + 0.1 x 8192) = 1758 s > 600 s
        parse_overrides(ExperimentConfig, ["env.servers=1", "gen.max_new_tokens=8192"])
    msg = str(e.value)
    assert "env.session_lease_s=600" in msg and "gen.max_new_tokens=8192" in msg and "1758" in msg, msg
    assert "rollout.timeout_per_token_s" in msg, msg
    with pytest.raises(ConfigError, match=r"env.session_lease_s=100 .*rollout.request_timeout=60"):
        parse_overrides(ExperimentConfig, ["env.servers=1", "rollout.request_timeout=60", "env.session_lease_s=100"])
    ok = parse_overrides(ExperimentConfig, ["env.servers=1", "gen.max_new_tokens=8192", "env.session_lease_s=1800"])
    assert ok.env.session_lease_s == 1800
    # without env servers the lease is not used: no refusal
    assert parse_overrides(ExperimentConfig, ["gen.max_new_tokens=8192"]).env.servers == 0
    with pytest.raises(ConfigError, match=r"env.call_timeout=90 .*rollout.env_timeout=60"):
        parse_overrides(ExperimentConfig, ["env.servers=1", "env.call_timeout=90"])
    with pytest.raises(ConfigError, match=r"env.call_timeout=60 .*rollout.env_timeout=60"):
        parse_overrides(ExperimentConfig, ["env.servers=1", "env.call_timeout=60"])
    assert parse_overrides(ExperimentConfig, ["env.servers=1", "env.call_timeout=50"]).env.call_timeout == 50


def test_the_default_and_shipped_experiments_pass_the_timeout_checks():
    from arl.cli import load_config
    from experiments import MODULES

    names = ["async-ppo-math", "tool-calc", "gsm8k", "openai-math", "openai-tool-calc", "openai-framework"]
    for name in names:
        for extra in ([], ["env.servers=1"]):
            load_config([f"experiment={name}", *extra], MODULES)
    load_config([], MODULES)  # the default experiment
