"""Tiny random encoder checkpoints saved by transformers: a BERT or
XLM-RoBERTa embedder (bge / gte-base / bge-m3 shaped, optionally with the
sentence-transformers files that name its pooler) and a BERT cross-encoder
(``BertForSequenceClassification``, one label), each with a WordPiece
tokenizer written from a small vocabulary; and the scores transformers
gives for the cross-encoder."""
import pathlib
from typing import List, Optional, Sequence, Tuple

import torch

from loadtest.tiny_embedder import write_sentence_transformers_files

WORDS = ("the a of to and in is it that paged attention cache block token model query document server "
         "embedding vector score rank encoder decoder batch step memory kernel fast slow small large").split()
SPECIAL = ["[PAD]", "<pad>", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]   # <pad>: XLM-RoBERTa's padding id 1


def write_tokenizer(path: pathlib.Path) -> None:
    """A WordPiece tokenizer over the small vocabulary above (every word one token)."""
    from transformers import BertTokenizer
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = SPECIAL + WORDS + letters + ["##" + c for c in letters] + [str(d) for d in range(10)] + list(".,?!")
    BertTokenizer(vocab={token: i for i, token in enumerate(vocab)}).save_pretrained(path)


def build_tiny_encoder(path, model_type: str = "bert", pooling_type: Optional[str] = "CLS",
                       normalize: bool = True, cross_encoder: bool = False, seed: int = 0) -> pathlib.Path:
    """A 2-layer encoder (hidden 64, 4 heads) in ``path``: ``model_type``
    "bert" or "xlm-roberta"; ``pooling_type``: the sentence-transformers
    pooler written beside it (None: no such files); ``cross_encoder``: a
    ``*ForSequenceClassification`` with one label instead."""
    from transformers import (BertConfig, BertForSequenceClassification, BertModel, XLMRobertaConfig,
                              XLMRobertaForSequenceClassification, XLMRobertaModel)
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    shape = dict(vocab_size=200, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128, hidden_act="gelu", type_vocab_size=2)
    if model_type == "xlm-roberta":
        roberta = XLMRobertaConfig(**shape, max_position_embeddings=130, pad_token_id=1, bos_token_id=3,
                                   eos_token_id=4, **({"num_labels": 1} if cross_encoder else {}))
        model = (XLMRobertaForSequenceClassification if cross_encoder else XLMRobertaModel)(roberta)
    elif cross_encoder:
        model = BertForSequenceClassification(BertConfig(**shape, max_position_embeddings=128, num_labels=1))
    else:
        model = BertModel(BertConfig(**shape, max_position_embeddings=128))
    with torch.no_grad():   # random weights far from the initial ones: LayerNorms and biases matter too
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.eval().save_pretrained(path)
    write_tokenizer(path)
    if pooling_type is not None and not cross_encoder:
        write_sentence_transformers_files(path, pooling_type, normalize)
    return path


def hf_scores(path, pairs: Sequence[Tuple[Sequence[int], Sequence[int]]]) -> List[float]:
    """transformers' logit of each (query ids, document ids) pair, encoded as
    BERT encodes a pair: [CLS] query [SEP] document [SEP], segment 0 then 1."""
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    cls, sep = 3, 4   # the ids of [CLS] and [SEP] in the vocabulary above
    out = []
    with torch.no_grad():
        for query, document in pairs:
            first, second = [cls, *query, sep], [*document, sep]
            ids = torch.tensor([first + second])
            types = torch.tensor([[0] * len(first) + [1] * len(second)])
            out.append(float(model(input_ids=ids, token_type_ids=types).logits[0, 0]))
    return out
