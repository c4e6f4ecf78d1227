"""The `train` command: `megatron-cpo train --config run.yaml [dotted.name=value ...]`.

One process for TP=PP=1, or `torchrun --nproc-per-node N -m megatron_cpo.cli train ...` for TP x PP x DP.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

from megatron_cpo.config import load_config


def add_train_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--config", required=True, help="YAML run config (see examples/tiny/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.train_batch_size=8")
    return parser


def run_train(args: argparse.Namespace) -> None:
    """Load and validate the config (a bad value raises `ConfigError`), train, print the final val metrics. A run
    that stops early (`RunAbortedError`: engines lost, SIGTERM during start-up, no intact checkpoint) prints one
    `error:` line and exits with its status."""
    from megatron_cpo.trainer.errors import RunAbortedError
    from megatron_cpo.trainer.loop import run_training

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = load_config(args.config, args.overrides)
    try:
        final = run_training(config)
    except RunAbortedError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(err.exit_code)
    if final:
        print(json.dumps({k: v for k, v in final.items() if k.startswith("val/")}, sort_keys=True), flush=True)
