"""A fixed `rollout.endpoint_port` with several rollout workers: worker i listens on endpoint_port + i (one port
for all would fail every group of the second worker with OSError), and a port range past 65535 is refused when the
config is read."""

from __future__ import annotations

import socket

import pytest

from arl.builtin import load_builtins
from arl.config import ConfigError, ExperimentConfig, parse_overrides
from arl.models.tiny import build_char_tokenizer
from arl.rollout.entry import agent_parts


def free_port_pair() -> int:
    """A port p with p and p + 1 free just now."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            if p >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", p + 1))
                except OSError:
                    continue
            return p
    raise AssertionError("no free port pair")


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_each_rollout_worker_offsets_a_fixed_endpoint_port(tmp_path):
    import experiments.openai_math  # noqa: F401 - registers the openai-math agent function

    load_builtins()
    build_char_tokenizer().save_pretrained(str(tmp_path))
    port = free_port_pair()
    cfg = ExperimentConfig()
    cfg.model.path = str(tmp_path)
    cfg.agent.name = "openai-math"
    cfg.rollout.num_workers, cfg.rollout.endpoint_port = 2, port
    servers = [agent_parts(cfg, index=i).endpoint for i in range(2)]
    try:
        for s in servers:
            await s.start()  # the second one bound the first one's port before the offset: OSError
        assert [s.port for s in servers] == [port, port + 1]
        assert all(s.vocab_size == len(s.tokenizer) for s in servers)
    finally:
        for s in servers:
            await s.close()
    cfg.rollout.endpoint_port = 0  # a free port each: nothing to offset
    assert agent_parts(cfg, index=1).endpoint.port == 0


def test_an_endpoint_port_range_past_65535_is_refused_naming_both_keys():
    with pytest.raises(ConfigError, match=r"rollout\.endpoint_port.*rollout\.num_workers"):
        parse_overrides(ExperimentConfig, ["rollout.endpoint_port=65535", "rollout.num_workers=2"])
    with pytest.raises(ConfigError, match=r"rollout\.endpoint_port"):
        parse_overrides(ExperimentConfig, ["rollout.endpoint_port=-1"])
    cfg = parse_overrides(ExperimentConfig, ["rollout.endpoint_port=65534", "rollout.num_workers=2"])
    assert cfg.rollout.endpoint_port == 65534
