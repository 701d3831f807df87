"""CUDA processes turn off PyTorch's cuDNN attention (a graph built per new shape, cached per thread for good);
CPU ones leave every backend as it is."""

from __future__ import annotations

import pytest
import torch

from arl.utils.attention import KEEP_CUDNN_ENV, avoid_per_shape_attention


@pytest.fixture
def cudnn_sdp_restored():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_a_cuda_device_turns_cudnn_attention_off(cudnn_sdp_restored, monkeypatch):
    monkeypatch.delenv(KEEP_CUDNN_ENV, raising=False)
    torch.backends.cuda.enable_cudnn_sdp(True)
    assert avoid_per_shape_attention("cuda") is True
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert avoid_per_shape_attention(torch.device("cuda", 0)) is True  # again: nothing left to do, still True


def test_cpu_and_the_opt_out_leave_it_on(cudnn_sdp_restored, monkeypatch):
    torch.backends.cuda.enable_cudnn_sdp(True)
    assert avoid_per_shape_attention("cpu") is False
    monkeypatch.setenv(KEEP_CUDNN_ENV, "1")
    assert avoid_per_shape_attention("cuda") is False
    assert torch.backends.cuda.cudnn_sdp_enabled()
