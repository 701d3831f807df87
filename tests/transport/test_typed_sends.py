"""Every control message a role sends is one of the typed classes of `arl.transport.messages`: nowhere in `arl/` is
a control message sent as a type name and a raw map (the receivers parse typed messages; a sender that builds maps
by hand drifts from them unseen). The worker tests check it at run time (`tests.typed_control`); this checks the
code paths those tests do not run."""

from __future__ import annotations

import ast
import pathlib

import arl
from arl.transport.codec import CONTROL_TYPES
from arl.transport.messages import MESSAGES

SENDS = {"send", "_send", "post", "send_control"}


def raw_control_sends(source: str) -> list[tuple[int, str]]:
    """(line, type) of each call of a send-like function with a control message type as a string literal."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else None
        if name not in SENDS:
            continue
        for arg in node.args[:2]:
            if isinstance(arg, ast.Constant) and arg.value in CONTROL_TYPES:
                out.append((node.lineno, arg.value))
    return out


def test_the_scan_finds_a_raw_send():
    assert raw_control_sends('await self._send("group_done", {"accepted": True})') == [(1, "group_done")]
    assert raw_control_sends('await router.send(ident, "gate_grant", {"n": 1})') == [(1, "gate_grant")]
    assert raw_control_sends("await self._send(GroupDone(accepted=True))") == []


def test_no_role_sends_an_untyped_control_message():
    root = pathlib.Path(arl.__file__).parent
    found = [f"{path.relative_to(root.parent)}:{line}: {t}" for path in sorted(root.rglob("*.py"))
             for line, t in raw_control_sends(path.read_text())]
    assert not found, "control messages sent as raw maps (send the class from arl.transport.messages):\n" + \
        "\n".join(found)


def test_every_control_type_on_the_wire_has_a_class():
    assert CONTROL_TYPES == set(MESSAGES), CONTROL_TYPES ^ set(MESSAGES)
