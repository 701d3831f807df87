"""Stack dumps on request: a role stuck in a loop that never yields, or stopped, still shows where it is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from arl.utils.forensics import process_state, request_stack_dump

CHILD = textwrap.dedent('''
    import time
    from arl.utils.forensics import install_stack_dump_handler
    install_stack_dump_handler()
    print("ready", flush=True)

    def spin_forever():
        while True:
            time.sleep(0.01)

    spin_forever()
''')


def _start(tmp_path):
    log = tmp_path / "child.log"
    f = open(log, "wb")
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdout=f, stderr=subprocess.STDOUT)
    f.close()
    deadline = time.monotonic() + 60
    while b"ready" not in log.read_bytes():
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.05)
    return p, str(log)


def test_dump_of_a_busy_process(tmp_path):
    p, log = _start(tmp_path)
    try:
        state, dump = request_stack_dump(p.pid, log, wait=20.0)
        assert "most recent call first" in dump and "spin_forever" in dump
        assert p.poll() is None  # dumping does not stop it
    finally:
        p.kill()
        p.wait()


def test_dump_of_a_stopped_process(tmp_path):
    p, log = _start(tmp_path)
    try:
        os.kill(p.pid, signal.SIGSTOP)
        for _ in range(100):
            if process_state(p.pid) == "T":
                break
            time.sleep(0.02)
        state, dump = request_stack_dump(p.pid, log, wait=20.0)
        assert state == "T" and "spin_forever" in dump  # resumed just long enough to write it
    finally:
        p.kill()
        p.wait()


def test_dump_of_a_dead_process_returns_nothing(tmp_path):
    p, log = _start(tmp_path)
    p.kill()
    p.wait()
    assert request_stack_dump(p.pid, log, wait=0.5)[1] == ""
