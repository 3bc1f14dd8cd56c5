# Over 400 lines: one scheduler's step loop, batch choice, memory and invariants read best together.
"""The scheduler: one step = admit → build a batch → forward → sample → finish → free.

Prefill has priority: when requests wait (or a chunked prefill is in progress) the step is an
EXTEND batch; otherwise the running requests decode. Every rank (every TP rank of every pipeline
stage) runs this same scheduler on the same inputs, so they take the same decisions without talking;
with pipeline stages the last stage's sampled tokens are broadcast to all of them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.worker.config import EngineConfig
from services.worker.mem.hybrid_radix_cache import HybridRadixCache
from services.worker.mem.radix_cache import RadixCache
from services.worker.mem.state_pool import HybridReqToTokenPool
from services.worker.runtime.forward_batch import ForwardMode
from services.worker.runtime.model_runner import SampledOnLastStage
from services.worker.scheduler.output import ReqOutput, final_output, sampled_output
from services.worker.scheduler.req import FinishReason, Req
from services.worker.scheduler.schedule_batch import InFlight, MemoryContext, PromptLogprobs, ScheduleBatch
from services.worker.scheduler.schedule_policy import (
    PrefillAdder,
    SchedulePolicy,
    model_keys_per_token,
    new_token_ratio_after_retraction,
    retract,
)
from services.worker.scheduler.spec.spec_worker import SpecStep, SpecWorker
from shared import trace

if TYPE_CHECKING:
    from services.worker.runtime.model_runner import ModelRunner, SampledTokens
    from services.worker.runtime.sampling.grammar import GrammarBackend

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_prefill_steps: int = 0
    num_decode_steps: int = 0
    num_retractions: int = 0
    num_micro_batches: int = 0  # pipeline stages: micro-batches the steps went through as
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0


def make_tree_cache(config: EngineConfig, runner: ModelRunner) -> RadixCache:
    """The prefix cache: a hybrid model's also keeps its linear layers' state at radix nodes (snapshots,
    see mem/hybrid_radix_cache.py), so a prefix hit resumes that state too. With no snapshot slots a
    hybrid model's cached KV could never be matched: its cache is off."""
    snapshots = runner.state_snapshots
    if snapshots is not None and snapshots.total > 0 and not config.disable_radix_cache:
        return HybridRadixCache(
            runner.req_to_token_pool, runner.allocator, snapshots.slots, snapshots.copy_state,
            snapshots.restore_state, eviction_policy=config.radix_eviction_policy,
        )
    return RadixCache(
        runner.req_to_token_pool, runner.allocator, eviction_policy=config.radix_eviction_policy,
        disable=config.disable_radix_cache or snapshots is not None,
    )


class Scheduler:
    """Continuous batching over one model runner (one TP rank)."""

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        decode_tail: Callable[[list[int]], str],
        grammar: GrammarBackend | None = None,
    ):
        self.config = config
        self.grammar = grammar
        self.runner = runner
        # Mixed steps size their chunk by its cost (see model_keys_per_token); unused otherwise.
        self._keys_per_token, self._min_mixed_chunk = 0.0, 1
        if config.enable_mixed_chunk:
            self._keys_per_token = model_keys_per_token(runner.model_config)
            self._min_mixed_chunk = runner.attn_backend.min_extend_chunk_tokens()
        self.decode_tail = decode_tail
        self.tree_cache = make_tree_cache(config, runner)
        self.mem = MemoryContext(
            req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool=runner.token_to_kv_pool,
            allocator=runner.allocator,
            tree_cache=self.tree_cache,
            attn_backend=runner.attn_backend,
            device=runner.device,
        )
        self.policy = SchedulePolicy(config.schedule_policy, self.tree_cache, seed=config.random_seed)
        self.max_running = min(config.max_running_requests, runner.req_to_token_pool.size)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.new_token_ratio = min(1.0, INIT_NEW_TOKEN_RATIO * config.schedule_conservativeness)
        self.stats = SchedulerStats()
        self._pending_outputs: list[ReqOutput] = []
        self.overlap = config.overlap_enabled(runner.device.type)
        self._inflight: InFlight | None = None
        self.spec: SpecWorker | None = None
        if config.speculative_algorithm is not None:
            self.spec = SpecWorker(config, runner, self.mem)
            logger.info(
                "speculative decoding: %s, %d draft tokens per step; the overlap schedule is off",
                config.speculative_algorithm, config.speculative_num_draft_tokens,
            )

    # ---- requests in and out -------------------------------------------------------------------

    def add_request(self, req: Req) -> None:
        if req.sampling_params.is_constrained and req.grammar is None:
            try:
                req.attach_grammar(self.grammar)
            except ValueError as exc:
                # Checked before it queued (SamplingParams.verify); this is a grammar that compiles
                # alone but not against this vocabulary.
                req.finished_reason = FinishReason("abort", message=str(exc))
                self._pending_outputs.append(final_output(req))
                return
        self.waiting.append(req)

    def abort_request(self, rid: str, reason: FinishReason | None = None) -> bool:
        """Abort a waiting or running request; its final output comes with the next step. `reason`:
        the final's finish (default: an 'abort' asked for by a client)."""
        reason = reason or FinishReason("abort", message="aborted by request")
        for i, req in enumerate(self.waiting):
            if req.rid == rid:
                del self.waiting[i]
                req.finished_reason = reason
                self._pending_outputs.append(final_output(req))
                return True
        for req in [*self.running, *([self.chunked_req] if self.chunked_req else [])]:
            if req.rid == rid and not req.finished():
                req.finished_reason = reason
                return True
        return False

    def has_work(self) -> bool:
        return bool(
            self.waiting or self.running or self.chunked_req or self._pending_outputs or self._inflight
        )

    def num_running(self) -> int:
        return len(self.running) + (1 if self.chunked_req else 0)

    def flush_cache(self) -> bool:
        """Drop the prefix cache; refused (False) while requests are in flight."""
        if self.waiting or self.running or self.chunked_req:
            return False
        self.tree_cache.reset()
        self.runner.allocator.clear()
        self.runner.req_to_token_pool.clear()
        if isinstance(self.tree_cache, HybridRadixCache):
            self.tree_cache.state_slots.clear()
        return True

    # ---- the step ------------------------------------------------------------------------------

    def step(self) -> list[ReqOutput]:
        """Run one scheduler step and return what it finished producing.

        With overlap, the batch chosen now is launched before the previous one's tokens are read
        back, so the host's scheduling and output processing hide under the device's forward; the
        decode inputs that depend on the previous step are taken from its device-side token ids.
        A step's outputs therefore come back one call later."""
        outputs, self._pending_outputs = self._pending_outputs, []
        self._release_aborted(outputs)
        if self._inflight is not None and self._must_sync_before_scheduling():
            self._finish_inflight(outputs)
        batch = self._next_batch(outputs)
        if self.spec is not None and batch is not None and batch.mode.is_decode():
            # Speculation turns overlap off; without proposals the batch decodes as usual.
            spec_step = self.spec.step(batch.reqs)
            if spec_step is not None:
                self._apply_spec_step(batch, spec_step, outputs)
                return outputs
        launched = self._launch(batch, outputs) if batch is not None else None
        self._finish_inflight(outputs)
        if self.overlap:
            self._inflight = launched
        elif launched is not None:
            self._process(launched, outputs)
        return outputs

    def _must_sync_before_scheduling(self) -> bool:
        """An extend step in flight changes the tree and the running set (chunked prefill, new
        requests); a mixed step would need its decodes' tokens on the host. Both wait for it. (A
        constrained request's mask needs the token in flight too, but only to sample: _launch reads
        it back after launching the next forward.)"""
        assert self._inflight is not None
        if self._inflight.batch.mode.is_extend():
            return True
        return self.config.enable_mixed_chunk and bool(self.waiting or self.chunked_req)

    def _launch(self, batch: ScheduleBatch, outputs: list[ReqOutput]) -> InFlight:
        """Prepare, run the forward and start sampling; nothing here waits for the device, unless a
        constrained request's grammar needs the token still in flight to mask this step: then the step
        in flight is read back (into `outputs`) once this forward is queued, and the grammars advance
        and compute their masks while it runs, as SGLang's overlap schedule does."""
        self.stats.num_steps += 1
        if self.runner.pp.size > 1:
            return self._launch_pipelined(batch)
        prev = self._inflight
        future = None
        if prev is not None and batch.mode.is_decode():
            future = (prev.handle.token_ids, {id(r): j for j, r in enumerate(prev.sampled)})
        forward_batch = batch.prepare_decode(future) if batch.mode.is_decode() else batch.prepare_extend()
        logits = self.runner.forward(forward_batch)
        assert logits is not None
        sampled_idx = batch.sampled_rows()
        sampled = [batch.reqs[i] for i in sampled_idx]
        batch.commit(forward_batch, logits)
        rows = logits if len(sampled_idx) == len(logits) else logits[sampled_idx]  # (past bs: prompt rows)
        if prev is not None and any(r.grammar is not None and r.num_inflight for r in sampled):
            self._finish_inflight(outputs)
            future = None
        handle = self.runner.sample_async(rows, sampled, future)
        for req in sampled:
            req.num_inflight += 1
        if batch.mode.is_extend():
            trace.mark_each(sampled, "scheduler.launched")  # RS_TRACE_DIR: the host's part of a prefill
        return InFlight(batch, sampled, handle)

    def _launch_pipelined(self, batch: ScheduleBatch) -> InFlight:
        """With pipeline stages the batch goes through as up to pp_size micro-batches (consecutive
        requests; a single request stays whole): each stage sends a micro-batch's activations on without
        waiting and starts the next, so stage s works on micro-batch k while stage s + 1 works on k - 1.
        Only the last stage has logits: it samples every micro-batch's rows (and takes the prompt
        log-probs) and every rank receives the result, so every rank's scheduler advances the same
        requests. The next step needs these tokens, so steps do not overlap."""
        parts = batch.split(self.runner.pp.size)
        self.stats.num_micro_batches += len(parts)
        runs = []
        for part in parts:
            forward_batch = part.prepare_decode() if part.mode.is_decode() else part.prepare_extend()
            runs.append((part, forward_batch, self.runner.forward(forward_batch), part.sampled_rows()))
        sampled = [part.reqs[i] for part, _, _, rows in runs for i in rows]

        def on_last_stage() -> tuple[SampledTokens, list[PromptLogprobs | None]]:
            picked = []
            for _, _, logits, rows in runs:
                assert logits is not None
                picked.append(logits if len(rows) == len(logits) else logits[rows])
            prompts = [part.prompt_logprobs_of(logits) for part, _, logits, _ in runs]  # type: ignore[arg-type]
            return self.runner.sample(torch.cat(picked), sampled), prompts

        tokens, prompts = self.runner.pipeline_sample(on_last_stage)
        for (part, forward_batch, _, _), prompt in zip(runs, prompts):
            part.commit(forward_batch, prompt=prompt)
        for req in sampled:
            req.num_inflight += 1
        return InFlight(batch, sampled, SampledOnLastStage(tokens))

    def _finish_inflight(self, outputs: list[ReqOutput]) -> None:
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            self._process(inflight, outputs)

    def _process(self, inflight: InFlight, outputs: list[ReqOutput]) -> None:
        """Read a launched step's tokens back (the host sync) and advance its requests."""
        result = inflight.handle.result()
        if inflight.batch.mode.is_extend():
            trace.mark_each(inflight.sampled, "scheduler.synced")
        for j, req in enumerate(inflight.sampled):
            req.num_inflight -= 1
            if req.finished():
                continue  # aborted, or finished by the step before, while this one was in flight
            self._append_token(req, result, j, outputs)
        if inflight.batch.mode.is_extend():
            self._after_extend(inflight.batch)
        self.running = [r for r in self.running if not r.finished()]

    def _apply_spec_step(self, batch: ScheduleBatch, step: SpecStep, outputs: list[ReqOutput]) -> None:
        """Each request of a speculative decode step gains its accepted proposals and the target's
        own token (or one plainly sampled token)."""
        self.stats.num_steps += 1
        for req, tokens, row in zip(batch.reqs, step.tokens, step.sampled_rows):
            if row is not None:
                assert step.sampled is not None
                self._append_token(req, step.sampled, row, outputs)
            else:
                out = ReqOutput(rid=req.rid, token_ids=[])
                self._add_tokens(req, tokens, out)
                outputs.append(out)
        self.running = [r for r in self.running if not r.finished()]

    def _append_token(self, req: Req, result: SampledTokens, j: int, outputs: list[ReqOutput]) -> None:
        out = sampled_output(req, result, j)  # max_new_tokens 0 (prompt log-probs only) finishes here
        self._add_tokens(req, [] if req.finished() else [result.token_ids[j]], out)
        outputs.append(out)

    def _add_tokens(self, req: Req, tokens: list[int], out: ReqOutput) -> None:
        """Append tokens to the request and to `out`, checking for a finish after each; tokens after a
        finishing one are dropped."""
        for token in tokens:
            req.append_output_token(token, self.decode_tail)
            out.token_ids.append(token)
            self.stats.generated_tokens += 1
            if req.finished():
                break
        if req.finished():
            self._release(req)
            out.take_final(final_output(req))

    def _after_extend(self, batch: ScheduleBatch) -> None:
        """Every request this step prefilled (a chunk or all of it) puts that KV into the tree, locked,
        so requests waiting with the same prefix hit it next step; fresh requests that did not finish
        on their first token join the running batch (decodes riding in a mixed step are already in)."""
        running = {id(r) for r in self.running}
        for req in batch.reqs:
            if req.finished() or id(req) in running:
                continue
            self.tree_cache.cache_unfinished_req(req)
            if req is not self.chunked_req:
                self.running.append(req)

    # ---- choosing the next batch ---------------------------------------------------------------

    def _next_batch(self, outputs: list[ReqOutput]) -> ScheduleBatch | None:
        prefill = self._prefill_batch()
        if prefill is not None:
            return prefill
        if not self.running:
            return None
        self._ensure_decode_memory(outputs)
        if not self.running:
            return None
        # A request whose in-flight token is its last (max_new_tokens) needs no further step.
        reqs = [r for r in self.running if r.remaining_new_tokens() > r.num_inflight]
        if not reqs:
            return None
        self.stats.num_decode_steps += 1
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        return ScheduleBatch(reqs, ForwardMode.DECODE, self.mem)

    def _prefill_batch(self) -> ScheduleBatch | None:
        if not self.waiting and self.chunked_req is None:
            return None
        mixed = self.config.enable_mixed_chunk and self.running
        running_for_budget = self.running
        adder = PrefillAdder(
            self.tree_cache,
            self.runner.allocator,
            running_for_budget,
            self.new_token_ratio,
            self.config.max_prefill_tokens,
            self.config.chunked_prefill_size,
            max_new_reqs=self.max_running - len(self.running),
            mixed_decode_tokens=len(self.running) if mixed else 0,
            attention_keys_per_token=self._keys_per_token if mixed else None,
            min_chunk_tokens=self._min_mixed_chunk,
        )
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            adder.add_chunked_req(self.chunked_req)
        if self.waiting and adder.new_chunked_req is None:
            self.policy.admit(self.waiting, adder)
        admitted = [r for r in adder.can_run_list if r is not self.chunked_req]
        if not adder.can_run_list:
            return None
        admitted_ids = {id(r) for r in admitted}
        self.waiting = [r for r in self.waiting if id(r) not in admitted_ids]
        for req in admitted:
            if req.cached_tokens is None:
                req.mark_admitted()
                self.stats.prompt_tokens += len(req.origin_input_ids)
                self.stats.cached_tokens += len(req.prefix_indices)
        self.chunked_req = adder.new_chunked_req
        reqs = list(adder.can_run_list)
        if mixed:
            for req in self.running:
                req.fill_ids = req.all_ids
            reqs += self.running
        self.stats.num_prefill_steps += 1
        return ScheduleBatch(reqs, ForwardMode.EXTEND, self.mem)

    # ---- memory --------------------------------------------------------------------------------

    def _ensure_decode_memory(self, outputs: list[ReqOutput]) -> None:
        """Each running request needs one slot; retract the ones that lose least until they fit."""
        def room() -> int:
            return self.runner.allocator.available_size() + self.tree_cache.evictable_size()

        if room() >= len(self.running):
            return
        # Retraction needs every running request's tokens on the host.
        self._finish_inflight(outputs)
        if not self.running or room() >= len(self.running):
            return
        retracted = retract(self.running, room, self.tree_cache)
        if retracted:
            self.stats.num_retractions += len(retracted)
            self.waiting[:0] = retracted
            self.new_token_ratio = new_token_ratio_after_retraction(self.running, self.new_token_ratio)
            logger.info("KV pool full: retracted %d request(s)", len(retracted))
        if room() < len(self.running):
            # A single request that outgrew the whole pool cannot continue.
            req = self.running.pop()
            req.finished_reason = FinishReason("length", message="KV cache pool is too small for this request")
            self._release(req)
            outputs.append(final_output(req))

    def _release(self, req: Req) -> None:
        if req.req_pool_idx is not None:
            self.tree_cache.cache_finished_req(req)
            req.req_pool_idx = None
        if self.spec is not None:
            self.spec.release(req)
        if req is self.chunked_req:
            self.chunked_req = None

    def _release_aborted(self, outputs: list[ReqOutput]) -> None:
        for req in [*self.running, *([self.chunked_req] if self.chunked_req else [])]:
            if req.finished():
                self._release(req)
                outputs.append(final_output(req))
        self.running = [r for r in self.running if not r.finished()]

    # ---- invariants ----------------------------------------------------------------------------

    def _holders(self) -> list[Req]:
        """Requests holding a request row (and a hybrid model's state row with it)."""
        candidates = [*self.running, self.chunked_req, *(self._inflight.batch.reqs if self._inflight else ())]
        return list({id(r): r for r in candidates if r is not None and r.req_pool_idx is not None}.values())

    def kv_slots_in_use_by_requests(self) -> int:
        """KV slots that running requests hold outside the tree (all of them without a cache)."""
        holders = self._holders()
        if self.tree_cache.disable:
            return sum(r.kv_committed_len for r in holders)
        return sum(r.kv_committed_len - len(r.prefix_indices) for r in holders)

    def check_pool_invariant(self) -> None:
        """free + evictable + protected + held by running requests == total slots; for a hybrid model
        also free + held state rows == all rows, and free + held snapshot slots == all slots."""
        total = self.runner.allocator.size
        parts = (
            self.runner.allocator.available_size(),
            self.tree_cache.evictable_size(),
            self.tree_cache.protected_size(),
            self.kv_slots_in_use_by_requests(),
        )
        if sum(parts) != total:
            raise AssertionError(f"KV pool leak: free+evictable+protected+running={parts} != {total}")
        if isinstance(self.runner.req_to_token_pool, HybridReqToTokenPool):
            self.runner.req_to_token_pool.check_state_invariant(len(self._holders()))
        if isinstance(self.tree_cache, HybridRadixCache):
            self.tree_cache.check_snapshot_slots()
        if self.spec is not None:
            self.spec.check_pool_invariant()
