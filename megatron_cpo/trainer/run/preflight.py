"""Everything about a run that can be checked before Ray, torch.distributed and the engines start.

`preflight(config)` hands each check here its own sections: it reads the model's config.json and the
data files, and reports every problem at once in one `ConfigError`: the model directory, TP/PP against the heads,
layers and world size, EP/ETP against the experts and the world size (and the model family's own checks,
`models.builder.check_hf_config`), verl's `trainer.nnodes x n_gpus_per_node`, the data files (present, non-empty,
every row as the dataset checks it, a grader for every data source), the output directory and the distillation
teachers (distillation_preflight.py). It returns the
`RunPlan` the config implies (its `Layout`, trainer/run/layout.py, and a step's batch arithmetic), which
`megatron-cpo train --dry-run` prints. The trainer calls it first, so a bad layout fails in a second instead of after
the engines have started.
"""
from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from megatron_cpo.compute_dtype import ComputeDtype, resolve_dtype
from megatron_cpo.config import Config
from megatron_cpo.config_checks import ConfigError
from megatron_cpo.data.config import DataConfig
from megatron_cpo.envs.config import MultiTurnConfig
from megatron_cpo.envs.registry import check_rows
from megatron_cpo.models.config import ModelConfig
from megatron_cpo.rewards.config import RewardConfig
from megatron_cpo.rollout.modes import rollout_mode_problems
from megatron_cpo.trainer.config import PARAMS_DTYPE_KEY, ActorConfig, MegatronConfig, TrainerConfig
from megatron_cpo.trainer.critic_config import CriticConfig
from megatron_cpo.trainer.driver.loggers import sink_package_problems
from megatron_cpo.trainer.run.distillation_preflight import describe_teachers, distillation_problems
from megatron_cpo.trainer.run.layout import Layout
from megatron_cpo.trainer.run.run_guards import mixing_problem

MODEL_KEY = "actor_rollout_ref.model.path"
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class RunPlan:
    """What a valid config implies: its `Layout`, where the world size came from, the dtype the actor and the engines
    compute in (and why), and the batch arithmetic of a step (`megatron-cpo train --dry-run` prints it)."""
    layout: Layout
    dtype: ComputeDtype
    world_source: str
    responses_per_step: int
    mini_batches_per_step: int
    micro_batches_per_rank: int
    generation_batch: int
    train_prompts: int | None
    steps: int | None
    teachers: tuple[str, ...] = ()  # on-policy distillation's signal and teachers (distillation_preflight.py)

    def describe(self) -> str:
        """Lines for `--dry-run`."""
        steps = "unknown (data not readable)" if self.steps is None else str(self.steps)
        return "\n".join([
            *self.layout.describe_processes(self.world_source),
            *self.describe_dtype(),
            f"per step: {self.responses_per_step} responses in {self.mini_batches_per_step} optimizer step(s), "
            f"{self.micro_batches_per_rank} micro-batch(es) per DP rank per optimizer step",
            f"generation batch: {self.generation_batch} prompts (unit of filter_groups.max_num_gen_batches)",
            f"training prompts: {self.train_prompts if self.train_prompts is not None else 'unknown'}; "
            f"steps: {steps}",
            *self.teachers,
        ])

    def describe_dtype(self) -> list[str]:
        """The dtype line, and the slow-bf16 warning when it applies (also logged when a run starts)."""
        warning = self.dtype.warning(PARAMS_DTYPE_KEY)
        return [f"dtype of the actor and the engines: {self.dtype.describe(PARAMS_DTYPE_KEY)}",
                *([f"warning: {warning}"] if warning else [])]


def trainer_world_size(trainer: TrainerConfig, planning: bool) -> tuple[int, str]:
    """torchrun's WORLD_SIZE when set; when only planning (`--dry-run`), verl's nnodes x n_gpus_per_node if given."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"]), "WORLD_SIZE"
    if planning and trainer.nnodes > 0 and trainer.n_gpus_per_node > 0:
        return trainer.nnodes * trainer.n_gpus_per_node, "trainer.nnodes x trainer.n_gpus_per_node"
    return 1, "a single process"


def model_problems(model: ModelConfig, actor: ActorConfig, rollout_tp: int) -> list[str]:
    """The model directory exists and holds a model whose heads and layers the TP/PP layout (and the engines'
    `rollout_tp`) divides."""
    path = Path(model.path)
    if not model.path:
        return [f"{MODEL_KEY} is not set; point it at a Hugging Face model directory (config.json, weights, "
                "tokenizer)"]
    if not path.exists():
        looks_like_repo = len(path.parts) == 2 and not str(path).startswith((".", "/", "~"))
        fix = (f"download it first (huggingface-cli download {path} --local-dir <dir>) and pass that directory"
               if looks_like_repo else "point it at a Hugging Face model directory")
        return [f"{MODEL_KEY}={str(path)!r} does not exist; {fix}"]
    if not path.is_dir() or not (path / "config.json").is_file():
        return [f"{MODEL_KEY}={str(path)!r} is not a model directory (no config.json); point it at a Hugging Face "
                "model directory, e.g. one written by megatron-cpo convert-mcore-to-hf"]
    problems = []
    if not any(next(path.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        problems.append(f"{MODEL_KEY}={str(path)!r} holds no weights (*.safetensors / *.bin)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        problems.append(f"{MODEL_KEY}={str(path)!r} holds no tokenizer (tokenizer.json / tokenizer_config.json)")
    try:
        hf = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as err:
        return problems + [f"{MODEL_KEY}={str(path)!r}: config.json is not readable JSON ({err})"]
    megatron = actor.megatron
    tp, pp = megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size
    prefix = "actor_rollout_ref.actor.megatron."
    heads = hf.get("num_attention_heads")
    kv_heads = hf.get("num_key_value_heads") or heads
    layers = hf.get("num_hidden_layers")
    if isinstance(heads, int) and heads % tp:
        problems.append(f"{prefix}tensor_model_parallel_size={tp} does not divide the model's "
                        f"num_attention_heads={heads}; choose a TP that divides it")
    if isinstance(kv_heads, int) and kv_heads % tp:
        problems.append(f"{prefix}tensor_model_parallel_size={tp} does not divide the model's "
                        f"num_key_value_heads={kv_heads}; choose a TP that divides it")
    if isinstance(layers, int) and layers % pp:
        problems.append(f"{prefix}pipeline_model_parallel_size={pp} does not divide the model's "
                        f"num_hidden_layers={layers}; choose a PP that divides it")
    if isinstance(heads, int) and heads % rollout_tp:
        problems.append(f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout_tp} does not divide the "
                        f"model's num_attention_heads={heads}; vLLM needs a TP that divides it")
    return problems + family_problems(model, actor, path, layout_checked=not problems)


ARCHITECTURE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "intermediate_size", "vocab_size", "num_experts", "num_local_experts",
                     "moe_intermediate_size")
"""The config.json entries that make two checkpoints the same architecture (the critic's and the actor's)."""


def critic_problems(model: ModelConfig, critic: CriticConfig) -> list[str]:
    """`critic.model.path`, when set, is a model directory of the actor's architecture: the critic is the actor's
    model with a value head, in the actor's layout."""
    path = Path(critic.model.path)
    if not critic.model.path or not Path(model.path, "config.json").is_file():
        return []  # the actor's model (checked above)
    name = f"critic.model.path={critic.model.path!r}"
    if not (path / "config.json").is_file():
        return [f"{name} is not a model directory (no config.json); point it at the actor's model or a critic "
                "saved by a PPO run (checkpoints/step_<k>/critic_huggingface), or leave it unset (the actor's model)"]
    if not any(next(path.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        return [f"{name} holds no weights (*.safetensors / *.bin)"]
    try:
        mine, actor = (json.loads(Path(folder, "config.json").read_text()) for folder in (path, model.path))
    except (OSError, ValueError) as err:
        return [f"{name}: config.json is not readable JSON ({err})"]
    differ = [f"{key} {mine.get(key)} (the actor's: {actor.get(key)})" for key in ARCHITECTURE_KEYS
              if mine.get(key) != actor.get(key)]
    if differ:
        return [f"{name} is another architecture than the actor's {MODEL_KEY}={model.path!r}: {'; '.join(differ)}; "
                "the critic is the actor's model with a value head, so point critic.model.path at a checkpoint of "
                "the actor's architecture, or leave it unset (the actor's model)"]
    return []


def family_problems(model: ModelConfig, actor: ActorConfig, path: Path, layout_checked: bool) -> list[str]:
    """What the model's family says about the run (models.builder.check_hf_config: a supported family, no option it
    cannot reproduce, experts that split over EP / ETP, when the heads and layers already fit TP / PP), and the
    mixture-of-experts settings: MoE with TP > 1 needs sequence parallelism (Megatron's MoE layer refuses to train
    without it), and router freezing / routing replay need a MoE model (replay: without context parallelism, and
    without full recompute under PP, which would replay a later micro-batch's routing in the backward)."""
    from megatron_cpo.models.builder import check_hf_config, load_hf_config
    from megatron_cpo.models.families import family_of

    megatron = actor.megatron
    try:
        hf_config = load_hf_config(path)
    except Exception as err:  # noqa: BLE001 - transformers' validators raise their own error types
        return [f"{MODEL_KEY}={str(path)!r}: transformers cannot read its config.json ({type(err).__name__}: {err})"]
    try:
        family = family_of(hf_config)
    except ValueError as err:
        return [f"{MODEL_KEY}={str(path)!r}: {err}"]
    problems = []
    # the heads and layers against TP / PP are reported above with their keys; checked again only when they fit
    tp, pp = ((megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size) if layout_checked
              else (1, 1))
    try:
        check_hf_config(hf_config, tp, pp, megatron.expert_model_parallel_size,
                        megatron.expert_tensor_parallel_size or tp)
    except ValueError as err:
        problems.append(f"{MODEL_KEY}={str(path)!r}: {err}")
    prefix = "actor_rollout_ref.actor."
    if family.moe(hf_config) is None:
        if megatron.freeze_moe_router:
            problems.append(f"{prefix}megatron.freeze_moe_router=true, but model_type={hf_config.model_type!r} has no "
                            "router (a dense model); set it false")
        if actor.router_replay.replays:
            problems.append(f"{prefix}router_replay.mode={actor.router_replay.mode} replays a mixture of experts' "
                            f"routing, but model_type={hf_config.model_type!r} is dense; set it to disabled")
        return problems
    if megatron.tensor_model_parallel_size > 1 and not megatron.sequence_parallel:
        problems.append(f"{prefix}megatron.tensor_model_parallel_size={megatron.tensor_model_parallel_size} with a "
                        "mixture of experts needs actor_rollout_ref.actor.megatron.sequence_parallel=true (Megatron's "
                        "MoE layer does not train under TP without it); set it")
    if actor.router_replay.replays and megatron.context_parallel_size > 1:
        problems.append(f"{prefix}router_replay.mode={actor.router_replay.mode} is not available with "
                        f"megatron.context_parallel_size={megatron.context_parallel_size}; set one of them back")
    if (actor.router_replay.replays and megatron.pipeline_model_parallel_size > 1
            and model.enable_gradient_checkpointing and megatron.recompute_granularity ==
            "full"):
        problems.append(f"{prefix}router_replay.mode={actor.router_replay.mode} with full recompute under "
                        f"pipeline_model_parallel_size={megatron.pipeline_model_parallel_size} would replay another "
                        "micro-batch's routing in the recomputed forward; use recompute_granularity=selective, "
                        "PP=1, or enable_gradient_checkpointing=false")
    return problems


def lora_problems(model: ModelConfig, actor: ActorConfig, critic: CriticConfig | None) -> list[str]:
    """LoRA's settings against the model and the layout (models/lora/targets.py) and a starting adapter against the
    base (models/lora/peft_format.py), for the actor and, when it trains one with LoRA, the critic."""
    from megatron_cpo.models.builder import load_hf_config
    from megatron_cpo.models.lora.peft_format import adapter_problems
    from megatron_cpo.models.lora.targets import layout_problems

    megatron = actor.megatron
    problems = []
    for path, lora in ((model.path, model.lora), ((critic.model.path or model.path) if critic else "",
                                                   critic.model.lora if critic else None)):
        if lora is None or not lora.enabled or not Path(path, "config.json").is_file():
            continue
        try:
            hf_config = load_hf_config(path)
            problems += layout_problems(hf_config, lora, megatron.tensor_model_parallel_size,
                                        megatron.pipeline_model_parallel_size, megatron.expert_tensor_parallel)
            if lora.adapter_path and not problems:
                problems += adapter_problems(lora.adapter_path, path, hf_config, lora)
        except Exception as err:  # noqa: BLE001 - the family check reports an unreadable or unsupported config
            problems.append(f"{lora.SECTION}: the model {path!r} cannot carry adapters ({type(err).__name__}: {err})")
    return problems


def context_parallel_problems(megatron: MegatronConfig, model: ModelConfig) -> list[str]:
    """Context parallelism needs Transformer Engine (its ring attention) and the padded rows."""
    from megatron_cpo.models.builder import uses_transformer_engine

    cp = megatron.context_parallel_size
    if cp == 1:
        return []
    name = f"actor_rollout_ref.actor.megatron.context_parallel_size={cp}"
    if not uses_transformer_engine():
        return [f"{name} needs Transformer Engine (its ring attention; GPU only), which is not importable here; set "
                "context_parallel_size=1 or install transformer_engine"]
    if model.use_remove_padding:
        return [f"{name} splits padded rows only; set actor_rollout_ref.model.use_remove_padding=false or "
                "context_parallel_size=1"]
    return []


def attention_problems(megatron: MegatronConfig) -> list[str]:
    """`attention_backend` names a core attention this machine has (`unfused` is Transformer Engine's)."""
    from megatron_cpo.models.builder import attention_kind

    try:
        attention_kind(megatron.attention_backend)
    except ValueError as error:
        return [str(error)]
    return []


def layout_problems(layout: Layout, model: ModelConfig, actor: ActorConfig, trainer: TrainerConfig,
                    world_source: str, planning: bool) -> list[str]:
    """TP x PP (x CP) divides the world; verl's nnodes x n_gpus_per_node, when given, is the world; context
    parallelism has Transformer Engine and padded rows; the attention backend exists here."""
    megatron, world_size, model_parallel = actor.megatron, layout.world_size, layout.model_parallel
    cp_text = (f" x context_parallel_size={megatron.context_parallel_size}"
               if megatron.context_parallel_size > 1 else "")
    problems = context_parallel_problems(megatron, model) + attention_problems(megatron)
    if world_size % model_parallel:
        problems.append(
            f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={megatron.tensor_model_parallel_size} x "
            f"pipeline_model_parallel_size={megatron.pipeline_model_parallel_size}{cp_text} = {model_parallel} does "
            f"not divide the trainer's {world_size} process(es) ({world_source}); launch a multiple of "
            f"{model_parallel} processes (torchrun --nproc-per-node) or lower TP/PP")
    expert_parallel = (megatron.pipeline_model_parallel_size * megatron.expert_model_parallel_size
                       * megatron.expert_tensor_parallel)
    if world_size % expert_parallel and not world_size % model_parallel:  # (the TP line above says it otherwise)
        problems.append(
            f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={megatron.pipeline_model_parallel_size} x "
            f"expert_model_parallel_size={megatron.expert_model_parallel_size} x expert_tensor_parallel_size="
            f"{megatron.expert_tensor_parallel} = {expert_parallel} does not divide the trainer's {world_size} "
            f"process(es) ({world_source}): each stage's experts are split EP x ETP ways over its processes; launch a "
            f"multiple of {expert_parallel} processes or lower EP/ETP")
    declared = trainer.nnodes * trainer.n_gpus_per_node
    if not planning and trainer.nnodes > 0 and trainer.n_gpus_per_node > 0 and declared != world_size:
        problems.append(
            f"trainer.nnodes={trainer.nnodes} x trainer.n_gpus_per_node={trainer.n_gpus_per_node} = {declared} but "
            f"the trainer runs on {world_size} process(es) ({world_source}); launch it with torchrun --nnodes "
            f"{trainer.nnodes} --nproc-per-node {trainer.n_gpus_per_node}, or drop these keys (the rollout engines "
            "are separate processes and not counted here)")
    return problems


def data_problems(data: DataConfig, reward: RewardConfig, multi_turn: MultiTurnConfig
                  ) -> tuple[list[str], int | None]:
    """Every data file is a readable parquet file whose rows pass the dataset's own check (`data.dataset.read_rows`:
    rows present, the prompt column, the verl schema, ground truths where the graders need them), and each data
    source has a grader (`reward.*`, or the row's environment scores itself with `multi_turn.enable`); returns the
    problems and the number of training rows (None when unreadable)."""
    from megatron_cpo.data.dataset import DataValidationError, read_rows
    from megatron_cpo.rewards.registry import missing_grader_message, sources_without_grader

    if not data.train_files:
        return ["data.train_files is empty; set it to one or more parquet files (verl schema, see docs/data.md)"], None
    problems: list[str] = []
    train_rows: int | None = 0
    sources: Counter = Counter()
    all_rows: list[dict] = []
    for key, files in (("data.train_files", data.train_files), ("data.val_files", data.val_files)):
        for file in files:
            try:
                rows = read_rows(file, data.prompt_key, reward.needs_ground_truth)
            except (FileNotFoundError, DataValidationError) as err:
                what = f"{file!r} is a directory" if Path(file).is_dir() else str(err)
                problems.append(f"{key}: {what}" + ("; give parquet files (tools/prepare_data.py or python -m "
                                                    "megatron_cpo.data.synthetic write them)"
                                                    if isinstance(err, FileNotFoundError) else ""))
            except Exception as err:  # noqa: BLE001 - any reader failure means "not a parquet file we can read"
                problems.append(f"{key}: {file!r} is not a readable parquet file ({type(err).__name__}: {err})")
            else:
                sources.update(row["data_source"] for row in rows)
                all_rows += rows
                if key == "data.train_files" and train_rows is not None:
                    train_rows += len(rows)
                continue
            train_rows = None if key == "data.train_files" else train_rows
    if multi_turn.enable:  # rows whose environment scores its episodes itself need no grader
        found, self_scored = check_rows(multi_turn, all_rows, reward.sandbox)
        problems += found
        sources = Counter({source: count for source, count in sources.items() if source not in self_scored})
    missing = sources_without_grader(reward, sources)
    if missing:
        counts = ", ".join(f"{source}: {sources[source]} rows" for source in missing)
        problems.append(missing_grader_message(missing, f"data.train_files / data.val_files ({counts})"))
    return problems, train_rows


def output_problems(trainer: TrainerConfig) -> list[str]:
    """`trainer.default_local_dir` and its checkpoints folder are folders (or can be created), and no earlier run
    there would mix with this one."""
    out = Path(trainer.default_local_dir)
    problems = []
    for path in (out, out / "checkpoints"):
        if path.exists() and not path.is_dir():
            problems.append(f"trainer.default_local_dir={str(out)!r}: {str(path)!r} is a file, not a folder; choose "
                            "another trainer.default_local_dir")
            break
    for parent in [out, *out.parents]:
        if parent.exists():
            if parent.is_dir() and not os.access(parent, os.W_OK):
                problems.append(f"trainer.default_local_dir={str(out)!r}: {str(parent)!r} is not writable; choose "
                                "a folder you can write to")
            elif not parent.is_dir() and parent != out:
                problems.append(f"trainer.default_local_dir={str(out)!r}: {str(parent)!r} is a file, not a folder")
            break
    mixing = mixing_problem(trainer)
    return problems + ([mixing] if mixing else [])


def preflight(config: Config, planning: bool = False) -> RunPlan:
    """Check what can be checked without starting anything, each check with its own sections; raise one
    `ConfigError` listing every problem, else return the run's `RunPlan`. The one function of the run's plumbing
    that reads the whole `Config`: it runs before the trainer exists (also for `megatron-cpo train --dry-run`,
    which must not import Megatron).

    `planning` (the dry run) takes the world size from verl's nnodes x n_gpus_per_node when not under torchrun.
    Under torchrun only rank 0 reads the data files (the only rank that loads them), every rank checks the rest."""
    model, actor, rollout = (config.actor_rollout_ref.model, config.actor_rollout_ref.actor,
                             config.actor_rollout_ref.rollout)
    world_size, world_source = trainer_world_size(config.trainer, planning)
    layout = Layout.from_sections(model, actor, rollout, config.needs_reference_model, world_size,
                                  critic=config.critic_enabled)
    lead = planning or os.environ.get("RANK", "0") == "0"
    problems = model_problems(model, actor, rollout.tensor_model_parallel_size)
    problems += critic_problems(model, config.critic) if config.critic_enabled else []
    problems += lora_problems(model, actor, config.critic if config.critic_enabled else None) if not problems else []
    problems += layout_problems(layout, model, actor, config.trainer, world_source, planning)
    found, train_rows = data_problems(config.data, config.reward, rollout.multi_turn) if lead else ([], None)
    problems += found + output_problems(config.trainer) + sink_package_problems(config.trainer.logger)
    problems += rollout_mode_problems(rollout) if lead else []
    problems += distillation_problems(config.distillation, model, config.data, actor.megatron) if lead else []
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} problems found before starting:\n" +
                          "\n".join(f"  - {p}" for p in problems))
    data = config.data
    per_mini = actor.ppo_mini_batch_size * rollout.n
    steps = config.total_steps(train_rows) if train_rows is not None else config.trainer.total_training_steps or None
    return RunPlan(layout=layout, dtype=resolve_dtype(actor.megatron.params_dtype), world_source=world_source,
                   responses_per_step=data.train_batch_size * rollout.n,
                   mini_batches_per_step=data.train_batch_size // actor.ppo_mini_batch_size * actor.ppo_epochs,
                   micro_batches_per_rank=math.ceil(per_mini / layout.dp / actor.ppo_micro_batch_size_per_gpu),
                   generation_batch=data.generation_batch_size, train_prompts=train_rows, steps=steps,
                   teachers=describe_teachers(config.distillation))
