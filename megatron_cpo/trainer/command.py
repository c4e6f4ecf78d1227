"""The `train` command: `megatron-cpo train --config run.yaml [dotted.name=value ...]`.

One process for TP=PP=1, or `torchrun --nproc-per-node N -m megatron_cpo.cli train ...` for TP x PP x DP.
`--dry-run` (alias `--print-config`) resolves and validates the whole config, runs the pre-start checks (model,
layout, data, graders, output folder), prints the config, the verl keys it ignores and the layout, and starts nothing.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

import yaml

from megatron_cpo.config import config_to_dict, load_config, resolve_config
from megatron_cpo.console import run_log_path, setup_logging


def add_train_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--config", required=True, help="YAML run config (see examples/tiny/*.yaml)")
    parser.add_argument("--dry-run", "--print-config", dest="dry_run", action="store_true",
                        help="check the config, model, layout and data, print the resolved config and the layout, "
                             "and exit without starting anything")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.train_batch_size=8")
    return parser


def dry_run_report(config_path: str, overrides: list[str]) -> str:
    """The resolved config as YAML, the ignored verl keys, the policy loss's aggregation where its mode fixes it,
    and the layout; raises `ConfigError` on any problem."""
    from megatron_cpo.trainer.run.preflight import preflight

    resolved = resolve_config(config_path, overrides)
    plan = preflight(resolved.config, planning=True)
    tree = json.loads(json.dumps(config_to_dict(resolved.config)))  # tuples -> lists for plain YAML
    lines = ["# resolved config", yaml.safe_dump(tree, sort_keys=False).rstrip()]
    if resolved.ignored:
        lines += ["", "# " + resolved.ignored_warning()]
    if note := resolved.config.actor_rollout_ref.actor.aggregation_note():
        lines += ["", "# " + note]
    lines += ["", "# layout", *("# " + line for line in plan.describe().splitlines()),
              "", "# dry run: config, model, layout and data are valid; nothing was started"]
    return "\n".join(lines)


def run_train(args: argparse.Namespace) -> None:
    """Load and validate the config (a bad value raises `ConfigError`), train, print the final val metrics. A run
    that stops early (`RunAbortedError`: engines lost, SIGTERM during start-up, no intact checkpoint) prints one
    `error:` line and exits with its status."""
    if args.dry_run:
        print(dry_run_report(args.config, args.overrides), flush=True)
        return
    from megatron_cpo.trainer.run.preflight import preflight

    config = load_config(args.config, args.overrides)
    preflight(config)  # before the run's folder gets its log file: a refused run leaves nothing on disk
    log_file = setup_logging(run_log_path(config.trainer.default_local_dir))
    logging.getLogger(__name__).info("full log (library messages and warnings included): %s", log_file)
    from megatron_cpo.trainer.assemble import run_training  # after the logging set-up: Megatron logs on import
    from megatron_cpo.trainer.run.errors import RunAbortedError
    try:
        final = run_training(config, checked=True)
    except RunAbortedError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(err.exit_code)
    if final:
        print(json.dumps({k: v for k, v in final.items() if k.startswith("val/")}, sort_keys=True), flush=True)
