"""Mixture-of-experts families generate what Hugging Face generates (greedy,
fp32) on tiny random checkpoints saved by transformers: batched, through each
expert kernel, with prefix-cache hits, under preemption by recompute and by
swap, on two tensor-parallel ranks (experts split by their intermediate
features or whole), compiled; beam search, n-gram speculation, sampling and
structured outputs run on them; quantisation is refused by name."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from loadtest.moe_model import build_tiny_moe
from pagedbackend import LLM, SamplingParams
from pagedbackend.kernels import moe_cpu
from pagedbackend.worker.compiled import compile_unavailable

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0.0)
EAGER = dict(compile=False, device="cpu")
PACKED = [] if moe_cpu.unavailable(torch.device("cpu"), torch.float32) else ["packed"]


def prompts_of(seed: int, lengths=(5, 23, 61)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]


def reference(name, tmp_path_factory):
    """(name, folder, the HF model, prompts, HF's greedy tokens for them)."""
    folder = build_tiny_moe(tmp_path_factory.mktemp(name), name)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = prompts_of(1)
    return name, folder, hf, prompts, [hf_greedy(hf, p) for p in prompts]


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return reference("qwen3_moe", tmp_path_factory)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return reference("mixtral", tmp_path_factory)


@pytest.fixture(params=["qwen3_moe", "mixtral"])
def family(request):
    return request.getfixturevalue(request.param)


def hf_greedy(hf, prompt, max_tokens=MAX_TOKENS):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                          do_sample=False, pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def greedy(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("kernel", PACKED + ["torch"])
def test_batched_greedy_equals_hugging_face(family, kernel):
    _, folder, _, prompts, expected = family
    with LLM(str(folder), moe_backend=kernel, num_kv_blocks=64, **EAGER) as llm:
        assert llm.engine.runner.moe_kernel == kernel
        assert greedy(llm, prompts) == expected
    assert len({tuple(t) for t in expected}) == len(expected)   # outputs differ: a real check


def test_prefix_cache_hits_keep_the_tokens(family):
    _, folder, hf, _, _ = family
    shared = prompts_of(2, (40,))[0]
    prompts = [shared + tail for tail in prompts_of(3, (3, 9))]
    with LLM(str(folder), num_kv_blocks=64, block_size=8, enable_prefix_caching=True, **EAGER) as llm:
        first = greedy(llm, prompts[:1])
        second = greedy(llm, prompts)   # the shared 40 tokens (5 blocks) come from the cache
        hits = llm.engine.get_stats().prefix_cache_hits
    assert hits >= 2 * 40 - 8
    assert first + second[1:] == [hf_greedy(hf, p) for p in prompts] and second[0] == first[0]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_the_tokens(family, mode):
    _, folder, hf, _, _ = family
    prompts = prompts_of(4, (30, 35, 40, 45))
    # Four sequences of up to 55 tokens need about 28 blocks of 8; 12 force preemption.
    with LLM(str(folder), num_kv_blocks=12, block_size=8, preemption_mode=mode,
             swap_space_blocks=32 if mode == "swap" else 0, **EAGER) as llm:
        got = greedy(llm, prompts)
        stats = llm.engine.get_stats()
    assert (stats.num_swap_preemptions if mode == "swap" else stats.num_recompute_preemptions) > 0
    assert got == [hf_greedy(hf, p) for p in prompts]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name, expert_parallel", [("qwen3_moe", False), ("mixtral", True)])
def test_two_ranks_generate_what_hugging_face_generates(request, name, expert_parallel):
    # Qwen3-MoE's experts split by their intermediate features (and its dense
    # layer as a dense MLP splits); Mixtral's whole, two experts per rank.
    _, folder, _, prompts, expected = request.getfixturevalue(name)
    with LLM(str(folder), tensor_parallel_size=2, enable_expert_parallel=expert_parallel, num_kv_blocks=64,
             **EAGER) as llm:
        assert greedy(llm, prompts) == expected


NO_COMPILER = compile_unavailable(torch.device("cpu"))


@pytest.mark.skipif(NO_COMPILER is not None, reason=f"torch.compile cannot run here: {NO_COMPILER}")
def test_compiled_step_equals_hugging_face(qwen3_moe):
    # One family compiled: the expert operators are the same for every family.
    _, folder, _, prompts, expected = qwen3_moe
    with LLM(str(folder), num_kv_blocks=64, compile=True, device="cpu") as llm:
        assert llm.engine.runner.compiled is not None
        assert greedy(llm, prompts) == expected


def test_beam_search_ngram_speculation_sampling_and_structured_outputs_run_on_experts(family):
    name, folder, hf, prompts, expected = family
    prompt = prompts[1]
    with LLM(str(folder), num_kv_blocks=64, block_size=8, **EAGER) as llm:
        beams = llm.generate([prompt], SamplingParams(n=2, best_of=2, use_beam_search=True, temperature=0.0,
                                                      max_tokens=8, ignore_eos=True))[0].outputs
        sampled = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6))[0].outputs
        chosen = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, structured_outputs={
            "choice": ["red", "green", "blue"]}))[0].outputs[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), num_beams=2, num_return_sequences=2, do_sample=False,
                          max_new_tokens=8, min_new_tokens=8, early_stopping=False, length_penalty=1.0,
                          pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert [o.token_ids for o in beams] == [r[len(prompt):].tolist() for r in ref]
    assert len(sampled) == 3 and all(len(o.token_ids) >= 1 for o in sampled)
    assert chosen.text in ("red", "green", "blue")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 0}
    with LLM(str(folder), num_kv_blocks=64, speculative_config=spec, **EAGER) as llm:
        assert greedy(llm, prompts) == expected


@pytest.mark.parametrize("quantization", ["int8"])
def test_quantisation_is_refused_by_name(family, quantization):
    _, folder, _, _, _ = family
    with pytest.raises(ValueError, match=f"quantization={quantization} does not cover the expert weights"):
        LLM(str(folder), quantization=quantization, num_kv_blocks=16, **EAGER)
