"""What on-policy distillation's teachers need, checked before Ray, torch.distributed and the engines start
(`trainer/run/preflight.py` calls `distillation_problems`): each problem one line naming the key and the fix.

- the teacher's directory (and a Megatron teacher's checkpoint) exists;
- its tokenizer is the student's: the same vocabulary (every token string to the same id) and special tokens. The
  teacher scores the student's token ids as they are, so another tokenizer gives silent garbage; the padded vocabulary
  sizes of config.json may differ within a family (152064 and 151936 in Qwen2.5), which is fine, and
  cross-tokenizer distillation is not supported;
- its context holds a whole sampled sequence and the one token vLLM generates (data.max_prompt_length +
  data.max_response_length + 1): the engines' `inference.max_model_len`, a server's, the model's own positions;
- a `server` teacher answers its health check (unreachable: named at start);
- a `megatron` teacher fits the actor's TP / PP (Megatron's parallel state is one per process, so it runs in the
  actor's layout);
- with several teachers, every value of `teacher_key` in the data has one.
"""
from __future__ import annotations

import json
from pathlib import Path

from megatron_cpo.data.config import DataConfig
from megatron_cpo.models.config import ModelConfig
from megatron_cpo.rollout.teacher_config import DEFAULT_KEY, DistillationConfig, TeacherModelConfig
from megatron_cpo.trainer.config import MegatronConfig

HEALTH_TIMEOUT_S = 10.0


def tokenizer_difference(student, teacher) -> str | None:
    """How two tokenizers differ in what scoring the student's ids needs (None: not at all): the token -> id
    vocabulary and the special tokens with their ids."""
    mine, theirs = student.get_vocab(), teacher.get_vocab()
    moved = [token for token, index in mine.items() if theirs.get(token) != index]
    extra = [token for token in theirs if token not in mine]
    if moved or extra:
        example = moved[0] if moved else extra[0]
        return (f"{len(moved)} of the student's {len(mine)} tokens are missing or have another id, and the teacher "
                f"has {len(extra)} tokens the student lacks (e.g. {example!r}: student {mine.get(example)}, teacher "
                f"{theirs.get(example)})")
    specials = {name: (getattr(student, name, None), getattr(teacher, name, None))
                for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")}
    differ = {name: pair for name, pair in specials.items() if pair[0] != pair[1]}
    if sorted(student.all_special_tokens) != sorted(teacher.all_special_tokens) or differ:
        return (f"the special tokens differ (student {sorted(student.all_special_tokens)}, teacher "
                f"{sorted(teacher.all_special_tokens)}; ids {differ})")
    return None


def _tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _model_problems(name: str, teacher: TeacherModelConfig, student: ModelConfig, context: int,
                    megatron: MegatronConfig) -> list[str]:
    """The teacher directory exists, holds the student's tokenizer and enough positions (and a Megatron teacher fits
    the actor's layout)."""
    key = f"distillation.teacher_models.{name}.model_path={teacher.model_path!r}"
    path = Path(teacher.model_path)
    if not (path / "config.json").is_file():
        looks_like_repo = len(path.parts) == 2 and not str(path).startswith((".", "/", "~"))
        fix = (f"download it first (huggingface-cli download {path} --local-dir <dir>) and pass that directory"
               if looks_like_repo else "point it at the teacher's Hugging Face directory")
        return [f"{key} is not a model directory (no config.json); {fix}"]
    problems = []
    try:
        hf = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as err:
        return [f"{key}: config.json is not readable JSON ({err})"]
    positions = hf.get("max_position_embeddings")
    if isinstance(positions, int) and positions < context:
        problems.append(f"{key} holds {positions} positions (max_position_embeddings) but scores sequences of up to "
                        f"data.max_prompt_length + data.max_response_length + 1 = {context} tokens; shorten them or "
                        "choose a teacher with a longer context")
    if student.path and Path(student.path, "config.json").is_file():
        try:
            difference = tokenizer_difference(_tokenizer(student.path), _tokenizer(teacher.model_path))
        except (OSError, ValueError) as err:
            difference = f"its tokenizer cannot be loaded ({type(err).__name__}: {err})"
        if difference:
            problems.append(f"{key} does not share the student's tokenizer (actor_rollout_ref.model.path="
                            f"{student.path!r}): {difference}; the teacher scores the student's token ids as they are, "
                            "so choose a teacher of the student's tokenizer (cross-tokenizer distillation is not "
                            "supported)")
    heads, engine_tp = hf.get("num_attention_heads"), teacher.inference.tensor_model_parallel_size
    if teacher.kind == "engines" and isinstance(heads, int) and heads % engine_tp:
        problems.append(f"distillation.teacher_models.{name}.inference.tensor_model_parallel_size={engine_tp} does "
                        f"not divide the teacher's num_attention_heads={heads}; vLLM needs a TP that divides it")
    if teacher.kind == "megatron":
        tp, pp = megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size
        for field, size, what in (("num_attention_heads", tp, "TP"), ("num_key_value_heads", tp, "TP"),
                                  ("num_hidden_layers", pp, "PP")):
            count = hf.get(field) or (hf.get("num_attention_heads") if field == "num_key_value_heads" else None)
            if isinstance(count, int) and count % size:
                problems.append(f"{key} (kind=megatron) runs in the actor's layout (Megatron's parallel state is one "
                                f"per process), but its {field}={count} does not divide by the actor's {what}={size}; "
                                "use an engines teacher or a layout that divides both")
        if teacher.load and not Path(teacher.load).exists():
            problems.append(f"distillation.teacher_models.{name}.load={teacher.load!r} does not exist; point it at the "
                            "teacher's Megatron checkpoint, or leave it empty to load model_path's weights")
    return problems


def _server_problems(name: str, teacher: TeacherModelConfig, context: int) -> list[str]:
    """Every server of a `server` teacher answers /health in time and serves `context` tokens."""
    from megatron_cpo.rollout.http_client import HttpCaller, health_problem

    caller = HttpCaller("")
    problems = []
    try:
        for url in teacher.server_urls:
            problem, body = health_problem(caller, url.rstrip("/"), HEALTH_TIMEOUT_S)
            key = f"distillation.teacher_models.{name}.server_urls"
            if problem is not None:
                problems.append(f"{key} holds {url}, which does not answer: {problem}; start it (megatron-cpo rollout "
                                "--model <teacher>) or fix the URL")
            elif body.get("max_model_len", 0) < context:
                problems.append(f"{key}: {url} serves {body.get('max_model_len')} tokens per sequence but the teacher "
                                f"scores up to data.max_prompt_length + data.max_response_length + 1 = {context}; "
                                f"restart it with --max-model-len {context}")
    finally:
        caller.close()
    return problems


def routing_problems(distillation: DistillationConfig, data: DataConfig) -> list[str]:
    """With several teachers (or one keyed teacher), every row's `teacher_key` value has a teacher."""
    from megatron_cpo.data.dataset import read_parquet_rows

    keys = {distillation.routing_key(name): name for name in distillation.teacher_models}
    if DEFAULT_KEY in keys:
        return []
    problems = []
    for file in [*data.train_files, *data.val_files]:
        try:
            rows = read_parquet_rows(file)
        except Exception:  # noqa: BLE001 - data_problems reports unreadable files
            continue
        values = {str(row.get(distillation.teacher_key)) for row in rows}
        missing = sorted(values - set(keys))
        if missing:
            problems.append(f"{file!r} has rows whose distillation.teacher_key={distillation.teacher_key} is "
                            f"{', '.join(map(repr, missing[:5]))}, which no teacher scores (teachers' keys: "
                            f"{sorted(keys)}); add a teacher with that key, or drop those rows")
    return problems


def distillation_problems(distillation: DistillationConfig, student: ModelConfig, data: DataConfig,
                          megatron: MegatronConfig) -> list[str]:
    """Every problem of the run's teachers (none when distillation is off)."""
    if not distillation.enabled:
        return []
    context = data.max_prompt_length + data.max_response_length + 1
    problems = []
    for name, teacher in distillation.teacher_models.items():
        engine_len = teacher.inference.max_model_len
        if teacher.kind == "engines" and engine_len is not None and engine_len < context:
            problems.append(f"distillation.teacher_models.{name}.inference.max_model_len={engine_len} is shorter than "
                            f"data.max_prompt_length + data.max_response_length + 1 = {context} (a sampled sequence "
                            f"and the token vLLM generates); set it to {context} or null")
        if teacher.kind == "server":
            problems += _server_problems(name, teacher, context)
        if teacher.kind != "self" and teacher.model_path:
            problems += _model_problems(name, teacher, student, context, megatron)
    return problems + routing_problems(distillation, data)


def describe_teachers(distillation: DistillationConfig) -> tuple[str, ...]:
    """`--dry-run`'s lines: the distillation signal and where each teacher runs (none when distillation is off)."""
    if not distillation.enabled:
        return ()
    loss = distillation.distillation_loss
    if distillation.uses_additive_form:
        signal = f"slime's additive form: advantages - {distillation.opd_kl_coef} x (student - teacher) log-probs"
    else:
        form = "as a reward (policy gradient)" if loss.use_policy_gradient else "as a loss"
        task = (f"plus the task loss, weight {loss.distillation_loss_coef}" if loss.use_task_rewards
                else "without the task loss")
        signal = f"{loss.loss_mode}{f' (top-{loss.topk})' if loss.rules.topk else ''} {form}, {task}"
    lines = [f"distillation: {signal}"]
    for name, teacher in distillation.teacher_models.items():
        key = distillation.routing_key(name)
        rows = "every row" if key == DEFAULT_KEY else f"rows with {distillation.teacher_key}={key}"
        tp = teacher.inference.tensor_model_parallel_size
        where = {"engines": f"{distillation.replicas(name)} engine(s) x TP {tp} of {teacher.model_path}",
                 "server": f"servers {', '.join(teacher.server_urls)}",
                 "megatron": f"a frozen Megatron model of {teacher.load or teacher.model_path} in the actor's layout",
                 "self": "the policy given the gold solution (the trainer's hinted pass)"}[teacher.kind]
        lines.append(f"teacher {name}: {where}; scores {rows}")
    return tuple(lines)
