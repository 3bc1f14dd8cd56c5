"""TritonAttnBackend gives the torch backend's outputs and pool contents, step after step: prefill,
a continued (chunked) prefill over a cached prefix next to a fresh request, then decode. Whole models
(Qwen3, Llama) check the fused path too: on the triton backend each layer's q/k norm, RoPE and KV store
are one kernel (kernels/qk_norm_rope.py) and the backend's own store is skipped."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from kernels.decode_rope import ROPE_IN_DECODE_ENV
from services.worker.mem.memory_pool import ReqToTokenPool, TokenToKVPool, TokenToKVPoolAllocator
from services.worker.runtime.attention import triton_backend
from services.worker.runtime.attention.torch_backend import TorchAttnBackend
from services.worker.runtime.attention.triton_backend import TritonAttnBackend
from services.worker.runtime.forward_batch import ForwardBatch, ForwardMode
from services.worker.runtime.layers.attention import RadixAttention
from services.worker.runtime.model_config import ModelConfig
from services.worker.runtime.model_loader import load_model
from tests.forward_helpers import BatchDriver, run_mixed_steps
from tests.kernels.conftest import rel_error

NUM_LAYERS = 2


class _Harness:
    """One ReqToTokenPool and slot allocator, and a KV pool per backend, so both see the same
    request -> slot mapping and each keeps the K/V it wrote itself."""

    def __init__(
        self, num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32, **scales: list[float]
    ) -> None:
        self.req_pool = ReqToTokenPool(size=6, max_context_len=128, device="cpu")
        self.allocator = TokenToKVPoolAllocator(size=400, device="cpu")
        self.kv_pools = {
            name: TokenToKVPool(400, NUM_LAYERS, num_kv_heads, head_dim, dtype, "cpu", **scales)
            for name in ("torch", "triton")
        }
        self.backends = {"torch": TorchAttnBackend(), "triton": TritonAttnBackend()}

    def batch(
        self, rows: list[int], prefix_lens: list[int], extend_lens: list[int], decode: bool
    ) -> ForwardBatch:
        locs, positions = [], []
        for row, prefix, n in zip(rows, prefix_lens, extend_lens):
            slots = self.allocator.alloc(n)
            assert slots is not None
            self.req_pool.write(row, prefix, slots)
            locs.append(slots)
            positions.append(torch.arange(prefix, prefix + n))
        seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            batch_size=len(rows),
            input_ids=torch.zeros(sum(extend_lens), dtype=torch.int64),
            positions=torch.cat(positions),
            req_pool_indices=torch.tensor(rows, dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            out_cache_loc=torch.cat(locs),
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=prefix_lens,
            extend_seq_lens_cpu=extend_lens,
            req_to_token_pool=self.req_pool,
            token_to_kv_pool=self.kv_pools["torch"],
            attn_backend=self.backends["torch"],
        )

    def run_both(self, batch: ForwardBatch, layers: list[RadixAttention], gen: torch.Generator) -> None:
        """Every layer on both backends with the same fresh q/k/v; outputs must agree."""
        per_backend = {
            name: dataclasses.replace(
                batch, token_to_kv_pool=self.kv_pools[name], attn_backend=self.backends[name]
            )
            for name in self.backends
        }
        for b in per_backend.values():
            b.attn_backend.init_forward_metadata(b)
        tokens = batch.num_tokens
        for layer in layers:
            q = torch.randn((tokens, layer.num_heads * layer.head_dim), generator=gen)
            k = torch.randn((tokens, layer.num_kv_heads * layer.head_dim), generator=gen)
            v = torch.randn((tokens, layer.num_kv_heads * layer.head_dim), generator=gen)
            outs = {name: layer(q, k, v, b) for name, b in per_backend.items()}
            assert outs["triton"].shape == outs["torch"].shape
            assert rel_error(outs["triton"], outs["torch"]) < 1e-4
        for layer_id in range(NUM_LAYERS):
            for buffers in ("k_buffer", "v_buffer"):
                ours = getattr(self.kv_pools["triton"], buffers)[layer_id]
                ref = getattr(self.kv_pools["torch"], buffers)[layer_id]
                assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8))  # bit for bit


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "dtype", "scales"),
    [
        (4, 4, torch.float32, {}),
        (8, 2, torch.float32, {}),
        # A float8 pool (--kv-cache-dtype fp8_e4m3 / fp8_e5m2), with per-layer scales.
        (8, 2, torch.float8_e4m3fn, {"k_scales": [0.5, 1.0], "v_scales": [2.0, 0.75]}),
        (4, 4, torch.float8_e5m2, {}),
    ],
    ids=["mha", "gqa", "fp8_e4m3_scaled", "fp8_e5m2"],
)
def test_triton_backend_matches_torch_backend_across_steps(
    gen, num_heads, num_kv_heads, dtype, scales
) -> None:
    head_dim = 16
    h = _Harness(num_kv_heads, head_dim, dtype, **scales)
    layers = [RadixAttention(num_heads, head_dim, head_dim**-0.5, num_kv_heads, i) for i in range(NUM_LAYERS)]
    # Step 1: prefill three requests from scratch (rows deliberately not 0..2).
    h.run_both(h.batch([4, 1, 2], [0, 0, 0], [5, 21, 9], decode=False), layers, gen)
    # Step 2: request in row 1 continues its chunked prefill over its 21 cached tokens, next to a new one.
    h.run_both(h.batch([1, 0], [21, 0], [12, 7], decode=False), layers, gen)
    # Steps 3-4: everyone decodes.
    rows, lens = [4, 1, 2, 0], [5, 33, 9, 7]
    for _ in range(2):
        h.run_both(h.batch(rows, lens, [1] * 4, decode=True), layers, gen)
        lens = [n + 1 for n in lens]


def test_forward_without_metadata_is_a_clear_error(gen) -> None:
    h = _Harness(2, 16)
    batch = h.batch([0], [0], [3], decode=False)
    batch = dataclasses.replace(
        batch, token_to_kv_pool=h.kv_pools["triton"], attn_backend=h.backends["triton"]
    )
    layer = RadixAttention(2, 16, 0.25, 2, 0)
    x = torch.randn((3, 32), generator=gen)
    with pytest.raises(ValueError, match="init_forward_metadata"):
        layer(x, x, x, batch)


def test_reserved_decode_buffers_never_move(gen) -> None:
    # CUDA graphs replay against the addresses seen at capture, so reserve() must cover every batch size.
    h = _Harness(2, 16)
    backend = h.backends["triton"]
    backend.reserve(max_batch_size=4, num_heads=8, num_kv_heads=2, head_dim=16, device="cpu")
    scratch = backend._scratch.data_ptr()
    layer = RadixAttention(8, 16, 0.25, 2, 0)
    h.run_both(h.batch([0, 1, 2, 3], [0] * 4, [3, 9, 2, 5], decode=False), [layer], gen)
    pointers = set()
    for rows, lens in (([0], [3]), ([0, 1, 2, 3], [4, 9, 2, 5])):
        batch = h.batch(rows, lens, [1] * len(rows), decode=True)
        batch = dataclasses.replace(batch, token_to_kv_pool=h.kv_pools["triton"], attn_backend=backend)
        backend.init_forward_metadata(batch)
        x = torch.randn((len(rows), 8 * 16), generator=gen)
        kv = torch.randn((len(rows), 2 * 16), generator=gen)
        layer(x, kv, kv, batch)
        pointers.add((backend._scratch.data_ptr(), backend._counters.data_ptr()))
        # The split counts come from seq_lens inside the kernel: no per-step tensor a graph would pin.
        assert not any(isinstance(v, torch.Tensor) for v in vars(batch.attn_metadata).values())
    assert len(pointers) == 1
    assert backend._scratch.data_ptr() == scratch


@pytest.mark.parametrize(
    ("rope_in_decode", "rows_share"),
    [("1", False), ("0", False), ("1", True)],
    ids=["rope-in-decode", "rope-launch", "rows-share-requests"],
)
@pytest.mark.parametrize("checkpoint", ["qwen3_path", "llama_path"])
def test_model_on_triton_backend_fuses_the_prologue_and_matches_torch_backend(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    checkpoint: str,
    rope_in_decode: str,
    rows_share: bool,
) -> None:
    """rows-share-requests: a backend whose decode rows may be rows of one request (speculative
    verification) keeps the prologue a launch of its own, which stores every row's K/V before any row
    attends; folded into decode attention, another program of the same launch would store them (a race the
    interpreter, running programs one by one, cannot show)."""
    monkeypatch.setenv(ROPE_IN_DECODE_ENV, rope_in_decode)
    path: Path = request.getfixturevalue(checkpoint)
    config = ModelConfig.from_path(path, dtype="float32")
    model = load_model(config, "cpu")
    drivers = {name: BatchDriver(model, config, max_requests=3, max_tokens=96) for name in ("torch", "triton")}
    drivers["triton"].backend = TritonAttnBackend()
    drivers["triton"].backend.decode_rows_share_requests = rows_share
    fused_calls: list[bool] = []
    qk_norm_rope = triton_backend.qk_norm_rope_

    def fused_spy(*args: object, **kwargs: object) -> object:
        fused_calls.append(kwargs["q_weight"] is not None)
        return qk_norm_rope(*args, **kwargs)

    def unfused_store(*args: object) -> None:
        raise AssertionError("the triton backend stored K/V again after the fused prologue")

    decode = triton_backend.decode_attention
    in_decode: list[bool] = []

    def decode_spy(*args: object, **kwargs: object) -> object:
        rope = kwargs["rope"]
        if rope is not None:  # the prologue folded into decode attention (kernels/decode_rope.py)
            in_decode.append(rope.q_weight is not None)
        return decode(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "qk_norm_rope_", fused_spy)
    monkeypatch.setattr(triton_backend, "decode_attention", decode_spy)
    monkeypatch.setattr(triton_backend, "store_kv", unfused_store)

    def check(logits: dict[str, torch.Tensor]) -> None:
        assert logits["triton"].shape == logits["torch"].shape
        assert rel_error(logits["triton"], logits["torch"]) < 1e-4

    run_mixed_steps(drivers, check)

    # Every layer of every step went through a fused prologue, with the norms exactly when the model has
    # them: its own launch in extend steps, inside decode attention in decode steps.
    assert bool(in_decode) == (rope_in_decode == "1" and not rows_share), (
        f"RS_ROPE_IN_DECODE={rope_in_decode}, rows_share={rows_share}: {len(in_decode)}"
    )
    assert fused_calls + in_decode == [checkpoint == "qwen3_path"] * (5 * config.num_layers)
    pools = {name: driver.kv_pool for name, driver in drivers.items()}
    for layer_id in range(config.num_layers):
        for buffers in ("k_buffer", "v_buffer"):
            ours, ref = getattr(pools["triton"], buffers)[layer_id], getattr(pools["torch"], buffers)[layer_id]
            assert rel_error(ours, ref) < 1e-5


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_qwen3_over_a_float8_pool_on_triton_matches_torch_backend(
    qwen3_path: Path, kv_dtype: torch.dtype
) -> None:
    """--kv-cache-dtype fp8 through the fused prologue (norm, RoPE and the quantizing store in one kernel),
    chunked extend and decode: the same logits and the same float8 pool as the torch backend. The two
    backends' RoPE may differ in a float32 last bit, which can tip a value across a float8 rounding
    boundary, so the pools are compared element by element (nearly all identical) rather than whole."""
    config = ModelConfig.from_path(qwen3_path, dtype="float32")
    model = load_model(config, "cpu")
    drivers = {
        name: BatchDriver(model, config, max_requests=3, max_tokens=96) for name in ("torch", "triton")
    }
    drivers["triton"].backend = TritonAttnBackend()
    for driver in drivers.values():
        driver.kv_pool = TokenToKVPool(
            96, config.num_attention_layers, config.num_kv_heads, config.head_dim, kv_dtype, "cpu",
            k_scales=[0.8] * config.num_attention_layers, v_scales=[1.25] * config.num_attention_layers,
        )  # fmt: skip

    def check(logits: dict[str, torch.Tensor]) -> None:
        assert rel_error(logits["triton"], logits["torch"]) < 1e-4

    run_mixed_steps(drivers, check)
    pools = {name: driver.kv_pool for name, driver in drivers.items()}
    for layer_id in range(config.num_layers):
        for buffers in ("k_buffer", "v_buffer"):
            ours = getattr(pools["triton"], buffers)[layer_id]
            ref = getattr(pools["torch"], buffers)[layer_id]
            assert ours.dtype == kv_dtype and ref[1:].float().abs().sum() > 0
            same = (ours.view(torch.uint8) == ref.view(torch.uint8)).float().mean().item()
            assert same > 0.999, f"{buffers}[{layer_id}]: only {same:.4%} of the float8 values identical"
