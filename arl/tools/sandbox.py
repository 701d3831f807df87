"""Run untrusted Python (model output) in a sandboxed subprocess; the worker process never evaluates it.

    sb = PythonSandbox(timeout=5.0, memory_mb=256)
    r = await sb.run("print(6 * 7)")      # SandboxResult(stdout="42\\n", exit_code=0, timed_out=False, ...)

Layers, strongest first (what is used depends on the machine; `sandbox_capabilities()` reports it):

1. Linux namespaces via `unshare` (when it works here): a new network namespace (no interfaces but a down
   loopback: every connect fails) and a new PID namespace (when its first process dies, the kernel kills every
   process in it, so nothing escapes the kill on timeout).
2. Privileges: when the worker runs as root, the code runs as `nobody` (uid/gid 65534) in its own temp dir (owned
   by nobody): it cannot write anywhere root owns, nor read root-only files.
3. Resource limits (setrlimit, before the code runs): CPU seconds (SIGXCPU then SIGKILL), address space (a 10 GB
   allocation raises MemoryError), file size, open files, and RLIMIT_NPROC = 0 (no new processes or threads;
   not enforced for root, hence layer 2).
4. A Python audit hook (defence in depth, Python level only): refuses fork/exec/subprocess/os.system, socket
   creation and connects, ctypes, writing or renaming files outside the temp dir, reading or listing files
   outside the temp dir and the standard library, and the usual ways of reaching the hook (gc.get_objects,
   replacing __code__).
5. From outside: a wall-clock timeout kills the whole process group (SIGKILL); stdout+stderr are read up to
   `max_output_bytes` and the process is killed as soon as it writes more; the temp dir is removed afterwards.

Honest limits: without `unshare` the network and process isolation rest on the audit hook and RLIMIT_NPROC,
which native code could bypass if it could be loaded (ctypes is refused, the interpreter runs with -I -S, so
site-packages are not importable by default); without root there is no uid drop, so files the worker's user can
write outside /tmp are protected only by the audit hook. Reads outside the temp dir are refused by the audit
hook (Python level); native code could bypass it, as above.
For hostile workloads run the rollout worker itself in a container (gVisor, nsjail, bubblewrap).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

from arl.tools.base import Tool

logger = logging.getLogger(__name__)

__all__ = ["PythonSandbox", "SandboxResult", "PythonTool", "sandbox_capabilities"]

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_runner.py")
NOBODY = 65534
PRELOAD = ("math", "cmath", "fractions", "decimal", "statistics", "itertools", "functools", "collections",
           "heapq", "bisect", "random", "re", "string", "json", "datetime", "operator", "copy", "textwrap",
           "typing", "dataclasses", "enum", "linecache", "tokenize")


@dataclasses.dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: Optional[int]
    timed_out: bool = False
    output_truncated: bool = False
    seconds: float = 0.0
    killed_reason: str = ""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def observation(self, max_chars: int = 1024) -> str:
        """What the model sees: stdout, then the last lines of stderr (the error), then why it stopped."""
        parts = []
        if self.stdout:
            parts.append(self.stdout.rstrip("\n"))
        if self.stderr.strip():
            parts.append("\n".join(self.stderr.strip().splitlines()[-4:]))
        if self.output_truncated:
            parts.append("[output truncated]")
        if self.timed_out:
            parts.append(f"Error: {self.killed_reason or 'timed out'}")
        elif self.exit_code not in (0, None) and self.exit_code < 0:
            parts.append(f"Error: killed ({self.killed_reason or signal.Signals(-self.exit_code).name})")
        text = "\n".join(parts) if parts else "(no output)"
        return text if len(text) <= max_chars else text[: max_chars - 20] + "\n[output truncated]"


@functools.lru_cache(maxsize=1)
def sandbox_capabilities() -> dict:
    """What this machine allows (probed once): namespaces via unshare, dropping root to nobody."""
    caps = {"unshare": None, "drop_root": os.geteuid() == 0, "platform": sys.platform}
    exe = shutil.which("unshare")
    if exe and sys.platform.startswith("linux"):
        for extra in ([], ["--map-root-user"]):
            cmd = [exe, "--net", "--pid", "--fork", "--kill-child", *extra, "true"]
            try:
                ok = subprocess.run(cmd, capture_output=True, timeout=10).returncode == 0
            except (OSError, subprocess.SubprocessError):
                ok = False
            if ok:
                caps["unshare"] = cmd[:-1]
                break
    if caps["drop_root"] and caps["unshare"] and "--map-root-user" in caps["unshare"]:
        caps["drop_root"] = False
    return caps


class PythonSandbox:
    """Runs one snippet per call in a fresh subprocess and temp dir. See the module docstring for the layers."""

    def __init__(
        self,
        timeout: float = 5.0,
        cpu_seconds: Optional[int] = None,
        memory_mb: int = 256,
        max_output_bytes: int = 4096,
        file_size_mb: int = 4,
        max_open_files: int = 32,
        use_namespaces: bool = True,
        drop_privileges: bool = True,
        python: str = sys.executable,
        site_packages: bool = False,
        preload: tuple[str, ...] = PRELOAD,
        tmp_root: Optional[str] = None,
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0, got {timeout!r}")
        self.timeout = float(timeout)
        self.cpu_seconds = int(cpu_seconds or max(1, math.ceil(timeout)))
        self.memory_bytes = int(memory_mb) << 20
        self.max_output_bytes = int(max_output_bytes)
        self.file_size_bytes = int(file_size_mb) << 20
        self.max_open_files = int(max_open_files)
        self.python = python
        self.site_packages = site_packages
        self.preload = tuple(preload)
        self.tmp_root = tmp_root
        caps = sandbox_capabilities()
        self.prefix: list[str] = list(caps["unshare"]) if (use_namespaces and caps["unshare"]) else []
        self.drop_uid: Optional[int] = NOBODY if (drop_privileges and caps["drop_root"]) else None

    @property
    def layers(self) -> list[str]:
        out = []
        if self.prefix:
            out.append("namespaces(net,pid)")
        if self.drop_uid is not None:
            out.append("uid nobody")
        return out + ["rlimits", "audit hook", "wall-clock kill"]

    def _command(self, workdir: str) -> list[str]:
        cfg = {"cpu_seconds": self.cpu_seconds, "memory_bytes": self.memory_bytes,
               "file_size_bytes": self.file_size_bytes, "max_open_files": self.max_open_files, "max_processes": 0,
               "preload": list(self.preload)}
        if self.drop_uid is not None:
            cfg.update(drop_to_uid=self.drop_uid, drop_to_gid=self.drop_uid)
        flags = ["-I"] + ([] if self.site_packages else ["-S"])
        return [*self.prefix, self.python, *flags, RUNNER, workdir, json.dumps(cfg)]

    async def run(self, code: str, stdin: str = "") -> SandboxResult:
        """Run `code`; never raises for anything the code does (a failure to start the process raises OSError)."""
        if not isinstance(code, str):
            raise TypeError(f"code must be a string, got {type(code).__name__}")
        t0 = time.monotonic()
        workdir = tempfile.mkdtemp(prefix="arl-sandbox-", dir=self.tmp_root)
        try:
            with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
                f.write(code)
            if self.drop_uid is not None:
                os.chown(workdir, self.drop_uid, self.drop_uid)
                os.chmod(workdir, 0o700)
            return await self._run_in(workdir, stdin, t0)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    async def _run_in(self, workdir: str, stdin: str, t0: float) -> SandboxResult:
        proc = await asyncio.create_subprocess_exec(
            *self._command(workdir),
            stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=workdir,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"},
            start_new_session=True,  # its own process group: one killpg reaches everything it started
        )
        budget = [self.max_output_bytes]
        truncated = asyncio.Event()
        bufs: dict[str, bytearray] = {"out": bytearray(), "err": bytearray()}

        async def pump(stream: asyncio.StreamReader, key: str) -> None:
            while True:
                chunk = await stream.read(4096)
                if not chunk:
                    return
                take = chunk[: max(0, budget[0])]
                bufs[key] += take
                budget[0] -= len(chunk)
                if budget[0] < 0:
                    # keep draining (and dropping) to EOF: a reader that stops pauses the pipe, and asyncio's
                    # proc.wait() then waits for an EOF that never comes (seen: 5 s stalls on a loaded machine)
                    truncated.set()

        async def feed() -> None:
            if stdin and proc.stdin is not None:
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    proc.stdin.write(stdin.encode()[: 1 << 20])
                    await proc.stdin.drain()
                    proc.stdin.close()

        assert proc.stdout is not None and proc.stderr is not None
        pumps = asyncio.gather(pump(proc.stdout, "out"), pump(proc.stderr, "err"), feed())
        timed_out, reason = False, ""
        trunc_wait = asyncio.ensure_future(truncated.wait())
        try:
            done, _ = await asyncio.wait({pumps, trunc_wait}, timeout=self.timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
            if trunc_wait in done:
                reason = "output limit"
            elif not done:
                timed_out, reason = True, f"timed out after {self.timeout:g}s"
            if reason:
                self._kill(proc)
            try:
                await asyncio.wait_for(proc.wait(), 5.0)
            except asyncio.TimeoutError:
                self._kill(proc)
                await asyncio.wait_for(proc.wait(), 5.0)
        finally:
            self._kill(proc)  # anything left in its group (no-op when it exited)
            trunc_wait.cancel()
            pumps.cancel()
            await asyncio.gather(pumps, trunc_wait, return_exceptions=True)
        code = proc.returncode
        if not reason and code is not None and code < 0:
            sig = -code
            reason = {signal.SIGXCPU: f"CPU time limit ({self.cpu_seconds}s)",
                      signal.SIGKILL: "killed (CPU or memory limit)"}.get(sig, "")
            if not reason:
                try:
                    reason = f"signal {signal.Signals(sig).name}"
                except ValueError:
                    reason = f"signal {sig}"
        return SandboxResult(stdout=bufs["out"].decode("utf-8", errors="replace"),
                             stderr=bufs["err"].decode("utf-8", errors="replace"), exit_code=code, timed_out=timed_out,
                             output_truncated=truncated.is_set(), seconds=time.monotonic() - t0, killed_reason=reason)

    @staticmethod
    def _kill(proc: asyncio.subprocess.Process) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


class PythonTool(Tool):
    """`python(code)`: runs the code in a `PythonSandbox` and returns what it printed (or its error)."""

    name = "python"
    description = ("Run a short Python 3 program in a sandbox (no network, no files outside its own folder, "
                   "limited time and memory) and return what it prints. Use print() to see results.")
    parameters = {"type": "object",
                  "properties": {"code": {"type": "string", "description": "The Python source to run."}},
                  "required": ["code"]}

    def __init__(self, timeout: float = 5.0, memory_mb: int = 256, max_output_chars: int = 1024,
                 name: str = "python", **sandbox_kwargs: object) -> None:
        self.name = name
        self.timeout = float(timeout) + 5.0  # the sandbox enforces `timeout`; this only guards process start-up
        self.max_output_chars = max_output_chars
        self.sandbox = PythonSandbox(timeout=timeout, memory_mb=memory_mb,
                                     max_output_bytes=max_output_chars * 4, **sandbox_kwargs)  # type: ignore[arg-type]

    async def run(self, code: str) -> str:  # type: ignore[override]
        from arl.tools.base import ToolResult

        r = await self.sandbox.run(code)
        return ToolResult(self.name, r.observation(self.max_output_chars), error=not r.ok)  # type: ignore[return-value]
