"""Decode steps of a hybrid model (Qwen3.5: Gated DeltaNet + attention layers) through the CUDA-graph
runner's padded static-buffer forward give the logits, KV and linear-attention states of plain eager
decode steps; padded rows write only the padding state row 0, never the state of request row 0 (a live
request the padded rows name as their request row) or of any request outside the batch.

CUDA graphs cannot be captured on CPU, so the runner replays by running the forward it would capture
directly (the same static buffers and padding as inside a graph). The model is a tiny seeded Qwen3.5 on
the triton attention backend, its GDN layers on the Triton kernels, under the Triton interpreter.
"""

from __future__ import annotations

import pytest
import torch

from services.worker.config import EngineConfig
from services.worker.mem.state_pool import HybridReqToTokenPool, StatePool
from services.worker.runtime.cuda_graph_runner import CudaGraphRunner
from services.worker.runtime.forward_batch import ForwardBatch, ForwardMode
from services.worker.runtime.model_config import ModelConfig
from services.worker.runtime.model_runner import ModelRunner
from tests.checkpoints import tiny_qwen3_5_config, write_checkpoint
from tests.forward_helpers import seeded_prompt

TOLERANCE = 1e-5
MAX_REQUESTS = 5


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    # One linear and one full attention layer (the interpreter's cost is per kernel launch), 16-wide
    # value heads (the Triton kernels' smallest, for tl.dot).
    path = write_checkpoint(
        tmp_path_factory.mktemp("qwen3_5_graph"),
        tiny_qwen3_5_config(
            num_hidden_layers=2, layer_types=["full_attention", "linear_attention"], linear_value_head_dim=16
        ),
        seed=3,
    )
    config = EngineConfig(
        model_path=str(path),
        attention_backend="triton",
        max_total_tokens=400,
        max_running_requests=MAX_REQUESTS,
        cpu_weight_prepack=False,
    )
    return ModelRunner(config, ModelConfig.from_path(path, dtype="float32"), torch.device("cpu"))


class _Session:
    """The runner with a graph runner attached (decode sizes 1, 2, 4), and its requests' lengths."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        # Extend buckets asked for: a hybrid model gets none (its extend steps stay eager).
        self.graphs = CudaGraphRunner(runner, max_bs=4, max_extend_tokens=64)
        runner.graph_runner = self.graphs
        pool = runner.req_to_token_pool
        assert isinstance(pool, HybridReqToTokenPool)
        self.req_pool = pool
        self.state_pool: StatePool = pool.state_pool
        self.seq_lens: dict[int, int] = {}

    def step(self, mode: ForwardMode, tokens: dict[int, list[int]], packed: bool = False) -> ForwardBatch:
        r = self.runner
        ids, positions, slots, prefix_lens, seq_lens = [], [], [], [], []
        for row, new in tokens.items():
            prefix = self.seq_lens.get(row, 0)
            loc = r.allocator.alloc(len(new))
            assert loc is not None
            r.req_to_token_pool.write(row, prefix, loc)
            ids += new
            positions.append(torch.arange(prefix, prefix + len(new)))
            slots.append(loc)
            prefix_lens.append(prefix)
            seq_lens.append(prefix + len(new))
            self.seq_lens[row] = prefix + len(new)
        batch = ForwardBatch(
            forward_mode=mode,
            batch_size=len(tokens),
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.cat(positions),
            req_pool_indices=torch.tensor(list(tokens), dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            out_cache_loc=torch.cat(slots).to(torch.int64),
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=prefix_lens,
            extend_seq_lens_cpu=[len(new) for new in tokens.values()],
            req_to_token_pool=r.req_to_token_pool,
            token_to_kv_pool=r.token_to_kv_pool,
            attn_backend=r.attn_backend,
        )
        if packed:  # as ScheduleBatch lays out a decode step's inputs
            batch.packed_rows = torch.stack(
                [batch.input_ids, batch.positions, batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc]
            )
        return batch

    def buffers(self) -> dict[str, list[torch.Tensor]]:
        kv = self.runner.token_to_kv_pool
        return {
            "kv": [*kv.k_buffer, *kv.v_buffer],
            "conv": self.state_pool.conv_state,
            "recurrent": self.state_pool.recurrent_state,
        }

    def snapshot(self) -> dict[str, list[torch.Tensor]]:
        return {name: [b.clone() for b in bufs] for name, bufs in self.buffers().items()}

    def restore(self, saved: dict[str, list[torch.Tensor]]) -> None:
        for name, bufs in self.buffers().items():
            for buffer, old in zip(bufs, saved[name]):
                buffer.copy_(old)

    @torch.inference_mode()
    def eager(self, batch: ForwardBatch) -> torch.Tensor:
        self.runner.attn_backend.init_forward_metadata(batch)
        batch.init_state_metadata()
        return self.runner.model(batch.input_ids, batch.positions, batch)

    def check_decode(self, tokens: dict[int, int], padded: int, bystanders: list[int], packed: bool = False) -> None:
        """A decode step of `tokens` replays the graph of `padded` rows and matches an eager step: logits,
        every KV slot but the padding slot 0, every state row but the padding row 0. The bystanders'
        states (requests outside the batch) stay as they were; state row 0 changes when (and only when)
        rows are padded."""
        batch = self.step(ForwardMode.DECODE, {row: [tok] for row, tok in tokens.items()}, packed)
        assert self.graphs.can_run(batch) and self.graphs.padded_size(len(tokens)) == padded
        # A mark in the padding state row: a padded row's step changes it (the conv window rolls, the
        # state decays), and no real row may read it.
        for state in (*self.state_pool.conv_state, *self.state_pool.recurrent_state):
            state[StatePool.PAD_ROW].fill_(0.5)
        before = self.snapshot()
        logits = self.runner.forward(batch)
        assert logits.data_ptr() == self.graphs.logits.data_ptr(), "not the graph runner's static buffer"
        graph_logits, graph = logits.clone(), self.snapshot()
        self.restore(before)
        eager_logits = self.eager(batch)
        eager = self.snapshot()
        assert graph_logits.shape == eager_logits.shape == (len(tokens), eager_logits.shape[1])
        assert (graph_logits - eager_logits).abs().max().item() <= TOLERANCE
        for name in ("kv", "conv", "recurrent"):
            for ours, ref, old in zip(graph[name], eager[name], before[name]):
                assert (ours[1:] - ref[1:]).abs().max().item() <= TOLERANCE, name
                if name != "kv":
                    for row in bystanders:
                        state_row = self.req_pool.state_row(row)
                        assert torch.equal(ours[state_row], old[state_row]), f"{name} state of row {row} changed"
                    assert torch.equal(ref[0], old[0]), "an eager step wrote the padding state row"
                    assert torch.equal(ours[0], old[0]) == (padded == len(tokens)), name
        # Go on from the graph's result (equal to eager's but for the padding rows).
        self.restore(graph)


@torch.inference_mode()
def test_padded_hybrid_decode_matches_eager(runner: ModelRunner) -> None:
    session = _Session(runner)
    assert session.graphs.extend_graphs == [] and session.graphs.batch_sizes == [1, 2, 4]
    rows = session.req_pool.alloc(4)
    assert rows == [0, 1, 2, 3]
    # Prefills stay eager (no extend graph takes them); row 0 is a live request.
    prefill = session.step(ForwardMode.EXTEND, {row: seeded_prompt(5 + 3 * row, seed=row) for row in rows})
    assert not session.graphs.can_run(prefill)
    runner.forward(prefill)
    # Three rows padded to four, request row 0 outside the batch: the padded row names request row 0
    # but must write state row 0, not row 0's state.
    session.check_decode({1: 7, 2: 8, 3: 9}, padded=4, bystanders=[0])
    session.check_decode({0: 10, 2: 11, 3: 12}, padded=4, bystanders=[1], packed=True)
    session.check_decode({1: 13, 3: 14}, padded=2, bystanders=[0, 2])
    session.check_decode({2: 15}, padded=1, bystanders=[0, 1, 3])
    # Request row 1 freed (it maps to the padding state row again), then new requests, one in its state row.
    state_row = session.req_pool.state_row(1)
    session.req_pool.free(1)
    assert int(session.req_pool.req_to_state[1]) == StatePool.PAD_ROW
    session.seq_lens.pop(1)
    new = session.req_pool.alloc(2)
    assert new == [4, 1] and session.req_pool.state_row(1) == state_row  # (free lists are FIFO)
    runner.forward(session.step(ForwardMode.EXTEND, {4: seeded_prompt(4, seed=9), 1: seeded_prompt(6, seed=10)}))
    session.check_decode({0: 16, 4: 17, 1: 18}, padded=4, bystanders=[2, 3], packed=True)
