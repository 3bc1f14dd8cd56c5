"""The gateway's gRPC API (proto/radixserve.proto) and the standard grpc.health.v1 service.

Generate streams one GenerateResponse per output step, the last with final = true. Errors are gRPC
statuses mapped from the HTTP ones (400 INVALID_ARGUMENT, 404 NOT_FOUND, 413 RESOURCE_EXHAUSTED,
503 UNAVAILABLE, 504 DEADLINE_EXCEEDED; with API keys 401 UNAUTHENTICATED, 403 PERMISSION_DENIED for a
user key's Abort of another key's request, 429 RESOURCE_EXHAUSTED); a request that does not parse (bad
UTF-8 in a string) is INVALID_ARGUMENT too. A cancelled call (client gone, deadline) aborts its request on the worker. Health: "" is SERVING while the gateway is connected to NATS; "radixserve.v1.RadixServe"
also needs a live worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from services.gateway.auth import authorize, current_key
from services.gateway.dispatch import Dispatcher
from services.gateway.errors import GatewayError, bad_request
from services.gateway.generate_spec import GenerateSpec
from services.gateway.protos import health_pb2, health_pb2_grpc, radixserve_pb2, radixserve_pb2_grpc
from shared.protocol import ChatMessage, Sampling, StreamOut, Usage

SERVICE_NAME = "radixserve.v1.RadixServe"
WATCH_INTERVAL_S = 1.0

_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def status_code(http_status: int) -> grpc.StatusCode:
    return _CODES.get(http_status, grpc.StatusCode.INTERNAL)


def sampling_from_proto(p: Any) -> Sampling:
    """Sampling's fields read by name from the proto's SamplingParams (tests/test_request_contract.py
    holds the two to the same names and types): unset optional fields and empty repeated or map fields
    stay None (the model's defaults apply)."""
    values: dict[str, Any] = {}
    for name in Sampling.__struct_fields__:
        field = p.DESCRIPTOR.fields_by_name[name]
        if field.has_presence:  # optional scalar
            values[name] = getattr(p, name) if p.HasField(name) else None
        elif field.message_type is not None:  # map<k, v>
            values[name] = dict(getattr(p, name)) or None
        else:  # repeated
            values[name] = list(getattr(p, name)) or None
    return Sampling(**values)


def spec_from_proto(request: Any) -> GenerateSpec:
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise bad_request("give one of text, input_ids or chat", "prompt")
    return GenerateSpec(
        sampling=sampling_from_proto(request.sampling_params),
        text=request.text if kind == "text" else None,
        input_ids=list(request.input_ids.ids) if kind == "input_ids" else None,
        messages=[ChatMessage(role=m.role, content=m.content) for m in request.chat.messages] if kind == "chat" else None,
        model=request.model or None,
        rid=request.rid or None,
        return_logprob=request.return_logprob,
        top_logprobs_num=request.top_logprobs_num,
    )


def response_from(rid: str, out: StreamOut) -> Any:
    response = radixserve_pb2.GenerateResponse(rid=rid, text=out.text, token_ids=out.token_ids)
    values, tops = (out.logprobs.values, out.logprobs.top or []) if out.logprobs is not None else ([], [])
    for i, (token_id, logprob) in enumerate(zip(out.token_ids, values)):
        entry = response.logprobs.add(token_id=token_id, logprob=logprob)
        for candidate in tops[i] if i < len(tops) else []:
            entry.top_logprobs.add(token_id=candidate.token_id, logprob=candidate.logprob)
    if out.finish is not None:
        response.final = True
        response.finish.type = out.finish.type
        response.finish.message = out.finish.message or ""
        if isinstance(out.finish.matched, int):
            response.finish.matched_token = out.finish.matched
        elif isinstance(out.finish.matched, str):
            response.finish.matched_text = out.finish.matched
        usage = out.usage or Usage()
        response.usage.prompt_tokens = usage.prompt_tokens
        response.usage.completion_tokens = usage.completion_tokens
        response.usage.cached_tokens = usage.cached_tokens
    return response


class RadixServeServicer(radixserve_pb2_grpc.RadixServeServicer):  # type: ignore[misc]
    """Generate, Abort and ModelInfo over the Dispatcher."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher

    async def _authorize(self, context: grpc.aio.ServicerContext, method: str) -> None:
        """With API keys on, the call's `authorization` metadata must hold a key within its limit
        (services/gateway/auth.py); the key then counts the request's usage."""
        if not self.dispatcher.keys.enabled:
            return
        metadata = {k.lower(): v for k, v in (context.invocation_metadata() or ())}
        verdict = await authorize(self.dispatcher.keys, str(metadata.get("authorization", "")))
        if verdict.key is None:
            self.dispatcher.metrics.count(method, verdict.status)
            await context.abort(status_code(verdict.status), verdict.message)
        current_key.set(verdict.key)

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:  # noqa: N802
        await self._authorize(context, "grpc.Generate")
        try:
            stream = await self.dispatcher.submit(spec_from_proto(request))
        except GatewayError as exc:
            self.dispatcher.metrics.count("grpc.Generate", exc.status)
            await context.abort(status_code(exc.status), exc.message)
        status = 200
        try:
            async for out in stream.outputs():
                yield response_from(stream.rid, out)
        except GatewayError as exc:
            status = exc.status
            await context.abort(status_code(exc.status), exc.message)
        finally:
            self.dispatcher.release(stream)
            self.dispatcher.metrics.count("grpc.Generate", status)

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        await self._authorize(context, "grpc.Abort")
        if not request.rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "rid: must not be empty")
        try:
            found = await self.dispatcher.aborts.abort(request.rid, current_key.get())
        except GatewayError as exc:
            self.dispatcher.metrics.count("grpc.Abort", exc.status)
            await context.abort(status_code(exc.status), exc.message)
        return radixserve_pb2.AbortResponse(found=found)

    async def ModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        await self._authorize(context, "grpc.ModelInfo")
        registry = self.dispatcher.registry
        response = radixserve_pb2.ModelInfoResponse()
        for model in registry.models():
            workers = registry.live(model)
            response.models.add(
                model=model,
                context_len=max(w.load.context_len for w in workers),
                max_total_tokens=max(w.load.max_total_tokens for w in workers),
                workers=len(workers),
            )
        return response


class HealthServicer(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """grpc.health.v1.Health: Check and Watch."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher

    def status(self, service: str) -> int | None:
        """The ServingStatus of `service`, or None for a service this server does not have."""
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        connected = self.dispatcher.bus.nc.is_connected
        if service == "":
            return serving if connected else not_serving
        if service == SERVICE_NAME:
            return serving if connected and self.dispatcher.registry.live() else not_serving
        return None

    async def Check(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        status = self.status(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:  # noqa: N802
        last = None
        while True:
            status = self.status(request.service)
            if status is None:
                status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(WATCH_INTERVAL_S)


class _Undecodable:
    """What a request that does not parse (bad UTF-8 in a string, a truncated message) becomes, so the
    call can answer INVALID_ARGUMENT rather than grpc's UNKNOWN for a deserializer's exception."""

    def __init__(self, error: DecodeError) -> None:
        self.message = f"the request does not parse: {error}"


class RefuseUndecodable(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Every method's request deserializer made lenient (-> _Undecodable) and its behaviour made to
    answer an _Undecodable with INVALID_ARGUMENT."""

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: grpc.HandlerCallDetails
    ) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None or handler.request_streaming:
            return handler
        decode = handler.request_deserializer

        def lenient(data: bytes) -> Any:
            try:
                return decode(data)
            except DecodeError as exc:
                return _Undecodable(exc)

        if handler.unary_stream is not None:
            streamed = handler.unary_stream

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                async for response in streamed(request, context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(
                stream, request_deserializer=lenient, response_serializer=handler.response_serializer)
        unary = handler.unary_unary

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return await unary(request, context)

        return grpc.unary_unary_rpc_method_handler(
            call, request_deserializer=lenient, response_serializer=handler.response_serializer)


async def start_grpc_server(dispatcher: Dispatcher, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Start the gRPC server on host:port (0: a free port); returns it and the bound port."""
    limit = dispatcher.bus.max_payload + 64 * 1024  # room for protobuf framing around a maximal request
    server = grpc.aio.server(
        interceptors=[RefuseUndecodable()],
        options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
    )
    radixserve_pb2_grpc.add_RadixServeServicer_to_server(RadixServeServicer(dispatcher), server)
    health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(dispatcher), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"gRPC could not bind {host}:{port}")
    await server.start()
    return server, bound
