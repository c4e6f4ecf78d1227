"""LoRA adapters on the Megatron model (docs/lora.md): the adapter layer and its split across TP / sequence
parallelism / experts (layers.py), which layers get one (targets.py), putting them on a built model and freezing the
rest (apply.py), and PEFT's adapter format (peft_format.py). The merged weights `W + alpha/rank B A` are what the
weight push and the Hugging Face export stream (weight_mapping.iter_hf_weights asks each weight's adapter)."""
