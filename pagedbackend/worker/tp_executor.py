"""Tensor parallelism, rank 0: the model runner interface over
``tensor_parallel_size`` ranks.

Rank 0 is the engine's own process: it holds the scheduler, the block manager
and one model shard. Ranks 1..k-1 are worker processes (``tp_worker``) holding
the other shards and, for their own KV heads, the same physical KV blocks;
they keep no memory-management state. Every rank runs the same forward and
only rank 0 computes logits.

Workers start and stop with the executor. A worker that dies makes the next
step raise ``TensorParallelError`` naming the rank; a worker exits when its
parent does (its stdin pipe closes).
"""
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from datetime import timedelta
from typing import List, Optional

import torch
import torch.distributed as dist

from pagedbackend.config import EngineConfig
from pagedbackend.core.kv_groups import kv_layout
from pagedbackend.models import model_args
from pagedbackend.models.default_model import check_model_folder, resolve_model_path
from pagedbackend.models.linear import even_split, kv_heads_of_rank, query_heads_of_rank
from pagedbackend.dtype_choice import resolve_dtype
from pagedbackend.kernels.kv_cache_dtype import cache_dtype, check_head_dim
from pagedbackend.worker.loader import DTYPES, kv_block_bytes, resolve_device
from pagedbackend.worker.model_runner import ModelRunner
from pagedbackend.worker.tp_protocol import (COPY, CONFIG_KEY, SWAP_IN, SWAP_OUT, Moves,
                                             TensorParallelError, control_group, init_groups,
                                             loaded_key, pack_step, stop_message, threads_per_rank)

class TensorParallelExecutor:
    """The model runner interface over ``tensor_parallel_size`` ranks; this
    process is rank 0 and starts the others."""

    def __init__(self, config: EngineConfig):
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group already exists in this process "
                               "(another tensor-parallel engine?); shut it down first")
        world = config.tensor_parallel_size
        self.model_path = resolve_model_path(config.model)
        # Rank 0 decides the pool size; every rank allocates exactly this many blocks.
        config = dataclasses.replace(config, model=str(self.model_path),
                                     num_kv_blocks=_plan_kv_blocks(config, self.model_path, world))
        self.config = config
        self._moves: Moves = []
        self._ranks = _Ranks(world, config.tp_timeout_s, config.tp_rendezvous_s)
        self._finalizer = weakref.finalize(self, self._ranks.close)
        try:
            self._ranks.start(config)
            # Shards load in parallel, all before the process group exists (see _Ranks.join).
            self.runner = ModelRunner(config, 0, world)
            self._ranks.join()
        except BaseException:
            self._finalizer()
            raise

    # The executor contract (worker.executor.Executor), rank 0's facts.
    max_model_len = property(lambda self: self.runner.max_model_len)
    num_kv_blocks = property(lambda self: self.runner.num_kv_blocks)
    block_size = property(lambda self: self.runner.block_size)
    vocab_size = property(lambda self: self.runner.vocab_size)
    hidden_size = property(lambda self: self.runner.hidden_size)
    device = property(lambda self: self.runner.device)
    kv_layout = property(lambda self: self.runner.kv_layout)
    lora = None   # adapters are not split over ranks (EngineConfig refuses enable_lora here)
    compiled_step = False   # a tensor-parallel step runs eager
    cpu_contended = property(lambda self: self.runner.cpu_contended)

    def wait_for_compile(self, timeout: Optional[float] = None) -> bool:
        return False

    def describe(self):
        return self.runner.describe()

    @property
    def worker_pids(self) -> List[int]:
        return [p.pid for p in self._ranks.procs]

    @property
    def master_port(self) -> int:
        return self._ranks.port

    def execute_model(self, entries, hidden_out=None) -> torch.Tensor:
        if hidden_out is not None:   # LLMEngine refuses embedding requests here
            raise ValueError("hidden states (pooling) are served with tensor_parallel_size=1")
        batch = self.runner.prepare(entries)   # bad input raises here, before any rank sees it

        def step():
            self._ranks.send(pack_step(batch, self._moves))
            self._moves = []
            return self.runner.execute_batch(batch)
        return self._ranks.run(step)

    # Rank 0 moves its blocks now; the workers move theirs before the next forward.
    def copy_blocks(self, pairs) -> None:
        self._move(COPY, self.runner.copy_blocks, pairs)

    def swap_out(self, pairs) -> None:
        self._move(SWAP_OUT, self.runner.swap_out, pairs)

    def swap_in(self, pairs) -> None:
        self._move(SWAP_IN, self.runner.swap_in, pairs)

    def _move(self, kind: int, local, pairs) -> None:
        if pairs:
            self._ranks.raise_if_failed()
            local(pairs)
            self._moves.append((kind, [(int(s), int(d)) for s, d in pairs]))

    def shutdown(self) -> None:
        """Stop the workers and release the process group and its port (idempotent)."""
        self._finalizer()


def _plan_kv_blocks(config: EngineConfig, path, world: int) -> Optional[int]:
    """Check, before any process starts, that the model splits over ``world``
    ranks; then decide the pool size for every rank."""
    args = model_args(check_model_folder(path))
    for rank in range(world):
        kv_heads_of_rank(args.num_kv_heads, rank, world)
        query_heads_of_rank(args.num_heads, args.num_kv_heads, rank, world)
    moe = getattr(args, "moe", None)
    if moe is None or not all(args.sparse_layers):   # dense MLPs split their intermediate features
        even_split(args.intermediate_size, 0, world, "intermediate_size")
    if moe is not None:   # experts split whole (expert parallelism) or by their intermediate features
        if config.enable_expert_parallel:
            even_split(moe.num_experts, 0, world, "num_experts (enable_expert_parallel)")
        else:
            even_split(moe.intermediate_size, 0, world, "the experts' intermediate size")
    # Every rank holds its own heads' rows in the cache's format (kv_cache_dtype).
    kv_dtype = cache_dtype(config.kv_cache_dtype, DTYPES[resolve_dtype(config.dtype, path, config.device)])
    check_head_dim(args.head_dim, kv_dtype)
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    # Rank 0 holds the largest KV share (kv_heads_of_rank), so the budget bounds every rank.
    heads = kv_heads_of_rank(args.num_kv_heads, 0, world)[1]
    layout = kv_layout(args.layer_windows,
                       free_out_of_window=not config.disable_hybrid_kv_cache_manager)
    blocks = config.kv_cache_bytes // kv_block_bytes(args, config.block_size, heads, kv_dtype, layers=layout.slots)
    return blocks or None   # None: rank 0's runner explains what one block needs


class _Ranks:
    """Worker processes, the store and the process groups of one executor.

    Kept apart from the executor so that its finalizer can close them after
    the executor has been garbage-collected."""

    def __init__(self, world: int, timeout_s: float, rendezvous_s: float):
        self.world, self.timeout_s, self.rendezvous_s = world, timeout_s, rendezvous_s
        self.procs: List[subprocess.Popen] = []
        self.store = self.ctrl = self.port = self.device = None
        self.threads_before: Optional[int] = None
        self.lock = threading.Lock()
        self.error: Optional[TensorParallelError] = None
        self.closed = False

    def start(self, config: EngineConfig) -> None:
        """Open the store (it carries the config and each rank's load status) and
        start the local workers."""
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        self.device = resolve_device(config.device)
        # Port 0 lets the store pick a free port: no race with other servers.
        self.store = dist.TCPStore(addr, int(os.environ.get("MASTER_PORT", "0")), self.world, True,
                                   timeout=timedelta(seconds=self.rendezvous_s), wait_for_workers=False)
        self.port = self.store.port
        self.store.set(CONFIG_KEY, json.dumps(dataclasses.asdict(config)))
        local = config.tp_local_size or self.world
        first_gpu = torch.cuda.current_device() if self.device.type == "cuda" else 0
        if self.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # The local ranks share the cores; oversubscribed, each step waits on
            # spinning threads (5-10x slower on the 2-core development VM).
            self.threads_before = torch.get_num_threads()
            torch.set_num_threads(threads_per_rank(local))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        for rank in range(1, min(local, self.world)):
            cmd = [_python(), "-m", "pagedbackend.worker.tp_worker", "--rank", str(rank),
                   "--world-size", str(self.world), "--master-addr", addr,
                   "--master-port", str(self.port), "--local-size", str(local),
                   "--rendezvous-s", repr(self.rendezvous_s), "--watch-stdin"]
            if self.device.type == "cuda":
                cmd += ["--cuda-device", str((first_gpu + rank) % torch.cuda.device_count())]
            self.procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env))

    def join(self) -> None:
        """Wait for every worker's shard, then form the process groups.

        The groups come last on purpose: some torch modules imported while a
        model loads capture the default group for good, which would keep the
        store, and its port, alive after shutdown."""
        waiting, deadline = set(range(1, self.world)), time.monotonic() + self.rendezvous_s
        while waiting:
            self.raise_if_failed()
            for rank in [r for r in waiting if self.store.check([loaded_key(r)])]:
                waiting.discard(rank)
                error = self.store.get(loaded_key(rank)).decode()
                if error:
                    raise TensorParallelError(f"tensor-parallel rank {rank} could not load the model: {error}")
            if waiting and time.monotonic() > deadline:
                raise TensorParallelError(
                    f"tensor-parallel rank(s) {sorted(waiting)} did not load within {self.rendezvous_s:.0f} s "
                    f"(master {os.environ.get('MASTER_ADDR', '127.0.0.1')}:{self.port})")
            time.sleep(0.02)

        def form_groups():
            init_groups(self.device, self.store, 0, self.world, self.timeout_s)
            # Bounded here, unbounded on the workers: rank 0 never waits forever on a hung worker.
            return control_group(timedelta(seconds=self.timeout_s))
        self.ctrl = self.run(form_groups)

    def send(self, tensors: List[torch.Tensor]) -> None:
        for tensor in tensors:
            dist.broadcast(tensor, 0, group=self.ctrl)

    def run(self, collective):
        """``collective()`` with the other ranks, one at a time; a failure stops
        every rank and raises ``TensorParallelError``."""
        with self.lock:
            self.raise_if_failed()
            try:
                return collective()
            except BaseException as exc:
                self.fail(exc)
                if not isinstance(exc, Exception):
                    raise
        # Raised outside the handler on purpose: the failed collective's frames
        # hold the process group, and with it the store's port, for as long as
        # an exception chained to them lives.
        raise self.error.with_traceback(None)

    def raise_if_failed(self) -> None:
        if self.error is None and any(p.poll() is not None for p in self.procs):
            self.fail(None)
        if self.error is not None:
            raise self.error.with_traceback(None)

    def fail(self, cause: Optional[BaseException]) -> TensorParallelError:
        """Name the dead ranks (waiting briefly for them to be reaped) and stop the rest."""
        deadline = time.monotonic() + 2.0
        dead = []
        while not dead and time.monotonic() < deadline:
            dead = [(r, p) for r, p in enumerate(self.procs, start=1) if p.poll() is not None]
            time.sleep(0.02)
        if dead:
            what = "; ".join(f"rank {r} (pid {p.pid}) {_exit_reason(p.returncode)}" for r, p in dead)
            message = f"tensor-parallel worker died: {what}"
        else:
            message = f"tensor-parallel step failed: {cause!r}"
        self.error = TensorParallelError(message + "; the engine has stopped all ranks")
        self._stop(graceful=False)
        return self.error

    def close(self) -> None:
        if self.lock.acquire(timeout=self.timeout_s):
            try:
                self._stop(graceful=self.error is None)
            finally:
                self.lock.release()
        else:   # a step is stuck in a collective: end the workers so that it fails
            for proc in self.procs:
                proc.kill()
        if self.error is None:
            self.error = TensorParallelError("the tensor-parallel executor is shut down")

    def _stop(self, graceful: bool) -> None:
        if self.closed:
            return
        self.closed = True
        if graceful and self.ctrl is not None:
            try:
                self.send(stop_message())
            except Exception:
                graceful = False
        for proc in self.procs:
            if not graceful or self.ctrl is None:
                proc.kill()   # workers hold nothing worth saving; a hung one ignores SIGTERM
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdin is not None:
                proc.stdin.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.ctrl = self.store = None   # the last reference: the port is released
        if self.threads_before is not None:
            torch.set_num_threads(self.threads_before)


def _exit_reason(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _python() -> str:
    """This interpreter (inside Triton's Python backend stub, the environment's python)."""
    if os.path.basename(sys.executable or "").startswith("python"):
        return sys.executable
    for name in ("python3", "python"):
        candidate = os.path.join(sys.prefix, "bin", name)
        if os.access(candidate, os.X_OK):
            return candidate
    raise RuntimeError(f"cannot find a python interpreter to start workers (sys.prefix {sys.prefix})")
