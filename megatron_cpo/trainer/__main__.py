"""`python -m megatron_cpo.trainer --config run.yaml [dotted.name=value ...]`, the same as `megatron-cpo train`."""
from __future__ import annotations

import argparse
import sys

from megatron_cpo.console import run_reporting_errors
from megatron_cpo.trainer.command import add_train_arguments, run_train


def main(argv: list[str] | None = None) -> int:
    """Bad input (a config, model, data or layout problem) is one `error: ...` line and exit status 2."""
    args = add_train_arguments(argparse.ArgumentParser(prog="megatron-cpo train")).parse_args(argv)
    run_reporting_errors(run_train, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
