"""The versions of the trainable listed policies on the inference servers. Pure: no I/O, no clock.

Each trainable listed policy (`policies: [{name: rival, trainable: true}]`, docs/multi_policy.md) has a learner of
its own (`learner<k>`) and its own version counter. Its versions travel as named adapters (`UpdateWeights.policy`,
the disk transport's files): every server is sent the newest version a learner published, a server that is
loading gets only the newest once it acked (coalesced, as `WeightSync` does for the run's weights), and a server
that registers again (restarted: it starts from the policy's initial adapter) is sent the newest at once.
`live(policy)` is the newest version of the policy every server in the run's ack set has; with the groups its
learner dropped (`drops`) it is that policy's bound in the staleness gate (`StalenessGate.others`), which admits a
group only while every trained policy has room.
"""

from __future__ import annotations

import dataclasses
from typing import Container, Optional


@dataclasses.dataclass(frozen=True)
class PolicySend:
    """Tell `server` to load version `version` of policy `policy` from `path`."""

    server: int
    policy: str
    version: int
    path: str


class PolicyWeights:
    """Per-server versions of each trainable listed policy (`names[k - 1]` is learner k's) on `num_servers`;
    `placement`: policy -> the servers that serve it (absent or []: all); the others never hear of it."""

    def __init__(self, names: list[str], num_servers: int, placement: Optional[dict[str, list[int]]] = None) -> None:
        self.names = list(names)
        self.num_servers = num_servers
        self.servers = {n: [i for i in range(num_servers) if not (placement or {}).get(n) or i in placement[n]]
                        for n in self.names}
        self.published: dict[str, tuple[int, str]] = {}  # policy -> (newest version, its path)
        self.acked = {n: [0] * num_servers for n in self.names}
        self.sent = {n: [0] * num_servers for n in self.names}
        self.failures = {n: [0] * num_servers for n in self.names}  # failed loads in a row
        self.drops = {n: 0 for n in self.names}  # groups each policy's learner dropped (stale, invalid, not its)

    def name(self, learner_index: int) -> Optional[str]:
        """The policy learner `learner_index` trains (None: 0, the run's own, or no such learner)."""
        return self.names[learner_index - 1] if 1 <= learner_index <= len(self.names) else None

    def publish(self, policy: str, version: int, path: str, lost: Container[int] = ()) -> list[PolicySend]:
        """Learner of `policy` published `version` at `path`: send it to every server not loading one already."""
        if policy not in self.acked or version <= self.published.get(policy, (-1, ""))[0]:
            return []
        self.published[policy] = (version, path)
        return self._to_servers(policy, lost)

    def loaded(self, policy: str, server: int, version: int) -> list[PolicySend]:
        """Server `server` acked `version` of `policy`; a newer one published meanwhile goes to it now."""
        if policy not in self.acked or server not in self.servers[policy]:
            return []
        if version > self.sent[policy][server]:  # a late ack from before the policy's learner went back
            return []
        self.acked[policy][server] = max(self.acked[policy][server], version)
        self.failures[policy][server] = 0
        nxt = self._next(policy, server)
        return [nxt] if nxt is not None else []

    def failed(self, policy: str, server: int) -> tuple[list[PolicySend], int]:
        """Server `server` could not load what it was sent of `policy`: (the newest again, failures in a row)."""
        if policy not in self.sent or server not in self.servers[policy]:
            return [], 0
        self.failures[policy][server] += 1
        self.sent[policy][server] = self.acked[policy][server]
        nxt = self._next(policy, server)
        return ([nxt] if nxt is not None else []), self.failures[policy][server]

    def registered(self, server: int) -> list[PolicySend]:
        """Server `server` (re)registered holding every policy's initial adapter (version 0): the newest of each."""
        out = []
        for n in self.names:
            if server in self.servers[n]:
                self.acked[n][server] = self.sent[n][server] = 0
                nxt = self._next(n, server)
                if nxt is not None:
                    out.append(nxt)
        return out

    def restart(self, policy: str, version: int, path: str, lost: Container[int] = ()) -> list[PolicySend]:
        """The policy's learner was restarted from its checkpoint `version` (weights at `path`): every server of
        it loads that version, even one that has a newer one; later versions go up from there."""
        if policy not in self.acked:
            return []
        self.published[policy] = (version, path)
        for i in self.servers[policy]:
            self.acked[policy][i] = self.sent[policy][i] = -1  # what they hold is of a lost learner
            self.failures[policy][i] = 0
        return self._to_servers(policy, lost)

    def live(self, policy: str, lost: Container[int] = ()) -> int:
        """The newest version of `policy` every server outside `lost` has loaded."""
        return min((self.acked[policy][i] for i in self.servers[policy] if i not in lost), default=0)

    def dropped(self, policy: str, n: int) -> None:
        """The learner of `policy` dropped `n` groups: the staleness gate gives that policy's budget back."""
        if policy in self.drops:
            self.drops[policy] += max(0, int(n))

    def behind(self, steps: int, role_stats: Optional[dict] = None) -> dict[str, int]:
        """Policies whose learner has not published version `steps` yet (or, given `role_stats`, not reported it in
        a heartbeat: the final accounting reads those) -> the newest it did."""
        newest = {n: self.published.get(n, (0, ""))[0] for n in self.names}
        if role_stats is not None:
            newest = {n: min(v, int(role_stats.get(("learner", k), {}).get("version", 0)))
                      for k, (n, v) in enumerate(newest.items(), 1)}
        return {n: v for n, v in newest.items() if v < steps}

    def accounting(self, role_stats: dict, lost: Container[int] = ()) -> dict[str, dict]:
        """Per trainable listed policy, from its learner's latest heartbeat (`role_stats[("learner", k)]`): its
        version, live version, and where every group it received went. `unaccounted` (received minus trained,
        dropped, buffered and in a step) is 0 when nothing was lost: exactly once, per policy."""
        out = {}
        for k, name in enumerate(self.names, 1):
            st = role_stats.get(("learner", k), {})
            n = {key: int(st.get(key, 0)) for key in ("groups_received", "trained_groups", "stale_groups_dropped",
                                                      "duplicate_prompts", "buffered_groups", "in_step_groups",
                                                      "invalid_groups", "groups_without_policy", "trained_twice")}
            settled = sum(n[key] for key in ("trained_groups", "stale_groups_dropped", "duplicate_prompts",
                                             "buffered_groups", "in_step_groups"))
            out[name] = {"version": st.get("version"), "live": self.live(name, lost), **n,
                         "unaccounted": n["groups_received"] - settled}
        return out

    def lowest_needed(self, policy: str, lost: Container[int] = ()) -> int:
        """The oldest version of `policy` a server may still read (sent or loaded); older files can go."""
        return min((min(self.acked[policy][i], self.sent[policy][i]) for i in self.servers[policy]
                    if i not in lost), default=0)

    def _to_servers(self, policy: str, lost: Container[int]) -> list[PolicySend]:
        """The newest version of `policy` to each of its servers outside `lost` that is not loading one."""
        return [s for i in self.servers[policy] if i not in lost and (s := self._next(policy, i)) is not None]

    def _next(self, policy: str, server: int) -> Optional[PolicySend]:
        newest = self.published.get(policy)
        if newest is None or self.sent[policy][server] > self.acked[policy][server]:  # one load in flight at most
            return None
        if newest[0] <= self.sent[policy][server]:
            return None
        self.sent[policy][server] = newest[0]
        return PolicySend(server, policy, newest[0], newest[1])
