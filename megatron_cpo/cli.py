"""`megatron-cpo` command line: one subcommand per row of `COMMANDS`.

Adding a subcommand touches only the table: a help line, a function that adds its flags to a parser, and a function
that runs it with the parsed arguments. Multi-process commands run under torchrun (`torchrun ... -m megatron_cpo.cli`).
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from megatron_cpo.console import run_reporting_errors, setup_logging
from megatron_cpo.eval import add_eval_arguments, run_eval_command
from megatron_cpo.models.conversion_commands import (
    add_hf_to_mcore_arguments,
    add_mcore_to_hf_arguments,
    run_hf_to_mcore,
)
from megatron_cpo.models.inference import add_generate_arguments, run_generate
from megatron_cpo.models.lora.merge_command import add_merge_lora_arguments, run_merge_lora
from megatron_cpo.rollout.server import add_rollout_arguments, run_rollout_command
from megatron_cpo.trainer.command import add_train_arguments, run_train
from megatron_cpo.trainer.run.checkpoint_conversion import run_checkpoint_to_hf


@dataclass(frozen=True)
class Command:
    """A subcommand: its one-line help, how it declares its flags and what it runs."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], argparse.ArgumentParser]
    run: Callable[[argparse.Namespace], None]


COMMANDS: dict[str, Command] = {
    "convert-hf-to-mcore": Command("HF model directory -> Megatron torch_dist checkpoint (run under torchrun; a PEFT "
                                   "adapter needs none: actor_rollout_ref.model.lora.adapter_path starts from it)",
                                   add_hf_to_mcore_arguments, run_hf_to_mcore),
    "convert-mcore-to-hf": Command("Megatron torch_dist or training-run checkpoint -> HF model directory (a LoRA "
                                   "run's: PEFT adapter, or merged with --merge)",
                                   add_mcore_to_hf_arguments, run_checkpoint_to_hf),
    "merge-lora": Command("PEFT LoRA adapter + its HF base model -> HF model directory with the adapter merged in",
                          add_merge_lora_arguments, run_merge_lora),
    "train": Command("RL post-training (GRPO, DAPO, CPO) from a YAML config and dotted overrides",
                     add_train_arguments, run_train),
    "generate": Command("load a model into Megatron, score a chat prompt and greedily continue it",
                        add_generate_arguments, run_generate),
    "eval": Command("sample a model on parquet prompts with vLLM and report pass@k / mean@k per data source",
                    add_eval_arguments, run_eval_command),
    "rollout": Command("serve vLLM rollout engines over HTTP for trainers with actor_rollout_ref.rollout.mode=server",
                       add_rollout_arguments, run_rollout_command),
}

def build_parser() -> argparse.ArgumentParser:
    """The `megatron-cpo` parser with one subparser per row of `COMMANDS`."""
    parser = argparse.ArgumentParser(prog="megatron-cpo", description=__doc__.strip().splitlines()[0])
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        command.add_arguments(subcommands.add_parser(name, help=command.help, description=command.help))
    return parser


def main(argv: list[str] | None = None) -> None:
    """Parse `argv` (default: sys.argv) and run the chosen subcommand."""
    args = build_parser().parse_args(argv)
    setup_logging()  # known library warnings off the console; `train` and `eval` add their log files
    run_reporting_errors(COMMANDS[args.command].run, args)


if __name__ == "__main__":
    main()
