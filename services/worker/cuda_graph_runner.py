"""CUDA graphs for decode: capture one forward per batch size once, then replay it every step.

A decode step of a small batch is a few hundred short kernels; launching them one by one from Python
costs far more than running them. A CUDA graph records the launches of one forward and replays them
with a single call, so the host cost of a step no longer grows with the number of layers.

A graph replays the exact kernels and addresses it saw, so:
- the inputs live in static buffers sized for the largest captured batch; a step copies its batch into
  them and pads the rest (padded rows: token 0 at position 0, request row 0, length 0, KV written to
  pool slot 0, the padding slot; decode attention gives a length-0 row zeros and reads nothing);
- the decode attention metadata (splits per request) is computed on the device from the static
  seq_lens inside the graph, and the backend's decode buffers are reserved up front so they never move;
- the logits are copied into one static buffer [max_bs, vocab]; a step returns a view of its rows,
  valid until the next replay (the scheduler samples from it before then).
A batch of bs requests replays the smallest captured size >= bs. All graphs share one memory pool,
captured largest first; they never run concurrently, so their intermediates may share memory.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from services.worker.attention.triton_backend import TritonAttnBackend
from services.worker.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from services.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Rows of the static integer buffer, one per per-request input of a decode step.
_INPUT_IDS, _POSITIONS, _REQ_POOL_INDICES, _SEQ_LENS, _OUT_CACHE_LOC = range(5)
# Eager forwards per batch size before capture: compiles the Triton kernels and lets cuBLAS pick its
# algorithms outside the graph.
_WARMUP_RUNS = 2


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_bs, and max_bs itself (ascending)."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1 to capture graphs, got {max_bs}")
    sizes = [bs for bs in (1, 2, 4, 8) if bs <= max_bs] + list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class CudaGraphRunner:
    """Captured decode forwards of one model runner, one per batch size in `batch_sizes`."""

    def __init__(self, runner: ModelRunner, max_bs: int) -> None:
        self.runner = runner
        self.device = runner.device
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        mc = runner.model_config
        backend = runner.attn_backend
        if not isinstance(backend, TritonAttnBackend):
            raise ValueError(
                f"cuda_graph_max_bs needs the triton attention backend, got {type(backend).__name__}"
            )
        # Reserve for eager decodes too (batches larger than max_bs): were the buffers to grow later,
        # the graphs would keep writing to the freed old ones.
        backend.reserve(
            max(self.max_bs, runner.req_to_token_pool.size),
            mc.num_attention_heads // runner.tp_size,
            runner.token_to_kv_pool.num_kv_heads,
            mc.head_dim,
            self.device,
        )
        self.inputs = torch.zeros((5, self.max_bs), dtype=torch.int64, device=self.device)
        self.logits: torch.Tensor | None = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.capture()

    def can_run(self, batch: ForwardBatch) -> bool:
        return (
            batch.forward_mode.is_decode()
            and not batch.return_all_logits
            and batch.batch_size <= self.max_bs
            and batch.num_tokens == batch.batch_size
        )

    def _static_batch(self, bs: int) -> ForwardBatch:
        """A decode batch of bs rows over the static buffers (host-side lists are placeholders: no
        layer reads them in decode)."""
        r = self.runner
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.inputs[_INPUT_IDS, :bs],
            positions=self.inputs[_POSITIONS, :bs],
            req_pool_indices=self.inputs[_REQ_POOL_INDICES, :bs],
            seq_lens=self.inputs[_SEQ_LENS, :bs],
            out_cache_loc=self.inputs[_OUT_CACHE_LOC, :bs],
            seq_lens_cpu=[0] * bs,
            extend_prefix_lens_cpu=[0] * bs,
            extend_seq_lens_cpu=[1] * bs,
            req_to_token_pool=r.req_to_token_pool,
            token_to_kv_pool=r.token_to_kv_pool,
            attn_backend=r.attn_backend,
        )

    def _forward_fn(self, bs: int) -> Callable[[], torch.Tensor]:
        batch = self._static_batch(bs)
        runner = self.runner

        def forward() -> torch.Tensor:
            runner.attn_backend.init_forward_metadata(batch)
            return runner.model(batch.input_ids, batch.positions, batch)

        return forward

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        self.inputs.zero_()
        vocab = self.runner.model_config.vocab_size
        # Largest first: the shared pool then has room for every smaller graph's intermediates.
        for bs in reversed(self.batch_sizes):
            forward = self._forward_fn(bs)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(_WARMUP_RUNS):
                    logits = forward()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            if self.logits is None:
                self.logits = torch.empty(
                    (self.max_bs, logits.shape[1]), dtype=logits.dtype, device=self.device
                )
            del logits
            graph = torch.cuda.CUDAGraph()
            # thread_local: the scheduler may run in a thread while its caller's threads use CUDA.
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self.logits[:bs].copy_(forward())
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d decode CUDA graphs (batch sizes %s) in %.1f s; logits [%d, %d]",
            len(self.graphs), self.batch_sizes, time.perf_counter() - start, self.max_bs, vocab,
        )

    def padded_size(self, bs: int) -> int:
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [bs, vocab] of a decode batch (a view of the static buffer, valid until the next
        replay)."""
        bs = batch.batch_size
        padded = self.padded_size(bs)
        self.inputs[:, bs:padded].zero_()
        self.inputs[_INPUT_IDS, :bs].copy_(batch.input_ids)
        self.inputs[_POSITIONS, :bs].copy_(batch.positions)
        self.inputs[_REQ_POOL_INDICES, :bs].copy_(batch.req_pool_indices)
        self.inputs[_SEQ_LENS, :bs].copy_(batch.seq_lens)
        self.inputs[_OUT_CACHE_LOC, :bs].copy_(batch.out_cache_loc)
        self.graphs[padded].replay()
        assert self.logits is not None
        return self.logits[:bs]
