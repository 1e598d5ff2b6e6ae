"""Speaker backbones: wespeaker's exact parameter counts, shapes, variable lengths, export."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from marginkit.audio.ecapa_tdnn import ECAPATDNN
from marginkit.audio.fbank import KaldiFbank
from marginkit.audio.pooling import AttentiveStatisticsPooling, StatisticsPooling
from marginkit.audio.resnet import SpeakerResNet


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("channels", "expected"), [(512, 6_190_720), (1024, 14_657_088)])
def test_ecapa_tdnn_parameter_counts_equal_wespeakers(channels: int, expected: int) -> None:
    with torch.device("meta"):
        model = ECAPATDNN((32000,), 192, True, channels=channels)
    assert count(model) == expected


def test_resnet34_parameter_count_equals_wespeakers() -> None:
    with torch.device("meta"):
        model = SpeakerResNet((32000,), 256, True)
    assert count(model) == 6_634_336


def small_models() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [
        ECAPATDNN((8000,), 24, True, channels=32, aggregation_channels=48, num_bins=24),
        SpeakerResNet((8000,), 24, True, width=4, blocks=(1, 1, 1, 1), num_bins=24),
    ]


@pytest.mark.parametrize("index", [0, 1])
def test_waveforms_of_any_length_and_fbank_input(index: int) -> None:
    model = small_models()[index].eval()
    for n in (model.min_samples, 8000, 12345):
        out = model(0.1 * torch.randn(3, n))
        assert out.shape == (3, 24)
        torch.testing.assert_close(out.norm(dim=1), torch.ones(3))
    # The front-end inside equals the front-end outside: the same model on fbank input.
    wave = 0.1 * torch.randn(2, 9000)
    feats = KaldiFbank(num_bins=24).eval()(wave)
    outside = type(model)((56, 24), 24, True, frontend="none", num_bins=24, **_arch(model)).eval()
    outside.load_state_dict(model.state_dict())
    torch.testing.assert_close(outside(feats), model(wave))
    with pytest.raises(ValueError, match=f"needs >= {model.min_samples} samples"):
        model(torch.zeros(1, model.min_samples - 1))
    with pytest.raises(ValueError, match=r"expects fbank features \[B, frames, 24\]"):
        outside(torch.zeros(1, 50, 80))


def _arch(model: torch.nn.Module) -> dict[str, object]:
    keep = ("channels", "aggregation_channels", "width", "blocks")
    return {k: v for k, v in model.config.items() if k in keep}


@pytest.mark.parametrize("index", [0, 1])
def test_training_step_and_freezing(index: int) -> None:
    model = small_models()[index].train()
    out = model(0.1 * torch.randn(4, 8000))
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    model.freeze(2)
    frozen = [p for m in model.stage_modules()[:2] for p in m.parameters()]
    assert frozen and not any(p.requires_grad for p in frozen)
    model.set_grad_checkpointing(True)
    model.zero_grad()
    model(0.1 * torch.randn(4, 8000)).sum().backward()
    assert model.projection.weight.grad is not None


def test_pooling_statistics() -> None:
    x = torch.randn(2, 5, 7, dtype=torch.float64)
    out = StatisticsPooling(5)(x)
    torch.testing.assert_close(out[:, :5], x.mean(-1))
    torch.testing.assert_close(out[:, 5:], (x.var(-1) + 1e-8).sqrt())
    pool = AttentiveStatisticsPooling(5, bottleneck=3).double()
    # Zero attention weights give uniform attention: the plain (biased) mean and deviation.
    for p in pool.parameters():
        torch.nn.init.zeros_(p)
    out = pool(x)
    torch.testing.assert_close(out[:, :5], x.mean(-1))
    torch.testing.assert_close(out[:, 5:], x.var(-1, unbiased=False).sqrt())


@pytest.mark.slow
@pytest.mark.parametrize("index", [0, 1])
def test_onnx_export_waveform_in_embedding_out(tmp_path, index: int) -> None:
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    model = small_models()[index].eval()
    example = 0.1 * torch.randn(2, 8000)
    time = torch.export.Dim("time", min=model.min_input_length)
    program = torch.onnx.export(
        model, (example,), input_names=["x"], output_names=["embedding"], dynamo=True, verbose=False,
        dynamic_shapes={"x": {0: torch.export.Dim("batch"), model.variable_axes[0]: time}},
    )  # fmt: skip
    program.save(tmp_path / "m.onnx")
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    for n in (8000, 11111):
        wave = (0.1 * np.random.default_rng(n).standard_normal((3, n))).astype(np.float32)
        (got,) = session.run(None, {"x": wave})
        with torch.no_grad():
            np.testing.assert_allclose(got, model(torch.from_numpy(wave)).numpy(), atol=2e-5)


def test_registered_with_build_model() -> None:
    import marginkit.audio  # noqa: F401  (registers the speaker backbones)
    from marginkit.models import build_model, model_options

    assert {"channels", "frontend", "window", "dither"} <= set(model_options("ecapa_tdnn"))
    model = build_model("speaker_resnet34", (8000,), embedding_dim=16, width=4, blocks=[1, 1, 1, 1])
    assert model.name == "speaker_resnet34" and model.config["name"] == "speaker_resnet34"
    clone = build_model(**model.config)
    clone.load_state_dict(model.state_dict())
    wave = 0.1 * torch.randn(2, 8000)
    torch.testing.assert_close(clone.eval()(wave), model.eval()(wave))
    with pytest.raises(ValueError, match="unknown option 'chanels'.*did you mean 'channels'"):
        build_model("ecapa_tdnn", (8000,), chanels=8)
