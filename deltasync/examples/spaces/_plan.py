"""What ``deltasync spaces`` deploys: its options, and the Hub calls that deploy them (nothing is called here)."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from ...protocol.env import BUCKET_ENV, DEFAULT_FOLLOW_INTERVAL, FOLLOW_ENV, FOLLOW_INTERVAL_ENV, TOKEN_ENV

DEFAULT_MODEL = "Qwen/Qwen3-1.7B"
#: The rollout server's interval when ``follow_interval`` is None (``vllm_ext``'s default).
_SKIP_PARTS = {"__pycache__", ".pytest_cache", ".mypy_cache"}
_SKIP_SUFFIXES = (".pyc", ".pyo")


@dataclass(kw_only=True)
class SpacesConfig:
    """What to deploy, and where."""

    namespace: str | None = None
    """User or organisation that owns the bucket and the Spaces. Default: the logged-in user."""
    bucket: str = "deltasync-wordle"
    """Name of the bucket the trainer publishes to and the rollout Space follows."""
    model: str = DEFAULT_MODEL
    """Model the rollout Space serves; the trainer's ``--model`` must be the same."""
    rollout_space: str = "deltasync-rollout"
    """Name of the rollout (vLLM) Space."""
    env_space: str = "deltasync-wordle"
    """Name of the Wordle environment Space."""
    hardware: str = "l4x1"
    """Hardware of the rollout Space (a GPU; billed while it runs)."""
    env_hardware: str = "cpu-basic"
    """Hardware of the Wordle Space."""
    public_bucket: bool = False
    """Make the bucket public (then the rollout Space needs no HF_TOKEN to read it)."""
    max_sessions: int = 256
    """Wordle games the environment Space plays at once."""
    vllm_args: str = ""
    """Extra vLLM flags for the rollout Space (its ``VLLM_ARGS`` variable), e.g. "--max-model-len 8192"."""
    sleep_time: int | None = None
    """Seconds without requests before the rollout Space sleeps (None: the Hub's default)."""
    token_env: str = TOKEN_ENV
    """Environment variable holding the shared token of the trainer and the rollout Space."""
    token_file: str | None = None
    """Where a token is read from when ``token_env`` is unset, and written when one is generated.
    Default: ``~/.cache/deltasync/spaces/<namespace>--<rollout_space>.token``."""
    hf_token_env: str = "HF_TOKEN"
    """Environment variable holding the Hub token the rollout Space gets as its ``HF_TOKEN``
    secret (to read a private bucket or model). Default when unset: the logged-in token."""
    follow: bool = False
    """The rollout Space follows the bucket by itself (its variable ``DELTASYNC_FOLLOW=1``): it
    reads the bucket's pointer every ``follow_interval`` seconds and serves each newer version,
    and the trainer only publishes (``DeltaSyncConfig(follow=True)``, the example's ``--follow``).
    False sets ``DELTASYNC_FOLLOW=0``, so a redeploy turns an earlier follow mode off."""
    follow_interval: float | None = None
    """Seconds between two reads of the pointer in follow mode (``DELTASYNC_FOLLOW_INTERVAL``);
    None: the server's default, 2 s (1,800 reads an hour)."""

    def __post_init__(self) -> None:
        from huggingface_hub import SpaceHardware

        if self.namespace is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}", self.namespace):
            raise ConfigError(f"namespace={self.namespace!r} is not a Hub user or organisation name")
        for option in ("bucket", "rollout_space", "env_space"):
            _check_name(option, getattr(self, option))
        if self.rollout_space == self.env_space:
            raise ConfigError(
                f"rollout_space and env_space are both {self.rollout_space!r}: the two Spaces need different names"
            )
        known = [h.value for h in SpaceHardware]
        for option in ("hardware", "env_hardware"):
            if getattr(self, option) not in known:
                raise ConfigError(f"{option}={getattr(self, option)!r} is not Space hardware; use one of {known}")
        if not self.model:
            raise ConfigError("model is empty: name the model the rollout Space serves, e.g. Qwen/Qwen3-1.7B")
        if self.max_sessions < 1:
            raise ConfigError(f"max_sessions={self.max_sessions}: the Wordle Space needs at least 1 session")
        if self.sleep_time is not None and self.sleep_time < -1:
            raise ConfigError(f"sleep_time={self.sleep_time}: give seconds, or -1 to never sleep")
        if self.follow_interval is not None:
            if not self.follow:
                raise ConfigError(
                    "follow_interval is set but follow is not: add follow (--follow), or drop the interval"
                )
            if not (isinstance(self.follow_interval, (int, float)) and math.isfinite(self.follow_interval)
                    and self.follow_interval > 0):  # fmt: skip
                raise ConfigError(f"follow_interval={self.follow_interval!r}: give a positive number of seconds")
        for option in ("token_env", "hf_token_env"):
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", getattr(self, option)):
                raise ConfigError(f"{option}={getattr(self, option)!r} is not an environment variable name")


def _check_name(option: str, name: str) -> None:
    ok = re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}", name) and "--" not in name and ".." not in name
    if not ok or name.endswith((".", "-")):
        raise ConfigError(
            f"{option}={name!r} is not a valid Hub name: letters, digits, '-', '_', '.', at most 96 characters, "
            "no '--' or '..', not ending in '-' or '.'"
        )


@dataclass(frozen=True)
class Step:
    """One ``HfApi`` call of the deployment."""

    method: str
    """The ``HfApi`` method, e.g. "create_bucket"."""
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    secret_note: str | None = None
    """For ``add_space_secret``: where the value comes from; the value itself is never shown."""
    files: Mapping[str, Path] | None = None
    """For ``upload_folder``: path in the Space -> local file, staged into ``folder_path``."""

    def __repr__(self) -> str:  # never the secret
        return f"Step({self.describe()})"

    def describe(self) -> str:
        """The call as text, with a secret's value replaced by where it comes from."""
        args = [repr(a) for a in self.args]
        if self.secret_note is not None:
            args[-1] = f"<{self.secret_note}>"
        kwargs = [f"{k}={v!r}" for k, v in self.kwargs.items()]
        if self.files is not None:
            kwargs.insert(0, f"folder_path=<{_summarize(self.files)}>")
        return f"{self.method}({', '.join(args + kwargs)})"


@dataclass
class SpacesPlan:
    """What :func:`deploy_spaces` does (or did): the calls, the URLs, and how to train."""

    config: SpacesConfig
    namespace: str
    steps: list[Step]
    bucket_url: str
    rollout_url: str
    env_url: str
    token_export: str
    """How the trainer gets the shared token (never the token itself)."""
    notes: list[str] = field(default_factory=list)

    @property
    def train_command(self) -> str:
        return (
            f"python examples/async_wordle.py --model {self.config.model} \\\n"
            f"    --rollout-url {self.rollout_url} \\\n"
            f"    --env-url {self.env_url} \\\n"
            f"    --bucket {self.bucket_url}" + (" \\\n    --follow" if self.config.follow else "")
        )

    def render(self, *, dry_run: bool) -> str:
        lines = [f"{'Would run' if dry_run else 'Running'} {len(self.steps)} Hub calls:"]
        lines += [f"  {i:2d}. {step.describe()}" for i, step in enumerate(self.steps, 1)]
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)

    def next_steps(self) -> str:
        rollout_id = f"{self.namespace}/{self.config.rollout_space}"
        env_id = f"{self.namespace}/{self.config.env_space}"
        return "\n".join([
            f"rollout server: {self.rollout_url}  (https://huggingface.co/spaces/{rollout_id})",
            f"Wordle server:  {self.env_url}  (https://huggingface.co/spaces/{env_id})",
            f"bucket:         {self.bucket_url}",
            f"Builds take a few minutes: `hf spaces logs {rollout_id}`; both answer GET /health when up.",
            f"The {self.config.hardware} Space is billed while it runs: `hf spaces pause {rollout_id}` when done.",
            "",
            "Train from anywhere (a GPU machine with deltasync[trl,wordle] installed):",
            f"  {self.token_export}",
            "  export HF_TOKEN=...   # a token that can write to the bucket",
            "  " + self.train_command.replace("\n", "\n  "),
            *self._follow_note(),
        ])  # fmt: skip

    def _follow_note(self) -> list[str]:
        if not self.config.follow:
            return []
        interval = self.config.follow_interval or DEFAULT_FOLLOW_INTERVAL
        return [
            "",
            f"The rollout Space follows the bucket by itself: it reads the pointer every {interval:g} s "
            f"({3600 / interval:,.0f} reads an hour) and serves each newer version. With --follow "
            "(DeltaSyncConfig(follow=True)) the trainer only publishes and never asks the Space to update; it "
            "uses --rollout-url to generate and to read which version the Space serves (GET /deltasync/status).",
        ]


def space_url(namespace: str, name: str) -> str:
    """The address a Space serves at: ``https://<namespace>-<name>.hf.space``."""
    host = re.sub(r"[^a-z0-9-]", "-", f"{namespace}-{name}".lower())
    return f"https://{host}.hf.space"


def default_token_file(namespace: str, rollout_space: str) -> Path:
    return Path.home() / ".cache" / "deltasync" / "spaces" / f"{namespace}--{rollout_space}.token"


def space_files(kind: str, repo_root: Path) -> dict[str, Path]:
    """The files of the ``kind`` Space ("vllm" or "wordle"): its path in the Space -> the local file.

    The Space repo mirrors this repository (so each Dockerfile builds from either), except
    that ``spaces/<kind>/Dockerfile`` and ``README.md`` (the Space card) sit at its root.
    """
    if kind not in ("vllm", "wordle"):
        raise ConfigError(f"kind={kind!r}: a Space here is 'vllm' or 'wordle'")
    root = repo_root / "spaces" / kind
    if not (root / "Dockerfile").is_file() or not (repo_root / "pyproject.toml").is_file():
        raise ConfigError(
            f"{repo_root} is not a deltasync checkout (no pyproject.toml or spaces/{kind}/Dockerfile): "
            "run from the repository, or pass --repo PATH"
        )
    files = {"Dockerfile": root / "Dockerfile", "README.md": root / "README.md",
             "pyproject.toml": repo_root / "pyproject.toml"}  # fmt: skip
    packages = ["deltasync", "vllm_ext"] if kind == "vllm" else ["deltasync"]
    for package in packages:
        for path in sorted((repo_root / package).rglob("*")):
            relative = path.relative_to(repo_root)
            if path.is_file() and not _SKIP_PARTS & set(relative.parts) and path.suffix not in _SKIP_SUFFIXES:
                files[relative.as_posix()] = path
    entry = "start.sh" if kind == "vllm" else "app.py"
    files[f"spaces/{kind}/{entry}"] = root / entry
    return files


def _summarize(files: Mapping[str, Path]) -> str:
    groups: dict[str, list[str]] = {}
    for name in files:
        groups.setdefault(name.split("/", 1)[0], []).append(name)
    parts = [names[0] if len(names) == 1 else f"{top}/ ({len(names)} files)" for top, names in groups.items()]
    return f"{len(files)} files: " + ", ".join(parts)


def find_repo_root(given: str | os.PathLike[str] | None) -> Path:
    """``given``, else the source checkout this package runs from (it holds ``spaces/``), else the cwd."""
    if given is not None:
        return Path(given).resolve()
    here = Path(__file__).resolve().parents[3]  # a source checkout (editable install)
    if (here / "spaces").is_dir():
        return here
    return Path.cwd()


@dataclass
class SharedToken:
    """The token the trainer and the rollout Space share, and where it comes from."""

    value: str | None
    source: str
    """Where the value comes from, shown instead of it."""
    export: str
    """How the trainer gets it."""
    generate_to: Path | None = None


def shared_token(config: SpacesConfig, namespace: str, environ: Mapping[str, str]) -> SharedToken:
    """The shared token: from ``config.token_env``, else ``config.token_file``, else a new one to write."""
    value = environ.get(config.token_env)
    if value:
        export = f"export {TOKEN_ENV}=...   # the value of ${config.token_env} here"
        return SharedToken(value, f"the value of ${config.token_env}", export)
    path = Path(config.token_file).expanduser() if config.token_file else default_token_file(namespace,
                                                                                              config.rollout_space)
    export = f"export {TOKEN_ENV}=$(cat {path})"
    if path.is_file() and path.read_text().strip():
        return SharedToken(path.read_text().strip(), f"the token in {path}", export)
    return SharedToken(None, f"a new token, written to {path} (mode 600)", export, generate_to=path)


def build_plan(
    config: SpacesConfig,
    *,
    namespace: str,
    token: SharedToken,
    hf_token: str | None,
    hf_token_note: str,
    repo_root: Path,
) -> SpacesPlan:
    """The Hub calls that deploy ``config``, in order (nothing is called here)."""
    rollout_id = f"{namespace}/{config.rollout_space}"
    env_id = f"{namespace}/{config.env_space}"
    bucket_id = f"{namespace}/{config.bucket}"
    bucket_url = f"hf://buckets/{bucket_id}"
    notes: list[str] = []
    # Public Spaces: a private one wants a Hub token in the Authorization header, where the
    # rollout server's own token goes; the token middleware guards its control routes.
    new_space = {"repo_type": "space", "space_sdk": "docker", "private": False, "exist_ok": True}
    steps = [
        Step("create_bucket", (bucket_id,), {"private": not config.public_bucket, "exist_ok": True}),
        Step("create_repo", (rollout_id,), new_space),
    ]
    variables = {"MODEL": config.model, BUCKET_ENV: bucket_url, FOLLOW_ENV: "1" if config.follow else "0"}
    if config.follow:
        variables[FOLLOW_INTERVAL_ENV] = repr(float(config.follow_interval or DEFAULT_FOLLOW_INTERVAL))
    if config.vllm_args:
        variables["VLLM_ARGS"] = config.vllm_args
    for key, value in variables.items():
        steps.append(Step("add_space_variable", (rollout_id, key, value)))
    steps.append(Step("add_space_secret", (rollout_id, TOKEN_ENV, token.value or ""), secret_note=token.source))
    if hf_token is not None:
        steps.append(Step("add_space_secret", (rollout_id, "HF_TOKEN", hf_token), secret_note=hf_token_note))
    elif not config.public_bucket:
        notes.append(
            f"no Hub token (${config.hf_token_env} unset, not logged in): the rollout Space could not read the "
            f"private bucket; set {config.hf_token_env} or use --public-bucket"
        )
    hardware_kwargs = {} if config.sleep_time is None else {"sleep_time": config.sleep_time}
    steps.append(Step("request_space_hardware", (rollout_id, config.hardware), hardware_kwargs))
    steps.append(Step("upload_folder", (), {"repo_id": rollout_id, "repo_type": "space",
                                            "commit_message": "deltasync rollout server (spaces/vllm)"},
                      files=space_files("vllm", repo_root)))  # fmt: skip

    steps.append(Step("create_repo", (env_id,), new_space))
    steps.append(Step("add_space_variable", (env_id, "MAX_SESSIONS", str(config.max_sessions))))
    steps.append(Step("request_space_hardware", (env_id, config.env_hardware)))
    steps.append(Step("upload_folder", (), {"repo_id": env_id, "repo_type": "space",
                                            "commit_message": "deltasync Wordle environment (spaces/wordle)"},
                      files=space_files("wordle", repo_root)))  # fmt: skip
    return SpacesPlan(
        config=config,
        namespace=namespace,
        steps=steps,
        bucket_url=bucket_url,
        rollout_url=space_url(namespace, config.rollout_space),
        env_url=space_url(namespace, config.env_space),
        token_export=token.export,
        notes=notes,
    )
