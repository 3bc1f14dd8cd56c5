# Over 400 lines: every worker knob with its help text and its checks, one frozen dataclass read in one place.
"""EngineConfig: every knob of the worker (scheduler, memory, model runner), in one frozen dataclass.

Built once, from keyword arguments (the offline Engine), CLI flags or RS_* environment variables (the
worker service). Defaults sit beside each field with a one-line help.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from services.worker.cpu_placement import (
    BIND_AUTO,
    BIND_NONE,
    ComputePlacement,
    check_cpu_bind,
    default_compute_threads,
    parse_cpu_list,
    plan_placement,
    usable_cores,
)
from shared.hf_tokenizer import chat_template_text
from shared.model_path import resolve_model_path

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random")
EVICTION_POLICIES = ("lru", "lfu", "fifo", "filo", "mru", "priority")
SPECULATIVE_ALGORITHMS = ("ngram", "draft")
GEMV_BACKENDS = ("auto", "triton", "cublas")
ATTENTION_BACKENDS = ("torch", "triton", "flashinfer")
# `--quantization` values (SGLang's flag): how the weights are stored in the model (runtime/layers/fp8.py).
QUANTIZATION_METHODS = ("fp8",)
# KV pool element types: the model's ('auto'), or float8 (fp8 is vLLM's name for fp8_e4m3).
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "fp8")
# The `architectures` names of config.json a model class runs (runtime/model_loader.py's MODEL_REGISTRY
# maps each to its class; a test holds the two to the same names). Here, below every floor, so a config
# naming a checkpoint radixserve cannot run is refused before anything loads.
ARCHITECTURES = frozenset({
    "LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
    "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
})
# Hybrid models (Gated DeltaNet linear-attention layers with per-request state): no speculative
# decoding (a rejected draft would need the recurrent state rolled back).
HYBRID_ARCHITECTURES = frozenset({
    "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
})
DTYPES = ("auto", "float32", "bfloat16", "float16")
# The other spellings SGLang and vLLM users type for a dtype (their `--dtype` choices).
DTYPE_SYNONYMS = {"half": "float16", "float": "float32", "fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def _help(text: str, default: object, *aliases: str) -> object:
    """A field's default and help; `aliases` are other flag/RS_* spellings of it (shared/flags.py)."""
    metadata: dict[str, object] = {"help": text}
    if aliases:
        metadata["aliases"] = aliases
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class EngineConfig:
    """Configuration of one worker (all its ranks share it)."""

    model_path: str = _help(
        "HF checkpoint directory, a model name under $RS_HOME/models, or a Hugging Face hub id (Qwen/Qwen3-8B: "
        "a snapshot in the hub cache, downloaded when absent; HF_HUB_OFFLINE=1 reads the cache only)",
        "", "model",
    )
    revision: str | None = _help("hub id only: the branch, tag or commit of the repository; default: main", None)
    tokenizer_path: str | None = _help(
        "the tokenizer's directory, model name or hub id, when not the model's own; default: the model's", None
    )
    chat_template: str | None = _help(
        "a Jinja chat template (a file, or the template itself) used instead of the checkpoint's", None
    )
    trust_remote_code: bool = _help(
        "accepted for compatibility: radixserve runs only its own model code, never a checkpoint's, so a "
        "checkpoint whose architecture it does not implement is refused naming it",
        False,
    )
    tp_size: int = _help("tensor-parallel ranks (one process each)", 1, "tensor_parallel_size", "tp")
    pp_size: int = _help(
        "pipeline-parallel stages: the decoder layers split into pp_size contiguous stages of tp_size ranks each "
        "(pp_size x tp_size processes; the first stage embeds, the last samples; each stage's KV pool holds its "
        "layers). Not with speculative decoding or hybrid (Qwen3.5) models",
        1, "pipeline_parallel_size", "pp",
    )
    scheduler_process: bool | None = _help(
        "tp_size 1: run the scheduler in its own process rather than a thread of the caller's (so the "
        "caller's Python work never waits on, or stalls, the scheduler's for the GIL); default: on CUDA, and in "
        "a worker service on any device",
        None,
    )
    device: str | None = _help("'cpu', 'cuda' or 'cuda:N'; default: cuda when available", None)
    dtype: str | None = _help(
        "auto, float32, bfloat16 or float16 (also half, float, fp16, bf16, fp32); default (auto): float32 on "
        "CPU, the checkpoint's on CUDA",
        None,
    )
    cpu_threads: int | None = _help(
        "CPU: compute threads per rank; default: the cores of cpu_bind when it lists them, else OMP_NUM_THREADS "
        "when set, else every usable core but cpu_reserved_cores (at least 1; usable: the affinity mask, cut to a cgroup CPU "
        "quota), shared among the node's ranks; with cpu_adaptive_threads the most it computes with",
        None,
    )
    cpu_reserved_cores: int | None = _help(
        "CPU: usable cores kept free of compute threads for the event loop, the other services and the host "
        "(the first ones; none when no more are usable); default: 0 with cpu_adaptive_threads (it gives cores "
        "back while others need them), else 1 for a worker service, so a loaded host slows the steps instead "
        "of stalling them; 0 for the offline Engine where the count is fixed, whose caller waits while it "
        "computes (on 2 vCPUs its batch-1 decode went from 13.8 to 19 tok/s with both cores). Setting it fixes "
        "the thread count",
        None,
    )
    cpu_adaptive_threads: bool | None = _help(
        "CPU: choose the compute threads between steps (cpu_threads.py): start on every usable core after "
        "cpu_reserved_cores, give cores back while other processes (the host's, the other services) take CPU "
        "time on them, take them back once they stop; default: on (a worker service and the offline Engine) "
        "under cpu_bind 'auto' unless cpu_threads, cpu_reserved_cores, OMP_NUM_THREADS or "
        "enable_deterministic_inference is set, each of which fixes the count",
        None,
    )
    cpu_bind: str = _help(
        "CPU: where compute threads run (cpu_placement.py): 'auto' pins them one to a core, on the usable "
        "cores after cpu_reserved_cores; 'none' leaves placement to the OS; a core list such as "
        "'1-3,6' pins one thread to each of those cores",
        "auto",
    )
    context_length: int | None = _help("override the model's max positions", None, "max_model_len")
    attention_backend: str | None = _help(
        "torch, triton or flashinfer (CUDA, optional package); default: torch on CPU, triton on CUDA", None
    )
    kv_cache_dtype: str = _help(
        "KV pool element type: auto (the model's dtype), fp8_e4m3 (or fp8) or fp8_e5m2: float8 K/V with a "
        "per-layer scale (1.0 unless the checkpoint gives k_scale/v_scale), twice the tokens per byte of "
        "bfloat16; not with the flashinfer backend",
        "auto",
    )
    cuda_graph_max_bs: int = _help(
        "capture decode CUDA graphs for batch sizes up to this (0: no CUDA graphs at all); CUDA only", 256
    )
    cuda_graph_max_extend_tokens: int = _help(
        "capture extend (prefill, chunked prefill, mixed) CUDA graphs for steps of up to this many tokens "
        "(0: off; ignored when cuda_graph_max_bs is 0)",
        2048,
    )
    gemv_backend: str = _help(
        "CUDA, bfloat16/float16: single-row linear layers (batch-1 decode) through 'triton' (kernels/gemv.py), "
        "'cublas' (F.linear), or 'auto': time both on each weight shape at load and keep the faster",
        "auto",
    )
    quantization: str | None = _help(
        "'fp8': keep the linear and MoE weights in FP8 (block-wise 128x128 e4m3 with float32 scales, quantized at "
        "load from a bf16/f16/f32 checkpoint; an FP8 checkpoint's own blocks); default (None): the checkpoint's "
        "own, an FP8 checkpoint running FP8 weights on CUDA and dequantized at load on the CPU",
        None,
    )
    enable_deterministic_inference: bool = _help(
        "batch-invariant products, attention splits and MoE tiles: a request's tokens (greedy, or sampled "
        "with a seed) are the same alone, in any batch, chunked or not; costs throughput. torch or triton "
        "attention, tp_size 1, not hybrid models",
        False,
    )
    disable_custom_all_reduce: bool = _help(
        "TP on CUDA: sum every activation through NCCL, also the small ones that otherwise take the "
        "symmetric-memory one-shot all-reduce",
        False,
    )
    # Memory.
    cpu_weight_prepack: bool = _help(
        "CPU: keep a oneDNN-blocked copy of each linear weight for batched products (weights take 2x memory)",
        True,
    )
    max_total_tokens: int | None = _help("KV pool size in tokens; default: from free memory", None)
    mem_fraction_static: float = _help("fraction of device memory for weights + KV pool", 0.85)
    max_running_requests: int = _help("most requests decoding at once", 256)
    # Scheduling.
    schedule_policy: str = _help("waiting-queue order: " + ", ".join(SCHEDULE_POLICIES), "fcfs")
    chunked_prefill_size: int | None = _help(
        "most new prompt tokens per step (None, or -1 as in SGLang: no chunking)", 2048
    )
    max_prefill_tokens: int = _help("most prompt tokens admitted in one prefill step", 16384)
    enable_mixed_chunk: bool = _help(
        "run decodes in the same step as a prefill chunk; that chunk is sized so its cost, attention over "
        "its prefix included, stays within chunked_prefill_size prefill tokens",
        False,
    )
    disable_radix_cache: bool = _help("turn the prefix cache off (every prompt prefilled in full)", False)
    radix_eviction_policy: str = _help("cache eviction: " + ", ".join(EVICTION_POLICIES), "lru")
    hybrid_snapshot_slots: int | None = _help(
        "hybrid (linear-attention) models: linear-layer states the prefix cache keeps at radix nodes, one "
        "request's state each; default: a share of the memory budget (2 per request row with max_total_tokens)",
        None,
    )
    schedule_conservativeness: float = _help("scales the decode-token reservation at admission", 1.0)
    random_seed: int = _help("seed for requests that bring none", 0)
    disable_overlap_schedule: bool | None = _help(
        "True: prepare each step only after the last one's tokens are back; default: overlap on CUDA only",
        None,
    )
    # Speculative decoding (services/worker/scheduler/spec/).
    speculative_algorithm: str | None = _help(
        "propose tokens cheaply and verify them in one target forward: 'ngram' (prompt lookup) or 'draft' "
        "(a small model); None: off. Speculation turns the overlap schedule off",
        None,
    )
    # 3 as SGLang's default draft steps: on the H200 (bench/results/gpu_spec_2026-11-29_f.json) k=3 gave 1.59x at an
    # accepted length of 2.65 where k=4 gave 1.35x at 2.49; a draft that agrees more often wants more.
    speculative_num_draft_tokens: int = _help("tokens proposed per request and decode step (k)", 3)
    speculative_draft_model_path: str | None = _help(
        "draft checkpoint directory for 'draft'; it must share the target's vocabulary", None
    )
    speculative_ngram_max_match: int = _help("'ngram': longest suffix of a request looked up in its own tokens", 12)
    speculative_ngram_min_match: int = _help("'ngram': shortest suffix that counts as a match", 1)
    # TP rendezvous; several nodes (machines) as in SGLang: --nnodes 2 --node-rank 0|1 --dist-init-addr H:P.
    dist_init_addr: str | None = _help(
        "host:port (or tcp://host:port) where the TP group meets: node 0's address and a free port every node "
        "reaches; default: a free local port (one node only)",
        None,
    )
    nnodes: int = _help("machines the worker's ranks span; each runs pp_size x tp_size / nnodes ranks", 1)
    node_rank: int = _help(
        "this machine's index among nnodes: node 0 serves (NATS, the scheduler's requests), the others run ranks only",
        0,
    )
    dist_timeout: float = _help(
        "seconds the TP group waits for every rank to join, and any collective for every rank to arrive: a node "
        "that never starts, or a rank that hangs, ends the group with an error after this long",
        300.0,
    )
    node_timeout: float = _help(
        "nnodes > 1: seconds without a heartbeat from another node (sent every node_timeout / 5 s to or from node "
        "0's dist_init_addr port + 1) before the group ends as failed: a node that died, froze or is cut off is "
        "noticed this fast on any backend, where a collective would wait dist_timeout",
        5.0,
    )

    def __post_init__(self) -> None:
        # SGLang's and vLLM's spellings are taken as they are given and stored in ours, once, while the
        # instance is built (fields read afterwards hold one spelling only).
        if self.chunked_prefill_size == -1:
            object.__setattr__(self, "chunked_prefill_size", None)
        if self.dtype in DTYPE_SYNONYMS:
            object.__setattr__(self, "dtype", DTYPE_SYNONYMS[self.dtype])
        if self.dtype not in (None, *DTYPES):
            spellings = ", ".join((*DTYPES, *DTYPE_SYNONYMS))
            raise ValueError(f"dtype must be one of {spellings}, got {self.dtype!r}")
        chat_template_text(self.chat_template)  # a file that is not there fails here, before any load
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.pp_size < 1:
            raise ValueError(f"pp_size must be >= 1, got {self.pp_size}")
        self._check_nodes()
        if self.cpu_threads is not None and not 1 <= self.cpu_threads <= 1024:
            raise ValueError(f"cpu_threads must be in [1, 1024], got {self.cpu_threads}")
        if self.cpu_reserved_cores is not None and not 0 <= self.cpu_reserved_cores <= 1024:
            raise ValueError(f"cpu_reserved_cores must be in [0, 1024], got {self.cpu_reserved_cores}")
        check_cpu_bind(self.cpu_bind)
        if self.cpu_adaptive_threads and (
            self.cpu_threads is not None or self.cpu_bind != BIND_AUTO or self.enable_deterministic_inference
        ):
            raise ValueError(
                "cpu_adaptive_threads needs cpu_bind 'auto' and no cpu_threads (it picks the count and pins the "
                "threads), and not enable_deterministic_inference (a count that changes changes the sums)"
            )
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        if self.radix_eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"radix_eviction_policy must be one of {EVICTION_POLICIES}, got {self.radix_eviction_policy!r}"
            )
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be >= 1, or -1 or None (off), got {self.chunked_prefill_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < 2:
            raise ValueError(f"max_total_tokens must be >= 2, got {self.max_total_tokens}")
        if self.hybrid_snapshot_slots is not None and self.hybrid_snapshot_slots < 0:
            raise ValueError(f"hybrid_snapshot_slots must be >= 0, got {self.hybrid_snapshot_slots}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}")
        if self.cuda_graph_max_bs < 0:
            raise ValueError(f"cuda_graph_max_bs must be >= 0 (0 turns CUDA graphs off), got {self.cuda_graph_max_bs}")
        if self.cuda_graph_max_extend_tokens < 0:
            raise ValueError(
                "cuda_graph_max_extend_tokens must be >= 0 (0 turns extend CUDA graphs off), got "
                f"{self.cuda_graph_max_extend_tokens}"
            )
        if self.gemv_backend not in GEMV_BACKENDS:
            raise ValueError(f"gemv_backend must be one of {GEMV_BACKENDS}, got {self.gemv_backend!r}")
        if self.quantization not in (None, *QUANTIZATION_METHODS):
            raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS} or None, got {self.quantization!r}")
        if self.attention_backend not in (None, *ATTENTION_BACKENDS):
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype != "auto" and self.attention_backend == "flashinfer":
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported with attention_backend='flashinfer'; "
                "use attention_backend='triton' (the CUDA default) for a float8 KV cache"
            )
        self._check_speculative()
        if self.enable_deterministic_inference:
            self._check_deterministic()
        architectures = _checkpoint_config(self.model_path).get("architectures")
        if architectures is not None and pick_architecture(architectures) in HYBRID_ARCHITECTURES:
            self._check_hybrid(pick_architecture(architectures))
        if self.pp_size > 1:
            self._check_pipeline()

    def _check_deterministic(self) -> None:
        # Every rank would need an all-reduce that sums in one order whatever the message size, and the
        # linear-attention layers' chunked scan is chunked by the batch: neither is batch-invariant yet.
        if self.tp_size > 1:
            raise ValueError(f"enable_deterministic_inference needs tp_size 1, got {self.tp_size}")
        if self.attention_backend == "flashinfer":
            raise ValueError(
                "enable_deterministic_inference needs the torch or triton attention backend, not flashinfer"
            )
        architectures = _checkpoint_config(self.model_path).get("architectures")
        if architectures is not None and pick_architecture(architectures) in HYBRID_ARCHITECTURES:
            name = pick_architecture(architectures)
            raise ValueError(f"enable_deterministic_inference does not support {name} (hybrid)")
        if self.kv_cache_dtype != "auto":
            raise ValueError(
                f"enable_deterministic_inference needs kv_cache_dtype 'auto', got {self.kv_cache_dtype!r}: its "
                "attention backends read the pool in the model's dtype"
            )
        # The FP8 products (kernels/fp8_gemm.py) pick their path by the number of rows.
        if self.quantization == "fp8" or _checkpoint_config(self.model_path).get("quantization_config"):
            raise ValueError("enable_deterministic_inference does not support FP8 weights (--quantization fp8 "
                             "or an FP8 checkpoint): their products are not batch-invariant")

    def _check_pipeline(self) -> None:
        if self.speculative_algorithm is not None:
            raise ValueError(
                f"speculative_algorithm={self.speculative_algorithm!r} is not supported with pp_size "
                f"{self.pp_size}: speculative decoding runs with one pipeline stage only"
            )
        raw = _checkpoint_config(self.model_path)
        architectures = raw.get("architectures")
        if architectures is not None and pick_architecture(architectures) in HYBRID_ARCHITECTURES:
            raise ValueError(
                f"pp_size {self.pp_size} is not supported for {pick_architecture(architectures)} (a hybrid model "
                "with Gated DeltaNet layers); run it with pp_size 1 (tp_size and nnodes still apply)"
            )
        layers = raw.get("num_hidden_layers") or (raw.get("text_config") or {}).get("num_hidden_layers")
        if isinstance(layers, int) and layers < self.pp_size:
            raise ValueError(
                f"pp_size {self.pp_size} is larger than the model's {layers} decoder layers: every pipeline "
                "stage needs at least one layer"
            )

    def _check_hybrid(self, architecture: str) -> None:
        if self.speculative_algorithm is not None:
            raise ValueError(
                f"speculative_algorithm={self.speculative_algorithm!r}: speculative decoding is not supported for "
                f"{architecture} (a hybrid model with Gated DeltaNet layers): a rejected draft would need the "
                "recurrent state rolled back"
            )

    def _check_nodes(self) -> None:
        if self.nnodes < 1:
            raise ValueError(f"nnodes must be >= 1, got {self.nnodes}")
        if self.world_size() % self.nnodes:
            shape = f"tp_size {self.tp_size}" if self.pp_size == 1 else f"pp_size x tp_size {self.world_size()}"
            raise ValueError(
                f"{shape} is not divisible by nnodes {self.nnodes}: every node runs "
                f"{'tp_size' if self.pp_size == 1 else 'pp_size x tp_size'} / nnodes ranks"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes - 1] = [0, {self.nnodes - 1}], got {self.node_rank}")
        if self.dist_timeout <= 0:
            raise ValueError(f"dist_timeout must be > 0, got {self.dist_timeout}")
        if self.node_timeout <= 0:
            raise ValueError(f"node_timeout must be > 0, got {self.node_timeout}")
        if self.dist_init_addr is not None:
            object.__setattr__(self, "dist_init_addr", tcp_init_method(self.dist_init_addr))
            if self.nnodes > 1 and self.dist_init_addr.endswith(":65535"):
                raise ValueError("dist_init_addr's port must be < 65535 with nnodes > 1: the next port carries the "
                                 "nodes' heartbeats")
        elif self.nnodes > 1:
            raise ValueError("nnodes > 1 needs dist_init_addr (host:port of node 0, the same on every node)")

    def world_size(self) -> int:
        """Every rank of the worker: tp_size ranks in each of pp_size stages."""
        return self.tp_size * self.pp_size

    def ranks_per_node(self) -> int:
        return self.world_size() // self.nnodes

    def local_ranks(self) -> range:
        """The global ranks this node runs: node_rank * ranks_per_node + local rank (a global rank is
        pp_rank * tp_size + tp_rank, so consecutive nodes hold consecutive stages)."""
        first = self.node_rank * self.ranks_per_node()
        return range(first, first + self.ranks_per_node())

    def _check_speculative(self) -> None:
        algorithm = self.speculative_algorithm
        if algorithm is not None and algorithm not in SPECULATIVE_ALGORITHMS:
            raise ValueError(
                f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS} or None, got {algorithm!r}"
            )
        if self.speculative_num_draft_tokens < 1:
            raise ValueError(f"speculative_num_draft_tokens must be >= 1, got {self.speculative_num_draft_tokens}")
        if not 1 <= self.speculative_ngram_min_match <= self.speculative_ngram_max_match:
            raise ValueError(
                "speculative_ngram_min_match must be >= 1 and <= speculative_ngram_max_match, got "
                f"{self.speculative_ngram_min_match} and {self.speculative_ngram_max_match}"
            )
        draft = self.speculative_draft_model_path
        if algorithm != "draft":
            if draft is not None:
                raise ValueError("speculative_draft_model_path is set but speculative_algorithm is not 'draft'")
            return
        if draft is None:
            raise ValueError("speculative_algorithm='draft' needs speculative_draft_model_path")
        draft_architectures = _checkpoint_config(draft).get("architectures")
        if isinstance(draft_architectures, list) and set(draft_architectures) & HYBRID_ARCHITECTURES:
            raise ValueError(
                f"speculative_draft_model_path {draft!r} is a hybrid model (Gated DeltaNet layers), which cannot "
                "draft: its recurrent state cannot be rolled back past rejected proposals"
            )
        draft_vocab = _checkpoint_vocab_size(draft)
        if draft_vocab is None:
            raise ValueError(f"speculative_draft_model_path {draft!r} has no config.json with a vocab_size")
        # Checked here rather than when the draft loads, so a mismatch fails before any scheduler starts.
        target_vocab = _checkpoint_vocab_size(self.model_path)
        if target_vocab is not None and draft_vocab != target_vocab:
            raise ValueError(
                f"speculative_draft_model_path {draft!r} has a vocabulary of {draft_vocab} tokens; the target "
                f"model has {target_vocab}: a draft must share the target's vocabulary"
            )

    def compute_threads(self) -> int | None:
        """Threads a CPU rank computes with (None: leave torch's setting, as OMP_NUM_THREADS gave it)."""
        if self.cpu_threads is not None:
            return self.cpu_threads
        if self.cpu_bind not in (BIND_AUTO, BIND_NONE):
            return max(1, len(parse_cpu_list(self.cpu_bind)) // self.ranks_per_node())
        if os.environ.get("OMP_NUM_THREADS") and not self.adaptive_threads():
            return None
        return default_compute_threads(len(usable_cores()), self.ranks_per_node(), self.reserved_cores())

    def adaptive_threads(self) -> bool:
        """Whether a CPU rank picks its thread count between steps (cpu_adaptive_threads, resolved)."""
        if self.cpu_adaptive_threads is not None:
            return self.cpu_adaptive_threads
        return (
            self.cpu_bind == BIND_AUTO
            and self.cpu_threads is None
            and self.cpu_reserved_cores is None
            and not os.environ.get("OMP_NUM_THREADS")
            and not self.enable_deterministic_inference
        )

    def reserved_cores(self) -> int:
        """Usable cores kept free of this node's compute threads (cpu_reserved_cores; default 0 when the
        count adapts, else 1)."""
        if self.cpu_reserved_cores is not None:
            return self.cpu_reserved_cores
        return 0 if self.adaptive_threads() else 1

    def compute_placement(self, rank: int, torch_threads: int) -> ComputePlacement:
        """Threads and cores of CPU rank `rank` (cpu_placement.py); torch_threads: torch's count,
        used when compute_threads() leaves it (OMP_NUM_THREADS)."""
        threads = self.compute_threads() or torch_threads
        local = rank - self.local_ranks().start
        placement = plan_placement(
            threads, self.cpu_bind, usable_cores(), local, self.ranks_per_node(), self.reserved_cores()
        )
        if self.adaptive_threads() and placement.cores is not None:
            # The model's thread on the last core, the workers on the ones before: a team cut to k
            # threads computes on the last k and gives back the first, those cpu_reserved_cores keeps.
            placement = dataclasses.replace(placement, cores=placement.cores[::-1])
        return placement

    def scheduler_in_process(self) -> bool:
        """Whether the scheduler runs in processes of its own (always with TP; see scheduler_process)."""
        if self.world_size() > 1:
            return True
        if self.scheduler_process is not None:
            return self.scheduler_process
        if self.device is not None:
            return self.device.startswith("cuda")
        # Imported here: the config is read by processes that never load torch (the CLI's flag parsing).
        import torch

        return torch.cuda.is_available()

    def overlap_enabled(self, device_type: str) -> bool:
        """Overlap pays where the device runs asynchronously to the host (CUDA); it can be forced on
        anywhere with disable_overlap_schedule=False (the CPU tests do, to check it). Speculative
        decoding needs each step's accepted tokens on the host before the next step is built, so it
        turns overlap off; so do pipeline stages (the last stage's tokens reach the first as host ids)."""
        if self.speculative_algorithm is not None or self.pp_size > 1:
            return False
        if self.disable_overlap_schedule is None:
            return device_type == "cuda"
        return not self.disable_overlap_schedule

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_kwargs(cls, model_path: str, **kwargs: object) -> EngineConfig:
        unknown = set(kwargs) - cls.field_names()
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        return cls(model_path=model_path, **kwargs)  # type: ignore[arg-type]

    @classmethod
    def resolved(cls, model_path: str | None, **kwargs: object) -> EngineConfig:
        """from_kwargs with the model (at `revision`) and a draft model resolved to directories, as every
        caller takes them: a directory, a name under $RS_HOME/models, a hub id, or None for the default
        model (shared/model_path.py; ValueError naming what cannot be found)."""
        path = resolve_model_path(model_path, revision=kwargs.get("revision"))  # type: ignore[arg-type]
        draft = kwargs.get("speculative_draft_model_path")
        if isinstance(draft, str) and draft:
            kwargs["speculative_draft_model_path"] = str(resolve_model_path(draft))
        return cls.from_kwargs(str(path), **kwargs)

    def replace(self, **changes: object) -> EngineConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def tcp_init_method(addr: str) -> str:
    """'host:port' (SGLang's spelling) or 'tcp://host:port' as torch's tcp:// init method; ValueError
    naming what is wrong. An IPv6 host goes in brackets: [::1]:5000."""
    rest = addr.removeprefix("tcp://")
    host, sep, port = rest.rpartition(":")
    if "://" in rest or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"dist_init_addr must be host:port (or tcp://host:port) with a port in [1, 65535], got {addr!r}")
    return f"tcp://{host}:{port}"


def pick_architecture(architectures: object) -> str:
    """The first of a config.json's `architectures` that radixserve implements; ValueError naming them
    and what is supported."""
    supported = ", ".join(sorted(ARCHITECTURES))
    if not architectures or not isinstance(architectures, list):
        raise ValueError(f"config.json has no 'architectures' entry; supported architectures: {supported}")
    for name in architectures:
        if name in ARCHITECTURES:
            return name
    raise ValueError(
        f"config.json architectures {architectures} are not implemented by radixserve, which runs only its own "
        f"model code (--trust-remote-code does not change that); supported architectures: {supported}"
    )


def _checkpoint_config(path: str) -> dict:
    """A checkpoint directory's config.json ({} when absent or unreadable: loading reports that)."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _checkpoint_vocab_size(path: str) -> int | None:
    """vocab_size from a checkpoint directory's config.json (None when absent or unreadable)."""
    raw = _checkpoint_config(path)
    vocab = raw.get("vocab_size") or (raw.get("text_config") or {}).get("vocab_size")
    return int(vocab) if isinstance(vocab, int) else None
