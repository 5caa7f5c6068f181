"""Kernels whose real outputs keep other storages than their fake (meta) counterparts.

Found by the OpInfo differential test and the family benchmark (bench/opinfo_storage.py,
bench/results/predictor_accuracy_families_vision.md); each is corrected here, under the trace,
to what the real kernel allocates, so the prediction never falls below the real run:

- `native_batch_norm` with a reduced-precision input (bf16/fp16 under autocast) and float32
  weights (a BatchNorm after an autocast conv): the real kernels keep the saved mean and
  inverse std in float32, the accumulation type; the meta kernel returns them in the input's
  dtype, half the bytes (about 40-170 KB per step of a bf16 EfficientNet or ResNet-50);
- `native_layer_norm` likewise (timm's ConvNeXt under bf16 autocast: 174 KB at batch 32).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_REDUCED = (torch.bfloat16, torch.float16)


class RealKernelStorages(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Replaces fake outputs whose real kernel allocates differently (see the module docstring)."""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.native_batch_norm.default:
            return _stats_in_float32(args[0], args[1], out)
        if func is torch.ops.aten.native_layer_norm.default:
            return _stats_in_float32(args[0], args[2], out)
        return out


def _stats_in_float32(data: torch.Tensor, weight: Any, out: Any) -> Any:
    """A norm's (output, mean, inverse std) with the statistics in float32 when mixed."""
    result, mean, invstd = out
    mixed = (
        data.dtype in _REDUCED
        and isinstance(weight, torch.Tensor)
        and weight.dtype == torch.float32
    )
    if not mixed or mean.dtype == torch.float32:
        return out
    as_float = [torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in (mean, invstd)]
    return result, *as_float


def real_kernel_storages() -> TorchDispatchMode:
    """The mode to enter inside the FakeTensorMode and outside the tracker."""
    return RealKernelStorages()  # type: ignore[no-untyped-call]
