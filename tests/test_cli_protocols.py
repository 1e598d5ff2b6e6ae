"""`marginkit eval/compare --protocol`: end to end on tiny open-set data, the fields of
metrics.json / summary.json against the library functions on the same embeddings, and the
one-line errors of every bad option."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from marginkit.cli import main
from marginkit.metrics import (
    actual_dcf,
    calibrate,
    cllr,
    cohort_stats,
    identification_metrics,
    min_cllr,
    normalize_scores,
    open_set_split,
    pair_scores,
    random_templates,
    template_features,
    verification_metrics,
)

IDENTITIES = [
    "--data", "identities", "--set", "data_options.num_train_identities=24",
    "--set", "data_options.train_samples_per_identity=8", "--set", "data_options.num_val_identities=8",
    "--set", "data_options.num_test_identities=16", "--set", "data_options.test_samples_per_identity=8",
    "--set", "data_options.dim=16", "--set", "data_options.hidden_dim=32",
]  # fmt: skip
TINY = ["--model", "mlp", "--set", "model_options.hidden=[32]", "--embedding-dim", "8", "--batch-size", "32",
        "--num-threads", "1", "--quiet"]  # fmt: skip


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def open_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("protocol-run") / "run"
    assert main(["train", *IDENTITIES, "--loss", "cosface", "--epochs", "2", *TINY, "--out", str(run)]) == 0
    _check_summary(run)  # train writes RUN/summary.json from its metrics.json
    return run


@pytest.fixture(scope="module")
def embeddings(open_run: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    path = tmp_path_factory.mktemp("protocol-emb") / "emb.npz"
    assert main(["embed", str(open_run), "--out", str(path), "--quiet"]) == 0
    with np.load(path) as z:
        return {k: torch.from_numpy(z[k]) for k in z.files if k != "fingerprint"}


def _metrics(run: Path) -> dict:
    return json.loads((run / "metrics.json").read_text())


def _check_summary(run: Path) -> dict:
    """RUN/summary.json: one row, in the format of compare's rows, holding metrics.json's figures."""
    (row,) = json.loads((run / "summary.json").read_text())
    m = _metrics(run)
    assert (row["loss"], row["kind"], row["n_seeds"], row["runs"]) == ("cosface", "class", 1, [str(run)])
    assert row["knn_accuracy"] == m["knn_accuracy"] and row["knn_accuracy_std"] is None
    assert row["seconds"] == m["train_seconds"]
    for key, prefix in [("verification", "ver"), ("verification_normalized", "ver_norm"),
                        ("templates", "tpl"), ("templates_normalized", "tpl_norm")]:  # fmt: skip
        if key not in m:
            assert f"{prefix}_eer" not in row, key
            continue
        for field in ("eer", "auc", "min_dcf", "cllr", "min_cllr", "actual_dcf"):  # Cllr: --protocol only
            if field in m[key] or field in ("eer", "auc", "min_dcf"):
                assert row[f"{prefix}_{field}"] == m[key][field], (key, field)
        assert row[f"{prefix}_tar_at_far_0.01"] == m[key]["tar_at_far"]["0.01"]
    if "identification" in m:
        ident = m["identification"]
        for rank in ("1", "5", "10"):  # not measurable (null in metrics.json): absent, as in compare's rows
            assert row.get(f"id_cmc_{rank}") == ident["cmc"][rank], rank
        for fpir in ("0.1", "0.01", "0.001"):
            assert row.get(f"id_dir_at_fpir_{fpir}") == ident["dir_at_fpir"][fpir], fpir
        assert "id_num_mated" not in row  # the scores only, as in compare's rows
    else:
        assert "id_cmc_1" not in row
    return row


def _same(stored: dict, direct: dict, keys=("eer", "auc", "min_dcf", "tar_at_far")) -> None:
    for key in keys:  # JSON keeps a float exactly; its keys become strings
        want = direct[key]
        assert stored[key] == ({str(k): v for k, v in want.items()} if isinstance(want, dict) else want), key


def _cohort(train: torch.Tensor, n: int, seed: int = 0) -> torch.Tensor:
    return train[torch.randperm(train.shape[0], generator=torch.Generator().manual_seed(seed))[:n]]


def test_verification_with_as_norm_matches_the_library(open_run, embeddings, capsys):
    code, out, err = run_cli(capsys, "eval", str(open_run), "--protocol", "verification", "--cohort", "60",
                             "--norm", "as-norm", "--top-k", "12")  # fmt: skip
    assert code == 0, err
    assert "normalised EER" in out and "as-norm against 60 training embeddings, top 12" in out
    m = _metrics(open_run)
    assert m["protocol"] == {"name": "verification", "norm": "as-norm", "cohort": 60, "top_k": 12}
    e, y = embeddings, {k: embeddings[f"{k}_labels"] for k in ("train", "val", "test")}
    s, g, pairs = pair_scores(e["test_embeddings"], y["test"], max_impostors=200000, return_pairs=True)
    _same(m["verification"], verification_metrics(s, g, fars=(1e-1, 1e-2, 1e-3, 1e-4)))
    cohort = _cohort(e["train_embeddings"], 60)
    norm = normalize_scores(s, *[cohort_stats(e["test_embeddings"], cohort, top_k=12)] * 2, method="as-norm",
                            trials=pairs)  # fmt: skip
    _same(m["verification_normalized"], verification_metrics(norm, g, fars=(1e-1, 1e-2, 1e-3, 1e-4)))
    assert m["verification_normalized"]["normalization"]["cohort_from"] == "training split"
    # calibration fitted on the validation pairs (normalised alike), applied to the test scores
    vs, vg, vp = pair_scores(e["val_embeddings"], y["val"], max_impostors=200000, seed=0, return_pairs=True)
    vnorm = normalize_scores(vs, *[cohort_stats(e["val_embeddings"], cohort, top_k=12)] * 2, method="as-norm",
                             trials=vp)  # fmt: skip
    llr = calibrate(vnorm, vg).llr(norm)
    got = m["verification_normalized"]
    assert got["cllr"] == pytest.approx(cllr(llr, g), rel=1e-9)
    assert got["actual_dcf"] == pytest.approx(actual_dcf(llr, g, p_target=0.01), rel=1e-9)
    assert got["min_cllr"] == pytest.approx(min_cllr(norm, g), rel=1e-9)
    assert got["calibration"]["fitted_on"] == "validation split"
    raw_llr = calibrate(vs, vg).llr(s)
    assert m["verification"]["cllr"] == pytest.approx(cllr(raw_llr, g), rel=1e-9)
    with np.load(open_run / "eval.npz") as z:
        assert {"det_verification_p_fa", "det_verification_normalized_p_miss"} <= set(z.files)
    report = (open_run / "report.html").read_text()
    assert "DET curves of pair scores" in report and "cohort-normalised scores" in report


def test_identification_matches_the_library(open_run, embeddings, capsys):
    code, out, err = run_cli(capsys, "eval", str(open_run), "--protocol", "identification")
    assert code == 0, err
    assert "CMC rank 1" in out and "DIR @ FPIR 1e-01" in out and "mated /" in out
    m = _metrics(open_run)["identification"]
    emb, y = embeddings["test_embeddings"], embeddings["test_labels"]
    gallery, probes = open_set_split(y, enrolled_fraction=0.5, gallery_per_subject=1, seed=0)
    want = identification_metrics(emb[probes], y[probes], emb[gallery], y[gallery])
    assert m["num_mated"] == want["num_mated"] and m["num_nonmated"] == want["num_nonmated"] > 0
    assert m["cmc"] == {str(k): v for k, v in want["cmc"].items()}
    assert m["dir_at_fpir"] == {str(k): v for k, v in want["dir_at_fpir"].items()}
    assert m["split"]["gallery_size"] == len(gallery)
    with np.load(open_run / "eval.npz") as z:
        ranks, rates = z["cmc_rank"], z["cmc_rate"]
        assert "det_identification_p_fa" in z.files
    assert ranks[0] == 1 and rates[0] == pytest.approx(want["cmc"][1]) and np.all(np.diff(rates) >= 0)
    report = (open_run / "report.html").read_text()
    assert "CMC of the open-set search" in report and "Open-set identification" in report


def test_templates_match_the_library(open_run, embeddings, capsys, tmp_path):
    out_json = tmp_path / "t.json"
    code, out, err = run_cli(capsys, "eval", str(open_run), "--protocol", "templates", "--template-size", "3",
                             "--cohort", "40", "--norm", "s-norm", "--json", str(out_json))  # fmt: skip
    assert code == 0, err
    m = json.loads(out_json.read_text())
    assert m == _metrics(open_run)
    emb, y = embeddings["test_embeddings"], embeddings["test_labels"]
    tid, tlab = random_templates(y, size=3, seed=0)
    _, feats = template_features(emb, tid)
    s, g, pairs = pair_scores(feats, tlab, max_impostors=200000, seed=0, return_pairs=True)
    _same(m["templates"], verification_metrics(s, g, fars=(1e-1, 1e-2, 1e-3, 1e-4)))
    assert m["templates"]["num_templates"] == len(tlab) and m["templates"]["template_size"] == 3
    stats = cohort_stats(feats, _cohort(embeddings["train_embeddings"], 40))
    norm = normalize_scores(s, stats, stats, method="s-norm", trials=pairs)
    _same(m["templates_normalized"], verification_metrics(norm, g, fars=(1e-1, 1e-2, 1e-3, 1e-4)))
    assert "templates of 3, s-norm" not in out  # labels of the report, not of the text table
    assert "normalised templates EER" in out


def test_eval_rewrites_the_runs_summary_json_with_metrics_json(open_run, capsys):
    code, _, err = run_cli(capsys, "eval", str(open_run), "--protocol", "verification", "--cohort", "40",
                           "--norm", "as-norm", "--top-k", "8", "--quiet")  # fmt: skip
    assert code == 0, err
    row = _check_summary(open_run)
    assert row["ver_norm_eer"] is not None and "tpl_eer" not in row
    assert row["ver_cllr"] == _metrics(open_run)["verification"]["cllr"] and "ver_norm_actual_dcf" in row
    code, _, err = run_cli(capsys, "eval", str(open_run), "--protocol", "identification", "--quiet")
    assert code == 0, err
    row = _check_summary(open_run)
    assert "id_cmc_5" in row and "ver_norm_eer" not in row
    # an evaluation that leaves metrics.json alone (another k, another checkpoint) leaves it alone too
    before = (open_run / "summary.json").read_bytes()
    for flags in (["--k", "3"], ["--checkpoint", "last"]):
        code, _, err = run_cli(capsys, "eval", str(open_run), *flags, "--quiet")
        assert code == 0, err
        assert (open_run / "summary.json").read_bytes() == before
    code, _, err = run_cli(capsys, "eval", str(open_run), "--protocol", "verification", "--cohort", "9")
    assert code == 2 and (open_run / "summary.json").read_bytes() == before


def test_eval_without_protocol_drops_the_protocol_fields(open_run, capsys):
    code, _, err = run_cli(capsys, "eval", str(open_run), "--quiet")
    assert code == 0, err
    m = _metrics(open_run)
    assert "protocol" not in m and "identification" not in m and "eer" in m["verification"]
    _check_summary(open_run)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ("--protocol verification --cohort 0 --norm as-norm", "--cohort must be >= 2"),
        ("--protocol verification --cohort 50 --norm bogus", "--norm must be one of s-norm, as-norm"),
        ("--protocol verification --norm as-norm", "--norm as-norm needs --cohort N"),
        ("--protocol verification --cohort 50", "--cohort 50 needs --norm"),
        ("--cohort 50 --norm s-norm", "--cohort needs --protocol"),
        ("--protocol identity", "--protocol must be one of verification, identification, templates"),
        ("--protocol identification --cohort 50 --norm s-norm", "not identification"),
        ("--protocol verification --cohort 50 --norm as-norm --top-k 1", "--top-k must be >= 2"),
        ("--protocol verification --cohort 50 --norm as-norm --top-k 60", "--top-k 60 exceeds --cohort 50"),
        ("--protocol verification --cohort 50 --norm s-norm --top-k 5", "use --norm as-norm"),
        ("--protocol verification --template-size 3", "--template-size applies to --protocol templates"),
        ("--protocol templates --template-size 0", "--template-size must be >= 1"),
        ("--protocol verification --cohort 5000 --norm s-norm", "--cohort 5000 exceeds the 192 training"),
        ("--protocol templates --template-size 5", "needs an identity with 10 test samples"),
    ],
)
def test_bad_protocol_options_are_one_line_errors(open_run, capsys, flags, message):
    before = (open_run / "metrics.json").read_bytes()
    code, _, err = run_cli(capsys, "eval", str(open_run), *flags.split())
    assert code == 2, err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert (open_run / "metrics.json").read_bytes() == before


def test_norm_needs_open_set_data(tmp_path, capsys):
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(3), 30)
    x = rng.normal(size=(3, 6))[y] + rng.normal(size=(90, 6))
    np.savez(tmp_path / "f.npz", x=x.astype(np.float32), y=y)
    data = f"features:{tmp_path / 'f.npz'}"
    code, _, err = run_cli(capsys, "compare", "--data", data, "--losses", "softmax", *TINY, "--epochs", "1",
                           "--out", str(tmp_path / "c"), "--protocol", "verification", "--cohort", "10",
                           "--norm", "s-norm")  # fmt: skip
    (line,) = [x for x in err.splitlines() if x.startswith("marginkit: error:")]  # after a small-data warning
    assert code == 2 and "--norm needs open-set data" in line and "Traceback" not in err
    assert not (tmp_path / "c" / "runs").exists()  # refused before any training


def test_compare_with_identification(tmp_path, capsys):
    out = tmp_path / "c"
    code, text, err = run_cli(capsys, "compare", *IDENTITIES, "--losses", "softmax,circle", "--epochs", "1",
                              *TINY, "--out", str(out), "--protocol", "identification")  # fmt: skip
    assert code == 0, err
    assert "id_cmc_1" in text
    rows = json.loads((out / "summary.json").read_text())
    assert [r["loss"] for r in rows] == ["softmax", "circle", "raw", "pca_whitened"]
    for row in rows:
        assert "knn_accuracy" in row and "ver_eer" in row and "id_num_mated" not in row
        assert row["id_cmc_1"] is not None  # the baselines are scored by the same protocol
        if row["kind"] == "baseline":
            continue
        run = json.loads((Path(row["runs"][0]) / "metrics.json").read_text())
        assert row["id_cmc_1"] == run["identification"]["cmc"]["1"]
        assert row["id_dir_at_fpir_0.1"] == run["identification"]["dir_at_fpir"]["0.1"]
    report = (out / "report.html").read_text()
    assert "CMC per loss" in report and "DET per loss" in report
    # rerun: the runs are reused and not re-evaluated (same protocol); another protocol re-evaluates them
    code, _, err = run_cli(capsys, "compare", *IDENTITIES, "--losses", "softmax,circle", "--epochs", "1",
                           *TINY[:-1], "--out", str(out), "--protocol", "verification")  # fmt: skip
    assert code == 0 and err.count("(reused)") == 2
    rows = json.loads((out / "summary.json").read_text())
    assert all("ver_min_cllr" in r and "id_cmc_1" not in r for r in rows)
