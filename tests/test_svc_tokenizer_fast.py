"""The Rust byte-level BPE (``_core.ByteLevelBpe``) gives HF ``tokenizers``' ids for the text it
takes: ASCII, Latin-1 Supplement, Latin Extended-A and General Punctuation.

Exactness is the whole contract: the door and the workers must agree on every id, or prefix keys
differ. The fast path is checked against HF itself: every ASCII string of up to two characters,
every supported character in each position class of the GPT-2 regex and beside every other
supported character, seeded random texts biased toward the regex's edge cases (contractions,
whitespace runs before words, control characters, typographic spaces and quotes), and the
package's own sources. Development runs also matched all 2.1 million ASCII strings of up to
three characters, 1.2 million strings of four and five characters over an alphabet of each
class's representatives, every pair of supported characters, and 830,000 strings of three and
four characters over the non-ASCII classes' representatives.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer

from kvcompass import _core
from kvcompass.engine.tokenizer import Tokenizer, default_corpus, load_tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    t = load_tokenizer(None)
    assert t.fast, "the built-in tokenizer is a plain byte-level BPE: the fast path must be on"
    return t


def hf_ids(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tok.hf.encode_batch(texts, add_special_tokens=False)]


def fast_ids(tok: Tokenizer, text: str) -> list[int]:
    ids = tok._fast.encode(text)  # type: ignore[union-attr]
    assert ids is not None, repr(text)
    assert ids.dtype == np.uint32
    return ids.tolist()


def assert_same(tok: Tokenizer, texts: list[str]) -> None:
    for text, want in zip(texts, hf_ids(tok, texts)):
        assert fast_ids(tok, text) == want, repr(text)


SUPPORTED = [chr(i) for i in range(0x80, 0x180)] + [chr(i) for i in range(0x2000, 0x2070) if i != 0x2065]


def test_every_ascii_string_of_up_to_two_characters(tok: Tokenizer) -> None:
    chars = [chr(i) for i in range(128)]
    assert_same(tok, chars + ["".join(p) for p in itertools.product(chars, repeat=2)])


@pytest.mark.parametrize("ctx", ["a{}b", "{}{}a", " {}a", "a {}", "'{}", "{}'s", "1{}2", "  {}  ", "\n{}\n", "x{} y", "{}'ll", "{} "])
def test_every_supported_character_in_each_context(tok: Tokenizer, ctx: str) -> None:
    assert_same(tok, [ctx.format(c, c) for c in [chr(i) for i in range(128)] + SUPPORTED])


def test_every_supported_character_beside_every_other(tok: Tokenizer) -> None:
    ascii_reps = list("aZ09 \t\n\x0b'!-_") + ["s"]
    texts = [a + b for a in SUPPORTED for b in SUPPORTED + ascii_reps] + [a + b for a in ascii_reps for b in SUPPORTED]
    assert_same(tok, texts)


def test_pieces_are_hf_pre_tokenizer_pieces(tok: Tokenizer) -> None:
    rng = random.Random(7)
    alphabet = list("aZs't lrvmed0 9\n\t\x0b\x0c\r !?.,-_\"'(") + ["  ", "'s", "'ll", "\n\n"]
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        want = [off for _, off in tok.hf.pre_tokenizer.pre_tokenize_str(text)]
        assert _core.ByteLevelBpe.pieces(text) == want, repr(text)


def test_seeded_random_texts(tok: Tokenizer) -> None:
    rng = random.Random(20261203)
    pools = [
        list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"),
        list("0123456789"),
        list(" \t\n\r\x0b\x0c"),
        list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"),
        ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "   ", "\n\n", " \n "],
        [chr(i) for i in range(32)] + ["\x7f"],
        list("éèàçñüößøåœŁłđ’‘“”—–…•\u00a0\u2003\u2009\u200b\u00ad\u0085\u2028²¼ªº"),
    ]
    texts = []
    for _ in range(3000):
        weights = [rng.random() for _ in pools]
        n = rng.choice([1, 2, 5, 20, 80, 300])
        texts.append("".join(rng.choice(rng.choices(pools, weights)[0]) for _ in range(n)))
    # Long single-class runs (one BPE word of hundreds of bytes) and a long whitespace run.
    texts += ["a" * 700, "ab" * 300, "7" * 500, "!?" * 200, " " * 300 + "x", "\n" * 50]
    assert_same(tok, texts)


def test_the_package_sources(tok: Tokenizer) -> None:
    texts = [p.read_text(encoding="utf-8") for p in default_corpus()]
    texts = [t for t in texts if t.isascii()][:40]
    assert len(texts) >= 20
    assert_same(tok, texts)


def test_other_text_goes_to_hf(tok: Tokenizer) -> None:
    for text in ["日本語 text", "🙂", "Ωmega", "a\u2065b", "naïve 한국어"]:
        assert tok._fast.encode(text) is None  # type: ignore[union-attr]
        assert tok.encode(text).tolist() == hf_ids(tok, [text])[0]
        assert _core.ByteLevelBpe.pieces(text) is None
    # Supported non-ASCII text is the fast path's, with HF's character offsets.
    text = "Café — “naïve”\u00a0costs 3½ €"
    assert _core.ByteLevelBpe.pieces(text) is None  # € (U+20AC) is outside the supported blocks
    text = "Café — “naïve”\u00a0costs 3½"
    assert _core.ByteLevelBpe.pieces(text) == [off for _, off in tok.hf.pre_tokenizer.pre_tokenize_str(text)]
    assert fast_ids(tok, text) == hf_ids(tok, [text])[0]


def test_chat_template_is_the_same_with_and_without_the_fast_path(tok: Tokenizer) -> None:
    slow = Tokenizer(HFTokenizer.from_str(tok.hf.to_str()))
    slow._fast = None
    chats = [
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Sum 2 and 3, don't explain."}],
        [{"role": "user", "content": "naïve café?"}, {"role": "assistant", "content": None}, {"role": "user", "content": "  spaced\n\nout  "}],
    ]
    for chat in chats:
        assert tok.apply_chat_template(chat).tolist() == slow.apply_chat_template(chat).tolist()
    assert tok.encode_chats(chats)[1][1] == slow.encode_chats(chats)[1][1]


def _variant(tok: Tokenizer, edit: dict[str, object]) -> Tokenizer:
    d = json.loads(tok.hf.to_str())
    for path, value in edit.items():
        node = d
        *head, last = path.split(".")
        for k in head:
            node = node[k]
        node[last] = value
    return Tokenizer(HFTokenizer.from_str(json.dumps(d)))


@pytest.mark.parametrize(
    "edit",
    [
        {"pre_tokenizer.add_prefix_space": True},
        {"normalizer": {"type": "Lowercase"}},
        {"model.dropout": 0.1},
        {"model.ignore_merges": True},
    ],
)
def test_files_it_does_not_reproduce_stay_on_hf(tok: Tokenizer, edit: dict[str, object]) -> None:
    other = _variant(tok, edit)
    assert not other.fast
    if "model.dropout" in edit:
        return  # HF's own ids are random then
    text = "Hello World, it's 2026!"
    assert other.encode(text).tolist() == [e.ids for e in other.hf.encode_batch([text], add_special_tokens=False)][0]


def test_a_non_special_added_token_keeps_hf(tok: Tokenizer, tmp_path: Path) -> None:
    d = json.loads(tok.hf.to_str())
    d["added_tokens"].append({"id": 3, "content": "hello", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": False})
    assert not Tokenizer(HFTokenizer.from_str(json.dumps(d))).fast


def test_a_file_with_a_repeated_merge_follows_hf(tok: Tokenizer) -> None:
    # HF's loader lets the later rank of a repeated pair win; the fast path reads the merges from
    # HF's serialization of what it loaded, so it applies the same ranks.
    d = json.loads(tok.hf.to_str())
    merges = d["model"]["merges"]
    d["model"]["merges"] = merges + [merges[16]]  # ('h', 'e') again, now last
    other = Tokenizer(HFTokenizer.from_str(json.dumps(d)))
    assert other.fast
    text = "the theme of the thesis is the other thing, then there"
    want = [e.ids for e in other.hf.encode_batch([text], add_special_tokens=False)][0]
    assert want != tok.encode(text).tolist()  # the repeat changed HF's ids ...
    assert other.encode(text).tolist() == want  # ... and the fast path's alike


def test_bad_construction() -> None:
    with pytest.raises(ValueError, match="256"):
        _core.ByteLevelBpe([0] * 255, [])
