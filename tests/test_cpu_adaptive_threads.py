"""A CPU rank's compute threads chosen between steps (cpu_threads.py): all its cores while the host is
quiet (this deployment's other services included), one given back while other processes take CPU time
there, taken back once they stop; never below one thread nor above its cores. The controller is driven
by a made-up host (readings of /proc/stat and of the compute threads' CPU time, and a clock), the /proc
readers against files of the kernel's format, the re-pinning in a process of its own."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from services.worker.config import EngineConfig
from services.worker.cpu_placement import parse_cpu_list
from services.worker.cpu_threads import AdaptivePolicy, AdaptiveThreads, read_busy_ticks, read_thread_ticks
from tests.cpu_helpers import python_stdout

TICKS = 100.0  # clock ticks per second, as USER_HZ
TWO_CORES = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores")


@pytest.fixture(autouse=True)
def claims_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "claims"
    monkeypatch.setenv("RS_CPU_CLAIMS_DIR", str(directory))
    return directory


class Host:
    """The rank's cores as the controller reads them: busy ticks of all processes, ticks of each compute
    thread, and the time. `window` moves them on by one stretch of stepping."""

    def __init__(self, most: int, policy: AdaptivePolicy | None = None) -> None:
        self.now = 0.0
        self.busy = 0
        self.own = {100 + i: 0 for i in range(most)}  # the model's thread (100) and the workers
        self.applied: list[int] = []
        self.reads = 0
        self.ctl = AdaptiveThreads(
            most,
            self.applied.append,
            self._read_busy,
            lambda: dict(self.own),
            policy,
            TICKS,
            lambda: self.now,
        )

    def _read_busy(self) -> int:
        self.reads += 1
        return self.busy

    def window(self, foreign: float, seconds: float = 0.25, waited_s: float = 0.0) -> int:
        """`seconds` of steps while other processes take `foreign` cores; the rank's threads keep theirs busy."""
        workers = [tid for tid in self.own if tid != 100][: self.ctl.threads - 1]
        per_thread = round(seconds * TICKS)
        self.now += seconds
        self.busy += round(foreign * seconds * TICKS) + per_thread * (1 + len(workers))
        for tid in (100, *workers):
            self.own[tid] += per_thread
        self.ctl.after_step(waited_s)
        return self.ctl.threads


def test_the_services_of_a_quiet_host_keep_every_thread() -> None:
    host = Host(2)
    # Gateway, tokenizer, detokenizer, NATS and the worker's event loop at 201 tok/s (docs/ARCHITECTURE.md).
    assert [host.window(0.3) for _ in range(40)] == [2] * 40
    assert host.applied == [] and host.ctl.foreign == pytest.approx(0.3, abs=0.05)  # whole ticks


def test_two_loaded_windows_give_a_core_back() -> None:
    host = Host(2)
    assert host.window(1.0) == 2
    assert host.window(1.0) == 1
    assert host.applied == [1]


def test_one_loaded_window_alone_gives_nothing_back() -> None:
    host = Host(2)
    assert [host.window(f) for f in (1.0, 0.2, 1.0, 0.2, 1.0)] == [2] * 5
    assert host.applied == []


def test_the_core_comes_back_after_the_neighbours_stop_and_not_before() -> None:
    host = Host(2)
    host.window(1.2)
    host.window(1.2)
    # A neighbour on the given-back core: its load stays above one core less than given back, and more.
    assert [host.window(1.1) for _ in range(20)] == [1] * 20
    assert [host.window(0.2) for _ in range(4)] == [1, 1, 1, 2]
    assert host.applied == [1, 2]


def test_a_neighbour_pausing_a_moment_does_not_bring_the_core_back() -> None:
    host = Host(2)
    host.window(1.0)
    host.window(1.0)
    assert [host.window(f) for f in (0.1, 0.1, 0.1, 1.0, 0.1, 0.1, 0.1)] == [1] * 7


def test_never_below_one_thread_nor_above_the_cores() -> None:
    host = Host(4)
    host.window(10.0)
    assert host.window(10.0) == 1  # as many cores as the load needs, but one thread stays
    assert [host.window(10.0) for _ in range(5)] == [1] * 5
    counts = [host.window(0.0) for _ in range(40)]
    assert counts[-1] == 4 and max(counts) == 4
    assert host.applied == [1, 2, 3, 4]  # back one core at a time


def test_as_many_cores_go_back_as_the_foreign_load_needs() -> None:
    host = Host(8)
    host.window(2.2)
    assert host.window(2.2) == 6  # ceil(2.2 - 0.5) = 2 cores
    assert [host.window(2.2) for _ in range(10)] == [6] * 10  # they fit in the two given back
    host.window(3.0)
    assert host.window(3.0) == 5


def test_a_wait_for_work_drops_the_window() -> None:
    host = Host(2)
    host.window(1.0)
    # The rank waited for work (another engine's turn on a benchmark host): that window is not counted,
    # nor is the loaded one before it.
    assert host.window(1.5, seconds=3.0, waited_s=2.9) == 2
    assert host.window(1.0) == 2
    assert host.window(1.0) == 1


def test_between_windows_nothing_is_read() -> None:
    host = Host(2)
    reads = host.reads
    for _ in range(5):
        host.now += 0.04
        host.ctl.after_step()
    assert host.reads == reads


def test_a_worker_gone_between_readings_is_not_counted_as_foreign() -> None:
    host = Host(2)
    host.own[101] = 5000  # a worker that computed a while already
    host.ctl.after_step(waited_s=1.0)  # the window starts with it
    del host.own[101]  # libgomp ended it: the model's thread alone computes
    host.window(0.1)
    assert host.ctl.foreign is not None and host.ctl.foreign < 1.0


def test_a_policy_that_would_give_and_take_in_turn_is_refused() -> None:
    with pytest.raises(ValueError, match="grow_below <= shrink_above"):
        AdaptivePolicy(shrink_above=0.3, grow_below=0.5)
    with pytest.raises(ValueError, match="most must be >= 1"):
        AdaptiveThreads(0, print, lambda: 0, dict)


class HelperHost:
    """A 2-core rank with row helpers: `window(model, helper)` is a stretch of stepping in which the model's
    thread gets `model` cores and each running helper `helper` (two busy neighbours take the rest)."""

    def __init__(self, policy: AdaptivePolicy | None = None, read_work: bool = False) -> None:
        self.now = 0.0
        self.busy = 0
        self.own = {100: 0, 101: 0}
        self.helper_work = 0  # ticks the helpers spent inside chunks
        self.helper_calls: list[int] = []
        self.thread_calls: list[int] = []
        self.next_tid = 200
        work = (lambda own: {**{t: v for t, v in own.items() if t < 200}, "helpers": self.helper_work}) if read_work else None
        self.ctl = AdaptiveThreads(2, self._set_threads, lambda: self.busy, lambda: dict(self.own), policy, TICKS,
                                   lambda: self.now, set_helpers=self._set_helpers, read_work=work)  # fmt: skip

    def _set_threads(self, threads: int) -> None:
        self.thread_calls.append(threads)
        if threads == 1:
            self.own.pop(101, None)
        else:
            self.own.setdefault(101, 0)

    def _set_helpers(self, count: int) -> None:
        self.helper_calls.append(count)
        for tid in [t for t in self.own if t >= 200]:
            del self.own[tid]
        for _ in range(count):  # new threads each time, as set_row_helpers starts them
            self.own[self.next_tid] = 0
            self.next_tid += 1

    def window(self, model: float, helper: float, foreign: float | None = None, worked: float = 1.0) -> None:
        """`foreign`: what others take of the two cores (default: all the rank's threads leave); `worked`: the
        share of a helper's CPU time spent inside chunks (the rest it spins)."""
        ticks = 0.25 * TICKS
        self.now += 0.25
        shares = {tid: helper if tid >= 200 else model if tid == 100 else 1.0 for tid in self.own}
        if foreign is None:
            foreign = max(0.0, 2.0 - sum(shares.values()))
        for tid, share in shares.items():
            self.own[tid] += round(share * ticks)
            if tid >= 200:
                self.helper_work += round(share * worked * ticks)
        self.busy += round((sum(shares.values()) + foreign) * ticks)
        self.ctl.after_step()

    def cut_to_one_thread(self) -> None:
        self.window(1.0, 0.0, foreign=1.2)
        self.window(1.0, 0.0, foreign=1.2)
        assert self.ctl.threads == 1 and self.thread_calls == [1]


def test_helpers_that_add_cpu_time_stay_on() -> None:
    """Neighbours in the rank's own scheduling group: with a helper the rank computes on two threads' shares
    (0.5 + 0.5 core of 2 among four threads), without it on one of three (0.67): the helper stays."""
    host = HelperHost()
    host.cut_to_one_thread()
    assert host.helper_calls == [1]  # the probe starts with the helper on
    for _ in range(4):
        host.window(0.5, 0.5)
    assert host.helper_calls == [1, 0]
    for _ in range(4):
        host.window(0.67, 0.0)
    assert host.helper_calls == [1, 0, 1] and host.ctl.helpers == 1
    for _ in range(120):  # the verdict holds, then the probe runs again: off once more, then on
        host.window(0.5, 0.5)
    for _ in range(4):
        host.window(0.5, 0.5)
    assert host.helper_calls == [1, 0, 1, 0]
    for _ in range(4):
        host.window(0.67, 0.0)
    assert host.helper_calls == [1, 0, 1, 0, 1]


@pytest.mark.parametrize(("worked", "kept"), [(0.8, True), (0.2, False)])
def test_the_probe_weighs_the_helpers_work_not_their_spinning(worked, kept) -> None:
    """The same group's neighbours, the helper's CPU time as above (0.5 + 0.5 core against 0.67), but it
    computes chunks for only part of it and spins the rest: at 80 % the rank's work is 0.9 core against
    0.67 and it stays; at 20 %, 0.6 against 0.67, and it stops, though its CPU time reads as a gain."""
    host = HelperHost(read_work=True)
    host.cut_to_one_thread()
    for _ in range(4):
        host.window(0.5, 0.5, worked=worked)
    for _ in range(4):
        host.window(0.67, 0.0)
    assert host.ctl.helpers == (1 if kept else 0)
    assert host.helper_calls == ([1, 0, 1] if kept else [1, 0])
    assert host.ctl.own is not None and host.ctl.work is not None and host.ctl.work <= host.ctl.own


def test_helpers_that_only_take_the_model_threads_time_stop() -> None:
    """Neighbours in a group of their own: the rank's group gets one core either way, so a helper's share
    comes out of the model's thread (1.0 core without it, 0.55 + 0.5 with, half the helper's spent
    spinning: the rank's work 0.8 against 1.0): it stops until the next probe."""
    host = HelperHost(read_work=True)
    host.cut_to_one_thread()
    for _ in range(4):
        host.window(0.55, 0.5, worked=0.5)
    for _ in range(4):
        host.window(1.0, 0.0)
    assert host.helper_calls == [1, 0] and host.ctl.helpers == 0
    for _ in range(119):
        host.window(1.0, 0.0)
    assert host.helper_calls == [1, 0]
    host.window(1.0, 0.0)  # the hold is over: probed again
    assert host.helper_calls == [1, 0, 1]


def test_taking_the_cores_back_ends_the_helpers_and_the_probe() -> None:
    host = HelperHost()
    host.cut_to_one_thread()
    for _ in range(4):  # the neighbours have stopped: the core comes back while the helper is probed
        host.window(1.0, 0.0, foreign=0.0)
    assert host.thread_calls == [1, 2] and host.helper_calls[-1] == 0 and host.ctl.helpers == 0
    for _ in range(200):
        host.window(1.0, 0.0, foreign=0.1)
    assert host.helper_calls[-1] == 0 and host.ctl.threads == 2


def test_helpers_without_the_probe_stay_on_while_cores_are_given_back() -> None:
    host = HelperHost(AdaptivePolicy(helper_probe=False))
    host.cut_to_one_thread()
    for _ in range(200):
        host.window(1.0, 0.0)  # no gain: the probe would have stopped them
    assert host.helper_calls == [1]
    for _ in range(4):
        host.window(1.0, 0.0, foreign=0.0)
    assert host.thread_calls == [1, 2] and host.helper_calls == [1, 0]


def test_a_policy_with_no_probe_windows_is_refused() -> None:
    with pytest.raises(ValueError, match="window counts >= 1"):
        AdaptivePolicy(helper_probe_windows=0)
    with pytest.raises(ValueError, match="helper_gain must be >= 0"):
        AdaptivePolicy(helper_gain=-0.1)


def test_proc_stat_busy_columns_of_the_given_cores(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  900 0 900 9000 9 0 0 0 0 0\n"
        "cpu0 100 1 20 5000 7 3 4 5 0 0\n"  # user nice system idle iowait irq softirq steal guest guest_nice
        "cpu1 300 2 40 4000 9 6 7 8 0 0\n"
        "cpu10 1 1 1 1 1 1 1 1 0 0\n"
        "intr 1 2 3\n"
    )
    assert read_busy_ticks((0,), stat) == 100 + 1 + 20 + 3 + 4 + 5
    assert read_busy_ticks((1, 0), stat) == 133 + 300 + 2 + 40 + 6 + 7 + 8


def test_thread_ticks_are_user_plus_system_and_skip_gone_threads(tmp_path: Path) -> None:
    task = tmp_path / "7"
    task.mkdir()
    # The command name may hold spaces and parentheses: the fields count from the last ')'.
    (task / "stat").write_text("7 (pt (main) x) S 1 7 7 0 -1 4194560 10 0 0 0 250 31 0 0 20 0 3 0 99\n")
    assert read_thread_ticks((7, 8), tmp_path) == {7: 281}
    me = os.getpid()
    before = read_thread_ticks((me,))[me]
    sum(i * i for i in range(3_000_000))
    assert read_thread_ticks((me,))[me] > before


def test_adaptive_threads_by_default_and_what_fixes_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert EngineConfig().adaptive_threads()
    assert not EngineConfig(cpu_adaptive_threads=False).adaptive_threads()
    assert not EngineConfig(cpu_reserved_cores=1).adaptive_threads()
    assert not EngineConfig(cpu_reserved_cores=0).adaptive_threads()
    assert not EngineConfig(cpu_threads=2).adaptive_threads()
    assert not EngineConfig(cpu_bind="none").adaptive_threads()
    assert EngineConfig(cpu_reserved_cores=1, cpu_adaptive_threads=True).reserved_cores() == 1
    with pytest.raises(ValueError, match="cpu_adaptive_threads needs cpu_bind 'auto' and no cpu_threads"):
        EngineConfig(cpu_threads=2, cpu_adaptive_threads=True)
    with pytest.raises(ValueError, match="cpu_adaptive_threads needs"):
        EngineConfig(cpu_bind="0-1", cpu_adaptive_threads=True)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert not EngineConfig().adaptive_threads()


def test_the_offline_engine_adapts_where_the_count_may_and_else_keeps_no_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """offline_cpu_defaults: under the defaults the Engine adapts as a service does, starting on every core;
    where something fixes the count it computes on every core (cpu_reserved_cores 0), not every core but one."""
    from services.worker.frontend.engine import offline_cpu_defaults

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    adaptive = offline_cpu_defaults(EngineConfig())
    assert adaptive.adaptive_threads() and adaptive.reserved_cores() == 0
    assert offline_cpu_defaults(EngineConfig(cpu_adaptive_threads=False)).reserved_cores() == 0
    assert offline_cpu_defaults(EngineConfig(cpu_reserved_cores=1)).reserved_cores() == 1  # asked for: kept
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    fixed = offline_cpu_defaults(EngineConfig())
    assert not fixed.adaptive_threads() and fixed.cpu_reserved_cores == 0


def test_the_switch_off_from_the_environment(monkeypatch: pytest.MonkeyPatch, qwen3_path: Path) -> None:
    from services.worker.frontend.service_config import WorkerServiceConfig

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # `make test` sets it, which fixes the count
    env = {"RS_MODEL_PATH": str(qwen3_path), "RS_CPU_ADAPTIVE_THREADS": "0"}
    assert not WorkerServiceConfig.from_args(None, env).engine.adaptive_threads()
    assert WorkerServiceConfig.from_args(None, {"RS_MODEL_PATH": str(qwen3_path)}).engine.adaptive_threads()


def test_adaptive_placement_gives_back_the_first_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's thread takes the last core, so a team cut short leaves free the cores that
    cpu_reserved_cores would keep."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    placement = EngineConfig().compute_placement(0, 1)
    assert (placement.threads, placement.cores) == (4, (3, 2, 1, 0))
    placement.release()
    fixed = EngineConfig(cpu_adaptive_threads=False).compute_placement(0, 1)
    assert (fixed.threads, fixed.cores) == (3, (1, 2, 3))
    fixed.release()


def _resized_in_subprocess(start: int, steps: list[int]) -> list[dict[str, object]]:
    """Pin `start` threads on the process's two last cores (the model's thread on the last), then
    resize_compute_threads to each count of `steps` and run a parallel op; each step's torch count and
    every compute thread's allowed cores as Linux reports them."""
    code = f"""
import json, os, threading, time
import torch
from services.worker.cpu_placement import ComputePlacement, pin_compute_threads, resize_compute_threads
cores = tuple(sorted(os.sched_getaffinity(0))[-2:])[::-1]
team = pin_compute_threads(ComputePlacement({start}, cores[:{start}]))
x = torch.randn(1 << 21)
for threads in {steps!r}:
    team = resize_compute_threads(cores, team, threads)
    for _ in range(20):
        x.mul_(1.0001).exp_().log_()
    allowed = {{}}
    for tid in team:
        status = open(f"/proc/self/task/{{tid}}/status").read()
        allowed[str(tid)] = next(l.split()[1] for l in status.splitlines() if l.startswith("Cpus_allowed_list"))
    print(json.dumps({{"threads": torch.get_num_threads(), "cores": cores, "team": {{str(k): v for k, v in team.items()}},
                      "allowed": allowed, "me": threading.get_native_id()}}))
"""
    return [json.loads(line) for line in python_stdout(code).strip().splitlines()]


@TWO_CORES
def test_a_team_resized_keeps_one_thread_per_core() -> None:
    one, two, one_again, two_again = _resized_in_subprocess(2, [1, 2, 1, 2])
    cores = one["cores"]
    assert isinstance(cores, list)
    for step, threads in ((one, 1), (two, 2), (one_again, 1), (two_again, 2)):
        assert step["threads"] == threads
        # The model's thread: on cores[0] beside a worker, free over the rank's cores alone.
        mine = parse_cpu_list(step["allowed"][str(step["me"])])  # type: ignore[index]
        assert mine == (tuple(sorted(cores)) if threads == 1 else (cores[0],))
    for step in (two, two_again):
        team, allowed = step["team"], step["allowed"]
        assert isinstance(team, dict) and isinstance(allowed, dict)
        assert sorted(team.values()) == sorted(cores)
        assert all(allowed[tid] == str(core) for tid, core in team.items())


@TWO_CORES
def test_a_worker_started_by_a_larger_team_is_pinned_to_the_core_left() -> None:
    """Started on one thread, the pool has no worker: growing to two starts one, which would inherit the
    model thread's core without the re-pinning."""
    (grown,) = _resized_in_subprocess(1, [2])
    team, allowed, cores = grown["team"], grown["allowed"], grown["cores"]
    assert isinstance(team, dict) and isinstance(allowed, dict) and isinstance(cores, list)
    assert sorted(team.values()) == sorted(cores) and len(team) == 2
    assert all(allowed[tid] == str(core) for tid, core in team.items())


@TWO_CORES
def test_the_step_loop_asks_the_controller_between_steps(
    qwen3_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.worker.frontend.engine import Engine

    waits: list[float] = []
    real = AdaptiveThreads.after_step

    def counted(self: AdaptiveThreads, waited_s: float = 0.0) -> None:
        waits.append(waited_s)
        real(self, waited_s)

    monkeypatch.setattr(AdaptiveThreads, "after_step", counted)
    with Engine(str(qwen3_path), cpu_adaptive_threads=True) as engine:
        assert engine.server_info["cpu_threads"] == len(os.sched_getaffinity(0))
        engine.generate("Hello there", {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert len(waits) >= 8  # one call per step at least: a prompt pass and the decode steps
    assert all(w >= 0 for w in waits)


@TWO_CORES
def test_cores_given_back_get_row_helpers_counted_as_the_ranks_own() -> None:
    """Cut to one thread, the rank starts a row helper (kernels/cpu/row_helpers.h) free to run on both of its
    cores, and counts it with its compute threads (else its CPU time would read as a neighbour's load and
    keep the core given back); grown again, the helper ends."""
    code = """
import json, os, threading, time
import torch
from kernels.cpu_matvec import load_matvec, row_helper_busy_ns, row_helper_stats
from services.worker.cpu_placement import ComputePlacement, pin_compute_threads
from services.worker.cpu_threads import adaptive_threads
load_matvec()
cores = tuple(sorted(os.sched_getaffinity(0))[-2:])
team = pin_compute_threads(ComputePlacement(2, cores))
adaptive = adaptive_threads(ComputePlacement(2, cores), team)
out = {}
for threads in (1, 2):
    adaptive._apply(threads, 0.0)  # as a decision does: the helpers' probe starts with them on
    own = sorted(adaptive._read_own())
    helpers = [t for t in own if t not in team and t != threading.get_native_id()]
    allowed = {}
    for tid in helpers:
        status = open(f"/proc/self/task/{tid}/status").read()
        allowed[tid] = next(l.split()[1] for l in status.splitlines() if l.startswith("Cpus_allowed_list"))
    if threads == 1:  # products until the helper has committed a chunk (a busy host may keep it off a core)
        w, x = torch.randn(4096, 256), torch.randn(1, 256)
        deadline = time.monotonic() + 30
        while row_helper_stats()[0] == 0 and time.monotonic() < deadline:
            torch.ops.radixserve_cpu.matvec(x, w)
    work = adaptive._read_work(adaptive._read_own())
    out[threads] = {"helpers": len(helpers), "allowed": sorted(allowed.values()), "stats": row_helper_stats(),
                    "busy_ns": row_helper_busy_ns(), "work_keys": sorted(str(k) for k in work),
                    "helper_tids": [str(t) for t in helpers]}
out["cores"] = cores
print(json.dumps(out))
"""
    result = json.loads(python_stdout(code).strip().splitlines()[-1])
    cores = ",".join(str(c) for c in result["cores"])
    assert result["1"]["helpers"] == 1
    assert result["1"]["allowed"] == [cores] or result["1"]["allowed"] == [f"{result['cores'][0]}-{result['cores'][1]}"]
    assert result["1"]["stats"][0] > 0  # the helper computed chunks of the products
    assert result["1"]["busy_ns"] > 0  # and its time inside them is counted as the rank's work
    # The rank's work: its threads' CPU time and the helpers' time in chunks, not the helpers' CPU time.
    assert "helpers" in result["1"]["work_keys"]
    assert not set(result["1"]["helper_tids"]) & set(result["1"]["work_keys"])
    assert result["2"]["helpers"] == 0
