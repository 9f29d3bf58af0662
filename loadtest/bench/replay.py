"""Replay a trace through an ``LLMEngine``: requests arrive at their trace times
(real time, one thread: add what has arrived, step, repeat) or all at once, and
the engine's ledger is sampled after every step.

Used by the memory, capacity and block-size benchmarks; it drives the engine
directly so that the scheduler, not a request thread, decides the batch.
"""
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

from pagedbackend import SamplingParams


@dataclass
class Job:
    """One request of a replay: when it arrives (seconds from the start) and what it asks."""

    request_id: str
    prompt: Union[str, List[int]]
    max_tokens: int
    arrival: float = 0.0


@dataclass
class RequestRecord:
    request_id: str
    arrival: float                 # seconds from the start of the replay
    requested_tokens: int          # max_tokens (EOS ignored: what it will generate)
    output_tokens: int             # generated
    finished: bool                 # False: cut off by the time limit
    latency: float                 # arrival -> last token (or -> the time limit)
    ttft: Optional[float]          # arrival -> first token

    @property
    def normalised_latency(self) -> float:
        """End-to-end latency per output token (the paper's Figure 12 measure).
        For a request cut off by the time limit it is a lower bound."""
        return self.latency / self.requested_tokens


@dataclass
class ReplayResult:
    requests: List[RequestRecord]
    seconds: float                  # wall time of the replay
    steps: int
    timed_out: bool
    # Per step, sampled right after it: running sequences, positions holding
    # K/V, and positions allocated (used blocks x block size).
    running: List[int] = field(default_factory=list)
    stored: List[int] = field(default_factory=list)
    allocated: List[int] = field(default_factory=list)
    step_seconds: List[float] = field(default_factory=list)
    preemptions: int = 0

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.requests)

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    @property
    def mean_running(self) -> float:
        """Running sequences, averaged over steps weighted by step time."""
        total = sum(self.step_seconds)
        if not total:
            return 0.0
        return sum(n * s for n, s in zip(self.running, self.step_seconds)) / total

    @property
    def utilisation(self) -> float:
        """Stored / allocated positions, both averaged over steps."""
        return sum(self.stored) / sum(self.allocated) if sum(self.allocated) else 0.0

    @property
    def mean_step_utilisation(self) -> float:
        """The per-step ratio stored / allocated, averaged over steps."""
        ratios = [s / a for s, a in zip(self.stored, self.allocated) if a]
        return statistics.fmean(ratios) if ratios else 0.0

    def mean_normalised_latency(self) -> float:
        return statistics.fmean(r.normalised_latency for r in self.requests) if self.requests else math.nan

    def summary(self) -> dict:
        finished = [r for r in self.requests if r.finished]
        ttfts = [r.ttft for r in finished if r.ttft is not None]
        return {"requests": len(self.requests), "finished": len(finished),
                "timed_out": self.timed_out, "seconds": round(self.seconds, 3), "steps": self.steps,
                "output_tokens": self.output_tokens,
                "output_tokens_per_s": round(self.tokens_per_second, 2),
                "requests_per_s": round(len(finished) / self.seconds, 3) if self.seconds else 0.0,
                "normalised_latency_s": round(self.mean_normalised_latency(), 5),
                "median_ttft_s": round(statistics.median(ttfts), 4) if ttfts else None,
                "mean_running": round(self.mean_running, 2),
                "utilisation": round(self.utilisation, 4),
                "mean_step_utilisation": round(self.mean_step_utilisation, 4),
                "preemptions": self.preemptions}


def jobs_from_trace(trace, prompts, arrivals: Optional[Sequence[float]] = None,
                    prefix: str = "r") -> List[Job]:
    """Jobs for a workload trace: its prompts, its output lengths, its arrival times."""
    arrivals = arrivals if arrivals is not None else [0.0] * len(trace)
    return [Job(f"{prefix}{i}", p, r.output_len, a)
            for i, (r, p, a) in enumerate(zip(trace, prompts, arrivals))]


def running_sequences(engine) -> int:
    return sum(len(g.seqs) for g in engine.scheduler.running)


def replay(engine, jobs: Sequence[Job], realtime: bool = True, time_limit: Optional[float] = None,
           max_steps: int = 10_000_000) -> ReplayResult:
    """Run ``jobs`` through ``engine`` until all finish, ``time_limit`` seconds
    pass (the rest are aborted and recorded as unfinished) or ``max_steps``.

    Every job generates exactly ``max_tokens`` tokens (greedy, EOS ignored), so
    all schemes and runs do the same work."""
    pending = sorted(jobs, key=lambda j: j.arrival)
    by_id = {j.request_id: j for j in pending}
    bm = engine.block_manager
    sch = engine.scheduler
    preempted_before = sch.num_swap_preemptions + sch.num_recompute_preemptions
    t0_wall, t0 = time.time(), time.perf_counter()
    records: List[RequestRecord] = []
    result = ReplayResult(records, 0.0, 0, False)
    nxt = 0
    for _ in range(max_steps):
        now = time.perf_counter() - t0
        if time_limit is not None and now > time_limit:
            result.timed_out = True
            break
        while nxt < len(pending) and (not realtime or pending[nxt].arrival <= now):
            job = pending[nxt]
            arrival = job.arrival if realtime else now
            params = SamplingParams(temperature=0.0, max_tokens=job.max_tokens, ignore_eos=True)
            engine.add_request(job.request_id, job.prompt, params, arrival_time=t0_wall + arrival)
            nxt += 1
        if not engine.has_unfinished_requests():
            if nxt == len(pending):
                break
            time.sleep(max(0.0, min(pending[nxt].arrival - now, 0.05)))
            continue
        outputs = engine.step()
        result.steps += 1
        result.step_seconds.append(engine.last_step_seconds)
        result.running.append(running_sequences(engine))
        result.stored.append(bm.stored_positions())
        result.allocated.append(bm.num_used_blocks * bm.block_size)
        for out in outputs:
            if out.finished:
                records.append(_record(by_id[out.request_id], out, t0_wall, finished=out.error is None))
    else:
        result.timed_out = True
    end_wall = time.time()
    for group_id in list(engine.groups):   # time limit: count what did not finish
        out = engine.abort_request(group_id)
        records.append(_record(by_id[group_id], out, t0_wall, finished=False, end=end_wall))
    result.seconds = time.perf_counter() - t0
    result.preemptions = sch.num_swap_preemptions + sch.num_recompute_preemptions - preempted_before
    return result


def _record(job: Job, out, t0_wall: float, finished: bool, end: Optional[float] = None) -> RequestRecord:
    m = out.metrics
    arrival = m.arrival_time if m is not None else t0_wall + job.arrival
    done = end if end is not None else (m.finished_time if m and m.finished_time else time.time())
    first = m.first_token_time if m is not None else None
    tokens = out.outputs[0].num_tokens if out.outputs else 0
    return RequestRecord(job.request_id, arrival - t0_wall, job.max_tokens, tokens, finished,
                         done - arrival, None if first is None else first - arrival)
