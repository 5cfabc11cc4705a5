"""Device selection: npu when torch_npu works, the CPU reference otherwise."""

from unittest import mock

import pytest

from vllm_ascend import device


def test_auto_without_torch_npu_is_cpu_reference():
    choice = device.choose("auto", torch_npu_installed=False)
    assert (choice.device_type, choice.dist_backend) == ("cpu", "gloo")


def test_forced_cpu_ignores_torch_npu():
    with mock.patch.object(device, "_npu_device_count") as count:
        choice = device.choose("cpu", torch_npu_installed=True)
    count.assert_not_called()
    assert choice.device_type == "cpu"


def test_forced_npu_without_torch_npu_is_an_error():
    with pytest.raises(RuntimeError, match="torch_npu is not installed"):
        device.choose("npu", torch_npu_installed=False)


def test_unknown_device_name_is_an_error():
    with pytest.raises(ValueError, match="'gpu' is not a device"):
        device.choose("gpu", torch_npu_installed=False)


def test_broken_torch_npu_is_an_error_not_a_fallback():
    no_torch_npu = mock.patch.dict("sys.modules", {"torch_npu": None})
    with no_torch_npu, pytest.raises(RuntimeError, match="failed to import"):
        device.choose("auto", torch_npu_installed=True)


def test_npu_with_devices_uses_hccl():
    with mock.patch.object(device, "_npu_device_count", return_value=8):
        choice = device.choose("auto", torch_npu_installed=True)
    assert (choice.device_type, choice.dist_backend) == ("npu", "hccl")


def test_npu_double_takes_npu_paths_on_cpu_tensors(monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_NPU_DOUBLE", "1")
    with mock.patch.object(device, "_npu_device_count", return_value=8):
        choice = device.choose("npu", torch_npu_installed=True)
    assert (choice.device_type, choice.dist_backend) == ("npu", "hccl")
    assert choice.npu_kernels and choice.torch_device_type == "cpu"


def test_npu_double_switch_refuses_the_real_torch_npu(monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_NPU_DOUBLE", "1")
    real = mock.MagicMock(CONTRACT_DOUBLE=False, __file__="/site/torch_npu")
    refused = pytest.raises(RuntimeError, match="is not the contract double")
    with mock.patch.dict("sys.modules", {"torch_npu": real}), refused:
        device.choose("npu", torch_npu_installed=True)


def test_real_npu_tensors_live_on_the_npu():
    with mock.patch.object(device, "_npu_device_count", return_value=8):
        choice = device.choose("auto", torch_npu_installed=True)
    assert choice.torch_device_type == "npu"
