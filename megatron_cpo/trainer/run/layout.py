"""`Layout`: how a run spreads over its processes and what its trainer keeps in memory, the one description that the
pre-start check (preflight.py, printed by `megatron-cpo train --dry-run`) and tools/plan_memory.py share."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_cpo.models.config import ModelConfig
from megatron_cpo.rollout.config import RolloutConfig
from megatron_cpo.trainer.config import ActorConfig


@dataclass
class Layout:
    """The trainer's `world_size` processes (one GPU each on a GPU machine) split TP x PP x CP x DP (a mixture of
    experts' experts EP x ETP within each stage's data-parallel processes), the rollout
    engines (`engines` of `rollout_tp` devices each, where `rollout_mode` puts them) and the switches that change
    what the trainer keeps in memory and how long it computes (docs/planning.md)."""

    tp: int = 1
    pp: int = 1
    world_size: int = 1
    ep: int = 1                   # expert-parallel size (MoE)
    etp: int | None = None        # expert-tensor-parallel size (None: the same as TP)
    engines: int = 1
    rollout_tp: int = 1
    rollout_mode: str = "ray"
    params_dtype: str = "bfloat16"
    distributed_optimizer: bool = True
    reference_model: bool = True
    fused_attention: bool = True  # False: attention_backend local or unfused, which materialise the scores
    sequence_parallel: bool = False
    context_parallel: int = 1
    recompute: str = ""           # "", "full" (uniform) or "selective"
    recompute_num_layers: int = 1
    remove_padding: bool = False
    dynamic_bsz: bool = False
    fused_kernels: bool = False
    critic: bool = False          # PPO's value model (trainer/workers/critic.py): the actor's size again, trained
    lora_rank: int = 0            # LoRA adapters (model.lora.rank; 0: off): only they train, the reference is no copy

    @property
    def model_parallel(self) -> int:
        """Processes that hold one copy of the model: TP x PP x CP."""
        return self.tp * self.pp * self.context_parallel

    @property
    def dp(self) -> int:
        """Data-parallel replicas: what TP x PP x CP leave of the world size."""
        if self.world_size % self.model_parallel:
            raise ValueError(f"the trainer's {self.world_size} processes are not a multiple of TP x PP x CP = "
                             f"{self.model_parallel}")
        return self.world_size // self.model_parallel

    @property
    def expert_dp(self) -> int:
        """Expert-data-parallel replicas: the processes of a stage that hold the same experts, world / (PP x EP x
        ETP)."""
        expert_parallel = self.pp * self.ep * (self.etp or self.tp)
        if self.world_size % expert_parallel:
            raise ValueError(f"the trainer's {self.world_size} processes are not a multiple of PP x EP x ETP = "
                             f"{expert_parallel}")
        return self.world_size // expert_parallel

    @classmethod
    def from_sections(cls, model: ModelConfig, actor: ActorConfig, rollout: RolloutConfig, reference_model: bool,
                      world_size: int, critic: bool = False) -> Layout:
        """The layout the model, actor and rollout sections imply on `world_size` trainer processes, with a frozen
        reference when `reference_model` (`Config.needs_reference_model`; with LoRA no copy: the base with the
        adapters off) and a critic when `critic` (`Config.critic_enabled`). Engines: `rollout.num_engines` Ray
        actors, one per `rollout.server_urls` entry (server mode), or one per rollout-TP group of the trainer's
        processes (colocate)."""
        megatron = actor.megatron
        engines = {"server": len(rollout.server_urls),
                   "colocate": max(1, world_size // rollout.tensor_model_parallel_size)}.get(rollout.mode,
                                                                                           rollout.num_engines)
        return cls(tp=megatron.tensor_model_parallel_size, pp=megatron.pipeline_model_parallel_size,
                   world_size=world_size, ep=megatron.expert_model_parallel_size,
                   etp=megatron.expert_tensor_parallel_size, engines=engines,
                   rollout_tp=rollout.tensor_model_parallel_size, rollout_mode=rollout.mode,
                   params_dtype=megatron.compute_dtype,
                   fused_attention=megatron.attention_backend not in ("local", "unfused"),
                   distributed_optimizer=megatron.use_distributed_optimizer,
                   reference_model=reference_model and not model.lora.enabled,
                   sequence_parallel=megatron.sequence_parallel,
                   context_parallel=megatron.context_parallel_size,
                   recompute=megatron.recompute_granularity if model.enable_gradient_checkpointing else "",
                   recompute_num_layers=megatron.recompute_num_layers, remove_padding=model.use_remove_padding,
                   dynamic_bsz=actor.use_dynamic_bsz, fused_kernels=model.use_fused_kernels, critic=critic,
                   lora_rank=model.lora.rank)

    def describe_processes(self, world_source: str) -> list[str]:
        """The trainer's and the engines' lines of `--dry-run` (`world_source`: where the world size came from)."""
        cp = f" x CP {self.context_parallel}" if self.context_parallel > 1 else ""
        trainer = (f"trainer: {self.world_size} process(es) ({world_source}) = TP {self.tp} x PP {self.pp}{cp} x "
                   f"DP {self.dp}")
        if self.ep > 1 or (self.etp or self.tp) != self.tp:
            trainer += (f"; experts: EP {self.ep} x ETP {self.etp or self.tp} x expert-DP {self.expert_dp} per "
                        "pipeline stage")
        if self.lora_rank:
            trainer += (f"; LoRA rank {self.lora_rank}: only the adapters train, the reference is the base with "
                        "them off (no copy)")
        if self.critic:
            trainer += "; a critic (value model) beside the actor, in the same layout"
        if self.rollout_mode == "server":
            return [trainer, f"rollout: {self.engines} external `megatron-cpo rollout` server(s) (rollout.server_urls)"]
        if self.rollout_mode == "colocate":
            return [trainer, f"rollout: {self.engines} vLLM engine(s) x TP {self.rollout_tp} colocated on the "
                             "trainer's devices (mode=colocate; they generate while the actor waits)"]
        return [trainer, f"rollout: {self.engines} vLLM engine(s) x TP {self.rollout_tp} "
                         f"({self.engines * self.rollout_tp} GPU(s) on GPU machines, besides the trainer's)"]
