"""Streaming controller vs verl's sequential generation batches on a long-tail rollout workload, interleaved.

Workload: the untrained tiny model (it almost never emits EOS, so a response runs to its `max_tokens`) with a
per-request `max_tokens` drawn from a log-normal distribution clipped to [--min-tokens, --max-tokens-cap]: median
`--median-tokens`, log-space sigma `--sigma`. The draw is a hash of the request's sampling seed (which the controller
fixes from run seed, step and data position), so both modes give every request the same length and the same
samples. Which groups pass filter-groups is a hash of the prompt (`benchmarks.trainer.graders.informative_fraction`),
the same in both modes, at each keep rate.

Modes, alternating which runs first in each repeat, on one shared engine and the same prompt order per repeat:
- sequential: verl's DAPO loop: submit `train_batch_size` prompts, wait for all of them, grade, filter, repeat
  until `train_batch_size` groups are kept;
- streaming: `RolloutController.collect` (the trainer's controller, its keep-rate history primed by one untimed
  batch per keep rate);
- streaming_old (with --old-tree): the controller of an older tree, loaded as bench_controller_ab.py does.

Engine use is read from when the controller side submits a group and gets it back (see README: "idle" is wall time
with nothing outstanding on the engine; "slot use" the time-mean of min(outstanding sequences, max_num_seqs) /
max_num_seqs), and the engine's work from the CPU seconds of its processes (`engine_cpu_seconds`).

    python benchmarks/streaming/bench_long_tail.py --keep-rates 0.1 0.3 0.7 --repeats 4
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

VLLM_DEFAULT_MAX_NUM_SEQS = 128


def long_tail_tokens(seed: int, median: float, sigma: float, low: int, cap: int) -> int:
    """A log-normal length, fixed by `seed`: exp(log(median) + sigma * z), z the standard-normal quantile of a
    hash of the seed, rounded and clipped to [low, cap]."""
    digest = hashlib.sha256(f"long-tail-{seed}".encode()).digest()
    uniform = (int.from_bytes(digest[:8], "big") + 0.5) / 2**64
    z = statistics.NormalDist().inv_cdf(uniform)
    return int(min(max(round(math.exp(math.log(median) + sigma * z)), low), cap))


class RecordingManager:
    """The rollout manager, recording when each group is submitted and when it comes back (or is cancelled)."""

    def __init__(self, manager) -> None:
        self.manager = manager
        self.outstanding: dict[str, int] = {}  # request id -> samples
        self.events: list[tuple[float, int]] = []  # (time, change in outstanding sequences)
        self.tokens = 0

    def submit(self, request_id, prompt_token_ids, params) -> None:
        self.manager.submit(request_id, prompt_token_ids, params)
        self.outstanding[request_id] = params.n
        self.events.append((time.perf_counter(), params.n))

    def _returned(self, groups) -> None:
        now = time.perf_counter()
        for group in groups:
            self.events.append((now, -self.outstanding.pop(group.request_id)))
            self.tokens += sum(len(sample.token_ids) for sample in group.samples)

    def finished(self, timeout=None):
        groups = self.manager.finished(timeout=timeout)
        self._returned(groups)
        return groups

    def completed(self, timeout=None):
        for group in self.manager.completed(timeout=timeout):
            self._returned([group])
            yield group

    def cancel_all(self) -> int:
        dropped = self.manager.cancel_all()
        self.events.append((time.perf_counter(), -sum(self.outstanding.values())))
        self.outstanding.clear()
        return dropped

    def usage(self, start: float, end: float, slots: int) -> dict[str, float]:
        """Idle seconds (nothing outstanding) and slot use over [start, end] from the recorded events."""
        level, idle, slot_seconds, last = 0, 0.0, 0.0, start
        for when, change in sorted(e for e in self.events if start <= e[0] <= end) + [(end, 0)]:
            if level == 0:
                idle += when - last
            slot_seconds += min(level, slots) * (when - last)
            level, last = level + change, when
        wall = max(end - start, 1e-9)
        return {"idle_s": idle, "idle_frac": idle / wall, "slot_use": slot_seconds / (slots * wall)}


def engine_cpu_seconds(engine) -> float:
    """CPU seconds used so far by the engine actors' processes and what they started (vLLM's engine core and
    workers): the engine's work, which, unlike wall time, does not grow when other jobs take the cores."""
    import psutil

    total = 0.0
    for pid_file in engine._pid_dir.glob("*.pid"):
        actor = psutil.Process(int(pid_file.read_text().partition(" ")[2]))
        for process in [actor, *actor.children(recursive=True)]:
            try:
                times = process.cpu_times()
                total += times.user + times.system
            except psutil.Error:
                continue
    return total


def add_workload_arguments(parser: argparse.ArgumentParser, max_num_seqs: int | None) -> None:
    """The long-tail workload's settings, shared with simulate_long_tail.py: batch, samples, the log-normal
    `max_tokens` per request, and the engine's `max_num_seqs` (None: vLLM's default)."""
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--median-tokens", type=float, default=16.0)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--min-tokens", type=int, default=2)
    parser.add_argument("--max-tokens-cap", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=max_num_seqs)


def sequential_batch(manager, stream, scorer, group_filter, batch_size, params_for, seed_for, step) -> int:
    """verl's loop: a generation batch of `batch_size` prompts, wait for all, grade, filter, until enough kept.
    Returns the prompts requested."""
    import torch

    kept, requested = 0, 0
    while kept < batch_size:
        records = {}
        for _ in range(batch_size):
            position, record = stream.next()
            request_id = f"seq-{step}-e{position.epoch}-o{position.offset}"
            records[request_id] = record
            manager.submit(request_id, list(record.prompt_ids), params_for(seed_for(step, position)))
        requested += batch_size
        groups = list(manager.completed(timeout=3600))
        scored = scorer([(records[g.request_id], [s.token_ids for s in g.samples]) for g in groups])
        keep = group_filter(torch.stack([acc.float() for _, acc, _ in scored]))
        kept += int(keep.sum())
    return requested


def summary(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep-rates", type=float, nargs="+", default=[0.1, 0.3, 0.7])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--batches-per-10pct", type=int, default=1,
                        help="filled batches per mode and repeat at a 10%% keep rate, in proportion at others "
                             "(so every keep rate commits about as many prompts per measurement)")
    add_workload_arguments(parser, max_num_seqs=None)
    parser.add_argument("--max-inflight-prompts", type=int, default=0)
    parser.add_argument("--old-tree", type=Path, default=None, help="also run the controller of this tree")
    parser.add_argument("--out", default="benchmarks/streaming/long_tail_results.json")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from benchmarks.trainer.bench_controller import build_controller, group_scorer, untrained_setup
    from megatron_cpo.rewards.manager import RewardConfig, RewardManager
    from megatron_cpo.rollout import SamplingParams
    from megatron_cpo.trainer.driver import controller as new_controller
    from megatron_cpo.trainer.driver.accumulator import keep_varied_groups
    from megatron_cpo.trainer.driver.prompt_stream import PromptStream

    controllers = {"streaming": new_controller}
    if args.old_tree is not None:
        from benchmarks.trainer.bench_controller_ab import load_old_controller
        controllers["streaming_old"] = load_old_controller(args.old_tree)
    modes = ("sequential", *controllers)
    tokenizer, dataset, engine = untrained_setup("bench_long_tail_", max_num_seqs=args.max_num_seqs)
    manager = RecordingManager(engine)
    slots = args.max_num_seqs or VLLM_DEFAULT_MAX_NUM_SEQS

    def params_for(seed):
        return SamplingParams(n=args.n, temperature=1.0, stop_token_ids=(tokenizer.eos_token_id,), seed=seed,
                              max_tokens=long_tail_tokens(seed, args.median_tokens, args.sigma, args.min_tokens,
                                                          args.max_tokens_cap))

    results = []
    try:
        engine.submit("warmup", dataset[0].prompt_ids, params_for(0))
        list(engine.completed(timeout=3600))
        for keep_rate in args.keep_rates:
            rewards = RewardManager(RewardConfig(
                num_workers=1, custom_reward_function="benchmarks.trainer.graders:informative_fraction",
                grader_kwargs={dataset[0].data_source: {"keep_rate": keep_rate}}))
            scorer = group_scorer(rewards, tokenizer)
            live = {name: build_controller(module, manager, PromptStream(dataset, 100, 1000), scorer,
                                           args.batch_size, keep_varied_groups, params_for, args.max_inflight_prompts)
                    for name, module in controllers.items()}
            for controller in live.values():  # prime the keep-rate history, as a running trainer's is
                controller.collect(step=0)
            runs = {mode: [] for mode in modes}
            batches = max(1, round(args.batches_per_10pct * keep_rate * 10))
            for repeat in range(args.repeats):
                steps = range(repeat * batches + 1, (repeat + 1) * batches + 1)
                for mode in modes[repeat % len(modes):] + modes[:repeat % len(modes)]:
                    stream = PromptStream(dataset, total_epochs=100, seed=7 + repeat, shuffle=True)
                    load = os.getloadavg()[0]
                    start, tokens, cpu = time.perf_counter(), manager.tokens, engine_cpu_seconds(engine)
                    requested = 0
                    for step in steps:
                        if mode == "sequential":
                            seed_for = live["streaming"]._request_seed
                            live["streaming"].stream = stream  # the seeds the controller would give these prompts
                            requested += sequential_batch(manager, stream, scorer, keep_varied_groups,
                                                          args.batch_size, params_for, seed_for, step)
                        else:
                            live[mode].stream = stream
                            requested += int(live[mode].collect(step).metrics["timing/requested_prompts"])
                    end = time.perf_counter()
                    runs[mode].append({"s": end - start, "batches": batches,
                                       "engine_cpu_s": engine_cpu_seconds(engine) - cpu,
                                       "requested_prompts": requested, "load_1min": load,
                                       "returned_tokens": manager.tokens - tokens,
                                       **manager.usage(start, end, slots)})
                    print(json.dumps({"keep_rate": keep_rate, "repeat": repeat, "mode": mode, **runs[mode][-1]}),
                          flush=True)
            rewards.close()
            row = {"keep_rate": keep_rate}
            for mode in modes:
                row[mode] = {key: summary([run[key] for run in runs[mode]]) for key in runs[mode][0]}
                row[mode]["runs"] = runs[mode]
            for mode in modes[1:]:
                row[f"{mode}_ratio"] = {}
                for key in ("s", "engine_cpu_s"):
                    ratios = [b[key] / a[key] for a, b in zip(runs["sequential"], runs[mode])]
                    row[f"{mode}_ratio"][key] = {
                        "of_means": row[mode][key]["mean"] / row["sequential"][key]["mean"],
                        "per_repeat": summary(ratios), "median_per_repeat": statistics.median(ratios)}
            print(json.dumps({"keep_rate": keep_rate, **{k: v for k, v in row.items() if k.endswith("_ratio")}}),
                  flush=True)
            results.append(row)
    finally:
        engine.shutdown()
    Path(args.out).write_text(json.dumps({"args": {**vars(args), "old_tree": str(args.old_tree)},
                                          "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
