"""The deployment itself: the Hub calls of a plan, through the ``HfApi`` given (tests pass a recorder)."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from ._plan import SpacesConfig, SpacesPlan, Step, build_plan, find_repo_root, shared_token

_PLACEHOLDER_NAMESPACE = "your-namespace"


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
    root = find_repo_root(repo_root)
    if not dry_run and api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    namespace = config.namespace
    if namespace is None:
        if dry_run:
            namespace = _PLACEHOLDER_NAMESPACE
        else:
            namespace = api.whoami()["name"]
    token = shared_token(config, namespace, environ)
    hf_token, hf_token_note = _hub_token(config, api, environ)
    if hf_token is None and not config.public_bucket and not dry_run:
        raise ConfigError(
            f"the rollout Space needs a Hub token to read the private bucket {namespace}/{config.bucket}: set "
            f"{config.hf_token_env} (a read token is enough), log in with `hf auth login`, or use --public-bucket"
        )
    plan = build_plan(config, namespace=namespace, token=token, hf_token=hf_token, hf_token_note=hf_token_note,
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
        plan = build_plan(config, namespace=namespace, token=token, hf_token=hf_token, hf_token_note=hf_token_note,
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
