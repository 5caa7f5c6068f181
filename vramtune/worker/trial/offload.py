"""The offload rungs: the forward's saved activations, or the optimizer's state and step, kept
in host memory so that the card holds less (issue 32). Both keep the numerics; both cost PCIe
transfers every step (vramtune/common/step_time.py's priors say how much).

- activation_offload: `torch.autograd.graph.save_on_cpu(pin_memory=True)` around the forward
  and loss: every tensor autograd saves for backward is copied to pinned host memory as it is
  saved and copied back to the card when backward needs it. The card then holds the
  parameters, gradients, optimizer state and the working set of the layer being computed.
- optimizer_offload: `HostOffloadedOptimizer`, the task's own optimizer stepping pinned host
  copies of the parameters: after backward the gradients go to the host, the step runs on the
  CPU, the updated parameters come back. The card never holds optimizer state. (torchao's
  `CPUOffloadOptimizer` does the same, but it asserts a CUDA device at construction and keeps
  no `Optimizer` hooks, state or param groups, so neither the trace nor the tracker's
  `watch_optimizer` could run it; this class is the same transfers in the task's optimizer.)

Only a CUDA card has a host apart from it: on the CPU the rungs would copy memory into itself,
so a real run on any other device is refused (`host_for`) and the policy never offers them
there. The predictor traces them with `traced_host`: on fake cuda (a GPU worker) the host
copies are fake cpu tensors, which a tracker counting the cuda device does not count; on fake
cpu emulating a CUDA card (a machine without one) they are meta tensors, which no tracker
counts. Either way the trace runs the same transfers and the card's bytes are told from the
host's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

from vramtune.service.wire import Plan
from vramtune.worker.trial.task import TaskConfigError

_TRACED_HOST: ContextVar[torch.device | None] = ContextVar("traced_host", default=None)


@contextmanager
def traced_host(host: torch.device) -> Iterator[None]:
    """Inside a trace: keep what the offload rungs move off the card on `host` (fake cpu on fake
    cuda, meta on fake cpu emulating a card), unpinned (pinning is the host's business)."""
    token = _TRACED_HOST.set(host)
    try:
        yield
    finally:
        _TRACED_HOST.reset(token)


def host_for(device: torch.device) -> torch.device:
    """Where the offload rungs keep what they move off `device`: the traced host inside a
    trace, else the CPU of a CUDA card. Raises TaskConfigError on any other device."""
    traced = _TRACED_HOST.get()
    if traced is not None:
        return traced
    if device.type != "cuda":
        raise TaskConfigError(
            f"the offload rungs need a CUDA card: on {device.type} the host and the card are "
            "one memory"
        )
    return torch.device("cpu")


def offloads(plan: Plan) -> bool:
    """Whether the plan moves anything to the host."""
    return plan.activation_offload or plan.optimizer_offload


def offload_activations(plan: Plan, device: torch.device) -> AbstractContextManager[Any]:
    """Around a forward and its loss: the tensors saved for backward kept on the host (the
    activation_offload rung), else nothing."""
    if not plan.activation_offload:
        return nullcontext()
    host = host_for(device)
    if _TRACED_HOST.get() is None:
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    return _saved_on(host)


def _saved_on(host: torch.device) -> AbstractContextManager[Any]:
    """save_on_cpu's transfers to `host` without pinning (a trace's host): a copy on the host
    as each tensor is saved, a new card tensor as backward unpacks it."""

    def pack(tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
        return tensor.device, tensor.to(host)

    def unpack(packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
        device, tensor = packed
        return tensor.to(device)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


class HostOffloadedOptimizer(torch.optim.Optimizer):
    """`inner` (the task's optimizer, holding no state yet) stepping host copies of the card's
    parameters: its param groups and state are the inner optimizer's (a learning-rate
    scheduler, the trace's foreach choice and the tracker read them), its step hooks are its
    own (the tracker's optimizer phase covers the transfers).

    Per step: each card gradient into its pinned host gradient, the inner step on the host,
    each host parameter it stepped back into its card parameter (in place: the card allocates
    nothing). A frozen parameter (a LoRA base) is neither copied nor stepped.
    The card keeps its gradients (zeroed by `zero_grad`, accumulated over micro-batches as
    without offload).
    """

    def __init__(self, inner: torch.optim.Optimizer, host: torch.device) -> None:
        self.inner = inner
        self.pinned = _TRACED_HOST.get() is None and host.type == "cpu"
        self.pairs: list[tuple[nn.Parameter, torch.Tensor]] = []
        card_parameters = [p for group in inner.param_groups for p in group["params"]]
        super().__init__(card_parameters, {})
        for group in inner.param_groups:  # a frozen parameter gets no step: it stays put
            group["params"] = [
                self._host_copy(card, host) if card.requires_grad else card
                for card in group["params"]
            ]
        self.param_groups = inner.param_groups
        self.state = inner.state

    def _host_copy(self, card: nn.Parameter, host: torch.device) -> torch.Tensor:
        with torch.no_grad():
            copy = torch.empty_like(card, device=host, pin_memory=self.pinned).copy_(card)
            copy.grad = torch.empty_like(copy, pin_memory=self.pinned)
        self.pairs.append((card, copy))
        return copy

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Gradients to the host, the task's step there, parameters back to the card."""
        loss = None if closure is None else closure()
        stepped = []
        for card, copy in self.pairs:
            if card.grad is None:
                copy.grad = None  # the inner optimizer skips it, as it would on the card
                continue
            if copy.grad is None:
                copy.grad = torch.empty_like(copy, pin_memory=self.pinned)
            copy.grad.copy_(card.grad, non_blocking=self.pinned)
            stepped.append((card, copy))
        _wait_for(stepped)
        self.inner.step()
        for card, copy in stepped:
            card.copy_(copy, non_blocking=self.pinned)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (or zero) the card's gradients; the host's are overwritten at the next step."""
        for card, _ in self.pairs:
            if card.grad is None:
                continue
            if set_to_none:
                card.grad = None
            else:
                card.grad.zero_()


def _wait_for(pairs: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
    """Let the non-blocking gradient copies land before the CPU reads them."""
    devices = {card.device for card, _ in pairs if card.device.type == "cuda"}
    for device in devices:
        torch.cuda.current_stream(device).synchronize()


def offload_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
    """`optimizer` stepping on the host of `model`'s card (the optimizer_offload rung)."""
    device = next(model.parameters()).device
    return HostOffloadedOptimizer(optimizer, host_for(device))
