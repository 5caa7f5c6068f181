"""A small GPT-2 trained with the Hugging Face Trainer, as its user writes it: no vramtune here.

The model is built from a config (nothing downloads); the data is the Python standard library's
own source as ASCII codes, in fixed windows of `SEQ_LEN` characters. Run it alone with
``python examples/hf_trainer/stdlib_gpt2.py``; `tasks.py` hands the same pieces to vramtune.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

SEQ_LEN = 32
VOCAB = 128  # ASCII


def windows(text: str, count: int, offset: int = 0) -> list[dict[str, list[int]]]:
    """`count` windows of SEQ_LEN character codes; the model shifts the labels itself."""
    codes = [min(ord(c), VOCAB - 1) for c in text]
    starts = range(offset, offset + count * SEQ_LEN, SEQ_LEN)
    return [{"input_ids": codes[s : s + SEQ_LEN], "labels": codes[s : s + SEQ_LEN]} for s in starts]


CORPUS = inspect.getsource(inspect) + inspect.getsource(json)
train_dataset = windows(CORPUS, 512)
eval_dataset = windows(CORPUS, 32, offset=600 * SEQ_LEN)


def model_init(trial: dict[str, Any] | None = None) -> GPT2LMHeadModel:
    """A fresh GPT-2 per trial; its depth and width may be hyperparameters."""
    params = trial or {}
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ_LEN,
        n_layer=int(params.get("n_layer", 2)),
        n_embd=int(params.get("n_embd", 64)),
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


args = TrainingArguments(
    output_dir="gpt2-stdlib",
    per_device_train_batch_size=16,
    learning_rate=1e-3,
    weight_decay=0.01,
    max_steps=60,
    eval_strategy="steps",
    eval_steps=20,
    logging_steps=20,
    report_to=[],
    use_cpu=True,
)

if __name__ == "__main__":
    trainer = Trainer(
        model_init=model_init,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=default_data_collator,
    )
    trainer.train()
    print(trainer.evaluate())
