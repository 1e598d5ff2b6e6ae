"""The ``marginkit`` subcommands: train, eval, embed, predict, report, compare, demo, losses, datasets."""

from __future__ import annotations

import argparse
import csv
import io
import json
import signal
import sys
from pathlib import Path
from typing import Any

from marginkit.cli.errors import UserError, user_errors

__all__ = [
    "build_config",
    "cmd_compare",
    "cmd_datasets",
    "cmd_demo",
    "cmd_embed",
    "cmd_eval",
    "cmd_losses",
    "cmd_predict",
    "cmd_report",
    "cmd_train",
    "format_metrics",
    "init_from_pairs",
]


def _config_errors() -> tuple[type[BaseException], ...]:
    from marginkit.train.errors import CheckpointError, ConfigError, RunDirError

    return (ConfigError, RunDirError, CheckpointError)


def _cli_overrides(args: argparse.Namespace, *, loss: str | None = None) -> list[tuple[str, Any]]:
    from marginkit.train.config import parse_assignment

    pairs: list[tuple[str, Any]] = []
    if getattr(args, "data", None):
        pairs.append(("data", args.data))
    if loss:
        pairs.append(("loss", loss))
    for name, value in vars(args).items():  # the option flags (dest "opt_KEY"), in parser order
        if name.startswith("opt_") and value is not None:
            pairs.append((name[len("opt_") :], value))
    for text in getattr(args, "assignments", []) or []:
        pairs.append(parse_assignment(text))
    return pairs


def build_config(args: argparse.Namespace, *, loss: str | None = None, base: Any = None) -> Any:
    """The run's :class:`TrainConfig`: defaults < ``--config`` YAML < flags < ``--set``."""
    from marginkit.train.config import TrainConfig, apply_overrides, load_config

    try:
        pairs: list[tuple[str, Any]] = []
        if getattr(args, "config", None):
            pairs.extend(load_config(args.config).items())
        pairs.extend(_cli_overrides(args, loss=loss))
        if base is None:  # (a resumed run has its stored config)
            pairs = [*init_from_pairs(pairs), *pairs]
        return apply_overrides(base if base is not None else TrainConfig(), pairs)
    except _config_errors() as exc:
        raise UserError(str(exc)) from exc


def init_from_pairs(pairs: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """With ``init_from`` among ``pairs``: the backbone of that run (model, embedding size,
    normalisation, model options) as pairs to put before ``pairs``, which may still override them."""
    from marginkit.train.starting import init_base

    runs = [value for key, value in pairs if str(key).replace("-", "_") == "init_from" and value]
    if not runs:
        return []
    try:
        return list(init_base(str(runs[-1])).items())
    except _config_errors() as exc:
        raise UserError(str(exc)) from exc


def _require(args: argparse.Namespace, config_pairs: dict[str, Any], *names: str) -> None:
    for name in names:
        if getattr(args, name, None) is None and name not in config_pairs:
            raise UserError(f"missing --{name} (or `{name}:` in the --config file)")


def _load_splits(config: Any, *, cache: bool = False) -> Any:
    from marginkit.train.components import load_splits
    from marginkit.train.sources import register_sources

    register_sources()  # audio: (registered above data/)

    with user_errors():
        return load_splits(config, cache=cache)


def format_metrics(metrics: dict[str, Any]) -> str:
    """A short aligned text table of the headline test metrics."""
    rows: list[tuple[str, str]] = []

    def add(label: str, key: str) -> None:
        v = metrics.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            rows.append((label, f"{v:.4f}"))

    loo = ", leave-one-out in test" if metrics.get("open_set") else ""
    add(f"K-NN accuracy (k={metrics.get('k')}{loo})", "knn_accuracy")
    add("cosine-head accuracy", "head_accuracy")
    add("precision@1", "precision_at_1")
    add("R-precision", "r_precision")
    add("MAP@R", "map_at_r")
    for key, title in (
        ("verification", "verification"), ("verification_normalized", "normalised"),
        ("templates", "templates"), ("templates_normalized", "normalised templates"),
    ):  # fmt: skip
        if isinstance(metrics.get(key), dict):
            rows.extend(_verification_rows(metrics[key], title))
    if isinstance(metrics.get("identification"), dict):
        rows.extend(_identification_rows(metrics["identification"]))
    if isinstance(metrics.get("trials"), dict):
        rows.extend(_trial_rows(metrics["trials"]))
    add("median margin gap (cos)", "margin_gap_median")
    add("mean support size", "support_size_mean")
    width = max((len(r[0]) for r in rows), default=10)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def _verification_rows(ver: dict[str, Any], title: str = "verification") -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    pre = "" if title == "verification" else f"{title} "  # the other sections' rows say which they are
    norm = ver.get("normalization")
    if isinstance(norm, dict):
        rows.append((f"{title}: score norm", f"{norm.get('method')} against {norm.get('cohort')} training "
                     f"embeddings" + (f", top {norm['top_k']}" if norm.get("top_k") else "")))  # fmt: skip
    ci = ver.get("confidence_intervals") if isinstance(ver.get("confidence_intervals"), dict) else {}

    def interval(value: Any) -> str:
        ok = (
            isinstance(value, (list, tuple))
            and len(value) == 2
            and all(isinstance(v, (int, float)) for v in value)
        )
        return f" [{value[0]:.4f}, {value[1]:.4f}]" if ok else ""

    if isinstance(ver.get("eer"), (int, float)):
        rows.append((f"{title} EER", f"{ver['eer']:.4f}{interval(ci.get('eer'))}"))
    if ci:
        how = f"{ci.get('level', 0.95):.0%} subject bootstrap, {ci.get('replicates')} replicates"
        rows.append((f"{pre}intervals [lo, hi]", f"{how} over {ci.get('num_subjects')} test classes"))
    tars, thresholds = ver.get("tar_at_far") or {}, ver.get("thresholds") or {}
    ci_tars = ci.get("tar_at_far") or {}
    for far, tar in tars.items():
        label = f"{pre}TAR @ FAR {float(far):.0e}"
        if tar is None:
            rows.append((label, f"not measurable with {ver.get('num_impostor')} impostor pairs"))
        else:
            rows.append(
                (
                    label,
                    f"{tar:.4f}{interval(ci_tars.get(far))} "
                    f"(threshold {thresholds.get(far, float('nan')):.4f})",
                )
            )
    if isinstance(ver.get("auc"), (int, float)):
        rows.append((f"{pre}ROC AUC", f"{ver['auc']:.4f}"))
    if isinstance(ver.get("min_dcf"), (int, float)):
        p = (ver.get("dcf_params") or {}).get("p_target")
        rows.append((f"{pre}minDCF (p_target {p})", f"{ver['min_dcf']:.4f}"))
    for key, label in (("cllr", "Cllr (calibrated on validation)"), ("min_cllr", "min Cllr"),
                       ("actual_dcf", "actual DCF")):  # fmt: skip
        if isinstance(ver.get(key), (int, float)):
            rows.append((pre + label, f"{ver[key]:.4f}"))
    skipped = (ver.get("calibration") or {}).get("skipped")
    if skipped:
        rows.append((f"{pre}Cllr, actual DCF", f"not computed: {skipped}"))
    if "num_genuine" in ver:
        what = "test template pairs" if "num_templates" in ver else "test pairs"
        rows.append((what, f"{ver['num_genuine']} genuine / {ver.get('num_impostor')} impostor"))
    return rows


def _trial_rows(trials: dict[str, Any]) -> list[tuple[str, str]]:
    """The rows of a scored trial list (``metrics["trials"]``)."""
    rows: list[tuple[str, str]] = [
        ("trial list", f"{trials.get('source')}: {trials.get('num_target')} target / "
                       f"{trials.get('num_nontarget')} non-target trials, {trials.get('num_utterances')} "
                       "utterances"),
    ]  # fmt: skip
    if trials.get("norm") not in (None, "none"):
        rows.append(("trials: score norm", str(trials["norm"])))
    ci = trials.get("confidence_intervals") if isinstance(trials.get("confidence_intervals"), dict) else {}

    def interval(value: Any) -> str:
        ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, float) for v in value)
        return f" [{value[0]:.4f}, {value[1]:.4f}]" if ok else ""

    if isinstance(trials.get("eer"), (int, float)):
        rows.append(("trials EER", f"{trials['eer']:.4f}{interval(ci.get('eer'))}"))
    for p in ("0.01", "0.05"):
        if isinstance(trials.get(f"min_dcf_{p}"), (int, float)):
            rows.append((f"trials minDCF (p_target {p})", f"{trials[f'min_dcf_{p}']:.4f}"))
    ci_tars = ci.get("tar_at_far") or {}
    for far, tar in (trials.get("tar_at_far") or {}).items():
        label = f"trials TAR @ FAR {float(far):.0e}"
        text = f"{tar:.4f}{interval(ci_tars.get(far))}" if tar is not None else "not measurable"
        rows.append((label, text))
    if ci:
        how = f"{ci.get('level', 0.95):.0%} speaker bootstrap, {ci.get('replicates')} replicates"
        rows.append(("trials intervals [lo, hi]", f"{how} over {ci.get('num_subjects')} speakers"))
    return rows


def _identification_rows(ident: dict[str, Any]) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    for rank, rate in (ident.get("cmc") or {}).items():
        gallery = ident.get("num_gallery_labels")
        text = f"{rate:.4f}" if rate is not None else f"— (gallery of {gallery} labels)"
        rows.append((f"CMC rank {rank}", text))
    for fpir, rate in (ident.get("dir_at_fpir") or {}).items():
        label = f"DIR @ FPIR {float(fpir):.0e}"
        n = ident.get("num_nonmated")
        text = f"{rate:.4f}" if rate is not None else f"not measurable with {n} non-mated probes"
        rows.append((label, text))
    rows.append(("probes", f"{ident.get('num_mated')} mated / {ident.get('num_nonmated')} non-mated"))
    return rows


# ---------------------------------------------------------------------- train
def _launch_processes(args: argparse.Namespace) -> int:
    """``train --nproc N``: run this command on N local processes with torchrun (loopback only).

    The torchrun agent gets SIGTERM when this process dies (any way, SIGKILL included) and
    SIGTERM when this process is interrupted or terminated; it then stops the ranks, which
    also die with the agent. Each rank uses ``cores // N`` threads unless told otherwise.
    """
    import os
    import subprocess

    from marginkit.distributed import _loopback_interface, find_free_port
    from marginkit.train.processes import parent_death_signal, sigterm_as_interrupt
    from marginkit.train.runtime import choose_threads

    argv, skip = [], False
    for a in getattr(args, "argv", []):
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            argv.append(a)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(args.nproc),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{find_free_port()}",
        "-m", "marginkit.cli", *argv,
    ]  # fmt: skip
    threads = str(choose_threads(args.nproc))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads)}
    env.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())
    agent = subprocess.Popen(  # preexec_fn is safe here: the launcher runs no threads of its own
        cmd, env=env, preexec_fn=lambda: parent_death_signal(signal.SIGTERM)
    )
    try:
        with sigterm_as_interrupt():
            return agent.wait()
    except BaseException:
        agent.terminate()  # the agent stops its ranks
        try:
            agent.wait(timeout=60)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
        raise


def cmd_train(args: argparse.Namespace) -> int:
    import os

    from marginkit.train.config import load_config
    from marginkit.train.rundir import load_checkpoint, stored_config
    from marginkit.train.trainer import train

    if args.nproc < 1:
        raise UserError(f"--nproc must be >= 1, got {args.nproc}")
    if args.nproc > 1 and "TORCHELASTIC_RUN_ID" not in os.environ:
        return _launch_processes(args)
    quiet = args.quiet
    if args.resume:
        last = Path(args.out) / "last.pt"
        if not last.is_file():
            raise UserError(f"cannot resume: {str(args.out)!r} holds no last.pt checkpoint")
        try:
            stored = stored_config(load_checkpoint(last), last)
        except _config_errors() as exc:
            raise UserError(str(exc)) from exc
        config = build_config(args, base=stored)
    else:
        try:
            from_file = load_config(args.config) if args.config else {}
        except _config_errors() as exc:
            raise UserError(str(exc)) from exc
        _require(args, {k.replace("-", "_"): v for k, v in from_file.items()}, "data", "loss")
        config = build_config(args, loss=args.loss)
    from marginkit.train.components import resolve_device

    try:
        resolve_device(config.device)  # an unavailable device fails like a typo, before the data loads
    except _config_errors() as exc:
        raise UserError(str(exc)) from exc
    splits = _load_splits(config)
    _check_trials(config, splits)
    try:
        result = train(
            config,
            args.out,
            resume=args.resume,
            stop_after=args.stop_after,
            overwrite=args.overwrite,
            quiet=quiet,
            splits=splits,
            report=not args.no_report,
        )
    except _config_errors() as exc:
        raise UserError(str(exc)) from exc
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun: rank 0 prints the summary
        return 0
    out = Path(args.out)
    if not result.finished:
        print(f"stopped after epoch {result.epochs_completed}/{result.config.epochs}: {out}")
        print(f"continue with: marginkit train --resume --out {out}")
        return 0
    m = result.metrics
    from marginkit.cli.compare import write_run_summary

    write_run_summary(out, m, config.loss)
    print(
        f"run     {out}\n"
        f"data    {m.get('data')} ({m.get('num_train')} train / {m.get('num_test')} test), "
        f"loss {config.loss}, model {m.get('model')}, {result.config.epochs} epochs "
        f"in {result.seconds:.1f} s "
        f"(best epoch {m.get('best_epoch')})"
    )
    print(format_metrics(m))
    if (out / "report.html").is_file():
        print(f"report  {out / 'report.html'}")
    return 0


# ---------------------------------------------------------------------- eval / embed / predict
def _load_run(run_dir: str, which: str = "best", device: str = "cpu") -> dict[str, Any]:
    from marginkit.train.rundir import load_run

    try:
        return load_run(run_dir, which, device)
    except _config_errors() as exc:
        raise UserError(str(exc)) from exc


def _other_splits(run: dict[str, Any], data: str | None) -> Any:
    from marginkit.train.config import apply_overrides

    config = run["config"]
    if data is None or data == config.data:
        return _load_splits(config)
    try:
        other = apply_overrides(config, {"data": data, "data_options": {}})
    except _config_errors() as exc:
        raise UserError(str(exc)) from exc
    other.data_options = {}
    if config.data.startswith("audio:") and data.startswith("audio:"):  # the signal the model was trained on
        signal = ("sample_rate", "crop_seconds", "channel", "resample")
        other.data_options = {k: v for k, v in config.data_options.items() if k in signal}
    splits = _load_splits(other)
    if tuple(splits.input_shape) != tuple(run["facts"]["input_shape"]):
        raise UserError(
            f"data set {data!r} has input shape {tuple(splits.input_shape)}; the run's model expects "
            f"{tuple(run['facts']['input_shape'])}"
        )
    return splits


def _protocol(args: argparse.Namespace) -> Any:
    """The ``--protocol`` options (``None`` without ``--protocol``), checked before any work."""
    from marginkit.train.protocols import ProtocolOptions

    try:
        return ProtocolOptions.from_flags(
            args.protocol, cohort=args.cohort, norm=args.norm, top_k=args.top_k,
            template_size=args.template_size,
        )  # fmt: skip
    except ValueError as exc:
        raise UserError(str(exc)) from None


def _check_protocol_data(protocol: Any, splits: Any) -> None:
    from marginkit.train.protocols import check_protocol_data

    if protocol is not None:
        with user_errors():
            check_protocol_data(protocol, splits)


def _eval_trials(args: argparse.Namespace) -> int:
    """``eval --trials FILE``: the trial list only (:func:`marginkit.train.evaluate.evaluate_run_trials`)."""
    from marginkit.train.evaluate import evaluate_run_trials

    other = [f for f, v in (("--protocol", args.protocol), ("--cohort", args.cohort), ("--k", args.k),
                            ("--template-size", args.template_size)) if v is not None]  # fmt: skip
    if other:
        hint = (
            "; the AS-norm cohort of a trial list is the run's training speakers: --norm as-norm [--top-k K]"
            if other[0] == "--cohort"
            else ""
        )
        raise UserError(
            f"{other[0]} does not apply with --trials, which scores the trial list only (evaluate the "
            f"test split in another `marginkit eval` without --trials){hint}"
        )
    if args.norm not in (None, "as-norm"):
        raise UserError(f"--norm with --trials: as-norm only (adaptive S-norm), got {args.norm!r}")
    if args.top_k is not None and args.norm is None:
        raise UserError("--top-k needs --norm as-norm")
    if args.top_k is not None and args.top_k < 1:
        raise UserError(f"--top-k must be >= 1, got {args.top_k}")
    out = _writable_file(args.json, overwrite=args.overwrite, flag="--json") if args.json else None
    try:
        with user_errors():
            metrics = evaluate_run_trials(
                args.run_dir, args.trials, data=args.data, device=args.device, which=args.checkpoint,
                norm=args.norm, top_k=300 if args.top_k is None else args.top_k,
            )  # fmt: skip
    except _config_errors() as exc:
        raise UserError(str(exc)) from exc
    print(f"run     {args.run_dir} ({metrics.get('checkpoint')}, epoch {metrics.get('epoch')})")
    print(f"data    {metrics.get('data')}, model {metrics.get('model')}")
    print(format_metrics(metrics))
    if out is not None:
        _write_output(out, lambda fh: fh.write((json.dumps(metrics, indent=2) + "\n").encode("utf-8")))
    return 0


def _check_trials(config: Any, splits: Any) -> None:
    """A trial list (``--trials``) that cannot be scored on ``splits`` fails before any training."""
    from marginkit.train.evaluate import check_trials

    try:
        check_trials(config, splits)
    except _config_errors() as exc:
        raise UserError(str(exc)) from exc


def cmd_eval(args: argparse.Namespace) -> int:
    from marginkit.train.evaluate import evaluate_run

    if args.trials:
        return _eval_trials(args)
    protocol = _protocol(args)
    out = _writable_file(args.json, overwrite=args.overwrite, flag="--json") if args.json else None
    run = _load_run(args.run_dir, args.checkpoint, args.device)
    splits = _other_splits(run, args.data)
    _check_protocol_data(protocol, splits)
    own = args.data is None or args.data == run["config"].data
    write = own and args.checkpoint == "best" and args.k is None
    try:
        with user_errors():
            metrics = evaluate_run(
                args.run_dir,
                splits=splits,
                device=args.device,
                which=args.checkpoint,
                k=args.k,
                write=write,
                protocol=protocol,
            )
    except _config_errors() as exc:
        raise UserError(str(exc)) from exc
    if write:  # metrics.json was rewritten: its headline figures follow
        from marginkit.cli.compare import write_run_summary

        write_run_summary(args.run_dir, metrics, run["config"].loss)
    print(f"run     {args.run_dir} ({metrics.get('checkpoint')}, epoch {metrics.get('epoch')})")
    print(
        f"data    {metrics.get('data')} ({metrics.get('num_train')} train / {metrics.get('num_test')} test)"
    )
    print(format_metrics(metrics))
    if out is not None:
        _write_output(out, lambda fh: fh.write((json.dumps(metrics, indent=2) + "\n").encode("utf-8")))
    return 0


def _writable_file(path: str, *, overwrite: bool, flag: str = "--out", suffix: str = "") -> Path:
    """The output file ``path`` (``suffix`` appended when missing), checked before any work:
    its directory exists, and it does not exist unless ``overwrite``."""
    p = Path(path)
    if suffix and p.suffix != suffix:
        p = p.with_name(p.name + suffix)
    if not p.parent.exists():
        raise UserError(f"cannot write {str(p)!r}: directory {str(p.parent)!r} does not exist")
    if p.is_dir():
        raise UserError(f"cannot write {str(p)!r}: it is a directory")
    if p.exists() and not overwrite:
        raise UserError(f"{str(p)!r} already exists; use --overwrite to replace it, or another {flag}")
    return p


def _write_output(path: Path, write: Any) -> None:
    """Write an output file atomically (``write(binary file)``); errors become one-line user errors."""
    from marginkit.train.rundir import atomic_write

    with user_errors():
        atomic_write(path, write)


def cmd_embed(args: argparse.Namespace) -> int:
    import numpy as np

    from marginkit.train.evaluate import embed_split

    out = _writable_file(args.out, overwrite=args.overwrite, suffix=".npz")
    run = _load_run(args.run_dir, args.checkpoint, args.device)
    splits = _other_splits(run, args.data)
    names = ("train", "val", "test") if args.split == "all" else (args.split,)
    arrays: dict[str, Any] = {}
    for name in names:
        split = getattr(splits, name)
        # batch by batch from the split's loader (a streamed source's files read by workers)
        emb, labels = embed_split(run["model"], split, run["config"], args.device)
        arrays[f"{name}_embeddings"] = emb.numpy()
        arrays[f"{name}_labels"] = labels.numpy()
        if split.streamed and len(labels) == len(split):  # the files, relative to the data's root
            arrays[f"{name}_paths"] = np.array([split.data.relative_path(i) for i in range(len(split))])
    arrays["fingerprint"] = np.array(run["fingerprint"])
    _write_output(out, lambda fh: np.savez_compressed(fh, **arrays))
    sizes = ", ".join(f"{n} {arrays[f'{n}_embeddings'].shape}" for n in names)
    print(f"wrote {out}: {sizes}")
    return 0


def _read_inputs(path: str) -> tuple[Any, Any]:
    import numpy as np

    p = Path(path)
    if not p.is_file():
        raise UserError(f"input file not found: {path}")
    import zipfile

    if not zipfile.is_zipfile(p):
        raise UserError(f"{path}: not an .npz archive (expected numpy.savez output with an array 'x')")
    with user_errors(f"{path}: "), np.load(p, allow_pickle=False) as z:
        files = list(z.files)
        if "x" not in files:
            raise UserError(
                f"{path}: expected an array named 'x' (inputs), found {', '.join(files) or 'none'}"
            )
        x = z["x"]
        y = z["y"] if "y" in files else None
    return x, y


def cmd_predict(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from marginkit.data.datasets import DatasetSplits, Split
    from marginkit.knn import KNNClassifier
    from marginkit.train.evaluate import embed

    out = _writable_file(args.out, overwrite=args.overwrite) if args.out else None
    run = _load_run(args.run_dir, "best", args.device)
    index = Path(args.run_dir) / "knn_index.npz"
    if not index.is_file():
        raise UserError(
            f"{str(args.run_dir)!r} has no K-NN index (knn_index.npz); run `marginkit eval` on it first"
        )
    facts = run["facts"]
    x_raw, y = _read_inputs(args.input)
    if len(x_raw) == 0:
        raise UserError(f"{args.input}: 'x' holds no samples (shape {list(x_raw.shape)}); nothing to predict")
    empty = Split(torch.empty(0), torch.empty(0, dtype=torch.long))
    space = DatasetSplits(
        train=empty, val=empty, test=empty, num_classes=facts["num_classes"],
        input_shape=tuple(facts["input_shape"]), name=facts.get("name", ""), kind=facts.get("kind", "vector"),
        mean=facts.get("mean"), std=facts.get("std"),
    )  # fmt: skip
    with user_errors(f"{args.input}: "):
        x = space.preprocess(x_raw)
    with user_errors():
        knn = KNNClassifier.load(index, expected_fingerprint=run["fingerprint"])
    emb = embed(run["model"], x, batch_size=run["config"].eval_batch_size, device=args.device)
    pred = knn.predict(emb)
    pred = pred.cpu().numpy() if isinstance(pred, torch.Tensor) else pred
    names = facts.get("class_names") or []

    def label_of(c: Any) -> str:
        return names[c] if isinstance(c, int) and 0 <= c < len(names) else str(c)

    # the labels are identifiers (any integers or strings): counted by value, never by np.bincount
    values, counts = np.unique(pred, return_counts=True)
    print(f"{len(pred)} predictions (K-NN over {args.run_dir}/knn_index.npz)")
    top = np.argsort(-counts, kind="stable")[:10]
    print("most predicted: " + ", ".join(f"{label_of(values[i].item())} ({counts[i]})" for i in top))
    if y is not None:
        from marginkit.data.loaders import labels_array

        with user_errors(f"{args.input}: "):
            y = labels_array(y, f"{args.input} y")
        if len(y) != len(pred):
            raise UserError(f"{args.input}: {len(pred)} inputs but {len(y)} labels in 'y'")
        print(f"accuracy against 'y': {float((pred == y).mean()):.4f}")
    if out is not None:
        if out.suffix == ".npz":
            _write_output(out, lambda fh: np.savez_compressed(fh, prediction=pred, embeddings=emb.numpy()))
        else:
            text = io.StringIO(newline="")
            w = csv.writer(text)
            w.writerow(["index", "prediction", "class_name"])
            for i, c in enumerate(pred.tolist()):
                w.writerow([i, c, label_of(c)])
            _write_output(out, lambda fh: fh.write(text.getvalue().encode("utf-8")))
        print(f"wrote {out}")
    else:
        head = ", ".join(label_of(c) for c in pred[:20].tolist())
        print(f"first predictions: {head}{' ...' if len(pred) > 20 else ''}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from marginkit.report import write_run_report

    run_dir = Path(args.run_dir)
    if not (run_dir / "metrics.json").is_file():
        raise UserError(f"{str(run_dir)!r} has no metrics.json; train or `marginkit eval` it first")
    with user_errors():
        path = write_run_report(run_dir)
    print(f"report  {path}")
    return 0


# ---------------------------------------------------------------------- listings
#: What ``marginkit losses`` says after the list: why a loss has two sets of defaults.
LOSSES_FOOTER = """\
Two sets of defaults. `marginkit train`, `compare` and `demo` (and build_loss(NAME) in Python)
use the command line's, chosen for the small data sets they are meant for: tens of classes.
The classes of marginkit.losses keep their papers' settings, most of them for face recognition
with 10^4-10^6 identities (the scale a softmax needs grows like ln(classes)). Both sets, why,
and what the study measured with each: docs/defaults.md."""


def cmd_losses(args: argparse.Namespace) -> int:
    from marginkit.train.registry import LOSSES, class_defaults, format_options

    width = max(len(n) for n in LOSSES)
    pad = " " * (width + 9)
    for name, spec in LOSSES.items():
        print(f"{name:<{width}}  {spec.kind:<5}  {spec.description}")
        mine, theirs = dict(spec.defaults), class_defaults(name)
        cls = f"{spec.loss_class().__name__}():"
        if mine == theirs:
            print(f"{pad}command line and {cls} {format_options(mine)}")
        else:
            label = max(len(cls), len("command line:"))
            print(f"{pad}{'command line:':<{label}} {format_options(mine)}")
            print(f"{pad}{cls:<{label}} {format_options(theirs)}")
    print()
    print(LOSSES_FOOTER)
    return 0


def cmd_datasets(args: argparse.Namespace) -> int:
    from marginkit.data.datasets import DATASET_INFO, DATASETS, FILE_FORMAT_INFO, FILE_FORMATS

    specs = [*DATASETS, *(f"{f}:PATH" for f in FILE_FORMATS)]
    width = max(map(len, specs))
    print("built-in (--data NAME):")
    for name in DATASETS:
        print(f"  {name:<{width}}  {DATASET_INFO[name].line()}")
    print("your files (--data FORMAT:PATH):")
    for name in FILE_FORMATS:
        print(f"  {name + ':PATH':<{width}}  {FILE_FORMAT_INFO[name]}")
    print("Splits, options and checks of each: docs/data.md")
    return 0


def cmd_study(args: argparse.Namespace) -> int:
    from marginkit.study import run_study

    if args.jobs < 1:
        raise UserError(f"--jobs must be >= 1, got {args.jobs}")
    res = run_study(args.out, quick=args.quick, jobs=args.jobs)
    for claim in res["claims"]:
        print(f"- {claim['claim']}: {claim['verdict']}")
    print(f"results: {res['results_md']}")
    print(f"study wall time: {res['wall_seconds']:.1f} s")
    return 0


# ---------------------------------------------------------------------- compare / demo
def cmd_compare(args: argparse.Namespace) -> int:
    from marginkit.cli.compare import run_compare

    losses = [s.strip() for s in args.losses.split(",") if s.strip()]
    if not losses:
        raise UserError("--losses needs at least one loss name")
    if args.protocol is None:  # --norm / --top-k without a protocol: the trial list's (eval's reading)
        args.opt_trials_norm, args.opt_trials_top_k = args.norm, args.top_k
        args.norm = args.top_k = None
    protocol = _protocol(args)
    from marginkit.train.config import load_config

    try:
        from_file = load_config(args.config) if args.config else {}
    except _config_errors() as exc:
        raise UserError(str(exc)) from exc
    _require(args, {k.replace("-", "_"): v for k, v in from_file.items()}, "data")
    from marginkit.cli.compare import base_config

    file_pairs, cli_pairs = list(from_file.items()), _cli_overrides(args)
    file_pairs = [*init_from_pairs([*file_pairs, *cli_pairs]), *file_pairs]
    base = base_config(losses, [*file_pairs, *cli_pairs])
    if protocol is not None:  # before any training
        _check_protocol_data(protocol, _load_splits(base, cache=True))
    if base.trials:
        _check_trials(base, _load_splits(base, cache=True))
    summary_text, report = run_compare(
        base, losses, seeds=args.seeds, out=args.out, quiet=args.quiet, overwrite=args.overwrite,
        file_pairs=file_pairs, cli_pairs=cli_pairs, jobs=args.jobs, protocol=protocol,
        baselines=not args.no_baselines,
    )  # fmt: skip
    print(summary_text)
    print(f"report  {report}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from marginkit.cli.compare import run_demo

    losses = [s.strip() for s in args.losses.split(",")] if args.losses else None
    summary_text, report, seconds = run_demo(
        args.out, seeds=args.seeds, epochs=args.epochs, losses=losses, quiet=args.quiet, device=args.device,
        jobs=args.jobs, overwrite=args.overwrite,
    )  # fmt: skip
    if args.markdown:
        from marginkit.cli.demo_markdown import demo_markdown

        print(demo_markdown(args.out, wall_seconds=seconds), end="")
        print(f"report  {report}", file=sys.stderr)
        return 0
    print(summary_text)
    print(f"\n{seconds:.0f} s · summary {Path(args.out) / 'summary.json'}")
    print(f"report  {report}")
    return 0
