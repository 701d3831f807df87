"""`python -m arl.ctl`: its arguments, and the clear errors when there is no run to talk to."""

from __future__ import annotations

import json
import os

import pytest

from arl import ctl


def test_parse_changes():
    assert ctl.parse_changes(["inference=+2"]) == {"inference": 2}
    assert ctl.parse_changes(["inference=-1", "inference=+3"]) == {"inference": 2}
    for bad in ("inference", "inference=two", "=+1", "inference=0", "inference=+"):
        with pytest.raises(ValueError, match="ROLE=\\+N"):
            ctl.parse_changes([bad])


def test_no_run_to_talk_to(tmp_path, capsys):
    assert ctl.main([str(tmp_path / "nope"), "scale", "inference=+1"]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert ctl.main([str(tmp_path), "scale", "inference=+1"]) == 2
    assert "no control.json" in capsys.readouterr().err
    assert ctl.main([str(tmp_path), "scale", "inference=x"]) == 2
    assert "ROLE=+N" in capsys.readouterr().err
    info = {"controller": "tcp://127.0.0.1:9", "key": "k", "signed": True, "pid": os.getpid()}
    (tmp_path / "control.json").write_text(json.dumps(info))
    env = os.environ.pop("ARL_SECRET", None)
    try:
        assert ctl.main([str(tmp_path), "scale", "inference=+1"]) == 2
        assert "ARL_SECRET" in capsys.readouterr().err  # the run signs its frames: no secret, no try
    finally:
        if env is not None:
            os.environ["ARL_SECRET"] = env
    (tmp_path / "control.json").write_text(json.dumps({**info, "signed": False, "pid": 2 ** 22 + 12345}))
    assert ctl.main([str(tmp_path), "scale", "inference=+1"]) == 2
    assert "not running" in capsys.readouterr().err  # its controller's process is gone
    (tmp_path / "control.json").write_text(json.dumps({**info, "signed": False}))
    assert ctl.main([str(tmp_path), "scale", "inference=+1", "--timeout", "0.5"]) == 2  # nothing listens there
    assert "no answer" in capsys.readouterr().err


def test_a_run_that_ends_while_it_answers_is_told_not_waited_out(tmp_path, capsys):
    import subprocess
    import sys

    import threading

    short = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])  # the controller, then gone
    threading.Thread(target=short.wait, daemon=True).start()  # reaped when it exits (no zombie keeps its pid)
    try:
        info = {"controller": "tcp://127.0.0.1:9", "key": "k", "signed": False, "pid": short.pid}
        (tmp_path / "control.json").write_text(json.dumps(info))
        assert ctl.main([str(tmp_path), "scale", "inference=+1", "--timeout", "120"]) == 2
        assert "ended (its controller" in capsys.readouterr().err
    finally:
        short.wait()
