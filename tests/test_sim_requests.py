"""RequestTable: a workload as columns gives back the very requests it was built from."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest

from kvcompass.errors import InvalidArgumentError
from kvcompass.sim.requests import ChainBlocks, Request, RequestTable, TraceBlocks
from kvcompass.sim.workload import synthetic_mixed


def _mixed_list() -> list[Request]:
    """Chain and trace requests, two regions and namespaces, out of arrival order."""
    out = []
    for i in range(40):
        blocks = ChainBlocks(((1000 + i % 3, 2), (77 + i, 1))) if i % 4 else TraceBlocks(np.arange(i % 5 + 1, dtype=np.uint64) + 10 * i)
        n = blocks.n_blocks
        out.append(Request(i, float((i * 37) % 11), ("eu", "us")[i % 2], i % 3, ("a", "b")[i % 5 == 0], n * 16 - 3, i, 16, i - i % 2, i - 1 if i % 2 else -1, blocks, ("trace", "tool")[i % 2]))
    return out


def test_rows_are_the_requests_they_were_built_from() -> None:
    reqs = _mixed_list()
    t = RequestTable.from_requests(reqs)
    assert len(t) == len(reqs) and t == reqs and list(t) == reqs
    for i in (0, 1, 5, 39, -1, -40):
        r = t[i]
        assert r == reqs[i] and type(r.blocks) is type(reqs[i].blocks)
        assert r._scalars() == reqs[i]._scalars()
        assert [type(v) for v in r._scalars()] == [type(v) for v in reqs[i]._scalars()]  # Python values, not numpy scalars
        assert np.array_equal(r.input_tokens(), reqs[i].input_tokens())
    assert t[3:17:2] == reqs[3:17:2] and isinstance(t[3:17:2], RequestTable)
    assert t[::-1] == reqs[::-1]
    with pytest.raises(IndexError):
        t[40]
    with pytest.raises(IndexError):
        t[-41]
    assert RequestTable.from_requests(t) is t


def test_by_arrival_orders_as_sorted_does() -> None:
    reqs = _mixed_list()
    t = RequestTable.from_requests(reqs).by_arrival()
    assert list(t) == sorted(reqs, key=lambda r: (r.arrival_ms, r.id))
    assert t.by_arrival() is t


def test_pickles_and_stays_read_only() -> None:
    t = RequestTable.from_requests(_mixed_list())
    back = pickle.loads(pickle.dumps(t))
    assert back == t and back.region_names == t.region_names
    with pytest.raises(AttributeError):
        t.ids = np.zeros(1)  # type: ignore[misc]
    with pytest.raises(ValueError):
        t.flat[0] = 1


def test_refuses_inconsistent_columns() -> None:
    t = RequestTable.from_requests(_mixed_list())
    cols = {k: getattr(t, k) for k in RequestTable.__slots__}
    with pytest.raises(InvalidArgumentError, match="offsets"):
        RequestTable(**{**cols, "offsets": cols["offsets"] + 1})
    with pytest.raises(InvalidArgumentError, match="shape"):
        RequestTable(**{**cols, "tenant": cols["tenant"][:-1]})
    with pytest.raises(InvalidArgumentError, match="region codes"):
        RequestTable(**{**cols, "region_names": ("eu",)})
    odd = cols["offsets"].copy()
    k = int(np.flatnonzero(cols["runs"])[0])
    odd[k + 1 :] -= 1
    with pytest.raises(InvalidArgumentError, match="pairs"):
        RequestTable(**{**cols, "offsets": odd, "flat": np.delete(cols["flat"], int(odd[k + 1]))})


def test_the_mixed_generator_holds_columns_not_objects() -> None:
    t = synthetic_mixed(3000, regions=("eu", "us", "ap"), seed=3, rate=50.0)
    assert isinstance(t, RequestTable) and len(t) == 3000
    # Twelve fields and about six (chain, count) runs a prompt: some 160 bytes a request, where
    # the objects were about 600.
    assert t.nbytes / len(t) < 250
    assert t.first_of_region().keys() == {"eu", "us", "ap"}
    r = t[17]
    assert dataclasses.replace(r) == r and r.n_blocks == -(-r.input_length // r.block_size)
