"""Tensor parallelism, ranks 1..k-1: load a shard, then run every step
rank 0 broadcasts until it says stop.

Local workers are started by rank 0 (``tp_executor``). Remote ranks for a
multi-node run are started by hand: ``python -m pagedbackend.worker.tp_worker
--rank R --world-size K --master-addr HOST --master-port PORT``
(docs/tensor_parallel.md).
"""
import argparse
import json
import os
import signal
import sys
import threading
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from pagedbackend.config import EngineConfig
from pagedbackend.worker.loader import resolve_device
from pagedbackend.worker.model_runner import ModelRunner
from pagedbackend.worker.tp_protocol import (CONFIG_KEY, apply_moves, control_group, init_groups,
                                             loaded_key, receive_step, threads_per_rank)


def run_worker(rank: int, world: int, master_addr: str, master_port: int, local_size: int,
               cuda_device: Optional[int] = None,
               rendezvous_s: float = EngineConfig.tp_rendezvous_s) -> int:
    """Load this rank's shard, join the groups, then run every step rank 0
    sends. ``rendezvous_s``: how long to wait for rank 0's store, before its
    config (which says the rest) can be read."""
    store = dist.TCPStore(master_addr, master_port, world, False,
                          timeout=timedelta(seconds=rendezvous_s))
    config = EngineConfig(**json.loads(store.get(CONFIG_KEY)))
    device = resolve_device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count() if cuda_device is None else cuda_device)
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(threads_per_rank(local_size))
    try:
        runner = ModelRunner(config, rank, world)
    except Exception as exc:
        store.set(loaded_key(rank), f"{type(exc).__name__}: {exc}")
        return 1
    store.set(loaded_key(rank), "")
    try:
        init_groups(device, store, rank, world, config.tp_timeout_s)
        ctrl = control_group()
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedbackend.worker.tp_worker",
                                     description="run one tensor-parallel worker rank (rank 0 is the engine)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR", "127.0.0.1"))
    parser.add_argument("--master-port", type=int, default=os.environ.get("MASTER_PORT"))
    parser.add_argument("--local-size", type=int, default=1,
                        help="ranks on this node (CPU threads are shared among them)")
    parser.add_argument("--cuda-device", type=int, default=None, help="default: rank %% GPUs")
    parser.add_argument("--rendezvous-s", type=float, default=EngineConfig.tp_rendezvous_s,
                        help="how long to wait for rank 0's store (default: EngineConfig.tp_rendezvous_s, "
                             "%(default)s; local workers get rank 0's)")
    parser.add_argument("--watch-stdin", action="store_true", help="exit when stdin closes")
    args = parser.parse_args(argv)
    if args.master_port is None:
        parser.error("--master-port (or MASTER_PORT) is required")
    if args.watch_stdin:
        # A local worker ends when rank 0 stops it or its stdin closes, not on
        # the SIGTERM that the launcher sends to the server's process group
        # (the engine drains first, then stops its workers).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        threading.Thread(target=_exit_when_parent_dies, daemon=True).start()
    return run_worker(args.rank, args.world_size, args.master_addr, args.master_port,
                      args.local_size, args.cuda_device, args.rendezvous_s)


if __name__ == "__main__":
    sys.exit(main())
