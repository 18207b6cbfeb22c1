"""``deltasync spaces``: deploy the Wordle example's servers as Hugging Face Spaces.

Three things on the Hub, each created only if missing and configured every time:

1. the bucket ``NAMESPACE/BUCKET`` (private unless asked otherwise) that the trainer publishes to;
2. the rollout Space (``spaces/vllm``: vLLM with deltasync's extension, on a GPU) with the
   variables ``MODEL`` and ``DELTASYNC_BUCKET``, the secrets ``DELTASYNC_TOKEN`` and ``HF_TOKEN``
   and its hardware;
3. the Wordle Space (``spaces/wordle``, on a CPU) with ``MAX_SESSIONS`` and its hardware;

then each Space's files are uploaded (which starts its build). Variables and secrets are set
before the upload, so the first build already runs with them. The shared token is taken from
an environment variable, or from a file, or generated and written to that file; it is never
printed. :func:`deploy_spaces` takes the ``HfApi`` to call, so tests pass a recorder.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import secrets
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._auth import TOKEN_ENV
from ._errors import ConfigError

__all__ = ["SpacesConfig", "SpacesPlan", "Step", "add_parser", "deploy_spaces", "run", "space_files", "space_url"]

DEFAULT_MODEL = "Qwen/Qwen3-1.7B"
_PLACEHOLDER_NAMESPACE = "your-namespace"
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
            f"    --bucket {self.bucket_url}"
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
        ])  # fmt: skip


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


def _repo_root(given: str | os.PathLike[str] | None) -> Path:
    if given is not None:
        return Path(given).resolve()
    here = Path(__file__).resolve().parents[1]  # a source checkout (editable install)
    if (here / "spaces").is_dir():
        return here
    return Path.cwd()


@dataclass
class _Token:
    value: str | None
    source: str
    """Where the value comes from, shown instead of it."""
    export: str
    """How the trainer gets it."""
    generate_to: Path | None = None


def _shared_token(config: SpacesConfig, namespace: str, environ: Mapping[str, str]) -> _Token:
    value = environ.get(config.token_env)
    if value:
        export = f"export {TOKEN_ENV}=...   # the value of ${config.token_env} here"
        return _Token(value, f"the value of ${config.token_env}", export)
    path = Path(config.token_file).expanduser() if config.token_file else default_token_file(namespace,
                                                                                              config.rollout_space)
    export = f"export {TOKEN_ENV}=$(cat {path})"
    if path.is_file() and path.read_text().strip():
        return _Token(path.read_text().strip(), f"the token in {path}", export)
    return _Token(None, f"a new token, written to {path} (mode 600)", export, generate_to=path)


def _plan(
    config: SpacesConfig,
    *,
    namespace: str,
    token: _Token,
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
    variables = {"MODEL": config.model, "DELTASYNC_BUCKET": bucket_url}
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


def deploy_spaces(
    config: SpacesConfig,
    *,
    api: Any = None,
    dry_run: bool = False,
    repo_root: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    echo: Callable[[str], None] = print,
) -> SpacesPlan:
    """Create or update the bucket and both Spaces through ``api`` (default ``HfApi()``).

    With ``dry_run`` print the calls (secrets masked) and touch nothing: no Hub call (the
    namespace, when not given, shows as a placeholder), no token generated or written.
    """
    environ = os.environ if environ is None else environ
    root = _repo_root(repo_root)
    if not dry_run and api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    namespace = config.namespace
    if namespace is None:
        if dry_run:
            namespace = _PLACEHOLDER_NAMESPACE
        else:
            namespace = api.whoami()["name"]
    token = _shared_token(config, namespace, environ)
    hf_token, hf_token_note = _hub_token(config, api, environ)
    if hf_token is None and not config.public_bucket and not dry_run:
        raise ConfigError(
            f"the rollout Space needs a Hub token to read the private bucket {namespace}/{config.bucket}: set "
            f"{config.hf_token_env} (a read token is enough), log in with `hf auth login`, or use --public-bucket"
        )
    plan = _plan(config, namespace=namespace, token=token, hf_token=hf_token, hf_token_note=hf_token_note,
                 repo_root=root)
    if config.namespace is None and dry_run:
        plan.notes.insert(0, f"no --namespace: shown as {namespace!r}; a real run uses the logged-in user's")
    echo(plan.render(dry_run=dry_run))
    if dry_run:
        echo("(dry run: nothing was created, uploaded or written)")
        return plan
    if token.value is None:
        assert token.generate_to is not None
        token.value = secrets.token_urlsafe(32)
        _write_secret(token.generate_to, token.value)
        echo(f"generated the shared token and wrote it to {token.generate_to} (mode 600)")
        plan = _plan(config, namespace=namespace, token=token, hf_token=hf_token, hf_token_note=hf_token_note,
                     repo_root=root)
    for i, step in enumerate(plan.steps, 1):
        echo(f"[{i}/{len(plan.steps)}] {step.describe()}")
        with _staged(step) as kwargs:
            getattr(api, step.method)(*step.args, **kwargs)
    echo("")
    echo(plan.next_steps())
    return plan


def _hub_token(config: SpacesConfig, api: Any, environ: Mapping[str, str]) -> tuple[str | None, str]:
    value = environ.get(config.hf_token_env)
    if value:
        return value, f"the value of ${config.hf_token_env}"
    value = getattr(api, "token", None) if api is not None else None
    if isinstance(value, str) and value:
        return value, "the token of the HfApi used"
    from huggingface_hub import get_token

    value = get_token()
    return (value, "your logged-in Hub token") if value else (None, "")


@contextlib.contextmanager
def _staged(step: Step) -> Iterator[dict[str, Any]]:
    """The step's keyword arguments, with its files copied into a temporary ``folder_path``."""
    if step.files is None:
        yield dict(step.kwargs)
        return
    with tempfile.TemporaryDirectory(prefix="deltasync-space-") as tmp:
        for name, source in step.files.items():
            target = Path(tmp, name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
        yield {**step.kwargs, "folder_path": tmp}


def _write_secret(path: Path, value: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    os.chmod(path, 0o600)


# --------------------------------------------------------------------------- command line


def add_parser(sub: argparse._SubParsersAction) -> None:
    defaults = SpacesConfig.__dataclass_fields__
    p = sub.add_parser(
        "spaces",
        help="deploy the Wordle example's rollout and environment servers as Hugging Face Spaces",
        description="Create (or update) a bucket, a GPU Space running vLLM with deltasync's extension, and a CPU "
        "Space running the Wordle environment; then print how to train against them. --dry-run shows every call.",
    )
    p.add_argument("--namespace", help="user or organisation that owns them (default: the logged-in user)")
    p.add_argument("--bucket", default=defaults["bucket"].default, help="bucket name (default %(default)s)")
    p.add_argument("--model", default=defaults["model"].default, help="model to serve (default %(default)s)")
    p.add_argument("--rollout-space", default=defaults["rollout_space"].default,
                   help="rollout Space name (default %(default)s)")
    p.add_argument("--env-space", default=defaults["env_space"].default, help="Wordle Space name (default %(default)s)")
    p.add_argument("--hardware", default=defaults["hardware"].default,
                   help="rollout Space hardware (default %(default)s; `hf spaces hardware` lists them)")
    p.add_argument("--env-hardware", default=defaults["env_hardware"].default,
                   help="Wordle Space hardware (default %(default)s)")
    p.add_argument("--public-bucket", action="store_true", help="make the bucket public (default: private)")
    p.add_argument("--max-sessions", type=int, default=defaults["max_sessions"].default,
                   help="Wordle games at once (default %(default)s)")
    p.add_argument("--vllm-args", default="",
                   help='extra vLLM flags for the rollout Space (VLLM_ARGS), e.g. --vllm-args="--max-model-len 8192"')
    p.add_argument("--sleep-time", type=int, default=None, help="seconds idle before the rollout Space sleeps")
    p.add_argument("--token-env", default=TOKEN_ENV, metavar="NAME",
                   help="environment variable with the shared token (default %(default)s); when unset, the "
                   "token file's, or a new one written there")
    p.add_argument("--token-file", default=None, metavar="PATH",
                   help="token file (default ~/.cache/deltasync/spaces/NAMESPACE--ROLLOUT_SPACE.token)")
    p.add_argument("--hf-token-env", default="HF_TOKEN", metavar="NAME",
                   help="environment variable with the Hub token the rollout Space reads the bucket and model "
                   "with (default %(default)s; else your logged-in token)")
    p.add_argument("--repo", default=None, metavar="PATH", help="deltasync checkout to upload from (default: this one)")
    p.add_argument("--dry-run", action="store_true", help="print every call it would make (secrets masked); do nothing")
    p.add_argument("--yes", action="store_true", help="do not ask before creating paid hardware")


def run(args: argparse.Namespace) -> int:
    config = SpacesConfig(
        namespace=args.namespace,
        bucket=args.bucket,
        model=args.model,
        rollout_space=args.rollout_space,
        env_space=args.env_space,
        hardware=args.hardware,
        env_hardware=args.env_hardware,
        public_bucket=args.public_bucket,
        max_sessions=args.max_sessions,
        vllm_args=args.vllm_args,
        sleep_time=args.sleep_time,
        token_env=args.token_env,
        token_file=args.token_file,
        hf_token_env=args.hf_token_env,
    )
    if args.dry_run:
        plan = deploy_spaces(config, dry_run=True, repo_root=args.repo)
        print()
        print(plan.next_steps())
        return 0
    if not args.yes:
        deploy_spaces(config, dry_run=True, repo_root=args.repo, echo=lambda _line: None)  # validate first
        if not sys.stdin.isatty():
            raise ConfigError("deltasync spaces creates paid hardware: add --yes to go ahead (or --dry-run to see "
                              "every call first)")
        answer = input(f"Create or update the bucket and two Spaces ({config.hardware} is billed while it runs)? "
                       "[y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing done")
            return 1
    deploy_spaces(config, repo_root=args.repo)
    return 0
