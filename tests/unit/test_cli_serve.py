"""``deltasync serve``: the vLLM command line and environment it execs."""

from __future__ import annotations

import json
import os
import sys

import pytest

from deltasync import ConfigError
from deltasync.control.serve import serve_command
from deltasync.cli import main

EXTENSION = ["--worker-extension-cls", "vllm_ext.DeltaWorkerExtension",
             "--weight-transfer-config", '{"backend": "delta"}',
             "--middleware", "vllm_ext.UpdateMiddleware"]  # fmt: skip


@pytest.fixture
def execs(monkeypatch):
    calls = []
    monkeypatch.setattr(os, "execvpe", lambda file, args, env: calls.append((file, args, env)))
    monkeypatch.delenv("DELTASYNC_TOKEN", raising=False)
    monkeypatch.delenv("DELTASYNC_BUCKET", raising=False)
    return calls


def test_serve_execs_the_api_server_with_the_extension_and_passes_vllm_args(execs, tmp_path, capsys):
    bucket = tmp_path / "bucket"
    code = main(["serve", "/models/tiny", "--bucket", str(bucket), "--max-model-len", "512", "--port", "8123",
                 "--enforce-eager"])  # fmt: skip
    assert code == 0
    ((file, args, env),) = execs
    assert file == sys.executable
    assert args == [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/tiny", *EXTENSION,
        "--max-model-len", "512", "--port", "8123", "--enforce-eager",
    ]  # fmt: skip
    assert json.loads(args[args.index("--weight-transfer-config") + 1]) == {"backend": "delta"}
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["DELTASYNC_BUCKET"] == str(bucket)
    assert "DELTASYNC_TOKEN" not in env and "vllm_ext.TokenMiddleware" not in args
    assert "warning: no token" in capsys.readouterr().err


def test_a_token_adds_the_middleware(execs, monkeypatch, tmp_path):
    monkeypatch.setenv("MY_SECRET", "s3cret")
    assert main(["serve", "m", "--bucket", "hf://buckets/me/run", "--token-env", "MY_SECRET"]) == 0
    ((_, args, env),) = execs
    assert args[-2:] == ["--middleware", "vllm_ext.TokenMiddleware"]
    assert env["DELTASYNC_TOKEN"] == "s3cret" and env["DELTASYNC_BUCKET"] == "hf://buckets/me/run"
    monkeypatch.setenv("DELTASYNC_TOKEN", "default")
    monkeypatch.setenv("DELTASYNC_BUCKET", str(tmp_path))
    assert main(["serve", "m"]) == 0  # bucket and token from the environment
    assert execs[1][2]["DELTASYNC_TOKEN"] == "default" and "vllm_ext.TokenMiddleware" in execs[1][1]


def test_relative_bucket_paths_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, env = serve_command("m", "bucket", environ={})
    assert env["DELTASYNC_BUCKET"] == str(tmp_path / "bucket")


def test_serve_errors(execs, monkeypatch, capsys):
    assert main(["serve", "m"]) == 1
    assert "error: deltasync serve needs the bucket to follow: give --bucket URL (or set DELTASYNC_BUCKET)" in (
        capsys.readouterr().err
    )
    assert main(["serve", "m", "--bucket", "b", "--token-env", "NOPE_UNSET"]) == 1
    assert "--token-env NOPE_UNSET: the environment variable NOPE_UNSET is not set or empty" in capsys.readouterr().err
    assert main(["serve", "m", "--bucket", "b", "--worker-extension-cls", "x.Y"]) == 1
    assert "sets --worker-extension-cls itself; drop --worker-extension-cls" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="sets --weight-transfer-config itself"):
        serve_command("m", "b", vllm_args=["--weight-transfer-config={}"], environ={})
    assert execs == []


def test_other_commands_still_refuse_unknown_arguments(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["stats", "bucket", "--nope"])
    assert exc.value.code == 2 and "unrecognized arguments: --nope" in capsys.readouterr().err


def _quantized_checkpoint(path, view_config):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "quantization_config": view_config}))
    return str(path)


def test_a_quantized_checkpoint_follows_its_view_and_contradictions_are_refused(tmp_path):
    from helpers import small_transformer

    from deltasync import DeltaPublisher
    from deltasync.protocol.env import VIEW_ENV
    from deltasync.views import get_scheme

    fp8 = _quantized_checkpoint(tmp_path / "fp8", get_scheme("FP8_DYNAMIC").quantization_config(["lm_head"]))
    bucket = tmp_path / "bucket"
    _, env = serve_command(fp8, str(bucket), environ={})  # an empty bucket: its trainer may start later
    assert env[VIEW_ENV] == "FP8_DYNAMIC"
    with pytest.raises(ConfigError, match=r"quantized as FP8_DYNAMIC, but the bucket .* holds no view FP8_DYNAMIC \(it holds the bf16 chain only\)"):
        with DeltaPublisher(bucket, small_transformer(), None) as publisher:
            publisher.publish()
        serve_command(fp8, str(bucket), environ={})
    with pytest.raises(ConfigError, match="asked to follow view W8A8, but its checkpoint .* is quantized as FP8_DYNAMIC"):
        serve_command(fp8, str(tmp_path / "other"), view="W8A8", environ={})
    plain = tmp_path / "bf16"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="asked to follow view FP8_DYNAMIC, but its checkpoint .* is not quantized"):
        serve_command(str(plain), str(tmp_path / "other"), view="FP8_DYNAMIC", environ={})
    _, env = serve_command(str(plain), str(tmp_path / "other"), environ={VIEW_ENV: "stale"})
    assert VIEW_ENV not in env  # a bf16 checkpoint follows the bf16 chain


def test_a_server_refuses_a_malformed_view_setting():
    from deltasync.server.config import ServerConfig

    assert ServerConfig.from_env({"DELTASYNC_VIEW": "FP8_DYNAMIC"}).view == "FP8_DYNAMIC"
    with pytest.raises(ConfigError, match="DELTASYNC_VIEW must be a scheme name such as FP8_DYNAMIC, got 'fp8'"):
        ServerConfig.from_env({"DELTASYNC_VIEW": "fp8"})
