"""Every service runs on one event loop choice (``lifecycle.run``): uvloop where installed (it is a
runtime dependency), the standard loop with ``KVCOMPASS_LOOP=asyncio``."""

from __future__ import annotations

import asyncio

import pytest

from kvcompass.services import lifecycle


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_run_uses_uvloop_unless_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("uvloop")  # a runtime dependency; absent only on platforms it does not build for
    monkeypatch.delenv(lifecycle.LOOP_ENV, raising=False)
    assert lifecycle.run(_loop_module()).startswith("uvloop")
    monkeypatch.setenv(lifecycle.LOOP_ENV, "asyncio")
    assert lifecycle.run(_loop_module()).startswith("asyncio")
    assert lifecycle.loop_factory() is None


def test_run_returns_the_result_and_raises_what_the_coroutine_raises() -> None:
    async def boom() -> None:
        raise KeyError("x")

    async def value() -> int:
        return 7

    assert lifecycle.run(value()) == 7
    with pytest.raises(KeyError):
        lifecycle.run(boom())


def test_the_service_commands_run_through_it(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("uvloop")
    from kvcompass.cli.services import _run

    monkeypatch.delenv(lifecycle.LOOP_ENV, raising=False)
    seen: list[str] = []

    async def service(args: object) -> int:
        seen.append(await _loop_module())
        return 3

    assert _run(service)(object()) == 3  # type: ignore[arg-type]
    assert seen and seen[0].startswith("uvloop")
