"""`vramtune fit TASK_FILE`: will a task's training step fit these cards?

Registered in the `vramtune.commands` entry-point group (pyproject.toml). The arguments are
checked before torch is imported, so a typo fails in a fraction of a second; every bad argument
exits 2 with a message naming it (those only `fit` can judge, such as a batch that does not
split over the ranks, are translated from its message to the option's name). Exit 1 means
`--budget` was given and the step, as asked, does not fit it (a CI gate); 0 otherwise. Nothing
is downloaded: the task file is imported as a worker imports it (``hf:PATH``: a local
config.json, built by transformers from the config alone), and the step is traced under fake
tensors. With ``--world-size`` the answer is rank 0's.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import yaml

from vramtune.common.units import human_bytes
from vramtune.worker.device.gpu import parse_size
from vramtune.worker.fit.cards import Card, card_named

if TYPE_CHECKING:
    from vramtune.worker.fit.api import CardFit, FitResult
    from vramtune.worker.trial.task import Task

BAD_INPUT = 2
OVER_BUDGET = 1
HF_PREFIX = "hf:"
HF_KEYS = frozenset({"batch_size", "seq_len"})
"""What an ``hf:`` model reads (vramtune.worker.fit.hf_config, which imports torch)."""

PHASE_WORDS = {
    "setup": "the first step's setup",
    "forward": "the forward pass",
    "backward": "the backward pass",
    "optimizer": "the optimizer step",
    "evaluation": "the evaluation",
}


STRATEGY_WORDS = {"ddp": "DDP", "fsdp": "FSDP2"}


class BadInput(ValueError):
    """An argument that cannot be used; the message names it."""


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `vramtune fit`; it sets `func(args) -> exit code`."""
    fit = subparsers.add_parser(
        "fit",
        help="predict a task's peak memory and which cards it fits (nothing runs)",
        description="Trace TASK_FILE's training step on one configuration under fake tensors "
        "and say, for each card, whether it fits as asked, fits only through a plan (which, "
        "and how much slower), or cannot fit and by how much, with the largest micro-batch "
        "that fits. Exit 2 on a bad argument; with --budget, exit 1 when it does not fit.",
    )
    fit.add_argument(
        "file",
        metavar="TASK_FILE",
        help="a .py file or dotted module of tasks, or hf:PATH, a local Hugging Face config.json "
        "(or its folder) with --config batch_size=..,seq_len=.. (nothing is downloaded)",
    )
    fit.add_argument(
        "--task", metavar="NAME", help="the task to predict, when the file has several"
    )
    fit.add_argument(
        "--config",
        metavar="KEY=VALUE,...",
        default="",
        help="the configuration, e.g. batch_size=64,width=1024 (values read as YAML scalars)",
    )
    fit.add_argument(
        "--cards",
        metavar="CARD,...",
        help="card names (T4, L4, A10, RTX-4090, A100-40GB, A100-80GB, H100, H200...) or sizes "
        "(8GiB); default: every built-in card",
    )
    fit.add_argument(
        "--budget",
        metavar="SIZE",
        help="exit 1 unless the step fits SIZE as asked (e.g. 8GiB): a CI gate",
    )
    fit.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="predict a CUDA card's run (default; emulated on a CPU-only torch) or the CPU's",
    )
    fit.add_argument(
        "--margin",
        type=float,
        default=0.0,
        help="fraction of each card's usable memory to keep free (default 0)",
    )
    fit.add_argument(
        "--world-size",
        type=int,
        default=1,
        metavar="N",
        help="ranks of data parallelism: predict rank 0's peak with the batch split over N "
        "(needs --strategy); default 1",
    )
    fit.add_argument(
        "--strategy",
        choices=("ddp", "fsdp2", "fsdp"),
        help="with --world-size above 1: DDP (a whole model per rank) or FSDP2 (sharded)",
    )
    fit.add_argument(
        "--lora",
        metavar="KEY=VALUE,...",
        help="with an hf: causal LM, LoRA adapters: r=16 (lora_alpha, lora_dropout, "
        "target_modules=q_proj+v_proj); QLoRA: quantized_base=nf4 or int8",
    )
    fit.add_argument(
        "--progress",
        action="store_true",
        help="say on stderr what is being traced (the default when stderr is a terminal)",
    )
    fit.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="print JSON for scripts"
    )
    fit.set_defaults(func=fit_command)


def fit_command(args: argparse.Namespace) -> int:
    """Check the arguments, load the task, predict, print; the exit code as the module says."""
    progress = Progress.wanted(args)
    try:
        config = parse_config(args.config)
        cards = parse_cards(args.cards)
        budget = parse_budget(args.budget)
        if not 0.0 <= args.margin < 1.0:
            raise BadInput(f"--margin: a fraction in [0, 1), got {args.margin}")
        check_ranks(args.world_size, args.strategy)
        lora = parse_lora(args.lora)
        model = model_of(args, config, lora)
        result = run_fit(model, args, config, cards, lora, progress)
    except BadInput as error:
        print(f"vramtune fit: {error}", file=sys.stderr)
        return BAD_INPUT
    finally:
        if progress is not None:
            progress.close()
    over = budget is not None and (result.method == "none" or result.card_bytes > budget)
    if getattr(args, "json", False):
        document = result.to_dict()
        if budget is not None:
            document["budget"] = {"bytes": budget, "fits": not over}
        print(json.dumps(document, indent=2))
    else:
        print(format_result(result, budget))
    return OVER_BUDGET if over else 0


def model_of(args: argparse.Namespace, config: dict[str, Any], lora: object) -> object:
    """What `fit` predicts: the hf: config as given (its file checked), or the file's task."""
    if is_hf(args.file):
        check_hf(args.file, args.task, config)
        return args.file
    if lora is not None:
        raise BadInput("--lora: adapters go on an hf: config (TASK_FILE hf:PATH)")
    task = load_task(args.file, args.task)
    check_config(task, config)
    return task


ARGUMENTS = {
    "model": "TASK_FILE",
    "batch_size": "--config",
    "config": "--config",
    "world_size": "--world-size",
    "strategy": "--strategy",
    "plan": "--world-size",
    "lora": "--lora",
}
"""`fit`'s argument names as the command line spells them, for its errors."""


def run_fit(
    model: object,
    args: argparse.Namespace,
    config: dict[str, Any],
    cards: list[Card] | None,
    lora: dict[str, Any] | None,
    progress: Progress | None,
) -> FitResult:
    """`fit` on the checked arguments; its errors become BadInput naming the option."""
    from vramtune.worker.fit.api import fit
    from vramtune.worker.trial.task import TaskConfigError

    name = getattr(model, "name", model)
    try:
        return fit(
            model,
            config=config,
            cards=cards,
            device=args.device,
            margin=args.margin,
            world_size=args.world_size,
            strategy=args.strategy,
            lora=lora,
            progress=progress,
        )
    except TaskConfigError as error:
        raise BadInput(f"--config: task {name!r} refuses it: {error}") from error
    except ValueError as error:
        argument, colon, rest = str(error).partition(": ")
        if not colon or argument not in ARGUMENTS:
            raise
        option = ARGUMENTS[argument]
        said = f"{argument}: {rest}" if option == "--config" and argument != "config" else rest
        raise BadInput(f"{option}: {said}") from error


class Progress:
    """What is being traced, on stderr: one line rewritten in place on a terminal, a line a
    step elsewhere (``--progress`` into a log)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.terminal = stream.isatty()
        self.shown = False

    @classmethod
    def wanted(cls, args: argparse.Namespace) -> Progress | None:
        """Shown when asked, or when stderr is a terminal and no script reads JSON."""
        asked = bool(args.progress)
        terminal = sys.stderr.isatty() and not getattr(args, "json", False)
        return cls(sys.stderr) if asked or terminal else None

    def __call__(self, line: str) -> None:
        text = f"vramtune fit: {line}"
        if self.terminal:
            self.stream.write(f"\r{text}\x1b[K")  # \x1b[K: clear what a longer line left
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        """Clear the terminal's line, so that the answer starts on a clean one."""
        if self.terminal and self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def check_ranks(world_size: int, strategy: str | None) -> None:
    """A world size of at least 1, with a strategy exactly when it is above 1."""
    if world_size < 1:
        raise BadInput(f"--world-size: a number of ranks >= 1, got {world_size}")
    if world_size > 1 and strategy is None:
        raise BadInput(f"--strategy: ddp or fsdp2 is needed with --world-size {world_size}")
    if world_size == 1 and strategy is not None:
        raise BadInput("--world-size: give the ranks (above 1) that --strategy splits over")


def is_hf(path: str) -> bool:
    """A Hugging Face config (``hf:PATH``) rather than a task file."""
    return path.startswith(HF_PREFIX)


def check_hf(path: str, task: str | None, config: dict[str, Any]) -> None:
    """The config file exists and --config gives exactly a batch and a sequence length."""
    local = Path(path.removeprefix(HF_PREFIX)).expanduser()
    if not (local / "config.json" if local.is_dir() else local).is_file():
        raise BadInput(f"TASK_FILE: no Hugging Face config at {local} (a config.json or folder)")
    if task is not None:
        raise BadInput("--task: an hf: config is one model; --task picks among a file's tasks")
    unknown = sorted(set(config) - HF_KEYS)
    if unknown:
        raise BadInput(
            f"--config: an hf: model takes no {', '.join(map(repr, unknown))} "
            "(it reads batch_size and seq_len)"
        )
    missing = sorted(HF_KEYS - set(config))
    if missing:
        raise BadInput(f"--config: an hf: model needs {', '.join(missing)}")


def parse_lora(text: str | None) -> dict[str, Any] | None:
    """``r=16,target_modules=q_proj+v_proj`` as LoRA settings (the names joined by "+": the
    comma separates settings), or None."""
    if text is None:
        return None
    lora = parse_config(text, option="--lora")
    if isinstance(lora.get("target_modules"), str):
        lora["target_modules"] = lora["target_modules"].replace("+", ",")
    return lora


def parse_config(text: str, option: str = "--config") -> dict[str, Any]:
    """``a=1,b=x`` as a dict, each value a YAML scalar (1 → int, 0.1 → float, x → str)."""
    config: dict[str, Any] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, equals, value = item.partition("=")
        if not equals or not key.strip():
            raise BadInput(f"{option}: expected KEY=VALUE, got {item!r}")
        try:
            config[key.strip()] = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError:
            config[key.strip()] = value
    return config


def parse_cards(text: str | None) -> list[Card] | None:
    """The cards named (None: every built-in one); an unknown name names itself."""
    if text is None:
        return None
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise BadInput("--cards: name at least one card or size")
    try:
        return [card_named(name) for name in names]
    except ValueError as error:
        raise BadInput(f"--cards: {error}") from error


def parse_budget(text: str | None) -> int | None:
    """The budget in bytes, or None."""
    if text is None:
        return None
    try:
        return parse_size(text)
    except ValueError as error:
        raise BadInput(f"--budget: {error}") from error


def load_task(path: str, name: str | None) -> Task:
    """The task `name` (or the only one) of the file, loaded as a worker loads it."""
    from vramtune.worker.tasks.registry import discover

    try:
        found = discover([path], entry_points=False)
    except Exception as error:  # a user's file may raise anything while importing
        raise BadInput(f"TASK_FILE: cannot load {path}: {error}") from error
    for source, problem in found.errors.items():
        print(f"vramtune fit: {source}: {problem}", file=sys.stderr)
    tasks: dict[str, Task] = {
        task_name: task
        for task_name, runner in found.runners.items()
        if (task := getattr(runner, "task", None)) is not None
    }
    if not tasks:
        raise BadInput(f"TASK_FILE: {path} defines no task vramtune can trace")
    if name is None:
        if len(tasks) > 1:
            raise BadInput(f"--task: {path} defines {', '.join(sorted(tasks))}; name one")
        return next(iter(tasks.values()))
    if name not in tasks:
        raise BadInput(f"--task: {path} defines no task {name!r} (it has {', '.join(tasks)})")
    return tasks[name]


def check_config(task: Task, config: dict[str, Any]) -> None:
    """Refuse keys the task does not read and missing shape parameters, by name."""
    known = config_keys(task)
    unknown = sorted(set(config) - known)
    if unknown:
        raise BadInput(
            f"--config: task {task.name!r} takes no {', '.join(map(repr, unknown))} "
            f"(it reads {', '.join(sorted(known))})"
        )
    missing = sorted({task.batch_size_param, *task.shape_params} - set(config))
    if missing:
        raise BadInput(
            f"--config: task {task.name!r} needs {', '.join(missing)} (its batch size and the "
            "shape parameters memory depends on)"
        )


def config_keys(task: Task) -> set[str]:
    """The keys a task reads: its batch size and shape parameters, and every literal key its
    own code reads from a configuration (``config["lr"]``, ``config.get("lr", 0.1)``)."""
    keys = {task.batch_size_param, *task.shape_params}
    for cls in type(task).__mro__:
        if cls.__module__.startswith(("vramtune.", "builtins", "typing")):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        except (OSError, TypeError, SyntaxError):
            continue
        keys |= set(_literal_keys(tree))
    return keys


def _literal_keys(tree: ast.AST) -> list[str]:
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and _is_config(node.value):
            key = node.slice
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and _is_config(node.func.value)
            and node.args
        ):
            key = node.args[0]
        else:
            continue
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            found.append(key.value)
    return found


def _is_config(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and "config" in node.id.lower()


def format_result(result: FitResult, budget: int | None = None) -> str:
    """The human answer: the peak and what is live at it, then one row per card."""
    config = ", ".join(f"{key}={value}" for key, value in result.config.items())
    where = PHASE_WORDS.get(result.peak_phase or "", "")
    ranks = (
        f", rank 0 of {result.world_size} ({STRATEGY_WORDS.get(result.strategy or '')})"
        if result.world_size > 1
        else ""
    )
    lines = [
        f"{result.task} ({config}) on {result.device.upper()} cards{ranks}: predicted peak "
        f"{human_bytes(result.peak_bytes)}"
        + (f", in {where}" if where else "")
        + f" ({result.method}, {result.prediction_seconds:.2f} s)",
    ]
    parts = [f"{name} {human_bytes(size)}" for name, size in result.breakdown.items() if size]
    if parts:
        lines.append("  live at the peak: " + ", ".join(parts))
    if result.cuda_context_bytes:
        lines.append(
            f"  CUDA context: {human_bytes(result.cuda_context_bytes)} (outside the allocator; "
            f"each card needs {human_bytes(result.card_bytes)} in all)"
        )
    if result.evaluation_bytes is not None:
        lines.append(f"  evaluation peak: {human_bytes(result.evaluation_bytes)}")
    if result.reason:
        lines.append(f"  note: {result.reason}")
    rows = [("card", "usable", "largest micro-batch", "answer")]
    rows += [_row(answer) for answer in result.cards]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines.append("")
    lines += [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[3]
        for row in rows
    ]
    if budget is not None:
        fits = result.method != "none" and result.card_bytes <= budget
        verdict = (
            "fits" if fits else f"does not fit ({human_bytes(result.card_bytes - budget)} over)"
        )
        lines += ["", f"budget {human_bytes(budget)}: {verdict}"]
    return "\n".join(lines)


def _row(answer: CardFit) -> tuple[str, str, str, str]:
    largest = "-" if answer.largest_micro_batch is None else str(answer.largest_micro_batch)
    if answer.verdict == "fits":
        said = "fits as asked"
    elif answer.verdict == "fits with a plan":
        slower = f", x{answer.slowdown:.2f} time per step" if answer.slowdown else ""
        said = f"fits with {answer.plan_in_words}{slower}"
    else:
        short = human_bytes(answer.short_by_bytes or 0)
        smallest = f" (smallest: {answer.plan_in_words})" if answer.plan_in_words else ""
        said = f"does not fit: {short} short{smallest}"
    return answer.card, human_bytes(answer.usable_bytes), largest, said
