"""Run NVIDIA's tritonserver (bundled by nvidia-pytriton) over our model repository.

    python -m pagedbackend.serve --model-repository model_repository \
        --http-port 8000 --grpc-port 8001 --metrics-port 8002

Engine settings come from the ``parameters`` of each model's ``config.pbtxt``
(names as ``EngineConfig`` fields). An environment variable
``PAGEDBACKEND_<FIELD>`` (e.g. ``PAGEDBACKEND_NUM_KV_BLOCKS=512``) overrides the
file; ``--set field=value`` and ``--model`` set those variables for the server.
The pieces (``find_tritonserver``, ``prepare_backend``, ``server_command``,
``TritonServer``, ``make_model_repository``) are reused by tests and benchmarks.
"""
import argparse
import ctypes
import hashlib
import os
import pathlib
import resource
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.request
from dataclasses import fields
from typing import Any, Dict, Mapping, Optional, Sequence

from pagedbackend.config import ENV_PREFIX, EngineConfig

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
DEFAULT_MODEL_NAME = "paged_llm"
# Without a GPU these silence CUDA probing (RECIPES.md); harmless with one.
NO_GPU_FLAGS = ("--allow-gpu-metrics=false", "--pinned-memory-pool-byte-size=0",
                "--cuda-memory-pool-byte-size=0:0")
# Explicit model control lets a model unload itself when its engine fails
# (pagedbackend/serving/health.py); the model repository API that this opens
# to clients (load, unload, index) is restricted to requests carrying a key.
MODEL_CONTROL_FLAGS = ("--model-control-mode=explicit", "--load-model=*",
                       # A model that fails to load is reported (in the log and as
                       # not ready); the others serve: /v2/models/NAME/ready tells which.
                       "--exit-on-error=false", "--strict-readiness=false")
ADMIN_HEADER = "pagedbackend-admin-key"
# tritonserver expects the restricted gRPC protocol's key header with this prefix.
GRPC_ADMIN_HEADER = "triton-grpc-protocol-" + ADMIN_HEADER
# The key, shared with the OpenAI-compatible server that lists the repository's models.
ADMIN_KEY_ENV = "PAGEDBACKEND_ADMIN_KEY"
# tritonserver 2.51's HTTP front end (libevhtp) parses a form-urlencoded body
# into two stack buffers of its size: a body over half the thread stack kills
# the server before any handler runs (docs/robustness.md). Threads get
# RLIMIT_STACK-sized stacks, so the server starts with 1 GiB (virtual; pages are
# touched only by such bodies), which moves the threshold from 4 MB to 536 MB.
SERVER_STACK_BYTES = 1 << 30
# Seconds tritonserver waits, after SIGTERM, for HTTP connections to close and
# requests to end (the model ends its own at once; idle keep-alive clients are
# what it waits for).
EXIT_TIMEOUT_S = 5
# After SIGTERM, tritonserver gets its exit timeout and this much more to exit
# before the launcher kills it.
DRAIN_MARGIN_S = 5


# --------------------------------------------------------------- engine settings

def read_model_config(config_text: str):
    """A ``config.pbtxt`` as Triton's ``ModelConfig`` protobuf message."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2
    return text_format.Parse(config_text, model_config_pb2.ModelConfig())


def read_parameters(config_text: str) -> Dict[str, str]:
    """The ``parameters`` (string values) of a config.pbtxt."""
    return {key: value.string_value for key, value in read_model_config(config_text).parameters.items()}


def make_model_repository(dest, settings: Mapping[str, Any] = (),
                          source=DEFAULT_MODEL_REPOSITORY,
                          model_name: str = DEFAULT_MODEL_NAME, name: Optional[str] = None) -> pathlib.Path:
    """Copy ``source/model_name`` into ``dest`` (as ``name``, default the same)
    with some parameters replaced or added."""
    from google.protobuf import text_format
    dest = pathlib.Path(dest)
    target = dest / (name or model_name)
    shutil.copytree(pathlib.Path(source) / model_name, target,
                    ignore=shutil.ignore_patterns("__pycache__"))
    config_file = target / "config.pbtxt"
    config = read_model_config(config_file.read_text())
    for key, value in dict(settings).items():
        value = "" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        config.parameters[key].string_value = value
    config_file.write_text(text_format.MessageToString(config))
    return dest


# --------------------------------------------------------------- tritonserver

def triton_home() -> pathlib.Path:
    """The tritonserver tree shipped inside nvidia-pytriton."""
    import importlib.util
    spec = importlib.util.find_spec("pytriton")   # located, not imported (its client is slow to import)
    if spec is None or spec.origin is None:
        raise FileNotFoundError("tritonserver comes from nvidia-pytriton: "
                                "pip install nvidia-pytriton==0.7.0 (or run make setup)")
    return pathlib.Path(spec.origin).parent / "tritonserver"


def find_tritonserver() -> pathlib.Path:
    binary = triton_home() / "bin" / "tritonserver"
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        raise FileNotFoundError(f"no executable tritonserver at {binary}; "
                                "reinstall nvidia-pytriton==0.7.0")
    return binary


def prepare_backend(home: Optional[pathlib.Path] = None) -> pathlib.Path:
    """Place the Python backend stub built for this Python next to libtriton_python.so.

    The stub must match the interpreter that runs model.py, and sit at the same
    depth so its relative library paths resolve. Copied only if missing or different.
    """
    home = home or triton_home()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    source = home / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not source.is_file():
        raise FileNotFoundError(f"nvidia-pytriton has no Python backend stub for Python {version}")
    target = home / "backends" / "python" / "triton_python_backend_stub"
    if not target.is_file() or _digest(target) != _digest(source):
        tmp = target.with_name(f".{target.name}.{os.getpid()}")
        shutil.copy2(source, tmp)
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)  # atomic for concurrent launchers
    return target


def _digest(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def server_env(base: Optional[Mapping[str, str]] = None,
               overrides: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """Environment for tritonserver: this venv's bin first on PATH (so the stub's
    Python finds the venv's packages) and Python's LIBDIR on LD_LIBRARY_PATH."""
    env = dict(os.environ if base is None else base)
    env.update(overrides or {})
    venv_bin = str(pathlib.Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([venv_bin] + [p for p in env.get("PATH", "").split(os.pathsep)
                                                if p and p != venv_bin])
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir:
        old = env.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = libdir + (os.pathsep + old if old else "")
    return env


def server_command(model_repository, http_port: int, grpc_port: int, metrics_port: int,
                   host: str = "127.0.0.1", log_verbose: int = 0,
                   exit_timeout_s: Optional[int] = EXIT_TIMEOUT_S, extra: Sequence[str] = (),
                   admin_key: Optional[str] = None) -> list:
    """The tritonserver command line. ``admin_key`` (random if not given) is the
    value of the ``pagedbackend-admin-key`` header that the model repository API needs."""
    home = triton_home()
    key = admin_key or secrets.token_hex(16)
    command = [str(find_tritonserver()),
               f"--model-repository={pathlib.Path(model_repository).resolve()}",
               f"--backend-directory={home / 'backends'}",
               f"--http-address={host}", f"--http-port={http_port}",
               f"--grpc-address={host}", f"--grpc-port={grpc_port}",
               f"--metrics-address={host}", f"--metrics-port={metrics_port}",
               *NO_GPU_FLAGS, *MODEL_CONTROL_FLAGS,
               f"--http-restricted-api=model-repository:{ADMIN_HEADER}={key}",
               f"--grpc-restricted-protocol=model-repository:{ADMIN_HEADER}={key}",
               f"--log-verbose={log_verbose}"]
    if exit_timeout_s is not None:
        command.append(f"--exit-timeout-secs={exit_timeout_s}")
    # Options given in ``extra`` replace ours of the same name (tritonserver
    # would add up repeated --load-model options, or take either value).
    given = {option.split("=", 1)[0] for option in extra if option.startswith("--")}
    extra = list(extra)
    for i, option in enumerate(extra):
        name, _, value = option.partition("=")
        if name == "--model-control-mode" and not value and i + 1 < len(extra):
            value = extra[i + 1]
        if name == "--model-control-mode" and value != "explicit":
            given.add("--load-model")   # only explicit mode takes --load-model
    return [option for option in command if option.split("=", 1)[0] not in given] + extra


def start_server_process(command, env, **popen_kwargs) -> subprocess.Popen:
    """Popen for tritonserver: a process group of its own (its Python stubs join
    it), a 1 GiB thread stack (see SERVER_STACK_BYTES) and, when started from
    the main thread, death with this process (PR_SET_PDEATHSIG fires when the
    thread that forked it ends)."""
    parent, die_with_parent = os.getpid(), threading.current_thread() is threading.main_thread()
    prctl = ctypes.CDLL(None).prctl   # looked up here: no dynamic loading between fork and exec

    def in_child():
        _raise_stack_limit(SERVER_STACK_BYTES)
        if die_with_parent:
            prctl(1, signal.SIGKILL, 0, 0, 0)   # PR_SET_PDEATHSIG
            if os.getppid() != parent:   # the parent died before prctl
                os._exit(1)
    return subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=in_child, **popen_kwargs)


def _raise_stack_limit(target: int) -> None:
    """Soft RLIMIT_STACK = ``target`` (or the hard limit if lower); never unlimited,
    which gives threads only 2 MiB stacks."""
    _, hard = resource.getrlimit(resource.RLIMIT_STACK)
    soft = target if hard == resource.RLIM_INFINITY else min(target, hard)
    resource.setrlimit(resource.RLIMIT_STACK, (soft, hard))


def stop_process_group(process: subprocess.Popen, timeout_s: float) -> Optional[int]:
    """SIGTERM to the server's whole process group (tritonserver, its stubs: the
    model drains on it, see serving/lifecycle.py), wait up to ``timeout_s``,
    then SIGKILL whatever is left of the group. Returns the server's status."""
    if process.poll() is None:
        _signal_group(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(process.pid, signal.SIGKILL)  # nothing of the group may outlive the server
    if process.poll() is None:
        process.wait(timeout=10)
    return process.returncode


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass


def prepare_models(model_repository, environ: Mapping[str, str] = os.environ,
                   failures: Optional[list] = None) -> list:
    """Resolve (and for "default", build once) each repository model's weights folder,
    so a slow first preparation happens here rather than inside the model load.
    A model that cannot be prepared is reported in ``failures`` as (name, error)
    and skipped, as tritonserver skips a model it cannot load; without
    ``failures`` the first error is raised."""
    try:
        from pagedbackend.models.default_model import resolve_model_path
    except ImportError:
        return []
    override = environ.get(ENV_PREFIX + "MODEL")
    paths = []
    for config_file in sorted(pathlib.Path(model_repository).glob("*/config.pbtxt")):
        try:
            params = read_parameters(config_file.read_text())
            if "model" in params or override:
                paths.append(resolve_model_path(override or params["model"]))
        except Exception as exc:
            if failures is None:
                raise
            failures.append((config_file.parent.name, exc))
    return paths


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def is_ready(http_url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(f"{http_url}/v2/health/ready", timeout=timeout) as reply:
            return reply.status == 200
    except OSError:
        return False


def is_model_ready(http_url: str, model: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(f"{http_url}/v2/models/{model}/ready", timeout=timeout) as reply:
            return reply.status == 200
    except OSError:
        return False


def repository_models(model_repository) -> list:
    """Names of the repository's model folders (those with a config.pbtxt)."""
    return sorted(path.parent.name for path in pathlib.Path(model_repository).glob("*/config.pbtxt"))


class ServerError(RuntimeError):
    """tritonserver did not start or did not become ready."""


class TritonServer:
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
                 required_models: Optional[Sequence[str]] = None, wait_for_compiled_step: bool = False):
        """``wait_for_compiled_step``: ``start`` returns once every model's
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
        self._own_log_dir = None if log_path else tempfile.mkdtemp(prefix="tritonserver-")
        self.log_path = pathlib.Path(log_path or pathlib.Path(self._own_log_dir) / "server.log")
        self.process: Optional[subprocess.Popen] = None

    http_url = property(lambda self: f"http://{self.host}:{self._port('http')}")
    grpc_url = property(lambda self: f"{self.host}:{self._port('grpc')}")
    metrics_url = property(lambda self: f"http://{self.host}:{self._port('metrics')}/metrics")

    def _port(self, kind: str) -> int:
        return self._bound[kind]

    def __enter__(self) -> "TritonServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

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
                                 self.exit_timeout_s, self.extra_args, admin_key=self.admin_key)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.process = start_server_process(command, server_env(overrides=self.env),
                                            stdin=subprocess.DEVNULL, stdout=self._log,
                                            stderr=subprocess.STDOUT)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"tritonserver exited with status {self.process.returncode} "
                                  f"before it was ready; log tail:\n{self.log_tail()}")
            if is_ready(self.http_url):
                required = repository_models(self.model_repository) if self.required_models is None \
                    else list(self.required_models)
                failed = [name for name in required if not is_model_ready(self.http_url, name)]
                if failed:
                    raise ServerError(f"model(s) {', '.join(failed)} did not load; "
                                      f"log tail:\n{self.log_tail()}")
                return
            time.sleep(0.2)
        raise ServerError(f"tritonserver not ready after {self.ready_timeout_s:.0f} s; "
                          f"log tail:\n{self.log_tail()}")

    def _wait_compiled(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        name = "pagedbackend:model_step_compiled{"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"tritonserver exited with status {self.process.returncode}; "
                                  f"log tail:\n{self.log_tail()}")
            values = [line.rsplit(" ", 1)[-1] for line in self.metrics().splitlines() if line.startswith(name)]
            if values and all(float(v) == 1.0 for v in values) or "the model step runs eager" in self.log_tail():
                return
            time.sleep(0.5)
        raise ServerError(f"the compiled model step did not take over within {self.ready_timeout_s:.0f} s; "
                          f"log tail:\n{self.log_tail()}")

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


# --------------------------------------------------------------- command line

def parse_args(argv=None) -> argparse.Namespace:
    """Our options, then ``--`` and any tritonserver options, which are passed
    through (and replace ours of the same name)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    argv, passed = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(prog="python -m pagedbackend.serve [OPTIONS] [-- TRITONSERVER OPTIONS]",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model-repository", default=str(DEFAULT_MODEL_REPOSITORY))
    parser.add_argument("--host", default="127.0.0.1", help="address for all three endpoints")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--model", help='engine model: "default" or a model folder (PAGEDBACKEND_MODEL)')
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override an engine setting (PAGEDBACKEND_<FIELD>); repeatable")
    parser.add_argument("--log-verbose", type=int, default=0)
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds")
    parser.add_argument("--exit-timeout", type=int, default=EXIT_TIMEOUT_S,
                        help="seconds tritonserver waits after SIGTERM for HTTP connections and requests")
    parser.add_argument("--admin-key", default=os.environ.get(ADMIN_KEY_ENV),
                        help=f"value of the {ADMIN_HEADER} header that the model repository API "
                             f"(load, unload, index) requires (${ADMIN_KEY_ENV}); random if not given")
    parser.add_argument("--prepare-only", action="store_true",
                        help="copy the backend stub and prepare the models, then exit")
    args = parser.parse_args(argv)
    args.tritonserver_args = passed
    return args


def setting_overrides(args: argparse.Namespace) -> Dict[str, str]:
    overrides = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep or name not in {f.name for f in fields(EngineConfig)}:
            raise SystemExit(f"--set expects FIELD=VALUE with an EngineConfig field, got {item!r}")
        overrides[ENV_PREFIX + name.upper()] = value
    if args.model:
        overrides[ENV_PREFIX + "MODEL"] = args.model
    return overrides


def main(argv=None) -> int:
    args = parse_args(argv)
    overrides = setting_overrides(args)
    failures = []
    try:
        prepare_backend()
        for path in prepare_models(args.model_repository, {**os.environ, **overrides}, failures):
            print(f"model weights: {path}", flush=True)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for name, exc in failures:
        print(f"{'error' if args.prepare_only else 'warning'}: model {name}: {exc}"
              f"{'' if args.prepare_only else '; tritonserver will load the others'}", file=sys.stderr)
    if args.prepare_only:
        return 1 if failures else 0
    command = server_command(args.model_repository, args.http_port, args.grpc_port, args.metrics_port,
                             args.host, args.log_verbose, args.exit_timeout, args.tritonserver_args,
                             admin_key=args.admin_key)
    process = start_server_process(command, server_env(overrides=overrides))
    stop_requested = []   # monotonic times of SIGTERM / SIGINT
    drain_s = args.exit_timeout + DRAIN_MARGIN_S

    def stop(signum, _frame):
        """The first signal: SIGTERM to the server's group (the model drains).
        Repeats while the drain has its time change nothing (one Ctrl-C or
        ``kill`` of ``make serve`` reaches us through the process group and
        through make's trap both); one after that kills the group."""
        now = time.monotonic()
        stop_requested.append(now)
        if len(stop_requested) == 1:
            _signal_group(process.pid, signal.SIGTERM)
        elif now - stop_requested[0] >= drain_s:
            _signal_group(process.pid, signal.SIGKILL)
        elif len(stop_requested) == 2:
            print(f"stopping: tritonserver is draining (up to {drain_s:.0f} s); "
                  "a signal after that kills it", file=sys.stderr, flush=True)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop)

    http_url = f"http://{args.host}:{args.http_port}"
    deadline = time.monotonic() + args.ready_timeout
    while process.poll() is None and not stop_requested and not is_ready(http_url):
        if time.monotonic() > deadline:
            print(f"tritonserver not ready after {args.ready_timeout:.0f} s; stopping it",
                  file=sys.stderr)
            stop(signal.SIGTERM, None)
            break
        time.sleep(0.5)
    if process.poll() is None and not stop_requested and is_ready(http_url):
        for name in repository_models(args.model_repository):
            if not is_model_ready(http_url, name):
                print(f"warning: model {name} is not ready (did not load, or not asked to; "
                      "see the server log)", file=sys.stderr, flush=True)
        print(f"ready: HTTP {http_url}  gRPC {args.host}:{args.grpc_port}  "
              f"metrics http://{args.host}:{args.metrics_port}/metrics", flush=True)
    while process.poll() is None:
        if stop_requested and time.monotonic() - stop_requested[0] > drain_s:
            # tritonserver 2.51 cannot unload a model, nor exit, while a client
            # keeps a gRPC stream open (docs/robustness.md); every request has
            # had its final response by now.
            print("tritonserver did not exit after SIGTERM (a client holding a gRPC stream open?); "
                  "killing it", file=sys.stderr)
            _signal_group(process.pid, signal.SIGKILL)
        time.sleep(0.2)
    _signal_group(process.pid, signal.SIGKILL)   # a dead server's stubs and workers go with it
    status = process.returncode
    if status < 0:
        print(f"tritonserver was killed by {signal.Signals(-status).name}", file=sys.stderr)
    else:
        print(f"stopped: tritonserver exited with status {status}", file=sys.stderr, flush=True)
    return 128 - status if status < 0 else status


if __name__ == "__main__":
    sys.exit(main())
