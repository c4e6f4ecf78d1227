"""The Megatron actor on the device: log-prob pass and one update on a length-skewed batch, through the trainer's code.

A randomly initialised model of Qwen2.5-1.5B's shape (`--layers` fewer to fit a time budget) is written as an HF
checkpoint and loaded by the trainer's `build_policies`; each step is the trainer's steps 3-5
(`trainer/workers/policy_update.py`) on a `StepBatch` of prompts x samples with log-normal response lengths (the long
tail of RL responses), with the actor's `log_probs` and `update` timed in place (the instance's methods are wrapped;
nothing else changes). The first step warms up (kernel compilation, allocator); the next one is measured.

Modes: every row of `MODES` whose config switches exist in `megatron_cpo.config` runs, one process per mode (the
padded path always; token-budget micro-batches, packing and the fused lm-head when the trainer offers them).

Reported per phase: real tokens/s (prompt + response tokens, padding excluded), MFU of the real tokens' model FLOPs
and of the padded batch's FLOPs against the device's dense bf16 peak (H100 SXM / H200: 989 TFLOPS; `--peak-tflops`
for others), the allocator's peak memory, and beside them what `tools/plan_memory.py` predicts for the same shapes
(its memory model, and its time model at its default 30% MFU).

    python -m benchmarks.gpu.actor_bench --out actor.jsonl            # on the GPU
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.gpu.report import append_record, read_records

ROOT = Path(__file__).resolve().parents[2]
QWEN25_1_5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                   num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                   rms_norm_eps=1e-6, tie_word_embeddings=True)
TINY_MODEL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, max_position_embeddings=256, rope_theta=1e4, rms_norm_eps=1e-6,
                  tie_word_embeddings=True)
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0}  # dense bf16 datasheet peaks (SXM); "H100 PCIe" is not listed


@dataclass(frozen=True)
class BatchShape:
    """prompts x samples; prompt lengths per prompt and response lengths per sample are log-normal, capped."""

    prompts: int
    n: int
    prompt_median: int
    prompt_cap: int
    response_median: int
    response_sigma: float
    response_cap: int
    micro_batch: int


GPU_BATCH = BatchShape(prompts=8, n=8, prompt_median=256, prompt_cap=512, response_median=400, response_sigma=1.0,
                       response_cap=2048, micro_batch=1)
TINY_BATCH = BatchShape(prompts=2, n=4, prompt_median=6, prompt_cap=10, response_median=8, response_sigma=1.0,
                        response_cap=24, micro_batch=2)


@dataclass(frozen=True)
class Mode:
    """A trainer mode: the config switches that turn it on (all must exist) and settings added when they exist."""

    name: str
    switches: tuple[str, ...] = ()
    settings: tuple[str, ...] = ()


MODES = [
    Mode("padded"),
    Mode("token_budget", ("actor_rollout_ref.actor.use_dynamic_bsz=true",),
         ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}",
          "actor_rollout_ref.actor.log_prob_max_token_len_per_gpu={budget}",
          "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={budget}",
          "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={budget}")),
    Mode("packed", ("actor_rollout_ref.model.use_remove_padding=true",)),
    Mode("fused_lm_head", ("actor_rollout_ref.model.use_fused_kernels=true",)),
]


def config_names() -> set[str]:
    """Every dotted name the trainer's config accepts (aliases included)."""
    from megatron_cpo.config import ALIASES, build_config, config_to_dict

    def flatten(tree: dict, prefix: str = "") -> list[str]:
        return [n for k, v in tree.items()
                for n in (flatten(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [f"{prefix}{k}"])]

    return set(flatten(config_to_dict(build_config()))) | set(ALIASES)


def offered_modes(names: set[str]) -> list[Mode]:
    """The modes whose switches all exist in the config, in `MODES` order."""
    return [m for m in MODES if all(s.split("=")[0] in names for s in m.switches)]


def mode_overrides(mode: Mode, names: set[str], budget: int) -> list[str]:
    return [*mode.switches, *(s.format(budget=budget) for s in mode.settings if s.split("=")[0] in names)]


def lengths(shape: BatchShape, seed: int) -> tuple[list[int], list[int]]:
    """Prompt length of every prompt and response length of every sample (log-normal around the medians, capped)."""
    gen = torch.Generator().manual_seed(seed)

    def log_normal(count: int, median: int, sigma: float, cap: int) -> list[int]:
        values = torch.exp(math.log(median) + sigma * torch.randn(count, generator=gen))
        return values.round().clamp(1, cap).long().tolist()

    return (log_normal(shape.prompts, shape.prompt_median, 0.5, shape.prompt_cap),
            log_normal(shape.prompts * shape.n, shape.response_median, shape.response_sigma, shape.response_cap))


def length_skewed_batch(shape: BatchShape, vocab: int, seed: int = 0):
    """A `StepBatch` of random tokens (ids >= 1; 0 pads) with log-normal lengths and mixed 0/1 scores per group."""
    from megatron_cpo.trainer.batch.step_batch import StepBatch

    prompt_lengths, response_lengths = lengths(shape, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    prompts = [torch.randint(1, vocab, (p,), generator=gen).tolist() for p in prompt_lengths]
    prompt_ids = [prompts[i // shape.n] for i in range(len(response_lengths))]
    response_ids = [torch.randint(1, vocab, (r,), generator=gen).tolist() for r in response_lengths]
    scores = (torch.arange(len(response_ids)) % 2).float()
    return StepBatch(prompt_ids, response_ids, [[-1.0] * r for r in response_lengths], scores, scores,
                     torch.arange(shape.prompts).repeat_interleave(shape.n), torch.zeros(len(response_ids),
                                                                                       dtype=torch.bool), 1.0)


def forward_flops(model: dict, seq_lengths: list[int]) -> float:
    """Model FLOPs of one forward over sequences of these lengths: 2 x matmul parameters (lm-head included, embedding
    lookup not) per token, plus causal attention 2 x layers x (heads x head_dim) x s^2 per sequence."""
    heads, kv, hidden = model["num_attention_heads"], model["num_key_value_heads"], model["hidden_size"]
    head_dim = model.get("head_dim") or hidden // heads
    attention_params = hidden * (heads + 2 * kv) * head_dim + heads * head_dim * hidden
    per_layer = attention_params + 3 * hidden * model["intermediate_size"]
    dense = model["num_hidden_layers"] * per_layer + model["vocab_size"] * hidden
    attention = 2 * model["num_hidden_layers"] * heads * head_dim
    return float(sum(2 * dense * s + attention * s * s for s in seq_lengths))


def peak_tflops(device_name: str, override: float | None) -> float | None:
    if override:
        return override
    if "PCIe" in device_name:
        return None
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device_name), None)


def write_random_model(out_dir: Path, model: dict, device: torch.device) -> Path:
    """A randomly initialised Qwen2 HF checkpoint of `model`'s shape (bf16, built on `device`), no tokenizer."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    out_dir.mkdir(parents=True, exist_ok=True)
    config = Qwen2Config(**model)
    torch.manual_seed(0)
    with torch.device(device):
        try:
            hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        except TypeError:  # transformers < 4.56 names it torch_dtype
            hf_model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    hf_model.save_pretrained(out_dir, safe_serialization=True)
    del hf_model
    return out_dir


def token_budget(padded_length: int) -> int:
    """The token budget of the modes that cut micro-batches by tokens: four of the batch's longest sequences."""
    return max(4 * padded_length, 4096)


def cuts_by_tokens(mode: Mode) -> bool:
    """Whether the mode's micro-batches are cut by the token budget (else one padded row of `micro_batch` each)."""
    return "actor_rollout_ref.actor.use_dynamic_bsz=true" in mode.switches


def plan_prediction(model_dir: Path, shape: BatchShape, max_prompt: int, padded_length: int, gpu: str,
                    by_tokens: bool) -> dict:
    """tools/plan_memory.py for this batch (padded to `padded_length` positions, micro-batches of the token budget
    when `by_tokens`, no reference, unfused attention: the local layer spec materialises attention scores)."""
    command = [sys.executable, str(ROOT / "tools" / "plan_memory.py"), "--model", str(model_dir), "--json",
               "--gpu", gpu, "--no-reference", "--unfused-attention", "--dtype", "bfloat16",
               "--train-batch-size", str(shape.prompts), "--n", str(shape.n), "--prompt-length", str(max_prompt),
               "--response-length", str(padded_length - max_prompt), "--micro-batch", str(shape.micro_batch)]
    if by_tokens:
        command += ["--dynamic-bsz", "--token-budget", str(token_budget(padded_length))]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        return {"plan_error": (proc.stderr.strip().splitlines() or ["?"])[-1][:200]}
    plan = json.loads(proc.stdout)
    times = plan.get("step_time_s", {})
    forwards = plan["batch"].get("extra_forwards", 2) or 1
    return {"plan_memory_gib": plan["memory_gib"]["total"], "plan_gpu": gpu,
            "plan_log_probs_s": times.get("log_prob_forwards", 0.0) / forwards, "plan_update_s": times.get("training"),
            "plan_mfu_assumed": 0.3}


class PhaseTimer:
    """Wraps an actor method: wall time (device synchronised) and peak memory of each call."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.calls = device, []

    def wrap(self, name: str, method):
        def timed(*args, **kwargs):
            if self.device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            result = method(*args, **kwargs)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() / 2**30
            else:
                peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # process peak RSS, GiB
            self.calls.append({"phase": name, "seconds": time.perf_counter() - start, "peak_gib": peak})
            return result
        return timed


def run_mode(mode_name: str, model_dir: Path, model: dict, shape: BatchShape, args: argparse.Namespace) -> list[dict]:
    """Build the actor for one mode, run two trainer steps (warm-up, measured) and return the measured phases."""
    from megatron_cpo import platform
    from megatron_cpo.config import build_config
    from megatron_cpo.trainer.components import policies_for, policy_update_config
    from megatron_cpo.trainer.workers.policy_update import compute_advantages, compute_log_probs, update_policy

    batch = length_skewed_batch(shape, model["vocab_size"])
    totals = (batch.prompt_ids.lengths() + batch.response_ids.lengths()).tolist()
    max_response = int(batch.response_ids.lengths().max())
    padded_length = max(totals)
    names = config_names()
    mode = next(m for m in MODES if m.name == mode_name)
    switches = mode_overrides(mode, names, budget=token_budget(padded_length))
    overrides = [f"actor_rollout_ref.model.path={model_dir}", f"data.train_batch_size={shape.prompts}",
                 f"data.max_prompt_length={shape.prompt_cap}", f"data.max_response_length={max_response}",
                 f"actor_rollout_ref.rollout.n={shape.n}",
                 f"actor_rollout_ref.actor.ppo_mini_batch_size={shape.prompts}",
                 f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={shape.micro_batch}",
                 f"actor_rollout_ref.actor.megatron.params_dtype={args.dtype}", "actor_rollout_ref.actor.optim.lr=1e-6",
                 "actor_rollout_ref.actor.use_kl_loss=false", "algorithm.adv_estimator=grpo",
                 *switches]
    platform.init_distributed(1, 1, seed=1)
    config = build_config({}, overrides)
    actor, reference = policies_for(config, pad_token_id=0, total_updates=4)
    settings = policy_update_config(config)
    device = platform.device()
    timer = PhaseTimer(device)
    actor.log_probs = timer.wrap("log_probs", actor.log_probs)  # CPO's hinted pass
    actor.log_probs_and_routing = timer.wrap("log_probs", actor.log_probs_and_routing)  # the old log-probs
    actor.update = timer.wrap("update", actor.update)
    actor.update_on_policy = timer.wrap("update", actor.update_on_policy)  # one epoch, one mini-batch
    for _ in range(2):
        timer.calls.clear()
        log_probs = compute_log_probs(batch, actor, reference, settings, pad_token_id=0)  # steps 3-5 of Trainer.step
        if log_probs.old_log_probs is None:  # on-policy: the update scores the batch itself; time that pass alone too
            actor.log_probs_and_routing(log_probs.seqs, config.actor_rollout_ref.rollout.log_prob_temperature)
        advantages, metrics = compute_advantages(batch, log_probs, settings)
        metrics.update(update_policy(actor, batch, log_probs, advantages, settings).metrics)
    real_tokens = sum(totals)
    flops_real = forward_flops(model, totals)
    flops_padded = forward_flops(model, [padded_length] * len(totals))
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    peak = peak_tflops(name, args.peak_tflops)
    records = []
    for call in timer.calls:
        factor = 3.0 if call["phase"] == "update" else 1.0
        seconds = call["seconds"]
        records.append({
            "mode": mode_name, "phase": call["phase"], "layers": model["num_hidden_layers"], "rows": len(totals),
            "real_tokens": real_tokens, "padded_positions": len(totals) * padded_length,
            "micro_batch": shape.micro_batch, "seconds": seconds, "real_tokens_per_s": real_tokens / seconds,
            "model_tflops_real": factor * flops_real / seconds / 1e12,
            "mfu_real": factor * flops_real / seconds / (peak * 1e12) if peak else None,
            "mfu_padded": factor * flops_padded / seconds / (peak * 1e12) if peak else None,
            "peak_tflops": peak, "peak_gib": call["peak_gib"],
            "peak_memory_kind": "allocator peak" if device.type == "cuda" else "process peak RSS",
            "loss": metrics.get("actor/pg_loss"), "overrides": switches or None})
    return records


def _child(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    model = json.loads(Path(args.model_dir, "shape.json").read_text())
    shape = BatchShape(**json.loads(args.batch))
    for record in run_mode(args.child_mode, Path(args.model_dir), model, shape, args):
        append_record(args.out, {**record, "status": "ok"})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="append one JSON line per mode and phase here")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and batch on CPU/gloo (the smoke test)")
    parser.add_argument("--layers", type=int, default=None, help="transformer layers (default: Qwen2.5-1.5B's 28)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default: by name)")
    parser.add_argument("--modes", default=None, help="comma-separated subset of the offered modes")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (gloo runs)")
    parser.add_argument("--deadline", type=float, default=float("inf"), help="unix time to stop starting modes")
    parser.add_argument("--child-mode", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--batch", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_mode:
        return _child(args)

    device = torch.device(args.device)
    model = dict(TINY_MODEL if args.tiny else QWEN25_1_5B)
    if args.layers:
        model["num_hidden_layers"] = args.layers
    shape = TINY_BATCH if args.tiny else GPU_BATCH
    names = config_names()
    modes = offered_modes(names)
    if args.modes:
        wanted = args.modes.split(",")
        unknown = [m for m in wanted if m not in {mode.name for mode in modes}]
        if unknown:
            parser.error(f"modes {unknown} are not offered by this config; offered: {[m.name for m in modes]}")
        modes = [m for m in modes if m.name in wanted]
    print(f"actor modes offered by the config: {[m.name for m in modes]}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_check_model_"))
    try:
        write_random_model(work, model, device)
        (work / "shape.json").write_text(json.dumps(model))
        prompt_lengths, response_lengths = lengths(shape, 0)
        totals = [prompt_lengths[i // shape.n] + r for i, r in enumerate(response_lengths)]
        gpu = "h200" if device.type == "cuda" and "H200" in torch.cuda.get_device_name() else "h100-sxm"
        plans: dict[bool, dict] = {}  # by whether the mode cuts micro-batches by tokens (one planner run each)
        for mode in modes:
            base = {"mode": mode.name, "layers": model["num_hidden_layers"]}
            remaining = args.deadline - time.time()
            if remaining < 15:
                append_record(args.out, {**base, "status": "skipped", "note": "time budget"})
                continue
            before = len(read_records(args.out))
            command = [sys.executable, "-m", "benchmarks.gpu.actor_bench", "--out", args.out, "--device", args.device,
                       "--dtype", args.dtype, "--threads", str(args.threads), "--child-mode", mode.name,
                       "--model-dir", str(work), "--batch", json.dumps(asdict(shape))]
            if args.peak_tflops:
                command += ["--peak-tflops", str(args.peak_tflops)]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
            try:
                proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                                      timeout=None if math.isinf(remaining) else remaining)
                note = None if proc.returncode == 0 else \
                    (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]
            except subprocess.TimeoutExpired:
                note = "time budget: stopped"
            if note:
                append_record(args.out, {**base, "status": "failed", "note": note})
                print(f"actor mode {mode.name}: {note}", flush=True)
                if note != "time budget: stopped":
                    print("\n".join(proc.stderr.strip().splitlines()[-40:]), flush=True)
            by_tokens = cuts_by_tokens(mode)
            if by_tokens not in plans:
                plans[by_tokens] = plan_prediction(work, shape, max(prompt_lengths), max(totals), gpu, by_tokens)
            for record in _add_plan(args.out, before, plans[by_tokens]):
                print(record, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _add_plan(path: str, start: int, plan: dict) -> list[dict]:
    """Add the plan_memory.py prediction to the records a mode's process appended (from line `start` on)."""
    records = read_records(path)
    for record in records[start:]:
        if record.get("status") == "ok" and "plan_memory_gib" not in record:
            seconds = plan.get(f"plan_{record['phase']}_s")
            record.update({"plan_memory_gib": plan.get("plan_memory_gib"), "plan_seconds": seconds,
                           "plan_real_tokens_per_s": record["real_tokens"] / seconds if seconds else None,
                           "plan_gpu": plan.get("plan_gpu"), "plan_mfu_assumed": plan.get("plan_mfu_assumed"),
                           "plan_error": plan.get("plan_error")})
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in records))
    return records[start:]


if __name__ == "__main__":
    raise SystemExit(main())
