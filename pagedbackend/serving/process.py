"""tritonserver as a process: the binary that nvidia-pytriton ships, the Python
backend stub it needs for this interpreter, its command line and environment,
and the process group it runs in, started with it and stopped with it."""
import ctypes
import hashlib
import os
import pathlib
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
from typing import Dict, Mapping, Optional, Sequence

from pagedbackend.serving.constants import ADMIN_HEADER, EXIT_TIMEOUT_S
from pagedbackend.serving.repository import only_our_models
from pagedbackend.serving.security import API_KEY_HEADER

# Without a GPU these silence CUDA probing (RECIPES.md); harmless with one.
NO_GPU_FLAGS = ("--allow-gpu-metrics=false", "--pinned-memory-pool-byte-size=0",
                "--cuda-memory-pool-byte-size=0:0")
# Explicit model control lets a model unload itself when its engine fails
# (pagedbackend/serving/triton/health.py); the model repository API that this
# opens to clients (load, unload, index) is restricted to requests carrying a key.
# So are the other APIs that change or reveal the server's state (ADMIN_APIS).
MODEL_CONTROL_FLAGS = ("--model-control-mode=explicit", "--load-model=*",
                       # A model that fails to load is reported (in the log and as
                       # not ready); the others serve: /v2/models/NAME/ready tells which.
                       "--exit-on-error=false", "--strict-readiness=false")
# A repository of our models only has complete config.pbtxt files: without this,
# the Python backend starts a stub per model only to ask model.py for its config
# (seconds each: the stub imports torch). Other repositories keep auto-completion.
NO_AUTO_COMPLETE_FLAGS = ("--disable-auto-complete-config",)
# tritonserver 2.51's HTTP front end (libevhtp) parses a form-urlencoded body
# into two stack buffers of its size: a body over half the thread stack kills
# the server before any handler runs (docs/robustness.md). Threads get
# RLIMIT_STACK-sized stacks, so the server starts with 1 GiB (virtual; pages are
# touched only by such bodies), which moves the threshold from 4 MB to 536 MB.
SERVER_STACK_BYTES = 1 << 30
# tritonserver's APIs behind the admin key, always: model control, system and
# CUDA shared memory (a registered region is read and written by the server),
# statistics, trace and logging settings. Behind the API key, when one is
# given: inference, model metadata and configuration. Health stays open (probes).
ADMIN_APIS = "model-repository,shared-memory,statistics,trace,logging"
CLIENT_APIS = "inference,metadata,model-config"


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
                   admin_key: Optional[str] = None, api_key: Optional[str] = None) -> list:
    """The tritonserver command line. ``admin_key`` (random if not given) is the
    value of the ``pagedbackend-admin-key`` header that ADMIN_APIS need;
    ``api_key`` (None: open) that of the ``pagedbackend-api-key`` header that
    CLIENT_APIS need."""
    home = triton_home()
    key = admin_key or secrets.token_hex(16)
    command = [str(find_tritonserver()),
               f"--model-repository={pathlib.Path(model_repository).resolve()}",
               f"--backend-directory={home / 'backends'}",
               f"--http-address={host}", f"--http-port={http_port}",
               f"--grpc-address={host}", f"--grpc-port={grpc_port}",
               f"--metrics-address={host}", f"--metrics-port={metrics_port}",
               *NO_GPU_FLAGS, *MODEL_CONTROL_FLAGS,
               f"--http-restricted-api={ADMIN_APIS}:{ADMIN_HEADER}={key}",
               f"--grpc-restricted-protocol={ADMIN_APIS}:{ADMIN_HEADER}={key}",
               f"--log-verbose={log_verbose}"]
    if api_key:
        command += [f"--http-restricted-api={CLIENT_APIS}:{API_KEY_HEADER}={api_key}",
                    f"--grpc-restricted-protocol={CLIENT_APIS}:{API_KEY_HEADER}={api_key}"]
    if exit_timeout_s is not None:
        command.append(f"--exit-timeout-secs={exit_timeout_s}")
    if only_our_models(model_repository):
        command += NO_AUTO_COMPLETE_FLAGS
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
    model drains on it, see serving/triton/lifecycle.py), wait up to ``timeout_s``,
    then SIGKILL whatever is left of the group. Returns the server's status."""
    if process.poll() is None:
        signal_group(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    signal_group(process.pid, signal.SIGKILL)  # nothing of the group may outlive the server
    if process.poll() is None:
        process.wait(timeout=10)
    return process.returncode


def signal_group(pgid: int, signum: int) -> None:
    """``signum`` to a process group, if anything of it is left."""
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass
