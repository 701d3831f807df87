"""Who is who among a run's roles: the router identity each registered with, where each listens, and where each
rollout worker's prompt stream continues. No sockets; `write` keeps run_dir/addresses.json up to date.

A role's identity is bound at registration: only a new incarnation (the old one died or was dropped, so it is no
longer heard) may register under its key, never a second peer beside a live one (a replayed or forged
`register`). A registration must name a role and index the run has, and an inference server its address. Only a
registered role may send anything but `register` and `lookup`, and some messages only one role (`SENDERS`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Callable, Container, Optional

from arl.data.position import DataPosition, stream_states
from arl.utils.fingerprint import fingerprint_mismatch

logger = logging.getLogger("arl.controller")

Key = tuple[str, int]  # (role, index)
Refusal = tuple[str, str]  # (kind, text) of a refused control message
# messages only one role may send (any other sender's are dropped and counted)
SENDERS = {"gate_acquire": "rollout", "group_done": "rollout", "groups_dropped": "learner", "group_received": "learner"}


class Refusals:
    """Counts of refused control messages by kind; logs at most one a second (a flood must not flood the log)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._logged_at = -1e9

    def __call__(self, kind: str, text: str, exc_info: bool = False) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        now = time.monotonic()
        if exc_info or now - self._logged_at >= 1.0:
            self._logged_at = now
            logger.warning("controller: %s (refused so far: %s)", text, self.counts, exc_info=exc_info)


class Peers:
    def __init__(self, *, num_inference: int, num_rollout: int, process_of: Callable[[str, int], str],
                 path: str = "", prompt_positions: Optional[dict[int, Any]] = None, num_env: int = 0,
                 num_judge: int = 0, fingerprint: Optional[dict] = None,
                 retired: Optional[dict[str, set[int]]] = None, num_policy_learners: int = 0) -> None:
        """`process_of(role, index)` names the process hosting a role; `path`: addresses.json ('' writes none);
        `prompt_positions`: prompt stream -> data position (`DataPosition` state: a resumed run's; stream `s`
        is drawn by rollout worker `s`, or `s % num_rollout` for a stream of a worker that joined the run it
        resumes). `fingerprint`: what the run runs (`arl.utils.fingerprint`): a role that registers with another is
        refused. `retired`: role -> indices scaled out of the run (the supervisor's): no address is awaited.
        `num_policy_learners`: learners 1.. of trainable listed policies (`Addresses.policy_learners`)."""
        self.limits = {"inference": num_inference, "learner": 1 + num_policy_learners, "rollout": num_rollout,
                       "env": num_env, "judge": num_judge}
        self.process_of, self.path, self.fingerprint = process_of, path, fingerprint
        self.retired = retired if retired is not None else {}
        self.peers: dict[Key, bytes] = {}  # (role, index) -> router identity
        self.who: dict[bytes, Key] = {}  # router identity of a registered role -> (role, index)
        self.addresses: dict[str, Any] = {"inference": [None] * num_inference, "learner": None}
        if num_env:
            self.addresses["env"] = [None] * num_env
        if num_judge:
            self.addresses["judge"] = [None] * num_judge
        if num_policy_learners:
            self.addresses["policy_learners"] = [None] * num_policy_learners
        self.positions = dict(prompt_positions or {})  # prompt stream -> its data position, last reported
        # prompt stream -> the rollout worker that draws it (absent: the worker of its index)
        self.owners = {s: s % num_rollout for s in self.positions if s >= num_rollout}
        self.last_messages: dict[str, dict[str, float]] = {}  # process -> message type -> when last heard

    @classmethod
    def of(cls, sup: Any, **kw: Any) -> "Peers":
        """The roster of the run `sup` (a `Supervisor`) supervises: its roles' counts, names and retired indices."""
        return cls(num_inference=sup.num_inference, num_rollout=sup.num_rollout, process_of=sup.process_of,
                   num_env=sup.num_env, num_judge=sup.num_judge, retired=sup.retired,
                   num_policy_learners=sup.num_policy_learners, **kw)

    def unknown_peer(self, ident: bytes, msg_type: str, payload: Any) -> Optional[Refusal]:
        """A message from a peer that is not registered (other than `register`/`lookup`) is refused."""
        if msg_type in ("register", "lookup", "scale") or ident in self.who:  # scale: checked by its own key
            return None
        what = f"dropped {msg_type} from an unregistered peer {ident[:16]!r}"
        if msg_type == "error" and isinstance(payload, dict):  # e.g. a role that failed before registering
            what += f": {str(payload.get('message'))[:500]}"  # (its exit itself is handled by the watch)
        return "unknown_peer", what

    def wrong_sender(self, ident: bytes, msg_type: str) -> Optional[Refusal]:
        """A message only another role may send (e.g. a group_done from the learner) is refused."""
        role, index = self.who.get(ident, ("", -1))
        if SENDERS.get(msg_type, role) == role:
            return None
        return f"unexpected_{msg_type}", f"dropped a {msg_type} from {role}{index}"

    def heard_from(self, ident: bytes, msg_type: str, now: float) -> None:
        """For the stall report: when each process last sent each kind of message."""
        key = self.who.get(ident)
        if key is not None:
            self.last_messages.setdefault(self.process_of(*key), {})[msg_type] = now

    def register(self, ident: bytes, role: str, index: int, address: Optional[str],
                 heard: Container[Key], fingerprint: Optional[dict] = None) -> Optional[Refusal]:
        """Bind `ident` to (`role`, `index`) listening at `address`; `heard`: the roles alive now; `fingerprint`:
        what it runs. Returns None, or (kind, text) of the refusal to count ('not_this_run': it is told why)."""
        if not 0 <= index < self.limits.get(role, 0) or (role in ("inference", "env", "judge") and address is None):
            return "bad_register", f"refused a registration as {role}/{index}"
        differs = fingerprint_mismatch(self.fingerprint, fingerprint)
        if differs:
            return "not_this_run", f"refused {role}{index}: {differs}"
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
        elif role == "learner" and index:
            self.addresses["policy_learners"][index - 1] = address
        elif role == "learner":
            self.addresses["learner"] = address
        elif role in ("env", "judge"):
            self.addresses[role][index] = address
        return None

    def forget(self, key: Key) -> None:
        self.who.pop(self.peers.pop(key, b""), None)

    def has_process(self, name: str) -> bool:
        """A role that process `name` hosts is registered."""
        return any(self.process_of(*k) == name for k in self.peers)

    def complete(self) -> bool:
        """Every inference server, env server and the learner said where they listen (lookups can be answered)."""
        def known(role: str) -> bool:  # a server scaled out (or never joined) is not waited for
            return all(a is not None or i in self.retired.get(role, ())
                       for i, a in enumerate(self.addresses.get(role) or ()))

        return self.addresses["learner"] is not None and all(map(known, ("inference", "env", "judge",
                                                                          "policy_learners")))

    def retire(self, role: str, index: int) -> None:
        """`role` `index` left the run (or never joined it): a lookup does not wait for it, and rollout workers
        that start later are told (`Addresses.retired`, `retired_env`)."""
        self.retired.setdefault(role, set()).add(index)
        key = {"inference": "retired", "env": "retired_env"}.get(role)
        if key:
            self.addresses[key] = sorted(self.retired[role])

    def streams_of(self, index: int) -> list[int]:
        """The prompt streams rollout worker `index` draws: its own and those it adopted."""
        return sorted({s for s, w in self.owners.items() if w == index} | ({index} - set(self.owners)))

    def adopt(self, streams: list[int], index: int) -> dict[str, Any]:
        """Rollout worker `index` draws `streams` from now on; returns their positions (for `AdoptStreams`)."""
        for s in streams:
            self.owners[s] = index
        return {str(s): self.positions.get(s, 0) for s in streams}

    def note_position(self, index: int, position: Any) -> None:
        """Rollout worker `index` reported which of its prompts ended, per stream (`stream_states`): a restart of
        it draws again the ones that had not (its groups in flight die with it). A malformed report is ignored."""
        try:
            states = stream_states(position, index)
            for s, state in states.items():
                reported = DataPosition.from_state(state)
                known = DataPosition.from_state(self.positions.get(s, 0))
                if len(reported) >= len(known):  # a report from before a resume's position reached it: ignored
                    self.positions[s] = state
        except ValueError:
            return

    def prompt_position(self, role: str, index: int) -> Any:
        """What a registering rollout worker continues from: {stream: data position} of the streams it draws."""
        if role != "rollout":
            return None
        return {str(s): self.positions[s] for s in self.streams_of(index) if s in self.positions} or None

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
