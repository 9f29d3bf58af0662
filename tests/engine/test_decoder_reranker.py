"""A decoder with a sequence-classification head (a reranker converted as
vLLM recommends, e.g. Qwen3-Reranker-*-seq-cls): its score of a (query,
document) pair is the sigmoid of the head's logit on the last token, as
transformers' ``*ForSequenceClassification`` and vLLM compute it; chunked
prefill and the prefix cache keep it; it serves no text."""
import pytest
import torch

from pagedbackend import LLM

QUERY = "What is the capital of France? Answer with the city."
DOCUMENTS = ["Paris is the capital and largest city of France.",
             "The mitochondria is the powerhouse of the cell, they said in class.",
             "Berlin is the capital of Germany; Paris is the capital of France."]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, default_model_dir):
    """A tiny random Qwen3ForSequenceClassification (one label), saved by transformers."""
    import shutil

    from transformers import AutoConfig, Qwen3ForSequenceClassification

    from loadtest.tiny_families import CASES
    from loadtest.tiny_model import TOKENIZER_FILES
    path = tmp_path_factory.mktemp("qwen3_seq_cls")
    config = AutoConfig.for_model("qwen3", **{**CASES["qwen3"][1], "num_labels": 1, "pad_token_id": None})
    torch.manual_seed(0)
    model = Qwen3ForSequenceClassification(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if name.endswith("norm.weight")
                        else 0.15 * torch.randn_like(param))
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (default_model_dir / name).is_file():
            shutil.copy(default_model_dir / name, path / name)
    return path


def hf_scores(path, query, documents):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    scores = []
    for document in documents:
        with torch.no_grad():
            logits = model(**tokenizer(query, document, return_tensors="pt")).logits
        scores.append(torch.sigmoid(logits[0, 0]).item())
    return scores


@pytest.mark.parametrize("chunked", [False, True])
def test_scores_equal_transformers(reranker, chunked):
    settings = dict(max_num_batched_tokens=8, long_prefill_token_threshold=0, tpot_target_s=0) if chunked else {}
    expected = hf_scores(reranker, QUERY, DOCUMENTS)
    assert max(expected) - min(expected) > 1e-3   # the documents score apart: a real check
    with LLM(model=str(reranker), compile=False, **settings) as llm:
        assert llm.engine.config.runner == "pooling"   # chosen from the architecture
        first = [o.outputs.score for o in llm.score(QUERY, DOCUMENTS)]
        again = [o.outputs.score for o in llm.score(QUERY, DOCUMENTS)]   # prefix-cache hits on the query
        hits = llm.engine.get_stats().prefix_cache_hits
    assert first == pytest.approx(expected, abs=1e-5)
    assert again == pytest.approx(expected, abs=1e-5)
    assert hits > 0


def test_a_reranker_serves_no_text(reranker):
    with pytest.raises(ValueError, match="sequence classifier"):
        LLM(model=str(reranker), runner="generate", compile=False)


def test_original_qwen3_reranker_by_hf_overrides(tiny_family):
    """The original Qwen3-Reranker layout (a plain Qwen3ForCausalLM) with
    vLLM's overrides: the score is softmax([no, yes])[yes] of the LM head's
    next-token logits on the last token, as the model card computes it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = tiny_family("qwen3")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
    expected = []
    for document in DOCUMENTS:
        with torch.no_grad():
            logits = model(**tokenizer(QUERY, document, return_tensors="pt")).logits[0, -1]
        expected.append(torch.softmax(logits[[no, yes]], -1)[1].item())
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
                 "is_original_qwen3_reranker": True}
    with LLM(model=str(path), compile=False, hf_overrides=overrides) as llm:
        assert llm.engine.config.runner == "pooling"
        scores = [o.outputs.score for o in llm.score(QUERY, DOCUMENTS)]
    assert scores == pytest.approx(expected, abs=1e-5)
    with pytest.raises(ValueError, match="classifier_from_token 'not-a-token' is not a token"):
        LLM(model=str(path), compile=False, hf_overrides={**overrides, "classifier_from_token": ["no", "not-a-token"]})
