"""Scale, shift and permutation invariances of every public op and loss at the ends of float32's range.

Issue 28: no silent wrong answer at the extremes. Each property draws small inputs on a grid that
the transformation maps exactly in the low precision (values ``k/64`` with ``|k| <= 64``, scales
``2^e`` for ``|e| <= 99``, i.e. 1e-30 … 1e30, shifts on the same grid), so the transformed input
is exact in float32 *and* bfloat16; the answer on it must then equal the float64 answer on the
untransformed input, transformed as the maths says, to the working precision. Where the maths
does not allow a scale (a result beyond float32's range, a margin beyond float64's), the op must
refuse it with a ``ValueError`` naming what is wrong, never return a wrong number.

Hypothesis draws: the CI profile runs 60 examples per property (``tests/conftest.py``); every
property here is a few milliseconds per example.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import marginkit.losses as L
from marginkit.ops import (
    alpha_divergence_loss,
    alpha_softargmax,
    circle_loss,
    contrastive_loss,
    margin_gap,
    mep,
    multi_similarity_loss,
    ntxent_loss,
    subcenter_cosines,
    supcon_loss,
)

LOW = [torch.float32, torch.bfloat16]
F64 = torch.float64

seeds = st.integers(0, 2**32 - 1)
low_dtypes = st.sampled_from(LOW)
exponents = st.integers(-99, 99)  # 2^±99 ≈ 1e±30
alphas = st.sampled_from([1.25, 1.5, 2.0, 3.0])


def _grid(gen: torch.Generator, *shape: int, low: int = -64, high: int = 64) -> torch.Tensor:
    """float64 values ``k/64``, ``low <= k <= high``: exact in bfloat16 (8 significant bits)."""
    return torch.randint(low, high + 1, shape, generator=gen).to(F64) / 64


def _close(out: torch.Tensor, expected: torch.Tensor, *, ulps: float = 64.0, floor: float = 1.0) -> None:
    """``out`` within ``ulps`` ulps of its working precision (float32 at least) of ``expected``.

    The error allowed is relative to ``|expected| + floor`` (``floor``: the natural magnitude of
    the result, e.g. a loss's scale, where cancellation leaves an absolute error).
    """
    info = torch.finfo(out.dtype if out.dtype in (torch.float64, torch.bfloat16) else torch.float32)
    err = (out.double() - expected).abs()
    # (a result below the smallest normal number keeps only an absolute precision of tiny·eps)
    allowed = ulps * info.eps * (expected.abs() + floor + info.tiny)
    assert bool((err <= allowed).all()), (
        f"max error {float(err.max()):.3g} above {float(allowed[err > allowed].min()):.3g} "
        f"({out.dtype}); got {out.tolist()} expected {expected.tolist()}"
    )


def _labels(gen: torch.Generator, rows: int, classes: int) -> torch.Tensor:
    return torch.randint(0, classes, (rows,), generator=gen)


# ------------------------------------------------------------------ alpha softargmax and its loss
@given(seed=seeds, dtype=low_dtypes, e=exponents, alpha=alphas, wide=st.booleans())
def test_alpha_softargmax_shift_and_permutation_at_every_scale(seed, dtype, e, alpha, wide):
    gen = torch.Generator().manual_seed(seed)
    theta = _grid(gen, 3, 6) * 2.0**e
    shift = _grid(gen, 3, 1) * 2.0**e
    # q: all ones, or powers of two spanning 2^±99 (exact in every dtype)
    q = 2.0 ** torch.randint(-99, 100, (3, 6), generator=gen).to(F64) if wide else None
    expected = alpha_softargmax(theta, alpha, q)
    perm = torch.randperm(6, generator=gen)
    q_low = None if q is None else q.to(dtype)
    for x, qq, back in ((theta, q_low, None), (theta + shift, q_low, None), (theta[:, perm], None, perm)):
        if back is not None:
            qq = None if q is None else q[:, perm].to(dtype)
        p = alpha_softargmax(x.to(dtype), alpha, qq)
        assert p.dtype == dtype
        want = expected if back is None else expected[:, back]
        _close(p, want, ulps=64 if dtype == torch.bfloat16 else 512, floor=1.0)


@given(seed=seeds, dtype=low_dtypes, e=exponents, alpha=alphas, wide=st.booleans())
def test_alpha_divergence_loss_shift_and_permutation_at_every_scale(seed, dtype, e, alpha, wide):
    gen = torch.Generator().manual_seed(seed)
    theta = _grid(gen, 3, 5) * 2.0**e
    shift = _grid(gen, 3, 1) * 2.0**e
    y = _labels(gen, 3, 5)
    q = 2.0 ** torch.randint(-40, 41, (3, 5), generator=gen).to(F64) if wide else None
    expected = alpha_divergence_loss(theta, y, alpha, q)
    perm = torch.randperm(5, generator=gen)
    inverse = torch.argsort(perm)
    for x, qq, yy in (
        (theta + shift, q, y),
        (theta[:, perm], None if q is None else q[:, perm], inverse[y]),
    ):
        loss = alpha_divergence_loss(x.to(dtype), yy, alpha, None if qq is None else qq.to(dtype))
        # the loss grows with the logits (and with E(q_y)); rounding is relative to that magnitude
        _close(loss, expected, ulps=512, floor=2.0**e + 1.0)


@given(seed=seeds, dtype=low_dtypes, e=st.integers(-99, 60), alpha=alphas, m=st.integers(0, 8))
def test_alpha_class_losses_at_every_scale(seed, dtype, e, alpha, m):
    gen = torch.Generator().manual_seed(seed)
    cos, y = _grid(gen, 4, 6), _labels(gen, 4, 6)
    scale, margin = 2.0**e, m / 16
    perm = torch.randperm(6, generator=gen)
    for loss in (
        L.QMarginLoss(alpha, scale, margin, reduction="none"),
        L.EntmaxLoss(alpha, scale, reduction="none"),
        L.SparsemaxLoss(scale, reduction="none"),
    ):
        try:
            expected = loss(cos, y)
        except ValueError as exc:  # (α − 1)·s·m beyond float64's range: refused, by name
            assert "float64's range" in str(exc) and (alpha - 1) * scale * margin > 700
            continue
        _close(loss(cos.to(dtype), y), expected, ulps=512, floor=scale)
        _close(loss(cos[:, perm].to(dtype), torch.argsort(perm)[y]), expected, ulps=512, floor=scale)
        order = [3, 1, 0, 2]
        _close(loss(cos[order].to(dtype), y[order]), expected[order], ulps=512, floor=scale)


@given(seed=seeds, dtype=low_dtypes, e=exponents, alpha=alphas)
def test_alpha_losses_on_raw_logits_are_shift_invariant(seed, dtype, e, alpha):
    gen = torch.Generator().manual_seed(seed)
    logits, y = _grid(gen, 4, 6) * 2.0**e, _labels(gen, 4, 6)
    shift = _grid(gen, 4, 1) * 2.0**e
    for loss in (
        L.EntmaxLoss(alpha, logits=True, reduction="none"),
        L.SparsemaxLoss(logits=True, reduction="none"),
    ):
        expected = loss(logits, y)
        _close(loss((logits + shift).to(dtype), y), expected, ulps=512, floor=2.0**e)


# ------------------------------------------------------------------ margin softmax family
def _margin_losses(scale: float) -> list[torch.nn.Module]:
    return [
        L.NormSoftmaxLoss(scale, reduction="none"),
        L.CosFaceLoss(scale, 0.25, reduction="none"),
        L.ArcFaceLoss(scale, 0.5, reduction="none"),
        L.CombinedMarginLoss(1.0, 0.3, 0.2, scale, reduction="none"),
        L.SubCenterArcFaceLoss(scale, 0.5, reduction="none"),
        L.ProxyAnchorLoss(alpha=scale, margin=0.1),
        L.ClassCircleLoss(margin=0.25, gamma=scale, reduction="none"),
    ]


@given(seed=seeds, dtype=low_dtypes, e=st.integers(-99, 99))
def test_margin_softmax_losses_at_every_scale_and_class_order(seed, dtype, e):
    gen = torch.Generator().manual_seed(seed)
    cos, y = _grid(gen, 4, 6), _labels(gen, 4, 6)
    y[0] = 5  # (proxy anchor: at least one class with positives)
    perm = torch.randperm(6, generator=gen)
    scale = 2.0**e
    for loss in _margin_losses(scale):
        try:
            expected = loss(cos, y)
        except ValueError as exc:
            # a scale whose logits leave float32 (2^99 · cos): refused by name, never inf/NaN
            assert "scale" in str(exc) or "alpha" in str(exc) or "gamma" in str(exc), exc
            continue
        assert bool(torch.isfinite(expected).all())
        _close(loss(cos.to(dtype), y), expected, ulps=512, floor=scale)
        _close(loss(cos[:, perm].to(dtype), torch.argsort(perm)[y]), expected, ulps=512, floor=scale)


@given(seed=seeds, dtype=low_dtypes, e=exponents)
def test_norm_softmax_on_raw_logits_is_shift_invariant(seed, dtype, e):
    gen = torch.Generator().manual_seed(seed)
    logits, y = _grid(gen, 4, 6) * 2.0**e, _labels(gen, 4, 6)
    shift = _grid(gen, 4, 1) * 2.0**e
    loss = L.NormSoftmaxLoss(logits=True, reduction="none")
    _close(loss((logits + shift).to(dtype), y), loss(logits, y), ulps=512, floor=2.0**e)


# norms at least 2^-39 ≈ 1.8e-12: below eps = 1e-12 the documented floor of F.normalize applies
@given(seed=seeds, dtype=low_dtypes, e=st.integers(-39, 99), w=st.integers(-39, 99))
def test_cosine_heads_do_not_depend_on_the_scale_of_embeddings_or_centres(seed, dtype, e, w):
    gen = torch.Generator().manual_seed(seed)
    emb, centres = _grid(gen, 4, 8), _grid(gen, 5, 2, 8)
    emb[:, 0] = 1.0  # no zero row
    centres[..., 0] = 1.0
    expected = subcenter_cosines(emb, centres)
    got = subcenter_cosines((emb * 2.0**e).to(dtype), (centres * 2.0**w).to(dtype))
    _close(got, expected, ulps=64, floor=1.0)


# ------------------------------------------------------------------ margin-enforcing projection
@given(seed=seeds, dtype=low_dtypes, e=exponents, norm=st.sampled_from(["l1", "l2"]))
def test_mep_is_shift_scale_and_permutation_equivariant(seed, dtype, e, norm):
    gen = torch.Generator().manual_seed(seed)
    x, y = _grid(gen, 4, 6), _labels(gen, 4, 6)
    shift = _grid(gen, 4, 1)
    s, margin = 2.0**e, 0.25
    perm = torch.randperm(6, generator=gen)
    base = mep(x, y, margin, norm)
    # shift: MEP(x + c) = MEP(x) + c; scale: MEP(s x; s m) = s MEP(x; m); order: equivariant
    cases = (
        ((x + shift) * s, y, base * s + shift * s),
        (x[:, perm] * s, torch.argsort(perm)[y], base[:, perm] * s),
    )
    for scores, labels, want in cases:
        z = mep(scores.to(dtype), labels, margin * s, norm)
        # (l1: the minimiser is not unique; the level chosen is, so the outputs compare)
        _close(z, want, ulps=64, floor=s)
    gap = margin_gap((x + shift).to(dtype) * s, y)
    _close(gap, margin_gap(x, y) * s, ulps=64, floor=s)
    loss = L.MEPLoss(margin * s, norm, reduction="none")
    want = L.MEPLoss(margin, norm, reduction="none")(x, y) * s * s
    top = torch.finfo(torch.float32).max
    try:
        got = loss(((x + shift) * s).to(dtype), y)
    except ValueError as exc:  # a loss beyond float32's range: refused by name, never inf
        assert "MEPLoss overflows float32" in str(exc) and float(want.max()) > 0.99 * top, exc
        return
    assert float(want.max()) <= top
    _close(got, want, floor=s * s)


# ------------------------------------------------------------------ pair losses on embeddings
def _pair_losses() -> list[tuple[str, torch.nn.Module]]:
    return [
        ("circle", L.CircleLoss(gamma=64.0, reduction="none")),
        ("triplet", L.TripletMarginLoss(0.2, reduction="none")),
        ("triplet-all", L.TripletMarginLoss(0.2, mining="batch_all", reduction="none")),
        ("local-triplet", L.LocalMarginTripletLoss(k=2, reduction="none")),
        ("multi-similarity", L.MultiSimilarityLoss(reduction="none")),
        ("supcon", L.SupConLoss(reduction="none")),
        ("ntxent", L.NTXentLoss(reduction="none")),
        ("contrastive", L.ContrastiveLoss(reduction="none")),
        ("contrastive-cosine", L.ContrastiveLoss(distance="cosine", normalize=False, reduction="none")),
    ]


@given(seed=seeds, dtype=low_dtypes, e=exponents)
def test_normalised_pair_losses_do_not_depend_on_the_scale(seed, dtype, e):
    gen = torch.Generator().manual_seed(seed)
    emb = _grid(gen, 8, 6)
    emb[:, 0] = 1.0  # no zero row
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 0, 1])
    perm = torch.randperm(8, generator=gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (collapsed-embedding warnings on coarse grids)
        for name, loss in _pair_losses():
            expected = loss(emb, labels)
            got = loss((emb * 2.0**e).to(dtype), labels)
            assert got.shape == expected.shape, name
            _close(got, expected, ulps=256, floor=1.0)
            permuted = loss((emb[perm] * 2.0**e).to(dtype), labels[perm])  # per anchor: permuted too
            _close(permuted, expected[perm], ulps=256, floor=1.0)


@given(seed=seeds, dtype=low_dtypes, e=st.integers(-99, 99), distance=st.sampled_from(["l2", "squared_l2"]))
def test_raw_triplet_loss_is_translation_and_scale_equivariant_or_refused(seed, dtype, e, distance):
    gen = torch.Generator().manual_seed(seed)
    emb, shift = _grid(gen, 8, 4), _grid(gen, 1, 4)
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 0, 1])
    s = 2.0**e
    power = 2 if distance == "squared_l2" else 1
    expected = L.TripletMarginLoss(0.25, distance=distance, normalize=False, reduction="none")(emb, labels)
    loss = L.TripletMarginLoss(0.25 * s**power, distance=distance, normalize=False, reduction="none")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            got = loss(((emb + shift) * s).to(dtype), labels)
        except ValueError as exc:  # squared distances beyond float32's range: refused by name
            message = str(exc)
            if s > 1:  # (|e| ≳ 1e19: the squares overflow)
                assert "embeddings are too large" in message and s > 1e15, message
            else:  # (|e| ≲ 3e-16: the squares lose their digits, then vanish)
                assert "embeddings are too small" in message and s < 1e-14, message
            return
    _close(got, expected * s**power, ulps=256, floor=s**power)


# ------------------------------------------------------------------ pair-matrix ops
@given(seed=seeds, dtype=low_dtypes, e=st.integers(-30, 0), g=st.integers(-10, 12))
def test_pair_matrix_ops_are_permutation_invariant_at_extreme_temperatures(seed, dtype, e, g):
    gen = torch.Generator().manual_seed(seed)
    sim = _grid(gen, 3, 7)
    pos = torch.rand(3, 7, generator=gen) < 0.4
    neg = ~pos
    pos[:, 0], neg[:, 0], neg[:, 1], pos[:, 1] = True, False, True, False
    perm = torch.randperm(7, generator=gen)
    temperature, gamma = 2.0**e, 2.0**g
    ops = (
        lambda s, p, n: supcon_loss(s, p, n, temperature),
        lambda s, p, n: ntxent_loss(s, p, n, temperature).sum(-1),
        lambda s, p, n: multi_similarity_loss(s, p, n, 2.0, gamma, 0.5),
        lambda s, p, n: circle_loss(s, s, 0.25, gamma, p, n),
        lambda s, p, n: contrastive_loss(1 - s, p, n, 0.0, 1.0),
    )
    for op in ops:
        expected = op(sim, pos, neg)
        assert bool(torch.isfinite(expected).all())
        floor = 1.0 / temperature + gamma
        _close(op(sim.to(dtype), pos, neg), expected, ulps=512, floor=floor)
        _close(op(sim[:, perm].to(dtype), pos[:, perm], neg[:, perm]), expected, ulps=512, floor=floor)


@pytest.mark.parametrize("dtype", LOW)
def test_the_extremes_themselves(dtype):
    # the corners hypothesis may not draw: 2^±99 on every property's simplest input
    x = torch.tensor([[0.5, -0.25, 1.0, 0.0]], dtype=F64)
    for s in (2.0**99, 2.0**-99):
        _close(alpha_softargmax((x * s).to(dtype), 1.5), alpha_softargmax(x * s, 1.5), floor=1.0)
        emb = torch.tensor([[1.0, 0.5], [1.0, 0.25], [0.5, 1.0], [0.25, 1.0]], dtype=F64)
        lab = torch.tensor([0, 0, 1, 1])
        for _, loss in _pair_losses():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _close(loss((emb * s).to(dtype), lab), loss(emb, lab), ulps=256, floor=1.0)
    assert math.isfinite(float(L.CosFaceLoss(2.0**99, 0.25)(x.clamp(-1, 1).to(dtype), torch.tensor([2]))))
