"""One rank of TRL's AsyncGRPOTrainer(delta_sync=...) on several CPU processes (run by torchrun).

``python -m torch.distributed.run --nproc_per_node 2 _trl_multiprocess.py MODEL BUCKET URL TOKEN OUT MODE STEPS``
with ``ACCELERATE_USE_CPU=true``. MODE is "ddp" (accelerate's MULTI_CPU), "ddp-lora" (the same with a
LoRA ``peft_config``, merged mode: the server has no LoRA) or "fsdp2": accelerate
drops FSDP on the CPU, so the trainer is switched to it after construction, the documented
workaround (see the README's multi-GPU section). Rank 0 writes a JSON report and the final full
bf16 weights (gathered here for the check only) to OUT.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(model_dir: str, bucket: str, url: str, token: str, out: str, mode: str, steps: str) -> None:
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    from deltasync import Pointer, RolloutClient, checkpoint_name, fingerprint, open_store
    from deltasync.examples.demo import reward_target_letter
    from deltasync.trl import AsyncGRPOConfig, AsyncGRPOTrainer, DeltaSyncConfig

    torch.set_num_threads(1)
    prompts = [[{"role": "user", "content": f"Say something about {w}."}] for w in ("cats", "rain", "tea", "maps")] * 8
    config = AsyncGRPOConfig(
        output_dir=str(Path(out) / "trainer"),
        max_steps=int(steps),
        learning_rate=1e-4,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_inflight_tasks=4,
        queue_maxsize=8,
        token_budget=0,
        gradient_checkpointing=False,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        vllm_server_base_url=url,
    )
    peft_config = None
    if mode == "ddp-lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    trainer = AsyncGRPOTrainer(
        model=model_dir,
        reward_funcs=[reward_target_letter],
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        delta_sync=DeltaSyncConfig(bucket=bucket, server_urls=[url], token=token),
        peft_config=peft_config,
    )
    if mode == "fsdp2":
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        state = trainer.accelerator.state
        state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
        trainer.is_fsdp_enabled = True
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    full = {
        checkpoint_name(name): (p.full_tensor() if isinstance(p, DTensor) else p.detach()).to(torch.bfloat16).contiguous()
        for name, p in model.named_parameters()
    }
    if peft_config is not None:
        import copy

        # What the server must serve: PEFT's merge of the trained adapter, then bf16.
        merged = copy.deepcopy(model).merge_and_unload()
        full = {checkpoint_name(n): p.detach().to(torch.bfloat16).contiguous() for n, p in merged.named_parameters()}
    layout = trainer.delta_publisher.detector.layout
    if trainer.accelerator.is_main_process:
        status = RolloutClient([url], token=token).status()[url]
        pointer = Pointer.from_bytes(open_store(bucket).read_bytes("latest.json"))
        save_file(full, str(Path(out) / "model.safetensors"))
        report = {
            "world": trainer.accelerator.num_processes,
            "sharded": sharded,
            "layout": None if layout is None else layout.description,
            "peft_sync": trainer._peft_sync,
            "parts": [len(e.parts) for e in pointer.chain],  # the deltas
            "anchor_parts": [len(e.parts) for e in pointer.anchors],
            "history": trainer.delta_history,
            "publisher_version": trainer.delta_publisher.version,
            "model_version": trainer.model_version,
            "trainer_fingerprint": fingerprint(full),
            "server_ok": status.ok,
            "server_error": status.error,
            "server_version": status.version,
            "server_fingerprint": status.fingerprint,
        }
        (Path(out) / "report.json").write_text(json.dumps(report, default=str))
    # Every rank leaves together, its groups shut down before the interpreter exits.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
