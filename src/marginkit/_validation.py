"""Argument checks shared by every public function: one line per argument at the call site.

Bad input must fail loudly with the argument's name and what was expected, never as a
silent NaN. Each check returns the (converted) value, so a call site reads
``self.rate = real(rate, "rate", low=0, high=1, open_low=True)``:

- scalars: :func:`real` (a finite number in an interval; :func:`positive_float` is its
  ``> 0`` / ``>= 0`` case), :func:`positive_int`, :func:`choice`;
- tensors: :func:`float_tensor` (type, dims, optionally finite values), :func:`label_tensor`
  (integer ids: dtype, shape, range), :func:`same_batch`, :func:`cosine_tensor` /
  :func:`cosine_range` (cosines in ``[-1, 1]`` from a full pass or from extremes at hand);
- arrays of data (metrics, K-NN): :func:`data_tensor` turns numpy arrays (and anything
  ``numpy.asarray`` takes) into tensors, :func:`accepts_arrays` does it for a public function's
  array arguments and returns numpy for numpy, scikit-learn style (:func:`to_caller`).

Numerics run in float32 or better whatever the input dtype: :func:`compute_dtype` gives the
working precision.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch

Reduction = str  # "mean" | "sum" | "none"
REDUCTIONS = ("mean", "sum", "none")


# ------------------------------------------------------------------ checks that read the device
# A check of tensor values (labels in range, finite scores, ...) needs one host read to decide
# whether to raise: on an accelerator, a synchronisation per check and per step. The policy:
# a library call checks immediately (a clear ValueError at the call, as always); inside
# ``deferred_checks()`` (the trainer) each check records an on-device flag instead, and the
# first failure is raised, with the same message, at the next ``raise_if_failed()``.

ErrorText = Callable[..., str]
_NEVER = 2**62  # "never failed" in the first-failure sequence numbers


class DeferredChecks:
    """On-device flags of failed value checks, read at :meth:`raise_if_failed` (one host read).

    Made by :func:`deferred_checks`; checks record into it through :func:`check_flag`. A record
    keeps the call's flag (reduced to one element) and the values its error message needs, as
    they are: no op on the device, so a step's checks cost only their own reductions. At
    :meth:`raise_if_failed` the flags and values of every pending call are packed into one
    tensor and read at once; the first failed call (in call order, over every check) raises.
    A check with ``FOLD`` pending calls (a caller that reads rarely) folds them on the device,
    without a read, into the sequence number of its first failed call and that call's values,
    so memory stays bounded.
    """

    FOLD = 256

    def __init__(self) -> None:
        self._slots: dict[tuple[str, torch.device], _Slot] = {}
        self._calls = 0

    def record(self, key: str, bad: torch.Tensor, text: ErrorText, *values: torch.Tensor) -> None:
        """Record the check ``key`` of one call: ``bad`` (a bool tensor, any shape: failed if any is
        true) and the ``values`` (0-d tensors) that ``text(*floats)`` turns into the error message."""
        call = self._calls
        self._calls += 1
        if bad.requires_grad:
            bad = bad.detach()
        if bad.dim():
            bad = bad.any()
        elif bad._base is not None:
            bad = bad.clone()
        slot = self._slots.get((key, bad.device))
        if slot is None:
            slot = self._slots[(key, bad.device)] = _Slot(text)
        kept = []
        for v in values:
            if v.requires_grad:
                v = v.detach()
            if v.device != bad.device:
                v = v.to(bad.device)
            kept.append(v if v._base is None else v.clone())  # never keep a large tensor alive through a view
        slot.pending.append((call, bad, kept))
        if len(slot.pending) >= self.FOLD:
            slot.fold()

    def raise_if_failed(self) -> None:
        """Raise the first failed check's ``ValueError`` (its message as an immediate check gives it).

        One host read per device that has flags (usually one). The pending records are consumed;
        after a read that found a failure every flag is cleared, so a caller that handles the
        error may continue.
        """
        failed: list[tuple[int, str]] = []
        by_device: dict[torch.device, list[_Slot]] = {}
        for (_, device), slot in self._slots.items():
            by_device.setdefault(device, []).append(slot)
        for slots in by_device.values():
            parts = [part for slot in slots for part in slot.packed()]
            if not parts:
                continue
            packed = torch.cat(parts).tolist()  # the read
            pos = 0
            for slot in slots:
                found, pos = slot.first_failure(packed, pos)
                if found is not None:
                    failed.append(found)
        self._slots.clear()
        if failed:
            raise ValueError(min(failed)[1])


class _Slot:
    """One check's records: its calls pending since the last read, and the fold of older ones."""

    def __init__(self, text: ErrorText) -> None:
        self.text = text
        self.pending: list[tuple[int, torch.Tensor, list[torch.Tensor]]] = []
        # folded: the first failed call (_NEVER: none) and its values, on the device
        self.folded: tuple[torch.Tensor, torch.Tensor] | None = None

    def fold(self) -> None:
        """The pending calls into :attr:`folded`, on the device (no read)."""
        for call, bad, values in self.pending:
            vals = _as_float64(values, bad)
            if self.folded is None:
                self.folded = torch.where(bad, call, _NEVER), vals
                continue
            first, kept = self.folded
            fresh = bad & (first == _NEVER)
            self.folded = torch.where(fresh, call, first), torch.where(fresh, vals, kept)
        self.pending = []

    def packed(self) -> list[torch.Tensor]:
        """float64 parts to read: the fold (first call, values), then every pending flag and the
        pending calls' values (one stack each)."""
        parts = []
        if self.folded is not None:
            parts += [self.folded[0].reshape(1).to(torch.float64), self.folded[1]]
        if self.pending:
            parts.append(torch.stack([bad for _, bad, _ in self.pending]).to(torch.float64))
            values = [v for _, _, vals in self.pending for v in vals]
            if values and len({v.dtype for v in values}) == 1:
                parts.append(torch.stack(values).to(torch.float64))
            elif values:
                parts.append(_as_float64(values, values[0]))
        return parts

    def first_failure(self, packed: list[float], pos: int) -> tuple[tuple[int, str] | None, int]:
        """This slot's first failed call in the read-back ``packed`` from ``pos`` (as laid out by
        :meth:`packed`): ``((call, message) or None, the position after this slot)``."""
        found = None
        if self.folded is not None:
            n = self.folded[1].numel()
            first, values = int(packed[pos]), packed[pos + 1 : pos + 1 + n]
            pos += 1 + n
            if first != _NEVER:
                found = (first, self.text(*values))
        count = len(self.pending)
        n_values = len(self.pending[0][2]) if self.pending else 0
        flags, values = packed[pos : pos + count], packed[pos + count : pos + count + count * n_values]
        pos += count + count * n_values
        if found is None:
            for i, flag in enumerate(flags):
                if flag:
                    found = (self.pending[i][0], self.text(*values[i * n_values : (i + 1) * n_values]))
                    break
        return found, pos


def _as_float64(values: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    if not values:
        return like.new_zeros(0, dtype=torch.float64)
    return torch.stack([v.reshape(()).to(torch.float64) for v in values])


_ACTIVE: contextvars.ContextVar[DeferredChecks | None] = contextvars.ContextVar(
    "marginkit_deferred_checks", default=None
)


@contextlib.contextmanager
def deferred_checks() -> Iterator[DeferredChecks]:
    """Inside the context, value checks that need a host read record on-device flags instead.

    Yields a :class:`DeferredChecks`; call its ``raise_if_failed()`` at the points where the
    caller reads the device anyway (the trainer: every N steps and at an epoch's end). On a
    normal exit the context calls it once more, so no failure is lost. Outside the context
    (the default, a library call) every check raises immediately. Checks of types, shapes and
    Python arguments never read the device and always raise immediately.
    """
    checks = DeferredChecks()
    token = _ACTIVE.set(checks)
    try:
        yield checks
    finally:
        _ACTIVE.reset(token)
    checks.raise_if_failed()


def active_checks() -> DeferredChecks | None:
    """The :class:`DeferredChecks` of the innermost :func:`deferred_checks` context, or ``None``."""
    return _ACTIVE.get()


def check_flag(key: str, bad: torch.Tensor, text: ErrorText, *values: torch.Tensor) -> None:
    """Raise ``ValueError(text(*values))`` if any of ``bad`` holds: now (one host read), or deferred.

    ``bad``: a bool tensor (failed where true); ``values``: 0-d tensors read only to build the
    message (immediately only when the check fails). Inside :func:`deferred_checks` the check
    is recorded under ``key`` and raised, with the same message, at the next ``raise_if_failed``.
    """
    checks = _ACTIVE.get()
    if checks is not None:
        checks.record(key, bad, text, *values)
        return
    if bool(bad.any() if bad.dim() else bad):
        raise ValueError(text(*(float(v) for v in values)))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Working precision for an input dtype: float64 stays, everything else is float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _has_data(x: torch.Tensor, name: str) -> None:
    """Refuse a tensor on the ``meta`` device: it has a shape but no values to check or compute with."""
    if x.device.type == "meta":
        raise ValueError(
            f"{name} is on the meta device (a shape without data), so its values cannot be checked or "
            "used; create it on a real device (a module built on 'meta' needs .to_empty(device=...) "
            "and its weights loaded)"
        )


def float_tensor(
    x: Any,
    name: str,
    *,
    min_dim: int = 1,
    allow_inf: bool = False,
    allow_empty: bool = False,
    check_values: bool = True,
) -> torch.Tensor:
    """Check that ``x`` is a floating tensor with at least ``min_dim`` dims and finite values.

    Returns ``x`` unchanged (callers cast with :func:`compute_dtype` themselves so that
    they can return results in the input dtype). ``allow_inf`` admits ``-inf`` only (masked
    entries), never ``+inf`` or NaN. ``check_values=False`` checks type and shape only.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    _has_data(x, name)
    if not torch.is_floating_point(x):
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dimension(s), got shape {tuple(x.shape)}")
    if not allow_empty and x.dim() > 0 and x.shape[-1] == 0:
        raise ValueError(f"{name} must have a non-empty last dimension, got shape {tuple(x.shape)}")
    if not check_values:
        return x
    if not x.numel():
        return x
    a = _numpy_values(x)
    if a is not None:  # a library call on the CPU: numpy's vectorised min / max, read at once
        hi = float(a.max())
        if not hi < math.inf or (not allow_inf and not -math.inf < float(a.min())):
            raise ValueError((_NAN_OR_POSINF if allow_inf else _NAN_OR_INF).format(name))
    elif allow_inf:
        # the maximum propagates NaN and shows +inf: one pass, no full-size temporaries
        check_flag(f"{name} values", ~(x.detach().amax() < math.inf), lambda: _NAN_OR_POSINF.format(name))
    else:
        # min and max propagate NaN and show infinities: one pass, no full-size temporaries
        # (torch.isfinite(x).all() makes them)
        lo, hi = torch.aminmax(x.detach())
        check_flag(
            f"{name} values", ~(torch.isfinite(lo) & torch.isfinite(hi)), lambda: _NAN_OR_INF.format(name)
        )
    return x


def _numpy_values(x: torch.Tensor) -> np.ndarray | None:
    """``x`` as numpy where :func:`float_tensor` checks its values there, else ``None``: a dense
    float32 / float64 CPU tensor outside :func:`deferred_checks` and ``torch.compile``'s tracing (the
    host reads the verdict at once either way, and numpy's min and max take about half the time of
    ``torch.aminmax``)."""
    if not (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.float64)
        and x.layout == torch.strided
        and _ACTIVE.get() is None
        and not torch.compiler.is_compiling()
    ):
        return None
    try:
        return x.detach().numpy()
    except (RuntimeError, TypeError):  # (torch.func's wrapped tensors, subclasses without storage)
        return None


_NAN_OR_INF = "{} contains NaN or infinite values"
_NAN_OR_POSINF = "{} contains NaN or +inf values (only -inf is allowed, for masked entries)"


def label_tensor(
    labels: Any, name: str, *, shape: Iterable[int] | None = None, num_classes: int | None = None
) -> torch.Tensor:
    """Check integer labels: dtype, optional exact ``shape``, range ``[0, num_classes)``."""
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of integer class ids, got {type(labels).__name__}")
    if labels.dtype == torch.bool or torch.is_floating_point(labels) or torch.is_complex(labels):
        raise TypeError(f"{name} must be an integer tensor, got dtype {labels.dtype}")
    _has_data(labels, name)
    if shape is not None:
        shape = tuple(shape)
        if tuple(labels.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(labels.shape)}")
    if num_classes is not None and labels.numel() > 0:
        lo, hi = torch.aminmax(labels.detach())
        check_flag(
            f"{name} range",
            (lo < 0) | (hi >= num_classes),
            lambda low, high: (
                f"{name} must lie in [0, {num_classes}), got values in [{int(low)}, {int(high)}]"
            ),
            lo,
            hi,
        )
    return labels


def real(
    value: Any,
    name: str,
    *,
    low: float | None = None,
    high: float | None = None,
    open_low: bool = False,
    open_high: bool = False,
) -> float:
    """Check a finite real scalar (a 1-element tensor too) in ``[low, high]`` (ends open on request)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    above = low is None or (value > low if open_low else value >= low)
    below = high is None or (value < high if open_high else value <= high)
    if not (math.isfinite(value) and above and below):
        if low is None and high is None:
            raise ValueError(f"{name} must be finite, got {value}")
        if high is None:
            raise ValueError(
                f"{name} must be a finite number {'>' if open_low else '>='} {low:g}, got {value}"
            )
        interval = f"{'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'}"
        raise ValueError(f"{name} must lie in {interval}, got {value}")
    return value


def positive_float(value: Any, name: str, *, allow_zero: bool = False) -> float:
    """Check a finite scalar ``> 0`` (or ``>= 0`` with ``allow_zero``) and return it as float."""
    return real(value, name, low=0.0, open_low=not allow_zero)


def nonnegative(value: Any, name: str) -> float:
    """Check a finite scalar ``>= 0`` (a margin) and return it as float."""
    return positive_float(value, name, allow_zero=True)


def optional_real(value: Any, name: str) -> float | None:
    """``None``, or a finite scalar returned as float."""
    return None if value is None else real(value, name)


def positive_int(value: Any, name: str, *, minimum: int = 1) -> int:
    """Check an integer ``>= minimum`` and return it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def choice(value: Any, name: str, choices: Iterable[str]) -> str:
    """Check that ``value`` is one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def reduce(loss: torch.Tensor, reduction: Reduction, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Apply ``reduction`` to per-example losses.

    With ``weight`` (a 0/1 or float mask of examples that count), ``"mean"`` divides by the
    weight sum (0 when nothing counts, keeping the graph connected) and ``"sum"`` sums the
    weighted losses; ``"none"`` returns the per-example values unchanged.
    """
    if reduction == "none":
        return loss
    if weight is not None:
        loss = loss * weight
        if reduction == "sum":
            return loss.sum()
        return loss.sum() / weight.sum().clamp_min(1)
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.mean() if loss.numel() else loss.sum()
    raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def reduce_kept(loss: torch.Tensor, keep: torch.Tensor | None, reduction: Reduction) -> torch.Tensor:
    """:func:`reduce` over the rows where ``keep`` holds: ``F.cross_entropy``'s ``ignore_index`` semantics.

    Other rows are 0 in ``"none"`` and contribute nothing (value or gradient) to ``"sum"`` and
    ``"mean"``; ``"mean"`` divides by the number of kept rows, so when every row is ignored it is
    NaN (0/0), as in torch, with a zero gradient.
    """
    if keep is None:
        return reduce(loss, reduction)
    loss = loss.masked_fill(~keep.reshape(loss.shape), 0.0)
    if reduction == "mean":
        return loss.sum() / keep.sum()
    return reduce(loss, reduction)


# Cosines may leave [-1, 1] by this much (normalisation round-off, half precision).
COSINE_ATOL = 1e-3


def cosine_range(lo: Any, hi: Any, name: str, *, atol: float = COSINE_ATOL) -> None:
    """Raise unless ``lo``/``hi`` (the min/max of some cosines) lie in ``[-1 - atol, 1 + atol]``.

    NaN and ±inf fail. For callers that already have the extremes from reductions they need
    anyway (one pass instead of a full check).
    """
    if isinstance(lo, torch.Tensor) and isinstance(hi, torch.Tensor):
        lo, hi = lo.detach(), hi.detach()
        inside = (lo >= -1 - atol) & (hi <= 1 + atol)  # False for NaN
        check_flag(f"{name} cosines", ~inside, lambda a, b: _cosine_text(name, a, b), lo, hi)
        return
    lo_f, hi_f = float(lo), float(hi)
    if not (math.isfinite(lo_f) and math.isfinite(hi_f) and lo_f >= -1 - atol and hi_f <= 1 + atol):
        raise ValueError(_cosine_text(name, lo_f, hi_f))


def _cosine_text(name: str, lo: float, hi: float) -> str:
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return _NAN_OR_INF.format(name)
    return f"{name} must be cosines in [-1, 1] (up to rounding), got |value| up to {max(-lo, hi):.4g}"


def cosine_tensor(x: Any, name: str, *, atol: float = COSINE_ATOL) -> torch.Tensor:
    """Check a floating tensor of cosines: finite and inside ``[-1, 1]`` up to rounding ``atol``.

    Values within ``atol`` outside the interval (normalisation round-off, half precision) are
    accepted; callers clamp. Anything further out means the input is not a cosine.
    """
    float_tensor(x, name, min_dim=1, check_values=False)
    if x.numel():  # one pass, no temporaries: min and max propagate NaN
        cosine_range(*torch.aminmax(x), name, atol=atol)
    return x


def mask_tensor(
    mask: Any, name: str, target: torch.Tensor, target_name: str, *, counts: bool = False
) -> torch.Tensor:
    """A bool mask (with ``counts``: integer multiplicities ``>= 0``) that broadcasts to ``target``."""
    ok = isinstance(mask, torch.Tensor) and (
        mask.dtype == torch.bool or (counts and not mask.is_floating_point() and not mask.is_complex())
    )
    if not ok:
        expected = "a bool tensor or integer multiplicities" if counts else "a bool tensor"
        raise TypeError(f"{name} must be {expected}, got {getattr(mask, 'dtype', type(mask).__name__)}")
    _has_data(mask, name)
    try:
        torch.broadcast_shapes(mask.shape, target.shape)
    except RuntimeError as err:
        raise ValueError(
            f"{name} of shape {tuple(mask.shape)} does not broadcast to {target_name} {tuple(target.shape)}"
        ) from err
    if mask.dtype != torch.bool and mask.numel():
        check_flag(f"{name} counts", mask.detach().amin() < 0, lambda: f"{name} multiplicities must be >= 0")
    return mask


def same_batch(a: torch.Tensor, a_name: str, b: torch.Tensor, b_name: str) -> None:
    """Check that two tensors share their first (batch) dimension."""
    if a.shape[:1] != b.shape[:1]:
        raise ValueError(
            f"{b_name} must have one entry per row of {a_name}: "
            f"got {a_name} batch {a.shape[0] if a.dim() else '()'} and {b_name} batch "
            f"{b.shape[0] if b.dim() else '()'}"
        )


# ------------------------------------------------------------------ arrays of data (numpy in)
_DATA_KINDS = {"float": "fiu", "int": "iu", "bool": "biu"}


def data_tensor(x: Any, name: str, kind: str = "float") -> torch.Tensor:
    """``x`` as a tensor: a ``torch.Tensor`` as it is, anything ``numpy.asarray`` takes converted.

    ``kind`` says what the argument holds: ``"float"`` (numbers; integers become float64, as
    scikit-learn takes integer features), ``"int"`` (integer ids) or ``"bool"`` (flags, or 0/1
    integers). A numpy array is shared, not copied, when it is contiguous and writable. Anything
    else (strings, objects, complex numbers, ragged lists) is a ``TypeError`` naming ``name``.
    """
    if isinstance(x, torch.Tensor):
        return x
    expected = {"float": "numbers", "int": "integers", "bool": "bools or 0/1 integers"}[kind]
    try:
        array = np.asarray(x)
    except (ValueError, TypeError) as exc:  # ragged nested lists, unconvertible objects
        raise TypeError(f"{name} must be a tensor or an array of {expected}, got {type(x).__name__}") from exc
    if array.dtype.kind not in _DATA_KINDS[kind]:
        raise TypeError(f"{name} must be a tensor or an array of {expected}, got dtype {array.dtype}")
    if array.dtype.kind == "u" and array.dtype.itemsize == 8 and array.size and int(array.max()) >= 2**63:
        raise ValueError(f"{name} must fit in 64-bit integers, got values up to {int(array.max())}")
    if kind == "float" and array.dtype.kind in "iu":
        array = array.astype(np.float64)
    elif array.dtype.kind == "u" and array.dtype != np.uint8:
        array = array.astype(np.int64)  # (torch has no uint16/32/64 arithmetic to speak of)
    if not array.flags.writeable:  # (torch warns on read-only memory; a copy is C-contiguous)
        array = array.copy()
    return torch.from_numpy(np.ascontiguousarray(array))


def to_caller(result: Any, as_numpy: bool) -> Any:
    """``result`` with its tensors (also inside a tuple or list) as numpy arrays when ``as_numpy``.

    The convention of the array-taking public functions: numpy in, numpy out (scikit-learn's);
    tensors in, tensors out. Tensors that are values of a returned dict are converted too; other
    values (floats, figures, result objects such as a ``GallerySearch``) are unchanged.
    """
    if not as_numpy:
        return result
    if isinstance(result, torch.Tensor):
        return result.detach().cpu().numpy()
    if isinstance(result, (tuple, list)) and not hasattr(result, "_fields"):
        return type(result)(to_caller(r, True) for r in result)
    if isinstance(result, dict):  # (e.g. a curve's arrays)
        return {k: to_caller(v, True) if isinstance(v, torch.Tensor) else v for k, v in result.items()}
    return result


_F = TypeVar("_F", bound=Callable[..., Any])


def accepts_arrays(**kinds: str) -> Callable[[_F], _F]:
    """Decorator: the named array arguments of a public function take numpy arrays too.

    ``kinds`` maps argument names to :func:`data_tensor` kinds (``"labels"``: passed as they are,
    the function reads them itself). Arguments given as something other than a tensor (or a
    result object, a dataclass) are converted; when the first named argument was, the function's
    tensors come back as numpy arrays (:func:`to_caller`).
    """

    def wrap(fn: _F) -> _F:
        signature = inspect.signature(fn)
        primary = next(iter(kinds))

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            values = bound.arguments
            as_numpy = (
                primary in values
                and values[primary] is not None
                and not isinstance(values[primary], torch.Tensor)
            )
            for name, kind in kinds.items():
                value = values.get(name)
                if value is None or kind == "labels" or isinstance(value, torch.Tensor):
                    continue
                if not dataclasses.is_dataclass(value):  # (a result object: the function reads it)
                    values[name] = data_tensor(value, name, kind)
            return to_caller(fn(*bound.args, **bound.kwargs), as_numpy)

        return wrapper  # type: ignore[return-value]

    return wrap
