"""Starting weights of a fresh run: ``weights`` (a file or a run), ``pretrained``, ``init_from``.

- ``weights: PATH`` starts the **trunk** (every tensor of the model but its projection) from a
  state dict ``.pt`` (read with ``torch.load(weights_only=True)``: no code is unpickled), a
  ``.safetensors`` file, or a marginkit run directory (its ``best.pt``). For a timm or
  torchvision model the file may hold the library model's own state dict (keys without the
  ``net.`` prefix, as the libraries save them); the removed classifier's tensors are ignored.
- ``pretrained: true`` (timm / torchvision) takes the library's own pretrained weights through
  its download and cache: timm's from the Hugging Face Hub (``$HF_HOME/hub``; with
  ``HF_HUB_OFFLINE=1`` the cache alone), torchvision's through ``torch.hub``
  (``$TORCH_HOME/hub/checkpoints/FILE``), read with ``weights_only=True`` (no pickled code) and
  checked against the hash in the file's name when downloaded. Without network access and
  without the file the error names it and where to put it. (An ``onnx:`` backbone starts from
  its file's own weights.)
- ``init_from: RUN`` starts the trunk **and the projection** from a trained run (its
  ``best.pt``): the run continues on new data and classes with a new head.

Every tensor the trunk needs must be in the file with the same shape, and a file holding
tensors the model does not have is refused (it is another architecture), except those of a
removed classifier or of the projection. Files are hostile: a file larger than a bound derived
from the model's own size is refused before it is read.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from marginkit._lazy import require
from marginkit.train.errors import CheckpointError, ConfigError

__all__ = ["apply_starting_weights", "init_base", "read_state_dict"]

#: A weight file may be this many times the model's own state (a library checkpoint holds a
#: classifier and sometimes an EMA copy), plus the slack below.
_SIZE_FACTOR, _SIZE_SLACK = 4, 64 * 2**20


def _model_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _checkpoint_of(run_dir: Path) -> Path:
    for name in ("best.pt", "last.pt"):
        if (run_dir / name).is_file():
            return run_dir / name
    raise ConfigError(f"{str(run_dir)!r} is a directory but holds no marginkit run (no best.pt or last.pt)")


def _unwrap(obj: Any, where: str) -> dict[str, torch.Tensor]:
    """The state dict inside a loaded file: a marginkit checkpoint's ``model``, a ``state_dict``
    or ``model`` entry, or the mapping itself; tensors only, ``module.`` (DDP) prefixes dropped."""
    from marginkit.train.rundir import FORMAT

    if isinstance(obj, Mapping) and obj.get("format") == FORMAT:
        obj = obj.get("model")
    elif isinstance(obj, Mapping) and not any(isinstance(v, torch.Tensor) for v in obj.values()):
        for key in ("state_dict", "model", "model_state_dict"):
            if isinstance(obj.get(key), Mapping):
                obj = obj[key]
                break
    if not isinstance(obj, Mapping) or not obj:
        raise ConfigError(f"{where} holds no state dict (a mapping of tensor names to tensors)")
    bad = [k for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise ConfigError(f"{where}: entry {str(bad[0])[:60]!r} is not a named tensor; expected a state dict")
    state = dict(obj)
    if all(k.startswith("module.") for k in state):
        state = {k[len("module.") :]: v for k, v in state.items()}
    return state


def read_state_dict(path: str | os.PathLike[str], *, max_bytes: int) -> tuple[dict[str, torch.Tensor], str]:
    """The tensors of a weight file or run directory, and what it was (``"run"``, ``"safetensors"``
    or ``"state dict"``). Refuses files over ``max_bytes`` before reading them, except a run's
    checkpoint (it also holds the head and optimiser state, whatever their size): that one is
    memory-mapped, so only the tensors copied into the model are read."""
    p = Path(path).expanduser()
    kind = "state dict"
    if p.is_dir():
        p, kind = _checkpoint_of(p), "run"
    if not p.is_file():
        raise ConfigError(f"weights file {str(path)!r} does not exist")
    size = p.stat().st_size
    if size > max_bytes and kind != "run":
        raise ConfigError(
            f"weights file {str(p)!r} is {size / 2**20:.0f} MiB, more than the {max_bytes / 2**20:.0f} MiB "
            "a state dict of this model can be; is it the right file?"
        )
    where = f"weights file {str(p)!r}"
    if p.suffix == ".safetensors":
        require("safetensors.torch", extra="weights", purpose=f"{where}: reading .safetensors")
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(p), device="cpu"), "safetensors"
        except (SafetensorError, OSError, ValueError) as exc:
            raise ConfigError(f"{where} is not a valid .safetensors file ({exc})") from None
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True, mmap=kind == "run")
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        raise ConfigError(
            f"{where} is not a state dict torch can load safely (weights_only=True: tensors and plain "
            f"containers, no pickled code): {type(exc).__name__}: {first}"
        ) from None
    return _unwrap(obj, where), kind


def _load(
    model: nn.Module,
    state: dict[str, torch.Tensor],
    where: str,
    *,
    with_projection: bool,
) -> int:
    """Copy ``state`` into the model's trunk (and projection); returns the tensors loaded."""
    own = model.state_dict()
    library_keys = hasattr(model, "net") and not any(k.startswith("net.") for k in state)
    if library_keys:  # timm / torchvision's own names: the trunk is model.net
        state = {f"net.{k}": v for k, v in state.items()}
    ignored = tuple(f"net.{c}." for c in getattr(model, "classifier_keys", ()))
    wanted = {k for k in own if with_projection or not k.startswith("projection.")}
    unexpected = [
        k
        for k in state
        if k not in own
        and not k.startswith(ignored)
        and not (k.startswith("projection.") and not with_projection)
    ]
    missing = sorted(wanted - set(state))
    if unexpected:
        shown = ", ".join(unexpected[:3])
        raise ConfigError(
            f"{where} holds {len(unexpected)} tensor(s) model {getattr(model, 'name', '?')!r} does not have "
            f"(e.g. {shown}): weights of another architecture or options"
        )
    if missing:
        shown = ", ".join(k.removeprefix("net.") for k in missing[:3])
        raise ConfigError(
            f"{where} lacks {len(missing)} tensor(s) of model {getattr(model, 'name', '?')!r} (e.g. {shown})"
        )
    for key in sorted(wanted):
        if tuple(state[key].shape) != tuple(own[key].shape):
            raise ConfigError(
                f"{where}: tensor {key.removeprefix('net.')!r} has shape {tuple(state[key].shape)}, "
                f"the model's is {tuple(own[key].shape)}"
            )
    with torch.no_grad():
        for key in wanted:
            own[key].copy_(state[key].to(own[key].dtype))
    return len(wanted)


def _pretrained_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The library's pretrained weights for ``model`` (timm / torchvision), through its cache."""
    library, arch = model.library, model.arch
    try:
        if library == "timm":
            import timm

            return timm.create_model(arch, pretrained=True, num_classes=0).state_dict()
        import torchvision

        weights = torchvision.models.get_model_weights(arch).DEFAULT
        # torch.hub unpickles by default: a file in the cache is read as tensors only
        return weights.get_state_dict(progress=False, check_hash=True, weights_only=True)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ConfigError(
            f"pretrained weights of {model.name} could not be obtained ({type(exc).__name__}: {first}). "
            + _where_to_put(library, arch)
        ) from None


def _where_to_put(library: str, arch: str) -> str:
    """Where the library looks for a downloaded file, for a machine without network access."""
    if library == "torchvision":
        import torchvision

        url = torchvision.models.get_model_weights(arch).DEFAULT.url
        cache = Path(torch.hub.get_dir()) / "checkpoints" / url.rsplit("/", 1)[-1]
        return (
            f"Without network access, download {url} elsewhere and put it at {cache} "
            "(torch.hub's cache; $TORCH_HOME moves it), or pass it as weights: PATH"
        )
    import timm

    cfg = timm.models.get_pretrained_cfg(arch) if hasattr(timm.models, "get_pretrained_cfg") else None
    hub_id = getattr(cfg, "hf_hub_id", None) or f"timm/{arch}"
    return (
        f"Without network access, fetch model.safetensors of the Hugging Face repository {hub_id!r} "
        "elsewhere and pass it as weights: PATH (or fill the Hugging Face cache, $HF_HOME/hub, and set "
        "HF_HUB_OFFLINE=1)"
    )


def apply_starting_weights(config: Any, model: nn.Module, log: Any = None) -> str | None:
    """Load the run's starting weights into ``model`` (fresh runs only); returns a log line or None."""
    max_bytes = _SIZE_FACTOR * _model_bytes(model) + _SIZE_SLACK
    if config.init_from is not None:
        state, _ = read_state_dict(config.init_from, max_bytes=max_bytes)
        n = _load(model, state, f"init_from run {config.init_from!r}", with_projection=True)
        return f"trunk and projection ({n} tensors) from run {config.init_from}; a new head"
    if config.weights is not None:
        state, kind = read_state_dict(config.weights, max_bytes=max_bytes)
        n = _load(model, state, f"weights {config.weights!r}", with_projection=False)
        return f"trunk ({n} tensors) from {kind} {config.weights}; projection and head new"
    if config.pretrained:
        n = _load(model, _pretrained_state(model), f"{model.name} pretrained weights", with_projection=False)
        return f"trunk ({n} tensors) from {model.name}'s pretrained weights"
    return None


#: The keys that ``init_from`` takes from the run it starts from (its architecture).
ARCHITECTURE_KEYS = ("model", "embedding_dim", "normalize", "model_options")


def init_base(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The architecture keys of the run at ``run_dir`` (:data:`ARCHITECTURE_KEYS`), for a config
    that starts from it: ``--init-from RUN`` builds the same backbone unless told otherwise."""
    from marginkit.train.rundir import load_checkpoint, stored_config

    p = Path(run_dir).expanduser()
    if not p.is_dir():
        raise ConfigError(f"init_from: run directory {str(run_dir)!r} does not exist")
    path = _checkpoint_of(p)
    try:
        stored = stored_config(load_checkpoint(path), path)
    except CheckpointError as exc:
        raise ConfigError(f"init_from: {exc}") from None
    raw = stored.to_dict()
    facts = load_checkpoint(path).get("data") or {}
    if raw["model"] == "auto" and isinstance(facts.get("input_shape"), list):  # as the run resolved it
        from marginkit.train.components import resolve_model_name

        raw["model"] = resolve_model_name(stored, tuple(facts["input_shape"]), str(facts.get("name", "")))
    return {key: raw[key] for key in ARCHITECTURE_KEYS}
