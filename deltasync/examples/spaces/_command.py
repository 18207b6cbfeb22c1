"""``deltasync spaces`` on the command line: options to :class:`SpacesConfig`, and a question before paid hardware."""

from __future__ import annotations

import argparse
import sys

from ...errors import ConfigError
from ...protocol.auth import TOKEN_ENV
from ._hub import deploy_spaces
from ._plan import SpacesConfig


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
    p.add_argument("--follow", action="store_true",
                   help="the rollout Space follows the bucket by itself (DELTASYNC_FOLLOW=1): the trainer only "
                   "publishes (examples/async_wordle.py --follow) and needs the Space's URL for generation only")
    p.add_argument("--follow-interval", type=float, default=None, metavar="SECONDS",
                   help="with --follow: seconds between two reads of the bucket's pointer (default 2: 1,800 reads "
                   "an hour)")
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
        follow=args.follow,
        follow_interval=args.follow_interval,
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
