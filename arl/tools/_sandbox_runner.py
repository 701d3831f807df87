"""Runs inside the sandbox subprocess (never imported by a worker): `python -I -S _sandbox_runner.py WORKDIR CONFIG`.

Order matters: set resource limits, import the allowed modules, drop privileges (when started as root), install
the audit hook, then exec the untrusted code from WORKDIR/main.py. Self-contained (stdlib only).
"""

import json
import os
import resource
import sys


def _limits(cfg):
    def setl(which, value):
        if value is None:
            return
        try:
            resource.setrlimit(which, (value, value))
        except (ValueError, OSError) as e:
            sys.stderr.write(f"sandbox: could not set limit {which}: {e}\n")

    cpu = cfg.get("cpu_seconds")
    if cpu:
        try:  # soft limit -> SIGXCPU, hard limit one second later -> SIGKILL
            resource.setrlimit(resource.RLIMIT_CPU, (int(cpu), int(cpu) + 1))
        except (ValueError, OSError) as e:
            sys.stderr.write(f"sandbox: could not set the CPU limit: {e}\n")
    setl(resource.RLIMIT_AS, cfg.get("memory_bytes"))
    setl(resource.RLIMIT_FSIZE, cfg.get("file_size_bytes"))
    setl(resource.RLIMIT_NOFILE, cfg.get("max_open_files"))
    setl(resource.RLIMIT_NPROC, cfg.get("max_processes"))
    setl(resource.RLIMIT_CORE, 0)


BLOCKED_EVENTS = {
    # new processes
    "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.startfile",
    "subprocess.Popen", "pty.spawn", "os.kill", "os.killpg",
    # network
    "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.gethostbyname",
    "socket.gethostbyaddr", "socket.sendto", "socket.sendmsg",
    # native code and ways to reach the audit hook
    "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function", "ctypes.addressof",
    "gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames", "sys.setprofile",
    "sys.settrace",
}
PATH_EVENTS = {"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.symlink", "os.link", "os.chmod", "os.chown",
               "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move", "os.chdir"}
BLOCKED_IMPORTS = {"ctypes", "_ctypes", "_posixsubprocess", "socket", "_socket", "multiprocessing", "mmap",
                   "_multiprocessing", "resource", "fcntl", "pty", "termios"}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _install_hook(workdir):
    root = os.path.realpath(workdir)
    allowed_files = {"/dev/null"}
    # reads: the working directory and the standard library (lazy imports); nothing else of the machine's files
    read_roots = (root, os.path.realpath(os.path.dirname(os.__file__)))
    state = {"busy": False}
    realpath, join, sep = os.path.realpath, os.path.join, os.sep

    def inside(path, roots=(root,)):
        if isinstance(path, int):
            return True  # an already open descriptor
        if isinstance(path, bytes):
            path = path.decode(errors="replace")
        state["busy"] = True  # realpath's own filesystem calls raise audit events: let them through
        try:
            full = realpath(join(root, str(path)))
        finally:
            state["busy"] = False
        return full in allowed_files or any(full == r or full.startswith(r + sep) for r in roots)

    def hook(event, args):
        if state["busy"]:
            return
        if event in BLOCKED_EVENTS:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args and str(args[0]).split(".")[0] in BLOCKED_IMPORTS:
            raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
        if event == "object.__setattr__" and len(args) > 1 and args[1] in ("__code__", "__globals__"):
            raise PermissionError("sandbox: replacing code objects is not allowed")
        if event == "open" and args:
            path, mode, flags = (list(args) + [None, None])[:3]
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & WRITE_FLAGS)
            if not (inside(path) if writes else inside(path, read_roots)):
                what = "writing" if writes else "reading"
                raise PermissionError(f"sandbox: {what} {path!r} outside the working directory is not allowed")
        elif event in ("os.listdir", "os.scandir") and args and args[0] is not None:
            if not inside(args[0], read_roots):
                raise PermissionError(f"sandbox: listing {args[0]!r} outside the working directory is not allowed")
        elif event in PATH_EVENTS and args:
            paths = [a for a in args if isinstance(a, (str, bytes, os.PathLike))]
            if not all(inside(os.fspath(p)) for p in paths):
                raise PermissionError(f"sandbox: {event} outside the working directory is not allowed")

    sys.addaudithook(hook)


def main():
    workdir, cfg = sys.argv[1], json.loads(sys.argv[2])
    _limits(cfg)
    os.chdir(workdir)
    import traceback  # before the audit hook: it reports the code's errors, when the stdlib is no longer readable
    for name in cfg.get("preload", []):
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - a missing optional module is not fatal
            pass
    with open(os.path.join(workdir, "main.py"), encoding="utf-8") as f:
        source = f.read()
    uid = cfg.get("drop_to_uid")
    if uid is not None:
        gid = cfg.get("drop_to_gid", uid)
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        if os.geteuid() != uid:
            sys.stderr.write("sandbox: could not drop privileges\n")
            sys.exit(97)
    os.environ.clear()
    os.environ.update({"HOME": workdir, "TMPDIR": workdir, "PATH": ""})
    for name in ("resource", "fcntl", "json"):  # modules the runner used; the code may not reach them by import
        if name not in cfg.get("preload", []):  # (unless preloaded for it: json is)
            sys.modules.pop(name, None)
    _install_hook(workdir)
    glb = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        code = compile(source, "main.py", "exec")
        del source
        exec(code, glb)  # noqa: S102 - this process is the sandbox
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - report it like the interpreter, without the runner's frames
        te = traceback.TracebackException(type(e), e, e.__traceback__)
        te.stack = traceback.StackSummary.from_list([f for f in te.stack if f.filename == "main.py"][-8:])
        sys.stderr.write("".join(te.format()))
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
