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
    assert [r.line for r in rows] == [2, 1, 4, 3, 5]  # sorted by time; ties shorter first
    assert rows[3].input_length == tok.apply_chat_template(chat("Do you sell drills?", "Yes, twelve models.", "Which is cheapest?")).size
    assert rows[0].input_length == tok.encode("Write a haiku about screws.").size
    assert [r.output_length for r in rows] == [50, 30, 12, 25, 18]
    objs = list(trace_lines(rows))
    assert [o["timestamp"] for o in objs] == [0.0, 500.0, 4500.0, 4500.0, 9500.0]
    assert [o["parent_chat_id"] for o in objs] == [-1, -1, -1, 1, 3]
    assert [o.get("region") for o in objs] == [None, "eu", "us", None, None]
    first, second, third = rows[1], rows[3], rows[4]
    for a, b in ((first, second), (second, third)):
        full = a.input_length // 16
        assert full >= 2 and np.array_equal(a.hash_ids[:full], b.hash_ids[:full])
        assert not np.array_equal(a.hash_ids[: full + 1], b.hash_ids[: full + 1])  # the partial block is not shared
    # Two conversations share the system prompt's full blocks and nothing after it.
    other = rows[2]
    shared = next(i for i, (x, y) in enumerate(zip(first.hash_ids, other.hash_ids)) if x != y)
    assert 2 <= shared < min(first.hash_ids.size, other.hash_ids.size)


def test_the_trace_loads_with_its_regions_and_sessions(tmp_path: Path) -> None:
    """What the simulator reads back: the follow-ups after their parents and in their root's
    region (eu), the Sunday question in us, every row's length."""
    rows = read_request_log(conversation_log(tmp_path / "log.jsonl"), block_size=16)
    out = tmp_path / "trace.jsonl"
    write_trace(rows, out)
    reqs = load_trace(out, 16, regions=load_topology("testbed-14x3"))
    assert [r.region for r in reqs][1:] == ["eu", "us", "eu", "eu"]
    assert [r.parent for r in reqs] == [-1, -1, -1, 1, 3]
    assert [r.input_length for r in reqs] == [r.input_length for r in rows]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl", "trace.jsonl"]  # no temporary file left
    # A log that names AWS regions, converted without --topology, keeps the labels: the
    # simulator maps them as the converter does (found in review: the suggested command failed).
    labelled = tmp_path / "labelled.jsonl"
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    labelled.write_text("".join(json.dumps({**o, "region": {"eu": "eu-central-1", "us": "us-east-1"}[o["region"]]} if "region" in o else o) + "\n" for o in lines))
    assert [r.region for r in load_trace(labelled, 16, regions=load_topology("testbed-14x3"))] == [r.region for r in reqs]


def test_output_lengths_come_from_the_log_then_usage_then_the_bound(tmp_path: Path) -> None:
    """``output_tokens`` over usage over ``max_tokens`` (a null falls through); a request's
    total is shared by its sequences either way (2 prompts x n=2 = 4: 80 tokens are 20 each);
    the bound is per sequence, and counted."""
    log = write_log(
        tmp_path / "log.jsonl",
        [
            {"time": 0, "request": {"prompt": "a b c", "max_tokens": 99}, "output_tokens": 7, "response": {"usage": {"completion_tokens": 8}}},
            {"time": 1, "request": {"prompt": "a b c", "max_tokens": 99}, "output_tokens": None, "response": {"usage": {"completion_tokens": 8}}},
            {"time": 2, "request": {"prompt": ["first prompt", "second prompt"], "n": 2}, "response": {"usage": {"completion_tokens": 80}}},
            {"time": 3, "request": {"prompt": ["first prompt", "second prompt"], "n": 2}, "output_tokens": 80},
            {"time": 4, "request": {"messages": chat("hi"), "max_completion_tokens": 33, "max_tokens": 44, "n": 3}},
            {"time": 5, "request": {"prompt": ["first prompt", "second prompt"]}, "output_tokens": 3},
        ],
    )
    counts = LogCounts()
    rows = read_request_log(log, counts=counts)
    # A total that does not divide is split so the rows add up to it (3 over two prompts: 2 + 1).
    assert [r.output_length for r in rows] == [7, 8, 20, 20, 20, 20, 33, 2, 1]
    assert (counts.requests, counts.prompts, counts.from_bound) == (6, 9, 1)


def test_a_batch_in_a_session_follows_the_previous_request_and_leads_the_next(tmp_path: Path) -> None:
    """Chained by request, not by prompt: a batch's prompts both wait for the request before
    them (not for each other), and the request after them follows the batch."""
    log = write_log(
        tmp_path / "log.jsonl",
        [
            {"time": 0, "request": {"prompt": "one"}, "output_tokens": 5, "session": "s"},
            {"time": 1, "request": {"prompt": ["two a", "two b"]}, "output_tokens": 10, "session": "s"},
            {"time": 2, "request": {"prompt": "three"}, "output_tokens": 5, "session": "s"},
        ],
    )
    objs = list(trace_lines(read_request_log(log)))
    assert [o["parent_chat_id"] for o in objs] == [-1, 0, 0, 2]


def test_tenants_and_engine_salts_never_share_blocks_and_the_secret_keys_the_export(tmp_path: Path) -> None:
    """Two tenants (or two ``cache_salt``s) with one prompt share nothing, as their engines keep
    their KV apart; within a tenant the ids are the same. One secret gives the same trace
    twice; without one, two exports share no id (a guessed prompt cannot be tested)."""
    body = {"messages": chat("What is the return policy?")}
    log = write_log(
        tmp_path / "log.jsonl",
        [
            {"time": 0, "request": body, "output_tokens": 5, "tenant": "acme"},
            {"time": 1, "request": body, "output_tokens": 5, "tenant": "acme"},
            {"time": 2, "request": body, "output_tokens": 5, "tenant": "globex"},
            {"time": 3, "request": {**body, "cache_salt": "x"}, "output_tokens": 5, "tenant": "acme"},
            {"time": 4, "request": body, "output_tokens": 5},
        ],
    )
    a, b, c, d, e = (r.hash_ids for r in read_request_log(log, salt=b"k"))
    assert np.array_equal(a, b)
    assert not set(a.tolist()) & (set(c.tolist()) | set(d.tolist()) | set(e.tolist()))
    again = [r.hash_ids for r in read_request_log(log, salt=b"k")]
    assert np.array_equal(again[2], c)
    fresh = [r.hash_ids for r in read_request_log(log)]
    assert not set(fresh[0].tolist()) & set(a.tolist())


def test_a_topology_maps_aws_labels_and_leaves_over_long_prompts_out(tmp_path: Path) -> None:
    """A real log names AWS regions; ``--topology`` maps a region's ``aws_region`` label to its
    name and refuses names it lacks. A prompt past the window is left out and counted, as an
    engine refuses it without computing."""
    import dataclasses

    topo = dataclasses.replace(load_topology("testbed-14x3"), max_prefix=256)
    aws = {r.name: r.aws_region for r in topo.regions}
    assert aws["us"] != "us"  # the test needs a label that differs from the name
    log = write_log(
        tmp_path / "log.jsonl",
        [
            {"time": 0, "request": {"prompt": "short"}, "output_tokens": 5, "region": aws["us"]},
            {"time": 1, "request": {"prompt": "long " * 600}, "output_tokens": 5, "region": "eu"},
            {"time": 2, "request": {"prompt": "short too"}, "output_tokens": 5, "region": "eu"},
        ],
    )
    counts = LogCounts()
    rows = read_request_log(log, counts=counts, topology=topo)
    assert [(r.line, r.region) for r in rows] == [(1, "us"), (3, "eu")]
    assert (counts.over_context, counts.over_context_lines) == (1, [2])
    bad = write_log(tmp_path / "bad.jsonl", [{"time": 0, "request": {"prompt": "x"}, "output_tokens": 1, "region": "mars-1"}])
    with pytest.raises(InvalidArgumentError, match="'mars-1' is neither a region of topology"):
        read_request_log(bad, topology=topo)


def test_the_trace_is_written_whole_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = read_request_log(conversation_log(tmp_path / "log.jsonl"))
    with pytest.raises(InvalidArgumentError, match="is a directory"):
        write_trace(rows, tmp_path)
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        write_trace(rows, tmp_path / "nowhere" / "t.jsonl")
    import kvcompass.cli.trace as trace_mod

    def broken(rows: Any) -> Any:
        yield {"timestamp": 0}
        raise OSError("disk full")

    monkeypatch.setattr(trace_mod, "trace_lines", broken)
    with pytest.raises(OSError, match="disk full"):
        write_trace(rows, tmp_path / "t.jsonl")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl"]  # no trace, no temporary file


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
        ({"time": 1, "request": {"prompt": "x"}, "output_tokens": -3}, "output_tokens", "expected an integer in [0, "),
        ({"time": 1, "request": {"prompt": "x"}, "response": {"usage": {"completion_tokens": "many"}}}, "response.usage.completion_tokens", "expected an integer in [0, "),
        ({"time": 1, "request": {"prompt": "x"}, "output_tokens": 1, "region": 5}, "region", "region name"),
        ({"time": 1, "request": {"prompt": "x"}, "output_tokens": 1, "session": [1]}, "session", "string or an integer"),
        ({"time": 1, "request": {"prompt": "x"}, "output_tokens": 1, "user": "u"}, "user", "unknown key"),
        ({"time": 1, "request": {"prompt": "x", "n": 0}, "output_tokens": 1}, "request.n", "n"),
        ('{"time": 1, "request": {"prompt": "x", "temperature": NaN}, "output_tokens": 1}', None, "not valid JSON"),
        ({"time": 1, "request": {"prompt": "x"}, "output_tokens": 1, "tenant": 1.5}, "tenant", "string or an integer"),
        (
            {"time": 1, "request": {"prompt": "x"}, "response": {"usage": {"completion_tokens": 5, "prompt_tokens": 1, "prompt_tokens_details": {"cached_tokens": 50}}}},
            "response.usage.prompt_tokens_details.cached_tokens", "[0, prompt_tokens = 1]",
        ),
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
        "over_context": 0,
        "tokens_vs_logged": None,
        "logged_hit_rate": None,
    }
    assert "--block-size 32" in captured.err and "max_tokens, an upper bound" in captured.err
    assert main(["trace", "from-log", str(out), "--out", str(out)]) == 2  # the log itself: refused
    assert "is the log itself" in capsys.readouterr().err
    args = ["simulate", "--trace", str(out), "--block-size", "32", "--topology", "testbed-14x3", "--arrivals", "trace", "--schemes", "kvcompass", "--out", str(tmp_path / "sim")]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (by_rate,) = result["results"]["kvcompass"].values()
    assert by_rate["requests"] == 5
    # Read at another block size, the trace says what is wrong.
    assert main([*args[:4], "16", *args[5:]]) == 2
    assert "another block size" in capsys.readouterr().err


def test_the_engines_own_counts_check_the_lengths_and_give_todays_reuse(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A logged ``usage.prompt_tokens`` measures our tokenizer against the engine's, and its
    ``cached_tokens`` is the fleet's hit rate today, beside what the simulator will find."""
    tok = load_tokenizer(None)
    n = tok.encode("how long is this prompt").size
    log = write_log(
        tmp_path / "log.jsonl",
        [
            {"time": 0, "request": {"prompt": "how long is this prompt"}, "response": {"usage": {"prompt_tokens": 2 * n, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": n}}}},
            {"time": 1, "request": {"prompt": "no usage here"}, "output_tokens": 4},
        ],
    )
    assert main(["trace", "from-log", str(log), "-o", str(tmp_path / "t.jsonl"), "--salt", "s"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["tokens_vs_logged"], summary["logged_hit_rate"]) == (0.5, 0.5)


def test_a_models_tokenizer_measures_prompts_as_its_engine_does(tmp_path: Path) -> None:
    """With the model's tokenizer (and its chat template beside it), a logged prompt's length is
    the engine's: a completion with the BOS the tokenizer adds, a chat under the model's
    template, not ChatML."""
    from test_chat_template import BOS, END_HEAD, EOT, HEAD, engine_ids, model_dir

    (tmp_path / "model").mkdir()
    path = model_dir(tmp_path / "model")
    log = write_log(
        tmp_path / "log.jsonl",
        [
            {"time": 0, "request": {"prompt": "hello there"}, "output_tokens": 3},
            {"time": 1, "request": {"messages": [{"role": "user", "content": "hi"}]}, "output_tokens": 3},
        ],
    )
    rows = read_request_log(log, tokenizer=path)
    chat = f"{BOS}{HEAD}user{END_HEAD}\n\nhi{EOT}{HEAD}assistant{END_HEAD}\n\n"
    assert [r.input_length for r in rows] == [len(engine_ids(path, "hello there", True)), len(engine_ids(path, chat, False))]
    # The engine started with --chat-template: the command takes the same flag.
    from test_chat_template import OPERATOR

    (tmp_path / "op.jinja").write_text(OPERATOR)
    out = tmp_path / "t.jsonl"
    assert main(["trace", "from-log", str(log), "-o", str(out), "--tokenizer", str(path), "--chat-template", str(tmp_path / "op.jinja")]) == 0
    lengths = [json.loads(line)["input_length"] for line in out.read_text().splitlines()]
    assert lengths == [len(engine_ids(path, "hello there", True)), len(engine_ids(path, f"{BOS}[user] hi\n[assistant] ", False))]
    assert main(["trace", "from-log", str(log), "-o", str(tmp_path / "u.jsonl"), "--chat-template", str(tmp_path / "op.jinja")]) == 2  # needs --tokenizer
