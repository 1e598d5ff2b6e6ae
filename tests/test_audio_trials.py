"""Trial lists: parsing, validation, and scores / EER / minDCF against brute force."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from marginkit.audio.trials import read_trials, score_trials, trial_scores


def brute_eer(scores: np.ndarray, labels: np.ndarray) -> float:
    """The EER by sweeping every threshold: FAR(t) = #impostor > t / n_i, FRR(t) = #genuine <= t / n_g,
    the crossing interpolated linearly between consecutive operating points."""
    thresholds = np.concatenate([[-np.inf], np.unique(scores)])
    g, i = scores[labels], scores[~labels]
    far = np.array([(i > t).mean() for t in thresholds])
    frr = np.array([(g <= t).mean() for t in thresholds])
    for k in range(len(thresholds) - 1):
        d0, d1 = far[k] - frr[k], far[k + 1] - frr[k + 1]
        if d0 >= 0 >= d1:
            w = d0 / (d0 - d1) if d0 != d1 else 0.0
            return float(far[k] + w * (far[k + 1] - far[k]))
    raise AssertionError("no crossing")


def brute_min_dcf(scores: np.ndarray, labels: np.ndarray, p: float) -> float:
    thresholds = np.concatenate([[-np.inf], np.unique(scores)])
    g, i = scores[labels], scores[~labels]
    costs = [p * (g <= t).mean() + (1 - p) * (i > t).mean() for t in thresholds]
    return float(min(costs) / min(p, 1 - p))


def make_data(tmp_path, seed: int = 0):
    rng = np.random.default_rng(seed)
    speakers, per = 12, 4
    centres = rng.standard_normal((speakers, 16))
    paths = np.array([f"id{s:05d}/vid{u % 2}/{u:05d}.wav" for s in range(speakers) for u in range(per)])
    spk = np.repeat(np.arange(speakers), per)
    embeddings = centres[spk] + 0.9 * rng.standard_normal((speakers * per, 16))
    a = rng.integers(0, len(paths), 400)
    b = rng.integers(0, len(paths), 400)
    keep = a != b
    a, b = a[keep], b[keep]
    labels = spk[a] == spk[b]
    lines = [f"{int(lab)} {paths[x]} {paths[y]}" for lab, x, y in zip(labels, a, b, strict=True)]
    path = tmp_path / "trials.txt"
    path.write_text("# a comment\n\n" + "\n".join(lines) + "\n")
    return path, embeddings, paths, spk, a, b, labels


def test_scores_and_metrics_equal_brute_force(tmp_path) -> None:
    path, emb, paths, _spk, a, b, labels = make_data(tmp_path)
    trials = read_trials(path)
    assert len(trials) == len(labels)
    np.testing.assert_array_equal(trials.labels, labels)
    np.testing.assert_array_equal(trials.enrol, paths[a])
    # Rows given in another order, plus rows no trial names: scores follow the paths.
    order = np.random.default_rng(1).permutation(len(paths))
    scores = trial_scores(trials, emb[order], paths[order]).numpy()
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    expected = np.sum(unit[a] * unit[b], axis=1)
    np.testing.assert_allclose(scores, expected, rtol=0, atol=1e-12)
    metrics = score_trials(trials, emb, paths)
    assert metrics["num_trials"] == len(labels)
    assert metrics["num_target"] == labels.sum() and metrics["num_nontarget"] == (~labels).sum()
    assert metrics["eer"] == pytest.approx(brute_eer(expected, labels), abs=1e-12)
    assert metrics["min_dcf_0.01"] == pytest.approx(brute_min_dcf(expected, labels, 0.01), abs=1e-12)
    assert metrics["min_dcf_0.05"] == pytest.approx(brute_min_dcf(expected, labels, 0.05), abs=1e-12)
    assert 0 < metrics["eer"] < 0.5


def test_as_norm_and_bootstrap(tmp_path) -> None:
    path, emb, paths, spk, *_ = make_data(tmp_path, seed=2)
    trials = read_trials(path)
    cohort = np.random.default_rng(3).standard_normal((20, 16))
    normed = score_trials(trials, torch.from_numpy(emb), paths, cohort=cohort, top_k=5)
    assert normed["norm"] == "as-norm (top 5 of 20 cohort rows)"
    assert normed["eer"] != score_trials(trials, emb, paths)["eer"]
    with_ci = score_trials(trials, emb, paths, bootstrap=20, speakers=spk.astype(str))
    lo, hi = with_ci["confidence_intervals"]["eer"]
    assert lo <= with_ci["eer"] <= hi


def test_wespeaker_format(tmp_path) -> None:
    path = tmp_path / "t.kaldi"
    path.write_text("a/1.wav b/1.wav nontarget\na/1.wav a/2.wav target\n")
    trials = read_trials(path)
    assert trials.labels.tolist() == [False, True]
    assert trials.test.tolist() == ["b/1.wav", "a/2.wav"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1 a.wav b.wav\n2 a.wav c.wav\n", r"line 2: the label must be 1"),
        ("1 a.wav b.wav\n0 a.wav\n", r"line 2: expected 3 fields"),
        ("1 a.wav b.wav\n1 a.wav c.wav\n", "only target trials"),
        ("\n# nothing\n", "holds no trials"),
    ],
)
def test_bad_lists_name_file_and_line(tmp_path, text: str, message: str) -> None:
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as err:
        read_trials(path)
    assert "bad.txt" in str(err.value)


def test_missing_and_duplicate_utterances(tmp_path) -> None:
    path = tmp_path / "t.txt"
    path.write_text("1 a.wav b.wav\n0 a.wav c.wav\n")
    trials = read_trials(path)
    missing = r"t.txt, line 2: utterance 'c.wav' is not in .*\(1 of the 3 utterances"
    with pytest.raises(ValueError, match=missing):
        trial_scores(trials, np.eye(2), ["a.wav", "b.wav"])
    with pytest.raises(ValueError, match="more than once"):
        trial_scores(trials, np.eye(4), ["a.wav", "b.wav", "c.wav", "a.wav"])
    with pytest.raises(ValueError, match="NaN"):
        trial_scores(trials, np.array([[1.0, 0], [np.nan, 1], [0, 1]]), ["a.wav", "b.wav", "c.wav"])
    with pytest.raises(FileNotFoundError):
        read_trials(tmp_path / "absent.txt")
