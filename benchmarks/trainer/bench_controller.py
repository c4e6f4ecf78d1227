"""Streaming filter-accumulate controller vs verl's sequential generation batches, on one real vLLM engine.

verl (DAPO recipe) generates a whole batch of `train_batch_size` prompts, waits for all of it, filters, and repeats
until enough prompts are kept. The controller requests ahead by the observed keep rate, scores every group that has
finished in one grading call and cancels the rest once the batch is full. Both fill batches of `train_batch_size`
kept prompts from the same prompts, model and sampling; the table reports wall time and rollouts requested per
filled batch at several keep rates (fraction of prompts whose group passes filter-groups).

Each repeat uses its own prompt order (seed 7 + repeat) for both modes, and the two modes alternate which runs
first, so a change of machine load hits both alike. The controller lives across repeats, as it lives across steps
in a training run (its keep-rate history is what a running trainer has).

    python benchmarks/trainer/bench_controller.py --keep-rates 0.1 0.3 0.7 --batches 2 --repeats 4 \
        [--max-num-seqs 256 --max-inflight-prompts 32]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def build_controller(module, manager, stream, scorer, batch_size: int, group_filter, params_for,
                     max_inflight_prompts: int = 0):
    """`module.RolloutController` filling batches of `batch_size` prompts. A controller of an older tree (it took its
    settings as `ControllerSettings`, before it read the run's config; it took the run's config, before it asked an
    `Admission`; or it took the engines, before it submitted to a group generator) is built the way it expects, so
    the A/B benchmarks still compare against commits from before."""
    import sys

    from megatron_cpo.config import build_config

    if hasattr(module, "ControllerSettings"):
        settings = module.ControllerSettings(train_batch_size=batch_size, max_inflight_prompts=max_inflight_prompts)
    else:
        settings = build_config({}, [f"data.train_batch_size={batch_size}",
                                     f"actor_rollout_ref.actor.ppo_mini_batch_size={batch_size}",
                                     f"actor_rollout_ref.rollout.max_inflight_prompts={max_inflight_prompts}"])
    if hasattr(module, "GroupGenerator"):  # a tree whose controller submits to a group generator
        from megatron_cpo.rollout.generators import SingleTurnGenerator

        manager = SingleTurnGenerator(manager)
    if hasattr(module, "Admission"):  # a tree whose controller asks an admission strategy, given its sections
        admission = sys.modules[module.Admission.__module__].admission_for(settings.async_training, batch_size,
                                                                           max_inflight_prompts)
        return module.RolloutController(manager, stream, scorer, admission, group_filter, params_for, settings.data,
                                        settings.algorithm.filter_groups)
    return module.RolloutController(manager, stream, scorer, settings, group_filter, params_for)


def sequential_batch(manager, stream, rewards, tokenizer, batch_size, params, step):
    """verl's loop: generate train_batch_size prompts at a time, wait for all, filter, accumulate, truncate."""
    from megatron_cpo.trainer.driver.accumulator import keep_varied_groups

    kept, rollouts = 0, 0
    while kept < batch_size:
        records = {}
        for _ in range(batch_size):
            position, record = stream.next()
            request_id = f"seq-{step}-{position.epoch}-{position.offset}"
            records[request_id] = record
            manager.submit(request_id, record.prompt_ids, params(step * 100003 + position.offset))
        groups = list(manager.completed(timeout=3600))
        rollouts += sum(len(g.samples) for g in groups)
        texts = [tokenizer.decode(s.token_ids, skip_special_tokens=True) for g in groups for s in g.samples]
        recs = [records[g.request_id] for g in groups for _ in g.samples]
        acc = rewards.score([r.data_source for r in recs], texts, [r.ground_truth for r in recs],
                            [r.extra_info for r in recs]).acc.float()
        kept += int(keep_varied_groups(acc.reshape(len(groups), -1)).sum())
    return rollouts


def group_scorer(rewards, tokenizer):
    """The trainer's scorer shape: decode and grade every response of the given groups in one pool call."""
    def score(items):
        texts = [[tokenizer.decode(r, skip_special_tokens=True) for r in rs] for _, rs in items]
        recs = [rec for rec, rs in items for _ in rs]
        acc = rewards.score([r.data_source for r in recs], [t for ts in texts for t in ts],
                            [r.ground_truth for r in recs], [r.extra_info for r in recs]).acc
        acc = acc.float().reshape(len(items), -1)
        return [(a, a, t) for a, t in zip(acc, texts)]
    return score


def summary(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "stdev": statistics.stdev(values) if len(values) > 1 else 0.0}


def untrained_setup(prefix: str, max_num_seqs: int | None = None):
    """An untrained tiny model, 4000 arithmetic prompts and one engine serving it: (tokenizer, dataset, manager)."""
    from transformers import AutoTokenizer

    from megatron_cpo.data import DataConfig, PromptDataset
    from megatron_cpo.data.synthetic import ArithConfig, write_arith_parquet
    from megatron_cpo.models.tiny import write_tiny_model
    from megatron_cpo.rollout import EngineLaunchConfig, RolloutEngineConfig, RolloutManager

    work = Path(tempfile.mkdtemp(prefix=prefix))
    model = write_tiny_model(work / "model")
    data = write_arith_parquet(work / "data", ArithConfig(num_train=4000, num_test=1))
    tokenizer = AutoTokenizer.from_pretrained(model)
    dataset = PromptDataset(data["train"], tokenizer, DataConfig(max_prompt_length=256))
    manager = RolloutManager(EngineLaunchConfig(model_path=str(model), dtype="float32", max_model_len=512, seed=1,
                                                engines=RolloutEngineConfig(ray_address="local"),
                                                max_num_seqs=max_num_seqs))
    return tokenizer, dataset, manager


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep-rates", type=float, nargs="+", default=[0.1, 0.3, 0.7])
    parser.add_argument("--batches", type=int, default=2, help="filled batches per mode in each repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="the engine's concurrent sequences (vLLM's default for AsyncLLM: 128)")
    parser.add_argument("--max-inflight-prompts", type=int, default=0,
                        help="the controller's look-ahead cap (0: 2 * batch size)")
    parser.add_argument("--out", default="benchmarks/trainer/controller_results.json")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from megatron_cpo.rewards.manager import RewardConfig, RewardManager
    from megatron_cpo.rollout import SamplingParams
    from megatron_cpo.trainer.driver import controller as controller_module
    from megatron_cpo.trainer.driver.accumulator import keep_varied_groups
    from megatron_cpo.trainer.driver.prompt_stream import PromptStream

    tokenizer, dataset, manager = untrained_setup("bench_controller_", max_num_seqs=args.max_num_seqs)

    def params(seed):
        return SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens,
                              stop_token_ids=(tokenizer.eos_token_id,), seed=seed)

    results = []
    try:
        manager.submit("warmup", dataset[0].prompt_ids, params(0))
        list(manager.completed(timeout=3600))
        for keep_rate in args.keep_rates:
            source = dataset[0].data_source
            rewards = RewardManager(RewardConfig(
                num_workers=1, custom_reward_function="benchmarks.trainer.graders:informative_fraction",
                grader_kwargs={source: {"keep_rate": keep_rate}}))
            controller = build_controller(controller_module, manager, PromptStream(dataset, 1, 7),
                                          group_scorer(rewards, tokenizer), args.batch_size, keep_varied_groups,
                                          params, args.max_inflight_prompts)
            runs = {"sequential": [], "streaming": []}
            load = [os.getloadavg()[0]]
            for repeat in range(args.repeats):
                modes = ("sequential", "streaming") if repeat % 2 == 0 else ("streaming", "sequential")
                for mode in modes:
                    stream = PromptStream(dataset, total_epochs=100, seed=7 + repeat, shuffle=True)
                    controller.stream = stream
                    start, rollouts, scoring, calls = time.perf_counter(), 0, 0.0, 0.0
                    for step in range(1, args.batches + 1):
                        if mode == "sequential":
                            rollouts += sequential_batch(manager, stream, rewards, tokenizer, args.batch_size,
                                                         params, step)
                        else:
                            metrics = controller.collect(step).metrics
                            rollouts += int(metrics["timing/requested_prompts"]) * args.n
                            scoring += metrics.get("timing/score_s", 0.0)
                            calls += metrics.get("timing/score_calls", 0.0)
                    runs[mode].append({"s_per_batch": (time.perf_counter() - start) / args.batches,
                                       "rollouts_per_batch": rollouts / args.batches,
                                       "score_s_per_batch": scoring / args.batches,
                                       "score_calls_per_batch": calls / args.batches})
                    load.append(os.getloadavg()[0])
            rewards.close()
            row = {"keep_rate": keep_rate, "runs": runs, "load_1min": summary(load)}
            for mode, mode_runs in runs.items():
                row[f"{mode}_s_per_batch"] = summary([r["s_per_batch"] for r in mode_runs])
                row[f"{mode}_rollouts_per_batch"] = summary([r["rollouts_per_batch"] for r in mode_runs])
            row["time_ratio_of_means"] = row["streaming_s_per_batch"]["mean"] / row["sequential_s_per_batch"]["mean"]
            row["time_ratio_per_repeat"] = [b["s_per_batch"] / a["s_per_batch"]
                                            for a, b in zip(runs["sequential"], runs["streaming"])]
            print(json.dumps({k: v for k, v in row.items() if k != "runs"}), flush=True)
            results.append(row)
    finally:
        manager.shutdown()
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
