"""SpecWorker: one speculative decode step for the scheduler's running batch.

    propose      the proposer offers up to k tokens per request (fewer near max_new_tokens, the
                 context end or a full pool; none for requests that do not speculate)
    verify       the target runs ONE forward over every request's [last token, proposals...], inside
                 the usual continuous batch: one decode row per token (a CUDA graph replay on the
                 GPU), or an extend with every token's logits when the rows exceed the largest graph;
                 verify.py accepts a prefix of each request's proposals and adds the target's own
                 next token
    free         KV slots of rejected proposals go back at once, in the target and the draft;
                 req.kv_committed_len then covers accepted tokens only, so the radix cache (which
                 takes a request's committed tokens) only ever receives accepted ones

The scheduler appends each request's tokens with a finish check after each (a token after EOS or a
stop is dropped). Requests with log-probs, penalties, a logit_bias or an unmet min_new_tokens do not
speculate: they get no proposals and their row is sampled by the ordinary sampler, exactly as a plain
decode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.worker.runtime.forward_batch import ForwardMode
from services.worker.runtime.sampling.penalties import to_device_async
from services.worker.runtime.sampling.sampler import SamplingBatchInfo, processed_logits
from services.worker.scheduler.schedule_batch import MemoryContext, ScheduleBatch
from services.worker.scheduler.spec import Proposal
from services.worker.scheduler.spec.draft import DraftProposer
from services.worker.scheduler.spec.ngram import NgramProposer
from services.worker.scheduler.spec.verify import Verdict, verify, verify_greedy

if TYPE_CHECKING:
    from services.worker.config import EngineConfig
    from services.worker.runtime.model_runner import ModelRunner, SampledTokens
    from services.worker.scheduler.req import Req
    from services.worker.scheduler.spec import Proposer


@dataclass
class SpecStep:
    """The step's result per request of the batch, in batch order: `tokens[i]` to append (accepted
    proposals, then the target's token), or for a request decoded plainly, row `sampled_rows[i]` of
    `sampled` (the ordinary sampler's output, with log-probs); sampled_rows[i] is None otherwise."""

    tokens: list[list[int]]
    sampled_rows: list[int | None]
    sampled: SampledTokens | None


def can_speculate(req: Req) -> bool:
    """Speculation needs every proposal's distribution to be known before the earlier ones are
    accepted: penalties and min_new_tokens bans change with each token, and log-probs are reported
    by the plain path; such requests decode one token per step. So do requests with a logit_bias
    (the greedy paths compare raw argmaxes) and constrained ones (a grammar's mask follows each
    accepted token)."""
    params = req.sampling_params
    return (
        not req.return_logprob
        and params.frequency_penalty == 0.0
        and params.presence_penalty == 0.0
        and params.repetition_penalty == 1.0
        and not params.logit_bias
        and not params.is_constrained
        and len(req.output_ids) >= params.min_new_tokens
    )


class SpecWorker:
    """Proposes and verifies for the scheduler's decode batches (config.speculative_algorithm)."""

    def __init__(self, config: EngineConfig, runner: ModelRunner, mem: MemoryContext) -> None:
        self.num_draft_tokens = config.speculative_num_draft_tokens
        self.runner = runner
        self.mem = mem
        # Most verification rows one DECODE batch takes (ModelRunner.max_decode_rows).
        self.max_verify_rows = runner.max_decode_rows()
        self.proposer: Proposer
        if config.speculative_algorithm == "ngram":
            self.proposer = NgramProposer(config.speculative_ngram_max_match, config.speculative_ngram_min_match)
        else:
            self.proposer = DraftProposer(config, runner)

    def step(self, reqs: list[Req]) -> SpecStep | None:
        """Propose, verify and free rejected KV for a decode batch (every running request). None when
        nothing was proposed: the batch then decodes plainly, as a DECODE forward is cheaper than a
        one-token EXTEND (and can replay a CUDA graph)."""
        self.proposer.retain_only(reqs)
        proposal = self.proposer.propose(reqs, self._limits(reqs))
        drafts = proposal.tokens
        if not any(drafts):
            self.proposer.commit(reqs, [0] * len(reqs))
            for req in reqs:
                req.spec_verify_steps += 1
            return None
        seq_lens = [r.seq_len for r in reqs]
        for req, draft in zip(reqs, drafts):
            req.fill_ids = req.all_ids + draft  # placeholders while proposal.device_tokens is set
        logits = self._verify_forward(reqs, proposal)
        starts = [0]
        for draft in drafts[:-1]:
            starts.append(starts[-1] + len(draft) + 1)

        plain = [i for i, d in enumerate(drafts) if not d]
        spec = [i for i, d in enumerate(drafts) if d]
        sampled = None
        sampled_rows: list[int | None] = [None] * len(reqs)
        if plain:
            sampled = self.runner.sample(logits[[starts[i] for i in plain]], [reqs[i] for i in plain])
            for j, i in enumerate(plain):
                sampled_rows[i] = j
        num_accepted = [0] * len(reqs)
        tokens: list[list[int]] = [[] for _ in reqs]
        if spec:
            verdict = self._verify(logits, starts, spec, reqs, proposal, seq_lens)
            for i, accepted, toks in zip(spec, verdict.num_accepted, verdict.tokens):
                num_accepted[i], tokens[i] = accepted, toks

        for req, seq_len, draft, accepted in zip(reqs, seq_lens, drafts, num_accepted):
            # The forward wrote KV for positions seq_len-1 .. seq_len-1+len(draft); the last token and
            # the accepted proposals keep theirs.
            committed = seq_len + accepted
            if len(draft) > accepted:
                rejected = self.mem.req_to_token_pool.read(req.req_pool_idx, committed, seq_len + len(draft))
                self.mem.allocator.free(rejected)
            req.kv_committed_len = committed
            req.fill_ids = req.fill_ids[:committed]
            req.spec_verify_steps += 1
            req.spec_proposed_tokens += len(draft)
            req.spec_accepted_tokens += accepted
        self.proposer.commit(reqs, num_accepted)
        return SpecStep(tokens, sampled_rows, sampled)

    def _verify_forward(self, reqs: list[Req], proposal: Proposal) -> torch.Tensor:
        """The target's logits at each of [last token, proposals...] of every request, rows in batch
        order. Up to `max_verify_rows` rows go as one DECODE row per token (ScheduleBatch.prepare_rows:
        a CUDA graph replay on the GPU), taking proposals still on the device from there; more go as
        one EXTEND step with every token's logits, after reading the proposals back."""
        drafts = proposal.tokens
        batch = ScheduleBatch(reqs, ForwardMode.EXTEND, self.mem)
        rows = sum(len(d) + 1 for d in drafts)
        if self.max_verify_rows is None or rows <= self.max_verify_rows:
            future = None
            if proposal.device_tokens is not None:
                index: list[int] = []
                offset = 0
                for draft in drafts:
                    index.append(-1)  # the request's last token: on the host
                    index.extend(range(offset, offset + len(draft)))
                    offset += len(draft)
                future = (proposal.device_tokens, index)
            forward_batch = batch.prepare_rows(future)
        else:
            if proposal.device_tokens is not None:
                self._resolve(reqs, proposal, proposal.device_tokens.tolist())
            forward_batch = batch.prepare_extend()
            forward_batch.return_all_logits = True
        assert forward_batch.num_tokens == rows, "the request's KV must end before its last token"
        return self.runner.forward(forward_batch)

    @staticmethod
    def _resolve(reqs: list[Req], proposal: Proposal, flat: list[int]) -> None:
        """Put proposals read back from the device in place of their placeholders, in the proposal
        and in each request's fill_ids."""
        proposal.resolve(flat)
        for req, draft in zip(reqs, proposal.tokens):
            if draft:
                req.fill_ids = req.fill_ids[: len(req.fill_ids) - len(draft)] + draft

    def _limits(self, reqs: list[Req]) -> list[int]:
        """Proposals each request may take: k, less near max_new_tokens (the target adds one token of
        its own) and the context end, and only while the KV pool (free + evictable, beyond the one
        slot per request a plain decode needs) has room."""
        room = self.mem.allocator.available_size() + self.mem.tree_cache.evictable_size() - len(reqs)
        context_len = self.runner.model_config.context_len
        limits = []
        for req in reqs:
            n = 0
            if can_speculate(req):
                n = min(self.num_draft_tokens, req.remaining_new_tokens() - 1, context_len - req.seq_len, room)
                n = max(n, 0)
            room -= n
            limits.append(n)
        return limits

    def _verify(
        self,
        logits: torch.Tensor,
        starts: list[int],
        spec: list[int],
        reqs: list[Req],
        proposal: Proposal,
        seq_lens: list[int],
    ) -> Verdict:
        """Verify the requests `spec` (batch indices) against their rows of the target's logits, under
        each one's own sampling settings. Proposals still on the device come back here, with the
        target's argmaxes in the greedy case (one read-back for both)."""
        drafts = proposal.tokens
        rows: list[int] = []
        row_reqs: list[Req] = []
        firsts: list[int] = []
        for i in spec:
            firsts.append(len(rows))
            rows.extend(range(starts[i], starts[i] + len(drafts[i]) + 1))
            row_reqs.extend([reqs[i]] * (len(drafts[i]) + 1))
        device = logits.device
        vocab = self.runner.model_config.vocab_size
        if all(r.sampling_params.is_greedy for r in row_reqs):
            # No penalties or bans while speculating, so greedy rows need only the argmax.
            picked = logits if len(rows) == logits.shape[0] else logits[to_device_async(torch.tensor(rows), device)]
            argmax = picked[:, :vocab].argmax(dim=-1)
            if proposal.device_tokens is None:
                return verify_greedy(argmax.tolist(), [drafts[i] for i in spec])
            both = torch.cat((argmax, proposal.device_tokens)).tolist()
            self._resolve(reqs, proposal, both[len(rows) :])
            return verify_greedy(both[: len(rows)], [drafts[i] for i in spec])
        if proposal.device_tokens is not None:
            self._resolve(reqs, proposal, proposal.device_tokens.tolist())
        info = SamplingBatchInfo.from_params(
            [r.sampling_params for r in row_reqs],
            [r.seed for r in row_reqs],
            vocab_size=vocab,
            device=device,
            num_output_tokens=[len(r.output_ids) for r in row_reqs],
        )
        target = processed_logits(logits[torch.tensor(rows, device=device)], info)
        seeds = info.seeds[torch.tensor(firsts, device=device)]
        positions = torch.tensor([seq_lens[i] for i in spec], dtype=torch.int64).to(device)
        return verify(target, [drafts[i] for i in spec], proposal.probs, seeds, positions)

    def release(self, req: Req) -> None:
        self.proposer.release(req)

    def check_pool_invariant(self) -> None:
        self.proposer.check_pool_invariant()
