"""The critic's scalar value head, and what makes a Hugging Face model directory a value model.

The actor's `GPTModel` with `ValueHead` (`h . w (+ b)` per position) as its output layer, as verl's Megatron critic;
on disk a token-classification model with one label (`score.weight`), as verl's FSDP critic. Sequence parallelism
and initialisation: docs/algorithms.md, "PPO's critic".
"""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

HEAD_INIT_SEED = 20250917  # any fixed value: every rank and layout starts the same fresh head


def is_value_model_config(hf_config: Any) -> bool:
    """Whether an HF config describes a token-classification model with one label (a saved critic)."""
    architectures = getattr(hf_config, "architectures", None) or []
    return any(name.endswith("ForTokenClassification") for name in architectures) and hf_config.num_labels == 1


def head_has_bias(hf_config: Any) -> bool:
    """Whether the checkpoint's head has a bias: transformers gives `score` one unless `token_classification_bias`
    is false; a fresh head (from a causal LM) has none, as verl's Megatron critic."""
    return is_value_model_config(hf_config) and bool(getattr(hf_config, "token_classification_bias", True))


def value_model_config(hf_config: Any, bias: bool) -> Any:
    """The HF config of the value model exported from `hf_config`'s architecture: its token-classification class,
    one label, and whether the head has a bias."""
    config = copy.deepcopy(hf_config)
    architecture = (getattr(hf_config, "architectures", None) or [f"{type(hf_config).__name__[:-6]}ForCausalLM"])[0]
    base = architecture.removesuffix("ForTokenClassification").removesuffix("ForCausalLM")
    config.architectures = [f"{base}ForTokenClassification"]
    config.num_labels = 1
    config.token_classification_bias = bias
    return config


class ValueHead(torch.nn.Module):
    """`[s, b, h]` final hidden states -> `[s, b, 1]` values, computed in float32; called as `GPTModel` calls its
    output layer (`(hidden, weight=..., ...) -> (output, bias)`), so the model's own forward returns the values."""

    def __init__(self, hidden_size: int, bias: bool, sequence_parallel: bool, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device)) if bias else None
        for param in (self.weight, self.bias):
            if param is not None:
                param.sequence_parallel = sequence_parallel  # each TP rank's gradient covers its part of the sequence
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """A fresh head: N(0, 1 / (hidden + 1)) from a fixed seed (the same on every rank and layout), bias 0."""
        generator = torch.Generator().manual_seed(HEAD_INIT_SEED)
        hidden = self.weight.shape[1]
        self.weight.copy_(torch.randn(self.weight.shape, generator=generator) / (hidden + 1))
        if self.bias is not None:
            self.bias.zero_()

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        values = F.linear(hidden_states.float(), self.weight.float(),
                          self.bias.float() if self.bias is not None else None)
        if self.sequence_parallel:
            from megatron.core import tensor_parallel

            # every TP rank computes the same loss on the gathered values, so the backward keeps its own part
            values = tensor_parallel.gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None
