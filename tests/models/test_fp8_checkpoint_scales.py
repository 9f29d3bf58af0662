"""An fp8 KV cache at per-layer scales through the engine: a tiny random Llama
saved with vLLM's ``k_scale`` / ``v_scale`` tensors (and the older
``k_proj.output_scale`` / ``v_proj.output_scale``) serves with those scales,
and one without them takes each layer's from its first prefill under
``calculate_kv_scales``. The reference is Hugging Face's forward with its
attention reading K/V rounded as the cache holds them: ``encode(k / k_scale)``
read back times ``k_scale`` (kernels/kv_cache_dtype.py)."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedbackend import LLM, SamplingParams
from pagedbackend.config import EngineConfig
from pagedbackend.kernels.kv_cache_dtype import decode, encode
from pagedbackend.models.fp8_scales import K_SCALE_CONSTANT, V_SCALE_CONSTANT

# Per layer of the tiny Llama (4 layers): layer 0's k_scale makes its largest
# keys saturate at 448, the others spread the values over e4m3's range.
K_SCALES = [0.005, 0.02, 0.05, 0.01]
V_SCALES = [0.1, 0.004, 0.2, 0.03]
PROMPTS = [list(range(100, 124)), list(range(3000, 3009)), [7, 77, 777, 7777, 17, 170, 1700, 4, 40, 400]]
TOKENS = 16


class Fp8Reference:
    """Hugging Face's model whose attention reads K/V as an fp8 cache at
    ``scales`` holds them (``round_prefill``: a prompt's own K/V too, as the
    torch twin reads them back from the cache; else a prefill attends to its
    K/V as computed, as SDPA does). With ``scales`` None it records each
    layer's first K/V absmax and uses it as vLLM's calculated scales."""

    def __init__(self, model_dir, dtype=torch.float8_e4m3fn):
        from transformers import AttentionInterface, AutoModelForCausalLM
        AttentionInterface.register("fp8_kv_reference", self._attend)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                          attn_implementation="fp8_kv_reference").eval()
        self.dtype, self.scales, self.round_prefill = dtype, None, True

    def _attend(self, module, query, key, value, attention_mask, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        layer = module.layer_idx
        if self.scales[layer] is None:   # the first prefill: vLLM's calculate_kv_scales
            self.scales[layer] = (float(key.abs().max() / K_SCALE_CONSTANT),
                                  float(value.abs().max() / V_SCALE_CONSTANT))
        k_scale, v_scale = self.scales[layer]
        if self.round_prefill or key.shape[2] != query.shape[2]:
            key = decode(encode(key / k_scale, self.dtype)) * k_scale
            value = decode(encode(value / v_scale, self.dtype)) * v_scale
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    def greedy(self, prompts, scales, round_prefill=True):
        self.scales, self.round_prefill = scales, round_prefill
        out = []
        with torch.no_grad():
            for prompt in prompts:
                ids = self.model.generate(torch.tensor([prompt]), max_new_tokens=TOKENS, do_sample=False,
                                          min_new_tokens=TOKENS, pad_token_id=0)
                out.append(ids[0, len(prompt):].tolist())
        return out


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return Fp8Reference(tiny_model_dir)


@pytest.fixture(scope="module")
def scaled_checkpoint(tiny_model_dir, tmp_path_factory):
    """The tiny Llama with a k and v scale per layer: vLLM's names on even
    layers, the older projection output scales on odd ones."""
    folder = tmp_path_factory.mktemp("tiny_llama_kv_scales")
    for path in tiny_model_dir.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, folder / path.name)
    tensors = load_file(tiny_model_dir / "model.safetensors")
    for i, (k, v) in enumerate(zip(K_SCALES, V_SCALES)):
        names = ("self_attn.k_scale", "self_attn.v_scale") if i % 2 == 0 else \
            ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale")
        tensors[f"model.layers.{i}.{names[0]}"] = torch.tensor(k)
        tensors[f"model.layers.{i}.{names[1]}"] = torch.tensor([v])
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _serve(folder, backend, **settings):
    llm = LLM(model=str(folder), compile=False, dtype="float32", kv_cache_dtype="fp8_e4m3",
              attention_backend=backend, num_kv_blocks=64, **settings)
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    return llm, [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def _f32(values):
    return [float(torch.tensor(x)) for x in values]


@pytest.mark.parametrize("backend", ["torch", "sdpa"])
def test_a_checkpoints_kv_scales_are_read_and_served(scaled_checkpoint, reference, backend):
    llm, tokens = _serve(scaled_checkpoint, backend)
    scales = llm.engine.runner.kv_scales
    assert scales.k == _f32(K_SCALES) and scales.v == _f32(V_SCALES)
    expected = reference.greedy(PROMPTS, list(zip(scales.k, scales.v)), round_prefill=backend == "torch")
    assert tokens == expected
    # the scales change what is served: at scale 1 the reference gives other tokens
    assert reference.greedy(PROMPTS, [(1.0, 1.0)] * 4, round_prefill=backend == "torch") != expected


def test_calculated_scales_come_from_the_first_prefill(tiny_model_dir, reference):
    llm = LLM(model=str(tiny_model_dir), compile=False, dtype="float32", kv_cache_dtype="fp8_e4m3",
              attention_backend="torch", num_kv_blocks=64, calculate_kv_scales=True)
    scales = llm.engine.runner.kv_scales
    assert scales.k == [1.0] * 4 and scales.v == [1.0] * 4   # the warm-ups set nothing
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    tokens = [llm.generate([prompt], params)[0].outputs[0].token_ids for prompt in PROMPTS]
    expected = reference.greedy(PROMPTS, [None] * 4)   # the first prompt's prefill sets them
    torch.testing.assert_close(scales.k, [k for k, _ in reference.scales], rtol=1e-5, atol=0)
    torch.testing.assert_close(scales.v, [v for _, v in reference.scales], rtol=1e-5, atol=0)
    assert min(scales.k + scales.v) > 0 and 1.0 not in scales.k
    assert tokens == expected


def test_what_the_scales_refuse(scaled_checkpoint, tmp_path):
    for path in scaled_checkpoint.iterdir():
        shutil.copy(path, tmp_path / path.name)
    tensors = load_file(scaled_checkpoint / "model.safetensors")
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor([0.1, 0.2])   # per KV head
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.0.self_attn.k_scale.*not per-head"):
        LLM(model=str(tmp_path), compile=False, dtype="float32", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="calculate_kv_scales scales an fp8 KV cache"):
        EngineConfig(model=str(scaled_checkpoint), kv_cache_dtype="int8", calculate_kv_scales=True)
    with pytest.raises(ValueError, match="calculate_kv_scales does not combine with kv_offload_dir"):
        EngineConfig(model=str(scaled_checkpoint), kv_cache_dtype="fp8", calculate_kv_scales=True,
                     kv_offload_dir=str(tmp_path / "tier"))
    with pytest.raises(ValueError, match="calculate_kv_scales must be true or false"):
        EngineConfig(model=str(scaled_checkpoint), kv_cache_dtype="fp8", calculate_kv_scales="yes")
