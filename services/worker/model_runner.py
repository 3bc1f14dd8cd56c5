"""ModelRunner: the model, its KV pools and attention backend on one device, and the sampler.

The scheduler hands it ForwardBatches and gets logits, then next tokens, back. Pool sizes come from
`max_total_tokens` or from free memory (device memory × mem_fraction_static on CUDA; a share of
available RAM on CPU), agreed across TP ranks.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.worker import distributed
from services.worker.attention.base import AttentionBackend
from services.worker.config import EngineConfig
from services.worker.forward_batch import ForwardBatch
from services.worker.mem.memory_pool import ReqToTokenPool, TokenToKVPool, TokenToKVPoolAllocator
from services.worker.model_config import ModelConfig
from services.worker.model_loader import load_model
from services.worker.sampling.sampler import Sampler, SamplingBatchInfo

if TYPE_CHECKING:
    from services.worker.scheduler.req import Req

logger = logging.getLogger(__name__)

# On CPU the pool takes at most this share of available RAM, and at most this many tokens.
CPU_MEM_SHARE = 0.25
CPU_MAX_POOL_TOKENS = 131072


@dataclass
class SampledTokens:
    """A step's sampling result on the host, row i for request i."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_attn_backend(name: str) -> AttentionBackend:
    if name == "torch":
        from services.worker.attention.torch_backend import TorchAttnBackend

        return TorchAttnBackend()
    if name == "triton":
        from services.worker.attention.triton_backend import TritonAttnBackend

        return TritonAttnBackend()
    raise ValueError(f"attention_backend must be 'torch' or 'triton', got {name!r}")


def _available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class ModelRunner:
    """Runs forwards and sampling for one TP rank."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, device: torch.device) -> None:
        self.config = config
        self.model_config = model_config
        self.device = device
        self.tp_size = distributed.get_tp_size()
        self.model = load_model(model_config, device)
        self.model.eval()

        kv_heads = model_config.num_kv_heads_per_rank(self.tp_size)
        bytes_per_token = TokenToKVPool.bytes_per_token(
            model_config.num_layers, kv_heads, model_config.head_dim, model_config.dtype
        )
        size = config.max_total_tokens or self._pool_size_from_memory(bytes_per_token)
        if self.tp_size > 1:
            agreed = torch.tensor([size], dtype=torch.int64, device=device if device.type == "cuda" else "cpu")
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
            size = int(agreed.item())
        self.max_total_tokens = size
        self.token_to_kv_pool = TokenToKVPool(
            size, model_config.num_layers, kv_heads, model_config.head_dim, model_config.dtype, device
        )
        self.allocator = TokenToKVPoolAllocator(size, device)
        rows = max(1, min(config.max_running_requests, size))
        self.req_to_token_pool = ReqToTokenPool(rows, model_config.context_len + 1, device)
        backend = config.attention_backend or ("triton" if device.type == "cuda" else "torch")
        self.attn_backend = make_attn_backend(backend)
        self.sampler = Sampler()
        logger.info(
            "model %s on %s (%s): KV pool %d tokens (%.1f MiB), %d request rows, %s attention",
            model_config.architecture, device, model_config.dtype, size,
            size * bytes_per_token / 2**20, rows, backend,
        )

    def _pool_size_from_memory(self, bytes_per_token: int) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - total * (1.0 - self.config.mem_fraction_static)
            size = int(budget // bytes_per_token)
            if size < 16:
                raise ValueError(
                    f"not enough device memory for the KV pool: {free / 2**30:.1f} GiB free after loading "
                    f"the model, mem_fraction_static={self.config.mem_fraction_static}"
                )
            return size
        size = int(_available_ram_bytes() * CPU_MEM_SHARE // bytes_per_token)
        return max(16, min(size, CPU_MAX_POOL_TOKENS))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.attn_backend.init_forward_metadata(batch)
        return self.model(batch.input_ids, batch.positions, batch)

    def sample(self, logits: torch.Tensor, reqs: list[Req]) -> SampledTokens:
        """Next token of each request (rows of `logits` in `reqs` order), with log-probs if asked."""
        info = SamplingBatchInfo.from_params(
            [r.sampling_params for r in reqs],
            [r.seed for r in reqs],
            vocab_size=self.model_config.vocab_size,
            device=logits.device,
            prompt_ids=[r.origin_input_ids for r in reqs],
            output_ids=[r.output_ids for r in reqs],
            eos_token_ids=tuple(self.model_config.eos_token_ids),
        )
        positions = torch.tensor([r.seq_len for r in reqs], dtype=torch.int64).to(logits.device)
        want_logprob = any(r.return_logprob for r in reqs)
        top_n = max((r.top_logprobs_num for r in reqs), default=0)
        out = self.sampler(
            logits[:, : self.model_config.vocab_size], info, positions,
            return_logprob=want_logprob, top_logprobs_num=top_n,
        )
        # The one host sync of the step.
        token_ids = out.next_token_ids.tolist()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        top: list[list[tuple[int, float]]] | None = None
        if out.top_logprobs_ids is not None and out.top_logprobs_vals is not None:
            ids, vals = out.top_logprobs_ids.tolist(), out.top_logprobs_vals.tolist()
            top = [
                list(zip(ids[i][: r.top_logprobs_num], vals[i][: r.top_logprobs_num])) for i, r in enumerate(reqs)
            ]
        return SampledTokens(token_ids, logprobs, top)
