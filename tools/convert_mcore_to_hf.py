"""Convert a Megatron-Core torch_dist checkpoint back to a Hugging Face model directory (weights, config, tokenizer).

    torchrun --nproc-per-node 1 tools/convert_mcore_to_hf.py --mcore DIR --out DIR --hf-config DIR [--force]

The output loads with `transformers.AutoModelForCausalLM.from_pretrained`. `--tp/--pp/--ep/--etp` (default 1; ETP:
TP) split the work over more processes for models that do not fit one; the checkpoint may have been saved at any
TP/PP/EP, and may be a plain
Megatron-Core one (Megatron-LM, verl) of the model `--hf-config` describes (docs/conversion.md).
"""
from __future__ import annotations

import argparse

from megatron_cpo.console import run_reporting_errors
from megatron_cpo.models.conversion_commands import add_mcore_to_hf_arguments, run_mcore_to_hf


def main(argv: list[str] | None = None) -> None:
    parser = add_mcore_to_hf_arguments(argparse.ArgumentParser(description=__doc__.strip().splitlines()[0]))
    run_reporting_errors(run_mcore_to_hf, parser.parse_args(argv))


if __name__ == "__main__":
    main()
