"""`kvcompass.records.fast_init`: the per-request records keep every dataclass behaviour."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from typing import Any

import numpy as np
import pytest

from kvcompass.agent.agent import AgentOutput
from kvcompass.agent.events import BlockRemoved, BlockStored, EngineBatch
from kvcompass.discovery.edge import Decision, ScoreTerms
from kvcompass.discovery.key_ops import KeyOpBatch
from kvcompass.discovery.maintenance import ApplyReport, PatchBatch
from kvcompass.discovery.plane import PropagationReport
from kvcompass.records import fast_init
from kvcompass.sim.schemes import Choice

HOT = [AgentOutput, BlockRemoved, BlockStored, EngineBatch, Decision, ScoreTerms, KeyOpBatch, ApplyReport, PatchBatch, PropagationReport, Choice]


def _stock(cls: type) -> type:
    """The same fields as ``cls`` on a plain frozen slotted dataclass (the stock ``__init__``)."""
    fields = [(f.name, f.type, f) for f in dataclasses.fields(cls)]
    copies = [(n, t, dataclasses.field(default=f.default, default_factory=f.default_factory)) for n, t, f in fields]  # type: ignore[call-overload]
    ns: dict[str, Any] = {}
    if "__post_init__" in cls.__dict__:
        ns["__post_init__"] = cls.__dict__["__post_init__"]
    return dataclasses.make_dataclass(f"Stock{cls.__name__}", copies, frozen=True, slots=True, namespace=ns)


@pytest.mark.parametrize("cls", HOT, ids=lambda c: c.__name__)
def test_hot_records_take_the_stock_signature(cls: type) -> None:
    assert inspect.signature(cls.__init__) == inspect.signature(_stock(cls).__init__)
    assert cls.__init__.__qualname__ == f"{cls.__qualname__}.__init__"


@fast_init
@dataclasses.dataclass(frozen=True, slots=True)
class _Sample:
    a: int
    b: list[int] = dataclasses.field(default_factory=list)
    c: float = 1.5

    def __post_init__(self) -> None:
        if self.a < 0:
            raise ValueError("a must be >= 0")


def test_a_fast_record_is_still_a_frozen_dataclass() -> None:
    x = _Sample(1)
    assert x == _Sample(1, [], 1.5) == _Sample(a=1, c=1.5)
    assert x.b == [] and x.b is not _Sample(1).b  # the factory runs per instance
    assert _Sample(2, b=[3]).b == [3]
    assert _Sample(1, None).b is None  # an explicit None is kept, not replaced by the factory
    assert repr(x) == "_Sample(a=1, b=[], c=1.5)"
    with pytest.raises(dataclasses.FrozenInstanceError):
        x.a = 2  # type: ignore[misc]
    assert dataclasses.replace(x, c=2.0) == _Sample(1, [], 2.0)
    assert pickle.loads(pickle.dumps(x)) == x
    with pytest.raises(ValueError, match="a must be"):
        _Sample(-1)
    with pytest.raises(TypeError):
        _Sample()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        _Sample(1, [], 1.5, 4)  # type: ignore[call-arg]


def test_the_hot_records_check_what_they_checked() -> None:
    k = np.zeros(2, np.uint64)
    with pytest.raises(ValueError, match="equal 1-D shapes"):
        KeyOpBatch("w", 1, 0, 1, k, np.zeros(3, np.uint8))
    b = KeyOpBatch("w", 1, 0, 1, k, np.zeros(2, np.uint8))
    assert b.reset is False and dataclasses.replace(b, reset=True).reset is True
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.seq = 2  # type: ignore[misc]


def test_fast_init_refuses_what_it_cannot_serve_exactly() -> None:
    @dataclasses.dataclass(frozen=True)
    class NoSlots:
        a: int

    @dataclasses.dataclass(slots=True)
    class Mutable:
        a: int

    @dataclasses.dataclass(frozen=True, slots=True)
    class InitVar:
        a: int
        b: dataclasses.InitVar[int]

    @dataclasses.dataclass(frozen=True, slots=True)
    class KwOnly:
        a: int = dataclasses.field(kw_only=True)

    @dataclasses.dataclass(frozen=True, slots=True)
    class NotInit:
        a: int = dataclasses.field(default=0, init=False)

    for cls in (NoSlots, Mutable, InitVar, KwOnly, NotInit, int):
        with pytest.raises(TypeError, match="fast_init"):
            fast_init(cls)
