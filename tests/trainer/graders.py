"""Real graders for trainer tests on an untrained tiny model (which never writes a correct arithmetic answer).

They are ordinary custom reward functions (`reward.custom_reward_function`), run by the real grading pool. Most
depend only on the sampled text, so groups are mixed or uniform at rates the tests can rely on; `mixed_on_even_rows`
makes them mixed or uniform by construction, for tests on the session's shared engine, whose weights are whatever the
last test pushed.
"""
import itertools

_calls_in_this_worker = itertools.count()


def even_first_character(data_source, solution_str, ground_truth, extra_info=None):
    """Correct when the response starts with a character whose code point is even (about half of the samples)."""
    correct = bool(solution_str) and ord(solution_str[0]) % 2 == 0
    return {"score": 1.0 if correct else 0.0, "acc": correct}


def mixed_on_even_rows(data_source, solution_str, ground_truth, extra_info=None):
    """Wrong on rows with an odd `extra_info.index`, so their groups are uniform; on the other rows correct on every
    other call of this grading worker, so with one worker (`reward.num_workers=1`), which grades a group's samples one
    after another, their groups are mixed whatever the engine samples."""
    correct = (extra_info or {}).get("index", 1) % 2 == 0 and next(_calls_in_this_worker) % 2 == 0
    return {"score": 1.0 if correct else 0.0, "acc": correct}


def never_correct(data_source, solution_str, ground_truth, extra_info=None):
    """Every response is wrong: filter-groups drops every group."""
    return {"score": 0.0, "acc": False}


def even_first_character_pausing(data_source, solution_str, ground_truth, extra_info=None):
    """`even_first_character`, but with cue points for tests that must act while a run is generating: for each step
    S in $PAUSE_AFTER_STEPS (comma-separated), once the run's metrics.jsonl ($PAUSE_RUN_DIR) holds step S, the first
    grading call writes $PAUSE_DIR/paused_S and waits (at most $PAUSE_MAX_S seconds, 120 by default) for
    $PAUSE_DIR/go_S; later calls grade at once. So the test acts during the rollout of step S + 1, with requests
    possibly still in flight, and the run cannot get past that rollout before the test lets it."""
    import json
    import os
    import time
    from pathlib import Path

    pause_dir = Path(os.environ["PAUSE_DIR"])
    metrics = Path(os.environ["PAUSE_RUN_DIR"]) / "metrics.jsonl"
    pending = [step for step in map(int, os.environ["PAUSE_AFTER_STEPS"].split(","))
               if not (pause_dir / f"paused_{step}").exists()]
    if pending and metrics.is_file():
        steps = set()
        for line in metrics.read_text().splitlines():
            try:
                steps.add(json.loads(line)["step"])
            except ValueError:
                pass
        for step in (step for step in pending if step in steps):
            (pause_dir / f"paused_{step}").touch()
            deadline = time.monotonic() + float(os.environ.get("PAUSE_MAX_S", "120"))
            while not (pause_dir / f"go_{step}").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
    return even_first_character(data_source, solution_str, ground_truth, extra_info)


def non_finite_for_some(data_source, solution_str, ground_truth, extra_info=None):
    """A custom reward function with a bug: NaN when the response's first character's code point is a multiple of 3,
    +inf when it is one more than that (about two thirds of the samples), `even_first_character` otherwise."""
    code = ord(solution_str[0]) % 3 if solution_str else 2
    if code < 2:
        return {"score": float("nan") if code == 0 else float("inf"), "acc": False}
    return even_first_character(data_source, solution_str, ground_truth, extra_info)
