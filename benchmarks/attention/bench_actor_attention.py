"""SmolLM2-135M's actor on CPU at response lengths 128, 1024 and 4096: the local attention against torch's fused one.

The actor alone (no engines), through the trainer's own `build_policies`, `compute_log_probs` and `update_policy`, on
a batch of random tokens per response length (a 52-token prompt; responses spread evenly up to the length, more rows
at short lengths so each step holds about 4-6k tokens), with the example's settings (examples/smollm2-135m/grpo.yaml:
`params_dtype: auto`, token-budget micro-batches, the fused lm-head, selective recompute of the attention; the budget
raised to the longest sequence). Settings: `local` (Megatron-Core's attention, the before), `fused` (torch's fused
attention, the default now) and `fused_packed` (the same with packed sequences, `use_remove_padding`). Each (length,
setting) runs in a fresh process, settings alternated `--rounds` times; each process times `--repeats` steps after one
warm-up step and reports the median CPU seconds (user + system) and wall seconds of the old-log-prob pass and of the
update, and its peak RSS.

    python benchmarks/attention/bench_actor_attention.py --out benchmarks/attention/actor_results.jsonl
    python benchmarks/attention/bench_actor_attention.py --markdown benchmarks/attention/actor_results.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks/real_model"))

from alternated import cpu_seconds, print_result, run_alternated  # noqa: E402

MODEL = ROOT / "examples/smollm2-135m/model"
CONFIG = ROOT / "examples/smollm2-135m/grpo.yaml"
PROMPT = 52
# response length: (prompts, samples per prompt, shortest response)
LENGTHS = {128: (4, 8, 24), 1024: (1, 8, 192), 4096: (1, 2, 2048)}
SETTINGS = {"local": ["actor_rollout_ref.actor.megatron.attention_backend=local"],
            "fused": ["actor_rollout_ref.actor.megatron.attention_backend=auto"],
            "fused_packed": ["actor_rollout_ref.actor.megatron.attention_backend=auto",
                             "actor_rollout_ref.model.use_remove_padding=true"]}


def make_batch(response_length: int, seed: int = 0):
    """A StepBatch of random tokens: `LENGTHS[response_length]` prompts x samples, responses spread evenly."""
    import torch

    from megatron_cpo.trainer.batch.step_batch import StepBatch

    prompts, n, shortest = LENGTHS[response_length]
    generator = torch.Generator().manual_seed(seed)
    rows = prompts * n
    lengths = torch.linspace(shortest, response_length, rows).round().long()[torch.randperm(rows, generator=generator)]
    prompt_ids = [torch.randint(100, 40000, (PROMPT,), generator=generator).tolist() for _ in range(prompts)]
    return StepBatch(
        prompt_ids=[prompt_ids[row // n] for row in range(rows)],
        response_ids=[torch.randint(100, 40000, (int(k),), generator=generator).tolist() for k in lengths],
        rollout_log_probs=[[-1.0] * int(k) for k in lengths],
        scores=(torch.arange(rows) % 2).float(), acc=torch.zeros(rows), group=torch.arange(rows) // n,
        truncated=torch.zeros(rows, dtype=torch.bool), kept_ratio=1.0)


def overrides(response_length: int, setting: str) -> list[str]:
    prompts, n, _ = LENGTHS[response_length]
    budget = max(1024, PROMPT + response_length)  # the example's 1024, or the longest sequence
    return [f"actor_rollout_ref.model.path={MODEL}", f"data.train_batch_size={prompts}",
            f"actor_rollout_ref.rollout.n={n}", f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
            f"data.max_response_length={response_length}",
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}",
            f"actor_rollout_ref.actor.log_prob_max_token_len_per_gpu={max(4096, budget)}", *SETTINGS[setting]]


def run_case(name: str, repeats: int, port: int) -> dict:
    """`name` is `<response length>:<setting>`: build the actor and time `repeats` steps after one warm-up."""
    import torch

    from megatron_cpo import platform
    from megatron_cpo.config import load_config
    from megatron_cpo.models.builder import unwrap_model
    from megatron_cpo.trainer.components import policies_for, policy_update_config
    from megatron_cpo.trainer.workers import policy_update
    from megatron_cpo.trainer.workers.policy_update import compute_advantages, compute_log_probs, update_policy

    length, setting = int(name.split(":")[0]), name.split(":")[1]
    policy_update.old_log_probs_from_update = lambda settings: False  # time the old-log-prob pass on its own
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    config = load_config(str(CONFIG), overrides(length, setting))
    platform.init_distributed(1, 1, seed=1)
    actor, reference = policies_for(config, pad_token_id=2, total_updates=repeats + 1)
    settings = policy_update_config(config)
    batch = make_batch(length)
    steps = []
    for index in range(repeats + 1):
        times = {}
        for part in ("log_probs", "update"):
            start_wall, start_cpu = time.perf_counter(), cpu_seconds()
            if part == "log_probs":
                log_probs = compute_log_probs(batch, actor, reference, settings, pad_token_id=2)
                advantages, _ = compute_advantages(batch, log_probs, settings)
            else:
                metrics = update_policy(actor, batch, log_probs, advantages, settings).metrics
            times[part] = (time.perf_counter() - start_wall, cpu_seconds() - start_cpu)
        if index:
            steps.append({"log_prob_s": times["log_probs"][0], "log_prob_cpu_s": times["log_probs"][1],
                          "update_s": times["update"][0], "update_cpu_s": times["update"][1],
                          "train_tokens": metrics["timing/train_tokens"]})
    result = {"case": name, "response_length": length, "setting": setting, "rows": len(batch.scores),
              "attention": unwrap_model(actor.model).attention_kind, "dtype": config.actor_rollout_ref.actor.megatron
              .compute_dtype, "torch_threads": torch.get_num_threads(), "load_1min_end": os.getloadavg()[0],
              "max_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}
    platform.destroy_distributed()
    for key in ("log_prob_s", "log_prob_cpu_s", "update_s", "update_cpu_s", "train_tokens"):
        result[key] = round(statistics.median(step[key] for step in steps), 2)
    result["steps"] = steps
    return result


def markdown(path: str) -> str:
    """The README's table: per response length and setting, the medians over rounds, and the ratio to `local`."""
    rows: dict[str, list[dict]] = {}
    for line in Path(path).read_text().splitlines():
        record = json.loads(line)
        rows.setdefault(record["case"], []).append(record)
    lines = ["| response length | rows | tokens | setting | attention | log-prob CPU s (wall) | update CPU s (wall) | "
             "actor CPU s vs local | peak RSS GiB | load (start-end) | runs |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    medians = {case: {key: statistics.median(r[key] for r in records) for key in
                      ("log_prob_cpu_s", "log_prob_s", "update_cpu_s", "update_s", "max_rss_gib")}
               for case, records in rows.items()}
    for case in sorted(rows, key=lambda c: (int(c.split(":")[0]), list(SETTINGS).index(c.split(":")[1]))):
        first, m = rows[case][0], medians[case]
        local = medians.get(f"{first['response_length']}:local")
        ratio = ((m["log_prob_cpu_s"] + m["update_cpu_s"]) / (local["log_prob_cpu_s"] + local["update_cpu_s"])
                 if local else None)
        loads = [r["load_1min_start"] for r in rows[case]] + [r["load_1min_end"] for r in rows[case]]
        lines.append(f"| {first['response_length']} | {first['rows']} | {first['train_tokens']:.0f} | "
                     f"{first['setting']} | {first['attention']} | {m['log_prob_cpu_s']:.1f} ({m['log_prob_s']:.1f}) | "
                     f"{m['update_cpu_s']:.1f} ({m['update_s']:.1f}) | {f'{ratio:.2f}x' if ratio else ''} | "
                     f"{m['max_rss_gib']:.2f} | {min(loads):.0f}-{max(loads):.0f} | {len(rows[case])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", nargs="+", type=int, default=list(LENGTHS), choices=sorted(LENGTHS))
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--port", type=int, default=29661)
    parser.add_argument("--out", default="benchmarks/attention/actor_results.jsonl")
    parser.add_argument("--markdown", metavar="RESULTS", help="print the table of a results JSONL and exit")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one case in this process
    args = parser.parse_args()
    if args.markdown:
        print(markdown(args.markdown))
        return
    if args.one:
        print_result(run_case(args.one, args.repeats, args.port))
        return
    if not (MODEL / "config.json").is_file():
        sys.exit(f"error: no model at {MODEL}; fetch it once with python tools/fetch_smollm2.py")
    cases = [f"{length}:{setting}" for length in args.lengths for setting in args.settings]
    run_alternated(__file__, cases, args.rounds, ["--repeats", str(args.repeats), "--port", str(args.port)],
                   args.out, ROOT)


if __name__ == "__main__":
    main()
