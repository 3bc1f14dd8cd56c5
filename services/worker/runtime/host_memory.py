"""The host's available memory, which sizes a CPU worker's pools (ModelRunner takes a share of it)."""

from __future__ import annotations

import os


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo; where that cannot be read, free pages x page size."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
