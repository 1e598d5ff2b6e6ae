"""The deployment subcommands: ``marginkit export`` and ``marginkit serve`` (see docs/deploy.md)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from marginkit.cli.errors import UserError, user_errors

__all__ = ["add_parsers", "cmd_export", "cmd_serve"]


def add_parsers(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register ``export`` and ``serve`` on the ``marginkit`` subparsers ``sub``."""
    p = sub.add_parser(
        "export", help="export a run's model as a deployment bundle (ONNX)", allow_abbrev=False
    )
    common(p)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by `marginkit train`")
    p.add_argument(
        "--format",
        choices=("onnx", "torchscript"),
        default="onnx",
        help="the model's file: onnx (a graph, run by onnxruntime) or torchscript (code: `serve` "
        "loads it only with --trust-torchscript)",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="bundle directory (created)")
    p.add_argument(
        "--checkpoint",
        choices=("best", "last"),
        default="best",
        help="which weights: best.pt (the epoch chosen on validation) or last.pt (the last epoch)",
    )
    p.add_argument("--examples", type=int, default=8, metavar="N", help="test samples kept for self-checks")
    p.add_argument("--overwrite", action="store_true", help="replace an existing bundle in DIR")
    p.set_defaults(handler=cmd_export)

    p = sub.add_parser("serve", help="serve a bundle and a gallery over HTTP", allow_abbrev=False)
    common(p)
    p.add_argument("bundle", metavar="BUNDLE", help="a bundle directory written by `marginkit export`")
    p.add_argument(
        "--gallery", required=True, metavar="PATH",
        help="the gallery (created when missing): a SQLite file, a milvus-lite file *.milvus.db, or a Milvus "
        "server milvus://HOST:PORT[/COLLECTION] (marginkit[milvus])",
    )  # fmt: skip
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on: 127.0.0.1 answers this machine only, 0.0.0.0 every network "
        "interface (then set --token-file)",
    )
    p.add_argument(
        "--gallery-dtype", choices=("float32", "float16", "int8"), default=None,
        help="template storage of a new SQLite gallery: float32 (4 D bytes each), float16 (2 D) or int8 "
        "(D + 4, one scale per template); default: an existing gallery's own, float32 for a new one",
    )  # fmt: skip
    p.add_argument(
        "--gallery-backend", choices=("exact", "faiss", "hnsw", "ivf"), default="exact",
        help="template search of identify and classify: exact (torch), faiss (FAISS flat, exact), hnsw or "
        "ivf (FAISS, approximate: millions of float32 templates; marginkit[faiss]); a Milvus gallery: exact, "
        "hnsw or ivf, fixed when its collection is made. verify is always exact",
    )  # fmt: skip
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on (1-65535)")
    p.add_argument("--far", type=float, default=1e-3, help="target false-accept rate of the decisions")
    p.add_argument("--threshold", type=float, help="explicit score threshold (instead of --far)")
    p.add_argument("--token-file", metavar="FILE", help="require 'Authorization: Bearer <token in FILE>'")
    p.add_argument("--max-body-mb", type=float, default=16.0, help="request body limit")
    p.add_argument("--max-batch", type=int, default=1024, help="samples per request")
    p.add_argument(
        "--max-audio-seconds", type=float, default=300.0,
        help="longest audio upload (speaker bundles), from its header before decoding",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=0, help="model runtime threads (0: its default)")
    p.add_argument(
        "--workers", type=int, default=1, metavar="N",
        help="worker processes (uvicorn's), each with its own model and gallery connection",
    )  # fmt: skip
    p.add_argument(
        "--access-log", action=argparse.BooleanOptionalAction, default=True,
        help="uvicorn's access log: one line per request (client, method, path, status) on stdout",
    )  # fmt: skip
    p.add_argument(
        "--trust-torchscript", action="store_true", help="allow a TorchScript bundle (it executes code)"
    )
    p.set_defaults(handler=cmd_serve)


def cmd_export(args: argparse.Namespace) -> int:
    from marginkit.export import ExportError, export_model
    from marginkit.train.checkpoint import CheckpointError
    from marginkit.train.trainer import RunDirError

    if args.examples < 0:
        raise UserError(f"--examples must be >= 0, got {args.examples}")
    try:
        with user_errors():
            bundle = export_model(
                args.run_dir, args.format, args.out, checkpoint=args.checkpoint, examples=args.examples,
                overwrite=args.overwrite,
            )  # fmt: skip
    except (RunDirError, CheckpointError, ExportError) as exc:
        raise UserError(str(exc)) from exc
    shape = list(bundle.input_shape)
    print(f"bundle  {bundle.path} ({bundle.format}, input {shape}, dim {bundle.embedding_dim})")
    for row in bundle.calibration["rows"]:
        t = row["threshold"]
        print(f"FAR {row['far']:.0e}  " + ("not measurable" if t is None else f"threshold {t:.4f}"))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from marginkit.export import BundleError
    from marginkit.gallery import GalleryError
    from marginkit.serve import Limits, build_app, read_token, serve

    if not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {args.port}")
    if args.max_body_mb <= 0 or args.max_batch < 1 or not args.max_audio_seconds > 0:
        raise UserError("--max-body-mb and --max-audio-seconds must be > 0 and --max-batch >= 1")
    if args.workers < 1:
        raise UserError(f"--workers must be >= 1, got {args.workers}")
    if args.workers > 1 and str(args.gallery).endswith(".milvus.db"):
        raise UserError(
            "a milvus-lite gallery file is open in one process at a time: use --workers 1, or a Milvus "
            "server (--gallery milvus://HOST:PORT/COLLECTION)"
        )
    try:
        with user_errors():
            token = read_token(args.token_file) if args.token_file else None
            limits = Limits(
                max_body_bytes=int(args.max_body_mb * 2**20), max_batch=args.max_batch,
                max_audio_seconds=args.max_audio_seconds,
            )  # fmt: skip
            build = {
                "bundle_path": str(args.bundle), "gallery_path": str(args.gallery), "far": args.far,
                "threshold": args.threshold, "trust_torchscript": args.trust_torchscript,
                "threads": args.threads, "gallery_dtype": args.gallery_dtype,
                "gallery_backend": args.gallery_backend,
            }  # fmt: skip
            # Built here even with several workers: a bad set-up fails now, with its reason.
            app = build_app(**build, token=token, limits=limits)
    except (BundleError, GalleryError, ImportError) as exc:
        raise UserError(str(exc)) from exc
    if not args.quiet:
        auth = "bearer token" if token else "no authentication"
        url = f"http://{args.host}:{args.port}"
        workers = f", {args.workers} workers" if args.workers > 1 else ""
        print(
            f"serving {args.bundle} and {args.gallery} on {url} ({auth}{workers}); docs at {url}/docs",
            flush=True,
        )
    if args.workers > 1:
        app.state.gallery.close()
        build.update(token_file=args.token_file, limits=dataclasses.asdict(limits))
    serve(
        app, args.host, args.port, access_log=args.access_log, quiet=args.quiet, workers=args.workers,
        build=build,
    )  # fmt: skip
    return 0
