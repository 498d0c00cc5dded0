"""``kvcompass trace from-log``: an OpenAI request log as a simulator trace."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcompass.cli import main
from kvcompass.cli.trace import LogCounts, read_request_log, trace_lines, write_trace
from kvcompass.discovery.topology import load_topology
from kvcompass.engine.tokenizer import load_tokenizer
from kvcompass.errors import InvalidArgumentError
from kvcompass.sim.workload import load_trace

SYSTEM = {"role": "system", "content": "You are the support assistant of a hardware shop. " * 6}


def chat(*turns: str) -> list[dict[str, str]]:
    """A conversation: user and assistant messages alternating, after the shared system prompt."""
    return [SYSTEM, *({"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns))]


def write_log(path: Path, lines: list[dict[str, Any] | str]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def conversation_log(path: Path) -> Path:
    return write_log(
        path,
        [
            {"time": 1000.0, "request": {"messages": chat("Do you sell drills?")}, "response": {"usage": {"completion_tokens": 30}}, "session": "c1", "region": "eu"},
            {"time": 999.5, "request": {"prompt": "Write a haiku about screws.", "max_tokens": 50}},
            {"time": 1004.0, "request": {"messages": chat("Do you sell drills?", "Yes, twelve models.", "Which is cheapest?")}, "output_tokens": 25, "session": "c1"},
            {"time": 1004.0, "request": {"messages": chat("Is the shop open on Sunday?")}, "output_tokens": 12, "session": 7, "region": "us"},
            {"time": 1009.0, "request": {"messages": chat("Do you sell drills?", "Yes, twelve models.", "Which is cheapest?", "The D-100.", "Does it come with bits?")}, "output_tokens": 18, "session": "c1"},
        ],
    )


def test_a_conversation_becomes_chained_rows_that_share_its_history(tmp_path: Path) -> None:
    """Each turn is the prompt the door would route (the chat template's tokens), its rows are
    in time order with times from the first, a session's turns name the previous one as parent,
    and a turn's ids are the previous turn's full blocks and then its own."""
    rows = read_request_log(conversation_log(tmp_path / "log.jsonl"), block_size=16)
    tok = load_tokenizer(None)
    assert [r.line for r in rows] == [2, 1, 3, 4, 5]  # sorted by time; ties keep file order
    assert rows[2].input_length == tok.apply_chat_template(chat("Do you sell drills?", "Yes, twelve models.", "Which is cheapest?")).size
    assert rows[0].input_length == tok.encode("Write a haiku about screws.").size
    assert [r.output_length for r in rows] == [50, 30, 25, 12, 18]
    objs = list(trace_lines(rows))
    assert [o["timestamp"] for o in objs] == [0.0, 500.0, 4500.0, 4500.0, 9500.0]
    assert [o["parent_chat_id"] for o in objs] == [-1, -1, 1, -1, 2]
    assert [o.get("region") for o in objs] == [None, "eu", None, "us", None]
    first, second, third = rows[1], rows[2], rows[4]
    for a, b in ((first, second), (second, third)):
        full = a.input_length // 16
        assert full >= 2 and np.array_equal(a.hash_ids[:full], b.hash_ids[:full])
        assert not np.array_equal(a.hash_ids[: full + 1], b.hash_ids[: full + 1])  # the partial block is not shared
    # Two conversations share the system prompt's full blocks and nothing after it.
    other = rows[3]
    shared = next(i for i, (x, y) in enumerate(zip(first.hash_ids, other.hash_ids)) if x != y)
    assert 2 <= shared < min(first.hash_ids.size, other.hash_ids.size)


def test_the_trace_loads_with_its_regions_and_sessions(tmp_path: Path) -> None:
    """What the simulator reads back: the follow-ups after their parents and in their root's
    region (eu), the Sunday question in us, every row's length."""
    rows = read_request_log(conversation_log(tmp_path / "log.jsonl"), block_size=16)
    out = tmp_path / "trace.jsonl"
    write_trace(rows, out)
    reqs = load_trace(out, 16, regions=load_topology("testbed-14x3"))
    assert [r.region for r in reqs][1:] == ["eu", "eu", "us", "eu"]
    assert [r.parent for r in reqs] == [-1, -1, 1, -1, 2]
    assert [r.input_length for r in reqs] == [r.input_length for r in rows]
    assert not (tmp_path / "trace.jsonl.part").exists()


def test_output_lengths_come_from_the_log_then_usage_then_the_bound(tmp_path: Path) -> None:
    """``output_tokens`` over usage over ``max_tokens``; a batch's usage is shared by its
    sequences (2 prompts x n=2 = 4: 80 tokens are 20 each); the bound is counted."""
    log = write_log(
        tmp_path / "log.jsonl",
        [
            {"time": 0, "request": {"prompt": "a b c", "max_tokens": 99}, "output_tokens": 7, "response": {"usage": {"completion_tokens": 8}}},
            {"time": 1, "request": {"prompt": "a b c", "max_tokens": 99}, "response": {"usage": {"completion_tokens": 8}}},
            {"time": 2, "request": {"prompt": ["first prompt", "second prompt"], "n": 2}, "response": {"usage": {"completion_tokens": 80}}},
            {"time": 3, "request": {"messages": chat("hi"), "max_completion_tokens": 33, "max_tokens": 44}},
        ],
    )
    counts = LogCounts()
    rows = read_request_log(log, counts=counts)
    assert [r.output_length for r in rows] == [7, 8, 20, 20, 33]
    assert (counts.requests, counts.prompts, counts.from_bound) == (4, 5, 1)


@pytest.mark.parametrize(
    ("line", "field", "says"),
    [
        ("not json", None, "not valid JSON"),
        ('["a"]', None, "expected a JSON object"),
        ({"request": {"prompt": "x"}, "output_tokens": 1}, "time", "arrival time in seconds"),
        ({"time": -1, "request": {"prompt": "x"}, "output_tokens": 1}, "time", "arrival time in seconds"),
        ({"time": True, "request": {"prompt": "x"}, "output_tokens": 1}, "time", "arrival time in seconds"),
        ({"time": 10**400, "request": {"prompt": "x"}, "output_tokens": 1}, "time", "arrival time in seconds"),
        ({"time": 1, "request": "x", "output_tokens": 1}, "request", "JSON body"),
        ({"time": 1, "request": {"prompt": ""}, "output_tokens": 1}, "request.prompt", "must not be empty"),
        ({"time": 1, "request": {"prompt": [1, -2]}, "output_tokens": 1}, "request.prompt", "token ids must be integers"),
        ({"time": 1, "request": {"messages": "hi"}, "output_tokens": 1}, "request.messages", "must be a list"),
        ({"time": 1, "request": {"prompt": "x"}}, "output_tokens", "missing"),
        ({"time": 1, "request": {"prompt": "x"}, "output_tokens": -3}, "output_tokens", "integer >= 0"),
        ({"time": 1, "request": {"prompt": "x"}, "response": {"usage": {"completion_tokens": "many"}}}, "response.usage.completion_tokens", "integer >= 0"),
        ({"time": 1, "request": {"prompt": "x"}, "output_tokens": 1, "region": 5}, "region", "region name"),
        ({"time": 1, "request": {"prompt": "x"}, "output_tokens": 1, "session": [1]}, "session", "string or an integer"),
        ({"time": 1, "request": {"prompt": "x"}, "output_tokens": 1, "user": "u"}, "user", "unknown key"),
    ],
)
def test_a_bad_line_is_refused_by_line_and_field(tmp_path: Path, line: Any, field: str | None, says: str) -> None:
    good = {"time": 0, "request": {"prompt": "fine"}, "output_tokens": 1}
    path = write_log(tmp_path / "log.jsonl", [good, line])
    with pytest.raises(InvalidArgumentError) as info:
        read_request_log(path)
    err = info.value
    assert (err.line, err.field) == (2, field), str(err)  # type: ignore[attr-defined]
    assert str(err).startswith(f"{path}, line 2") and says in str(err)


def test_an_empty_log_and_a_bad_block_size_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="no requests in the log"):
        read_request_log(write_log(tmp_path / "e.jsonl", ["", "  "]))
    with pytest.raises(InvalidArgumentError, match="block_size must be an integer >= 1"):
        read_request_log(conversation_log(tmp_path / "log.jsonl"), block_size=0)


def test_the_command_writes_a_trace_that_simulate_replays(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The path an operator takes: from-log, then simulate with the printed block size."""
    out = tmp_path / "trace.jsonl"
    assert main(["trace", "from-log", str(conversation_log(tmp_path / "log.jsonl")), "--out", str(out), "--block-size", "32"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary | {"out": None} == {
        "out": None,
        "requests": 5,
        "rows": 5,
        "sessions": 2,
        "regions": {"eu": 1, "us": 1},
        "block_size": 32,
        "span_s": 9.5,
        "mean_input_tokens": summary["mean_input_tokens"],
        "mean_output_tokens": 27.0,
        "outputs_from_max_tokens": 1,
    }
    assert "--block-size 32" in captured.err and "max_tokens, an upper bound" in captured.err
    args = ["simulate", "--trace", str(out), "--block-size", "32", "--topology", "testbed-14x3", "--arrivals", "trace", "--schemes", "kvcompass", "--out", str(tmp_path / "sim")]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (by_rate,) = result["results"]["kvcompass"].values()
    assert by_rate["requests"] == 5
    # Read at another block size, the trace says what is wrong.
    assert main([*args[:4], "16", *args[5:]]) == 2
    assert "another block size" in capsys.readouterr().err
