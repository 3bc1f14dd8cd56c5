"""The gateway's gRPC API (proto/radixserve.proto), the standard grpc.health.v1 service and server
reflection.

Generate streams one GenerateResponse per output step, the last with final = true; a request with
logprob_start_len gets its prompt's log-probs (prompt_logprobs) on the one that ends the prefill.
Errors are gRPC statuses mapped from the HTTP ones (400 INVALID_ARGUMENT, 404 NOT_FOUND, 413 RESOURCE_EXHAUSTED,
503 UNAVAILABLE, 504 DEADLINE_EXCEEDED; with API keys 401 UNAUTHENTICATED, 403 PERMISSION_DENIED for a
user key's Abort of another key's request, 429 RESOURCE_EXHAUSTED); a request that does not parse (bad
UTF-8 in a string) is INVALID_ARGUMENT too. A cancelled call (client gone, deadline) aborts its
request on the worker.

Health is grpcio-health-checking's servicer (Check, Watch) with List added, which that package's
servicers leave unimplemented: "" is SERVING while the gateway is connected to NATS, and
"radixserve.v1.RadixServe" when it also has a live worker. The statuses are read from the dispatcher
as each Check or List is answered, and every WATCH_INTERVAL_S while a Watch is open. Reflection
(grpcio-reflection) names the three services and serves their descriptors, so grpcurl and similar
tools need no .proto.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from services.gateway.auth import authorize, current_key
from services.gateway.dispatch import Dispatcher
from services.gateway.errors import GatewayError, bad_request
from services.gateway.generate_spec import GenerateSpec
from services.gateway.metrics import begin_request
from services.gateway.protos import radixserve_pb2, radixserve_pb2_grpc
from shared.protocol import ChatMessage, Sampling, StreamOut, Usage

SERVICE_NAME = radixserve_pb2.DESCRIPTOR.services_by_name["RadixServe"].full_name
HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
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
        logprob_start_len=request.logprob_start_len if request.HasField("logprob_start_len") else None,
        prompt_param=kind,  # text, input_ids or chat
    )


def response_from(rid: str, out: StreamOut) -> Any:
    response = radixserve_pb2.GenerateResponse(rid=rid, text=out.text, token_ids=out.token_ids)
    values, tops = (out.logprobs.values, out.logprobs.top or []) if out.logprobs is not None else ([], [])
    for i, (token_id, logprob) in enumerate(zip(out.token_ids, values)):
        entry = response.logprobs.add(token_id=token_id, logprob=logprob)
        for candidate in tops[i] if i < len(tops) else []:
            entry.top_logprobs.add(token_id=candidate.token_id, logprob=candidate.logprob)
    prompt = out.logprobs.prompt if out.logprobs is not None else None
    if prompt is not None:
        prompt_tops = prompt.top or []
        for i, (token_id, logprob) in enumerate(zip(prompt.token_ids, prompt.values)):
            entry = response.prompt_logprobs.add(token_id=token_id)
            if logprob is not None:  # the first token listed has none
                entry.logprob = logprob
            for candidate in (prompt_tops[i] if i < len(prompt_tops) else None) or []:
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
        (services/gateway/auth.py); the key then counts the request's usage. Starts the call's count."""
        begin_request()
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


class GatewayHealth(health_aio.HealthServicer):  # type: ignore[misc]
    """grpc.health.v1.Health with each service's status taken from the dispatcher (module docstring)."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        super().__init__()
        self.dispatcher = dispatcher
        self.statuses: dict[str, int] = {}  # what was last set, per service: what List answers
        self._watches = 0
        self._refresher: asyncio.Task[None] | None = None

    def current(self) -> dict[str, int]:
        """Every service's ServingStatus as the dispatcher stands now."""
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        connected = self.dispatcher.bus.nc.is_connected
        return {
            "": serving if connected else not_serving,
            SERVICE_NAME: serving if connected and self.dispatcher.registry.live() else not_serving,
        }

    async def refresh(self) -> None:
        """Set each service whose status changed (which wakes its watchers)."""
        for service, status in self.current().items():
            if self.statuses.get(service) != status:
                self.statuses[service] = status
                await self.set(service, status)

    async def _keep_current(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            await self.refresh()

    async def Check(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        await self.refresh()
        return await super().Check(request, context)

    async def List(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        await self.refresh()
        return health_pb2.HealthListResponse(
            statuses={name: health_pb2.HealthCheckResponse(status=status) for name, status in self.statuses.items()}
        )

    async def Watch(self, request: Any, context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        await self.refresh()
        self._watches += 1
        if self._refresher is None:
            self._refresher = asyncio.create_task(self._keep_current(), name="grpc-health")
        try:
            await super().Watch(request, context)
        finally:
            self._watches -= 1
            if self._watches == 0 and self._refresher is not None:
                self._refresher.cancel()
                self._refresher = None


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

        streamed = handler.unary_stream
        if streamed is not None and inspect.isasyncgenfunction(streamed):

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                async for response in streamed(request, context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(
                stream, request_deserializer=lenient, response_serializer=handler.response_serializer)
        # A coroutine: it returns its response, or writes its stream with context.write (health's Watch).
        behaviour = streamed or handler.unary_unary

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return await behaviour(request, context)

        make = grpc.unary_unary_rpc_method_handler if streamed is None else grpc.unary_stream_rpc_method_handler
        return make(call, request_deserializer=lenient, response_serializer=handler.response_serializer)


async def start_grpc_server(dispatcher: Dispatcher, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Start the gRPC server on host:port (0: a free port); returns it and the bound port."""
    limit = dispatcher.bus.max_payload + 64 * 1024  # room for protobuf framing around a maximal request
    server = grpc.aio.server(
        interceptors=[RefuseUndecodable()],
        options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
    )
    radixserve_pb2_grpc.add_RadixServeServicer_to_server(RadixServeServicer(dispatcher), server)
    health = GatewayHealth(dispatcher)
    await health.refresh()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection((SERVICE_NAME, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"gRPC could not bind {host}:{port}")
    await server.start()
    return server, bound
