"""Mixture-of-experts families (Qwen3-MoE, Mixtral, gpt-oss) generate what
Hugging Face generates (greedy, fp32) on tiny random checkpoints saved by
transformers: batched, with prefix-cache hits, under preemption by recompute
and by swap, on two tensor-parallel ranks (experts split by their
intermediate features or whole), compiled; gpt-oss beyond its 128-position
window with non-zero sinks, and from MXFP4 experts as published. Beam search,
n-gram speculation, sampling and structured outputs run on experts;
quantisation is refused by name."""
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from loadtest.moe_model import build_tiny_moe, write_mxfp4_copy
from pagedbackend import LLM, SamplingParams
from pagedbackend.worker.compiled import compile_unavailable

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0.0)
EAGER = dict(compile=False, device="cpu")
# gpt-oss's prompts cross its 128-position window (every other layer attends to its last 128 positions).
PROMPT_LENGTHS = {"qwen3_moe": (5, 23, 61), "mixtral": (5, 23, 61), "gpt_oss": (5, 70, 150)}


def prompts_of(seed: int, lengths):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(hf, prompt, max_tokens=MAX_TOKENS):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                          do_sample=False, pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def greedy(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


class Family:
    """A tiny checkpoint of one family, its HF model and HF's greedy tokens for ``prompts``."""

    def __init__(self, name, tmp_path_factory):
        self.name = name
        self.folder = build_tiny_moe(tmp_path_factory.mktemp(name), name)
        self.hf = AutoModelForCausalLM.from_pretrained(self.folder, dtype=torch.float32).eval()
        self.prompts = prompts_of(1, PROMPT_LENGTHS[name])
        self.expected = [hf_greedy(self.hf, p) for p in self.prompts]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    built = {}

    def get(name):
        if name not in built:
            built[name] = Family(name, tmp_path_factory)
        return built[name]
    return get


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_batched_greedy_and_prefix_cache_hits_equal_hugging_face(families, name):
    family = families(name)
    shared = prompts_of(2, (40,))[0]
    with_prefix = [shared + tail for tail in prompts_of(3, (3, 9))]
    with LLM(str(family.folder), num_kv_blocks=96, block_size=8, enable_prefix_caching=True, **EAGER) as llm:
        assert llm.engine.runner.moe_kernel in ("packed", "torch")
        assert greedy(llm, family.prompts) == family.expected
        first = greedy(llm, with_prefix[:1])
        second = greedy(llm, with_prefix)   # the shared 40 tokens (5 blocks) come from the cache
        hits = llm.engine.get_stats().prefix_cache_hits
    assert hits >= 2 * 40 - 8
    assert first + second[1:] == [hf_greedy(family.hf, p) for p in with_prefix]
    assert second[0] == first[0]
    assert len({tuple(t) for t in family.expected}) == len(family.expected)   # outputs differ: a real check


@pytest.mark.parametrize("name, mode", [("qwen3_moe", "recompute"), ("mixtral", "swap"),
                                        ("gpt_oss", "recompute"), ("gpt_oss", "swap")])
def test_preemption_keeps_the_tokens(families, name, mode):
    family = families(name)
    prompts = prompts_of(4, (30, 35, 40, 45))
    # Four sequences of up to 55 tokens need about 28 blocks of 8; 12 force preemption.
    # gpt-oss keeps a table for its windowed layers and one for its full ones (KV
    # groups), each block holding half the layers: twice the blocks for the same bytes.
    blocks = 24 if name == "gpt_oss" else 12
    with LLM(str(family.folder), num_kv_blocks=blocks, block_size=8, preemption_mode=mode,
             swap_space_blocks=32 if mode == "swap" else 0, **EAGER) as llm:
        got = greedy(llm, prompts)
        stats = llm.engine.get_stats()
    assert (stats.num_swap_preemptions if mode == "swap" else stats.num_recompute_preemptions) > 0
    assert got == [hf_greedy(family.hf, p) for p in prompts]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name, expert_parallel", [("qwen3_moe", False), ("mixtral", True), ("gpt_oss", False)])
def test_two_ranks_generate_what_hugging_face_generates(families, name, expert_parallel):
    # Experts split by their intermediate features (Qwen3-MoE's dense layer as
    # a dense MLP; gpt-oss's sinks and biases per rank) or whole (Mixtral: two per rank).
    family = families(name)
    with LLM(str(family.folder), tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
             num_kv_blocks=64, **EAGER) as llm:
        assert greedy(llm, family.prompts) == family.expected


NO_COMPILER = compile_unavailable(torch.device("cpu"))


@pytest.mark.skipif(NO_COMPILER is not None, reason=f"torch.compile cannot run here: {NO_COMPILER}")
def test_compiled_gpt_oss_step_equals_hugging_face(tmp_path):
    # The expert operators and the sinks argument of the attention operator in
    # one graph; two layers (one windowed, one full) keep the compile short.
    folder = build_tiny_moe(tmp_path, "gpt_oss", num_hidden_layers=2)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = prompts_of(5, (4, 140))
    with LLM(str(folder), num_kv_blocks=64, compile=True, device="cpu") as llm:
        assert llm.engine.runner.compiled is not None
        assert greedy(llm, prompts) == [hf_greedy(hf, p) for p in prompts]


def test_gpt_oss_from_mxfp4_experts_equals_hugging_face_on_its_own_dequantisation(families, tmp_path):
    family = families("gpt_oss")
    published = write_mxfp4_copy(family.folder, tmp_path / "mxfp4")
    packed = load_file(str(published / "model.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(family.folder, dtype=torch.float32).eval()
    with torch.no_grad():   # transformers' own MXFP4 dequantisation of the same blocks
        for i, layer in enumerate(hf.model.layers):
            for proj in ("gate_up_proj", "down_proj"):
                base = f"model.layers.{i}.mlp.experts.{proj}"
                getattr(layer.mlp.experts, proj).copy_(
                    convert_moe_packed_tensors(packed[base + "_blocks"], packed[base + "_scales"], dtype=torch.float32))
    expected = [hf_greedy(hf, p) for p in family.prompts]
    assert expected != family.expected   # MXFP4 rounding changed the model: a real check
    with LLM(str(published), num_kv_blocks=64, **EAGER) as llm:
        assert greedy(llm, family.prompts) == expected


def test_beam_search_ngram_speculation_sampling_and_structured_outputs_run_on_experts(families):
    family = families("qwen3_moe")
    prompt = family.prompts[1]
    with LLM(str(family.folder), num_kv_blocks=64, block_size=8, **EAGER) as llm:
        beams = llm.generate([prompt], SamplingParams(n=2, best_of=2, use_beam_search=True, temperature=0.0,
                                                      max_tokens=8, ignore_eos=True))[0].outputs
        sampled = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6))[0].outputs
        chosen = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, structured_outputs={
            "choice": ["red", "green", "blue"]}))[0].outputs[0]
    with torch.no_grad():
        ref = family.hf.generate(torch.tensor([prompt]), num_beams=2, num_return_sequences=2, do_sample=False,
                                 max_new_tokens=8, min_new_tokens=8, early_stopping=False, length_penalty=1.0,
                                 pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert [o.token_ids for o in beams] == [r[len(prompt):].tolist() for r in ref]
    assert len(sampled) == 3 and all(len(o.token_ids) >= 1 for o in sampled)
    assert chosen.text in ("red", "green", "blue")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 0}
    with LLM(str(family.folder), num_kv_blocks=64, speculative_config=spec, **EAGER) as llm:
        assert greedy(llm, family.prompts) == family.expected


def test_quantisation_is_refused_by_name(families):
    with pytest.raises(ValueError, match="quantization=int8 does not cover the expert weights"):
        LLM(str(families("mixtral").folder), quantization="int8", num_kv_blocks=16, **EAGER)
