"""Convert a Megatron-Core torch_dist checkpoint, or a training run's checkpoint, to a Hugging Face directory.

    torchrun --nproc-per-node 1 tools/convert_mcore_to_hf.py --mcore DIR --out DIR --hf-config DIR [--force]

The output loads with `transformers.AutoModelForCausalLM.from_pretrained`. `--tp/--pp/--ep/--etp` (default 1; ETP:
TP) split the work over more processes for models that do not fit one; the checkpoint may have been saved at any
TP/PP/EP, and may be a plain Megatron-Core one (Megatron-LM, verl) of the model `--hf-config` describes
(docs/conversion.md).

A training run's checkpoint (`--mcore <default_local_dir>/checkpoints/step_<k>`, `--hf-config` the run's
`actor_rollout_ref.model.path`) converts on as many processes as the run had, at its layout: a LoRA run's as its PEFT
adapter directory (`PeftModel.from_pretrained(base, out)`), with `--merge` as the model with the adapters merged in;
a fully trained one as the model (docs/lora.md).
"""
from __future__ import annotations

import argparse

from megatron_cpo.console import run_reporting_errors
from megatron_cpo.models.conversion_commands import add_mcore_to_hf_arguments
from megatron_cpo.trainer.run.checkpoint_conversion import run_checkpoint_to_hf


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0],
                                     epilog="\n\n".join(__doc__.strip().split("\n\n")[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    run_reporting_errors(run_checkpoint_to_hf, add_mcore_to_hf_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    main()
