"""Trace a Hugging Face `Trainer`'s own training loop under fake tensors.

The trace runs the user's Trainer class itself, `Trainer.train()` for two optimizer steps, inside
a `FakeTensorMode` with the same byte counter that measures real CPU runs
(`worker.device.memory.MemoryTracker`), so what it counts is what `train()` allocates: the model
from `model_init`, the prefetched micro-batches of one accumulation window, `training_step`'s
forward and backward, gradient clipping, the optimizer and its state. Four things differ, each
for a reason fake tensors give:

- The data pipeline (sampler, collator) runs outside the fake mode: samplers read tensor values
  (`RandomSampler` seeds itself with `.item()`). Each collated batch is then made inside the mode
  as an empty tensor of the same shape and dtype, so the batches alive at the step are counted:
  the accumulation window's (the Trainer fetches them all first) and the one accelerate's data
  loader fetches ahead.
- transformers' mask decisions that read tensor values (is the padding all ones, are sequences
  packed) are answered from the real batches' values (`BatchValues`).
- `Module.to` to the device a module already lives on returns the module (as it does for real
  tensors); on fake parameters it would try to swap them, which fake tensors refuse.
- Training stops by an exception after step 2's `on_step_end`: `train()`'s summary reads the
  loss with `.item()`, which a fake tensor has no value for; and `logging_nan_inf_filter`, which
  branches on the loss's value, is off (it only makes a one-byte temporary).

The evaluation is traced from that same `on_step_end`, where the real run's `train()` calls
`Trainer.evaluate` (its live set then: the model, the optimizer state, the accumulation
window's batches): the Trainer's own evaluation loop, `prediction_step` over the eval data set's
fake batches of `per_device_eval_batch_size`, with what it gathers on the device (the losses;
the logits and labels when `compute_metrics` is set), in the tracker's evaluation phase
(`vramtune.worker.predictor.evaluation.trace_evaluation`). It ends where the loop hands its gathered
tensors to NumPy (`EvalLoopContainer.get_arrays`): the metrics are computed on the host from
there, and fake tensors have no values to compute them from.
"""

from __future__ import annotations

import dataclasses
import importlib
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map_only
from torch.utils.data import DataLoader

from vramtune.worker.device.memory import MemoryLimitExceeded, MemoryTracker
from vramtune.worker.predictor.opmodel import real_kernel_storages
from vramtune.worker.predictor.trace import (
    CannotTrace,
    Target,
    Trace,
    TrainingPart,
    _FakeDeepcopy,
    evaluation_part,
    untraceable_reason,
)
from vramtune.worker.trial.task import TaskConfigError

TRACED_STEPS = 2
"""Step 2 is the steady state: the optimizer state exists."""

TrainerFactory = Callable[..., Any]
"""Builds the Trainer to trace from its training arguments and extra callbacks:
`make(args, callbacks, model_init_wrapper)`."""


class _Traced(Exception):
    """Raised after the last traced step: ends `train()` before its value-reading summary."""


class _Evaluated(Exception):
    """Raised where the evaluation loop hands its gathered tensors to NumPy: ends `evaluate()`
    before its host-side metrics, which read values."""


def _hand_to_numpy(container: Any) -> Any:
    raise _Evaluated


def trace_trainer(make_trainer: TrainerFactory, args: Any, target: Target) -> Trace:
    """Trace `TRACED_STEPS` optimizer steps of the Trainer `make_trainer` builds; CannotTrace
    (with a reason) when fake tensors cannot run it."""
    transformers = _transformers()
    importlib.import_module("transformers.masking_utils")
    traced_args = dataclasses.replace(
        args,
        max_steps=TRACED_STEPS,
        logging_nan_inf_filter=False,
        eval_strategy="no",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    tracker = MemoryTracker(device_type=target.device.type, record_events=target.cuda)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    stop = _stop_after(transformers.TrainerCallback, TRACED_STEPS, (fake, tracker))
    started = time.perf_counter()
    try:
        with ExitStack() as stack:
            stack.enter_context(mock.patch.object(nn.Module, "to", _to_unless_there))
            containers = importlib.import_module("transformers.trainer_pt_utils")
            stack.enter_context(
                mock.patch.object(containers.EvalLoopContainer, "get_arrays", _hand_to_numpy)
            )
            stack.enter_context(fake)
            stack.enter_context(_FakeDeepcopy())
            stack.enter_context(real_kernel_storages())
            stack.enter_context(tracker)
            values = BatchValues()

            # A plain function: as a class attribute it is bound to each loader.
            def fake_iter(loader: DataLoader[Any]) -> Iterator[Any]:
                return values.fake_batches(loader)

            stack.enter_context(mock.patch.object(DataLoader, "__iter__", fake_iter))
            for name, answer in values.mask_answers(transformers).items():
                stack.enter_context(mock.patch.object(transformers.masking_utils, name, answer))
            trainer = make_trainer(traced_args, [stop], _built_on(target.device))
            stop.trainer = trainer
            with suppress(_Traced):
                trainer.train()
    except (TaskConfigError, MemoryLimitExceeded, CannotTrace):
        raise
    except Exception as error:
        raise CannotTrace(untraceable_reason(error)) from error
    return Trace.counted(tracker, started, stop.part)


def _transformers() -> Any:
    with _disable_current_modes():
        return importlib.import_module("transformers")


def _stop_after(
    callback_class: type, steps: int, modes: tuple[FakeTensorMode, MemoryTracker]
) -> Any:
    """A TrainerCallback that labels the training state (the breakdown's parameters, gradients
    and optimizer state), evaluates after `steps` optimizer steps and ends training there.
    Its `trainer` is set once the Trainer is built; its `part` holds where the training steps
    ended and whether the evaluation was traced."""
    fake, tracker = modes

    class StopAfter(callback_class):  # type: ignore[misc]
        trainer: Any = None
        part: TrainingPart | None = None

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if kwargs.get("model") is not None and kwargs.get("optimizer") is not None:
                tracker.label_training_state(kwargs["model"], kwargs["optimizer"])
            if state.global_step >= steps:
                # The Trainer's data is loaded before its loop runs: no warm-up pass; its
                # batches are fake already.
                self.part = evaluation_part(
                    self.evaluate, fake, tracker, warm_up=False, real_factories=False
                )
                raise _Traced

        def evaluate(self) -> None:
            with suppress(_Evaluated):
                self.trainer.evaluate()

    return StopAfter()


def _built_on(device: torch.device) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
    """Wrap `model_init` so the model is built on the trace's device (a fake CUDA model cannot
    be moved there afterwards)."""

    def wrap(model_init: Callable[[], Any]) -> Callable[[], Any]:
        # No parameters: the Trainer then calls it without a trial (it is bound already).
        def on_device() -> Any:
            with torch.device(device):
                return model_init()

        return on_device

    return wrap


def _to_unless_there(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
    """`Module.to`, but a module already on the device (and no dtype asked) is returned as is."""
    device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
    tensors = (*module.parameters(), *module.buffers())
    if dtype is None and device is not None and all(_on(t, device) for t in tensors):
        return module
    moved: nn.Module = _MODULE_TO(module, *args, **kwargs)
    return moved


_MODULE_TO = nn.Module.to


def _on(tensor: torch.Tensor, device: torch.device) -> bool:
    return tensor.device.type == device.type and device.index in (None, tensor.device.index)


_DATALOADER_ITER = DataLoader.__iter__


@dataclass
class BatchValues:
    """What the real batches' values tell that their fake stand-ins cannot.

    transformers decides from tensor values whether an attention mask must be built: none when
    the padding mask is all ones (SDPA's `is_causal` or no mask then), none when the positions
    pack no second sequence. On a fake tensor it cannot read them and builds the full
    batch x length x length mask, which a checkpointed model then keeps for its recomputation
    (16 KiB over the real run on a small GPT-2, 64 KiB on a small BERT). The real batches are
    collated here anyway, so their values answer for the fake ones.
    """

    padding_all_ones: bool = True
    positions_given: bool = False

    def fake_batches(self, loader: DataLoader[Any]) -> Iterator[Any]:
        """A data loader's iterator that samples and collates for real, outside the fake mode,
        and yields fake batches of the same shapes. Patched in at the torch DataLoader, below
        accelerate's, which fetches one batch ahead: that batch is then counted, as in a real
        run."""
        with _disable_current_modes():
            batches = _DATALOADER_ITER(loader)
        return _FakeBatches(batches, self)

    def note(self, batch: Any) -> None:
        """Read the values the masks depend on (outside the fake mode)."""
        if not isinstance(batch, Mapping):
            return
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            self.padding_all_ones &= bool(mask.all())
        self.positions_given |= "position_ids" in batch

    def mask_answers(self, transformers: Any) -> dict[str, Callable[..., Any]]:
        """Replacements of transformers' value-reading mask decisions that answer for fake
        tensors from the real batches' values and call the originals otherwise."""
        masks = transformers.masking_utils
        answers: dict[str, Callable[..., Any]] = {}
        for name in ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa"):
            if hasattr(masks, name):
                answers[name] = self._without_padding(getattr(masks, name))
        if hasattr(masks, "find_packed_sequence_indices"):
            answers["find_packed_sequence_indices"] = self._unpacked(
                masks.find_packed_sequence_indices
            )
        return answers

    def _without_padding(self, decide: Callable[..., Any]) -> Callable[..., Any]:
        def answer(padding_mask: Any, *args: Any, **kwargs: Any) -> Any:
            if is_fake(padding_mask) and self.padding_all_ones:
                padding_mask = None  # all ones: the same answer as no padding mask
            return decide(padding_mask, *args, **kwargs)

        return answer

    def _unpacked(self, find: Callable[..., Any]) -> Callable[..., Any]:
        def answer(position_ids: Any) -> Any:
            # Positions the model made itself (none in the batch) are one sequence per row.
            if is_fake(position_ids) and not self.positions_given:
                return None
            return find(position_ids)

        return answer


def is_fake(value: object) -> bool:
    """Whether `value` is a fake tensor."""
    return isinstance(value, FakeTensor)


class _FakeBatches:
    """An iterator over a real data loader's batches, each turned into empty fake tensors."""

    def __init__(self, batches: Iterator[Any], values: BatchValues) -> None:
        self.batches = batches
        self.values = values

    def __iter__(self) -> _FakeBatches:
        return self

    def __next__(self) -> Any:
        with _disable_current_modes():
            batch = next(self.batches)
            self.values.note(batch)
        return tree_map_only(torch.Tensor, _empty_like, batch)


def _empty_like(tensor: torch.Tensor) -> torch.Tensor:
    """A new tensor of the same shape, dtype and device: counted as the collated one was."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
