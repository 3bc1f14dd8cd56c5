"""A minimal stand-in for the model runner: owns the KV pools and builds ForwardBatch objects, so model
tests can run prefill, chunked extend and decode steps on real pools and the torch backend."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from services.worker.mem.memory_pool import ReqToTokenPool, TokenToKVPool, TokenToKVPoolAllocator
from services.worker.mem.state_pool import HybridReqToTokenPool, StatePool
from services.worker.mem.state_snapshots import StateSnapshots
from services.worker.runtime.attention.base import AttentionBackend
from services.worker.runtime.attention.torch_backend import TorchAttnBackend
from services.worker.runtime.forward_batch import ForwardBatch, ForwardMode
from services.worker.runtime.model_config import ModelConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel


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
        self.snapshots: StateSnapshots | None = None
        if config.is_hybrid:  # linear-attention layers keep their state in a StatePool row per request
            state_pool = StatePool(max_requests, config.state_shape(tp_size), self.device)
            self.req_pool = HybridReqToTokenPool(max_requests, config.context_len, self.device, state_pool)
            self.snapshots = StateSnapshots(max_requests, self.req_pool)  # slots a step can track into
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
        self,
        reqs: Sequence[tuple[int, Sequence[int]]],
        return_all_logits: bool = False,
        track: Sequence[tuple[int, int]] = (),
    ) -> torch.Tensor:
        """Append tokens to each (row, tokens) request in one EXTEND step; each (i, slot) of `track` saves
        request i's state one token short of its end into snapshot slot `slot` (ForwardBatch.state_track)."""
        return self._forward(ForwardMode.EXTEND, reqs, return_all_logits, track)

    def decode(self, reqs: Sequence[tuple[int, int]]) -> torch.Tensor:
        """One DECODE step: each (row, token) request appends one token; returns [bs, vocab] logits."""
        return self._forward(ForwardMode.DECODE, [(row, [tok]) for row, tok in reqs], False)

    @torch.inference_mode()
    def _forward(
        self,
        mode: ForwardMode,
        reqs: Sequence[tuple[int, Sequence[int]]],
        return_all_logits: bool,
        track: Sequence[tuple[int, int]] = (),
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
        if track:
            batch.state_track = list(track)
            batch.init_state_metadata(self.snapshots)
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


def assert_rows_close(ours: torch.Tensor, ref: torch.Tensor, rel_tol: float = 1e-4) -> None:
    """Every row's relative error ||a - b|| / ||b|| is within rel_tol."""
    assert ours.shape == ref.shape
    rel = (ours - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert rel.max().item() <= rel_tol, f"relative error per row: {rel.tolist()}"


@torch.no_grad()
def hf_logits(hf: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    """transformers' float32 logits at every position of one prompt."""
    return hf(torch.tensor([tokens])).logits[0].float()


def check_greedy_decode(config: ModelConfig, model: nn.Module, hf: PreTrainedModel, prompt: list[int], steps: int) -> None:
    """A prefill of `prompt` and `steps` greedy decode steps on a BatchDriver give transformers' greedy
    tokens, and logits within assert_rows_close of its logits at every step."""
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=steps + 1, do_sample=False, eos_token_id=None,
            pad_token_id=0, output_logits=True, return_dict_in_generate=True,
        )
    assert len(ref.logits) == steps + 1
    driver = BatchDriver(model, config)
    row = driver.new_request()
    prefill = driver.extend([(row, prompt)])
    assert prefill.shape == (1, config.vocab_size)
    assert_rows_close(prefill, ref.logits[0].float())
    tokens, step_logits = driver.greedy_decode(row, int(prefill[0].argmax()), steps)
    assert tokens == ref.sequences[0, len(prompt) :].tolist()
    assert_rows_close(torch.stack(step_logits), torch.cat(ref.logits[1:]).float())
    assert len(set(tokens)) > 4, "the seeded model should not just repeat one token"


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
