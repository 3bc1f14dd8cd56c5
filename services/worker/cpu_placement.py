"""Where a CPU rank computes: how many threads, on which cores, each pinned to its own.

Done the way vLLM's CPU build and llama.cpp do it. The usable cores are this process's affinity mask,
cut to the cgroup's CPU quota where one is set (a container limited to 2 CPUs on a 64-core host must
not start 63 threads: the quota throttles them all at once). With a fixed count (cpu_reserved_cores set,
or cpu_adaptive_threads off) one core stays to the event loop, the other services and the host (vLLM
keeps one for its front end), unless only one is usable; an adaptive rank takes them all and gives cores
back at run time while others want them (cpu_threads.py, through resize_compute_threads here). The cores
are split among the node's ranks, and each rank pins its compute threads one to a core: the thread that
runs the model to the first of its cores, every OpenMP worker of its pool to the next.

Why pin: an unpinned team of OpenMP threads migrates, and a step waits for its slowest thread at every
barrier; one thread per core of a fixed set keeps each thread's cache and keeps the threads off the
reserved core, where the services run. How it degrades: a restricted affinity (taskset, a cpuset) or a
quota shrinks the team to what is there, never beyond it; with one usable core the single compute thread
shares it with everything else rather than waiting on a second thread that cannot run; a team the
adaptive count (cpu_threads.py) cut to one thread under contention runs that thread unpinned over the
rank's cores, where the kernel gives it a fairer share than the one core it would split with a neighbour.
Under 'auto' a rank claims its cores (an flock on a file per core under $RS_CPU_CLAIMS_DIR, default
/dev/shm/radixserve-cpu, released when the rank ends or its process dies): a second worker, Engine or test
process on the host takes the cores left unclaimed, or runs unpinned where none are, instead of stacking
its threads on the first one's cores.

`cpu_bind` (EngineConfig) picks the placement: "auto" (the above), "none" (threads chosen as above,
placement left to the OS) or a core list such as "1-3,6" (those cores, one thread each).
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
CLAIMS_DIR_ENV = "RS_CPU_CLAIMS_DIR"
BIND_AUTO, BIND_NONE = "auto", "none"


def parse_cpu_list(spec: str) -> tuple[int, ...]:
    """'0-3,6' -> (0, 1, 2, 3, 6): Linux's cpu-list syntax (taskset -c, cpuset.cpus), sorted, no repeats."""
    cores: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"cpu_bind must be 'auto', 'none' or a core list such as '1-3,6', got {spec!r}")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"cpu_bind range {part!r} runs backwards (write {last}-{first})")
        cores.update(range(first, last + 1))
    return tuple(sorted(cores))


def check_cpu_bind(spec: str) -> None:
    """Raise ValueError unless `spec` is 'auto', 'none' or a well-formed core list."""
    if spec not in (BIND_AUTO, BIND_NONE):
        parse_cpu_list(spec)


def cgroup_cpu_quota(path: Path = CGROUP_CPU_MAX) -> float | None:
    """CPUs the cgroup (v2) lets this process use, e.g. 2.5 for '250000 100000'; None without a limit."""
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return int(quota) / int(period)


def usable_cores(quota_path: Path = CGROUP_CPU_MAX) -> tuple[int, ...]:
    """The cores this process may run on (its affinity mask), the first ceil(quota) of them under a
    cgroup CPU quota."""
    if hasattr(os, "sched_getaffinity"):
        cores = tuple(sorted(os.sched_getaffinity(0)))
    else:
        cores = tuple(range(os.cpu_count() or 1))
    quota = cgroup_cpu_quota(quota_path)
    if quota is not None:
        cores = cores[: max(1, math.ceil(quota))]
    return cores


def default_compute_threads(usable: int, ranks_per_node: int = 1, reserved: int = 1) -> int:
    """Every usable core but `reserved` (kept for the services and the host; none kept when no more
    are usable), shared among the node's ranks; at least one each."""
    spare = usable - reserved if usable > reserved else usable
    return max(1, spare // max(1, ranks_per_node))


@dataclass(frozen=True)
class ComputePlacement:
    """A rank's compute threads and the cores they are pinned to (None: placement left to the OS).
    `claims`: the open, locked claim files of 'auto' cores (release() closes them)."""

    threads: int
    cores: tuple[int, ...] | None
    claims: tuple[int, ...] = field(default=(), compare=False)

    def release(self) -> None:
        for fd in self.claims:
            os.close(fd)


def _claims_dir() -> Path:
    return Path(os.environ.get(CLAIMS_DIR_ENV) or "/dev/shm/radixserve-cpu")


def claim_cores(cores: tuple[int, ...], wanted: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Up to `wanted` of `cores`, taken from the end, that no other rank on the host holds: (cores, fds of
    their held claim files). A core whose claim file cannot be made or locked is skipped."""
    directory = _claims_dir()
    try:
        directory.mkdir(mode=0o777, parents=True, exist_ok=True)
    except OSError:
        return (), ()
    taken: list[int] = []
    fds: list[int] = []
    for core in reversed(cores):
        if len(taken) == wanted:
            break
        try:
            fd = os.open(directory / f"core-{core}", os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        taken.append(core)
        fds.append(fd)
    return tuple(reversed(taken)), tuple(reversed(fds))


def plan_placement(
    threads: int,
    bind: str,
    usable: tuple[int, ...],
    local_rank: int = 0,
    ranks_per_node: int = 1,
    reserved: int = 1,
) -> ComputePlacement:
    """The placement of `threads` compute threads of local rank `local_rank` under `bind`.

    'auto': the rank's share of the usable cores after the first `reserved` (kept), one thread per core, the
    cores counted from the end and claimed (claim_cores); fewer threads when fewer cores are there or
    free. A core list: those cores (each must be usable), the rank's share of them when several ranks
    run on the node, unclaimed (the user placed them)."""
    if bind == BIND_NONE:
        return ComputePlacement(threads, None)
    if bind == BIND_AUTO:
        pool = usable[reserved:] if len(usable) > reserved else usable
    else:
        pool = parse_cpu_list(bind)
        outside = sorted(set(pool) - set(usable))
        if outside:
            raise ValueError(
                f"cpu_bind {bind!r} names cores {outside} this process may not run on (usable: {list(usable)})"
            )
    share = len(pool) // max(1, ranks_per_node)
    if share == 0:
        # More ranks than cores to pin them to: the OS shares the cores out.
        return ComputePlacement(threads, None)
    mine = pool[local_rank * share : (local_rank + 1) * share]
    if bind != BIND_AUTO:
        return ComputePlacement(len(mine), mine)
    cores, claims = claim_cores(mine, min(threads, len(mine)))
    if not cores:
        logger.info(
            "every core of %s is claimed by another rank on this host: placement left to the OS", mine
        )
        return ComputePlacement(threads, None)
    if len(cores) < min(threads, len(mine)):
        logger.info("cores %s of %s are free of other ranks: %d compute thread(s)", cores, mine, len(cores))
    return ComputePlacement(len(cores), cores, claims)


def _task_ids() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def pin_compute_threads(placement: ComputePlacement) -> dict[int, int]:
    """Give torch `placement.threads` intra-op threads and pin them: the calling thread (the one that
    runs the model) to the first core, each OpenMP worker its pool starts to the next. Call it from
    that thread before it runs any parallel torch op. Returns {thread id: core} of what it pinned
    (empty when placement.cores is None)."""
    import torch

    torch.set_num_threads(placement.threads)
    if placement.cores is None or not hasattr(os, "sched_setaffinity"):
        return {}
    cores = placement.cores
    me = threading.get_native_id()
    # Workers inherit the mask of the thread that starts them: the whole set first, so even a worker
    # not told apart below stays on the rank's cores.
    os.sched_setaffinity(0, set(cores))
    before = _task_ids()
    # A parallel op large enough to run on every thread starts this thread's OpenMP pool.
    torch.ones(1 << 20).add_(1.0)
    workers = sorted(_task_ids() - before)
    pinned = {me: cores[0]}
    os.sched_setaffinity(0, {cores[0]})
    if len(workers) == placement.threads - 1:
        for tid, core in zip(workers, cores[1:]):
            os.sched_setaffinity(tid, {core})
            pinned[tid] = core
    elif workers:
        logger.warning(
            "%d new threads where %d OpenMP workers were expected: they keep cores %s",
            len(workers),
            placement.threads - 1,
            list(cores),
        )
    return pinned


def _place_model_thread(cores: tuple[int, ...], threads: int) -> None:
    """The model's thread on cores[0], or, computing alone on a rank that gave cores back, free to run on
    any of them: with no barrier partner pinning buys it only its cache, and beside other busy processes
    a pinned thread keeps half of the one core it shares with one of them, where the kernel's wake-up
    placement gives an unpinned one more (SmolLM2 batch 1 on 2 vCPUs beside two busy loops, 3 x 4 runs
    alternating: 31-38 tok/s pinned, 36-42 free)."""
    os.sched_setaffinity(0, set(cores) if threads == 1 and len(cores) > 1 else {cores[0]})


def resize_compute_threads(cores: tuple[int, ...], pinned: dict[int, int], threads: int) -> dict[int, int]:
    """Compute on the first `threads` of `cores` (pinned as pin_compute_threads left them, `pinned`
    what it or an earlier resize returned): torch's count set, and any OpenMP worker started for it pinned.
    Call it from the model's thread, which keeps cores[0] (or, at one thread of several cores, any of
    them: _place_model_thread). libgomp reuses its pool in order and ends the workers a smaller team
    leaves out, so the workers still alive keep their cores, and the ones a larger team starts, which
    inherit this thread's one-core mask, get the cores left. Returns the live {thread id: core}."""
    import torch

    if not 1 <= threads <= len(cores):
        raise ValueError(f"threads must be in [1, {len(cores)}] (the placement's cores), got {threads}")
    torch.set_num_threads(threads)
    alive = _task_ids()
    kept = {tid: core for tid, core in pinned.items() if tid in alive}
    wanted = [core for core in cores[1:threads] if core not in kept.values()]
    if not hasattr(os, "sched_setaffinity"):
        return kept
    if not wanted:
        _place_model_thread(cores, threads)
        return kept
    os.sched_setaffinity(0, set(cores[:threads]))
    before = _task_ids()
    torch.ones(1 << 20).add_(1.0)
    workers = sorted(_task_ids() - before)
    os.sched_setaffinity(0, {cores[0]})
    if len(workers) != len(wanted):
        logger.warning(
            "%d new threads where %d OpenMP workers were expected: they keep cores %s",
            len(workers),
            len(wanted),
            list(cores[:threads]),
        )
        return kept
    for tid, core in zip(workers, wanted):
        os.sched_setaffinity(tid, {core})
        kept[tid] = core
    return kept
