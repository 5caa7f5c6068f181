"""The server's checks of built-in model-family studies (no torch, no model library)."""

from __future__ import annotations

from vramtune.common.task_rules import study_problem


def test_every_combination_of_choices_is_checked() -> None:
    problem = study_problem(
        "hf-causal-lm",
        {"model_type": "llama"},
        {"hidden_size": [64, 96], "num_attention_heads": [4, 8], "num_key_value_heads": [3]},
    )
    assert problem is not None
    field, message = problem
    assert field == "search_space.num_key_value_heads"
    assert "must be divisible by num_key_value_heads (3)" in message


def test_buildable_studies_and_other_tasks_pass() -> None:
    choices = {"hidden_size": [64, 128], "num_attention_heads": [2, 4], "model_type": ["gpt2"]}
    assert study_problem("hf-causal-lm", {"vocab_size": 50257}, choices) is None
    assert (
        study_problem("timm-image", {}, {"model_name": ["resnet50", "vit_small_patch16_224"]})
        is None
    )
    assert study_problem("char-transformer", {"d_model": 30, "n_heads": 4}, {}) is None


def test_a_model_name_that_is_no_name_is_refused() -> None:
    assert study_problem("torchvision-image", {"model_name": "../etc"}, {}) == (
        "task_config.model_name",
        "not a model name: '../etc'",
    )


def test_lora_settings_without_lora_or_another_method_are_refused() -> None:
    assert study_problem("hf-causal-lm", {}, {"lora_r": [8, 64]}) == (
        "search_space.lora_r",
        "needs finetune: {method: lora} in task_config",
    )
    problem = study_problem("hf-causal-lm", {"finetune": {"method": "qlora"}}, {})
    assert problem is not None and problem[0] == "task_config.finetune"
    lora = {"finetune": {"method": "lora", "r": 8}}
    assert study_problem("hf-causal-lm", lora, {"lora_r": [8, 64]}) is None
    assert study_problem("hf-causal-lm", {"finetune": "lora"}, {"lora_r": [8, 64]}) is None
    assert study_problem("hf-causal-lm", {"finetune": "dora"}, {}) == (
        "task_config.finetune",
        "unknown method 'dora': only lora (finetune: lora, or a mapping)",
    )


def test_a_quantized_base_is_one_of_the_known_kinds_and_needs_lora() -> None:
    lora = {"finetune": "lora"}
    assert study_problem("hf-causal-lm", lora, {"quantized_base": ["none", "int8", "nf4"]}) is None
    assert study_problem("hf-causal-lm", lora, {"quantized_base": ["int8", "int4"]}) == (
        "search_space.quantized_base",
        "unknown quantized base 'int4'; use one of ['none', 'int8', 'nf4']",
    )
    nested = {"finetune": {"method": "lora", "quantized_base": "fp4"}}
    problem = study_problem("hf-causal-lm", nested, {})
    assert problem is not None and problem[0] == "task_config.finetune" and "'fp4'" in problem[1]
    assert study_problem("hf-causal-lm", {"quantized_base": "int8"}, {}) == (
        "task_config.quantized_base",
        "needs finetune: {method: lora} in task_config",
    )
    assert study_problem("hf-causal-lm", {"quantized_base": "none"}, {}) is None


# 17 x 16 x 16 = 4,352 combinations of parameters no rule reads, sorted after the rules' own.
UNREAD = {"z1": list(range(17)), "z2": list(range(16)), "z3": list(range(16))}


def test_a_bad_choice_behind_4096_combinations_is_found() -> None:
    """Issue 47: only the first 4,096 combinations were checked; "bogus" came after them."""
    space = {"quantized_base": ["none", "bogus"], **UNREAD}
    assert study_problem("hf-causal-lm", {}, space) == (
        "search_space.quantized_base",
        "unknown quantized base 'bogus'; use one of ['none', 'int8', 'nf4']",
    )


def test_a_clash_of_two_later_choices_behind_4096_combinations_is_found() -> None:
    """Width 64 with 12 heads: neither is bad beside the other's first choice (96, 4); only
    their combination, past the first 4,096, is."""
    space = {"hidden_size": [96, 64], "num_attention_heads": [4, 12], **UNREAD}
    problem = study_problem("hf-causal-lm", {}, space)
    assert problem is not None and problem[0] == "search_space.num_attention_heads", problem
    fine = {"hidden_size": [96, 48], "num_attention_heads": [4, 12], **UNREAD}
    assert study_problem("hf-causal-lm", {}, fine) is None
