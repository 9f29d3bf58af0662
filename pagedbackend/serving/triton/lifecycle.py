"""How the Python backend stub lives and dies with tritonserver.

``watch_server()``: the stub must never outlive its server. The stub's own
watchdog (a C++ thread probing ``kill(ppid, 0)``) misses a dead server that is
not yet reaped, and hangs when another thread of ours is blocked in a
stub-to-server call (a metric update, ``is_cancelled``) that the dead server
never answers, holding the GIL. So a small helper process, which needs no GIL
of ours, waits on a pidfd of the server and SIGKILLs the stub when the server
exits; it dies with the stub (``PR_SET_PDEATHSIG``). Measured: the stub is gone
within 0.15 s of the server, however the server died (docs/robustness.md).

``on_sigterm(callback)``: tritonserver 2.51 never calls ``finalize`` while a
decoupled stream is open, and once its exit timeout expires it tears itself
down while our threads may still send, and crashes. The launcher therefore
sends SIGTERM to the server's whole process group, and the model drains on it:
refuse new requests, end every open stream with a final response, stop the
engine. Then Triton finds nothing in flight, unloads the model and exits 0.

``watch_listener(callback)``: SIGTERM to tritonserver alone (not to its
process group) never reaches the stub, and tritonserver then waits for the
open streams until its exit timeout and tears itself down under them. It
stops answering HTTP at once, though (``/v2/health/ready`` gets an empty
reply), so a thread of ours that has seen it ready and then finds it not
answering drains the model just as the group's SIGTERM does (a probe every
0.25 s, two misses in a row).

``end_stub()``: the end of ``finalize``. The stub replies to tritonserver's
finalize request before it calls ``finalize``, and tritonserver then only
waits for the process to exit (within its exit timeout). The stub's own
teardown releases the model's metric families after its stub object is gone:
each family's destructor asks for the stub again, gets a fresh one without
shared memory and segfaults (tritonserver 2.51, on every stop; the kernel log
showed ``segfault at 60`` in ``triton_python_backend_stub``). Releasing them
earlier, in the drain, costs seconds of round trips to a server that is
unloading. So the metric families live until the process ends, and the
process ends here, with every request answered and the engine stopped,
without the interpreter's teardown (which also took seconds for a large stub).

``use_utf8_locale()``: the stub's embedded interpreter starts in the C locale
whatever ``LANG`` says, so text files and subprocess output decode as ASCII
there; inductor then fails on the first non-ASCII byte it reads and the step
ran eager in every server started with a cold inductor cache (BENCHMARKS.md,
"compiled step").
"""
import faulthandler
import locale
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Optional, Tuple

_WATCHER = r"""
import ctypes, os, select, signal, sys
stub, server, shm = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
signal.signal(signal.SIGTERM, signal.SIG_IGN)     # the launcher's group SIGTERM is for the others
signal.signal(signal.SIGINT, signal.SIG_IGN)
ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)   # PR_SET_PDEATHSIG: die with the stub
if os.getppid() != stub:
    sys.exit(0)
try:
    pidfd = os.pidfd_open(server)
except ProcessLookupError:
    pidfd = None
if pidfd is not None:
    select.select([pidfd], [], [])                # readable once the server has exited
if shm:                                           # the stub's teardown would have removed it
    try:
        os.unlink("/dev/shm/" + shm)
    except OSError:
        pass
os.kill(stub, signal.SIGKILL)
"""


def _utf8() -> bool:
    return locale.getpreferredencoding(False).lower().replace("-", "") == "utf8"


def use_utf8_locale() -> str:
    """Make text I/O of this process default to UTF-8 (``LC_CTYPE``) where it
    defaults to something else; returns the encoding now in effect."""
    if not _utf8():
        for name in ("C.UTF-8", "C.utf8", "en_US.UTF-8", ""):
            try:
                locale.setlocale(locale.LC_CTYPE, name)
            except locale.Error:
                continue
            if _utf8():
                break
    return locale.getpreferredencoding(False)


def shm_region_name() -> str:
    """The stub's shared-memory region (an argument on its command line), or ''."""
    try:
        args = open("/proc/self/cmdline", "rb").read().split(b"\0")
    except OSError:
        return ""
    return next((a.decode() for a in args if a.startswith(b"triton_python_backend_shm_region")), "")


def watch_server() -> subprocess.Popen:
    """Start the helper that SIGKILLs this process (the stub) when its parent
    (tritonserver) exits. Call from ``initialize``, which runs on the stub's
    main thread: the helper's parent-death signal is tied to that thread."""
    return subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCHER, str(os.getpid()),
                             str(os.getppid()), shm_region_name()],
                            stdin=subprocess.DEVNULL, close_fds=True)


def on_sigterm(callback: Callable[[], None]) -> Optional[threading.Thread]:
    """Run ``callback`` in a thread of its own when this process gets SIGTERM.

    The stub's main thread sits in C++ waiting for the server, so a Python
    signal handler would not run there; Python's C-level handler writes the
    signal number to a wakeup pipe instead, and a thread waiting on the pipe
    runs the callback. Needs the main thread; returns None elsewhere."""
    if threading.current_thread() is not threading.main_thread():
        return None
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    signal.signal(signal.SIGTERM, lambda *_: None)

    def wait():
        while True:
            data = os.read(read_fd, 64)
            if not data:
                return
            if signal.SIGTERM in data:
                break
        callback()
    thread = threading.Thread(target=wait, name="sigterm-drain", daemon=True)
    thread.start()
    return thread


def log_to_stderr() -> None:
    """The engine's log lines (logger ``pagedbackend``, INFO and above) on this
    process's stderr, which tritonserver's log holds: the compiled step taking
    over, CPU contention switches, failed requests. A crash of the stub (a
    segfault, an abort) writes every thread's Python stack there too
    (faulthandler): otherwise only the kernel log would tell."""
    faulthandler.enable(sys.stderr, all_threads=True)
    log = logging.getLogger("pagedbackend")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def end_stub(status: int = 0) -> None:
    """End this process now: flush the log and standard streams, then exit
    without running the interpreter's teardown (see the module docstring)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


LISTENER_POLL_S = 0.25


def server_http_address(pid: int) -> Optional[Tuple[str, int]]:
    """The (host, port) that tritonserver ``pid`` serves HTTP on, from its
    command line (defaults 0.0.0.0 and 8000); None when HTTP is off."""
    try:
        args = [a.decode(errors="replace") for a in open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")]
    except OSError:
        return None
    options = {}
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name.startswith("--"):
            options[name] = value if eq else (args[i + 1] if i + 1 < len(args) else "")
    if options.get("--allow-http", "true").lower() in ("false", "0", "no"):
        return None
    host = options.get("--http-address", "0.0.0.0")
    try:
        port = int(options.get("--http-port", "8000"))
    except ValueError:
        return None
    return ("127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host), port


def answers_ready(address: Tuple[str, int], timeout_s: float = 2.0) -> Optional[bool]:
    """Whether tritonserver at ``address`` answers ``/v2/health/ready`` with 200:
    False when it refuses, drops the connection or answers otherwise (as it
    does from the moment it is asked to stop), None when it is only slow."""
    import http.client
    connection = http.client.HTTPConnection(*address, timeout=timeout_s)
    try:
        connection.request("GET", "/v2/health/ready")
        return connection.getresponse().status == 200
    except socket.timeout:
        return None
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()


def watch_listener(callback: Callable[[], None], address: Optional[Tuple[str, int]] = None,
                   poll_s: float = LISTENER_POLL_S) -> Optional[threading.Thread]:
    """Call ``callback`` once tritonserver's HTTP endpoint (``address``, read
    from the parent's command line by default), having answered ready, stops
    answering so twice in a row. None when there is no HTTP endpoint to watch."""
    address = address or server_http_address(os.getppid())
    if address is None:
        return None

    def watch():
        seen, misses = False, 0
        while True:
            time.sleep(poll_s)
            ready = answers_ready(address)
            if ready:
                seen, misses = True, 0
            elif seen and ready is False:
                misses += 1
                if misses >= 2:
                    callback()
                    return
    thread = threading.Thread(target=watch, name="listener-watch", daemon=True)
    thread.start()
    return thread
