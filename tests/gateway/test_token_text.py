"""Where tokens' text is (no model, no processes): prompt tokens' offsets in the text as sent, and
the own bytes of tokens that are pieces of a UTF-8 character, with the default model's byte-level
BPE tokenizer and a SentencePiece-style byte-fallback one."""

from __future__ import annotations

import pytest

from pagedserve.text.token_text import MisalignedText, TokenBytes, text_offsets

WORD = "日本語"


@pytest.mark.parametrize("tokenizer_fixture", ["hf_tokenizer", "sp_tokenizer"])
def test_pieces_of_characters_have_their_own_bytes(request, tokenizer_fixture):
    tokenizer = request.getfixturevalue(tokenizer_fixture)
    ids = tokenizer.encode(WORD, add_special_tokens=False)
    names = [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    assert "\ufffd" in "".join(names)  # some tokens are pieces of a character
    token_bytes = TokenBytes(tokenizer)
    assert b"".join(token_bytes(i, name) for i, name in zip(ids, names)) == WORD.encode()


def test_text_offsets_index_the_text_as_sent(hf_tokenizer):
    text = "Hi 日本<|im_start|>x"  # a special token typed in the text is in it
    plain = hf_tokenizer.encode(text, add_special_tokens=False)
    offsets = text_offsets(hf_tokenizer, text, plain)
    pieces = [hf_tokenizer.decode([i], skip_special_tokens=False) for i in plain]
    for piece, offset in zip(pieces, offsets):
        assert "\ufffd" in piece or text.startswith(piece, offset)
    assert offsets == sorted(offsets) and offsets[-1] == len(text) - 1
    # a BOS put before the text stands at 0, an EOS after it at the text's end
    assert text_offsets(hf_tokenizer, text, [1, *plain, 2]) == [0, *offsets, len(text)]
    with pytest.raises(MisalignedText):
        text_offsets(hf_tokenizer, text, [1, *plain[1:]])
