"""`python -m megatron_cpo.trainer --config run.yaml [dotted.name=value ...]` (what `megatron-cpo train` runs).

Launch one process for TP=PP=1, or `torchrun --nproc-per-node N -m megatron_cpo.trainer ...` for TP x PP x DP.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

from megatron_cpo.config import ConfigError, load_config


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="megatron-cpo train", description=__doc__)
    parser.add_argument("--config", required=True, help="YAML run config (see examples/tiny/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.train_batch_size=8")
    return parser


def run(args: argparse.Namespace) -> int:
    """Load and validate the config, train, print the final metrics as JSON on rank 0."""
    from megatron_cpo.trainer.loop import run_training

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    final = run_training(config)
    if final:
        print(json.dumps({k: v for k, v in final.items() if k.startswith("val/")}, sort_keys=True))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
