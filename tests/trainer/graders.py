"""Real graders for trainer tests on an untrained tiny model (which never writes a correct arithmetic answer).

They are ordinary custom reward functions (`reward.custom_reward_function`), run by the real grading pool. Their
outcomes depend only on the sampled text, so groups are mixed or uniform at rates the tests can rely on.
"""


def even_first_character(data_source, solution_str, ground_truth, extra_info=None):
    """Correct when the response starts with a character whose code point is even (about half of the samples)."""
    correct = bool(solution_str) and ord(solution_str[0]) % 2 == 0
    return {"score": 1.0 if correct else 0.0, "acc": correct}


def never_correct(data_source, solution_str, ground_truth, extra_info=None):
    """Every response is wrong: filter-groups drops every group."""
    return {"score": 0.0, "acc": False}
