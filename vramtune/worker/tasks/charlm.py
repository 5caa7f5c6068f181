"""A character-level GPT trained on the Python standard library's own source files.

Every machine with Python has its stdlib's ``.py`` files (``sysconfig.get_paths()["stdlib"]``);
the task reads them in sorted order up to ``corpus_chars`` characters, maps each character to
its ASCII code (others to ``?``) and holds out the last tenth for evaluation. The metric is the
validation loss in nats per character (chance: ln 128 = 4.85). Memory is attention- and
batch-bound: it grows with layers, width, sequence length and batch.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn
from torch.nn import functional as F

from vramtune.worker.tasks.common import parse_config
from vramtune.worker.trial.data import seeded_batches
from vramtune.worker.trial.task import Batch, Config, Metric, TaskConfigError

VOCAB = 128
HELD_OUT_FRACTION = 0.1
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


class CharLMConfig(BaseModel):
    """The tunable and fixed settings of the character language model."""

    # Unknown keys are an error: a misspelt parameter must not be silently ignored.
    model_config = ConfigDict(extra="forbid")

    n_layers: int = Field(2, ge=1, le=256)
    d_model: int = Field(64, ge=1, le=65536)
    n_heads: int = Field(4, ge=1, le=1024)
    seq_len: int = Field(64, ge=2, le=65536)
    batch_size: int = Field(32, ge=1, le=10**7)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    lr: float = Field(1e-3, gt=0, le=10)
    weight_decay: float = Field(0.01, ge=0, le=10)
    corpus_chars: int = Field(1_000_000, ge=10_000, le=100_000_000, description="Text read.")
    eval_windows: int = Field(64, ge=1, le=100_000, description="Held-out windows evaluated.")
    seed: int = Field(0, description="Seeds the weights, dropout and the order of windows.")

    @model_validator(mode="after")
    def _heads_divide_width(self) -> CharLMConfig:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        return self


def _stdlib_sources(root: Path) -> Iterator[Path]:
    """The stdlib's .py files in a deterministic (sorted, top-down) order."""
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_DIRS)
        for name in sorted(files):
            if name.endswith(".py"):
                yield Path(directory, name)


@functools.cache
def corpus(n_chars: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and held-out character codes (uint8), read once per size."""
    parts: list[str] = []
    remaining = n_chars
    for path in _stdlib_sources(Path(sysconfig.get_paths()["stdlib"])):
        text = path.read_text(encoding="utf-8", errors="replace")[:remaining]
        parts.append(text)
        remaining -= len(text)
        if remaining <= 0:
            break
    codes = "".join(parts).encode("ascii", errors="replace")
    data = torch.frombuffer(bytearray(codes), dtype=torch.uint8)
    split = int(len(data) * (1 - HELD_OUT_FRACTION))
    return data[:split], data[split:]


def windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int) -> Batch:
    """Inputs and next-character targets of the windows beginning at `starts`."""
    index = starts[:, None] + torch.arange(seq_len)
    return data[index].long(), data[index + 1].long()


def on_device(device: torch.device, batch: Batch) -> Batch:
    """The batch moved to `device`."""
    return tuple(t.to(device) for t in batch)


def n_windows(data: torch.Tensor, seq_len: int, task: str = "char-transformer") -> int:
    """How many non-overlapping windows (with their targets) `data` holds."""
    count = (len(data) - 1) // seq_len
    if count < 1:
        raise TaskConfigError(f"{task}: seq_len {seq_len} exceeds the corpus")
    return count


def training_windows(
    task: str, corpus_chars: int, seq_len: int, micro_batch: int, device: torch.device, seed: int
) -> Iterator[Batch]:
    """Endless (codes, next codes) batches of non-overlapping training windows, seeded epochs."""
    train, _ = corpus(corpus_chars)  # read now, before the worker starts measuring
    return seeded_batches(
        n_windows(train, seq_len, task),
        micro_batch,
        seed,
        lambda index: on_device(device, windows(train, index * seq_len, seq_len)),
    )


def held_out_loss(
    task: str,
    loss: Callable[[Batch], torch.Tensor],
    corpus_chars: int,
    seq_len: int,
    eval_windows: int,
    batch_size: int,
    device: torch.device,
) -> float:
    """Mean `loss` over the first `eval_windows` held-out windows, in `batch_size` chunks."""
    _, held_out = corpus(corpus_chars)
    count = min(eval_windows, n_windows(held_out, seq_len, task))
    starts = torch.arange(count) * seq_len
    total = 0.0
    for chunk in torch.split(starts, batch_size):
        batch = on_device(device, windows(held_out, chunk, seq_len))
        total += float(loss(batch)) * len(chunk)
    return total / count


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through scaled_dot_product_attention."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over earlier positions only."""
        batch, length, width = x.shape
        heads = self.qkv(x).view(batch, length, 3, self.n_heads, width // self.n_heads)
        q, k, v = heads.permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(batch, length, width))
        return out


class Block(nn.Module):
    """A pre-norm Transformer block: attention then a 4x MLP, each with a residual."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x + attention, then + MLP."""
        x = x + self.drop(self.attn(self.ln1(x)))
        out: torch.Tensor = x + self.drop(self.mlp(self.ln2(x)))
        return out


class CharGPT(nn.Module):
    """Token and position embeddings, `n_layers` blocks, a final norm and a linear head."""

    def __init__(self, settings: CharLMConfig) -> None:
        super().__init__()
        width = settings.d_model
        self.tokens = nn.Embedding(VOCAB, width)
        self.positions = nn.Embedding(settings.seq_len, width)
        self.drop = nn.Dropout(settings.dropout)
        self.blocks = nn.ModuleList(
            Block(width, settings.n_heads, settings.dropout) for _ in range(settings.n_layers)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.apply(_gpt2_init)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """Next-character logits (batch, length, VOCAB)."""
        positions = torch.arange(codes.shape[1], device=codes.device)
        x = self.drop(self.tokens(codes) + self.positions(positions))
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


def _gpt2_init(module: nn.Module) -> None:
    """GPT-2's initialisation (N(0, 0.02), zero biases): it trains faster than the defaults."""
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class CharTransformerTask:
    """A GPT-style character language model on the stdlib's source."""

    name = "char-transformer"
    batch_size_param = "batch_size"
    # dropout counts: p = 0 saves no masks and lets SDPA pick a kernel without dropout.
    shape_params = frozenset({"n_layers", "d_model", "n_heads", "seq_len", "dropout"})
    metric = Metric("val_loss", "minimize")

    def settings(self, config: Config) -> CharLMConfig:
        """The validated configuration."""
        return parse_config(self.name, CharLMConfig, config)

    def build_model(self, config: Config) -> nn.Module:
        """A fresh CharGPT with the configuration's shapes."""
        return CharGPT(self.settings(config))

    def build_optimizer(self, model: nn.Module, config: Config) -> torch.optim.Optimizer:
        """AdamW; foreach spelled out so CPU runs allocate what CUDA runs (and the trace) do."""
        settings = self.settings(config)
        return torch.optim.AdamW(
            model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay, foreach=True
        )

    def example_batch(self, config: Config, micro_batch: int, device: torch.device) -> Batch:
        """Random codes of the real batches' shapes."""
        shape = (micro_batch, self.settings(config).seq_len)
        return (
            torch.randint(0, VOCAB, shape, device=device),
            torch.randint(0, VOCAB, shape, device=device),
        )

    def batches(
        self, config: Config, micro_batch: int, device: torch.device, seed: int
    ) -> Iterator[Batch]:
        """Non-overlapping training windows in seeded epochs."""
        settings = self.settings(config)
        return training_windows(
            self.name, settings.corpus_chars, settings.seq_len, micro_batch, device, seed
        )

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Mean cross-entropy per character."""
        codes, targets = batch
        logits = model(codes)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    def evaluate(self, model: nn.Module, config: Config, device: torch.device) -> float:
        """Mean held-out loss over the first `eval_windows` windows, in batch-size chunks."""
        settings = self.settings(config)
        return held_out_loss(
            self.name,
            lambda batch: self.loss(model, batch),
            settings.corpus_chars,
            settings.seq_len,
            settings.eval_windows,
            settings.batch_size,
            device,
        )

    def checkpoint_block_count(self, config: Config) -> int:
        """The Transformer blocks, the ones selective checkpointing chooses among."""
        return self.settings(config).n_layers

    def checkpoint_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        """The Transformer blocks."""
        blocks = model.get_submodule("blocks")
        assert isinstance(blocks, nn.ModuleList)
        return list(blocks)
