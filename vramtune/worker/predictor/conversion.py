"""Models that cannot be built under fake tensors: built outside the fake mode, then converted.

A model whose construction reads tensor values (`.item()` in timm's DeiT with a custom image
size, `torch.unique` in its RegNet) or moves its parameters (`peft.get_peft_model` calls
`Module.to`, which cannot swap fake parameters) fails to build under `FakeTensorMode`. The trace
then builds it outside every mode, on the `meta` device (no memory at all) or, when even that
fails (`.item()` has no value on meta), for real on the CPU, and converts it: each parameter,
buffer and tensor attribute is replaced by a fake tensor made inside the trace's modes, so the
tracker counts it as a build inside them would have.

A tensor subclass that wraps others (torchao's quantized weights: int8 codes and scales in an
`Int8Tensor`, 4-bit codes in an `NF4Tensor`) is converted through its own flatten/unflatten
protocol: the tensors it holds become fake, the wrapper is rebuilt around them, so the trace
counts the packed storage the real run holds (not a float tensor of the wrapper's shape) and
runs the subclass's own kernels.

The conversion keys on storage identity: a parameter that two modules share (tied embeddings)
becomes one fake parameter, and tensors that view one storage view one fake storage. (Applying
`fake_mode.from_tensor` module by module made two parameters of a tied one: twice its gradient
and optimizer state.) A model that builds neither way is left to the caller's fallback (the
probe), with both reasons.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes, is_traceable_wrapper_subclass

from vramtune.service.wire import Plan
from vramtune.worker.device.memory import MemoryLimitExceeded
from vramtune.worker.trial.steps import build_for_plan
from vramtune.worker.trial.task import Config, Task, TaskConfigError

META = torch.device("meta")
CPU = torch.device("cpu")


class BuildFailed(Exception):
    """The model builds neither under fake tensors, nor on meta, nor for real."""


def build_for_trace(task: Task, config: Config, plan: Plan, device: torch.device) -> nn.Module:
    """The task's model as fake tensors on `device`, built inside the active modes if it can be.

    Called inside the trace's fake mode and tracker. Raises `BuildFailed` (with each way's
    reason) when no way builds it; `TaskConfigError` and `MemoryLimitExceeded` pass through.
    """
    try:
        with torch.device(device):
            return build_for_plan(task, config, plan, device)
    except (TaskConfigError, MemoryLimitExceeded):
        raise
    except Exception as error:
        inside = _reason(error)
    gc.collect()  # the failed build's fake tensors leave the tracker's live set
    with _disable_current_modes():
        model = build_outside(task, config, plan, inside)
    return to_fake(model, device)


def build_outside(task: Task, config: Config, plan: Plan, inside: str) -> nn.Module:
    """Build with no mode active: on meta, else for real on the CPU; BuildFailed if neither."""
    reasons = [f"under fake tensors: {inside}"]
    for device in (META, CPU):
        try:
            with torch.device(device):
                return build_for_plan(task, config, plan, device)
        except TaskConfigError:
            raise
        except Exception as error:
            reasons.append(f"on {device.type}: {_reason(error)}")
    raise BuildFailed("the model does not build " + "; ".join(reasons))


def to_fake(model: nn.Module, device: torch.device) -> nn.Module:
    """Replace `model`'s tensors (parameters, buffers, tensor attributes) by fresh tensors made
    under the active modes, in place; one per storage, so tied and aliased tensors stay so."""
    convert = _Converter(device)
    for module in _children_first(model):
        for name, parameter in module._parameters.items():
            if parameter is not None:
                module._parameters[name] = convert.parameter(parameter)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = convert.tensor(buffer)
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor):
                setattr(module, name, convert.tensor(value))
    return model


def _children_first(module: nn.Module) -> Iterator[nn.Module]:
    """Every module once, children before their parent: the order `Module.to` moves a model
    built on the CPU to the card in, which the allocator model's segments depend on."""
    seen: set[int] = set()

    def visit(node: nn.Module) -> Iterator[nn.Module]:
        for child in node.children():
            if id(child) not in seen:
                seen.add(id(child))
                yield from visit(child)
        yield node

    return visit(module)


class _Converter:
    """Fake counterparts of outside tensors, memoised by object and by storage."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._objects: dict[int, torch.Tensor] = {}
        self._storages: dict[int, torch.Tensor] = {}
        self._keep: list[torch.Tensor] = []  # keeps ids unique while converting

    def parameter(self, parameter: nn.Parameter) -> nn.Parameter:
        made = self._memo(
            parameter,
            lambda: nn.Parameter(self._content(parameter), requires_grad=parameter.requires_grad),
        )
        assert isinstance(made, nn.Parameter)
        return made

    def tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, nn.Parameter):
            return self.parameter(tensor)
        return self._memo(
            tensor, lambda: self._content(tensor).requires_grad_(tensor.requires_grad)
        )

    def _content(self, tensor: torch.Tensor) -> torch.Tensor:
        """`_data` for a plain tensor; a wrapper subclass rebuilt around its converted tensors."""
        if not is_traceable_wrapper_subclass(tensor):
            return self._data(tensor)
        names, context = tensor.__tensor_flatten__()
        inner = {name: self.tensor(getattr(tensor, name)) for name in names}
        rebuilt: torch.Tensor = type(tensor).__tensor_unflatten__(
            inner, _on_device(context, self.device), tensor.size(), tensor.stride()
        )
        return rebuilt

    def _memo(self, tensor: torch.Tensor, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        key = id(tensor)
        if key not in self._objects:
            self._keep.append(tensor)
            self._objects[key] = make()
        return self._objects[key]

    def _data(self, tensor: torch.Tensor) -> torch.Tensor:
        """A fresh tensor of `tensor`'s layout on the fake counterpart of its storage.

        The first tensor seen on a storage makes it: as itself when it covers the storage
        (the usual parameter), else as a flat tensor of the storage's size it then views.
        """
        storage = tensor.untyped_storage()
        key = storage._cdata  # the StorageImpl: every view of one storage shares it
        elements = storage.nbytes() // tensor.element_size()
        on_storage = self._storages.get(key)
        with torch.no_grad():
            if on_storage is None:
                if _covers(tensor, elements):
                    made = torch.empty_strided(
                        tensor.shape, tensor.stride(), dtype=tensor.dtype, device=self.device
                    )
                    self._storages[key] = made
                    return made
                on_storage = torch.empty(elements, dtype=tensor.dtype, device=self.device)
                self._storages[key] = on_storage
            if on_storage.dtype != tensor.dtype:
                raise BuildFailed(
                    f"tensors of {on_storage.dtype} and {tensor.dtype} share one storage"
                )
            return on_storage.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())


def _on_device(context: Any, device: torch.device) -> Any:
    """A wrapper's flatten context with each device it names set to `device`: torchao's NF4
    tensor keeps its own device there (a dataclass), and a model built on meta would otherwise
    come back as a wrapper on meta around fake tensors on the trace device."""
    if isinstance(context, torch.device):
        return device
    if isinstance(context, dict):
        return {key: _on_device(value, device) for key, value in context.items()}
    if dataclasses.is_dataclass(context) and not isinstance(context, type):
        fields = {f.name: getattr(context, f.name) for f in dataclasses.fields(context) if f.init}
        return dataclasses.replace(
            context, **{name: _on_device(value, device) for name, value in fields.items()}
        )
    return context


def _covers(tensor: torch.Tensor, elements: int) -> bool:
    """Whether `tensor` is its storage's one dense, whole view."""
    return tensor.is_contiguous() and tensor.storage_offset() == 0 and tensor.numel() == elements


def _reason(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {(text[0] if text else '')[:200]}"
