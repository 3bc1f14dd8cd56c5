"""Draft-model proposer: a second, smaller checkpoint with the target's vocabulary proposes k tokens
per request by decoding k steps on its own ModelRunner (own weights, own KV pool and request rows).

Each request keeps a draft sequence: draft KV for its first `length` tokens. A step first catches the
draft up on the tokens it has not seen (the whole prompt the first time; afterwards the target's own
token and whatever else was appended since) in one forward, which yields the first proposal, then runs
one decode per further proposal. A short catch-up goes as decode rows, one per token, so on the GPU
every draft forward after the first replays a CUDA graph. After verification the draft keeps the KV of the accepted drafts and
frees the rest, so it never holds a rejected token.

The draft has no prefix cache: every request holds its full sequence. When the draft pool is short,
requests propose fewer tokens (none at worst) rather than wait.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.worker.runtime.forward_batch import ForwardBatch, ForwardMode
from services.worker.runtime.model_config import ModelConfig
from services.worker.runtime.model_runner import ModelRunner
from services.worker.runtime.sampling.penalties import to_device_async
from services.worker.runtime.sampling.sampler import SamplingBatchInfo, gumbel_noise, processed_logits
from services.worker.scheduler.spec import Proposal
from services.worker.scheduler.spec.verify import DRAFT_SALT

if TYPE_CHECKING:
    from services.worker.config import EngineConfig
    from services.worker.scheduler.req import Req


@dataclass
class _DraftSeq:
    """One request's state in the draft: its request row, and how many of its tokens have draft KV."""

    req: Req
    row: int
    length: int = 0


@dataclass
class _Planned:
    """A request proposing this step: its index in the batch, its sequence length then, its count."""

    index: int
    seq: _DraftSeq
    seq_len: int
    count: int


class DraftProposer:
    """Proposes with a draft model (see the module docstring)."""

    def __init__(self, config: EngineConfig, target: ModelRunner) -> None:
        path = config.speculative_draft_model_path
        assert path is not None, "EngineConfig checks that 'draft' has a path"
        model_config = ModelConfig.from_path(path, dtype=config.dtype, device=target.device)
        if model_config.vocab_size != target.model_config.vocab_size:
            raise ValueError(
                f"speculative_draft_model_path {path!r} has a vocabulary of {model_config.vocab_size} tokens; "
                f"the target has {target.model_config.vocab_size}"
            )
        if model_config.context_len < target.model_config.context_len:
            raise ValueError(
                f"speculative_draft_model_path {path!r} holds {model_config.context_len} positions, fewer than "
                f"the target's {target.model_config.context_len}: lower context_length"
            )
        # As many KV slots as the target's pool; without a prefix cache the draft can still run short
        # when requests share long prefixes, and they then propose less.
        draft_config = config.replace(
            model_path=path,
            max_total_tokens=target.max_total_tokens,
            speculative_algorithm=None,
            speculative_draft_model_path=None,
        )
        self.runner = ModelRunner(draft_config, model_config, target.device, draft=True)
        # Catch-ups of at most this many tokens in all run as decode rows, longer ones as an EXTEND.
        self.max_rows = self.runner.max_decode_rows()
        self.vocab_size = model_config.vocab_size
        self._seqs: dict[int, _DraftSeq] = {}
        self._planned: list[_Planned] = []

    # ---- proposing ------------------------------------------------------------------------------

    def propose(self, reqs: list[Req], limits: list[int]) -> Proposal:
        plan = self._plan(reqs, limits)
        self._planned = plan
        tokens: list[list[int]] = [[] for _ in reqs]
        if not plan:
            return Proposal(tokens)
        # All-greedy drafting proposes argmaxes: point masses, no distribution to carry.
        sampled = not all(p.seq.req.sampling_params.is_greedy for p in plan)
        # Step 0 catches every planned sequence up and proposes its first token.
        new = [p.seq.req.all_ids[p.seq.length :] for p in plan]
        input_ids = torch.tensor([t for ids in new for t in ids], dtype=torch.int64)
        logits = self._forward(ForwardMode.EXTEND, [p.seq for p in plan], input_ids, [len(ids) for ids in new])
        step_tokens, step_probs = self._sample(logits, plan, 0, sampled)
        all_tokens, all_probs, active = [step_tokens], [step_probs], plan
        for j in range(1, max(p.count for p in plan)):
            keep = [i for i, p in enumerate(active) if p.count > j]
            active = [active[i] for i in keep]
            prev = step_tokens if len(keep) == len(step_tokens) else step_tokens[
                to_device_async(torch.tensor(keep, dtype=torch.int64), step_tokens.device)]
            logits = self._forward(ForwardMode.DECODE, [p.seq for p in active], prev, [1] * len(active))
            step_tokens, step_probs = self._sample(logits, active, j, sampled)
            all_tokens.append(step_tokens)
            all_probs.append(step_probs)
        # Step-major rows -> request-major rows: step j ran the planned requests with count > j, in
        # plan order.
        row_of: dict[tuple[int, int], int] = {}
        for j in range(len(all_tokens)):
            for p in (q for q in plan if q.count > j):
                row_of[(p.index, j)] = len(row_of)
        order = to_device_async(
            torch.tensor([row_of[(p.index, j)] for p in plan for j in range(p.count)], dtype=torch.int64),
            logits.device,
        )
        for p in plan:
            tokens[p.index] = [0] * p.count  # placeholders: the tokens stay on the device (Proposal)
        probs = torch.cat(all_probs)[order] if sampled else None
        return Proposal(tokens, probs, device_tokens=torch.cat(all_tokens)[order])

    def _plan(self, reqs: list[Req], limits: list[int]) -> list[_Planned]:
        """Who proposes how many: each request's catch-up plus count - 1 decode tokens must fit."""
        free = self.runner.allocator.available_size()
        plan: list[_Planned] = []
        for i, (req, limit) in enumerate(zip(reqs, limits)):
            if limit < 1:
                continue
            seq = self._seqs.get(id(req))
            if seq is not None and seq.req is not req:  # a finished request's id reused
                self._free(seq)
                seq = None
            if seq is None:
                rows = self.runner.req_to_token_pool.alloc(1)
                if rows is None:
                    continue
                seq = self._seqs[id(req)] = _DraftSeq(req, rows[0])
            catch_up = req.seq_len - seq.length
            count = min(limit, free - catch_up + 1)
            if count < 1:
                continue
            free -= catch_up + count - 1
            plan.append(_Planned(i, seq, req.seq_len, count))
        return plan

    def _sample(
        self, logits: torch.Tensor, plan: list[_Planned], step: int, sampled: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's proposal for position seq_len + step, drawn from the draft's distribution under
        the request's own sampling settings (argmax for greedy), with noise salted away from the
        target's; and that distribution when some request samples."""
        if not sampled:
            # Greedy rows speculate without penalties or bans (can_speculate): the draft's argmax.
            return logits[:, : self.vocab_size].argmax(dim=-1), None
        reqs = [p.seq.req for p in plan]
        info = SamplingBatchInfo.from_params(
            [r.sampling_params for r in reqs],
            [r.seed for r in reqs],
            vocab_size=self.vocab_size,
            device=logits.device,
            num_output_tokens=[len(r.output_ids) for r in reqs],
        )
        dist = processed_logits(logits[:, : self.vocab_size], info)
        positions = to_device_async(torch.tensor([p.seq_len + step for p in plan], dtype=torch.int64), logits.device)
        vocab = torch.arange(dist.shape[-1], device=logits.device).unsqueeze(0)
        tokens = (dist + gumbel_noise(info.seeds ^ DRAFT_SALT, positions, vocab)).argmax(dim=-1)
        return tokens, dist.softmax(dim=-1)

    def _forward(
        self, mode: ForwardMode, seqs: list[_DraftSeq], input_ids: torch.Tensor, new_lens: list[int]
    ) -> torch.Tensor:
        """Append new_lens[i] tokens to draft sequence i (KV slots from the plan's budget) and return
        the draft's logits for each sequence's last new token. input_ids is a host tensor (a catch-up)
        or the device tensor of the last step's proposals; everything else the device needs goes over
        in one pinned copy, so preparing this step never waits for the one in flight."""
        runner = self.runner
        pool = runner.req_to_token_pool
        slots = runner.allocator.alloc(sum(new_lens))
        assert slots is not None, "the plan reserved these slots"
        prefix_lens = [s.length for s in seqs]
        table_rows = torch.repeat_interleave(torch.tensor([s.row for s in seqs], dtype=torch.int64),
                                             torch.tensor(new_lens, dtype=torch.int64))
        positions = torch.cat([torch.arange(p, p + n, dtype=torch.int64) for p, n in zip(prefix_lens, new_lens)])
        for seq, prefix, n in zip(seqs, prefix_lens, new_lens):
            seq.length = prefix + n
        pool.write_cpu(table_rows, positions, slots)
        rows = len(positions)
        as_rows = mode.is_extend() and (self.max_rows is None or rows <= self.max_rows)
        if as_rows:
            # Each new token its own decode row over its request's KV (see ScheduleBatch.prepare_rows):
            # the catch-up replays a decode CUDA graph instead of running an eager EXTEND.
            mode = ForwardMode.DECODE
            pool_rows = table_rows
            prefix_list = positions.tolist()
            seq_lens, prefix_lens, new_counts = [p + 1 for p in prefix_list], prefix_list, [1] * rows
        else:
            pool_rows = torch.tensor([s.row for s in seqs], dtype=torch.int64)
            seq_lens, new_counts = [p + n for p, n in zip(prefix_lens, new_lens)], list(new_lens)
        device = runner.device
        host_ids = input_ids.device.type == "cpu"
        parts = [positions, pool_rows, torch.tensor(seq_lens, dtype=torch.int64), slots, table_rows]
        parts += [input_ids] if host_ids else []
        pieces = list(to_device_async(torch.cat(parts), device).split([p.numel() for p in parts]))
        positions_d, pool_rows_d, seq_lens_d, slots_d, table_rows_d = pieces[:5]
        pool.write_device(table_rows_d, positions_d, slots_d)
        batch = ForwardBatch(
            forward_mode=mode,
            batch_size=len(pool_rows),
            input_ids=pieces[5] if host_ids else input_ids,
            positions=positions_d,
            req_pool_indices=pool_rows_d,
            seq_lens=seq_lens_d,
            out_cache_loc=slots_d,
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=prefix_lens,
            extend_seq_lens_cpu=new_counts,
            req_to_token_pool=pool,
            token_to_kv_pool=runner.token_to_kv_pool,
            attn_backend=runner.attn_backend,
        )
        logits = runner.forward(batch)
        if as_rows and rows != len(seqs):
            last = torch.tensor(new_lens, dtype=torch.int64).cumsum(0) - 1
            logits = logits[to_device_async(last, device)]
        return logits

    # ---- bookkeeping ----------------------------------------------------------------------------

    def commit(self, reqs: list[Req], num_accepted: list[int]) -> None:
        """Keep draft KV up to the last accepted proposal (the last proposal never had KV written)."""
        for p in self._planned:
            keep = p.seq_len + min(num_accepted[p.index], p.count - 1)
            self._truncate(p.seq, keep)
        self._planned = []

    def release(self, req: Req) -> None:
        seq = self._seqs.get(id(req))
        if seq is not None and seq.req is req:
            self._free(seq)

    def retain_only(self, reqs: list[Req]) -> None:
        live = {id(r) for r in reqs}
        for key, seq in list(self._seqs.items()):
            if key not in live:
                self._free(seq)

    def _truncate(self, seq: _DraftSeq, length: int) -> None:
        if length < seq.length:
            self.runner.allocator.free(self.runner.req_to_token_pool.read(seq.row, length, seq.length))
            seq.length = length

    def _free(self, seq: _DraftSeq) -> None:
        self._truncate(seq, 0)
        self.runner.req_to_token_pool.free(seq.row)
        del self._seqs[id(seq.req)]

    def check_pool_invariant(self) -> None:
        held = sum(s.length for s in self._seqs.values())
        free = self.runner.allocator.available_size()
        if free + held != self.runner.allocator.size:
            raise AssertionError(f"draft KV pool leak: free {free} + held {held} != {self.runner.allocator.size}")
        rows = self.runner.req_to_token_pool
        if rows.available_size() + len(self._seqs) != rows.size:
            raise AssertionError(f"draft request rows leak: {rows.available_size()} free, {len(self._seqs)} held")
