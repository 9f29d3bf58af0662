"""Readiness of a started tritonserver: HTTP probes and a wait that gives up
when the process exits. The launcher and the fleet use them; so do the test
and benchmark harnesses (loadtest/harness/)."""
import subprocess
import time
import urllib.request
from typing import Callable, Sequence


def answers_ok(url: str, timeout: float = 1.0) -> bool:
    """Whether a GET of ``url`` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status == 200
    except OSError:
        return False


def is_ready(http_url: str, timeout: float = 1.0) -> bool:
    return answers_ok(f"{http_url}/v2/health/ready", timeout)


def is_model_ready(http_url: str, model: str, timeout: float = 1.0) -> bool:
    return answers_ok(f"{http_url}/v2/models/{model}/ready", timeout)


def models_not_ready(http_url: str, names: Sequence[str]) -> list:
    return [name for name in names if not is_model_ready(http_url, name)]


def wait_until(probe: Callable[[], bool], process: subprocess.Popen, timeout_s: float,
               stopping: Callable[[], bool] = lambda: False, poll_s: float = 0.2) -> bool:
    """Poll ``probe`` (e.g. ``is_ready``) until it holds (True), or the process
    exits or ``stopping()`` holds (False); TimeoutError after ``timeout_s``.
    With explicit model control tritonserver is ready before its models load:
    ask ``models_not_ready`` after it."""
    deadline = time.monotonic() + timeout_s
    while process.poll() is None and not stopping():
        if probe():
            return True
        if time.monotonic() > deadline:
            raise TimeoutError(f"not ready after {timeout_s:.0f} s")
        time.sleep(poll_s)
    return False
