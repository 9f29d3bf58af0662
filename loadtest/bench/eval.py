"""EleutherAI's lm-evaluation-harness against our OpenAI API, beside its own
``hf`` model on the same weights offline: per-request log-likelihoods and
accuracy on a multiple-choice task whose data ships in the repository
(``loadtest/data/mc_questions.jsonl``: 40 generated questions, capitals and
sums; no download).

lm-eval runs in a virtual environment of its own (``--lm-eval`` or
``BENCH_LM_EVAL`` names its ``lm_eval`` command; without one it is installed on
demand into ``$PAGEDBACKEND_CACHE/lm-eval-venv`` beside the CPU torch; never
part of ``make setup``). The served model is the shipped configuration behind
``make serve``'s OpenAI API; lm-eval's ``local-completions`` sends every
choice as token ids with ``echo``, ``logprobs: 1`` and ``max_tokens: 0``.
"""
import argparse
import json
import os
import pathlib
import subprocess
import tempfile
from typing import Dict, List

from .common import tool_command, write_result

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "mc_questions.jsonl"
LM_EVAL_VERSION = "0.4.13"
TASK = "pagedbackend_mc"
TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def run_lm_eval(lm_eval: str, model: str, model_args: str, include: pathlib.Path, out: pathlib.Path,
                limit, extra=()) -> List[dict]:
    command = [lm_eval, "--model", model, "--model_args", model_args, "--tasks", TASK,
               "--include_path", str(include), "--output_path", str(out), "--log_samples",
               "--batch_size", "1", *extra]
    if limit:
        command += ["--limit", str(limit)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    samples = sorted(out.rglob(f"samples_{TASK}_*.jsonl"))
    if done.returncode != 0 or not samples:
        raise RuntimeError(f"lm_eval ({model}) exited with {done.returncode}: {(done.stdout + done.stderr)[-3000:]}")
    return [json.loads(line) for line in samples[-1].read_text().splitlines() if line.strip()]


def loglikelihoods(samples: List[dict]) -> Dict[int, List[float]]:
    """Per document, the log-likelihood of each choice."""
    return {s["doc_id"]: [float(r[0][0]) for r in s["resps"]] for s in samples}


def accuracy(samples: List[dict]) -> float:
    return sum(float(s["acc"]) for s in samples) / len(samples)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm-eval", default=os.environ.get("BENCH_LM_EVAL"), help="the lm_eval command")
    ap.add_argument("--limit", type=int, default=None, help="documents (default all 40)")
    ap.add_argument("--out", default="results/bench")
    ap.add_argument("--quick", action="store_true", help="4 documents")
    args = ap.parse_args(argv)
    if args.quick:
        args.limit = 4
    from loadtest.bench.aiperf import _Ours
    from pagedbackend.models.default_model import resolve_model_path
    from loadtest.harness.triton import free_port
    folder = str(resolve_model_path("default"))
    # The CPU torch first: lm-eval would otherwise pull a CUDA build. hf: transformers for
    # local-completions' tokenizer and for the offline model.
    lm_eval = tool_command(args.lm_eval, "lm-eval-venv", "lm_eval",
                           [["torch==2.13.0"], [f"lm-eval[api,hf]=={LM_EVAL_VERSION}"]])
    with tempfile.TemporaryDirectory(prefix="bench-eval-") as tmp:
        include = pathlib.Path(tmp) / "tasks"
        include.mkdir()
        (include / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=DATA))
        port = free_port()
        with _Ours("default", port, 2):
            served = run_lm_eval(lm_eval, "local-completions",
                                 f"model=paged_llm,base_url=http://127.0.0.1:{port}/v1/completions,"
                                 f"tokenizer_backend=huggingface,tokenizer={folder},tokenized_requests=True,"
                                 "num_concurrent=4,max_retries=1", include, pathlib.Path(tmp) / "served",
                                 args.limit)
        offline = run_lm_eval(lm_eval, "hf", f"pretrained={folder},dtype=float32", include,
                              pathlib.Path(tmp) / "hf", args.limit, ["--device", "cpu"])
    ours, reference = loglikelihoods(served), loglikelihoods(offline)
    differences = [abs(a - b) for doc in reference for a, b in zip(ours[doc], reference[doc])]
    result = {"documents": len(reference), "choices": len(differences),
              "max_abs_loglikelihood_difference": max(differences),
              "accuracy_served": accuracy(served), "accuracy_hf": accuracy(offline),
              "same_accuracy": accuracy(served) == accuracy(offline),
              "within_1e-3": max(differences) <= 1e-3, "lm_eval": LM_EVAL_VERSION, "data": str(DATA.name)}
    print(json.dumps(result), flush=True)
    path = write_result(args.out, "eval", result)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
