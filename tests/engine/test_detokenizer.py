"""Incremental detokenisation: the text streamed token by token is the text of
the whole output, through the Rust backend's decode and through
transformers' wrapper alike."""
import copy

import pytest

from pagedbackend.engine.output_processor import SeqText
from pagedbackend.engine.detokenizer import _decoder, decode_new_text
from pagedbackend.engine.tokenizer import load_tokenizer

TEXT = "Héllo wörld — 日本語 and emoji 🙂🚀, then <|im_end|> plain ascii."


@pytest.mark.parametrize("wrapper", [False, True])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streamed_text_is_the_whole_outputs_text(default_model_dir, wrapper, skip_special_tokens):
    tokenizer = load_tokenizer(default_model_dir)
    if wrapper:   # transformers' clean-up of spaces asked for: its own decode must be used
        tokenizer = copy.copy(tokenizer)
        tokenizer.clean_up_tokenization_spaces = True
        assert _decoder(tokenizer) == tokenizer.decode
    else:
        assert _decoder(tokenizer) != tokenizer.decode   # the backend's, a fast tokenizer here
    prompt = tokenizer.encode("Say something:", add_special_tokens=False)
    output = tokenizer.encode(TEXT, add_special_tokens=False)
    seq = SeqText(prompt, index=0)
    pieces = []
    for token in output:
        seq.token_ids.append(token)
        pieces.append(decode_new_text(tokenizer, seq, skip_special_tokens))
    assert "".join(pieces) == seq.output_text
    assert seq.output_text == tokenizer.decode(output, skip_special_tokens=skip_special_tokens)
    assert any(p == "" for p in pieces)   # a multi-byte character waited for its last token
