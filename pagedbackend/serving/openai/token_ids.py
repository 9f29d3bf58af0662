"""Token ids a client sends, checked against the vocabulary before they reach
the tokenizer or Triton: completions' ``prompt`` given as ids (one list, or a
list of lists) and ``/detokenize``'s ``tokens``. The bound is the tokenizer's
(as vLLM's), so every id accepted can also be decoded (echo, logprobs)."""
from typing import Sequence

from pagedbackend.errors import InvalidRequestError


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str, where: str = "") -> None:
    """InvalidRequestError naming ``param`` for the first id outside
    ``[0, vocab_size)``; ``where`` says which list of the field it is in."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"{param}{where}: token id {bad} is outside the vocabulary "
                                  f"(0..{vocab_size - 1})", param)
