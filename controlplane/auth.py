"""Caller authentication for the control plane's services, as istiod asks for it (off by default).

With `--auth-token FILE`, every call (Delta ADS and CreateCertificate alike) must carry
`authorization: Bearer <the file's token>`; with `--cluster-id ID` also `clusterid: ID`, the header
istiod uses to pick the cluster whose API validates the token. A call without them ends at once with
UNAUTHENTICATED and a one-line reason, and the control plane logs the refusal. The file is read on
every call, so a rotated token takes effect without a restart. (istiod validates the token as a
Kubernetes service-account JWT; this development server only compares it.)
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

log = logging.getLogger(__name__)


class CallerCheck(grpc.aio.ServerInterceptor):
    """Refuses calls whose bearer token (and, when asked, cluster id) is not the expected one."""

    def __init__(self, token_path: Path | None, cluster_id: str | None = None) -> None:
        self.token_path = token_path
        self.cluster_id = cluster_id

    def refusal(self, metadata: dict[str, str]) -> str | None:
        """Why a call with this metadata is refused, or None when it is let through."""
        if self.token_path is not None:
            try:
                expected = self.token_path.read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as e:
                log.error("cannot read the expected token %s: %s", self.token_path, e)
                return "the control plane cannot read its token file"
            header = metadata.get("authorization")
            if header is None:
                return "no authorization header (expected a bearer token)"
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not token:
                return "authorization header is not a bearer token"
            if not hmac.compare_digest(token.strip().encode(), expected.encode()):
                return "bearer token is not valid"
        if self.cluster_id is not None:
            got = metadata.get("clusterid")
            if got != self.cluster_id:
                return f"clusterid {got!r} is not {self.cluster_id!r}"
        return None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        metadata = {
            str(k): v if isinstance(v, str) else v.decode(errors="replace")
            for k, v in (handler_call_details.invocation_metadata or ())  # type: ignore[attr-defined]
        }
        handler = await continuation(handler_call_details)
        reason = self.refusal(metadata)
        if reason is None or handler is None:
            return handler
        method = handler_call_details.method  # type: ignore[attr-defined]
        log.warning("refused %s: %s", method, reason)
        return _refusing(handler, reason)


def _refusing(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that aborts with UNAUTHENTICATED."""

    async def abort(context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await abort(context)

    async def streaming(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        return await abort(context)

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(bool(handler.request_streaming), bool(handler.response_streaming))]
    return make(
        streaming if handler.request_streaming else unary,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
