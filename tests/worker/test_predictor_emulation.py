"""CUDA emulation on fake cpu: the autocast policy table, kernel choices, and clean exit."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from vramtune.worker.device.memory import MemoryTracker
from vramtune.worker.predictor.emulation import (
    CUDA_AUTOCAST_POLICY,
    _registered,
    cuda_emulation,
    prefer_foreach,
)


def test_the_policy_table_matches_the_installed_torch_autocast_cuda_registrations() -> None:
    assert set(CUDA_AUTOCAST_POLICY) == _registered("AutocastCUDA")


def _under_cpu_autocast_in_fake_mode(emulate: bool) -> dict[str, torch.dtype]:
    with FakeTensorMode(), cuda_emulation() if emulate else nullcontext():
        x = torch.randn(4, 8)
        weight = torch.randn(8, 8, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            linear = F.linear(x, weight)
            return {
                "linear": linear.dtype,
                "layer_norm": F.layer_norm(linear, (8,)).dtype,
                "softmax": linear.softmax(-1).dtype,
                "log_softmax": F.log_softmax(linear, -1).dtype,
                "exp": linear.exp().dtype,
                "sum": linear.sum().dtype,
            }


def test_emulated_autocast_follows_the_cuda_policy_and_the_cpu_one_comes_back() -> None:
    emulated = _under_cpu_autocast_in_fake_mode(emulate=True)
    assert emulated["linear"] == torch.bfloat16
    for name in ("layer_norm", "softmax", "log_softmax", "exp", "sum"):
        assert emulated[name] == torch.float32, name
    plain = _under_cpu_autocast_in_fake_mode(emulate=False)
    assert plain["layer_norm"] == torch.bfloat16  # CPU policy again once the context is gone
    assert plain["softmax"] == torch.bfloat16


def test_binary_cross_entropy_is_refused_as_cuda_autocast_refuses_it() -> None:
    with FakeTensorMode(), cuda_emulation(), torch.autocast("cpu", dtype=torch.bfloat16):
        probabilities = torch.rand(4)
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(probabilities, torch.ones(4))


def _dropout_kept_bytes(emulate: bool) -> int:
    tracker = MemoryTracker(round_to=1)
    with FakeTensorMode(), cuda_emulation() if emulate else nullcontext(), tracker:
        x = torch.randn(1024, 256, requires_grad=True)
        before = tracker.live_bytes
        y = F.dropout(x, 0.1, training=True)
        kept = tracker.live_bytes - before  # the output and what backward keeps
        del y
    return kept


def test_emulated_dropout_keeps_a_bool_mask_instead_of_float_noise() -> None:
    elements = 1024 * 256
    assert _dropout_kept_bytes(emulate=False) == 4 * elements + 4 * elements
    assert _dropout_kept_bytes(emulate=True) == 4 * elements + elements


class _Ops(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records the aten ops that run."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.names: list[str] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    ("dtype", "kernel"),
    [
        (torch.float32, "_scaled_dot_product_efficient_attention.default"),
        (torch.bfloat16, "_scaled_dot_product_flash_attention.default"),
    ],
)
def test_emulated_attention_takes_the_cuda_fused_kernel(dtype: torch.dtype, kernel: str) -> None:
    ops = _Ops()
    with FakeTensorMode(), cuda_emulation(), ops:
        q, k, v = (torch.randn(2, 4, 256, 64, dtype=dtype, requires_grad=True) for _ in range(3))
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        out.sum().backward()  # type: ignore[no-untyped-call]
    assert kernel in ops.names
    assert kernel.replace(".default", "_backward.default") in ops.names
    assert not any("math" in name for name in ops.names)


def test_prefer_foreach_sets_only_an_undecided_choice() -> None:
    model = nn.Linear(4, 4)
    undecided = torch.optim.AdamW(model.parameters())
    loop = torch.optim.AdamW(model.parameters(), foreach=False)
    prefer_foreach(undecided)
    prefer_foreach(loop)
    assert undecided.param_groups[0]["foreach"] is True
    assert loop.param_groups[0]["foreach"] is False
