"""Asynchronous training on a model of a GPU engine and trainer: wall time per step for k = 0, 1, 2, no timing noise.

A model, not a measurement (like benchmarks/streaming/simulate_long_tail.py, whose workload it reuses): the engine
is vLLM's scheduler reduced to a clock (first come first served, at most `max_num_seqs` sequences decode at once,
each running sequence gains a token per decode step, a decode step costs `decode_step_s` at any batch size, as on a
GPU below its capacity; a group returns when its last sample ends). Each request's length is the long-tail draw of
bench_long_tail.py (all n samples of a request share it). The trainer's update takes `train_s_per_token` per trained
token plus `train_fixed_s`, the weight push `push_s`, during which the engine is paused (in-flight requests keep their
tokens and go on afterwards: `partial_rollout`). The controller is the real one (`RolloutController`, the shipped
admission and commit rules), driving this engine through the `RolloutEngines` calls it makes.

One timeline: while the controller waits for groups the clock runs the engine; the update advances the clock by its
cost while the engine keeps decoding what it holds (nothing new is admitted: submitting ahead happens at the
hand-off, as in the trainer); the push advances it with the engine paused. Reported per k: wall time per step,
the engines' idle share of the update windows, the trainer's idle time (collection), staleness, and for the
submit-ahead vs background-thread question the slots that dropped groups freed during update windows (what a thread
admitting during the update could have refilled).

    python benchmarks/async/simulate_async.py --train-to-gen 0.25 0.5 1.0 2.0 --keep-rates 1.0 0.5 --steps 40
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.streaming.bench_long_tail import long_tail_tokens  # noqa: E402
from benchmarks.streaming.simulate_long_tail import Record, scorer_for  # noqa: E402
from megatron_cpo.rollout.types import RolloutGroup, RolloutSample, SamplingParams  # noqa: E402


@dataclass
class _Request:
    request_id: str
    params: SamplingParams
    length: int
    tokens: int = 0
    versions: list | None = None
    started: bool = False


class ClockedEngine:
    """`RolloutEngines` on a decode-step clock (see the module docstring)."""

    def __init__(self, max_num_seqs: int, decode_step_s: float) -> None:
        self.max_num_seqs, self.decode_step_s = max_num_seqs, decode_step_s
        self.queue: list[_Request] = []
        self.done: list[RolloutGroup] = []
        self.now = 0.0
        self.busy_s = 0.0
        self.weight_version = 0
        self.engines, self.last_engine_failure = ["model"], None

    def submit(self, request_id, prompt_token_ids, params) -> None:
        self.queue.append(_Request(request_id, params, params.max_tokens, versions=[]))

    def _step(self) -> None:
        running = 0
        for request in self.queue:
            if not request.started:
                if running + request.params.n > self.max_num_seqs:
                    break
                request.started = True
            running += request.params.n
        self.now += self.decode_step_s
        self.busy_s += self.decode_step_s
        for request in self.queue:
            if request.started:
                request.tokens += 1
                request.versions.append(self.weight_version)
        finished = [r for r in self.queue if r.tokens >= r.length]
        self.queue = [r for r in self.queue if r.tokens < r.length]
        self.done += [RolloutGroup(r.request_id, [1, 2, 3], [
            RolloutSample([0] * r.length, [0.0] * r.length, "length", True, list(r.versions))
            for _ in range(r.params.n)]) for r in finished]

    def run_for(self, seconds: float) -> float:
        """Decode for `seconds` of clock (the trainer updates meanwhile); returns the seconds the engine was idle."""
        end, idle = self.now + seconds, 0.0
        while self.now + self.decode_step_s <= end:
            if not self.queue:
                idle, self.now = end - self.now, end
                break
            self._step()
        self.now = max(self.now, end)
        return idle

    def finished(self, timeout=None) -> list[RolloutGroup]:
        if timeout == 0:
            if not self.done:
                raise TimeoutError("nothing finished")
        while not self.done and self.queue:
            self._step()
        done, self.done = self.done, []
        return done

    def completed(self, timeout=None):
        while self.queue or self.done:
            yield from self.finished()

    def cancel_all(self) -> int:
        dropped, self.queue, self.done = len(self.queue), [], []
        return dropped

    def push(self, push_s: float) -> None:
        """The weight push: the engine is paused for `push_s`, then samples with the new version."""
        self.now += push_s
        self.weight_version += 1


def simulate(k: int, keep_rate: float, train_s_per_token: float, args) -> dict:
    from megatron_cpo.config import build_config
    from megatron_cpo.rollout.generators import SingleTurnGenerator
    from megatron_cpo.trainer.driver.accumulator import keep_varied_groups
    from megatron_cpo.trainer.driver.admission import admission_for
    from megatron_cpo.trainer.driver.controller import RolloutController
    from megatron_cpo.trainer.driver.prompt_stream import PromptStream

    engine = ClockedEngine(args.max_num_seqs, args.decode_step_s)
    filtering = keep_rate < 1.0
    config = build_config({}, [f"data.train_batch_size={args.batch_size}", f"actor_rollout_ref.rollout.n={args.n}",
                               f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch_size}",
                               f"algorithm.filter_groups.enable={str(filtering).lower()}",
                               f"async_training.max_staleness={k}"])

    def params_for(seed):
        return SamplingParams(n=args.n, seed=seed, max_tokens=long_tail_tokens(
            seed, args.median_tokens, args.sigma, args.min_tokens, args.max_tokens_cap))

    stream = PromptStream([Record(i) for i in range(100_000)], total_epochs=1, seed=args.seed)
    controller = RolloutController(SingleTurnGenerator(engine), stream, scorer_for(keep_rate),
                                   admission_for(config.async_training, args.batch_size),
                                   keep_varied_groups if filtering else None, params_for, config.data,
                                   config.algorithm.filter_groups)
    steps, update_idle, update_total, collect_s, staleness, freed = [], 0.0, 0.0, [], [], 0
    for step in range(1, args.steps + 1):
        start = engine.now
        collected = controller.collect(step, engine.weight_version)
        collect_s.append(engine.now - start)
        tokens = sum(len(t) for g in collected.groups for t in g.response_token_ids)
        update_s = args.train_fixed_s + train_s_per_token * tokens
        done_before = len(engine.done)
        update_idle += engine.run_for(update_s)
        update_total += update_s
        # dropped groups that finished during the update: slots a thread admitting during the update could refill
        finished_in_update = engine.done[done_before:]
        scored = controller.scorer([(Record(int(g.request_id.split("-o")[-1])), [[0]] * args.n)
                                    for g in finished_in_update]) if filtering and finished_in_update else []
        freed += sum(1 for acc, _, _ in scored if float(acc.float().std()) == 0.0)
        engine.push(args.push_s)
        steps.append(engine.now - start)
        staleness.append(collected.metrics.get("async/staleness_max", 0.0))
    warm = args.steps // 4  # the first steps fill the pipeline
    return {"k": k, "keep_rate": keep_rate, "train_s_per_token": train_s_per_token,
            "step_s": statistics.fmean(steps[warm:]), "collect_s": statistics.fmean(collect_s[warm:]),
            "engine_idle_in_update_frac": update_idle / update_total, "staleness_max": max(staleness),
            "slots_freed_in_updates_per_step": freed / args.steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--keep-rates", type=float, nargs="+", default=[1.0, 0.5])
    parser.add_argument("--train-to-gen", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0],
                        help="the update's cost relative to the synchronous collection's (k = 0, keep rate 1)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--median-tokens", type=float, default=400.0)
    parser.add_argument("--sigma", type=float, default=0.8)
    parser.add_argument("--min-tokens", type=int, default=16)
    parser.add_argument("--max-tokens-cap", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--decode-step-s", type=float, default=0.03)
    parser.add_argument("--push-s", type=float, default=3.0)
    parser.add_argument("--train-fixed-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/async/simulated_results.json")
    args = parser.parse_args()

    baseline = simulate(0, 1.0, 0.0, args)  # the synchronous collection alone sets the scale
    tokens_per_step = args.batch_size * args.n * statistics.fmean(
        long_tail_tokens(s, args.median_tokens, args.sigma, args.min_tokens, args.max_tokens_cap)
        for s in range(10_000))
    results = []
    for ratio in args.train_to_gen:
        per_token = max(0.0, ratio * baseline["collect_s"] - args.train_fixed_s) / tokens_per_step
        for keep_rate in args.keep_rates:
            rows = {k: simulate(k, keep_rate, per_token, args) for k in args.ks}
            for row in rows.values():
                row["train_to_gen"] = ratio
                row["step_ratio_vs_k0"] = row["step_s"] / rows[args.ks[0]]["step_s"]
                print(json.dumps(row), flush=True)
                results.append(row)
    Path(args.out).write_text(json.dumps({"args": vars(args), "sync_collect_s": baseline["collect_s"],
                                          "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
