"""Where CPO finds the worked solution it shows as a hint (`data.hint_key`), and the check of that list.

A key is a dotted path into a row, starting at `extra_info` or `reward_model`. The defaults cover the places real
data sets keep a worked solution: our `tools/prepare_data.py` (`extra_info.solution`), verl's GSM8K preprocessing
(`extra_info.answer`: the reasoning and the `#### n` line), and `reward_model.solution`; the bare answer
(`reward_model.ground_truth`) is the last resort, and a warning says so when it is used.
"""
from __future__ import annotations

DEFAULT_HINT_KEYS = ("extra_info.solution", "extra_info.gold_solution", "extra_info.answer", "reward_model.solution",
                     "reward_model.ground_truth")
HINT_ROOTS = ("extra_info", "reward_model")


def check_hint_keys(keys: list[str] | tuple[str, ...]) -> None:
    """Raise ValueError naming a key that is not `extra_info.<field>` or `reward_model.<field>`."""
    if isinstance(keys, str) or not keys:
        raise ValueError(f"data.hint_key={keys!r} must be a non-empty list such as {list(DEFAULT_HINT_KEYS)}")
    for key in keys:
        root, _, rest = str(key).partition(".")
        if root not in HINT_ROOTS or not rest or "" in rest.split("."):
            raise ValueError(f"data.hint_key entry {key!r} must be a dotted path starting at extra_info or "
                             f"reward_model, e.g. extra_info.solution")
