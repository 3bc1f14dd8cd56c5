"""kernels/cpu/extend_attention.cpp, a prefill batch's causal attention over the KV pool on the CPU: against
float64 SDPA over the gathered, head-repeated keys (GQA groups 1 to 20, head sizes 16 to 128, cached
prefixes, strided queries, scattered slots) on each instruction-set path; a request's rows bit for bit the
same alone and batched, whole and in chunks; its errors on bad input; and a model whose prefill takes it
against the same model on SDPA (RS_CPU_EXTEND_ATTENTION=0)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels.cpu_matvec as cpu_matvec
from services.worker.runtime.model_config import ModelConfig
from services.worker.runtime.model_loader import load_model
from tests.forward_helpers import BatchDriver
from tests.test_cpu_matvec import isa, needs_matvec  # noqa: F401 (the fixture)

pytestmark = needs_matvec


def attend(*args: object) -> torch.Tensor:
    return torch.ops.radixserve_cpu.extend_attention_rows(*args)


def reference(q, k_pool, v_pool, slots, seq_lens, q_lens, scale) -> torch.Tensor:
    """float64 SDPA per request over its gathered keys, each KV head repeated to its group of query heads."""
    out, start = [], 0
    _, heads, group, d = q.shape
    for b, (seq_len, q_len) in enumerate(zip(seq_lens.tolist(), q_lens.tolist())):
        prefix = seq_len - q_len
        qi = q[start : start + q_len].reshape(q_len, heads * group, d).transpose(0, 1)[None].double()
        ki = k_pool[slots[b, :seq_len]].repeat_interleave(group, dim=1).transpose(0, 1)[None].double()
        vi = v_pool[slots[b, :seq_len]].repeat_interleave(group, dim=1).transpose(0, 1)[None].double()
        mask = torch.arange(seq_len)[None, :] <= (prefix + torch.arange(q_len))[:, None]
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
        out.append(o[0].transpose(0, 1).reshape(q_len, -1))
        start += q_len
    return torch.cat(out).float()


def batch(heads: int, group: int, d: int, seq_lens: list[int], q_lens: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    pool = 4 * sum(seq_lens) + 16
    k_pool, v_pool = torch.randn(pool, heads, d, generator=g), torch.randn(pool, heads, d, generator=g)
    slots = torch.zeros(len(seq_lens), max(seq_lens) + 3, dtype=torch.int64)
    free = torch.randperm(pool, generator=g)
    used = 0
    for b, n in enumerate(seq_lens):
        slots[b, :n] = free[used : used + n]
        used += n
    tokens = sum(q_lens)
    # q as a slice of a wider projection output (strided token rows), as the backend passes it.
    qkv = torch.randn(tokens, heads * group * d + 40, generator=g)
    q = qkv[:, : heads * group * d].view(tokens, heads, group, d)
    return q, k_pool, v_pool, slots, torch.tensor(seq_lens), torch.tensor(q_lens), d**-0.5


@pytest.mark.parametrize(
    "heads,group,d",
    [(3, 3, 64), (8, 2, 128), (2, 1, 16), (1, 7, 24), (2, 20, 32), (4, 4, 80)],
)
def test_matches_float64_sdpa(isa: str, heads: int, group: int, d: int) -> None:  # noqa: F811
    # A lone new token, a whole short prompt, a short extend after a long prefix, a 200-token prompt
    # (blocks of 64 keys, tasks of 16 tokens), a 64-token chunk after a 66-token prefix.
    args = batch(heads, group, d, [1, 5, 70, 200, 130], [1, 5, 3, 200, 64], seed=heads * d)
    torch.testing.assert_close(attend(*args), reference(*args), rtol=1e-5, atol=5e-6)


def test_a_request_is_the_same_alone_batched_and_chunked(isa: str) -> None:  # noqa: F811
    heads, group, d = 3, 3, 64
    q, k_pool, v_pool, slots, _, _, scale = batch(heads, group, d, [300, 90, 17], [300, 90, 17], seed=7)
    whole = attend(q, k_pool, v_pool, slots, torch.tensor([300, 90, 17]), torch.tensor([300, 90, 17]), scale)
    alone = attend(q[:300], k_pool, v_pool, slots[:1], torch.tensor([300]), torch.tensor([300]), scale)
    assert torch.equal(alone, whole[:300])
    for size in (1, 7, 64):
        parts = []
        for start in range(0, 300, size):
            end = min(300, start + size)
            parts.append(
                attend(
                    q[start:end],
                    k_pool,
                    v_pool,
                    slots[:1],
                    torch.tensor([end]),
                    torch.tensor([end - start]),
                    scale,
                )
            )
        assert torch.equal(torch.cat(parts), alone), f"chunks of {size}"


def test_refuses_bad_input_with_a_clear_error() -> None:
    q, k_pool, v_pool, slots, seq_lens, q_lens, scale = batch(2, 2, 16, [10, 6], [4, 6])
    with pytest.raises(RuntimeError, match="request 0 has q_len 11 and seq_len 10"):
        attend(q, k_pool, v_pool, slots, seq_lens, torch.tensor([11, 6]), scale)
    with pytest.raises(RuntimeError, match="q has 10 token rows but q_lens sum to 9"):
        attend(q, k_pool, v_pool, slots, seq_lens, torch.tensor([3, 6]), scale)
    bad = slots.clone()
    bad[1, 2] = k_pool.shape[0]
    with pytest.raises(RuntimeError, match=f"slot {k_pool.shape[0]} of request 1 is outside the pool"):
        attend(q, k_pool, v_pool, bad, seq_lens, q_lens, scale)
    with pytest.raises(RuntimeError, match="must be float32 CPU tensors"):
        attend(q.double(), k_pool, v_pool, slots, seq_lens, q_lens, scale)
    with pytest.raises(RuntimeError, match="does not match q"):
        attend(q, k_pool[:, :1], v_pool[:, :1], slots, seq_lens, q_lens, scale)


@torch.no_grad()
def test_a_models_prefill_on_the_op_matches_sdpa(qwen3_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Qwen3 in float32: three prompts prefilled together, a fourth of 17 tokens in chunks of 5 (each
    after the ones before it, in the pool), then greedy decode steps of the three; the same tokens, and
    logits within 1e-5 of the same model on SDPA."""
    config = ModelConfig.from_path(qwen3_path, dtype="float32")
    model = load_model(config, "cpu")
    prompts = [[5, 9, 31, 7, 2, 44], [8, 3, 61, 17], [12, 40, 2, 9, 9, 3, 3, 7, 70, 1, 4]]
    long_prompt = [11, 2, 33, 4, 58, 6, 7, 81, 9, 10, 1, 12, 13, 4, 15, 16, 7]

    def run() -> tuple[list[torch.Tensor], list[list[int]]]:
        driver = BatchDriver(model, config)
        rows = [driver.new_request() for _ in prompts]
        logits, tokens = [driver.extend(list(zip(rows, prompts)))], [list(p) for p in prompts]
        row = driver.new_request()
        for start in range(0, len(long_prompt), 5):
            logits.append(driver.extend([(row, long_prompt[start : start + 5])]))
        last = logits[0]
        for _ in range(4):
            nxt = last.argmax(-1).tolist()
            for seq, token in zip(tokens, nxt):
                seq.append(token)
            last = driver.decode(list(zip(rows, nxt)))
            logits.append(last)
        return logits, tokens

    if cpu_matvec.extend_attention() is None:
        pytest.skip("the op serves float32 prefill only on AVX-512 and AVX2 CPUs")
    ours, tokens = run()
    monkeypatch.setenv(cpu_matvec.EXTEND_ATTENTION_ENV, "0")
    assert cpu_matvec.extend_attention() is None
    sdpa, sdpa_tokens = run()
    assert tokens == sdpa_tokens
    for a, b in zip(ours, sdpa):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
