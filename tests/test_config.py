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
        ({"val_fraction": 1.0}, "val_fraction must be < 1"),
        ({"optimizer": "adamm"}, "unknown optimizer 'adamm' \\(did you mean 'adamw'\\?\\)"),
        ({"scheduler": "linear"}, "unknown scheduler 'linear'"),
        ({"model": "resnt"}, "unknown model 'resnt' \\(did you mean 'resnet'\\?\\)"),
        ({"loss": "arcfce"}, "unknown loss 'arcfce' \\(did you mean 'arcface'\\?\\)"),
        ({"normalize": "maybe"}, "normalize must be true or false"),
        ({"warmup_epochs": 50, "epochs": 10}, "warmup_epochs"),
        ({"device": "tpu"}, "device must be"),
        ({"samples_per_class": 1}, "samples_per_class must be >= 2"),
        ({"epochs.x": 1}, "not a mapping"),
        ({"data_options.train_per_class": 1}, "data_options.train_per_class is not a data option.*--set"),
        ({"data_options.seed": 3}, "data_options.seed is not a data option"),
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


# ---------------------------------------------------------------------- ranges of every option
@pytest.mark.parametrize(
    ("loss", "assignment", "message"),
    [
        ("softmax", "epochs=1e10", "epochs must be <= 100000, got 10000000000"),
        ("softmax", "loss.scale=1e30", r"loss_options.scale must be <= 1000, got 1e\+30"),
        ("cosface", "loss_options.margin=-1", "loss_options.margin must be >= 0, got -1"),
        ("arcface", "loss.margin=2", "loss_options.margin must be <= 1.5708"),
        ("qmargin", "loss.alpha=1", "loss_options.alpha must be > 1, got 1"),
        ("qmargin", "loss.topk=1.5", "loss_options.topk must be null, an integer in"),
        ("circle", "loss.gamma=0", "loss_options.gamma must be > 0"),
        ("triplet", "classes_per_batch=1", "classes_per_batch must be >= 2 for pair losses"),
        ("softmax", f"seed={2**64}", "seed must be <= 9223372036854775807"),
        ("softmax", "seed=-1", "seed must be >= 0"),
        ("softmax", "k=100000", "k must be <= 10000, got 100000"),
        ("softmax", "num_threads=100000000", "num_threads must be <= 1024"),
        ("softmax", "embedding_dim=100000000", "embedding_dim must be <= 65536"),
        ("softmax", "model.channels=[32, 100000]", r"model_options.channels must be a list of 1 to 16"),
        ("softmax", "model_options.width=1e9", "model_options.width must be an integer in"),
        ("softmax", "model_options.dropout=1", "model_options.dropout must be < 1"),
        ("softmax", "device=cuda:abc", "device must be 'cpu', 'cuda', 'cuda:N', 'mps' or 'auto'"),
        ("softmax", "lr=1e9", "lr must be <= 10"),
        ("softmax", "batch_size=0", "batch_size must be >= 1"),
        ("softmax", "batch_size=1", "batch_size must be >= 2: batch norm needs two samples"),
        ("triplet", "loss.mining=hardest", "loss 'triplet': mining must be one of"),
        ("local_triplet", "loss.k=0", "loss_options.k must be >= 1"),
        ("multi_similarity", "loss.beta=1e30", "loss_options.beta must be <= 1000"),
        ("multi_similarity", "loss.base=3", "loss_options.base must be <= 1"),
        ("supcon", "loss.temperature=1e-9", "loss_options.temperature must be >= 0.001"),
        ("contrastive", "loss.neg_margin=-1", "loss_options.neg_margin must be >= 0"),
    ],
)
def test_every_option_is_range_checked_up_front(loss, assignment, message):
    with pytest.raises(ConfigError, match=message) as info:
        apply_overrides(TrainConfig(loss=loss), [parse_assignment(assignment)])
    assert len(str(info.value).splitlines()) == 1


def test_a_batch_of_one_is_accepted_without_batch_norm():
    cfg = apply_overrides(TrainConfig(), {"batch_size": 1, "model.norm": "none"})
    assert cfg.batch_size == 1


def test_values_at_the_bounds_are_accepted():
    cfg = apply_overrides(
        TrainConfig(loss="qmargin"),
        {"epochs": 100_000, "seed": 2**63 - 1, "k": 10_000, "loss.scale": 1000, "loss.alpha": 100,
         "loss.margin": 1.0, "loss.topk": 0.5, "model.channels": [4096], "device": "cuda:3"},
    )  # fmt: skip
    assert cfg.loss_options == {"scale": 1000, "alpha": 100, "margin": 1.0, "topk": 0.5}
    assert cfg.model_options == {"channels": [4096]}


def test_every_numeric_loss_option_has_a_range():
    import inspect

    from marginkit.train.ranges import loss_option_ranges
    from marginkit.train.registry import _accepted

    for name, spec in LOSSES.items():
        params = inspect.signature(spec.loss_class().__init__).parameters
        accepted, _ = _accepted(spec)
        for option in accepted:
            default = params[option].default if option in params else 1.0  # 'scale' of a score loss
            numeric = isinstance(default, (int, float)) and not isinstance(default, bool)
            if numeric or option == "topk":
                assert option in loss_option_ranges(name), (name, option)


def test_unavailable_devices_are_user_errors():
    import torch

    from marginkit.train.trainer import resolve_device

    if not torch.backends.mps.is_available():
        with pytest.raises(ConfigError, match="MPS .* is not available"):
            resolve_device("mps")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            resolve_device("cuda:1")
    else:
        with pytest.raises(ConfigError, match="CUDA devices"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")


# ---------------------------------------------------------------------- hostile YAML
@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("loss: circle\nepochs: 3\nepochs: 5\n", "duplicate key 'epochs' \\(lines 2 and 3\\)"),
        ("loss_options:\n  gamma: 3\n  gamma: 4\n", "duplicate key 'gamma'"),
        ("loss_options: {gamma: 3, gamma: 4}\n", "duplicate key 'gamma' \\(lines 1 and 1\\)"),
        ("a: &x [1, 2]\nloss_options: {m: *x}\n", "aliases"),
        ("data_options: " + "[" * 10_000 + "]" * 10_000 + "\n", "nested deeper than 32 levels"),
        ("data_options:\n" + "".join(" " * (2 * i) + f"k{i}:\n" for i in range(1, 200)), "nested deeper"),
    ],
)
def test_hostile_yaml_is_refused(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        load_config(path)
    assert "c.yaml" in str(info.value) and len(str(info.value).splitlines()) == 1


def test_hostile_values_on_the_command_line_and_in_checkpoints(tmp_path):
    with pytest.raises(ConfigError, match="duplicate key 'scale'"):
        parse_assignment("loss_options={scale: 1, scale: 2}")
    assert parse_assignment("data=features:/a b/x.npz") == ("data", "features:/a b/x.npz")
    with pytest.raises(ConfigError, match="nested too deeply"):
        TrainConfig.from_json('{"data_options": ' + "[" * 100_000 + "]" * 100_000 + "}")
    big = tmp_path / "big.yaml"
    big.write_text("# padding\n" * 200_000)
    with pytest.raises(ConfigError, match="larger than 1 MB"):
        load_config(big)


def test_every_numeric_field_has_a_range():
    import dataclasses
    import typing

    from marginkit.train.ranges import FIELD_RANGES

    hints = typing.get_type_hints(TrainConfig)
    numeric = [
        f.name
        for f in dataclasses.fields(TrainConfig)
        if any(a in (int, float) for a in (typing.get_args(hints[f.name]) or (hints[f.name],)))
    ]
    assert numeric and not [name for name in numeric if name not in FIELD_RANGES]
