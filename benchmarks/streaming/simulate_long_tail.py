"""Engine steps to fill a batch on the long-tail workload, counted on a model of vLLM's scheduler (no timing noise).

A model, not a measurement: the engine is replaced by a step counter that behaves like vLLM's scheduler for this
workload (first come, first served; at most `max_num_seqs` sequences decode at once; every running sequence
gains one token per step; a group of n samples returns when its last sample reaches its `max_tokens`, i.e. no
EOS, which the untrained model almost never emits; cancelled groups leave at once). The controllers are the real
code (`RolloutController`, the old tree's with --old-tree) and the sequential loop is bench_long_tail.py's, driving
that counter through the manager interface. It reports, per filled batch, the engine steps (the time on a GPU,
where a decode step costs about the same at any batch size) and the sequence-steps (the work, what one step's
cost grows with on this CPU), so the benchmark's wall times can be split into "fewer steps" and "fuller steps".

    python benchmarks/streaming/simulate_long_tail.py --keep-rates 0.1 0.3 0.7 --repeats 200
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.streaming.bench_long_tail import add_workload_arguments, long_tail_tokens, sequential_batch  # noqa: E402
from megatron_cpo.rollout.types import RolloutGroup, RolloutSample, SamplingParams  # noqa: E402


@dataclass
class Record:
    index: int
    prompt_ids: tuple[int, ...] = (1, 2, 3)


class SteppedEngine:
    """The manager interface (submit / finished / completed / cancel_all) over a step-counting scheduler model."""

    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.queue: list[list] = []  # [request_id, params, running, tokens so far], in submission order
        self.steps = 0
        self.seq_steps = 0

    def submit(self, request_id, prompt_token_ids, params) -> None:
        self.queue.append([request_id, params, False, 0])

    def _step(self) -> list[RolloutGroup]:
        running = sum(entry[1].n for entry in self.queue if entry[2])
        for entry in self.queue:  # first come, first served: admit whole groups while their samples fit
            if not entry[2]:
                if running + entry[1].n > self.max_num_seqs:
                    break
                entry[2], running = True, running + entry[1].n
        self.steps += 1
        self.seq_steps += running
        done = []
        for entry in self.queue:
            if entry[2]:
                entry[3] += 1
                if entry[3] >= entry[1].max_tokens:
                    done.append(entry)
        if done:
            self.queue = [entry for entry in self.queue if entry[3] < entry[1].max_tokens]
        return [RolloutGroup(entry[0], [1, 2, 3], [RolloutSample([0] * entry[1].max_tokens,
                                                                  [0.0] * entry[1].max_tokens, "length", True)
                                                    for _ in range(entry[1].n)]) for entry in done]

    def finished(self, timeout=None) -> list[RolloutGroup]:
        while self.queue:
            groups = self._step()
            if groups:
                return groups
        return []

    def completed(self, timeout=None):
        while self.queue:
            yield from self._step()

    def cancel_all(self) -> int:
        dropped, self.queue = len(self.queue), []
        return dropped


def kept_prompt(index: int, keep_rate: float) -> bool:
    """The same rule as benchmarks.trainer.graders.informative_fraction: a hash of the prompt's index."""
    digest = hashlib.sha256(str(index).encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < keep_rate


def scorer_for(keep_rate: float):
    def score(items):
        out = []
        for record, responses in items:
            acc = (torch.arange(len(responses)) % 2 == 0) if kept_prompt(record.index, keep_rate) \
                else torch.zeros(len(responses), dtype=torch.bool)
            out.append((acc.float(), acc, [""] * len(responses)))
        return out
    return score


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep-rates", type=float, nargs="+", default=[0.1, 0.3, 0.7])
    parser.add_argument("--repeats", type=int, default=200)
    add_workload_arguments(parser, max_num_seqs=128)
    parser.add_argument("--max-inflight-prompts", type=int, nargs="+", default=[0])
    parser.add_argument("--old-tree", type=Path, default=None)
    parser.add_argument("--uncommitted-bound", type=int, default=0,
                        help="what-if: also bound the new controller's uncommitted prompts by this (wraps its "
                             "prompts_to_request for this process only; 0: as shipped)")
    parser.add_argument("--out", default="benchmarks/streaming/simulated_results.json")
    args = parser.parse_args()

    from benchmarks.trainer.bench_controller import build_controller
    from megatron_cpo.trainer.driver import controller as new_controller
    from megatron_cpo.trainer.driver.accumulator import keep_varied_groups
    from megatron_cpo.trainer.driver.prompt_stream import PromptStream

    if args.uncommitted_bound:
        from megatron_cpo.trainer.driver import admission as new_admission

        as_shipped = new_admission.prompts_to_request
        new_admission.prompts_to_request = lambda needed, rate: min(as_shipped(needed, rate), args.uncommitted_bound)
    modules = {"streaming": new_controller}
    if args.old_tree is not None:
        from benchmarks.trainer.bench_controller_ab import load_old_controller
        modules["streaming_old"] = load_old_controller(args.old_tree)
    records = [Record(i) for i in range(4000)]

    def params_for(seed):
        return SamplingParams(n=args.n, seed=seed, max_tokens=long_tail_tokens(
            seed, args.median_tokens, args.sigma, args.min_tokens, args.max_tokens_cap))

    results = []
    for keep_rate in args.keep_rates:
        for cap in args.max_inflight_prompts:
            engine = SteppedEngine(args.max_num_seqs)
            live = {name: build_controller(module, engine, PromptStream(records, 100, 1000), scorer_for(keep_rate),
                                           args.batch_size, keep_varied_groups, params_for, cap)
                    for name, module in modules.items()}
            for controller in live.values():
                controller.collect(step=0)
            runs = {mode: [] for mode in ("sequential", *live)}
            for repeat in range(args.repeats):
                for mode in runs:
                    stream = PromptStream(records, total_epochs=100, seed=7 + repeat, shuffle=True)
                    steps, seq_steps = engine.steps, engine.seq_steps
                    if mode == "sequential":
                        live["streaming"].stream = stream
                        sequential_batch(engine, stream, scorer_for(keep_rate), keep_varied_groups, args.batch_size,
                                         params_for, live["streaming"]._request_seed, repeat + 1)
                    else:
                        live[mode].stream = stream
                        live[mode].collect(repeat + 1)
                    runs[mode].append((engine.steps - steps, engine.seq_steps - seq_steps))
            row = {"keep_rate": keep_rate, "max_inflight_prompts": cap}
            for mode, values in runs.items():
                row[mode] = {"steps": statistics.fmean(v[0] for v in values),
                             "seq_steps": statistics.fmean(v[1] for v in values),
                             "slot_use": statistics.fmean(v[1] / (v[0] * args.max_num_seqs) for v in values)}
                if mode != "sequential":
                    ratios = [a[0] / b[0] for a, b in zip(values, runs["sequential"])]
                    row[mode]["step_ratio_median"] = statistics.median(ratios)
                    row[mode]["step_ratio_of_means"] = row[mode]["steps"] / row["sequential"]["steps"]
                    row[mode]["seq_step_ratio_of_means"] = row[mode]["seq_steps"] / row["sequential"]["seq_steps"]
            print(json.dumps(row), flush=True)
            results.append(row)
    Path(args.out).write_text(json.dumps({"args": {**vars(args), "old_tree": str(args.old_tree)},
                                          "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
