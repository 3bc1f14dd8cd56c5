"""The `flashinfer` attention backend where FlashInfer cannot run (CPU, no package): its errors, its page
table, and its plumbing against a reference of FlashInfer's documented wrapper contract.

FlashInfer's kernels need CUDA; bench/gpu_flashinfer.py checks the real package against the triton
backend on the device. Here `ReferenceFlashInfer` computes what FlashInfer's docs say its paged wrappers
compute (page tables as indptr / indices / last_page_len, NHD caches [pages, page_size, kv_heads,
head_dim], GQA, sm_scale, a causal mask aligned to the end of each request's keys), so a model run on
the backend matching the torch backend shows the page table, layout, K/V store and plan-once-per-step
logic are what FlashInfer expects.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

from services.worker.config import EngineConfig
from services.worker.runtime.attention.flashinfer_backend import (
    FlashInferAttnBackend,
    check_flashinfer_target,
    kv_page_indices,
)
from services.worker.runtime.model_config import ModelConfig
from services.worker.runtime.model_loader import load_model
from tests.forward_helpers import BatchDriver, run_mixed_steps


class _ReferenceWrapper:
    """plan() keeps the page table; run() attends request by request in float32."""

    plans: list[tuple[str, dict]]

    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", **kwargs: object) -> None:
        assert kv_layout == "NHD"
        assert workspace.dtype == torch.uint8 and workspace.numel() > 0
        self.plan_args: dict | None = None

    def _keys(self, cache: torch.Tensor, i: int) -> torch.Tensor:
        a = self.plan_args
        assert a is not None, "run() before plan()"
        pages = a["indices"][a["indptr"][i] : a["indptr"][i + 1]].long()
        rows = cache[pages]  # [n_pages, page_size, kv_heads, head_dim]
        assert rows.shape[1] == a["page_size"]
        full = rows.reshape(-1, rows.shape[2], rows.shape[3])
        return full[: full.shape[0] - a["page_size"] + int(a["last_page_len"][i])]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        a = self.plan_args
        group = a["num_qo_heads"] // a["num_kv_heads"]
        k = k.float().repeat_interleave(group, dim=1)  # [keys, heads, dim]
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k) * a["sm_scale"]
        if causal:
            nq, nk = q.shape[0], k.shape[0]
            allowed = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)
            scores = scores.masked_fill(~allowed[None], float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)


class ReferenceDecodeWrapper(_ReferenceWrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kw) -> None:
        type(self).plans.append(("decode", kw))
        self.plan_args = dict(indptr=indptr, indices=indices, last_page_len=last_page_len, num_qo_heads=num_qo_heads,
                              num_kv_heads=num_kv_heads, page_size=page_size, sm_scale=kw["sm_scale"])

    def run(self, q: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        outs = [self._attend(q[i : i + 1], self._keys(cache[0], i), self._keys(cache[1], i), causal=False)
                for i in range(q.shape[0])]
        return torch.cat(outs)


class ReferencePrefillWrapper(_ReferenceWrapper):
    def plan(self, qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             **kw) -> None:
        type(self).plans.append(("prefill", kw))
        self.plan_args = dict(qo_indptr=qo_indptr, indptr=indptr, indices=indices, last_page_len=last_page_len,
                              num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, page_size=page_size,
                              sm_scale=kw["sm_scale"], causal=kw["causal"])

    def run(self, q: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        qo = self.plan_args["qo_indptr"]
        outs = [self._attend(q[qo[i] : qo[i + 1]], self._keys(cache[0], i), self._keys(cache[1], i),
                             causal=self.plan_args["causal"]) for i in range(len(qo) - 1)]
        return torch.cat(outs)


@pytest.fixture
def reference_flashinfer(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict]]:
    plans: list[tuple[str, dict]] = []
    module = types.ModuleType("flashinfer")
    module.BatchDecodeWithPagedKVCacheWrapper = type("Decode", (ReferenceDecodeWrapper,), {"plans": plans})
    module.BatchPrefillWithPagedKVCacheWrapper = type("Prefill", (ReferencePrefillWrapper,), {"plans": plans})
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return plans


@pytest.mark.parametrize("checkpoint", ["qwen3_path", "qwen3_one_kv_head_path"])
def test_model_on_the_flashinfer_backend_matches_the_torch_backend(
    request: pytest.FixtureRequest, reference_flashinfer: list, checkpoint: str
) -> None:
    path: Path = request.getfixturevalue(checkpoint)
    config = ModelConfig.from_path(path, dtype="float32")
    model = load_model(config, "cpu")
    drivers = {name: BatchDriver(model, config, max_requests=3, max_tokens=96) for name in ("torch", "flashinfer")}
    drivers["flashinfer"].backend = FlashInferAttnBackend(workspace_bytes=1024)

    def check(logits: dict[str, torch.Tensor]) -> None:
        assert logits["flashinfer"].shape == logits["torch"].shape
        torch.testing.assert_close(logits["flashinfer"], logits["torch"], rtol=1e-4, atol=1e-4)

    # The continued prefill after request 0's cached prefix is causal from the end.
    run_mixed_steps(drivers, check)
    # One plan per step (at its first layer), with the layer's scale and a causal mask for prefill.
    assert [kind for kind, _ in reference_flashinfer] == ["prefill"] * 2 + ["decode"] * 3
    scale = model.model.layers[0].self_attn.attn.scaling
    assert all(kw["sm_scale"] == scale for _, kw in reference_flashinfer)
    assert all(kw["causal"] for kind, kw in reference_flashinfer if kind == "prefill")
    pools = {name: driver.kv_pool for name, driver in drivers.items()}
    for layer_id in range(config.num_layers):
        torch.testing.assert_close(pools["flashinfer"].k_buffer[layer_id], pools["torch"].k_buffer[layer_id])


def test_page_indices_are_each_requests_slots_in_order() -> None:
    g = torch.Generator().manual_seed(5)
    req_to_token = torch.randint(1, 1000, (6, 40), generator=g, dtype=torch.int32)
    rows = torch.tensor([4, 0, 2])
    lens = torch.tensor([7, 1, 33])
    want = torch.cat([req_to_token[r, :n] for r, n in zip(rows.tolist(), lens.tolist())])
    got = kv_page_indices(req_to_token, rows, lens, int(lens.sum()))
    assert got.dtype == torch.int32 and torch.equal(got, want)
    assert kv_page_indices(req_to_token, rows[:0], lens[:0], 0).numel() == 0


def test_flashinfer_without_the_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.worker.runtime.model_runner import make_attn_backend

    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer -> ImportError
    with pytest.raises(ImportError, match="pip install flashinfer-python"):
        make_attn_backend("flashinfer")
    # The name itself is valid configuration.
    assert EngineConfig(model_path="unused", attention_backend="flashinfer").attention_backend == "flashinfer"
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(model_path="unused", attention_backend="flash")


def test_flashinfer_needs_cuda_and_a_half_dtype() -> None:
    with pytest.raises(ValueError, match="CUDA only"):
        check_flashinfer_target(torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        check_flashinfer_target(torch.device("cuda", 0), torch.float32)
    check_flashinfer_target(torch.device("cuda", 0), torch.bfloat16)


def test_an_engine_on_the_cpu_refuses_the_flashinfer_backend(qwen3_path: Path) -> None:
    from services.worker.frontend.engine import Engine

    with pytest.raises(ValueError, match="attention_backend='flashinfer' runs on CUDA only"):
        Engine(str(qwen3_path), attention_backend="flashinfer", device="cpu")
