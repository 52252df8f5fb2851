"""GPU runs of the package's examples (two processes each, byte-exact checks inside): skipped
without a CUDA GPU, torch or CuPy. On the GPU machine: ``pytest -v test_gpu.py``."""

import importlib.util
import os
import subprocess
import sys

import pytest


def _have_gpu() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


needs_torch_gpu = pytest.mark.skipif(not _have_gpu(), reason="needs a CUDA GPU and torch")
needs_cupy = pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="needs CuPy")


def run_example(name, *args):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.run(
        [sys.executable, "-m", f"mscclpp_rs.examples.{name}", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    print(p.stdout, p.stderr)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


@needs_torch_gpu
@pytest.mark.parametrize("transport", ["cuda_ipc", "ethernet"])
def test_kv_cache_block_between_two_processes(transport):
    assert "byte-exact" in run_example("kv_cache", "--transport", transport)


@needs_torch_gpu
def test_kv_cache_block_host_tensors_over_ethernet():
    assert "byte-exact" in run_example("kv_cache", "--transport", "ethernet", "--cpu")


@needs_torch_gpu
@needs_cupy
@pytest.mark.parametrize("transport,compiler", [("cuda_ipc", "mscclpp"), ("ethernet", "mscclpp"), ("cuda_ipc", "cupy")])
def test_port_channel_kernel(transport, compiler):
    out = run_example("port_channel_kernel", "--transport", transport, "--compiler", compiler)
    assert out.count("byte-exact") == 2


@needs_torch_gpu
@needs_cupy
def test_memory_channel_put():
    assert "byte-exact" in run_example("memory_channel_put")
