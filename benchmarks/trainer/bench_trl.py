"""TRL's GRPOTrainer on the quickstart's model, data and batch, on CPU: seconds per step and generated tokens/s.

Runs in its own environment (TRL is not a dependency of megatron-cpo), e.g.

    python -m venv ../trl-venv
    ../trl-venv/bin/pip install torch==2.13.0 trl math-verify==0.9.0 pandas pyarrow   # torch: the CPU build
    python -m megatron_cpo.data.synthetic --out DIR --keep-levels 1 2
    PYTHONPATH=$PWD ../trl-venv/bin/python benchmarks/trainer/bench_trl.py --data DIR/train.parquet --steps 12

The setting matches examples/tiny/grpo_arith.yaml: 8 prompts x 8 samples per step (one optimizer step per generation
batch), at most 48 new tokens, temperature 1, lr 1e-4 with 2 warm-up steps, clip 0.2/0.2, token-mean loss (TRL's
"dapo" loss type), rewards normalised by the group's std, no KL term and so no reference model. The reward is
megatron-cpo's own arithmetic grader (`megatron_cpo.rewards.compute_score`, which imports no torch). Differences
that stay: TRL generates with `transformers.generate` in the training process (no vLLM on CPU here), our trainer with
a vLLM engine in a Ray actor plus a weight push per step; TRL runs the 64 completions' forward/backward as one batch,
or, with `--grad-accum g` (where that batch does not fit in memory: SmolLM2's 64 x 128-token batch took TRL past
24 GB), as g micro-batches of 64 / g accumulated into the same single optimizer step of one generation batch.
The first `--warmup` steps are left out of the means.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def arithmetic_reward(prompts, completions, data_source, reward_model, extra_info, **_):
    """TRL reward function: megatron-cpo's grader score for each completion (conversational format)."""
    from megatron_cpo.rewards import compute_score

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(compute_score(source, text, model["ground_truth"], info)["score"])
            for source, text, model, info in zip(data_source, texts, reward_model, extra_info)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="train.parquet of megatron_cpo.data.synthetic --keep-levels 1 2")
    parser.add_argument("--model", default="examples/tiny/model")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (rollout.temperature)")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (fp32 master weights), as our bf16 actor")
    parser.add_argument("--grad-accum", type=int, default=1,
                        help="micro-batches per optimizer step (one generation batch of prompts x n either way)")
    parser.add_argument("--out", default="benchmarks/trainer/trl_results.json")
    args = parser.parse_args()
    if (args.prompts * args.n) % args.grad_accum:
        parser.error(f"--grad-accum {args.grad_accum} must divide the {args.prompts * args.n} completions of a step")

    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepTimer(TrainerCallback):
        """Wall time of each optimizer step (generation, reward, loss, backward, update) and its logged metrics."""

        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.logs: list[dict] = []
            self._start = 0.0

        def on_step_begin(self, *_, **__):
            self._start = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.seconds.append(time.perf_counter() - self._start)

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "completions/mean_length" in logs:
                self.logs.append(dict(logs))

    dataset = datasets.load_dataset("parquet", data_files=args.data, split="train")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = GRPOConfig(
        output_dir=str(Path(args.out).with_suffix("")) + "_run", use_cpu=True, bf16=args.bf16, seed=1,
        max_steps=args.steps, per_device_train_batch_size=args.prompts * args.n // args.grad_accum,
        gradient_accumulation_steps=args.grad_accum, num_generations=args.n, steps_per_generation=args.grad_accum,
        num_iterations=1, max_completion_length=args.max_new_tokens,
        temperature=args.temperature, top_p=1.0, learning_rate=args.lr, warmup_steps=2,
        lr_scheduler_type="constant_with_warmup",
        max_grad_norm=1.0, epsilon=0.2, beta=0.0, loss_type="dapo", scale_rewards="group", logging_steps=1,
        save_strategy="no", report_to=[], dataloader_num_workers=0, disable_dropout=True, gradient_checkpointing=False)
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=arithmetic_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[timer])
    load_before = os.getloadavg()
    trainer.train()
    load_after = os.getloadavg()

    lengths = [log["completions/mean_length"] for log in timer.logs]
    tokens = [length * args.prompts * args.n for length in lengths]
    measured = list(zip(timer.seconds, tokens))[args.warmup:]
    step_s = [seconds for seconds, _ in measured]
    tokens_per_s = [count / seconds for seconds, count in measured]
    result = {
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
                     "datasets": datasets.__version__},
        "args": vars(args), "torch_threads": torch.get_num_threads(),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "load_1min_before_after": [load_before[0], load_after[0]],
        "step_s_mean": statistics.fmean(step_s), "step_s_median": statistics.median(step_s),
        "tokens_per_s_mean": statistics.fmean(tokens_per_s),
        "mean_completion_length": statistics.fmean(lengths[args.warmup:]),
        "reward_mean": statistics.fmean(log.get("reward", 0.0) for log in timer.logs[args.warmup:]),
        "step_s_all": timer.seconds, "generated_tokens_all": tokens,
    }
    print(json.dumps({k: v for k, v in result.items() if not k.endswith("_all")}), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
