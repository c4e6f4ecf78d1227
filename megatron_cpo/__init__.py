"""megatron-cpo: Megatron-Core recipe for RL post-training of LLMs (GRPO, DAPO, CPO) with vLLM rollouts."""

__version__ = "0.1.0"
