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

A plan choice traces several micro-batches of one configuration, each a window of up to the
whole batch in micro-batches, each followed by the whole held-out set: minutes, at a batch of
512 (issue 43). On a CPU card three things keep it to seconds, each exact to the byte
(tests/worker/test_hf_trainer.py compares them with the full trace and the real run):

- the loops' repeated steps are replayed (`_replay_repeats`, vramtune/worker/predictor/
  repeats.py): `training_step` and `prediction_step` run the model for the first calls of a
  window or of the evaluation, and the rest count the same excess above what is live;
- the middle of the evaluation loop is jumped over (vramtune/worker/integrations/
  hf_trainer_evaluation.py): its last turns, which hold the most gathered, are traced;
- the evaluation is traced once per evaluation (`trace_trainer`'s `evaluation`): another
  micro-batch's trace counts its excess above what the training steps leave live.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Mapping
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

from vramtune.worker.device.memory import (
    EVALUATION_PHASE,
    Excess,
    MemoryLimitExceeded,
    MemoryTracker,
)
from vramtune.worker.integrations.hf_trainer_evaluation import EvaluationJump
from vramtune.worker.predictor.opmodel import real_kernel_storages
from vramtune.worker.predictor.repeats import RepeatedCalls
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

log = logging.getLogger(__name__)

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


@dataclass
class TrainerTrace:
    """A traced Trainer: the trace, and its evaluation's excess above the bytes live when it
    began where it can stand in for that evaluation in another trace (`trace_trainer`'s
    `evaluation`); None where it cannot (a CUDA trace, an evaluation that did not finish or
    freed what the training steps left). `calls`: the loops' steps run and replayed;
    `skipped_batches`: the evaluation's batches its loop jumped over; `jump_undone`: why a
    jump was not exact and the trace ran again without it."""

    trace: Trace
    evaluation: Excess | None = None
    calls: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    skipped_batches: int = 0
    jump_undone: str = ""


def trace_trainer(
    make_trainer: TrainerFactory,
    args: Any,
    target: Target,
    evaluation: Excess | None = None,
    *,
    jump: bool = True,
) -> TrainerTrace:
    """Trace `TRACED_STEPS` optimizer steps of the Trainer `make_trainer` builds, then its
    evaluation; CannotTrace (with a reason) when fake tensors cannot run it.

    `evaluation`, an earlier CPU trace's (`TrainerTrace.evaluation`, of the same evaluation:
    model, evaluation batch and set, arguments), is counted in its place instead of running
    the evaluation again. It is exact: the evaluation allocates what its own code and shapes
    make, above what the training steps left live (it frees none of that), whatever the
    training micro-batch was; so its peak is the bytes live at its start plus the same excess.
    A CUDA trace always runs it: the allocator model replays every event.

    A CPU trace replays the loops' repeated steps (`_replay_repeats`) and, with `jump`,
    skips the middle of the evaluation loop (vramtune/worker/integrations/
    hf_trainer_evaluation.py); where the jump cannot be shown exact, the trace runs again
    without it.
    """
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
    known = None if target.cuda else evaluation
    stop = _stop_after(transformers.TrainerCallback, TRACED_STEPS, (fake, tracker), known)
    values = BatchValues()
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
            _fake_data(stack, values, stop)
            for name, answer in values.mask_answers(transformers).items():
                stack.enter_context(mock.patch.object(transformers.masking_utils, name, answer))
            trainer = make_trainer(traced_args, [stop], _built_on(target.device))
            stop.trainer = trainer
            steps = [] if target.cuda else _replay_repeats(trainer, tracker, values)
            if steps and jump:
                stop.jump = _jump_over(trainer, tracker, values, steps[-1], stack)
            with suppress(_Traced):
                trainer.train()
    except (TaskConfigError, MemoryLimitExceeded, CannotTrace):
        raise
    except Exception as error:
        raise CannotTrace(untraceable_reason(error)) from error
    if stop.rerun:
        log.info("tracing the Trainer's evaluation again, every batch: %s", stop.rerun)
        again = trace_trainer(make_trainer, args, target, evaluation, jump=False)
        return dataclasses.replace(again, jump_undone=stop.rerun)
    calls = {step.__name__: (step.run, step.replayed) for step in steps}
    skipped = stop.jump.skipped if stop.jump is not None else 0
    trace = Trace.counted(tracker, started, stop.part)
    return TrainerTrace(trace, stop.evaluation, calls, skipped)


def _reads_sync_flag(trainer: Any) -> bool:
    """Whether a training step may read accelerate's last-micro-batch flag (`sync_gradients`).
    transformers' own `training_step` and `compute_loss` do not, and on one process accelerate
    reads it only to sync gradients across processes: its last micro-batch of a window then
    allocates what the others do. A subclass that overrides either might."""
    transformers = _transformers()
    own = all(
        getattr(type(trainer), name) is getattr(transformers.Trainer, name)
        for name in ("training_step", "compute_loss")
    )
    processes = getattr(getattr(trainer, "accelerator", None), "num_processes", 1)
    return not own or processes != 1


def _fake_data(stack: ExitStack, values: BatchValues, stop: Any) -> None:
    """Every data loader yields fake batches of its real ones' shapes (`BatchValues`), the
    evaluation's through the jump `stop` holds once the Trainer is built."""

    # A plain function: as a class attribute it is bound to each loader.
    def fake_iter(loader: DataLoader[Any]) -> Iterator[Any]:
        return values.fake_batches(loader, stop.jump)

    stack.enter_context(mock.patch.object(DataLoader, "__iter__", fake_iter))


def _jump_over(
    trainer: Any,
    tracker: MemoryTracker,
    values: BatchValues,
    prediction_step: RepeatedCalls,
    stack: ExitStack,
) -> EvaluationJump:
    """The jump over the middle of the evaluation loop, wired into the Trainer's containers."""
    jump = EvaluationJump(
        tracker,
        trainer.args,
        lambda: (prediction_step.run, prediction_step.replayed),
        lambda: (values.padding_all_ones, values.positions_given),
    )
    containers = importlib.import_module("transformers.trainer_pt_utils").EvalLoopContainer
    add = containers.add
    tracing = threading.get_ident()

    def gathered(container: Any, tensors: Any) -> None:
        # The patch is the process's: a real run's evaluation in another thread (a worker that
        # plans ahead) gathers as it always does.
        if threading.get_ident() == tracing:
            jump.gathered(add, container, tensors)
        else:
            add(container, tensors)

    stack.enter_context(mock.patch.object(containers, "add", gathered))
    return jump


def _replay_repeats(trainer: Any, tracker: MemoryTracker, values: BatchValues) -> list[Any]:
    """The Trainer's `training_step` and `prediction_step` with their repeats replayed
    (vramtune/worker/predictor/repeats.py): a window of micro-batches, or the held-out
    batches, run the model for the first calls alone."""

    accelerator = getattr(trainer, "accelerator", None)
    reads_sync = _reads_sync_flag(trainer)

    def context() -> Hashable:
        # Besides the arguments, what decides a step's allocations: the phase, the modes, the
        # Trainer's last-micro-batch flag where it is read, the mask answers, the model's mode
        # and which of its gradients exist (a window's first micro-batch makes them: zero_grad
        # drops them).
        model = trainer.model
        return (
            tracker.current_phase(),
            torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(),
            torch._C._is_any_autocast_enabled(),
            getattr(accelerator, "sync_gradients", None) if reads_sync else None,
            values.padding_all_ones,
            values.positions_given,
            getattr(model, "training", None),
            tuple(p.grad is not None for p in model.parameters()),
        )

    steps = []
    for name in ("training_step", "prediction_step"):
        step = RepeatedCalls(getattr(trainer, name), tracker, context)
        setattr(trainer, name, step)
        steps.append(step)
    return steps


def _transformers() -> Any:
    with _disable_current_modes():
        return importlib.import_module("transformers")


def _stop_after(
    callback_class: type,
    steps: int,
    modes: tuple[FakeTensorMode, MemoryTracker],
    known: Excess | None,
) -> Any:
    """A TrainerCallback that labels the training state (the breakdown's parameters, gradients
    and optimizer state), evaluates after `steps` optimizer steps (or counts the `known`
    evaluation's excess there) and ends training there. Its `trainer` is set once the
    Trainer is built; its `part` holds where the training steps ended and whether the
    evaluation was traced; its `evaluation`, the excess of the evaluation it traced, where
    another trace can count it instead (see `trace_trainer`)."""
    fake, tracker = modes

    class StopAfter(callback_class):  # type: ignore[misc]
        trainer: Any = None
        part: TrainingPart | None = None
        evaluation: Excess | None = None
        jump: EvaluationJump | None = None
        rerun = ""

        def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.jump is not None:
                self.jump.turn_done()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if kwargs.get("model") is not None and kwargs.get("optimizer") is not None:
                tracker.label_training_state(kwargs["model"], kwargs["optimizer"])
            if state.global_step < steps:
                return
            if known is not None:
                self.part = TrainingPart(tracker.peak_bytes, len(tracker.events or []))
                with tracker.phase(EVALUATION_PHASE):
                    tracker.count_transient(known)
                raise _Traced
            with tracker.counting_block() as block:
                # The Trainer's data is loaded before its loop runs: no warm-up pass; its
                # batches are fake already.
                self.part = evaluation_part(
                    self.evaluate, fake, tracker, warm_up=False, real_factories=False
                )
            if self.jump is not None and not self.jump.below(block.highest):
                self.rerun = self.jump.why_not or "the jump's concatenation reached the peak"
            elif self.part.evaluation_reason == "" and not block.freed_older:
                self.evaluation = block.excess()
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

    def fake_batches(
        self, loader: DataLoader[Any], jump: EvaluationJump | None = None
    ) -> Iterator[Any]:
        """A data loader's iterator that samples and collates for real, outside the fake mode,
        and yields fake batches of the same shapes. Patched in at the torch DataLoader, below
        accelerate's, which fetches one batch ahead: that batch is then counted, as in a real
        run. `jump` may drop batches of the evaluation's loop."""
        with _disable_current_modes():
            batches = _DATALOADER_ITER(loader)
        return _FakeBatches(batches, self, jump, _length(loader))

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
    """An iterator over a real data loader's batches, each turned into empty fake tensors
    (`count` of them, when the loader has a length)."""

    def __init__(
        self,
        batches: Iterator[Any],
        values: BatchValues,
        jump: EvaluationJump | None,
        count: int | None,
    ) -> None:
        self.batches = batches
        self.values = values
        self.jump = jump
        self.count = count

    def __iter__(self) -> _FakeBatches:
        return self

    def __next__(self) -> Any:
        batch = self._real()
        if self.jump is not None:
            batch = self.jump.fetched(batch, self.count, self._real)
        return tree_map_only(torch.Tensor, _empty_like, batch)

    def _real(self) -> Any:
        """The next collated batch, made outside the fake mode, its values noted."""
        with _disable_current_modes():
            batch = next(self.batches)
            self.values.note(batch)
        return batch


def _length(loader: DataLoader[Any]) -> int | None:
    """How many batches `loader` yields; None when it cannot tell (an iterable data set)."""
    try:
        return len(loader)
    except TypeError:
        return None


def _empty_like(tensor: torch.Tensor) -> torch.Tensor:
    """A new tensor of the same shape, dtype and device: counted as the collated one was."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
