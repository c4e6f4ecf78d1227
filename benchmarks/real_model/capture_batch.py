"""Capture one real step's batch of the SmolLM2 example, for benchmarks that must time every setting on the same batch.

Starts the example's vLLM engine and rank 0's controller (no Megatron actor), collects one step's kept groups at the
example's settings and pickles them (the `ScoredGroup`s, with their dataset rows, so CPO's hint contexts can be built
from them) with the collection's metrics. `--filter-groups` collects as DAPO does (only groups whose responses
disagree on `acc`); without it, the groups as they come (GRPO's batch).

    python benchmarks/real_model/capture_batch.py --out outputs/batches/grpo_step1.pkl
    python benchmarks/real_model/capture_batch.py --filter-groups --out outputs/batches/dapo_step1.pkl
"""
from __future__ import annotations

import argparse
import pickle
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MODEL = ROOT / "examples/smollm2-135m/model"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--data", default="outputs/addition")
    parser.add_argument("--filter-groups", action="store_true")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from megatron_cpo.config import load_config
    from megatron_cpo.trainer.components import engine_launch_config
    from megatron_cpo.trainer.driver.lead import LeadDriver

    example = "dapo.yaml" if args.filter_groups else "grpo.yaml"
    config = load_config(str(ROOT / "examples/smollm2-135m" / example), [
        f"actor_rollout_ref.model.path={MODEL}", f"data.train_files={args.data}/train.parquet",
        f"data.val_files={args.data}/test.parquet", f"trainer.seed={args.seed}",
        "actor_rollout_ref.rollout.ray_address=local"])
    tokenizer = AutoTokenizer.from_pretrained(str(MODEL))
    lead = LeadDriver(config, tokenizer, engine_launch_config(config))
    try:
        outcome = lead.collect_groups(1)  # rank 0's collection alone: no process group here
        if outcome.collected is None:
            sys.exit(f"error: {outcome.engines_lost or outcome.rewards_refused}")
        collected = outcome.collected
    finally:
        lead.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "wb") as out:
        pickle.dump({"groups": collected.groups, "metrics": collected.metrics, "example": example}, out)
    acc = [float(g.acc.float().mean()) for g in collected.groups]
    print(f"wrote {args.out}: {len(collected.groups)} groups, per-group acc {acc}, "
          f"{sum(sum(map(len, g.response_token_ids)) for g in collected.groups)} response tokens")


if __name__ == "__main__":
    main()
