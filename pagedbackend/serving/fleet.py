"""A fleet on one machine: N replicas (each a tritonserver, as ``make serve``
starts it, publishing KV-cache events), one Dynamo worker per replica and
Dynamo's frontend with its KV-aware router, all on loopback.

    python -m pagedbackend.serving.fleet --replicas 2 --openai-port 9000 --base-port 8100

Replica i takes ports base + 10 i (HTTP), + 1 (gRPC), + 2 (metrics), + 3 (KV
events) and its worker + 4 (Dynamo's system port: /metrics, /health; up to
32767 only, Dynamo 1.6.1's limit). Dynamo
runs without etcd or NATS: file discovery in a temporary folder, the TCP
request plane, the ZMQ event plane. Compute threads are split between the
replicas. A replica or worker that dies is started again (its streams end
with an error, or move to another replica with ``--migration-limit``); Ctrl-C
or SIGTERM stops everything, frontend first, and removes the folder. The
fleet's state (pids, ports) is written to ``fleet.json`` in that folder.
"""
import argparse
import ctypes
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Dict, List, Optional

from pagedbackend.config import ENV_PREFIX
from pagedbackend.serving.constants import SERVED_MODEL
from pagedbackend.serving.readiness import is_model_ready

HOST = "127.0.0.1"
NAMESPACE = "pagedbackend"
KV_TOPIC = "kv-events"
STOP_TIMEOUT_S = 30.0
# Dynamo 1.6.1 reads DYN_SYSTEM_PORT as a signed 16-bit number: a worker on a
# higher port runs without its system server (/metrics, /health).
MAX_SYSTEM_PORT = 32767
RESTARTS_PER_MINUTE = 5


def dynamo_env(discovery_dir: str) -> Dict[str, str]:
    """Dynamo without etcd and NATS, everything on loopback (RECIPES.md)."""
    return {"DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": discovery_dir, "DYN_REQUEST_PLANE": "tcp",
            "DYN_EVENT_PLANE": "zmq", "DYN_TCP_RPC_HOST": HOST, "DYN_EVENT_PLANE_HOST": HOST,
            "DYN_TCP_RESPONSE_STREAM_HOST": HOST, "DYN_SYSTEM_HOST": HOST, "HF_HUB_OFFLINE": "1",
            "DYN_NAMESPACE": NAMESPACE}


def _get_json(url: str):
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return json.loads(reply.read())
    except (OSError, ValueError):
        return {}


def frontend_workers(port: int, model: str = SERVED_MODEL) -> int:
    """Workers serving ``generate`` that Dynamo's frontend on ``port`` knows,
    or 0 while it does not list ``model`` yet (or does not answer)."""
    models = _get_json(f"http://{HOST}:{port}/v1/models").get("data") or []
    if not any(m.get("id") == model for m in models):
        return 0
    instances = _get_json(f"http://{HOST}:{port}/health").get("instances") or []
    return sum(1 for i in instances if i.get("endpoint") == "generate")


def child_pids(pid: int) -> List[int]:
    """Live children of ``pid`` (a replica's launcher: its tritonserver)."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def parse_args(argv=None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="python -m pagedbackend.serving.fleet", description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=int(env("REPLICAS", "2")))
    parser.add_argument("--openai-port", type=int, default=int(env("OPENAI_PORT", "9000")))
    parser.add_argument("--base-port", type=int, default=int(env("FLEET_BASE_PORT", "8100")))
    parser.add_argument("--router-mode", default="kv", choices=["kv", "round-robin", "random"])
    parser.add_argument("--migration-limit", type=int, default=int(env("MIGRATION_LIMIT", "3")),
                        help="times a stream cut by a dying replica may move to another (0: it ends with an error)")
    parser.add_argument("--model", default=env("PAGEDBACKEND_MODEL", "default"),
                        help='"default" or a model folder (default: $PAGEDBACKEND_MODEL, else "default")')
    parser.add_argument("--model-repository", help="default: the checkout's model_repository/")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="an engine setting for every replica (as python -m pagedbackend.serve --set)")
    parser.add_argument("--threads", type=int, help="compute threads per replica (default: the cores / replicas)")
    parser.add_argument("--work-dir", help="discovery folder, logs and fleet.json (default: a temporary folder, "
                                           "removed at exit)")
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    if args.replicas < 1:
        parser.error("--replicas must be >= 1")
    return args


class Fleet:
    """The processes of a fleet, started, watched and stopped by ``run``."""

    def __init__(self, args: argparse.Namespace, work_dir: pathlib.Path):
        from pagedbackend.models.default_model import resolve_model_path
        self.args, self.work = args, work_dir
        self.discovery = work_dir / "discovery"
        self.logs = work_dir / "logs"
        self.discovery.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.model_path = str(resolve_model_path(args.model))
        self.block_size = self._setting("block_size", 16)
        self.threads = args.threads or max(1, (os.cpu_count() or 1) // args.replicas)
        self.replicas: List[Optional[subprocess.Popen]] = [None] * args.replicas
        self.workers: List[Optional[subprocess.Popen]] = [None] * args.replicas
        self.frontend: Optional[subprocess.Popen] = None
        self.restarts: List[List[float]] = [[] for _ in range(args.replicas)]
        self.stopping = False

    def _setting(self, name: str, default: int) -> int:
        """An engine setting the replicas get: --set, else PAGEDBACKEND_<NAME>, else ``default``."""
        for item in reversed(self.args.set):
            key, _, value = item.partition("=")
            if key == name:
                return int(value)
        return int(os.environ.get(ENV_PREFIX + name.upper(), default))

    def ports(self, i: int) -> Dict[str, int]:
        base = self.args.base_port + 10 * i
        return {"http": base, "grpc": base + 1, "metrics": base + 2, "kv_events": base + 3, "worker": base + 4}

    def _spawn(self, name: str, command: List[str], env: Dict[str, str]) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "ab")
        prctl, parent = ctypes.CDLL(None).prctl, os.getpid()

        def in_child():   # SIGTERM when the fleet dies, however it dies
            prctl(1, signal.SIGTERM, 0, 0, 0)   # PR_SET_PDEATHSIG
            if os.getppid() != parent:
                os._exit(1)
        try:   # a session of its own: a terminal's Ctrl-C reaches only us, and we stop it in order
            return subprocess.Popen(command, env={**os.environ, **env}, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=in_child)
        finally:
            log.close()

    def start_replica(self, i: int) -> None:
        p = self.ports(i)
        kv = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://{HOST}:{p['kv_events']}",
              "topic": KV_TOPIC}
        command = [sys.executable, "-m", "pagedbackend.serve", "--http-port", str(p["http"]),
                   "--grpc-port", str(p["grpc"]), "--metrics-port", str(p["metrics"]), "--model", self.args.model,
                   "--set", f"kv_events_config={json.dumps(kv)}", *sum((["--set", s] for s in self.args.set), [])]
        if self.args.model_repository:
            command += ["--model-repository", self.args.model_repository]
        self.replicas[i] = self._spawn(f"replica{i}", command, {"OMP_NUM_THREADS": str(self.threads)})

    def start_worker(self, i: int) -> None:
        p = self.ports(i)
        command = [sys.executable, "-m", "pagedbackend.serving.dynamo", "--model-path", self.model_path,
                   "--triton-url", f"{HOST}:{p['grpc']}", "--metrics-url", f"http://{HOST}:{p['metrics']}/metrics",
                   "--kv-events-endpoint", f"tcp://{HOST}:{p['kv_events']}", "--kv-events-topic", KV_TOPIC,
                   "--block-size", str(self.block_size), "--ready-timeout", str(self.args.ready_timeout)]
        env = dynamo_env(str(self.discovery))
        if p["worker"] <= MAX_SYSTEM_PORT:
            env["DYN_SYSTEM_PORT"] = str(p["worker"])
        self.workers[i] = self._spawn(f"worker{i}", command, env)

    def start_frontend(self) -> None:
        command = [sys.executable, "-m", "dynamo.frontend", "--http-host", HOST,
                   "--http-port", str(self.args.openai_port), "--router-mode", self.args.router_mode,
                   "--kv-cache-block-size", str(self.block_size), "--namespace", NAMESPACE,
                   "--migration-limit", str(self.args.migration_limit)]
        self.frontend = self._spawn("frontend", command, dynamo_env(str(self.discovery)))

    def write_state(self) -> None:
        state = {"openai_url": f"http://{HOST}:{self.args.openai_port}/v1", "model": SERVED_MODEL,
                 "model_path": self.model_path, "frontend_pid": self.frontend.pid if self.frontend else None,
                 "replicas": [{"index": i, **self.ports(i),
                               "serve_pid": r.pid if r else None, "worker_pid": w.pid if w else None}
                              for i, (r, w) in enumerate(zip(self.replicas, self.workers))]}
        tmp = self.work / "fleet.json.tmp"
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, self.work / "fleet.json")

    def replica_ready(self, i: int) -> bool:
        return is_model_ready(f"http://{HOST}:{self.ports(i)['http']}", SERVED_MODEL)

    def wait_ready(self) -> bool:
        """Until the frontend knows a worker per replica."""
        deadline = time.monotonic() + self.args.ready_timeout
        while not self.stopping and time.monotonic() < deadline:
            if self.check() is not None:
                return False
            if frontend_workers(self.args.openai_port) >= self.args.replicas:
                return True
            time.sleep(0.5)
        return False

    def check(self) -> Optional[str]:
        """Start a worker once its replica is ready; start again a replica or
        worker that exited (a replica's worker with it). A reason to stop, or None."""
        if self.frontend is not None and self.frontend.poll() is not None:
            return f"Dynamo's frontend exited with status {self.frontend.returncode}"
        for i in range(self.args.replicas):
            replica, worker = self.replicas[i], self.workers[i]
            if replica.poll() is None and worker is None:
                if self.replica_ready(i):   # so that the worker's start does not wait on it
                    self.start_worker(i)
                    self.write_state()
                continue
            if replica.poll() is None and worker.poll() is None:
                continue
            now = time.monotonic()
            self.restarts[i] = [t for t in self.restarts[i] if now - t < 60] + [now]
            if len(self.restarts[i]) > RESTARTS_PER_MINUTE:
                return f"replica {i} failed {RESTARTS_PER_MINUTE} times in a minute (logs: {self.logs})"
            if replica.poll() is not None:
                print(f"fleet: replica {i} exited with status {replica.returncode}; starting it again",
                      file=sys.stderr, flush=True)
                stop(worker, 10.0)
                self.start_replica(i)
                self.workers[i] = None
            else:
                print(f"fleet: worker {i} exited with status {worker.returncode}; starting it again",
                      file=sys.stderr, flush=True)
                self.start_worker(i)
            self.write_state()
        return None

    def stop_all(self) -> None:
        """The frontend first (no new requests), then the workers and replicas
        together (each drains what it has open)."""
        self.stopping = True
        stop(self.frontend, STOP_TIMEOUT_S)
        running = [p for p in self.workers + self.replicas if p is not None and p.poll() is None]
        for process in running:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for process in running:
            stop(process, STOP_TIMEOUT_S)


def stop(process: Optional[subprocess.Popen], timeout_s: float) -> None:
    """SIGTERM to the process's group, then SIGKILL to what is left of it."""
    if process is None:
        return
    for signum in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=timeout_s)
            if signum == signal.SIGTERM:
                os.killpg(process.pid, signal.SIGKILL)   # stragglers of the group
            break
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            break
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def main(argv=None) -> int:
    args = parse_args(argv)
    own_dir = args.work_dir is None
    work = pathlib.Path(args.work_dir or tempfile.mkdtemp(prefix="pagedbackend-fleet-"))
    fleet = Fleet(args, work)
    signals = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda s, _f: (signals.append(s), setattr(fleet, "stopping", True)))
    status = 0
    try:
        for i in range(args.replicas):
            fleet.start_replica(i)   # its worker follows once it is ready (check)
        fleet.start_frontend()
        fleet.write_state()
        print(f"fleet: {args.replicas} replica(s), {fleet.threads} thread(s) each, router {args.router_mode}; "
              f"logs and state in {work}", flush=True)
        if fleet.wait_ready():
            print(f"ready: OpenAI API http://{HOST}:{args.openai_port}/v1 (model {SERVED_MODEL})", flush=True)
        while not fleet.stopping:
            reason = fleet.check()
            if reason is not None:
                print(f"fleet: {reason}; stopping", file=sys.stderr, flush=True)
                status = 1
                break
            time.sleep(0.5)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)   # a second Ctrl-C must not cut the stop short
        fleet.stop_all()
        if own_dir:
            shutil.rmtree(work, ignore_errors=True)
        print("stopped: fleet", file=sys.stderr, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
