"""The engine's embeddings and scores against sentence-transformers itself
(the library users compare with) on tiny random checkpoints that carry its
files: ``SentenceTransformer.encode`` for a Qwen3 decoder with last-token
pooling and for BERT and XLM-RoBERTa encoders with CLS and mean pooling,
``CrossEncoder.predict`` (a sigmoid over one label) for BERT and
XLM-RoBERTa cross-encoders. Text in, as a user sends it, so both sides
tokenise."""
import pytest
import torch

from loadtest.tiny_embedder import build_tiny_embedder, cosine_distance
from loadtest.tiny_encoder import WORDS, build_tiny_encoder
from pagedbackend import LLM

TOLERANCE = 1e-4   # cosine distance for embeddings; absolute for scores
SETTINGS = {"compile": False}


def texts(n, seed=0):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 60, (n,), generator=generator).tolist()
    return [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (k,), generator=generator))
            for k in lengths]


EMBEDDERS = {
    "qwen3-last": lambda path: build_tiny_embedder(path, "LAST"),
    "bert-cls": lambda path: build_tiny_encoder(path, "bert", "CLS"),
    "bert-mean": lambda path: build_tiny_encoder(path, "bert", "MEAN", normalize=False),
    "xlm-roberta-mean": lambda path: build_tiny_encoder(path, "xlm-roberta", "MEAN"),
}


@pytest.mark.parametrize("case", sorted(EMBEDDERS))
def test_embeddings_equal_sentence_transformers_encode(tmp_path, case):
    from sentence_transformers import SentenceTransformer
    folder = EMBEDDERS[case](tmp_path / case)
    batch = texts(12, seed=len(case))
    reference = SentenceTransformer(str(folder), device="cpu").encode(batch, convert_to_tensor=True)
    with LLM(model=str(folder), **SETTINGS) as llm:
        outputs = llm.embed(batch)
    assert len(outputs) == len(batch)
    for output, want in zip(outputs, reference):
        assert len(output.outputs.embedding) == want.shape[0]
        assert cosine_distance(output.outputs.embedding, want) < TOLERANCE
    if case == "bert-mean":   # not normalised: the lengths must agree too
        ours = torch.tensor([o.outputs.embedding for o in outputs])
        torch.testing.assert_close(ours.norm(dim=1), reference.norm(dim=1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model_type", ["bert", "xlm-roberta"])
def test_scores_equal_sentence_transformers_cross_encoder(tmp_path, model_type):
    from sentence_transformers import CrossEncoder
    folder = build_tiny_encoder(tmp_path / model_type, model_type, None, cross_encoder=True, seed=3)
    query, documents = texts(1, seed=7)[0], texts(8, seed=8)
    reference = CrossEncoder(str(folder), device="cpu").predict([(query, d) for d in documents])
    with LLM(model=str(folder), **SETTINGS) as llm:
        scores = [o.outputs.score for o in llm.score(query, documents)]
    assert len(set(round(s, 3) for s in scores)) > 1   # the documents are told apart
    assert max(abs(s - float(r)) for s, r in zip(scores, reference)) < TOLERANCE
