"""Suite-wide settings and fixtures.

CPU runs use the Triton interpreter and keep thread counts small (CI has 2 cores). Tests are marked `engine`,
`multiprocess` and `slow` (registered in pytest.ini; `pytest -m "not slow"` is the quick loop): a module or test can
mark itself, and `pytest_collection_modifyitems` below marks what it can tell from the test itself, so that new tests
are marked without anyone remembering to:
- `engine`: the test or one of the fixtures it uses (at any depth) builds a `RolloutManager` or calls `run_training`
  (so every user of the `manager` and `rollout_manager` fixtures is one).
- `multiprocess`: the test or one of its fixtures calls `tests.multiprocess.run_processes`.
- `slow`: every `engine` and `multiprocess` test, every test using a fixture of SLOW_FIXTURES, and every test that
  starts this interpreter again (`subprocess` with `sys.executable`: the child imports torch, Megatron or the
  trainer before it does anything, seconds each).
The code read is that of the test and fixture functions, of functions nested in them, and of the functions and
classes (their methods) of the test's own module that they use (at any depth); not that of other modules' helpers: a
test that starts engines, ranks or interpreters through one of those marks itself, and so does a module whose tests
run something slow that the names do not show (the code sandbox's tests, the setup script's).
"""
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("PYTHONPATH", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
torch.set_num_threads(min(2, torch.get_num_threads()))

# Names whose use in the code of a test or of any fixture it uses marks it (fixtures are matched by what they call,
# not by their names: tests/rewards has a `manager` fixture too, a RewardManager).
MULTIPROCESS_NAMES = frozenset({"run_processes"})
ENGINE_NAMES = frozenset({"RolloutManager", "run_training"})
# Fixtures that make any test using them slow: a private Ray cluster takes seconds to start.
SLOW_FIXTURES = frozenset({"ray_cluster"})
# A test whose code uses both names starts `sys.executable` in a subprocess.
INTERPRETER_SUBPROCESS_NAMES = frozenset({"subprocess", "executable"})


@pytest.fixture(autouse=True)
def _cli_logging_removed():
    """A test that runs the CLI in this process installs its console handler on pytest's capture stream and sets the
    root logger to INFO (console.setup_logging): both are undone after it, so that later tests neither log into a
    closed stream nor capture INFO records they did not ask for."""
    import logging

    from megatron_cpo.console import remove_logging

    level = logging.getLogger().level
    yield
    remove_logging()
    logging.getLogger().setLevel(level)


@pytest.fixture(scope="session")
def ray_cluster():
    """A private local Ray cluster (never another user's) for every in-process engine of the session (tests/rollout's
    and tests/trainer's), shut down at the end of the session. One process holds one Ray connection, so whichever
    directory's tests run first must not start a smaller cluster that the other's engines would not fit in."""
    import ray

    from megatron_cpo.rollout.ray_cluster import PRIVATE_CLUSTER_CONFIG

    ray.init(address="local", num_cpus=4, object_store_memory=256 * 1024**2, include_dashboard=False,
             log_to_driver=False, namespace="megatron_cpo_tests", _system_config=PRIVATE_CLUSTER_CONFIG)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The suite's tiny model: random qwen2 weights (seed 0, float32), its character tokenizer and generation config,
    written once per session (megatron_cpo.models.tiny.write_tiny_model). Tests only read it; a test that needs a
    different model (another family, dtype or shape) writes its own. examples/tiny/model is a different model (the
    warm-started one the quickstart trains) and stays the quickstart's."""
    from megatron_cpo.models.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny_model") / "tiny-qwen2", family="qwen2", seed=0)


@pytest.fixture(scope="session")
def tied_llama_dir(tmp_path_factory) -> Path:
    """A tiny Llama with tied embeddings (seed 0, float32), as SmolLM2 and Llama-3.2 are: the model of the engine
    tests of training runs (tests/trainer's `tiny_model`, server and colocate mode), where a push that leaves the
    engine's output head behind (issue 24) shows in `mismatch/*` and the sync check."""
    from megatron_cpo.models.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tied_llama") / "tiny-llama", family="llama", seed=0)


@pytest.fixture(scope="session")
def tied_qwen2_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2 with tied embeddings and random qkv biases (seed 0, float32), as Qwen2.5-0.5B: the model of
    tests/rollout's shared engines, so weight pushes at TP=2 and PP=2 carry a tied head and sharded biases."""
    from megatron_cpo.models.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tied_qwen2") / "tiny-qwen2-tied", family="qwen2", seed=0,
                            random_biases=True, tie_word_embeddings=True)


def _code_names(code) -> set[str]:
    """Global and attribute names a code object (and the functions nested in it) refers to."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _code_names(const)
    return names


def _names_used(item: pytest.Item) -> set[str]:
    """Names referred to by the test function, by the functions of every fixture it uses, and by the functions and
    class methods of the test's module that any of these use (followed to any depth)."""
    functions = [getattr(item, "function", None)]
    fixture_info = getattr(item, "_fixtureinfo", None)
    if fixture_info is not None:
        functions += [definition.func for definitions in fixture_info.name2fixturedefs.values()
                      for definition in definitions]
    module = getattr(item, "module", None)
    names: set[str] = set()
    seen: set = set()
    while functions:
        code = getattr(functions.pop(), "__code__", None)
        if code is None or code in seen:
            continue
        seen.add(code)
        found = _code_names(code)
        names |= found
        for name in found:  # the module's own helpers the code calls: functions, and the methods of classes
            helper = getattr(module, name, None)
            if not callable(helper) or getattr(helper, "__module__", None) != getattr(module, "__name__", ""):
                continue
            functions += [getattr(member, "__func__", member) for member in vars(helper).values()] \
                if isinstance(helper, type) else [helper]
    return names


def pytest_collection_modifyitems(config, items):
    for item in items:
        used = _names_used(item)
        if ENGINE_NAMES & used:
            item.add_marker(pytest.mark.engine)
        if MULTIPROCESS_NAMES & used:
            item.add_marker(pytest.mark.multiprocess)
        if (item.get_closest_marker("engine") or item.get_closest_marker("multiprocess")
                or SLOW_FIXTURES & set(getattr(item, "fixturenames", ()))
                or INTERPRETER_SUBPROCESS_NAMES <= used):
            item.add_marker(pytest.mark.slow)
