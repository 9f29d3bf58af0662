"""``python -m loadtest.bench kv_formats``: the layouts' rounding rules and a
run at quick size on the default model."""
import json

import pytest
import torch

from loadtest.bench import kv_formats
from loadtest.bench.__main__ import BENCHMARKS
from pagedbackend.kernels.kv_cache_dtype import decode, quantize_rows


def rows(seed=0):
    """Rows of head size 64 with a few large channels, as keys have (RoPE's low frequencies)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 64, generator=g)
    x[:, 60:] *= 40.0
    x[:8] = 0.0   # rows of zeros keep zeros
    x[8:16] *= 1e-6
    return x


def test_it_is_a_named_benchmark():
    assert "kv_formats" in BENCHMARKS


def test_the_layouts_bytes_at_head_size_64_and_128():
    assert {n: b(64) for n, (b, _) in kv_formats.LAYOUTS.items()} == \
        {"f16x16": 72, "f16x32": 68, "log4x16": 67, "f16row": 66}
    assert kv_formats.LAYOUTS["log4x16"][0](128) == 128 + 1 + 4


def test_todays_layout_is_the_cache_s_own_rule():
    x = rows()
    assert torch.equal(kv_formats.LAYOUTS["f16x16"][1](x), decode(quantize_rows(x), torch.float32))


def test_log4_fields_fit_their_bits_and_every_scale_covers_its_group():
    x = rows()
    E, e, values, scale = kv_formats.log4_fields(x)
    nonzero = x.abs().amax(dim=-1) > 0
    assert E[nonzero].min() >= -128 and E[nonzero].max() <= 127   # a byte
    assert e.min() >= 0 and e.max() <= 15                        # four bits
    assert values.abs().max() <= 127 and torch.equal(values, values.round())
    need = x.unflatten(-1, (-1, 16)).abs().amax(dim=-1, keepdim=True) / 127
    assert (scale >= need).all()
    # the smallest such step: one quarter-octave finer would not cover the group
    finer = torch.exp2(E - (e + 1) / 4)
    assert ((finer < need) | (e == 15) | (need == 0)).all()
    assert torch.equal(kv_formats._log4(x)[:8], torch.zeros(8, 64))
    # and the rounding stays within half a step of each value
    err = (kv_formats._log4(x) - x).abs().unflatten(-1, (-1, 16))
    assert (err <= scale / 2 + 1e-12).all()


def test_narrower_layouts_round_such_rows_no_better_than_todays():
    x = rows(1)
    error = {n: ((r(x) - x).norm() / x.norm()).item() for n, (_, r) in kv_formats.LAYOUTS.items()}
    assert error["f16x16"] <= error["log4x16"] < error["f16row"]
    assert error["f16x16"] <= error["f16x32"] < error["f16row"]


def test_an_unknown_layout_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        kv_formats.main(["--layouts", "f16x16,int4", "--quick"])
    assert "unknown layout(s) int4" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_quick_run_on_the_default_model(tmp_path):
    result = kv_formats.main(["--quick", "--threads", "1", "--layouts", "f16x16,f16row", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "kv_formats.json").read_text())["error"] == result["error"]
    assert result["error_rows"] > 0
    for name in ("f16x16", "f16row"):
        assert 0 < result["error"][name]["k"] < 0.05 and 0 < result["error"][name]["v"] < 0.05
    assert result["error"]["f16x16"]["k"] < result["error"]["f16row"]["k"]
    quality = result["quality"]
    assert quality["float32"]["prompts_equal"] == quality["float32"]["prompts"] == 4
    for name in ("f16x16", "f16row"):
        assert quality[name]["prompts"] == 4 and quality[name]["tokens"] == 32
        assert abs(quality[name]["perplexity_change_pct"]) < 5
