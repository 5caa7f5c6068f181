"""The offload rungs (issue 32): the saved activations (`save_on_cpu`) or the optimizer's state
and step kept in host memory. They keep the numerics and are offered on CUDA cards only.

This machine has no CUDA device, and fake `cuda` tensors on its CPU build of torch abort the
process as soon as autograd records a graph (checked: `F.linear` on a fake cuda weight that
requires grad, under `FakeTensorMode`, ends in "PyTorch is not linked with support for cuda
devices"). So the card's bytes are told from the host's here on the trace a CUDA card gets on a
machine without one (fake cpu emulating the card, the host copies on meta); a worker with a GPU
traces on fake cuda with the host on fake cpu, and `bench/gpu_offload.py` (in gpu_check.sh)
compares that prediction with `torch.cuda.max_memory_allocated` on a real card. The transfers
themselves run here on real tensors with the host on the CPU (`traced_host`), where the
parameters they train must equal a run without offload bit for bit.

Cost: ~2.5 min on 2 shared cores at load 8-13 (a 2-block char transformer: traces on the
emulated card, most of them for the policy, and a few real CPU steps).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from vramtune.common.memory import peak_of
from vramtune.common.plans import plan_in_words, plan_key, rungs_of, stored_plan
from vramtune.common.step_time import default_step_time_fit, step_time_slowdown
from vramtune.service.fleet.predictions import plan_column
from vramtune.service.wire import CardInfo, MemoryPolicy, Plan, PlanOut, Resize
from vramtune.worker.plan.policy import HandBack, RunAsPlanned, choose_plan, step_features
from vramtune.worker.predictor import clear_cache, predict
from vramtune.worker.run.training import TorchTaskRunner
from vramtune.worker.tasks.charlm import CharTransformerTask
from vramtune.worker.trial.offload import HostOffloadedOptimizer, offload_optimizer, traced_host
from vramtune.worker.trial.runner import CardSpec
from vramtune.worker.trial.steps import (
    batch_feeder,
    build_for_plan,
    build_optimizer_for_plan,
    train_step,
)
from vramtune.worker.trial.task import TaskConfigError

CONFIG: dict[str, Any] = {
    "n_layers": 2,
    "d_model": 64,
    "n_heads": 4,
    "seq_len": 64,
    "batch_size": 2,
}
CPU = torch.device("cpu")
INFO = CardInfo(model="test", total_bytes=2**40, free_bytes=2**40)
CUDA_CARD = CardSpec(info=INFO, device="cuda")
CPU_CARD = CardSpec(info=INFO, device="cpu")
ACTIVATIONS = Plan(activation_offload=True)
OPTIMIZER = Plan(optimizer_offload=True)
BOTH = Plan(activation_offload=True, optimizer_offload=True)
OFFLOADS: list[Resize] = ["activation_offload", "optimizer_offload"]


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    clear_cache()
    yield
    clear_cache()


def _card_prediction(plan: Plan, config: dict[str, Any] = CONFIG) -> dict[str, int]:
    prediction = predict(CharTransformerTask(), config, plan, CUDA_CARD)
    assert prediction.method == "trace", prediction.reason
    return {**prediction.breakdown, "peak": prediction.peak_allocated_bytes}


def test_offloading_takes_the_activations_and_the_optimizer_state_off_the_card() -> None:
    asked, activations, optimizer, both = map(
        _card_prediction, (Plan(), ACTIVATIONS, OPTIMIZER, BOTH)
    )
    # The forward's saved tensors live on the host between forward and backward.
    assert asked["activations"] > 400_000
    assert activations["activations"] < asked["activations"] / 100
    assert activations["peak"] < asked["peak"]
    # What backward unpacks comes back to the card for a moment: it is counted there.
    assert activations["temporaries"] > asked["temporaries"]
    # AdamW's two moments (8 B a parameter) leave; its step counters (0-d tensors, one a
    # parameter, kept on the host by real CUDA AdamW too) are what the emulated trace still
    # counts, at 512 B each.
    parameters = sum(p.numel() for p in _model().parameters())
    assert asked["optimizer_state"] >= 8 * parameters
    assert optimizer["optimizer_state"] <= 512 * len(list(_model().parameters()))
    assert optimizer["activations"] == asked["activations"]
    assert optimizer["peak"] < asked["peak"]
    assert both["peak"] < min(activations["peak"], optimizer["peak"])


def _model() -> torch.nn.Module:
    return build_for_plan(CharTransformerTask(), CONFIG, Plan(), CPU)


def test_a_run_or_a_trace_off_a_cuda_card_refuses_the_offload_rungs() -> None:
    task = CharTransformerTask()
    for plan in (ACTIVATIONS, OPTIMIZER):
        with pytest.raises(TaskConfigError, match="need a CUDA card"):
            build_for_plan(task, CONFIG, plan, CPU)
        with pytest.raises(TaskConfigError, match="host and the card are one memory"):
            predict(task, CONFIG, plan, CPU_CARD)


def _trained(plan: Plan, steps: int = 2) -> tuple[list[torch.Tensor], list[float]]:
    """Parameters and losses after `steps` real CPU steps, host copies on the CPU."""
    task = CharTransformerTask()
    torch.manual_seed(0)
    with traced_host(CPU):
        model = build_for_plan(task, CONFIG, plan, CPU)
        optimizer = build_optimizer_for_plan(task, model, CONFIG, plan)
        next_batch = batch_feeder(task.batches(CONFIG, CONFIG["batch_size"], CPU, seed=0))
        losses = [
            float(train_step(task, model, optimizer, next_batch, CONFIG["batch_size"], plan, CPU))
            for _ in range(steps)
        ]
    assert isinstance(optimizer, HostOffloadedOptimizer) == plan.optimizer_offload
    return [p.detach().clone() for p in model.parameters()], losses


@pytest.mark.parametrize(
    "plan",
    [
        Plan(micro_batch=1, accumulation=2, activation_offload=True),
        Plan(micro_batch=1, accumulation=2, optimizer_offload=True),
    ],
    ids=["activations", "optimizer"],
)
def test_the_offload_transfers_keep_the_numerics(plan: Plan) -> None:
    plain = plan.model_copy(update={"activation_offload": False, "optimizer_offload": False})
    expected, expected_losses = _trained(plain)
    parameters, losses = _trained(plan)
    assert losses == expected_losses
    assert all(torch.equal(a, b) for a, b in zip(parameters, expected, strict=True))
    initial, _ = _trained(plain, steps=0)
    assert not all(torch.equal(a, b) for a, b in zip(parameters, initial, strict=True))


def test_the_host_optimizer_keeps_the_task_optimizer_its_groups_and_state() -> None:
    """As the emulated trace builds it: fake card parameters, host copies on meta."""
    task = CharTransformerTask()
    with FakeTensorMode(), traced_host(torch.device("meta")):
        model = build_for_plan(task, CONFIG, Plan(), CPU)
        optimizer = build_optimizer_for_plan(task, model, CONFIG, OPTIMIZER)
        assert isinstance(optimizer, HostOffloadedOptimizer)
        assert isinstance(optimizer.inner, torch.optim.AdamW)
        assert optimizer.param_groups is optimizer.inner.param_groups
        hosted = [p for group in optimizer.param_groups for p in group["params"]]
        assert hosted and all(p.device.type == "meta" for p in hosted)
        assert len(hosted) == len(list(model.parameters()))
        seen: list[str] = []
        optimizer.register_step_pre_hook(lambda *_: seen.append("pre"))  # the tracker's hook
        for parameter in model.parameters():
            parameter.grad = torch.zeros_like(parameter)
        optimizer.step()
        assert seen == ["pre"]
        moments = {
            name: value.device.type
            for state in optimizer.state.values()
            for name, value in state.items()
        }
        assert moments == {"step": "cpu", "exp_avg": "meta", "exp_avg_sq": "meta"}
        optimizer.zero_grad()
        assert all(p.grad is None for p in model.parameters())


def test_a_frozen_parameter_is_neither_copied_nor_stepped() -> None:
    """A LoRA base is frozen: the host keeps no copy of it and the step never writes it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model[0].weight.requires_grad_(False)
    frozen, trained = model[0].weight.detach().clone(), model[1].weight.detach().clone()
    with traced_host(CPU):
        optimizer = offload_optimizer(torch.optim.AdamW(model.parameters(), lr=0.1), model)
    assert isinstance(optimizer, HostOffloadedOptimizer)
    assert len(optimizer.pairs) == 3  # two biases and the second weight
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    assert torch.equal(model[0].weight, frozen)
    assert not torch.equal(model[1].weight, trained)


def _fits_only_offloaded(runner: TorchTaskRunner) -> int:
    """Free bytes between the smaller offloaded plan and every plan without offload."""
    task, config = CharTransformerTask(), {**CONFIG, "batch_size": 1}
    offloaded = min(
        peak_of(predict(task, config, plan, CUDA_CARD)) for plan in (ACTIVATIONS, OPTIMIZER)
    )
    precise = peak_of(predict(task, config, Plan(checkpointing=True), CUDA_CARD))
    assert offloaded < precise
    return (offloaded + precise) // 2


def test_the_policy_offers_offload_on_a_cuda_card_only() -> None:
    runner = TorchTaskRunner(CharTransformerTask())
    config = {**CONFIG, "batch_size": 1}  # one sequence: no micro-batch to take
    free = _fits_only_offloaded(runner)
    policy = MemoryPolicy(resizes=["checkpointing", *OFFLOADS], margin=0.0)
    decision = choose_plan(runner, config, policy, CUDA_CARD, free)
    assert isinstance(decision, RunAsPlanned), decision
    assert set(rungs_of(decision.plan)) & set(OFFLOADS)
    assert decision.prediction.peak_allocated_bytes <= free
    assert "host" in decision.plan.reason
    # Not listed, not offered; on the CPU card never; nor to a runner that builds its own loop.
    unlisted = MemoryPolicy(resizes=["checkpointing"], margin=0.0)
    assert isinstance(choose_plan(runner, config, unlisted, CUDA_CARD, free), HandBack)
    cpu_free = peak_of(predict(CharTransformerTask(), config, Plan(checkpointing=True))) - 1
    assert isinstance(choose_plan(runner, config, policy, CPU_CARD, cpu_free), HandBack)
    own_loop = TorchTaskRunner(CharTransformerTask())
    own_loop.can_offload = False  # as the Trainer's and Lightning's runners say (by absence)
    assert isinstance(choose_plan(own_loop, config, policy, CUDA_CARD, free), HandBack)


def test_offloading_is_slower_than_checkpointing_and_keeps_the_numerics_tier() -> None:
    fit = default_step_time_fit()
    slowdown = {
        name: step_time_slowdown(fit, step_features(plan, 8))
        for name, plan in {
            "checkpointing": Plan(checkpointing=True),
            "activations": ACTIVATIONS,
            "optimizer": OPTIMIZER,
            "both": BOTH,
        }.items()
    }
    assert 1 < slowdown["checkpointing"] < slowdown["optimizer"] < slowdown["activations"]
    assert slowdown["both"] == pytest.approx(slowdown["activations"] * slowdown["optimizer"])


def test_the_plan_record_keys_and_words_of_the_offload_rungs() -> None:
    assert plan_key(ACTIVATIONS) != plan_key(OPTIMIZER) != plan_key(Plan())
    assert plan_column(Plan(micro_batch=2, accumulation=2, activation_offload=True)) == (
        "2x2:ckpt=0:bf16=0:aoff"
    )
    assert plan_column(BOTH) == "allx1:ckpt=0:bf16=0:aoff:ooff"
    for model in (Plan(), PlanOut()):  # a plan without offload reads (and keys) as before
        assert "activation_offload" not in model.model_dump(mode="json")
        assert "optimizer_offload" not in model.model_dump(mode="json")
    stored = Plan(micro_batch=2, accumulation=4, optimizer_offload=True).model_dump(mode="json")
    shown = stored_plan(stored)
    assert plan_key(PlanOut.model_validate(stored)) == plan_key(shown)
    assert rungs_of(shown) == ["micro_batch", "optimizer_offload"]
    assert plan_in_words(shown) == "micro-batch 2 × 4, optimizer offloaded to host memory"
    assert plan_in_words(BOTH) == (
        "activations offloaded to host memory, optimizer offloaded to host memory"
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("plan", [ACTIVATIONS, OPTIMIZER], ids=["activations", "optimizer"])
def test_on_a_real_card_offloading_lowers_the_peak_the_trace_predicts(plan: Plan) -> None:
    from task_contract import RecordingReporter

    from vramtune.service.wire import TrainBudget

    total = torch.cuda.get_device_properties(0).total_memory
    info = CardInfo(model=torch.cuda.get_device_name(0), total_bytes=total, free_bytes=total)
    card = CardSpec(info=info, device="cuda:0")
    task, config = CharTransformerTask(), {**CONFIG, "d_model": 256, "seq_len": 256}
    runner, budget = TorchTaskRunner(task), TrainBudget(max_steps=3, eval_every=3)
    peaks = {}
    for ran in (Plan(), plan):
        predicted = predict(task, config, ran, card).peak_allocated_bytes
        measured = runner.run(config, ran, budget, card, RecordingReporter()).measured
        assert abs(predicted - measured.peak_allocated_bytes) <= 0.1 * measured.peak_allocated_bytes
        peaks[plan_key(ran)] = measured.peak_allocated_bytes
    assert peaks[plan_key(plan)] < peaks[plan_key(Plan())]
