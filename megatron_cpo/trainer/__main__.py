"""`python -m megatron_cpo.trainer --config run.yaml [dotted.name=value ...]`, the same as `megatron-cpo train`."""
from __future__ import annotations

import argparse
import sys

from megatron_cpo.config import ConfigError
from megatron_cpo.trainer.command import add_train_arguments, run_train


def main(argv: list[str] | None = None) -> int:
    args = add_train_arguments(argparse.ArgumentParser(prog="megatron-cpo train")).parse_args(argv)
    try:
        run_train(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
