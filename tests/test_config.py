"""Config: YAML files, overrides, type coercion, validation with nearest-key suggestions."""

from __future__ import annotations

import pytest

from marginkit.train.config import (
    ConfigError,
    TrainConfig,
    apply_overrides,
    config_from_dict,
    load_config,
    parse_assignment,
    suggest,
)
from marginkit.train.registry import LOSSES, build_loss, check_loss_options, resolved_options


def test_defaults_are_valid_and_roundtrip_json():
    cfg = TrainConfig(loss="circle").validate()
    again = TrainConfig.from_json(cfg.to_json())
    assert again == cfg
    assert set(cfg.to_dict()) == set(TrainConfig.keys())


def test_yaml_roundtrip(tmp_path):
    cfg = apply_overrides(TrainConfig(loss="circle"), {"epochs": 3, "loss_options": {"gamma": 32.0}})
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml())
    assert config_from_dict(load_config(path)) == cfg


def test_overrides_coerce_strings_from_the_command_line():
    cfg = apply_overrides(
        TrainConfig(loss="circle"),
        {"lr": "1e-3", "epochs": "7", "amp": "true", "grad_clip": "none", "train-per-class": "10"},
    )
    assert cfg.lr == pytest.approx(1e-3) and isinstance(cfg.lr, float)
    assert cfg.epochs == 7 and cfg.amp == "bf16" and cfg.grad_clip is None and cfg.train_per_class == 10


def test_dotted_keys_set_option_dictionaries():
    cfg = apply_overrides(
        TrainConfig(loss="circle"), {"loss_options.gamma": "80", "data_options.noise": "0.5"}
    )
    assert cfg.loss_options == {"gamma": 80} and cfg.data_options == {"noise": 0.5}


def test_parse_assignment_reads_yaml_values():
    assert parse_assignment("lr=1e-3") == ("lr", 1e-3)
    assert parse_assignment("loss_options.margin=0.3") == ("loss_options.margin", 0.3)
    assert parse_assignment("normalize=false") == ("normalize", False)
    with pytest.raises(ConfigError, match="key=value"):
        parse_assignment("lr")


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("learning_rate", "lr"),
        ("epoch", "epochs"),
        ("batchsize", "batch_size"),
        ("embeding_dim", "embedding_dim"),
    ],
)
def test_unknown_key_suggests_nearest(key, expected):
    with pytest.raises(ConfigError, match=f"unknown config key '{key}' \\(did you mean '{expected}'\\?\\)"):
        apply_overrides(TrainConfig(loss="circle"), {key: 1})


def test_unknown_key_in_yaml_names_file_and_suggestion(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("loss: circle\nepocs: 3\n")
    with pytest.raises(
        ConfigError, match=r"run.yaml: unknown config key 'epocs' \(did you mean 'epochs'\?\)"
    ):
        load_config(path)


def test_bad_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("epochs: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(lst)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"epochs": 0}, "epochs must be >= 1"),
        ({"epochs": "three"}, "epochs must be an integer"),
        ({"lr": -1.0}, "lr must be > 0"),
        ({"lr": "fast"}, "lr must be a number"),
        ({"val_fraction": 1.0}, "val_fraction must be in"),
        ({"optimizer": "adamm"}, "unknown optimizer 'adamm' \\(did you mean 'adamw'\\?\\)"),
        ({"scheduler": "linear"}, "unknown scheduler 'linear'"),
        ({"model": "resnt"}, "unknown model 'resnt' \\(did you mean 'resnet'\\?\\)"),
        ({"loss": "arcfce"}, "unknown loss 'arcfce' \\(did you mean 'arcface'\\?\\)"),
        ({"normalize": "maybe"}, "normalize must be true or false"),
        ({"warmup_epochs": 50, "epochs": 10}, "warmup_epochs"),
        ({"device": "tpu"}, "device must be"),
        ({"samples_per_class": 1}, "samples_per_class must be >= 2"),
        ({"epochs.x": 1}, "not a mapping"),
    ],
)
def test_validation_errors_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        apply_overrides(TrainConfig(loss="circle"), override)


def test_unknown_loss_lists_valid_names():
    with pytest.raises(ConfigError) as info:
        apply_overrides(TrainConfig(loss="circle"), {"loss": "nope"})
    for name in LOSSES:
        assert name in str(info.value)


def test_loss_options_checked_against_the_loss_signature():
    with pytest.raises(ConfigError, match="loss 'circle' has no option 'gama' \\(did you mean 'gamma'\\?\\)"):
        apply_overrides(TrainConfig(loss="circle"), {"loss_options.gama": 10})
    with pytest.raises(ConfigError, match="no option 'reduction'"):
        check_loss_options("circle", {"reduction": "none"})


def test_suggest_returns_empty_when_nothing_is_close():
    assert suggest("zzzzzz", ["lr", "epochs"]) == ""


def test_registry_kinds_and_names():
    assert set(LOSSES) == {
        "softmax", "cosface", "arcface", "qmargin", "entmax", "sparsemax",
        "mep", "circle", "class_circle", "triplet", "local_triplet",
        "multi_similarity", "supcon", "ntxent", "contrastive", "smooth_triplet",
        "combined_margin", "subcenter_arcface", "adaface", "proxy_anchor",
    }  # fmt: skip
    assert {n for n, s in LOSSES.items() if s.kind == "pair"} == {
        "circle", "triplet", "local_triplet",
        "multi_similarity", "supcon", "ntxent", "contrastive", "smooth_triplet",
    }  # fmt: skip
    assert resolved_options("local_triplet", {}, k=7)["k"] == 7
    assert resolved_options("local_triplet", {"k": 3}, k=7)["k"] == 3


def test_build_loss_applies_defaults_and_overrides():
    loss = build_loss("circle", {"gamma": 32.0})
    assert loss.gamma == 32.0 and loss.margin == LOSSES["circle"].defaults["margin"]
    with pytest.raises(ValueError, match="unknown loss"):
        build_loss("circel")
