"""Gateway test support: a gateway served from a background thread, and FakePipeline, a scripted
stand-in for tokenizer + workers + detokenizer that speaks the real protocol on a real nats-server.

FakePipeline "generates" by echoing the prompt's words, one word per step:
- text (or the last chat message, or input ids as `t<id>`) -> one token per word, text "<word> ";
  finish "stop" after the last word, "length" at max_new_tokens, or "stop" matched on a stop string
  (the matching word is not emitted);
- a prompt starting with "ERROR" is refused like a tokenizer refusing it (error final);
- a prompt starting with "DOWN" ends with a worker's error final marked 503 (a worker shutting down);
- a prompt starting with "HANG" emits one word and then waits until it is aborted (abort final) or its
  worker is killed (nothing more, as a crashed worker);
- a prompt starting with "SILENT" is taken by the worker and never produces anything;
- a prompt seen before reports all but its last token as cached.
Logprobs: token i has logprob -(i + 1) / 10; top candidates are ids 0..k-1 with texts "c<j>".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
import uuid
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import nats
from nats.aio.msg import Msg

from services.gateway.config import GatewayConfig
from services.gateway.service import GatewayService
from shared.bus import Bus
from shared.protocol import (
    PROTOCOL_VERSION,
    BatchStreamOut,
    ControlReply,
    ControlRequest,
    Finish,
    GenerateRequest,
    Logprobs,
    NatsGenerateChunk,
    NatsGenerateRequest,
    StreamOut,
    TokenizeRequest,
    TopLogprob,
    Usage,
    WorkerInfo,
    WorkerLoad,
)

T = TypeVar("T")

FAKE_MODEL = "fake-model"
FAKE_CONTEXT = 64
LOAD_INTERVAL_S = 0.2


class LoopThread:
    """An asyncio event loop running in a daemon thread; `run` executes a coroutine on it."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()  # its selector and self-pipe, else left to the garbage collector


class GatewayThread:
    """A full GatewayService (HTTP, gRPC, NATS front door) on free ports, in its own thread."""

    def __init__(self, nats_url: str, **overrides: Any) -> None:
        values: dict[str, Any] = {"nats_url": nats_url, "port": 0, "grpc_port": 0, "drain_timeout": 2.0}
        self.config = GatewayConfig(**{**values, **overrides})
        self.service = GatewayService(self.config)
        self.thread = LoopThread(f"gateway-{self.config.gateway_id}")
        try:
            self.thread.run(self.service.start())
        except BaseException:
            self.close()  # what it started (its NATS connection) and its thread, before the error goes on
            raise

    @property
    def url(self) -> str:
        return self.service.url

    @property
    def grpc_target(self) -> str:
        return f"{self.config.host}:{self.service.grpc_port}"

    def close(self) -> None:
        try:
            self.thread.run(self.service.drain(), timeout=30)
        finally:
            self.thread.close()


@dataclass
class FakeRequest:
    """One request the fake pipeline is serving."""

    msg: TokenizeRequest
    words: list[str]
    aborted: asyncio.Event = field(default_factory=asyncio.Event)


class FakePipeline:
    """Tokenizer, workers and detokenizer in one scripted NATS client (see the module docstring)."""

    def __init__(
        self,
        nats_url: str,
        workers: tuple[str, ...] = ("w1",),
        prefix: str = "rs",
        step_s: float = 0.01,
        with_tokenizer: bool = True,
        progress: bool = False,
    ) -> None:
        self.nats_url = nats_url
        self.with_tokenizer = with_tokenizer
        self.prefix = prefix
        self.step_s = step_s
        self.alive = {wid: True for wid in workers}
        self.requests: list[TokenizeRequest] = []
        self.aborts: list[tuple[str, str]] = []
        self.controls: list[tuple[str, str]] = []
        self.running: dict[str, dict[str, FakeRequest]] = {wid: {} for wid in workers}
        self.seen_prompts: set[str] = set()
        self.refuse_flush = False
        self.down_status = 503  # the status a "DOWN" prompt's error final carries
        self.subscriptions: dict[str, list[Any]] = {}
        # Each worker's process id, and whether its reports show its step count moving.
        self.instances = {wid: "first" for wid in workers}
        self.progress = progress
        self.steps = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self.thread = LoopThread("fake-pipeline")
        self.thread.run(self._start())

    async def _start(self) -> None:
        self.bus = await Bus.connect(self.nats_url, "fake-pipeline", self.prefix)
        if self.with_tokenizer:
            await self.bus.subscribe(
                self.bus.subjects.tokenize, (TokenizeRequest,), self._on_tokenize, queue="tokenizer"
            )
        for wid in self.alive:
            self.subscriptions[wid] = [
                await self.bus.subscribe(self.bus.subjects.worker_control(wid), (ControlRequest,), self._control_handler(wid)),
                await self.bus.subscribe(self.bus.subjects.worker_requests(wid), (GenerateRequest,), self._generate_handler(wid)),
            ]
        self._loads = asyncio.create_task(self._publish_loads())
        await self._publish_loads_once()

    def close(self) -> None:
        async def stop() -> None:
            for task in [self._loads, *self._tasks]:
                task.cancel()
            await asyncio.gather(self._loads, *self._tasks, return_exceptions=True)
            await self.bus.nc.close()

        self.thread.run(stop())
        self.thread.close()

    def __enter__(self) -> FakePipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def kill_worker(self, worker_id: str) -> None:
        """The worker stops reporting and stepping, without finals, and its subscriptions go (as a
        crashed process's do when its connection closes)."""
        self.alive[worker_id] = False

        async def unsubscribe() -> None:
            for sub in self.subscriptions.pop(worker_id, []):
                await sub.unsubscribe()
            await self.bus.nc.flush()

        self.thread.run(unsubscribe())

    def restart_worker(self, worker_id: str) -> None:
        """A new process under the same id: it reports a new instance and knows no old request."""
        self.instances[worker_id] = uuid.uuid4().hex[:8]
        self.running[worker_id].clear()

    def stall_worker(self, worker_id: str) -> None:
        """The worker stops reporting, stepping and answering, but its process lives (a wedged loop)."""
        self.alive[worker_id] = False

    def in_flight(self, worker_id: str) -> list[str]:
        return list(self.running[worker_id])

    def wait_until(self, predicate: Any, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError("condition not reached in time")
            time.sleep(0.02)

    # ---- NATS side ------------------------------------------------------------------------------

    async def _publish_loads_once(self) -> None:
        self.steps += self.progress
        for wid, alive in self.alive.items():
            if alive:
                load = WorkerLoad(
                    v=PROTOCOL_VERSION, worker_id=wid, model=FAKE_MODEL, num_running=len(self.running[wid]),
                    num_waiting=0, kv_usage=0.0, cache_hit_rate=0.0, max_total_tokens=1000,
                    context_len=FAKE_CONTEXT, timestamp=time.time(), instance=self.instances[wid], steps=self.steps,
                )
                await self.bus.publish(self.bus.subjects.workers_load, load)

    async def _publish_loads(self) -> None:
        while True:
            await asyncio.sleep(LOAD_INTERVAL_S)
            await self._publish_loads_once()

    def _control_handler(self, wid: str) -> Any:
        async def handle(msg: ControlRequest, raw: Msg) -> None:
            if not self.alive[wid]:
                return
            self.controls.append((wid, msg.command))
            reply = ControlReply(v=PROTOCOL_VERSION, ok=True)
            if msg.command == "abort":
                assert msg.rid is not None
                self.aborts.append((wid, msg.rid))
                request = self.running[wid].get(msg.rid)
                if request is not None:
                    request.aborted.set()
                else:
                    reply = ControlReply(v=PROTOCOL_VERSION, ok=False, message=f"no request {msg.rid}")
            elif msg.command == "status":
                if msg.rid not in self.running[wid]:
                    reply = ControlReply(v=PROTOCOL_VERSION, ok=False, message=f"request {msg.rid!r} is not in flight on worker {wid}")
            elif msg.command == "ping":
                reply = ControlReply(v=PROTOCOL_VERSION, ok=True, message=self.instances[wid])
            elif msg.command == "flush_cache":
                reply = ControlReply(v=PROTOCOL_VERSION, ok=not self.refuse_flush)
            elif msg.command == "get_info":
                info = WorkerInfo(
                    worker_id=wid, model=FAKE_MODEL, max_total_tokens=1000, max_running_requests=8,
                    context_len=FAKE_CONTEXT, num_running=len(self.running[wid]), num_waiting=0, kv_free=1000,
                    kv_cached=0, kv_in_use=0, cache_hit_rate=0.0, generated_tokens=0, tp_size=1, device="cpu",
                )
                reply = ControlReply(v=PROTOCOL_VERSION, ok=True, info=info)
            await self.bus.respond(raw, reply)

        return handle

    def _generate_handler(self, wid: str) -> Any:
        """A request that came to worker `wid` already tokenized (the gateway sends prompts of token ids
        straight to the worker): scripted as if the tokenizer had forwarded it."""

        async def handle(msg: GenerateRequest, raw: Msg) -> None:
            if self.alive[wid]:
                await self._on_tokenize(TokenizeRequest(
                    v=msg.v, rid=msg.rid, gateway_id=msg.gateway_id, worker_id=wid, sampling=msg.sampling,
                    input_ids=msg.input_ids, return_logprob=msg.return_logprob,
                    top_logprobs_num=msg.top_logprobs_num, priority=msg.priority, stream=msg.stream,
                    resume_ids=msg.resume_ids, resume_chars=msg.resume_chars,
                ), raw)

        return handle

    async def _on_tokenize(self, msg: TokenizeRequest, raw: Msg) -> None:
        self.requests.append(msg)
        prompt = _prompt_of(msg)
        if prompt.startswith("ERROR"):
            # As the tokenizer service refuses a prompt too long: naming the field it came in.
            field = "text" if msg.text is not None else "messages" if msg.messages is not None else "input_ids"
            await self._send(msg, StreamOut(rid=msg.rid, text="", token_ids=[], finish=Finish(
                type="error", message=f"the prompt has 9999 tokens; the model's context is 64 (`{field}` too long)",
                param=field)))
            return
        if prompt.startswith("DOWN"):
            await self._send(msg, StreamOut(rid=msg.rid, text="", token_ids=[], finish=Finish(
                type="error", message=f"worker {msg.worker_id} is shutting down", status=self.down_status)))
            return
        if prompt.startswith("LOST"):
            return  # dropped on the way: no worker ever holds it
        request = FakeRequest(msg, prompt.split())
        self.running[msg.worker_id][msg.rid] = request
        if prompt.startswith("SILENT"):
            return
        task = asyncio.create_task(self._generate(request, cached=prompt in self.seen_prompts))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self.seen_prompts.add(prompt)

    async def _send(self, msg: TokenizeRequest, out: StreamOut) -> None:
        await self.bus.publish(self.bus.subjects.gateway_stream(msg.gateway_id), BatchStreamOut(v=PROTOCOL_VERSION, items=[out]))

    async def _generate(self, request: FakeRequest, cached: bool) -> None:
        msg, wid = request.msg, request.msg.worker_id
        limit = msg.sampling.max_new_tokens if msg.sampling.max_new_tokens is not None else 128
        stops = msg.sampling.stop or []
        hang = request.words[:1] == ["HANG"]  # a prompt of white space alone has no words
        usage = {"prompt_tokens": len(request.words), "cached_tokens": max(len(request.words) - 1, 0) if cached else 0}
        # A migrated request goes on after the words its client has (one token per word).
        produced = len(msg.resume_ids or [])
        try:
            for i, word in enumerate(request.words):
                if i < produced:
                    continue
                await asyncio.sleep(self.step_s)
                if not self.alive[wid]:
                    return
                if produced == limit:
                    await self._send(msg, _final(msg.rid, Finish(type="length", matched=limit), produced, usage))
                    return
                if word in stops:
                    await self._send(msg, _final(msg.rid, Finish(type="stop", matched=word), produced, usage))
                    return
                produced += 1
                await self._send(msg, _token(msg, i, word))
                if hang:
                    await request.aborted.wait()
                    if self.alive[wid]:
                        await self._send(msg, _final(msg.rid, Finish(type="abort", message="aborted"), produced, usage))
                    return
            await asyncio.sleep(self.step_s)
            if self.alive[wid]:
                await self._send(msg, _final(msg.rid, Finish(type="stop"), produced, usage))
        finally:
            self.running[wid].pop(msg.rid, None)


def _prompt_of(msg: TokenizeRequest) -> str:
    if msg.text is not None:
        return msg.text
    if msg.messages:
        return msg.messages[-1].content
    return " ".join(f"t{i}" for i in msg.input_ids or [])


def _token(msg: TokenizeRequest, index: int, word: str) -> StreamOut:
    out = StreamOut(rid=msg.rid, text=word + " ", token_ids=[100 + index])
    if msg.return_logprob:
        out.logprobs = Logprobs([-(index + 1) / 10], texts=[word + " "])
        if msg.top_logprobs_num:
            out.logprobs.top = [[TopLogprob(j, -(j + 1) / 10) for j in range(msg.top_logprobs_num)]]
            out.logprobs.top_texts = [[f"c{j}" for j in range(msg.top_logprobs_num)]]
    return out


def _final(rid: str, finish: Finish, produced: int, usage: dict[str, int]) -> StreamOut:
    return StreamOut(rid=rid, text="", token_ids=[], finish=finish, usage=Usage(completion_tokens=produced, **usage))


def wait_for_workers(url: str, count: int, timeout: float = 10.0) -> None:
    """Block until the gateway at `url` hears `count` live workers."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).json().get("workers", 0) >= count:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"the gateway at {url} did not see {count} worker(s) within {timeout} s")


def run_in_new_loop(coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
    """Run a coroutine on a fresh event loop in a helper thread (tests are synchronous)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result(timeout)


def nats_generate(nats_url: str, request: NatsGenerateRequest, timeout: float = 120.0) -> list[NatsGenerateChunk]:
    """What a nats-py client of the front door receives for one request on rs.v1.generate: every
    chunk on its reply inbox, up to and including the final one."""

    async def ask() -> list[NatsGenerateChunk]:
        nc = await nats.connect(nats_url)
        try:
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox)
            await nc.publish("rs.v1.generate", msgspec.msgpack.encode(request), reply=inbox)
            chunks = [msgspec.msgpack.decode((await sub.next_msg(timeout=timeout)).data, type=NatsGenerateChunk)]
            while not chunks[-1].final:
                chunks.append(msgspec.msgpack.decode((await sub.next_msg(timeout=timeout)).data, type=NatsGenerateChunk))
            return chunks
        finally:
            await nc.close()

    return asyncio.run(ask())


@contextlib.contextmanager
def serving_gateway(nats_url: str, workers: int = 1, **overrides: Any) -> Iterator[GatewayThread]:
    """A GatewayThread (GatewayConfig overrides) that has heard `workers` live workers; drained on the
    way out."""
    gateway = GatewayThread(nats_url, **overrides)
    try:
        wait_for_workers(gateway.url, workers)
        yield gateway
    finally:
        gateway.close()


@contextlib.contextmanager
def served_by_fake(nats_url: str, **gateway_overrides: Any) -> Iterator[tuple[GatewayThread, FakePipeline]]:
    """A FakePipeline with worker w1 and a GatewayThread (GatewayConfig overrides) that has heard it;
    both closed on the way out."""
    with (
        FakePipeline(nats_url, workers=("w1",)) as pipeline,
        serving_gateway(nats_url, **gateway_overrides) as gateway,
    ):
        yield gateway, pipeline


def openai_client(gateway: GatewayThread) -> Any:
    """The official openai client for `gateway` (no retries, so a failure shows at once)."""
    import openai

    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=15)
