"""``export_model``: a trained run directory -> a deployment bundle (see :mod:`.bundle`)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from marginkit.export.bundle import (
    BUNDLE_FORMAT,
    BUNDLE_VERSION,
    MANIFEST,
    Bundle,
    BundleError,
    _input_space,
    _sha256,
    load_bundle,
)
from marginkit.export.calibration import CALIBRATION_FARS, calibration_table
from marginkit.export.model_file import (
    FORMATS,
    INPUT_NAME,
    MODEL_FILES,
    OUTPUT_NAME,
    require_runtime,
    write_model_file,
)

__all__ = ["ExportError", "export_model"]

INDEX_FILE, PREPROCESSING_FILE, EXAMPLES_FILE = "knn_index.npz", "preprocessing.npz", "examples.npz"


class ExportError(RuntimeError):
    """The exported model does not reproduce the PyTorch model's embeddings."""


def _raw_inputs(x: torch.Tensor, facts: dict[str, Any]) -> np.ndarray:
    """Model-space samples back in the raw space that ``Bundle.preprocess`` accepts."""
    if facts.get("mean") is not None and facts.get("std") is not None:
        x = x * torch.as_tensor(facts["std"]) + torch.as_tensor(facts["mean"])
    return x.numpy().astype(np.float32)


def export_model(
    run_dir: str | os.PathLike[str],
    format: str = "onnx",
    out: str | os.PathLike[str] | None = None,
    *,
    checkpoint: str = "best",
    fars: tuple[float, ...] = CALIBRATION_FARS,
    examples: int = 8,
    overwrite: bool = False,
    model: Any = None,
) -> Bundle:
    """Export the embedding model of a trained run as a bundle directory ``out``.

    The bundle holds the model (``format``: ``"onnx"`` or ``"torchscript"``, dynamic batch
    axis), the K-NN index over the training embeddings, the class names, the input
    preprocessing, the calibration table (thresholds at ``fars`` from the run's validation
    pairs, :func:`~marginkit.export.calibration.calibration_table`), ``examples`` test
    inputs with their PyTorch embeddings, and the model fingerprint. The bundle is written
    to a temporary directory next to ``out`` and renamed into place, then loaded back: the
    exported model must reproduce PyTorch's embeddings of the examples within 1e-4.

    Args:
        run_dir: a run directory written by ``marginkit train``.
        format: ``"onnx"`` (graph of standard operators; needs ``marginkit[export]``) or
            ``"torchscript"`` (code that PyTorch executes: trusted consumers only).
        out: the bundle directory (default ``RUN_DIR/bundle-FORMAT``).
        checkpoint: ``"best"`` or ``"last"``.
        fars: target false-accept rates of the calibration table.
        examples: test samples stored in ``examples.npz`` (0: none).
        overwrite: replace an existing ``out``.
        model: for a run that trained your own module (``train(..., model=module)``), a new
            instance of its class (the checkpoint's weights go into it); it must be exportable
            in ``format`` (ONNX: torch.onnx's dynamo exporter).

    Returns:
        The loaded :class:`~marginkit.export.Bundle` (TorchScript loaded as trusted: you made it).

    Raises:
        ValueError: bad arguments or an existing ``out``; ``RunDirError``/``CheckpointError``
            for a bad run directory; :class:`ExportError` when the runtime disagrees.
    """
    from marginkit import __version__
    from marginkit.knn import KNNClassifier
    from marginkit.train.evaluate import embed
    from marginkit.train.trainer import load_run, load_splits, resolve_model_name

    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    if isinstance(examples, bool) or not isinstance(examples, int) or examples < 0:
        raise ValueError(f"examples must be an integer >= 0, got {examples!r}")
    require_runtime(format)  # a missing package fails now, before the run is loaded
    run = load_run(run_dir, checkpoint, "cpu", model=model)
    out = Path(out) if out is not None else Path(run_dir) / f"bundle-{format}"
    if out.exists() and not overwrite:
        raise ValueError(f"{out} already exists; choose another --out or pass overwrite=True (--overwrite)")
    if not out.parent.is_dir():
        raise ValueError(f"cannot write the bundle {out}: directory {out.parent} does not exist")
    config, facts, model = run["config"], run["facts"], run["model"]
    splits = load_splits(config)
    if tuple(splits.input_shape) != tuple(facts["input_shape"]):
        raise ValueError(
            f"the run's data {config.data!r} now has input shape {tuple(splits.input_shape)}; "
            f"its model expects {tuple(facts['input_shape'])}"
        )
    shape = tuple(int(s) for s in facts["input_shape"])
    bs = config.eval_batch_size
    # a streamed split (audio: utterances of any length) is read batch by batch, not stacked
    train_emb = embed(model, _inputs(splits.train), batch_size=bs, device="cpu")
    val_emb = embed(model, _inputs(splits.val), batch_size=bs, device="cpu")
    knn = KNNClassifier(k=min(config.k, len(train_emb)), metric=config.knn_metric, weights=config.knn_weights)
    knn.fit(train_emb, splits.train.y, model_fingerprint=run["fingerprint"])
    calibration = calibration_table(
        val_emb, splits.val.y, fars, max_impostors=config.max_impostors, seed=config.seed
    )
    audio = _audio_input(model, facts).get("kind") == "audio"
    if audio:
        x_examples = _audio_examples(splits.test.data, examples, config.seed)
    else:
        x_examples = splits.test.x[:examples]

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        model_file = MODEL_FILES[format]
        write_model_file(model, shape, tmp / model_file, format)
        knn.save(tmp / INDEX_FILE)
        standardized = facts.get("mean") is not None and facts.get("std") is not None
        inp: dict[str, Any] = {
            "shape": list(shape), "dtype": "float32", "kind": facts.get("kind", "vector"),
            "standardized": standardized,
            "scaling": (
                "uint8 images are divided by 255; floating images must lie in [0, 1]"
                if facts.get("kind") == "image"
                else "(x - mean) / std with the training statistics" if standardized else "none"
            ),
        }  # fmt: skip
        inp.update(_audio_input(model, facts))
        if standardized:
            np.savez(
                tmp / PREPROCESSING_FILE,
                mean=torch.as_tensor(facts["mean"], dtype=torch.float32).numpy(),
                std=torch.as_tensor(facts["std"], dtype=torch.float32).numpy(),
            )
            inp["preprocessing_file"] = PREPROCESSING_FILE
            inp["preprocessing_sha256"] = _sha256(tmp / PREPROCESSING_FILE)
        example_spec = None
        if len(x_examples):
            # What any runtime must reproduce: PyTorch's embeddings of the raw examples after
            # the bundle's own preprocessing.
            if audio:  # waveforms are the model's input as they are
                raw, pre = x_examples.numpy(), x_examples
            else:
                raw = _raw_inputs(x_examples, facts)
                pre = _input_space(shape, inp["kind"], facts.get("mean"), facts.get("std")).preprocess(raw)
            np.savez(
                tmp / EXAMPLES_FILE, x=raw, embeddings=embed(model, pre, batch_size=bs, device="cpu").numpy()
            )
            example_spec = {"file": EXAMPLES_FILE, "sha256": _sha256(tmp / EXAMPLES_FILE), "count": len(raw)}
        ckpt = run["checkpoint"]
        manifest: dict[str, Any] = {
            "format": BUNDLE_FORMAT,
            "version": BUNDLE_VERSION,
            "model": {
                "format": format, "file": model_file, "sha256": _sha256(tmp / model_file),
                "input_name": INPUT_NAME, "output_name": OUTPUT_NAME, "batch_axis": 0,
            },
            "input": inp,
            "embedding": {
                "dim": int(config.embedding_dim), "normalized": bool(config.normalize), "metric": "cosine",
            },
            "model_fingerprint": run["fingerprint"],
            "classes": {
                "num_classes": int(facts["num_classes"]), "names": list(facts.get("class_names") or []),
                "open_set": bool(facts.get("open_set", False)),
            },
            "knn_index": {"file": INDEX_FILE, "sha256": _sha256(tmp / INDEX_FILE), "k": knn.k,
                          "metric": knn.metric, "num_references": knn.num_references},
            "calibration": calibration,
            "examples": example_spec,
            "run": {
                "run_dir": str(Path(run_dir).resolve()), "checkpoint": Path(run["path"]).name,
                "epoch": int(ckpt["epoch"]), "loss": config.loss, "data": str(config.data),
                "model": resolve_model_name(config, shape, facts.get("name", "")),
                "marginkit": __version__, "torch": str(torch.__version__),
            },
        }  # fmt: skip
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        try:
            load_bundle(tmp, trust_torchscript=True, check=True)
        except BundleError as exc:
            raise ExportError(f"the exported {format} model fails its check: {exc}") from None
        os.chmod(tmp, 0o755 & ~_umask())
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
        raise
    return load_bundle(out, trust_torchscript=True, check=False)


def _audio_input(model: torch.nn.Module, facts: dict[str, Any]) -> dict[str, Any]:
    """The manifest's audio fields for a speaker model whose input is the waveform (the fbank in
    the graph): ``kind: "audio"``, ``sample_rate``, ``min_samples`` (its time axis is dynamic)."""
    config = getattr(model, "speaker_config", None)
    if facts.get("kind") != "audio" or not isinstance(config, dict) or config.get("frontend") != "fbank":
        return {} if facts.get("kind") != "audio" else {"kind": "vector"}
    rate = int(config["sample_rate"])
    return {
        "kind": "audio", "sample_rate": rate, "min_samples": int(model.min_input_length),
        "scaling": f"mono float32 waveform in [-1, 1] at {rate} Hz, any length >= min_samples",
    }  # fmt: skip


def _inputs(split: Any) -> Any:
    return split.data if split.streamed else split.x


def _audio_examples(x: Any, count: int, seed: int) -> torch.Tensor:
    """The first ``count`` test utterances as equal-length waveforms ``[count, crop]``: each a
    crop drawn as in training (seeded by ``seed`` and the row), so the examples stack."""
    rows = [x.read(i, np.random.default_rng([seed, 2**31 - 2, i])) for i in range(min(count, len(x)))]
    if not rows:
        return torch.empty(0)
    return torch.from_numpy(np.stack(rows).astype(np.float32))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
