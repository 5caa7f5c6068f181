"""The model zoo's architectures: small enough to read, shaped like the ones people train."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class MLPBlock(nn.Module):
    """Linear, GELU, dropout."""

    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.dropout(F.gelu(self.linear(x)))
        return out


class MLP(nn.Module):
    """An input projection, `depth` blocks, a classifier."""

    def __init__(self, inputs: int, width: int, depth: int, classes: int, dropout: float) -> None:
        super().__init__()
        self.stem = nn.Linear(inputs, width)
        self.blocks = nn.Sequential(*(MLPBlock(width, dropout) for _ in range(depth)))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.blocks(F.gelu(self.stem(x))))
        return out


def conv_bn(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    """3x3 convolution, batch norm, ReLU."""
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class ConvNet(nn.Module):
    """Conv-BN-ReLU stages halving the resolution and doubling the channels."""

    def __init__(self, width: int, depth: int, classes: int) -> None:
        super().__init__()
        channels = [3] + [width * 2**i for i in range(depth)]
        self.stages = nn.Sequential(
            *(
                nn.Sequential(
                    conv_bn(channels[i], channels[i + 1]),
                    conv_bn(channels[i + 1], channels[i + 1], 2),
                )
                for i in range(depth)
            )
        )
        self.head = nn.Linear(channels[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.stages(x).mean(dim=(2, 3)))
        return out


class BasicBlock(nn.Module):
    """ResNet's two-convolution residual block."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        out: torch.Tensor = F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))
        return out


class ResNet18(nn.Module):
    """ResNet-18: a 7x7 stem, max-pool, four stages of two basic blocks."""

    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 7, 2, 3, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        )
        widths = [width, 2 * width, 4 * width, 8 * width]
        blocks: list[nn.Module] = []
        cin = width
        for i, cout in enumerate(widths):
            blocks += [BasicBlock(cin, cout, 1 if i == 0 else 2), BasicBlock(cout, cout, 1)]
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))
        return out


class UNet(nn.Module):
    """An encoder-decoder with skip connections, per-pixel classes."""

    def __init__(self, width: int, depth: int, classes: int) -> None:
        super().__init__()
        widths = [width * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList(
            nn.Sequential(
                conv_bn(3 if i == 0 else widths[i - 1], widths[i]), conv_bn(widths[i], widths[i])
            )
            for i in range(depth)
        )
        self.bottom = nn.Sequential(
            conv_bn(widths[depth - 1], widths[depth]), conv_bn(widths[depth], widths[depth])
        )
        self.up = nn.ModuleList(
            nn.ConvTranspose2d(widths[i + 1], widths[i], 2, 2) for i in reversed(range(depth))
        )
        self.merge = nn.ModuleList(
            nn.Sequential(conv_bn(2 * widths[i], widths[i]), conv_bn(widths[i], widths[i]))
            for i in reversed(range(depth))
        )
        self.head = nn.Conv2d(width, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.bottom(x)
        for up, merge, skip in zip(self.up, self.merge, reversed(skips), strict=True):
            x = merge(torch.cat([up(x), skip], dim=1))
        out: torch.Tensor = self.head(x)
        return out


class RNNLM(nn.Module):
    """An LSTM or GRU language model."""

    def __init__(self, kind: str, vocab: int, width: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        rnn = nn.LSTM if kind == "lstm" else nn.GRU
        self.rnn = rnn(width, width, depth, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(idx))
        out: torch.Tensor = self.head(hidden)
        return out


class Encoder(nn.Module):
    """torch's TransformerEncoder (multi-head attention, pre-norm) over tokens, mean-pooled."""

    def __init__(self, vocab: int, width: int, heads: int, depth: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.1, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.encoder(self.embed(idx)).mean(dim=1))
        return out


class AttentionBlock(nn.Module):
    """A pre-norm transformer block with scaled_dot_product_attention."""

    def __init__(self, width: int, heads: int, dropout: float, causal: bool) -> None:
        super().__init__()
        self.heads, self.dropout, self.causal = heads, dropout, causal
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, time, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)
        y = self.proj(y.transpose(1, 2).reshape(batch, time, width))
        x = x + F.dropout(y, p, self.training)
        y = self.out(F.gelu(self.fc(self.norm2(x))))
        out: torch.Tensor = x + F.dropout(y, p, self.training)
        return out


class GPT(nn.Module):
    """A GPT-2-style decoder; the head shares the token embedding's weight."""

    def __init__(
        self, vocab: int, width: int, heads: int, depth: int, time: int, dropout: float
    ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(time, width)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.Sequential(
            *(AttentionBlock(width, heads, dropout, True) for _ in range(depth))
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.dropout(self.tokens(idx) + self.positions(positions))
        out: torch.Tensor = self.head(self.norm(self.blocks(x)))
        return out


class ViT(nn.Module):
    """A vision transformer: patch embedding, class token, attention blocks."""

    def __init__(
        self, resolution: int, patch: int, width: int, heads: int, depth: int, classes: int
    ) -> None:
        super().__init__()
        self.patchify = nn.Conv2d(3, width, patch, patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, width))
        self.positions = nn.Parameter(torch.zeros(1, (resolution // patch) ** 2 + 1, width))
        self.blocks = nn.Sequential(
            *(AttentionBlock(width, heads, 0.0, False) for _ in range(depth))
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patchify(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.positions
        out: torch.Tensor = self.head(self.norm(self.blocks(x))[:, 0])
        return out


class TiedAutoencoder(nn.Module):
    """An autoencoder whose decoder reuses the encoder's weights, transposed."""

    def __init__(self, inputs: int, width: int, depth: int) -> None:
        super().__init__()
        sizes = [inputs] + [width // 2**i for i in range(depth)]
        self.encoders = nn.ModuleList(nn.Linear(sizes[i], sizes[i + 1]) for i in range(depth))
        self.biases = nn.ParameterList(nn.Parameter(torch.zeros(sizes[i])) for i in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for encoder in self.encoders:
            x = F.relu(encoder(x))
        for encoder, bias in zip(reversed(self.encoders), reversed(self.biases), strict=True):
            weight: torch.Tensor = encoder.weight  # type: ignore[assignment]
            x = F.linear(x, weight.t(), bias)
        return x


class DropoutTransformer(nn.Module):
    """A transformer classifier with dropout after every layer, attention included."""

    def __init__(
        self, vocab: int, width: int, heads: int, depth: int, classes: int, dropout: float
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.Sequential(
            *(AttentionBlock(width, heads, dropout, False) for _ in range(depth))
        )
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(width, classes))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.blocks(self.dropout(self.embed(idx))).mean(dim=1))
        return out


class TwoInputs(nn.Module):
    """Two inputs of two kinds: an image through a convolution tower and a caption's tokens
    through an embedding, mean-pooled, concatenated, classified."""

    def __init__(self, vocab: int, width: int, classes: int) -> None:
        super().__init__()
        self.image = nn.Sequential(conv_bn(3, width), conv_bn(width, 2 * width, 2))
        self.tokens = nn.Embedding(vocab, 2 * width)
        self.text = AttentionBlock(2 * width, 2, 0.0, False)
        self.head = nn.Linear(4 * width, classes)

    def forward(self, images: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        seen = self.image(images).mean(dim=(2, 3))
        read = self.text(self.tokens(idx)).mean(dim=1)
        out: torch.Tensor = self.head(torch.cat([seen, read], dim=1))
        return out


def frozen_stages(model: ConvNet, trained: int) -> ConvNet:
    """`model` with every stage but the last `trained` frozen (their BatchNorms still update
    their running statistics: the module stays in training mode)."""
    for stage in list(model.stages)[: len(model.stages) - trained]:
        stage.requires_grad_(False)
    return model


def with_lora(model: nn.Module, rank: int, targets: list[str]) -> nn.Module:
    """`model` wrapped by peft's LoRA on the named linear layers (the base frozen)."""
    from peft import LoraConfig, get_peft_model  # the [peft] extra: only this model needs it

    wrapped: nn.Module = get_peft_model(model, LoraConfig(r=rank, target_modules=targets))  # type: ignore[arg-type]
    return wrapped
