"""compute_score dispatch, user graders by dotted path and the error for an unknown source."""
import pytest

from megatron_cpo.import_paths import import_callable
from megatron_cpo.rewards import compute_score, get_grader, known_sources, register_grader
from megatron_cpo.rewards.registry import normalise_result


def test_unknown_source_lists_the_known_ones():
    with pytest.raises(ValueError) as error:
        compute_score("no/such-source", "x", "y")
    message = str(error.value)
    assert "no/such-source" in message and "math500" in message and "openai/gsm8k" in message


def test_builtin_sources_are_registered():
    expected = {"hendrycks_math", "math500", "aime*", "amc23", "openai/gsm8k", "gpqa",
                "hiyouga/geometry3k", "codecontests", "apps", "codeforces", "taco", "megatron_cpo/arith"}
    assert expected <= set(known_sources())
    assert get_grader("math500").failure_score == -1.0 and get_grader("openai/gsm8k").failure_score == 0.0


def test_user_grader_registered_by_dotted_path():
    grader = register_grader("tests/exact", "tests.rewards.hostile_graders:exact_match", overwrite=True)
    assert grader.name == "tests.rewards.hostile_graders:exact_match"
    assert compute_score("tests/exact", " yes ", "yes") == {"score": 1.0, "acc": True, "pred": "yes"}
    with pytest.raises(ValueError, match="already has grader"):
        register_grader("tests/exact", "tests.rewards.hostile_graders:exact_match")


@pytest.mark.parametrize("path, message", [
    ("no_colon_or_dot", "must look like"),
    ("tests.rewards.no_such_module:fn", "cannot import module"),
    ("tests.rewards.hostile_graders:missing", "has no 'missing'"),
    ("tests.rewards.hostile_graders:__doc__", "is not callable"),
])
def test_bad_dotted_paths_say_what_is_wrong(path, message):
    with pytest.raises(ValueError, match=rf"^reward.custom_reward_function={path!r}.*{message}"):
        import_callable(path, "reward.custom_reward_function")


def test_grader_results_are_normalised():
    assert normalise_result(0.5, "g") == {"score": 0.5, "acc": True, "pred": None}
    assert normalise_result({"score": -1}, "g") == {"score": -1.0, "acc": False, "pred": None}
    with pytest.raises(ValueError, match="without 'score'"):
        normalise_result({"acc": True}, "g")
    with pytest.raises(TypeError, match="returned str"):
        normalise_result("1", "g")
