"""The OpenMP wait governor: spin while the cores are ours, short spin beside a busy neighbour."""
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from pagedbackend.worker.cpu_wait import (ENTER_AT_ONCE, ENTER_DELAY, ENTER_WINDOWS, LEAVE_DELAY,
                                          LEAVE_WINDOWS, MAX_LEAVE_WINDOWS, REENTER_S, WINDOW_S, ParkedTeam,
                                          WaitGovernor, build_governor, governor_for, run_queue_seconds)


class Counter:
    """A run-queue counter and a clock the test moves by hand."""

    def __init__(self):
        self.now, self.delay = 0.0, 0.0

    def advance(self, seconds: float, delay_rate: float) -> None:
        self.now += seconds
        self.delay += seconds * delay_rate


def parked_threads():
    """A park function that holds its calls, as a team would."""
    calls = []
    return calls, lambda threads: calls.append(threads) or threads


def windows(governor, counter, count: int, rate: float) -> None:
    for _ in range(count):
        counter.advance(WINDOW_S, rate)
        governor.poll()


def governed():
    counter, (calls, park) = Counter(), parked_threads()
    return counter, calls, WaitGovernor(park, 2, read_delay=lambda: counter.delay, clock=lambda: counter.now)


def test_governor_enters_short_spin_after_enter_windows_of_contention():
    counter, calls, governor = governed()
    windows(governor, counter, 1, LEAVE_DELAY / 2)
    windows(governor, counter, ENTER_WINDOWS - 1, ENTER_DELAY * 1.5)
    assert not governor.contended
    windows(governor, counter, 1, ENTER_DELAY * 1.5)
    assert governor.contended and calls == [2]
    governor.close()
    assert not governor.contended


def test_one_window_far_above_our_own_load_enters_at_once():
    counter, calls, governor = governed()
    windows(governor, counter, 1, ENTER_AT_ONCE * 1.1)
    assert governor.contended and calls == [2]


def test_one_busy_window_among_quiet_ones_changes_nothing():
    """Our own load has bursts (a burst of arrivals, tokenising): one window
    over the threshold is not a neighbour."""
    counter, calls, governor = governed()
    for _ in range(5):
        windows(governor, counter, ENTER_WINDOWS - 1, (ENTER_DELAY + ENTER_AT_ONCE) / 2)
        windows(governor, counter, 1, (LEAVE_DELAY + ENTER_DELAY) / 2)
    assert not governor.contended and calls == []


def test_governor_decides_once_per_window():
    counter, calls, governor = governed()
    counter.advance(WINDOW_S / 4, 10.0)   # a burst, but the window is not over
    governor.poll()
    assert not governor.contended and calls == []


def test_governor_leaves_only_after_enough_quiet_windows():
    counter, calls, governor = governed()
    windows(governor, counter, ENTER_WINDOWS, 1.0)
    assert governor.contended
    windows(governor, counter, LEAVE_WINDOWS - 1, LEAVE_DELAY / 2)
    assert governor.contended
    windows(governor, counter, 1, (LEAVE_DELAY + ENTER_DELAY) / 2)   # a busy window resets the count
    windows(governor, counter, LEAVE_WINDOWS - 1, LEAVE_DELAY / 2)
    assert governor.contended
    windows(governor, counter, 1, LEAVE_DELAY / 2)
    assert not governor.contended and governor.switches == 2


def test_a_quick_return_to_contention_doubles_the_quiet_windows_needed_to_leave():
    """A neighbour whose short-spin rate reads as quiet would make the governor
    flap (leave, wait a second in the long spin, enter again); each quick
    return doubles the patience, and a long calm resets it."""
    counter, _, governor = governed()
    windows(governor, counter, ENTER_WINDOWS, 1.0)
    needed = []
    for _ in range(3):
        windows(governor, counter, governor.leave_windows, LEAVE_DELAY / 2)
        assert not governor.contended
        windows(governor, counter, ENTER_WINDOWS, 1.0)   # back at once
        assert governor.contended
        needed.append(governor.leave_windows)
    assert needed == [2 * LEAVE_WINDOWS, 4 * LEAVE_WINDOWS, 8 * LEAVE_WINDOWS]
    windows(governor, counter, governor.leave_windows - 1, LEAVE_DELAY / 2)
    assert governor.contended
    windows(governor, counter, 1, LEAVE_DELAY / 2)
    assert not governor.contended
    windows(governor, counter, int(REENTER_S / WINDOW_S) + 1, 0.1)   # a long calm
    windows(governor, counter, ENTER_WINDOWS, 1.0)
    assert governor.contended and governor.leave_windows == LEAVE_WINDOWS
    for _ in range(10):
        windows(governor, counter, governor.leave_windows, 0.0)
        windows(governor, counter, ENTER_WINDOWS, 1.0)
    assert governor.leave_windows == MAX_LEAVE_WINDOWS


def test_governor_without_a_counter_never_switches():
    calls, park = parked_threads()
    clock = iter(range(0, 100)).__next__
    governor = WaitGovernor(park, 2, read_delay=lambda: None, clock=lambda: float(clock()))
    for _ in range(10):
        governor.poll()
    assert not governor.contended and calls == []


needs_governor = pytest.mark.skipif(build_governor(2) is None,
                                    reason="needs GNU OpenMP, schedstat and a C compiler")


@needs_governor
def test_parked_team_holds_real_openmp_threads_until_closed():
    library_governor = build_governor(2)
    before = len(os.listdir("/proc/self/task"))
    team = ParkedTeam(library_governor._park, 3)
    assert team.size == 3
    # the holding thread and its two team threads
    assert len(os.listdir("/proc/self/task")) >= before + 3
    team.close()
    deadline = time.monotonic() + 5
    while len(os.listdir("/proc/self/task")) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(os.listdir("/proc/self/task")) <= before


def test_run_queue_seconds_reads_every_thread():
    first = run_queue_seconds()
    if first is None:
        pytest.skip("this kernel reports no schedstat")
    assert first >= 0.0
    assert run_queue_seconds() >= first
    assert run_queue_seconds("/nonexistent/*/schedstat") is None


def test_governor_only_for_multithreaded_cpu_steps():
    assert governor_for("cuda", 8) is None
    assert governor_for("cpu", 1) is None


@needs_governor
def test_every_engine_in_a_process_shares_one_watching_governor():
    """libgomp's wait is one per process: one governor, one watching thread."""
    first = governor_for("cpu", 2)
    assert first is governor_for("cpu", 2) and first._watcher.is_alive()
    watchers = [t for t in threading.enumerate() if t.name == "pagedbackend-cpu-wait"]
    assert len(watchers) == 1


@needs_governor
@pytest.mark.skipif(len(os.sched_getaffinity(0)) > 4, reason="one busy process contends only on a few cores")
@pytest.mark.serial   # the other tests' processes would be neighbours too
def test_real_neighbour_switches_to_short_spin_and_back():
    """Matmuls on every core of ours beside processes that spin on every core:
    the governor sees our threads wait and switches; without them it switches back."""
    cores = len(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(cores)
    governor = build_governor(cores).watch()
    x = torch.randn(384, 384)

    def work_until(predicate, limit_s: float) -> bool:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            for _ in range(20):
                x @ x
            if predicate():
                return True
        return False

    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        entered = work_until(lambda: governor.contended, 15.0)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    try:
        left = work_until(lambda: not governor.contended, 15.0)
    finally:
        governor.close()
        torch.set_num_threads(threads)
    assert entered, "the governor did not see the busy neighbours"
    assert left, "the governor did not return to the long spin once they were gone"


def test_logs_name_each_switch(caplog):
    counter, (_, park) = Counter(), parked_threads()
    governor = WaitGovernor(park, 2, read_delay=lambda: counter.delay, clock=lambda: counter.now)
    with caplog.at_level("INFO", logger="pagedbackend"):
        windows(governor, counter, ENTER_WINDOWS, 1.0)
        for _ in range(LEAVE_WINDOWS):
            counter.advance(WINDOW_S, 0.0)
            governor.poll()
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "CPU contention" in messages and "spin between regions again" in messages
