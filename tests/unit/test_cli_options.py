"""The CLI's common options parse the same before and after the subcommand (parser only, no server)."""

from __future__ import annotations

import argparse

import pytest
from triton_embed.cli import _parser, model_of

COMMANDS = {"embed": ["a text"], "similarity": ["one", "two"], "health": [], "stats": [], "rerank": ["q", "d"]}
OPTIONS = ["--url", "10.0.0.5:9001", "--protocol", "http", "--model", "other", "--timeout", "2.5", "--json"]


def parse(*argv: str) -> dict:
    return vars(_parser().parse_args(argv))


def subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", COMMANDS)
def test_options_before_and_after_the_subcommand_parse_alike(command):
    before = parse(*OPTIONS, command, *COMMANDS[command])
    after = parse(command, *OPTIONS, *COMMANDS[command])
    assert before == after
    assert (before["url"], before["protocol"], before["model"], before["timeout"], before["json"]) == (
        "10.0.0.5:9001",
        "http",
        "other",
        2.5,
        True,
    )


@pytest.mark.parametrize("command", COMMANDS)
def test_without_options_the_defaults_hold(command):
    args = parse(command, *COMMANDS[command])
    assert (args["url"], args["protocol"], args["timeout"], args["json"]) == (None, None, 30.0, False)
    # the model a user names by `make model ... NAME=`: embed, and rerank for the rerank command
    assert model_of(argparse.Namespace(**args)) == ("rerank" if command == "rerank" else "embed")
    assert model_of(argparse.Namespace(**parse(command, "--model", "multi", *COMMANDS[command]))) == "multi"


def test_the_value_after_the_subcommand_wins():
    args = parse("--url", "first:1", "--timeout", "9", "health", "--url", "second:2")
    assert (args["url"], args["timeout"]) == ("second:2", 9.0)


def test_every_subcommand_takes_every_main_option():
    main_options = {s for a in _parser()._actions for s in a.option_strings} - {"-h", "--help", "--version"}
    assert main_options >= {"--url", "--protocol", "--model", "--timeout", "--json"}
    clients = {name: sub for name, sub in subparsers().items() if name != "gateway"}  # takes the gateway's own
    assert set(clients) == {"embed", "similarity", "health", "stats", "rerank"}
    for name, sub in clients.items():
        assert main_options <= {s for a in sub._actions for s in a.option_strings}, name


def test_a_bad_option_value_before_the_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(["--protocol", "udp", "health"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'udp'" in capsys.readouterr().err


def test_the_gateway_command_without_its_extra_names_the_extra_in_one_line():
    """What `triton-embed-gateway` prints after a plain `pip install .`: uvicorn is not there (blocked here)."""
    import subprocess
    import sys

    script = (
        "import sys; sys.modules['uvicorn'] = None\n"
        "from triton_embed.cli import gateway_command; sys.exit(gateway_command())"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, "--help"], capture_output=True, text=True, check=False, timeout=60
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1
    assert "the gateway needs the 'gateway' extra (pip install 'triton-embed[gateway]')" in done.stderr
