"""The reproducible study of the sources' claims: regenerates every table of docs/RESULTS.md.

    python benchmarks/study.py --out study_out            # full study (budget: 60 min on 2 cores)
    python benchmarks/study.py --out study_out --quick    # CI smoke version (about a minute)

Writes OUT/RESULTS.md, OUT/tables/*.md, OUT/figures/, OUT/claims.json and every run's config
and result under OUT/runs/; prints the wall time. Finished runs are reused when rerun.
"""

from __future__ import annotations

import argparse

from marginkit.study import run_study


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--quick", action="store_true", help="tiny budget (CI smoke run)")
    parser.add_argument(
        "--jobs", type=int, default=2, help="worker processes, one torch thread each (default 2)"
    )
    parser.add_argument(
        "--collect-only",
        action="store_true",
        help="train nothing: write the tables from the finished runs already in --out (interrupted study)",
    )
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    res = run_study(args.out, quick=args.quick, jobs=args.jobs, collect_only=args.collect_only)
    for claim in res["claims"]:
        print(f"- {claim['claim']}: {claim['verdict']}")
    print(f"results: {res['results_md']}")
    print(f"study wall time: {res['wall_seconds']:.1f} s")


if __name__ == "__main__":
    main()
