"""bench/gpu_check.sh without a GPU: a clear message, exit status 2, nothing written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_the_gpu_check_refuses_clearly_without_a_cuda_device() -> None:
    before = sorted((REPO / "bench" / "results").glob("gpu_*"))
    done = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_check.sh")],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "no CUDA device" in done.stderr and "needs one NVIDIA GPU" in done.stderr
    assert sorted((REPO / "bench" / "results").glob("gpu_*")) == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_the_offload_check_refuses_clearly_without_a_cuda_device(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_offload.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "no CUDA device visible" in done.stderr
    assert not list(tmp_path.iterdir())
