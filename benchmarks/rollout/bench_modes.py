"""Step-time breakdown per rollout mode (ray / server / colocate) on the quickstart's tiny GRPO config.

Each mode trains the same shortened run (`--steps` steps, `--batch` prompts x `--n` samples, `--max-tokens` new
tokens) from examples/tiny/grpo_arith.yaml and reports, per step after the first (the first includes warm-up), the
medians of the metrics the trainer logs: `timing/gen_s` (generation wall time), `timing/weight_sync_s` (weight
push), `timing/step_s` (the whole step), and the rest, step - gen - push (log-prob passes, grading, the update).
Engine start-up is reported apart. Server mode starts its `megatron-cpo rollout` process here and times its
start-up the same way (URL written = engines ready).

    VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/rollout/bench_modes.py --modes ray server colocate --steps 6
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny"


def start_server(work: Path) -> tuple[subprocess.Popen, str, float]:
    token = work / "token"
    token.write_text("bench-token")
    ready = work / "server.url"
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "megatron_cpo.cli", "rollout", "--model", str(TINY / "model"),
                                "--dtype", "float32", "--max-model-len", "512", "--port", "0", "--token-file",
                                str(token), "--ready-file", str(ready)], stdout=open(work / "server.log", "wb"),
                               stderr=subprocess.STDOUT, start_new_session=True)
    while not ready.exists():
        if process.poll() is not None:
            raise RuntimeError((work / "server.log").read_text()[-2000:])
        time.sleep(0.2)
    return process, ready.read_text().strip(), time.perf_counter() - started


def run_mode(mode: str, args: argparse.Namespace, data: dict, work: Path) -> dict:
    from megatron_cpo.config import load_config
    from megatron_cpo.rollout.modes import build_rollout_manager
    from megatron_cpo.trainer.assemble import run_training
    from megatron_cpo.trainer.components import engine_launch_config

    extra, server = [], None
    start_s = 0.0
    if mode == "server":
        server, url, start_s = start_server(work)
        extra = [f"actor_rollout_ref.rollout.server_urls=[{url}]",
                 f"actor_rollout_ref.rollout.server_token_file={work / 'token'}"]
    elif mode == "ray":
        extra = ["actor_rollout_ref.rollout.ray_address=local"]
    out = work / f"run-{mode}"
    config = load_config(TINY / "grpo_arith.yaml", [
        f"data.train_files={data['train']}", f"data.val_files={data['test']}", f"data.train_batch_size={args.batch}",
        f"data.max_response_length={args.max_tokens}", f"actor_rollout_ref.rollout.n={args.n}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.batch * args.n}",
        f"actor_rollout_ref.model.path={TINY / 'model'}", f"actor_rollout_ref.rollout.mode={mode}",
        f"trainer.total_training_steps={args.steps}", "trainer.test_freq=-1", "trainer.val_before_train=false",
        f"trainer.default_local_dir={out}", "trainer.logger=[jsonl]", *extra])
    try:
        if mode != "server":
            started = time.perf_counter()
            manager = build_rollout_manager(config.actor_rollout_ref.rollout, engine_launch_config(config))
            start_s = time.perf_counter() - started
        else:
            manager = None
        try:
            run_training(config, manager)
        finally:
            if manager is not None:
                manager.shutdown()
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=120)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "timing/step_s" in row and row["step"] > 1]
    median = {key: statistics.median(row[key] for row in steps)
              for key in ("timing/gen_s", "timing/weight_sync_s", "timing/step_s")}
    return {"mode": mode, "engine_start_s": start_s, "steps": len(steps), **median,
            "rest_s": median["timing/step_s"] - median["timing/gen_s"] - median["timing/weight_sync_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["ray", "server", "colocate"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from megatron_cpo.data.synthetic import ArithConfig, write_arith_parquet

    with tempfile.TemporaryDirectory(prefix="bench-modes-") as tmp:
        work = Path(tmp)
        written = write_arith_parquet(work / "data", ArithConfig(num_train=256, num_test=8))
        data = {k: str(v) for k, v in written.items()}
        results = []
        for mode in args.modes:
            saved = dict(os.environ)
            try:
                results.append(run_mode(mode, args, data, work))
            finally:
                os.environ.clear()
                os.environ.update(saved)
            print(json.dumps(results[-1]), flush=True)
    print("| mode | engine start s | steps timed | generation s | weight push s | rest s (log-probs, grading, update) "
          "| step s |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['mode']} | {r['engine_start_s']:.1f} | {r['steps']} | {r['timing/gen_s']:.3f} | "
              f"{r['timing/weight_sync_s']:.3f} | {r['rest_s']:.3f} | {r['timing/step_s']:.3f} |")


if __name__ == "__main__":
    main()
