"""AsyncGRPOConfig's bf16 rule: fp32 only where bf16 training is unavailable, and never silently."""

from __future__ import annotations

import warnings

import pytest
import transformers.training_args

from deltasync.trl import AsyncGRPOConfig, cpu_config_overrides
from deltasync.trl import _cpu_compat, _trainer


def _config(tmp_path, **kwargs) -> AsyncGRPOConfig:
    return AsyncGRPOConfig(output_dir=str(tmp_path), report_to=[], **kwargs)


@pytest.fixture
def no_bf16(monkeypatch):
    monkeypatch.setattr(_trainer, "bf16_training_available", lambda: False)
    monkeypatch.setattr(_cpu_compat, "bf16_training_available", lambda: False)


@pytest.fixture
def bf16_accelerator(monkeypatch):
    """What transformers sees on a bf16-capable CUDA, XPU or MPS device: its own check passes."""
    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: True)
    monkeypatch.setattr(_trainer, "bf16_training_available", lambda: True)
    monkeypatch.setattr(_cpu_compat, "bf16_training_available", lambda: True)


@pytest.mark.parametrize("bf16", [True, None])
def test_bf16_becomes_fp32_with_a_warning_where_unavailable(no_bf16, tmp_path, bf16) -> None:
    with pytest.warns(UserWarning, match=r"bf16=True needs a bf16-capable accelerator .* training in fp32"):
        config = _config(tmp_path, bf16=bf16)
    assert config.bf16 is False
    assert cpu_config_overrides() == {"bf16": False}


@pytest.mark.parametrize("kwargs", [{"bf16": False}, {"use_cpu": True}, {"bf16": True, "use_cpu": True}])
def test_no_warning_when_nothing_is_changed(no_bf16, tmp_path, kwargs) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*bf16-capable accelerator.*")
        config = _config(tmp_path, **kwargs)
    assert config.bf16 is kwargs.get("bf16", True)  # use_cpu=True keeps TRL's bf16 default (autocast)


@pytest.mark.parametrize("bf16", [True, None])
def test_bf16_is_kept_where_an_accelerator_supports_it(bf16_accelerator, tmp_path, bf16) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*bf16-capable accelerator.*")
        config = _config(tmp_path, bf16=bf16)
    assert config.bf16 is True
    assert cpu_config_overrides() == {}


def test_the_rule_is_the_one_transformers_enforces(tmp_path) -> None:
    """On this machine: where the rule says unavailable, TRL's own config refuses bf16=True."""
    from trl.experimental.async_grpo import AsyncGRPOConfig as TRLConfig

    if _cpu_compat.bf16_training_available():
        TRLConfig(output_dir=str(tmp_path), report_to=[], bf16=True)  # accepted
    else:
        with pytest.raises(ValueError, match="bf16"):
            TRLConfig(output_dir=str(tmp_path), report_to=[], bf16=True)
        TRLConfig(output_dir=str(tmp_path), report_to=[], **cpu_config_overrides())  # accepted


def test_delta_sync_config_nests_the_publish_options() -> None:
    from deltasync import ConfigError, PublishOptions
    from deltasync.trl import DeltaSyncConfig

    assert DeltaSyncConfig().publish == PublishOptions()
    options = PublishOptions(anchor_every=5, codec="raw")
    assert DeltaSyncConfig(publish=options).publish is options
    with pytest.raises(ConfigError, match="publish must be a PublishOptions, got dict"):
        DeltaSyncConfig(publish={"anchor_every": 5})
    with pytest.raises(TypeError):
        DeltaSyncConfig(anchor_every=5)  # no copy of the publish fields


def test_delta_sync_config_background_and_follow():
    from deltasync import ConfigError
    from deltasync.trl import DeltaSyncConfig

    config = DeltaSyncConfig()
    assert (config.background, config.follow) == (True, False)  # background by default; push, not follow
    assert DeltaSyncConfig(follow=True, peft_sync="merged").follow is True
    with pytest.raises(ConfigError, match="follow=True with peft_sync='adapter': followers serve full weights"):
        DeltaSyncConfig(follow=True, peft_sync="adapter")
