"""The server's incremental detokenizer: same text and stops as decoding the whole generation
every token (the reference below), with bounded work per token."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from runtime.server import _Detokenizer
from runtime.testing import ascii_tokenizer


def byte_tokenizer():
    """Byte-level: one token per UTF-8 byte, so a character can span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    core = Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(alphabet))}, []))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core)


ASCII, BYTES = ascii_tokenizer(), byte_tokenizer()


def reference(tokenizer, tokens: list[int], stops: list[str]) -> tuple[str, bool]:
    """Decode everything after every token (what the server did before): final text, stopped."""
    ids: list[int] = []
    for token in tokens:
        ids.append(token)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        cuts = [text.find(stop) for stop in stops if stop in text]
        if cuts:
            return text[:min(cuts)], True
    return tokenizer.decode(ids, skip_special_tokens=True), False


def streamed(tokenizer, tokens: list[int], stops: list[str]) -> tuple[str, str, bool]:
    detok = _Detokenizer(tokenizer, stops)
    pieces = detok.push_many(tokens)
    return "".join(pieces) + detok.finish(), detok.text, detok.stopped


@given(text=st.text(alphabet="abcab é€😀\n", max_size=60),
       stops=st.lists(st.text(alphabet="abc é€", min_size=1, max_size=4), max_size=4))
def test_deltas_and_stops_match_decoding_everything(text, stops):
    ascii_text = text.encode("ascii", "ignore").decode()
    ascii_stops = [s for s in (s.encode("ascii", "ignore").decode() for s in stops) if s]
    for tokenizer, body, stop in ((ASCII, ascii_text, ascii_stops), (BYTES, text, stops)):
        tokens = tokenizer(body, add_special_tokens=False)["input_ids"]
        expected, stopped = reference(tokenizer, tokens, stop)
        joined, whole, was_stopped = streamed(tokenizer, tokens, stop)
        assert (joined, whole, was_stopped) == (expected, expected, stopped)


def test_the_byte_tokenizer_splits_characters():
    tokens = BYTES("é😀", add_special_tokens=False)["input_ids"]
    assert len(tokens) == 6 and BYTES.decode(tokens[:1]) == "\ufffd"
    assert BYTES.decode(tokens) == "é😀"


def test_a_stop_split_across_tokens_is_held_back_then_cut():
    detok = _Detokenizer(ASCII, ["END"])
    out = [detok.push(ord(c)) for c in "abcENxEN"]
    assert "".join(out) == "abcENx"  # "EN" held while it could still become "END"
    assert detok.push(ord("D")) == "" and detok.stopped and detok.text == "abcENx"


class CountingTokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.decoded_ids = tokenizer, 0

    def decode(self, ids, **kwargs):
        self.decoded_ids += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


def test_each_token_decodes_a_short_window_not_the_whole_generation():
    counting = CountingTokenizer(ASCII)
    detok = _Detokenizer(counting, ["never appears"])
    n = 3000
    detok.push_many([ord("a") + i % 20 for i in range(n)])
    assert len(detok.text) == n
    assert counting.decoded_ids <= 4 * n  # the whole-text decode read n*(n+1)/2 = 4.5M ids
