"""The pure-Python helpers in kvcompass.index_types and the package's public surface."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvcompass as kc
from kvcompass import _core
from kvcompass.index_types import Namespace, Tier, as_tokens, pack_tiers, tier_of, unpack_tiers


def test_public_surface_reexports_the_core() -> None:
    for name in kc.__all__:
        assert hasattr(kc, name), name
    for name in ["LudoTable", "LudoView", "Router", "RouteResult", "ApplyResult", "prefix_keys", "prefix_keys_batch", "namespace_digest", "shard_of", "decode_batch_header", "NO_KEY", "PATCH_VERSION"]:
        assert getattr(kc, name) is getattr(_core, name)
    assert kc.errors.__name__ == "kvcompass.errors"
    assert isinstance(kc.__version__, str)


# ---- Namespace ----------------------------------------------------------------------------


def test_namespace_digest_and_defaults() -> None:
    n = Namespace("llama")
    assert n.tenant == "public"
    assert n.digest == kc.namespace_digest("llama", "public")
    assert Namespace("llama", "acme").digest == kc.namespace_digest("llama", "acme")
    assert Namespace("llama", "acme").digest != n.digest
    assert "digest" not in repr(n)


def test_namespace_is_frozen_value_object() -> None:
    a, b = Namespace("m", "t"), Namespace("m", "t")
    assert a == b and hash(a) == hash(b)
    assert a != Namespace("m", "u")
    assert len({a, b, Namespace("m", "u")}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.model = "x"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.digest = b"\x00" * 32  # type: ignore[misc]
    with pytest.raises(TypeError):
        Namespace("m", "t", b"\x00" * 32)  # type: ignore[call-arg]  # digest is not an init field
    assert not hasattr(a, "__dict__")  # slots


def test_namespace_keys_equals_prefix_keys(rng: np.random.Generator) -> None:
    n = Namespace("m", "t")
    tokens = rng.integers(0, 2**32, size=50, dtype=np.uint32)
    lengths = np.array([1, 8, 50, 51], dtype=np.uint32)
    want = kc.prefix_keys(n.digest, tokens, lengths)
    for toks in (tokens, tokens.tolist(), tokens.astype(np.int64)):
        for lens in (lengths, lengths.tolist(), tuple(lengths.tolist())):
            got = n.keys(toks, lens)
            assert got.dtype == np.uint64
            assert got.tolist() == want.tolist()
    assert n.keys(tokens, [51]).tolist() == [kc.NO_KEY]


def test_namespace_keys_refuses_bad_tokens() -> None:
    n = Namespace("m")
    with pytest.raises(ValueError):
        n.keys([1, -2, 3], [1])
    with pytest.raises(ValueError):
        n.keys([2**32], [1])


def test_namespace_keys_refuses_lengths_that_do_not_fit() -> None:
    n = Namespace("m")
    tokens = list(range(10))
    with pytest.raises(ValueError):
        n.keys(tokens, np.array([2**32 + 3], dtype=np.int64))
    with pytest.raises(ValueError):
        n.keys(tokens, np.array([-1], dtype=np.int64))


# ---- Tier and packing ---------------------------------------------------------------------


def test_tier_enum() -> None:
    assert [int(t) for t in Tier] == [0, 1, 2]
    assert Tier.ABSENT == 0 and Tier.VRAM == 1 and Tier.DRAM == 2
    assert isinstance(Tier.VRAM, int)
    with pytest.raises(ValueError):
        Tier(3)


def test_pack_tiers_layout() -> None:
    assert pack_tiers([]) == 0
    assert pack_tiers([1]) == 0b01
    assert pack_tiers([2]) == 0b10
    assert pack_tiers([0, 1]) == 0b0100
    assert pack_tiers([2, 0, 1]) == 0b01_00_10
    assert pack_tiers([Tier.DRAM] * 32) == int("10" * 32, 2)
    assert pack_tiers([0] * 31 + [1]) == 1 << 62


@pytest.mark.parametrize("bad", [3, -1, 4, 255])
def test_pack_tiers_refuses_reserved_and_out_of_range(bad: int) -> None:
    with pytest.raises(ValueError, match="field 1"):
        pack_tiers([1, bad, 2])


def test_tier_of_and_unpack() -> None:
    v = 0b10_01_00_10
    assert tier_of(v, 0) is Tier.DRAM
    assert tier_of(v, 1) is Tier.ABSENT
    assert tier_of(v, 2) is Tier.VRAM
    assert tier_of(v, 3) is Tier.DRAM
    assert tier_of(v, 40) is Tier.ABSENT
    assert unpack_tiers(v, 5) == [Tier.DRAM, Tier.ABSENT, Tier.VRAM, Tier.DRAM, Tier.ABSENT]
    assert unpack_tiers(v, 0) == []


@given(st.lists(st.sampled_from([0, 1, 2]), max_size=32))
def test_pack_unpack_roundtrip(tiers: list[int]) -> None:
    v = pack_tiers(tiers)
    assert 0 <= v < 2**64
    assert unpack_tiers(v, len(tiers)) == [Tier(t) for t in tiers]
    for f, t in enumerate(tiers):
        assert tier_of(v, f) == t


def test_pack_matches_table_set_field() -> None:
    # The helper's layout is the one the Rust table writes (field f at bits 2f..2f+1).
    t = kc.LudoTable(capacity=16, value_bits=64)
    tiers = [2, 0, 1, 1, 0, 2] + [0] * 20 + [1, 0, 0, 0, 0, 2]
    v = 0
    for f, tier in enumerate(tiers):
        v = t.set_field(7, f, tier)
    assert v == pack_tiers(tiers) == t.get(7)
    assert unpack_tiers(v, 32) == [Tier(x) for x in tiers]


# ---- as_tokens ----------------------------------------------------------------------------


def test_as_tokens_accepts_fitting_integers() -> None:
    for src in ([0, 1, 2**32 - 1], (0, 1, 2**32 - 1), np.array([0, 1, 2**32 - 1], dtype=np.int64), np.array([0, 1, 2**32 - 1], dtype=np.uint64)):
        out = as_tokens(src)
        assert out.dtype == np.uint32 and out.flags.c_contiguous
        assert out.tolist() == [0, 1, 2**32 - 1]
    for dt in (np.int8, np.uint8, np.int16, np.uint16, np.int32):
        assert as_tokens(np.array([1, 2, 3], dtype=dt)).tolist() == [1, 2, 3]
    empty = as_tokens([])
    assert empty.dtype == np.uint32 and empty.shape == (0,)


def test_as_tokens_uint32_fast_path() -> None:
    a = np.arange(10, dtype=np.uint32)
    assert as_tokens(a) is a or np.shares_memory(as_tokens(a), a)
    strided = a[::2]
    out = as_tokens(strided)
    assert out.flags.c_contiguous and out.tolist() == [0, 2, 4, 6, 8]
    be = np.arange(5, dtype=">u4")
    assert as_tokens(be).tolist() == [0, 1, 2, 3, 4] and as_tokens(be).dtype == np.uint32


@pytest.mark.parametrize(
    "bad",
    [
        [1, -1],
        np.array([0, -5], dtype=np.int64),
        [2**32],
        np.array([2**32], dtype=np.int64),
        np.array([2**40], dtype=np.uint64),
        [2**64],
        [1.0, 2.0],
        np.array([1.5]),
        [True, False],
        ["1"],
    ],
)
def test_as_tokens_refuses_values_that_do_not_fit(bad: object) -> None:
    with pytest.raises(ValueError):
        as_tokens(bad)  # type: ignore[arg-type]


def test_token_array_takes_exact_ints_that_fit_and_names_the_first_that_does_not() -> None:
    # The one-pass conversion behind as_tokens for lists and tuples (and the door's JSON ids).
    for seq in ([0, 7, 2**32 - 1], (0, 7, 2**32 - 1)):
        arr, bad = _core.token_array(seq)
        assert bad == -1 and arr.dtype == np.uint32 and arr.tolist() == [0, 7, 2**32 - 1]
    assert _core.token_array([])[1] == -1 and _core.token_array(())[0].shape == (0,)

    class Sub(int):
        pass

    for seq, i in (([1, 2**32], 1), ([5, -1], 1), ([True], 0), ([1, 2, 3.0], 2), ([2**64], 0), ([2**64 - 1], 0), ([0, Sub(3)], 1), ([0, np.uint32(3)], 1), ((1, "2"), 1)):
        arr, bad = _core.token_array(seq)
        assert (bad, arr.shape) == (i, (0,)), seq
    with pytest.raises(TypeError):
        _core.token_array(np.arange(3))


def test_as_tokens_from_lists_and_tuples_equals_the_numpy_path() -> None:
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 2**32, 5000, dtype=np.uint64)
    want = ids.astype(np.uint32)
    for src in (ids.tolist(), tuple(ids.tolist())):
        out = as_tokens(src)
        assert out.dtype == np.uint32 and out.flags.c_contiguous and np.array_equal(out, want)
    # What the one pass refuses still goes through the general path: numpy integers are taken.
    assert as_tokens([np.uint32(4), 5]).tolist() == [4, 5]


@pytest.mark.parametrize("bad", [[[1, 2], [3, 4]], np.zeros((2, 2), dtype=np.int64), np.array(5, dtype=np.int64)])
def test_as_tokens_refuses_non_1d(bad: object) -> None:
    with pytest.raises(ValueError, match="one-dimensional"):
        as_tokens(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [np.zeros((2, 3), dtype=np.uint32), np.array(5, dtype=np.uint32)])
def test_as_tokens_refuses_non_1d_uint32(bad: np.ndarray) -> None:
    with pytest.raises(ValueError, match="one-dimensional"):
        as_tokens(bad)
