"""Opt-in training augmentation on the batch tensor: seeded per batch, never at evaluation.

Options (the ``augment`` config block; ``--augment flip,crop`` takes each named one at its
default):

==============  ==========  =====================================================================
name            default     what
==============  ==========  =====================================================================
``flip``        0.5         images: horizontal flip with this probability
``crop``        0.1         images: pad by this fraction of each side, crop back at a random offset
                            (a random shift); sequences: the same along time
``rotate``      10          images: rotation by an angle drawn uniformly in ``±rotate`` degrees
``brightness``  0.2         images: brightness factor drawn in ``[1 - b, 1 + b]``
``contrast``    0.2         images: contrast factor drawn in ``[1 - c, 1 + c]``
``time_mask``   0.1         sequences: zero one block of up to this fraction of the frames
                            (SpecAugment's time masking, Park et al. 2019)
``speed``       2/3         audio: speed perturbation 0.9 / 1.1 with this probability
``noise``       0.3         audio: additive noise from ``data_options.noise_dir``
``reverb``      0.3         audio: reverberation by an RIR of ``data_options.rir_dir``
``spec_mask``   0.6         audio: SpecAugment frequency and time masks on the fbank
==============  ==========  =====================================================================

Audio is augmented where its crops are read, not here: :mod:`marginkit.audio.augment`.

Images (``[N, C, H, W]`` in [0, 1]) go through Kornia's augmentation modules
(``kornia.augmentation``), which draw *per-sample* parameters for a whole batch tensor on its
device; torchvision's ``transforms.v2`` draws one set of parameters per call, so a batch would
get the same flip and crop for every sample unless transformed row by row. Kornia draws from
torch's global generator: each batch forks it (:func:`torch.random.fork_rng`) and seeds it from
``(seed, epoch, step)``, so the augmented batch depends on nothing else — the same after
``--resume``, and the training's own random stream is untouched. Sequences (``[N, L]`` or
``[N, C, L]``, the last axis time) are shifted and masked here with a seeded
:class:`torch.Generator` (no library covers them on batches).
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from marginkit._lazy import require

__all__ = ["AUGMENTATIONS", "BatchAugment", "augment_options"]

#: name -> (default, kinds it applies to, lowest, highest)
AUGMENTATIONS: dict[str, tuple[float, tuple[str, ...], float, float]] = {
    "flip": (0.5, ("image",), 0.0, 1.0),
    "crop": (0.1, ("image", "sequence"), 0.0, 0.5),
    "rotate": (10.0, ("image",), 0.0, 180.0),
    "brightness": (0.2, ("image",), 0.0, 1.0),
    "contrast": (0.2, ("image",), 0.0, 1.0),
    "time_mask": (0.1, ("sequence",), 0.0, 0.5),
    # audio (marginkit.audio.augment: applied to the training crops where they are read)
    "speed": (2 / 3, ("audio",), 0.0, 1.0),
    "noise": (0.3, ("audio",), 0.0, 1.0),
    "reverb": (0.3, ("audio",), 0.0, 1.0),
    "spec_mask": (0.6, ("audio",), 0.0, 1.0),
}


def augment_options(value: Any) -> dict[str, float]:
    """The ``augment`` option as ``{name: parameter}``: from ``"flip,crop"``, a list of names, or a
    mapping of names to parameters (``None`` / ``true`` for the default; ``0`` / ``false`` drops it)."""
    if value is None or value is False:
        return {}
    if isinstance(value, str):
        value = [
            v.strip() for v in value.split(",") if v.strip() and v.strip().lower() not in ("none", "off")
        ]
    if isinstance(value, (list, tuple)):
        if not all(isinstance(v, str) for v in value):
            raise ValueError(f"augment must list augmentation names, got {value!r}")
        value = dict.fromkeys(value)
    if not isinstance(value, Mapping):
        raise ValueError(
            "augment must be names ('flip,crop') or a mapping of name to parameter, "
            f"got {type(value).__name__}"
        )
    out: dict[str, float] = {}
    for name, param in value.items():
        if name not in AUGMENTATIONS:
            guess = difflib.get_close_matches(str(name), AUGMENTATIONS, n=1)
            hint = f" (did you mean {guess[0]!r}?)" if guess else ""
            raise ValueError(f"unknown augmentation {name!r}{hint}; valid: {', '.join(AUGMENTATIONS)}")
        default, _, lo, hi = AUGMENTATIONS[name]
        if param is None or param is True:
            param = default
        if param is False:
            continue
        if isinstance(param, bool) or not isinstance(param, numbers.Real) or not lo <= float(param) <= hi:
            raise ValueError(f"augment.{name} must be a number in [{lo:g}, {hi:g}], got {param!r}")
        if float(param) > 0:
            out[str(name)] = float(param)
    return out


def batch_seed(seed: int, epoch: int, step: int) -> int:
    """The seed of one batch's augmentation: a function of ``(seed, epoch, step)`` only."""
    return int(np.random.SeedSequence([int(seed), int(epoch), int(step), 0x617567]).generate_state(1)[0])


class BatchAugment:
    """Augment training batches of one data set: ``aug(x, seed=, epoch=, step=)``.

    Args:
        options: :func:`augment_options`' mapping (every name must apply to ``kind``).
        kind: ``"image"`` (``x`` is ``[N, C, H, W]``) or ``"sequence"`` (``[N, L]`` / ``[N, C, L]``).
    """

    def __init__(self, options: Mapping[str, float], kind: str) -> None:
        if kind not in ("image", "sequence"):
            raise ValueError(f"augmentation applies to images and sequences, not to {kind} inputs")
        self.options, self.kind = dict(augment_options(dict(options))), kind
        wrong = [n for n in self.options if kind not in AUGMENTATIONS[n][1]]
        if wrong:
            raise ValueError(
                f"augment: {', '.join(wrong)} do(es) not apply to {kind} inputs; for {kind}s: "
                + ", ".join(n for n, spec in AUGMENTATIONS.items() if kind in spec[1])
            )
        self._kornia = self._image_pipeline() if kind == "image" and self.options else None

    def _image_pipeline(self) -> Any:
        K = require("kornia.augmentation", extra="augment", purpose="augmenting images")
        o = self.options
        steps: list[Any] = []
        if "flip" in o:
            steps.append(K.RandomHorizontalFlip(p=o["flip"]))
        if "rotate" in o:
            steps.append(K.RandomRotation(degrees=o["rotate"], p=1.0))
        if "brightness" in o or "contrast" in o:
            steps.append(
                K.ColorJitter(brightness=o.get("brightness", 0.0), contrast=o.get("contrast", 0.0), p=1.0)
            )
        self._crop_module = K if "crop" in o else None
        return K.AugmentationSequential(*steps) if steps else None

    def __repr__(self) -> str:
        return f"BatchAugment({self.options}, kind={self.kind!r})"

    def __call__(self, x: torch.Tensor, *, seed: int, epoch: int, step: int) -> torch.Tensor:
        if not self.options:
            return x
        s = batch_seed(seed, epoch, step)
        if self.kind == "sequence":
            return self._sequence(x, torch.Generator().manual_seed(s))
        devices = [x.device] if x.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(s)
            out = x
            if "crop" in self.options:
                h, w = x.shape[-2:]
                pad = (
                    max(1, round(self.options["crop"] * w)),
                    max(1, round(self.options["crop"] * h)),
                )  # (l/r, t/b)
                crop = self._crop_module.RandomCrop((h, w), padding=pad, padding_mode="reflect", p=1.0)
                out = crop(out)
            if self._kornia is not None:
                out = self._kornia(out)
            return out.clamp_(0.0, 1.0).to(x.dtype).contiguous(memory_format=torch.contiguous_format)

    def _sequence(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """Per sample: a random shift along the last axis (edge frames repeated), then one
        zeroed block of frames."""
        n, length = x.shape[0], x.shape[-1]
        out = x
        if "crop" in self.options:
            pad = max(1, round(self.options["crop"] * length))
            offset = torch.randint(0, 2 * pad + 1, (n,), generator=gen).to(x.device)
            index = (torch.arange(length, device=x.device)[None] + offset[:, None] - pad).clamp_(
                0, length - 1
            )
            index = index.view(n, *([1] * (x.dim() - 2)), length).expand_as(x)
            out = torch.gather(out, -1, index)
        if "time_mask" in self.options:
            most = max(1, math.floor(self.options["time_mask"] * length))
            width = torch.randint(0, most + 1, (n,), generator=gen)
            start = (torch.rand(n, generator=gen) * (length - width + 1)).floor().long()
            t = torch.arange(length)[None]
            mask = ((t >= start[:, None]) & (t < (start + width)[:, None])).to(x.device)
            out = out.masked_fill(mask.view(n, *([1] * (x.dim() - 2)), length), 0.0)
        return out
