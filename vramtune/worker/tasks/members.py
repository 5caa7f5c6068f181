"""The Task contract's members, each with the rule it keeps, spelled without importing torch.

Task discovery scans a user's module for classes with these members, and every loading error
(`vramtune tasks`, `vramtune tasks check`, a worker's start) names the members a near-miss class
lacks and the rule each one keeps: "no Task found" alone leaves a user guessing.
`vramtune.worker.trial.task.Task` is the protocol itself, with the same rules at length.
"""

from __future__ import annotations

TASK_ATTRIBUTES: dict[str, str] = {
    "name": "the name studies use to ask for this task (letters, digits, '._-')",
    "batch_size_param": "the configuration key of the batch size, which the worker may split "
    "into micro-batches with gradient accumulation",
    "shape_params": "a frozenset of the configuration keys that change tensor shapes "
    "(widths, depth, sequence length); the predictor caches by them",
    "metric": "Metric(name, 'minimize' | 'maximize'): what evaluate returns",
}
TASK_METHODS: dict[str, str] = {
    "build_model": "build_model(config) -> a fresh nn.Module on the CPU, built from the "
    "configuration alone (no downloads); raise TaskConfigError for an impossible one",
    "build_optimizer": "build_optimizer(model, config) -> an optimizer over model.parameters()",
    "example_batch": "example_batch(config, micro_batch, device) -> a batch of the real "
    "batches' shapes and dtypes, made with tensor factories only (the predictor traces it)",
    "batches": "batches(config, micro_batch, device, seed) -> an endless iterator of real "
    "batches of micro_batch examples",
    "loss": "loss(model, batch) -> the batch's mean loss, a scalar tensor",
    "evaluate": "evaluate(model, config, device) -> the metric on held-out data, as a float "
    "(evaluate in chunks of the batch size: the plan is sized to the training step)",
    "checkpoint_modules": "checkpoint_modules(model) -> the sub-modules whose forward may be "
    "recomputed in backward ([] if none)",
}
TASK_MEMBERS: dict[str, str] = {**TASK_ATTRIBUTES, **TASK_METHODS}

# A class with at least this many of the methods was meant as a task: say what it lacks.
NEAR_MISS_METHODS = 3


def missing_members(candidate: object) -> list[str]:
    """The Task members `candidate` (a class or an instance) lacks, in the protocol's order."""
    missing = [name for name in TASK_ATTRIBUTES if not hasattr(candidate, name)]
    missing += [name for name in TASK_METHODS if not callable(getattr(candidate, name, None))]
    return missing


def describe_missing(owner: str, missing: list[str]) -> str:
    """'Owner lacks a, b: a is ...; b is ...' — one line a user can act on."""
    rules = "; ".join(f"{name} is {TASK_MEMBERS[name]}" for name in missing)
    return f"{owner} is not a Task: it lacks {', '.join(missing)} ({rules})"
