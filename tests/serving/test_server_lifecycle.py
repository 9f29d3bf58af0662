"""How the server ends, against real tritonserver processes on the tiny model:
SIGTERM with streams in flight ends every stream and exits 0 without a crash;
whatever kills tritonserver or the launcher, no stub, watcher or
tensor-parallel worker stays behind; an engine that fails for good ends every
open stream and the model stops being ready. Each test needs a server of its own."""
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from client import ServerError, generate, grpc_stream, http_stream
from fault_injection import make_faulty_repository
from loadtest.harness.triton import TritonServer, free_port
from pagedbackend.serving.constants import EXIT_TIMEOUT_S
from pagedbackend.serving.launcher import DRAIN_MARGIN_S
from pagedbackend.serving.repository import make_model_repository
from processes import group_members

pytestmark = pytest.mark.slow

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
SETTINGS = dict(num_kv_blocks=128, max_num_seqs=16, device="cpu", compile=False)
LONG = {"max_tokens": 450, "ignore_eos": True}
# The stub's own crashes reach the log through faulthandler ("Fatal Python error: ...").
CRASH_MARKS = ("Signal (11)", "Signal (6)", "Signal (7)", "Segmentation fault", "terminate called",
               "core dumped", "Exit timeout expired", "Fatal Python error")


def alive(pid: int) -> bool:
    """Running and not a zombie."""
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


class Launcher:
    """``python -m pagedbackend.serve`` on free ports, its output in a file."""

    def __init__(self, repo: pathlib.Path, log: pathlib.Path):
        self.ports = [free_port() for _ in range(3)]
        self.log = log
        self.http_url = f"http://127.0.0.1:{self.ports[0]}"
        self.grpc_url = f"127.0.0.1:{self.ports[1]}"
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "pagedbackend.serve", "--model-repository", str(repo),
                 "--http-port", str(self.ports[0]), "--grpc-port", str(self.ports[1]),
                 "--metrics-port", str(self.ports[2])],
                cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = 240) -> None:
        assert wait_until(lambda: "ready:" in self.text() or self.process.poll() is not None, timeout_s)
        assert self.process.poll() is None, self.text()[-3000:]

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def server_pid(self) -> int:
        children = pathlib.Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
        return int(children[0])

    def kill_everything(self) -> None:
        for pid in [self.process.pid] + group_members(self.server_pid_or_none() or -1):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(timeout=10)

    def server_pid_or_none(self):
        try:
            return self.server_pid()
        except (OSError, IndexError):
            return None


@pytest.fixture
def tiny_repo(tmp_path, tiny_model_dir):
    return make_model_repository(tmp_path / "repo", {"model": tiny_model_dir, **SETTINGS})


def start_streams(launcher: Launcher, count: int):
    """``count`` long streams, half over gRPC and half over HTTP, each past its first token."""
    outcomes, started = {}, threading.Barrier(count + 1, timeout=120)

    def run(i):
        stream = grpc_stream if i % 2 else http_stream
        deltas = stream(f"Stream {i}", LONG, url=launcher.grpc_url if i % 2 else launcher.http_url, timeout=120)
        tokens = 0
        try:
            for delta in deltas:
                tokens += delta.num_tokens
                if tokens == delta.num_tokens:
                    started.wait()
            outcomes[i] = ("finished", tokens)
        except Exception as exc:
            outcomes[i] = ("error", str(exc))
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    started.wait()
    return threads, outcomes


@pytest.mark.timeout(400)
def test_sigterm_to_the_launcher_with_streams_in_flight_ends_them_and_exits_cleanly(tmp_path, tiny_repo):
    launcher = Launcher(tiny_repo, tmp_path / "serve.log")
    try:
        launcher.wait_ready()
        server = launcher.server_pid()
        group = group_members(server)
        threads, outcomes = start_streams(launcher, 4)

        start = time.monotonic()
        launcher.process.send_signal(signal.SIGTERM)
        code = launcher.process.wait(timeout=60)
        seconds = time.monotonic() - start
        for thread in threads:
            thread.join(timeout=30)
    finally:
        if launcher.process.poll() is None:
            launcher.kill_everything()

    assert code == 0 and seconds < 15
    assert outcomes == {i: ("error", "the server is shutting down") for i in range(4)}, outcomes
    log = launcher.text()
    assert "drained; 4 open request(s) ended" in log
    assert not [mark for mark in CRASH_MARKS if mark in log], log[-3000:]
    assert len(group) >= 3 and not [pid for pid in group if alive(pid)]  # server, stub, watcher


@pytest.mark.timeout(600)
def test_three_sigterm_stops_in_a_row_exit_0_without_a_crash(tmp_path, tiny_repo):
    """Every stop used to segfault the stub in tritonserver's metric teardown
    (the kernel log said so; faulthandler now writes it into the server's)."""
    for round_ in range(3):
        launcher = Launcher(tiny_repo, tmp_path / f"serve{round_}.log")
        try:
            launcher.wait_ready()
            result = generate("Hello", {"max_tokens": 4}, url=launcher.grpc_url)   # fills the histograms
            assert result.num_output_tokens == [4]
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{launcher.ports[2]}/metrics", timeout=10).read()
            assert b"pagedbackend:e2e_request_latency_seconds_count" in metrics
            launcher.process.send_signal(signal.SIGTERM)
            code = launcher.process.wait(timeout=60)
        finally:
            if launcher.process.poll() is None:
                launcher.kill_everything()
        log = launcher.text()
        assert code == 0 and "stopped: tritonserver exited with status 0" in log, log[-3000:]
        assert not [mark for mark in CRASH_MARKS if mark in log], log[-3000:]


@pytest.mark.timeout(400)
def test_sigterm_ends_after_the_exit_timeout_and_margin_even_while_a_client_holds_a_grpc_stream_open(tmp_path, tiny_repo):
    """tritonserver 2.51 neither unloads nor exits while a client keeps a gRPC
    stream open, even one whose requests are all answered; the launcher ends it."""
    import tritonclient.grpc as grpcclient
    from client.streaming import _grpc_inputs
    launcher = Launcher(tiny_repo, tmp_path / "serve.log")
    answers = []
    client = None
    try:
        launcher.wait_ready()
        group = group_members(launcher.server_pid())
        client = grpcclient.InferenceServerClient(launcher.grpc_url)
        client.start_stream(callback=lambda result, error: answers.append(error))
        client.async_stream_infer("paged_llm", _grpc_inputs(grpcclient, "Story", LONG, True, None))
        assert wait_until(lambda: answers, 60.0)

        start = time.monotonic()
        launcher.process.send_signal(signal.SIGTERM)
        code = launcher.process.wait(timeout=60)
        seconds = time.monotonic() - start
    finally:
        if client is not None:
            client.stop_stream()
            client.close()
        if launcher.process.poll() is None:
            launcher.kill_everything()

    assert seconds < EXIT_TIMEOUT_S + DRAIN_MARGIN_S + 5 and code != 0
    assert "killing it" in launcher.text()
    assert any(error is not None and "shutting down" in str(error) for error in answers)
    assert not [pid for pid in group if alive(pid)]


@pytest.mark.timeout(400)
def test_sigkill_of_the_launcher_takes_tritonserver_and_its_stub_with_it(tmp_path, tiny_repo):
    launcher = Launcher(tiny_repo, tmp_path / "serve.log")
    try:
        launcher.wait_ready()
        group = group_members(launcher.server_pid())
        stream = grpc_stream("Story", LONG, url=launcher.grpc_url, timeout=120)
        next(stream)

        launcher.process.kill()
        launcher.process.wait(timeout=10)

        assert len(group) >= 3
        assert wait_until(lambda: not [pid for pid in group if alive(pid)], 10.0), \
            [pathlib.Path(f"/proc/{p}/cmdline").read_bytes()[:80] for p in group if alive(p)]
        with pytest.raises(ServerError):
            list(stream)  # what was already received, then the broken connection
    finally:
        launcher.kill_everything()


@pytest.mark.timeout(400)
def test_when_tritonserver_is_killed_no_stub_watcher_or_worker_stays_behind(tmp_path, tiny_model_dir):
    repo = make_model_repository(tmp_path / "repo", {"model": tiny_model_dir, **SETTINGS,
                                                     "tensor_parallel_size": 2})
    server = TritonServer(repo, ready_timeout_s=240)
    server.start()
    try:
        stream = grpc_stream("Story", LONG, url=server.grpc_url, timeout=120)
        next(stream)  # busy: the stub is streaming and updating metrics
        pid = server.process.pid
        others = [p for p in group_members(pid) if p != pid]

        os.kill(pid, signal.SIGKILL)  # not reaped by us: a zombie until stop()

        assert len(others) >= 3  # stub, watcher, tensor-parallel worker
        assert wait_until(lambda: not [p for p in others if alive(p)], 10.0)
        with pytest.raises(ServerError):
            list(stream)  # what was already received, then the broken connection
    finally:
        server.stop()


@pytest.mark.timeout(400)
@pytest.mark.parametrize("switches, unload", [
    ({"UNLOAD_ON_ENGINE_FAILURE": True}, True),
    ({"UNLOAD_ON_ENGINE_FAILURE": False}, False),
    # vllm_backend's name for the switch wins over ours.
    ({"UNLOAD_ON_ENGINE_FAILURE": True, "ENABLE_VLLM_HEALTH_CHECK": False}, False),
], ids=["unload", "stay-loaded", "vllm-health-check-off"])
def test_a_failed_engine_ends_open_streams_and_the_model_stops_serving(tmp_path, tiny_model_dir, switches,
                                                                       unload):
    from transformers import AutoTokenizer
    poison = "A lost device"
    # The forward pass carries a test-only fault: it raises (as a lost device would) for this prompt.
    repo = make_faulty_repository(tmp_path / "repo", {"model": tiny_model_dir, **SETTINGS, **switches},
                                  "forward", AutoTokenizer.from_pretrained(tiny_model_dir).encode(poison))
    with TritonServer(repo, ready_timeout_s=240) as server:
        stream = grpc_stream("Story", LONG, url=server.grpc_url, timeout=120)
        next(stream)
        stub = [p for p in group_members(server.process.pid) if p != server.process.pid]
        assert stub, "the Python stub should be in tritonserver's process group"

        with pytest.raises(ServerError, match="injected device fault"):
            generate(poison, {"max_tokens": 4}, url=server.grpc_url, timeout=60)

        with pytest.raises(ServerError, match="the engine failed.*injected device fault"):
            list(stream)
        model_ready = server.http_url + "/v2/models/paged_llm/ready"
        assert status(server.http_url + "/v2/health/live") == 200
        if unload:
            assert wait_until(lambda: status(model_ready) != 200, 15.0)
            with pytest.raises(ServerError, match="unknown model"):
                generate("Hello", {"max_tokens": 2}, url=server.grpc_url, timeout=30)
            assert wait_until(lambda: not [p for p in stub if alive(p)], 15.0)  # the stub went with it
        else:
            assert status(model_ready) == 200
            with pytest.raises(ServerError, match="the engine has failed.*restart the server"):
                generate("Hello", {"max_tokens": 2}, url=server.grpc_url, timeout=30)
        assert "the engine failed: RuntimeError('injected device fault')" in server.log_tail(400)


def test_use_utf8_locale_makes_text_io_utf8_in_a_process_started_in_the_c_locale(tmp_path):
    # What the Python backend's stub gets: an interpreter whose text I/O is ASCII.
    sample = tmp_path / "sample.txt"
    sample.write_text("attention \u2013 paged\n", encoding="utf-8")
    code = ("import locale, sys\n"
            "from pagedbackend.serving.triton.lifecycle import use_utf8_locale\n"
            "before = locale.getpreferredencoding(False)\n"
            "after = use_utf8_locale()\n"
            "print(before, after, open(sys.argv[1]).read().strip() == 'attention \\u2013 paged')\n")
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    out = subprocess.run([sys.executable, "-c", code, str(sample)], env=env, capture_output=True,
                         text=True, encoding="utf-8", timeout=120)
    assert out.returncode == 0, out.stderr
    before, after, read = out.stdout.split()
    assert before.lower().replace("-", "") != "utf8"   # the C locale really was in effect
    assert after.lower().replace("-", "") == "utf8" and read == "True"


def test_waiting_for_the_compiled_step_survives_the_metrics_service_starting_after_http(tmp_path):
    # tritonserver answers ready on HTTP before its metrics service listens:
    # the compiled-step probe then meets a refused connection, which means "not yet".
    server = TritonServer(tmp_path, metrics_port=free_port("127.0.0.1"), log_path=tmp_path / "server.log",
                          wait_for_compiled_step=True)
    server.log_path.write_text("")
    assert server._step_compiled() is False
    server.log_path.write_text("pagedbackend: the model step runs eager\n")
    assert server._step_compiled() is True


@pytest.mark.timeout(400)
def test_a_killed_tensor_parallel_worker_fails_the_engine_and_both_servers_exit_non_zero(tmp_path,
                                                                                         tiny_model_dir):
    """A real fault, nothing injected: SIGKILL to rank 1's process. The engine
    fails, the model unloads itself, the launcher stops tritonserver and exits
    with status 3, and the OpenAI server in front exits 3 too, so that a
    supervisor restarts them; nothing of either is left."""
    from loadtest.harness.openai import OpenAIServer
    from processes import processes_mentioning
    repo = make_model_repository(tmp_path / "repo", {"model": tiny_model_dir, **SETTINGS,
                                                     "tensor_parallel_size": 2})
    launcher = Launcher(repo, tmp_path / "launcher.log")
    api = OpenAIServer(launcher.grpc_url, tokenizer=tiny_model_dir, extra_args=["--exit-after-triton-lost", "1"])
    try:
        launcher.wait_ready()
        api.start()
        group = group_members(launcher.server_pid())
        workers = [p for p in processes_mentioning("pagedbackend.worker.tp_worker") if p in group]
        assert len(workers) == 1
        stream = grpc_stream("Story", LONG, url=launcher.grpc_url, timeout=120)
        next(stream)

        os.kill(workers[0], signal.SIGKILL)
        killed = time.monotonic()
        model_ready = launcher.http_url + "/v2/models/paged_llm/ready"
        assert wait_until(lambda: status(model_ready) != 200 or launcher.process.poll() is not None, 10.0)
        red_after = time.monotonic() - killed
        launcher.process.wait(timeout=20)
        exit_after = time.monotonic() - killed
        api_status = api.process.wait(timeout=20) if api.process else None

        with pytest.raises(ServerError):
            list(stream)
        assert launcher.process.returncode == 3, launcher.text()[-3000:]
        assert "model paged_llm stopped being ready" in launcher.text()
        assert api_status == 3
        assert wait_until(lambda: not [p for p in group if alive(p)], 10.0)
        print(f"health red {red_after:.2f} s, launcher exited {exit_after:.2f} s after the kill")
        assert exit_after < 10.0, (red_after, exit_after)
    finally:
        api.stop()
        if launcher.process.poll() is None:
            launcher.kill_everything()
