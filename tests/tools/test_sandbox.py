"""The Python sandbox: hostile snippets fail safely and quickly; nothing runs in the test process.

Each case is checked with every isolation layer this machine offers, and again with only the portable ones
(rlimits + audit hook + kill), so a machine without unshare/root is covered too.
"""

import asyncio
import os
import time

import pytest

from arl.tools import PythonTool, ToolCall, ToolSet
from arl.tools.sandbox import PythonSandbox, sandbox_capabilities

LAYERS = {"full": {}, "portable": {"use_namespaces": False, "drop_privileges": False}}
TIMEOUT = 2.0


@pytest.fixture(params=sorted(LAYERS))
def sandbox(request, tmp_path):
    return PythonSandbox(timeout=TIMEOUT, memory_mb=256, max_output_bytes=2048, tmp_root=str(tmp_path),
                         **LAYERS[request.param])


def run(sb, code):
    t0 = time.monotonic()
    r = asyncio.run(sb.run(code))
    return r, time.monotonic() - t0


def test_ordinary_code_runs_and_can_use_its_own_dir(sandbox):
    r, _ = run(sandbox, "import math\nopen('f.txt', 'w').write('hi')\nprint(open('f.txt').read(), math.factorial(5))")
    assert r.ok and r.stdout == "hi 120\n", r
    r, _ = run(sandbox, "raise ValueError('boom')")
    assert r.exit_code == 1 and "ValueError: boom" in r.observation() and "_sandbox_runner" not in r.stderr


def test_fork_bomb_fails_fast(sandbox):
    for code in ["import os\nwhile True:\n    os.fork()",
                 "import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])",
                 "import os\nos.system(':(){ :|:& };:')"]:
        r, secs = run(sandbox, code)
        assert not r.ok and not r.timed_out and secs < TIMEOUT, (code, r)


def test_infinite_loop_is_killed_at_the_timeout(sandbox):
    r, secs = run(sandbox, "while True:\n    pass")
    assert not r.ok and (r.timed_out or r.exit_code < 0) and secs < TIMEOUT + 3
    assert "timed out" in r.observation() or "CPU" in r.observation()


def test_ten_gigabytes_are_refused(sandbox):
    r, secs = run(sandbox, "x = bytearray(10 * 1024**3)\nprint(len(x))")
    assert not r.ok and "MemoryError" in r.stderr and secs < TIMEOUT


def test_network_connect_fails(sandbox):
    r, secs = run(sandbox, "import socket\ns = socket.create_connection(('1.1.1.1', 80), timeout=1)\nprint('ok')")
    assert not r.ok and "ok" not in r.stdout and secs < TIMEOUT
    r, _ = run(sandbox, "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:1')\nprint('ok')")
    assert not r.ok and "ok" not in r.stdout


def test_writes_outside_its_dir_fail(sandbox, tmp_path):
    target = tmp_path / "outside.txt"
    for code in [f"open({str(target)!r}, 'w').write('x')",
                 f"import os\nos.rename('main.py', {str(target)!r})",
                 f"import shutil\nshutil.copyfile('main.py', {str(target)!r})",
                 "open('../escape.txt', 'w').write('x')"]:
        r, secs = run(sandbox, code)
        assert not r.ok and secs < TIMEOUT, (code, r)
    assert not target.exists() and not (tmp_path / "escape.txt").exists()


def test_reads_outside_its_dir_fail(sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the key")
    secret.chmod(0o644)  # world-readable: file permissions alone would let `nobody` read it
    for code in [f"print(open({str(secret)!r}).read())", "print(open('/etc/passwd').read())",
                 f"import os\nprint(os.listdir({str(tmp_path)!r}))", "print(open('../secret.txt').read())"]:
        r, secs = run(sandbox, code)
        assert not r.ok and "the key" not in r.stdout and "root:" not in r.stdout and secs < TIMEOUT, (code, r)
    r, _ = run(sandbox, "import json, statistics\nopen('own.txt', 'w').write('7')\n"
                        "print(open('own.txt').read(), statistics.mean([1, 2]))")
    assert r.ok and r.stdout.split() == ["7", "1.5"], r  # its own files and the standard library stay readable


def test_output_is_truncated_and_the_process_stopped(sandbox):
    r, secs = run(sandbox, "while True:\n    print('x' * 100)")
    assert r.output_truncated and len(r.stdout) <= 2048 and secs < TIMEOUT
    assert r.observation(200).endswith("[output truncated]")


def test_temp_dir_is_removed(tmp_path):
    sb = PythonSandbox(timeout=TIMEOUT, tmp_root=str(tmp_path))
    r, _ = run(sb, "print(__import__('os').getcwd())")
    assert r.ok and not os.path.exists(r.stdout.strip()) and os.listdir(tmp_path) == []


def test_python_tool_reports_errors_as_observations():
    ts = ToolSet([PythonTool(timeout=TIMEOUT)])
    ok, bad = asyncio.run(ts.call_all([ToolCall("python", {"code": "print(6 * 7)"}),
                                       ToolCall("python", {"code": "1/0"})]))
    assert (ok.content, ok.error) == ("42", False)
    assert bad.error and "ZeroDivisionError" in bad.content


def test_capabilities_are_reported():
    caps = sandbox_capabilities()
    assert set(caps) >= {"unshare", "drop_root"}
    assert "rlimits" in PythonSandbox().layers
