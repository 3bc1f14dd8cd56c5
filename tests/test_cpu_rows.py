"""kernels/cpu/rows.cpp, the decoder layer's row-wise steps for batches of float32 or bfloat16 rows on the CPU,
against references: RMSNorm (with and without the residual add) against float64, the q/k norm + RoPE bit for
bit against the torch ops it replaces, the KV row store against index_put, SiLU-and-mul within 2 ulp of torch
on each instruction-set path; in bfloat16 each bit for bit the torch ops' roundings (SiLU within one rounding);
their errors on bad input; and a model whose layers take them against the same model on torch's ops
(RS_CPU_ROW_OPS=0's path)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import kernels.cpu_matvec as cpu_matvec
from services.worker.runtime.layers.activation import silu_and_mul
from services.worker.runtime.layers.layernorm import RMSNorm
from services.worker.runtime.layers.rotary import RotaryEmbedding
from services.worker.runtime.model_config import ModelConfig
from services.worker.runtime.model_loader import load_model
from services.worker.runtime.sampling.sampler import greedy_ids
from tests.forward_helpers import BatchDriver
from tests.test_cpu_matvec import isa, needs_matvec  # noqa: F401 (the fixture)

pytestmark = needs_matvec


def ops():
    return torch.ops.radixserve_cpu


@pytest.fixture
def without_row_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers as RS_CPU_ROW_OPS=0 leaves them: torch's ops."""
    monkeypatch.setattr(cpu_matvec, "_row_ops", None)


def _norm64(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h64 = h.double()
    return w.double() * h64 / torch.sqrt(h64.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("rows", [1, 16, 300])
def test_add_rmsnorm_rows_matches_float64_and_adds_exactly(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    # Rows of a wider tensor (strided), as a projection's slice would be.
    x = torch.randn(rows, 600, generator=g)[:, :576]
    residual, w = torch.randn(rows, 576, generator=g), torch.randn(576, generator=g)
    normed, total = ops().add_rmsnorm_rows(x, residual, w, 1e-5)
    assert torch.equal(total, x + residual)
    ref = _norm64(x + residual, w, 1e-5)
    torch.testing.assert_close(normed.double(), ref, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(
        ops().rmsnorm_rows(x, w, 1e-5).double(), _norm64(x, w, 1e-5), rtol=2e-6, atol=2e-6
    )


def test_rmsnorm_layer_takes_the_op_and_stays_within_an_ulp_of_torch(without_row_ops: None) -> None:
    g = torch.Generator().manual_seed(3)
    x, residual = torch.randn(16, 96, generator=g), torch.randn(16, 96, generator=g)
    norm = RMSNorm(96, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=g))
    torch_y, torch_sum = norm(x, residual)
    cpu_matvec._row_ops = torch.ops.radixserve_cpu
    y, total = norm(x, residual)
    assert torch.equal(total, torch_sum)
    torch.testing.assert_close(y, torch_y, rtol=1e-6, atol=1e-6)


def _torch_rotation(rope: RotaryEmbedding, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    """The rotation as the torch ops give it (the row ops off for the call)."""
    cpu_matvec._row_ops, saved = None, cpu_matvec._row_ops
    try:
        return rope(positions, q, k)
    finally:
        cpu_matvec._row_ops = saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [64, 32])
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_rope_in_place_is_bit_identical_to_the_torch_rotation(rows: int, rotary_dim: int, dtype: torch.dtype) -> None:
    """In float32 and in bfloat16 (cos and sin rounded to it first, each product and sum rounded, as torch's
    bfloat16 ops do)."""
    head_dim = 64
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    rope = RotaryEmbedding(head_dim, inv_freq, 4096)
    g = torch.Generator().manual_seed(rows)
    qkv = (torch.randn(rows, (6 + 2 + 2) * head_dim, generator=g) * 4).to(dtype)
    positions = torch.randint(0, 4096, (rows,), generator=g)
    q, k, v = qkv.split([6 * head_dim, 2 * head_dim, 2 * head_dim], dim=-1)
    ref_q, ref_k = _torch_rotation(rope, positions, q.clone(), k.clone())
    v_before = v.clone()
    assert rope.norm_rope_in_place(positions, q, k, None, None)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k) and torch.equal(v, v_before)


def test_qk_norms_then_rope_match_the_layers_steps() -> None:
    head_dim = 32
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    rope = RotaryEmbedding(head_dim, inv_freq, 256)
    g = torch.Generator().manual_seed(9)
    q_norm, k_norm = RMSNorm(head_dim, 1e-6), RMSNorm(head_dim, 1e-6)
    with torch.no_grad():
        q_norm.weight.copy_(torch.randn(head_dim, generator=g))
        k_norm.weight.copy_(torch.randn(head_dim, generator=g))
    q, k = torch.randn(8, 4 * head_dim, generator=g), torch.randn(8, 2 * head_dim, generator=g)
    positions = torch.randint(0, 256, (8,), generator=g)
    nq = torch.from_numpy(_norm64(q.view(-1, head_dim), q_norm.weight.detach(), 1e-6).float().numpy()).view(
        q.shape
    )
    nk = torch.from_numpy(_norm64(k.view(-1, head_dim), k_norm.weight.detach(), 1e-6).float().numpy()).view(
        k.shape
    )
    ref_q, ref_k = _torch_rotation(rope, positions, nq, nk)
    assert rope.norm_rope_in_place(positions, q, k, q_norm, k_norm)
    torch.testing.assert_close(q, ref_q, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(k, ref_k, rtol=2e-6, atol=2e-6)


def test_rope_in_place_declines_what_it_does_not_take() -> None:
    rope = RotaryEmbedding(16, 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)), 64)
    positions = torch.arange(3)
    q, k = torch.randn(3, 32), torch.randn(3, 16)
    q0, k0 = q.clone(), k.clone()
    assert not rope.norm_rope_in_place(positions, q.double(), k.double(), None, None)
    assert not rope.norm_rope_in_place(positions, q.t().contiguous().t(), k, None, None)  # columns strided
    norm_a, norm_b = RMSNorm(16, 1e-6), RMSNorm(16, 1e-5)
    assert not rope.norm_rope_in_place(positions, q, k, norm_a, norm_b)  # two epsilons: the torch steps
    assert torch.equal(q, q0) and torch.equal(k, k0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_rows_equals_index_put(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(6, 3 * 48, generator=g).to(dtype)
    k, v = qkv[:, 48:96], qkv[:, 96:]
    pool_k, pool_v = torch.zeros(20, 3, 16, dtype=dtype), torch.zeros(20, 3, 16, dtype=dtype)
    rows = torch.tensor([19, 0, 4, 7, 8, 2])
    ref_k, ref_v = pool_k.clone(), pool_v.clone()
    ref_k[rows], ref_v[rows] = k.reshape(6, 3, 16), v.reshape(6, 3, 16)
    ops().store_kv_rows_(k, v, pool_k, pool_v, rows)
    assert torch.equal(pool_k, ref_k) and torch.equal(pool_v, ref_v)


@pytest.mark.parametrize("cols", [1536, 17, 1])
def test_silu_mul_rows_within_two_ulp_of_torch(isa: str, cols: int) -> None:  # noqa: F811
    g = torch.Generator().manual_seed(cols)
    x = torch.randn(16, 2 * cols, generator=g) * 6
    if cols >= 4:  # the exp's clamps: far below and above its range
        x[0, :4] = torch.tensor([-200.0, -90.0, 88.0, 200.0])
    gate, up = x.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    got = ops().silu_mul_rows(x)
    torch.testing.assert_close(got, ref, rtol=3e-7, atol=1e-30)
    assert torch.equal(silu_and_mul(x), got)


def test_row_ops_refuse_bad_input_with_a_clear_error() -> None:
    x, w = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(RuntimeError, match="weight must be a contiguous float32 CPU vector of 8"):
        ops().rmsnorm_rows(x, torch.randn(7), 1e-6)
    with pytest.raises(RuntimeError, match="x must be a float32 CPU tensor"):
        ops().add_rmsnorm_rows(x.double(), x, w, 1e-6)
    with pytest.raises(RuntimeError, match="residual has 3 rows"):
        ops().add_rmsnorm_rows(x, torch.randn(3, 8), w, 1e-6)
    cos = sin = torch.randn(10, 4)
    with pytest.raises(RuntimeError, match="position 10 of row 1 is outside the rotary table's 10"):
        ops().qk_norm_rope_rows_(x, x.clone(), torch.tensor([0, 10, 1, 2]), cos, sin, None, None, 1e-6, 8)
    with pytest.raises(RuntimeError, match="not whole heads of 3"):
        ops().qk_norm_rope_rows_(x, x.clone(), torch.arange(4), cos, sin, None, None, 1e-6, 3)
    with pytest.raises(RuntimeError, match="row 5 is outside the destination's 5"):
        ops().store_kv_rows_(x, x, torch.zeros(5, 8), torch.zeros(5, 8), torch.tensor([0, 1, 5, 2]))
    with pytest.raises(RuntimeError, match="an even number of values"):
        ops().silu_mul_rows(torch.randn(2, 7))


@torch.no_grad()
def test_a_model_on_the_row_ops_matches_torch_ops_and_transformers(
    qwen3_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny Qwen3 (q/k norms) in float32, a batched prefill then 5 greedy decode steps of 3 requests: the
    same tokens with the row ops as on torch's ops, logits within 1e-5, and the last step within 1e-4 of
    transformers on the whole sequences."""
    config = ModelConfig.from_path(qwen3_path, dtype="float32")
    model = load_model(config, "cpu")
    prompts = [[5, 9, 31, 7, 2, 44], [8, 3, 61, 17], [12, 40, 2, 9, 9]]

    def run() -> tuple[list[torch.Tensor], list[list[int]]]:
        driver = BatchDriver(model, config)
        rows = [driver.new_request() for _ in prompts]
        logits, tokens = [driver.extend(list(zip(rows, prompts)))], [list(p) for p in prompts]
        for _ in range(5):
            nxt = logits[-1].argmax(-1).tolist()
            for seq, token in zip(tokens, nxt):
                seq.append(token)
            logits.append(driver.decode(list(zip(rows, nxt))))
        return logits, tokens

    assert cpu_matvec.row_ops() is not None
    ours, tokens = run()
    monkeypatch.setattr(cpu_matvec, "_row_ops", None)
    torch_logits, torch_tokens = run()
    assert tokens == torch_tokens
    for a, b in zip(ours, torch_logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    hf = AutoModelForCausalLM.from_pretrained(
        qwen3_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ref = torch.stack([hf(torch.tensor([seq])).logits[0, -1].float() for seq in tokens])
    assert ((ours[-1] - ref).norm(dim=-1) / ref.norm(dim=-1)).max() <= 1e-4


# bfloat16: each op against torch's bfloat16 ops (layers/ on bfloat16 tensors), which round every stored
# result to bfloat16; the norm's reference sums its squares in double, as the op does.
BF16 = torch.bfloat16


def _bf16_norm(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of bfloat16 rows as layers/layernorm.py's torch steps, with mean(h^2) from a double sum."""
    h32 = h.float()
    inv = 1.0 / torch.sqrt((h32.double().pow(2).sum(-1, keepdim=True) / h.shape[-1]).float() + eps)
    return w * (h32 * inv).to(BF16)


@pytest.mark.parametrize("rows", [1, 16, 70])
def test_bfloat16_norms_round_as_torch_does(isa: str, rows: int) -> None:  # noqa: F811
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 600, generator=g) * 3).to(BF16)[:, :584]  # strided rows; a 16-lane tail of 8
    residual, w = torch.randn(rows, 584, generator=g).to(BF16), torch.randn(584, generator=g).to(BF16)
    normed, total = ops().add_rmsnorm_rows(x, residual, w, 1e-5)
    assert total.dtype == normed.dtype == BF16
    assert torch.equal(total, x + residual)
    assert torch.equal(normed, _bf16_norm(x + residual, w, 1e-5))
    assert torch.equal(ops().rmsnorm_rows(x, w, 1e-5), _bf16_norm(x, w, 1e-5))


def test_bfloat16_rmsnorm_layer_takes_the_op_within_a_rounding_of_torch(without_row_ops: None) -> None:
    g = torch.Generator().manual_seed(4)
    x, residual = torch.randn(16, 96, generator=g).to(BF16), torch.randn(16, 96, generator=g).to(BF16)
    norm = RMSNorm(96, 1e-6).to(BF16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=g))
    torch_y, torch_sum = norm(x, residual)
    cpu_matvec._row_ops = torch.ops.radixserve_cpu
    y, total = norm(x, residual)
    assert y.dtype == BF16 and torch.equal(total, torch_sum)
    # torch's float32 mean and the op's double sum may put h * inv either side of a rounding.
    torch.testing.assert_close(y, torch_y, rtol=2**-7, atol=0)


def test_bfloat16_qk_norms_then_rope_are_the_torch_steps() -> None:
    head_dim = 32
    rope = RotaryEmbedding(head_dim, 1.0 / (1e6 ** (torch.arange(0, head_dim, 2).float() / head_dim)), 256)
    g = torch.Generator().manual_seed(10)
    q_norm, k_norm = RMSNorm(head_dim, 1e-6).to(BF16), RMSNorm(head_dim, 1e-6).to(BF16)
    with torch.no_grad():
        q_norm.weight.copy_(torch.randn(head_dim, generator=g))
        k_norm.weight.copy_(torch.randn(head_dim, generator=g))
    q, k = torch.randn(8, 4 * head_dim, generator=g).to(BF16), torch.randn(8, 2 * head_dim, generator=g).to(BF16)
    positions = torch.randint(0, 256, (8,), generator=g)
    nq = _bf16_norm(q.view(-1, head_dim), q_norm.weight.detach(), 1e-6).view(q.shape)
    nk = _bf16_norm(k.view(-1, head_dim), k_norm.weight.detach(), 1e-6).view(k.shape)
    ref_q, ref_k = _torch_rotation(rope, positions, nq, nk)
    assert rope.norm_rope_in_place(positions, q, k, q_norm, k_norm)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)


@pytest.mark.parametrize("cols", [1536, 17])
def test_bfloat16_silu_mul_rows_rounds_as_torch_does(isa: str, cols: int) -> None:  # noqa: F811
    g = torch.Generator().manual_seed(cols)
    x = (torch.randn(16, 2 * cols, generator=g) * 6).to(BF16)
    x[0, :4] = torch.tensor([-200.0, -90.0, 88.0, 200.0])
    gate, up = x.chunk(2, dim=-1)
    ref = F.silu(gate) * up  # silu rounded to bfloat16, then the product rounded
    got = ops().silu_mul_rows(x)
    assert got.dtype == BF16 and torch.equal(silu_and_mul(x), got)
    # The exp is within 2 ulp of torch's in float32: a silu value that lands on a bfloat16 rounding
    # boundary may round the other way (then one bfloat16 step apart, before the product).
    differ = (got != ref).sum().item()
    assert differ <= max(2, got.numel() // 200)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2**-7, atol=1e-30)


def test_bfloat16_row_ops_refuse_mixed_dtypes_with_a_clear_error() -> None:
    x, w = torch.randn(4, 8).to(BF16), torch.randn(8).to(BF16)
    with pytest.raises(RuntimeError, match="weight must be a contiguous bfloat16 CPU vector of 8 values"):
        ops().rmsnorm_rows(x, w.float(), 1e-6)
    with pytest.raises(RuntimeError, match=r"residual must be a bfloat16 CPU tensor \(all of a call's float32"):
        ops().add_rmsnorm_rows(x, x.float(), w, 1e-6)
    with pytest.raises(RuntimeError, match="k must be a bfloat16 CPU tensor"):
        ops().qk_norm_rope_rows_(x, x.float(), torch.arange(4), torch.randn(10, 4), torch.randn(10, 4), None, None,
                                 1e-6, 8)  # fmt: skip
    with pytest.raises(RuntimeError, match="cos and sin must be contiguous float32"):
        ops().qk_norm_rope_rows_(x, x.clone(), torch.arange(4), torch.randn(10, 4).to(BF16),
                                 torch.randn(10, 4).to(BF16), None, None, 1e-6, 8)  # fmt: skip
    with pytest.raises(RuntimeError, match="k_dst and v_dst must be contiguous bfloat16 CPU tensors"):
        ops().store_kv_rows_(x, x, torch.zeros(5, 8), torch.zeros(5, 8), torch.tensor([0, 1, 3, 2]))


@torch.no_grad()
def test_a_bfloat16_model_on_the_row_ops_keeps_the_torch_ops_logits(
    qwen3_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny Qwen3 in bfloat16, a batched prefill then 5 greedy decode steps of 3 requests (each step fed
    the same tokens on both sides): every layer's row-wise steps through the ops, logits within bfloat16's
    rounding of the same model on torch's ops (here they are equal; a norm's product may round the other
    way on another CPU)."""
    config = ModelConfig.from_path(qwen3_path, dtype="bfloat16")
    model = load_model(config, "cpu")
    prompts = [[5, 9, 31, 7, 2, 44], [8, 3, 61, 17], [12, 40, 2, 9, 9]]
    steps = [[3 + 7 * i + j for j in range(3)] for i in range(5)]

    def run() -> tuple[list[torch.Tensor], dict[str, int]]:
        driver = BatchDriver(model, config)
        rows = [driver.new_request() for _ in prompts]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            logits = [driver.extend(list(zip(rows, prompts)))]
            for tokens in steps:
                logits.append(driver.decode(list(zip(rows, tokens))))
        wanted = ("radixserve_cpu::qk_norm_rope_rows_", "radixserve_cpu::silu_mul_rows")
        return logits, {e.key: e.count for e in prof.key_averages() if e.key in wanted}

    assert cpu_matvec.row_ops() is not None
    ours, counts = run()
    calls = 6 * config.num_layers  # the prefill and 5 decode steps
    assert counts == {"radixserve_cpu::qk_norm_rope_rows_": calls, "radixserve_cpu::silu_mul_rows": calls}
    monkeypatch.setattr(cpu_matvec, "_row_ops", None)
    theirs, none = run()
    assert none == {}
    for a, b in zip(ours, theirs):
        assert ((a - b).norm() / b.norm()) <= 1e-2


@pytest.mark.parametrize("cols", [49152, 37, 1])
def test_argmax_rows_is_torchs_max_indices(isa: str, cols: int) -> None:  # noqa: F811
    """The first index of each row's maximum, a NaN counting as the maximum (the first NaN), as
    torch's max(dim).indices gives greedy sampling: ties, infinities, signed zeros, tails past 16 lanes,
    rows of a wider tensor."""
    g = torch.Generator().manual_seed(cols)
    x = torch.randn(12, cols + 5, generator=g)[:, :cols]  # strided rows
    if cols >= 37:
        x[1, 3] = x[1, 30] = 50.0  # a tie: the first
        x[2, 20], x[2, 33] = float("nan"), float("nan")  # NaNs: the first, whatever the values
        x[3] = float("-inf")  # every value -inf (a row masked out): index 0
        x[4, 36] = float("inf")  # the tail lanes
        x[5] = 0.0
        x[5, 9], x[5, 2] = -0.0, -0.0  # signed zeros tie: the first
        x[6, cols - 1] = float("nan")
        x[7, 0] = 1e30
    got = torch.ops.radixserve_cpu.argmax_rows(x)
    assert got.dtype == torch.int64 and torch.equal(got, x.max(dim=-1).indices)
    assert torch.equal(greedy_ids(x), got)


def test_greedy_sampling_takes_argmax_rows_where_it_can() -> None:
    x = torch.randn(4, 100)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ids = greedy_ids(x)
    assert any(e.key == "radixserve_cpu::argmax_rows" for e in prof.key_averages())
    assert torch.equal(ids, x.argmax(-1))
    for other in (x.double(), x.bfloat16(), x.t().contiguous().t(), torch.randn(3, 4, 5)):
        assert torch.equal(greedy_ids(other), other.max(dim=-1).indices)  # torch's max(dim) there
    with pytest.raises(RuntimeError, match="x must be a float32 CPU tensor"):
        torch.ops.radixserve_cpu.argmax_rows(x.double())
    with pytest.raises(RuntimeError, match="at least one value"):
        torch.ops.radixserve_cpu.argmax_rows(torch.empty(2, 0))
