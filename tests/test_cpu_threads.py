"""How many threads a CPU rank computes with: --cpu-threads when given, else OMP_NUM_THREADS when set
(torch's own reading of it stands), else every usable core but one, at least one, so the event loop,
the other services and the host keep a core."""

from __future__ import annotations

import os

import pytest

from services.worker.config import EngineConfig


def test_cpu_threads_given_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert EngineConfig(cpu_threads=5).compute_threads() == 5


def test_omp_num_threads_is_left_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert EngineConfig().compute_threads() is None


def test_by_default_one_usable_core_is_left_free(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    usable = len(os.sched_getaffinity(0))
    assert EngineConfig().compute_threads() == max(1, usable - 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert EngineConfig().compute_threads() == 1


def test_a_bad_cpu_threads_is_refused() -> None:
    with pytest.raises(ValueError, match="cpu_threads must be in"):
        EngineConfig(cpu_threads=0)
