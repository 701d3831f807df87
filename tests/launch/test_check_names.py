"""Names a run refers to are checked before any process starts: here the tool-call parser."""

import pytest

from arl.builtin import load_builtins
from arl.config import ExperimentConfig
from arl.launch.run import check_names
from arl.models.tiny import build_char_tokenizer
from arl.rollout.entry import tool_parser
from arl.utils.errors import ConfigError


def test_an_unknown_tool_parser_is_refused_naming_the_registered_ones():
    load_builtins()
    cfg = ExperimentConfig()
    cfg.rollout.tool_parser = "xml"
    with pytest.raises(ConfigError, match=r"rollout.tool_parser: unknown tool-call parser 'xml'.*'llama3_json'"):
        check_names(cfg)
    cfg.rollout.tool_parser = "mistral"
    check_names(cfg)


def test_auto_reads_the_chat_template():
    tok = build_char_tokenizer()
    assert tool_parser("auto", tok) == "hermes" and tool_parser("mistral", tok) == "mistral"
    tok.chat_template = "{{ '[TOOL_CALLS]' }}"
    assert tool_parser("auto", tok) == "mistral"


def test_the_task_api_key_may_not_be_the_run_secret():
    load_builtins()
    cfg = ExperimentConfig()
    cfg.secret = cfg.rollout.task_api_key = "same-secret-of-enough-length-1234"
    with pytest.raises(ConfigError, match="task_api_key must not be the run's secret"):
        check_names(cfg)
