"""``vllm serve`` with a bad device, checkpoint or speculative config exits
at startup with a message that names the problem.

The cases start together (each is mostly import time) and are collected
once for the module.
"""

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.utils.npu import NPU_ENV
from tests.utils.quantized_checkpoints import quantize
from tools.demo.serve import MTP_CONFIG, free_port, serve_args, vllm_executable

TIMEOUT = 240
# Past this line in the output the engine core is being started: the
# configuration was accepted, so a config-time check did not fire.
PAST_CONFIG = "EngineCore_DP0"
MISSING = "model.layers.2.mlp.experts.5.down_proj.weight"
NO_SCALE = "model.layers.1.self_attn.o_proj.deq_scale"


def _variant(src: Path, dst: Path) -> Path:
    """A copy of the checkpoint: links to its files, config.json copied."""
    dst.mkdir()
    for item in src.iterdir():
        if item.name == "config.json":
            shutil.copy(item, dst / item.name)
        else:
            (dst / item.name).symlink_to(item)
    return dst


def _without_tensor(src: Path, dst: Path, name: str) -> Path:
    _variant(src, dst)
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"].pop(name)
    tensors = load_file(str(src / shard))
    del tensors[name]
    (dst / shard).unlink()
    save_file(tensors, str(dst / shard), metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").unlink()
    index_path.write_text(json.dumps(index))
    return dst


def _cases(model_dir: Path, tmp: Path) -> dict[str, tuple[list[str], dict]]:
    no_mtp = _variant(model_dir, tmp / "no-mtp")
    config = json.loads((no_mtp / "config.json").read_text())
    config["num_nextn_predict_layers"] = 0
    (no_mtp / "config.json").write_text(json.dumps(config))
    missing = _without_tensor(model_dir, tmp / "missing", MISSING)
    cpu = {"VLLM_ASCEND_DEVICE": "cpu"}

    def args(model: Path, spec: dict | None) -> list[str]:
        out = serve_args(model, free_port(), mtp=False, max_model_len=256)
        if spec is not None:
            out += ["--speculative-config", json.dumps(spec)]
        return out

    head_128 = _variant(model_dir, tmp / "head-128")
    config["num_nextn_predict_layers"] = 1
    config["head_dim"] = 128
    (head_128 / "config.json").write_text(json.dumps(config))

    def npu_args(model: Path, *extra: str) -> list[str]:
        out = args(model, MTP_CONFIG)
        out[out.index("--dtype") + 1] = "bfloat16"
        return out + list(extra)

    # W8A8 (tools.quantize.w8a8) without one layer's deq_scale, in
    # the shards and in the description.
    no_scale = quantize(model_dir, tmp / "w8a8-no-scale")
    tensors = load_file(str(no_scale / "model.safetensors"))
    del tensors[NO_SCALE]
    save_file(tensors, str(no_scale / "model.safetensors"),
              metadata={"format": "pt"})
    description = json.loads(
        (no_scale / "quant_model_description.json").read_text())
    del description[NO_SCALE]
    (no_scale / "quant_model_description.json").write_text(
        json.dumps(description))
    ascend = ["--quantization", "ascend"]

    kv3 = _variant(model_dir, tmp / "kv-heads-3")
    config.update(num_attention_heads=6, num_key_value_heads=3,
                  head_dim=32)
    (kv3 / "config.json").write_text(json.dumps(config))
    ep = ["--data-parallel-size", "2", "--enable-expert-parallel"]

    float32 = args(model_dir, MTP_CONFIG)
    return {
        "tp_kv_heads": (args(kv3, MTP_CONFIG) +
                        ["--tensor-parallel-size", "2"], cpu),
        # Graphs are the NPU's (the CPU reference device runs eager).
        "alltoall_in_graphs": (npu_args(head_128, *ep),
                               {**NPU_ENV, "VLLM_ASCEND_MOE_COMM": "alltoall"}),
        "ascend_float_checkpoint": (args(model_dir, MTP_CONFIG) + ascend,
                                    cpu),
        "ascend_no_scale": (args(no_scale, MTP_CONFIG) + ascend, cpu),
        "npu_float32": (float32, NPU_ENV),
        "npu_head_dim": (npu_args(model_dir), NPU_ENV),
        "npu_block_size": (npu_args(head_128, "--block-size", "16"), NPU_ENV),
        "unknown_device": (args(model_dir, None),
                           {"VLLM_ASCEND_DEVICE": "gpu"}),
        "mtp_without_mtp_layers": (args(no_mtp, MTP_CONFIG), cpu),
        "zero_speculative_tokens": (
            args(model_dir, {**MTP_CONFIG, "num_speculative_tokens": 0}),
            cpu),
        "missing_tensor": (args(missing, MTP_CONFIG), cpu),
    }


@pytest.fixture(scope="module")
def outcomes(model_dir, tmp_path_factory) -> dict[str, tuple[int, str]]:
    """Exit code and output of each case; -1 if it got past the config."""
    tmp = tmp_path_factory.mktemp("startup")
    procs = {}
    for name, (args, env) in _cases(model_dir, tmp).items():
        log = open(tmp / f"{name}.log", "w+")  # noqa: SIM115
        procs[name] = (subprocess.Popen(
            [vllm_executable(), *args], stdout=log, stderr=subprocess.STDOUT,
            env=dict(os.environ, **env), start_new_session=True), log)
    results: dict[str, tuple[int, str]] = {}
    deadline = time.monotonic() + TIMEOUT
    try:
        while procs and time.monotonic() < deadline:
            for name, (proc, log) in list(procs.items()):
                text = Path(log.name).read_text(errors="replace")
                if proc.poll() is not None:
                    results[name] = (proc.returncode, text)
                elif PAST_CONFIG in text:
                    results[name] = (-1, text)
                    os.killpg(proc.pid, 9)
                    proc.wait(10)
                else:
                    continue
                log.close()
                del procs[name]
            time.sleep(0.5)
    finally:
        for name, (proc, log) in procs.items():
            os.killpg(proc.pid, 9)
            proc.wait(10)
            results[name] = (-2, Path(log.name).read_text(errors="replace"))
            log.close()
    return results


def _assert_fails_with(outcome: tuple[int, str], message: str) -> None:
    code, output = outcome
    assert code != -2, f"still running after {TIMEOUT} s:\n{output[-3000:]}"
    assert code != -1, (
        "the server accepted the configuration and started its engine:\n"
        f"{output[-3000:]}")
    assert code != 0
    assert message in output, output[-3000:]


def test_unknown_device(outcomes):
    _assert_fails_with(
        outcomes["unknown_device"],
        "VLLM_ASCEND_DEVICE='gpu' is not a device vllm_ascend knows; use one "
        "of auto, npu, cpu.")


def test_mtp_on_checkpoint_without_mtp_layers(outcomes):
    _assert_fails_with(
        outcomes["mtp_without_mtp_layers"],
        "has no MTP layers (num_nextn_predict_layers is 0), so MTP "
        "speculative decoding cannot run")


def test_zero_speculative_tokens(outcomes):
    _assert_fails_with(
        outcomes["zero_speculative_tokens"],
        "Expected num_speculative_tokens to be greater than zero (0).")


def test_missing_expert_tensor(outcomes):
    _assert_fails_with(outcomes["missing_tensor"],
                       f"is missing 1 tensor(s) that its config.json "
                       f"requires: {MISSING}")


def test_ascend_quantization_errors(outcomes):
    # The flag is accepted; what the checkpoint lacks is named.
    _assert_fails_with(
        outcomes["ascend_float_checkpoint"],
        "--quantization ascend needs quant_model_description.json in ")
    _assert_fails_with(
        outcomes["ascend_no_scale"],
        "model.layers.1.self_attn.o_proj.weight is W8A8 but the checkpoint "
        f"has no {NO_SCALE}: re-export the checkpoint")


def test_parallel_layout_errors(outcomes):
    _assert_fails_with(
        outcomes["tp_kv_heads"],
        "--tensor-parallel-size 2 cannot split the model's 3 KV heads")
    _assert_fails_with(
        outcomes["alltoall_in_graphs"],
        "VLLM_ASCEND_MOE_COMM=alltoall reads per-rank token counts on the "
        "host and cannot run in captured graphs")


def test_npu_limits_fail_at_startup(outcomes):
    # What the fused attention cannot run, in one line, with what to use.
    _assert_fails_with(
        outcomes["npu_float32"],
        "dtype torch.float32 is not supported on the Ascend NPU (the fused "
        "attention's TND layout takes bfloat16 only): use --dtype bfloat16.")
    _assert_fails_with(
        outcomes["npu_head_dim"],
        "head_dim 32 is not supported on the Ascend NPU: the fused attention "
        "(TND layout) takes head_dim 128 or 192.")
    _assert_fails_with(
        outcomes["npu_block_size"],
        "--block-size 16 is not supported on the Ascend NPU (the fused "
        "attention needs a multiple of 128 in [128, 512]): use --block-size "
        "128.")


@pytest.mark.parametrize("case", [
    "unknown_device", "mtp_without_mtp_layers", "zero_speculative_tokens",
    "npu_float32", "npu_head_dim", "npu_block_size",
    "ascend_float_checkpoint", "ascend_no_scale", "tp_kv_heads",
    "alltoall_in_graphs"
])
def test_config_error_has_no_traceback(outcomes, case):
    code, output = outcomes[case]
    assert code == 1
    assert "Traceback" not in output, output[-3000:]
