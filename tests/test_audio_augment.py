"""Audio augmentation (marginkit.audio.augment): seeded per (seed, epoch, index) in the workers' read,
the same batch for 0 and 2 workers, never at evaluation; speed, noise and reverberation checked
against independent computations; bad noise / RIR folders named; SpecAugment in training mode only
and absent from the ONNX graph."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from marginkit.audio.augment import AudioAugment, attach, spec_mask
from marginkit.audio.ecapa_tdnn import ECAPATDNN
from marginkit.audio.io import read_audio, read_crop
from marginkit.audio.sources import read_audio_folder
from marginkit.audio.synthetic import synthetic_speakers, write_speaker_folder
from marginkit.data.augment import augment_options
from marginkit.data.loading import Loader, ShuffledBatches

sf = pytest.importorskip("soundfile")
pytest.importorskip("soxr")
RATE = 16000


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("aug")
    speakers = base / "speakers"
    write_speaker_folder(speakers, synthetic_speakers(6, seed=3), 3, seconds=(0.6, 1.0), seed=4)
    rng = np.random.default_rng(0)
    noise = base / "noise" / "free-sound"  # MUSAN-like nesting
    noise.mkdir(parents=True)
    for i in range(2):
        sf.write(noise / f"n{i}.wav", rng.normal(0, 0.1, RATE // 2).astype(np.float32), RATE)
    rir = base / "rir"
    rir.mkdir()
    decay = np.exp(-np.arange(2000) / 300) * rng.normal(0, 1, 2000)
    sf.write(rir / "room.flac", decay.astype(np.float32), RATE, subtype="PCM_24")
    return base, speakers


def augmented_source(speakers, base, options):
    raw = read_audio_folder(speakers, crop_seconds=0.4, test_fraction=1 / 3, split_seed=0)
    source = raw.x_train
    source.augment = AudioAugment(options, noise_dir=base / "noise", rir_dir=base / "rir")
    return source, torch.as_tensor(raw.y_train)


def first_batches(source, labels, workers: int, epoch: int = 0) -> list[torch.Tensor]:
    loader = Loader(source, labels, ShuffledBatches(len(labels), 4, seed=1), workers=workers, seed=7)
    try:
        return [b.x.clone() for b in loader.epoch(epoch)][:3]
    finally:
        loader.close()


def test_same_seed_same_augmented_batches_for_0_and_2_workers(folders):
    base, speakers = folders
    options = {"speed": 0.7, "noise": 0.5, "reverb": 0.5}
    source, labels = augmented_source(speakers, base, options)
    zero = first_batches(source, labels, 0)
    two = first_batches(source, labels, 2)
    assert all(torch.equal(a, b) for a, b in zip(zero, two, strict=True))
    again = first_batches(source, labels, 0)  # a fresh reader: nothing but (seed, epoch, index) counts
    assert all(torch.equal(a, b) for a, b in zip(zero, again, strict=True))
    assert not torch.equal(zero[0], first_batches(source, labels, 0, epoch=1)[0])
    source.augment = None
    plain = first_batches(source, labels, 0)
    assert not any(torch.equal(a, b) for a, b in zip(zero, plain, strict=True))  # it did augment


def test_evaluation_reads_are_never_augmented(folders):
    base, speakers = folders
    source, _ = augmented_source(speakers, base, {"speed": 1.0, "noise": 1.0, "reverb": 1.0})
    for i in range(len(source)):
        np.testing.assert_array_equal(source.read(i), read_audio(source.where(i), RATE))


def test_speed_perturbation_scales_the_pitch_by_0_9_or_1_1(tmp_path):
    t = np.arange(RATE) / RATE
    sf.write(
        tmp_path / "tone.wav", (0.5 * np.sin(2 * np.pi * 400 * t)).astype(np.float32), RATE, subtype="FLOAT"
    )
    aug = AudioAugment({"speed": 1.0})
    seen = set()
    for seed in range(8):
        crop = aug.read(str(tmp_path / "tone.wav"), RATE, 8000, np.random.default_rng(seed))
        peak = np.argmax(np.abs(np.fft.rfft(crop * np.hanning(crop.size)))) * RATE / crop.size
        seen.add(round(peak / 400, 2))
    assert seen == {0.9, 1.1}  # 360 Hz or 440 Hz: a sped-up read, each factor drawn


def test_noise_at_an_snr_in_0_to_15_db_and_a_delta_rir_leaves_the_crop(folders, tmp_path):
    base, speakers = folders
    path = str(next(speakers.rglob("*.wav")))
    aug = AudioAugment({"noise": 1.0}, noise_dir=base / "noise")
    snrs = []
    for seed in range(6):
        noisy = aug.read(path, RATE, 4000, np.random.default_rng(seed))
        rng = np.random.default_rng(seed)
        rng.random(3)  # the augmentation's first draws, then the same crop
        clean = read_crop(path, RATE, 4000, rng)
        added = noisy - clean
        snrs.append(
            10 * np.log10(np.mean(clean.astype(np.float64) ** 2) / np.mean(added.astype(np.float64) ** 2))
        )
    assert all(-1e-3 <= s <= 15 + 1e-3 for s in snrs) and np.ptp(snrs) > 1
    rir = tmp_path / "rir"
    rir.mkdir()
    delayed = np.zeros(100, np.float32)
    delayed[7] = 0.3  # a pure delay of 7 samples: the crop shifted, rescaled to its own peak
    sf.write(rir / "delay.wav", delayed, RATE, subtype="FLOAT")
    aug = AudioAugment({"reverb": 1.0}, rir_dir=rir)
    out = aug.read(path, RATE, 4000, np.random.default_rng(0))
    rng = np.random.default_rng(0)
    rng.random(3)
    clean = read_crop(path, RATE, 4000, rng)
    want = np.concatenate([np.zeros(7, np.float32), clean[:-7]])
    want *= np.abs(clean).max() / np.abs(want).max()
    np.testing.assert_allclose(out, want, atol=1e-5)


def test_bad_noise_and_rir_folders_are_named(folders, tmp_path):
    _, speakers = folders
    source = read_audio_folder(speakers, crop_seconds=0.4, test_fraction=1 / 3).x_train
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"data_options.noise_dir '.*empty' holds no .wav or .flac"):
        attach(source, None, {"noise": 0.3}, {"noise_dir": str(empty)})
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "not-audio.wav").write_text("this is text, not a wav file\n")
    with pytest.raises(ValueError, match=r"data_options.rir_dir: .*not-audio.wav"):
        attach(source, None, {"reverb": 0.3}, {"rir_dir": str(bad)})
    with pytest.raises(ValueError, match=r"data_options.noise_dir=DIR"):
        attach(source, None, {"noise": 0.3}, {})
    with pytest.raises(ValueError, match=r"not a folder"):
        attach(source, None, {"noise": 0.3}, {"noise_dir": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match="flip do"):
        attach(source, None, augment_options("flip,speed"), {})
    assert source.augment is None  # nothing attached by a refused call


def test_options_take_wespeakers_defaults():
    assert augment_options("speed,noise,reverb,spec_mask") == {
        "speed": pytest.approx(2 / 3), "noise": 0.3, "reverb": 0.3, "spec_mask": 0.6,
    }  # fmt: skip


def test_spec_mask_masks_one_band_and_one_span_per_utterance():
    torch.manual_seed(0)
    feats = torch.randn(64, 50, 24) + 10.0  # no zero before masking
    out = spec_mask(feats, 1.0)
    zero = out == 0
    for row in zero:  # bins masked in every frame and frames masked in every bin: at most 8 and 10
        bins = torch.nonzero(row.all(dim=0)).flatten()
        frames = torch.nonzero(row.all(dim=1)).flatten()
        assert len(bins) <= 8 and len(frames) <= 10
        if len(bins):
            assert int(bins[-1] - bins[0]) + 1 == len(bins)  # one contiguous band
        if len(frames):
            assert int(frames[-1] - frames[0]) + 1 == len(frames)
        expect = torch.zeros_like(row)
        expect[:, bins] = True
        expect[frames, :] = True
        assert torch.equal(row, expect)  # nothing else zeroed
    assert zero.any() and torch.equal(spec_mask(feats, 0.0), feats)


def tiny_model() -> ECAPATDNN:
    torch.manual_seed(0)
    model = ECAPATDNN((8000,), 8, True, channels=16, aggregation_channels=24, num_bins=24, dither=0.0)
    model.spec_augment = 1.0
    return model


def test_spec_augment_only_in_training_mode():
    model = tiny_model()
    wave = torch.randn(3, 8000) * 0.1
    model.eval()
    with torch.no_grad():
        masked_eval = model(wave)
        model.spec_augment = 0.0
        plain = model(wave)
    assert torch.equal(masked_eval, plain)
    model.train()
    model.spec_augment = 1.0
    torch.manual_seed(1)
    a = model(wave)
    model.spec_augment = 0.0
    b = model(wave)
    assert not torch.allclose(a, b)


def test_spec_augment_absent_from_the_onnx_export(tmp_path):
    pytest.importorskip("onnxscript")
    onnx = pytest.importorskip("onnx")
    from marginkit.export.model_file import load_model_file, write_model_file

    model = tiny_model().train()  # the writer exports eval mode whatever the module's mode
    write_model_file(model, (8000,), tmp_path / "m.onnx", "onnx")
    graph = onnx.load(str(tmp_path / "m.onnx")).graph
    ops = {n.op_type for n in graph.node}
    for fn in onnx.load(str(tmp_path / "m.onnx")).functions:
        ops |= {n.op_type for n in fn.node}
    assert not {o for o in ops if o.startswith("Random")}, ops
    wave = (torch.randn(2, 6000) * 0.1).numpy()
    model.eval()
    with torch.no_grad():
        want = model(torch.from_numpy(wave)).numpy()
    np.testing.assert_allclose(load_model_file(tmp_path / "m.onnx", "onnx")(wave), want, atol=2e-5)


def test_an_augmented_run_resumes_bit_identically_with_any_worker_count(folders, tmp_path):
    """``marginkit train --augment speed,noise,reverb,spec_mask`` on audio: stopped after epoch 1 and
    resumed with 2 workers, it ends with the weights of an uninterrupted run with none; a run
    without augmentation ends elsewhere (so the augmentation took part)."""
    from marginkit.cli import main

    base, speakers = folders
    common = ["train", "--data", f"audio:{speakers}", "--model", "ecapa_tdnn", "--loss", "cosface",
              "--epochs", "2", "--batch-size", "4", "--set", "model_options.channels=16",
              "--set", "model_options.aggregation_channels=24", "--set", "model_options.num_bins=24",
              "--set", "data_options.crop_seconds=0.4", "--set", f"data_options.noise_dir={base / 'noise'}",
              "--set", f"data_options.rir_dir={base / 'rir'}", "--set", "data_options.test_fraction=0.34",
              "--no-report", "-q"]  # fmt: skip
    augment = ["--augment", "speed,noise,reverb,spec_mask"]
    assert main([*common, *augment, "--workers", "0", "--out", str(tmp_path / "whole")]) == 0
    assert (
        main([*common, *augment, "--workers", "0", "--out", str(tmp_path / "cut"), "--stop-after", "1"]) == 0
    )
    assert (
        main(["train", "--resume", "--out", str(tmp_path / "cut"), "--workers", "2", "-q", "--no-report"])
        == 0
    )
    assert main([*common, "--workers", "0", "--out", str(tmp_path / "plain")]) == 0

    def weights(run: str) -> dict[str, torch.Tensor]:
        return torch.load(tmp_path / run / "last.pt", weights_only=True)["model"]

    whole, cut, plain = weights("whole"), weights("cut"), weights("plain")
    assert all(torch.equal(whole[k], cut[k]) for k in whole)
    assert not all(torch.equal(whole[k], plain[k]) for k in whole)
