"""How many CPUs this process may use, for the intra-op threads of each local rank.

`os.cpu_count()` is the machine's count. A job rarely owns the machine: SLURM's
`--cpus-per-task`, `taskset`, `numactl --physcpubind` and a container's cpuset all restrict the
process's affinity mask instead, and sizing OMP_NUM_THREADS from the machine's count then gives
each rank more threads than it has cores — they time-slice, and one descheduled thread stalls
every reduction that waits for it. The mask is what the scheduler honours, so that is what counts here
(a CPU quota, `docker --cpus`, is not a mask and is not seen).
"""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """CPUs in this process's affinity mask (the machine's count where the OS has no masks)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS, Windows: no affinity API
        return max(1, os.cpu_count() or 1)


def threads_per_rank(nproc: int) -> int:
    """Intra-op threads for each of `nproc` local ranks sharing this process's CPUs (at least 1)."""
    return max(1, usable_cpus() // max(1, nproc))
