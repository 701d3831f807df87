"""`python -m arl.ctl RUN_DIR scale inference=+2 rollout=+1` — change a running run's fleet (and say what happened).

The command talks to the run's controller over its control socket, showing the run's control key
(RUN_DIR/control.json, written by the controller, readable by its owner only) and, on a run that signs its
frames, the shared secret (env ARL_SECRET, as the run was given it; a secret the run made itself, as a run on Ray
does, is in the control file). It waits for the controller's answer: what
changed, or why nothing did. Exit status: 0 done, 1 refused by the run, 2 no run to talk to (not a run
directory, the run is not running, or the secret is missing or wrong: frames without it are dropped unanswered).

    python -m arl.ctl runs/my-run scale inference=+2      # two more inference servers
    python -m arl.ctl runs/my-run scale inference=-1      # drain the newest server, then stop it
    python -m arl.ctl runs/my-run scale rollout=+1        # one more rollout worker (a prompt stream of its own)
    python -m arl.ctl runs/my-run scale rollout=-1        # drain the newest one; rollout0 takes its prompt streams
    python -m arl.ctl runs/my-run scale env=+1            # one more env server (a run with env.servers=N)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Optional, Sequence

from arl.controller.scaling import CONTROL_FILE
from arl.transport.messages import Scale
from arl.transport.security import SECRET_ENV
from arl.transport.sockets import Dealer


class CtlError(RuntimeError):
    """No run to talk to, with the reason."""


def parse_changes(items: Sequence[str]) -> dict[str, int]:
    """['inference=+2', 'inference=-1'] -> {'inference': 1}; ValueError naming a malformed item."""
    changes: dict[str, int] = {}
    for item in items:
        role, sep, n = item.partition("=")
        try:
            delta = int(n)
        except ValueError:
            delta = 0
        if not sep or not role or not n.strip().lstrip("+-").isdigit() or delta == 0:
            raise ValueError(f"{item!r}: expected ROLE=+N or ROLE=-N (e.g. inference=+2)")
        changes[role] = changes.get(role, 0) + delta
    return changes


def control_info(run_dir: str) -> dict:
    path = os.path.join(run_dir, CONTROL_FILE)
    if not os.path.isdir(run_dir):
        raise CtlError(f"{run_dir!r} is not a directory")
    try:
        with open(path) as f:
            info = json.load(f)
    except FileNotFoundError:
        raise CtlError(f"{run_dir!r} has no {CONTROL_FILE}: not a run directory, or the run has not started") from None
    except (OSError, ValueError) as e:
        raise CtlError(f"cannot read {path}: {e}") from None
    if not isinstance(info, dict) or not {"controller", "key"} <= set(info):
        raise CtlError(f"{path} is not a control file")
    return info


async def send_scale(run_dir: str, changes: dict[str, int], timeout: float) -> dict:
    """The controller's answer (`scaled`) to a scale of `changes`; CtlError when nothing answers."""
    info = control_info(run_dir)
    secret = os.environ.get(SECRET_ENV, "") or str(info.get("secret") or "")  # the file's: a secret the run made
    if info.get("signed") and not secret:
        raise CtlError(f"the run signs its control frames: set {SECRET_ENV} to its shared secret")
    pid = info.get("pid")
    if isinstance(pid, int) and not _alive(pid):
        raise CtlError(f"the run in {run_dir!r} is not running (its controller, pid {pid}, has exited)")
    dealer = Dealer(secret=secret.encode() if info.get("signed") else None)
    try:
        dealer.connect(info["controller"])
        await dealer.send(Scale.TYPE, Scale(token=str(info["key"]), changes=changes).to_payload())
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:  # in slices: a run that ends while it drains (its last step came) is told at once, not at timeout
                msg_type, payload = await dealer.recv(timeout=max(0.01, min(1.0, left)))
            except asyncio.TimeoutError:
                if isinstance(pid, int) and not _alive(pid):
                    raise CtlError(f"the run in {run_dir!r} ended (its controller, pid {pid}, exited) before it "
                                   "answered: the change may be partly done; its log says how far") from None
                if left <= 0:
                    raise CtlError(f"no answer from the run's controller at {info['controller']} in {timeout:g}s: "
                                   "it is not running, busy, or the secret is wrong") from None
                continue
            if msg_type == "scaled":
                return payload
    finally:
        dealer.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m arl.ctl", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    sub = ap.add_subparsers(dest="command", required=True)
    sc = sub.add_parser("scale", help="add or drain roles: inference=+N | rollout=-N | env=+N ... (ROLE=+N or ROLE=-N)")
    sc.add_argument("changes", nargs="+")
    sc.add_argument("--timeout", type=float, default=300.0,
                    help="seconds to wait for the answer (a drain takes up to inference.drain_timeout_s or "
                         "rollout.drain_timeout_s)")
    a = ap.parse_args(argv)
    try:
        changes = parse_changes(a.changes)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        reply = asyncio.run(send_scale(a.run_dir, changes, a.timeout))
    except CtlError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(reply.get("message", ""))
    return 0 if reply.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
