"""megatron-cpo: Megatron-Core recipe for RL post-training of LLMs (GRPO, DAPO, CPO) with vLLM rollouts."""
import warnings

__version__ = "0.1.0"

# Megatron-Core announces on import that it falls back to its own PyTorch code without Transformer Engine / Apex (on
# every CPU run; models/builder.py picks the layer spec itself). Filtered here, before any module of this package
# imports Megatron, so that no command, rank or worker prints them (DEVELOPERS.md "Console and log files").
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* (is|are) not installed", category=UserWarning)
