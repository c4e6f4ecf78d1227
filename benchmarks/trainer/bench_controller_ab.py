"""Before/after: sequential batches, the controller of an older commit and the current one, interleaved on one engine.

The old controller is loaded from a tree of that commit (`git archive 682f28d | tar -x -C OLD`). Each repeat runs
the three modes in a rotated order over the same prompt order, so a change of machine load hits all three alike.

    git archive 682f28d | tar -x -C /tmp/old
    python benchmarks/trainer/bench_controller_ab.py --old-tree /tmp/old --keep-rates 0.1 0.3 0.7 --repeats 4
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MODES = ("sequential", "old", "new")


def load_old_controller(tree: Path):
    spec = importlib.util.spec_from_file_location("old_controller", tree / "megatron_cpo/trainer/driver/controller.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_controller"] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old-tree", required=True, type=Path)
    parser.add_argument("--keep-rates", type=float, nargs="+", default=[0.1, 0.3, 0.7])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/trainer/controller_ab_results.json")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from benchmarks.trainer.bench_controller import build_controller, group_scorer, sequential_batch, untrained_setup
    from megatron_cpo.rewards.manager import RewardConfig, RewardManager
    from megatron_cpo.rollout import SamplingParams
    from megatron_cpo.trainer.driver import controller as new_controller
    from megatron_cpo.trainer.driver.accumulator import keep_varied_groups
    from megatron_cpo.trainer.driver.prompt_stream import PromptStream

    old_controller = load_old_controller(args.old_tree)
    tokenizer, dataset, manager = untrained_setup("bench_controller_ab_")

    def params(seed):
        return SamplingParams(n=8, temperature=1.0, max_tokens=32, stop_token_ids=(tokenizer.eos_token_id,), seed=seed)

    results = []
    try:
        manager.submit("warmup", dataset[0].prompt_ids, params(0))
        list(manager.completed(timeout=3600))
        for keep_rate in args.keep_rates:
            rewards = RewardManager(RewardConfig(
                num_workers=1, custom_reward_function="benchmarks.trainer.graders:informative_fraction",
                grader_kwargs={dataset[0].data_source: {"keep_rate": keep_rate}}))
            controllers = {name: build_controller(module, manager, PromptStream(dataset, 1, 7),
                                                  group_scorer(rewards, tokenizer), 8, keep_varied_groups, params)
                           for name, module in (("old", old_controller), ("new", new_controller))}
            runs, loads = {mode: [] for mode in MODES}, []
            for repeat in range(args.repeats):
                for mode in MODES[repeat % 3:] + MODES[:repeat % 3]:
                    stream = PromptStream(dataset, total_epochs=100, seed=7 + repeat, shuffle=True)
                    start, rollouts = time.perf_counter(), 0
                    for step in range(1, args.batches + 1):
                        if mode == "sequential":
                            rollouts += sequential_batch(manager, stream, rewards, tokenizer, 8, params, step)
                        else:
                            controllers[mode].stream = stream
                            collected = controllers[mode].collect(step)
                            rollouts += int(collected.metrics["timing/requested_prompts"]) * 8
                    runs[mode].append({"s": (time.perf_counter() - start) / args.batches,
                                       "rollouts": rollouts / args.batches})
                    loads.append(os.getloadavg()[0])
            rewards.close()
            row = {"keep_rate": keep_rate, "load_1min_mean": statistics.fmean(loads)}
            for mode in MODES:
                seconds = [run["s"] for run in runs[mode]]
                row[mode] = {"s_per_batch": statistics.fmean(seconds), "s_stdev": statistics.stdev(seconds),
                             "rollouts_per_batch": statistics.fmean(run["rollouts"] for run in runs[mode]),
                             "s_per_repeat": seconds}
            row["ratio_old"] = row["old"]["s_per_batch"] / row["sequential"]["s_per_batch"]
            row["ratio_new"] = row["new"]["s_per_batch"] / row["sequential"]["s_per_batch"]
            print(json.dumps(row), flush=True)
            results.append(row)
    finally:
        manager.shutdown()
    Path(args.out).write_text(json.dumps({"args": {**vars(args), "old_tree": str(args.old_tree)},
                                          "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
