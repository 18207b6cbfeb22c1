"""Compare, between two vLLM releases, the source of every vLLM API deltasync touches.

    pip download vllm==0.32.0 vllm==0.33.0 --no-deps --only-binary :all: -d wheels/
    python scripts/vllm_api_diff.py wheels/vllm-0.32.0-*.whl wheels/vllm-0.33.0-*.whl [--diff]

Reads the Python sources inside the two wheels (no install, no GPU) and prints, per symbol,
"same", "CHANGED" (with ``--diff``, the unified diff) or "MISSING". A CHANGED symbol still
needs a reading: the README's "vLLM versions" says which changes were judged harmless and why.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import sys
import zipfile

#: (file under vllm/, dotted symbol), grouped by what deltasync uses it for.
SYMBOLS = {
    "weight-transfer engine (vllm_ext/_engine.py, vllm_ext.register)": [
        ("distributed/weight_transfer/base.py", "WeightTransferEngine"),
        ("distributed/weight_transfer/base.py", "WeightTransferInitInfo"),
        ("distributed/weight_transfer/base.py", "WeightTransferUpdateInfo"),
        ("distributed/weight_transfer/base.py", "WeightTransferUpdateRequest"),
        ("distributed/weight_transfer/factory.py", "WeightTransferEngineFactory"),
        ("v1/worker/gpu_worker.py", "Worker.init_weight_transfer_engine"),
        ("v1/worker/gpu_worker.py", "Worker.start_weight_update"),
        ("v1/worker/gpu_worker.py", "Worker.update_weights"),
        ("v1/worker/gpu_worker.py", "Worker.finish_weight_update"),
        ("v1/engine/async_llm.py", "AsyncLLM.start_weight_update"),
        ("v1/engine/async_llm.py", "AsyncLLM.update_weights"),
        ("v1/engine/async_llm.py", "AsyncLLM.finish_weight_update"),
        ("entrypoints/rl/online/api_router.py", "start_weight_update"),
        ("entrypoints/rl/online/api_router.py", "update_weights"),
        ("entrypoints/rl/online/api_router.py", "finish_weight_update"),
    ],
    "pause / resume (vllm_ext/_vllm_engine.py)": [
        ("v1/engine/async_llm.py", "AsyncLLM.pause_generation"),
        ("v1/engine/async_llm.py", "AsyncLLM.resume_generation"),
        ("v1/engine/core_client.py", "AsyncMPClient.pause_scheduler_async"),
        ("v1/engine/core_client.py", "AsyncMPClient.resume_scheduler_async"),
        ("v1/engine/core.py", "EngineCore.pause_scheduler"),
        ("v1/engine/core.py", "EngineCore.resume_scheduler"),
        ("engine/protocol.py", "EngineClient.pause_generation"),
        ("engine/protocol.py", "EngineClient.resume_generation"),
        ("entrypoints/rl/online/api_router.py", "pause_generation"),
        ("entrypoints/rl/online/api_router.py", "resume_generation"),
    ],
    "collective_rpc and the worker extension (vllm_ext/_extension.py, _vllm_engine.py, _lora.py)": [
        ("v1/engine/async_llm.py", "AsyncLLM.collective_rpc"),
        ("engine/protocol.py", "EngineClient.collective_rpc"),
        ("entrypoints/serve/dev/rpc/api_router.py", "collective_rpc"),
        ("v1/executor/multiproc_executor.py", "MultiprocExecutor.collective_rpc"),
        ("v1/executor/uniproc_executor.py", "UniProcExecutor.collective_rpc"),
        ("v1/worker/worker_base.py", "WorkerWrapperBase"),
        ("v1/worker/worker_base.py", "WorkerBase.get_model"),
        ("v1/worker/cpu_model_runner.py", "CPUModelRunner.get_model"),
        ("distributed/parallel_state.py", "get_tp_group"),
        ("distributed/parallel_state.py", "get_pp_group"),
        ("distributed/parallel_state.py", "GroupCoordinator.__init__"),
    ],
    "model loader and load_weights (vllm_ext/_reload.py, _worker.py, _quantized.py)": [
        ("model_executor/model_loader/__init__.py", "get_model_loader"),
        ("model_executor/model_loader/reload/layerwise.py", "get_layerwise_info"),
        ("model_executor/model_loader/reload/layerwise.py", "initialize_layerwise_reload"),
        ("model_executor/model_loader/reload/layerwise.py", "finalize_layerwise_reload"),
        ("model_executor/model_loader/reload/layerwise.py", "_layerwise_process"),
        ("model_executor/model_loader/reload/types.py", "LayerReloadingInfo"),
        ("model_executor/model_loader/default_loader.py", "DefaultModelLoader.get_all_weights"),
        ("model_executor/models/qwen2.py", "Qwen2Model.load_weights"),
        ("model_executor/models/qwen2.py", "Qwen2ForCausalLM.load_weights"),
        ("model_executor/models/utils.py", "AutoWeightsLoader"),
        ("model_executor/layers/attention/__init__.py", "is_deferred_attention_layer"),
        ("config/vllm.py", "set_current_vllm_config"),
    ],
    "LoRA routes (vllm_ext/_lora.py, _lora_worker.py)": [
        ("entrypoints/serve/lora/protocol.py", "LoadLoRAAdapterRequest"),
        ("entrypoints/serve/lora/protocol.py", "UnloadLoRAAdapterRequest"),
        ("entrypoints/serve/engine/protocol.py", "ErrorResponse"),
        ("entrypoints/openai/models/serving.py", "OpenAIServingModels.load_lora_adapter"),
        ("entrypoints/openai/models/serving.py", "OpenAIServingModels.unload_lora_adapter"),
        ("lora/peft_helper.py", "PEFTHelper"),
        ("lora/utils.py", "parse_fine_tuned_lora_name"),
        ("lora/model_manager.py", "LoRAModelManager.list_adapters"),
    ],
    "CPU GEMM dispatch (vllm_ext/_plain_gemm.py)": [
        ("model_executor/layers/utils.py", "dispatch_cpu_unquantized_gemm"),
        ("model_executor/layers/linear.py", "UnquantizedLinearMethod.process_weights_after_loading"),
        ("model_executor/layers/linear.py", "UnquantizedLinearMethod.apply"),
        ("model_executor/layers/vocab_parallel_embedding.py", "UnquantizedEmbeddingMethod.process_weights_after_loading"),
        ("platforms/interface.py", "Platform.is_cpu"),
    ],
}


def source(wheel: zipfile.ZipFile, path: str, dotted: str) -> str | None:
    """The source text of ``dotted`` in ``vllm/<path>`` of the wheel, or None if absent."""
    try:
        text = wheel.read(f"vllm/{path}").decode()
    except KeyError:
        return None
    node: ast.AST = ast.parse(text)
    for part in dotted.split("."):
        found = None
        for child in getattr(node, "body", []):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and child.name == part:
                found = child
        if found is None:
            return None
        node = found
    return ast.get_source_segment(text, node)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", help="the older vLLM wheel")
    parser.add_argument("new", help="the newer vLLM wheel")
    parser.add_argument("--diff", action="store_true", help="print the diff of every changed symbol")
    args = parser.parse_args(argv)
    changed = 0
    with zipfile.ZipFile(args.old) as old, zipfile.ZipFile(args.new) as new:
        for group, symbols in SYMBOLS.items():
            print(f"# {group}")
            for path, dotted in symbols:
                a, b = source(old, path, dotted), source(new, path, dotted)
                state = "MISSING-old" if a is None else "MISSING-new" if b is None else "same" if a == b else "CHANGED"
                changed += state != "same"
                print(f"{state:12s} {path}::{dotted}")
                if args.diff and state == "CHANGED":
                    old_lines, new_lines = (f"{a}\n".splitlines(True), f"{b}\n".splitlines(True))
                    sys.stdout.writelines(difflib.unified_diff(old_lines, new_lines, n=1))
    print(f"{changed} of {sum(map(len, SYMBOLS.values()))} symbols differ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
