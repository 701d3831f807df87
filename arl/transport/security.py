"""Where sockets bind and which secret signs their frames.

Sockets bind to loopback unless a host is configured. A run bound to any other interface can be reached from other
machines, so it must carry a shared secret: every frame then has an HMAC-SHA256 tag (arl.transport) and a frame
from a peer without the secret is dropped and counted as malformed, never acted on.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from typing import Mapping, Optional

from arl.utils.errors import ConfigError

logger = logging.getLogger("arl.launch")

__all__ = ["effective_bind_host", "is_loopback", "resolve_secret", "advertised_address", "SECRET_ENV"]

SECRET_ENV = "ARL_SECRET"
_WILDCARDS = ("*", "0.0.0.0", "::", "[::]")


def effective_bind_host(configured: str, env: Mapping[str, str] = os.environ) -> str:
    """The configured `bind_host`; the older env override ARL_BIND_HOST wins if set."""
    return env.get("ARL_BIND_HOST") or configured or "127.0.0.1"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name or a wildcard: reachable from elsewhere as far as we know
        return False


def resolve_secret(configured: str, bind_host: str, env: Mapping[str, str] = os.environ) -> Optional[bytes]:
    """The run's shared secret (config `secret`, else env ARL_SECRET), or None on a loopback-only run.

    Raises ConfigError when the run binds to a non-loopback interface without a secret.
    """
    secret = configured or env.get(SECRET_ENV, "")
    if not secret:
        if not is_loopback(bind_host):
            raise ConfigError(
                f"bind_host={bind_host!r} is reachable from other machines: a multi-host run needs a shared secret "
                f"(secret=... or env {SECRET_ENV}) so that unauthenticated peers are rejected"
            )
        return None
    if len(secret) < 16:
        logger.warning("the shared secret is only %d characters long; use 16 or more random ones", len(secret))
    return secret.encode("utf-8")


def advertised_address(address: str) -> str:
    """A bound address others can connect to: a wildcard host is replaced by this machine's address."""
    for w in _WILDCARDS:
        prefix = f"tcp://{w}:"
        if address.startswith(prefix):
            return f"tcp://{socket.gethostbyname(socket.gethostname())}:{address[len(prefix):]}"
    return address
