"""Servers for tests and benchmarks: a tritonserver on free loopback ports,
started and stopped as a context (the readiness probes are the product's,
``pagedbackend.serving.readiness``)."""
import pathlib
import re
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from typing import Callable, Mapping, Optional, Sequence

from pagedbackend.serving.constants import ADMIN_KEY_ENV, EXIT_TIMEOUT_S
from pagedbackend.serving.readiness import answers_ok, is_model_ready, is_ready, models_not_ready, wait_until  # noqa: F401
from pagedbackend.serving.process import (prepare_backend, server_command, server_env, start_server_process,
                                          stop_process_group)
from pagedbackend.serving.repository import repository_models

# tritonserver's error lines: E, month and day, the time.
ERROR_LINE = re.compile(r"E\d{4} \d\d:\d\d:\d\d")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ServerError(RuntimeError):
    """tritonserver did not start or did not become ready."""


class Started:
    """A server that starts on entering a ``with`` block and stops on leaving it."""

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class TritonServer(Started):
    """A tritonserver process on loopback ports, started and stopped as a context.

        with TritonServer(repo) as server:
            server.grpc_url, server.http_url, server.metrics_url, server.metrics()

    Ports left as None are picked free. The process runs in its own process
    group; stopping sends SIGTERM, then SIGKILL to anything left in the group.
    """

    def __init__(self, model_repository, http_port: Optional[int] = None,
                 grpc_port: Optional[int] = None, metrics_port: Optional[int] = None,
                 host: str = "127.0.0.1", env: Optional[Mapping[str, str]] = None,
                 log_verbose: int = 0, ready_timeout_s: float = 300.0,
                 exit_timeout_s: int = EXIT_TIMEOUT_S, log_path=None, extra_args: Sequence[str] = (),
                 required_models: Optional[Sequence[str]] = None, wait_for_compiled_step: bool = False,
                 api_key: Optional[str] = None):
        """``api_key``: inference, metadata and model configuration need it
        (``security.API_KEY_HEADER``). ``wait_for_compiled_step``: ``start`` returns once every model's
        ``pagedbackend:model_step_compiled`` gauge is 1 (a server is ready
        with eager steps and compiles its step in the background; a benchmark
        measures the compiled one)."""
        self.model_repository = pathlib.Path(model_repository)
        self.wait_for_compiled_step = wait_for_compiled_step
        # Models that must load for start() to succeed; None: every one in the repository.
        self.required_models = required_models
        self.host = host
        self.ports = {"http": http_port, "grpc": grpc_port, "metrics": metrics_port}
        self._bound = dict(self.ports)  # the ports in use once started
        self.env = dict(env or {})
        self.log_verbose = log_verbose
        self.ready_timeout_s = ready_timeout_s
        self.exit_timeout_s = exit_timeout_s
        self.extra_args = list(extra_args)
        self.admin_key = secrets.token_hex(16)   # opens the model repository API (GRPC_ADMIN_HEADER)
        self.api_key = api_key
        self._own_log_dir = None if log_path else tempfile.mkdtemp(prefix="tritonserver-")
        self.log_path = pathlib.Path(log_path or pathlib.Path(self._own_log_dir) / "server.log")
        self.process: Optional[subprocess.Popen] = None

    http_url = property(lambda self: f"http://{self.host}:{self._port('http')}")
    grpc_url = property(lambda self: f"{self.host}:{self._port('grpc')}")
    metrics_url = property(lambda self: f"http://{self.host}:{self._port('metrics')}/metrics")

    def _port(self, kind: str) -> int:
        return self._bound[kind]

    def start(self) -> None:
        prepare_backend()
        auto = [k for k, v in self.ports.items() if v is None]
        for attempt in range(3):  # a picked port can be taken before tritonserver binds it
            self._bound = {k: v if v is not None else free_port(self.host) for k, v in self.ports.items()}
            self._launch()
            try:
                self._wait_ready()
                if self.wait_for_compiled_step:
                    self._wait_compiled()
                return
            except ServerError:
                tail = self.log_tail()
                self.stop()
                if not (auto and "already in use" in tail.lower()) or attempt == 2:
                    raise

    def _launch(self) -> None:
        command = server_command(self.model_repository, self._bound["http"], self._bound["grpc"],
                                 self._bound["metrics"], self.host, self.log_verbose,
                                 self.exit_timeout_s, self.extra_args, admin_key=self.admin_key,
                                 api_key=self.api_key)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        # The model sees the key too: loading adapters at run time needs it (serving/triton/lora.py).
        env = {ADMIN_KEY_ENV: self.admin_key, **self.env}
        self.process = start_server_process(command, server_env(overrides=env),
                                            stdin=subprocess.DEVNULL, stdout=self._log,
                                            stderr=subprocess.STDOUT)

    def _wait_ready(self) -> None:
        self._wait(lambda: is_ready(self.http_url), f"tritonserver not ready after {self.ready_timeout_s:.0f} s",
                   " before it was ready")
        required = repository_models(self.model_repository) if self.required_models is None \
            else list(self.required_models)
        failed = models_not_ready(self.http_url, required)
        if failed:
            raise ServerError(f"model(s) {', '.join(failed)} did not load; log tail:\n{self.log_tail()}"
                              f"{self.log_errors()}")

    def _wait_compiled(self) -> None:
        self._wait(self._step_compiled, "the compiled model step did not take over within "
                   f"{self.ready_timeout_s:.0f} s", poll_s=0.5)

    def _wait(self, probe: Callable[[], bool], timed_out: str, exited: str = "", poll_s: float = 0.2) -> None:
        """``wait_until`` the probe holds; ServerError, with the log's tail, when
        the ready timeout passes first (``timed_out``) or tritonserver exits."""
        try:
            done = wait_until(probe, self.process, self.ready_timeout_s, poll_s=poll_s)
        except TimeoutError:
            raise ServerError(f"{timed_out}; log tail:\n{self.log_tail()}{self.log_errors()}") from None
        if not done:
            raise ServerError(f"tritonserver exited with status {self.process.returncode}{exited}; "
                              f"log tail:\n{self.log_tail()}{self.log_errors()}")

    def _step_compiled(self) -> bool:
        name = "pagedbackend:model_step_compiled{"
        try:
            text = self.metrics()
        except OSError:   # tritonserver starts its metrics service after HTTP: not up yet
            return "the model step runs eager" in self.log_tail()
        values = [line.rsplit(" ", 1)[-1] for line in text.splitlines() if line.startswith(name)]
        if values and all(float(v) == 1.0 for v in values):
            return True
        return "the model step runs eager" in self.log_tail()

    def log_errors(self, limit: int = 4000) -> str:
        """The log's error lines (tritonserver's ``E<date>`` lines, a model's
        Python traceback) wherever they are, after a heading; "" when there
        are none. A model that fails to load is named above the options table
        tritonserver prints next, so the tail alone can miss why."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        picked, in_traceback = [], False
        for line in lines:
            if line.startswith("Traceback (most recent call last)"):
                in_traceback = True
            if in_traceback or ERROR_LINE.match(line):
                picked.append(line)
            if in_traceback and line and not line.startswith((" ", "Traceback")):
                in_traceback = False   # the exception's own line ends it
        text = "\n".join(picked)
        return f"\nerrors in the log:\n{text[-limit:]}" if text else ""

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def metrics(self, timeout: float = 5.0) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=timeout) as reply:
            return reply.read().decode()

    def stop(self, timeout_s: Optional[float] = None) -> Optional[int]:
        """SIGTERM to the process group, wait, then SIGKILL whatever remains of it."""
        process, self.process = self.process, None
        if process is None:
            return None
        if timeout_s is None:  # tritonserver gives up on unloading after exit_timeout_s
            timeout_s = self.exit_timeout_s + 15.0
        stop_process_group(process, timeout_s)
        self._log.close()
        if self._own_log_dir:  # errors raised earlier already carry the log tail
            shutil.rmtree(self._own_log_dir, ignore_errors=True)
        return process.returncode
