"""``deltasync demo``: a real async GRPO run with delta sync, on the CPU, from nothing.

It builds a tiny model and tokenizer offline and fits it for a few seconds to answer with one
word (no syncing yet), starts a real vLLM server with the deltasync extension following a local
bucket, trains with TRL's AsyncGRPOTrainer (``delta_sync``) at an RL learning rate to answer
with words rich in the letter "e", and checks at the end that the server serves exactly the
trainer's bf16 weights.

Why these settings: the share of bf16 elements a step changes is set by the learning rate
against the weights' magnitude (an update smaller than half a bf16 step rounds away), and how
far the policy moves by the learning rate against how many weights act together, which a
128-wide model has few of. A random tiny model at Qwen2's std 0.02 needs a rate that changes
most elements to learn anything in a minute; drawn at std 0.2 and fitted first, it learns at
4e-5 while each step changes a few % of its elements, as RL steps on real models do.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
import warnings
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from ..errors import DeltaSyncError

__all__ = ["NOISE", "NOISE_LOGS", "add_parser", "run", "reward_target_letter", "silence_noise"]

TARGET = "e"
#: Subjects of the prompts ("Say one word about the sea.").
SUBJECTS = ("the sea", "a tree", "the moon", "green fields", "the wind", "a river", "evening", "bees")
#: The words the base model is fitted to answer with, before RL: from none to half of their
#: letters an "e", so the reward has room to rise (0.18 on average at the start, 0.5 at best).
WORDS = ("we", "he", "be", "week", "there", "the", "sea", "one", "and", "of", "in", "is", "it", "day", "wind",
         "water", "two", "four", "old", "a")
INIT_STD = 0.2
"""Standard deviation of the tiny model's random weights (see the module docstring)."""
FIT_STEPS = 100
"""Supervised steps that fit the base model to answer with one word of :data:`WORDS`."""
ANCHOR_EVERY = 25
"""The demo's anchor schedule; the size rule (``anchor_bytes_ratio=1``) only fires if deltas
grow unexpectedly, and the summary says which anchors came from where."""


def reward_target_letter(completions: list[Any], **kwargs: Any) -> list[float]:
    """The demo's task: use the letter "e" as much as possible (share of letters that are "e").

    Module-level so TRL's rollout process (spawned) can import it.
    """
    rewards = []
    for completion in completions:
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        letters = [c for c in (text or "").lower() if c.isalpha()]
        rewards.append(sum(c == TARGET for c in letters) / len(letters) if letters else 0.0)
    return rewards


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="run a real async GRPO training with delta sync on the CPU (tiny model, real vLLM server)",
        description="Build a tiny model offline, start a vLLM server with the deltasync extension, "
        "train it with TRL's AsyncGRPOTrainer(delta_sync=...) and check the server ends bit-exact.",
    )
    p.add_argument("--steps", type=int, default=40, help="optimizer steps (default 40)")
    p.add_argument("--output", default="deltasync-demo", help="output folder (default ./deltasync-demo)")
    p.add_argument("--bucket", default=None, help="bucket URL or path (default OUTPUT/bucket)")
    p.add_argument("--keep-server", action="store_true", help="leave the vLLM server running at the end")
    p.add_argument(
        "--lr", type=float, default=4e-5,
        help="learning rate (default 4e-5: each step changes a few %% of the bf16 elements, "
        "as RL steps on real models do, and the reward still rises within the run)",
    )
    p.add_argument("--port", type=int, default=None, help="server port (default: a free one)")
    p.add_argument("--view", default=None, metavar="SCHEME",
                   help="serve a quantized view (e.g. FP8_DYNAMIC): the server starts from the model quantized as "
                   "SCHEME and follows that view of the bucket; the trainer publishes it beside the bf16 chain")
    p.add_argument("--seed", type=int, default=0)


def _say(message: str) -> None:
    print(message, flush=True)


#: Warnings the demo silences, each known to be noise here: (start of the message, category).
NOISE: tuple[tuple[str, type[Warning]], ...] = (
    # TRL 1.16 checks the installed vLLM against 0.22-0.31 each time one of its modules asks,
    # in the trainer and in its rollout process. The demo's trainer never drives vLLM (rollouts
    # go over HTTP, weights through the bucket), and deltasync's tests run TRL 1.16 against the
    # vLLM it pins.
    ("TRL currently supports vLLM versions", UserWarning),
)
#: Log records the demo drops, each known to be noise here: (logger, start of the message).
NOISE_LOGS = (
    # TRL's async GRPO trainer adds two StepIntervalCallbacks on purpose (weight sync and
    # metrics, each on its own interval); transformers warns about any class added twice.
    ("transformers.trainer_callback", "You are adding a <class 'trl.experimental.async_grpo"),
    # The trainer imports vLLM only through TRL's helpers and runs none of its kernels. (TRL's
    # spawned rollout process logs it once more: no setting of ours reaches it before it
    # imports vLLM, and vLLM's own log level does not apply that early.)
    ("vllm.triton_utils.importing", "Triton is installed, but doesn't include CPU backend"),
)


class _DropLog(logging.Filter):
    """Drops the records whose message starts with ``prefix``."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def silence_noise(environ: MutableMapping[str, str] = os.environ) -> None:
    """Silence :data:`NOISE` and :data:`NOISE_LOGS` in this process, and :data:`NOISE` in the
    processes it starts (they read ``PYTHONWARNINGS``, TRL's spawned rollout worker too)."""
    for message, category in NOISE:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)
    for name, prefix in NOISE_LOGS:
        logging.getLogger(name).addFilter(_DropLog(prefix))
    # -W syntax, action:message:category; the message is matched literally, at the start.
    options = [f"ignore:{message}:{category.__name__}" for message, category in NOISE]
    present = [o for o in environ.get("PYTHONWARNINGS", "").split(",") if o]
    environ["PYTHONWARNINGS"] = ",".join(present + [o for o in options if o not in present])


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    silence_noise()
    import torch

    torch.set_num_threads(1)
    from .. import open_store
    from ..control.serve import extension_args
    from ..protocol.env import BUCKET_ENV, PLAIN_GEMM_ENV
    from .launcher import VLLMServer
    from .tiny import build_tiny_model, fit_tiny_model

    if args.steps < 1:
        from ..errors import ConfigError

        raise ConfigError(f"--steps must be >= 1, got {args.steps}")
    out = Path(args.output).resolve()
    out.mkdir(parents=True, exist_ok=True)
    bucket = args.bucket or str(out / "bucket")
    open_store(bucket)  # validate the URL before anything slow
    started = time.perf_counter()
    _say(f"[1/5] building a tiny Qwen2 model and tokenizer offline in {out / 'base-model'}, "
         f"fitting it to answer with one word ({FIT_STEPS} supervised steps, no syncing)")
    model_dir = build_tiny_model(out / "base-model", seed=args.seed, initializer_range=INIT_STD)
    fit_tiny_model(model_dir, _fit_texts(model_dir), steps=FIT_STEPS, seed=args.seed)
    served_dir = model_dir
    if args.view is not None:
        served_dir = _view_checkpoint(model_dir, out / f"base-model-{args.view}", args.view)
        _say(f"      quantized it as {args.view} for the server: {served_dir}")
    _say("[2/5] starting a vLLM server with the deltasync extension (about 30-60 s on a CPU)")
    server = VLLMServer(
        served_dir,
        port=args.port,
        # Plain CPU linear weights: deltas are written in place and the server's fingerprint
        # is hashed from the weights it serves, so the EXACT check below is about the model.
        env={BUCKET_ENV: bucket, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", PLAIN_GEMM_ENV: "1"},
        extra_args=[
            *extension_args(),
            "--served-model-name", str(model_dir),
            # TRL seeds every request; vLLM-CPU crashes prefilling a seeded request in chunks
            "--no-enable-chunked-prefill",
        ],
        log_file=out / "vllm-server.log",
    )
    server.start(timeout=600)
    _say(f"      server ready at {server.url} (log: {out / 'vllm-server.log'})")
    try:
        code = _train(args, out, bucket, model_dir, server.url, started)
    finally:
        if args.keep_server:
            _say(f"server left running at {server.url} (pid {server.pid}); stop it with: kill -TERM -{server.pid}")
        else:
            server.stop()
    return code


def _view_checkpoint(model_dir: Path, out: Path, view: str) -> Path:
    """The fitted model quantized as ``view`` (the view's version 0), for the server to start from."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from .. import write_view_checkpoint

    if out.exists():
        shutil.rmtree(out)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)  # as the trainer loads it
    write_view_checkpoint(model, out, view, like=model_dir)
    return out


def _prompt(subject: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Say one word about {subject}."}]


def _fit_texts(model_dir: Path) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [
        tokenizer.apply_chat_template([*_prompt(subject), {"role": "assistant", "content": word}], tokenize=False)
        for subject in SUBJECTS
        for word in WORDS
    ]


def _train(args: argparse.Namespace, out: Path, bucket: str, model_dir: Path, url: str, started: float) -> int:
    from datasets import Dataset
    from transformers import TrainerCallback

    from .. import PublishOptions, RolloutClient, bf16_state_dict, fingerprint
    from ..trl import AsyncGRPOConfig, AsyncGRPOTrainer, DeltaSyncConfig, cpu_config_overrides

    _say(f"[3/5] training {args.steps} steps at learning rate {args.lr:g} with AsyncGRPOTrainer(delta_sync=...), "
         f"bucket {bucket}; reward: the share of '{TARGET}' in the answer")
    dataset = Dataset.from_dict({"prompt": [_prompt(subject) for subject in SUBJECTS] * 8})
    config = AsyncGRPOConfig(
        output_dir=str(out / "trainer"),
        max_steps=args.steps,
        learning_rate=args.lr,
        per_device_train_batch_size=32,  # 4 prompts x 8 answers per step
        num_generations=8,
        max_completion_length=8,
        max_inflight_tasks=4,
        queue_maxsize=32,
        max_staleness=8,
        disable_tqdm=True,
        token_budget=0,
        gradient_checkpointing=False,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        vllm_server_base_url=url,
        seed=args.seed,
        temperature=1.0,
        **cpu_config_overrides(),  # fp32 training where bf16 training is unavailable
    )

    rows: list[dict[str, Any]] = []

    class Progress(TrainerCallback):
        def on_log(self, _args: Any, state: Any, _control: Any, logs: dict[str, float] | None = None, **kw: Any) -> None:
            if not logs or "reward" not in logs:
                return
            history = trainer.delta_history
            last = history[-1] if history else {}
            row = {
                "step": state.global_step,
                "reward": float(logs["reward"]),
                "version": last.get("version"),
                "kind": last.get("kind"),
                "changed": last.get("changed_fraction", 0.0),
                "nbytes": last.get("nbytes", 0),
                "paused_s": last.get("paused_s", 0.0),
            }
            rows.append(row)
            _say(
                f"  step {row['step']:3d}/{args.steps}  version {row['version']}  {row['kind']:6s}  "
                f"changed {100 * row['changed']:6.2f}%  {row['nbytes'] / 1e3:9.1f} KB  "
                f"paused {row['paused_s']:.3f}s  reward {row['reward']:.3f}"
            )

    trainer = AsyncGRPOTrainer(
        model=str(model_dir),
        reward_funcs=[reward_target_letter],
        args=config,
        train_dataset=dataset,
        callbacks=[Progress()],
        delta_sync=DeltaSyncConfig(
            bucket=bucket, server_urls=[url], publish=PublishOptions(anchor_every=ANCHOR_EVERY, anchor_bytes_ratio=1.0),
            view=args.view,
        ),
    )
    # Our per-step line replaces the Trainer's progress bar and printed log dicts.
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.train()

    _say(f"[4/5] saving the trained model to {out / 'model'}")
    trainer.save_model(str(out / "model"))
    model = trainer.accelerator.unwrap_model(trainer.model)
    want = fingerprint(bf16_state_dict(model))
    with RolloutClient([url]) as client:
        served = client.served()[url]
    history = trainer.delta_history
    publisher = trainer.delta_publisher
    what = "trainer bf16 fingerprint"
    if args.view is not None:
        assert publisher is not None
        want, what = publisher.view_fingerprint(args.view) or "", f"trainer's {args.view} view fingerprint"
    # In-place mode hashes the fingerprint from the weights being served; only then is it proof.
    exact = served.ok and served.mode == "in-place" and served.view == args.view and served.fingerprint == want
    status = served
    _say("[5/5] summary")
    _say(_summary(rows, history, _anchor_sizes(bucket)))
    if args.view is not None:
        view_bytes = sum(h.get("view_nbytes") or 0 for h in history)
        bf16_bytes = sum(h["nbytes"] for h in history)
        _say(f"  {args.view} view: {view_bytes / 1e6:.2f} MB shipped beside the bf16 chain's {bf16_bytes / 1e6:.2f} MB "
             f"({view_bytes / max(bf16_bytes, 1):.2f}x)")
    _say(f"  served weights ({status.mode} mode{', view ' + str(status.view) if status.view else ''}): version "
         f"{status.version}, fingerprint {status.fingerprint}; {what} {want}: " + ("EXACT" if exact else "MISMATCH"))
    _say(_plot_line(rows, history, out / "demo.png"))
    (out / "history.json").write_text(json.dumps({"steps": rows, "syncs": history}, indent=1))
    _say(f"done in {time.perf_counter() - started:.0f} s; outputs in {out}")
    if not exact:
        print(f"error: the server does not serve the trainer's weights ({status.error or 'fingerprint mismatch'})",
              file=sys.stderr)
        return 1
    return 0


def _anchor_sizes(bucket: str) -> dict[int, int]:
    """Version -> size of its anchor file, from the bucket's history (anchors beside deltas are
    written in the background: the sync records do not know their size)."""
    from .. import open_store

    sizes: dict[int, int] = {}
    try:
        text = open_store(bucket).read_bytes("history.jsonl").decode()
    except DeltaSyncError:
        return sizes
    for line in text.splitlines():
        record = json.loads(line) if line.strip() else {}
        if record.get("kind") == "anchor":
            sizes[int(record["version"])] = int(record["nbytes"])
        elif "anchor_nbytes" in record:
            sizes[int(record["version"])] = int(record["anchor_nbytes"])
    return sizes


def _summary(rows: list[dict[str, Any]], history: list[dict[str, Any]], anchors: dict[int, int]) -> str:
    """The run in figures: sparsity of the deltas, anchors, bytes against full copies, reward.
    ``anchors``: version -> anchor size of every anchor written (first version included)."""
    import statistics

    deltas = [h for h in history if h["kind"] == "delta"]
    beside = sorted(v for v in anchors if any(h["version"] == v and h["kind"] == "delta" for h in history))
    scheduled = [v for v in beside if v % ANCHOR_EVERY == 0]
    shipped = sum(h["nbytes"] for h in deltas) + sum(anchors.values())
    full = max(anchors.values(), default=0) * len(history)
    paused = [h["paused_s"] for h in history[1:]] or [0.0]
    lines = [f"  versions published: {len(history)}: {len(history) - len(deltas)} with an anchor only "
             f"(the first), {len(deltas)} deltas; {len(beside)} anchors written beside deltas (versions "
             f"{', '.join(map(str, beside)) or 'none'}; {len(scheduled)} on the every-{ANCHOR_EVERY} schedule)"]
    if deltas:
        changed = sorted(100 * h["changed_fraction"] for h in deltas)
        lines.append(f"  changed per delta: median {statistics.median(changed):.2f}% of the bf16 elements "
                     f"(min {changed[0]:.2f}%, max {changed[-1]:.2f}%); median delta "
                     f"{statistics.median(h['nbytes'] for h in deltas) / 1e3:.1f} KB")
    lines.append(f"  bytes shipped: {shipped / 1e6:.2f} MB; full bf16 copies would be {full / 1e6:.2f} MB "
                 f"({full / max(shipped, 1):.1f}x more)")
    lines.append(f"  mean inference pause per update: {sum(paused) / len(paused):.3f} s")
    if rows:
        k = max(1, min(10, len(rows) // 4))  # a quarter of the run, at most 10 steps: rewards are noisy
        first = sum(r["reward"] for r in rows[:k]) / k
        last = sum(r["reward"] for r in rows[-k:]) / k
        lines.append(f"  reward: {first:.3f} (mean of the first {k} steps) -> {last:.3f} (last {k}), "
                     f"{last - first:+.3f}")
    return "\n".join(lines)


def _plot_line(rows: list[dict[str, Any]], history: list[dict[str, Any]], path: Path) -> str:
    if _plot(rows, history, path):
        return f"  plot: {path}"
    return "  plot skipped: matplotlib is not installed (pip install 'deltasync[plot]', or pip install matplotlib)"


def _plot(rows: list[dict[str, Any]], history: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=False)
    versions = [h["version"] for h in history]
    colors = ["tab:red" if h["kind"] == "anchor" else "tab:blue" for h in history]
    ax1.bar(versions, [h["nbytes"] / 1e3 for h in history], color=colors)
    ax1.set_ylabel("KB a follower downloads")
    ax1.set_xlabel("version (red: the first, an anchor; blue: deltas)")
    ax1.set_title("deltasync demo: bytes per sync and reward per step")
    steps, rewards = [r["step"] for r in rows], [r["reward"] for r in rows]
    ax2.plot(steps, rewards, marker="o", linestyle="", color="tab:green", alpha=0.5, label="per step")
    window = 8  # rewards of 32 answers per step are noisy: show the trend too
    if len(rewards) >= window:
        means = [sum(rewards[i - window + 1 : i + 1]) / window for i in range(window - 1, len(rewards))]
        ax2.plot(steps[window - 1 :], means, color="tab:green", label=f"mean of the last {window} steps")
    ax2.legend(loc="lower right")
    ax2.set_xlabel("optimizer step")
    ax2.set_ylabel(f"reward (share of '{TARGET}')")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
