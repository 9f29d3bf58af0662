"""Tensor parallelism: one scheduler in the engine's process, SPMD workers beside it.

Rank 0 is the engine's own process: it holds the scheduler, the block manager
and one model shard. Ranks 1..k-1 are worker processes holding the other
shards and, for their own KV heads, the same physical KV blocks. Each step
rank 0 broadcasts the step's inputs packed in one int64 tensor (two for
large prefills) over a gloo group; every rank runs the same forward, the
row-parallel layers summing partial outputs with all-reduce (nccl on CUDA,
gloo on CPU), and only rank 0 computes logits. Workers keep no
memory-management state: block copies and swaps travel with the next step, in
the order rank 0 carried them out.

Workers start and stop with the executor. A worker that dies makes the next
step raise ``TensorParallelError`` naming the rank; a worker exits when its
parent does (its stdin pipe closes). Remote ranks for a multi-node run are
started by hand: ``python -m pagedbackend.parallel worker --rank R
--world-size K --master-addr HOST --master-port PORT`` (docs/tensor_parallel.md).
``python -m pagedbackend.parallel bench`` measures the broadcast's cost.
"""
import argparse
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
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .config import EngineConfig
from .default_model import check_model_folder, resolve_model_path
from .model_runner import DTYPES, ModelRunner, StepBatch, kv_block_bytes, resolve_device
from .models import LlamaArgs
from .models.attention import AttentionMetadata
from .models.linear import even_split, kv_heads_of_rank, query_heads_of_rank

# A collective (an all-reduce inside the forward) waits this long for a hung rank.
TIMEOUT_S = float(os.environ.get("PAGEDBACKEND_TP_TIMEOUT_S", "120"))
# Rank 0 waits this long for every worker's shard (remote ranks may start later).
RENDEZVOUS_S = float(os.environ.get("PAGEDBACKEND_TP_RENDEZVOUS_S", "900"))
# Workers wait for the next step as long as the server idles.
IDLE = timedelta(days=365)
CONFIG_KEY = "pagedbackend/config"

OP_STEP, OP_STOP = 1, 2
HEADER_LEN = 8   # op, tokens, seqs, block-table width, move words; the rest reserved
# int64 words broadcast every step: the header and, when it fits, the payload.
# One broadcast instead of two halves the per-step cost on CPU (docs/tensor_parallel.md).
MESSAGE_LEN = 4096
COPY, SWAP_OUT, SWAP_IN = 0, 1, 2
Moves = List[Tuple[int, Sequence[Tuple[int, int]]]]


class TensorParallelError(RuntimeError):
    """A rank died or a collective failed; the engine cannot continue."""


# ---- the step message ---------------------------------------------------

def pack_step(batch: StepBatch, moves: Moves) -> List[torch.Tensor]:
    """The tensors rank 0 broadcasts for one step: a fixed-size message holding
    the header and, when it fits, the payload (a decode batch of 64 sequences of
    512 tokens fits); a larger payload follows as a second tensor. Payload: token
    ids, positions, slots, cu_seqlens, seq lens, block tables, then each block
    move as (kind, n, src0, dst0, src1, dst1, ...)."""
    meta = batch.meta
    num_seqs, width = meta.block_tables.shape
    words: List[int] = []
    for kind, pairs in moves:
        words += [kind, len(pairs)]
        for src, dst in pairs:
            words += [src, dst]
    payload = torch.cat([batch.input_ids, batch.positions, meta.slot_mapping,
                         meta.cu_seqlens_q.long(), meta.seq_lens.long(),
                         meta.block_tables.long().flatten(), torch.tensor(words, dtype=torch.long)])
    message = torch.empty(MESSAGE_LEN, dtype=torch.long)
    message[:5] = torch.tensor([OP_STEP, len(batch.input_ids), num_seqs, width, len(words)])
    if len(payload) > MESSAGE_LEN - HEADER_LEN:
        return [message, payload]
    message[HEADER_LEN:HEADER_LEN + len(payload)] = payload
    return [message]


def stop_message() -> List[torch.Tensor]:
    message = torch.zeros(MESSAGE_LEN, dtype=torch.long)
    message[0] = OP_STOP
    return [message]


def receive_step(group) -> Optional[Tuple[StepBatch, Moves]]:
    """A worker's side of ``pack_step``; None when rank 0 says stop."""
    message = torch.empty(MESSAGE_LEN, dtype=torch.long)
    dist.broadcast(message, 0, group=group)
    tensors = [message]
    size = _payload_size(message)
    if size > MESSAGE_LEN - HEADER_LEN:
        tensors.append(torch.empty(size, dtype=torch.long))
        dist.broadcast(tensors[1], 0, group=group)
    return unpack_step(tensors)


def _payload_size(message: torch.Tensor) -> int:
    _, tokens, seqs, width, words = message[:5].tolist()
    return 3 * tokens + 2 * seqs + 1 + seqs * width + words


def unpack_step(tensors: List[torch.Tensor]) -> Optional[Tuple[StepBatch, Moves]]:
    """The batch (host tensors) and block moves of ``pack_step``'s tensors."""
    message = tensors[0]
    op, tokens, seqs, width, words = message[:5].tolist()
    if op == OP_STOP:
        return None
    size = _payload_size(message)
    payload = tensors[1] if len(tensors) > 1 else message[HEADER_LEN:HEADER_LEN + size]
    ids, pos, slots, cu, lens, tables, flat = payload.split(
        [tokens, tokens, tokens, seqs + 1, seqs, seqs * width, words])
    meta = AttentionMetadata(slot_mapping=slots, block_tables=tables.view(seqs, width).int(),
                             cu_seqlens_q=cu.int(), seq_lens=lens.int())
    moves: Moves = []
    flat, i = flat.tolist(), 0
    while i < len(flat):
        kind, n = flat[i], flat[i + 1]
        pairs = flat[i + 2:i + 2 + 2 * n]
        moves.append((kind, list(zip(pairs[0::2], pairs[1::2]))))
        i += 2 + 2 * n
    return StepBatch(ids, pos, meta, torch.empty(0, dtype=torch.long)), moves


def apply_moves(runner: ModelRunner, moves: Moves) -> None:
    do = {COPY: runner.copy_blocks, SWAP_OUT: runner.swap_out, SWAP_IN: runner.swap_in}
    for kind, pairs in moves:
        do[kind](pairs)


# ---- rank 0 -------------------------------------------------------------

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
        self._ranks = _Ranks(world)
        self._finalizer = weakref.finalize(self, self._ranks.close)
        try:
            self._ranks.start(config)
            # Shards load in parallel, all before the process group exists (see _Ranks.join).
            self.runner = ModelRunner(config, 0, world)
            self._ranks.join()
        except BaseException:
            self._finalizer()
            raise
        for name in ("tokenizer", "max_model_len", "num_kv_blocks", "block_size", "vocab_size",
                     "eos_token_ids", "device"):
            setattr(self, name, getattr(self.runner, name))
        self.last_broadcast_seconds = 0.0

    @property
    def worker_pids(self) -> List[int]:
        return [p.pid for p in self._ranks.procs]

    @property
    def master_port(self) -> int:
        return self._ranks.port

    def execute_model(self, entries) -> torch.Tensor:
        batch = self.runner.prepare(entries)   # bad input raises here, before any rank sees it

        def step():
            start = time.perf_counter()
            self._ranks.send(pack_step(batch, self._moves))
            self._moves = []
            self.last_broadcast_seconds = time.perf_counter() - start
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
    args = LlamaArgs.from_hf_config(check_model_folder(path))
    for rank in range(world):
        kv_heads_of_rank(args.num_kv_heads, rank, world)
        query_heads_of_rank(args.num_heads, args.num_kv_heads, rank, world)
    even_split(args.intermediate_size, 0, world, "intermediate_size")
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    # Rank 0 holds the largest KV share (kv_heads_of_rank), so the budget bounds every rank.
    heads = kv_heads_of_rank(args.num_kv_heads, 0, world)[1]
    blocks = config.kv_cache_bytes // kv_block_bytes(args, config.block_size, heads,
                                                     DTYPES[config.dtype])
    return blocks or None   # None: rank 0's runner explains what one block needs


class _Ranks:
    """Worker processes, the store and the process groups of one executor.

    Kept apart from the executor so that its finalizer can close them after
    the executor has been garbage-collected."""

    def __init__(self, world: int):
        self.world = world
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
                                   timeout=timedelta(seconds=RENDEZVOUS_S), wait_for_workers=False)
        self.port = self.store.port
        self.store.set(CONFIG_KEY, json.dumps(dataclasses.asdict(config)))
        local = int(os.environ.get("PAGEDBACKEND_TP_LOCAL_SIZE", self.world))
        first_gpu = torch.cuda.current_device() if self.device.type == "cuda" else 0
        if self.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # The local ranks share the cores; oversubscribed, each step waits on
            # spinning threads (5-10x slower on the 2-core development VM).
            self.threads_before = torch.get_num_threads()
            torch.set_num_threads(_threads_per_rank(local))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        for rank in range(1, min(local, self.world)):
            cmd = [_python(), "-m", "pagedbackend.parallel", "worker", "--rank", str(rank),
                   "--world-size", str(self.world), "--master-addr", addr,
                   "--master-port", str(self.port), "--local-size", str(local), "--watch-stdin"]
            if self.device.type == "cuda":
                cmd += ["--cuda-device", str((first_gpu + rank) % torch.cuda.device_count())]
            self.procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env))

    def join(self) -> None:
        """Wait for every worker's shard, then form the process groups.

        The groups come last on purpose: some torch modules imported while a
        model loads capture the default group for good, which would keep the
        store, and its port, alive after shutdown."""
        waiting, deadline = set(range(1, self.world)), time.monotonic() + RENDEZVOUS_S
        while waiting:
            self.raise_if_failed()
            for rank in [r for r in waiting if self.store.check([_loaded_key(r)])]:
                waiting.discard(rank)
                error = self.store.get(_loaded_key(rank)).decode()
                if error:
                    raise TensorParallelError(f"tensor-parallel rank {rank} could not load the model: {error}")
            if waiting and time.monotonic() > deadline:
                raise TensorParallelError(
                    f"tensor-parallel rank(s) {sorted(waiting)} did not load within {RENDEZVOUS_S:.0f} s "
                    f"(master {os.environ.get('MASTER_ADDR', '127.0.0.1')}:{self.port})")
            time.sleep(0.02)

        def form_groups():
            _init_groups(self.device, self.store, 0, self.world)
            # Bounded here, unbounded on the workers: rank 0 never waits forever on a hung worker.
            return _control_group(timedelta(seconds=TIMEOUT_S))
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
        if self.lock.acquire(timeout=TIMEOUT_S):
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


def _threads_per_rank(local_ranks: int) -> int:
    return max(1, (os.cpu_count() or 1) // local_ranks)


def _loaded_key(rank: int) -> str:
    return f"pagedbackend/loaded/{rank}"


def _init_groups(device: torch.device, store, rank: int, world: int) -> None:
    """The default group carries the all-reduces, with a timeout so that a hung rank fails."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_S))


def _control_group(timeout: timedelta = IDLE):
    """Gloo (CPU) group for step messages. Workers wait in it, without a
    timeout, for as long as the server idles."""
    return dist.new_group(backend="gloo", timeout=timeout)


# ---- ranks 1..k-1 ---------------------------------------------------------

def run_worker(rank: int, world: int, master_addr: str, master_port: int,
               local_size: int, cuda_device: Optional[int] = None) -> int:
    """Load this rank's shard, join the groups, then run every step rank 0 sends."""
    store = dist.TCPStore(master_addr, master_port, world, False,
                          timeout=timedelta(seconds=RENDEZVOUS_S))
    config = EngineConfig(**json.loads(store.get(CONFIG_KEY)))
    device = resolve_device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count() if cuda_device is None else cuda_device)
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(_threads_per_rank(local_size))
    try:
        runner = ModelRunner(config, rank, world)
    except Exception as exc:
        store.set(_loaded_key(rank), f"{type(exc).__name__}: {exc}")
        return 1
    store.set(_loaded_key(rank), "")
    try:
        _init_groups(device, store, rank, world)
        ctrl = _control_group()
        while True:
            step = receive_step(ctrl)
            if step is None:
                break
            batch, moves = step
            apply_moves(runner, moves)
            runner.execute_batch(batch, compute_logits=False)
    except Exception as exc:   # rank 0 has gone or stopped us; its error names the cause
        print(f"pagedbackend tensor-parallel rank {rank}: {exc!r}", file=sys.stderr, flush=True)
        return 1
    dist.destroy_process_group()
    return 0


def _exit_when_parent_dies() -> None:
    """The parent holds our stdin pipe: end of file means it has gone."""
    while os.read(0, 4096):   # raw reads: no buffered-stdin lock at interpreter exit
        pass
    os._exit(0)


# ---- broadcast cost ------------------------------------------------------

def synthetic_decode_batch(num_seqs: int, context: int, block_size: int = 16) -> StepBatch:
    """A decode step of ``num_seqs`` sequences, each ``context`` tokens long."""
    width = -(-context // block_size)
    tables = torch.arange(num_seqs * width, dtype=torch.int32).view(num_seqs, width)
    pos = torch.full((num_seqs,), context - 1, dtype=torch.long)
    slots = tables[:, -1].long() * block_size + pos % block_size
    meta = AttentionMetadata(slot_mapping=slots, block_tables=tables,
                             cu_seqlens_q=torch.arange(num_seqs + 1, dtype=torch.int32),
                             seq_lens=torch.full((num_seqs,), context, dtype=torch.int32))
    return StepBatch(torch.randint(0, 1000, (num_seqs,)), pos, meta, torch.arange(num_seqs))


def _bench_rank(rank: int, port: int, sizes: List[int], context: int, out, store=None) -> None:
    store = store or dist.TCPStore("127.0.0.1", port, 2, False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    ctrl, one = _control_group(), torch.zeros(1)
    batches = {size: synthetic_decode_batch(size, context) for size in sizes}
    times = {size: [] for size in [0] + sizes}   # 0: the all-reduce alone, the baseline
    for _ in range(BENCH_ROUNDS):   # rounds interleave the cases
        for size in times:
            start = time.perf_counter()
            for _ in range(BENCH_STEPS):
                if size and rank == 0:
                    for tensor in pack_step(batches[size], []):
                        dist.broadcast(tensor, 0, group=ctrl)
                elif size:
                    receive_step(ctrl)
                dist.all_reduce(one)   # the forward's first all-reduce waits for every rank
            times[size].append((time.perf_counter() - start) / BENCH_STEPS)
    if rank == 0:
        out.put({size: min(t) for size, t in times.items()})
    dist.destroy_process_group()


BENCH_ROUNDS, BENCH_STEPS = 15, 100


def bench_broadcast(sizes=(1, 64), context: int = 512) -> dict:
    """Per-step cost, in seconds, of the step message on two local CPU ranks
    (gloo), for decode batches of ``sizes`` sequences of ``context`` tokens
    (block size 16). ``step_s``: a step loop with the broadcast and one
    all-reduce minus the same loop with the all-reduce alone; ``pack_s``: rank
    0 packing plus a worker unpacking, without communication. Each is the best
    of 15 rounds, so that other load on the machine inflates it least."""
    import torch.multiprocessing as mp
    results = {}
    for n in sizes:
        batch, best = synthetic_decode_batch(n, context), float("inf")
        for _ in range(BENCH_ROUNDS):
            start = time.perf_counter()
            for _ in range(BENCH_STEPS):
                unpack_step(pack_step(batch, []))
            best = min(best, (time.perf_counter() - start) / BENCH_STEPS)
        results[f"batch_{n}_pack_s"] = best
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    peer = ctx.Process(target=_bench_rank, args=(1, store.port, list(sizes), context, out))
    peer.start()
    _bench_rank(0, store.port, list(sizes), context, out, store)
    steps = out.get()
    peer.join()
    results["all_reduce_s"] = steps[0]
    for n in sizes:
        results[f"batch_{n}_step_s"] = steps[n] - steps[0]
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedbackend.parallel")
    sub = parser.add_subparsers(dest="command", required=True)
    worker = sub.add_parser("worker", help="run one worker rank (rank 0 is the engine)")
    worker.add_argument("--rank", type=int, required=True)
    worker.add_argument("--world-size", type=int, required=True)
    worker.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR", "127.0.0.1"))
    worker.add_argument("--master-port", type=int, default=os.environ.get("MASTER_PORT"))
    worker.add_argument("--local-size", type=int, default=1,
                        help="ranks on this node (CPU threads are shared among them)")
    worker.add_argument("--cuda-device", type=int, default=None, help="default: rank %% GPUs")
    worker.add_argument("--watch-stdin", action="store_true", help="exit when stdin closes")
    bench = sub.add_parser("bench", help="measure the per-step broadcast cost on CPU")
    bench.add_argument("--sizes", default="1,64")
    bench.add_argument("--context", type=int, default=512)
    args = parser.parse_args(argv)
    if args.command == "bench":
        sizes = [int(n) for n in args.sizes.split(",")]
        results = bench_broadcast(sizes, args.context)
        print(f"all-reduce of one float (baseline): {results['all_reduce_s'] * 1e6:.1f} us")
        for n in sizes:
            print(f"decode batch {n:4d}, context {args.context}: broadcast adds "
                  f"{results[f'batch_{n}_step_s'] * 1e6:.1f} us per step "
                  f"(pack + unpack {results[f'batch_{n}_pack_s'] * 1e6:.1f} us)")
        return 0
    if args.master_port is None:
        parser.error("--master-port (or MASTER_PORT) is required")
    if args.watch_stdin:
        threading.Thread(target=_exit_when_parent_dies, daemon=True).start()
    return run_worker(args.rank, args.world_size, args.master_addr, args.master_port,
                      args.local_size, args.cuda_device)


if __name__ == "__main__":
    sys.exit(main())
