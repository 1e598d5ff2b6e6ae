"""`marginkit --version`, and help that shows every option's default."""

from __future__ import annotations

import argparse
import re

import pytest

import marginkit
from marginkit.cli import main
from marginkit.cli.app import OVERRIDES, build_parser
from marginkit.cli.compare import DEMO_OPTIONS
from marginkit.train.config import TrainConfig


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def option_help(parser: argparse.ArgumentParser, flag: str) -> str:
    """The help line of ``flag``, unwrapped."""
    text = parser.format_help()
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"\s+{re.escape(flag)}\b", line))
    block = [lines[start]]
    for line in lines[start + 1 :]:
        if re.match(r"\s+-", line) or not line.startswith(" " * 8):
            break
        block.append(line)
    return " ".join(part.strip() for part in block)


def test_version(capsys):
    assert main(["--version"]) == 0
    out = capsys.readouterr().out.strip()
    version = re.escape(marginkit.__version__)
    assert re.fullmatch(rf"marginkit {version} \(torch \S+, Python \d+\.\d+\.\d+\)", out)


@pytest.mark.parametrize(
    "command, flag, default",
    [
        ("train", "--epochs", "auto, at least 10 and at least 5,000 training samples seen"),
        ("train", "--lr", TrainConfig().lr),
        ("train", "--batch-size", TrainConfig().batch_size),
        ("train", "--nproc", 1),
        ("compare", "--epochs", "auto, at least 10 and at least 5,000 training samples seen"),
        ("compare", "--seeds", 1),
        ("compare", "--jobs", 1),
        ("demo", "--epochs", DEMO_OPTIONS["epochs"]),
        ("demo", "--seeds", 1),
        ("demo", "--out", "demo_out"),
        ("study", "--jobs", 2),
        ("eval", "--checkpoint", "best"),
    ],
)
def test_help_shows_the_default(command, flag, default):
    line = option_help(subparsers(build_parser())[command], flag)
    assert f"(default: {default})" in line, line


def test_no_help_says_default_none():
    """``epochs: null`` means auto: the help says what it does, not Python's None."""
    for name, sub in subparsers(build_parser()).items():
        assert "default: None" not in sub.format_help(), f"marginkit {name} --help"


def test_every_option_with_a_default_says_it():
    """Any option added later is covered too: a default that is not None/False is shown."""
    for name, sub in subparsers(build_parser()).items():
        for action in sub._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS:
                continue
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            flag = action.option_strings[-1]
            if action.dest.startswith("opt_") or action.default not in (None, False, []):
                assert "default" in option_help(sub, flag), f"marginkit {name} {flag}"
    flags = {f for f, *_ in OVERRIDES}
    assert {"--epochs", "--lr"} <= flags


def test_subcommand_help_exits_cleanly(capsys):
    assert main(["demo", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: marginkit demo")
