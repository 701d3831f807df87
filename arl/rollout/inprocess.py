"""The in-process path from an agent's SDK to the endpoint: an HTTP transport that hands each request to
`EndpointServer.dispatch` without a socket, HTTP framing or a second parse, for agents that run inside the rollout
worker. The SDK is unchanged (its client is built with this transport); subprocess and external agents keep the
socket path, and both paths answer through the same `dispatch`, so they cannot drift apart.

Why a transport and not a fake client: the SDK still builds, validates and parses exactly what it would over the
network (its retries, its errors, its stream parsing), so an agent that works here works against the socket.
The SDKs ship their own copy of httpx (`httpx2` in the 2.x/3.x SDKs, `httpx` before); the transport subclasses the
one the SDK's client is built on.
"""

from __future__ import annotations

import importlib
from typing import Any, Awaitable, Callable, Mapping

__all__ = ["in_process_http_client"]

Dispatch = Callable[[str, str, Mapping[str, str], bytes], Awaitable[Any]]


def _httpx_of(client_cls: type) -> Any:
    """The httpx-like package an SDK's default async client derives from."""
    for base in client_cls.__mro__:
        root = base.__module__.split(".")[0]
        if base.__name__ == "AsyncClient" and root.startswith("httpx"):
            return importlib.import_module(root)
    raise TypeError(f"{client_cls.__name__} is not an httpx AsyncClient")


def in_process_http_client(dispatch: Dispatch, client_cls: type) -> Any:
    """An instance of the SDK's default async HTTP client (`openai.DefaultAsyncHttpxClient`,
    `anthropic.DefaultAsyncHttpxClient`) whose transport calls `dispatch` directly."""
    httpx = _httpx_of(client_cls)

    class EndpointTransport(httpx.AsyncBaseTransport):  # type: ignore[name-defined, misc]
        async def handle_async_request(self, request: Any) -> Any:
            body = await request.aread()
            reply = await dispatch(request.method, request.url.path, request.headers, body)
            return httpx.Response(reply.status, headers={"content-type": reply.content_type}, content=reply.body,
                                  request=request)

    return client_cls(transport=EndpointTransport())
