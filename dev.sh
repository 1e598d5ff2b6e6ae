#!/usr/bin/env bash
# One-command set-up and run:  ./dev.sh demo   |   ./dev.sh test [pytest args]
# Creates .venv (if missing), installs marginkit with the CPU torch pinned in
# constraints.txt, then runs the demo or the full test suite (ruff included).
set -euo pipefail
cd "$(dirname "$0")"
VENV="${MARGINKIT_VENV:-.venv}"
what="${1:-}"; shift || true
case "$what" in
  demo) extras="cli" ;;
  test) extras="test" ;;
  *) echo "usage: ./dev.sh demo [marginkit demo args] | ./dev.sh test [pytest args]" >&2; exit 2 ;;
esac
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
stamp="$VENV/.installed-$extras-$(cat pyproject.toml constraints.txt | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet -c constraints.txt -e ".[$extras]"
  touch "$stamp"
fi
export PATH="$PWD/$VENV/bin:$PATH"
case "$what" in
  demo) exec marginkit demo "$@" ;;
  test)
    # Idle OpenMP threads sleep instead of spinning: on a small shared machine spinning
    # workers slow the many small tensor ops of the suite by orders of magnitude.
    export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
    ruff check src tests benchmarks
    ruff format --check src tests benchmarks
    exec python -m pytest "$@" ;;
esac
