"""What the server checks before any work, as an ASGI middleware: the API key, the content
type of a body (JSON only) and the body's size.

A web page the user opens can send a "simple" cross-origin request (a ``text/plain`` POST,
no preflight) to a server on 127.0.0.1: refusing every body that is not
``application/json`` leaves such a page only requests that need a CORS preflight, which is
refused unless ``--allowed-origins`` names the page's origin.
"""

from __future__ import annotations

import hmac
import json

from paged_attention.server.protocol import APIError

OPEN_PATHS = frozenset({"/health"})
"""Routes answered without the API key (a load balancer's probe)."""

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20


class RequestGuard:
    """An ASGI middleware in front of the routes: 401 without the right ``Authorization:
    Bearer <api_key>`` (when a key is set), 415 for a body that is not JSON, 413 for a body
    over ``max_request_bytes`` (told by its ``content-length`` at once, else as it arrives).
    Every refusal is in OpenAI's error shape. ``json_paths``: the routes whose POST bodies
    are checked."""

    def __init__(
        self, app, api_key: str | None, max_request_bytes: int, json_paths: frozenset[str]
    ) -> None:
        if api_key is not None and not api_key:
            raise ValueError("api_key must not be empty (None: no key)")
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be at least 1, got {max_request_bytes}")
        self.app = app
        self.api_key = api_key.encode() if api_key is not None else None
        self.max_request_bytes = max_request_bytes
        self.json_paths = json_paths  # the routes that take a body (others answer 404/405)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            await _send_error(send, refusal)
            return
        await self.app(scope, self._limited(receive), send)

    def _refusal(self, scope, headers: dict[bytes, bytes]) -> APIError | None:
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            if not self._authorized(headers.get(b"authorization", b"")):
                return APIError(
                    "a valid API key is required: send it as 'Authorization: Bearer <key>'",
                    status=401,
                    code="invalid_api_key",
                    headers={"www-authenticate": "Bearer"},
                )
        if scope["method"] != "POST" or scope["path"] not in self.json_paths:
            return None
        media_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if media_type != b"application/json":
            shown = media_type.decode("latin-1") or "none"
            return APIError(
                f"the request body must be JSON sent as 'Content-Type: application/json' "
                f"(got {shown})",
                status=415,
                code="unsupported_media_type",
            )
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_request_bytes:
            return self._too_large()
        return None

    def _authorized(self, header: bytes) -> bool:
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return hmac.compare_digest(token.strip(), self.api_key)

    def _too_large(self) -> APIError:
        return APIError(
            f"the request body is larger than this server's limit of {self.max_request_bytes} "
            "bytes",
            status=413,
            code="request_too_large",
        )

    def _limited(self, receive):
        """``receive`` that raises the 413 once the body outgrows the limit (a body sent
        without ``content-length``, or longer than it said)."""
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_request_bytes:
                    raise self._too_large()
            return message

        return limited_receive


async def _send_error(send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
