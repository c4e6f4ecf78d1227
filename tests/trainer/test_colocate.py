"""`rollout.mode=colocate` end to end on CPU: the quickstart's DAPO config (shortened, filter off) trains with its
engine started on the trainer's node by `build_rollout_manager` (its own process tree, loopback, a random token, no
Ray), weights pushed over shared memory; after each run's last push the engine generates transformers' greedy tokens
for that step's exported weights, and a resumed run continues from the checkpoint on the same engine; multi-turn
episodes then train one step on it (two-try arithmetic, examples/tiny/arith_retry.yaml; the engine's context, set by
the first config, fits their prompts and budget). (The quickstart's GRPO and CPO configs train against an engine
server, the same HTTP client and server code, in tests/rollout/test_server_mode.py.) Then a
trainer on two emulated nodes (one rank each, loopback; PP=2, a stage per node) trains a tiny Llama with tied
embeddings at learning rate 3e-2: each node's rank starts that node's engine, rank 0 drives both, weights go over the
collective, and both engines' log-probs, of their samples and of the sync probe, equal the trainer's after every
push."""
import json
import logging
import os
from pathlib import Path

import psutil
import pytest

from megatron_cpo.trainer.assemble import run_training
from tests.rollout.servers import assert_engine_in_sync, greedy_matches_transformers

pytestmark = pytest.mark.usefixtures("restore_environment")
TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny"


def _config(arith_data, out_dir, steps, *extra, example="dapo_arith.yaml"):
    from megatron_cpo.config import load_config

    return load_config(TINY / example, [
        f"data.train_files={arith_data['train']}", f"data.val_files={arith_data['test']}", "data.train_batch_size=4",
        "data.max_response_length=12", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", f"actor_rollout_ref.model.path={TINY / 'model'}",
        "actor_rollout_ref.rollout.mode=colocate", "algorithm.filter_groups.enable=false",
        "reward.overlong_buffer.len=4", "trainer.test_freq=-1",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]", "trainer.save_freq=1",
        f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={out_dir}", "trainer.logger=[jsonl]",
        *extra])


def test_colocated_training_pushes_into_its_own_engine_and_resumes(arith_data, tmp_path, caplog):
    import ray

    from megatron_cpo.rollout.colocate import ColocatedRolloutManager
    from megatron_cpo.rollout.modes import build_rollout_manager
    from megatron_cpo.trainer.components import engine_launch_config

    out = tmp_path / "run"
    ray_was_running = ray.is_initialized()
    config = _config(arith_data, out, 2)
    with caplog.at_level("INFO", logger="megatron_cpo.rollout.colocate"):
        manager = build_rollout_manager(config.actor_rollout_ref.rollout, engine_launch_config(config))
    assert "vLLM sleep/wake does nothing here" in caplog.text
    assert isinstance(manager, ColocatedRolloutManager) and len(manager.engines) == 1
    assert manager.engines[0].startswith("http://127.0.0.1:") and manager.weight_transport == "shm"
    engine_pids = [p.pid for p in psutil.Process(manager.local_servers.processes[0].pid).children(recursive=True)]
    try:
        first = run_training(_config(arith_data, out, 2), manager)
        assert first["rollout/engines_alive"] == 1.0
        assert_engine_in_sync(_rows(out), (1, 2))
        greedy_matches_transformers(manager, out / "checkpoints" / "step_000002" / "huggingface")
        resumed = run_training(_config(arith_data, out, 3, "trainer.resume=auto"), manager)
        assert "val/acc" in resumed
        steps = sorted({json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()})
        assert steps == [0, 1, 2, 3]
        greedy_matches_transformers(manager, out / "checkpoints" / "step_000003" / "huggingface")
        episodes = run_training(_config(arith_data, tmp_path / "arith_retry", 1, "data.max_response_length=128",
                                        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=40",
                                        example="arith_retry.yaml"), manager)  # multi-turn episodes, colocated
        assert episodes["multi_turn/turns_max"] == 2 and episodes["multi_turn/observation_tokens_mean"] > 0
        assert episodes["multi_turn/template_differs"] == 0 and "val/multi_turn/turns_mean" in episodes
    finally:
        manager.shutdown()
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                   for pid in engine_pids), "the colocated engine's processes outlive the manager"
    assert ray.is_initialized() == ray_was_running, "colocate mode must not start Ray"


def _rows(out: Path) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _train_as_the_only_rank_of_its_node(rank, world_size, arith_data, out_dir, model_dir):
    """This rank is LOCAL_RANK 0 of LOCAL_WORLD_SIZE 1: node `rank` of a 2-node trainer (PP=2: a stage per node)."""
    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", VLLM_CPU_KVCACHE_SPACE="1")
    messages = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    colocate_logger = logging.getLogger("megatron_cpo.rollout.colocate")
    colocate_logger.addHandler(handler)
    colocate_logger.setLevel(logging.INFO)
    metrics = run_training(_config(arith_data, Path(out_dir), 2,
                                   "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                                   "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                                   f"actor_rollout_ref.model.path={model_dir}",
                                   "actor_rollout_ref.actor.optim.lr=3e-2"))
    return {"metrics": metrics, "log": messages}


@pytest.mark.multiprocess
def test_a_trainer_on_two_nodes_starts_an_engine_on_each_and_pushes_over_the_collective(arith_data, tmp_path,
                                                                                        tied_llama_dir):
    from tests.multiprocess import run_processes

    out = tmp_path / "run"
    ranks = run_processes(_train_as_the_only_rank_of_its_node, 2, arith_data, str(out), str(tied_llama_dir))
    started = {}
    for node, rank in enumerate(ranks):
        [line] = [m for m in rank["log"] if m.startswith(f"node {node}: 1 colocated engine server(s) at ")]
        assert "http://127.0.0.1:" in line, line
        started[node] = int(line.rsplit("(pids ", 1)[1].rstrip(")"))
    assert "colocated rollout on 2 node(s): 2 engine(s), weights by collective" in ranks[0]["log"]
    assert ranks[0]["metrics"]["rollout/engines_alive"] == 2.0 and ranks[1]["metrics"] == {}
    rows = _rows(out)
    assert [step for step, row in rows.items() if "actor/grad_norm" in row] == [1, 2]
    # both nodes' engines got each push: their log-probs equal the trainer's (fp32), the sync probe covers both
    assert_engine_in_sync(rows, (1, 2))
    assert (out / "checkpoints" / "step_000002" / "huggingface" / "config.json").is_file()
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                   for pid in started.values()), f"a node's engine server outlives the run: {started}"


def test_an_engine_that_does_not_start_in_time_fails_every_rank_naming_its_node_and_leaves_no_process(arith_data,
                                                                                                      tmp_path):
    """One process stands for every rank (`exchange` returns its own value): the node's engine misses its start
    timeout, so the call raises naming the node, the engine and its log, after stopping the server it started."""
    import dataclasses

    from megatron_cpo.rollout.colocate import start_colocated_engines
    from megatron_cpo.rollout.modes import colocated_client_settings
    from megatron_cpo.rollout.types import RolloutEngineStartError
    from megatron_cpo.trainer.components import engine_launch_config

    config = _config(arith_data, tmp_path / "run", 1)
    engines = dataclasses.replace(engine_launch_config(config), engine_start_timeout_s=0.5)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(RolloutEngineStartError, match=r"^node 0 \(.*\): colocated rollout engine 0 of node 0 did not "
                                                      r"start within rollout engine_start_timeout_s=0.5s \(log: "):
        start_colocated_engines(engines, lambda value: [value],
                                colocated_client_settings(config.actor_rollout_ref.rollout, engines))
    left = []
    for process in psutil.Process().children(recursive=True):
        try:
            if process.pid not in before and process.status() != psutil.STATUS_ZOMBIE:
                left.append(process)
        except psutil.NoSuchProcess:
            pass
    assert left == [], left
