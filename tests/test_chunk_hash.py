"""Prefix keys: known answers derived independently with hashlib/struct, and the array boundary.

Reference derivation (rust/chunk_hash.rs):
    namespace = SHA-256(b"kvcompass-ns-v1" || u32le(len(model)) || model || u32le(len(tenant)) || tenant)
    key(c)    = u64be(SHA-256(namespace || tokens[:c] as u32le)[:8]) >> 1
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvcompass as kc
from kvcompass import errors as E

NO_KEY = 2**64 - 1


def ref_namespace(model: str, tenant: str) -> bytes:
    m, t = model.encode("utf-8"), tenant.encode("utf-8")
    return hashlib.sha256(b"kvcompass-ns-v1" + struct.pack("<I", len(m)) + m + struct.pack("<I", len(t)) + t).digest()


def ref_key(ns: bytes, tokens: list[int], c: int) -> int:
    if c > len(tokens):
        return NO_KEY
    d = hashlib.sha256(ns + struct.pack(f"<{c}I", *tokens[:c])).digest()
    return int.from_bytes(d[:8], "big") >> 1


def u32(xs: list[int] | range) -> np.ndarray:
    return np.array(list(xs), dtype=np.uint32)


# Constants pinned by the Rust unit tests; the reference above must reproduce them too, so the
# two implementations are checked against each other and against a fixed answer.
KAT_NS_HEX = "0ace51f96917c52aa632830dec8e10c8d747cc92c623086cbff9b5c3f913459b"
KAT_TOKENS = [i * 1000 + 7 for i in range(8)]
KAT_KEYS = {1: 0x448B89159A03A245, 4: 0x4BE10151A51B4959, 8: 0x3C9A63D3757B21AD}


def test_constants() -> None:
    assert kc.NO_KEY == NO_KEY
    assert isinstance(kc.PATCH_VERSION, int) and kc.PATCH_VERSION == 1


def test_reference_reproduces_pinned_answers() -> None:
    ns = ref_namespace("llama-3.1-8b", "public")
    assert ns.hex() == KAT_NS_HEX
    for c, k in KAT_KEYS.items():
        assert ref_key(ns, KAT_TOKENS, c) == k


def test_known_answer_namespace_and_keys() -> None:
    ns = kc.namespace_digest("llama-3.1-8b", "public")
    assert isinstance(ns, bytes) and len(ns) == 32
    assert ns.hex() == KAT_NS_HEX
    keys = kc.prefix_keys(ns, u32(KAT_TOKENS), u32([1, 4, 8, 9]))
    assert keys.dtype == np.uint64 and keys.shape == (4,)
    assert keys.tolist() == [KAT_KEYS[1], KAT_KEYS[4], KAT_KEYS[8], NO_KEY]


@pytest.mark.parametrize(
    ("model", "tenant"),
    [("", ""), ("m", "t"), ("llama-3.1-70b", "tenant-42"), ("modèle-ü", "租户"), ("a" * 300, "b" * 70_000)],
)
def test_namespace_digest_matches_reference(model: str, tenant: str) -> None:
    # Non-ASCII names check the prefix is the UTF-8 byte length, not the character count.
    assert kc.namespace_digest(model, tenant) == ref_namespace(model, tenant)


def test_keys_match_reference_for_many_prompts(rng: np.random.Generator) -> None:
    for model, tenant in [("m", "t"), ("qwen", "public"), ("", "x")]:
        ns = kc.namespace_digest(model, tenant)
        for n in [0, 1, 2, 7, 64, 257]:
            tokens = rng.integers(0, 2**32, size=n, dtype=np.uint32)
            lengths = [1, 2, 3, 16, 64, 128, 256, 257, 1000]
            got = kc.prefix_keys(ns, tokens, u32(lengths)).tolist()
            assert got == [ref_key(ns, tokens.tolist(), c) for c in lengths]


def test_extreme_token_values_are_hashed_as_u32_le() -> None:
    ns = kc.namespace_digest("m", "t")
    tokens = [0, 2**32 - 1, 1, 2**31, 0x01020304]
    got = kc.prefix_keys(ns, u32(tokens), u32([1, 2, 3, 4, 5])).tolist()
    assert got == [ref_key(ns, tokens, c) for c in range(1, 6)]


def test_keys_are_63_bit(rng: np.random.Generator) -> None:
    ns = kc.namespace_digest("m", "t")
    tokens = rng.integers(0, 2**32, size=2000, dtype=np.uint32)
    keys = kc.prefix_keys(ns, tokens, np.arange(1, 2001, dtype=np.uint32))
    assert int(keys.max()) < 2**63
    assert len(np.unique(keys)) == 2000


def test_one_pass_equals_separate_calls_any_order(rng: np.random.Generator) -> None:
    ns = kc.namespace_digest("m", "t")
    tokens = rng.integers(0, 2**32, size=300, dtype=np.uint32)
    lengths = [256, 1, 64, 300, 64, 128, 301, 5, 1]  # unsorted, duplicates, one past the prompt
    together = kc.prefix_keys(ns, tokens, u32(lengths)).tolist()
    separate = [int(kc.prefix_keys(ns, tokens, u32([c]))[0]) for c in lengths]
    assert together == separate
    assert together == [ref_key(ns, tokens.tolist(), c) for c in lengths]
    assert together[0] != together[3]  # different lengths give different keys


def test_namespaces_separate_keys() -> None:
    tokens = u32([1, 2, 3, 4])
    lengths = u32([1, 4])
    a = kc.prefix_keys(kc.namespace_digest("m", "a"), tokens, lengths)
    b = kc.prefix_keys(kc.namespace_digest("m", "b"), tokens, lengths)
    c = kc.prefix_keys(kc.namespace_digest("n", "a"), tokens, lengths)
    assert set(a.tolist()).isdisjoint(b.tolist())
    assert set(a.tolist()).isdisjoint(c.tolist())


def test_model_and_tenant_are_length_prefixed() -> None:
    # Plain concatenation would make all of these equal.
    pairs = [("ab", "c"), ("a", "bc"), ("abc", ""), ("", "abc")]
    digests = {kc.namespace_digest(m, t) for m, t in pairs}
    assert len(digests) == len(pairs)
    for m, t in pairs:
        assert kc.namespace_digest(m, t) == ref_namespace(m, t)


def test_no_key_past_the_prompt() -> None:
    ns = kc.namespace_digest("m", "t")
    keys = kc.prefix_keys(ns, u32(range(10)), u32([9, 10, 11, 2**32 - 1])).tolist()
    assert keys[0] != NO_KEY and keys[1] != NO_KEY
    assert keys[2:] == [NO_KEY, NO_KEY]
    assert kc.prefix_keys(ns, u32([]), u32([1, 5])).tolist() == [NO_KEY, NO_KEY]
    assert kc.prefix_keys(ns, u32(range(10)), u32([])).shape == (0,)


def test_prefix_keys_accepts_read_only_arrays() -> None:
    ns = kc.namespace_digest("m", "t")
    tokens = u32(range(20))
    lengths = u32([3, 20])
    tokens.setflags(write=False)
    lengths.setflags(write=False)
    assert kc.prefix_keys(ns, tokens, lengths).tolist() == [ref_key(ns, list(range(20)), c) for c in (3, 20)]


def test_batch_form_equals_single(rng: np.random.Generator) -> None:
    ns = kc.namespace_digest("m", "t")
    prompts = [rng.integers(0, 2**32, size=n, dtype=np.uint32) for n in [5, 0, 40, 16, 1, 33]]
    tokens = np.concatenate(prompts).astype(np.uint32)
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in prompts])]).astype(np.uint64)
    lengths = u32([1, 4, 16, 32, 40, 41])
    got = kc.prefix_keys_batch(ns, tokens, offsets, lengths)
    assert got.dtype == np.uint64 and got.shape == (len(prompts), len(lengths))
    for i, p in enumerate(prompts):
        assert got[i].tolist() == kc.prefix_keys(ns, p, lengths).tolist()
        assert got[i].tolist() == [ref_key(ns, p.tolist(), c) for c in lengths.tolist()]


def test_batch_offsets_need_not_start_at_zero_and_may_be_empty() -> None:
    ns = kc.namespace_digest("m", "t")
    tokens = u32(range(30))
    got = kc.prefix_keys_batch(ns, tokens, np.array([10, 20, 30], dtype=np.uint64), u32([1, 10]))
    assert got.tolist() == [
        [ref_key(ns, list(range(10, 20)), 1), ref_key(ns, list(range(10, 20)), 10)],
        [ref_key(ns, list(range(20, 30)), 1), ref_key(ns, list(range(20, 30)), 10)],
    ]
    none = kc.prefix_keys_batch(ns, tokens, np.array([0], dtype=np.uint64), u32([1, 2]))
    assert none.shape == (0, 2) and none.dtype == np.uint64


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=40),
    lengths=st.lists(st.integers(1, 45), max_size=12),
    model=st.text(max_size=8),
    tenant=st.text(max_size=8),
)
def test_property_matches_reference(tokens: list[int], lengths: list[int], model: str, tenant: str) -> None:
    ns = kc.namespace_digest(model, tenant)
    assert ns == ref_namespace(model, tenant)
    got = kc.prefix_keys(ns, u32(tokens), u32(lengths)).tolist()
    assert got == [ref_key(ns, tokens, c) for c in lengths]


# ---- errors -------------------------------------------------------------------------------


NS = kc.namespace_digest("m", "t")


@pytest.mark.parametrize(
    ("tokens", "lengths", "name"),
    [
        (np.arange(10, dtype=np.int64), u32([1]), "tokens"),
        (np.arange(10, dtype=np.uint64), u32([1]), "tokens"),
        (np.arange(10, dtype=np.float64), u32([1]), "tokens"),
        ([1, 2, 3], u32([1]), "tokens"),
        (np.zeros((2, 5), dtype=np.uint32), u32([1]), "tokens"),
        (u32(range(10)), np.array([1.0, 2.0]), "lengths"),
        (u32(range(10)), np.array([1, 2], dtype=np.int64), "lengths"),
        (u32(range(10)), [1, 2], "lengths"),
    ],
)
def test_wrong_dtype_or_shape_is_a_value_error_naming_the_argument(tokens: object, lengths: object, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        kc.prefix_keys(NS, tokens, lengths)  # type: ignore[arg-type]


def test_non_contiguous_arrays_are_refused() -> None:
    base = u32(range(20))
    with pytest.raises(ValueError, match="tokens.*contiguous"):
        kc.prefix_keys(NS, base[::2], u32([1]))
    with pytest.raises(ValueError, match="lengths.*contiguous"):
        kc.prefix_keys(NS, base, u32([1, 2, 3, 4])[::2])
    # The same data made contiguous is accepted and hashes the selected tokens.
    got = kc.prefix_keys(NS, np.ascontiguousarray(base[::2]), u32([10]))
    assert got.tolist() == [ref_key(NS, list(range(0, 20, 2)), 10)]


@pytest.mark.parametrize("bad", [b"", b"\x00" * 31, b"\x00" * 33, "x" * 32, bytearray(32), np.zeros(32, np.uint8), None])
def test_namespace_must_be_32_bytes(bad: object) -> None:
    with pytest.raises(ValueError, match="namespace"):
        kc.prefix_keys(bad, u32([1]), u32([1]))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="namespace"):
        kc.prefix_keys_batch(bad, u32([1]), np.array([0, 1], dtype=np.uint64), u32([1]))  # type: ignore[arg-type]


def test_length_zero_is_invalid_argument() -> None:
    with pytest.raises(E.InvalidArgumentError, match="length"):
        kc.prefix_keys(NS, u32(range(5)), u32([3, 0]))
    with pytest.raises(E.InvalidArgumentError):
        kc.prefix_keys_batch(NS, u32(range(5)), np.array([0, 5], dtype=np.uint64), u32([0]))
    assert issubclass(E.InvalidArgumentError, ValueError)


@pytest.mark.parametrize(
    "offsets",
    [
        [],  # needs at least one element
        [0, 11],  # past the end of tokens
        [5, 2],  # decreasing
        [0, 4, 3, 10],  # decreasing in the middle
        [0, 10, 2**64 - 1],  # huge end
    ],
)
def test_bad_offsets(offsets: list[int]) -> None:
    tokens = u32(range(10))
    off = np.array(offsets, dtype=np.uint64)
    with pytest.raises(E.InvalidArgumentError, match="offsets"):
        kc.prefix_keys_batch(NS, tokens, off, u32([1]))


def test_offsets_dtype_and_contiguity() -> None:
    tokens = u32(range(10))
    with pytest.raises(ValueError, match="offsets"):
        kc.prefix_keys_batch(NS, tokens, np.array([0, 10], dtype=np.int64), u32([1]))
    with pytest.raises(ValueError, match="offsets"):
        kc.prefix_keys_batch(NS, tokens, np.array([0, 5, 5, 10], dtype=np.uint64)[::2], u32([1]))


def test_shard_of() -> None:
    for key in [0, 1, 12345678901234567, 2**63 - 1, 2**64 - 1]:
        for shards in [1, 2, 3, 7, 2**32 - 1]:
            assert kc.shard_of(key, shards) == key % shards
    with pytest.raises(ValueError):
        kc.shard_of(5, 0)
