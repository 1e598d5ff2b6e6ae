"""Every code block of README.md runs as written, in order, as a user would run it.

The blocks run in one bash session in an empty directory that holds only the environment
``./dev.sh`` made (``.venv``, a link to the one running these tests): ```` ```bash ````
blocks as they are (so ``source .venv/bin/activate`` holds for the rest, and files written by one
block are there for the next), ```` ```python ```` blocks each in a fresh ``python`` of that
session, fed line by line through the interactive interpreter's rules (as when pasted into
``python``; a block that only runs as a saved script fails here). Before the first
``source .venv/bin/activate`` neither ``marginkit`` nor the environment's ``python`` is on
PATH. Each section (``##`` / ``###`` heading) runs in a session and directory of its own,
beside the others under pytest-xdist (:func:`parts`): a section's blocks may use the files its
earlier blocks wrote, never another section's.

A bash block may follow one marker comment (HTML, invisible on the rendered page):

- ``<!-- readme-test: skip (REASON) -->`` — not run: the set-up itself, an install into
  the reader's own environment, the test suite.
- ``<!-- readme-test: append "OPTIONS" (REASON) -->`` — the block's one command runs with
  OPTIONS added (a cheap variant of a run that takes minutes, e.g. ``--epochs 1``).
- ``<!-- readme-test: replace "OLD" "NEW" (REASON) -->`` — the block runs with the text OLD,
  which must occur in it exactly once, replaced by NEW (e.g. ``--epochs 20`` by ``--epochs 2``).

Python blocks take no marker: they must be cheap and self-contained. Fences in other
languages must be output or data (:data:`NOT_CODE`); an unlabelled fence is an error, so a new
section's blocks cannot escape the test.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from marginkit.distributed import find_free_port

README = Path(__file__).resolve().parents[1] / "README.md"

RUN = {"python", "bash"}
#: Fence languages that hold output or data, not commands.
NOT_CODE = {"text", "yaml", "json", "csv", "markdown"}
MARKER = re.compile(r"<!--\s*readme-test:\s*(?P<body>.*?)\s*-->")
SKIP = re.compile(r"skip \((?P<reason>[^)]+)\)")
APPEND = re.compile(r'append "(?P<options>[^"]+)" \((?P<reason>[^)]+)\)')
REPLACE = re.compile(r'replace "(?P<old>[^"]+)" "(?P<new>[^"]+)" \((?P<reason>[^)]+)\)')
#: Seconds for the whole README (the demo's tiny variant, a train, eval, predict, compare).
TIMEOUT = 1500
#: The port the README's deploy block serves on. The tests serve on a free port instead, so that
#: two runs of the suite on one machine (or two of its xdist workers) never meet on one port.
README_PORT = 8000
_PORT = re.compile(rf"(?<=--port ){README_PORT}\b|(?<=127\.0\.0\.1:){README_PORT}\b")


def on_a_free_port(script: str, port: int | None = None) -> tuple[str, int]:
    """``script`` with the README's port replaced by ``port`` (default: a free one), and how many
    places changed."""
    return _PORT.subn(str(port or find_free_port()), script)


@dataclass
class Block:
    lang: str
    code: str
    line: int  # 1-based line of the opening fence
    marker: str | None
    section: str = ""  # the ## or ### heading above the block

    @property
    def where(self) -> str:
        return f"README.md:{self.line} ({self.lang})"


def blocks(text: str) -> list[Block]:
    """The fenced blocks of ``text`` with the marker comment right above each (if any)."""
    out: list[Block] = []
    lines = text.splitlines()
    section = ""
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(.*)$", lines[i])
        if not m:
            heading = re.match(r"^#{2,3} (.+)$", lines[i])
            section = heading.group(1).strip() if heading else section
            i += 1
            continue
        if m.group(1):
            raise AssertionError(
                f"README.md:{i + 1}: indented fence; the README test reads fences at column 0"
            )
        lang = m.group(2).strip()
        start = i
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        if j == len(lines):
            raise AssertionError(f"README.md:{start + 1}: unclosed fence")
        k = start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = MARKER.search(lines[k]) if k >= 0 else None
        code = "\n".join(lines[start + 1 : j]) + "\n"
        out.append(Block(lang, code, start + 1, marker.group("body") if marker else None, section))
        i = j + 1
    return out


def commands(code: str) -> list[str]:
    """Non-empty, non-comment lines, backslash continuations joined."""
    joined = re.sub(r"\s*\\\n\s*", " ", code)
    return [ln for ln in joined.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def plan(block: Block) -> str | None:
    """The bash text to run for ``block`` (``None``: skipped by its marker)."""
    if block.marker is None:
        return block.code
    if block.lang != "bash":
        raise AssertionError(f"{block.where}: only bash blocks take a readme-test marker")
    if SKIP.fullmatch(block.marker):
        return None
    r = REPLACE.fullmatch(block.marker)
    if r:
        if block.code.count(r.group("old")) != 1:
            raise AssertionError(
                f"{block.where}: 'replace' needs {r.group('old')!r} exactly once in the block"
            )
        return block.code.replace(r.group("old"), r.group("new"))
    m = APPEND.fullmatch(block.marker)
    if not m:
        raise AssertionError(
            f"{block.where}: unknown marker {block.marker!r}; "
            "use 'skip (REASON)', 'append \"OPTIONS\" (REASON)' or 'replace \"OLD\" \"NEW\" (REASON)'"
        )
    cmds = commands(block.code)
    if len(cmds) != 1:
        raise AssertionError(f"{block.where}: 'append' needs a block of one command, found {len(cmds)}")
    command = re.split(r"\s+#", cmds[0], maxsplit=1)[0].rstrip()  # before a trailing comment
    return f"{command} {m.group('options')}\n"


def readme_blocks() -> list[Block]:
    found = blocks(README.read_text(encoding="utf-8"))
    for b in found:
        if b.lang not in RUN | NOT_CODE:
            raise AssertionError(
                f"{b.where}: fence language {b.lang!r} is neither run ({sorted(RUN)}) nor output/data "
                f"({sorted(NOT_CODE)}); label it (a shell command block is ```bash)"
            )
    return found


def test_readme_blocks_are_all_classified():
    """Cheap and always on: every fence is run or declared output, every marker parses."""
    found = readme_blocks()
    python = [b for b in found if b.lang == "python"]
    bash = [b for b in found if b.lang == "bash"]
    assert len(python) >= 8 and len(bash) >= 5
    skipped = [b for b in bash if plan(b) is None]
    for b in python:
        assert plan(b) == b.code
    # what may be skipped: the set-up (./dev.sh), an install, the suite itself; nothing else
    for b in skipped:
        for cmd in commands(b.code):
            assert re.match(r"(\S+=\S+ )*(\./dev\.sh|pip install|\.venv/bin/python benchmarks/)", cmd), (
                f"{b.where}: skipped, but {cmd!r} is not set-up or development; run it (or give it an "
                "'append' variant with small options)"
            )
    first = next(i for i, b in enumerate(found) if b.lang in RUN and plan(b) is not None)
    assert "source .venv/bin/activate" in found[first].code, (
        "the first block run must activate the environment"
    )


def test_block_parser_sees_markers_and_languages():
    text = textwrap.dedent(
        """\
        intro
        <!-- readme-test: append "--epochs 1" (minutes otherwise) -->

        ```bash
        marginkit demo --out d   # comment
        ```
        ```python
        x = 1
        ```
        """
    )
    a, b = blocks(text)
    assert (a.lang, a.line, a.marker) == ("bash", 4, 'append "--epochs 1" (minutes otherwise)')
    assert plan(a) == "marginkit demo --out d --epochs 1\n"
    assert (b.lang, b.marker, plan(b)) == ("python", None, "x = 1\n")
    with pytest.raises(AssertionError, match="one command"):
        plan(Block("bash", "a\nb\n", 1, 'append "-x" (r)'))
    assert plan(Block("bash", "t --epochs 20\ne\n", 1, 'replace "--epochs 20" "--epochs 2" (r)')) == (
        "t --epochs 2\ne\n"
    )
    with pytest.raises(AssertionError, match="exactly once"):
        plan(Block("bash", "t --epochs 20\nt --epochs 20\n", 1, 'replace "--epochs 20" "--epochs 2" (r)'))
    with pytest.raises(AssertionError, match="unknown marker"):
        plan(Block("bash", "a\n", 1, "ignore"))
    assert commands("a \\\n   b\n# c\n\nd\n") == ["a b", "d"]


#: Runs a python block as the interactive interpreter would: line by line, a blank line ends a
#: compound statement; the first error ends the process with status 1.
CONSOLE = """\
import code, sys
class Console(code.InteractiveConsole):
    def showtraceback(self):
        super().showtraceback(); sys.exit(1)
    def showsyntaxerror(self, filename=None, **kw):
        super().showsyntaxerror(filename); sys.exit(1)
console = Console(filename=sys.argv[1])
more = False
for line in open(sys.argv[1], encoding="utf-8").read().splitlines():
    more = console.push(line)
if more:
    console.push("")
"""


def _venv(work: Path) -> None:
    """``work/.venv``: the environment running these tests (./dev.sh's ``.venv`` under CI)."""
    prefix = Path(sys.prefix)
    if prefix != Path(sys.base_prefix) and (prefix / "bin" / "activate").is_file():
        (work / ".venv").symlink_to(prefix, target_is_directory=True)
        return
    bindir = work / ".venv" / "bin"  # not in a venv: an activate script that finds this python
    bindir.mkdir(parents=True)
    (bindir / "activate").write_text(f'export PATH="{Path(sys.executable).parent}:$PATH"\n')


def parts() -> dict[str, list[tuple[int, Block]]]:
    """The run blocks (index, block) grouped by the section (``##`` / ``###`` heading) they are in,
    in README order: each section runs in a session and directory of its own, so that the
    sections run at once under pytest-xdist. A section's blocks may use what its earlier blocks
    wrote, never another section's files (a section that does fails here)."""
    out: dict[str, list[tuple[int, Block]]] = {}
    for n, b in enumerate(readme_blocks()):
        if b.lang in RUN and plan(b) is not None:
            out.setdefault(b.section, []).append((n, b))
    return out


def test_the_sections_hold_every_block_once():
    split = parts()
    run = [(n, b) for n, b in enumerate(readme_blocks()) if b.lang in RUN and plan(b) is not None]
    assert sorted(n for blocks_ in split.values() for n, _ in blocks_) == [n for n, _ in run]
    assert len(split) >= 5 and all(len({b.section for _, b in v}) == 1 for v in split.values())
    assert blocks("## A\n```bash\nx\n```\n### B\n```python\n# C\n```\n")[1].section == "B"


@pytest.mark.slow
@pytest.mark.parametrize("part", list(parts()), ids=[p.split(" — ")[0] for p in parts()])
def test_readme_runs_as_written(tmp_path, part):
    work = tmp_path / "clone"
    work.mkdir()
    _venv(work)
    logs = tmp_path / "logs"
    logs.mkdir()
    (tmp_path / "console.py").write_text(CONSOLE)
    script = ["set -euo pipefail"]
    port = find_free_port()  # the section's server (the README says 8000) and its clients, bash or python
    if part != next(iter(parts())):  # the environment the first section's first block activates
        script.append("source .venv/bin/activate")
    ran: list[Block] = []
    for n, b in parts()[part]:
        text = plan(b)
        assert text is not None
        log = logs / f"{n}.log"
        script.append(f"echo {n} > {shlex.quote(str(tmp_path / 'current'))}")
        if b.lang == "python":
            path = tmp_path / f"block{n}.py"
            path.write_text(on_a_free_port(b.code, port)[0], encoding="utf-8")
            body = f"python {shlex.quote(str(tmp_path / 'console.py'))} {shlex.quote(str(path))}"
        else:
            body = text.rstrip("\n")
        script.append(f"{{\n{body}\n}} > {shlex.quote(str(log))} 2>&1")
        ran.append(b)
    script.append(f"echo done > {shlex.quote(str(tmp_path / 'current'))}")
    venv_bin = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p and p != venv_bin)
    t0 = time.perf_counter()
    text, _ = on_a_free_port("\n".join(script), port)
    proc = subprocess.run(
        ["bash", "-c", text], cwd=work, env=env, timeout=TIMEOUT, capture_output=True, text=True
    )
    current = (tmp_path / "current").read_text().strip() if (tmp_path / "current").is_file() else "?"
    if proc.returncode != 0 or current != "done":
        n = int(current) if current.isdigit() else -1
        failed = next((b for i, b in enumerate(readme_blocks()) if i == n), None)
        output = (logs / f"{n}.log").read_text() if (logs / f"{n}.log").is_file() else proc.stderr
        pytest.fail(
            f"{failed.where if failed else 'README'} failed (exit {proc.returncode}):\n"
            f"{plan(failed) if failed else ''}\n--- output (last 3000 characters) ---\n{output[-3000:]}"
        )
    print(f"{len(ran)} README blocks ({part}) ran in {time.perf_counter() - t0:.0f} s")
