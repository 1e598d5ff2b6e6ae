"""Argument parsing and dispatch of the ``marginkit`` command line."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import platform
import sys
import warnings
from collections.abc import Sequence
from typing import Any, NoReturn

from marginkit._lazy import missing_extra
from marginkit.cli.compare import DEMO_LOSSES, DEMO_OPTIONS, demo_jobs
from marginkit.cli.errors import EXIT_INTERRUPTED, EXIT_TRAINING, EXIT_USAGE, UserError
from marginkit.train.config import TrainConfig
from marginkit.train.small_data import AUTO_MIN_EPOCHS, AUTO_MIN_SAMPLES

__all__ = ["build_parser", "main"]

# flag -> config key, type for argparse, help
OVERRIDES: tuple[tuple[str, str, Any, str], ...] = (
    (
        "--model",
        "model",
        str,
        "backbone: auto (by the data's shape), mlp, cnn1d, cnn2d, resnet, timm:NAME, torchvision:NAME, "
        "onnx:FILE",
    ),
    ("--backbone", "model", str, "the same as --model (default: auto)"),
    (
        "--epochs",
        "epochs",
        int,
        f"training epochs (default: auto, at least {AUTO_MIN_EPOCHS} and at least "
        f"{AUTO_MIN_SAMPLES:,} training samples seen)",
    ),
    ("--lr", "lr", float, "learning rate"),
    (
        "--workers",
        "workers",
        int,
        "data-loading worker processes of a streamed source (default: the available cores but one)",
    ),
    ("--batch-size", "batch_size", int, "mini-batch size (P×K for pair losses)"),
    ("--embedding-dim", "embedding_dim", int, "embedding dimension"),
    ("--seed", "seed", int, "random seed (data split, init, batch order)"),
    ("--train-per-class", "train_per_class", int, "keep N training samples per class (default: all)"),
    ("--val-fraction", "val_fraction", float, "share of training data held out for validation"),
    ("--k", "k", int, "neighbours of the K-NN classifier"),
    ("--optimizer", "optimizer", str, "adamw or sgd"),
    ("--scheduler", "scheduler", str, "cosine, step or none"),
    ("--warmup-epochs", "warmup_epochs", float, "linear warm-up length in epochs"),
    ("--weight-decay", "weight_decay", float, "weight decay of the backbone"),
    ("--grad-clip", "grad_clip", float, "clip the global gradient norm (default: off)"),
    (
        "--weights",
        "weights",
        str,
        "start the trunk from a state dict .pt, .safetensors file or run dir (default: random)",
    ),
    (
        "--init-from",
        "init_from",
        str,
        "start trunk and projection from this run, with its backbone and a new head (default: none)",
    ),
    ("--freeze", "freeze", str, "keep fixed: none, trunk, or N (the first N stages)"),
    ("--backbone-lr-mult", "backbone_lr_mult", float, "the trunk's learning rate is lr times this"),
    ("--device", "device", str, "cpu, cuda, cuda:N, mps or auto"),
    # --num-threads: its help depends on the command (_threads_help)
)


class HelpFormatter(argparse.HelpFormatter):
    """Help that ends each option with its default, unless there is none (``None``, ``False``)
    or the text already states it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, False, [], argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and action.option_strings and action.default not in (None, False, []):
            action = copy.copy(action)  # an option without a help text still shows its default
            action.help = "(default: %(default)s)"
        return super()._format_action(action)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors that suggest the nearest valid flag or command, and help
    that shows the defaults."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_args(self._argv, namespace)

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments:"):
            message = "unrecognized arguments: " + " ".join(self._hints(message.split(":", 1)[1].split()))
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")

    def _hints(self, bad: list[str]) -> list[str]:
        """Each unrecognised argument, a flag with the nearest flag of the command it was given
        to, or the commands that do take it."""
        from marginkit.train.errors import nearest

        def flags(actions: list[argparse.Action]) -> dict[str, str]:
            return {s[2:].replace("-", "_"): s for a in actions for s in a.option_strings if s[:2] == "--"}

        commands: dict[str, dict[str, str]] = {}
        for a in self._actions:
            if isinstance(a, argparse._SubParsersAction):
                commands.update({name: flags(sub._actions) for name, sub in a.choices.items()})
        command = next((t for t in getattr(self, "_argv", []) if t in commands), None)
        mine = {**flags(self._actions), **commands.get(command, {})}
        hints = []
        for b in bad:
            name = b.split("=")[0][2:].replace("-", "_")
            others = [c for c, taken in commands.items() if c != command and name in taken]
            close = nearest(name, mine) if b.startswith("--") else None
            if b.startswith("--") and others:
                where = f"marginkit {command}" if command else "this command"
                takers = " and ".join(f"marginkit {c}" for c in others)
                hints.append(f"{b} (an option of {takers}, not of {where})")
            elif close is not None:
                hints.append(f"{b} (did you mean {mine[close]}?)")
            else:
                hints.append(b)
        return hints


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar or log lines")
    p.add_argument("--debug", action="store_true", help="show full tracebacks on errors")


def _threads_help(parallel: str) -> str:
    """``--num-threads``'s help with the real default: the cores this process may use, divided
    by the runs (``compare --jobs``) or processes (``train --nproc``) that share them."""
    from marginkit.train.runtime import available_cores

    cores = available_cores()
    return (
        f"torch intra-op threads of each run (default: the {cores} CPU core(s) this process may use "
        f"divided by {parallel}, at least 1; the run logs the number it chose and records it in "
        "config.yaml)"
    )


def _overrides(p: argparse.ArgumentParser, *, with_loss: bool) -> None:
    g = p.add_argument_group("run options (override --config)")
    g.add_argument("--config", metavar="FILE.yaml", help="YAML file with any run options")
    g.add_argument(
        "--data", metavar="DATA", help="data set: mnist1d, digits, breast_cancer, identities, npz:PATH, ..."
    )
    if with_loss:
        g.add_argument("--loss", metavar="LOSS", help="loss name (see `marginkit losses`)")
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    for flag, key, typ, help_ in OVERRIDES:
        if "default" not in help_:  # the flag's own default is None: "take it from --config"
            help_ = f"{help_} (default: {defaults[key]})"
        g.add_argument(flag, dest=f"opt_{key}", type=typ, metavar=key.upper(), help=help_)
    parallel = "--nproc" if with_loss else "--jobs"  # train / compare
    g.add_argument(
        "--num-threads", dest="opt_num_threads", type=int, metavar="NUM_THREADS", help=_threads_help(parallel)
    )
    g.add_argument(
        "--compile",
        dest="opt_compile",
        action="store_true",
        default=None,
        help="torch.compile the model for the training step (default: off)",
    )
    g.add_argument(
        "--amp",
        dest="opt_amp",
        nargs="?",
        const="bf16",
        choices=("bf16", "fp16", "off"),
        help="autocast: bf16 (the default of a bare --amp) or fp16 (with a gradient scaler); default: off",
    )
    g.add_argument(
        "--augment",
        dest="opt_augment",
        metavar="NAMES",
        help="opt-in training augmentation, comma-separated: flip, crop, rotate, brightness, contrast "
        "(images), crop, time_mask (sequences); never at evaluation (default: none)",
    )
    g.add_argument(
        "--trials",
        dest="opt_trials",
        metavar="FILE",
        help="audio: a speaker-verification trial list ('1 id1/s1/00001.wav id2/s2/00003.wav', paths "
        "relative to the audio: data root, in any split) scored after training, each utterance embedded "
        "once: EER, minDCF at p_target 0.01 and 0.05, TAR@FAR under 'trials' in metrics.json (default: none)",
    )
    if with_loss:  # compare's --norm / --top-k are its protocol flags, and the trial list's without one
        g.add_argument(
            "--norm",
            dest="opt_trials_norm",
            choices=("as-norm", "none"),
            help="with --trials: adaptive S-norm of the trial scores against a cohort of the training "
            "speakers (as eval --trials --norm as-norm; default: none)",
        )
        g.add_argument(
            "--top-k",
            dest="opt_trials_top_k",
            type=int,
            metavar="K",
            help="with --norm as-norm: the cohort scores kept on each side (default: 300, at most the "
            "speakers)",
        )
    g.add_argument(
        "--pretrained",
        dest="opt_pretrained",
        action="store_const",
        const=True,
        help="start a timm / torchvision model from the library's pretrained weights (its download "
        "and cache; see docs/finetune.md; default: off)",
    )
    g.add_argument(
        "--grad-checkpointing",
        dest="opt_grad_checkpointing",
        action="store_const",
        const=True,
        help="recompute activations in the backward pass (less memory, one more forward; default: off)",
    )
    g.add_argument(
        "--tensorboard",
        dest="opt_tracking.tensorboard",
        nargs="?",
        const=True,
        metavar="DIR",
        help="write TensorBoard event files (default: off; DIR defaults to RUN_DIR/tensorboard)",
    )
    g.add_argument(
        "--mlflow",
        dest="opt_tracking.mlflow",
        nargs="?",
        const=True,
        metavar="URI",
        help="log an MLflow run (default: off; URI defaults to a local store, "
        "sqlite:///RUN_DIR/mlflow.db, for compare OUT/mlflow.db)",
    )
    g.add_argument(
        "--set",
        dest="assignments",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any option, e.g. --set loss_options.scale=30 (repeatable; wins over flags)",
    )


def _protocol_flags(p: argparse.ArgumentParser) -> None:
    from marginkit.train.protocols import NORMS, PROTOCOLS

    g = p.add_argument_group("evaluation protocol (on the test split; see docs/knn_and_metrics.md)")
    g.add_argument(
        "--protocol",
        metavar="|".join(PROTOCOLS),
        help="also evaluate this protocol: 1:1 pairs, open-set 1:N search, or pooled templates",
    )
    g.add_argument("--cohort", type=int, metavar="N", help="normalisation cohort: N training embeddings")
    g.add_argument(
        "--norm",
        metavar="|".join(NORMS),
        help="cohort score normalisation of pair scores; without --protocol, with --trials: the trial "
        "list's (as-norm against the training speakers)",
    )
    g.add_argument(
        "--top-k",
        type=int,
        metavar="K",
        help="cohort scores kept by as-norm (default: N // 10; a trial list's: 300)",
    )
    g.add_argument("--template-size", type=int, metavar="S", help="samples per template (default: 4)")


def build_parser() -> argparse.ArgumentParser:
    """The ``marginkit`` argument parser."""
    parser = Parser(
        prog="marginkit",
        description="Train, evaluate and compare margin-based embedding models.",
        allow_abbrev=False,
    )
    _common(parser)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)

    p = sub.add_parser("train", help="train and evaluate one model", allow_abbrev=False)
    _common(p)
    _overrides(p, with_loss=True)
    p.add_argument("--out", required=True, metavar="RUN_DIR", help="run directory (created)")
    p.add_argument("--resume", action="store_true", help="continue the interrupted run in RUN_DIR")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run in RUN_DIR")
    p.add_argument("--stop-after", type=int, metavar="N", help="stop after N epochs (resume later)")
    p.add_argument("--no-report", action="store_true", help="skip report.html")
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        metavar="N",
        help="train data-parallel on N local processes (torchrun; see docs/distributed.md)",
    )

    p = sub.add_parser("eval", help="evaluate a run (optionally on other data)", allow_abbrev=False)
    _common(p)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by `marginkit train`")
    p.add_argument("--data", metavar="DATA", help="evaluate on this data set (default: the run's)")
    p.add_argument("--checkpoint", choices=("best", "last"), default="best", help="which checkpoint")
    p.add_argument("--k", type=int, help="K of the K-NN classifier (default: the run's)")
    p.add_argument("--json", metavar="FILE", help="also write the metrics to FILE")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --json FILE")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, mps or auto")
    p.add_argument(
        "--trials",
        metavar="FILE",
        help="score this speaker-verification trial list only, embedding exactly the utterances it names "
        "(paths relative to the root of --data, an audio: source, every utterance of it; default: the "
        "run's data): EER, minDCF at p_target 0.01 and 0.05, TAR@FAR under 'trials'; with --norm as-norm "
        "[--top-k K, default 300] against the run's training speakers",
    )
    _protocol_flags(p)

    p = sub.add_parser("embed", help="write embeddings of a data set to .npz", allow_abbrev=False)
    _common(p)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by `marginkit train`")
    p.add_argument("--data", metavar="DATA", help="data set (default: the run's)")
    p.add_argument(
        "--out", required=True, metavar="FILE.npz", help="the embeddings, labels and split of each sample"
    )
    p.add_argument("--split", choices=("train", "val", "test", "all"), default="all", help="which split")
    p.add_argument("--checkpoint", choices=("best", "last"), default="best", help="which checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, mps or auto")

    p = sub.add_parser("predict", help="K-NN predictions for new inputs (x in an .npz)", allow_abbrev=False)
    _common(p)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by `marginkit train`")
    p.add_argument(
        "input", metavar="INPUT.npz", help="array `x` (raw inputs, like the training data's files)"
    )
    p.add_argument("--out", metavar="FILE", help="write predictions (.csv or .npz)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, mps or auto")

    p = sub.add_parser("report", help="(re)write RUN_DIR/report.html", allow_abbrev=False)
    _common(p)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by `marginkit train`")

    p = sub.add_parser("compare", help="train several losses on the same data and budget", allow_abbrev=False)
    _common(p)
    _overrides(p, with_loss=False)
    p.add_argument("--losses", required=True, help="comma-separated loss names")
    p.add_argument("--seeds", type=int, default=1, help="seeds per loss (mean ± std)")
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="where the runs (DIR/runs/LOSS/seedN), summary.json, the table and report.html go; "
        "rerun into it to reuse finished runs and resume the others",
    )
    p.add_argument("--overwrite", action="store_true", help="replace existing runs in DIR")
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs trained at once in separate processes, sharing the cores: each run gets cores / "
        "JOBS torch threads unless --num-threads (1: one run at a time on every core; `demo` instead "
        "runs min(2, cores) runs of one thread each)",
    )
    p.add_argument(
        "--no-baselines",
        action="store_true",
        help="leave out the baselines' rows (closed set: raw-input 1-NN, logistic regression; "
        "open set: raw inputs, whitened PCA), scored on the same splits by the same evaluation",
    )
    _protocol_flags(p)

    p = sub.add_parser("demo", help="compare 8 losses on mnist1d (a few minutes on CPU)", allow_abbrev=False)
    _common(p)
    p.add_argument("--out", default="demo_out", metavar="DIR", help="where the runs, tables and report go")
    p.add_argument("--seeds", type=int, default=1, help="seeds per loss (mean ± std)")
    p.add_argument("--epochs", type=int, help=f"epochs of every run (default: {DEMO_OPTIONS['epochs']})")
    p.add_argument(
        "--losses",
        help=f"comma-separated subset of the demo's losses (default: all {len(DEMO_LOSSES)}: "
        + ", ".join(DEMO_LOSSES)
        + ")",
    )
    p.add_argument(
        "--jobs",
        type=int,
        help="runs trained at once, in separate processes of one torch thread each, so that the table "
        f"is the same for any JOBS (default: min(2, CPU cores) = {demo_jobs()} here; `compare` "
        "defaults to 1 run using every core)",
    )
    p.add_argument("--overwrite", action="store_true", help="retrain runs already in DIR")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, mps or auto")
    p.add_argument(
        "--markdown",
        action="store_true",
        help="print the table and its conditions for the README (to paste verbatim)",
    )

    p = sub.add_parser("study", help="the reproducible study of docs/RESULTS.md", allow_abbrev=False)
    _common(p)
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="where the runs, tables, claims.json and RESULTS.md go (created); a rerun into DIR "
        "reuses the jobs already finished there",
    )
    p.add_argument("--quick", action="store_true", help="tiny budget (CI smoke run)")
    p.add_argument("--jobs", type=int, default=2, help="worker processes, one torch thread each")

    from marginkit.cli.deploy import add_parsers as add_deploy_parsers

    add_deploy_parsers(sub, _common)

    from marginkit.cli.pack import add_parsers as add_pack_parsers

    add_pack_parsers(sub, _common)

    p = sub.add_parser("losses", help="list the loss names and their defaults", allow_abbrev=False)
    _common(p)
    p = sub.add_parser(
        "datasets", help="describe the built-in data sets and the file formats", allow_abbrev=False
    )
    _common(p)
    return parser


def _version() -> str:
    """``marginkit X (torch Y, Python Z)``, without importing torch."""
    from importlib.metadata import PackageNotFoundError, version

    from marginkit import __version__

    try:
        torch = version("torch")
    except PackageNotFoundError:  # pragma: no cover - torch is a dependency
        torch = "not installed"
    return f"marginkit {__version__} (torch {torch}, Python {platform.python_version()})"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``marginkit`` console script; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:  # usage errors (exit 2) and --help (exit 0) return their code
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    from marginkit.cli import commands

    args.argv = list(sys.argv[1:] if argv is None else argv)  # for `train --nproc` re-launching
    handler = getattr(args, "handler", None) or getattr(commands, f"cmd_{args.command}")
    try:
        with warnings.catch_warnings():
            if not args.debug:
                warnings.simplefilter("default")
                warnings.showwarning = _show_warning
            return int(handler(args) or 0)
    except UserError as exc:
        if args.debug:
            raise
        print(f"marginkit: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        if args.debug:
            raise
        hint = ""
        if args.command == "train":
            hint = f"; continue with: marginkit train --resume --out {args.out}"
        elif args.command in ("compare", "demo"):
            hint = "; run the same command again to reuse finished runs and resume the others"
        print(f"\nmarginkit: interrupted{hint}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if args.debug:
            raise
        missing = missing_extra(exc, f"`marginkit {args.command}`")
        if missing is not None:  # the user's installation, not a bug: a usage error
            print(f"marginkit: error: {missing}", file=sys.stderr)
            return EXIT_USAGE
        from marginkit.train.trainer import TrainingError

        kind = "error" if isinstance(exc, TrainingError) else f"internal error ({type(exc).__name__})"
        first = (str(exc).strip().splitlines() or [""])[0]
        print(f"marginkit: {kind}: {first} (run with --debug for the traceback)", file=sys.stderr)
        return EXIT_TRAINING


def _show_warning(
    message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: str | None = None
) -> None:
    print(f"marginkit: warning: {message}", file=sys.stderr)
