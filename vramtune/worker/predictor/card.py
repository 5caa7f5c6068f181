"""Per-card constants the trace cannot see, measured once by the worker on its own card."""

from __future__ import annotations

import gc

import torch

from vramtune.service.wire import CardConstants


def measure_card_constants(device: str | torch.device) -> CardConstants:
    """CUDA context and cuBLAS/cuBLASLt workspace bytes on `device`; zeros on the CPU.

    The workspaces are what fp32 and bf16 matmuls, forward and backward (the autograd thread
    has a handle of its own), leave allocated after every tensor is gone; the context is what
    NVML charges this process beyond torch's reserved bytes (0 when NVML cannot say).
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return CardConstants()
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    with torch.cuda.device(dev):
        _release(dev)
        before = torch.cuda.memory_allocated(dev)
        _exercise_blas(dev)
        _release(dev)
        workspace = max(torch.cuda.memory_allocated(dev) - before, 0)
        used = _process_used_bytes(dev.index or 0)
        context = 0 if used is None else max(used - torch.cuda.memory_reserved(dev), 0)
    return CardConstants(cuda_context_bytes=context, cublas_workspace_bytes=workspace)


def _release(device: torch.device) -> None:
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def _exercise_blas(device: torch.device) -> None:
    """Matmuls through cuBLAS and cuBLASLt, fp32 and bf16, forward and backward."""
    weight = torch.randn(256, 256, device=device, requires_grad=True)
    bias = torch.randn(256, device=device, requires_grad=True)
    for bf16 in (False, True):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = (torch.nn.functional.linear(weight, weight, bias) @ weight).sum()
        loss.backward()  # type: ignore[no-untyped-call]
    del weight, bias, loss


def _process_used_bytes(device_index: int) -> int | None:
    """NVML's bytes for this process (vramtune.worker.device.gpu is the one module that imports
    pynvml)."""
    try:
        from vramtune.worker.device.gpu import process_used_bytes
    except ImportError:
        return None
    return process_used_bytes(device_index)
