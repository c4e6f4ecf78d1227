"""`megatron-cpo merge-lora`: a PEFT adapter trained by the real `peft` (separate A for q, k and v, B not zero) merged
into the tiny HF base gives the logits of `PeftModel` on that base, and PEFT's own `merge_and_unload` weights; an
adapter of another base is refused naming the tensor."""
from pathlib import Path

import pytest
import torch

from megatron_cpo.cli import main

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny" / "model"
TOKENS = torch.tensor([[5, 9, 33, 40, 2, 7, 8, 11]])


def peft_adapter(base: Path, out: Path, rank: int = 4, alpha: float = 8, share_fused_a: bool = False):
    """An adapter of the real `peft` on every linear layer of `base`, A and B random (B small, as trained), saved to
    `out`; `share_fused_a`: k and v take q's A, up takes gate's (the adapters Megatron's fused layers hold)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(r=rank, lora_alpha=alpha, target_modules="all-linear", init_lora_weights=False))
    params = dict(model.named_parameters())
    with torch.no_grad():  # a trained adapter's size: B random, small
        for name, param in params.items():
            if "lora_B" in name:
                param.mul_(0.05)
            for first, fused in (("q_proj", ("k_proj", "v_proj")), ("gate_proj", ("up_proj",))):
                if share_fused_a and f".{first}.lora_A." in name:
                    for other in fused:
                        params[name.replace(first, other)].copy_(param)
    model.save_pretrained(out)
    return model


def test_a_merged_adapter_gives_peft_logits_and_peft_merged_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    adapted = peft_adapter(TINY, tmp_path / "adapter")
    main(["merge-lora", "--base", str(TINY), "--adapter", str(tmp_path / "adapter"), "--out", str(tmp_path / "out")])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    with torch.no_grad():
        expected, got = adapted(TOKENS).logits, merged(TOKENS).logits
    assert (expected - got).abs().max() < 1e-4  # float noise on logits up to 13 (PEFT's own merge: 3e-5)
    assert (got - AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)(TOKENS).logits).abs().max() > 1e-3
    reference = adapted.merge_and_unload().state_dict()
    for name, tensor in merged.state_dict().items():
        assert torch.allclose(tensor, reference[name], atol=1e-6), name
    assert (tmp_path / "out" / "tokenizer.json").is_file() and not (tmp_path / "out.partial").exists()


def test_an_adapter_of_another_base_is_refused(tmp_path):
    from megatron_cpo.models.tiny import write_tiny_model

    other = write_tiny_model(tmp_path / "other", family="qwen2", seed=0, hidden_size=64, intermediate_size=128)
    peft_adapter(other, tmp_path / "adapter")
    with pytest.raises(ValueError, match="it was trained on another base model"):
        from megatron_cpo.models.lora.merge_command import merge_lora

        merge_lora(TINY, tmp_path / "adapter", tmp_path / "out")
