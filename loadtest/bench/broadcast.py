"""Tensor parallelism: what the per-step broadcast of the step message costs
on two local CPU ranks (gloo), against an all-reduce alone.

``python -m loadtest.bench broadcast [--sizes 1,64] [--context 512]``
"""
import argparse
import time
from typing import List

import torch
import torch.distributed as dist

from pagedbackend.models.attention import AttentionMetadata
from pagedbackend.worker.batch import StepBatch
from pagedbackend.worker.tp_protocol import control_group, pack_step, receive_step, unpack_step


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
    ctrl, one = control_group(), torch.zeros(1)
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
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench broadcast", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--quick", action="store_true", help="decode batch of 1 only")
    parser.add_argument("--out", help="ignored (prints only)")
    args = parser.parse_args(argv)
    sizes = [1] if args.quick else [int(n) for n in args.sizes.split(",")]
    results = bench_broadcast(sizes, args.context)
    print(f"all-reduce of one float (baseline): {results['all_reduce_s'] * 1e6:.1f} us")
    for n in sizes:
        print(f"decode batch {n:4d}, context {args.context}: broadcast adds "
              f"{results[f'batch_{n}_step_s'] * 1e6:.1f} us per step "
              f"(pack + unpack {results[f'batch_{n}_pack_s'] * 1e6:.1f} us)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
