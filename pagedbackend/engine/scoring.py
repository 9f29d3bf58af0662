"""Scores of a cross-encoder (``BertForSequenceClassification`` with one
label, a reranker): a (query, document) pair is one request, tokenised as
its tokenizer encodes a pair (BERT: ``[CLS] query [SEP] document [SEP]``,
segment 0 then 1), computed whole by the encoder (``worker.encoder_runner``),
whose classifier's logit, through a sigmoid, is the score (vLLM's and
sentence-transformers' ``CrossEncoder`` activation for one label).

A pair prompt is ``{"text": query, "text_pair": document}`` (the names of
the tokenizer's arguments).
"""
from typing import List, Optional, Tuple

import torch

from ..errors import InvalidRequestError

PAIR_KEYS = ("text", "text_pair")


def is_pair(prompt) -> bool:
    """Whether ``prompt`` is a (query, document) pair."""
    return isinstance(prompt, dict) and "text_pair" in prompt


def tokenize_pair(tokenizer, prompt: dict, max_chars: int) -> Tuple[List[int], Optional[int]]:
    """The token ids of a pair and where its second segment starts (None: one segment)."""
    if set(prompt) != set(PAIR_KEYS):
        raise InvalidRequestError(f"a text pair has the keys {', '.join(PAIR_KEYS)}; got {sorted(prompt)}")
    for key in PAIR_KEYS:
        text = prompt[key]
        if not isinstance(text, str) or not text:
            raise InvalidRequestError(f"{key} of a text pair must be a non-empty string")
        if len(text) > max_chars:
            raise InvalidRequestError(f"{key} has {len(text)} characters; the limit is {max_chars} "
                                      "(engine setting max_prompt_chars)")
    encoded = tokenizer(prompt["text"], prompt["text_pair"])
    ids, types = list(encoded["input_ids"]), encoded.get("token_type_ids")
    start = types.index(1) if types is not None and 1 in types else None
    return ids, start


def score_of(logits: torch.Tensor) -> torch.Tensor:
    """The score of one pair from its classifier's one logit."""
    return torch.sigmoid(logits)
