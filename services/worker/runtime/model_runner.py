# Over 400 lines: one rank's model, pools and their sizing, forward (pipelined or not) and sampling share their state.
"""ModelRunner: the model, its KV pools and attention backend on one device, and the sampler.

The scheduler hands it ForwardBatches and gets logits, then next tokens, back. Pool sizes come from
`max_total_tokens` or from free memory (device memory × mem_fraction_static on CUDA; a share of
available RAM on CPU), agreed across all ranks. With pipeline stages (runtime/pipeline.py) a runner
holds its stage's layers and a KV pool for those layers only; its forward receives the previous
stage's activations and sends its own on without waiting (so it can start the next micro-batch), and
only the last stage has logits (pipeline_sample hands its sampled tokens to every rank).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from services.worker.config import ATTENTION_BACKENDS, EngineConfig
from services.worker.mem.memory_pool import (
    ReqToTokenPool,
    TokenToKVPool,
    TokenToKVPoolAllocator,
    is_fp8,
    kv_storage_dtype,
)
from services.worker.mem.state_pool import HybridReqToTokenPool, StatePool, state_rows_for_budget
from services.worker.mem.state_snapshots import SNAPSHOTS_PER_ROW, StateSnapshots, snapshot_slots_for_budget
from services.worker.runtime import distributed
from services.worker.runtime.attention.base import AttentionBackend
from services.worker.runtime.attention.flashinfer_backend import (
    FlashInferAttnBackend,
    check_flashinfer_target,
    import_flashinfer,
)
from services.worker.runtime.attention.torch_backend import TorchAttnBackend
from services.worker.runtime.forward_batch import ForwardBatch
from services.worker.runtime.host_memory import available_ram_bytes as _available_ram_bytes
from services.worker.runtime.kv_scales import pool_layer_ids, read_kv_scales
from services.worker.runtime.layers.batch_invariant import make_batch_invariant
from services.worker.runtime.layers.cpu_prepack import cpu_prepack_available, prepack_cpu_weights
from services.worker.runtime.layers.fp8_weights import weight_bytes
from services.worker.runtime.layers.linear_calibration import (
    calibrate_alone_prefetch,
    calibrate_product_isa,
    calibrate_single_row,
    select_gemv_tiles,
    single_row_product,
)
from services.worker.runtime.model_config import ModelConfig
from services.worker.runtime.model_loader import load_model, safetensors_files
from services.worker.runtime.pipeline import PendingSends, recv_from_prev_stage
from services.worker.runtime.sampling.grammar import MaskBuffers
from services.worker.runtime.sampling.penalties import to_device_async
from services.worker.runtime.sampling.sampler import SampleOutput, Sampler, SamplingBatchInfo

if TYPE_CHECKING:
    from services.worker.runtime.cuda_graph_runner import CudaGraphRunner
    from shared.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Prompt log-probs: rows of logits put through log-softmax at a time (1024 x a 152k vocabulary: 0.6 GiB).
PROMPT_LOGPROB_ROWS = 1024
# On CPU the pool takes at most this share of available RAM, and at most this many tokens.
CPU_MEM_SHARE = 0.25
CPU_MAX_POOL_TOKENS = 131072


@dataclass
class SampledTokens:
    """A step's sampling result on the host, row i for request i."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


class SamplingRequest(Protocol):
    """What sampling reads of a request; the scheduler's Req has these fields (the runner sees no
    more of it, so it does not depend on the scheduler)."""

    sampling_params: SamplingParams
    seed: int
    origin_input_ids: list[int]
    output_ids: list[int]
    num_inflight: int  # tokens sampled on the device whose ids the host has not read yet
    grammar: Any  # the llguidance matcher of a constrained request, else None
    return_logprob: bool
    top_logprobs_num: int

    @property
    def seq_len(self) -> int: ...

    def finished(self) -> bool: ...


FutureTokens = tuple[torch.Tensor, dict[int, int]]  # device token ids of a step, row of each id(req)


class SampledOnLastStage:
    """A pipelined step's sampling result, already on the host of every rank (pipeline_sample): the
    PendingSample interface without device ids (pipelining runs without the overlap schedule)."""

    token_ids = None

    def __init__(self, tokens: SampledTokens) -> None:
        self._tokens = tokens

    def result(self) -> SampledTokens:
        return self._tokens


class PendingSample:
    """A step's sampling result on its way to the host: copies start at once (pinned, non-blocking
    on CUDA) and `result()` is the step's one host sync."""

    def __init__(self, out: SampleOutput, top_logprobs_nums: list[int]) -> None:
        self.token_ids = out.next_token_ids
        self._top_nums = top_logprobs_nums
        tensors = [out.next_token_ids, out.logprobs, out.top_logprobs_ids, out.top_logprobs_vals]
        self._host = [None if t is None else _to_host_async(t) for t in tensors]
        self._event = None
        if self.token_ids.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> SampledTokens:
        if self._event is not None:
            self._event.synchronize()
        ids, logprobs, top_ids, top_vals = (None if t is None else t.tolist() for t in self._host)
        top: list[list[tuple[int, float]]] | None = None
        if top_ids is not None and top_vals is not None:
            top = [list(zip(top_ids[i][:n], top_vals[i][:n])) for i, n in enumerate(self._top_nums)]
        return SampledTokens(ids, logprobs, top)


def _to_host_async(t: torch.Tensor) -> torch.Tensor:
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


@torch.inference_mode()
def prompt_logprobs(
    logits: torch.Tensor, targets: list[int], top_n: int
) -> tuple[list[float], list[list[tuple[int, float]]] | None]:
    """Prompt log-probs: row i's log-prob of token targets[i] (the prompt token after its position),
    from the raw logits (no temperature, penalty or grammar, as SGLang's input log-probs), and its
    top_n most likely tokens when top_n > 0. Read back at once: a prefill step that asks waits here.
    Rows go PROMPT_LOGPROB_ROWS at a time, so a long chunk's log-softmax never doubles its logits."""
    index = torch.tensor(targets, dtype=torch.int64, device=logits.device).unsqueeze(1)
    values: list[torch.Tensor] = []
    tops: list[tuple[torch.Tensor, torch.Tensor]] = []
    for start in range(0, logits.shape[0], PROMPT_LOGPROB_ROWS):
        logprobs = torch.log_softmax(logits[start : start + PROMPT_LOGPROB_ROWS], dim=-1)
        values.append(logprobs.gather(1, index[start : start + PROMPT_LOGPROB_ROWS]).squeeze(1))
        if top_n > 0:
            tops.append(logprobs.topk(min(top_n, logprobs.shape[-1]), dim=-1))
    if not tops:
        return torch.cat(values).tolist(), None
    top_vals, top_ids = torch.cat([v for v, _ in tops]).tolist(), torch.cat([i for _, i in tops]).tolist()
    return torch.cat(values).tolist(), [list(zip(i, v)) for i, v in zip(top_ids, top_vals)]


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_attn_backend(name: str, deterministic: bool = False, context_len: int = 0) -> AttentionBackend:
    """The backend `name`; deterministic: its batch-invariant form (torch or triton; context_len bounds the
    triton form's decode splits)."""
    if deterministic and name == "torch":
        from services.worker.runtime.attention.deterministic_torch import DeterministicTorchAttnBackend

        return DeterministicTorchAttnBackend()
    if deterministic and name == "triton":
        from services.worker.runtime.attention.deterministic_triton import DeterministicTritonAttnBackend

        return DeterministicTritonAttnBackend(context_len)
    if deterministic:
        raise ValueError(f"deterministic inference needs the torch or triton attention backend, not {name!r}")
    if name == "torch":
        return TorchAttnBackend()
    if name == "triton":
        # Imported here: its kernels need triton, an optional dependency (absent off Linux).
        from services.worker.runtime.attention.triton_backend import TritonAttnBackend

        return TritonAttnBackend()
    if name == "flashinfer":
        return FlashInferAttnBackend()
    raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")


class ModelRunner:
    """Runs forwards and sampling for one TP rank."""

    # The last sampled batch's requests and their SamplingBatchInfo, while it can be reused.
    _sampling_cache: tuple[list[SamplingRequest], SamplingBatchInfo] | None = None
    # Constrained decoding's host bitmasks (grammar.py), made at the first constrained step.
    _masks: MaskBuffers | None = None

    def __init__(
        self, config: EngineConfig, model_config: ModelConfig, device: torch.device, draft: bool = False
    ) -> None:
        """draft: this runner is a speculative draft model's (DraftProposer), whose catch-ups run as decode
        rows sharing requests, as the target's verification steps do."""
        self.config = config
        self.model_config = model_config
        self.device = device
        self.tp_size = distributed.get_tp_size()
        self.pp = distributed.get_pp_group()
        self._sends = PendingSends()
        backend = config.attention_backend or ("triton" if device.type == "cuda" else "torch")
        if backend == "flashinfer":
            # Before the weights load: a CPU or float32 run cannot use it, and the package may be missing.
            check_flashinfer_target(device, model_config.dtype)
            import_flashinfer()
        self.model = load_model(model_config, device)
        self.model.eval()
        # Parameter bytes (FP8 weights at one byte each); on CUDA the KV pool's budget is what they leave free.
        self.weight_bytes = weight_bytes(self.model)
        # CPU only: which product single rows use, and the one-pass times that chose it (get_info).
        self.single_row: dict[str, Any] | None = None
        if self.tp_size > 1 and device.type == "cuda" and not config.disable_custom_all_reduce:
            if distributed.enable_fast_all_reduce(model_config.dtype, device):
                logger.info("TP all-reduces of up to 1 MiB go through symmetric memory (one-shot)")
        deterministic = config.enable_deterministic_inference
        if device.type == "cpu" and config.cpu_weight_prepack and cpu_prepack_available():
            packed = prepack_cpu_weights(self.model)
            # The C++ product's loop first (where the CPU has two), so the product choice times the faster one.
            loops = {} if deterministic else calibrate_product_isa(self.model)
            best = None if deterministic else calibrate_single_row(self.model)
            if best:
                times = {name: best[name] for name in ("plain", "packed", "matvec") if name in best}
                self.single_row = {
                    "product": single_row_product(),
                    **{f"{name}_ms": seconds * 1e3 for name, seconds in times.items()},
                    "clean_rounds": int(best["clean_rounds"]),
                }
                logger.info(
                    "prepacked %.1f MiB of linear weights for batched CPU products; single rows use the %s "
                    "product (one pass over the weights: %s; %d undisturbed round(s)%s)",
                    packed / 2**20, self.single_row["product"],
                    ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in times.items()),
                    self.single_row["clean_rounds"],
                    "" if self.single_row["clean_rounds"] else ": every pass ran beside other work, so this choice may be the slower",
                )
            if loops and self.single_row is not None:
                from kernels.cpu_matvec import product_isa

                self.single_row["matvec_loop"] = product_isa()
                logger.info(
                    "the C++ single-row product runs its %s loop (one pass: avx512 %.1f ms, avx2 %.1f ms)",
                    self.single_row["matvec_loop"], loops["avx512"] * 1e3, loops["avx2"] * 1e3,
                )  # fmt: skip
            alone = {} if deterministic else calibrate_alone_prefetch(self.model)
            if alone and self.single_row is not None:
                from kernels.cpu_matvec import prefetch_setting

                self.single_row["alone_prefetch"] = prefetch_setting()[1] != 0
                logger.info(
                    "a lone thread's single-row product %s its weight's lines ahead (one pass alone: with the "
                    "requests %.1f ms, without %.1f ms)",
                    "asks for" if self.single_row["alone_prefetch"] else "does not ask for",
                    alone["prefetch"] * 1e3, alone["none"] * 1e3,
                )  # fmt: skip

        if deterministic:
            switched = make_batch_invariant(self.model)
            logger.info("deterministic inference: %d modules use batch-invariant products", switched)
        elif device.type == "cuda" and model_config.dtype in (torch.bfloat16, torch.float16):
            chosen = select_gemv_tiles(self.model, config.gemv_backend)
            if chosen:
                logger.info("single-row linears (N x K): %s", ", ".join(
                    f"{n}x{k} " + (f"triton {t.kind} {t.block_n}x{t.block_k}/{t.num_warps}w/{t.num_stages}s" if t else "cublas")
                    for (n, k), t in chosen.items()))

        kv_heads = model_config.num_kv_heads_per_rank(self.tp_size)
        kv_layers = model_config.num_attention_layers
        if self.pp.size > 1:  # this stage's layers only (hybrid models are refused with pp_size > 1)
            kv_layers = self.model.model.end_layer - self.model.model.start_layer
        kv_dtype = kv_storage_dtype(config.kv_cache_dtype, model_config.dtype)
        bytes_per_token = TokenToKVPool.bytes_per_token(kv_layers, kv_heads, model_config.head_dim, kv_dtype)
        # Hybrid models: the linear layers' per-request state comes out of the budget first.
        state_shape = model_config.state_shape(self.tp_size) if model_config.is_hybrid else None
        rows = config.max_running_requests
        snapshots = 0 if config.disable_radix_cache else config.hybrid_snapshot_slots  # prefix-cache state; None: sized below
        if config.max_total_tokens:
            size = config.max_total_tokens
        else:
            budget = self._memory_budget()
            if state_shape is not None:
                rows = state_rows_for_budget(state_shape, budget, rows)
                budget -= (rows + 1) * state_shape.bytes_per_row()
                if snapshots is None:
                    snapshots = snapshot_slots_for_budget(state_shape, budget, budget // bytes_per_token)
                budget -= snapshots * state_shape.bytes_per_row()
            size = self._pool_size_from_budget(budget, bytes_per_token)
        if distributed.get_world_size() > 1:
            shares = [size, rows, -1 if snapshots is None else snapshots]  # (None on every rank or on none)
            agreed = torch.tensor(shares, dtype=torch.int64, device=device if device.type == "cuda" else "cpu")
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
            size, rows, agreed_snapshots = (int(v) for v in agreed.tolist())
            snapshots = None if agreed_snapshots < 0 else agreed_snapshots
        self.max_total_tokens = size
        # Sized from free memory: taken as used; by max_total_tokens: committed at start (soak.py's RSS check).
        self.token_to_kv_pool = TokenToKVPool(
            size, kv_layers, kv_heads, model_config.head_dim, kv_dtype, device,
            commit_at_start=bool(config.max_total_tokens), **self._kv_scales(kv_dtype),
        )
        self.allocator = TokenToKVPoolAllocator(size, device)
        rows = max(1, min(rows, size))
        self.state_pool: StatePool | None = None
        self.state_snapshots: StateSnapshots | None = None
        if state_shape is not None:
            self.state_pool = StatePool(rows, state_shape, device)
            self.req_to_token_pool: ReqToTokenPool = HybridReqToTokenPool(
                rows, model_config.context_len + 1, device, self.state_pool
            )
            snapshots = min(size, SNAPSHOTS_PER_ROW * rows if snapshots is None else snapshots)  # (one per node)
            self.state_snapshots = StateSnapshots(snapshots, self.req_to_token_pool)
            logger.info(
                "hybrid model: state pool of %d request rows (%.1f MiB, %d linear-attention layers), %d prefix "
                "cache snapshots (%.1f MiB), KV pool for %d attention layers", rows, (rows + 1) * state_shape.bytes_per_row()
                / 2**20, state_shape.num_layers, snapshots, self.state_snapshots.nbytes() / 2**20, kv_layers,
            )
        else:
            self.req_to_token_pool = ReqToTokenPool(rows, model_config.context_len + 1, device)
        self.attn_backend = make_attn_backend(backend, deterministic, model_config.context_len)
        self.attn_backend.decode_rows_share_requests = draft or config.speculative_algorithm is not None
        self.sampler = Sampler()
        self.graph_runner: CudaGraphRunner | None = None
        if config.cuda_graph_max_bs > 0 and device.type == "cuda":
            if self.pp.size > 1:
                logger.warning("cuda_graph_max_bs=%d ignored: pipeline stages run eagerly", config.cuda_graph_max_bs)
            elif backend == "triton":
                # Imported here, like the triton backend itself: it needs triton, an optional
                # dependency (absent off Linux).
                from services.worker.runtime.cuda_graph_runner import CudaGraphRunner

                self.graph_runner = CudaGraphRunner(
                    self, min(config.cuda_graph_max_bs, rows), config.cuda_graph_max_extend_tokens
                )
            else:
                logger.warning("cuda_graph_max_bs=%d ignored: CUDA graphs need the triton attention "
                               "backend, not %s", config.cuda_graph_max_bs, backend)
        if device.type == "cuda":
            from kernels.step_inputs import step_kernels_enabled, warm_step_kernels  # triton, as above

            if step_kernels_enabled(device):
                warm_step_kernels(device, model_config.vocab_size)
        logger.info(
            "model %s on %s (%s%s): weights %.1f MiB, KV pool %d tokens (%s, %.1f MiB, %d layers), %d request "
            "rows, %s attention%s",
            model_config.architecture, device, model_config.dtype,
            ", FP8 weights" if model_config.quantization and model_config.quantization.resident else "",
            self.weight_bytes / 2**20, size, str(kv_dtype).removeprefix("torch."),
            size * bytes_per_token / 2**20, kv_layers, rows, backend,
            f"; pipeline stage {self.pp.rank} of {self.pp.size}, layers {self.model.model.start_layer}-"
            f"{self.model.model.end_layer - 1}" if self.pp.size > 1 else "",
        )

    def _kv_scales(self, kv_dtype: torch.dtype) -> dict[str, list[float]]:
        """A float8 pool's per-layer scales from the checkpoint, when it has them (runtime/kv_scales.py)."""
        if not is_fp8(kv_dtype):
            return {}
        model = self.model.model
        start, end = (model.start_layer, model.end_layer) if self.pp.size > 1 else (0, self.model_config.num_layers)
        layer_ids = pool_layer_ids(self.model_config, start, end)
        scales = read_kv_scales(safetensors_files(self.model_config.path), layer_ids)
        return {} if scales is None else {"k_scales": scales[0], "v_scales": scales[1]}

    def _memory_budget(self) -> int:
        """Bytes the pools may take: device memory x mem_fraction_static less what is in use on CUDA,
        a share of available RAM on CPU."""
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return int(free - total * (1.0 - self.config.mem_fraction_static))
        return int(_available_ram_bytes() * CPU_MEM_SHARE)

    def _pool_size_from_budget(self, budget: int, bytes_per_token: int) -> int:
        size = int(budget // bytes_per_token)
        if self.device.type == "cuda":
            if size < 16:
                raise ValueError(
                    f"not enough device memory for the KV pool: {budget / 2**30:.2f} GiB left for it after "
                    f"loading the model, mem_fraction_static={self.config.mem_fraction_static}"
                )
            return size
        return max(16, min(size, CPU_MAX_POOL_TOKENS))

    def max_decode_rows(self) -> int | None:
        """Most rows a DECODE batch should have here: the largest captured decode graph, since a larger
        eager decode would grow the attention buffers the graphs hold; None (any) without graphs."""
        return self.graph_runner.max_bs if self.graph_runner is not None else None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Logits [bs or tokens, vocab] float32. Decode batches up to cuda_graph_max_bs and extend batches
        up to cuda_graph_max_extend_tokens replay a CUDA graph; their logits are then a view that the next
        forward overwrites. A pipeline stage other than the last returns None, once it has sent its
        activations on."""
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.replay(batch)
        self.attn_backend.init_forward_metadata(batch)
        batch.init_state_metadata(self.state_snapshots)
        if self.pp.size == 1:
            return self.model(batch.input_ids, batch.positions, batch)
        proxy = None
        if not self.pp.is_first:
            mc = self.model_config
            proxy = recv_from_prev_stage(batch.input_ids.shape[0], mc.hidden_size, mc.dtype, self.device)
        out = self.model(batch.input_ids, batch.positions, batch, proxy)
        if self.pp.is_last:
            return out
        self._sends.send(out)
        return None

    def pipeline_sample(self, make: Callable[[], tuple[SampledTokens, Any]]) -> tuple[SampledTokens, Any]:
        """A pipelined step's result on every rank: the last stage runs `make` (sampling, and whatever
        else only its logits give) and its first TP rank broadcasts what it returns to every rank of
        every stage; the other stages do not call `make`."""
        result = make() if self.pp.is_last else None
        self._sends.wait()
        return distributed.broadcast_object(result, src=self.pp.global_rank(self.pp.size - 1, 0))  # type: ignore[return-value]

    def _reusable_sampling_info(self, reqs: Sequence[SamplingRequest]) -> SamplingBatchInfo | None:
        """The last step's sampling tensors if `reqs` are the same requests and nothing in them can
        have changed (see _sampling_info), else None."""
        cached = self._sampling_cache
        if cached is not None and len(cached[0]) == len(reqs) and all(a is b for a, b in zip(cached[0], reqs)):
            return cached[1]
        return None

    def _sampling_info(
        self, reqs: Sequence[SamplingRequest], device: torch.device, pending: torch.Tensor | None
    ) -> SamplingBatchInfo:
        """The batch's sampling tensors, built (and cached for the next step when they can be reused).
        Decode steps repeat the same requests, and without penalties or min_new_tokens bans left the
        tensors depend only on each request's fixed parameters and seed: then the next step reuses
        them instead of rebuilding them from 256 requests' lists."""
        produced = [len(r.output_ids) + r.num_inflight for r in reqs]
        info = SamplingBatchInfo.from_params(
            [r.sampling_params for r in reqs],
            [r.seed for r in reqs],
            vocab_size=self.model_config.vocab_size,
            device=device,
            prompt_ids=[r.origin_input_ids for r in reqs],
            output_ids=[r.output_ids for r in reqs],
            num_output_tokens=produced,
            eos_token_ids=tuple(self.model_config.eos_token_ids),
            pending_output_ids=pending,
        )
        # The output count only grows, so a request past min_new_tokens stays past it.
        static = info.penalties is None and all(
            n >= r.sampling_params.min_new_tokens for r, n in zip(reqs, produced)
        )
        # The cache holds the requests themselves: an id() could be reused by a later request.
        self._sampling_cache = (list(reqs), info) if static else None
        return info

    def sample(self, logits: torch.Tensor, reqs: Sequence[SamplingRequest]) -> SampledTokens:
        """Next token of each request (rows of `logits` in `reqs` order), with log-probs if asked."""
        return self.sample_async(logits, reqs).result()

    def sample_async(
        self, logits: torch.Tensor, reqs: Sequence[SamplingRequest], future: FutureTokens | None = None
    ) -> PendingSample:
        """Start sampling without waiting for the device. `future` holds the tokens of the step
        still in flight (device ids and each request's row): those requests' host histories lag one
        token, which the penalties, min_new_tokens and the noise position take into account."""
        info = self._reusable_sampling_info(reqs)
        if info is None:
            # The in-flight tokens matter only to penalties and min_new_tokens, which a build reads;
            # a reused info needs neither them nor their copy to the device.
            pending = None
            if future is not None and any(r.num_inflight for r in reqs):
                tokens, rows = future
                index = to_device_async(
                    torch.tensor([rows.get(id(r), -1) for r in reqs], dtype=torch.int64), logits.device
                )
                pending = torch.where(index >= 0, tokens[index.clamp(min=0)], -1)
            info = self._sampling_info(reqs, logits.device, pending)
        # Greedy rows need no noise, so an all-greedy step sends no positions either.
        positions = None
        if not info.all_greedy:
            host = torch.tensor([r.seq_len + r.num_inflight for r in reqs], dtype=torch.int64)
            positions = to_device_async(host, logits.device)
        # A request finished by the step read back meanwhile is sampled for nothing; its grammar is done.
        constrained = [i for i, r in enumerate(reqs) if r.grammar is not None and not r.finished()]
        if constrained:
            # Each step's masks are new: they ride on a copy, and the cached info stays mask-free.
            if self._masks is None:
                self._masks = MaskBuffers(self.model_config.vocab_size, logits.device)
            rows = to_device_async(torch.tensor(constrained, dtype=torch.int64), logits.device)
            bitmask = self._masks.bitmask([reqs[i].grammar for i in constrained])
            info = dataclasses.replace(info, grammar=(rows, bitmask))
        top_n = max((r.top_logprobs_num for r in reqs), default=0)
        out = self.sampler(
            logits[:, : self.model_config.vocab_size],
            info,
            positions,
            return_logprob=any(r.return_logprob for r in reqs),
            top_logprobs_num=top_n,
        )
        return PendingSample(out, [r.top_logprobs_num for r in reqs])
