"""``python -m loadtest.bench kv_memory`` at a tiny size: the capacity read
from each engine, the decode figures, and a decode over the copied K/V that
continues as the model does over its own prefill."""
import json
import pathlib

import pytest

from loadtest.bench import kv_memory
from loadtest.bench.__main__ import BENCHMARKS

CONTEXT, SEQS = 256, 2


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("kv_memory")
    result = kv_memory.main(["--contexts", str(CONTEXT), "--seqs", str(SEQS), "--steps", "2", "--rounds", "1",
                             "--kv-cache-bytes", str(32 * 2 ** 20), "--dtypes", "auto,bfloat16,int8",
                             "--threads", "1", "--out", str(out)])
    assert json.loads((out / "kv_memory.json").read_text())["capacity"] == result["capacity"]
    return result


def test_it_is_a_named_benchmark():
    assert "kv_memory" in BENCHMARKS


def test_the_pool_holds_more_blocks_in_the_narrower_formats(result):
    cap = result["capacity"]
    assert cap["int8"]["blocks"] > cap["bfloat16"]["blocks"] > cap["auto"]["blocks"] > 0
    # float32 rows of 256 bytes, bfloat16 128, int8 72 (scales included): the block bytes in that ratio.
    assert cap["auto"]["block_bytes"] == 2 * cap["bfloat16"]["block_bytes"]
    assert cap["bfloat16"]["block_bytes"] * 72 == cap["int8"]["block_bytes"] * 128
    for row in cap.values():
        assert row["blocks"] == 32 * 2 ** 20 // row["block_bytes"]
        per_seq = row["blocks_per_seq"][str(CONTEXT)]
        assert per_seq == CONTEXT // 16
        assert row["max_seqs"][str(CONTEXT)] == row["blocks"] // per_seq


def test_every_format_decodes_every_sequence_at_a_positive_rate(result):
    rows = {row["kv_cache_dtype"]: row for row in result["decode"]}
    assert list(rows) == ["auto", "bfloat16", "int8"]
    for row in rows.values():
        assert row["context"] == CONTEXT and row["seqs"] == SEQS
        assert row["tok_s"] > 0 and len(row["tok_s_rounds"]) == 1
        assert row["pool_blocks"] >= SEQS * CONTEXT // 16
        assert row["tokens"][0] == 0 and len(row["tokens"]) == 1 + 2 * 2   # the skipped prefill's, warm-up, round
    assert rows["auto"]["vs_auto"] == 1.0
    assert result["reference_prefill"]["tokens"] == CONTEXT


def test_a_decode_over_the_copied_kv_continues_as_over_a_real_prefill(result):
    """The auto engine's tokens after the skipped prefill's id 0 are the
    model's greedy continuation of prompt + [0], prefilled for real."""
    from pagedbackend import LLM, SamplingParams
    prompt = kv_memory.make_prompt(CONTEXT, 0)
    with LLM(model=result["model"], dtype="float32", compile=False, num_kv_blocks=64) as llm:
        out = llm.generate([prompt + [0]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    auto = next(row for row in result["decode"] if row["kv_cache_dtype"] == "auto")
    assert auto["tokens"][1:] == out.outputs[0].token_ids


def test_a_context_past_the_model_positions_gets_a_copy_with_more():
    from pagedbackend.models.default_model import prepare_default_model
    source = prepare_default_model()
    assert kv_memory.model_for(4096) == str(source)
    folder = pathlib.Path(kv_memory.model_for(9000))
    config = json.loads((folder / "config.json").read_text())
    assert config["max_position_embeddings"] == 9000
    assert config == {**json.loads((source / "config.json").read_text()), "max_position_embeddings": 9000}
    assert (folder / "model.safetensors").resolve() == (source / "model.safetensors").resolve()
