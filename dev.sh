#!/usr/bin/env bash
# One-command set-up and run, from a clone of the repository:
#   ./dev.sh demo [marginkit demo args]   .venv with marginkit[cli,export,serve], then `marginkit demo`
#   ./dev.sh install                      the same environment, nothing run
#   ./dev.sh test [pytest args]           .venv with marginkit[test] (every extra and the test tools),
#                                         then ruff and the whole test suite on every core (+1 worker)
# Creates .venv (if missing) and installs with the torch and torchvision pinned in constraints.txt
# (one environment for demo and test); an install is redone only when pyproject.toml or
# constraints.txt changed.
set -euo pipefail
cd "$(dirname "$0")"
VENV="${MARGINKIT_VENV:-.venv}"
what="${1:-}"; shift || true
case "$what" in
  demo|install) extras="cli,export,serve" ;;  # what the README's sections use
  test) extras="test" ;;
  *) echo "usage: ./dev.sh demo [marginkit demo args] | ./dev.sh install | ./dev.sh test [pytest args]" >&2; exit 2 ;;
esac
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
stamp="$VENV/.installed-${extras//,/-}-$(cat pyproject.toml constraints.txt | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  # --no-compile: Python compiles a module when it is first imported; compiling every file of
  # every package at install time (torch, MLflow, ...) took two thirds of a fresh install.
  "$VENV/bin/python" -m pip install --quiet --no-compile -c constraints.txt -e ".[$extras]"
  if [ "$extras" = test ]; then
    # Resemblyzer's pretrained speaker encoder (the audio baseline, marginkit.audio.ge2e): only its
    # weights file is read, so not its dependencies (librosa, numba, webrtcvad, which compiles).
    "$VENV/bin/python" -m pip install --quiet --no-compile --no-deps "resemblyzer==0.1.4"
  fi
  touch "$stamp"
fi
export PATH="$PWD/$VENV/bin:$PATH"
# Byte-code is written once, on first import, under the environment (never beside the sources):
# with PYTHONDONTWRITEBYTECODE set (as on some CI images) and an install without compiling,
# every process would compile torch's modules again (5 s an import against 2 s); the suite
# starts many processes (CLI runs, servers, torchrun).
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-$PWD/$VENV/pycache}"
case "$what" in
  install) echo "marginkit[$extras] installed in $VENV; activate it with: source $VENV/bin/activate" ;;
  demo) exec marginkit demo "$@" ;;
  test)
    # Idle OpenMP threads sleep instead of spinning: on a small shared machine spinning
    # workers slow the many small tensor ops of the suite by orders of magnitude.
    export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
    ruff check src tests benchmarks
    ruff format --check src tests benchmarks
    # pytest-xdist: one worker per core and one more (at most 4; MARGINKIT_TEST_WORKERS=N sets
    # N, 0 runs the suite in this process): many tests wait on subprocesses, servers or timeouts,
    # and the extra worker keeps the cores busy meanwhile (2 cores: 6.0 min against 7.0 with two).
    # worksteal hands a finished worker the queued tests of a busy one.
    cores="$(python -c 'import os; print(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)')"
    workers="${MARGINKIT_TEST_WORKERS:-$((cores + 1))}"
    exec python -m pytest -n "$workers" --maxprocesses=4 --dist worksteal "$@" ;;
esac
