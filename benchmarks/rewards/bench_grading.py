"""Grading throughput (samples/s) of the reward manager for math and code on this machine.

Math samples mix the three decision stages (exact, numeric, symbolic) and right/wrong answers, every string unique
(math-verify caches parses, so repeated strings would flatter the numbers); code samples are
APPS-style stdin/stdout problems with 3 tests each (one sandboxed process per test), reported as samples/s and
programs/s, plus the CPU time one sandboxed program costs (summed over every process of the run, measured inline in
this process, so it hardly depends on the machine's load). Run from the repository root:

    python benchmarks/rewards/bench_grading.py --workers 2 --math-samples 512 --code-samples 48

``--sandbox-mode`` picks ``reward.sandbox.mode`` (default: the configured default, ``auto``). The script only uses
APIs that older checkouts have too, so ``PYTHONPATH=<old checkout> python <this script>`` measures "before".
"""
import argparse
import json
import os
import random
import resource
import time

import psutil

from megatron_cpo.rewards import RewardConfig, RewardManager, compute_score, run_python

MATH_TEMPLATES = [  # (prediction, ground truth) from an integer k: exact, numeric and symbolic decisions
    lambda k: (f"{k}", f"{k}"), lambda k: (f"\\dfrac{{{k}}}{{{k + 1}}}", f"\\frac{{{k}}}{{{k + 1}}}"),
    lambda k: (f"{k / 4}", f"\\frac{{{k}}}{{4}}"), lambda k: (f"{k}.5\\times10^{{2}}", f"{k * 100 + 50}"),
    lambda k: (f"(x+{k})^2", f"x^2+{2 * k}x+{k * k}"), lambda k: (f"\\frac{{{k}\\sqrt{{2}}}}{{2}}", f"{k}\\sqrt2/2"),
    lambda k: (f"\\{{{k},{k + 1}\\}}", f"\\{{{k + 1},{k}\\}}"), lambda k: (f"({k},{k + 2}]", f"({k}, {k + 2}]"),
    lambda k: (f"{k + 1}", f"{k}"), lambda k: (f"\\frac{{{k}}}{{3}}", f"\\frac{{{k + 1}}}{{3}}"),
    lambda k: (f"x^2-{k}", f"x^2+{k}"), lambda k: (f"[0,{k}]", f"(0,{k})"),
]
CODE_PROBLEMS = [
    ("a, b = map(int, input().split())\nprint(a + b)", {"inputs": ["1 2\n", "3 4\n", "10 -2\n"],
                                                        "outputs": ["3\n", "7\n", "8\n"]}),
    ("n = int(input())\nprint(sum(range(n + 1)))", {"inputs": ["3\n", "10\n", "100\n"],
                                                    "outputs": ["6\n", "55\n", "5050\n"]}),
    ("s = input()\nprint(s[::-1])", {"inputs": ["abc\n", "x\n", "racecar\n"],
                                     "outputs": ["cba\n", "x\n", "racecar\n"]}),
    ("print(int(input()) * 3)", {"inputs": ["1\n", "2\n", "3\n"], "outputs": ["2\n", "4\n", "6\n"]}),  # wrong
]


def math_batch(count: int) -> tuple[list, list, list]:
    rng = random.Random(0)
    pairs = [rng.choice(MATH_TEMPLATES)(rng.randint(2, 999)) for _ in range(count)]
    return (["math500"] * count, [f"Reasoning...\nThe answer is $\\boxed{{{p}}}$." for p, _ in pairs],
            [truth for _, truth in pairs])


def code_batch(count: int) -> tuple[list, list, list]:
    problems = [CODE_PROBLEMS[index % len(CODE_PROBLEMS)] for index in range(count)]
    return (["codecontests"] * count, [f"```python\n{code}\n```" for code, _ in problems],
            [json.dumps(tests) for _, tests in problems])


def timed_manager_run(manager: RewardManager, batch: tuple[list, list, list]) -> tuple[float, float]:
    started = time.perf_counter()
    result = manager.score(*batch)
    elapsed = time.perf_counter() - started
    assert result.metrics["reward/timeouts"] == 0 and result.metrics["reward/errors"] == 0, result.metrics
    failed_tests = [status for detail in result.details for status in detail.get("test_statuses", [])
                    if status not in ("passed", "wrong_answer")]
    if failed_tests:  # a correct program that did not pass (e.g. a wall timeout under heavy load)
        print(f"test cases that did not run to completion: {failed_tests}")
    return len(batch[0]) / elapsed, result.acc.float().mean().item()


def cpu_seconds_of_this_process_tree() -> float:
    """User + system CPU of this process, its reaped children and its live descendants (and their reaped ones)."""
    usage = [resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)]
    total = sum(item.ru_utime + item.ru_stime for item in usage)
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
            total += times.user + times.system + times.children_user + times.children_system
        except psutil.Error:
            continue
    return total


def sandbox_cpu_ms_per_program(count: int = 24) -> float:
    """CPU milliseconds (user + system, every process involved) that one sandboxed run of a small program costs."""
    run_python("print(1)")
    before = cpu_seconds_of_this_process_tree()
    for index in range(count):
        assert run_python("n = int(input())\nprint(sum(range(n + 1)))", f"{index}\n").stdout.strip() == str(
            index * (index + 1) // 2)
    time.sleep(0.2)  # let the last run's processes be reaped, so their time is counted
    return 1000 * (cpu_seconds_of_this_process_tree() - before) / count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--math-samples", type=int, default=512)
    parser.add_argument("--code-samples", type=int, default=48)
    parser.add_argument("--sandbox-mode", default=None, choices=("auto", "namespaces", "process"))
    arguments = parser.parse_args()
    sandbox = {}
    if arguments.sandbox_mode:
        from megatron_cpo.rewards.sandbox import configure_sandbox
        from megatron_cpo.rewards.sandbox_types import SandboxConfig

        sandbox = {"sandbox": SandboxConfig(mode=arguments.sandbox_mode)}
        print(f"sandbox backend: {configure_sandbox(sandbox['sandbox'])}")
    math_samples, code_samples = math_batch(arguments.math_samples), code_batch(arguments.code_samples)
    compute_score("math500", "\\boxed{(x+1)^2}", "x^2+2x+1")  # imports and first-use set-up
    inline_batch = math_batch(128)
    started, started_cpu = time.perf_counter(), time.process_time()
    for source, solution, truth in zip(*inline_batch):
        compute_score(source, solution, truth)
    inline_math = 128 / (time.perf_counter() - started)
    inline_cpu_ms = 1000 * (time.process_time() - started_cpu) / 128
    sandbox_cpu_ms = sandbox_cpu_ms_per_program()
    config = RewardConfig(num_workers=arguments.workers, timeout_s=60.0, **sandbox)
    with RewardManager(config) as manager:
        manager.score(*math_batch(16))  # workers up and warm
        math_rate, math_acc = timed_manager_run(manager, math_samples)
        code_rate, code_acc = timed_manager_run(manager, code_samples)
    print(f"cores={os.cpu_count()} workers={arguments.workers} load_avg_1m={os.getloadavg()[0]:.1f}")
    print(f"math inline (1 process, no pool): {inline_math:.1f} samples/s, {inline_cpu_ms:.1f} CPU ms/sample "
          f"(load-independent: {1000 / inline_cpu_ms:.0f} samples per CPU-second)")
    print(f"math via RewardManager: {math_rate:.1f} samples/s over {arguments.math_samples} (acc {math_acc:.2f})")
    print(f"code via RewardManager: {code_rate:.2f} samples/s = {3 * code_rate:.2f} programs/s over "
          f"{arguments.code_samples} samples, 3 tests each (acc {code_acc:.2f})")
    print(f"one sandboxed program, inline: {sandbox_cpu_ms:.1f} CPU ms (all processes)")


if __name__ == "__main__":
    main()
