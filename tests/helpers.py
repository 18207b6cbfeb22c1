"""Helpers shared by the tests: small models built offline, training steps, old pointers."""

from __future__ import annotations

import json

import threading

import torch

from deltasync import NotFoundError, StoreError
from deltasync.reader.chain import bits
from deltasync.stores import LocalStore

def small_transformer(seed: int = 0) -> torch.nn.Module:
    """A 2-layer Qwen2-style causal LM with tied embeddings, fp32, built from a config."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(config).float()

def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int, *, step: bool = True) -> None:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (4, 16), generator=gen)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    if step:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def tiny_grpo_args(output_dir, url: str, steps: int, **overrides):
    """``(AsyncGRPOConfig, Dataset)`` for a few quick TRL steps of the tiny model against ``url``:
    short completions, small queues (two cores), no checkpoints or reports."""
    from datasets import Dataset

    from deltasync.trl import AsyncGRPOConfig

    prompts = [[{"role": "user", "content": f"Say something about {w}."}] for w in ("cats", "rain", "tea", "maps")] * 8
    options = dict(
        output_dir=str(output_dir), max_steps=steps, learning_rate=1e-4, per_device_train_batch_size=8,
        num_generations=4, max_completion_length=8, max_inflight_tasks=4, queue_maxsize=8, token_budget=0,
        gradient_checkpointing=False, report_to=[], save_strategy="no", logging_steps=1, vllm_server_base_url=url,
    )  # fmt: skip
    return AsyncGRPOConfig(**{**options, **overrides}), Dataset.from_dict({"prompt": prompts})


def old_pointer(pointer, format_version: int = 1) -> bytes:
    """``pointer`` (a :class:`deltasync.Pointer`) laid out as formats 1 and 2 wrote it: one
    chain, the anchor first, then its deltas. Writers write format 3 only; this makes the old
    buckets readers must still read. Only a pointer whose one anchor is at its base has this
    layout."""
    assert format_version in (1, 2)
    (anchor,) = pointer.anchors
    assert anchor.version == pointer.base, "formats 1 and 2 cannot list deltas before the anchor"
    body = {
        "format": "deltasync",
        "format_version": format_version,
        "version": pointer.version,
        "anchor": anchor.version,
        "fingerprint": pointer.fingerprint,
        "total": pointer.total,
        "chain": [item.to_json() for item in (anchor, *pointer.chain)],
    }
    return (json.dumps(body, sort_keys=True, indent=1) + "\n").encode()


def replace_file(
    store, version: int, data: bytes, *, kind: str = "delta", fix_pointer: bool = True, manifest: str | None = None
) -> None:
    """Overwrite the committed delta (or anchor, with ``kind="anchor"``) of ``version``; with
    ``fix_pointer``, also rewrite the pointer to the new size and SHA-256, as an attacker who
    controls the whole bucket would, and with ``manifest`` its manifest digest too."""
    import dataclasses

    from deltasync import Pointer
    from deltasync.format import POINTER_PATH, sha256_hex

    pointer = Pointer.from_bytes(store.read_bytes(POINTER_PATH))
    key = {"delta": "chain", "anchor": "anchors"}[kind]
    items = getattr(pointer, key)
    (entry,) = [item for item in items if item.version == version]
    store.write_bytes(entry.path, data)
    if fix_pointer:
        items = tuple(dataclasses.replace(e, nbytes=len(data), sha256=sha256_hex(data)) if e is entry else e for e in items)
        changes = {key: items} if manifest is None else {key: items, "manifest": manifest}
        store.write_bytes(POINTER_PATH, dataclasses.replace(pointer, **changes).to_bytes())


def record_thread_starts(monkeypatch) -> list[str]:  # type: ignore[no-untyped-def]
    """Every thread started from now on, as ``"<its name> from <the starting thread's name>"``."""
    started: list[str] = []
    real = threading.Thread.start

    def start(self: threading.Thread) -> None:
        started.append(f"{self.name} from {threading.current_thread().name}")
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    return started


class GatedStore(LocalStore):
    """A local bucket for background-publishing tests: writes of paths starting with ``gated``
    wait for ``gate`` (``waiting`` is set once one does), a write of a path starting with
    ``fail`` fails once, and every read is recorded in ``reads``."""

    def __init__(self, root) -> None:  # type: ignore[no-untyped-def]
        super().__init__(root)
        self.gated, self.fail = "", ""
        self.gate, self.waiting = threading.Event(), threading.Event()
        self.gate.set()
        self.reads: list[str] = []

    def _before_write(self, path: str) -> None:
        if self.fail and path.startswith(self.fail):
            self.fail = ""
            raise StoreError(f"injected failure writing {path!r}")
        if self.gated and path.startswith(self.gated):
            self.waiting.set()
            assert self.gate.wait(60), "the gate was never opened"

    def write_bytes(self, path: str, data: bytes) -> None:
        self._before_write(path)
        super().write_bytes(path, data)

    def write_stream(self, path, chunks) -> None:  # type: ignore[no-untyped-def]
        self._before_write(path)
        super().write_stream(path, chunks)

    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        self.reads.append(path)
        return super().read_bytes(path, limit)

    def open_read(self, path: str):  # type: ignore[no-untyped-def]
        self.reads.append(path)
        return super().open_read(path)


class FiveMethodStore:
    """A custom store with only the protocol's five methods (no streaming, no read limit)."""

    def __init__(self) -> None:
        self.url = "custom://five"
        self.files: dict[str, bytes] = {}

    def read_bytes(self, path: str) -> bytes:
        if path not in self.files:
            raise NotFoundError(path)
        return self.files[path]

    def write_bytes(self, path: str, data: bytes) -> None:
        self.files[path] = bytes(data)

    def exists(self, path: str) -> bool:
        return path in self.files

    def list(self, prefix: str = "") -> list[str]:
        return sorted(p for p in self.files if p.startswith(prefix))

    def delete(self, paths) -> None:  # type: ignore[no-untyped-def]
        for path in paths:
            self.files.pop(path, None)


# --------------------------------------------------------------------------- chains of bit patterns

#: bf16 bit patterns a float path would not keep: NaN payloads, -0.0, infinities, subnormals.
PATTERNS = [0x7FC1, 0xFFFF, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x7F81]


def checkpoint_model(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> torch.nn.Module:
    """A module whose parameters are named ``<module>.<attr>`` as ``shapes`` says (bf16)."""
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Module()
    for name, shape in shapes.items():
        module, attr = name.split(".")
        sub = torch.nn.Module()
        sub.register_parameter(attr, torch.nn.Parameter(torch.randn(shape, generator=gen).to(torch.bfloat16)))
        model.add_module(module, sub)
    return model


def edit_bits(model: torch.nn.Module, step: int) -> None:
    """Step ``step``'s changes: a few elements of every parameter, special patterns included."""
    with torch.no_grad():
        for k, param in enumerate(model.parameters()):
            flat = bits(param.data.view(-1))
            for j in range(3):
                pattern = PATTERNS[(step + j) % len(PATTERNS)]
                flat[(step * 5 + k * 3 + j * 7) % flat.numel()] = pattern - 0x10000 if pattern >= 0x8000 else pattern
            param.data.view(-1)[(step * 11 + k) % flat.numel()] += 1


def publish_chain(
    bucket, model: torch.nn.Module, *, deltas: int, anchor_at: int | None = None, metadata: dict | None = None, **options
) -> list[dict]:
    """Anchor 0 and ``deltas`` deltas of :func:`edit_bits` (an extra anchor at ``anchor_at``,
    both kept; ``metadata`` in every anchor); the state of each version."""
    from deltasync import DeltaPublisher

    publisher = DeltaPublisher(bucket, model, **{"anchor_bytes_ratio": 0, "keep_anchors": 2, **options})
    publisher.anchor_metadata = dict(metadata or {})
    states = []
    for step in range(deltas + 1):
        if step:
            edit_bits(model, step)
        publisher.publish(anchor=step == anchor_at)
        states.append({n: p.detach().clone() for n, p in model.named_parameters()})
    publisher.close()
    return states


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Same names, and the same bf16 bit patterns in each."""
    return set(a) == set(b) and all(torch.equal(bits(a[n].reshape(-1)), bits(b[n].reshape(-1))) for n in a)


def chain_manifest(store) -> str | None:
    """The manifest digest a bucket's pointer commits (what a forged file must name to get past
    the header check)."""
    from deltasync import Pointer
    from deltasync.format import POINTER_PATH

    return Pointer.from_bytes(store.read_bytes(POINTER_PATH)).manifest
