"""The server's incremental detokenizer: same text and stops as decoding the whole generation
every token (the reference below), with bounded work per token; the concatenated stream equals
one full decode for random id sequences of the tiny tokenizers and of the real SmolLM2 one."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.serving.detokenize import Detokenizer
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


def byte_fallback_tokenizer():
    """SentencePiece/Llama style: a few pieces, and every other character as <0xNN> byte tokens
    (ByteFallback decoder), with the word-initial "▁" and the leading space stripped."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", "a", "b", "c", "▁a", "▁b", "é", "▁é"]:
        vocab[piece] = len(vocab)
    core = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    core.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                            normalizers.Replace(" ", "▁")])
    core.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                      decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


ASCII, BYTES, FALLBACK = ascii_tokenizer(), byte_tokenizer(), byte_fallback_tokenizer()


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
    detok = Detokenizer(tokenizer, stops)
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
    detok = Detokenizer(ASCII, ["END"])
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
    detok = Detokenizer(counting, ["never appears"])
    n = 3000
    detok.push_many([ord("a") + i % 20 for i in range(n)])
    assert len(detok.text) == n
    assert counting.decoded_ids <= 4 * n  # the whole-text decode read n*(n+1)/2 = 4.5M ids


def full_decode(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True)


def deltas(tokenizer, tokens: list[int]) -> list[str]:
    """What a client receives, token by token, then the tail finish() releases."""
    detok = Detokenizer(tokenizer, [])
    pieces = detok.push_many(tokens)
    pieces.append(detok.finish())
    assert detok.text == "".join(pieces)  # the non-streamed answer is the same text
    return pieces


def test_multi_byte_characters_come_out_whole():
    text = "aé€😀b"
    tokens = BYTES(text, add_special_tokens=False)["input_ids"]
    assert len(tokens) == len(text.encode())  # one token per byte: 1 + 2 + 3 + 4 + 1
    pieces = deltas(BYTES, tokens)
    assert [p for p in pieces if p] == ["a", "é", "€", "😀", "b"]


@given(text=st.text(alphabet="ab é€😀\nz", max_size=40))
def test_byte_fallback_tokens_stream_whole_characters(text):
    tokens = FALLBACK(text, add_special_tokens=False)["input_ids"]
    pieces = deltas(FALLBACK, tokens)
    assert "".join(pieces) == full_decode(FALLBACK, tokens)
    assert not any("\ufffd" in piece for piece in pieces)


def test_the_byte_fallback_tokenizer_uses_byte_tokens():
    tokens = FALLBACK("a €", add_special_tokens=False)["input_ids"]
    assert FALLBACK.convert_ids_to_tokens(tokens)[-3:] == ["<0xE2>", "<0x82>", "<0xAC>"]


def test_an_incomplete_character_at_the_end_is_released_by_finish():
    tokens = BYTES("€", add_special_tokens=False)["input_ids"][:2]  # 2 of its 3 bytes
    detok = Detokenizer(BYTES, [])
    assert detok.push_many(tokens) == ["", ""]
    assert detok.finish() == full_decode(BYTES, tokens) == "\ufffd"


@pytest.mark.parametrize("tokenizer", [ASCII, BYTES], ids=["ascii", "bytes"])
def test_random_sequences_stream_as_one_full_decode(tokenizer):
    """Any ids at all, special ones and invalid UTF-8 byte runs included."""
    rng = random.Random(16)
    for _ in range(400):
        tokens = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 60))]
        assert "".join(deltas(tokenizer, tokens)) == full_decode(tokenizer, tokens), tokens


def test_a_long_run_of_invalid_bytes_is_released_with_bounded_work():
    """Bytes that never form a character are held MAX_PENDING tokens at most, and the text
    still equals a full decode (a character completed later is not cut in half)."""
    counting = CountingTokenizer(BYTES)
    rng = random.Random(5)
    lead, continuation = BYTES("€", add_special_tokens=False)["input_ids"][:2]
    tokens = [rng.choice([lead, continuation, continuation]) for _ in range(3000)]
    detok = Detokenizer(counting, [])
    text = "".join(detok.push_many(tokens)) + detok.finish()
    assert text == full_decode(BYTES, tokens)
    assert counting.decoded_ids <= 40 * len(tokens)  # a whole-text decode per token: 4.5M


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """The real SmolLM2 tokenizer (byte-level BPE), from the GGUF the runtime serves."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from runtime.model import smollm2_gguf_path

    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                         local_files_only=True)


@pytest.mark.slow
def test_random_sequences_of_the_real_tokenizer_stream_as_one_full_decode(smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    # Tokens holding part of a character (about 300 of 49,152) are drawn often, so characters
    # split over tokens, invalid runs and held windows all occur.
    fragments = [i for i in range(len(tokenizer)) if "\ufffd" in tokenizer.decode([i])]
    assert 100 < len(fragments) < 1000
    rng = random.Random(16)
    for share in (0.0, 0.5, 0.8):
        for _ in range(200):
            tokens = [rng.choice(fragments) if rng.random() < share
                      else rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 60))]
            assert "".join(deltas(tokenizer, tokens)) == full_decode(tokenizer, tokens), tokens


@pytest.mark.slow
def test_real_text_streams_whole_characters(smollm2_tokenizer):
    text = "Grüße aus Köln: 東京 → 😀 naïve café"
    tokens = smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = deltas(smollm2_tokenizer, tokens)
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
