"""Reading audio files (marginkit.audio.io) and the audio: sources (marginkit.audio.sources)."""

from __future__ import annotations

import pickle
import tracemalloc

import numpy as np
import pytest

from marginkit.audio.io import audio_info, read_audio, read_crop
from marginkit.audio.sources import AudioFiles, read_audio_folder, read_audio_source, read_wav_scp
from marginkit.audio.synthetic import synthetic_speakers, voiced_utterance, write_speaker_folder
from marginkit.data.samples import BadSampleError, concat_samples

sf = pytest.importorskip("soundfile")


def tone(n: int = 16000, rate: int = 16000, freq: float = 440.0) -> np.ndarray:
    return (0.5 * np.sin(2 * np.pi * freq * np.arange(n) / rate)).astype(np.float32)


@pytest.mark.parametrize(
    ("fmt", "subtype", "atol"),
    [("WAV", "PCM_16", 2**-15), ("WAV", "PCM_24", 2**-23), ("WAV", "FLOAT", 0.0), ("FLAC", "PCM_16", 2**-15),
     ("FLAC", "PCM_24", 2**-23), ("WAV", "PCM_32", 2**-31)],
)  # fmt: skip
def test_formats_round_trip(tmp_path, fmt: str, subtype: str, atol: float) -> None:
    wave = tone()
    path = tmp_path / f"a.{fmt.lower()}"
    sf.write(path, wave, 16000, subtype=subtype, format=fmt)
    got = read_audio(path, 16000)
    assert got.dtype == np.float32 and got.shape == wave.shape
    np.testing.assert_allclose(got, wave, atol=atol + 1e-7)


def test_channels_first_by_default_or_mean(tmp_path) -> None:
    stereo = np.stack([tone(), tone(freq=220.0)], axis=1)
    path = tmp_path / "stereo.wav"
    sf.write(path, stereo, 16000, subtype="FLOAT")
    np.testing.assert_array_equal(read_audio(path, 16000), stereo[:, 0])
    np.testing.assert_array_equal(read_audio(path, 16000, channel=1), stereo[:, 1])
    np.testing.assert_allclose(read_audio(path, 16000, channel="mean"), stereo.mean(axis=1), atol=1e-7)
    with pytest.raises(BadSampleError, match="has 2 channel"):
        read_audio(path, 16000, channel=2)


def test_resampling_with_soxr_or_a_refusal(tmp_path) -> None:
    path = tmp_path / "a44.wav"
    sf.write(path, tone(44100, rate=44100, freq=300.0), 44100, subtype="FLOAT")
    got = read_audio(path, 16000)
    assert got.size == 16000
    # The tone survives: its frequency is found where it should be at the new rate.
    spectrum = np.abs(np.fft.rfft(got * np.hanning(got.size)))
    assert abs(np.argmax(spectrum) * 16000 / got.size - 300.0) < 2.0
    with pytest.raises(BadSampleError, match="sampled at 44100 Hz, the model takes 16000 Hz"):
        read_audio(path, 16000, resample=False)
    crop = read_crop(path, 16000, 8000, np.random.default_rng(0))
    assert crop.shape == (8000,)


def test_crop_reads_only_its_frames(tmp_path) -> None:
    """A crop of a long file costs the crop's memory: 2 s of a 10 min file allocate ~2 s."""
    path = tmp_path / "long.flac"
    minutes = 10
    with sf.SoundFile(path, "w", 16000, 1, subtype="PCM_16", format="FLAC") as f:
        for _ in range(minutes * 6):
            f.write(tone(160000))
    info = audio_info(path)
    assert info.frames == minutes * 60 * 16000
    tracemalloc.start()
    crop = read_crop(path, 16000, 32000, np.random.default_rng(1), info=info)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert crop.shape == (32000,)
    assert peak < 8 * 32000 * 4  # the whole file as float32 would be 38 MB
    # Seeded: the same generator state gives the same crop, another a different one.
    again = read_crop(path, 16000, 32000, np.random.default_rng(1), info=info)
    np.testing.assert_array_equal(crop, again)


def test_crop_of_a_short_file_repeats_it(tmp_path) -> None:
    path = tmp_path / "short.wav"
    wave = tone(5000)
    sf.write(path, wave, 16000, subtype="FLOAT")
    crop = read_crop(path, 16000, 12000, np.random.default_rng(0))
    assert crop.shape == (12000,)
    tiled = np.tile(wave, 4)
    starts = [s for s in range(tiled.size - 12000 + 1) if np.array_equal(tiled[s : s + 12000], crop)]
    assert starts


def test_bad_inputs_name_the_file(tmp_path) -> None:
    text = tmp_path / "notes.wav"
    text.write_text("not audio at all")
    with pytest.raises(BadSampleError, match="notes.wav: not an audio file"):
        audio_info(text)
    empty = tmp_path / "empty.wav"
    sf.write(empty, np.zeros(0, np.float32), 16000)
    with pytest.raises(BadSampleError, match="empty.wav: the file holds 0 samples"):
        read_audio(empty, 16000)
    nan = tmp_path / "nan.wav"
    wave = tone()
    wave[1234] = np.nan
    sf.write(nan, wave, 16000, subtype="FLOAT")
    with pytest.raises(BadSampleError, match="nan.wav: NaN or infinite sample at frame 1234"):
        read_audio(nan, 16000)
    full = tmp_path / "full.wav"
    sf.write(full, tone(), 16000, subtype="PCM_16")
    data = full.read_bytes()
    cut = tmp_path / "cut.wav"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(BadSampleError, match="cut.wav: truncated"):
        read_audio(cut, 16000)
    flac = tmp_path / "full.flac"
    sf.write(
        flac, np.random.default_rng(0).uniform(-0.5, 0.5, 32000).astype(np.float32), 16000, format="FLAC"
    )
    cut_flac = tmp_path / "cut.flac"
    cut_flac.write_bytes(flac.read_bytes()[: flac.stat().st_size // 2])
    with pytest.raises(BadSampleError, match="cut.flac: "):
        read_audio(cut_flac, 16000)
    with pytest.raises(BadSampleError, match="missing.wav: no such file"):
        audio_info(tmp_path / "missing.wav")


def test_missing_soundfile_names_the_extra(monkeypatch) -> None:
    import builtins

    import marginkit.audio.io as io

    real_import = builtins.__import__

    def no_soundfile(name, *args, **kwargs):
        if name == "soundfile":
            raise ImportError("No module named 'soundfile'")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(__import__("sys").modules, "soundfile")
    monkeypatch.setattr(builtins, "__import__", no_soundfile)
    with pytest.raises(ImportError, match=r"marginkit\[audio\]"):
        io.soundfile_module()


# ----------------------------------------------------------------------------------------- sources


@pytest.fixture(scope="module")
def speaker_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("speakers")
    write_speaker_folder(root, synthetic_speakers(6, seed=1), 3, seconds=(0.5, 1.0), seed=2)
    return root


def test_folder_source(speaker_dir) -> None:
    raw = read_audio_folder(speaker_dir, crop_seconds=0.25, test_fraction=1 / 3, split_seed=0)
    # speaker-disjoint; labels index all speakers, so load_dataset relabels them (training speakers first)
    assert raw.kind == "audio" and not np.isin(raw.y_test, raw.y_train).any()
    assert raw.class_names == [f"spk{i:03d}" for i in range(6)]
    x, y = raw.x_train, raw.y_train
    assert isinstance(x, AudioFiles) and x.kind == "audio" and x.sample_shape == ()
    assert len(x) == 12 and len(raw.x_test) == 6
    assert set(y.tolist()).isdisjoint(raw.y_test.tolist())  # speaker-disjoint
    # Relative paths are VoxCeleb-style, what trial lists name; labels follow the speaker folder.
    rel = x.relative_path(0)
    assert rel.count("/") == 2 and rel.endswith(".wav") and rel.split("/")[0] == raw.class_names[y[0]]
    crop = x.read(0, np.random.default_rng(0))
    assert crop.shape == (4000,) and crop.dtype == np.float32
    whole = x.read(0)
    assert whole.size >= 8000 and whole.size == audio_info(x.where(0)).frames
    np.testing.assert_array_equal(x.read(0, np.random.default_rng(0)), crop)
    # Views, concatenation and pickling (to DataLoader workers) keep rows and names.
    view = x[np.array([2, 0])]
    assert view.relative_path(1) == rel
    pooled = concat_samples([raw.x_train, raw.x_test])
    assert len(pooled) == 18
    clone = pickle.loads(pickle.dumps(view))
    np.testing.assert_array_equal(clone.read(1), whole)
    assert sorted(x.relative_paths().tolist() + raw.x_test.relative_paths().tolist()) == sorted(
        p.relative_to(speaker_dir).as_posix() for p in speaker_dir.rglob("*.wav")
    )


def test_named_test_speakers_through_a_class_split(speaker_dir) -> None:
    """``split=classes`` pools the speakers (the source holds none out) and tests those named:
    the way a trial list's speakers are kept out of training."""
    from marginkit.data import load_dataset
    from marginkit.train.sources import register_sources

    register_sources()
    data = load_dataset(
        f"audio:{speaker_dir}", split="classes", test_classes=["spk004", "spk005"], val_fraction=0.0,
        crop_seconds=0.25,
    )  # fmt: skip
    tested = {data.test.data.relative_path(i).split("/")[0] for i in range(len(data.test))}
    trained = {data.train.data.relative_path(i).split("/")[0] for i in range(len(data.train))}
    assert tested == {"spk004", "spk005"} and trained == {f"spk00{i}" for i in range(4)}
    assert data.open_set and data.num_classes == 4
    with pytest.raises(ValueError, match=r"test_fraction must lie in \[0, 1\)"):
        read_audio_folder(speaker_dir, test_fraction=1.0)


def test_folder_with_train_and_test_layout(tmp_path) -> None:
    speakers = synthetic_speakers(4, seed=3)
    write_speaker_folder(tmp_path / "train", speakers[:2], 2, seconds=(0.3, 0.4))
    write_speaker_folder(tmp_path / "test", speakers[2:], 2, seconds=(0.3, 0.4))
    raw = read_audio_source(str(tmp_path))
    assert len(raw.x_train) == 4 and len(raw.x_test) == 4
    assert raw.x_test.relative_path(0).startswith("test/")
    assert raw.info["split"].startswith("train/ and test/")


def test_a_corrupt_file_in_a_source_names_it(tmp_path) -> None:
    write_speaker_folder(tmp_path, synthetic_speakers(4), 2, seconds=(0.3, 0.4))
    bad = tmp_path / "spk001" / "sess0" / "00000.wav"
    bad.write_bytes(b"RIFF garbage")
    raw = read_audio_folder(tmp_path, test_fraction=0.5)
    pooled = concat_samples([raw.x_train, raw.x_test])
    rows = [i for i in range(len(pooled)) if pooled.where(i) == str(bad)]
    with pytest.raises(BadSampleError, match=r"spk001/sess0/00000\.wav: not an audio file"):
        pooled.read(rows[0])


def test_wav_scp_and_utt2spk(tmp_path, speaker_dir) -> None:
    files = sorted(speaker_dir.rglob("*.wav"))
    lines, spk = [], []
    for i, f in enumerate(files):
        utt = f.relative_to(speaker_dir).as_posix()
        location = str(f) if i % 2 else str(f.relative_to(speaker_dir))  # absolute and relative paths
        lines.append(f"{utt} {location}")
        spk.append(f"{utt} {utt.split('/')[0]}")
    scp = speaker_dir / "wav.scp"
    scp.write_text("\n".join(lines) + "\n")
    (speaker_dir / "utt2spk").write_text("\n".join(spk) + "\n")
    try:
        raw = read_audio_source(str(scp), test_fraction=1 / 3)
        pooled = concat_samples([raw.x_train, raw.x_test])
        assert len(pooled) == len(files)
        row = next(i for i in range(len(pooled)) if pooled.where(i).endswith("spk002/sess1/00001.wav"))
        assert pooled.relative_path(row) == "spk002/sess1/00001.wav"
        np.testing.assert_array_equal(
            pooled.read(row), read_audio(speaker_dir / "spk002/sess1/00001.wav", 16000)
        )
    finally:
        scp.unlink()
        (speaker_dir / "utt2spk").unlink()


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("u1 sox a.wav -t wav - |", "command pipe"),
        ("u1 raw.ark:1234", "Kaldi archive entry"),
        ("u1", "expected '<utterance-id> <wav.scp value>'"),
        ("u9 a.wav", "has no speaker"),
    ],
)
def test_wav_scp_refusals(tmp_path, line: str, message: str) -> None:
    marker = tmp_path / "ran"
    scp = tmp_path / "wav.scp"
    scp.write_text(line.replace("sox", f"touch {marker}; sox") + "\n")
    (tmp_path / "utt2spk").write_text("u1 s1\n")
    with pytest.raises(ValueError, match=message) as err:
        read_wav_scp(scp)
    assert "line 1" in str(err.value) and str(scp) in str(err.value)
    assert not marker.exists()


def test_synthetic_speakers_differ_by_pitch_and_formants() -> None:
    a, b = synthetic_speakers(2, seed=5)
    wave = voiced_utterance(a, 0.5, np.random.default_rng(0))
    assert wave.dtype == np.float32 and wave.shape == (8000,) and np.abs(wave).max() <= 0.5 + 1e-6
    assert (a.f0, a.formant_scale) != (b.f0, b.formant_scale)


def test_uploaded_bytes(tmp_path) -> None:
    from marginkit.audio.io import decode_audio_bytes

    path = tmp_path / "u.flac"
    sf.write(path, tone(8000), 16000, format="FLAC")
    body = path.read_bytes()
    np.testing.assert_allclose(decode_audio_bytes(body, 16000), tone(8000), atol=2**-15)
    with pytest.raises(BadSampleError, match="upload: not an audio file"):
        decode_audio_bytes(b"\x89PNG not audio", 16000)
    with pytest.raises(BadSampleError, match="upload: empty body"):
        decode_audio_bytes(b"", 16000)
    with pytest.raises(BadSampleError, match="over the 100-byte limit"):
        decode_audio_bytes(body, 16000, max_bytes=100)
    with pytest.raises(BadSampleError, match="over the 0.1 s limit"):
        decode_audio_bytes(body, 16000, max_seconds=0.1)
    nan = tmp_path / "n.wav"
    wave = tone(800)
    wave[5] = np.inf
    sf.write(nan, wave, 16000, subtype="FLOAT")
    with pytest.raises(BadSampleError, match="NaN or infinite sample at frame 5"):
        decode_audio_bytes(nan.read_bytes(), 16000)
    empty = tmp_path / "e.wav"
    sf.write(empty, np.zeros(0, np.float32), 16000)
    with pytest.raises(BadSampleError, match="0 samples"):
        decode_audio_bytes(empty.read_bytes(), 16000)
    wav = tmp_path / "w.wav"
    sf.write(wav, tone(), 16000, subtype="PCM_16")
    with pytest.raises(BadSampleError, match="truncated"):
        decode_audio_bytes(wav.read_bytes()[:9000], 16000)


# ------------------------------------------------------------------------------- audio:FILE.csv


def _manifest(path, rows, header="path,label,split") -> None:
    path.write_text(header + "\n" + "\n".join(",".join(r) for r in rows) + "\n")


def test_csv_manifest_of_utterances(tmp_path, speaker_dir) -> None:
    """``audio:FILE.csv``: csv:'s convention (path, label, split) listing audio; the speaker is the
    label, a row's name is its path as written (what a trial list names)."""
    from marginkit.audio.sources import read_audio_files, read_audio_manifest
    from marginkit.data import load_dataset
    from marginkit.train.sources import register_sources

    files = sorted(speaker_dir.rglob("*.wav"))
    rows = []
    for i, f in enumerate(files):
        rel = f.relative_to(speaker_dir).as_posix()
        speaker = rel.split("/")[0]
        side = "test" if speaker in ("spk004", "spk005") else "train"
        # relative to the CSV's folder, or absolute
        rows.append((rel if i % 2 else str(f), f"person-{speaker}", side))
    csv_file = speaker_dir / "utterances.csv"
    _manifest(csv_file, rows)
    try:
        raw = read_audio_source(str(csv_file), crop_seconds=0.25)
        assert raw.kind == "audio" and raw.info["split"].startswith(
            "the manifest's train / validation / test"
        )
        assert raw.class_names == [f"person-spk00{i}" for i in range(6)]
        assert len(raw.x_train) == 12 and len(raw.x_test) == 6
        test_speakers = {raw.class_names[c] for c in raw.y_test.tolist()}
        assert test_speakers == {"person-spk004", "person-spk005"}
        names = raw.x_train.relative_paths().tolist() + raw.x_test.relative_paths().tolist()
        assert sorted(names) == sorted(r[0] for r in rows)
        row = names.index(rows[3][0])
        pooled = concat_samples([raw.x_train, raw.x_test])
        np.testing.assert_array_equal(pooled.read(row), read_audio(files[3], 16000))
        assert pooled.read(row, np.random.default_rng(0)).shape == (4000,)
        # The trial-list reader lists the same utterances, whole and unsplit.
        listed, y, speakers = read_audio_files(str(csv_file))
        assert len(listed) == 18 and speakers == raw.class_names and listed.crop_seconds is None
        assert sorted(y.tolist()) == sorted(raw.y_train.tolist() + raw.y_test.tolist())
        # Through load_dataset (the trainer's path).
        register_sources()
        data = load_dataset(f"audio:{csv_file}", crop_seconds=0.25, val_fraction=0.0)
        assert data.open_set and data.num_classes == 4 and len(data.test) == 6

        # train rows only: the speakers are split, as for audio:DIR
        _manifest(csv_file, [(r[0], r[1], "train") for r in rows])
        raw = read_audio_manifest(csv_file, test_fraction=1 / 3, split_seed=0)
        assert raw.info["split"].startswith("speaker-disjoint") and len(raw.x_test) == 6
        assert set(raw.y_test.tolist()).isdisjoint(raw.y_train.tolist())
        # OML's convention: validation rows are the test split when no row is 'test'
        _manifest(csv_file, [(r[0], r[1], "validation" if r[2] == "test" else "train") for r in rows])
        raw = read_audio_manifest(csv_file)
        assert len(raw.x_test) == 6 and raw.x_val is None and "OML" in raw.info["split"]
    finally:
        csv_file.unlink()


def test_csv_manifest_refusals_name_the_file_and_line(tmp_path, speaker_dir) -> None:
    from marginkit.audio.sources import read_audio_manifest
    from marginkit.data.manifest import read_manifest

    wav = next(speaker_dir.rglob("*.wav"))
    (tmp_path / "a.png").write_bytes(b"\x89PNG")
    bad = tmp_path / "m.csv"
    _manifest(bad, [(str(wav), "s1", "train"), ("a.png", "s2", "train")])
    with pytest.raises(ValueError, match=r"m\.csv, line 3: 'a\.png' is not a \.wav or \.flac file"):
        read_audio_manifest(bad)
    _manifest(bad, [(str(wav), "s1", "train"), ("gone.wav", "s2", "train")])
    with pytest.raises(ValueError, match=r"m\.csv, line 3: .*gone\.wav: no such file"):
        read_audio_manifest(bad)
    _manifest(bad, [(str(wav), "s1", "training")])
    with pytest.raises(ValueError, match=r"m\.csv, line 2: unknown split 'training'"):
        read_audio_manifest(bad)
    _manifest(bad, [(str(wav), "s1", "train")], header="file,speaker,split")
    with pytest.raises(ValueError, match=r"m\.csv: missing column\(s\) path, label"):
        read_audio_manifest(bad)
    # csv: (images) refuses a manifest of utterances and names the audio spec
    _manifest(bad, [(str(wav), "s1", "train"), (str(wav), "s2", "test")])
    with pytest.raises(ValueError, match=r"lists audio files .*--data audio:.*m\.csv"):
        read_manifest(bad)
    with pytest.raises(FileNotFoundError, match=r"absent\.csv: no such file \(expected a CSV manifest"):
        read_audio_source(str(tmp_path / "absent.csv"))
    with pytest.raises(FileNotFoundError, match="no such folder, wav.scp or CSV manifest"):
        read_audio_source(str(tmp_path / "absent"))
