"""What each rank runs in the multi-process PEFT tests (imported by spawned processes).

One gloo process group runs every check: FSDP2 (``fully_shard``) and DDP, each in adapter and
merged mode. The full model is gathered only to check what a receiver holds, never by the
code under test.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from deltasync import DeltaReceiver, fingerprint, open_store
from deltasync.format import POINTER_PATH, Pointer, read_metadata
from deltasync.trainer.lora import (
    ADAPTER_CONFIG_KEY,
    BASE_FINGERPRINT_KEY,
    adapter_publisher,
    _base_parameters,
    adapter_state_dict,
    merged_publisher,
    merged_state_dict,
)

from _sharded_workers import assert_exact, follow, process_group  # this folder is on sys.path (the test puts it there)

STEPS = 5


def lora_net(seed: int = 0) -> torch.nn.Module:
    """A small Qwen2 LM (vocab 259: no world size divides it) with LoRA on q/v/o and down_proj."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=259, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    base = Qwen2ForCausalLM(config).float()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"], lora_dropout=0.0,
                      init_lora_weights=False)  # fmt: skip
    return get_peft_model(base, lora)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 259, (2, 12), generator=gen)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole in fp32 (a collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    return {
        name.removeprefix("module."): (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone()
        for name, p in model.named_parameters()
    }


def reference(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A single-process PEFT model holding ``state``: what the sharded one stands for."""
    model = lora_net()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(m.endswith("lm_head.weight") for m in missing), (missing, unexpected)  # tied
    return model


def _fsdp(model: torch.nn.Module, world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _anchor_metadata(root: Path, version: int) -> dict[str, str]:
    """The metadata of the newest anchor (0, then the one beside version 3)."""
    pointer = Pointer.from_bytes(open_store(root).read_bytes(POINTER_PATH))
    entry = pointer.anchors[-1]
    assert entry.version == version - version % 3, (entry.version, version)
    path = entry.parts[0].path if entry.parts else entry.path
    return read_metadata((root / path).read_bytes(), where=path)


def _run(rank: int, world: int, root: Path, mode: str, parallel: str, report: dict[str, object]) -> None:
    model = lora_net()
    wrapped = _fsdp(model, world) if parallel == "fsdp2" else torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    bucket = root / f"{parallel}-{mode}"
    make = adapter_publisher if mode == "adapter" else merged_publisher
    pub = make(bucket, model, opt, anchor_every=3, anchor_bytes_ratio=0)
    layout = pub.detector.layout
    want_layout = "FSDP2, 2 shards" if parallel == "fsdp2" else f"replicated (DDP), {world} ranks"
    assert layout is not None and layout.description.replace(f"{world} shards", "2 shards") == want_layout, layout
    receiver = DeltaReceiver(bucket) if rank == 0 else None
    kinds, scheduled = [], []
    for i in range(STEPS + 1):
        if i:
            step(wrapped, opt, seed=100 * i + rank)  # different data per rank: DDP averages, FSDP2 reduces
        result = pub.publish()
        pub.flush()  # the anchor beside version 3 commits
        kinds.append(result.kind)
        if result.anchor_scheduled:
            scheduled.append(result.version)
        state = full_state(model)
        if rank != 0:
            continue
        ref = reference(state)
        if mode == "adapter":
            want = adapter_state_dict(ref)
        else:
            # PEFT's own merge of the gathered model, then bf16: what merged mode must equal
            merged = copy.deepcopy(ref).merge_and_unload()
            want = {n: p.detach().to(torch.bfloat16) for n, p in merged.named_parameters()}
            assert all(torch.equal(want[n], t) for n, t in merged_state_dict(ref).items())
        assert receiver is not None
        if result.version:
            follow(receiver, result.version)
        else:
            receiver.sync()
        assert_exact(receiver, want, f"{parallel} {mode} version {result.version}")
        assert result.fingerprint == fingerprint(want)
        if mode == "adapter":
            meta = _anchor_metadata(bucket, result.version)
            assert json.loads(meta[ADAPTER_CONFIG_KEY])["r"] == 4
            # the reference's own base weights, hashed in this process alone (base_fingerprint
            # is collective when torch.distributed has several ranks)
            assert meta[BASE_FINGERPRINT_KEY] == fingerprint(dict(_base_parameters(ref)))
    assert kinds == ["anchor"] + ["delta"] * STEPS and scheduled == [3], (kinds, scheduled)
    if rank == 0:
        pointer = Pointer.from_bytes(open_store(bucket).read_bytes(POINTER_PATH))
        late = DeltaReceiver(bucket)  # from the anchor beside version 3
        staged = late.stage()
        assert (staged.kind, staged.versions) == ("anchor", [3, 4, 5]), staged.versions
        late.apply(staged)
        assert_exact(late, want, f"{parallel} {mode} late receiver")
        report[f"{parallel}-{mode}"] = {
            "parts": [len(e.parts) for e in pointer.chain],
            "anchor_parts": [len(e.parts) for e in pointer.anchors],
            "changed": result.changed,
        }
    pub.close()


def _refusals(rank: int, world: int) -> None:
    """Merged mode refuses a sharded LoRA layer whose pieces are not all Shard(0) alike."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from deltasync import ConfigError

    model = lora_net()
    mesh = init_device_mesh("cpu", (world,))
    # Only the first layer's v_proj base weight is sharded: lora_B stays a plain tensor.
    fully_shard(model.base_model.model.model.layers[0].self_attn.v_proj.base_layer, mesh=mesh)
    try:
        merged_publisher(Path("/nonexistent-never-written"), model)
    except ConfigError as exc:
        text = str(exc)
        assert text.startswith("model.layers.0.self_attn.v_proj.weight: merged mode with sharded parameters"), text
        assert "lora_B is placed as a plain tensor" in text and "peft_sync='adapter'" in text, text
    else:
        raise AssertionError("a half-sharded LoRA layer was accepted in merged mode")


def run(rank: int, world: int, init_file: str, root: str, out: str) -> None:
    with process_group(rank, world, init_file, root):
        report: dict[str, object] = {}
        _refusals(rank, world)
        for parallel in ("fsdp2", "ddp"):
            for mode in ("adapter", "merged"):
                _run(rank, world, Path(root), mode, parallel, report)
        if rank == 0:
            Path(out).write_text(json.dumps(report))
