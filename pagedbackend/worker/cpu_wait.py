"""How torch's OpenMP threads wait between parallel regions: spin while the
cores are ours, sleep as soon as another process (or thread) wants them.

A CPU step runs hundreds of parallel regions. Between two, libgomp's threads
spin (about 300,000 spins, a few milliseconds, by default), which is the
fastest wait on cores nobody else wants. Beside a busy process the spin is a
disaster: a thread spins on its core while the thread it waits for has been
descheduled, so every region lasts until the scheduler runs that thread again
(a 2-core machine with one busy neighbour: 10-12x slower). Sleeping at once
(``OMP_WAIT_POLICY=PASSIVE``) survives the neighbour but costs a fifth of the
idle speed, and libgomp reads its policy only once, at load.

libgomp has one switch that works while it runs: whenever it manages more
threads than there are CPUs, every team spins only 100 times before sleeping
(its ``GOMP_SPINCOUNT`` documentation). ``WaitGovernor`` uses it: while this
process's threads keep waiting on a run queue (``/proc/self/task/*/schedstat``,
the kernel's count of time runnable but not running), a thread of ours holds a
parked team of idle threads, which tips libgomp into the short spin; once the
waiting stops, the team is let go and the long spin returns. The decision is
taken every ``WINDOW_S`` by a thread of the governor's own, with thresholds
that tell a busy neighbour from our own serving load.
"""
import glob
import logging
import os
import threading
import time
from typing import Callable, Optional

logger = logging.getLogger("pagedbackend")

WINDOW_S = 0.5
# The thresholds are core-seconds our threads waited on a run queue per second
# of wall time, set from the rates measured alone and beside a busy process,
# in each wait mode (BENCHMARKS.md, "contention", keeps the table). Our own
# load (the client, tokenising, Triton's threads) waits too, so the thresholds
# sit between "alone under load" and "beside a busy process".
ENTER_DELAY = 0.6       # above this in ENTER_WINDOWS windows in a row: short spin
ENTER_WINDOWS = 2
ENTER_AT_ONCE = 0.9     # above this in one window: short spin at once (a long-spin step
                        # beside a neighbour can last seconds; our own load never came near)
LEAVE_DELAY = 0.42      # below this for the quiet windows required: long spin again
LEAVE_WINDOWS = 3
# A return to the short spin within REENTER_S of leaving it doubles the quiet
# windows required next time (up to MAX_LEAVE_WINDOWS): a neighbour that makes
# the short-spin rate look quiet cannot make the governor flap.
REENTER_S = 10.0
MAX_LEAVE_WINDOWS = 96

def run_queue_seconds(task_glob: str = "/proc/self/task/*/schedstat") -> Optional[float]:
    """Seconds this process's threads have spent runnable but not running, or
    None where the kernel does not say (no schedstat)."""
    total, seen = 0, False
    for path in glob.glob(task_glob):
        try:
            with open(path) as handle:
                total += int(handle.read().split()[1])
            seen = True
        except (OSError, ValueError, IndexError):
            continue   # a thread that ended meanwhile
    return total / 1e9 if seen else None


def uses_libgomp() -> bool:
    """Whether this process runs GNU OpenMP (torch's CPU wheels do)."""
    try:
        with open("/proc/self/maps") as maps:
            return any("libgomp" in line for line in maps)
    except OSError:
        return False


class ParkedTeam:
    """A thread holding an OpenMP team of ``threads`` idle threads until ``close``."""

    def __init__(self, park: Callable[[int], int], threads: int):
        self._release = threading.Event()
        ready = threading.Event()
        self.size = 0

        def hold():
            self.size = park(threads)
            ready.set()
            self._release.wait()
        self._thread = threading.Thread(target=hold, name="pagedbackend-omp-park", daemon=True)
        self._thread.start()
        ready.wait()

    def close(self) -> None:
        self._release.set()
        self._thread.join()


class WaitGovernor:
    """``watch()`` polls from a thread of its own every ``WINDOW_S`` (tests call
    ``poll()`` themselves); ``contended`` says which wait is in force.
    ``read_delay`` and ``clock`` are the run-queue counter and the time source
    (tests pass their own)."""

    def __init__(self, park: Callable[[int], int], cpus: int,
                 read_delay: Callable[[], Optional[float]] = run_queue_seconds,
                 clock: Callable[[], float] = time.monotonic):
        self._park, self._cpus = park, cpus
        self._read_delay, self._clock = read_delay, clock
        self._team: Optional[ParkedTeam] = None
        self._busy_windows = self._quiet_windows = 0
        self.leave_windows = LEAVE_WINDOWS   # quiet windows needed to leave the short spin
        self._left_at: Optional[float] = None
        self.switches = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher: Optional[threading.Thread] = None
        self._start, self._delay = clock(), read_delay()

    def watch(self) -> "WaitGovernor":
        """Poll every window from a daemon thread until ``close``. A thread of
        its own sees a neighbour arrive within a window or two, even in the
        middle of a step that the long spin beside it stretches to seconds,
        and windows never span the engine's idle time."""
        def loop():
            while not self._stop.wait(WINDOW_S):
                self.poll()
        self._watcher = threading.Thread(target=loop, name="pagedbackend-cpu-wait", daemon=True)
        self._watcher.start()
        return self

    @property
    def contended(self) -> bool:
        return self._team is not None

    def poll(self) -> None:
        with self._lock:
            self._poll()

    def _poll(self) -> None:
        now = self._clock()
        if now - self._start < WINDOW_S:
            return
        delay = self._read_delay()
        if delay is None or self._delay is None:
            self._start, self._delay = now, delay
            return
        rate = (delay - self._delay) / (now - self._start)
        self._start, self._delay = now, delay
        if self._team is None:
            self._busy_windows = self._busy_windows + 1 if rate > ENTER_DELAY else 0
            if self._busy_windows >= ENTER_WINDOWS or rate > ENTER_AT_ONCE:
                self._enter(now, rate)
            return
        self._quiet_windows = self._quiet_windows + 1 if rate < LEAVE_DELAY else 0
        if self._quiet_windows >= self.leave_windows:
            self._team.close()
            self._team = None
            self._left_at = now
            self.switches += 1
            logger.info("pagedbackend: CPU contention over: OpenMP threads spin between regions again")

    def _enter(self, now: float, rate: float) -> None:
        if self._left_at is not None and now - self._left_at < REENTER_S:
            self.leave_windows = min(2 * self.leave_windows, MAX_LEAVE_WINDOWS)
        elif self._left_at is not None:
            self.leave_windows = LEAVE_WINDOWS
        self._team = ParkedTeam(self._park, self._cpus)
        self._busy_windows = self._quiet_windows = 0
        self.switches += 1
        logger.info("pagedbackend: CPU contention (threads waited %.2f s/s for a core): "
                    "OpenMP threads now sleep between regions", rate)

    def close(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join()
        with self._lock:
            if self._team is not None:
                self._team.close()
                self._team = None


_shared: Optional[WaitGovernor] = None
_shared_lock = threading.Lock()


def governor_for(device_type: str, torch_threads: int) -> Optional[WaitGovernor]:
    """The process's governor for a CPU step with more than one thread under
    libgomp, watching from its thread, or None (with a log line saying why,
    where it could have helped). libgomp's wait is one per process, so every
    engine in a process shares one governor."""
    global _shared
    if device_type != "cpu" or torch_threads < 2:
        return None
    with _shared_lock:
        if _shared is None:
            _shared = build_governor(torch_threads)
            if _shared is not None:
                _shared.watch()
        return _shared


def build_governor(torch_threads: int) -> Optional[WaitGovernor]:
    """A new governor (not watching) for ``torch_threads`` threads, or None
    where this process cannot have one (the log says why)."""
    if not uses_libgomp():
        logger.info("pagedbackend: no contention governor: this torch does not use GNU OpenMP")
        return None
    if run_queue_seconds() is None:
        logger.info("pagedbackend: no contention governor: the kernel reports no schedstat")
        return None
    from pagedbackend.kernels import native
    try:
        library = native.load("omp_park")
    except RuntimeError as exc:
        logger.info("pagedbackend: no contention governor: %s", exc)
        return None
    park = library.omp_park_team
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return WaitGovernor(park, max(cpus, torch_threads))
