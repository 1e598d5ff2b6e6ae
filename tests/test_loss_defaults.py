"""One set of defaults per loss, said side by side: the command line's (the registry) and the
Python class's, in ``marginkit losses``, in each class's docstring and in docs/defaults.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from marginkit.cli import main
from marginkit.train.registry import LOSSES, build_loss, class_defaults, format_options

DEFAULTS_MD = Path(__file__).resolve().parents[1] / "docs" / "defaults.md"
SECTION = "## Two sets of loss defaults"


def differing() -> list[str]:
    return [name for name, spec in LOSSES.items() if dict(spec.defaults) != class_defaults(name)]


def test_class_defaults_are_what_the_class_uses():
    from marginkit.losses import CosFaceLoss, MEPLoss, NormSoftmaxLoss, QMarginLoss

    assert class_defaults("cosface") == {"scale": CosFaceLoss().scale, "margin": CosFaceLoss().margin}
    assert class_defaults("qmargin")["scale"] == QMarginLoss().scale == 35.0
    assert class_defaults("softmax") == {"scale": NormSoftmaxLoss().scale} == {"scale": 30.0}  # None -> 30
    assert class_defaults("mep") == {"margin": MEPLoss().margin}  # no scale: the CLI scales the cosines
    # the registry's values are what build_loss (and so `marginkit train`) uses
    built, registered = build_loss("cosface"), LOSSES["cosface"].defaults
    assert (built.scale, built.margin) == (registered["scale"], registered["margin"]) == (16.0, 0.2)
    assert {"softmax", "cosface", "arcface", "qmargin", "circle", "triplet"} <= set(differing())
    assert "proxy_anchor" not in differing()


def test_losses_command_prints_both_sets(capsys):
    assert main(["losses"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for name in LOSSES:
        (i,) = [i for i, line in enumerate(lines) if line.split()[:1] == [name]]
        cli, cls = format_options(LOSSES[name].defaults), format_options(class_defaults(name))
        below = " ".join(lines[i + 1 : i + 3])
        klass = LOSSES[name].loss_class().__name__
        if name in differing():
            assert re.search(rf"command line:\s+{re.escape(cli)}\s", below + " "), (name, below)
            assert re.search(rf"{klass}\(\):\s+{re.escape(cls)}\b", below), (name, below)
        else:
            assert f"command line and {klass}(): {cli}" in lines[i + 1], (name, lines[i + 1])
    assert "scale=16.0, margin=0.2" in out and "CosFaceLoss(): scale=64.0, margin=0.4" in out
    assert "docs/defaults.md" in out and "ln(classes)" in out  # and why


@pytest.mark.parametrize("name", differing())
def test_class_docstring_names_the_command_line_defaults(name):
    doc = " ".join(LOSSES[name].loss_class().__doc__.split())
    cli = format_options(LOSSES[name].defaults)
    assert f"--loss {name}`` with ``{cli}``" in doc or f"--loss {name}`` trains with ``{cli}``" in doc, doc
    assert "docs/defaults.md" in doc


def test_docs_defaults_table_matches_the_code():
    text = DEFAULTS_MD.read_text(encoding="utf-8")
    section = text[text.index(SECTION) :]
    section = section[: section.index("\n## ", 1)]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`") and cells[0] != "`":
            rows[cells[0].strip("`")] = cells
    assert list(rows) == list(LOSSES), "one row per registered loss, in registry order"
    for name, (_, cli, cls, why) in rows.items():
        klass = LOSSES[name].loss_class().__name__
        assert cli == format_options(LOSSES[name].defaults), name
        assert cls == f"`{klass}()`: {format_options(class_defaults(name))}", name
        assert why.startswith("the same") == (name not in differing()), name
