"""The Spaces: their Dockerfiles and cards, the entry points that need no server, and
``deltasync spaces`` against a recorder of the Hub API (the live Hub is out of reach)."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml
from servers import REPO_ROOT

from deltasync.errors import ConfigError
from deltasync.examples.spaces import SpacesConfig, deploy_spaces, space_files, space_url
from deltasync.cli import main as cli_main

SPACES = REPO_ROOT / "spaces"
KINDS = ("vllm", "wordle")
ENTRY_POINTS = {"vllm": "spaces/vllm/start.sh", "wordle": "spaces/wordle/app.py"}


# --------------------------------------------------------------------------- Dockerfiles


def dockerfile(kind: str) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` pairs, continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in (SPACES / kind / "Dockerfile").read_text().splitlines():
        if line.lstrip().startswith("#") and not pending:
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        line = pending + line
        pending = ""
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
    return instructions


def copied(kind: str) -> tuple[list[str], set[PurePosixPath]]:
    """The COPY/ADD sources (paths in the build context) and where they land in the image."""
    sources: list[str] = []
    landed: set[PurePosixPath] = set()
    workdir = PurePosixPath("/")
    for keyword, rest in dockerfile(kind):
        if keyword == "WORKDIR":
            workdir = workdir / rest
        elif keyword in ("COPY", "ADD"):
            parts = [p for p in shlex.split(rest) if not p.startswith("--")]
            *srcs, dest = parts
            target = workdir / dest
            for src in srcs:
                sources.append(src)
                into_dir = dest.endswith("/") or dest in (".", "./") or len(srcs) > 1
                landed.add(target / PurePosixPath(src).name if into_dir else target)
    return sources, landed


def exec_form(kind: str, keyword: str) -> list[str]:
    values = [rest for k, rest in dockerfile(kind) if k == keyword]
    return json.loads(values[-1]) if values else []


@pytest.mark.parametrize("kind", KINDS)
def test_dockerfile_copies_only_what_the_repo_has(kind: str) -> None:
    sources, _ = copied(kind)
    assert sources
    for src in sources:
        assert (REPO_ROOT / src).exists(), f"spaces/{kind}/Dockerfile copies {src}, which the repository lacks"


@pytest.mark.parametrize("kind", KINDS)
def test_dockerfile_runs_a_copied_entry_point(kind: str) -> None:
    _, landed = copied(kind)
    command = exec_form(kind, "ENTRYPOINT") + exec_form(kind, "CMD")
    files = [arg for arg in command if arg.endswith((".sh", ".py"))]
    assert files, f"the {kind} image runs no script: {command}"
    for arg in files:
        path = PurePosixPath(arg)
        assert any(path == p or p in path.parents for p in landed), f"{arg} is not copied into the image"
    assert (REPO_ROOT / ENTRY_POINTS[kind]).is_file()


@pytest.mark.parametrize("kind", KINDS)
def test_dockerfile_runs_as_uid_1000(kind: str) -> None:
    instructions = dockerfile(kind)
    runs = [rest for keyword, rest in instructions if keyword == "RUN"]
    creates = [r for r in runs if "useradd" in r and "-u 1000" in r]
    assert creates, "no `useradd -u 1000`"
    user = shlex.split(creates[0].split("useradd", 1)[1])[-1]
    users = [rest for keyword, rest in instructions if keyword == "USER"]
    assert users and users[-1] == user, f"the image must end as USER {user} (uid 1000), got {users}"
    created_at = next(i for i, (k, r) in enumerate(instructions) if k == "RUN" and "useradd" in r)
    switched_at = max(i for i, (k, _) in enumerate(instructions) if k == "USER")
    assert created_at < switched_at
    env = " ".join(rest for keyword, rest in instructions if keyword == "ENV")
    assert "HOME=/home/user" in env


def front_matter(kind: str) -> dict[str, Any]:
    text = (SPACES / kind / "README.md").read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n", 2)[1])


@pytest.mark.parametrize("kind", KINDS)
def test_space_card_front_matter(kind: str) -> None:
    from huggingface_hub import SpaceHardware

    meta = front_matter(kind)
    assert meta["sdk"] == "docker"
    assert meta["app_port"] == 8000
    assert meta["title"] and meta["emoji"]
    assert len(meta["short_description"]) <= 60
    colors = {"red", "yellow", "green", "blue", "indigo", "purple", "pink", "gray"}
    assert meta["colorFrom"] in colors and meta["colorTo"] in colors
    assert meta["suggested_hardware"] in {h.value for h in SpaceHardware}
    assert meta["suggested_hardware"].startswith("cpu") == (kind == "wordle")  # vLLM wants a GPU
    exposed = [rest for keyword, rest in dockerfile(kind) if keyword == "EXPOSE"]
    assert exposed == [str(meta["app_port"])]


@pytest.mark.parametrize("kind", KINDS)
def test_uploaded_space_builds_from_its_own_files(kind: str) -> None:
    """What ``deltasync spaces`` uploads holds every COPY source of the Space's Dockerfile."""
    files = space_files(kind, REPO_ROOT)
    assert files["Dockerfile"] == SPACES / kind / "Dockerfile"
    assert files["README.md"] == SPACES / kind / "README.md"  # the card, at the Space's root
    for src in copied(kind)[0]:
        assert src in files or any(name.startswith(src.rstrip("/") + "/") for name in files), src
    assert not [name for name in files if "__pycache__" in name or name.endswith(".pyc")]
    assert "deltasync/examples/wordle/data/wordle_answers.txt" in files
    assert ("vllm_ext/__init__.py" in files) == (kind == "vllm")


# --------------------------------------------------------------------------- entry points, no Docker


def test_wordle_space_app_reads_the_space_variables() -> None:
    sys.path.insert(0, str(SPACES / "wordle"))
    try:
        import app  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    assert app.argv({}) == ["--host", "0.0.0.0", "--port", "8000", "--max-sessions", "256", "--max-guesses", "6",
                            "--log-level", "info"]  # fmt: skip
    assert app.argv({"MAX_SESSIONS": "32", "PORT": "9000"})[3:6] == ["9000", "--max-sessions", "32"]


def _start_sh_env(**values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DELTASYNC_TOKEN", "MODEL", "DELTASYNC_BUCKET")}
    return {**env, "PYTHON": sys.executable, **values}


@pytest.mark.parametrize(
    ("values", "missing"),
    [
        ({"MODEL": "m", "DELTASYNC_BUCKET": "/tmp/b"}, "DELTASYNC_TOKEN"),
        ({"MODEL": "m", "DELTASYNC_BUCKET": "/tmp/b", "DELTASYNC_TOKEN": ""}, "DELTASYNC_TOKEN"),
        ({"DELTASYNC_TOKEN": "t", "DELTASYNC_BUCKET": "/tmp/b"}, "MODEL"),
        ({"DELTASYNC_TOKEN": "t", "MODEL": "m"}, "DELTASYNC_BUCKET"),
    ],
)
def test_rollout_start_refuses_without_its_settings(values: dict[str, str], missing: str) -> None:
    proc = subprocess.run(["bash", str(SPACES / "vllm" / "start.sh")], env=_start_sh_env(**values),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 64
    assert f"{missing} is not set" in proc.stderr
    assert "deltasync serve" not in proc.stderr  # nothing was started


def _start_sh_argv(tmp_path: Path, **values: str) -> subprocess.CompletedProcess[str]:
    """Run start.sh with a stand-in interpreter that prints the arguments it was given as JSON."""
    stub = tmp_path / "python"
    script = "import json, sys; print(json.dumps(sys.argv[1:]))"
    stub.write_text(f'#!/usr/bin/env bash\nexec "$REAL_PYTHON" -c "{script}" "$@"\n')
    stub.chmod(0o755)
    env = _start_sh_env(DELTASYNC_TOKEN="t", MODEL="m", DELTASYNC_BUCKET="/tmp/b", REAL_PYTHON=sys.executable,
                        **values)  # fmt: skip
    env = {k: v for k, v in env.items() if not k.startswith("DELTASYNC_FOLLOW") or k in values}
    env["PYTHON"] = str(stub)
    return subprocess.run(["bash", str(SPACES / "vllm" / "start.sh")], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip


@pytest.mark.parametrize(
    ("values", "follow"),
    [
        ({}, []),
        ({"DELTASYNC_FOLLOW": "0", "DELTASYNC_FOLLOW_INTERVAL": "5"}, []),
        ({"DELTASYNC_FOLLOW": "1"}, ["--follow"]),
        ({"DELTASYNC_FOLLOW": "True", "DELTASYNC_FOLLOW_INTERVAL": "0.5"}, ["--follow", "--follow-interval", "0.5"]),
    ],
)
def test_rollout_start_follows_the_bucket_when_the_variable_says_so(tmp_path: Path, values: dict[str, str],
                                                                     follow: list[str]) -> None:  # fmt: skip
    proc = _start_sh_argv(tmp_path, **values)
    assert proc.returncode == 0, proc.stderr
    argv = json.loads(proc.stdout)
    assert argv[:6] == ["-m", "deltasync.cli", "serve", "m", "--bucket", "/tmp/b"]
    assert argv[6:6 + len(follow)] == follow and argv.count("--follow") == len(follow[:1])
    # What `deltasync serve` makes of those arguments: the variables vllm_ext reads.
    from deltasync.control.serve import serve_command

    interval = float(follow[2]) if len(follow) > 2 else None
    _, env = serve_command("m", "/tmp/b", environ={}, follow=bool(follow), follow_interval=interval)
    assert env.get("DELTASYNC_FOLLOW") == ("1" if follow else None)
    assert env.get("DELTASYNC_FOLLOW_INTERVAL") == (None if interval is None else repr(interval))


def test_rollout_start_refuses_an_unknown_follow_value(tmp_path: Path) -> None:
    proc = _start_sh_argv(tmp_path, DELTASYNC_FOLLOW="sometimes")
    assert proc.returncode == 64 and "DELTASYNC_FOLLOW must be 1" in proc.stderr
    assert proc.stdout == ""  # nothing was started


def test_rollout_start_script_is_executable() -> None:
    mode = (SPACES / "vllm" / "start.sh").stat().st_mode
    assert mode & stat.S_IXUSR
    assert (SPACES / "vllm" / "start.sh").read_text().startswith("#!/usr/bin/env bash\n")


# --------------------------------------------------------------------------- deltasync spaces


class RecordingApi:
    """Stands in for ``huggingface_hub.HfApi``: records every call; snapshots uploaded folders."""

    def __init__(self, user: str = "me") -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.uploads: dict[str, dict[str, bytes]] = {}
        self.user = user
        self.token = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args, kwargs))
            if name == "whoami":
                return {"name": self.user}
            if name == "upload_folder":
                root = Path(kwargs["folder_path"])
                self.uploads[kwargs["repo_id"]] = {
                    p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()
                }
            return None

        return call


def expected_calls(token: str, *, hf_token: str | None = "hf_reader") -> list[tuple[str, tuple[Any, ...]]]:
    calls = [
        ("create_bucket", ("me/deltasync-wordle",)),
        ("create_repo", ("me/deltasync-rollout",)),
        ("add_space_variable", ("me/deltasync-rollout", "MODEL", "Qwen/Qwen3-1.7B")),
        ("add_space_variable", ("me/deltasync-rollout", "DELTASYNC_BUCKET", "hf://buckets/me/deltasync-wordle")),
        ("add_space_variable", ("me/deltasync-rollout", "DELTASYNC_FOLLOW", "0")),  # a redeploy turns follow off
        ("add_space_secret", ("me/deltasync-rollout", "DELTASYNC_TOKEN", token)),
        ("add_space_secret", ("me/deltasync-rollout", "HF_TOKEN", hf_token)),
        ("request_space_hardware", ("me/deltasync-rollout", "l4x1")),
        ("upload_folder", ()),
        ("create_repo", ("me/deltasync-wordle",)),
        ("add_space_variable", ("me/deltasync-wordle", "MAX_SESSIONS", "256")),
        ("request_space_hardware", ("me/deltasync-wordle", "cpu-basic")),
        ("upload_folder", ()),
    ]
    return [c for c in calls if not (c[0] == "add_space_secret" and c[1][1] == "HF_TOKEN" and hf_token is None)]


def test_deploy_makes_exactly_the_expected_calls(tmp_path: Path) -> None:
    api = RecordingApi()
    token_file = tmp_path / "tokens" / "rollout.token"
    out: list[str] = []
    config = SpacesConfig(namespace="me", token_file=str(token_file))
    plan = deploy_spaces(config, api=api, environ={"HF_TOKEN": "hf_reader"}, echo=out.append)

    token = token_file.read_text().strip()
    assert len(token) >= 40 and stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert [(name, args) for name, args, _ in api.calls] == expected_calls(token)
    kwargs = {name: kw for name, _, kw in api.calls}
    assert api.calls[0][2] == {"private": True, "exist_ok": True}
    assert kwargs["create_repo"] == {"repo_type": "space", "space_sdk": "docker", "private": False, "exist_ok": True}
    uploads = [kw for name, _, kw in api.calls if name == "upload_folder"]
    assert [(u["repo_id"], u["repo_type"]) for u in uploads] == [("me/deltasync-rollout", "space"),
                                                                   ("me/deltasync-wordle", "space")]  # fmt: skip

    rollout, wordle = api.uploads["me/deltasync-rollout"], api.uploads["me/deltasync-wordle"]
    assert rollout["Dockerfile"] == (SPACES / "vllm" / "Dockerfile").read_bytes()
    assert rollout["README.md"] == (SPACES / "vllm" / "README.md").read_bytes()
    assert rollout["spaces/vllm/start.sh"] == (SPACES / "vllm" / "start.sh").read_bytes()
    assert "deltasync/server/middleware.py" in rollout and "deltasync/control/serve.py" in rollout
    assert wordle["Dockerfile"] == (SPACES / "wordle" / "Dockerfile").read_bytes()
    assert "spaces/wordle/app.py" in wordle and "vllm_ext/__init__.py" not in wordle

    printed = "\n".join(out)
    assert token not in printed and "hf_reader" not in printed  # secrets never shown
    assert str(token_file) in printed
    assert plan.rollout_url == "https://me-deltasync-rollout.hf.space"
    assert plan.env_url == "https://me-deltasync-wordle.hf.space"
    assert plan.train_command == (
        "python examples/async_wordle.py --model Qwen/Qwen3-1.7B \\\n"
        "    --rollout-url https://me-deltasync-rollout.hf.space \\\n"
        "    --env-url https://me-deltasync-wordle.hf.space \\\n"
        "    --bucket hf://buckets/me/deltasync-wordle"
    )
    assert plan.train_command.replace("\n", "\n  ") in printed
    assert f"export DELTASYNC_TOKEN=$(cat {token_file})" in printed

    # A second run keeps the stored token; a token in the environment wins over the file.
    again = RecordingApi()
    deploy_spaces(config, api=again, environ={"HF_TOKEN": "hf_reader"}, echo=lambda _: None)
    assert ("add_space_secret", ("me/deltasync-rollout", "DELTASYNC_TOKEN", token), {}) in again.calls
    third = RecordingApi()
    deploy_spaces(config, api=third, environ={"HF_TOKEN": "hf_reader", "DELTASYNC_TOKEN": "from-env"},
                  echo=lambda _: None)  # fmt: skip
    assert ("add_space_secret", ("me/deltasync-rollout", "DELTASYNC_TOKEN", "from-env"), {}) in third.calls


def test_deploy_options_reach_the_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)  # not logged in
    api = RecordingApi(user="org")
    config = SpacesConfig(model="me/policy", bucket="run1", rollout_space="gen", env_space="games",
                          hardware="a100-large", env_hardware="cpu-upgrade", public_bucket=True, max_sessions=64,
                          vllm_args="--max-model-len 8192", sleep_time=3600, token_env="MY_TOKEN")  # fmt: skip
    deploy_spaces(config, api=api, environ={"MY_TOKEN": "tok"}, echo=lambda _: None)
    calls = [(name, args, kw) for name, args, kw in api.calls if name != "upload_folder"]
    assert calls[0] == ("whoami", (), {})  # no namespace: the logged-in user's
    assert ("create_bucket", ("org/run1",), {"private": False, "exist_ok": True}) in calls
    assert ("add_space_variable", ("org/gen", "MODEL", "me/policy"), {}) in calls
    assert ("add_space_variable", ("org/gen", "VLLM_ARGS", "--max-model-len 8192"), {}) in calls
    assert ("add_space_secret", ("org/gen", "DELTASYNC_TOKEN", "tok"), {}) in calls
    assert not [c for c in calls if c[0] == "add_space_secret" and c[1][1] == "HF_TOKEN"]  # public bucket, no token
    assert ("request_space_hardware", ("org/gen", "a100-large"), {"sleep_time": 3600}) in calls
    assert ("request_space_hardware", ("org/games", "cpu-upgrade"), {}) in calls
    assert ("add_space_variable", ("org/games", "MAX_SESSIONS", "64"), {}) in calls


def test_deploy_in_follow_mode(tmp_path: Path) -> None:
    """--follow: the rollout Space follows the bucket by itself; the trainer only publishes."""
    out: list[str] = []
    config = SpacesConfig(namespace="me", token_file=str(tmp_path / "t"), follow=True, follow_interval=5)
    api = RecordingApi()
    plan = deploy_spaces(config, api=api, environ={"HF_TOKEN": "hf_reader"}, echo=out.append)
    rollout = "me/deltasync-rollout"
    variables = [args for name, args, _ in api.calls if name == "add_space_variable" and args[0] == rollout]
    assert variables == [
        ("me/deltasync-rollout", "MODEL", "Qwen/Qwen3-1.7B"),
        ("me/deltasync-rollout", "DELTASYNC_BUCKET", "hf://buckets/me/deltasync-wordle"),
        ("me/deltasync-rollout", "DELTASYNC_FOLLOW", "1"),
        ("me/deltasync-rollout", "DELTASYNC_FOLLOW_INTERVAL", "5.0"),
    ]
    # Set before the upload, so the first build already follows.
    names = [name for name, _, _ in api.calls]
    last_variable = max(i for i, c in enumerate(api.calls) if c[0] == "add_space_variable" and c[1][0] == rollout)
    assert last_variable < names.index("upload_folder")
    # The interval is read by what the Space runs: start.sh passes it to `deltasync serve`.
    assert api.uploads["me/deltasync-rollout"]["spaces/vllm/start.sh"] == (SPACES / "vllm" / "start.sh").read_bytes()
    assert plan.train_command.endswith("--bucket hf://buckets/me/deltasync-wordle \\\n    --follow")
    printed = "\n".join(out)
    assert plan.train_command.replace("\n", "\n  ") in printed
    assert "every 5 s (720 reads an hour)" in printed and "DeltaSyncConfig(follow=True)" in printed
    # The example takes the flag it is told to (its command line is tested in tests/unit/examples).
    assert 'add_argument("--follow"' in (REPO_ROOT / "examples" / "async_wordle.py").read_text()
    # Without follow: no flag, no note; with follow and no interval: the server's default, 2 s.
    plain = deploy_spaces(SpacesConfig(namespace="me", token_file=str(tmp_path / "t")), api=RecordingApi(),
                          environ={"HF_TOKEN": "x"}, echo=lambda _: None)  # fmt: skip
    assert "--follow" not in plain.train_command and "follows the bucket by itself" not in plain.next_steps()
    # The default interval is the server's (2 s).
    default = deploy_spaces(SpacesConfig(namespace="me", token_file=str(tmp_path / "t"), follow=True),
                            api=RecordingApi(), environ={"HF_TOKEN": "x"}, echo=lambda _: None)  # fmt: skip
    follow_variables = [s.args[1:] for s in default.steps if s.method == "add_space_variable" and "FOLLOW" in s.args[1]]
    assert follow_variables == [("DELTASYNC_FOLLOW", "1"), ("DELTASYNC_FOLLOW_INTERVAL", "2.0")]
    assert "every 2 s (1,800 reads an hour)" in default.next_steps()


def test_deploy_refuses_a_private_bucket_the_space_cannot_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    api = RecordingApi()
    config = SpacesConfig(namespace="me", token_file=str(tmp_path / "t"))
    with pytest.raises(ConfigError, match="HF_TOKEN"):
        deploy_spaces(config, api=api, environ={}, echo=lambda _: None)
    assert api.calls == [] and not (tmp_path / "t").exists()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"hardware": "h100"}, "hardware='h100' is not Space hardware"),
        ({"rollout_space": "same", "env_space": "same"}, "need different names"),
        ({"bucket": "bad--name"}, "bucket='bad--name' is not a valid Hub name"),
        ({"token_env": "1X"}, "not an environment variable name"),
        ({"follow_interval": 5.0}, "follow_interval is set but follow is not"),
        ({"follow": True, "follow_interval": 0}, "give a positive number of seconds"),
        ({"follow": True, "follow_interval": float("nan")}, "give a positive number of seconds"),
    ],
)
def test_config_checks(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SpacesConfig(**options)


def test_space_url() -> None:
    assert space_url("Me", "My_Space.v2") == "https://me-my-space-v2.hf.space"


def _no_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoHub:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise AssertionError("a dry run must not touch the Hub")

    monkeypatch.setattr("huggingface_hub.HfApi", NoHub)


def test_cli_dry_run_prints_the_plan_and_calls_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    _no_hub(monkeypatch)
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    monkeypatch.delenv("DELTASYNC_TOKEN", raising=False)
    token_file = tmp_path / "token"
    code = cli_main(["spaces", "--namespace", "me", "--dry-run", "--token-file", str(token_file)])
    printed = capsys.readouterr().out
    assert code == 0
    for call in ("create_bucket('me/deltasync-wordle'", "create_repo('me/deltasync-rollout'",
                 "add_space_variable('me/deltasync-rollout', 'MODEL'", "add_space_secret('me/deltasync-rollout', "
                 "'DELTASYNC_TOKEN'", "add_space_secret('me/deltasync-rollout', 'HF_TOKEN'",
                 "request_space_hardware('me/deltasync-rollout', 'l4x1')", "create_repo('me/deltasync-wordle'",
                 "request_space_hardware('me/deltasync-wordle', 'cpu-basic')", "upload_folder("):  # fmt: skip
        assert call in printed, call
    assert printed.count("upload_folder(") == 2
    assert "hf_secret_value" not in printed and "<the value of $HF_TOKEN>" in printed
    assert f"<a new token, written to {token_file} (mode 600)>" in printed
    assert "nothing was created" in printed
    assert "--rollout-url https://me-deltasync-rollout.hf.space" in printed
    assert not token_file.exists()


def test_cli_follow_options_reach_the_plan(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _no_hub(monkeypatch)
    monkeypatch.setenv("DELTASYNC_TOKEN", "tok")
    assert cli_main(["spaces", "--dry-run", "--public-bucket", "--follow", "--follow-interval", "10"]) == 0
    printed = capsys.readouterr().out
    assert "add_space_variable('your-namespace/deltasync-rollout', 'DELTASYNC_FOLLOW', '1')" in printed
    assert "add_space_variable('your-namespace/deltasync-rollout', 'DELTASYNC_FOLLOW_INTERVAL', '10.0')" in printed
    assert "--follow" in printed and "every 10 s (360 reads an hour)" in printed
    assert cli_main(["spaces", "--dry-run", "--public-bucket", "--follow-interval", "10"]) != 0
    assert "follow_interval is set but follow is not" in capsys.readouterr().err


def test_cli_dry_run_never_shows_a_token_from_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    _no_hub(monkeypatch)
    monkeypatch.setenv("DELTASYNC_TOKEN", "very-secret-token")
    assert cli_main(["spaces", "--dry-run", "--public-bucket"]) == 0
    printed = capsys.readouterr().out
    assert "very-secret-token" not in printed
    assert "<the value of $DELTASYNC_TOKEN>" in printed
    assert "your-namespace/deltasync-rollout" in printed  # no --namespace, and no Hub call to find it


def test_cli_asks_before_creating_paid_hardware(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    _no_hub(monkeypatch)
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    monkeypatch.setattr("sys.stdin", open(os.devnull))  # noqa: SIM115 - not a terminal
    assert cli_main(["spaces", "--namespace", "me"]) == 1
    assert "add --yes" in capsys.readouterr().err
