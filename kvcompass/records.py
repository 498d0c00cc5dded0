"""Frozen records at the price of plain ones.

A frozen dataclass's generated ``__init__`` sets each field through ``object.__setattr__``
(the class's own ``__setattr__`` refuses), a generic attribute write per field: on this
project's per-request path (a route's :class:`~kvcompass.discovery.edge.Decision` and its score
terms, an agent's key-op batches, a unit's patch batches and reports, about a dozen records and
80 fields a simulated request) that was near a tenth of a KVCompass simulation's time.
:func:`fast_init` gives such a class an ``__init__`` that writes each slot through its own
descriptor instead, which skips the generic lookup. Everything else stays the dataclass's:
fields, defaults, ``__post_init__``, equality, hashing, ``repr``, ``dataclasses.replace``,
pickling, and the refusal to assign after construction.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

__all__ = ["fast_init"]

T = TypeVar("T")


def fast_init(cls: type[T]) -> type[T]:
    """Replace the ``__init__`` of ``cls``, a ``@dataclass(frozen=True, slots=True)`` class, by one
    with the same signature that writes each slot through its member descriptor.

    Applied above the dataclass decorator. Refused (TypeError) for a class it cannot serve
    exactly: not a frozen slotted dataclass, or with init-only variables, fields left out of
    ``__init__`` or keyword-only fields."""
    params_of = getattr(cls, "__dataclass_params__", None)
    if not dataclasses.is_dataclass(cls) or params_of is None or not params_of.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"fast_init needs a @dataclass(frozen=True, slots=True) class, got {cls!r}")
    fields = dataclasses.fields(cls)
    if len(fields) != len(getattr(cls, "__dataclass_fields__")):  # noqa: B009  # InitVars are only there
        raise TypeError(f"fast_init: {cls.__qualname__} has init-only variables")
    env: dict[str, Any] = {"_FACTORY": _FACTORY}
    params: list[str] = []
    body: list[str] = []
    for f in fields:
        if not f.init or f.kw_only:
            raise TypeError(f"fast_init: field {f.name!r} of {cls.__qualname__} is left out of __init__ or keyword-only")
        n = f.name
        env[f"_set_{n}"] = cls.__dict__[n].__set__
        if f.default is not dataclasses.MISSING:
            env[f"_default_{n}"] = f.default
            params.append(f"{n}=_default_{n}")
        elif f.default_factory is not dataclasses.MISSING:
            env[f"_factory_{n}"] = f.default_factory
            params.append(f"{n}=_FACTORY")
            body.append(f"    if {n} is _FACTORY:\n        {n} = _factory_{n}()")
        else:
            params.append(n)
        body.append(f"    _set_{n}(self, {n})")
    if hasattr(cls, "__post_init__"):
        body.append("    self.__post_init__()")
    src = f"def __init__(self, {', '.join(params)}):\n" + ("\n".join(body) or "    pass") + "\n"
    exec(src, env)  # noqa: S102  # source built above from the class's own field names
    init = env["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__doc__ = cls.__init__.__doc__
    init.__annotations__ = dict(cls.__init__.__annotations__)
    cls.__init__ = init  # type: ignore[method-assign]
    return cls


class _Factory:
    """The default of a field built by its ``default_factory`` (a caller may pass None)."""

    def __repr__(self) -> str:
        return "<factory>"


_FACTORY = _Factory()
