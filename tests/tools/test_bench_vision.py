"""``loadtest.bench vision`` on tiny_vision's LLaVA, one round: the table's
rows, and the encoder cache row with the vision tower skipped."""
import json

from loadtest.bench import vision


def test_vision_bench_one_round_on_a_tiny_llava(tiny_vision, tmp_path, capsys):
    result = vision.main(["--model", str(tiny_vision("llava")), "--rounds", "1", "--pairs", "1",
                          "--concurrency", "1,3", "--hf-batches", "1", "--max-tokens", "4",
                          "--kv-cache-gib", "0.05", "--threads", "1", "--out", str(tmp_path)])

    rows = {r["concurrency"]: r for r in result["rows"]}
    assert list(rows) == [1, 3]
    assert rows[1]["ours_tok_s"] > 0 and rows[1]["hf_tok_s"] > 0 and rows[1]["tok_s_ours_over_hf"] > 0
    assert rows[1]["same_tokens_as_hf"] == 1.0   # greedy, the same images: HF's tokens
    assert rows[3]["ours_tok_s"] > 0 and rows[3]["hf_tok_s"] is None   # HF runs only at --hf-batches
    cache = {r["case"]: r for r in result["encoder_rows"]}
    assert list(cache) == ["cold", "encoder", "prefix"]
    assert cache["cold"]["tower_runs"] == 1 and cache["cold"]["cached_prompt_tokens"] == 0
    # Another question before the same image: the prompt is computed again, the tower is not.
    assert cache["encoder"]["tower_runs"] == 0 and cache["encoder"]["cached_prompt_tokens"] == 0
    assert cache["prefix"]["tower_runs"] == 0 and cache["prefix"]["cached_prompt_tokens"] > 0
    assert result["shape"]["image_tokens"] == 16 and "vllm" in result
    printed = capsys.readouterr().out
    assert "| 3 | " in printed and "0 of 1 |" in printed and result["cpu_model"] in printed
    assert json.loads((tmp_path / "vision.json").read_text())["encoder_rows"] == result["encoder_rows"]
