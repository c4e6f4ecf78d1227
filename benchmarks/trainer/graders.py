"""A grader with a chosen fraction of informative prompts, for the controller benchmark on an untrained model.

A prompt is informative when a hash of its index falls below `keep_rate`; its responses are then right or wrong by
the parity of their first character (so its group is almost surely mixed and passes filter-groups). Every response
to any other prompt is wrong, so its group is dropped. The fraction of groups that pass the filter is `keep_rate`.
"""
import hashlib


def informative_fraction(data_source, solution_str, ground_truth, extra_info=None, keep_rate=0.3):
    digest = hashlib.sha256(str((extra_info or {}).get("index", ground_truth)).encode()).digest()
    informative = int.from_bytes(digest[:4], "big") / 2**32 < keep_rate
    correct = informative and bool(solution_str) and ord(solution_str[0]) % 2 == 0
    return {"score": 1.0 if correct else 0.0, "acc": correct}
