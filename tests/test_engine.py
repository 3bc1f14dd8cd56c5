"""The offline Engine end to end on tiny seeded checkpoints: outputs match transformers, and every
scheduling path (chunking, prefix hits, batching, retraction) gives the same greedy tokens."""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from services.worker.frontend.engine import Engine
from tests.engine_helpers import GREEDY, hf_greedy, hf_model, output_ids, random_prompts


@pytest.fixture(params=["qwen3", "qwen3_moe", "llama"])
def any_model(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"{request.param}_path")


def generate_ids(path: Path, prompts: list[list[int]], n: int = 16, **engine_kwargs: object) -> list[list[int]]:
    with Engine(str(path), **engine_kwargs) as engine:
        return output_ids(engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": n}))


def test_greedy_matches_transformers_for_32_steps(any_model: Path) -> None:
    prompts = random_prompts(3, 5, 30, seed=1)
    ours = generate_ids(any_model, prompts, n=32)
    for prompt, got in zip(prompts, ours):
        assert got == hf_greedy(any_model, prompt, 32)


@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_chunked_prefill_matches_unchunked(qwen3_path: Path, chunk: int) -> None:
    prompts = random_prompts(4, 10, 40, seed=2)
    assert generate_ids(qwen3_path, prompts, chunked_prefill_size=chunk) == generate_ids(
        qwen3_path, prompts, chunked_prefill_size=None
    )


def test_prefix_cache_hits_give_the_same_tokens_as_no_cache(qwen3_path: Path) -> None:
    shared = random_prompts(1, 24, 24, seed=3)[0]
    prompts = random_prompts(6, 2, 8, seed=4, prefix=shared)
    params = {**GREEDY, "max_new_tokens": 12}
    with Engine(str(qwen3_path)) as engine:
        first = engine.generate(input_ids=prompts[0], sampling_params=params)
        rest = engine.generate(input_ids=prompts[1:], sampling_params=params)
        again = engine.generate(input_ids=prompts[0], sampling_params=params)
    assert first["meta_info"]["cached_tokens"] == 0
    assert all(r["meta_info"]["cached_tokens"] >= len(shared) for r in rest)
    # The whole prompt (but its last token) and the generated tokens were cached by the first run.
    assert again["meta_info"]["cached_tokens"] == len(prompts[0]) - 1
    cached = output_ids([first, *rest])
    assert again["output_ids"] == first["output_ids"]
    assert cached == generate_ids(qwen3_path, prompts, n=12, disable_radix_cache=True)


def test_request_batched_with_15_others_matches_alone(qwen3_moe_path: Path) -> None:
    prompts = random_prompts(16, 3, 40, seed=5)
    batched = generate_ids(qwen3_moe_path, prompts, n=20)
    alone = generate_ids(qwen3_moe_path, prompts[7:8], n=20)
    assert batched[7] == alone[0]


def test_small_pool_retracts_and_still_finishes_every_request_identically(llama_path: Path) -> None:
    prompts = random_prompts(16, 10, 20, seed=6)
    ample = generate_ids(llama_path, prompts, n=40)
    with Engine(str(llama_path), max_total_tokens=160) as engine:
        small = output_ids(engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 40}))
        stats = engine.get_server_info()["stats"]
    assert stats["num_retractions"] > 0
    assert small == ample


def test_scheduler_in_its_own_process_matches_the_thread(qwen3_path: Path) -> None:
    """scheduler_process (the CUDA default at tp_size 1) runs the loop in a spawned process: same
    tokens, same stats and controls as the thread the CPU uses."""
    prompts = random_prompts(6, 5, 30, seed=9)
    before = set(threading.enumerate())
    with Engine(str(qwen3_path), scheduler_process=True) as engine:
        ids = output_ids(engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 12}))
        info = engine.get_server_info()
        assert engine.flush_cache()
        readers = [t for t in set(threading.enumerate()) - before if t.name == "radixserve-outputs"]
    # Shut down means the thread reading the scheduler's queue has stopped (none is left for exit).
    assert len(readers) == 1 and not readers[0].is_alive()
    assert ids == generate_ids(qwen3_path, prompts, n=12)
    assert info["stats"]["generated_tokens"] == 6 * 12 and info["kv_in_use"] == 0
    assert info["scheduler_pid"] != os.getpid()


def test_tensor_parallel_2_matches_1(qwen3_moe_path: Path) -> None:
    prompts = random_prompts(4, 5, 25, seed=7)
    assert generate_ids(qwen3_moe_path, prompts, tp_size=2) == generate_ids(qwen3_moe_path, prompts)


class TestSeeds:
    PARAMS = {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True}

    def test_same_seed_same_tokens_alone_and_in_a_mixed_batch(self, qwen3_path: Path) -> None:
        prompt = random_prompts(1, 10, 10, seed=8)[0]
        others = random_prompts(5, 3, 30, seed=9)
        with Engine(str(qwen3_path)) as engine:
            alone = engine.generate(input_ids=prompt, sampling_params={**self.PARAMS, "seed": 42})
            mixed = engine.generate(
                input_ids=[*others[:2], prompt, *others[2:]],
                sampling_params=[
                    {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 9},
                    {"temperature": 0.0, "max_new_tokens": 20},
                    {**self.PARAMS, "seed": 42},
                    {"temperature": 1.3, "top_k": 5, "max_new_tokens": 16},
                    {"temperature": 1.0, "repetition_penalty": 1.2, "max_new_tokens": 4},
                    {"temperature": 1.0, "seed": 7, "max_new_tokens": 30},
                ],
            )
        assert mixed[2]["output_ids"] == alone["output_ids"]

    def test_different_seeds_give_different_tokens(self, qwen3_path: Path) -> None:
        prompt = random_prompts(1, 10, 10, seed=8)[0]
        with Engine(str(qwen3_path)) as engine:
            runs = [
                engine.generate(input_ids=prompt, sampling_params={**self.PARAMS, "seed": s})["output_ids"]
                for s in (1, 2, 3)
            ]
        assert len({tuple(r) for r in runs}) == 3


class TestFinishing:
    def test_max_new_tokens_gives_length(self, qwen3_path: Path) -> None:
        with Engine(str(qwen3_path)) as engine:
            out = engine.generate(input_ids=[5, 6, 7], sampling_params={**GREEDY, "max_new_tokens": 5})
            # Every generated token is in the text, the last one too.
            assert out["text"] == engine.tokenizer.decode(out["output_ids"], skip_special_tokens=True)
        assert len(out["output_ids"]) == 5
        assert out["meta_info"]["finish_reason"] == {"type": "length", "matched": 5}
        assert out["meta_info"]["completion_tokens"] == 5 and out["meta_info"]["prompt_tokens"] == 3

    def test_stop_token_ids_end_the_request_after_min_new_tokens(self, qwen3_path: Path) -> None:
        prompt = [5, 6, 7, 8]
        with Engine(str(qwen3_path)) as engine:
            free = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 12})["output_ids"]
            stop_at = free[3]
            first = free.index(stop_at)
            out = engine.generate(
                input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 12, "stop_token_ids": [stop_at]}
            )
            assert out["output_ids"] == free[: first + 1]
            assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
            later = engine.generate(
                input_ids=prompt,
                sampling_params={**GREEDY, "max_new_tokens": 12, "stop_token_ids": [stop_at], "min_new_tokens": 6},
            )
        # Before min_new_tokens the stop token cannot be sampled, so the run diverges or goes on.
        assert len(later["output_ids"]) >= 6
        assert stop_at not in later["output_ids"][:6]

    def test_eos_stops_unless_ignore_eos(self, qwen3_path: Path) -> None:
        prompt = [9, 10, 11]
        with Engine(str(qwen3_path)) as engine:
            free = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 40})
            # The checkpoint's EOS ids come from config.json and generation_config.json.
            eos_ids = set(engine.model_config.eos_token_ids)
            hits = [i for i, t in enumerate(free["output_ids"]) if t in eos_ids]
            honoured = engine.generate(
                input_ids=prompt, sampling_params={"temperature": 0.0, "max_new_tokens": 40}
            )
        if hits:
            assert honoured["output_ids"] == free["output_ids"][: hits[0] + 1]
            assert honoured["meta_info"]["finish_reason"]["type"] == "stop"
        else:
            assert honoured["output_ids"] == free["output_ids"]

    def test_stop_string_cuts_the_text_and_stops(self, qwen3_path: Path) -> None:
        with Engine(str(qwen3_path)) as engine:
            prompt = "The capital of France is"
            free = engine.generate(prompt, {**GREEDY, "max_new_tokens": 24})
            text = free["text"]
            assert len(text) > 8
            stop = text[len(text) // 2 : len(text) // 2 + 3]
            cut = engine.generate(prompt, {**GREEDY, "max_new_tokens": 24, "stop": [stop]})
        assert cut["text"] == text[: text.index(stop)]
        assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert len(cut["output_ids"]) < len(free["output_ids"])

    def test_max_new_tokens_zero_returns_nothing(self, qwen3_path: Path) -> None:
        with Engine(str(qwen3_path)) as engine:
            out = engine.generate(input_ids=[4, 5], sampling_params={"max_new_tokens": 0})
        assert out["output_ids"] == [] and out["text"] == ""


def test_logprobs_equal_transformers_log_softmax(llama_path: Path) -> None:
    prompt = random_prompts(1, 12, 12, seed=10)[0]
    with Engine(str(llama_path)) as engine:
        out = engine.generate(
            input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 6}, return_logprob=True, top_logprobs_num=3
        )
    ids = torch.tensor([prompt + out["output_ids"]])
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(str(llama_path))(ids).logits[0].float(), dim=-1)
    for step, (lp, tid, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        expected = ref[len(prompt) - 1 + step]
        assert math.isclose(lp, expected[tid].item(), rel_tol=1e-4, abs_tol=1e-4)
        top = out["meta_info"]["output_top_logprobs"][step]
        assert [t for _, t, _ in top] == expected.topk(3).indices.tolist()
        assert top[0][1] == tid


def test_logit_bias_matches_transformers_single_token_sequence_bias(qwen3_path: Path) -> None:
    """OpenAI's logit_bias is transformers' sequence_bias of one-token sequences: the same greedy
    tokens. The biases push the unbiased answer's first tokens out and lift others; a request without
    a bias in the same batch gets the unbiased answer."""
    prompts = random_prompts(2, 6, 12, seed=21)
    plain = [hf_greedy(qwen3_path, prompt, 12) for prompt in prompts]
    bias = {plain[0][0]: -100.0, plain[0][1]: -100.0, plain[0][4]: -3.0, 40: 2.0, 41: 5.0}
    model = hf_model(str(qwen3_path))
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        ref = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12, do_sample=False,
            pad_token_id=0, sequence_bias=[[[tid], value] for tid, value in bias.items()],
        )[0, len(prompts[0]):].tolist()
    assert ref != plain[0]
    with Engine(str(qwen3_path)) as engine:
        biased = {**GREEDY, "max_new_tokens": 12, "logit_bias": {str(t): v for t, v in bias.items()}}
        out = output_ids(engine.generate(input_ids=prompts, sampling_params=[biased, {**GREEDY, "max_new_tokens": 12}]))
        with pytest.raises(ValueError, match="logit_bias for token 3 must be a number in"):
            engine.generate(input_ids=prompts[0], sampling_params={"logit_bias": {3: -101}})
    assert out == [ref, plain[1]]


def test_streaming_chunks_add_up_to_the_full_text(llama_path: Path) -> None:
    params = {**GREEDY, "max_new_tokens": 20}
    with Engine(str(llama_path)) as engine:
        whole = engine.generate("hello world", params)
        chunks = list(engine.generate("hello world", params, stream=True))

        async def collect() -> list[dict]:
            stream = await engine.async_generate("hello world", params, stream=True)
            return [c async for c in stream]

        achunks = asyncio.run(collect())
    for got in (chunks, achunks):
        assert "".join(c["text"] for c in got) == whole["text"]
        assert sum((c["output_ids"] for c in got), []) == whole["output_ids"]
        assert got[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]


def test_abort_ends_a_running_request_and_frees_its_kv(qwen3_path: Path) -> None:
    with Engine(str(qwen3_path)) as engine:
        result: dict = {}
        worker = threading.Thread(
            target=lambda: result.update(
                engine.generate(input_ids=[3, 4, 5], sampling_params={**GREEDY, "max_new_tokens": 200}, rid="long")
            )
        )
        worker.start()
        while engine.get_server_info()["num_running"] == 0:
            pass
        engine.abort("long")
        worker.join(timeout=30)
        info = engine.get_server_info()
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(result["output_ids"]) < 200
    assert info["num_running"] == 0 and info["kv_in_use"] == 0


def test_flush_cache_empties_the_prefix_cache(qwen3_path: Path) -> None:
    with Engine(str(qwen3_path)) as engine:
        engine.generate(input_ids=[3, 4, 5, 6], sampling_params={**GREEDY, "max_new_tokens": 4})
        assert engine.get_server_info()["kv_cached"] > 0
        assert engine.flush_cache() is True
        info = engine.get_server_info()
        again = engine.generate(input_ids=[3, 4, 5, 6], sampling_params={**GREEDY, "max_new_tokens": 4})
    assert info["kv_cached"] == 0 and info["kv_free"] == info["max_total_tokens"]
    assert again["meta_info"]["cached_tokens"] == 0


def test_requests_sharing_a_prefix_in_one_batch_compute_it_once(qwen3_path: Path) -> None:
    shared = random_prompts(1, 40, 40, seed=12)[0]
    prompts = random_prompts(6, 3, 9, seed=13, prefix=shared)
    with Engine(str(qwen3_path)) as engine:
        out = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 6})
    cached = [r["meta_info"]["cached_tokens"] for r in out]
    # The first computes the shared prefix; the others wait a step and reuse its KV.
    assert cached[0] == 0 and all(c >= len(shared) for c in cached[1:])
    assert output_ids(out) == generate_ids(qwen3_path, prompts, n=6, disable_radix_cache=True)


@pytest.mark.parametrize(
    "options",
    [{}, {"chunked_prefill_size": 5}, {"max_total_tokens": 160}, {"enable_mixed_chunk": True, "chunked_prefill_size": 8}],
    ids=["plain", "chunked", "retracting", "mixed"],
)
def test_overlap_schedule_gives_the_same_tokens(llama_path: Path, options: dict) -> None:
    """Overlap (forced on, on the CPU) launches step N+1 before reading step N's tokens back."""
    prompts = random_prompts(16, 10, 20, seed=14)
    params = [
        {**GREEDY, "max_new_tokens": 30} if i % 2 else
        {"temperature": 0.9, "top_k": 20, "max_new_tokens": 25, "seed": i, "frequency_penalty": 0.5, "min_new_tokens": 5}
        for i in range(len(prompts))
    ]
    runs = []
    for overlap in (False, True):
        with Engine(str(llama_path), disable_overlap_schedule=not overlap, **options) as engine:
            runs.append(output_ids(engine.generate(input_ids=prompts, sampling_params=params)))
    assert runs[1] == runs[0]


def test_tensor_parallel_2_with_the_triton_backend_matches_1(qwen3_path: Path) -> None:
    # The GPU path's pieces over two ranks (gloo, Triton's interpreter on the CPU): heads split per
    # rank, the fused q/k-norm + rotary + KV-store launch and the one-launch decode, against TP=1 on
    # the torch backend.
    prompts = random_prompts(3, 5, 20, seed=11)
    reference = generate_ids(qwen3_path, prompts, n=8)
    assert generate_ids(qwen3_path, prompts, n=8, tp_size=2, attention_backend="triton") == reference
    assert generate_ids(qwen3_path, prompts, n=8, attention_backend="triton") == reference


def test_an_async_caller_that_leaves_early_does_not_stop_the_engine(qwen3_path: Path) -> None:
    """A stream abandoned when its event loop closes still gets outputs (and its final one) from the
    scheduler: they are dropped, and the engine keeps serving everyone else."""

    async def first_chunk(engine: Engine) -> dict:
        stream = await engine.async_generate(
            input_ids=[5, 6, 7], sampling_params={**GREEDY, "max_new_tokens": 40}, stream=True
        )
        async for chunk in stream:
            return chunk
        raise AssertionError("no chunk")

    with Engine(str(qwen3_path)) as engine:
        asyncio.run(first_chunk(engine))  # the loop closes with the request still running
        pool = ThreadPoolExecutor(1)  # a dead dispatcher would leave generate waiting forever
        try:
            call = pool.submit(engine.generate, input_ids=[5, 6, 7], sampling_params={**GREEDY, "max_new_tokens": 8})
            after = call.result(timeout=20)
        finally:
            pool.shutdown(wait=False)
        alone = generate_ids(qwen3_path, [[5, 6, 7]], n=8)
    assert after["output_ids"] == alone[0]


def test_a_script_without_a_main_guard_gets_a_clear_error_not_a_hang(qwen3_path: Path, tmp_path: Path) -> None:
    """The scheduler process is spawned, and spawning re-runs the script's top level: an Engine made
    there cannot start its scheduler. The parent says so as soon as the process dies."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from services.worker.frontend.engine import Engine\n"
        f"engine = Engine({str(qwen3_path)!r}, scheduler_process=True)\n"
        "print('started')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0 and "started" not in done.stdout
    assert 'if __name__ == "__main__":' in done.stderr and "exited during start-up" in done.stderr


def test_inline_outputs_come_from_the_scheduler_thread_with_the_same_tokens(qwen3_path: Path) -> None:
    """outputs_inline (the worker service's choice): a scheduler thread hands each step's outputs to
    the callback itself, no dispatcher wake-up between; the tokens are the queued path's, and control
    replies still arrive."""
    from services.worker.config import EngineConfig
    from services.worker.frontend.scheduler_client import SchedulerClient

    prompts = random_prompts(3, 5, 30, seed=11)

    def run(inline: bool) -> tuple[dict[str, list[int]], set[str], dict]:
        tokens: dict[str, list[int]] = {}
        threads: set[str] = set()
        done = threading.Event()

        def on_outputs(outputs: list) -> None:
            threads.add(threading.current_thread().name)
            for out in outputs:
                tokens.setdefault(out.rid, []).extend(out.token_ids)
                if out.finished_reason is not None and len(tokens) == len(prompts):
                    if all(len(t) == 8 for t in tokens.values()):
                        done.set()

        config = EngineConfig.from_kwargs(str(qwen3_path), scheduler_process=False)
        client = SchedulerClient(config, on_outputs, lambda message: None, outputs_inline=inline)
        try:
            for i, ids in enumerate(prompts):
                (req,) = client.build_reqs(ids, {**GREEDY, "max_new_tokens": 8}, rid=f"r{i}")
                client.add(req)
            assert done.wait(60)
            info = client.control("get_info")
        finally:
            client.shutdown()
        return tokens, threads, info

    inline_tokens, inline_threads, info = run(True)
    queued_tokens, queued_threads, _ = run(False)
    assert inline_threads == {"radixserve-scheduler"} and queued_threads == {"radixserve-outputs"}
    assert inline_tokens == queued_tokens == {f"r{i}": ids for i, ids in enumerate(generate_ids(qwen3_path, prompts, n=8))}
    assert info["stats"]["generated_tokens"] == 3 * 8


def test_a_scheduler_process_s_outputs_can_be_read_on_an_event_loop(qwen3_path: Path) -> None:
    """outputs_loop (the worker service's choice with a scheduler process): the outbox is read by a
    reader on the asyncio loop, no dispatcher thread; outputs arrive on the loop's thread with the
    dispatcher's tokens, control replies too, and shutdown ends the reading."""
    import asyncio

    from services.worker.config import EngineConfig
    from services.worker.frontend.scheduler_client import SchedulerClient

    prompts = random_prompts(3, 5, 30, seed=12)

    async def main() -> tuple[dict[str, list[int]], set[int], dict, set[str]]:
        loop = asyncio.get_running_loop()
        tokens: dict[str, list[int]] = {}
        threads: set[int] = set()
        done = asyncio.Event()

        def on_outputs(outputs: list) -> None:
            threads.add(threading.get_ident())
            for out in outputs:
                tokens.setdefault(out.rid, []).extend(out.token_ids)
            if len(tokens) == len(prompts) and all(len(t) == 8 for t in tokens.values()):
                done.set()

        before = set(threading.enumerate())
        config = EngineConfig.from_kwargs(str(qwen3_path), scheduler_process=True)
        client = await asyncio.to_thread(SchedulerClient, config, on_outputs, lambda message: None, outputs_loop=loop)
        started = {t.name for t in set(threading.enumerate()) - before}
        try:
            for i, ids in enumerate(prompts):
                (req,) = client.build_reqs(ids, {**GREEDY, "max_new_tokens": 8}, rid=f"l{i}")
                client.add(req)
            await asyncio.wait_for(done.wait(), 60)
            info = await asyncio.to_thread(client.control, "get_info")
        finally:
            await asyncio.to_thread(client.shutdown)
        return tokens, threads, info, started

    tokens, threads, info, started = asyncio.run(main())
    assert "radixserve-outputs" not in started
    assert threads == {threading.get_ident()}  # asyncio.run's loop runs on this thread
    assert tokens == {f"l{i}": ids for i, ids in enumerate(generate_ids(qwen3_path, prompts, n=8))}
    assert info["stats"]["generated_tokens"] == 3 * 8
