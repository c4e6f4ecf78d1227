"""The colocated actor offload on the device: parameters, gradients and optimizer state to pinned host memory and back.

A randomly initialised model of Qwen2.5-1.5B's shape (8 of its layers by default, `--layers`) is written as an HF
checkpoint and built twice by the trainer's `build_policies` (bf16, distributed Adam); both take one trainer step
(log-probs, advantages, update), then one is offloaded with `trainer/workers/offload.py` (all three parts, as
`actor.megatron.{param,grad,optimizer}_offload=true` in `rollout.mode=colocate`) and reloaded. Recorded: the bytes
of each part, the allocator's allocated memory before, while offloaded and after reload (the offloaded bytes must
really leave the device and come back), the copy times and bandwidths, whether every parameter, gradient and
optimizer tensor came back bit-identical, and whether one more step of both actors gives the same metrics and
parameters.

With `--tiny` on CPU (the smoke test) the same code runs on the suite-sized model, the "host" copy being a separate
CPU buffer; allocator figures are then not applicable (None).

    python -m benchmarks.gpu.offload_check --out offload.jsonl            # on the GPU
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.gpu.actor_bench import (
    QWEN25_1_5B,
    TINY_BATCH,
    TINY_MODEL,
    BatchShape,
    length_skewed_batch,
    write_random_model,
)
from benchmarks.gpu.report import append_record

GPU_BATCH = BatchShape(prompts=4, n=4, prompt_median=128, prompt_cap=256, response_median=256, response_sigma=0.5,
                       response_cap=512, micro_batch=4)
PARTS = ("params", "grads", "optimizer")


def _allocated(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def round_trip(model_dir: Path, shape: BatchShape, vocab: int, device: torch.device) -> dict:
    """Build two identical actors, step both, offload and reload one, step both again; the record of it."""
    from megatron_cpo import platform
    from megatron_cpo.config import build_config
    from megatron_cpo.trainer.components import policies_for, policy_update_config
    from megatron_cpo.trainer.workers.offload import actor_tensors, colocated_offload
    from megatron_cpo.trainer.workers.policy_update import compute_advantages, compute_log_probs, update_policy

    batch = length_skewed_batch(shape, vocab)
    config = build_config({}, [
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_batch_size={shape.prompts}",
        f"data.max_prompt_length={shape.prompt_cap}", f"data.max_response_length={shape.response_cap}",
        f"actor_rollout_ref.rollout.n={shape.n}", f"actor_rollout_ref.actor.ppo_mini_batch_size={shape.prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={shape.micro_batch}",
        "actor_rollout_ref.actor.megatron.params_dtype=bfloat16", "actor_rollout_ref.actor.optim.lr=1e-4",
        "actor_rollout_ref.actor.megatron.param_offload=true", "actor_rollout_ref.actor.megatron.grad_offload=true",
        "actor_rollout_ref.actor.megatron.optimizer_offload=true", "algorithm.adv_estimator=grpo"])
    platform.init_distributed(1, 1, seed=1)
    offloaded, _ = policies_for(config, pad_token_id=0, total_updates=4)
    plain, _ = policies_for(config, pad_token_id=0, total_updates=4)
    settings = policy_update_config(config)
    offload = colocated_offload(offloaded, config.actor_rollout_ref.actor.megatron, "colocate")

    def train(actor):  # steps 3-5 of Trainer.step, without a reference
        log_probs = compute_log_probs(batch, actor, None, settings, pad_token_id=0)
        advantages, metrics = compute_advantages(batch, log_probs, settings)
        metrics.update(update_policy(actor, batch, log_probs, advantages, settings).metrics)
        return {k: v for k, v in metrics.items() if not k.startswith("timing/")}  # wall times differ

    for actor in (offloaded, plain):
        train(actor)
    tensors = actor_tensors(offloaded.model, offloaded.ddp_model, offloaded.optimizer)
    before = {part: [t.detach().cpu().clone() for t in group] for part, group in tensors.items()}

    loaded_bytes = _allocated(device)
    start = time.perf_counter()
    freed = offload.offload()
    offload_s = time.perf_counter() - start
    offloaded_bytes = _allocated(device)
    released = all(s.nbytes() == 0 for part in PARTS for s in offload.storages(part))
    start = time.perf_counter()
    restored = offload.reload()
    reload_s = time.perf_counter() - start
    reloaded_bytes = _allocated(device)
    identical = {part: all(torch.equal(a.cpu(), b) for a, b in zip(tensors[part], before[part])) for part in PARTS}

    after = [train(actor) for actor in (offloaded, plain)]
    same_step = after[0] == after[1] and all(
        torch.equal(a, b) for a, b in zip(offloaded.model.parameters(), plain.model.parameters()))
    platform.destroy_distributed()
    # every offloaded byte leaves the allocator and comes back (it counts whole blocks, so at least the bytes moved;
    # a re-allocated block may be rounded differently, so the reloaded total need not equal the first to the byte)
    device_released = loaded_bytes is None or loaded_bytes - offloaded_bytes >= freed
    device_restored = reloaded_bytes is None or reloaded_bytes - offloaded_bytes >= restored
    passed = (released and device_released and device_restored and freed == restored > 0
              and all(identical.values()) and same_step)
    return {
        **{f"{part}_gib": offload.nbytes(part) / 2**30 for part in PARTS}, "offloaded_gib": freed / 2**30,
        "allocated_gib": None if loaded_bytes is None else loaded_bytes / 2**30,
        "allocated_offloaded_gib": None if offloaded_bytes is None else offloaded_bytes / 2**30,
        "allocated_reloaded_gib": None if reloaded_bytes is None else reloaded_bytes / 2**30,
        "offload_s": offload_s, "reload_s": reload_s, "offload_gb_s": freed / offload_s / 1e9,
        "reload_gb_s": restored / reload_s / 1e9, "storages_released": released, "device_released": device_released,
        "device_restored": device_restored,
        **{f"identical_{part}": identical[part] for part in PARTS}, "identical": all(identical.values()),
        "next_step_identical": same_step,
        "status": "ok" if passed else "failed"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="append one JSON line here")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="the tiny model on CPU/gloo (the smoke test)")
    parser.add_argument("--layers", type=int, default=8, help="transformer layers of the Qwen2.5-1.5B shape")
    parser.add_argument("--deadline", type=float, default=float("inf"), help="unix time (accepted for run_check)")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    device = torch.device(args.device)
    model = dict(TINY_MODEL if args.tiny else {**QWEN25_1_5B, "num_hidden_layers": args.layers})
    shape = TINY_BATCH if args.tiny else GPU_BATCH
    work = Path(tempfile.mkdtemp(prefix="gpu_check_offload_"))
    try:
        write_random_model(work, model, device)
        record = round_trip(work, shape, model["vocab_size"], device)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    append_record(args.out, {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                             "layers": model["num_hidden_layers"], **record})
    print(f"offload round trip: {record['status']}", flush=True)
    return 0 if record["status"] == "ok" else 1


if __name__ == "__main__":
    raise SystemExit(main())
