"""`rollout.mode=server`: real `megatron-cpo rollout` processes (vLLM on CPU) serving trainers over HTTP.

Two servers of a tiny Llama with tied embeddings start once for the module (each its own process tree, started
together). Three trainers (the quickstart's GRPO, CPO and DAPO configs, shortened, at learning rate 3e-2) run one
after the other against the first server and push their weights over the gloo collective the server's engine joins;
after every push the engine's log-probs, of its samples and of the sync probe, equal the trainer's, and afterwards the
server generates transformers' greedy tokens for each run's exported weights. Multi-turn episodes (verl's tool agent)
train against a server. A server stopped (hung) or killed while holding prompts has them served by the other, and a
hung one that answers again is taken back at the next push; a wrong token is refused, and a port that accepts
connections but never answers is an error naming its URL within the timeout. A server scores its own samples as a
distillation teacher.
"""
import json
import signal
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from megatron_cpo.rollout import RolloutEnginesLostError, SamplingParams
from megatron_cpo.rollout.http_client import RolloutServerAuthError
from megatron_cpo.rollout.server_client import ServerClientConfig, ServerRolloutManager
from megatron_cpo.rollout.types import RolloutEngineStartError
from tests.conditions import wait_until
from tests.rollout.servers import assert_engine_in_sync, end_server, greedy_matches_transformers, start_server, wait_url

pytestmark = [pytest.mark.engine, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny"
TOKEN = "test-token-0123456789"


@pytest.fixture
def restore_environment():
    """run_training records its one-process rendezvous in os.environ; the next run gets a fresh one."""
    import os

    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tied_llama_dir):
    """Two servers of the tied tiny Llama, started together; the token file they were given."""
    work = tmp_path_factory.mktemp("servers")
    token_file = work / "token"
    token_file.write_text(TOKEN + "\n")
    processes = {name: start_server(tied_llama_dir, work, name, token_file) for name in ("a", "b")}
    try:
        urls = {name: wait_url(process, work, name) for name, process in processes.items()}
        yield {"urls": urls, "processes": processes, "token_file": token_file, "model": tied_llama_dir}
    finally:
        for process in processes.values():
            end_server(process)


def _example_config(name, servers, data, out_dir):
    from megatron_cpo.config import load_config

    return load_config(TINY / name, [
        f"data.train_files={data['train']}", f"data.val_files={data['test']}", "data.train_batch_size=4",
        "data.max_response_length=12", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", f"actor_rollout_ref.model.path={servers['model']}",
        "actor_rollout_ref.actor.optim.lr=3e-2", "actor_rollout_ref.rollout.mode=server",
        f"actor_rollout_ref.rollout.server_urls=[{servers['urls']['a']}]",
        f"actor_rollout_ref.rollout.server_token_file={servers['token_file']}",
        "actor_rollout_ref.rollout.weight_transport=auto", "trainer.total_training_steps=2", "trainer.test_freq=-1",
        "algorithm.filter_groups.enable=false", "reward.overlong_buffer.len=4",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
        f"trainer.default_local_dir={out_dir}", "trainer.logger=[jsonl]"])


def test_two_trainers_one_after_the_other_train_against_one_server_and_it_serves_their_weights(servers, tmp_path,
                                                                                              restore_environment):
    import ray

    from megatron_cpo.data.synthetic import ArithConfig, write_arith_parquet
    from megatron_cpo.trainer.assemble import run_training

    data = {k: str(v) for k, v in write_arith_parquet(tmp_path / "data", ArithConfig(num_train=32, num_test=4)).items()}
    ray_was_running = ray.is_initialized()
    changed = []
    for name in ("grpo_arith.yaml", "cpo_arith.yaml", "dapo_arith.yaml"):  # the quickstart's three configs
        out = tmp_path / name.split(".")[0]
        started = time.perf_counter()
        metrics = run_training(_example_config(name, servers, data, out))
        print(f"{name} against the server: {time.perf_counter() - started:.1f}s, weight push "
              f"{metrics['timing/weight_sync_s']:.3f}s")
        assert metrics["rollout/engines_alive"] == 1.0 and "val/acc" in metrics
        rows = {row["step"]: row for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
        assert max(rows) == 2
        changed.append(assert_engine_in_sync(rows, (1, 2), require_change=False))
        with ServerRolloutManager(ServerClientConfig(urls=(servers["urls"]["a"],), token=TOKEN)) as client:
            gap = greedy_matches_transformers(client, out / "checkpoints" / "step_000002" / "huggingface")
        print(f"{name}: the server reproduces the run's exported weights (max log-prob gap {gap:.1e})")
    assert any(changed), "no run changed the weights (every group's rewards were equal)"
    assert ray.is_initialized() == ray_was_running, "server mode must not start Ray"


def test_multi_turn_episodes_train_against_a_server_distilled_from_the_other(servers, tmp_path, restore_environment):
    """Multi-turn in server mode: verl's GSM8K-with-tools rows (tests/fixtures/multi_turn, `agent_name: tool_agent`)
    run as episodes with the fixtures' tool YAML and verl-style interaction, on the server's random model (its turns
    rarely end before the per-turn cap, which ends the episode; the warm-started model's two-turn episodes with the
    same fixtures run in Ray mode, tests/trainer/test_multi_turn_e2e.py). Server b is an on-policy distillation
    teacher (`kind=server`, k1 as a reward beside the task's) holding the student's own starting weights, so at the
    first step the signal is float noise: the teacher's log-probs line up with the episode's sampled tokens across
    its tool observations (which carry none)."""
    from megatron_cpo.config import load_config
    from megatron_cpo.trainer.assemble import run_training

    fixtures = ROOT / "tests" / "fixtures" / "multi_turn"
    rows = fixtures / "gsm8k_tool_agent.parquet"
    out = tmp_path / "tool_agent"
    config = load_config(TINY / "grpo_arith.yaml", [
        f"data.train_files={rows}", f"data.val_files={rows}", "data.train_batch_size=2", "data.val_max_samples=2",
        "data.max_response_length=96", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        f"actor_rollout_ref.model.path={servers['model']}", "actor_rollout_ref.rollout.mode=server",
        f"actor_rollout_ref.rollout.server_urls=[{servers['urls']['a']}]",
        f"actor_rollout_ref.rollout.server_token_file={servers['token_file']}",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=32",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={fixtures / 'tool_config.yaml'}",
        f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={fixtures / 'interaction_config.yaml'}",
        "trainer.total_training_steps=1", "trainer.test_freq=-1", f"trainer.default_local_dir={out}",
        "trainer.logger=[jsonl]", "distillation.enabled=true", "distillation.nnodes=0",
        "distillation.teacher_models.teacher_model.kind=server",
        f"distillation.teacher_models.teacher_model.server_urls=[{servers['urls']['b']}]",
        f"distillation.teacher_models.teacher_model.server_token_file={servers['token_file']}",
        "distillation.distillation_loss.loss_mode=k1", "distillation.distillation_loss.use_policy_gradient=true",
        "distillation.distillation_loss.use_task_rewards=true"])
    metrics = run_training(config)
    assert metrics["rollout/engines_alive"] == 1.0 and "val/acc" in metrics
    print(f"server teacher on the student's own weights: |D| mean {metrics['actor/distillation/abs_loss']:.1e}, max "
          f"{metrics['actor/distillation/loss_max']:.1e}, scoring {metrics['distillation/teacher_seconds']:.2f}s")
    assert metrics["distillation/teacher_seconds"] > 0
    assert metrics["actor/distillation/abs_loss"] < 1e-3 and metrics["actor/distillation/loss_max"] < 1e-2
    assert sum(value for key, value in metrics.items() if key.startswith("multi_turn/stop/")) == 4  # 2 prompts x 2
    assert metrics["multi_turn/turns_mean"] >= 1 and metrics["val/multi_turn/turns_mean"] >= 1


def test_a_wrong_token_is_refused_and_health_needs_none(servers):
    url = servers["urls"]["a"]
    with pytest.raises(RolloutServerAuthError, match=f"rollout server {url} refused the token"):
        ServerRolloutManager(ServerClientConfig(urls=(url,), token="not-the-token"))
    request = urllib.request.Request(url + "/weights/begin", data=b"{}", method="POST",
                                     headers={"Authorization": "Bearer not-the-token"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 401
    with urllib.request.urlopen(url + "/health", timeout=30) as response:
        assert json.loads(response.read())["ok"] is True


def test_a_server_as_a_distillation_teacher_scores_its_own_greedy_samples(servers):
    """`kind: server` (POST /score): the log-probs the server gives its own greedy samples equal those it sampled
    them with (temperature 0 samples carry the plain log-softmax, which the teacher scores at), and its top-1 id is
    the sampled token."""
    from megatron_cpo.rollout.engine_teacher import EngineTeacher

    with ServerRolloutManager(ServerClientConfig(urls=(servers["urls"]["a"],), token=TOKEN)) as client:
        for index, prompt in enumerate([[1, 40, 41, 42], [1, 60, 70, 80, 90], [1, 33, 3]]):
            client.submit(f"greedy-{index}", prompt, SamplingParams(temperature=0.0, max_tokens=8))
        groups = sorted(client.completed(timeout=120), key=lambda group: group.request_id)
        teacher = EngineTeacher("server", client, topk=3, owns_engines=False)
        scores = teacher.score([g.prompt_token_ids for g in groups], [g.samples[0].token_ids for g in groups])
    for row, group in enumerate(groups):
        sample = group.samples[0]
        length = len(sample.token_ids)
        assert max(abs(a - b) for a, b in zip(scores.log_probs[row, :length].tolist(), sample.logprobs)) < 1e-4
        assert scores.topk_ids[row, :length, 0].tolist() == sample.token_ids


def test_a_url_that_never_answers_is_an_error_naming_it_within_the_timeout(tmp_path):
    from megatron_cpo.config import build_config
    from megatron_cpo.rollout.modes import rollout_mode_problems

    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.perf_counter()
        with pytest.raises(RolloutEngineStartError, match=f"rollout server {url} did not answer /health within 1.5s"):
            ServerRolloutManager(ServerClientConfig(urls=(url,), token=TOKEN, timeout_s=1.5))
        assert time.perf_counter() - started < 10
        token_file = tmp_path / "token"
        token_file.write_text(TOKEN)
        config = build_config({}, ["actor_rollout_ref.rollout.mode=server",
                                   f"actor_rollout_ref.rollout.server_urls=[{url}]",
                                   f"actor_rollout_ref.rollout.server_token_file={token_file}",
                                   "actor_rollout_ref.rollout.server_timeout_s=1.5"])
        (problem,) = rollout_mode_problems(config.actor_rollout_ref.rollout)
    assert f"server_urls: {url} did not answer /health within server_timeout_s=1.5s" in problem


def test_a_hung_server_is_given_up_then_taken_back_and_a_killed_ones_prompts_go_to_the_other(servers):
    """Server b is stopped (SIGSTOP) while it holds prompts: it is given up within the health check's interval +
    timeout and a serves them; continued, it answers /health again, and the next weight push takes it back before it
    gets prompts. Then b is stopped again while it holds a distillation teacher's scoring requests: the teacher's
    client (`kind: server`) gives it up as generation's does and has a score them, with the log-probs a gives them
    directly; continued, b is taken back by the teacher at once (its weights are never pushed) and scores as a does.
    Stopped once more while it holds prompts, b is killed: a serves the prompts, and a client of b alone names the
    URL and the prompt it could not serve."""
    from transformers import AutoModelForCausalLM

    from megatron_cpo.rollout.config import EngineHealthConfig

    urls, process_b = servers["urls"], servers["processes"]["b"]
    health = EngineHealthConfig(check_interval_s=0.5, timeout_s=3)
    both = ServerRolloutManager(ServerClientConfig(urls=(urls["a"], urls["b"]), token=TOKEN, timeout_s=5,
                                                   health=health))
    only_b = ServerRolloutManager(ServerClientConfig(urls=(urls["b"],), token=TOKEN, timeout_s=5, health=health))
    teacher = ServerRolloutManager(ServerClientConfig(urls=(urls["a"], urls["b"]), token=TOKEN, timeout_s=5,
                                                      health=health, frozen_weights=True))
    params = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=3)

    def served(prefix: str) -> list:
        for index in range(6):
            both.submit(f"{prefix}{index}", [1, 40 + index, 41, 42], params)
        assert sum(request.engine_index == 1 for request in both._requests()) == 3
        return list(both.completed(timeout=120))

    base = AutoModelForCausalLM.from_pretrained(servers["model"]).state_dict()
    try:
        process_b.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        groups = served("hung")
        print(f"the stopped server was given up and its prompts served in {time.monotonic() - started:.1f} s")
        assert sorted(g.request_id for g in groups) == [f"hung{i}" for i in range(6)]
        assert all(g.engine_index == 0 for g in groups) and both.num_engines_alive() == 1
        assert "did not answer /health within" in both.last_engine_failure and urls["b"] in both.last_engine_failure
        process_b.send_signal(signal.SIGCONT)
        # every 2 s, as a trainer's pushes at most: checked in a tight loop (a /health round trip through a's engine
        # each time), b's vLLM engine core waited minutes on its worker in 7 of 19 tries here (docs/distillation.md)
        wait_until(lambda: both.check_engines() == 2, 120, "server b answering /health again", interval_s=2.0)
        both.sync_weights(base.items())  # earlier tests trained a's weights: now both servers hold the same
        assert (both.rejoined, both.num_engines_alive(), both.engine_restarts) == ((1,), 2, 1)
        assert both.last_engine_failure is None

        process_b.send_signal(signal.SIGSTOP)
        held_by_b = scored_on(teacher, "hung-score", on_b=3)  # b is given up while they wait
        assert teacher.num_engines_alive() == 1 and "did not answer /health within" in teacher.last_engine_failure
        direct = scored_on(teacher, "score", on_b=0)  # a's own scores
        process_b.send_signal(signal.SIGCONT)
        wait_until(lambda: teacher.check_engines() == 2, 120, "server b answering the teacher again", interval_s=2.0)
        scored_on(teacher, "wake", on_b=0)  # taken back at the first look while these wait: a teacher takes no push
        assert (teacher.num_engines_alive(), teacher.engine_restarts, teacher.last_engine_failure) == (2, 1, None)
        scored_by_b_again = scored_on(teacher, "back", on_b=3)

        process_b.send_signal(signal.SIGSTOP)  # so that it surely holds prompts when it is killed
        only_b.submit("lonely", [1, 40, 41, 42], params)
        for index in range(6):
            both.submit(f"p{index}", [1, 40 + index, 41, 42], params)
        assert sum(request.engine_index == 1 for request in both._requests()) == 3
        end_server(process_b, signal.SIGKILL)
        groups = list(both.completed(timeout=120))
        assert sorted(g.request_id for g in groups) == [f"p{i}" for i in range(6)]
        assert all(g.engine_index == 0 and len(g.samples) == 2 for g in groups)
        assert both.num_engines_alive() == 1 and urls["b"] in both.last_engine_failure
        with pytest.raises(RolloutEnginesLostError, match=f"all 1 rollout servers are dead \\({urls['b']}[;,]") as lost:
            list(only_b.completed(timeout=120))
        assert "'lonely'" in str(lost.value)
        for prefix, scored in (("hung-score", held_by_b), ("back", scored_by_b_again)):  # re-sent to a; b again
            for index in range(6):
                for served_then, served_now in zip(scored[f"{prefix}{index}"].responses,
                                                   direct[f"score{index}"].responses):
                    assert max(map(abs, (x - y for x, y in zip(served_then.log_probs, served_now.log_probs)))) < 1e-5
    finally:
        both.shutdown()
        only_b.shutdown()
        teacher.shutdown()


def scored_on(client, prefix: str, on_b: int) -> dict:
    """Six scoring requests, `on_b` of them sent to server b, collected."""
    from megatron_cpo.rollout.scoring import ScoreRequest

    for index in range(6):
        client.submit_score(ScoreRequest(f"{prefix}{index}", [1, 40 + index, 41, 42], [[50, 51, 52, 53]], 2))
    assert sum(server == 1 for _, server, _ in client._scoring.values()) == on_b
    return client.collect_scores(timeout=120)


def test_a_push_with_groups_in_flight_leaves_greedy_samples_unchanged_on_a_server(servers):
    """The in-flight policies reach the server's engines through /weights/begin and /weights/finish (the Ray
    engines run the same check for every policy in test_in_flight_push.py)."""
    from tests.rollout.servers import push_interrupts_greedy_groups_without_changing_them

    # server a: the test before this one killed b
    with ServerRolloutManager(ServerClientConfig(urls=(servers["urls"]["a"],), token=TOKEN)) as client:
        push_interrupts_greedy_groups_without_changing_them(client, servers["model"], "partial")
