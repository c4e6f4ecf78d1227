"""Evaluate a model on verl-schema parquet files: pass@k and mean@k per data source, with vLLM rollout engines.

Each prompt is sampled `n` times by the trainer's engines and graded by its `data_source`'s grader; reported per
source and overall: `mean@n`, unbiased `pass@k` (Chen et al., 2021) and `score@n` (docs/eval.md). Lengths are
checked against the model's positions before anything starts.
"""
from __future__ import annotations

import argparse
import json
import logging
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from megatron_cpo.compute_dtype import PARAMS_DTYPES, resolve_dtype
from megatron_cpo.progress import ProgressLine


def pass_at_k(num_correct: np.ndarray, num_samples: int, k: int) -> np.ndarray:
    """Unbiased pass@k per prompt from `num_correct` (int array) out of `num_samples`, vectorised over prompts:
    1 - prod_{j<k} (n - c - j) / (n - j), which equals 1 - C(n-c, k)/C(n, k) without overflowing."""
    if not 1 <= k <= num_samples:
        raise ValueError(f"pass@{k} needs 1 <= k <= n={num_samples} samples per prompt")
    steps = np.arange(k)
    failing = np.clip(num_samples - np.asarray(num_correct)[:, None] - steps, 0, None)
    return 1.0 - np.prod(failing / (num_samples - steps), axis=1)


def pass_ks(num_samples: int) -> list[int]:
    """The k reported for n samples: powers of two below n, and n itself."""
    ks = [1 << i for i in range(num_samples.bit_length()) if 1 << i < num_samples]
    return ks + [num_samples]


def summarize(correct: np.ndarray, scores: np.ndarray) -> dict[str, float]:
    """Metrics of a [prompts, n] boolean `correct` matrix and float `scores` matrix."""
    num_prompts, num_samples = correct.shape
    summary = {"num_prompts": float(num_prompts), f"mean@{num_samples}": float(correct.mean()),
               f"score@{num_samples}": float(scores.mean())}
    num_correct = correct.sum(axis=1)
    for k in pass_ks(num_samples):
        summary[f"pass@{k}"] = float(pass_at_k(num_correct, num_samples, k).mean())
    return summary


def summarize_by_source(sources: list[str], correct: np.ndarray, scores: np.ndarray) -> dict[str, dict[str, float]]:
    """`summarize` per data source (sorted) plus "all" over every prompt."""
    rows_by_source: dict[str, list[int]] = defaultdict(list)
    for row, source in enumerate(sources):
        rows_by_source[source].append(row)
    report = {source: summarize(correct[rows], scores[rows]) for source, rows in sorted(rows_by_source.items())}
    report["all"] = summarize(correct, scores)
    return report


@dataclass
class EvalConfig:
    """What to evaluate and how to sample it."""

    data_files: list[str]
    model_path: str
    n: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    max_prompt_length: int = 1024
    max_response_length: int = 1024
    max_prompts: int = 0
    num_engines: int = 1
    tensor_model_parallel_size: int = 1
    dtype: str = "auto"
    seed: int = 0
    output_dir: str = ""
    ray_address: str = "auto"

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"--n={self.n}: sample at least one response per prompt")
        if self.temperature == 0 and self.n > 1:
            raise ValueError(f"--temperature 0 (greedy) with --n={self.n} repeats one answer n times; use --n 1 "
                             "or a positive temperature")
        if self.max_prompts < 0:
            raise ValueError(f"--max-prompts={self.max_prompts} must be >= 0 (0: every prompt)")
        if self.max_prompt_length < 1 or self.max_response_length < 1:
            raise ValueError(f"--max-prompt-length={self.max_prompt_length} and --max-response-length="
                             f"{self.max_response_length} must both be >= 1")


def check_lengths(config: EvalConfig) -> None:
    """Prompt + response tokens must fit the model's positions (vLLM would otherwise fail deep in engine start)."""
    from megatron_cpo.models import load_hf_config

    positions = getattr(load_hf_config(config.model_path), "max_position_embeddings", None)
    total = config.max_prompt_length + config.max_response_length
    if positions is not None and total > positions:
        raise ValueError(f"--max-prompt-length {config.max_prompt_length} + --max-response-length "
                         f"{config.max_response_length} = {total} tokens exceed the {positions} positions of "
                         f"{config.model_path} (max_position_embeddings); lower them so they sum to at most "
                         f"{positions}")


def generate_and_grade(config: EvalConfig) -> tuple[list[str], np.ndarray, np.ndarray, list[dict]]:
    """Sample every prompt n times and grade each sample; returns (data sources, correct, scores, sample records)."""
    from transformers import AutoTokenizer

    from megatron_cpo.data import DataConfig, PromptDataset
    from megatron_cpo.rewards import compute_score
    from megatron_cpo.rewards.registry import missing_grader_message, missing_graders
    from megatron_cpo.rollout import EngineLaunchConfig, RolloutEngineConfig, RolloutManager, SamplingParams

    check_lengths(config)
    tokenizer = AutoTokenizer.from_pretrained(config.model_path)
    dataset = PromptDataset(config.data_files, tokenizer,
                            DataConfig(max_prompt_length=config.max_prompt_length, truncation="left"))
    records = dataset.records[:config.max_prompts] if config.max_prompts else dataset.records
    missing = missing_graders(record.data_source for record in records)
    if missing:  # before the engines start
        raise ValueError(missing_grader_message(missing, ", ".join(config.data_files)))
    dtype = resolve_dtype(config.dtype)
    dtype.announce(logging.getLogger(__name__), "the engines", "--dtype")
    rollout = EngineLaunchConfig(model_path=config.model_path, engines=RolloutEngineConfig(
        num_engines=config.num_engines, tensor_model_parallel_size=config.tensor_model_parallel_size,
        ray_address=config.ray_address), dtype=dtype.name,
        max_model_len=config.max_prompt_length + config.max_response_length, seed=config.seed)
    stop = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    groups = {}
    with RolloutManager(rollout) as manager:
        for record in records:
            params = SamplingParams(n=config.n, temperature=config.temperature, top_p=config.top_p,
                                    max_tokens=config.max_response_length, stop_token_ids=stop,
                                    seed=config.seed * 1_000_003 + record.index)
            manager.submit(str(record.index), record.prompt_ids, params)
        progress = ProgressLine("eval", len(records), "prompts")
        for group in manager.completed():
            groups[int(group.request_id)] = group
            progress.update(len(groups))
    correct = np.zeros((len(records), config.n), dtype=bool)
    scores = np.zeros((len(records), config.n))
    samples = []
    for row, record in enumerate(records):
        texts = tokenizer.batch_decode([s.token_ids for s in groups[record.index].samples], skip_special_tokens=True)
        for column, (text, sample) in enumerate(zip(texts, groups[record.index].samples)):
            result = compute_score(record.data_source, text, record.ground_truth, record.extra_info)
            correct[row, column], scores[row, column] = result["acc"], result["score"]
            samples.append({"index": record.index, "sample": column, "data_source": record.data_source,
                            "response": text, "ground_truth": record.ground_truth, "acc": bool(result["acc"]),
                            "score": float(result["score"]), "pred": None if result.get("pred") is None
                            else str(result["pred"]), "truncated": sample.truncated})
    return [record.data_source for record in records], correct, scores, samples


def format_table(report: dict[str, dict[str, float]]) -> str:
    """A fixed-width table: one row per data source, one column per metric."""
    columns = list(report["all"])
    width = max(len(source) for source in report) + 2
    lines = ["source".ljust(width) + "".join(c.rjust(12) for c in columns)]
    for source, metrics in report.items():
        cells = "".join((f"{metrics[c]:.0f}" if c == "num_prompts" else f"{metrics[c]:.4f}").rjust(12) for c in columns)
        lines.append(source.ljust(width) + cells)
    return "\n".join(lines)


def run_eval(config: EvalConfig) -> dict[str, dict[str, float]]:
    """Evaluate and, with `output_dir`, write `metrics.json` (report + config) and `samples.jsonl`."""
    sources, correct, scores, samples = generate_and_grade(config)
    report = summarize_by_source(sources, correct, scores)
    if config.output_dir:
        out = Path(config.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps({"metrics": report, "config": asdict(config)}, indent=1))
        with (out / "samples.jsonl").open("w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(sample) + "\n" for sample in samples)
    return report


def add_eval_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Flags of `megatron-cpo eval`."""
    parser.add_argument("--data", nargs="+", required=True, help="verl-schema parquet file(s) (tools/prepare_data.py)")
    parser.add_argument("--model", required=True, help="HF model directory (config, weights, tokenizer)")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt; pass@k is reported for k up to n "
                        "(default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="sampling temperature; 0 is greedy and needs --n 1 (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    parser.add_argument("--max-prompt-length", type=int, default=1024,
                        help="prompt tokens kept (longer prompts lose their start); with --max-response-length it "
                        "must fit the model's max_position_embeddings (default: %(default)s)")
    parser.add_argument("--max-response-length", type=int, default=1024,
                        help="tokens generated at most per sample (default: %(default)s)")
    parser.add_argument("--max-prompts", type=int, default=0, help="evaluate the first N prompts only (0: all)")
    parser.add_argument("--num-engines", type=int, default=1, help="vLLM engines sharing the prompts "
                        "(default: %(default)s)")
    parser.add_argument("--tensor-model-parallel-size", "--tensor-parallel-size", type=int, default=1,
                        help="GPUs per vLLM engine (default: %(default)s)")
    parser.add_argument("--dtype", default="auto", choices=PARAMS_DTYPES,
                        help="engine weights' dtype; auto: bfloat16 where the machine multiplies it natively, else "
                        "float32 (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed; each prompt's samples are seeded from "
                        "it and the prompt's index, so a rerun reproduces them (default: %(default)s)")
    parser.add_argument("--output-dir", default="", help="write metrics.json, samples.jsonl and eval.log here")
    parser.add_argument("--ray-address", default="auto",
                        help="'auto' (default): join the Ray cluster in RAY_ADDRESS when that is set (as the SLURM "
                        "launcher sets it), else start a private local one; 'local': always a private one; "
                        "'host:port': join that cluster")
    return parser


def run_eval_command(args: argparse.Namespace) -> None:
    """`megatron-cpo eval`: print the per-source table (and write files with --output-dir)."""
    from megatron_cpo.console import setup_logging

    setup_logging(Path(args.output_dir) / "eval.log" if args.output_dir else None)
    config = EvalConfig(data_files=args.data, model_path=args.model, n=args.n, temperature=args.temperature,
                        top_p=args.top_p, max_prompt_length=args.max_prompt_length,
                        max_response_length=args.max_response_length, max_prompts=args.max_prompts,
                        num_engines=args.num_engines, tensor_model_parallel_size=args.tensor_model_parallel_size,
                        dtype=args.dtype,
                        seed=args.seed, output_dir=args.output_dir, ray_address=args.ray_address)
    print(format_table(run_eval(config)), flush=True)
