"""``marginkit pack``: write any data source as WebDataset tar shards (``wds:``), once.

A folder of images, a ``csv:`` manifest, an insightface ``rec:`` pack, an ``.npz`` or a built-in
data set is read as its reader gives it (its own train / val / test splits, no re-splitting) and
written by :func:`marginkit.data.shards.write_shards`; training then reads ``wds:DIR``
sequentially, in worker processes, from a local disk or a URL (see docs/data.md).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from marginkit.cli.errors import UserError, user_errors

__all__ = ["add_parsers", "cmd_pack"]


def add_parsers(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register ``pack`` on the ``marginkit`` subparsers ``sub``."""
    p = sub.add_parser(
        "pack", help="write a data source as WebDataset tar shards (read back as wds:DIR)", allow_abbrev=False
    )
    common(p)
    p.add_argument(
        "source", metavar="DATA", help="a data source, e.g. folder:DIR, csv:FILE, rec:DIR, npz:FILE"
    )
    p.add_argument("--out", required=True, metavar="DIR", help="the shard folder (created)")
    p.add_argument(
        "--option",
        dest="options",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the source's reader, e.g. --option image_size=112 (repeatable)",
    )
    p.add_argument("--samples-per-shard", type=int, default=5000, metavar="N", help="samples per tar shard")
    p.add_argument(
        "--max-shard-mb", type=float, default=256.0, metavar="MB", help="a shard closes at this size too"
    )
    p.add_argument("--overwrite", action="store_true", help="replace a finished shard set in DIR")
    p.set_defaults(handler=cmd_pack)


def _reader_options(spec: str, texts: list[str]) -> dict[str, Any]:
    import yaml

    from marginkit.data.datasets import PIPELINE_OPTIONS, SPLIT_OPTIONS, dataset_options

    allowed = [o for o in dataset_options(spec) if o not in (*SPLIT_OPTIONS, *PIPELINE_OPTIONS)]
    options: dict[str, Any] = {}
    for text in texts:
        key, sep, value = text.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UserError(f"--option expects KEY=VALUE, got {text!r}")
        if key not in allowed:
            valid = ", ".join(allowed) or "none"
            reader = spec.split(":", 1)[0]
            raise UserError(f"--option {key}: not an option of the {reader} reader; valid: {valid}")
        try:  # a YAML scalar (112, true, [112, 112]); otherwise the plain string
            options[key] = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError:
            options[key] = value.strip()
    return options


def cmd_pack(args: argparse.Namespace) -> int:
    from marginkit.data.datasets import read_source
    from marginkit.data.shards import write_shards

    if args.samples_per_shard < 1:
        raise UserError(f"--samples-per-shard must be >= 1, got {args.samples_per_shard}")
    if not args.max_shard_mb > 0:
        raise UserError(f"--max-shard-mb must be > 0, got {args.max_shard_mb}")
    with user_errors(f"{args.source}: "):
        options = _reader_options(args.source, args.options)
        raw = read_source(args.source, **options)
    from pathlib import Path

    from marginkit.data.shards import META_NAME

    if (Path(args.out) / META_NAME).exists() and not args.overwrite:
        raise UserError(f"{args.out}: a shard set is already here (pass --overwrite to replace it)")
    with user_errors(f"{args.out}: "):
        meta = write_shards(
            raw, args.out, samples_per_shard=args.samples_per_shard,
            max_shard_bytes=int(args.max_shard_mb * 2**20), overwrite=args.overwrite,
        )  # fmt: skip
    print(f"wrote {meta.parent} (read it back as --data wds:{meta.parent})")
    return 0
