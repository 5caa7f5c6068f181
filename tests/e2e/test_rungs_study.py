"""A LoRA study tuning `lora_r` and `lr` on two simulated cards, on SQLite and PostgreSQL: the
small card holds its configurations only through a new rung (chunked cross-entropy), the large
one runs them as asked; every trial completes, predicted to the byte (a real server; in-process
agents with the hf-causal-lm task).

Cost: 2.5-5 min per database at load 16-17 on 2 cores (tiny Llama configs with a 16k vocabulary:
the small card is sized from four traces, then four trials of two steps each).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.conftest import Studies
from vramtune.common.memory import peak_of
from vramtune.service.testing import ServerProcess
from vramtune.service.wire import Plan
from vramtune.worker.device.gpu import simulated_card
from vramtune.worker.loop.agent import Agent
from vramtune.worker.loop.api import ServerClient
from vramtune.worker.loop.cycle import AgentOptions
from vramtune.worker.predictor import predict
from vramtune.worker.run.training import TorchTaskRunner
from vramtune.worker.trial.runner import CardSpec, plan_for_micro_batch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("peft") is None,
    reason="needs vramtune[hf] and vramtune[peft]",
)

CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "vocab_size": 16384,
    "seq_len": 64,
    "batch_size": 2,
    "corpus_chars": 20_000,
    "eval_windows": 2,
    "finetune": "lora",
}
RANKS = [4, 32]
RUNGS = ["micro_batch", "checkpointing", "chunked_cross_entropy"]
MARGIN = 0.10  # the policy's default


def _footprint(config: dict[str, Any], plan: Plan) -> int:
    from vramtune.worker.tasks.hf import HFCausalLMTask

    return peak_of(predict(HFCausalLMTask(), config, plan))


def _small_card_bytes() -> int:
    """A card whose budget lies between the old ladder's smallest plan (micro-batch 1 and
    checkpointing) and the new one's (the same, with the loss in chunks), for every rank."""
    batch = int(CONFIG["batch_size"])
    old = plan_for_micro_batch(batch, 1, checkpointing=True)
    new = plan_for_micro_batch(batch, 1, checkpointing=True, chunked_loss=True)
    configs = [{**CONFIG, "lora_r": r} for r in RANKS]
    old_smallest = min(_footprint(c, old) for c in configs)
    new_largest = max(_footprint(c, new) for c in configs)
    assert new_largest < old_smallest, (new_largest, old_smallest)
    return math.ceil((new_largest + old_smallest) / 2 / (1.0 - MARGIN))


def _agent(server: ServerProcess, name: str, memory: int) -> Agent:
    from vramtune.worker.tasks.hf import HFCausalLMTask

    return Agent(
        ServerClient(server.url),
        {"hf-causal-lm": TorchTaskRunner(HFCausalLMTask())},
        CardSpec(info=simulated_card(memory)),
        AgentOptions(name=name),
    )


@pytest.fixture
def cards(fleet_server: ServerProcess) -> Iterator[tuple[Agent, Agent]]:
    small = _agent(fleet_server, "rungs-small", _small_card_bytes())
    large = _agent(fleet_server, "rungs-large", 1024**3)
    yield small, large
    small.close()
    large.close()


def test_a_lora_study_completes_with_a_configuration_only_a_new_rung_fits(
    cards: tuple[Agent, Agent], studies: Studies
) -> None:
    small, large = cards
    space = {
        "lora_r": {"type": "categorical", "choices": RANKS},
        "lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True},
    }
    name = studies.create(
        space,
        task="hf-causal-lm",
        task_config=CONFIG,
        n_trials=4,
        budget={"max_steps": 2, "eval_every": 2},
        memory_policy={"resizes": RUNGS, "margin": MARGIN},
    )
    for agent in (small, large, small, large):
        assert agent.run_once() is True
    trials = studies.trials(name)
    assert [t.state for t in trials] == ["COMPLETE"] * 4, [t.user_attrs for t in trials]
    by_worker = {
        worker: [t for t in trials if t.worker == worker]
        for worker in {"rungs-small", "rungs-large"}
    }
    for trial in by_worker["rungs-small"]:
        assert trial.plan is not None and trial.plan.chunked_loss, trial.plan
        assert "chunked_cross_entropy" in trial.plan.reason
        assert trial.outcome == "resized"
    for trial in by_worker["rungs-large"]:
        assert trial.plan is not None and not trial.plan.chunked_loss
        assert trial.outcome == "as_asked"
    assert len(by_worker["rungs-small"]) == len(by_worker["rungs-large"]) == 2
    for trial in trials:
        assert trial.measured_peak_bytes == trial.predicted_peak_bytes  # the simulated card
    assert {t.params["lora_r"] for t in trials} <= set(RANKS)


def test_an_unknown_rung_is_refused_naming_the_field(studies: Studies) -> None:
    with pytest.raises(Exception, match=r"memory_policy.*resizes"):
        studies.create(
            {"x": {"type": "float", "low": 0, "high": 1}},
            memory_policy={"resizes": ["micro_batch", "teleport"]},
        )
