"""How many threads a CPU rank computes with and where they run (cpu_placement.py): --cpu-threads
when given, else the cores of a --cpu-bind list, else OMP_NUM_THREADS when set (torch's own reading of it
stands), else every usable core, fewer while other processes want them (cpu_threads.py, its own tests),
or with that off or cpu_reserved_cores set every usable core but the reserved ones (1), at least one;
'auto' pins the threads one to a core, claimed so that a second rank on the host takes other cores or none."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from services.worker.config import EngineConfig
from services.worker.cpu_placement import (
    ComputePlacement,
    cgroup_cpu_quota,
    parse_cpu_list,
    plan_placement,
    usable_cores,
)
from tests.cpu_helpers import python_stdout

TWO_CORES = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores")


@pytest.fixture(autouse=True)
def claims_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Core claims of this test only (not the host's, where an Engine of another test may hold some)."""
    directory = tmp_path / "claims"
    monkeypatch.setenv("RS_CPU_CLAIMS_DIR", str(directory))
    return directory


def test_cpu_threads_given_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert EngineConfig(cpu_threads=5).compute_threads() == 5


def test_omp_num_threads_is_left_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert EngineConfig().compute_threads() is None


def test_by_default_a_worker_starts_on_every_usable_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    usable = len(os.sched_getaffinity(0))
    assert EngineConfig().adaptive_threads()
    assert EngineConfig().compute_threads() == usable
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert EngineConfig().compute_threads() == 1


def test_without_adaptive_threads_one_usable_core_is_left_free(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    usable = len(os.sched_getaffinity(0))
    assert EngineConfig(cpu_adaptive_threads=False).compute_threads() == max(1, usable - 1)
    assert EngineConfig(cpu_reserved_cores=1).compute_threads() == max(1, usable - 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert EngineConfig(cpu_adaptive_threads=False).compute_threads() == 1


def test_ranks_of_one_node_share_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(9)))
    assert EngineConfig(tp_size=2, cpu_adaptive_threads=False).compute_threads() == 4
    assert EngineConfig(tp_size=2).compute_threads() == 4  # 9 // 2: nothing kept, the odd core unused
    first = plan_placement(4, "auto", tuple(range(9)), local_rank=0, ranks_per_node=2)
    second = plan_placement(4, "auto", tuple(range(9)), local_rank=1, ranks_per_node=2)
    assert (first.cores, second.cores) == ((1, 2, 3, 4), (5, 6, 7, 8))


def test_a_cgroup_cpu_quota_caps_the_usable_cores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    quota = tmp_path / "cpu.max"
    quota.write_text("250000 100000\n")
    assert cgroup_cpu_quota(quota) == 2.5
    assert usable_cores(quota) == (0, 1, 2)
    quota.write_text("max 100000\n")
    assert usable_cores(quota) == tuple(range(16))


def test_cpu_lists_parse_as_linux_writes_them() -> None:
    assert parse_cpu_list("0-3,6") == (0, 1, 2, 3, 6)
    assert parse_cpu_list(" 5 , 2-2") == (2, 5)
    assert EngineConfig(cpu_bind="1-3").compute_threads() == 3


@pytest.mark.parametrize("spec", ["", "1-", "a", "3-1", "1,,2", "auto,1"])
def test_a_bad_cpu_bind_is_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="cpu_bind"):
        EngineConfig(cpu_bind=spec)


def test_a_bad_cpu_threads_is_refused() -> None:
    with pytest.raises(ValueError, match="cpu_threads must be in"):
        EngineConfig(cpu_threads=0)


def test_auto_pins_one_thread_per_core_after_the_first() -> None:
    placement = plan_placement(3, "auto", (0, 1, 2, 3))
    assert (placement.threads, placement.cores) == (3, (1, 2, 3))
    placement.release()
    fewer = plan_placement(8, "auto", (0, 1, 2, 3))  # asked for more than there are: one per core
    assert (fewer.threads, fewer.cores) == (3, (1, 2, 3))
    fewer.release()


def test_with_no_core_reserved_auto_pins_to_every_usable_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """The offline Engine's default (cpu_reserved_cores 0: its caller waits while it computes)."""
    placement = plan_placement(4, "auto", (0, 1, 2, 3), reserved=0)
    assert (placement.threads, placement.cores) == (4, (0, 1, 2, 3))
    placement.release()
    kept_two = plan_placement(4, "auto", (0, 1, 2, 3), reserved=2)
    assert (kept_two.threads, kept_two.cores) == (2, (2, 3))
    kept_two.release()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)))
    assert EngineConfig(cpu_reserved_cores=0).compute_threads() == 6
    assert EngineConfig(cpu_reserved_cores=2).compute_threads() == 4
    assert EngineConfig(cpu_reserved_cores=6).compute_threads() == 6  # no more than kept: none kept
    assert EngineConfig(cpu_adaptive_threads=False).compute_threads() == 5
    assert EngineConfig().compute_threads() == 6  # adaptive: starts on them all
    with pytest.raises(ValueError, match=r"cpu_reserved_cores must be in \[0, 1024\], got -1"):
        EngineConfig(cpu_reserved_cores=-1)


def test_the_offline_engine_keeps_no_core_and_a_worker_adapts(qwen3_path: Path, monkeypatch) -> None:
    from services.worker.frontend.engine import Engine

    with Engine(str(qwen3_path)) as engine:
        assert engine.config.reserved_cores() == 0 and not engine.config.adaptive_threads()
    with Engine(str(qwen3_path), cpu_reserved_cores=1) as engine:
        assert engine.config.reserved_cores() == 1
    # `make test` sets OMP_NUM_THREADS, which fixes the count (and turns adapting off) by design.
    assert not EngineConfig(model_path=str(qwen3_path)).adaptive_threads() or not os.environ.get("OMP_NUM_THREADS")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    worker = EngineConfig(model_path=str(qwen3_path))  # how the worker service builds it
    assert worker.adaptive_threads() and worker.reserved_cores() == 0
    assert EngineConfig(model_path=str(qwen3_path), cpu_adaptive_threads=False).reserved_cores() == 1


def test_under_a_restricted_affinity_auto_stays_inside_it() -> None:
    lone = plan_placement(1, "auto", (5,))  # one usable core: nothing kept back, the thread shares it
    assert (lone.threads, lone.cores) == (1, (5,))
    lone.release()
    two = plan_placement(1, "auto", (2, 7))
    assert (two.threads, two.cores) == (1, (7,))
    two.release()


def test_a_second_rank_on_the_host_takes_the_unclaimed_cores_or_none() -> None:
    first = plan_placement(2, "auto", (0, 1, 2, 3, 4))
    assert first.cores == (3, 4)
    second = plan_placement(4, "auto", (0, 1, 2, 3, 4))
    assert (second.threads, second.cores) == (2, (1, 2))
    third = plan_placement(2, "auto", (0, 1, 2, 3, 4))
    assert (third.threads, third.cores) == (2, None)  # every core claimed: the OS places its threads
    first.release()
    again = plan_placement(2, "auto", (0, 1, 2, 3, 4))
    assert again.cores == (3, 4)
    for placement in (second, again):
        placement.release()


def test_a_core_list_outside_the_affinity_is_refused() -> None:
    with pytest.raises(ValueError, match=r"names cores \[9\]"):
        plan_placement(2, "8-9", (0, 8))
    assert plan_placement(2, "none", (0, 1)) == ComputePlacement(2, None)


def _placed_in_subprocess(affinity: set[int], bind: str) -> dict[str, object]:
    """Plan the default thread count under `bind` and pin it (pin_compute_threads) in a fresh process
    whose affinity is `affinity`, and read back every thread's allowed cores as Linux reports them."""
    code = f"""
import json, os, threading
os.sched_setaffinity(0, {sorted(affinity)!r})
from services.worker.cpu_placement import (
    default_compute_threads, parse_cpu_list, pin_compute_threads, plan_placement, usable_cores)
import torch
usable = usable_cores()
threads = default_compute_threads(len(usable)) if {bind!r} == "auto" else len(parse_cpu_list({bind!r}))
placement = plan_placement(threads, {bind!r}, usable)
pinned = pin_compute_threads(placement)
allowed = {{}}
for tid in os.listdir("/proc/self/task"):
    status = open(f"/proc/self/task/{{tid}}/status").read()
    allowed[tid] = next(l.split()[1] for l in status.splitlines() if l.startswith("Cpus_allowed_list"))
print(json.dumps({{"threads": torch.get_num_threads(), "cores": placement.cores,
                  "pinned": {{str(k): v for k, v in pinned.items()}}, "allowed": allowed,
                  "me": threading.get_native_id()}}))
"""
    return json.loads(python_stdout(code).strip().splitlines()[-1])


@TWO_CORES
def test_pinning_under_a_restricted_affinity_uses_the_one_core_left() -> None:
    core = max(os.sched_getaffinity(0))
    result = _placed_in_subprocess({core}, "auto")
    assert result["threads"] == 1 and result["cores"] == [core]
    assert result["allowed"][str(result["me"])] == str(core)


@TWO_CORES
def test_each_compute_thread_is_pinned_to_its_own_core() -> None:
    cores = sorted(os.sched_getaffinity(0))[:2]
    result = _placed_in_subprocess(set(cores), f"{cores[0]},{cores[1]}")
    assert result["threads"] == 2 and result["cores"] == cores
    pinned = result["pinned"]
    assert isinstance(pinned, dict) and sorted(pinned.values()) == cores  # the model's thread and one worker
    assert result["allowed"][str(result["me"])] == str(cores[0])
    for tid, core in pinned.items():
        assert result["allowed"][tid] == str(core)


def test_a_scheduler_built_in_the_tests_thread_leaves_its_cores(qwen3_path: Path) -> None:
    """scheduler_here (tests/engine_helpers.py) builds with cpu_bind 'none': under 'auto' the loop pins the
    thread that builds it, and pytest's thread pinned to one core broke this file's two-core tests in CI."""
    from tests.engine_helpers import scheduler_here

    before = os.sched_getaffinity(0)
    scheduler_here(EngineConfig.from_kwargs(str(qwen3_path), max_total_tokens=256))
    assert os.sched_getaffinity(0) == before
