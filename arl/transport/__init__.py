"""Transport: the only package that imports zmq and msgpack.

``codec``: versioned msgpack envelopes with raw-bytes arrays and optional HMAC (``encode``/``decode``).
``sockets``: asyncio Router/Dealer, Push/Pull that batch what one loop iteration sends to a peer and
drop and count malformed input.
``loop``: the opt-in event loop that polls before it sleeps (config ``busy_poll_us``).
"""

from arl.transport.codec import (CONTROL_TYPES, DEFAULT_MAX_BYTES, MESSAGE_TYPES, PROTOCOL_VERSION, TYPED_TYPES,
                                 MalformedMessage, decode, encode)
from arl.transport.sockets import Dealer, Pull, Push, Router, SocketClosed, bind_random, context

__all__ = ["CONTROL_TYPES", "DEFAULT_MAX_BYTES", "MESSAGE_TYPES", "PROTOCOL_VERSION", "TYPED_TYPES", "MalformedMessage",
           "decode", "encode", "Dealer", "Pull", "Push", "Router", "SocketClosed", "bind_random", "context"]
