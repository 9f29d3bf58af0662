"""Offline run of vLLM's ``LLM.generate`` for ``python -m loadtest.bench peers``.

Run by vLLM's own Python (a separate environment), never imported by the
project: ``VLLM_PYTHON vllm_offline.py JOB.json``. The job holds the model
folder, the prompts as token ids, the output lengths and the batch cap; the
last line printed is a JSON object with the timed run's seconds and tokens.
Greedy, EOS ignored, every request queued at once, after a warm-up: the
job's ``warm_prompts`` all at once for ``warm_tokens`` tokens each.
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
    llm = LLM(model=job["model"], dtype="float32", max_model_len=job["max_model_len"],
              max_num_seqs=job["max_num_seqs"], seed=0)
    init_s = time.perf_counter() - started
    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    warm = SamplingParams(max_tokens=job.get("warm_tokens", 4), temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": ids} for ids in job.get("warm_prompts", job["prompts"][:1])],
                 warm, use_tqdm=False)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in job["lengths"]]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    print(json.dumps({"seconds": seconds, "init_s": init_s, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
