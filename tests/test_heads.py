"""CosineHead against an F.normalize-based autograd reference, in value and gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from marginkit.heads import CosineHead
from marginkit.heads.cosine import cosine_similarity_matrix


def reference(e: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.normalize(e, dim=-1) @ F.normalize(w, dim=-1).t()


def grads(fn, e, w, g):
    e = e.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    out = fn(e, w)
    ge, gw = torch.autograd.grad(out, (e, w), g)
    return out.detach(), ge, gw


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_and_gradients_equal_normalize_reference(gen, dtype):
    head = CosineHead(37, 16, dtype=dtype)
    e = 3 * torch.randn(11, 16, generator=gen, dtype=dtype)
    w = head.weight.detach() * torch.rand(37, 1, generator=gen, dtype=dtype) * 5  # non-unit norms
    g = torch.randn(11, 37, generator=gen, dtype=dtype)
    ours = grads(cosine_similarity_matrix, e, w, g)
    ref = grads(reference, e, w, g)
    tol = {"rtol": 1e-12, "atol": 1e-13} if dtype == torch.float64 else {"rtol": 2e-5, "atol": 2e-6}
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, **tol)
    torch.testing.assert_close(head(e), reference(e, head.weight.detach()), **tol)


def test_gradcheck_float64(gen):
    e = torch.randn(5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(cosine_similarity_matrix, (e, w))
    e3 = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(cosine_similarity_matrix, (e3, w))


def test_leading_dimensions(gen):
    head = CosineHead(7, 5)
    e = torch.randn(2, 3, 5, generator=gen)
    out = head(e)
    assert out.shape == (2, 3, 7)
    torch.testing.assert_close(out, head(e.reshape(6, 5)).reshape(2, 3, 7))
    assert head(e[0, 0]).shape == (7,)


def test_zero_vectors_are_safe():
    head = CosineHead(4, 3, dtype=torch.float64)
    with torch.no_grad():
        head.weight[2] = 0.0
    e = torch.tensor([[0.0, 0.0, 0.0], [1.0, 2.0, 3.0]], dtype=torch.float64, requires_grad=True)
    out = head(e)
    assert torch.equal(out[0], torch.zeros(4, dtype=torch.float64))
    assert out[1, 2] == 0.0
    out.sum().backward()
    assert torch.isfinite(e.grad).all() and torch.isfinite(head.weight.grad).all()
    # same (finite, eps-scaled) gradient as the F.normalize reference at the zero vector
    g = torch.ones(2, 4, dtype=torch.float64)
    ours = grads(cosine_similarity_matrix, e, head.weight, g)
    ref = grads(reference, e, head.weight, g)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_embeddings_and_weights(gen, dtype):
    e = torch.randn(8, 32, generator=gen).to(dtype)
    head = CosineHead(50, 32)
    x = e.clone().requires_grad_(True)
    out = head(x)
    assert out.dtype == torch.float32
    # computed in float32 on the half values: equal to a float64 evaluation up to float32 rounding
    torch.testing.assert_close(out.double(), reference(e.double(), head.weight.double()), rtol=0, atol=1e-6)
    out.sum().backward()
    assert x.grad.dtype == dtype and head.weight.grad.dtype == torch.float32
    # half weights too (head.half()): the matmul still runs in float32
    head_h = CosineHead(50, 32).to(dtype)
    out_h = head_h(e)
    assert out_h.dtype == torch.float32
    torch.testing.assert_close(
        out_h.double(), reference(e.double(), head_h.weight.double()), rtol=0, atol=1e-6
    )
    out_h.sum().backward()
    assert head_h.weight.grad.dtype == dtype and torch.isfinite(head_h.weight.grad).all()


def test_half_norm_would_overflow_but_head_does_not(gen):
    # ‖e‖² of 512 float16 values of size 30 is 4.6e5 > 65504 (float16 max): computed in float32.
    e = torch.full((2, 512), 30.0, dtype=torch.float16)
    out = CosineHead(3, 512)(e)
    assert torch.isfinite(out).all() and out.abs().max() <= 1 + 1e-6


def test_autocast_keeps_float32(gen):
    head = CosineHead(20, 8)
    e = torch.randn(4, 8, generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = head(e)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, head(e), rtol=0, atol=0)


def test_predict_and_logits(gen):
    head = CosineHead(30, 6)
    e = torch.randn(12, 6, generator=gen)
    pred = head.predict(e)
    assert pred.dtype == torch.long and pred.shape == (12,)
    assert torch.equal(pred, reference(e, head.weight.detach()).argmax(dim=1))
    assert not pred.requires_grad
    torch.testing.assert_close(head.logits(e), head(e), rtol=0, atol=0)
    # an embedding equal to a centre is predicted as that class
    assert torch.equal(head.predict(head.weight.detach()[[3, 17]] * 2.5), torch.tensor([3, 17]))


def test_init_and_module_behaviour():
    torch.manual_seed(123)  # module init draws from the global RNG, like torch.nn layers
    head = CosineHead(1000, 64)
    norms = head.weight.detach().norm(dim=1)
    torch.testing.assert_close(norms, torch.ones(1000), rtol=0, atol=1e-5)
    # directions roughly uniform: mean centre near 0, pairwise cosines near 0 (std ≈ 1/√64)
    assert head.weight.detach().mean(0).norm() < 0.1
    gram = (head.weight @ head.weight.t()).detach()
    off = gram[torch.triu(torch.ones_like(gram, dtype=torch.bool), diagonal=1)]
    assert 0.1 < off.std() < 0.15 and off.mean().abs() < 0.01
    assert [n for n, _ in head.named_parameters()] == ["weight"]
    assert set(head.state_dict()) == {"weight"}
    assert "num_classes=1000, embedding_dim=64" in repr(head)
    # an optimizer step moves the centres
    g = torch.Generator().manual_seed(1)
    e, y = torch.randn(8, 64, generator=g), torch.randint(0, 1000, (8,), generator=g)
    before = head.weight.detach().clone()
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    F.cross_entropy(10 * head(e), y).backward()
    opt.step()
    assert not torch.equal(before, head.weight.detach())


def test_bad_arguments(gen):
    for bad in (0, -3):
        with pytest.raises(ValueError, match="num_classes must be >= 1"):
            CosineHead(bad, 4)
        with pytest.raises(ValueError, match="embedding_dim must be >= 1"):
            CosineHead(4, bad)
    with pytest.raises(TypeError, match="num_classes must be an int"):
        CosineHead(4.0, 4)
    with pytest.raises(TypeError, match="embedding_dim must be an int"):
        CosineHead(4, "8")
    with pytest.raises(ValueError, match="eps"):
        CosineHead(4, 4, eps=0.0)
    head = CosineHead(5, 8)
    with pytest.raises(
        ValueError, match=r"embeddings must have last dimension embedding_dim=8, got shape \(3, 7\)"
    ):
        head(torch.randn(3, 7, generator=gen))
    with pytest.raises(TypeError, match="embeddings must be a floating-point tensor"):
        head(torch.ones(3, 8, dtype=torch.long))
    with pytest.raises(TypeError, match="embeddings must be a torch.Tensor"):
        head([[0.0] * 8])
    bad = torch.randn(3, 8, generator=gen)
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="embeddings contains NaN"):
        head(bad)
    with pytest.raises(ValueError, match="embeddings"):
        head.predict(torch.randn(3, 9, generator=gen))


# --- the sparse-gradient handshake with the alpha losses ---------------------------------------


def _head_grads(loss_fn, head, e, y, *, detour: bool):
    """Gradients of e and of the centres; ``detour`` inserts a clone (a dense-gradient producer)."""
    e = e.detach().clone().requires_grad_(True)
    head.zero_grad(set_to_none=True)
    cos = head(e)
    loss = loss_fn(cos.clone() if detour else cos, y)
    loss.backward()
    return loss.detach(), e.grad, head.weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sparse_gradient_path_equals_the_dense_one(gen, dtype, monkeypatch):
    from marginkit.heads import cosine as cosine_module
    from marginkit.losses import EntmaxLoss, QMarginLoss, SparsemaxLoss
    from marginkit.ops.alpha._autograd import _SPARSE_FRACTION
    from marginkit.ops.alpha._static import budgets

    calls = []
    sparse_backward = cosine_module._sparse_backward
    monkeypatch.setattr(
        cosine_module, "_sparse_backward", lambda ctx, g: (calls.append(g.layout), sparse_backward(ctx, g))[1]
    )
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    for n_classes in (40, 3000):  # one partial block only; the block pre-filter and padded rows
        head = CosineHead(n_classes, 24, dtype=dtype)
        with torch.no_grad():  # non-unit centre norms exercise the 1/‖w‖ factors
            head.weight.mul_(torch.rand(n_classes, 1, generator=gen, dtype=dtype) + 0.5)
        e = torch.randn(20, 24, generator=gen, dtype=dtype)
        y = torch.randint(0, n_classes, (20,), generator=gen)
        y[:4] = y[4]  # repeated labels
        losses = (
            QMarginLoss(),
            QMarginLoss(alpha=1.5, scale=20.0),
            EntmaxLoss(),
            SparsemaxLoss(),
            QMarginLoss(topk=2),
        )
        for loss_fn in losses:
            calls.clear()
            sparse = _head_grads(loss_fn, head, e, y, detour=False)
            # a sparse gradient when the fixed candidate budget is a small part of the scores
            k = None if loss_fn.topk is None else loss_fn.topk
            size, _ = budgets(20, n_classes, k)
            expected = [torch.sparse_coo] if size * _SPARSE_FRACTION <= 20 * n_classes else []
            assert calls == expected
            dense = _head_grads(loss_fn, head, e, y, detour=True)
            assert len(calls) == len(expected)  # the detour got a dense gradient
            for a, b in zip(sparse, dense, strict=True):
                torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_sparse_gradient_only_reaches_the_head(gen):
    from marginkit.heads.cosine import accepts_sparse_grad
    from marginkit.losses import QMarginLoss

    head = CosineHead(500, 8, dtype=torch.float64)
    e = torch.randn(6, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 500, (6,), generator=gen)
    cos = head(e)
    assert accepts_sparse_grad(cos) and not accepts_sparse_grad(cos.clone()) and not accepts_sparse_grad(e)
    # a leaf gets a dense .grad
    leaf = cos.detach().requires_grad_(True)
    QMarginLoss()(leaf, y).backward()
    assert leaf.grad is not None and leaf.grad.layout == torch.strided
    # the head output used twice: the sparse and the dense gradients add up correctly
    (QMarginLoss()(cos, y) + 0.1 * cos.square().sum()).backward()
    expected_e, expected_w = torch.autograd.grad(
        QMarginLoss()(head(e).clone(), y) + 0.1 * head(e).square().sum(), (e, head.weight)
    )
    torch.testing.assert_close(e.grad, expected_e, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(head.weight.grad, expected_w, rtol=1e-12, atol=1e-12)


def test_gradcheck_head_and_alpha_loss_sparse_path(gen):
    from marginkit.losses import QMarginLoss

    w = torch.randn(300, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    e = torch.randn(5, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 300, (5,), generator=gen)
    loss_fn = QMarginLoss(alpha=1.5, scale=10.0, margin=0.1, reduction="sum")
    assert torch.autograd.gradcheck(lambda e, w: loss_fn(cosine_similarity_matrix(e, w), y), (e, w))
