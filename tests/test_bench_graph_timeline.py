"""bench/gpu_profile_step.py's graph timeline: each kernel's part of a replay from its device-clock records.

The records come from CUPTI on the GPU; the arithmetic that turns them into the table is checked here on
records written by hand, where each kernel's increment and lead are known."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from bench.gpu_profile_step import timeline_table  # noqa: E402


def _replay(t0: float, layers: int) -> list[tuple[float, float, str]]:
    """One replay: an embedding, then per layer qkv (3 us), attention (6 us, starting 1 us before qkv ends:
    an early start under PDL), o (2 us), then the LM head (10 us) after a 0.5 us gap."""
    out = [(t0, t0 + 2.0, "embed")]
    t = t0 + 2.0
    for _ in range(layers):
        out.append((t, t + 3.0, "_gemv_kernel"))
        out.append((t + 2.0, t + 9.0, "_decode_kernel"))
        out.append((t + 9.0, t + 11.0, "_gemv_kernel"))
        t += 11.0
    out.append((t + 0.5, t + 10.5, "_gemv_dot_kernel"))
    return out


def test_increments_and_leads_of_each_place_in_a_layer() -> None:
    records = sorted(_replay(0.0, 4) + _replay(10_000.0, 4) + _replay(20_000.0, 4))
    table = timeline_table(records, num_layers=4)
    rows = {r["kernel"]: r for r in table["table"]}
    # The first replay is dropped; the others are 2 + 4 * 11 + 10.5 us from first start to last end.
    assert table["replay_us"] == pytest.approx(56.5)
    assert table["kernels_per_replay"] == 14 and table["anchor"] == "_decode_kernel"
    attention = rows["layer +0 _decode_kernel"]
    assert attention["per_replay"] == 4
    # It starts 1 us before qkv ends (lead 1) and ends 6 us after it (increment 6 of its 7 us).
    assert (attention["increment_us"], attention["lead_us"], attention["duration_us"]) == (6.0, 1.0, 7.0)
    assert rows["layer +1 _gemv_kernel"]["increment_us"] == 2.0
    # qkv of layers 1..3 sits after the layer before's o; layer 0's is in the head.
    assert rows["layer +2 _gemv_kernel"]["per_replay"] == 3 and rows["layer +2 _gemv_kernel"]["increment_us"] == 3.0
    assert rows["head 1 _gemv_kernel"]["increment_us"] == 3.0
    # A gap before a kernel is its own increment: the LM head adds 10.5 us, leading by -0.5.
    head = rows["tail +2 _gemv_dot_kernel"]
    assert (head["increment_us"], head["lead_us"]) == (10.5, -0.5)
    # The increments add up to the replay.
    assert sum(r["increment_total_us"] for r in table["table"]) == pytest.approx(table["replay_us"])


def test_a_replay_without_a_kernel_per_layer_is_refused_with_the_reason() -> None:
    records = sorted(_replay(0.0, 4) + _replay(10_000.0, 4))
    with pytest.raises(ValueError, match="no kernel runs once per layer"):
        timeline_table(records, num_layers=5)
