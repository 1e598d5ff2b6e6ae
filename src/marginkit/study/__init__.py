"""The reproducible study of the sources' claims (docs/RESULTS.md): plan, runner, tables, verdicts.

python benchmarks/study.py --out study_out [--quick]
"""

from marginkit._lazy import attach

__getattr__, __dir__, __all__ = attach(
    __name__,
    {
        "StudyPlan": "plan",
        "study_plan": "plan",
        "run_study": "runner",
        "run_job": "jobs",
        "fake_quantized": "jobs",
        "paired_bootstrap": "stats",
        "crammer_singer_hinge": "jobs",
    },
)
