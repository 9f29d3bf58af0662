"""RoPE tables equal Hugging Face's rotary embeddings for every served RoPE
type, read per layer type from transformers 5's nested ``rope_parameters``
as from old-style ``rope_theta`` / ``rope_scaling``; what is not served is
refused by name."""
import pytest
import torch

from pagedbackend.models.model_args import UnsupportedModelError
from pagedbackend.models.rotary import RotaryEmbedding, apply_rotary, rope_parameters

HEAD_DIM, MAX_POS = 32, 64


def hf_rotary(model_type, **settings):
    """HF's rotary module and the config.json dict it was built from."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    config = AutoConfig.for_model(model_type, hidden_size=HEAD_DIM * 4, num_attention_heads=4,
                                  num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=MAX_POS,
                                  **settings)
    rotary = (Phi3RotaryEmbedding if model_type == "phi3" else LlamaRotaryEmbedding)(config)
    return rotary, config.to_dict()


def hf_cos_sin(rotary, positions):
    x = torch.zeros(1, len(positions), HEAD_DIM)
    cos, sin = rotary(x, torch.tensor([positions]))
    half = cos.shape[-1] // 2
    return cos[0, :, :half], sin[0, :, :half]


def ours(cfg, max_positions=MAX_POS * 4):
    return RotaryEmbedding(rope_parameters(cfg), HEAD_DIM, cfg["max_position_embeddings"], max_positions,
                           torch.float32)


STATIC = {
    "default": dict(rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
    "linear": dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 3.0}),
    "llama3": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 16}),
    "yarn": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 16}),
    "yarn-mscale": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 16, "mscale": 0.707,
                                         "mscale_all_dim": 1.0, "beta_fast": 16, "truncate": False}),
    "old-style-yarn": dict(rope_theta=20000.0, rope_scaling={"type": "yarn", "factor": 2.0,
                                                             "original_max_position_embeddings": 32}),
}


@pytest.mark.parametrize("name", sorted(STATIC))
def test_static_rope_types_equal_hugging_face_at_every_position(name):
    rotary, cfg = hf_rotary("llama", **STATIC[name])
    positions = list(range(MAX_POS * 2))
    cos, sin = hf_cos_sin(rotary, positions)
    table = ours(cfg)
    torch.testing.assert_close(table.cos[:len(positions)], cos, rtol=0, atol=0)
    torch.testing.assert_close(table.sin[:len(positions)], sin, rtol=0, atol=0)
    if name.startswith("yarn"):   # the attention factor scales cos and sin
        assert rotary.attention_scaling != 1.0 and table.cos[0, 0] == pytest.approx(rotary.attention_scaling)


def test_yarn_attention_factor_follows_mscale_over_mscale_all_dim():
    rotary, cfg = hf_rotary("llama", **STATIC["yarn-mscale"])
    assert ours(cfg).cos[0, 0].item() == pytest.approx(rotary.attention_scaling) != pytest.approx(1.0)


def test_dynamic_ntk_equals_hugging_face_generate_token_by_token():
    """HF grows the NTK base with each decode step past max_position_embeddings;
    each position here carries the base HF uses when it computes that token."""
    rotary, cfg = hf_rotary("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                      "factor": 2.0})
    table = ours(cfg)
    prompt = list(range(40))   # a prompt within max_position_embeddings, then decode steps past it
    cos, sin = hf_cos_sin(rotary, prompt)
    torch.testing.assert_close(table.cos[:40], cos, rtol=0, atol=0)
    for position in range(40, MAX_POS * 2):
        cos, sin = hf_cos_sin(rotary, [position])
        torch.testing.assert_close(table.cos[position], cos[0], rtol=0, atol=0)
        torch.testing.assert_close(table.sin[position], sin[0], rtol=0, atol=0)
    assert not torch.equal(table.cos[MAX_POS + 10], ours(hf_rotary("llama")[1]).cos[MAX_POS + 10])


LONGROPE = dict(original_max_position_embeddings=16, partial_rotary_factor=0.5,
                rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                 "short_factor": [1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5],
                                 "long_factor": [2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0]})


@pytest.mark.parametrize("served, hf_length", [(16, 16), (MAX_POS, 40)])
def test_longrope_uses_the_short_or_long_factors_by_the_served_length(served, hf_length):
    """Short factors when serving at most original_max_position_embeddings
    (HF: every sequence that short), long ones otherwise (HF: a longer prompt)."""
    rotary, cfg = hf_rotary("phi3", **LONGROPE)
    table = ours(cfg, max_positions=served)
    assert table.rotary_dim == HEAD_DIM // 2
    cos, sin = hf_cos_sin(rotary, list(range(hf_length)))
    torch.testing.assert_close(table.cos[:hf_length], cos, rtol=0, atol=0)
    torch.testing.assert_close(table.sin[:hf_length], sin, rtol=0, atol=0)


def test_partial_rotation_leaves_the_last_dimensions_of_each_head_as_they_are():
    rotary, cfg = hf_rotary("phi3", **LONGROPE)
    q, k = torch.randn(5, 4, HEAD_DIM), torch.randn(5, 2, HEAD_DIM)
    q2, k2 = apply_rotary(q, k, ours(cfg, 16)(torch.arange(5)))
    assert torch.equal(q2[..., HEAD_DIM // 2:], q[..., HEAD_DIM // 2:])
    assert not torch.allclose(q2[1:, :, :HEAD_DIM // 2], q[1:, :, :HEAD_DIM // 2])


def test_nested_rope_parameters_are_read_per_layer_type_never_flattened():
    cfg = {"layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 128,
           "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}}}
    assert rope_parameters(cfg, "sliding_attention") == {"rope_type": "default", "rope_theta": 10000.0}
    assert rope_parameters(cfg, "full_attention") == {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}
    cfg["rope_parameters"]["sliding_attention"] = None   # a layer type without RoPE
    assert rope_parameters(cfg, "sliding_attention") is None


@pytest.mark.parametrize("params, field", [
    ({"rope_type": "proportional", "rope_theta": 1e4}, "rope_parameters.rope_type='proportional'"),
    ({"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0], "long_factor": [1.0],
      "original_max_position_embeddings": 8}, "rope_parameters.long_factor=1"),
])
def test_unserved_rope_settings_are_refused_by_name(params, field):
    with pytest.raises(UnsupportedModelError, match=f"unsupported {field}"):
        RotaryEmbedding(params, HEAD_DIM, MAX_POS, MAX_POS)
