"""Incremental detokenisation and stop-string detection.

Decoding a short window of recent tokens (with a few tokens of context before
it) keeps the cost per step constant; a window that ends inside a multi-byte
character (U+FFFD) waits for the next token.
"""
from typing import Optional

_CONTEXT_TOKENS = 5


def _decoder(tokenizer):
    """The tokenizer's decode, or that of its Rust ``tokenizers`` backend when
    the two give the same text (a fast tokenizer without transformers'
    clean-up of spaces): transformers' wrapper costs more than the decoding
    of a few tokens, twice per sequence per step."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "decode") and \
            not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return backend.decode
    return tokenizer.decode


def decode_new_text(tokenizer, seq, skip_special_tokens: bool = True) -> str:
    """New text of ``seq`` (``output_processor.SeqText``) since the previous
    call; updates its offsets and text."""
    if seq.read_offset == 0:
        seq.read_offset = seq.num_prompt_tokens
        seq.prefix_offset = max(seq.num_prompt_tokens - _CONTEXT_TOKENS, 0)
    ids = seq.token_ids
    decode = _decoder(tokenizer)
    prefix_text = decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip_special_tokens)
    full_text = decode(ids[seq.prefix_offset:], skip_special_tokens=skip_special_tokens)
    if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
        new_text = full_text[len(prefix_text):]
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        seq.output_text += new_text
        return new_text
    return ""


def find_stop_string(seq, new_text_len: int, stops, include_stop: bool) -> Optional[str]:
    """If a stop string now appears in the output text, truncate the text there
    and return it. Only the tail that the new text could complete is searched, so
    stops spanning token boundaries are found."""
    text = seq.output_text
    for stop in stops:
        start = max(0, len(text) - new_text_len - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1:
            seq.output_text = text[:idx + len(stop)] if include_stop else text[:idx]
            return stop
    return None
