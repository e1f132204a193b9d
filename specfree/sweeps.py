"""Sharing one machine's cores between the jobs of a local parallel multirun.

Hydra's joblib launcher (``-m hydra/launcher=joblib hydra.launcher.n_jobs=N``) runs N jobs of a
sweep at once, each in its own worker process. Left alone, every worker's torch starts one
thread per core: N workers then run N times as many threads as there are cores, slow each other
down, and their tokens/s mean nothing. So each job gets an equal share instead: ``threads`` is
set to cores // N and, on Linux, the worker is pinned to its own disjoint set of cores. An
explicit ``threads=`` from the user wins (then nothing is changed). Other launchers (the basic
one, submitit on a cluster, where every job has its own allocation) are left alone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["CoreShares", "available_cpus", "parallel_workers"]


def available_cpus() -> list[int]:
    """The cores this process may run on (taskset and cpusets respected where the OS says)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def parallel_workers(launcher: Mapping[str, Any] | None, jobs: int, cores: int) -> int:
    """How many of a sweep's ``jobs`` the launcher runs at once as processes on this machine:
    the joblib launcher's ``n_jobs`` (negative counts back from the cores, as joblib does:
    -1 is one per core); 1 for launchers without ``n_jobs``."""
    n_jobs = launcher.get("n_jobs") if launcher is not None else None
    if n_jobs is None:
        return 1
    n_jobs = int(n_jobs)
    if n_jobs < 0:
        n_jobs = cores + 1 + n_jobs
    return max(1, min(n_jobs, jobs))


class CoreShares:
    """The cores of the launching process, split evenly between the jobs that run at once.

    Made where the sweep is launched (which knows the sweep's size and the cores it may use) and
    carried into every job with the task function. A running job holds its share by locking the
    share's file in a folder that lives as long as this object is entered: job numbers cannot
    tell which shares are free, because the launcher hands the next job to whichever worker
    finishes first.
    """

    def __init__(self, jobs: int):
        self.jobs = jobs
        self.cpus = available_cpus()
        self.folder: str | None = None

    def __enter__(self) -> Self:
        if self.jobs > 1:
            self.folder = tempfile.mkdtemp(prefix="specfree-cores-")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    @contextlib.contextmanager
    def claim(self, cfg: Any) -> Iterator[None]:
        """Run one job of the sweep on its share: ``cfg.threads`` set to the share's size (so the
        job applies it and records it) and, on Linux, every thread of the process on its cores."""
        from hydra.core.hydra_config import HydraConfig

        launcher = HydraConfig.get().launcher if HydraConfig.initialized() else None
        workers = parallel_workers(launcher, self.jobs, len(self.cpus))
        if workers <= 1 or cfg.threads is not None:
            yield
            return
        size = max(1, len(self.cpus) // workers)
        cfg.threads = size
        share, lock = _lock_free_share(self.folder, workers) if hasattr(os, "sched_setaffinity") else (None, None)
        if share is None:  # no pinning on this OS: the threads are shared out all the same
            yield
            return
        try:
            _pin(self.cpus[share * size:(share + 1) * size] or [self.cpus[share % len(self.cpus)]])
            yield
        finally:
            _pin(self.cpus)  # the worker process may run another job next
            lock.close()  # releases the share


def _lock_free_share(folder: str | None, shares: int):
    """The first share no other running job holds, and the open file whose lock holds it."""
    import fcntl  # POSIX; only called where sched_setaffinity exists (Linux)

    if folder is None:
        return None, None
    for share in range(shares):
        handle = open(Path(folder) / f"{share}.lock", "a")  # noqa: SIM115 - held until the job ends
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            continue
        return share, handle
    return None, None


def _pin(cpus: Sequence[int]) -> None:
    """Every thread of this process onto ``cpus``: sched_setaffinity(0) moves only the calling
    thread, and torch's pool threads from an earlier job in this worker would stay where they were."""
    tasks = Path("/proc/self/task")
    for tid in [int(t) for t in os.listdir(tasks)] if tasks.is_dir() else [0]:
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, cpus)
