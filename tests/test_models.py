"""build_model: shapes, normalisation, precision, rebuild, errors, and cnn1d fitness for mnist1d."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import marginkit.models
from marginkit.audio.models import SPEAKER_MODELS  # registers them: the same list in every worker
from marginkit.models import EmbeddingModel, build_model, model_options

# the models of images and sequences; the speaker backbones (waveforms in) are tested in
# tests/test_audio_models.py
MODELS = tuple(m for m in marginkit.models.MODELS if m not in SPEAKER_MODELS)

CASES = [
    ("mlp", (40,)),
    ("mlp", (1, 8, 8)),
    ("mlp", (3, 5)),
    ("cnn1d", (40,)),
    ("cnn1d", (2, 40)),
    ("cnn1d", (1, 5)),
    ("cnn2d", (1, 8, 8)),
    ("cnn2d", (1, 28, 28)),
    ("cnn2d", (3, 5, 7)),
    ("resnet", (1, 28, 28)),
    ("resnet", (3, 32, 32)),
    ("resnet", (3, 64, 64)),
    ("resnet", (1, 8, 8)),
]


@pytest.fixture(autouse=True)
def _seeded_single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny convolutions: a second thread only spins on shared cores
    try:
        with torch.random.fork_rng():
            torch.manual_seed(0)  # module initialisation draws from the global generator
            yield
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(("name", "shape"), CASES)
def test_shapes_and_unit_norm(name, shape, gen):
    model = build_model(name, shape, embedding_dim=24)
    assert isinstance(model, EmbeddingModel) and model.embedding_dim == 24 and model.input_shape == shape
    x = torch.randn(5, *shape, generator=gen)
    z = model(x)
    assert z.shape == (5, 24) and z.dtype == torch.float32
    torch.testing.assert_close(z.norm(dim=1), torch.ones(5), atol=1e-6, rtol=0)
    # gradients reach every parameter
    z.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    # in eval mode a batch equals its rows one at a time
    model.eval()
    with torch.no_grad():
        batched = model(x)
        rows = torch.cat([model(x[i : i + 1]) for i in range(5)])
    torch.testing.assert_close(batched, rows, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", MODELS)
def test_unnormalised_output_and_rebuild_from_config(name, gen):
    shape = (40,) if name in ("mlp", "cnn1d") else (1, 12, 12)
    model = build_model(name, shape, embedding_dim=8, normalize=False)
    z = model(torch.randn(6, *shape, generator=gen))
    assert not torch.allclose(z.norm(dim=1), torch.ones(6))
    clone = build_model(**model.config)
    assert clone.config == model.config
    clone.load_state_dict(model.state_dict())  # same architecture, parameter for parameter
    model.eval()
    clone.eval()
    x = torch.randn(3, *shape, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(clone(x), model(x))


@pytest.mark.parametrize("name", ["cnn2d", "resnet"])
def test_image_models_keep_channels_last_weights_and_compute_the_nchw_function(name, gen):
    model = build_model(name, (3, 16, 16), embedding_dim=8).eval()
    convs = [m.weight for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert convs and all(w.is_contiguous(memory_format=torch.channels_last) for w in convs)
    nchw = build_model(**model.config).eval()
    nchw.load_state_dict(model.state_dict())
    nchw.to(memory_format=torch.contiguous_format)
    assert not any(
        m.weight.is_contiguous(memory_format=torch.channels_last)
        for m in nchw.modules()
        if isinstance(m, torch.nn.Conv2d) and m.kernel_size != (1, 1)  # a 1x1 kernel is both
    )
    x = torch.randn(4, 3, 16, 16, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(model(x), nchw(x), atol=1e-5, rtol=1e-5)
    # the layout travels with the module to another dtype
    assert all(
        w.is_contiguous(memory_format=torch.channels_last)
        for w in model.double().parameters()
        if w.dim() == 4
    )


def test_float64_and_bfloat16(gen):
    model = build_model("cnn1d", (40,)).double()
    z = model(torch.randn(4, 40, generator=gen, dtype=torch.float64))
    assert z.dtype == torch.float64
    torch.testing.assert_close(z.norm(dim=1), torch.ones(4, dtype=torch.float64), atol=1e-12, rtol=0)
    for name, shape in (("mlp", (40,)), ("cnn1d", (40,)), ("cnn2d", (1, 8, 8)), ("resnet", (1, 16, 16))):
        model = build_model(name, shape).to(torch.bfloat16)
        x = torch.randn(4, *shape, generator=gen).to(torch.bfloat16)
        z = model(x)
        assert z.dtype == torch.bfloat16 and torch.isfinite(z).all()
        torch.testing.assert_close(z.float().norm(dim=1), torch.ones(4), atol=1e-2, rtol=0)
        model = build_model(name, shape)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            z = model(x.float())
        assert torch.isfinite(z).all()
        torch.testing.assert_close(z.float().norm(dim=1), torch.ones(4), atol=1e-2, rtol=0)


def test_options_change_the_architecture():
    small = build_model("cnn1d", (40,), channels=(8, 16), kernel_size=3)
    default = build_model("cnn1d", (40,))
    deeper = build_model("cnn1d", (40,), convs_per_stage=2)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(small) < count(default) < count(deeper)
    assert build_model("mlp", (10,), hidden=(7,), norm="none").trunk[1].out_features == 7
    wide = build_model("resnet", (3, 32, 32), width=8, blocks=(1, 2))
    assert wide.projection.in_features == 16
    assert build_model("resnet", (3, 64, 64)).stem[0].stride == (2, 2)
    assert build_model("resnet", (3, 32, 32)).stem[0].stride == (1, 1)
    assert "convs_per_stage" in model_options("cnn1d")


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown model 'cnn' .*valid: mlp, cnn1d, cnn2d, resnet"):
        build_model("cnn", (40,))
    with pytest.raises(ValueError, match=r"cnn1d expects input_shape \(L,\) or \(C, L\)"):
        build_model("cnn1d", (1, 28, 28))
    with pytest.raises(ValueError, match=r"cnn2d expects input_shape \(C, H, W\)"):
        build_model("cnn2d", (40,))
    with pytest.raises(ValueError, match="resnet needs images of at least 8x8"):
        build_model("resnet", (1, 4, 4))
    with pytest.raises(ValueError, match="sequences of length >= 4"):
        build_model("cnn1d", (3,))
    with pytest.raises(ValueError, match="input_shape must be >= 1"):
        build_model("mlp", (0, 3))
    with pytest.raises(TypeError, match="input_shape must be a non-empty tuple"):
        build_model("mlp", ())
    with pytest.raises(ValueError, match="embedding_dim must be >= 1"):
        build_model("mlp", (3,), embedding_dim=0)
    with pytest.raises(TypeError, match="normalize must be a bool"):
        build_model("mlp", (3,), normalize="yes")
    with pytest.raises(ValueError, match="unknown option 'chanels' .*did you mean 'channels'"):
        build_model("cnn2d", (1, 8, 8), chanels=(4,))
    with pytest.raises(ValueError, match="kernel_size must be odd"):
        build_model("cnn1d", (40,), kernel_size=4)
    with pytest.raises(ValueError, match="norm must be one of"):
        build_model("mlp", (3,), norm="layer")
    model = build_model("cnn1d", (40,))
    with pytest.raises(ValueError, match=r"cnn1d model expects x of shape \[B, 40\], got \[2, 41\]"):
        model(torch.zeros(2, 41))
    with pytest.raises(TypeError, match="floating-point"):
        model(torch.zeros(2, 40, dtype=torch.long))


@pytest.mark.slow
def test_cnn1d_learns_mnist1d_with_plain_softmax(tmp_path):
    """The demo needs >= 0.85 K-NN accuracy on mnist1d: a short softmax run must clear it."""
    from marginkit.data import load_dataset

    data = load_dataset("mnist1d", cache_dir=str(tmp_path), val_fraction=0.0)
    model = build_model("cnn1d", data.input_shape, embedding_dim=32)
    weight = torch.nn.Parameter(torch.randn(10, 32) * 0.01)
    opt = torch.optim.Adam([*model.parameters(), weight], lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        order = torch.randperm(len(data.train), generator=gen)
        for i in range(0, len(order), 128):
            b = order[i : i + 128]
            logits = 16 * model(data.train.x[b]) @ F.normalize(weight, dim=1).T
            loss = F.cross_entropy(logits, data.train.y[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        ref, query = model(data.train.x), model(data.test.x)
    nearest = data.train.y[(query @ ref.T).argmax(1)]
    assert float((nearest == data.test.y).double().mean()) >= 0.85
