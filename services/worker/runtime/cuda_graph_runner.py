"""CUDA graphs for decode and extend steps: capture one forward per padded size once, then replay it.

A step of a small batch is a few hundred short kernels; launching them one by one from Python costs
far more than running them (an eager extend step of a 0.6B model spends ~17 ms launching whatever its
size). A CUDA graph records the launches of one forward and replays them with a single call, so the
host cost of a step no longer grows with the number of layers.

A graph replays the exact kernels and addresses it saw, so:
- the inputs live in static buffers sized for the largest graph; a step copies its batch into them and
  pads the rest: padded tokens take id 0 at position 0 and write their KV to pool slot 0 (the padding
  slot); padded requests take request row 0, length 0, no new tokens and prefix 0;
- decode graphs, one per batch size (capture_batch_sizes): a batch of bs requests replays the smallest
  size >= bs. The decode attention metadata (splits per request) is computed on the device from the
  static seq_lens inside the graph, and the backend's decode buffers are reserved up front so they never
  move; decode attention gives a length-0 row zeros and reads nothing;
- extend graphs (prefill, chunked prefill, mixed steps), one per token bucket (extend_token_buckets),
  each taking up to min(bucket, request rows) requests: a batch replays the smallest bucket that holds
  its tokens and its requests. Its attention metadata (offsets, prefix lengths and the query block table)
  is written into one static buffer before the replay; the extend kernel's grid is the table's length,
  fixed per bucket (TritonAttnBackend.extend_blocks_bound). Padded tokens belong to no request and no
  query block, so attention leaves their rows alone and every other layer works row by row: they never
  touch a real token's values. The logits rows (each request's last new token) are gathered with an
  index the graph computes from the static offsets. The deterministic backend derives its per-token rows
  from the same offsets and takes requests of up to extend_graph_max_seq_len positions (longer: eager);
- hybrid models (linear-attention layers, mem/state_pool.py): a decode graph's layers read each row's
  state row from a static buffer filled before the replay (request row -> state row, on the device);
  padded rows take state row 0, the padding row, so they never touch a request's state (request row 0
  may be a live request). Their extend steps run eagerly (no extend graphs);
- the logits land in one static float32 buffer [rows, vocab] (the logits processor casts them into it
  in one launch: the static batch's logits_out); a step returns a view of its rows, valid until the
  next replay (the scheduler samples from it before then).
All graphs share one memory pool, captured largest (most tokens) first; they never run concurrently, so
their intermediates may share memory.

Off CUDA nothing is captured: a replay runs the same padded static-buffer forward directly, which is how
the CPU tests compare the padding against plain eager forwards.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from services.worker.mem.memory_pool import ReqToTokenPool, TokenToKVPool
from services.worker.mem.state_pool import HybridReqToTokenPool, StateMetadata, StatePool
from services.worker.runtime.attention.base import AttentionBackend
from services.worker.runtime.attention.triton_backend import (
    EXTEND_METADATA_ROWS,
    TritonAttnBackend,
    TritonExtendMetadata,
)
from services.worker.runtime.forward_batch import ForwardBatch, ForwardMode
from services.worker.runtime.model_config import ModelConfig

logger = logging.getLogger(__name__)

# Rows of the static integer buffer: per-token inputs (ids, positions, KV slots) and per-request ones
# (request rows, lengths, state rows). Input ids .. out_cache_loc are in the order of
# ForwardBatch.packed_rows (ScheduleBatch packs a decode step's inputs so), which replay() copies as one
# block.
_INPUT_IDS, _POSITIONS, _REQ_POOL_INDICES, _SEQ_LENS, _OUT_CACHE_LOC, _STATE_INDICES = range(6)
# Eager forwards per graph before capture: compiles the Triton kernels and lets cuBLAS pick its
# algorithms outside the graph.
_WARMUP_RUNS = 2
# The smallest extend token bucket; each next one doubles.
_MIN_EXTEND_BUCKET = 64


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_bs, and max_bs itself (ascending)."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1 to capture graphs, got {max_bs}")
    sizes = [bs for bs in (1, 2, 4, 8) if bs <= max_bs] + list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def extend_token_buckets(max_tokens: int) -> list[int]:
    """64, 128, 256, ... below max_tokens, then max_tokens itself (ascending); none for 0."""
    if max_tokens < 0:
        raise ValueError(f"cuda_graph_max_extend_tokens must be >= 0, got {max_tokens}")
    buckets = []
    tokens = _MIN_EXTEND_BUCKET
    while tokens < max_tokens:
        buckets.append(tokens)
        tokens *= 2
    return buckets + [max_tokens] if max_tokens else buckets


@dataclass
class _Graph:
    """One padded forward over the static buffers: num_tokens token rows, batch_size request rows
    (also its logits rows), and on CUDA the graph captured from it."""

    mode: ForwardMode
    num_tokens: int
    batch_size: int
    forward: Callable[[], torch.Tensor]
    graph: torch.cuda.CUDAGraph | None = None


class GraphTarget(Protocol):
    """What the graphs capture: the model with its pools and attention backend on one device (the
    ModelRunner that owns the CudaGraphRunner)."""

    device: torch.device
    model_config: ModelConfig
    tp_size: int
    model: Callable[[torch.Tensor, torch.Tensor, ForwardBatch], torch.Tensor]
    attn_backend: AttentionBackend
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: TokenToKVPool


class CudaGraphRunner:
    """Captured forwards of one model runner: decode ones for the batch sizes up to max_bs, extend ones
    for the token buckets up to max_extend_tokens (0: none)."""

    def __init__(self, runner: GraphTarget, max_bs: int, max_extend_tokens: int = 0) -> None:
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
        self.backend = backend
        # Reserve for eager decodes too (batches larger than max_bs): were the buffers to grow later,
        # the graphs would keep writing to the freed old ones.
        backend.reserve(
            max(self.max_bs, runner.req_to_token_pool.size),
            mc.num_attention_heads // runner.tp_size,
            runner.token_to_kv_pool.num_kv_heads,
            mc.head_dim,
            self.device,
        )
        rows = runner.req_to_token_pool.size
        pool = runner.req_to_token_pool
        self.hybrid = pool if isinstance(pool, HybridReqToTokenPool) else None
        if self.hybrid is not None and max_extend_tokens:
            logger.info("hybrid model: extend steps run eagerly (cuda_graph_max_extend_tokens=%d unused)",
                        max_extend_tokens)  # fmt: skip
            max_extend_tokens = 0
        self.decode_graphs = [self._graph(ForwardMode.DECODE, bs, bs) for bs in self.batch_sizes]
        self.extend_graphs = [
            self._graph(ForwardMode.EXTEND, tokens, min(tokens, rows))
            for tokens in extend_token_buckets(max_extend_tokens)
        ]
        width = max(g.num_tokens for g in self.decode_graphs + self.extend_graphs)
        self.inputs = torch.zeros((6, width), dtype=torch.int64, device=self.device)
        # A decode step's per-row state metadata besides the state rows: every row continues a state,
        # one token each (the decode ops read neither, but the metadata names them).
        self.decode_has_state = torch.ones(self.max_bs, dtype=torch.bool, device=self.device)
        self.decode_cu_seqlens = torch.arange(self.max_bs + 1, dtype=torch.int32, device=self.device)
        bound = backend.extend_blocks_bound
        meta_width = max(
            (max(g.batch_size + 1, bound(g.num_tokens, g.batch_size)) for g in self.extend_graphs), default=1
        )
        self.extend_meta = torch.zeros((EXTEND_METADATA_ROWS, meta_width), dtype=torch.int32, device=self.device)
        # An empty batch: every table entry (-1) is skipped, which is all the warm-up and capture need.
        backend.fill_extend_metadata(self.extend_meta, [], [])
        logits_rows = max(g.batch_size for g in self.decode_graphs + self.extend_graphs)
        self.logits = torch.empty((logits_rows, mc.vocab_size), dtype=torch.float32, device=self.device)
        self.pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        self.capture()

    def _graph(self, mode: ForwardMode, num_tokens: int, batch_size: int) -> _Graph:
        return _Graph(mode, num_tokens, batch_size, self._forward_fn(mode, num_tokens, batch_size))

    def _static_batch(self, mode: ForwardMode, num_tokens: int, bs: int) -> ForwardBatch:
        """A batch over the static buffers. Its host-side lists are placeholders: no layer reads them
        here (decode metadata comes from the device seq_lens, extend metadata from the static buffer
        and the logits rows from last_token_rows)."""
        r = self.runner
        return ForwardBatch(
            forward_mode=mode,
            batch_size=bs,
            input_ids=self.inputs[_INPUT_IDS, :num_tokens],
            positions=self.inputs[_POSITIONS, :num_tokens],
            req_pool_indices=self.inputs[_REQ_POOL_INDICES, :bs],
            seq_lens=self.inputs[_SEQ_LENS, :bs],
            out_cache_loc=self.inputs[_OUT_CACHE_LOC, :num_tokens],
            seq_lens_cpu=[0] * bs,
            extend_prefix_lens_cpu=[0] * bs,
            extend_seq_lens_cpu=[1 if mode.is_decode() else 0] * bs,
            req_to_token_pool=r.req_to_token_pool,
            token_to_kv_pool=r.token_to_kv_pool,
            attn_backend=r.attn_backend,
            logits_out=self.logits,
        )

    def _forward_fn(self, mode: ForwardMode, num_tokens: int, bs: int) -> Callable[[], torch.Tensor]:
        """The padded forward a graph records. The batch object is rebuilt per call (from the same
        buffers), so nothing caches a result under a tensor whose contents changed since."""
        runner = self.runner

        def forward() -> torch.Tensor:
            batch = self._static_batch(mode, num_tokens, bs)
            if mode.is_decode():
                runner.attn_backend.init_forward_metadata(batch)
                if self.hybrid is not None:
                    batch.state_metadata = self._decode_state_metadata(self.hybrid.state_pool, bs)
            else:
                # A block table long enough for any batch the bucket takes: its length is the grid.
                num_blocks = self.backend.extend_blocks_bound(num_tokens, bs)
                meta = TritonExtendMetadata.view(self.extend_meta, bs, num_blocks)
                batch.attn_metadata = meta
                # A padded request's offset is the token total: its "last row" is a real one, unused.
                batch.last_token_rows = meta.qo_indptr[1:].to(torch.int64) - 1
            return runner.model(batch.input_ids, batch.positions, batch)

        return forward

    def _decode_state_metadata(self, state_pool: StatePool, bs: int) -> StateMetadata:
        return StateMetadata(
            state_pool=state_pool,
            state_indices=self.inputs[_STATE_INDICES, :bs],
            has_initial_state=self.decode_has_state[:bs],
            cu_seqlens=self.decode_cu_seqlens[: bs + 1],
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """On CUDA, warm up and capture every graph, most tokens first; elsewhere nothing to do."""
        if self.device.type != "cuda":
            return
        start = time.perf_counter()
        self.inputs.zero_()
        order = sorted(
            self.decode_graphs + self.extend_graphs, key=lambda g: (-g.num_tokens, g.mode.is_decode())
        )
        for g in order:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(_WARMUP_RUNS):
                    g.forward()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            g.graph = torch.cuda.CUDAGraph()
            # thread_local: the scheduler may run in a thread while its caller's threads use CUDA.
            with torch.cuda.graph(g.graph, pool=self.pool, capture_error_mode="thread_local"):
                self._forward_into_logits(g)
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d CUDA graphs in %.1f s: decode batch sizes %s, extend (tokens, requests) %s; logits %s",
            len(order), time.perf_counter() - start, self.batch_sizes,
            [(g.num_tokens, g.batch_size) for g in self.extend_graphs], tuple(self.logits.shape),
        )  # fmt: skip

    def padded_size(self, bs: int) -> int:
        """The decode graph size a batch of bs requests replays."""
        return self._decode_graph(bs).batch_size

    def _decode_graph(self, bs: int) -> _Graph:
        return self.decode_graphs[bisect.bisect_left(self.batch_sizes, bs)]

    def padded_extend(self, num_tokens: int, bs: int) -> tuple[int, int] | None:
        """(tokens, requests) of the extend graph a batch of num_tokens tokens and bs requests replays;
        None when no graph holds it."""
        g = self._extend_graph(num_tokens, bs)
        return None if g is None else (g.num_tokens, g.batch_size)

    def _extend_graph(self, num_tokens: int, bs: int) -> _Graph | None:
        """The smallest extend bucket that holds num_tokens tokens and bs requests."""
        return next(
            (g for g in self.extend_graphs if g.num_tokens >= num_tokens and g.batch_size >= bs), None
        )

    def can_run(self, batch: ForwardBatch) -> bool:
        if batch.return_all_logits or batch.prompt_logit_rows is not None:
            return False
        if batch.forward_mode.is_decode():
            return batch.batch_size <= self.max_bs and batch.num_tokens == batch.batch_size
        longest = self.backend.extend_graph_max_seq_len  # the deterministic backend's bound
        if longest is not None and max(batch.seq_lens_cpu, default=0) > longest:
            return False
        return self._extend_graph(batch.num_tokens, batch.batch_size) is not None

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [bs, vocab] of a batch can_run accepted (a view of the static buffer, valid until the
        next replay)."""
        bs, num_tokens = batch.batch_size, batch.num_tokens
        if batch.forward_mode.is_decode():
            g = self._decode_graph(bs)
        else:
            found = self._extend_graph(num_tokens, bs)
            assert found is not None, "replay() takes only batches can_run accepts"
            g = found
            prefix_lens, extend_lens = batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu
            bound = self.backend.extend_blocks_bound(g.num_tokens, g.batch_size)
            self.backend.fill_extend_metadata(self.extend_meta, prefix_lens, extend_lens, bound)
        # Padding: token 0 at position 0 into KV slot 0; request row 0 of length 0, state row 0 (one
        # launch: a graph has no more requests than tokens, and the copies below overwrite the real part).
        if min(bs, num_tokens) < g.num_tokens:
            self.inputs[:, min(bs, num_tokens) : g.num_tokens].zero_()
        if batch.packed_rows is not None:  # one token per request: [5, bs]
            self.inputs[_INPUT_IDS : _OUT_CACHE_LOC + 1, :bs].copy_(batch.packed_rows)
        else:
            self.inputs[_INPUT_IDS, :num_tokens].copy_(batch.input_ids)
            self.inputs[_POSITIONS, :num_tokens].copy_(batch.positions)
            self.inputs[_OUT_CACHE_LOC, :num_tokens].copy_(batch.out_cache_loc)
            self.inputs[_REQ_POOL_INDICES, :bs].copy_(batch.req_pool_indices)
            self.inputs[_SEQ_LENS, :bs].copy_(batch.seq_lens)
        if self.hybrid is not None:  # decode only: each request row's state row
            rows = self.inputs[_REQ_POOL_INDICES, :bs]
            torch.index_select(self.hybrid.req_to_state, 0, rows, out=self.inputs[_STATE_INDICES, :bs])
        if g.graph is not None:
            g.graph.replay()
        else:
            self._forward_into_logits(g)
        return self.logits[:bs]

    def _forward_into_logits(self, g: _Graph) -> None:
        """g's forward, its logits in the static buffer: the logits processor writes them there itself
        (the static batch's logits_out); a model that returns them elsewhere gets them copied."""
        logits = g.forward()
        if logits.data_ptr() != self.logits.data_ptr():
            self.logits[: g.batch_size].copy_(logits)
