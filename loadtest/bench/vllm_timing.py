"""Decode and prefill timings of vLLM's ``LLM.generate`` for ``python -m
loadtest.bench moe``, measured as that benchmark measures every system.

Run by vLLM's own Python (a separate environment), never imported by the
project: ``VLLM_PYTHON vllm_timing.py JOB.json``. The job holds the model
folder, the prompts (token ids) per stream count, the decode length and
the shorter run's (``short_tokens``, 1 unless given), the prefill prompt
(optional), the rounds and the dtype (float32 unless given); the last line
printed is a JSON object with the seconds of each run. Greedy, EOS ignored,
every request queued at once.
"""
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # the engine in this process


def main(job_path: str) -> None:
    from vllm import LLM, SamplingParams

    with open(job_path) as f:
        job = json.load(f)
    started = time.perf_counter()
    llm = LLM(model=job["model"], dtype=job.get("dtype", "float32"), max_model_len=job["max_model_len"],
              max_num_seqs=job["max_num_seqs"], seed=0, enable_prefix_caching=False)
    init_s = time.perf_counter() - started

    def timed(prompts, tokens):
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start

    for prompts in job["streams"].values():   # warm-up at every stream count (short prompts)
        timed([p[:8] for p in prompts], 4)
    runs = []
    for _ in range(job["rounds"]):
        for streams, prompts in job["streams"].items():
            runs.append({"streams": int(streams), "tokens": job["decode_tokens"],
                         "seconds": timed(prompts, job["decode_tokens"])})
            short = job.get("short_tokens", 1)
            runs.append({"streams": int(streams), "tokens": short, "seconds": timed(prompts, short)})
        if job.get("prefill"):
            runs.append({"prefill": len(job["prefill"]), "seconds": timed([job["prefill"]], 1)})
    print(json.dumps({"init_s": init_s, "runs": runs}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
