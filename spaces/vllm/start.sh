#!/usr/bin/env bash
# The rollout Space's entry point: vLLM's OpenAI-compatible server with deltasync's worker
# extension and "delta" weight-transfer backend, following the bucket DELTASYNC_BUCKET, its
# routes other than inference and read-only ones (weight updates, pause/resume, RPC, LoRA)
# behind the token DELTASYNC_TOKEN.
#
# Space settings (Settings > Variables and secrets):
#   MODEL             variable  the model to serve, e.g. Qwen/Qwen3-1.7B (the trainer's --model)
#   DELTASYNC_BUCKET  variable  the bucket the trainer publishes to, e.g. hf://buckets/me/run1
#   DELTASYNC_TOKEN   secret    shared with the trainer; required: without it anyone could
#                               pause this server or make it load versions from its bucket
#   HF_TOKEN          secret    read access to a private bucket or a gated/private model
#   VLLM_ARGS         variable  optional extra vLLM flags, e.g. "--max-model-len 8192"
#   DELTASYNC_FOLLOW  variable  optional: 1 follows the bucket by itself (reads its pointer and
#                               serves each newer version; the trainer only publishes), 0 or
#                               unset serves what the trainer asks for
#   DELTASYNC_FOLLOW_INTERVAL  variable  optional, with DELTASYNC_FOLLOW=1: seconds between two
#                               reads of the pointer (default 2: 1,800 reads an hour)
#   DELTASYNC_PUBLIC_ROUTES  variable  optional routes open without the token besides the
#                               inference and read-only ones, e.g. "/v1/messages /v1/responses"
#
# Outside a Space (tests, a CPU box): PYTHON picks the interpreter, HOST and PORT the address.
set -euo pipefail

if [ -z "${DELTASYNC_TOKEN:-}" ]; then
    echo "start.sh: refusing to start: DELTASYNC_TOKEN is not set. Add it as a Space secret (the trainer" \
         "needs the same value): without it anyone could pause this server or make it load weights." >&2
    exit 64
fi
if [ -z "${MODEL:-}" ]; then
    echo "start.sh: MODEL is not set: add a Space variable MODEL with the model to serve (e.g. Qwen/Qwen3-1.7B)." >&2
    exit 64
fi
if [ -z "${DELTASYNC_BUCKET:-}" ]; then
    echo "start.sh: DELTASYNC_BUCKET is not set: add a Space variable with the trainer's bucket" \
         "(e.g. hf://buckets/me/run1)." >&2
    exit 64
fi

follow_args=()
follow="${DELTASYNC_FOLLOW:-}"
case "${follow,,}" in
    1|true|yes)
        follow_args=(--follow)
        if [ -n "${DELTASYNC_FOLLOW_INTERVAL:-}" ]; then
            follow_args+=(--follow-interval "$DELTASYNC_FOLLOW_INTERVAL")
        fi
        ;;
    ""|0|false|no) ;;
    *)
        echo "start.sh: DELTASYNC_FOLLOW must be 1 (follow the bucket) or 0, got '$DELTASYNC_FOLLOW'." >&2
        exit 64
        ;;
esac

read -r -a vllm_args <<< "${VLLM_ARGS:-}"
# `deltasync serve` adds --worker-extension-cls vllm_ext.DeltaWorkerExtension,
# --weight-transfer-config '{"backend": "delta"}' and --middleware vllm_ext.UpdateMiddleware
# (one-request updates), sets VLLM_SERVER_DEV_MODE=1, then execs
# `python -m vllm.entrypoints.openai.api_server` with the arguments it does not know. With
# --follow it sets DELTASYNC_FOLLOW=1 (and DELTASYNC_FOLLOW_INTERVAL) for vllm_ext.UpdateMiddleware.
exec "${PYTHON:-python3}" -m deltasync.cli serve "$MODEL" \
    --bucket "$DELTASYNC_BUCKET" \
    "${follow_args[@]}" \
    --middleware vllm_ext.TokenMiddleware \
    --host "${HOST:-0.0.0.0}" \
    --port "${PORT:-8000}" \
    "${vllm_args[@]}" "$@"
