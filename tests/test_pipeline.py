"""The back half of the service pipeline as real processes on a real nats-server: tokenizer, worker and
detokenizer serving the embedded default model (SmolLM2-135M-Instruct), driven by a fake gateway that
speaks NATS directly. Answers must equal the offline Engine's; every fault leaves the services serving.

One set of processes serves the whole module; the last test stops them with SIGTERM.
"""

from __future__ import annotations

import asyncio
import math
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest

from services.worker.frontend.engine import Engine
from shared.natsd import NatsServer, start_nats_server
from shared.protocol import (
    PROTOCOL_VERSION,
    BatchTokenOut,
    ChatMessage,
    ControlReply,
    GenerateRequest,
    Sampling,
    Subjects,
    WorkerLoad,
    decoder,
    encode,
)
from tests.services_helpers import FakeGateway, ServiceProcess, metric_value, run

WORKER = "w1"
QUESTION = [ChatMessage("user", "What is the capital of France?")]
GREEDY = Sampling(temperature=0.0, max_new_tokens=24)
SUBJECTS = Subjects()


@dataclass
class Pipeline:
    nats: NatsServer
    tokenizer: ServiceProcess
    worker: ServiceProcess
    detokenizer: ServiceProcess
    model_path: Path
    log_dir: Path

    @property
    def services(self) -> list[ServiceProcess]:
        return [self.tokenizer, self.worker, self.detokenizer]


@pytest.fixture(scope="module")
def pipeline(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    log_dir = tmp_path_factory.mktemp("pipeline_logs")
    nats_server = start_nats_server()
    common = ["--nats-url", nats_server.url, "--metrics-port", "0", "--model-path", str(default_model_path)]
    worker_args = ["--worker-id", WORKER, "--max-total-tokens", "8192", "--drain-timeout", "30"]
    services = [
        ServiceProcess.start("tokenizer", common, log_dir),
        ServiceProcess.start("worker", [*common, *worker_args], log_dir),
        ServiceProcess.start("detokenizer", common, log_dir),
    ]
    try:
        for service in services:
            service.wait_ready()
        yield Pipeline(nats_server, *services, default_model_path, log_dir)
    finally:
        for service in services:
            service.kill()
        nats_server.stop()


def test_chat_answer_says_paris_exactly_like_the_offline_engine(pipeline: Pipeline, engine: Engine) -> None:
    async def main() -> object:
        async with await FakeGateway.connect(pipeline.nats.url, "g1") as gateway:
            return await gateway.generate(gateway.tokenize_request("paris", WORKER, sampling=GREEDY, messages=QUESTION))

    result = run(main())
    prompt = engine.apply_chat_template([{"role": m.role, "content": m.content} for m in QUESTION])
    expected = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 24})
    assert "Paris" in result.text
    assert result.text == expected["text"]
    assert result.token_ids == expected["output_ids"]
    assert result.final.usage.prompt_tokens == expected["meta_info"]["prompt_tokens"]
    assert result.final.usage.completion_tokens == len(expected["output_ids"])
    assert {"type": result.finish.type, "matched": result.finish.matched} == expected["meta_info"]["finish_reason"]


def test_stop_string_and_logprobs_match_the_offline_engine(pipeline: Pipeline, engine: Engine) -> None:
    prompt = "The three primary colors are"
    free = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True})
    stop = free["text"][len(free["text"]) // 2 :][:4]
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True, "stop": [stop]}
    expected = engine.generate(prompt, params, return_logprob=True, top_logprobs_num=2)

    async def main() -> object:
        async with await FakeGateway.connect(pipeline.nats.url, "g1") as gateway:
            req = gateway.tokenize_request(
                "stop", WORKER, sampling=Sampling(**params), text=prompt, return_logprob=True, top_logprobs_num=2
            )
            return await gateway.generate(req)

    result = run(main())
    assert result.text == expected["text"] == free["text"][: free["text"].index(stop)]
    assert result.token_ids == expected["output_ids"]
    assert result.finish.type == "stop" and result.finish.matched == stop
    logprobs = [lp for c in result.chunks if c.logprobs for lp in c.logprobs.values]
    assert len(logprobs) == len(expected["output_ids"])
    for got, (want, _, _) in zip(logprobs, expected["meta_info"]["output_token_logprobs"]):
        assert math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-4)
    top = [[t.token_id for t in step] for c in result.chunks if c.logprobs for step in c.logprobs.top or []]
    assert top == [[tid for _, tid, _ in step] for step in expected["meta_info"]["output_top_logprobs"]]
    texts = [t for c in result.chunks if c.logprobs for t in c.logprobs.texts or []]
    assert texts == [engine.tokenizer.decode([t]) for t in result.token_ids]


def test_concurrent_requests_travel_as_one_token_message_per_step_and_one_stream_message_per_gateway(
    pipeline: Pipeline,
) -> None:
    rids = {"a1": "g-a", "a2": "g-a", "b1": "g-b", "b2": "g-b"}
    sampling = Sampling(temperature=0.0, max_new_tokens=12, ignore_eos=True)

    async def main() -> tuple[list[BatchTokenOut], dict[str, FakeGateway], dict[str, object]]:
        watcher = await nats.connect(pipeline.nats.url)
        steps: list[BatchTokenOut] = []
        dec = decoder(BatchTokenOut)

        async def on_step(raw: object) -> None:
            batch = dec.decode(raw.data)  # type: ignore[attr-defined]
            if any(item.rid in rids for item in batch.items):
                steps.append(batch)

        await watcher.subscribe(SUBJECTS.detok(WORKER), cb=on_step)
        await watcher.flush()
        gateways = {gid: await FakeGateway.connect(pipeline.nats.url, gid) for gid in set(rids.values())}
        for i, (rid, gid) in enumerate(rids.items()):
            await gateways[gid].send(gateways[gid].tokenize_request(rid, WORKER, sampling=sampling, text=f"Story {i}:"))
        results = {rid: await gateways[gid].collect(rid) for rid, gid in rids.items()}
        await watcher.flush()
        await watcher.close()
        for gateway in gateways.values():
            await gateway.nc.close()
        return steps, gateways, results

    steps, gateways, results = run(main())
    assert all(len(r.token_ids) == 12 for r in results.values())  # type: ignore[attr-defined]
    for batch in steps:
        assert len({item.rid for item in batch.items}) == len(batch.items)
    assert max(len(batch.items) for batch in steps) == 4
    assert len(steps) < 4 * 12
    for gid, gateway in gateways.items():
        steps_with_gateway = [b for b in steps if any(item.gateway_id == gid for item in b.items)]
        assert len(gateway.messages) == len(steps_with_gateway)
        assert all(rids[item.rid] == gid for m in gateway.messages for item in m.items)


def test_a_request_not_streamed_travels_as_its_first_token_and_one_final_with_the_engines_answer(
    pipeline: Pipeline, engine: Engine
) -> None:
    prompt = "List the planets of the solar system:"
    params = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    expected = engine.generate(prompt, params, return_logprob=True)

    async def main() -> tuple[dict[str, list[object]], dict[str, object]]:
        watcher = await nats.connect(pipeline.nats.url)
        items: dict[str, list[object]] = {"streamed": [], "whole": []}
        dec = decoder(BatchTokenOut)

        async def on_step(raw: object) -> None:
            for item in dec.decode(raw.data).items:  # type: ignore[attr-defined]
                if item.rid in items:
                    items[item.rid].append(item)

        await watcher.subscribe(SUBJECTS.detok(WORKER), cb=on_step)
        await watcher.flush()
        results = {}
        async with await FakeGateway.connect(pipeline.nats.url, "g1") as gateway:
            for rid, stream in (("streamed", True), ("whole", False)):
                req = gateway.tokenize_request(
                    rid, WORKER, sampling=Sampling(**params), text=prompt, return_logprob=True, stream=stream
                )
                results[rid] = await gateway.generate(req)
        await watcher.flush()
        await watcher.close()
        return items, results

    items, results = run(main())
    streamed, whole = results["streamed"], results["whole"]
    for result in (streamed, whole):
        assert result.token_ids == expected["output_ids"]  # type: ignore[attr-defined]
        assert result.text == expected["text"]  # type: ignore[attr-defined]
        logprobs = [lp for c in result.chunks if c.logprobs for lp in c.logprobs.values]  # type: ignore[attr-defined]
        want = [lp for lp, _, _ in expected["meta_info"]["output_token_logprobs"]]
        assert len(logprobs) == 16 and all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(logprobs, want))
        assert result.final.usage.completion_tokens == 16  # type: ignore[attr-defined]
    assert len(items["streamed"]) > 2
    first, final = items["whole"]
    assert first.first and first.finish is None and len(first.token_ids) == 1  # type: ignore[attr-defined]
    assert final.finish is not None and len(final.token_ids) == 15  # type: ignore[attr-defined]
    assert len(whole.chunks) == 2  # type: ignore[attr-defined]


def test_abort_through_control_ends_the_request_and_frees_its_kv_even_before_it_arrives(pipeline: Pipeline) -> None:
    async def main() -> tuple[object, object, object, object]:
        async with await FakeGateway.connect(pipeline.nats.url, "g1") as gateway:
            long = Sampling(temperature=0.0, max_new_tokens=4000, ignore_eos=True)
            await gateway.send(gateway.tokenize_request("long", WORKER, sampling=long, text="Count to ten thousand:"))
            first = await gateway.next_chunk("long")
            busy = await gateway.control(WORKER, "get_info")
            aborted = await gateway.control(WORKER, "abort", "long")
            result = await gateway.collect("long", first=first)
            info = await gateway.control(WORKER, "get_info")
            unknown = await gateway.control(WORKER, "abort", "early")
            # The abort overtook its request: the request ends as soon as it reaches the worker.
            early = await gateway.generate(gateway.tokenize_request("early", WORKER, sampling=long, text="Hi"))
            return busy, aborted, result, (info, unknown, early)

    busy, aborted, result, (info, unknown, early) = run(main())
    assert busy.info.kv_in_use > 0 and busy.info.num_running == 1  # type: ignore[attr-defined]
    assert aborted.ok  # type: ignore[attr-defined]
    assert result.finish.type == "abort" and len(result.token_ids) < 4000  # type: ignore[attr-defined]
    assert info.info.kv_in_use == 0 and info.info.num_running == 0  # type: ignore[attr-defined]
    assert not unknown.ok and "not in flight" in unknown.message  # type: ignore[attr-defined]
    assert early.finish.type == "abort" and early.token_ids == []  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"text": ""}, "empty"),
        ({"messages": []}, "messages"),
        ({"text": "hi", "input_ids": [1, 2]}, "exactly one"),
        ({"input_ids": [5] * 8192}, "input_ids"),  # the model's context is 8192 tokens
        ({"input_ids": [5, 49152]}, "input_ids"),  # its vocabulary is 49152 tokens
        ({"text": "hi", "sampling": Sampling(temperature=-1.0)}, "temperature"),
        ({"text": "hi", "sampling": Sampling(top_p=0.0)}, "top_p"),
        ({"text": "hi", "top_logprobs_num": -1}, "top_logprobs_num"),
    ],
)
def test_tokenizer_refusals_reach_the_gateway_as_error_finals(pipeline: Pipeline, fields: dict, named: str) -> None:
    async def main() -> object:
        async with await FakeGateway.connect(pipeline.nats.url, "g1") as gateway:
            req = gateway.tokenize_request("bad", WORKER, **{"sampling": Sampling(), **fields})
            return await gateway.generate(req, timeout=20)

    result = run(main())
    assert result.finish.type == "error" and named in (result.finish.message or "")
    assert result.token_ids == [] and result.text == ""


@pytest.mark.parametrize(
    ("sampling", "named"),
    [(Sampling(top_k=0), "top_k"), (Sampling(stop_token_ids=[10**6]), "stop_token_ids")],
)
def test_worker_refuses_a_bad_generate_request_with_an_error_final(
    pipeline: Pipeline, sampling: Sampling, named: str
) -> None:
    async def main() -> object:
        async with await FakeGateway.connect(pipeline.nats.url, "g1") as gateway:
            bad = GenerateRequest(v=PROTOCOL_VERSION, rid="direct", gateway_id="g1", input_ids=[1, 2, 3], sampling=sampling)
            await gateway.nc.publish(SUBJECTS.worker_requests(WORKER), encode(bad))
            return await gateway.collect("direct", timeout=20)

    result = run(main())
    assert result.finish.type == "error" and named in (result.finish.message or "")


def test_a_bad_sampling_value_past_the_gateway_is_refused_by_the_worker(pipeline: Pipeline) -> None:
    """The tokenizer trusts the gateway's check of the sampling values (Sampling.validate) and passes
    them on; a publisher that skipped the gateway still gets a clear error final, from the worker."""
    def count(text: str, name: str, status: str) -> float:
        # A labelled counter has no sample before its first use.
        wanted = f'{name}{{model_name="{pipeline.model_path.name}",status="{status}"}} '
        return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(wanted)), 0.0)

    def errors() -> tuple[float, float, float]:
        tokenizer, worker = pipeline.tokenizer.scrape(), pipeline.worker.scrape()
        return (count(tokenizer, "rs_tokenizer_requests_total", "ok"), count(tokenizer, "rs_tokenizer_requests_total", "error"),
                count(worker, "rs_worker_requests_total", "error"))

    async def main() -> object:
        async with await FakeGateway.connect(pipeline.nats.url, "g1") as gateway:
            req = gateway.tokenize_request("past-gateway", WORKER, sampling=Sampling(temperature=-1.0), text="hi")
            return await gateway.generate(req, timeout=20)

    before = errors()
    result = run(main())
    after = errors()
    assert result.finish.type == "error" and "temperature must be >= 0" in (result.finish.message or "")
    assert [b - a for a, b in zip(before, after)] == [1, 0, 1]  # tokenized fine, refused by the worker


def test_malformed_messages_are_dropped_and_every_service_keeps_serving(pipeline: Pipeline) -> None:
    junk = [b"\xc1\xc1 not msgpack", encode(WorkerLoad(PROTOCOL_VERSION, "x", "m", 0, 0, 0.0, 0.0, 1, 1, 0.0))]
    subjects = [SUBJECTS.tokenize, SUBJECTS.worker_requests(WORKER), SUBJECTS.worker_control(WORKER), SUBJECTS.detok(WORKER)]

    async def main() -> object:
        async with await FakeGateway.connect(pipeline.nats.url, "g1") as gateway:
            for subject in subjects:
                for payload in junk:
                    await gateway.nc.publish(subject, payload)
            short = Sampling(temperature=0.0, max_new_tokens=4, ignore_eos=True)
            return await gateway.generate(gateway.tokenize_request("after-junk", WORKER, sampling=short, text="Hello"))

    result = run(main())
    assert result.finish.type == "length" and len(result.token_ids) == 4
    for service, expected in ((pipeline.tokenizer, 2), (pipeline.worker, 4), (pipeline.detokenizer, 2)):
        assert service.log().count("dropped a malformed message") == expected, service.log()[-3000:]


def test_worker_load_arrives_about_every_second(pipeline: Pipeline) -> None:
    async def main() -> list[WorkerLoad]:
        nc = await nats.connect(pipeline.nats.url)
        loads: asyncio.Queue[WorkerLoad] = asyncio.Queue()
        dec = decoder(WorkerLoad)

        async def on_load(raw: object) -> None:
            load = dec.decode(raw.data)  # type: ignore[attr-defined]
            if load.worker_id == WORKER:
                loads.put_nowait(load)

        await nc.subscribe(SUBJECTS.workers_load, cb=on_load)
        got = [await asyncio.wait_for(loads.get(), 5) for _ in range(4)]
        await nc.close()
        return got

    loads = run(main())
    gaps = [b.timestamp - a.timestamp for a, b in zip(loads, loads[1:])]
    assert all(0.5 < gap < 2.0 for gap in gaps), gaps
    assert {(w.model, w.max_total_tokens, w.context_len) for w in loads} == {("SmolLM2-135M-Instruct", 8192, 8192)}
    assert all(0.0 <= w.kv_usage <= 1.0 and 0.0 <= w.cache_hit_rate <= 1.0 for w in loads)


def test_every_service_says_which_event_loop_serves_it(pipeline: Pipeline) -> None:
    # uvloop is installed with the project (and is what RS_EVENT_LOOP=auto picks).
    for service in pipeline.services:
        assert "runs on the uvloop event loop" in service.log(), service.log_path


def test_every_service_serves_its_prometheus_metrics(pipeline: Pipeline) -> None:
    async def main() -> None:
        async with await FakeGateway.connect(pipeline.nats.url, "g1") as gateway:
            short = Sampling(temperature=0.0, max_new_tokens=3, ignore_eos=True)
            text = "Prometheus scrapes every service of the pipeline once a second"
            # The same prompt twice, one after the other: the second is served from the prefix cache.
            for rid in ("metrics-1", "metrics-2"):
                await gateway.generate(gateway.tokenize_request(rid, WORKER, sampling=short, text=text))
            bad = await gateway.generate(gateway.tokenize_request("metrics-bad", WORKER, sampling=short, text=""))
            assert bad.finish.type == "error"  # counted as a tokenizer error
            await gateway.control(WORKER, "get_info")  # refreshes the worker's gauges

    model = f'model_name="{pipeline.model_path.name}"'
    before = pipeline.worker.scrape()
    run(main())
    worker = pipeline.worker.scrape()
    assert metric_value(worker, "rs_worker_generated_tokens_total", model) >= 3
    assert metric_value(worker, "rs_worker_requests_total", f'{model},status="length"') >= 1
    assert metric_value(worker, "rs_worker_running_requests", model) == 0
    assert 0.0 <= metric_value(worker, "rs_worker_kv_usage", model) <= 1.0
    assert 0.0 < metric_value(worker, "rs_worker_cache_hit_rate", model) <= 1.0  # the prompt was asked twice
    # The two requests the worker served, each scheduled once: two queue times, two 'length' finals.
    for name, labels in (("rs_worker_requests_total", f'{model},status="length"'),
                         ("rs_worker_queue_time_seconds_count", model)):
        was = metric_value(before, name, labels) if f"{name}{{{labels}}} " in before else 0.0
        assert metric_value(worker, name, labels) - was == 2, name
    assert metric_value(worker, "rs_worker_max_total_num_tokens", model) == 8192
    assert metric_value(worker, "rs_worker_num_used_tokens", model) == 0  # nothing runs now
    assert metric_value(worker, "rs_worker_retractions_total", model) == 0
    assert metric_value(worker, "rs_worker_gen_throughput", model) >= 0.0
    tokenizer = pipeline.tokenizer.scrape()
    assert metric_value(tokenizer, "rs_tokenizer_message_seconds_count", model) >= 1
    assert metric_value(tokenizer, "rs_tokenizer_requests_total", f'{model},status="ok"') >= 1
    assert metric_value(tokenizer, "rs_tokenizer_requests_total", f'{model},status="error"') >= 1
    detokenizer = pipeline.detokenizer.scrape()
    assert metric_value(detokenizer, "rs_detokenizer_message_seconds_count", model) >= 1
    assert metric_value(detokenizer, "rs_detokenizer_active_requests", model) == 0


def test_a_worker_with_its_own_detokenizer_answers_alike_and_when_killed_sends_no_final(pipeline: Pipeline) -> None:
    """A second worker, detokenizing in-process (so the standalone detokenizer never sees its steps),
    answers exactly like w1; SIGKILLed mid-stream it leaves its request without a final (the gateway's
    cue to report the worker dead) while the tokenizer, the detokenizer and w1 keep serving."""
    common = ["--nats-url", pipeline.nats.url, "--metrics-port", "none", "--model-path", str(pipeline.model_path)]
    args = [*common, "--worker-id", "w2", "--max-total-tokens", "4096", "--with-detokenizer"]
    doomed = ServiceProcess.start("worker", args, pipeline.log_dir, "w2")
    short = Sampling(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    try:
        doomed.wait_ready()

        async def main() -> tuple[object, object, int, bool, object]:
            async with await FakeGateway.connect(pipeline.nats.url, "g1") as gateway:
                on_w2 = await gateway.generate(gateway.tokenize_request("on-w2", "w2", sampling=short, text="Hi there"))
                on_w1 = await gateway.generate(gateway.tokenize_request("on-w1", WORKER, sampling=short, text="Hi there"))
                long = Sampling(temperature=0.0, max_new_tokens=4000, ignore_eos=True)
                await gateway.send(gateway.tokenize_request("doomed", "w2", sampling=long, text="Count:"))
                await gateway.next_chunk("doomed")
                doomed.kill()
                try:
                    await gateway.collect("doomed", timeout=2)
                    final_seen = True
                except asyncio.TimeoutError:
                    final_seen = False
                duplicates = gateway.pending("on-w2")
                after = await gateway.generate(gateway.tokenize_request("survivor", WORKER, sampling=short, text="Hi"))
                return on_w2, on_w1, duplicates, final_seen, after

        on_w2, on_w1, duplicates, final_seen, after = run(main())
    finally:
        doomed.kill()
    assert (on_w2.text, on_w2.token_ids) == (on_w1.text, on_w1.token_ids)  # type: ignore[attr-defined]
    assert duplicates == 0
    assert not final_seen
    assert after.finish.type == "length" and len(after.token_ids) == 8  # type: ignore[attr-defined]
    assert all(s.proc.poll() is None for s in pipeline.services)


def test_a_worker_with_a_scheduler_process_reads_its_outputs_on_the_event_loop(pipeline: Pipeline) -> None:
    """--scheduler-process (the CUDA default): the scheduler's outbox is read by the worker's event loop,
    not a dispatcher thread. Streamed tokens, the final, control replies (get_info, flush_cache) and the
    drain on SIGTERM all come through it, and the answer is w1's (a scheduler thread). w3 busy-polls
    (--busy-poll-ms), which changes when its loop looks for work, not what it does."""
    common = ["--nats-url", pipeline.nats.url, "--metrics-port", "none", "--model-path", str(pipeline.model_path)]
    args = [*common, "--worker-id", "w3", "--max-total-tokens", "4096", "--with-detokenizer", "--scheduler-process",
            "--drain-timeout", "30", "--busy-poll-ms", "100"]
    worker = ServiceProcess.start("worker", args, pipeline.log_dir, "w3")
    sampling = Sampling(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    try:
        worker.wait_ready()
        assert "the scheduler's outputs reach the event loop from its process's pipe" in worker.log()
        assert "busy-polls for 100 ms after each message or request" in worker.log()

        async def main() -> tuple[object, object, ControlReply, ControlReply, object]:
            async with await FakeGateway.connect(pipeline.nats.url, "g1") as gateway:
                on_w3 = await gateway.generate(gateway.tokenize_request("on-w3", "w3", sampling=sampling, messages=QUESTION))
                on_w1 = await gateway.generate(gateway.tokenize_request("on-w1-3", WORKER, sampling=sampling, messages=QUESTION))
                info = await gateway.control("w3", "get_info")
                flushed = await gateway.control("w3", "flush_cache")
                # SIGTERM with a request running: it finishes through the loop's reader, then w3 exits 0.
                long = Sampling(temperature=0.0, max_new_tokens=40, ignore_eos=True)
                await gateway.send(gateway.tokenize_request("draining", "w3", sampling=long, text="Once upon a time"))
                first = await gateway.next_chunk("draining")
                worker.proc.send_signal(signal.SIGTERM)
                drained = await gateway.collect("draining", first=first)
                return on_w3, on_w1, info, flushed, drained

        on_w3, on_w1, info, flushed, drained = run(main())
        assert worker.proc.wait(timeout=60) == 0
    finally:
        worker.kill()
    assert (on_w3.text, on_w3.token_ids) == (on_w1.text, on_w1.token_ids)  # type: ignore[attr-defined]
    assert len(on_w3.token_ids) == 12  # type: ignore[attr-defined]
    assert info.ok and info.info is not None and info.info.max_total_tokens == 4096
    assert flushed.ok
    assert drained.finish.type == "length" and len(drained.token_ids) == 40  # type: ignore[attr-defined]


def test_sigterm_lets_running_requests_finish_refuses_new_ones_and_every_service_exits_0(pipeline: Pipeline) -> None:
    """Runs last: it stops the module's services."""

    async def main() -> tuple[object, object]:
        async with await FakeGateway.connect(pipeline.nats.url, "g1") as gateway:
            running = Sampling(temperature=0.0, max_new_tokens=40, ignore_eos=True)
            await gateway.send(gateway.tokenize_request("running", WORKER, sampling=running, text="Once upon a time"))
            first = await gateway.next_chunk("running")
            pipeline.worker.proc.send_signal(signal.SIGTERM)
            while "SIGTERM received" not in pipeline.worker.log():
                await asyncio.sleep(0.05)
            late = await gateway.generate(gateway.tokenize_request("late", WORKER, sampling=running, text="Hi"))
            return await gateway.collect("running", first=first), late

    finished, late = run(main())
    assert finished.finish.type == "length" and len(finished.token_ids) == 40  # type: ignore[attr-defined]
    assert late.finish.type == "error" and "shutting down" in (late.finish.message or "")  # type: ignore[attr-defined]
    assert pipeline.worker.terminate() == 0
    assert pipeline.tokenizer.terminate() == 0
    assert pipeline.detokenizer.terminate() == 0
    for service in pipeline.services:
        assert f"{service.service} stopped" in service.log()


def test_prompt_size_decides_what_is_tokenized_on_an_event_loop() -> None:
    from shared.prompt_tokenizer import INLINE_TOKENIZE_CHARS, is_quick, prompt_chars
    from shared.protocol import ChatMessage, Sampling, TokenizeRequest

    def request(**prompt: object) -> TokenizeRequest:
        return TokenizeRequest(v=PROTOCOL_VERSION, rid="r", gateway_id="g", worker_id="w", sampling=Sampling(), **prompt)

    chat = [ChatMessage("system", "Be brief."), ChatMessage("user", "x" * 90)]
    assert prompt_chars(request(text="abc")) == 3
    assert prompt_chars(request(messages=chat)) == len("system") + 9 + len("user") + 90
    assert prompt_chars(request(input_ids=[1] * 50_000)) == 0
    assert is_quick(request(input_ids=[1] * 50_000), max_chars=0)  # ids are never costly
    assert is_quick(request(text="x" * INLINE_TOKENIZE_CHARS))
    assert not is_quick(request(text="x" * (INLINE_TOKENIZE_CHARS + 1)))
    assert is_quick(request(messages=chat), max_chars=109) and not is_quick(request(messages=chat), max_chars=108)
