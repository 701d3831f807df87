"""The worker side of a broadcast to an SGLang server: the server itself receives the tensors, this drives it.

SGLang 0.5.23's recipe (measured, see docs): ``POST /init_weights_update_group`` joins the sender's group (blocks
until the sender joins too); each update is ``/begin_weight_update``, then one ``/update_weights_from_distributed``
per bucket (``load_format: flattened_bucket``; the server blocks in it while the sender broadcasts that bucket),
then ``/end_weight_update``; ``/destroy_weights_update_group`` leaves. The plan (names, dtypes, shapes) comes from
the sender's store, where `WeightSender` announces it; the outcome goes back there (``arl/done/<seq>``) so the
sender knows the server loaded the weights. Blocking calls over urllib: an async caller runs them in a thread.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Optional

from arl.weights.group import GroupSpec, WeightTransferError, arl_store, sign_value, store_client, wait_announced
from arl.weights.plan import TransferPlan

__all__ = ["SGLangWeightClient"]


class SGLangWeightClient:
    """Makes the SGLang server at `base_url` a member (rank `spec.rank`) of the sender's group `spec.group_name`
    and loads each transfer the sender announces. `http_timeout_s` bounds each HTTP call (a bucket's call lasts
    as long as its broadcast)."""

    def __init__(self, base_url: str, spec: GroupSpec, *, timeout_s: float = 60.0,
                 http_timeout_s: Optional[float] = None, flush_cache: bool = True,
                 secret: Optional[bytes] = None) -> None:
        """`secret`: the run's; only announcements signed with it are loaded, and the outcome is signed."""
        self.base_url = base_url.rstrip("/")
        self.secret = secret
        self.stats = {"forged_values": 0}
        self.spec, self.timeout_s, self.flush_cache = spec, timeout_s, flush_cache
        self.http_timeout_s = http_timeout_s if http_timeout_s is not None else timeout_s
        self._store: Any = None
        self.seq = 0
        self.version: Optional[int] = None

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(self.base_url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.http_timeout_s) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            raise WeightTransferError(f"{path}: HTTP {e.code}: {detail}") from e
        except (urllib.error.URLError, OSError) as e:
            raise WeightTransferError(f"{path}: {e}") from e
        try:
            out = json.loads(raw) if raw else {}
        except ValueError:
            out = {"message": raw.decode(errors="replace")}
        if isinstance(out, dict) and out.get("success") is False:
            raise WeightTransferError(f"{path}: {out.get('message')}")
        return out if isinstance(out, dict) else {"result": out}

    def join(self) -> None:
        """Connect to the sender's store and make the server join the group (blocks until the sender has)."""
        s = self.spec
        try:
            self._store = arl_store(store_client(s.master_address, s.master_port, self.timeout_s), s.group_name)
        except Exception as e:  # noqa: BLE001
            raise WeightTransferError(f"group {s.group_name!r}: cannot reach the sender's store at "
                                      f"{s.master_address}:{s.master_port}: {e}") from e
        self._post("/init_weights_update_group", s.sglang_init_request())

    def receive(self, wait_s: Optional[float] = None) -> int:
        """Load the next transfer into the server; returns its version (the server's ``weight_version`` is now
        ``str(version)``). Raises `WeightTransferError` when the server refused or failed; the sender is told."""
        return self.load(*self.next_transfer(wait_s))

    def next_transfer(self, wait_s: Optional[float] = None) -> tuple[int, TransferPlan]:
        """Wait (at most `wait_s`, default `timeout_s`) for the sender to announce its next transfer: its version
        and plan. `load` must follow (the sender is waiting for the server): a caller pauses the server between
        the two, so the pause does not include the wait for the learner."""
        if self._store is None:
            raise WeightTransferError(f"group {self.spec.group_name!r}: not joined")
        return wait_announced(self._store, self.spec.group_name, self.seq,
                              self.timeout_s if wait_s is None else wait_s, self.secret, self._forged)

    def _forged(self, key: str) -> None:
        self.stats["forged_values"] += 1

    def load(self, version: int, plan: TransferPlan) -> int:
        """Have the server receive the announced transfer (`next_transfer`); returns `version`."""
        if self._store is None:
            raise WeightTransferError(f"group {self.spec.group_name!r}: not joined")
        seq = self.seq
        self.seq += 1
        outcome: dict[str, Any] = {"success": False, "message": ""}
        try:
            self._post("/begin_weight_update", {})
            try:
                msg = ""
                for body in plan.sglang_requests(self.spec.group_name, str(version), flush_cache=self.flush_cache):
                    msg = str(self._post("/update_weights_from_distributed", body).get("message", ""))
            finally:
                self._post("/end_weight_update", {})
            outcome = {"success": True, "message": msg}
        except WeightTransferError as e:
            outcome = {"success": False, "message": str(e)}
            raise
        finally:
            key = f"arl/done/{seq}"
            self._store.set(key, sign_value(self.secret, self.spec.group_name, key, json.dumps(outcome)))
        self.version = version
        return version

    def close(self) -> None:
        """Make the server leave the group (best effort: a dead group may already be gone there)."""
        if self._store is None:
            return
        self._store = None
        try:
            self._post("/destroy_weights_update_group", {"group_name": self.spec.group_name})
        except WeightTransferError:
            pass
