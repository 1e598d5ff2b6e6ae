"""marginkit serve with a speaker bundle: wav / flac uploads on /enroll, /verify, /identify, /embed,
and every bad audio upload a 4xx naming the fault. The bundle is a tiny ECAPA-TDNN trained for one
epoch on synthetic speakers (marginkit.audio.synthetic) and exported to ONNX (fbank in the graph)."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("onnxscript")
pytest.importorskip("onnxruntime")
sf = pytest.importorskip("soundfile")
soxr = pytest.importorskip("soxr")
from fastapi.testclient import TestClient  # noqa: E402

from marginkit.audio.synthetic import (  # noqa: E402
    synthetic_speakers,
    voiced_utterance,
    write_speaker_folder,
)
from marginkit.gallery import Gallery  # noqa: E402
from marginkit.serve import Limits, create_app  # noqa: E402

RATE = 16000
LIMITS = Limits(max_body_bytes=200_000, max_batch=8, max_audio_seconds=3.0)


@pytest.fixture(scope="module")
def speaker_run(tmp_path_factory):
    from marginkit.train.config import TrainConfig
    from marginkit.train.trainer import train

    root = tmp_path_factory.mktemp("speakers")
    write_speaker_folder(root, synthetic_speakers(10, seed=1), 3, seconds=(0.7, 1.1), seed=2)
    run = tmp_path_factory.mktemp("speaker-run") / "run"
    config = TrainConfig(
        data=f"audio:{root}", loss="cosface", model="ecapa_tdnn", embedding_dim=8, epochs=1, batch_size=8,
        num_threads=1, k=1, data_options={"crop_seconds": 0.5},
        model_options={"channels": 16, "aggregation_channels": 24, "num_bins": 24},
    )  # fmt: skip
    train(config, run, quiet=True, report=False)
    return run


@pytest.fixture(scope="module")
def audio_bundle(speaker_run, tmp_path_factory):
    from marginkit.export import export_model

    return export_model(speaker_run, "onnx", tmp_path_factory.mktemp("audio-bundle") / "onnx")


@pytest.fixture
def served(audio_bundle, tmp_path):
    gallery = Gallery(tmp_path / "g.db", audio_bundle, far=None, threshold=0.5)
    with TestClient(create_app(audio_bundle, gallery, limits=LIMITS)) as client:
        yield client, gallery


def wave_of(speaker: int, seconds: float = 0.8, seed: int = 0) -> np.ndarray:
    return voiced_utterance(synthetic_speakers(10, seed=1)[speaker], seconds, np.random.default_rng(seed))


def encoded(wave: np.ndarray, rate: int = RATE, fmt: str = "WAV", subtype: str = "PCM_16") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, wave, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def upload(data: bytes, name: str = "a.wav") -> dict:
    return {"file": (name, data, "application/octet-stream")}


def decoded(data: bytes) -> np.ndarray:
    """The file's samples as libsndfile reads them, a batch of one."""
    return sf.read(io.BytesIO(data), dtype="float32")[0][None]


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def test_bundle_records_audio_input_and_embeds_any_length(audio_bundle, speaker_run):
    from marginkit.train.rundir import load_run

    inp = audio_bundle.manifest["input"]
    assert inp["kind"] == "audio" and inp["sample_rate"] == RATE and inp["shape"] == [8000]
    assert audio_bundle.sample_rate == RATE and 0 < audio_bundle.min_samples < 8000
    model = load_run(speaker_run)["model"]
    for seconds in (0.3, 1.7):  # other lengths than the training crop: the time axis is dynamic
        wave = wave_of(0, seconds)[None]
        with torch.no_grad():
            want = model(torch.from_numpy(wave)).numpy()
        np.testing.assert_allclose(audio_bundle.embed(wave).numpy(), want, atol=2e-5)
    with pytest.raises(ValueError, match="needs >= "):
        audio_bundle.embed(np.zeros((1, audio_bundle.min_samples - 1), np.float32))


def test_health_says_audio_and_rate(served):
    client, _ = served
    model = client.get("/health").json()["model"]
    assert model["input_kind"] == "audio" and model["sample_rate"] == RATE


def test_enroll_verify_identify_embed_from_wav_and_flac(served, audio_bundle):
    client, gallery = served
    a0, a1, b0 = wave_of(0, 0.9, 1), wave_of(0, 0.8, 2), wave_of(5, 0.8, 3)
    r = client.post("/embed", files=upload(encoded(a0)))
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(
        r.json()["embeddings"], audio_bundle.embed(decoded(encoded(a0))).numpy(), atol=1e-5
    )
    assert "x-marginkit-input" not in r.headers  # mono at the model's rate: nothing done to it
    flac = encoded(a1, fmt="FLAC")
    r = client.post("/embed", files=upload(flac, "a.flac"))
    np.testing.assert_allclose(r.json()["embeddings"], audio_bundle.embed(decoded(flac)).numpy(), atol=1e-5)

    r = client.post("/enroll", files=upload(encoded(a0)), data={"identity": "alice"})
    assert r.status_code == 200, r.text
    assert r.json()["enrolled"] == [{"identity": "alice", "added": 1, "templates": 1}]
    r = client.post("/enroll?identity=bob", content=encoded(b0), headers={"content-type": "audio/wav"})
    assert r.status_code == 200, r.text
    assert len(gallery) == 2

    r = client.post("/verify", files=upload(flac, "a.flac"), data={"identity": "alice"})
    assert r.status_code == 200, r.text
    got = r.json()["results"][0]
    want = (
        unit(audio_bundle.embed(decoded(encoded(a0))).numpy())
        @ unit(audio_bundle.embed(decoded(flac)).numpy()).T
    )[0, 0]
    assert got["identity"] == "alice" and got["score"] == pytest.approx(want, abs=1e-5)
    assert got["match"] == (got["score"] > got["threshold"])

    r = client.post("/identify?k=2", content=flac, headers={"content-type": "audio/flac"})
    assert r.status_code == 200, r.text
    cands = r.json()["results"][0]["candidates"]
    assert {c["identity"] for c in cands} == {"alice", "bob"}
    assert next(c for c in cands if c["identity"] == "alice")["score"] == pytest.approx(want, abs=1e-5)


def test_stereo_takes_channel_0_and_other_rates_are_resampled(served, audio_bundle):
    client, _ = served
    wave = wave_of(2, 0.8, 4)
    noise = np.random.default_rng(0).uniform(-0.5, 0.5, wave.size).astype(np.float32)
    stereo = np.stack([wave, noise], axis=1)
    r = client.post("/embed", files=upload(encoded(stereo, subtype="FLOAT")))
    assert r.status_code == 200, r.text
    assert "2 channels: channel 0 kept" in r.headers["x-marginkit-input"]
    np.testing.assert_allclose(r.json()["embeddings"], audio_bundle.embed(wave[None]).numpy(), atol=1e-5)

    slow = voiced_utterance(synthetic_speakers(10, seed=1)[2], 0.8, np.random.default_rng(5), 8000)
    r = client.post("/embed", files=upload(encoded(slow, 8000, subtype="FLOAT")))
    assert r.status_code == 200, r.text
    assert "resampled from 8000 Hz to 16000 Hz" in r.headers["x-marginkit-input"]
    want = soxr.resample(slow, 8000, RATE, quality="HQ").astype(np.float32)  # the library io.py names
    np.testing.assert_allclose(r.json()["embeddings"], audio_bundle.embed(want[None]).numpy(), atol=1e-5)


def _bad_audio(min_samples: int) -> list[tuple[str, bytes, int, str]]:
    wave = wave_of(1, 0.5)
    nan = wave.copy()
    nan[100] = np.nan
    ok = encoded(wave)
    return [
        ("text", b"hello, not audio at all", 415, "not an audio file"),
        ("png", b"\x89PNG\r\n\x1a\n" + bytes(64), 415, "not an audio file"),
        ("empty file", b"", 415, "empty"),
        ("0 samples", encoded(np.zeros(0, np.float32)), 422, "0 samples"),
        ("NaN", encoded(nan, subtype="FLOAT"), 422, "NaN or infinite sample at frame 100"),
        ("too long", encoded(np.zeros(4 * RATE, np.float32), subtype="PCM_U8"), 413, r"over the 3 s limit"),
        ("too big", encoded(np.zeros(120_000, np.float32)), 413, "limit"),
        ("truncated", ok[: len(ok) // 2], 422, "truncated"),
        ("too short", encoded(wave[: min_samples - 1]), 422, f"needs >= {min_samples}"),
    ]


def test_every_bad_audio_upload_is_a_4xx_naming_the_fault(served, audio_bundle):
    client, gallery = served
    for what, data, status, match in _bad_audio(audio_bundle.min_samples):
        for kwargs in (
            {"files": upload(data), "data": {"identity": "x"}},
            {"content": data, "headers": {"content-type": "audio/wav"}, "params": {"identity": "x"}},
        ):
            for path in ("/enroll", "/verify"):
                r = client.post(path, **kwargs)
                assert r.status_code == status, (what, path, r.status_code, r.text[:300])
                assert re.search(match, r.json()["detail"]), (what, r.json()["detail"])
    assert len(gallery) == 0


def test_audio_body_to_an_image_bundle_is_refused(onnx_bundle, tmp_path):
    gallery = Gallery(tmp_path / "g.db", onnx_bundle, far=1e-2)
    with TestClient(create_app(onnx_bundle, gallery, limits=LIMITS)) as client:
        r = client.post("/embed", content=encoded(wave_of(0)), headers={"content-type": "audio/wav"})
        assert r.status_code == 415 and "does not take audio" in r.json()["detail"]
        r = client.post("/embed", files=upload(encoded(wave_of(0))))
        assert r.status_code in (415, 422), r.text
