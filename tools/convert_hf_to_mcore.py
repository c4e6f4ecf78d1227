"""Convert a Hugging Face model to a Megatron-Core torch_dist checkpoint that loads at any TP/PP/EP.

Any family of megatron_cpo/models/families/ (docs/conversion.md lists them).

    torchrun --nproc-per-node N*M tools/convert_hf_to_mcore.py --hf DIR --out DIR --tp N --pp M [--force]
    torchrun --nproc-per-node 8 tools/convert_hf_to_mcore.py --hf DIR --out DIR --ep 8   # a mixture of experts

A PEFT LoRA adapter needs no conversion: the trainer starts a LoRA actor from the base
(`actor_rollout_ref.model.path`) and the adapter directory (`actor_rollout_ref.model.lora.adapter_path`) at any
layout. For a checkpoint of the model with the adapter merged in, `megatron-cpo merge-lora` first (docs/lora.md).
"""
from __future__ import annotations

import argparse

from megatron_cpo.console import run_reporting_errors
from megatron_cpo.models.conversion_commands import add_hf_to_mcore_arguments, run_hf_to_mcore


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0],
                                     epilog="\n\n".join(__doc__.strip().split("\n\n")[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    run_reporting_errors(run_hf_to_mcore, add_hf_to_mcore_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    main()
