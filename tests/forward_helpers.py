"""A minimal stand-in for the model runner: owns the KV pools and builds ForwardBatch objects, so model
tests can run prefill, chunked extend and decode steps on real pools and the torch backend."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from services.worker.mem.memory_pool import ReqToTokenPool, TokenToKVPool, TokenToKVPoolAllocator
from services.worker.mem.state_pool import HybridReqToTokenPool, StatePool
from services.worker.runtime.attention.base import AttentionBackend
from services.worker.runtime.attention.torch_backend import TorchAttnBackend
from services.worker.runtime.forward_batch import ForwardBatch, ForwardMode
from services.worker.runtime.model_config import ModelConfig


class BatchDriver:
    """Runs `model` over requests identified by their ReqToTokenPool row, tracking each one's length."""

    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        tp_size: int = 1,
        max_requests: int = 4,
        max_tokens: int = 512,
        device: torch.device | str = "cpu",
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.req_pool = ReqToTokenPool(max_requests, config.context_len, self.device)
        if config.is_hybrid:  # linear-attention layers keep their state in a StatePool row per request
            state_pool = StatePool(max_requests, config.state_shape(tp_size), self.device)
            self.req_pool = HybridReqToTokenPool(max_requests, config.context_len, self.device, state_pool)
        self.kv_pool = TokenToKVPool(
            max_tokens,
            config.num_attention_layers,
            config.num_kv_heads_per_rank(tp_size),
            config.head_dim,
            config.dtype,
            self.device,
        )
        self.allocator = TokenToKVPoolAllocator(max_tokens, self.device)
        self.backend = TorchAttnBackend()
        self.seq_lens: dict[int, int] = {}

    def new_request(self) -> int:
        rows = self.req_pool.alloc(1)
        assert rows is not None, "out of request rows"
        self.seq_lens[rows[0]] = 0
        return rows[0]

    def extend(
        self, reqs: Sequence[tuple[int, Sequence[int]]], return_all_logits: bool = False
    ) -> torch.Tensor:
        """Append tokens to each (row, tokens) request in one EXTEND step."""
        return self._forward(ForwardMode.EXTEND, reqs, return_all_logits)

    def decode(self, reqs: Sequence[tuple[int, int]]) -> torch.Tensor:
        """One DECODE step: each (row, token) request appends one token; returns [bs, vocab] logits."""
        return self._forward(ForwardMode.DECODE, [(row, [tok]) for row, tok in reqs], False)

    @torch.inference_mode()
    def _forward(
        self, mode: ForwardMode, reqs: Sequence[tuple[int, Sequence[int]]], return_all_logits: bool
    ) -> torch.Tensor:
        prefix_lens, out_locs = [], []
        for row, tokens in reqs:
            slots = self.allocator.alloc(len(tokens))
            assert slots is not None, "out of KV slots"
            prefix_lens.append(self.seq_lens[row])
            out_locs.append(slots)
            self.seq_lens[row] += len(tokens)
        input_ids = torch.tensor([t for _, tokens in reqs for t in tokens], dtype=torch.int64, device=self.device)
        batch = step_batch(
            mode, [row for row, _ in reqs], prefix_lens, out_locs, input_ids, self.req_pool, self.kv_pool,
            self.backend, return_all_logits,
        )
        return self.model(batch.input_ids, batch.positions, batch)

    def greedy_decode(self, row: int, first_token: int, steps: int) -> tuple[list[int], list[torch.Tensor]]:
        """Feed first_token, then each step's argmax, for `steps` steps: (tokens fed, logits per step)."""
        tokens, logits = [first_token], []
        for _ in range(steps):
            step_logits = self.decode([(row, tokens[-1])])[0]
            logits.append(step_logits)
            tokens.append(int(step_logits.argmax()))
        return tokens, logits


def step_batch(
    mode: ForwardMode,
    rows: Sequence[int],
    prefix_lens: Sequence[int],
    slots: Sequence[torch.Tensor],
    input_ids: torch.Tensor,
    req_pool: ReqToTokenPool,
    kv_pool: TokenToKVPool,
    backend: AttentionBackend,
    return_all_logits: bool = False,
) -> ForwardBatch:
    """One step's ForwardBatch, its backend metadata initialised: request row i appends len(slots[i])
    tokens after its first prefix_lens[i], at KV slots slots[i] (written into req_pool here)."""
    counts = [len(s) for s in slots]
    for row, prefix, loc in zip(rows, prefix_lens, slots):
        req_pool.write(row, prefix, loc)
    seq_lens = [p + n for p, n in zip(prefix_lens, counts)]
    device = input_ids.device
    batch = ForwardBatch(
        forward_mode=mode,
        batch_size=len(rows),
        input_ids=input_ids,
        positions=torch.cat([torch.arange(p, p + n) for p, n in zip(prefix_lens, counts)]).to(device),
        req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        out_cache_loc=torch.cat(list(slots)).to(device),
        seq_lens_cpu=seq_lens,
        extend_prefix_lens_cpu=list(prefix_lens),
        extend_seq_lens_cpu=counts,
        req_to_token_pool=req_pool,
        token_to_kv_pool=kv_pool,
        attn_backend=backend,
        return_all_logits=return_all_logits,
    )
    backend.init_forward_metadata(batch)
    batch.init_state_metadata()
    return batch


def seeded_prompt(length: int, seed: int) -> list[int]:
    """`length` token ids in [3, 300), the same for the same seed."""
    return torch.randint(3, 300, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_mixed_steps(drivers: dict[str, BatchDriver], check: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """The same five steps on every driver (each over its own pools), `check` given each step's logits
    by driver name: a prefill of two prompts, a continued (chunked) prefill over request 0's cached
    prefix beside a fresh request, then three decode steps of all three requests."""

    def new_requests(count: int) -> list[int]:
        rows = [[driver.new_request() for _ in range(count)] for driver in drivers.values()]
        assert all(r == rows[0] for r in rows), rows
        return rows[0]

    def step(run: Callable[[BatchDriver], torch.Tensor]) -> None:
        check({name: run(driver) for name, driver in drivers.items()})

    rows = new_requests(2)
    step(lambda d: d.extend([(rows[0], seeded_prompt(9, 1)), (rows[1], seeded_prompt(5, 2))], return_all_logits=True))
    [fresh] = new_requests(1)
    step(lambda d: d.extend([(rows[0], seeded_prompt(6, 3)), (fresh, seeded_prompt(4, 4))], return_all_logits=True))
    for token in (7, 11, 13):
        step(lambda d, t=token: d.decode([(rows[0], t), (rows[1], t + 1), (fresh, t + 2)]))
