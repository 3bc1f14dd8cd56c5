"""Extend steps through the CUDA-graph runner's padded static-buffer forward give the logits and the KV
pool of plain eager extend steps, and batches no graph takes run eagerly.

CUDA graphs cannot be captured on CPU, so the runner replays by running the forward it would capture
directly: the padding (tokens, requests, the block table's length), the static metadata buffer and the
device-side logits rows are the same as inside a graph. The model is a tiny seeded Qwen3 on the triton
attention backend, under the Triton interpreter, with 16-row query blocks so that requests span several
blocks and the padded block tables hold many unused entries. With --enable-deterministic-inference the
replay must give eager's logits bit for bit (the per-token rows come from the graph's static offsets).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels import extend_attention
from kernels.decode_attention import DecodeTiles
from kernels.extend_attention import ExtendTiles
from services.worker.config import EngineConfig
from services.worker.runtime.attention import triton_backend
from services.worker.runtime.attention.deterministic_triton import DeterministicTritonAttnBackend
from services.worker.runtime.cuda_graph_runner import CudaGraphRunner, extend_token_buckets
from services.worker.runtime.forward_batch import ForwardBatch, ForwardMode
from services.worker.runtime.model_config import ModelConfig
from services.worker.runtime.model_runner import ModelRunner

MAX_REQUESTS = 5
# Extend buckets of 64 and 80 tokens, each taking up to MAX_REQUESTS requests.
MAX_EXTEND_TOKENS = 80
TOLERANCE = 1e-5
SMALL_TILES = ExtendTiles(block_m=16, block_n=16, num_warps=4, num_stages=1)


class _Session:
    """A CPU ModelRunner on the triton backend with a graph runner attached, and its requests' lengths."""

    def __init__(self, path: Path, deterministic: bool = False) -> None:
        config = EngineConfig(
            model_path=str(path),
            attention_backend="triton",
            max_total_tokens=600,
            max_running_requests=MAX_REQUESTS,
            cpu_weight_prepack=False,
            enable_deterministic_inference=deterministic,
        )
        self.runner = ModelRunner(config, ModelConfig.from_path(path, dtype="float32"), torch.device("cpu"))
        if deterministic:
            # 16-key splits of one 16-key tile (the interpreter is slow): graphs then hold requests of up
            # to GRAPH_SPLITS x 16 = 64 positions, and a step's merge adds up to four splits.
            self.runner.attn_backend = DeterministicTritonAttnBackend(
                self.runner.model_config.context_len, 16, DecodeTiles(block_n=16)
            )
        self.graphs = CudaGraphRunner(self.runner, max_bs=4, max_extend_tokens=MAX_EXTEND_TOKENS)
        self.runner.graph_runner = self.graphs
        self.seq_lens: dict[int, int] = {}
        self.gen = torch.Generator().manual_seed(7)

    def new_request(self) -> int:
        rows = self.runner.req_to_token_pool.alloc(1)
        assert rows is not None
        self.seq_lens[rows[0]] = 0
        return rows[0]

    def batch(self, new_tokens: dict[int, int], mode: ForwardMode = ForwardMode.EXTEND) -> ForwardBatch:
        """One step appending new_tokens[row] random tokens to each request."""
        r = self.runner
        ids, positions, slots, prefix_lens, seq_lens = [], [], [], [], []
        for row, n in new_tokens.items():
            prefix = self.seq_lens[row]
            loc = r.allocator.alloc(n)
            assert loc is not None
            r.req_to_token_pool.write(row, prefix, loc)
            ids.append(torch.randint(3, 300, (n,), generator=self.gen))
            positions.append(torch.arange(prefix, prefix + n))
            slots.append(loc)
            prefix_lens.append(prefix)
            seq_lens.append(prefix + n)
            self.seq_lens[row] = prefix + n
        return ForwardBatch(
            forward_mode=mode,
            batch_size=len(new_tokens),
            input_ids=torch.cat(ids),
            positions=torch.cat(positions),
            req_pool_indices=torch.tensor(list(new_tokens), dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            out_cache_loc=torch.cat(slots).to(torch.int64),
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=prefix_lens,
            extend_seq_lens_cpu=list(new_tokens.values()),
            req_to_token_pool=r.req_to_token_pool,
            token_to_kv_pool=r.token_to_kv_pool,
            attn_backend=r.attn_backend,
        )

    def pool(self) -> list[torch.Tensor]:
        kv = self.runner.token_to_kv_pool
        return [b.clone() for b in (*kv.k_buffer, *kv.v_buffer)]

    def restore(self, saved: list[torch.Tensor]) -> None:
        kv = self.runner.token_to_kv_pool
        for buffer, old in zip((*kv.k_buffer, *kv.v_buffer), saved):
            buffer.copy_(old)

    @torch.inference_mode()
    def eager(self, batch: ForwardBatch) -> torch.Tensor:
        self.runner.attn_backend.init_forward_metadata(batch)
        return self.runner.model(batch.input_ids, batch.positions, batch)

    def check_graph_matches_eager(self, batch: ForwardBatch, padded: tuple[int, int], tolerance: float = TOLERANCE) -> None:
        """The step replays the graph of (tokens, requests) `padded` and gives eager's logits, and
        writes eager's K/V and nothing else but the padding slot 0 (within `tolerance`; 0: the same bits)."""
        assert self.graphs.can_run(batch)
        assert self.graphs.padded_extend(batch.num_tokens, batch.batch_size) == padded
        before = self.pool()
        logits = self.runner.forward(batch)
        assert logits.data_ptr() == self.graphs.logits.data_ptr(), "not the graph runner's static buffer"
        graph_logits, graph_pool = logits.clone(), self.pool()
        self.restore(before)
        eager_logits = self.eager(batch)
        assert graph_logits.shape == eager_logits.shape == (batch.batch_size, 300)
        assert (graph_logits - eager_logits).abs().max() <= tolerance
        for ours, ref in zip(graph_pool, self.pool()):
            assert (ours[1:] - ref[1:]).abs().max() <= tolerance


@pytest.fixture
def session(qwen3_path: Path, monkeypatch: pytest.MonkeyPatch) -> _Session:
    # The backend reads its tiles when it builds a block table, sizes one and launches the kernel.
    monkeypatch.setattr(triton_backend, "EXTEND_TILES", SMALL_TILES)
    return _Session(qwen3_path)


@pytest.fixture
def deterministic_session(qwen3_path: Path) -> _Session:
    return _Session(qwen3_path, deterministic=True)


def test_deterministic_extend_graphs_give_eager_bits(deterministic_session: _Session) -> None:
    session = deterministic_session
    assert session.runner.attn_backend.extend_graph_max_seq_len == 64
    a, b, c = (session.new_request() for _ in range(3))
    session.check_graph_matches_eager(session.batch({a: 9, b: 30, c: 24}), (64, MAX_REQUESTS), tolerance=0)
    # Continuing prefixes into a third 16-key split (a at 39 positions, c at 47: a three-way merge), one
    # request a single token (as in a mixed step), the bucket padded by 10 tokens and two requests.
    session.check_graph_matches_eager(session.batch({a: 30, c: 23, b: 1}), (64, MAX_REQUESTS), tolerance=0)
    # A request past the bound (b at 65 positions) needs more splits than the graphs hold: eager.
    assert not session.graphs.can_run(session.batch({b: 34}))
    assert session.graphs.can_run(session.batch({a: 25}))  # a at 64 positions: four splits still fit


def test_extend_token_buckets() -> None:
    assert extend_token_buckets(2048) == [64, 128, 256, 512, 1024, 2048]
    assert extend_token_buckets(100) == [64, 100]
    assert extend_token_buckets(16) == [16]
    assert extend_token_buckets(0) == []


def test_padded_extend_matches_eager_across_bucket_edges(session: _Session) -> None:
    a, b, c = (session.new_request() for _ in range(3))
    # Fresh prompts, 63 tokens: just below the 64-token edge.
    session.check_graph_matches_eager(session.batch({a: 9, b: 30, c: 24}), (64, MAX_REQUESTS))
    d = session.new_request()
    # Fewer tokens in the same bucket after a fuller step: the last step's token rows must be padded
    # again (a stale KV slot there would overwrite another request's cache). Mixed prefixes: a and c
    # continue over their cached tokens (a with one token, like a decode in a mixed step), d is new.
    session.check_graph_matches_eager(session.batch({a: 1, d: 17, c: 12}), (64, MAX_REQUESTS))
    # 65 tokens, just above the edge: the 80 bucket; b's 40 new tokens span three query blocks.
    session.check_graph_matches_eager(session.batch({b: 40, d: 20, a: 5}), (MAX_EXTEND_TOKENS, MAX_REQUESTS))
    # Exactly on the edge, every request continuing a cached prefix.
    session.check_graph_matches_eager(session.batch({c: 16, a: 16, b: 16, d: 16}), (64, MAX_REQUESTS))


def test_padded_decode_matches_eager(session: _Session) -> None:
    rows = [session.new_request() for _ in range(3)]
    session.eager(session.batch({row: n for row, n in zip(rows, (4, 11, 7))}))
    batch = session.batch(dict.fromkeys(rows, 1), ForwardMode.DECODE)
    assert session.graphs.can_run(batch) and session.graphs.padded_size(3) == 4
    graph_logits = session.runner.forward(batch).clone()
    assert (graph_logits - session.eager(batch)).abs().max() <= TOLERANCE


def test_padded_decode_from_packed_rows_matches_eager(session: _Session) -> None:
    """A decode batch whose input ids .. out_cache_loc are rows of one block (as ScheduleBatch packs
    them) goes into the graph's inputs in one copy: the same logits as eager."""
    rows = [session.new_request() for _ in range(3)]
    session.eager(session.batch({row: n for row, n in zip(rows, (5, 2, 9))}))
    batch = session.batch(dict.fromkeys(rows, 1), ForwardMode.DECODE)
    block = torch.stack([batch.input_ids, batch.positions, batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc])
    batch.input_ids, batch.positions, batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc = block.unbind(0)
    batch.packed_rows = block
    session.graphs.inputs.fill_(7)  # stale values a missed row would leave behind
    graph_logits = session.runner.forward(batch).clone()
    assert (graph_logits - session.eager(batch)).abs().max() <= TOLERANCE


def test_extend_batches_over_the_bounds_run_eagerly(session: _Session) -> None:
    a, b = session.new_request(), session.new_request()
    # More tokens than the largest bucket.
    batch = session.batch({a: 50, b: MAX_EXTEND_TOKENS + 1 - 50})
    assert not session.graphs.can_run(batch)
    assert session.graphs.padded_extend(batch.num_tokens, batch.batch_size) is None
    logits = session.runner.forward(batch)
    assert logits.data_ptr() != session.graphs.logits.data_ptr()
    assert torch.equal(logits, session.eager(batch))
    # Every token's logits (verification steps): eager.
    everything = session.batch({a: 3, b: 2})
    everything.return_all_logits = True
    assert not session.graphs.can_run(everything)
    assert session.runner.forward(everything).shape == (5, 300)
    # More requests than any graph takes (the request rows are reused: only the counts matter here).
    crowded = session.batch({a: 1, b: 1})
    bs = MAX_REQUESTS + 1
    crowded.batch_size = bs
    crowded.req_pool_indices = crowded.req_pool_indices.repeat(bs)[:bs]
    crowded.input_ids = crowded.input_ids.repeat(bs)[:bs]
    assert not session.graphs.can_run(crowded)


def test_split_prefixes_in_graph_and_eager_steps_match_unsplit(session: _Session, monkeypatch) -> None:  # noqa: ANN001
    """A short step after a long prefix splits that prefix over several table entries (the backend's
    SM count on CPU is 8, the tiny model has 4 heads): the graph's padded table and the eager one both
    carry the splits, and both give the logits of the same step with no split."""
    monkeypatch.setattr(extend_attention, "MIN_KEYS_PER_SPLIT", 16)
    a, b = session.new_request(), session.new_request()
    session.eager(session.batch({a: 60}))
    session.eager(session.batch({a: 60, b: 20}))
    batch = session.batch({a: 2, b: 1})
    backend = session.runner.attn_backend
    rows = triton_backend.extend_metadata_rows([120, 20], [2, 1], None, backend._splitting)
    assert rows[triton_backend._BLOCK_TABLE][3].max() > 1, "the step does not split"
    session.check_graph_matches_eager(batch, (64, MAX_REQUESTS))
    split_logits = session.eager(batch).clone()
    monkeypatch.setattr(backend, "_splitting", None)
    unsplit = session.eager(batch)
    assert (split_logits - unsplit).abs().max() <= TOLERANCE
