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
    # the flag first on its line, or after the action's other spellings (--access-log, --no-access-log)
    start = next(i for i, line in enumerate(lines) if re.match(rf" {{2}}(-\S+, )*{re.escape(flag)}\b", line))
    block = [lines[start]]
    for line in lines[start + 1 :]:
        if re.match(r" {2}-", line) or not line.startswith(" " * 8):  # the next option, or a section
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
        ("export", "--format", "onnx"),
        ("export", "--checkpoint", "best"),
        ("serve", "--host", "127.0.0.1"),
        ("serve", "--port", 8000),
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


def test_every_option_and_argument_has_a_description():
    for name, sub in subparsers(build_parser()).items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            what = action.option_strings[-1] if action.option_strings else action.dest
            assert action.help and action.help != argparse.SUPPRESS, f"marginkit {name} {what}"
            assert len(action.help.replace("(default: %(default)s)", "").strip()) > 10, (
                f"marginkit {name} {what}"
            )


@pytest.mark.parametrize("command, parallel", [("train", "--nproc"), ("compare", "--jobs")])
def test_num_threads_help_states_the_threads_a_run_takes(command, parallel):
    from marginkit.train.runtime import available_cores, choose_threads

    line = option_help(subparsers(build_parser())[command], "--num-threads")
    assert "torch's default" not in line
    assert f"the {available_cores()} CPU core(s) this process may use divided by {parallel}" in line, line
    # what the runs then choose (and log, and record in config.yaml)
    assert choose_threads(1) == available_cores() and choose_threads(2) == max(1, available_cores() // 2)
    assert choose_threads(1, requested=3) == 3


def test_jobs_defaults_of_compare_and_demo_are_stated_and_explained(monkeypatch):
    from marginkit.cli import compare
    from marginkit.train.runtime import available_cores

    subs = subparsers(build_parser())
    compare_line, demo_line = option_help(subs["compare"], "--jobs"), option_help(subs["demo"], "--jobs")
    assert "(1: one run at a time on every core" in compare_line and compare_line.endswith("(default: 1)")
    assert "`demo` instead runs min(2, cores) runs of one thread each" in compare_line
    assert compare.demo_jobs() == min(2, available_cores())
    assert f"(default: min(2, CPU cores) = {compare.demo_jobs()} here" in demo_line and "compare" in demo_line
    seen = {}
    monkeypatch.setattr(compare, "run_compare", lambda *a, **k: seen.update(k) or ("", None))
    compare.run_demo("unused", quiet=True)
    assert seen["jobs"] == compare.demo_jobs()  # the default the help states is the one used


def test_datasets_command_describes_every_set_and_format(capsys):
    from marginkit.data.datasets import DATASET_INFO, DATASETS, FILE_FORMAT_INFO, FILE_FORMATS

    assert main(["datasets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name in DATASETS:
        (line,) = [ln for ln in lines if ln.split()[:1] == [name]]
        info = DATASET_INFO[name]
        assert line.split(None, 1)[1] == info.line()
        assert f"{info.samples:,} samples, {info.classes} classes" in line and info.source in line
    for fmt in FILE_FORMATS:
        (line,) = [ln for ln in lines if ln.split()[:1] == [f"{fmt}:PATH"]]
        assert line.split(None, 1)[1] == FILE_FORMAT_INFO[fmt]


@pytest.mark.parametrize("name", ["digits", "breast_cancer", "identities", "mnist1d", "japanese-vowels"])
def test_dataset_sizes_said_are_the_data_sets_sizes(name):
    """(mnist-sample's: tests/test_packaged.py, which loads it anyway.)"""
    from marginkit.data import load_dataset
    from marginkit.data.datasets import DATASET_INFO

    if name == "japanese-vowels":
        pytest.importorskip("aeon")
    data = load_dataset(name, seed=0)
    info = DATASET_INFO[name]
    assert len(data.train) + len(data.val) + len(data.test) == info.samples
    assert data.num_classes == info.classes
