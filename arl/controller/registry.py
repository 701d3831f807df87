"""Who is who among a run's roles: the router identity each registered with, where each listens, and where each
rollout worker's prompt stream continues. No sockets; `write` keeps run_dir/addresses.json up to date.

A role's identity is bound at registration: only a new incarnation (the old one died or was dropped, so it is no
longer heard) may register under its key, never a second peer beside a live one (a replayed or forged
`register`). A registration must name a role and index the run has, and an inference server its address.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable, Container, Optional

logger = logging.getLogger("arl.controller")

Key = tuple[str, int]  # (role, index)


class Registry:
    def __init__(self, *, num_inference: int, num_rollout: int, process_of: Callable[[str, int], str],
                 path: str = "", prompt_positions: Optional[dict[int, int]] = None) -> None:
        """`process_of(role, index)` names the process hosting a role; `path`: addresses.json ('' writes none);
        `prompt_positions`: rollout worker -> prompt stream position (a resumed run's)."""
        self.limits = {"inference": num_inference, "learner": 1, "rollout": num_rollout}
        self.process_of, self.path = process_of, path
        self.peers: dict[Key, bytes] = {}  # (role, index) -> router identity
        self.who: dict[bytes, Key] = {}  # router identity of a registered role -> (role, index)
        self.addresses: dict[str, Any] = {"inference": [None] * num_inference, "learner": None}
        self.positions = dict(prompt_positions or {})

    def register(self, ident: bytes, role: str, index: int, address: Optional[str],
                 heard: Container[Key]) -> Optional[tuple[str, str]]:
        """Bind `ident` to (`role`, `index`) listening at `address`; `heard`: the roles alive now. Returns None, or
        (kind, text) of the refusal to count."""
        if not 0 <= index < self.limits.get(role, 0) or (role == "inference" and address is None):
            return "bad_register", f"refused a registration as {role}/{index}"
        key = (role, index)
        old = self.peers.get(key)
        if old is not None and old != ident and key in heard:
            return "register_taken", (f"refused a registration as {role}{index} from peer {ident[:16]!r}: that role "
                                      "is registered and alive")
        self.forget(key)  # a new incarnation: the old one's identity is no longer heard
        self.peers[key] = ident
        self.who[ident] = key
        if role == "inference":
            self.addresses["inference"][index] = address
        elif role == "learner":
            self.addresses["learner"] = address
        return None

    def forget(self, key: Key) -> None:
        self.who.pop(self.peers.pop(key, b""), None)

    def has_process(self, name: str) -> bool:
        """A role that process `name` hosts is registered."""
        return any(self.process_of(*k) == name for k in self.peers)

    def complete(self) -> bool:
        """Every inference server and the learner said where they listen (lookups can be answered)."""
        return None not in self.addresses["inference"] and self.addresses["learner"] is not None

    def note_position(self, index: int, position: Any) -> None:
        """Rollout worker `index` reported its prompt stream `position`: a restart continues from there."""
        if isinstance(position, int):
            self.positions[index] = max(self.positions.get(index, 0), position)

    def prompt_position(self, role: str, index: int) -> Optional[int]:
        return self.positions.get(index) if role == "rollout" else None

    def write(self, controller: str) -> None:
        """run_dir/addresses.json: where every role listens (for tools and the fault tests)."""
        if not self.path:
            return
        try:
            with open(self.path + ".tmp", "w") as f:
                json.dump({"controller": controller, **self.addresses}, f)
            os.replace(self.path + ".tmp", self.path)
        except OSError as e:
            logger.warning("could not write %s: %s", self.path, e)
