"""`--trials FILE` on the command line: `marginkit train` and `marginkit eval` score a VoxCeleb trial
list (EER, minDCF at p_target 0.01 / 0.05) that equals a brute-force computation from the output of
`marginkit embed` (embeddings + `<split>_paths`, cosine scores, every threshold swept); `compare`
gives every row, the pretrained baseline's included, the trial metrics; bad inputs are named."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from marginkit.audio.synthetic import synthetic_speakers, write_speaker_folder
from marginkit.cli import main
from test_audio_end_to_end import brute_eer

pytest.importorskip("soundfile")

TINY = ["--set", "model_options.channels=16", "--set", "model_options.aggregation_channels=24",
        "--set", "model_options.num_bins=24", "--set", "data_options.crop_seconds=0.5"]  # fmt: skip
TRAIN = ["--model", "ecapa_tdnn", "--epochs", "1", "--batch-size", "8", "--workers", "0",
         "--num-threads", "1", *TINY]  # fmt: skip


def brute_min_dcf(scores: np.ndarray, labels: np.ndarray, p_target: float) -> float:
    """NIST's normalised DCF (C_miss = C_fa = 1, accept iff score > t) minimised over every threshold."""
    thresholds = np.concatenate([[-np.inf], np.unique(scores)])
    p_miss = np.array([(scores[labels] <= t).mean() for t in thresholds])
    p_fa = np.array([(scores[~labels] > t).mean() for t in thresholds])
    dcf = p_target * p_miss + (1 - p_target) * p_fa
    return float(dcf.min() / min(p_target, 1 - p_target))


def write_trials(path, names: list[str], *, per_speaker: int, seed: int) -> None:
    """Every pair of ``per_speaker`` utterances drawn from each speaker (``<speaker>/...`` names),
    label first, with a comment and a blank line as VoxCeleb lists may have."""
    rng = np.random.default_rng(seed)
    speaker = np.array([n.split("/")[0] for n in names])
    chosen = np.concatenate(
        [rng.choice(np.flatnonzero(speaker == s), per_speaker, replace=False) for s in np.unique(speaker)]
    )
    i, j = np.triu_indices(len(chosen), 1)
    lines = ["# label enrol test", ""]
    lines += [
        f"{int(speaker[chosen[a]] == speaker[chosen[b]])} {names[chosen[a]]} {names[chosen[b]]}"
        for a, b in zip(i, j, strict=True)
    ]
    path.write_text("\n".join(lines) + "\n")


def trial_arrays(path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = [line.split() for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return (
        np.array([r[0] == "1" for r in rows]),
        np.array([r[1] for r in rows]),
        np.array([r[2] for r in rows]),
    )


def brute_force(npz, trials_path) -> dict[str, float]:
    """EER and minDCF of the trial list from `marginkit embed` output (every split's paths)."""
    arrays = np.load(npz)
    splits = [k[: -len("_paths")] for k in arrays.files if k.endswith("_paths")]
    emb = np.concatenate([arrays[f"{s}_embeddings"] for s in splits]).astype(np.float64)
    paths = np.concatenate([arrays[f"{s}_paths"] for s in splits]).tolist()
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    row = {p: i for i, p in enumerate(paths)}
    labels, enrol, test = trial_arrays(trials_path)
    scores = np.sum(unit[[row[p] for p in enrol]] * unit[[row[p] for p in test]], axis=1)
    return {
        "eer": brute_eer(scores, labels),
        "min_dcf_0.01": brute_min_dcf(scores, labels, 0.01),
        "min_dcf_0.05": brute_min_dcf(scores, labels, 0.05),
        "num_trials": len(labels),
    }


def assert_matches(found: dict, expected: dict) -> None:
    assert found["num_trials"] == expected["num_trials"]
    for key in ("eer", "min_dcf_0.01", "min_dcf_0.05"):
        assert found[key] == pytest.approx(expected[key], abs=1e-5), key


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """8 training-root speakers (2 of them held out by the speaker split) and a list over all of
    them (utterances of the train, validation and test splits); 8 other, unseen speakers with
    their own list."""
    root = tmp_path_factory.mktemp("trials_data")
    names = write_speaker_folder(root / "dev", synthetic_speakers(8, seed=4), 4, seconds=(0.6, 1.0), seed=5)
    write_trials(root / "dev_trials.txt", names, per_speaker=2, seed=1)
    others = synthetic_speakers(16, seed=9)[8:]
    unseen = write_speaker_folder(root / "unseen", others, 2, seconds=(0.6, 1.0), seed=6)
    write_trials(root / "unseen_trials.txt", unseen, per_speaker=2, seed=2)
    return root


@pytest.fixture(scope="module")
def run(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("trial_runs") / "ecapa"
    code = main(["train", "--data", f"audio:{data / 'dev'}", "--loss", "cosface", *TRAIN, "--trials",
                 str(data / "dev_trials.txt"), "--out", str(out), "--no-report", "-q"])  # fmt: skip
    assert code == 0
    return out


def test_train_reports_the_trial_list_equal_to_brute_force_from_embed(data, run, tmp_path):
    metrics = json.loads((run / "metrics.json").read_text())
    trials = metrics["trials"]  # nested: jq .trials.eer, or marginkit.audio.evaluate.as_dotted
    assert trials["num_trials"] == 120 and trials["num_target"] == 8 and trials["norm"] == "none"
    assert trials["source"] == str(data / "dev_trials.txt")
    assert trials["num_utterances"] == 16  # 2 of each of the 8 speakers: rows of the train and test splits
    assert len(trials["confidence_intervals"]["eer"]) == 2
    assert main(["embed", str(run), "--out", str(tmp_path / "e.npz")]) == 0
    assert_matches(trials, brute_force(tmp_path / "e.npz", data / "dev_trials.txt"))
    from marginkit.audio.evaluate import as_dotted

    dotted = as_dotted(trials)
    assert dotted["trials.eer"] == trials["eer"] and dotted["trials.num_trials"] == 120
    assert trials["min_dcf_0.05"] <= 1


def test_the_run_report_shows_the_trial_metrics(run):
    assert main(["report", str(run)]) == 0
    page = (run / "report.html").read_text()
    trials = json.loads((run / "metrics.json").read_text())["trials"]
    assert "trial-list EER" in page and "Speaker verification: the trial list" in page
    for label in ("minDCF (P_target 0.01)", "minDCF (P_target 0.05)", "TAR @ FAR 0.01", "target trials"):
        assert f"<td>{label}</td>" in page, label
    assert str(trials["num_trials"]) in page


def test_eval_scores_exactly_the_listed_utterances_of_other_data(data, run, tmp_path, capsys):
    out = tmp_path / "eval.json"
    code = main(["eval", str(run), "--data", f"audio:{data / 'unseen'}", "--trials",
                 str(data / "unseen_trials.txt"), "--json", str(out)])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "trials EER" in printed and "trials minDCF (p_target 0.01)" in printed
    result = json.loads(out.read_text())
    assert result["data"] == f"audio:{data / 'unseen'}" and result["trials"]["num_utterances"] == 16
    # brute force: `marginkit embed` of the same folder, every split (the speaker split of a data set)
    assert main(["embed", str(run), "--data", f"audio:{data / 'unseen'}", "--out", str(tmp_path / "u")]) == 0
    assert_matches(result["trials"], brute_force(tmp_path / "u.npz", data / "unseen_trials.txt"))
    # the run's own data: the same numbers as its metrics.json
    code = main(["eval", str(run), "--trials", str(data / "dev_trials.txt"), "--json", str(tmp_path / "own")])
    assert code == 0
    own = json.loads((tmp_path / "own").read_text())["trials"]
    stored = json.loads((run / "metrics.json").read_text())["trials"]
    assert_matches(own, stored)


def test_eval_trials_as_norm_against_the_training_speakers(data, run, tmp_path, capsys):
    from marginkit.train.components import load_splits
    from marginkit.train.rundir import load_run

    code = main(["eval", str(run), "--data", f"audio:{data / 'unseen'}", "--trials",
                 str(data / "unseen_trials.txt"), "--norm", "as-norm", "--top-k", "3",
                 "--json", str(tmp_path / "n.json")])  # fmt: skip
    assert code == 0
    speakers = int(torch.unique(load_splits(load_run(run)["config"]).train.y).numel())
    trials = json.loads((tmp_path / "n.json").read_text())["trials"]
    assert trials["norm"] == f"as-norm (top 3 of {speakers} cohort rows)"
    assert 0 <= trials["eer"] <= 1 and "trials: score norm" in capsys.readouterr().out


def test_eval_reads_a_folder_too_small_to_split(run, tmp_path):
    """A trial list's data is read whole: 3 speakers could not be split into train and test."""
    names = write_speaker_folder(tmp_path / "three", synthetic_speakers(3, seed=7), 2, seconds=(0.6, 0.8))
    write_trials(tmp_path / "t.txt", names, per_speaker=2, seed=0)
    out = tmp_path / "r.json"
    assert main(["eval", str(run), "--data", f"audio:{tmp_path / 'three'}", "--trials",
                 str(tmp_path / "t.txt"), "--json", str(out)]) == 0  # fmt: skip
    assert json.loads(out.read_text())["trials"]["num_trials"] == 15


def test_compare_rows_get_the_trial_metrics(data, tmp_path, monkeypatch):
    from marginkit.audio.ge2e import WEIGHTS_ENV
    from test_audio_ge2e import _state

    torch.save({"model_state": _state()}, tmp_path / "pretrained.pt")
    monkeypatch.setenv(WEIGHTS_ENV, str(tmp_path / "pretrained.pt"))
    out = tmp_path / "cmp"
    code = main(["compare", "--data", f"audio:{data / 'unseen'}", "--losses", "cosface", *TRAIN, "--k", "3",
                 "--trials", str(data / "unseen_trials.txt"), "--out", str(out), "-q"])  # fmt: skip
    assert code == 0
    rows = {row["loss"]: row for row in json.loads((out / "summary.json").read_text())}
    assert set(rows) == {"cosface", "pretrained_ge2e"}
    for row in rows.values():
        assert 0 <= row["trials_eer"] <= 1 and row["trials_num_trials"] == 120
        assert "trials_min_dcf_0.01" in row and "trials_min_dcf_0.05" in row
    table = (out / "summary.md").read_text()
    assert "trials_eer" in table and "pretrained_ge2e (baseline)" in table
    run_metrics = json.loads((out / "runs" / "cosface" / "seed0" / "metrics.json").read_text())
    assert run_metrics["trials"]["eer"] == pytest.approx(rows["cosface"]["trials_eer"])
    assert run_metrics["trials"]["norm"] == "none"
    # --norm without --protocol is the trial list's: the finished run is reused, not retrained, and
    # scored again with AS-norm (the baseline goes through the same trial_metrics; not here: the
    # random GE2E weights above embed every utterance alike, and AS-norm refuses constant scores)
    trained = (out / "runs" / "cosface" / "seed0" / "best.pt").stat().st_mtime_ns
    code = main(["compare", "--data", f"audio:{data / 'unseen'}", "--losses", "cosface", *TRAIN, "--k", "3",
                 "--trials", str(data / "unseen_trials.txt"), "--norm", "as-norm", "--no-baselines",
                 "--out", str(out), "-q"])  # fmt: skip
    assert code == 0
    assert (out / "runs" / "cosface" / "seed0" / "best.pt").stat().st_mtime_ns == trained
    normed = json.loads((out / "runs" / "cosface" / "seed0" / "metrics.json").read_text())["trials"]
    assert normed["norm"].startswith("as-norm (top ") and normed["num_trials"] == 120
    rows = {row["loss"]: row for row in json.loads((out / "summary.json").read_text())}
    assert set(rows) == {"cosface"} and rows["cosface"]["trials_eer"] == pytest.approx(normed["eer"])


def test_train_trials_as_norm_equals_eval(data, tmp_path):
    """``train --trials F --norm as-norm`` scores the list as ``eval RUN --trials F --norm as-norm``."""
    out = tmp_path / "normed"
    code = main(["train", "--data", f"audio:{data / 'dev'}", "--loss", "cosface", *TRAIN, "--trials",
                 str(data / "dev_trials.txt"), "--norm", "as-norm", "--top-k", "3", "--out", str(out),
                 "--no-report", "-q"])  # fmt: skip
    assert code == 0
    stored = json.loads((out / "metrics.json").read_text())["trials"]
    assert stored["norm"] == "as-norm (top 3 of 6 cohort rows)"  # the 6 training speakers
    code = main(["eval", str(out), "--trials", str(data / "dev_trials.txt"), "--norm", "as-norm",
                 "--top-k", "3", "--json", str(tmp_path / "e.json")])  # fmt: skip
    assert code == 0
    again = json.loads((tmp_path / "e.json").read_text())["trials"]
    assert again["norm"] == stored["norm"]
    assert_matches(again, stored)


def test_bad_trial_inputs_are_named(data, run, tmp_path, capsys):
    dev = f"audio:{data / 'dev'}"
    absent = tmp_path / "absent.txt"
    assert main(["train", "--data", dev, "--loss", "cosface", *TRAIN, "--trials", str(absent),
                 "--out", str(tmp_path / "r1"), "-q"]) == 2  # fmt: skip
    assert f"trial list {str(absent)!r} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "r1").exists()  # refused before the run directory is made
    bad = tmp_path / "bad.txt"
    bad.write_text("1 a.wav b.wav\n\n0 a.wav\n")
    assert main(["eval", str(run), "--trials", str(bad)]) == 2
    assert f"{bad}, line 3: expected 3 fields" in capsys.readouterr().err
    stray = tmp_path / "stray.txt"
    real = trial_arrays(data / "dev_trials.txt")
    stray.write_text(f"1 {real[1][0]} {real[2][0]}\n0 {real[1][0]} spk9/sess0/00001.wav\n")
    assert main(["eval", str(run), "--trials", str(stray)]) == 2
    err = capsys.readouterr().err
    assert f"{stray}, line 2: utterance 'spk9/sess0/00001.wav' is not in data" in err
    assert main(["train", "--data", dev, "--loss", "cosface", *TRAIN, "--trials", str(stray),
                 "--out", str(tmp_path / "r2"), "-q"]) == 2  # fmt: skip
    assert "line 2: utterance 'spk9/sess0/00001.wav'" in capsys.readouterr().err
    # a source that is not audio: train, compare and eval refuse it in one line
    assert main(["train", "--data", "digits", "--loss", "cosface", "--trials", str(stray),
                 "--out", str(tmp_path / "r3"), "-q"]) == 2  # fmt: skip
    assert "--data must be audio:DIR or audio:wav.scp, got 'digits'" in capsys.readouterr().err
    assert main(["compare", "--data", "digits", "--losses", "cosface", "--trials", str(stray),
                 "--out", str(tmp_path / "c"), "-q"]) == 2  # fmt: skip
    assert "audio:DIR" in capsys.readouterr().err
    assert main(["eval", str(run), "--data", "digits", "--trials", str(stray)]) == 2
    assert "data 'digits' is not audio" in capsys.readouterr().err
    assert main(["eval", str(run), "--trials", str(stray), "--protocol", "verification"]) == 2
    assert "--protocol does not apply with --trials" in capsys.readouterr().err
    assert main(["eval", str(run), "--trials", str(stray), "--norm", "z-norm"]) == 2
    assert "as-norm only" in capsys.readouterr().err
    # train / compare: --norm is the trial list's and needs one
    assert main(["train", "--data", dev, "--loss", "cosface", *TRAIN, "--norm", "as-norm",
                 "--out", str(tmp_path / "r4"), "-q"]) == 2  # fmt: skip
    assert "trials_norm (--norm) normalises the scores of a trial list: set trials" in capsys.readouterr().err
    assert main(["compare", "--data", dev, "--losses", "cosface", *TRAIN, "--trials", str(stray),
                 "--norm", "z-norm", "--out", str(tmp_path / "c2"), "-q"]) == 2  # fmt: skip
    assert "unknown trials_norm 'z-norm' (--norm); valid: as-norm, none" in capsys.readouterr().err
    assert main(["train", "--data", dev, "--loss", "cosface", *TRAIN, "--trials", str(stray), "--norm",
                 "as-norm", "--top-k", "0", "--out", str(tmp_path / "r5"), "-q"]) == 2  # fmt: skip
    assert "trials_top_k must be >= 1" in capsys.readouterr().err


def test_trial_scores_are_calibrated_on_the_validation_speakers(data, tmp_path):
    """min Cllr always; Cllr and actual DCF (P_target 0.01) of llrs calibrated on the run's
    validation speakers, equal to an independent fit (sklearn's class-balanced logistic regression
    on `marginkit embed`'s validation pairs) and hand-computed costs; skipped, saying why, when the
    list names validation utterances."""
    from sklearn.linear_model import LogisticRegression

    out = tmp_path / "cal"
    code = main(["train", "--data", f"audio:{data / 'dev'}", "--loss", "cosface", *TRAIN,
                 "--set", "data_options.split=classes", "--set", "data_options.test_classes=[spk006,spk007]",
                 "--set", "data_options.val_classes=[spk004,spk005]",
                 "--trials", str(data / "dev_trials.txt"), "--out", str(out), "--no-report",
                 "-q"])  # fmt: skip
    assert code == 0
    own = json.loads((out / "metrics.json").read_text())["trials"]
    assert own["calibration"]["skipped"].startswith("the trial list names utterances of the validation split")
    assert own["cllr"] is None and 0 <= own["min_cllr"] <= 1

    code = main(["eval", str(out), "--data", f"audio:{data / 'unseen'}", "--trials",
                 str(data / "unseen_trials.txt"), "--json", str(tmp_path / "u.json")])  # fmt: skip
    assert code == 0
    found = json.loads((tmp_path / "u.json").read_text())["trials"]
    cal = found["calibration"]
    assert cal["num_genuine"] == 12 and cal["num_impostor"] == 16  # 2 speakers x 4 utterances
    # the fit, independently
    assert main(["embed", str(out), "--split", "val", "--out", str(tmp_path / "v.npz")]) == 0
    with np.load(tmp_path / "v.npz") as z:
        emb, labels = z["val_embeddings"].astype(np.float64), z["val_labels"]
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    i, j = np.triu_indices(len(unit), 1)
    scores, genuine = np.sum(unit[i] * unit[j], axis=1), labels[i] == labels[j]
    fit = LogisticRegression(C=1e12, class_weight="balanced", tol=1e-12, max_iter=10_000)
    fit.fit(scores[:, None], genuine)
    assert cal["slope"] == pytest.approx(fit.coef_[0, 0], rel=1e-3)
    assert cal["offset"] == pytest.approx(fit.intercept_[0], rel=1e-3, abs=1e-3)
    # the costs of the calibrated llrs, by hand, on brute-force trial scores
    assert main(["embed", str(out), "--data", f"audio:{data / 'unseen'}", "--out", str(tmp_path / "u")]) == 0
    with np.load(tmp_path / "u.npz") as z:
        names = np.concatenate([z[f"{s}_paths"] for s in ("train", "val", "test") if f"{s}_paths" in z])
        vecs = np.concatenate([z[f"{s}_embeddings"] for s in ("train", "val", "test") if f"{s}_paths" in z])
    vecs = vecs.astype(np.float64) / np.linalg.norm(vecs, axis=1, keepdims=True)
    target, a, b = trial_arrays(data / "unseen_trials.txt")
    where = {n: k for k, n in enumerate(names.tolist())}
    trial = np.array([vecs[where[x]] @ vecs[where[y]] for x, y in zip(a, b, strict=True)])
    llr = cal["slope"] * trial + cal["offset"]
    cllr = 0.5 * (np.mean(np.log2(1 + np.exp(-llr[target]))) + np.mean(np.log2(1 + np.exp(llr[~target]))))
    assert found["cllr"] == pytest.approx(cllr, rel=1e-4)
    p = 0.01
    accept = llr > -np.log(p / (1 - p))
    dcf = (p * np.mean(~accept[target]) + (1 - p) * np.mean(accept[~target])) / min(p, 1 - p)
    assert found["actual_dcf_0.01"] == pytest.approx(dcf, abs=1e-9)
