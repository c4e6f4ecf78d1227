"""`distillation.*`: on-policy distillation's teachers under verl's names and meanings, plus what this project adds
(the teacher's kind, slime's additive coefficient). Torch-free: loading a config imports no torch.

A teacher scores the student's sampled tokens, prompt + response as sampled, at temperature 1 (rollout/teachers.py).
Its kind says where it runs: `engines` (verl's only kind: vLLM engines of its own, `num_replicas` of them at
`inference.tensor_model_parallel_size`, started through the rollout manager), `server` (running `megatron-cpo
rollout` servers), `megatron` (a frozen Megatron model of `model_path` in the trainer, in the actor's layout, as
slime's `--opd-type megatron`) or `self` (the policy itself with the gold solution in its context: on-policy
self-distillation). The loss settings are algorithms/distillation_config.py's. docs/distillation.md says which
teacher to use when.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_cpo.algorithms.distillation_config import ADDITIVE_LOSS_MODES, DistillationLossConfig
from megatron_cpo.config_checks import check, check_choice

PREFIX = "distillation."
TEACHER_KINDS = ("engines", "server", "megatron", "self")
TRAINER_KINDS = ("megatron", "self")
"""The kinds that score in the trainer, on every rank (trainer/workers/megatron_teacher.py)."""
DEFAULT_TEACHER = "teacher_model"
"""verl's single-teacher entry: alone it scores every row; verl drops it silently when other entries exist."""
DEFAULT_KEY = "default"


@dataclass
class TeacherInferenceConfig:
    """verl's `teacher_models.<name>.inference`: how an `engines` teacher's own vLLM engines run (each over
    `tensor_model_parallel_size` devices; on CPU `kv_cache_gib` of KV cache, on GPU `gpu_memory_utilization`).
    `max_model_len` (null: data.max_prompt_length + data.max_response_length + 1, a whole sampled sequence and the
    one token vLLM generates) must hold that; `dtype` (empty: the actor's compute dtype); `max_logprobs` is raised to
    the loss's `topk` as verl does. verl's other engine keys (enforce_eager, cudagraph sizes, ...) load without effect
    (megatron_cpo/verl_compat.py); the teacher always scores at temperature 1."""
    name: str = "vllm"
    tensor_model_parallel_size: int = 1
    data_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    kv_cache_gib: float | str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    dtype: str = ""

    def check(self, prefix: str) -> None:
        check_choice(prefix + "name", self.name, ("vllm",))
        check(self.tensor_model_parallel_size >= 1, f"{prefix}tensor_model_parallel_size="
                                                    f"{self.tensor_model_parallel_size} must be >= 1")
        for name in ("data_parallel_size", "pipeline_model_parallel_size"):
            check(getattr(self, name) == 1, f"{prefix}{name}={getattr(self, name)}: a teacher engine is one vLLM "
                                            "engine over tensor_model_parallel_size devices; set it to 1 and raise "
                                            "the teacher's num_replicas for more engines")
        check(0 < self.gpu_memory_utilization <= 1, f"{prefix}gpu_memory_utilization={self.gpu_memory_utilization} "
                                                    "must be in (0, 1]")
        check(self.max_model_len is None or self.max_model_len >= 2, f"{prefix}max_model_len={self.max_model_len} "
                                                                     "must be >= 2 or null")
        check(self.dtype in ("", "float32", "bfloat16", "float16"), f"{prefix}dtype={self.dtype!r}: use float32, "
                                                                    "bfloat16, float16 or leave it empty (the actor's)")

    @property
    def world_size(self) -> int:
        return self.tensor_model_parallel_size * self.data_parallel_size * self.pipeline_model_parallel_size


@dataclass
class TeacherModelConfig:
    """verl's `teacher_models.<name>`: `key` (the value of the row's `distillation.teacher_key` this teacher scores;
    the lone `teacher_model` entry scores every row), `model_path` (its Hugging Face directory; the student's
    tokenizer), `num_replicas` (engines; 0: as many as `distillation.n_gpus_per_node x nnodes` holds for a single
    teacher, or one when that pool is 0) and `inference`.
    Ours: `kind` (engines, server, megatron or self, see the module), `server_urls` / `server_token_file` (kind
    server: the teacher's `megatron-cpo rollout` servers and their token), `load` (kind megatron: a Megatron
    checkpoint of the teacher's weights, slime's `--opd-teacher-load`; empty: `model_path`'s)."""
    key: str | None = None
    model_path: str = ""
    num_replicas: int = 0
    inference: TeacherInferenceConfig = field(default_factory=TeacherInferenceConfig)
    kind: str = "engines"
    server_urls: list[str] = field(default_factory=list)
    server_token_file: str = ""
    load: str = ""

    def check(self, prefix: str) -> None:
        check_choice(prefix + "kind", self.kind, TEACHER_KINDS)
        self.inference.check(prefix + "inference.")
        if self.kind == "self":
            check(not self.model_path and not self.load, f"{prefix}kind=self is the policy itself given the gold "
                                                         f"solution; remove {prefix}model_path / load")
        elif self.kind != "server":
            check(bool(self.model_path), f"{prefix}model_path is not set; point it at the teacher's Hugging Face "
                                         "directory (config.json, weights, tokenizer)")
        check(self.kind == "megatron" or not self.load, f"{prefix}load={self.load!r} is read only with kind=megatron; "
                                                        "remove it or set kind=megatron")
        check(self.kind == "server" or not self.server_urls, f"{prefix}server_urls is read only with kind=server; "
                                                             "remove it or set kind=server")
        if self.kind == "server":
            check(bool(self.server_urls), f"{prefix}kind=server needs {prefix}server_urls=[http://HOST:PORT, ...] "
                                          "(servers started with `megatron-cpo rollout --model <teacher>`)")
            check(bool(self.server_token_file), f"{prefix}kind=server needs {prefix}server_token_file (the token "
                                                "file the servers were started with)")
        check(self.num_replicas >= 0, f"{prefix}num_replicas={self.num_replicas} must be >= 0 (0: auto)")


@dataclass
class DistillationConfig:
    """`distillation`: on-policy distillation (verl's names; docs/distillation.md). `enabled` turns it on; the
    teachers are `teacher_models` (a lone `teacher_model` entry scores every row; several entries each score the rows
    whose `teacher_key` column (default `data_source`) equals their `key`); `n_gpus_per_node` x `nnodes` is verl's
    pool of teacher devices, which the `engines` teachers' `num_replicas x tensor_model_parallel_size` must fill
    exactly when it is not 0. `distillation_loss` is the signal (algorithms/distillation_config.py).
    `opd_kl_coef` > 0 (slime's `--opd-kl-coef`) selects slime's form instead: the advantages minus `opd_kl_coef x
    (student - teacher)` log-probs per token, trained by the actor's own policy loss (needs loss_mode k1)."""
    enabled: bool = False
    n_gpus_per_node: int = 8
    nnodes: int = 0
    teacher_key: str = "data_source"
    teacher_models: dict[str, TeacherModelConfig] = field(default_factory=dict)
    distillation_loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)
    opd_kl_coef: float = 0.0

    def __post_init__(self) -> None:
        check(self.opd_kl_coef >= 0, f"{PREFIX}opd_kl_coef={self.opd_kl_coef} must be >= 0 (0: verl's loss form)")
        if not self.enabled:
            return
        models = self.teacher_models
        check(bool(models), f"{PREFIX}enabled=true needs a teacher; set {PREFIX}teacher_models.{DEFAULT_TEACHER}."
                            "model_path=<HF dir> (or kind=self: the policy given the gold solution)")
        check(DEFAULT_TEACHER not in models or len(models) == 1,
              f"{PREFIX}teacher_models holds {DEFAULT_TEACHER} beside {sorted(set(models) - {DEFAULT_TEACHER})}: "
              f"verl drops {DEFAULT_TEACHER} silently then; give it another name and a key")
        for name, teacher in models.items():
            teacher.check(f"{PREFIX}teacher_models.{name}.")
            check(len(models) == 1 and name == DEFAULT_TEACHER or teacher.key is not None,
                  f"{PREFIX}teacher_models.{name}.key is not set; a teacher other than a lone {DEFAULT_TEACHER} "
                  f"scores the rows whose {self.teacher_key} equals its key: set it (e.g. openai/gsm8k), or name a "
                  f"lone teacher {DEFAULT_TEACHER} to score every row")
        keys = [teacher.key for teacher in models.values() if len(models) > 1]
        check(len(keys) == len(set(keys)), f"{PREFIX}teacher_models: two teachers share one key ({keys}); give each "
                                           "its own")
        self._check_pool()
        in_trainer = [name for name, t in models.items() if t.kind in TRAINER_KINDS]
        check(not in_trainer or len(models) == 1,
              f"{PREFIX}teacher_models: {in_trainer[0] if in_trainer else ''} (kind "
              f"{models[in_trainer[0]].kind if in_trainer else ''}) beside other teachers is not available yet: a "
              "teacher in the trainer (kind megatron or self) is the run's only teacher; route several teachers with "
              "kind engines or server")
        loss = self.distillation_loss
        problem = None if self.uses_additive_form else loss.gradient_problem()
        check(problem is None, problem or "")
        check(not self.opd_kl_coef or loss.loss_mode in ADDITIVE_LOSS_MODES,
              f"{PREFIX}opd_kl_coef={self.opd_kl_coef} (slime's additive form) subtracts coef x (student - teacher) "
              f"log-probs, the k1 estimator; set {PREFIX}distillation_loss.loss_mode=k1")

    def _check_pool(self) -> None:
        """verl's rule: the `engines` teachers fill the teacher pool `n_gpus_per_node x nnodes` exactly."""
        pool = self.n_gpus_per_node * self.nnodes
        engines = {name: t for name, t in self.teacher_models.items() if t.kind == "engines"}
        if pool == 0 or not engines:
            return
        if len(engines) == 1:
            (name, teacher), = engines.items()
            per_replica = teacher.inference.world_size
            check(teacher.num_replicas > 0 or pool % per_replica == 0,
                  f"{PREFIX}teacher_models.{name}: one replica takes {per_replica} devices, which does not divide the "
                  f"teacher pool {PREFIX}n_gpus_per_node x nnodes = {pool}; set num_replicas or the pool")
        used = sum(self.replicas(name) * t.inference.world_size for name, t in engines.items())
        check(used == pool, f"the teachers' num_replicas x tensor_model_parallel_size sum to {used} devices, but "
                            f"{PREFIX}n_gpus_per_node x nnodes = {pool}; make them equal (verl's rule), or set "
                            f"{PREFIX}nnodes=0 to size each teacher by its num_replicas alone")

    def replicas(self, name: str) -> int:
        """How many engines teacher `name` starts: `num_replicas`, or when 0 the pool a lone engines teacher fills
        (verl), or one."""
        teacher = self.teacher_models[name]
        if teacher.num_replicas:
            return teacher.num_replicas
        engines = [t for t in self.teacher_models.values() if t.kind == "engines"]
        pool = self.n_gpus_per_node * self.nnodes
        if pool and len(engines) == 1:
            return max(1, pool // teacher.inference.world_size)
        return 1

    def routing_key(self, name: str) -> str:
        """The `teacher_key` value whose rows teacher `name` scores (`DEFAULT_KEY`: every row)."""
        teacher = self.teacher_models[name]
        return DEFAULT_KEY if len(self.teacher_models) == 1 and name == DEFAULT_TEACHER else str(teacher.key)

    @property
    def has_self_teacher(self) -> bool:
        """Whether the policy given the gold solution is a teacher (the driver builds every row's hint context)."""
        return self.enabled and any(teacher.kind == "self" for teacher in self.teacher_models.values())

    @property
    def uses_additive_form(self) -> bool:
        """slime's form (advantages shaped by the reverse KL) instead of verl's loss term."""
        return self.enabled and self.opd_kl_coef > 0

    @property
    def replaces_task_reward(self) -> bool:
        """Whether the estimator's advantages are unused (verl's loss form without `use_task_rewards`): then verl's
        OPD scripts run `rollout.n=1` with a group estimator."""
        return self.enabled and not self.uses_additive_form and not self.distillation_loss.use_task_rewards
