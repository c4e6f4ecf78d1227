"""The examples of docs/multi_turn.md run as written: each Python block is loaded as the module its first-line comment
names, each YAML block is loaded by the config, tool or interaction loader it is shown for, and the environment, tool
and interaction are exercised (the environment through the episode runner, with scripted token ids)."""
import re
import sys
import types
from pathlib import Path

import yaml

from megatron_cpo.config import build_config
from megatron_cpo.envs import EnvironmentRegistry, EpisodeRunner
from megatron_cpo.envs.interactions import AsyncCalls, load_interactions
from megatron_cpo.envs.tools import load_tools
from megatron_cpo.rollout.types import SamplingParams
from tests.envs.scripted import ScriptedEngines
from tests.envs.test_episode_runner import EOS, TOKENIZER, ids, record

PAGE = Path(__file__).resolve().parents[2] / "docs" / "multi_turn.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", PAGE.read_text(), re.DOTALL)


def load_examples(monkeypatch) -> None:
    """Each Python block as the module its first line names (`# my_envs/guess.py` -> my_envs.guess)."""
    for source in blocks("python"):
        name = source.splitlines()[0].lstrip("# ").removesuffix(".py").replace("/", ".")
        package = name.rsplit(".", 1)[0]
        monkeypatch.setitem(sys.modules, package, sys.modules.get(package) or types.ModuleType(package))
        module = types.ModuleType(name)
        exec(compile(source, str(PAGE), "exec"), module.__dict__)  # noqa: S102 - our own documentation
        monkeypatch.setitem(sys.modules, name, module)


def test_the_environment_example_plays_through_the_runner(monkeypatch):
    load_examples(monkeypatch)
    [environment_yaml] = [b for b in blocks("yaml") if "default_agent" in b]
    overrides = yaml.safe_load(environment_yaml)["actor_rollout_ref"]["rollout"]["multi_turn"]
    config = build_config({"actor_rollout_ref": {"rollout": {"multi_turn": overrides}}}, [])
    multi_turn = config.actor_rollout_ref.rollout.multi_turn

    def script(request, turn):  # guess 1, 2, 3, ... until the environment says done
        return ids(str(turn + 1)) + [EOS], "stop"

    runner = EpisodeRunner(ScriptedEngines(script), TOKENIZER, EnvironmentRegistry(multi_turn), 256, 256)
    runner.submit("g", record(), SamplingParams(n=2, max_tokens=64, stop_token_ids=(EOS,), seed=5))
    [group] = runner.finished(timeout=30)
    runner.close()
    for sample in group.samples:
        episode = sample.episode
        assert episode.stop_reason in ("done", "max_assistant_turns") and episode.turns <= 5
        if episode.stop_reason == "done":  # the secret was within the first five guesses
            assert episode.turn_rewards[-1] == 1.0 / episode.turns and episode.final_score == 0.0
    assert len({s.episode.turns for s in group.samples}) == 1  # one secret per group: the same guesses


def test_the_tool_and_interaction_examples_load_from_their_yaml_and_answer(monkeypatch, tmp_path):
    load_examples(monkeypatch)
    tools_yaml, interactions_yaml = (next(b for b in blocks("yaml") if b.startswith(f"# {name}.yaml"))
                                     for name in ("tools", "interactions"))
    (tmp_path / "tools.yaml").write_text(tools_yaml)
    (tmp_path / "interactions.yaml").write_text(interactions_yaml)
    tools = load_tools(tmp_path / "tools.yaml")
    assert sorted(tools) == ["calculator", "code_interpreter", "convert"]
    context = type("Context", (), {"kwargs": {}, "state": {}})()
    assert [tools["convert"].call({"value": 1, "unit": "m"}, context).text for _ in range(4)][-1] == "3.281"
    assert tools["convert"].call({"value": 1, "unit": "m"}, context).reward == -0.01
    calls = AsyncCalls()
    check = load_interactions(tmp_path / "interactions.yaml", calls)["check"]
    check.start("a", {"ground_truth": "42"})
    assert check.respond("a", [{"role": "assistant", "content": "It is 41"}], {})[:3] == (
        False, "Not quite; try again.", 0.0)
    assert check.respond("a", [{"role": "assistant", "content": "It is 42"}], {})[:3] == (True, "Correct.", 1.0)
    check.finalize("a", {})
    calls.close()
