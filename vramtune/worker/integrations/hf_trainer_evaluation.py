"""The middle of a Trainer's evaluation loop, skipped in a CPU trace (issue 43).

`Trainer.evaluate` turns its loop once per held-out batch: with `compute_metrics` each batch's
logits are gathered on the device (`EvalLoopContainer.add` concatenates them to what it holds),
so the loop's live bytes grow turn by turn and its peak comes at the end. A plan that splits the
training batch below `per_device_eval_batch_size` evaluates in batches of its micro-batch: 512
held-out rows in batches of 1 are 512 turns, seconds of tracing even with `prediction_step`
replayed (vramtune/worker/predictor/repeats.py).

The turns repeat. Once two turns in a row ran batches of one shape, replayed their
`prediction_step` and gathered tensors of the same shapes, and the batch fetched ahead has that
shape too, the trace jumps (`EvaluationJump`): the data loader's batches up to the last three
are collated and dropped, and the next turn's gathering first adds their rows to each container
at once. The loop then goes on as the run's would at that point; its last three turns (the last
two full batches and the last batch, whatever its size) are traced as they run.

Why it is exact: a skipped turn holds what the third-to-last turn holds (a full batch run, a
full batch fetched ahead) with fewer rows gathered, and each container only grows (rounding each
storage up to 512 bytes keeps that order): its peak is at most that turn's, which is traced. The
jump's own concatenation holds no more rows than the turn that stands for it, but one storage
more to round: it must stay below the evaluation's peak (`EvaluationJump.below`), else the
trace runs again without a jump, as it does when a skipped batch has another shape or changes
what the batch values answer (a padded batch). No jump when the loop moves what it gathered to
the host every `eval_accumulation_steps`, computes metrics batch by batch, or keeps the batches
apart (`eval_do_concat_batches` off).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from vramtune.worker.device.memory import EVALUATION_PHASE, MemoryTracker

TURNS_TRACED_AT_THE_END = 3
"""Turns traced after a jump: the two full ones before the last, and the last."""


def shapes(tree: Any) -> Hashable:
    """The structure of `tree` with each tensor's shape, dtype and device."""
    leaves, spec = tree_flatten(tree)
    described = tuple(
        (tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor) else type(x)
        for x in leaves
    )
    return spec, described


@dataclass
class _Turn:
    """One turn of the loop: its batch's shapes, whether its `prediction_step` alone was
    replayed, and the shapes it gathered into each container."""

    batch: Hashable
    replayed: bool
    gathered: dict[int, Hashable] = field(default_factory=dict)


class EvaluationJump:
    """The jump over the middle of one traced evaluation loop (see the module docstring).

    The trace wires it in: its data loader calls `fetched` with each real batch,
    `EvalLoopContainer.add` goes through `gathered`, and the Trainer's `on_prediction_step`
    calls `turn_done`. `steps()` gives the (run, replayed) counts of `prediction_step`,
    `answers()` what the batch values answer so far (`BatchValues`).
    """

    def __init__(
        self,
        tracker: MemoryTracker,
        args: Any,
        steps: Callable[[], tuple[int, int]],
        answers: Callable[[], Hashable],
    ) -> None:
        self.tracker = tracker
        self.steps = steps
        self.answers = answers
        self.why_not = _not_allowed(args)
        self.turns: list[_Turn] = []
        self.batches: list[Hashable] = []
        self.count: int | None = None
        self.gathering: dict[int, Hashable] = {}
        self.skip = 0
        self.skipped = 0
        self.grow: dict[int, int] = {}
        self.highest = 0
        self._steps_then = (0, 0)
        self._answered: Hashable = None

    # ------------------------------------------------------------------ the loop's events

    def fetched(self, batch: Any, count: int | None, next_batch: Callable[[], Any]) -> Any:
        """The batch the evaluation's data loader yields (`count` batches in all): `batch`, or
        once a jump is armed, the one after the batches it drops. Other loaders' batches (the
        training steps') pass as they are."""
        if self.tracker.current_phase() != EVALUATION_PHASE:
            return batch
        self.count = count
        if self.skip:
            batch = self._jump(batch, next_batch)
        self.batches.append(shapes(batch))
        return batch

    def gathered(self, add: Callable[[Any, Any], None], container: Any, tensors: Any) -> None:
        """`EvalLoopContainer.add`, first with the skipped turns' rows after a jump."""
        self.gathering[id(container)] = shapes(tensors)
        rows = self.grow.pop(id(container), 0)
        if rows and container.tensors is not None:
            with self.tracker.counting_block() as block:
                add(container, tree_map_only(torch.Tensor, _rows_of(rows), tensors))
            self.highest = max(self.highest, block.highest)
        add(container, tensors)

    def turn_done(self) -> None:
        """A turn ended (`on_prediction_step`): arm the jump when it and the one before were
        alike, and the batch fetched ahead has their shape."""
        steps = self.steps()
        run, replayed = (now - then for now, then in zip(steps, self._steps_then, strict=True))
        self._steps_then = steps
        number = len(self.turns)
        batch = self.batches[number] if number < len(self.batches) else None
        self.turns.append(_Turn(batch, (run, replayed) == (0, 1), self.gathering))
        self.gathering = {}
        if self.why_not or self.skipped or self.skip or self.count is None:
            return
        skip = self.count - len(self.turns) - 1 - TURNS_TRACED_AT_THE_END
        if skip >= 1 and self._steady():
            self.skip, self._answered = skip, self.answers()

    def below(self, peak: int) -> bool:
        """Whether the jump's concatenations stayed below the evaluation's `peak` and every
        skipped batch was as the jump took it (else the trace must run without a jump)."""
        return not self.skipped or (not self.why_not and self.highest < peak)

    # ------------------------------------------------------------------ the jump

    def _steady(self) -> bool:
        """The last two turns alike, and the batch fetched ahead of their shape."""
        if len(self.turns) < 2 or len(self.batches) <= len(self.turns):
            return False
        first, second = self.turns[-2:]
        ahead = self.batches[len(self.turns)]
        return (
            first.replayed
            and second.replayed
            and bool(first.gathered)
            and first.gathered == second.gathered
            and first.batch == second.batch == ahead
        )

    def _jump(self, batch: Any, next_batch: Callable[[], Any]) -> Any:
        """Drop `self.skip` batches from `batch` on and return the one after them; each must
        have the shape of the turns it stands for (`fetched` checks the one returned)."""
        template = self.batches[-1]
        for _ in range(self.skip):
            if shapes(batch) != template:
                self.why_not = "a skipped batch had another shape"
                break
            batch = next_batch()
            self.skipped += 1
        if shapes(batch) != template:
            self.why_not = self.why_not or "the batch after the skipped ones had another shape"
        if self.answers() != self._answered:
            self.why_not = self.why_not or "a skipped batch changed what the batch values answer"
        self.skip = 0
        self.grow = dict.fromkeys(self.turns[-1].gathered, self.skipped)
        return batch


def _not_allowed(args: Any) -> str:
    """Why the loop's turns cannot be skipped under these arguments ('' when they can)."""
    if args.eval_accumulation_steps is not None:
        return "the loop moves what it gathered to the host every eval_accumulation_steps"
    if args.batch_eval_metrics:
        return "the metrics are computed batch by batch"
    if not args.eval_do_concat_batches:
        return "the batches are gathered apart (eval_do_concat_batches off)"
    return ""


def _rows_of(turns: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """An empty tensor of `turns` times what one turn gathers along the first dimension (the
    rows the skipped turns would have added)."""

    def rows(tensor: torch.Tensor) -> torch.Tensor:
        size = (tensor.shape[0] * turns, *tensor.shape[1:]) if tensor.dim() else (turns,)
        return torch.empty(size, dtype=tensor.dtype, device=tensor.device)

    return rows
