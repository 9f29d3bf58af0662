"""The OpenAI server as a child process on a loopback port, for tests and benchmarks."""
import os
import subprocess
import sys
import tempfile
from typing import Mapping, Optional

from loadtest.harness.triton import Started, answers_ok, free_port, wait_until


class OpenAIServer(Started):
    """``python -m pagedbackend.serving.openai_server`` as a child process on a
    loopback port, started and stopped as a context (tests, benchmarks).

        with OpenAIServer(triton.grpc_url, tokenizer=folder) as api:
            api.base_url  # http://127.0.0.1:PORT/v1
    """

    def __init__(self, triton_url: str, tokenizer: str = "default", port: Optional[int] = None,
                 extra_args=(), ready_timeout_s: float = 120.0, env: Optional[Mapping[str, str]] = None):
        self.triton_url, self.tokenizer, self.port = triton_url, str(tokenizer), port
        self.env = dict(env or {})
        self.extra_args, self.ready_timeout_s = list(extra_args), ready_timeout_s
        self.process: Optional[subprocess.Popen] = None
        self.output = ""

    url = property(lambda self: f"http://127.0.0.1:{self.port}")
    base_url = property(lambda self: f"{self.url}/v1")

    def start(self) -> None:
        """Start it and wait until /health answers 200 (Triton ready behind it)."""
        self.port = self.port or free_port()
        self._log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pagedbackend.serving.openai_server", "--triton-url", self.triton_url,
             "--port", str(self.port), "--tokenizer", self.tokenizer, *self.extra_args],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **self.env})
        try:
            if wait_until(lambda: answers_ok(f"{self.url}/health", timeout=2.0), self.process,
                          self.ready_timeout_s):
                return
        except TimeoutError:
            pass
        self.stop()
        raise RuntimeError(f"the OpenAI server on port {self.port} did not become ready; "
                           f"its output:\n{self.output}")

    def stop(self) -> Optional[int]:
        process, self.process = self.process, None
        if process is None:
            return None
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        self._log.seek(0)
        self.output = self._log.read().decode(errors="replace")
        self._log.close()
        return process.returncode

