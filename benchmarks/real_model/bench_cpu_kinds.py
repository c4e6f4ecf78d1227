"""SmolLM2-135M, a whole GRPO step: ours against TRL's GRPOTrainer, alternated, on each kind of CPU.

A CPU kind is what the machine's kernels may use (`--isa`): `native` (the CPU as it is) or `avx2` (oneDNN capped at
AVX2 with `ONEDNN_MAX_CPU_ISA=AVX2` and torch's own kernels with `ATEN_CPU_CAPABILITY=avx2`: an AVX-512 machine
computing as an AVX2-only CPU does; vLLM's own CPU kernels, attention among them, still take the machine's AVX-512,
since vLLM picks them from the CPU's flags). Both arms run with the same settings, those of
examples/smollm2-135m/grpo.yaml: 8 prompts x 8 samples of "What is a + b?" (`python -m megatron_cpo.data.addition`),
at most 128 new tokens, temperature 0.7, lr 1e-5, clip 0.2, token-mean loss, no KL, in the dtype `auto` chooses for
that kind (megatron_cpo/compute_dtype.py; TRL gets `--bf16` when that is bfloat16). TRL accumulates gradients over
`--trl-grad-accum` micro-batches of one generation batch (its one-batch step did not fit in 24 GB).

Runs alternate, ours then TRL, `--rounds` times per kind, each in a fresh process through
benchmarks/trainer/bench_steps.py and bench_trl.py (TRL in its own venv, `--trl-python`). A run whose result file is
already in `--runs-dir` is read, not repeated, so an interrupted table resumes. The summary (`--out`, the README's
table is made from it) has every run, each arm's mean seconds per step over the rounds, ours / TRL, the CPU and the
1-minute load average around each run; `--markdown` prints the table.

    python -m megatron_cpo.data.addition --out outputs/addition
    python benchmarks/real_model/bench_cpu_kinds.py --isa native avx2 --rounds 2 --steps 5 --warmup 2
    python benchmarks/real_model/bench_cpu_kinds.py --isa native avx2 --markdown     # the table, from the files
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ISA_ENVIRONMENTS = {"native": {}, "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}}
CONFIG = "examples/smollm2-135m/grpo.yaml"
MODEL = "examples/smollm2-135m/model"
TEMPERATURE, LR, MAX_NEW_TOKENS = 0.7, 1e-5, 128
PROMPTS, SAMPLES = 8, 8
OURS = {"ours": [], "ours_local": ["actor_rollout_ref.actor.megatron.attention_backend=local"]}  # arm: overrides


def kind_facts(isa: str) -> dict:
    """What this machine is under `isa`: the CPU, torch's kernel level and the dtype `auto` chooses (asked in a fresh
    interpreter with the kind's environment, as the runs see it)."""
    code = ("import json, torch; from megatron_cpo.compute_dtype import resolve_dtype; chosen = resolve_dtype('auto');"
            "caps = torch.cpu.get_capabilities(); print(json.dumps({'cpu': caps.get('cpu_name'), "
            "'flags': [f for f in ('avx2', 'avx512_f', 'avx512_bf16', 'amx_bf16') if caps.get(f)], "
            "'torch_kernels': torch.backends.cpu.get_cpu_capability(), "
            "'onednn_bf16': torch.ops.mkldnn._is_mkldnn_bf16_supported(), 'dtype': chosen.name, "
            "'dtype_reason': chosen.reason}))")
    done = subprocess.run([sys.executable, "-c", code], env=_environment(isa), check=True, capture_output=True,
                          text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _environment(isa: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), **ISA_ENVIRONMENTS[isa]}


def arm_command(arm: str, facts: dict, args: argparse.Namespace, result: Path) -> list[str]:
    """The command of one run of `arm` writing its result to `result`: "ours", "ours_local" (ours on Megatron-Core's
    local attention, the attention before issue 50) or "trl"."""
    if arm in OURS:
        return [sys.executable, str(ROOT / "benchmarks/trainer/bench_steps.py"), "--data", args.data,
                "--config", CONFIG, "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(result),
                f"actor_rollout_ref.rollout.temperature={TEMPERATURE}", f"actor_rollout_ref.actor.optim.lr={LR}",
                f"data.max_response_length={MAX_NEW_TOKENS}", f"data.train_batch_size={PROMPTS}",
                f"actor_rollout_ref.rollout.n={SAMPLES}", "actor_rollout_ref.actor.megatron.params_dtype=auto",
                "data.val_max_samples=8",  # the validation after the last step is not timed: keep it short
                *OURS[arm]]
    return [args.trl_python, str(ROOT / "benchmarks/trainer/bench_trl.py"),
            "--data", str(Path(args.data) / "train.parquet"), "--model", MODEL, "--lr", str(LR),
            "--temperature", str(TEMPERATURE), "--max-new-tokens", str(MAX_NEW_TOKENS), "--prompts", str(PROMPTS),
            "--n", str(SAMPLES), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--grad-accum", str(args.trl_grad_accum), "--out", str(result),
            *(["--bf16"] if facts["dtype"] == "bfloat16" else [])]


def run_arm(arm: str, isa: str, round_index: int, facts: dict, args: argparse.Namespace) -> dict | None:
    """One run's result: read from `--runs-dir` when it finished before, else run now (None with --markdown)."""
    folder = Path(args.runs_dir) / isa / f"{arm}-{round_index}"
    result = folder / "result.json"
    if not result.is_file():
        if args.markdown:
            return None
        folder.mkdir(parents=True, exist_ok=True)
        command = arm_command(arm, facts, args, result)
        load_before = os.getloadavg()[0]
        with open(folder / "output.log", "w") as log:
            done = subprocess.run(command, cwd=ROOT, env=_environment(isa), stdout=log, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            print(f"{isa} {arm} round {round_index} failed (exit {done.returncode}); see {folder / 'output.log'}",
                  flush=True)
            return None
        row = json.loads(result.read_text())
        row.update(isa=isa, arm=arm, round=round_index, load_1min_around=[load_before, os.getloadavg()[0]],
                   command=" ".join(command))
        result.write_text(json.dumps(row, indent=2) + "\n")
    return json.loads(result.read_text())


def summarize(runs: list[dict], facts: dict[str, dict]) -> dict:
    """Each kind's arms: mean seconds per step over their runs, and ours / TRL."""
    kinds = {}
    for isa, kind in facts.items():
        arms = {}
        for arm in (*OURS, "trl"):
            steps = [run["step_s_mean"] for run in runs if run["isa"] == isa and run["arm"] == arm]
            if steps:
                arms[arm] = {"runs": len(steps), "step_s_mean": statistics.fmean(steps), "step_s_runs": steps,
                             "tokens_per_s_mean": statistics.fmean(
                                 run["tokens_per_s_mean"] for run in runs if run["isa"] == isa and run["arm"] == arm)}
        ratio = arms["ours"]["step_s_mean"] / arms["trl"]["step_s_mean"] if {"ours", "trl"} <= set(arms) else None
        kinds[isa] = {**kind, "arms": arms, "ours_over_trl": ratio}
        if {"ours_local", "trl"} <= set(arms):
            kinds[isa]["ours_local_over_trl"] = arms["ours_local"]["step_s_mean"] / arms["trl"]["step_s_mean"]
    return kinds


def markdown(kinds: dict) -> str:
    local = any("ours_local" in kind["arms"] for kind in kinds.values())  # the before of issue 50's attention
    arms = ("ours", "ours_local", "trl") if local else ("ours", "trl")
    lines = ["| CPU kind | dtype (auto) | ours s/step | " + ("ours, local attention s/step | " if local else "")
             + "TRL s/step | ours / TRL | " + ("ours local / TRL | " if local else "") + "runs each |",
             "|---|---|---|---|---|" + ("---|---|" if local else "") + "---|"]
    for isa, kind in kinds.items():
        ran = kind["arms"]
        cell = {arm: f"{ran[arm]['step_s_mean']:.1f}" if arm in ran else "-" for arm in arms}
        ratios = [kind.get("ours_over_trl")] + ([kind.get("ours_local_over_trl")] if local else [])
        runs = "/".join(str(ran[arm]["runs"]) if arm in ran else "0" for arm in arms)
        lines.append(f"| {isa}: {kind['cpu']}, torch kernels {kind['torch_kernels']}, oneDNN bf16 "
                     f"{kind['onednn_bf16']} | {kind['dtype']} | " + " | ".join(cell[arm] for arm in arms) + " | "
                     + " | ".join(f"{r:.2f}x" if r else "-" for r in ratios) + f" | {runs} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", nargs="+", default=list(ISA_ENVIRONMENTS), choices=list(ISA_ENVIRONMENTS))
    parser.add_argument("--data", default="outputs/addition", help="python -m megatron_cpo.data.addition --out DIR")
    parser.add_argument("--rounds", type=int, default=2, help="ours-then-TRL pairs per kind")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each run left out of its mean")
    parser.add_argument("--arms", nargs="+", default=["ours", "trl"], choices=[*OURS, "trl"])
    parser.add_argument("--trl-python", default=str(ROOT.parent / "trl-venv/bin/python"),
                        help="python of a venv with torch==2.13.0, trl, math-verify, pandas, pyarrow")
    parser.add_argument("--trl-grad-accum", type=int, default=4, help="TRL micro-batches per step (64 / g each)")
    parser.add_argument("--runs-dir", default="runs/bench_cpu_kinds", help="each run's result.json and output.log")
    parser.add_argument("--out", default="benchmarks/real_model/cpu_kinds_results.json")
    parser.add_argument("--markdown", action="store_true", help="only read finished runs and print the table")
    args = parser.parse_args()
    args.data = str(Path(args.data).resolve())
    if "trl" in args.arms and not args.markdown and not Path(args.trl_python).is_file():
        parser.error(f"--trl-python {args.trl_python} does not exist; make TRL's venv (python3 -m venv DIR && "
                     "DIR/bin/pip install torch==2.13.0 trl math-verify pandas pyarrow) and pass DIR/bin/python")

    facts = {isa: kind_facts(isa) for isa in args.isa}
    runs = []
    for round_index in range(1, args.rounds + 1):
        for isa in args.isa:
            for arm in args.arms:
                row = run_arm(arm, isa, round_index, facts[isa], args)
                if row is not None:
                    runs.append(row)
                    print(f"{isa} {arm} round {round_index}: {row['step_s_mean']:.1f} s/step", flush=True)
    kinds = summarize(runs, facts)
    if not args.markdown:
        text = json.dumps({"settings": {"config": CONFIG, "prompts": PROMPTS, "samples": SAMPLES,
                                        "max_new_tokens": MAX_NEW_TOKENS, "temperature": TEMPERATURE, "lr": LR,
                                        "steps": args.steps, "warmup": args.warmup,
                                        "trl_grad_accum": args.trl_grad_accum},
                           "kinds": kinds, "runs": runs}, indent=2) + "\n"
        # paths relative to the repository (its parent as ../), so the committed summary names no one's machine
        Path(args.out).write_text(text.replace(f"{ROOT}/", "").replace(f"{ROOT.parent}/", "../"))
    print(markdown(kinds), flush=True)


if __name__ == "__main__":
    main()
