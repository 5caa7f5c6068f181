"""Model-family trials a worker cannot build fail with a message naming the field; the worker
keeps working; a LoRA study runs traced (a real server; an in-process agent on a simulated card)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.conftest import Studies
from vramtune.service.testing import ServerProcess
from vramtune.worker.device.gpu import parse_size, simulated_card
from vramtune.worker.loop.agent import Agent
from vramtune.worker.loop.api import ServerClient
from vramtune.worker.loop.cycle import AgentOptions
from vramtune.worker.run.training import TorchTaskRunner
from vramtune.worker.trial.runner import CardSpec, TrialRunner


def _runners() -> dict[str, TrialRunner]:
    runners: dict[str, TrialRunner] = {}
    if importlib.util.find_spec("transformers") is not None:
        from vramtune.worker.tasks.hf import HFCausalLMTask

        runners["hf-causal-lm"] = TorchTaskRunner(HFCausalLMTask())
    try:
        from vramtune.worker.tasks.vision import TorchvisionImageTask
    except ImportError:
        pass
    else:
        runners["torchvision-image"] = TorchTaskRunner(TorchvisionImageTask())
    return runners


@pytest.fixture
def agent(fleet_server: ServerProcess) -> Iterator[Agent]:
    """An in-process agent with the family tasks that import here, on a 256 MiB card."""
    runners = _runners()
    if not runners:
        pytest.skip("neither vramtune[hf] nor vramtune[vision] is installed")
    made = Agent(
        ServerClient(fleet_server.url),
        runners,
        CardSpec(info=simulated_card(parse_size("256MiB"))),
        AgentOptions(name="families"),
    )
    yield made
    made.close()


def _fails_naming(agent: Agent, studies: Studies, task: str, space: dict[str, Any]) -> str:
    if task not in agent.runners:
        pytest.skip(f"{task} is not installed here")
    name = studies.create(space, task=task, task_config={"batch_size": 4}, budget={"max_steps": 1})
    assert agent.run_once() is True
    [trial] = studies.trials(name)
    assert trial.state == "FAIL"
    assert trial.outcome == "failed"
    reason: str = trial.user_attrs["vramtune.fail_reason"]
    return reason


def test_heads_that_do_not_divide_fail_the_trial_naming_the_field(
    agent: Agent, studies: Studies
) -> None:
    # An int range, not choices: the server cannot check every value, the worker refuses it.
    space = {"num_key_value_heads": {"type": "int", "low": 3, "high": 5, "step": 2}}
    reason = _fails_naming(agent, studies, "hf-causal-lm", space)
    assert "num_key_value_heads: num_attention_heads (4) must be divisible by" in reason
    assert agent.run_once() is False  # still polling: the worker did not crash


def test_a_model_name_the_library_lacks_fails_the_trial_with_close_matches(
    agent: Agent, studies: Studies
) -> None:
    space = {"model_name": {"type": "categorical", "choices": ["mobilenet_v3_smal"]}}
    reason = _fails_naming(agent, studies, "torchvision-image", space)
    assert "model_name: torchvision has no classification model 'mobilenet_v3_smal'" in reason
    assert "mobilenet_v3_small" in reason


def test_a_resolution_too_small_for_the_model_fails_the_trial_naming_the_field(
    agent: Agent, studies: Studies
) -> None:
    # 32 px passes the server's floor for every model; Inception's stem shrinks it below its
    # kernels, which only building and running the model tells (the worker's plan choice).
    space = {
        "model_name": {"type": "categorical", "choices": ["inception_v3"]},
        "resolution": {"type": "categorical", "choices": [32]},
    }
    reason = _fails_naming(agent, studies, "torchvision-image", space)
    assert "resolution: torchvision model cannot run" in reason
    assert agent.run_once() is False  # still polling: the worker did not crash


def test_a_lora_study_tunes_rank_and_learning_rate_traced_not_probed(
    agent: Agent, studies: Studies
) -> None:
    """LoRA through the wire's flat form: `finetune: lora` fixed, `lora_r` and `lr` sampled."""
    if "hf-causal-lm" not in agent.runners or importlib.util.find_spec("peft") is None:
        pytest.skip("needs vramtune[peft]")
    space = {
        "lora_r": {"type": "categorical", "choices": [4, 16]},
        "lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True},
    }
    config = {"finetune": "lora", "batch_size": 4, "seq_len": 16, "corpus_chars": 20_000}
    name = studies.create(
        space,
        task="hf-causal-lm",
        task_config={**config, "eval_windows": 4},
        n_trials=2,
        budget={"max_steps": 2, "eval_every": 2},
    )
    assert agent.run_once() is True
    assert agent.run_once() is True
    trials = studies.trials(name)
    assert [t.state for t in trials] == ["COMPLETE", "COMPLETE"], [t.user_attrs for t in trials]
    assert {t.params["lora_r"] for t in trials} <= {4, 16}
    for trial in trials:
        assert trial.plan is not None and "probed" not in trial.plan.reason
        assert trial.predicted_peak_bytes is not None and trial.measured_peak_bytes is not None
        assert trial.measured_peak_bytes == trial.predicted_peak_bytes  # the simulated card


def test_lora_settings_without_finetune_are_refused_naming_the_field(studies: Studies) -> None:
    with pytest.raises(Exception, match=r"'search_space', 'lora_r'\], 'msg': 'needs finetune"):
        studies.create({"lora_r": {"type": "categorical", "choices": [4, 16]}}, task="hf-causal-lm")
