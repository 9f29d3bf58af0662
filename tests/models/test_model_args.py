"""A config.json picks its family through the registry; every field a family
does not serve is refused by name when the config is read (never served
wrong), and a refused folder never gets as far as its weights."""
import json
import shutil

import pytest

from loadtest.tiny_families import CASES, WINDOW
from pagedbackend import LLM
from pagedbackend.models import ENCODER_MODEL_TYPES, FAMILIES, SUPPORTED_MODEL_TYPES, model_args, model_class
from pagedbackend.models.decoder import CausalLM
from pagedbackend.models.model_args import UnsupportedModelError


def config(case, **changes):
    """The config.json fields of a tiny case (as transformers saves them), changed."""
    from transformers import AutoConfig
    model_type, settings = CASES[case]
    cfg = AutoConfig.for_model(model_type, **settings).to_dict()
    return {**cfg, **changes}


def test_every_registered_model_type_has_a_decoder_class():
    assert SUPPORTED_MODEL_TYPES - ENCODER_MODEL_TYPES == set(FAMILIES) >= {"llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3",
                                                      "gemma2", "phi3", "mistral3", "ministral3", "smollm3", "granite"}
    for model_type in FAMILIES:
        assert issubclass(model_class(model_type), CausalLM)
    assert ENCODER_MODEL_TYPES == {"bert", "xlm-roberta"}   # served by worker.encoder_runner


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_case_parses_to_one_entry_per_layer(case):
    args = model_args(config(case))
    assert len(args.layer_windows) == len(args.layer_ropes) == args.num_layers
    assert all(i is None or 0 <= i < len(args.ropes) for i in args.layer_ropes)


def test_gemma3_reads_an_old_style_config_per_layer_type():
    """transformers 4's Gemma 3: rope_theta and rope_scaling for the full
    layers, rope_local_base_freq for the sliding ones, a sliding_window_pattern."""
    cfg = {key: value for key, value in config("gemma3_text").items() if key not in ("rope_parameters", "layer_types")}
    cfg.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
               sliding_window_pattern=2)
    args = model_args(cfg)
    assert args.layer_windows == [WINDOW, None, WINDOW, None]
    assert [args.ropes[i] for i in args.layer_ropes[:2]] == [
        {"rope_type": "default", "rope_theta": 1e4}, {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}]


@pytest.mark.parametrize("case, changes, named", [
    ("gemma2", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
    ("gemma3_text", dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    ("gemma3_text", dict(hidden_activation="relu"), "hidden_activation='relu'"),
    ("qwen3", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ("qwen3", dict(rope_parameters={"rope_type": "mrope", "rope_theta": 1e4}), "rope_parameters.rope_type='mrope'"),
    ("qwen3", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                                    "partial_rotary_factor": 0.5}), "partial_rotary_factor=0.5"),
    ("smollm3", dict(layer_types=["full_attention", "chunked_attention"] * 2), "layer_types='chunked_attention'"),
    ("smollm3", dict(no_rope_layers=[1, 0]), "no_rope_layers=2"),
    ("mistral3", dict(text_config={"model_type": "llama"}), "text_config.model_type='llama'"),
    ("gemma3", dict(text_config={"model_type": "gemma2"}), "text_config.model_type='gemma2'"),
    ("qwen3", dict(vocab_size=None), "config.json lacks vocab_size"),
    ("qwen3", dict(model_type="deepseek_v3"), "unsupported model_type 'deepseek_v3'"),
])
def test_an_unserved_field_is_refused_by_name(case, changes, named):
    with pytest.raises(UnsupportedModelError, match=named.replace("(", r"\(").replace(".", r"\.")):
        model_args(config(case, **changes))


def test_a_refused_folder_fails_at_load_naming_the_field(tiny_family, tmp_path):
    folder = shutil.copytree(tiny_family("gemma2"), tmp_path / "gemma2")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "attn_logit_softcapping": 50.0}))
    with pytest.raises(UnsupportedModelError, match="unsupported attn_logit_softcapping=50.0: attention-score"):
        LLM(model=str(folder), compile=False, num_kv_blocks=8)
