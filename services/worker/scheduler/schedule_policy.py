"""Waiting-queue order (FCFS, LPM, DFS-weight, LOF, random) and the PrefillAdder that admits requests
into a prefill step under the token budgets, chunking the one that does not fit.
"""

from __future__ import annotations

import enum
import math
import random
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING

from services.worker.mem.hybrid_radix_cache import HybridMatchResult
from services.worker.scheduler.req import Req

if TYPE_CHECKING:
    from services.worker.mem.memory_pool import TokenToKVPoolAllocator
    from services.worker.mem.radix_cache import RadixCache
    from services.worker.runtime.model_config import ModelConfig

# Cache-aware orders cost a prefix match per waiting request; past this many they fall back to FCFS.
CACHE_AWARE_QUEUE_LIMIT = 128
# A request's reservation for future decode tokens is clipped, so one huge max_new_tokens does not
# block admission; retraction covers the rare case where the estimate is short.
CLIP_MAX_NEW_TOKENS = 4096
# After a retraction, assume each running request still needs this many steps.
RETRACT_DECODE_STEPS = 20
# Requests whose next uncached tokens agree on this many are not prefilled in the same step.
IN_BATCH_PREFIX_TOKENS = 32


def match_prefix(req: Req, tree_cache: RadixCache) -> None:
    """Set req.prefix_indices/last_node to the longest cached prefix of everything it has so far.
    The last token is never matched: its logits are needed, so at least one token is extended; nor is
    any position whose logits the request's prompt log-probs still need."""
    ids = req.all_ids[:-1]
    first = req.next_prompt_logprob_position()
    if first is not None:
        ids = ids[:first]
    result = tree_cache.match_prefix(ids)
    req.prefix_indices, req.last_node = result.indices, result.last_node
    req.cached_kv_len = result.kv_len if isinstance(result, HybridMatchResult) else len(result.indices)


class SchedulePolicy:
    """Orders the waiting queue in place before each prefill admission."""

    def __init__(self, policy: str, tree_cache: RadixCache, seed: int = 0) -> None:
        self.policy = policy
        self.tree_cache = tree_cache
        self._rng = random.Random(seed)

    def sort(self, waiting: list[Req]) -> None:
        policy = self.policy
        if policy in ("lpm", "dfs-weight") and (
            len(waiting) > CACHE_AWARE_QUEUE_LIMIT or self.tree_cache.disable
        ):
            policy = "fcfs"
        if policy == "fcfs":
            return
        if policy == "lof":
            waiting.sort(key=lambda r: -r.sampling_params.max_new_tokens)
        elif policy == "random":
            self._rng.shuffle(waiting)
        elif policy == "lpm":
            for req in waiting:
                match_prefix(req, self.tree_cache)
            waiting.sort(key=lambda r: -len(r.prefix_indices))
        elif policy == "dfs-weight":
            self._sort_dfs_weight(waiting)

    def admit(self, waiting: list[Req], adder: PrefillAdder) -> None:
        """Offer the waiting requests to `adder` in this policy's order until one does not fit."""
        self.sort(waiting)
        admitted_keys: set[tuple[int, ...]] = set()
        for req in list(waiting):
            match_prefix(req, self.tree_cache)
            req.init_next_round_input()
            key = self._uncached_head(req)
            if key in admitted_keys:
                # It shares an uncached prefix with a request admitted this step: wait one step
                # and reuse that request's KV instead of computing the prefix twice.
                continue
            if adder.add_one_req(req) is not AddResult.CONTINUE:
                break
            if key is not None:
                admitted_keys.add(key)

    def _uncached_head(self, req: Req) -> tuple[int, ...] | None:
        """The first IN_BATCH_PREFIX_TOKENS tokens the request still has to prefill, when it has that
        many (None without a cache: nothing could be shared)."""
        if self.tree_cache.disable:
            return None
        start = len(req.prefix_indices)
        head = req.fill_ids[start : start + IN_BATCH_PREFIX_TOKENS]
        return tuple(head) if len(head) == IN_BATCH_PREFIX_TOKENS else None

    def _sort_dfs_weight(self, waiting: list[Req]) -> None:
        """Visit the radix tree depth-first, heaviest subtree (most waiting requests) first, so
        requests sharing a prefix run together and the shared part stays cached."""
        at_node: dict[int, list[Req]] = defaultdict(list)
        weight: dict[int, int] = defaultdict(int)
        for req in waiting:
            match_prefix(req, self.tree_cache)
            node = req.last_node
            at_node[id(node)].append(req)
            while node is not None:
                weight[id(node)] += 1
                node = node.parent
        order: list[Req] = []
        stack = [self.tree_cache.root]
        while stack:
            node = stack.pop()
            order.extend(at_node.get(id(node), ()))
            children = [c for c in node.children.values() if weight.get(id(c), 0) > 0]
            # Pushed lightest first so the heaviest is popped first.
            stack.extend(sorted(children, key=lambda c: weight[id(c)]))
        waiting[:] = order


# How much slower the extend-attention kernel is than a dense matmul per FLOP: on the H200 the Triton
# extend kernel ran at 200-300 TFLOP/s against a 770 TFLOP/s bf16 matmul (bench/HISTORY.md, "GPU, third
# session", P3; today's extend figure is in bench/RESULTS.md).
ATTENTION_SLOWDOWN = 3.0


def attention_keys_per_token(
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    active_experts: int = 1,
) -> float:
    """K such that a prefill token attending to K keys costs as much as its linear layers: the linear
    FLOPs per token (2 per weight: q/k/v/o and the active experts' gated MLP) over the attention FLOPs per
    key (QK^T and PV: 4 * heads * head_dim per layer), the latter slowed by ATTENTION_SLOWDOWN."""
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    weights = hidden_size * (2 * q + 2 * kv) + 3 * hidden_size * intermediate_size * active_experts
    attention = 4 * num_heads * head_dim * ATTENTION_SLOWDOWN
    return 2 * weights / attention


def attention_cost(prefix: int, tokens: int, keys_per_token: float) -> int:
    """A chunk's cost in plain prefill tokens: each of its `tokens` pays 1 for the linear layers and
    keys/K for attention, where it sees the `prefix` plus on average (tokens + 1)/2 of the chunk."""
    return math.ceil(tokens * (1 + (prefix + (tokens + 1) / 2) / keys_per_token))


def tokens_within_cost(prefix: int, budget: int, keys_per_token: float) -> int:
    """The longest chunk whose attention_cost after `prefix` is at most `budget` (0 if none)."""
    if budget <= 0:
        return 0
    # tokens^2 / (2K) + tokens * (1 + (prefix + 0.5) / K) - budget <= 0
    a, b = 1 / (2 * keys_per_token), 1 + (prefix + 0.5) / keys_per_token
    n = int((-b + math.sqrt(b * b + 4 * a * budget)) / (2 * a))
    while n > 0 and attention_cost(prefix, n, keys_per_token) > budget:
        n -= 1
    while attention_cost(prefix, n + 1, keys_per_token) <= budget:
        n += 1
    return n


def model_keys_per_token(mc: ModelConfig) -> float:
    """attention_keys_per_token for this model: a mixed step sizes its prefill chunk by
    what the chunk costs with its prefix, so the decodes riding in it wait about as long late in a
    long prompt as early (P6 in bench/RESULTS.md). Hybrid models: hybrid_keys_per_token."""
    hf = mc.hf_config
    if mc.num_experts:
        inter = getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size
        active = getattr(hf, "num_experts_per_tok", 1)
    else:
        inter, active = hf.intermediate_size, 1
    if mc.is_hybrid:
        return hybrid_keys_per_token(mc, inter, active)
    return attention_keys_per_token(
        mc.num_layers, mc.hidden_size, mc.num_attention_heads, mc.num_kv_heads, mc.head_dim, inter, active
    )


def hybrid_keys_per_token(mc: ModelConfig, intermediate_size: int, active_experts: int) -> float:
    """attention_keys_per_token for a hybrid model (Qwen3.5): only its full-attention layers read keys,
    while every layer has linear FLOPs, so K is the linear FLOPs per token of all layers over the
    attention FLOPs per key of the attention layers. A token's linear FLOPs: 2 per weight of the
    attention layers' projections (q_proj also gives the output gate: 2 * heads * head_dim rows), the
    Gated DeltaNet layers' in_proj (q, k, v, z, b, a), conv1d and out_proj, and every layer's MLP (the
    active experts, the shared expert and the router for MoE); plus the delta rule's state update, about
    4 FLOPs per state element [Hv, Dk, Dv] (decay, k^T S, the rank-1 write, q^T S)."""
    hf, hidden = mc.hf_config, mc.hidden_size
    q, kv = mc.num_attention_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    linear = mc.state_shape()
    value_dim = linear.num_v_heads * linear.v_head_dim
    mlp = 3 * hidden * intermediate_size * active_experts
    if mc.num_experts:
        shared = int(getattr(hf, "shared_expert_intermediate_size", 0) or 0)
        mlp += hidden * mc.num_experts + (3 * hidden * shared + hidden if shared else 0)
    attention_weights = hidden * (2 * q + q + 2 * kv) + mlp
    gdn_weights = (
        hidden * (linear.conv_dim + value_dim + 2 * linear.num_v_heads)
        + linear.conv_dim * linear.conv_width
        + value_dim * hidden
        + mlp
    )
    recurrent_flops = 4 * linear.num_v_heads * linear.k_head_dim * linear.v_head_dim
    num_attention, num_linear = mc.num_attention_layers, linear.num_layers
    flops = 2 * (num_attention * attention_weights + num_linear * gdn_weights) + num_linear * recurrent_flops
    per_key = num_attention * 4 * mc.num_attention_heads * mc.head_dim * ATTENTION_SLOWDOWN
    return flops / per_key


class AddResult(enum.Enum):
    CONTINUE = "continue"  # admitted; try the next one
    NO_TOKEN = "no_token"  # the KV pool cannot hold it now
    OTHER = "other"  # a per-step budget is spent (prefill tokens, chunk, running slots)


class PrefillAdder:
    """Admits requests into one prefill step.

    Budgets: the KV pool (free + evictable slots, less what running requests are expected to still
    need), the step's prompt tokens (max_prefill_tokens) and the chunk (chunked_prefill_size). A
    request longer than what is left of the chunk is truncated and continues next step.
    """

    def __init__(
        self,
        tree_cache: RadixCache,
        allocator: TokenToKVPoolAllocator,
        running: list[Req],
        new_token_ratio: float,
        max_prefill_tokens: int,
        chunked_prefill_size: int | None,
        max_new_reqs: int,
        mixed_decode_tokens: int = 0,
        attention_keys_per_token: float | None = None,
        min_chunk_tokens: int = 1,
    ) -> None:
        self.tree_cache = tree_cache
        # Mixed steps: a chunk's tokens cost more the longer the prefix they attend to; with this set,
        # the chunk budget counts attention_cost() (see there) instead of plain tokens.
        self.keys_per_token = attention_keys_per_token
        self.min_chunk_tokens = max(1, min_chunk_tokens)  # never cut a cost-sized chunk below this
        self.nothing_running = not running
        self.new_token_ratio = new_token_ratio
        reserved = sum(self._reservation(r) for r in running)
        # Slots this step can actually get (free or evictable), whatever is reserved for later.
        self.room = allocator.available_size() + tree_cache.evictable_size() - mixed_decode_tokens
        self.rem_total_tokens = self.room + mixed_decode_tokens - reserved
        self.rem_input_tokens = max_prefill_tokens - mixed_decode_tokens
        self.rem_chunk_tokens = (
            None if chunked_prefill_size is None else chunked_prefill_size - mixed_decode_tokens
        )
        self.max_new_reqs = max_new_reqs
        self.can_run_list: list[Req] = []
        self.new_chunked_req: Req | None = None

    def _reservation(self, req: Req) -> int:
        return int(min(req.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS) * self.new_token_ratio)

    def _chunk_cost(self, req: Req) -> int:
        if self.keys_per_token is None:
            return req.extend_input_len
        return attention_cost(len(req.prefix_indices), req.extend_input_len, self.keys_per_token)

    def _take(self, req: Req) -> None:
        self.can_run_list.append(req)
        self.room -= req.extend_input_len
        self.rem_total_tokens -= req.extend_input_len + self._reservation(req)
        self.rem_input_tokens -= req.extend_input_len
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= self._chunk_cost(req)

    def _truncate(self, req: Req) -> bool:
        """Cut req to what is left of the chunk; True when it was cut."""
        if self.rem_chunk_tokens is None or self._chunk_cost(req) <= self.rem_chunk_tokens:
            return False
        if self.keys_per_token is None:
            req.extend_input_len = self.rem_chunk_tokens
        else:
            fits = tokens_within_cost(len(req.prefix_indices), self.rem_chunk_tokens, self.keys_per_token)
            fits = max(fits, min(self.min_chunk_tokens, self.rem_input_tokens, self.room))
            if fits >= req.extend_input_len:
                return False
            req.extend_input_len = max(1, fits)
        req.fill_ids = req.fill_ids[: len(req.prefix_indices) + req.extend_input_len]
        return True

    def _end_at_branch(self, req: Req) -> bool:
        """A hybrid model's match stops at the deepest state snapshot, while the cache may hold KV
        further (requests that shared this head, then diverged): end the first chunk where that KV
        ends, so caching the chunk leaves a snapshot at the branch point and the next request with
        this head resumes there (a later chunk of a longer stretch still ends there). True when it
        cut the request."""
        end = req.cached_kv_len
        if not len(req.prefix_indices) < end < len(req.fill_ids):
            return False
        req.fill_ids = req.fill_ids[:end]
        req.extend_input_len = end - len(req.prefix_indices)
        return True

    def add_chunked_req(self, req: Req) -> bool:
        """The request chunked last step continues (its prefix is locked already), as far as the
        chunk and the pool allow; False when there is no room at all this step."""
        if self.room <= 0:
            self.new_chunked_req = req
            return False
        if self.rem_chunk_tokens is None or self.rem_chunk_tokens > self.room:
            self.rem_chunk_tokens = self.room
        cut = self._end_at_branch(req)
        if self._truncate(req) or cut:
            self.new_chunked_req = req
        self._take(req)
        return True

    def add_one_req(self, req: Req) -> AddResult:
        if len(self.can_run_list) >= self.max_new_reqs:
            return AddResult.OTHER
        if self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0:
            return AddResult.OTHER
        if self.rem_input_tokens <= 0 or (
            req.extend_input_len > self.rem_input_tokens and self.can_run_list
        ):
            return AddResult.OTHER
        # Lock the shared prefix first: locked tokens stop counting as evictable room.
        delta = self.tree_cache.inc_lock_ref(req.last_node)
        self.room += delta
        self.rem_total_tokens += delta
        # The whole prompt must fit, not just this step's chunk, so later chunks find room. The
        # reservation for decode tokens is an estimate: with nothing else in flight, admit anyway
        # rather than wait forever (retraction covers a shortfall).
        alone = self.nothing_running and not self.can_run_list
        need = req.extend_input_len
        if need > self.room or (need + self._reservation(req) > self.rem_total_tokens and not alone):
            self.room -= delta
            self.rem_total_tokens -= delta
            self.tree_cache.dec_lock_ref(req.last_node)
            return AddResult.NO_TOKEN
        cut = self._end_at_branch(req)
        if self._truncate(req) or cut:
            self.new_chunked_req = req
            self._take(req)
            return AddResult.OTHER
        self._take(req)
        return AddResult.CONTINUE


def retract(running: list[Req], room: Callable[[], int], tree_cache: RadixCache) -> list[Req]:
    """Take requests out of `running` until room() holds one slot for each of the rest (or one is
    left), those that lose least work first: fewest generated tokens, then longest prompt. Their KV
    goes into the tree and they are reset for the waiting queue."""
    order = sorted(running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
    retracted: list[Req] = []
    while room() < len(running) and len(running) > 1:
        victim = order.pop(0)
        running.remove(victim)
        tree_cache.cache_finished_req(victim)
        victim.reset_for_retract()
        retracted.append(victim)
    return retracted


def new_token_ratio_after_retraction(running: list[Req], ratio: float) -> float:
    """The share of max_new_tokens admission reserves, raised after a retraction to what the running
    requests have decoded plus RETRACT_DECODE_STEPS more each."""
    decoded = sum(len(r.output_ids) for r in running)
    budget = sum(r.sampling_params.max_new_tokens for r in running) or 1
    estimate = (decoded + RETRACT_DECODE_STEPS * len(running)) / budget
    return min(1.0, max(ratio, estimate))
