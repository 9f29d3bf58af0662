"""A fleet (``python -m pagedbackend.serving.fleet``) for tests and benchmarks,
started and stopped as a context, on free loopback ports."""
import json
import pathlib
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

from loadtest.harness.triton import Started, free_port


def free_port_block(size: int, low: int = 20000, high: int = 32000, tries: int = 200) -> int:
    """A base port with ``size`` free ports above it (checked, not reserved),
    below the ephemeral range and under Dynamo 1.6.1's system-port limit (32767)."""
    rng = random.Random()
    for _ in range(tries):
        base = rng.randrange(low, high - size)
        if all(_free(base + k) for k in range(size)):
            return base
    raise RuntimeError(f"no block of {size} free ports found in [{low}, {high})")


def _free(port: int) -> bool:
    import socket
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


class FleetProcess(Started):
    """``python -m pagedbackend.serving.fleet`` with ``args`` (or ``make fleet``
    in the checkout ``make_in``, its arguments in FLEET_ARGS); ``start`` returns
    once it prints ready. ``state()`` reads its fleet.json (pids and ports)."""

    def __init__(self, replicas: int = 2, args: Sequence[str] = (), ready_timeout_s: float = 900.0,
                 env: Optional[dict] = None, make_in: Optional[pathlib.Path] = None):
        self.replicas, self.extra, self.ready_timeout_s = replicas, list(args), ready_timeout_s
        self.env, self.make_in = env, make_in
        self.work = pathlib.Path(tempfile.mkdtemp(prefix="fleet-test-"))
        self.process: Optional[subprocess.Popen] = None
        self.openai_port = self.base_port = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.openai_port}/v1"

    def start(self) -> None:
        self.openai_port = free_port()
        self.base_port = free_port_block(10 * self.replicas)
        args = ["--work-dir", str(self.work / "fleet"), *self.extra]
        if self.make_in is not None:   # -o: a test never reinstalls the environment or builds the step
            command = ["make", "-s", "-C", str(self.make_in), "-o", ".venv/.installed", "-o", ".venv/.step-built",
                       "fleet",
                       f"REPLICAS={self.replicas}", f"OPENAI_PORT={self.openai_port}",
                       f"FLEET_BASE_PORT={self.base_port}", "FLEET_ARGS=" + " ".join(map(shlex.quote, args))]
        else:
            command = [sys.executable, "-m", "pagedbackend.serving.fleet", "--replicas", str(self.replicas),
                       "--openai-port", str(self.openai_port), "--base-port", str(self.base_port), *args]
        self.log = open(self.work / "fleet.out", "wb")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + self.ready_timeout_s
        while b"ready: " not in (self.work / "fleet.out").read_bytes():
            if self.process.poll() is not None or time.monotonic() > deadline:
                output = self.output() + "".join(f"\n--- {name}:\n{self.log_tail(name, 15)}" for name in
                                                 ["frontend"] + [f"{kind}{i}" for i in range(self.replicas)
                                                                 for kind in ("replica", "worker")])
                self.stop()
                raise RuntimeError(f"the fleet did not become ready:\n{output}")
            time.sleep(0.5)

    def output(self) -> str:
        return (self.work / "fleet.out").read_text(errors="replace")

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.work / "fleet" / "logs" / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def state(self) -> dict:
        return json.loads((self.work / "fleet" / "fleet.json").read_text())

    def stop(self, timeout_s: float = 120.0) -> Optional[int]:
        """SIGTERM (as Ctrl-C would), then SIGKILL to its group if it outlives ``timeout_s``."""
        process, self.process = self.process, None
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        self.log.close()
        shutil.rmtree(self.work, ignore_errors=True)
        return process.returncode
