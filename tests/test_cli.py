"""The ``marginkit`` command line end to end, with tiny budgets, and its one-line errors."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from marginkit.cli import main

TINY = ["--model", "mlp", "--set", "model_options.hidden=[32]", "--embedding-dim", "8", "--batch-size", "32",
        "--k", "3", "--num-threads", "1", "--quiet"]  # fmt: skip


def blobs(path: Path, *, classes: int = 3, per_class: int = 30, dim: int = 6, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, dim)) * 2.0
    y = np.repeat(np.arange(classes), per_class)
    x = centres[y] + rng.normal(size=(y.size, dim))
    np.savez(path, x=x.astype(np.float32), y=y)
    return path


@pytest.fixture(scope="module")
def features(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return blobs(tmp_path_factory.mktemp("cli-data") / "blobs.npz")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, features: Path) -> Path:
    run = tmp_path_factory.mktemp("cli-run") / "run"
    code = main(
        [
            "train",
            "--data",
            f"features:{features}",
            "--loss",
            "cosface",
            "--epochs",
            "2",
            *TINY,
            "--out",
            str(run),
        ]
    )
    assert code == 0
    return run


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_train_prints_metrics_and_writes_the_run(trained, capsys):
    names = {p.name for p in trained.iterdir()}
    assert {
        "config.yaml",
        "metrics.jsonl",
        "metrics.json",
        "last.pt",
        "best.pt",
        "knn_index.npz",
        "report.html",
        "summary.json",
    } <= names
    metrics = json.loads((trained / "metrics.json").read_text())
    assert metrics["loss"] == "cosface" and metrics["k"] == 3
    assert len((trained / "metrics.jsonl").read_text().splitlines()) == 2


def test_train_stdout(tmp_path, features, capsys):
    code, out, err = run_cli(
        capsys, "train", "--data", f"features:{features}", "--loss", "softmax", "--epochs", "1", *TINY,
        "--out", str(tmp_path / "r"), "--no-report",
    )  # fmt: skip
    assert code == 0, err
    assert "K-NN accuracy (k=3)" in out and "MAP@R" in out and "cosine-head accuracy" in out
    # --quiet: no progress, no log lines; only the tiny-data notice (3 classes x 24 samples)
    assert [line for line in err.splitlines() if "no validation split carved" not in line] == []
    assert not (tmp_path / "r" / "report.html").exists()


def test_yaml_config_and_command_line_precedence(tmp_path, features, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"data: features:{features}\nloss: softmax\nepochs: 3\nlr: 0.01\nloss_options:\n  scale: 10\n"
    )
    code, _, err = run_cli(
        capsys, "train", "--config", str(cfg), "--epochs", "1", "--set", "lr=0.002", *TINY,
        "--out", str(tmp_path / "r"), "--no-report",
    )  # fmt: skip
    assert code == 0, err
    stored = json.loads(torch.load(tmp_path / "r" / "last.pt", weights_only=True)["config"])
    assert stored["epochs"] == 1 and stored["lr"] == 0.002 and stored["loss_options"] == {"scale": 10}
    assert stored["embedding_dim"] == 8


def test_stop_and_resume_from_the_command_line(tmp_path, features, capsys):
    common = ["--data", f"features:{features}", "--loss", "triplet", "--epochs", "2", *TINY]
    code, out, _ = run_cli(capsys, "train", *common, "--out", str(tmp_path / "a"), "--stop-after", "1")
    assert code == 0 and "stopped after epoch 1/2" in out and "--resume" in out
    code, out, err = run_cli(
        capsys, "train", "--resume", "--out", str(tmp_path / "a"), "--quiet", "--no-report"
    )
    assert code == 0, err
    code, _, _ = run_cli(capsys, "train", *common, "--out", str(tmp_path / "b"), "--no-report")
    a = torch.load(tmp_path / "a" / "last.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "b" / "last.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    code, _, err = run_cli(capsys, "train", "--resume", "--out", str(tmp_path / "a"), "--lr", "0.5")
    assert code == 2 and "cannot resume with different options: lr" in err


def test_eval_embed_predict(trained, tmp_path, features, capsys):
    code, out, err = run_cli(capsys, "eval", str(trained), "--json", str(tmp_path / "m.json"))
    assert code == 0, err
    assert "K-NN accuracy (k=3)" in out
    assert (
        json.loads((tmp_path / "m.json").read_text())["knn_accuracy"]
        == json.loads((trained / "metrics.json").read_text())["knn_accuracy"]
    )

    code, out, err = run_cli(capsys, "embed", str(trained), "--out", str(tmp_path / "emb.npz"))
    assert code == 0, err
    with np.load(tmp_path / "emb.npz") as z:
        assert z["test_embeddings"].shape[1] == 8
        assert z["train_embeddings"].shape[0] == z["train_labels"].shape[0]
        norms = np.linalg.norm(z["test_embeddings"], axis=1)
        assert np.allclose(norms, 1, atol=1e-5)

    # predict on raw (unstandardised) inputs: the run's standardisation is applied
    with np.load(features) as z:
        x, y = z["x"][:20], z["y"][:20]
    np.savez(tmp_path / "new.npz", x=x, y=y)
    code, out, err = run_cli(
        capsys, "predict", str(trained), str(tmp_path / "new.npz"), "--out", str(tmp_path / "p.csv")
    )
    assert code == 0, err
    assert "20 predictions" in out and "accuracy against 'y'" in out
    acc = float(out.split("accuracy against 'y': ")[1].split()[0])
    assert acc > 0.8  # well-separated blobs; a missing standardisation would wreck this
    rows = list(csv.DictReader((tmp_path / "p.csv").open()))
    assert len(rows) == 20 and set(rows[0]) == {"index", "prediction", "class_name"}


def test_predict_refuses_an_index_from_another_model(trained, tmp_path, capsys):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(trained, other)
    ckpt = torch.load(other / "best.pt", weights_only=True)
    ckpt["model"] = {k: v + 1 if v.is_floating_point() else v for k, v in ckpt["model"].items()}
    torch.save(ckpt, other / "best.pt")
    np.savez(tmp_path / "x.npz", x=np.zeros((2, 6), np.float32))
    code, _, err = run_cli(capsys, "predict", str(other), str(tmp_path / "x.npz"))
    assert code == 2 and "fingerprint mismatch" in err


def test_report_command_rewrites_the_report(trained, capsys):
    (trained / "report.html").unlink()
    code, out, _ = run_cli(capsys, "report", str(trained))
    assert code == 0 and (trained / "report.html").is_file() and "report.html" in out


def test_compare_writes_table_csv_plot_and_report(tmp_path, features, capsys):
    code, out, err = run_cli(
        capsys, "compare", "--data", f"features:{features}", "--losses", "softmax,circle", "--seeds", "2",
        "--epochs", "1", *TINY, "--out", str(tmp_path / "c"), "--set", "loss_options.gamma=32",
    )  # fmt: skip
    assert code == 0, err
    assert "| loss | knn_accuracy" in out and "| circle |" in out and " ± " in out
    c = tmp_path / "c"
    summary = json.loads((c / "summary.json").read_text())
    assert [r["loss"] for r in summary] == ["softmax", "circle", "raw_1nn", "logistic"]
    assert all(r["n_seeds"] == 2 for r in summary) and summary[3]["head_accuracy"] is not None
    assert all("knn_accuracy" in r and "map_at_r" in r for r in summary[:3])
    assert [r["kind"] for r in summary] == ["class", "pair", "baseline", "baseline"]
    assert "| raw_1nn (baseline) |" in out and "ver_eer" not in out  # closed set: verification in the report
    assert summary[1]["knn_accuracy_std"] is not None
    rows = list(csv.DictReader((c / "summary.csv").open()))
    assert rows[0]["loss"] == "softmax" and "map_at_r_std" in rows[0]
    assert (c / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "data:image/png;base64," in (c / "report.html").read_text()
    # gamma went to circle only (softmax has no such option), and the seeds differ
    circle = json.loads(torch.load(c / "runs/circle/seed1/last.pt", weights_only=True)["config"])
    soft = json.loads(torch.load(c / "runs/softmax/seed0/last.pt", weights_only=True)["config"])
    assert circle["loss_options"] == {"gamma": 32} and circle["seed"] == 1 and soft["loss_options"] == {}
    # rerunning reuses finished runs
    code, out, err = run_cli(
        capsys, "compare", "--data", f"features:{features}", "--losses", "softmax,circle", "--seeds", "2",
        "--epochs", "1", *TINY[:-1], "--out", str(c), "--set", "loss_options.gamma=32",
    )  # fmt: skip
    assert code == 0 and err.count("(reused)") == 4


T = "train --data digits --loss softmax "


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ("train --data digts --loss softmax", "unknown dataset 'digts' (did you mean 'digits'?)"),
        (
            "train --data digits --loss sofmax",
            "unknown loss 'sofmax' (did you mean 'softmax'?); valid: softmax, ",
        ),
        (T + "--model resnt", "unknown model 'resnt' (did you mean 'resnet'?)"),
        (T + "--set epochz=2", "unknown config key 'epochz' (did you mean 'epochs'?)"),
        (T + "--set loss_options.scal=2", "has no option 'scal' (did you mean 'scale'?)"),
        ("train --data npz:/nonexistent/file.npz --loss softmax", "/nonexistent/file.npz: no such file"),
        (T + "--epochs 0", "epochs must be >= 1"),
        ("train --loss softmax", "missing --data"),
        (T + "--learning-rate 1", "(did you mean --lr?)"),
        (
            T + "--protocol verification",
            "--protocol (an option of marginkit eval and marginkit compare, not of marginkit train)",
        ),
        ("eval RUN --protocl identification", "--protocl (did you mean --protocol?)"),
        (T + "--bogus", "unrecognized arguments: --bogus\n"),  # nothing near it: no guess
        ("compare --data digits --losses softmax,nope", "unknown loss 'nope'"),
        (
            "compare --data digits --losses softmax,circle --set loss_options.gama=1",
            "(did you mean 'gamma'?)",
        ),
    ],
)
def test_bad_input_is_a_one_line_error_with_exit_code_2(tmp_path, capsys, argv, message):
    code, _, err = run_cli(capsys, *argv.split(), "--out", str(tmp_path / "o"))
    assert code == 2
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_labels_that_are_not_integers(tmp_path, capsys):
    np.savez(tmp_path / "f.npz", x=np.zeros((10, 3), np.float32), y=np.linspace(0, 1, 10))
    code, _, err = run_cli(
        capsys,
        "train",
        "--data",
        f"features:{tmp_path / 'f.npz'}",
        "--loss",
        "softmax",
        "--out",
        str(tmp_path / "o"),
    )
    assert code == 2 and "labels must be integers" in err and len(err.strip().splitlines()) == 1


def test_unwritable_output_and_run_dirs_without_checkpoints(tmp_path, features, capsys):
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    code, _, err = run_cli(
        capsys,
        "train",
        "--data",
        f"features:{features}",
        "--loss",
        "softmax",
        *TINY,
        "--out",
        str(blocker / "r"),
    )
    assert code == 2 and "cannot write to output directory" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    for argv in (
        ["eval", str(empty)],
        ["embed", str(empty), "--out", str(tmp_path / "e.npz")],
        ["predict", str(empty), str(tmp_path / "x.npz")],
    ):
        code, _, err = run_cli(capsys, *argv)
        assert code == 2 and "holds no checkpoint" in err, argv
    code, _, err = run_cli(capsys, "eval", str(tmp_path / "missing"))
    assert code == 2 and "does not exist" in err
    code, _, err = run_cli(capsys, "train", "--resume", "--out", str(empty))
    assert code == 2 and "no last.pt" in err


def test_corrupt_files_are_clear_errors(trained, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    (run / "best.pt").write_bytes((run / "best.pt").read_bytes()[:500])
    code, _, err = run_cli(capsys, "eval", str(run))
    assert code == 2 and "corrupted" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "bad.npz").write_text("garbage")
    code, _, err = run_cli(capsys, "predict", str(trained), str(tmp_path / "bad.npz"))
    assert code == 2 and "not an .npz archive" in err
    np.savez(tmp_path / "nox.npz", features=np.zeros((2, 6)))
    code, _, err = run_cli(capsys, "predict", str(trained), str(tmp_path / "nox.npz"))
    assert code == 2 and "expected an array named 'x'" in err
    np.savez(tmp_path / "shape.npz", x=np.zeros((2, 5), np.float32))
    code, _, err = run_cli(capsys, "predict", str(trained), str(tmp_path / "shape.npz"))
    assert code == 2 and "per-sample shape" in err
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("epochs: [1\n")
    code, _, err = run_cli(capsys, "train", "--config", str(bad_yaml), "--out", str(tmp_path / "o"))
    assert code == 2 and "not valid YAML" in err


def test_debug_shows_the_traceback(tmp_path, capsys):
    from marginkit.cli.errors import UserError

    with pytest.raises(UserError):
        main(["train", "--data", "digts", "--loss", "softmax", "--out", str(tmp_path / "o"), "--debug"])


def test_listing_commands(capsys):
    code, out, _ = run_cli(capsys, "losses")
    assert code == 0 and "qmargin" in out and "pair" in out
    code, out, _ = run_cli(capsys, "datasets")
    assert code == 0 and "mnist1d" in out and "npz:PATH" in out
    code, _, err = run_cli(capsys)
    assert code == 2 and "usage" in err


def test_console_script_entry_point(tmp_path):
    exe = Path(sys.executable).with_name("marginkit")
    if not exe.exists():
        pytest.skip("console script not installed in this environment")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [str(exe), "eval", str(tmp_path)], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert proc.returncode == 2 and proc.stderr.startswith("marginkit: error:")


def test_eval_on_other_data_prints_without_overwriting(trained, tmp_path, capsys):
    other = blobs(tmp_path / "other.npz", seed=5)
    before = (trained / "metrics.json").read_text()
    code, out, err = run_cli(capsys, "eval", str(trained), "--data", f"features:{other}")
    assert code == 0, err
    assert f"features:{other}" in out and "K-NN accuracy" in out
    assert (trained / "metrics.json").read_text() == before
    bad = tmp_path / "wide.npz"
    np.savez(bad, x=np.zeros((30, 9), np.float32), y=np.arange(30) % 3)
    code, _, err = run_cli(capsys, "eval", str(trained), "--data", f"features:{bad}")
    assert code == 2 and "input shape" in err


def test_ctrl_c_exits_130_with_a_resume_hint(tmp_path, features, capsys, monkeypatch):
    import marginkit.train.trainer as trainer

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "train", interrupted)
    code, _, err = run_cli(
        capsys,
        "train",
        "--data",
        f"features:{features}",
        "--loss",
        "softmax",
        *TINY,
        "--out",
        str(tmp_path / "r"),
    )
    assert code == 130 and "marginkit train --resume --out" in err


def test_outputs_are_not_overwritten_without_overwrite(trained, tmp_path, capsys):
    np.savez(tmp_path / "new.npz", x=np.zeros((5, 6), np.float32))
    commands = {
        "predict --out": (["predict", str(trained), str(tmp_path / "new.npz"), "--out"], tmp_path / "p.csv"),
        "embed --out": (["embed", str(trained), "--out"], tmp_path / "e.npz"),
        "eval --json": (["eval", str(trained), "--checkpoint", "last", "--json"], tmp_path / "m.json"),
    }
    for flag, (argv, out) in commands.items():
        out.write_bytes(b"precious")
        code, _, err = run_cli(capsys, *argv, str(out))
        assert code == 2 and out.read_bytes() == b"precious", flag
        assert err.strip() == (
            f"marginkit: error: {str(out)!r} already exists; use --overwrite to replace it, "
            f"or another {flag.split()[1]}"
        )
        code, _, err = run_cli(capsys, *argv, str(out), "--overwrite")
        assert code == 0 and out.read_bytes() != b"precious", (flag, err)
