"""The predictor: fake == real on the CPU card, the affine fit, lowering plans, the probe."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from vramtune.service.wire import Calibration, CardConstants, CardInfo, MemoryPolicy, Plan
from vramtune.worker.device.memory import MemoryTracker
from vramtune.worker.plan.policy import HandBack, choose_plan
from vramtune.worker.predictor import (
    CPU_TARGET,
    EMULATED_CUDA_TARGET,
    CannotTrace,
    clear_cache,
    core as predict_module,
    footprint,
    largest_micro_batch,
    measure_card_constants,
    predict,
    target_for,
    trace_training,
)
from vramtune.worker.run.training import TorchTaskRunner
from vramtune.worker.trial.runner import CardSpec, plan_for_micro_batch
from vramtune.worker.trial.steps import (
    batch_feeder,
    build_for_plan,
    build_optimizer_for_plan,
    train_step,
)
from vramtune.worker.trial.task import Batch, Config, Metric, Task

MiB = 2**20


class _SmallTask:
    """What the test tasks share: random data from factories only, AdamW, cross-entropy."""

    name = "small"
    batch_size_param = "batch_size"
    shape_params: frozenset[str] = frozenset({"width"})
    metric = Metric("loss", "minimize")

    def build_model(self, config: Config) -> nn.Module:
        raise NotImplementedError

    def build_optimizer(self, model: nn.Module, config: Config) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=float(config.get("lr", 1e-3)))

    def example_batch(self, config: Config, micro_batch: int, device: torch.device) -> Batch:
        raise NotImplementedError

    def batches(
        self, config: Config, micro_batch: int, device: torch.device, seed: int
    ) -> Iterator[Batch]:
        torch.manual_seed(seed)
        while True:
            yield self.example_batch(config, micro_batch, device)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        inputs, targets = batch
        logits = model(inputs)
        loss: torch.Tensor = F.cross_entropy(logits.flatten(0, -2), targets.flatten())
        return loss

    def evaluate(self, model: nn.Module, config: Config, device: torch.device) -> float:
        return 0.0

    def checkpoint_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        return [m for m in model.modules() if isinstance(m, _Block)]


class MLPTask(_SmallTask):
    """Linear layers with dropout."""

    name = "test-mlp"

    def build_model(self, config: Config) -> nn.Module:
        width = int(config["width"])
        return nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Dropout(0.1), nn.Linear(width, 10))

    def example_batch(self, config: Config, micro_batch: int, device: torch.device) -> Batch:
        return (
            torch.randn(micro_batch, 32, device=device),
            torch.randint(0, 10, (micro_batch,), device=device),
        )


class CNNTask(_SmallTask):
    """Convolutions with batch norm."""

    name = "test-cnn"

    def build_model(self, config: Config) -> nn.Module:
        width = int(config["width"])
        return nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1, stride=2),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(width, 10),
        )

    def example_batch(self, config: Config, micro_batch: int, device: torch.device) -> Batch:
        return (
            torch.randn(micro_batch, 3, 16, 16, device=device),
            torch.randint(0, 10, (micro_batch,), device=device),
        )


class _Block(nn.Module):
    """A pre-norm transformer block with SDPA and dropout."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(0.1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, time, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, time, width))
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class _GPT(nn.Module):
    """Token and position embeddings, blocks, a head tied to the token embedding."""

    def __init__(self, vocab: int, width: int, depth: int, time: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(time, width)
        self.blocks = nn.Sequential(*(_Block(width, 4) for _ in range(depth)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tokens(idx) + self.positions(positions)
        logits: torch.Tensor = self.head(self.norm(self.blocks(x)))
        return logits


class GPTTask(_SmallTask):
    """A small GPT: the model the CUDA emulation matters most for."""

    name = "test-gpt"
    shape_params = frozenset({"width", "depth"})

    def build_model(self, config: Config) -> nn.Module:
        return _GPT(64, int(config["width"]), int(config.get("depth", 2)), 32)

    def example_batch(self, config: Config, micro_batch: int, device: torch.device) -> Batch:
        idx = torch.randint(0, 64, (micro_batch, 32), device=device)
        return idx, torch.randint(0, 64, (micro_batch, 32), device=device)


class EncoderTask(_SmallTask):
    """torch's TransformerEncoder, which deep-copies its layer (fake tensors must follow)."""

    name = "test-encoder"

    def build_model(self, config: Config) -> nn.Module:
        width = int(config["width"])
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, batch_first=True)
        return nn.Sequential(
            nn.Embedding(64, width), nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        )

    def example_batch(self, config: Config, micro_batch: int, device: torch.device) -> Batch:
        idx = torch.randint(0, 64, (micro_batch, 16), device=device)
        return idx, torch.randint(0, int(config["width"]), (micro_batch, 16), device=device)


class LSTMTask(_SmallTask):
    """An LSTM, whose CPU kernel (oneDNN) sizes a workspace the fake kernel does not."""

    name = "test-lstm"

    def build_model(self, config: Config) -> nn.Module:
        return _LSTM(int(config["width"]))

    def example_batch(self, config: Config, micro_batch: int, device: torch.device) -> Batch:
        x = torch.randn(micro_batch, 12, 16, device=device)
        return x, torch.randint(0, int(config["width"]), (micro_batch, 12), device=device)


class _LSTM(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.rnn = nn.LSTM(16, width, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.rnn(x)[0]
        return out


class DataDependentTask(MLPTask):
    """Reads a loss value in Python: fake tensors cannot trace it."""

    name = "test-data-dependent"

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        loss = super().loss(model, batch)
        if loss.item() > 1e6:
            raise ValueError("diverged")
        return loss


def measured_cpu_peak(task: Task, config: Config, plan: Plan, steps: int = 2) -> int:
    """The real CPU run's tracked peak: the trainer's own build and step, real batches."""
    device = torch.device("cpu")
    batch_size = int(config[task.batch_size_param])
    micro = plan.micro_batch or batch_size
    tracker = MemoryTracker(device_type="cpu")
    with tracker:
        model = build_for_plan(task, config, plan, device)
        optimizer = build_optimizer_for_plan(task, model, config, plan)
        next_batch = batch_feeder(task.batches(config, micro, device, seed=0))
        loss = None
        for _ in range(steps):
            loss = train_step(task, model, optimizer, next_batch, batch_size, plan, device)
        del loss
    return tracker.peak_bytes


PLANS = {
    "as asked": Plan(),
    "micro-batches": Plan(micro_batch=3, accumulation=3),
    "checkpointing": Plan(checkpointing=True),
    "bf16": Plan(bf16=True),
}


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    clear_cache()
    yield
    clear_cache()


def test_test_tasks_satisfy_the_task_protocol() -> None:
    for task in (MLPTask(), CNNTask(), GPTTask(), EncoderTask(), LSTMTask(), DataDependentTask()):
        assert isinstance(task, Task)


@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("task", [MLPTask(), CNNTask(), GPTTask()], ids=lambda t: t.name)
def test_fake_cpu_prediction_equals_the_real_cpu_peak_to_the_byte(
    task: _SmallTask, plan_name: str
) -> None:
    plan = PLANS[plan_name]
    if plan.checkpointing and not task.checkpoint_modules(task.build_model({"width": 8})):
        pytest.skip("the task has nothing to checkpoint")
    config = {"width": 48, "batch_size": 8}
    prediction = predict(task, config, plan)
    assert prediction.method == "trace"
    assert prediction.peak_allocated_bytes == measured_cpu_peak(task, config, plan)
    assert prediction.peak_reserved_bytes == prediction.peak_allocated_bytes
    assert sum(prediction.breakdown.values()) == prediction.peak_allocated_bytes


class RegressionTask(_SmallTask):
    """An MLP regressing 10 targets with a given loss: CPU kernels of some losses return a 0-d
    view of their whole elementwise buffer, kept alive while the loop keeps the loss."""

    def __init__(self, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.name, self.loss_fn = f"test-{loss.__name__}", loss

    def build_model(self, config: Config) -> nn.Module:
        width = int(config["width"])
        return nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, 10), nn.Sigmoid())

    def example_batch(self, config: Config, micro_batch: int, device: torch.device) -> Batch:
        return torch.randn(micro_batch, 32, device=device), torch.rand(
            micro_batch, 10, device=device
        )

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        # Kept for logging, as users' loops do: its storage stays alive through the backward.
        self.logged = self.loss_fn(model(batch[0]), batch[1])
        return self.logged


@pytest.mark.parametrize(
    "loss",
    [F.mse_loss, F.smooth_l1_loss, F.soft_margin_loss, F.binary_cross_entropy, F.l1_loss],
    ids=lambda f: f.__name__,
)
def test_a_loss_that_keeps_its_elementwise_buffer_is_counted_as_the_real_run_does(
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> None:
    task, config = RegressionTask(loss), {"width": 16, "batch_size": 4096}
    prediction = predict(task, config, Plan())
    assert prediction.method == "trace"
    assert prediction.peak_allocated_bytes == measured_cpu_peak(task, config, Plan())


class BatchNormTask(_SmallTask):
    """BatchNorm over features: training refuses a batch of one example."""

    name = "test-batchnorm"

    def build_model(self, config: Config) -> nn.Module:
        return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.Linear(64, 10))

    def example_batch(self, config: Config, micro_batch: int, device: torch.device) -> Batch:
        return (
            torch.randn(micro_batch, 32, device=device),
            torch.randint(0, 10, (micro_batch,), device=device),
        )


def test_a_micro_batch_that_cannot_run_is_never_planned_and_the_hand_back_says_why() -> None:
    runner, config = TorchTaskRunner(BatchNormTask()), {"width": 64, "batch_size": 2}
    card = CardSpec(info=CardInfo(model="simulated", total_bytes=2**30, free_bytes=2**30))
    whole = runner.predict(config, Plan(), card)
    assert whole.method == "trace"
    budget = whole.peak_allocated_bytes - 1
    assert runner.largest_micro_batch(config, Plan(), budget, card) is None
    micro_batches_only = MemoryPolicy(margin=0.0, resizes=["micro_batch"])
    decision = choose_plan(runner, config, micro_batches_only, card, budget, [])
    assert isinstance(decision, HandBack)  # was: micro-batches of 1, "predicted" at 0 bytes
    assert decision.min_footprint_bytes == whole.peak_allocated_bytes
    assert "smaller micro-batches cannot run" in decision.reason
    assert "Expected more than 1 value per channel" in decision.reason


@pytest.mark.parametrize("task", [EncoderTask(), LSTMTask()], ids=lambda t: t.name)
def test_deep_copied_layers_and_onednn_workspaces_are_counted_as_the_real_run_does(
    task: _SmallTask,
) -> None:
    config = {"width": 32, "batch_size": 4}
    prediction = predict(task, config, Plan())
    assert prediction.method == "trace", prediction.reason
    assert prediction.peak_allocated_bytes == measured_cpu_peak(task, config, Plan())


def test_the_simulated_cpu_card_uses_the_plain_fake_cpu_trace() -> None:
    info = CardInfo(model="cpu", total_bytes=2**30, free_bytes=2**30, simulated=True)
    card = CardSpec(info=info)
    assert target_for(card) == CPU_TARGET
    assert target_for(None) == CPU_TARGET
    config = {"width": 32, "batch_size": 4}
    on_card, bare = predict(MLPTask(), config, Plan(), card), predict(MLPTask(), config, Plan())
    assert on_card.peak_allocated_bytes == bare.peak_allocated_bytes
    assert on_card.constants == {}


def test_the_peak_is_affine_in_the_micro_batch() -> None:
    task, config = CNNTask(), {"width": 16, "batch_size": 12}
    peaks = [footprint(predict(task, config, plan_for_micro_batch(12, m))) for m in (2, 3, 4, 5)]
    steps = [b - a for a, b in itertools.pairwise(peaks)]
    assert steps[0] > 0
    # Rounding small per-row tensors (norm statistics) to 512 bytes is the only non-linearity.
    assert max(steps) - min(steps) <= 16 * 512


def test_largest_micro_batch_solves_the_budget_and_confirms_it() -> None:
    task, config = CNNTask(), {"width": 16, "batch_size": 16}
    peaks = {m: footprint(predict(task, config, plan_for_micro_batch(16, m))) for m in (6, 7)}
    budget = (peaks[6] + peaks[7]) // 2
    solved = largest_micro_batch(task, config, Plan(), budget)
    assert solved is not None
    micro, prediction = solved
    assert micro == 6
    assert footprint(prediction) == peaks[6] <= budget


def test_largest_micro_batch_compares_calibrated_predictions() -> None:
    task, config = CNNTask(), {"width": 16, "batch_size": 16}
    budget = footprint(predict(task, config, plan_for_micro_batch(16, 8)))
    doubled = Calibration(card_model="cpu", torch_version="2.13.0", task=task.name, scale=2.0)
    doubled = doubled.model_copy(update={"margin_fraction": 0.0})
    solved = largest_micro_batch(task, config, Plan(), budget, calibration=doubled)
    assert solved is not None
    assert solved[0] < 8 and footprint(solved[1]) <= budget
    assert solved[1].constants["uncalibrated_reserved_bytes"] * 2 == footprint(solved[1])


def test_largest_micro_batch_takes_the_whole_batch_or_nothing() -> None:
    task, config = CNNTask(), {"width": 16, "batch_size": 8}
    whole = footprint(predict(task, config, Plan()))
    solved = largest_micro_batch(task, config, Plan(), whole)
    assert solved is not None and solved[0] == 8 and footprint(solved[1]) == whole
    one = footprint(predict(task, config, plan_for_micro_batch(8, 1)))
    assert largest_micro_batch(task, config, Plan(), one - 1) is None


def test_largest_micro_batch_keeps_the_plan_flags() -> None:
    task, config = GPTTask(), {"width": 64, "depth": 2, "batch_size": 8}
    plain = footprint(predict(task, config, plan_for_micro_batch(8, 2)))
    solved = largest_micro_batch(task, config, Plan(checkpointing=True), plain)
    assert solved is not None and solved[0] > 2  # checkpointing makes room for more
    assert solved[1].peak_allocated_bytes <= plain


@pytest.mark.parametrize("target", [CPU_TARGET, EMULATED_CUDA_TARGET], ids=lambda t: t.name)
def test_checkpointing_and_bf16_lower_the_prediction(target: object) -> None:
    task, config = GPTTask(), {"width": 64, "depth": 2, "batch_size": 8}
    card = _cuda_card() if target is EMULATED_CUDA_TARGET else None
    plain = predict(task, config, Plan(), card, target=target)  # type: ignore[arg-type]
    for plan in (Plan(checkpointing=True), Plan(bf16=True)):
        lowered = predict(task, config, plan, card, target=target)  # type: ignore[arg-type]
        assert lowered.peak_allocated_bytes < plain.peak_allocated_bytes, plan
        assert lowered.breakdown["activations"] < plain.breakdown["activations"], plan


def test_a_cuda_card_adds_its_constants_and_the_allocator_reserve() -> None:
    task, config = GPTTask(), {"width": 64, "batch_size": 8}
    card = _cuda_card()
    cuda = predict(task, config, Plan(), card, target=EMULATED_CUDA_TARGET)
    traced = trace_training(task, config, Plan(), EMULATED_CUDA_TARGET)
    workspace = CardConstants.model_validate(card.constants).cublas_workspace_bytes
    assert cuda.constants["cublas_workspace_bytes"] == workspace
    assert cuda.constants["cuda_context_bytes"] == 500 * MiB
    assert cuda.peak_allocated_bytes >= traced.peak_bytes + workspace
    assert cuda.peak_reserved_bytes >= cuda.peak_allocated_bytes
    assert cuda.peak_reserved_bytes % (2 * MiB) == 0  # whole segments


def test_predictions_are_cached_by_shape_params_not_by_learning_rate() -> None:
    task = MLPTask()
    first = predict(task, {"width": 32, "batch_size": 4, "lr": 1e-3}, Plan())
    entries = len(predict_module._PREDICTIONS)
    again = predict(task, {"width": 32, "batch_size": 4, "lr": 0.5}, Plan())
    assert len(predict_module._PREDICTIONS) == entries
    assert again.peak_allocated_bytes == first.peak_allocated_bytes
    wider = predict(task, {"width": 64, "batch_size": 4, "lr": 1e-3}, Plan())
    assert len(predict_module._PREDICTIONS) == entries + 1
    assert wider.peak_allocated_bytes > first.peak_allocated_bytes


def test_an_untraceable_model_says_why_and_falls_back_to_a_measured_probe() -> None:
    task, config = DataDependentTask(), {"width": 512, "batch_size": 4}
    with pytest.raises(CannotTrace, match="data-dependent"):
        trace_training(task, config, Plan(), CPU_TARGET)
    probe = predict(task, config, plan_for_micro_batch(4, 2))
    assert probe.method == "probe"
    assert "data-dependent" in probe.reason and "measured" in probe.reason
    # The probe at micro-batch 2 ran exactly this plan: two micro-batches of 2.
    assert probe.peak_allocated_bytes == measured_cpu_peak(task, config, plan_for_micro_batch(4, 2))
    # Elsewhere it extrapolates its lines: close to what a real run measures.
    big = {**config, "batch_size": 256}
    extrapolated = predict(task, big, plan_for_micro_batch(256, 128))
    measured = measured_cpu_peak(task, big, plan_for_micro_batch(256, 128))
    assert extrapolated.method == "probe"
    assert extrapolated.peak_allocated_bytes > probe.peak_allocated_bytes
    assert abs(extrapolated.peak_allocated_bytes - measured) <= 0.05 * measured


def test_a_probed_plan_says_why_in_its_reason() -> None:
    from vramtune.service.wire import MemoryPolicy
    from vramtune.worker.plan.policy import RunAsPlanned, choose_plan
    from vramtune.worker.run.training import TorchTaskRunner

    card = CardSpec(
        info=CardInfo(model="cpu", total_bytes=2**30, free_bytes=2**30), constants={}, device="cpu"
    )
    runner = TorchTaskRunner(DataDependentTask())
    decision = choose_plan(runner, {"width": 64, "batch_size": 4}, MemoryPolicy(), card, 2**30)
    assert isinstance(decision, RunAsPlanned)
    assert decision.prediction.method == "probe"
    # The plan's reason is what the trial record and the dashboard's plan column show.
    assert "[probed: cannot trace (data-dependent operation" in (decision.plan.reason or "")
    # A probe runs training steps only: the reason says how the evaluation is bounded.
    assert "evaluation not traced (the training step was probed)" in decision.plan.reason


@torch.library.custom_op("vramtune_test::scaled", mutates_args=())
def _scaled(x: torch.Tensor) -> torch.Tensor:
    """A custom kernel with no fake implementation, as a compiled extension may be."""
    return x * 2


_scaled.register_autograd(lambda ctx, grad: grad * 2)


class CustomKernelTask(MLPTask):
    """Runs its activations through a custom op that fake tensors know nothing about."""

    name = "test-custom-kernel"

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        inputs, targets = batch
        return F.cross_entropy(_scaled(model(inputs)), targets)


def test_a_custom_kernel_without_a_fake_implementation_is_probed_with_the_reason() -> None:
    task, config = CustomKernelTask(), {"width": 64, "batch_size": 4}
    with pytest.raises(CannotTrace, match="vramtune_test"):
        trace_training(task, config, Plan(), CPU_TARGET)
    probe = predict(task, config, plan_for_micro_batch(4, 2))
    assert probe.method == "probe"
    assert "vramtune_test" in probe.reason and "measured" in probe.reason


def test_a_compiled_model_cannot_be_traced() -> None:
    class Compiled(MLPTask):
        def build_model(self, config: Config) -> nn.Module:
            model = super().build_model(config)
            model.compile()
            return model

    with pytest.raises(CannotTrace, match=r"torch\.compile"):
        trace_training(Compiled(), {"width": 8, "batch_size": 2}, Plan(), CPU_TARGET)


def test_card_constants_are_zero_on_the_cpu() -> None:
    assert measure_card_constants("cpu") == CardConstants()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fake_cuda_prediction_is_close_to_the_measured_cuda_peak() -> None:
    device = torch.device("cuda:0")
    constants = measure_card_constants(device)
    card = CardSpec(
        info=CardInfo(model=torch.cuda.get_device_name(0), total_bytes=1, free_bytes=1),
        constants=constants.model_dump(),
        device="cuda:0",
    )
    task, config = GPTTask(), {"width": 256, "depth": 4, "batch_size": 16}
    prediction = predict(task, config, Plan(), card)
    torch.cuda.reset_peak_memory_stats(device)
    model = build_for_plan(task, config, Plan(), device)
    optimizer = task.build_optimizer(model, config)
    next_batch = batch_feeder(task.batches(config, 16, device, seed=0))
    for _ in range(2):
        train_step(task, model, optimizer, next_batch, 16, Plan(), device)
    measured = torch.cuda.max_memory_allocated(device)
    assert abs(prediction.peak_allocated_bytes - measured) <= 0.05 * measured


def _cuda_card() -> CardSpec:
    constants = CardConstants(cuda_context_bytes=500 * MiB, cublas_workspace_bytes=64 * MiB)
    return CardSpec(
        info=CardInfo(model="NVIDIA H200", total_bytes=141 * 2**30, free_bytes=140 * 2**30),
        constants=constants.model_dump(),
        device="cuda:0",
    )
