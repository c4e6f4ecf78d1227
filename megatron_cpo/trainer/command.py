"""The `train` command: `megatron-cpo train --config run.yaml [dotted.name=value ...]`.

One process for TP=PP=1, or `torchrun --nproc-per-node N -m megatron_cpo.cli train ...` for TP x PP x DP.
"""
from __future__ import annotations

import argparse
import json
import logging

from megatron_cpo.config import load_config
from megatron_cpo.console import run_log_path, setup_logging


def add_train_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--config", required=True, help="YAML run config (see examples/tiny/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.train_batch_size=8")
    return parser


def run_train(args: argparse.Namespace) -> None:
    """Load and validate the config (a bad value raises `ConfigError`), train, print the final val metrics."""
    config = load_config(args.config, args.overrides)
    log_file = setup_logging(run_log_path(config.trainer.default_local_dir))
    logging.getLogger(__name__).info("full log (library messages and warnings included): %s", log_file)
    from megatron_cpo.trainer.loop import run_training  # after the logging set-up: Megatron logs on import
    final = run_training(config)
    if final:
        print(json.dumps({k: v for k, v in final.items() if k.startswith("val/")}, sort_keys=True), flush=True)
