"""How many of its cores a CPU rank computes on, chosen between steps from the CPU time others take there.

A team of OpenMP threads waits at every barrier for its slowest thread, so when another process takes a
core from one of them the whole step waits: on 2 vCPUs with two busy neighbour processes, two compute
threads served 60 tok/s where one served 130. Keeping a core back for good avoids that but costs a
third of the speed on a quiet host (143 tok/s against 201). So under cpu_bind 'auto' a rank starts on
all of its cores and, every `interval_s` of stepping, reads the foreign load of its cores: the CPU time
they gave to anything but its compute threads (/proc/stat less /proc/self/task/*/stat), in cores. That
counts the host's other processes and also this deployment's gateway, tokenizer, detokenizer, NATS and
the worker's own event loop, whose work grows with ours; the thresholds sit above what those take while
the rank serves at full speed on a quiet host (measured in docs/ARCHITECTURE.md).

With `given` the cores already given back (its cores less its threads), the rank
  - gives cores back (threads fewer) when the foreign load exceeds `given + shrink_above` in
    `shrink_windows` windows running: as many as the load needs, ceil(load - shrink_above) in all;
  - takes one back when the load would fit in one core fewer with room, under `given - 1 + grow_below`,
    in `grow_windows` windows running: slower to come back than to leave, so a neighbour that pauses
    for a moment does not bring the stall back.
A window is only taken while the rank steps: one that spans a wait for work is dropped, since an idle
rank's cores say nothing about what a step would meet (on the benchmark host the next engine's turn).

The cores given back still serve the products through row helpers (start_row_helpers), which a product
never waits for; their CPU time is counted as the rank's, not as foreign load. They help only where they get
CPU time the model's thread would not have had: beside neighbours in the rank's own scheduling group (an
autogroup, a cgroup) they add the cores' share that the neighbours would have taken, but where the
neighbours sit in a group of their own the kernel gives the rank's group the same share with or without
them and a helper's time comes out of the model's thread (SmolLM2 served beside two busy loops of another
session: decode 34.5 tok/s without helpers, 28.1 with). So a rank that gives cores back probes: the
helpers run for `helper_probe_windows` windows, then none for as many, and they stay on only where the
rank's work (its threads' CPU time and the helpers' time inside their chunks, in cores) was at least as
high with them (`helper_gain` higher: 0 by default); the verdict holds for `helper_hold_windows` windows of stepping, then the probe runs
again. A helper's CPU time is not its work: between products it spins before it sleeps, and beside
neighbours in the rank's own group a helper that spins while the model's thread is preempted takes a share
that thread would have had, so its CPU time always reads as a gain there (four threads of one group on 2
cores: the model's 0.5 core and the helper's 0.5 against 0.67 alone) where its work may not be. Measured on a
Zen 5 guest beside two busy loops of the rank's group (bench/cpu_row_helpers.py): the rank's CPU time 0.92-1.09
core with a helper against 0.68-0.71 without, its work 0.72-0.78 against 0.63-0.65, batch-1 decode about
the same either way (35-38 tok/s). Where the work is even, helpers stay: the probe times whatever the rank
runs then, and a batch's products (panels.cpp's, long chunks) gain more from a helper than single rows do;
with a 0.1-core bar a probe over batch-1 decode stopped them and the batch-16 and prompt-pass calls after it
ran 10-25 % slower on one thread (bench/peers_cpu.py beside two busy loops, `peers_cpu_2026-12-07_15` against
`_16` and `_17`). RS_CPU_ROW_HELPERS=always keeps them on without probing (a deployment whose neighbours share
its group), 0 starts none.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from services.worker.cpu_placement import ComputePlacement, resize_compute_threads

logger = logging.getLogger(__name__)

PROC_STAT = Path("/proc/stat")
TASK_DIR = Path("/proc/self/task")
# /proc/stat's per-core columns counted as busy: user, nice, system, irq, softirq, steal (a hypervisor
# running another guest stalls a thread of ours just as a neighbour does). Idle and iowait are not.
BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)


def read_busy_ticks(cores: tuple[int, ...], stat: Path = PROC_STAT) -> int:
    """Clock ticks the cores `cores` have spent busy since boot, all processes together."""
    wanted = {f"cpu{core}" for core in cores}
    total = 0
    for line in stat.read_text().splitlines():
        label, _, rest = line.partition(" ")
        if label in wanted:
            columns = rest.split()
            total += sum(int(columns[i]) for i in BUSY_COLUMNS if i < len(columns))
    return total


def read_thread_ticks(tids: tuple[int, ...], task_dir: Path = TASK_DIR) -> dict[int, int]:
    """{thread id: user + system clock ticks} of those threads of this process still alive."""
    ticks: dict[int, int] = {}
    for tid in tids:
        try:
            text = (task_dir / str(tid) / "stat").read_text()
        except OSError:
            continue
        fields = text.rpartition(")")[2].split()  # after the command name, which may hold spaces
        ticks[tid] = int(fields[11]) + int(fields[12])
    return ticks


@dataclass(frozen=True)
class AdaptivePolicy:
    """When a rank gives a core back and takes it again (the module's docstring says how they act)."""

    interval_s: float = 0.25
    shrink_above: float = 0.5
    grow_below: float = 0.35
    shrink_windows: int = 2
    grow_windows: int = 4
    helper_probe_windows: int = 4
    helper_hold_windows: int = 120
    helper_gain: float = 0.0
    helper_probe: bool = True  # False: helpers on whenever cores are given back (RS_CPU_ROW_HELPERS=always)

    def __post_init__(self) -> None:
        counts = (self.shrink_windows, self.grow_windows, self.helper_probe_windows, self.helper_hold_windows)
        if self.interval_s <= 0 or min(counts) < 1:
            raise ValueError(f"interval_s must be > 0 and the window counts >= 1, got {self}")
        if self.helper_gain < 0:
            raise ValueError(f"helper_gain must be >= 0, got {self}")
        if not 0 <= self.grow_below <= self.shrink_above:
            raise ValueError(
                f"need 0 <= grow_below <= shrink_above (else a rank would give and take a core in turn), got {self}"
            )


class AdaptiveThreads:
    """A rank's compute thread count between 1 and `most`, moved by the foreign load of its cores.

    The readers and the clock are passed in (the tests drive it with made-up readings): `read_busy`
    gives the busy ticks of the rank's cores, `read_own` the ticks of each of its compute threads (a
    thread gone since the last reading, as libgomp ends the workers a smaller team leaves out, is
    simply not counted, and the row helpers' ticks with them), `set_threads` applies a new count,
    `set_helpers` (None: the rank has none) starts that many row helpers, ending those before, and
    `read_work` (None: read_own's reading itself) the ticks of the rank's work from read_own's reading (no
    second read of /proc): its compute threads' CPU time and the row helpers' time inside their chunks, keyed
    like that reading, which the helpers' probe compares."""

    def __init__(
        self,
        most: int,
        set_threads: Callable[[int], None],
        read_busy: Callable[[], int],
        read_own: Callable[[], Mapping[int, int]],
        policy: AdaptivePolicy | None = None,
        ticks_per_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        set_helpers: Callable[[int], None] | None = None,
        read_work: Callable[[Mapping[int, int]], Mapping[object, int]] | None = None,
    ) -> None:
        if most < 1:
            raise ValueError(f"most must be >= 1, got {most}")
        self.most = most
        self.threads = most
        self.helpers = 0
        self.policy = policy or AdaptivePolicy()
        self.foreign: float | None = None  # the last window's foreign load, in cores
        self.own: float | None = None  # the last window's CPU time of its threads and helpers, in cores
        self.work: float | None = None  # the last window's work (read_work), in cores
        self._set_threads, self._read_busy, self._read_own = set_threads, read_busy, read_own
        self._read_work = read_work or (lambda own: own)
        self._set_helpers = set_helpers
        # The helpers' probe: "on" or "off" while it times each side, "hold" while its verdict stands.
        self._probe: str | None = None
        self._probe_own: dict[str, list[float]] = {"on": [], "off": []}
        self._hold_left = 0
        self._ticks_per_s = ticks_per_s or float(os.sysconf("SC_CLK_TCK"))
        self._clock = clock
        self._over = self._under = 0
        self._restart()

    def _restart(self) -> None:
        self._t0 = self._clock()
        self._busy0 = self._read_busy()
        self._own0 = dict(self._read_own())
        self._work0 = dict(self._read_work(self._own0))

    def after_step(self, waited_s: float = 0.0) -> None:
        """Call between steps, from the thread that runs the model; `waited_s`: how long the loop waited
        for work before this step. Cheap unless a window has ended."""
        if waited_s >= self.policy.interval_s:
            self._over = self._under = 0
            self._restart()
            return
        now = self._clock()
        if now - self._t0 < self.policy.interval_s:
            return
        busy, own = self._read_busy(), dict(self._read_own())
        work = dict(self._read_work(own))
        mine = sum(own[tid] - self._own0[tid] for tid in own.keys() & self._own0.keys())
        done = sum(work[key] - self._work0[key] for key in work.keys() & self._work0.keys())
        self.foreign = max(0.0, (busy - self._busy0 - mine) / self._ticks_per_s / (now - self._t0))
        self.own = mine / self._ticks_per_s / (now - self._t0)
        self.work = done / self._ticks_per_s / (now - self._t0)
        self._t0, self._busy0, self._own0, self._work0 = now, busy, own, work
        threads = self.threads
        self._decide(self.foreign)
        if self.threads == threads and self._probe is not None:
            self._probe_window(self.work)

    def _decide(self, foreign: float) -> None:
        policy, given = self.policy, self.most - self.threads
        self._over = self._over + 1 if self.threads > 1 and foreign > given + policy.shrink_above else 0
        self._under = self._under + 1 if given > 0 and foreign < given - 1 + policy.grow_below else 0
        if self._over >= policy.shrink_windows:
            needed = math.ceil(foreign - policy.shrink_above)
            self._apply(max(1, min(self.threads - 1, self.most - needed)), foreign)
        elif self._under >= policy.grow_windows:
            self._apply(self.threads + 1, foreign)

    def _apply(self, threads: int, foreign: float) -> None:
        logger.info(
            "CPU compute threads %d -> %d of %d: the other processes took %.2f core(s) of this rank's cores",
            self.threads,
            threads,
            self.most,
            foreign,
        )
        self._set_threads(threads)
        self.threads = threads
        self._over = self._under = 0
        if self._set_helpers is not None:
            if threads < self.most and self.policy.helper_probe:
                self._start_probe()
            elif threads < self.most:
                self._switch_helpers(self.most - threads)
                self._probe = None
            else:
                self._switch_helpers(0)
                self._probe = None
        self._restart()

    def _switch_helpers(self, count: int) -> None:
        if count != self.helpers and self._set_helpers is not None:
            self._set_helpers(count)
            self.helpers = count
            self._restart()  # the window's thread ids change with the helpers

    def _start_probe(self) -> None:
        self._probe = "on"
        self._probe_own = {"on": [], "off": []}
        self._switch_helpers(self.most - self.threads)

    def _probe_window(self, work: float) -> None:
        """One window of stepping at an unchanged thread count: the probe's reading, or the hold's count."""
        if self._probe == "hold":
            self._hold_left -= 1
            if self._hold_left <= 0:
                self._start_probe()
            return
        side = self._probe
        assert side in ("on", "off")
        self._probe_own[side].append(work)
        if len(self._probe_own[side]) < self.policy.helper_probe_windows:
            return
        if side == "on":
            self._probe = "off"
            self._switch_helpers(0)
            return
        with_helpers, without = (statistics.median(self._probe_own[k]) for k in ("on", "off"))
        keep = with_helpers >= without + self.policy.helper_gain
        logger.info(
            "CPU row helpers %s: the rank's work took %.2f core(s) with them and %.2f without",
            "kept" if keep else "stopped",
            with_helpers,
            without,
        )
        self._switch_helpers(self.most - self.threads if keep else 0)
        self._probe = "hold"
        self._hold_left = self.policy.helper_hold_windows


def adaptive_threads(placement: ComputePlacement, pinned: dict[int, int]) -> AdaptiveThreads:
    """The AdaptiveThreads of a pinned placement (pin_compute_threads' result `pinned`), reading /proc."""
    if placement.cores is None or len(pinned) != placement.threads:
        raise ValueError("adaptive threads need every compute thread pinned to a core of its own")
    cores = placement.cores[: placement.threads]
    team = dict(pinned)
    helpers: list[int] = []

    def set_threads(threads: int) -> None:
        live = resize_compute_threads(cores, team, threads)
        team.clear()
        team.update(live)

    def set_helpers(count: int) -> None:
        helpers[:] = start_row_helpers(cores, count)

    from kernels.cpu_matvec import ROW_HELPERS_ENV, row_helper_busy_ns

    ticks_per_ns = os.sysconf("SC_CLK_TCK") / 1e9

    def read_work(own: Mapping[int, int]) -> dict[object, int]:
        # The team's CPU time (read_own's reading of it), and the helpers' time in their chunks (one counter).
        helpers_ticks = int(row_helper_busy_ns() * ticks_per_ns)
        return {**{tid: ticks for tid, ticks in own.items() if tid in team}, "helpers": helpers_ticks}

    helpers_env = os.environ.get(ROW_HELPERS_ENV, "1")
    return AdaptiveThreads(
        placement.threads,
        set_threads,
        read_busy=lambda: read_busy_ticks(cores),
        read_own=lambda: read_thread_ticks((*team, *helpers)),
        policy=AdaptivePolicy(helper_probe=helpers_env != "always"),
        set_helpers=None if helpers_env == "0" else set_helpers,
        read_work=read_work,
    )


def start_row_helpers(cores: tuple[int, ...], count: int) -> list[int]:
    """`count` row helpers for the single-row products (kernels/cpu/row_helpers.h) on the cores a rank gave
    back, free to run on any of `cores`; returns their thread ids (none where the C++ products are not
    loaded). A team cut to fewer threads waits at each barrier only for its own; the helpers take whatever
    share of the given-back cores the kernel grants them and never make a product wait, so the batch-1
    products, most of such a step, still use those cores (SmolLM2 on 2 vCPUs beside two busy loops: a pass
    over the weights 56-60 ms with one helper against 52-92 without, bench/HISTORY.md, thirty-eighth
    session). Their CPU time is the rank's own: the caller counts them with its compute threads."""
    from kernels.cpu_matvec import set_row_helpers

    tids = set_row_helpers(count)
    if hasattr(os, "sched_setaffinity"):
        for tid in tids:
            try:
                os.sched_setaffinity(tid, set(cores))
            except OSError:  # a helper that has already ended keeps no mask to set
                pass
    return tids
