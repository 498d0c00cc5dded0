"""Bad command lines get the one-line refusal the README promises: ``kvcompass CMD: error: ...``
and exit status 2, whether the value is wrong, an option unknown or a required one missing
(a newcomer's read of the README found the last two printing argparse's usage block, and an
unknown option blamed on ``kvcompass`` rather than the subcommand)."""

from __future__ import annotations

import pytest

from kvcompass.cli import main


@pytest.mark.parametrize(
    ("argv", "start"),
    [
        (["up", "--bogus"], "kvcompass up: error: unrecognized arguments: --bogus"),
        (["reproduce", "--figure", "12"], "kvcompass reproduce: error: the following arguments are required: --out"),
        (["simulate", "--gpu-sharing", "shared"], "kvcompass simulate: error: argument --gpu-sharing: invalid choice"),
        ([], "kvcompass: error: the following arguments are required: command"),
    ],
)
def test_a_bad_command_line_is_one_line_naming_the_subcommand(argv: list[str], start: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(start) and err.count("\n") == 1 and "usage:" not in err, err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        # A unit whose state file could never be written started and said it was ready (review).
        (["maintenance", "--topology", "testbed-14x3", "--shard", "0", "--state-file", "/nonexistent-dir/x.state"], "--state-file '/nonexistent-dir/x.state': its directory does not exist"),
        # A negative heartbeat period was taken as "off" in silence (review).
        (["agent", "--topology", "testbed-14x3", "--worker", "us-0", "--events", "tcp://127.0.0.1:1", "--maintenance", "127.0.0.1:1,127.0.0.1:2", "--heartbeat-s", "-1"], "--heartbeat-s must be"),
    ],
)
def test_a_service_refuses_a_value_it_could_not_honour_before_it_starts(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvcompass {argv[0]}: error: ") and needle in err and err.count("\n") == 1, err
