"""A tiny Qwen3.5 on the triton attention backend (its Gated DeltaNet layers then run the Triton kernels
of kernels/causal_conv1d.py and kernels/gated_delta_rule.py, under the Triton interpreter on CPU) gives
the torch backend's logits (gdn_ops.py, the reference) within a float32 tolerance and the same greedy
tokens: a chunked prefill whose first chunk spans two 64-token delta-rule chunks, prefills continued over a carried state beside a fresh
request, and decode steps.

The checkpoint (conftest's qwen3_5_v16_path) has one layer of each kind and 16-wide value heads (the
kernels' smallest, for tl.dot) instead of qwen3_5_path's 8."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from services.worker.mem.state_pool import HybridReqToTokenPool
from services.worker.runtime.attention.triton_backend import TritonAttnBackend
from services.worker.runtime.layers import gdn_ops
from services.worker.runtime.layers.gated_delta_net import gdn_ops_for
from services.worker.runtime.model_config import ModelConfig
from services.worker.runtime.model_loader import load_model
from tests.forward_helpers import BatchDriver, run_mixed_steps, seeded_prompt

TOLERANCE = 2e-4  # max absolute logit difference, float32 (logits are O(1))
DECODE_STEPS = 2


@pytest.fixture(scope="module")
def model(qwen3_5_v16_path: Path) -> tuple[ModelConfig, torch.nn.Module]:
    config = ModelConfig.from_path(qwen3_5_v16_path, dtype="float32")
    return config, load_model(config, "cpu")


def drivers(config: ModelConfig, model: torch.nn.Module) -> dict[str, BatchDriver]:
    torch_driver, triton_driver = BatchDriver(model, config), BatchDriver(model, config)
    triton_driver.backend = TritonAttnBackend()
    return {"torch": torch_driver, "triton": triton_driver}


def gdn_ops_for_backend(driver: BatchDriver):
    return gdn_ops_for(SimpleNamespace(attn_backend=driver.backend))  # type: ignore[arg-type]


def test_the_backend_picks_the_ops(model) -> None:
    config, net = model
    both = drivers(config, net)
    row = both["triton"].new_request()
    calls: list[str] = []
    ops = gdn_ops_for_backend(both["triton"])
    assert ops is not gdn_ops and ops.chunk_gated_delta_rule.__module__ == "kernels.gated_delta_rule"
    assert ops.causal_conv1d_update.__module__ == "kernels.causal_conv1d"
    assert ops.gated_rms_norm.__module__ == "kernels.gated_rms_norm"
    assert gdn_ops_for_backend(both["torch"]) is gdn_ops
    # The layer really calls them: count the calls of the Triton decode update (the gating fused in) and
    # gated norm over an extend and a decode step.
    names = ["fused_sigmoid_gating_delta_rule_update", "gated_rms_norm"]
    originals = {name: getattr(ops, name) for name in names}

    def counted(name: str):
        def call(*args, **kwargs):
            calls.append(name)
            return originals[name](*args, **kwargs)

        return call

    for name in names:
        setattr(ops, name, counted(name))
    try:
        both["triton"].extend([(row, [5, 6, 7])])
        extend_calls = list(calls)
        both["triton"].decode([(row, 8)])
    finally:
        for name, original in originals.items():
            setattr(ops, name, original)
    layers = config.state_shape(1).num_layers
    assert extend_calls == ["gated_rms_norm"] * layers
    assert calls[len(extend_calls) :] == names * layers


def test_triton_backend_matches_torch_over_mixed_steps(model) -> None:
    config, net = model

    def check(logits: dict[str, torch.Tensor]) -> None:
        ref, ours = logits["torch"], logits["triton"]
        assert ours.shape == ref.shape
        assert (ours - ref).abs().max().item() <= TOLERANCE
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))

    run_mixed_steps(drivers(config, net), check)


def test_greedy_tokens_after_a_two_chunk_prefill(model) -> None:
    config, net = model
    both = drivers(config, net)
    prompt = seeded_prompt(70, seed=3)
    results = {}
    for name, driver in both.items():
        row = driver.new_request()
        # A chunked prefill: 66 tokens (two delta-rule chunks), then 4 continuing from the state left.
        driver.extend([(row, prompt[:66])])
        prefill = driver.extend([(row, prompt[66:])], return_all_logits=True)
        tokens, logits = driver.greedy_decode(row, int(prefill[-1].argmax()), DECODE_STEPS)
        results[name] = (prefill, tokens, torch.stack(logits))
    (ref_prefill, ref_tokens, ref_logits), (prefill, tokens, logits) = results["torch"], results["triton"]
    assert tokens == ref_tokens
    assert (prefill - ref_prefill).abs().max().item() <= TOLERANCE
    assert (logits - ref_logits).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_tracked_extend_saves_the_state_one_token_short_and_changes_no_logit(model, backend: str) -> None:
    """A step that tracks (ForwardBatch.state_track) leaves in each tracked request's snapshot slot the
    state a prefill one token shorter leaves in its row, conv window and delta-rule state, and gives the
    logits and final states of the same step untracked: a 2-token extend over a cached 5-token prefix
    (its conv window partly from the prefix's), a fresh 70-token prompt (two delta-rule chunks) and an
    untracked fresh request beside them."""
    config, net = model
    tracked, plain, shorter = (drivers(config, net)[backend] for _ in range(3))
    head, prompt, other = seeded_prompt(7, seed=4), seeded_prompt(70, seed=5), seeded_prompt(4, seed=6)
    logits = {}
    for name, driver in (("tracked", tracked), ("plain", plain)):
        rows = [driver.new_request() for _ in range(3)]
        driver.extend([(rows[0], head[:5])])
        track = [(0, 1), (1, 0)] if driver is tracked else []
        step = [(rows[0], head[5:]), (rows[1], prompt), (rows[2], other)]
        logits[name] = driver.extend(step, return_all_logits=True, track=track)
    rows = [shorter.new_request() for _ in range(2)]
    shorter.extend([(rows[0], head[:5])])
    shorter.extend([(rows[0], head[5:6]), (rows[1], prompt[:-1])])
    assert (logits["tracked"] - logits["plain"]).abs().max().item() <= TOLERANCE
    assert torch.equal(logits["tracked"].argmax(-1), logits["plain"].argmax(-1))
    snapshots = tracked.snapshots
    assert snapshots is not None
    for driver in (tracked, plain, shorter):
        assert isinstance(driver.req_pool, HybridReqToTokenPool)
    for layer in range(config.state_shape(1).num_layers):
        for kind in ("conv_state", "recurrent_state"):
            pools = {d: getattr(d.req_pool.state_pool, kind)[layer] for d in (tracked, plain, shorter)}  # type: ignore[union-attr]
            saved = getattr(snapshots, kind)[layer]
            # Slot 1 holds request 0 one token short, slot 0 request 1 (the short run's rows 1 and 2).
            for slot, row in ((1, 1), (0, 2)):
                torch.testing.assert_close(saved[slot], pools[shorter][row], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(pools[tracked][1:4], pools[plain][1:4], rtol=1e-5, atol=1e-5)
