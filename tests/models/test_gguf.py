"""GGUF files as a model source: tiny random checkpoints of the families
(Qwen3-MoE's experts included), written as Q8_0, Q4_0 and Q4_K_M GGUF files (and Q4_1, Q5_K_M, and the
unquantised F16 and BF16 files a conversion writes), generate
greedily what transformers generates when it loads the same file (it
dequantises every block to float32), batched, with prefix caching and under
preemption; the blocks are multiplied as the file holds them, an expert's
blocks per expert. A truncated file or one with hostile tensor shapes is
refused with a clear error."""
import struct

import numpy as np
import pytest
import torch

from loadtest.tiny_gguf import VOCAB, build_tiny_gguf, load_hf_gguf, quantize, tiny_checkpoint, write_gguf
from pagedbackend import LLM, SamplingParams
from pagedbackend.kernels.moe_ref import fused_experts_torch
from pagedbackend.models.gguf_file import GGUFError, GGUFFile
from pagedbackend.models.gguf_linear import WIDEN_ROWS, GGUFLinear, int8_activations_unavailable
from pagedbackend.models.gguf_moe import GGUFExperts

NEW_TOKENS = 10
CASES = [(family, scheme) for family in ("llama", "qwen2", "qwen3", "qwen3_moe")
         for scheme in ("Q8_0", "Q4_0", "Q4_K_M")]
CASES += [("gemma3", "Q8_0"), ("gemma3", "Q4_K_M"), ("phi3", "Q8_0"), ("phi3", "Q4_K_M"),
          ("mistral", "Q4_K_M"), ("llama", "Q4_1"), ("qwen2", "Q5_K_M"), ("llama", "F16"), ("qwen3", "BF16"),
          ("qwen3_moe", "F16")]


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    files = {}

    def file(family, scheme):
        if (family, scheme) not in files:
            files[family, scheme] = build_tiny_gguf(folder, family, scheme)
        return files[family, scheme]
    return file


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_blocks_widen_to_the_reference_values_and_multiply_in_any_dtype(kind):
    import gguf
    rng = np.random.default_rng(1)
    w = rng.normal(size=(37, 512)).astype(np.float32)
    blocks = quantize(w, kind)
    reference = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind]).copy())
    layer = GGUFLinear([torch.from_numpy(blocks)], [kind], 512)
    assert torch.equal(layer.dequantized(), reference)   # bit for bit: no second rounding
    for rows in (1, 3, 9, 20, WIDEN_ROWS):   # the last: a long prefill chunk, widened once
        x = torch.randn(rows, 512)
        torch.testing.assert_close(layer(x), x @ reference.T, rtol=1e-5, atol=1e-4)
    x = torch.randn(5, 512).bfloat16()
    y = layer(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), x.float() @ reference.T, rtol=1e-2, atol=1e-2)


def test_a_merged_layer_mixes_types_and_reads_rows_through_a_map():
    import gguf
    rng = np.random.default_rng(2)
    a, b = rng.normal(size=(16, 256)).astype(np.float32), rng.normal(size=(8, 256)).astype(np.float32)
    qa, qb = quantize(a, "Q4_K"), quantize(b, "Q6_K")
    order = torch.randperm(16)
    layer = GGUFLinear([torch.from_numpy(qa), torch.from_numpy(qb)], ["Q4_K", "Q6_K"], 256, [order, None])
    wa = torch.from_numpy(gguf.quants.dequantize(qa, gguf.GGMLQuantizationType.Q4_K).copy())[order]
    wb = torch.from_numpy(gguf.quants.dequantize(qb, gguf.GGMLQuantizationType.Q6_K).copy())
    x = torch.randn(4, 256)
    torch.testing.assert_close(layer(x), x @ torch.cat([wa, wb]).T, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="Q4_K weight of 512 columns"):
        GGUFLinear([torch.from_numpy(qa)], ["Q4_K"], 512)


@pytest.mark.parametrize("kinds", [("Q8_0", "Q8_0", "Q8_0"), ("Q4_K", "Q4_K", "Q6_K"), ("Q4_0", "Q4_1", "Q5_K")])
def test_experts_multiply_their_own_blocks_as_the_reference_loop_does(kinds):
    import gguf
    rng = np.random.default_rng(3)
    experts, hidden, inter = 4, 256, 512
    floats = [0.05 * rng.normal(size=(experts, rows, cols)).astype(np.float32)
              for rows, cols in ((inter, hidden), (inter, hidden), (hidden, inter))]
    blocks = [quantize(w, kind) for w, kind in zip(floats, kinds)]
    widened = [torch.from_numpy(gguf.quants.dequantize(b, gguf.GGMLQuantizationType[kind]).copy())
               for b, kind in zip(blocks, kinds)]
    layer = GGUFExperts(*(torch.from_numpy(b) for b in blocks), list(kinds), hidden, inter)
    w13, w2 = layer.dequantized()
    assert torch.equal(w13, torch.cat(widened[:2], dim=1)) and torch.equal(w2, widened[2])
    x = torch.randn(7, hidden)
    ids = torch.tensor([[0, 2], [2, 3], [1, 0], [3, 2], [0, 1], [2, 0], [3, 1]], dtype=torch.int32)
    weights = torch.rand(7, 2)
    torch.testing.assert_close(layer(x, ids, weights), fused_experts_torch(x, ids, weights, w13, w2),
                               rtol=1e-5, atol=1e-4)
    assert layer.expert_bytes() == sum(b[0].nbytes for b in blocks)


def prompts_for(seed=7):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, VOCAB, (36,), generator=g).tolist()
    return [prefix + torch.randint(3, VOCAB, (3 + i,), generator=g).tolist() for i in range(6)]


def hf_greedy(hf, prompt):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=NEW_TOKENS, pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    return tokens[:tokens.index(2) + 1] if 2 in tokens else tokens   # EOS is 2


@pytest.mark.parametrize("family, scheme", CASES)
def test_engine_generates_what_transformers_generates_from_the_same_file(gguf_files, family, scheme):
    path = gguf_files(family, scheme)
    hf = load_hf_gguf(path)
    prompts = prompts_for()
    expected = [hf_greedy(hf, p) for p in prompts]
    assert len({tuple(e) for e in expected}) > 1   # outputs differ: a real check
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    # 7 sequences of up to ~54 positions need ~45 blocks of 8: 14 force preemption
    # (swap takes the 6 host blocks first, then falls back to recompute). Gemma 3's
    # layers all slide (windows of 16) and give blocks back as they move on: 10 and 4.
    blocks, host = (10, 4) if family == "gemma3" else (14, 6)
    with LLM(model=str(path), compile=False, block_size=8, num_kv_blocks=blocks, preemption_mode="swap",
             swap_space_blocks=host) as llm:
        first = llm.generate(prompts[:1], greedy)   # leaves the shared prefix in the prefix cache
        outs = llm.generate(prompts, greedy)
        stats = llm.engine.get_stats()
        types = llm.engine.runner.model.gguf_types
        windows = llm.engine.runner.model.layer_windows
        moe_kernel = llm.engine.runner.moe_kernel
    assert first[0].outputs[0].token_ids == expected[0]
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert stats.prefix_cache_hits > 0
    assert stats.num_swap_preemptions > 0 and stats.num_recompute_preemptions > 0
    served = {"Q4_K_M": {"Q4_K", "Q6_K"}, "Q5_K_M": {"Q5_K", "Q6_K"},
              "Q4_0": {"Q4_0", "Q6_K"}, "Q4_1": {"Q4_1", "Q6_K"}}.get(scheme, {scheme})
    if family in ("qwen3", "gemma3"):   # tied: no output tensor, the head reads token_embd
        served -= {"Q6_K"} if scheme in ("Q4_0", "Q4_1") else set()
    assert set(types) == served
    assert windows == ([16, 16] if family == "gemma3" else [None, None])   # sequences run past three windows
    if family == "qwen3_moe":   # quantised experts from their blocks; float ones by the float kernel
        assert moe_kernel == ("packed" if scheme == "F16" else "gguf")


@pytest.mark.parametrize("scheme, fallbacks", [("Q4_K_M", {"Q5_0", "Q8_0"}), ("Q5_K_M", {"Q5_1", "Q8_0"})])
def test_k_quant_files_with_rows_that_are_not_whole_super_blocks_hold_fallback_types(tmp_path, scheme, fallbacks):
    """llama-quantize writes a K-quant tensor whose rows are not whole
    super-blocks of 256 (an MLP of 320 here; Gemma 3 1B's 1152, Qwen2.5 0.5B's
    896) as Q5_0 (for Q4_K), Q5_1 (Q5_K) or Q8_0 (Q6_K): such a file loads,
    and the engine generates what transformers generates from it."""
    path = build_tiny_gguf(tmp_path, "llama", scheme, intermediate_size=320)
    hf = load_hf_gguf(path)
    prompts = prompts_for()
    expected = [hf_greedy(hf, p) for p in prompts]
    with LLM(model=str(path), compile=False, block_size=8, num_kv_blocks=64) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
        types = set(llm.engine.runner.model.gguf_types)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert fallbacks <= types and {scheme[:4], "Q6_K"} <= types


def test_the_tokenizer_and_chat_template_come_from_the_file(gguf_files):
    path = gguf_files("qwen2", "Q8_0")
    with LLM(model=str(path), compile=False, num_kv_blocks=16) as llm:
        tokenizer = llm.engine.tokenizer
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)
        out = llm.generate(["import json"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert len(tokenizer) == VOCAB
    assert out[0].prompt_token_ids == tokenizer("import json")["input_ids"]


def test_quantization_settings_are_refused_for_a_gguf(gguf_files):
    with pytest.raises(ValueError, match="GGUF file's weights are served in their own blocks"):
        LLM(model=str(gguf_files("llama", "Q8_0")), compile=False, num_kv_blocks=16, quantization="int8")


def round_linear_inputs(model: torch.nn.Module, group: int) -> None:
    """Every linear layer of ``model`` takes its input rounded to int8 per
    ``group`` values, as the int8-activation GGUF kernels round it."""
    def rounded(module, args):
        x = args[0]
        g = x.reshape(-1, x.shape[-1] // group, group)
        d = g.abs().amax(-1, keepdim=True) / 127.0
        inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        return ((torch.round(g * inverse).clamp(-127, 127) * d).reshape(x.shape),)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(rounded)


@pytest.mark.parametrize("scheme, group", [("Q8_0", 32), ("Q4_K_M", 256), ("Q5_K_M", 256)])
def test_int8_activations_generate_what_transformers_generates_with_the_same_rounding(gguf_files, scheme, group):
    """``quantization=w8a8`` on a GGUF file: x rounded to int8 per group of 32
    (Q8_0) or super-block of 256 (K-quants), integer products. Each token the
    engine picks is transformers' choice on the same dequantised file, every
    linear layer's input rounded the same way, given the engine's own tokens
    before it; or, at a near-tie, one within 0.15 of it: there float32's
    different sums can move a value across a rounding boundary of the next
    layer's input, one int8 step, a change far larger than float32's (a random
    tiny model has many near-ties)."""
    if int8_activations_unavailable():
        pytest.skip(f"int8-activation GGUF products: {int8_activations_unavailable()}")
    path = gguf_files("llama", scheme)
    hf = load_hf_gguf(path)
    round_linear_inputs(hf, group)
    prompts = prompts_for(seed=11)
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    with LLM(model=str(path), compile=False, block_size=8, num_kv_blocks=64, quantization="w8a8") as llm:
        outs = llm.generate(prompts, greedy)
        layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, GGUFLinear)]
    assert layers and all(layer.int8_activations for layer in layers)
    assert all(panel.numel() for layer in layers for panel in layer.panels)   # every type read from panels
    picked = same = 0
    for prompt, out in zip(prompts, outs):
        tokens = list(out.outputs[0].token_ids)
        with torch.no_grad():   # transformers' logits at every generated position, given the engine's tokens
            logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        for at, token in enumerate(tokens):
            assert logits[at].max() - logits[at, token] < 0.15, f"token {at}: not transformers' choice nor a near-tie"
            same += int(logits[at].argmax()) == token
        picked += len(tokens)
    assert same >= 0.9 * picked


# ---------------------------------------------------------------- hostile files

def _string(text: str) -> bytes:
    return struct.pack("<Q", len(text)) + text.encode()


def _header(dims, type_id=8, offset=0, data=b"\0" * 64) -> bytes:
    kv = _string("general.architecture") + struct.pack("<I", 8) + _string("llama")
    info = _string("token_embd.weight") + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
    info += struct.pack("<IQ", type_id, offset)
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, 1) + kv + info
    return head + b"\0" * (-len(head) % 32) + data


@pytest.mark.parametrize("dims, message", [
    ((256, 2 ** 62, 4), "overflows 64-bit"),                  # 2^72 elements
    ((2 ** 64 - 1, 1), "dimension 18446744073709551615"),     # beyond 2^63
    ((32, 1 << 40), "runs past the end"),                     # 34 TiB of blocks in a tiny file
    ((33, 2), "not whole Q8_0 blocks"),
    ((32, 2, 1, 1, 1), "5 dimensions"),
    ((32, 0), "dimension 0"),
])
def test_hostile_tensor_shapes_are_refused(tmp_path, dims, message):
    path = tmp_path / "hostile.gguf"
    path.write_bytes(_header(dims))
    with pytest.raises(GGUFError, match=message):
        GGUFFile(path)
    with pytest.raises(GGUFError, match=message):
        LLM(model=str(path), compile=False)


def test_offsets_counts_and_lengths_past_the_file_are_refused(tmp_path):
    path = tmp_path / "hostile.gguf"
    path.write_bytes(_header((32, 1), offset=1 << 40))
    with pytest.raises(GGUFError, match="runs past the end"):
        GGUFFile(path)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2 ** 60, 1))
    with pytest.raises(GGUFError, match="more than a 24-byte file can hold"):
        GGUFFile(path)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2 ** 63) + b"key")
    with pytest.raises(GGUFError, match="truncated"):
        GGUFFile(path)
    path.write_bytes(b"GGML" + b"\0" * 40)
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(path)


@pytest.mark.parametrize("tensor, keep, message", [
    ("model.layers.1.mlp.experts.down_proj", 3, r"ffn_down_exps.weight of shape \[768, 256, 3\] holds 3 experts; "
                                                r"the metadata \(expert_count\) says 4"),
    ("model.layers.0.mlp.gate.weight", 5, r"ffn_gate_inp.weight has shape \[256, 5\]"),
], ids=["experts", "router"])
def test_expert_tensors_disagreeing_with_the_expert_count_are_refused(tmp_path, tensor, keep, message):
    state, cfg, arch = tiny_checkpoint("qwen3_moe")
    state[tensor] = torch.cat([state[tensor]] * 2)[:keep]   # a hostile expert count, the metadata unchanged
    path = write_gguf(tmp_path / "hostile-moe.gguf", state, cfg, arch, "Q8_0")
    with pytest.raises(GGUFError, match=message):
        LLM(model=str(path), compile=False, num_kv_blocks=16)


def test_a_truncated_file_is_refused(gguf_files, tmp_path):
    whole = gguf_files("llama", "Q8_0").read_bytes()
    for keep in (len(whole) - 100, len(whole) // 2, 40):
        path = tmp_path / f"cut{keep}.gguf"
        path.write_bytes(whole[:keep])
        with pytest.raises(GGUFError, match="truncated|runs past the end"):
            LLM(model=str(path), compile=False)
