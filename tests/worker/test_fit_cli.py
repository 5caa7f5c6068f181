"""`vramtune fit TASK_FILE`: the table, --json against a real CPU run, the --budget gate, and
bad input named with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from task_contract import run_trial

from vramtune.worker.tasks.registry import discover

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = "examples/plain_task.py"
CONFIG = "batch_size=16,width=32"


def vramtune_fit(*args: str, target: str = EXAMPLE) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vramtune", "fit", target, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_json_is_the_real_cpu_runs_peak_to_the_byte() -> None:
    done = vramtune_fit("--config", CONFIG, "--cards", "8GiB,T4", "--device", "cpu", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    runner = discover([str(ROOT / EXAMPLE)], entry_points=False).runners["plain-digits"]
    config = {"batch_size": 16, "width": 32}
    # Evaluating after every step puts the evaluation inside the measured window each time.
    measured = run_trial(runner.task, config, steps=3, eval_every=1).measured  # type: ignore[attr-defined]
    assert result["peak_bytes"] == measured.peak_allocated_bytes
    assert result["evaluation_bytes"] == measured.evaluation_peak_bytes
    assert [card["verdict"] for card in result["cards"]] == ["fits", "fits"]
    assert result["peak_phase"] in ("forward", "backward", "optimizer", "evaluation")


def test_the_table_and_the_budget_gate() -> None:
    done = vramtune_fit("--config", CONFIG, "--cards", "8GiB,H100,4KiB", "--budget", "8GiB")
    assert done.returncode == 0, done.stderr
    table = done.stdout
    assert "plain-digits (batch_size=16, width=32) on CUDA cards: predicted peak" in table
    assert "fits as asked" in table and "does not fit" in table and "budget 8.00 GiB: fits" in table
    assert "CUDA context: 384 MiB (outside the allocator; each card needs" in table
    over = vramtune_fit("--config", CONFIG, "--cards", "H100", "--budget", "4KiB")
    assert over.returncode == 1 and "budget 4.00 KiB: does not fit" in over.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--config", "batch_size=16,width=32,depth=2"],
            "--config: task 'plain-digits' takes no 'depth'",
        ),
        (["--config", "batch_size=16"], "--config: task 'plain-digits' needs width"),
        (["--config", "batch_size"], "--config: expected KEY=VALUE, got 'batch_size'"),
        (["--config", CONFIG, "--cards", "8GiB,H1000"], "--cards: unknown card 'H1000'"),
        (["--config", CONFIG, "--budget", "lots"], "--budget: not a size: 'lots'"),
        (["--config", CONFIG, "--world-size", "2"], "--strategy: ddp or fsdp2 is needed"),
        (["--config", CONFIG, "--world-size", "0"], "--world-size: a number of ranks >= 1"),
        (["--config", CONFIG, "--strategy", "ddp"], "--world-size: give the ranks"),
        (["--config", CONFIG, "--strategy", "zero3"], "--strategy: invalid choice: 'zero3'"),
        (["--config", CONFIG, "--lora", "r=8"], "--lora: adapters go on an hf: config"),
        (["--config", CONFIG, "--lora", "r"], "--lora: expected KEY=VALUE, got 'r'"),
    ],
    ids=[
        "unknown-key",
        "missing-key",
        "not-key-value",
        "unknown-card",
        "budget",
        "no-strategy",
        "no-ranks",
        "strategy-alone",
        "unknown-strategy",
        "lora-on-a-task",
        "lora-not-key-value",
    ],
)
def test_bad_input_is_named_and_exits_2(args: list[str], message: str) -> None:
    done = vramtune_fit(*args)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_an_hf_config_per_rank_as_json_with_progress_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Its per-rank bytes are the ladder's own trace's (test_fit_hf_ranks.py): here the wiring,
    # in this process (a second one would import torch and transformers again: 10 s at load).
    pytest.importorskip("transformers")
    from test_fit_hf_ranks import tiny_llama

    from vramtune.service.cli.parser import build_parser

    path = tiny_llama(tmp_path)
    ranks = ["--world-size", "2", "--strategy", "fsdp2", "--cards", "T4,1KiB"]
    shown = ["--device", "cpu", "--progress", "--json"]
    args = build_parser().parse_args(
        ["fit", f"hf:{path}", "--config", "batch_size=4,seq_len=16", *ranks, *shown]
    )
    code = args.func(args)
    done = capsys.readouterr()
    assert code == 0, done.err
    result = json.loads(done.out)  # progress never reaches the JSON
    assert "vramtune fit: [1/3] the step, rank 0 of 2..." in done.err
    assert (result["task"], result["config"]) == (
        "LlamaForCausalLM",
        {"batch_size": 4, "seq_len": 16},
    )
    assert (result["world_size"], result["strategy"], result["method"]) == (2, "fsdp", "trace")
    assert result["cuda_context_bytes"] == 0 and result["card_bytes"] == result["peak_bytes"]
    verdicts = [card["verdict"] for card in result["cards"]]
    assert verdicts == ["fits", "does not fit"]
    assert result["cards"][1]["short_by_bytes"] == result["peak_bytes"] - 1024


@pytest.mark.parametrize(
    ("target", "args", "message"),
    [
        ("hf:missing/config.json", [], "TASK_FILE: no Hugging Face config at missing"),
        ("hf:LLAMA", ["--config", "batch_size=4"], "--config: an hf: model needs seq_len"),
        ("hf:LLAMA", ["--config", "batch_size=4,seq_len=8,width=2"], "takes no 'width'"),
        ("hf:LLAMA", ["--config", "batch_size=4,seq_len=8", "--task", "x"], "--task: an hf:"),
    ],
    ids=["missing-file", "no-seq-len", "unknown-key", "task"],
)
def test_bad_hf_input_is_named_and_exits_2(
    tmp_path: Path, target: str, args: list[str], message: str
) -> None:
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text("{}")  # checked before it is read
    done = vramtune_fit(*args, target=target.replace("LLAMA", str(folder)))
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_the_card_table_and_the_command_line_need_no_torch() -> None:
    code = "import sys, vramtune; vramtune.CARDS; vramtune.register_card\n"
    code += "from vramtune.service.cli.parser import build_parser\n"
    code += "build_parser().parse_args(['fit', 'task.py', '--cards', 'T4'])\n"
    code += "sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=False).returncode == 0


def test_the_keys_a_task_reads_are_its_shapes_batch_and_literal_reads() -> None:
    from vramtune.worker.fit.cli import config_keys

    runner = discover([str(ROOT / EXAMPLE)], entry_points=False).runners["plain-digits"]
    # width: a shape parameter; lr: read by build_optimizer as config.get("lr", 0.1).
    assert config_keys(runner.task) == {"batch_size", "width", "lr"}  # type: ignore[attr-defined]


def test_progress_rewrites_one_line_on_a_terminal_and_writes_lines_elsewhere() -> None:
    import io

    from vramtune.worker.fit.cli import Progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal, log = Terminal(), io.StringIO()
    for stream in (terminal, log):
        shown = Progress(stream)
        shown("[1/2] the step...")
        shown("[2/2] T4: tracing micro-batch 8 of 64...")
        shown.close()
    assert terminal.getvalue() == (
        "\rvramtune fit: [1/2] the step...\x1b[K"
        "\rvramtune fit: [2/2] T4: tracing micro-batch 8 of 64...\x1b[K\r\x1b[K"
    )
    assert log.getvalue().splitlines() == [
        "vramtune fit: [1/2] the step...",
        "vramtune fit: [2/2] T4: tracing micro-batch 8 of 64...",
    ]
