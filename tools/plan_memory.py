"""Plan a run before booking GPUs: trainer memory per GPU and a step-time estimate from the model config and layout.

    python tools/plan_memory.py --model Qwen2.5-Math-7B/ --tp 4 --pp 1 --trainer-gpus 16 --engines 8 --rollout-tp 2 \
        --train-batch-size 1024 --n 8 --prompt-length 1024 --response-length 3072 --micro-batch 4 --gpu h100-sxm
    python tools/plan_memory.py --recipe examples/qwen2.5-math-7b/cpo.yaml --trainer-gpus 16 --gpu h100-sxm

Method (docs/planning.md has the derivation):
- Parameters are counted from the HF config through the model family registry (tools/model_shape.py: embedding,
  per-layer attention with GQA, biases and q/k norms, SwiGLU MLP or router + experts + shared expert, norms, untied
  output layer). A GPU holds 1/TP of the sharded matrices of its pipeline stage (layers/PP, plus the embedding on the
  first stage and the output layer on the last; the larger stage is reported) and 1/(EP x ETP) of its routed experts.
  A mixture of experts is reported with its total and its active parameters per token (top-k experts per MoE layer).
- Resident state per parameter: the weights in `params_dtype`; fp32 gradients (Megatron DDP reduces in fp32); Adam
  moments (8 bytes) plus an fp32 master copy when the weights are 16-bit, divided by DP with the distributed optimizer
  (the experts' by the expert-data-parallel size, trainer GPUs / (PP x EP x ETP)); a frozen reference copy of the
  weights when the run keeps a reference model (KL loss, KL in the reward or verl's reference sync:
  `Config.needs_reference_model`, the rule the trainer builds by); PPO's critic (`--critic`, or a recipe with
  `algorithm.adv_estimator=gae`) again as weights, gradients and optimizer state of the actor's stage with a one-row
  value head in place of an untied lm-head (its activations come one phase after the actor's, not on top of them).
  With LoRA (`--lora-rank`, or a recipe's `model.lora.rank`) gradients and optimizer state are the adapters' only
  (r x (in + out) per linear, all four linears of every layer) and there is no reference copy; the adapters'
  activations (the rank-wide intermediate) are left out, and the backward costs one forward instead of two.
- Activations of one micro-batch of `micro_batch * (prompt + response)` tokens (with `--dynamic-bsz`: the token
  budget), counted from the tensors autograd keeps per layer (norm inputs, QKV, attention output, MLP inputs and
  SwiGLU halves; in a MoE layer the router's scores and, per routed copy of a token, its dispatched input and the
  expert's SwiGLU activations), plus attention scores and probabilities when attention is not fused (CPU, or GPUs
  without flash attention), plus the fp32 logits and their gradient for the log-prob kernel (only per-token
  statistics with `--fused-kernels`). Pipeline parallelism keeps up to PP micro-batches in flight on the first stage.
  Sequence parallelism divides the norm/residual activations by TP too; context parallelism divides the tokens by CP;
  full recompute (`--recompute full`, uniform, `--recompute-num-layers` N) keeps only every N-th layer input, plus one
  group of N layers' activations while it is recomputed; selective recompute drops the unfused attention scores.
- Step time = generation + log-prob forwards + training + weight sync. Generation is memory-bandwidth bound: a
  decode step of an engine reads its weights once (all experts of a MoE: a batch of sequences touches them all). A
  forward-only log-prob pass costs 2 x (active) params x tokens FLOPs plus
  the attention's 2 x layers x heads x head_dim x L^2 per sequence (causal), about 1/3 of a training pass (6 x and
  3 x those); full recompute adds one forward to training (8 x). There is one log-prob pass for the old log-probs,
  one for the reference (KL loss) and one for CPO's hinted contexts; a critic adds its value pass and its own
  training passes. Tokens are padded rows (prompt + response
  length) unless `--remove-padding` or `--dynamic-bsz`, then the real tokens (`--mean-response-length`). FLOPs run
  at the GPU's datasheet peak times `--mfu`. These are model estimates; benchmarks/trainer/README.md compares their
  ratios with CPU measurements of the trainer.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

from megatron_cpo.trainer.run.layout import Layout  # noqa: E402  (the layout preflight prints, one class for both)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_shape import ModelShape  # noqa: E402  (tools/ is not a package)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Datasheet peaks (dense bf16 tensor TFLOP/s, HBM GB/s, GiB): inputs of the estimate, not measurements.
GPUS = {"h100-sxm": (989.0, 3350.0, 80), "h200": (989.0, 4800.0, 141), "a100-80g": (312.0, 2039.0, 80)}
GIB = 1024 ** 3


@dataclass
class Batch:
    """Batch geometry in the config's units: prompts for train/mini batches, responses for the micro-batch."""

    train_batch_size: int = 8
    n: int = 4
    prompt_length: int = 128
    response_length: int = 32
    micro_batch: int = 8
    ppo_epochs: int = 1
    extra_forwards: int = 2  # old log-probs + reference (CPO adds one more for the hinted context)
    token_budget: int = 0          # ppo_max_token_len_per_gpu (tokens of one micro-batch) with dynamic batch sizes
    mean_response_length: int = 0  # of the real responses (0: response_length, the worst case)
    sequence_lengths: list[int] | None = None  # prompt + response of every sequence of one step (None: all the same)

    @property
    def mean_response(self) -> int:
        return self.mean_response_length or self.response_length


def padded_vocab(vocab: int, tp: int, multiple: int = 128) -> int:
    """Megatron pads the vocabulary to a multiple of 128 x TP."""
    step = multiple * tp
    return -(-vocab // step) * step


def norm_bytes(shape: ModelShape, layout: Layout) -> float:
    """Per token, one layer's two RMSNorms: each keeps its input and normalised rows in float32 and its output (the
    next linear's input) in the activation dtype; sequence parallelism splits them over TP."""
    act = DTYPE_BYTES[layout.params_dtype]
    return 2 * (8 + act) * shape.hidden_size / (layout.tp if layout.sequence_parallel else 1)


def attention_bytes(shape: ModelShape, layout: Layout) -> float:
    """Per token, what one layer's attention keeps for backward apart from the scores (`attention_score_bytes`).

    Local (unfused) attention: the rotated queries, the keys and values repeated to every query head, and the output
    (the output projection's input): 4 x heads x head_dim. Fused attention (torch's or Transformer Engine's): the
    rotated queries and keys, the QKV projection (the values are a view of it), the output (which the output
    projection reads in place) and its per-head log-sum-exp in float32. Selective recompute keeps the attention's
    inputs and output, either kind."""
    act = DTYPE_BYTES[layout.params_dtype]
    queries, groups = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    if not layout.fused_attention and layout.recompute != "selective":
        return act * 4 * queries / layout.tp
    log_sum_exp = 4 * shape.num_heads if layout.recompute != "selective" else 0
    return (act * (3 * queries + 3 * groups) + log_sum_exp) / layout.tp


def attention_score_bytes(shape: ModelShape, layout: Layout, rows: float, width: float) -> float:
    """One layer's saved softmax of the local attention over `rows` rows of `width` positions (0 for fused
    attention or under selective recompute): float32 probabilities, plus their 16-bit copy in a 16-bit model."""
    if layout.fused_attention or layout.recompute == "selective":
        return 0.0
    act = DTYPE_BYTES[layout.params_dtype]
    per_score = 4 + (act if act < 4 else 0)
    return per_score * shape.num_heads / layout.tp * rows * width * width / layout.context_parallel


def mlp_bytes(shape: ModelShape, layout: Layout) -> float:
    """Per token and layer, averaged over the stage's layers: SwiGLU's fused input projection (2 x width) and three
    width-sized tensors, or the router's scores plus, per routed copy (top-k), the dispatched input and output and the
    expert's SwiGLU activations."""
    act = DTYPE_BYTES[layout.params_dtype]
    tp, h = layout.tp, shape.hidden_size
    dense_layers, moe_layers = shape.stage_layers(layout.pp)
    routed = shape.num_experts + shape.top_k * (2 * h + 3 * shape.expert_ffn / (layout.etp or tp))
    return act * (dense_layers * 5 * shape.intermediate_size / tp
                  + moe_layers * (routed + 3 * shape.shared_expert_ffn / tp)) / (dense_layers + moe_layers)


def activation_bytes(shape: ModelShape, layout: Layout, tokens: int, sequences: int) -> dict[str, float]:
    """Activations autograd keeps for one micro-batch of `tokens` positions in `sequences` rows on the first pipeline
    stage (see the module docstring and docs/planning.md)."""
    act = DTYPE_BYTES[layout.params_dtype]
    width = tokens / sequences
    tokens = tokens / layout.context_parallel  # each CP rank holds 1/CP of every row
    per_token = norm_bytes(shape, layout) + attention_bytes(shape, layout) + mlp_bytes(shape, layout)
    layer_input = act * shape.hidden_size / (layout.tp if layout.sequence_parallel else 1)
    final_norm = norm_bytes(shape, layout) / 2 if layout.pp == 1 else 0.0  # the first stage is also the last
    scores = attention_score_bytes(shape, layout, sequences, width)
    layers = sum(shape.stage_layers(layout.pp))
    in_flight = layout.pp
    if layout.recompute == "full":  # every N-th layer's input stays; one group of N layers is live at a time
        group = min(layout.recompute_num_layers, layers)
        result = {"layers": tokens * (math.ceil(layers / group) * layer_input * in_flight + group * per_token
                                      + final_norm)}
        live_layers = group
    else:
        result = {"layers": tokens * (per_token * layers * in_flight + final_norm)}
        live_layers = layers * in_flight
    if scores:
        result["attention_scores"] = scores * live_layers
    if layout.fused_kernels:  # per-token log-prob, entropy and softmax statistics; the logits never exist
        result["logits"] = 4 * tokens * 4
    else:
        result["logits"] = 2 * tokens * padded_vocab(shape.vocab_size, layout.tp) / layout.tp * 4
    return result


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as the trainer computes it: `rows` rows of `width` positions holding sequences of `lengths`;
    `per_sequence`: the sequences end to end in one row, attention inside each (THD packing, fused attention)."""

    rows: int
    width: int
    lengths: tuple[int, ...]
    per_sequence: bool = False

    @property
    def positions(self) -> int:
        return self.rows * self.width


def micro_batches(lengths: list[int], layout: Layout, batch: Batch) -> list[list[MicroBatch]]:
    """Every data-parallel rank's micro-batches of one pass over sequences of `lengths` tokens, cut by the trainer's
    own rules (megatron_cpo/trainer/batch/micro_batches.py): `micro_batch` rows at the batch's longest length, or
    with `dynamic_bsz` by the token budget (padded rows: rows x their longest; packed: real tokens). Packed
    micro-batches (`remove_padding`) are one THD row with fused attention, else bin-packed rows (packing.py)."""
    import torch

    from megatron_cpo.trainer.batch.micro_batches import fixed_plan, token_budget_plan
    from megatron_cpo.trainer.batch.packing import first_fit_rows

    if layout.dynamic_bsz:
        plan = token_budget_plan(torch.tensor(lengths), layout.dp, batch.token_budget, "--token-budget", layout.pp,
                                 packed=layout.remove_padding)
    else:  # the trainer pads with one-token rows to a multiple of DP x micro-batch rows
        lengths = lengths + [1] * (-len(lengths) % (layout.dp * batch.micro_batch))
        plan = fixed_plan(len(lengths), layout.dp, batch.micro_batch)
    longest = max(lengths)
    result = []
    for rank in plan:
        cut = []
        for rows in rank:
            own = tuple(lengths[i] for i in rows.tolist())
            if layout.remove_padding and layout.fused_attention:
                cut.append(MicroBatch(1, sum(own), own, per_sequence=True))
            elif layout.remove_padding:
                cut.append(MicroBatch(len(first_fit_rows(list(own), max(own))), max(own), own))
            else:
                cut.append(MicroBatch(len(own), max(own) if layout.dynamic_bsz else longest, own))
        result.append(cut)
    return result


def micro_batch_flops(shape: ModelShape, micro: MicroBatch) -> float:
    """Forward FLOPs of one micro-batch: 2 x active parameters per position computed (padding included) and causal
    attention per row, or per sequence when the attention runs per sequence."""
    rows = micro.lengths if micro.per_sequence else [micro.width] * micro.rows
    return 2 * shape.active_params() * micro.positions + sum(attention_flops(shape, row) for row in rows)


def critic_bytes(shape: ModelShape, layout: Layout, stage: dict, per_param: int, optimizer_per_param: int) -> float:
    """PPO's critic on the same GPU (0 without one): the actor's stage (`stage`) with a one-row value head in place
    of the untied lm-head of a single stage, as weights and fp32 gradients (`per_param` bytes) and optimizer state."""
    if not layout.critic:
        return 0.0
    lm_head = (padded_vocab(shape.vocab_size, layout.tp) * shape.hidden_size / layout.tp
               if layout.pp == 1 and not shape.tied_embeddings else 0.0)
    dense = stage["dense"] - lm_head + shape.hidden_size
    sharded = (dense / layout.dp + stage["experts"] / layout.expert_dp if layout.distributed_optimizer
               else dense + stage["experts"])
    return (dense + stage["experts"]) * per_param + sharded * optimizer_per_param


def lora_stage_params(shape: ModelShape, layout: Layout) -> dict[str, float]:
    """LoRA adapter parameters on one GPU of the largest stage, adapters on all four linears of every layer (the
    default targets): r x (in + out) per linear, split over TP (experts: over EP x ETP) as models/lora/ splits them."""
    rank, tp = layout.lora_rank, layout.tp
    attention_width = shape.num_heads * shape.head_dim
    attention = rank * ((shape.hidden_size + shape.qkv_width) + (attention_width + shape.hidden_size)) / tp

    def mlp(width: int) -> float:  # fc1 (gate and up fused) and fc2
        return rank * ((shape.hidden_size + 2 * width) + (width + shape.hidden_size))

    dense_layers, moe_layers = shape.stage_layers(layout.pp)
    dense = (dense_layers * (attention + mlp(shape.intermediate_size) / tp)
             + moe_layers * (attention + (mlp(shape.shared_expert_ffn) / tp if shape.shared_expert_ffn else 0)))
    experts = moe_layers * shape.num_experts / layout.ep * mlp(shape.expert_ffn) / (layout.etp or tp)
    return {"dense": dense, "experts": experts}


def lora_memory(shape: ModelShape, layout: Layout, params: float, weight_bytes: int, optimizer_per_param: int
                ) -> dict[str, float]:
    """The trainer's resident state with LoRA (`layout.lora_rank`): the frozen base (`params` on the GPU) in its
    dtype plus the adapters, fp32 gradients and Adam state for the adapters only (sharded by the distributed
    optimizer), and no reference copy (the base with the adapters off is the reference)."""
    adapters = lora_stage_params(shape, layout)
    count = adapters["dense"] + adapters["experts"]
    sharded = (adapters["dense"] / layout.dp + adapters["experts"] / layout.expert_dp
               if layout.distributed_optimizer else count)
    return {"weights": (params + count) * weight_bytes, "gradients": count * 4,
            "optimizer": sharded * optimizer_per_param, "reference": 0.0}


def trainer_memory(shape: ModelShape, layout: Layout, batch: Batch) -> dict[str, float]:
    """Bytes per trainer GPU by component, and their total."""
    stage = shape.stage_params(layout.tp, layout.pp, padded_vocab(shape.vocab_size, layout.tp), layout.ep, layout.etp)
    params = stage["dense"] + stage["experts"]
    weight_bytes = DTYPE_BYTES[layout.params_dtype]
    optimizer_per_param = 8 + (4 if weight_bytes < 4 else 0)
    sharded = (stage["dense"] / layout.dp + stage["experts"] / layout.expert_dp if layout.distributed_optimizer
               else params)
    memory = {"weights": params * weight_bytes, "gradients": params * 4,
              "optimizer": sharded * optimizer_per_param,
              "reference": params * weight_bytes if layout.reference_model else 0.0,
              "critic": critic_bytes(shape, layout, stage, weight_bytes + 4, optimizer_per_param)}
    if layout.lora_rank:
        memory.update(lora_memory(shape, layout, params, weight_bytes, optimizer_per_param))
    if batch.sequence_lengths:  # the largest of the micro-batches the trainer cuts from these sequences
        activations = max((activation_bytes(shape, layout, micro.positions, micro.rows)
                           for rank in micro_batches(batch.sequence_lengths, layout, batch) for micro in rank),
                          key=lambda parts: sum(parts.values()))
    else:
        length = batch.prompt_length + batch.response_length
        tokens = batch.micro_batch * length
        if layout.dynamic_bsz and batch.token_budget:  # a micro-batch holds at most the budget's tokens
            tokens = max(batch.token_budget, length)
        activations = activation_bytes(shape, layout, tokens, max(1, tokens // length))
    for name, value in activations.items():
        memory[f"activations/{name}"] = value
    memory["total"] = sum(memory.values())
    return memory


OFFLOADABLE = {"param": "weights", "grad": "gradients", "optimizer": "optimizer"}  # verl's *_offload -> component


def colocated_memory(trainer: dict[str, float], engine_weights: float, kv_cache: float, offload: set[str],
                     sleep_level: int, engine_overhead: float = 0.0) -> dict[str, float]:
    """Bytes per GPU when training and the engines share it one phase at a time (`rollout.mode=colocate`): the
    peak of the two phases, not their sum.

    - training, engines asleep: the trainer's whole footprint (`trainer_memory`) plus what a sleeping engine keeps:
      `engine_overhead` (CUDA context and graph pools, which sleep mode does not free) at `sleep_level` 1 or 2, or
      its weights and KV cache too at level 0 (`rollout.free_cache_engine=false`: the engine never sleeps);
    - rollout, actor offloaded: the engine's weights + KV cache + overhead plus the trainer components that stay
      (those not in `offload`, verl's `param`/`grad`/`optimizer`; the reference is never offloaded, a critic is
      counted as staying; no activations).
    Host memory holds the offloaded actor parts, and at level 1 the sleeping engine's weights.
    """
    unknown = set(offload) - set(OFFLOADABLE)
    if unknown:
        raise ValueError(f"--offload {sorted(unknown)} unknown; choose from {sorted(OFFLOADABLE)}")
    if sleep_level not in (0, 1, 2):
        raise ValueError(f"--sleep-level={sleep_level}; use 1, 2, or 0 for engines that never sleep")
    engine_awake = engine_weights + kv_cache + engine_overhead
    asleep = engine_overhead if sleep_level else engine_awake
    moved = {OFFLOADABLE[name] for name in offload}
    kept = sum(trainer[name] for name in ("weights", "gradients", "optimizer", "reference") if name not in moved)
    kept += trainer.get("critic", 0.0)  # a critic's state stays (its own critic.megatron.*_offload are not planned)
    memory = {"training/trainer": trainer["total"], "training/engines_asleep": asleep,
              "rollout/engines": engine_awake, "rollout/trainer_kept": kept}
    memory["training"] = memory["training/trainer"] + asleep
    memory["rollout"] = engine_awake + kept
    memory["peak"] = max(memory["training"], memory["rollout"])
    memory["host/actor_offloaded"] = sum(trainer[name] for name in moved)
    memory["host/engine_weights"] = engine_weights if sleep_level == 1 else 0.0
    return memory


def _colocate_report(args: argparse.Namespace, shape: ModelShape, layout: Layout,
                     trainer: dict[str, float]) -> dict[str, float]:
    """`--colocate`: the settings from the recipe (its offload switches, sleep level, gpu_memory_utilization) or the
    flags; the KV cache is `--kv-cache-gib`, or what `gpu_memory_utilization` of `--gpu` leaves after the weights."""
    offload = set(filter(None, args.offload.split(","))) if args.offload is not None else set()
    sleep_level, utilization = args.sleep_level, args.gpu_memory_utilization
    if args.recipe:
        from megatron_cpo.config import load_config

        config = load_config(args.recipe)
        megatron, rollout = config.actor_rollout_ref.actor.megatron, config.actor_rollout_ref.rollout
        if args.offload is None:
            offload = {name for name in OFFLOADABLE if getattr(megatron, f"{name}_offload")}
        sleep_level = rollout.sleep_level if rollout.free_cache_engine else 0
        utilization = rollout.gpu_memory_utilization
    engine_params = shape.stage_params(layout.rollout_tp, 1, padded_vocab(shape.vocab_size, layout.rollout_tp, 64))
    engine_weights = (engine_params["dense"] + engine_params["experts"]) * DTYPE_BYTES[layout.params_dtype]
    if args.kv_cache_gib is not None:
        kv_cache = args.kv_cache_gib * GIB
    elif args.gpu:
        kv_cache = utilization * GPUS[args.gpu][2] * GIB - engine_weights - args.engine_overhead_gib * GIB
        if kv_cache <= 0:
            raise ValueError(f"gpu_memory_utilization={utilization} of {args.gpu} leaves no KV cache after "
                             f"{engine_weights / GIB:.1f} GiB of engine weights; raise it or --rollout-tp")
    else:
        raise ValueError("--colocate needs the engines' KV cache: pass --kv-cache-gib or --gpu")
    return colocated_memory(trainer, engine_weights, kv_cache, offload, sleep_level, args.engine_overhead_gib * GIB)


def attention_flops(shape: ModelShape, length: float) -> float:
    """Forward FLOPs of causal attention over one sequence of `length` tokens (QK^T and PV, half the square)."""
    return 2 * shape.num_layers * shape.num_heads * shape.head_dim * length * length


def step_time(shape: ModelShape, layout: Layout, batch: Batch, gpu: str, mfu: float,
              decode_efficiency: float = 0.5) -> dict[str, float]:
    """Seconds per step by phase for `gpu` (a `GPUS` key), at `mfu` of peak FLOPs and `decode_efficiency` of HBM
    bandwidth while decoding."""
    peak_tflops, bandwidth_gbs, _ = GPUS[gpu]
    params, active = shape.total_params(), shape.active_params()
    responses = batch.train_batch_size * batch.n
    prompts_per_engine = math.ceil(batch.train_batch_size / layout.engines)
    decode_step_s = params * 2 / layout.rollout_tp / (bandwidth_gbs * 1e9 * decode_efficiency)
    generation = batch.response_length * decode_step_s * max(1.0, prompts_per_engine * batch.n / 256)
    if batch.sequence_lengths:  # the slowest data-parallel rank's micro-batches, on its TP x PP x CP devices
        flops_per_s = layout.model_parallel * peak_tflops * 1e12 * mfu
        forward_flops = max(sum(micro_batch_flops(shape, micro) for micro in rank)
                            for rank in micro_batches(batch.sequence_lengths, layout, batch))
    else:
        padding_free = layout.remove_padding or layout.dynamic_bsz
        length = batch.prompt_length + (batch.mean_response if padding_free else batch.response_length)
        flops_per_s = layout.world_size * peak_tflops * 1e12 * mfu
        forward_flops = 2 * active * responses * length + attention_flops(shape, length) * responses
    models = 2 if layout.critic else 1  # a critic scores the batch once and trains as the actor does
    forwards = (batch.extra_forwards + models - 1) * forward_flops / flops_per_s
    # forward + backward (2 forwards' worth; with LoRA 1: no weight gradients of the frozen base) (+ the recompute)
    passes = (4 if layout.recompute == "full" else 3) - (1 if layout.lora_rank else 0)
    training = models * batch.ppo_epochs * passes * forward_flops / flops_per_s
    weight_sync = params * 2 / (bandwidth_gbs * 1e9 * 0.05)
    times = {"generation": generation, "log_prob_forwards": forwards, "training": training,
             "weight_sync": weight_sync}
    times["total"] = sum(times.values())
    return times


def _from_recipe(path: str, trainer_gpus: int) -> tuple[dict, Layout, Batch]:
    from megatron_cpo.config import load_config

    config = load_config(path)
    actor, rollout = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout
    layout = Layout.from_sections(config.actor_rollout_ref.model, actor, rollout, config.needs_reference_model,
                                  trainer_gpus, critic=config.critic_enabled)
    batch = Batch(train_batch_size=config.data.train_batch_size, n=rollout.n,
                  prompt_length=config.data.max_prompt_length, response_length=config.data.max_response_length,
                  micro_batch=actor.ppo_micro_batch_size_per_gpu, ppo_epochs=actor.ppo_epochs,
                  extra_forwards=1 + layout.reference_model + config.algorithm.shaper.needs_hint_contexts,
                  token_budget=actor.ppo_max_token_len_per_gpu)
    return {"model": config.actor_rollout_ref.model.path}, layout, batch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--model", help="HF model directory or config.json (default: the recipe's model path)")
    parser.add_argument("--recipe", help="a recipe YAML: layout and batch sizes come from it")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=None, help="expert-parallel size (MoE; default 1 or the recipe's)")
    parser.add_argument("--etp", type=int, default=None, help="expert-tensor-parallel size (MoE; default: TP)")
    parser.add_argument("--trainer-gpus", type=int, default=1)
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--rollout-tp", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    parser.add_argument("--no-reference", action="store_true", help="no KL loss: no reference copy")
    parser.add_argument("--critic", action="store_true", help="PPO with a critic (adv_estimator=gae): a value model")
    parser.add_argument("--lora-rank", type=int, default=None, help="LoRA adapters of this rank on every linear "
                        "(default: off, or the recipe's model.lora.rank): only they train, no reference copy")
    parser.add_argument("--unfused-attention", action="store_true", help="attention scores materialised "
                        "(attention_backend=local; a recipe's setting otherwise)")
    parser.add_argument("--train-batch-size", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size")
    parser.add_argument("--recompute", default="", choices=("", "full", "selective"))
    parser.add_argument("--recompute-num-layers", type=int, default=1)
    parser.add_argument("--remove-padding", action="store_true", help="padding-free packing")
    parser.add_argument("--dynamic-bsz", action="store_true", help="micro-batches cut by --token-budget")
    parser.add_argument("--token-budget", type=int, default=0, help="ppo_max_token_len_per_gpu")
    parser.add_argument("--fused-kernels", action="store_true", help="log-probs fused with the lm-head")
    parser.add_argument("--mean-response-length", type=int, default=0,
                        help="mean real response length for padding-free step time (default: --response-length)")
    parser.add_argument("--sequence-lengths", metavar="JSON", help="a JSON file listing prompt + response tokens of "
                        "every sequence of one step: memory and time follow the micro-batches the trainer cuts")
    parser.add_argument("--gpu", choices=sorted(GPUS), help="estimate step time with this GPU's datasheet peaks")
    parser.add_argument("--mfu", type=float, default=0.3, help="fraction of peak FLOPs training reaches")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--colocate", action="store_true", help="engines share the trainer's GPUs: plan the peak of "
                        "the training and rollout phases (colocated_memory)")
    parser.add_argument("--offload", help="with --colocate: actor parts offloaded during rollout, comma-separated "
                        "from param,grad,optimizer (default: the recipe's actor.megatron.*_offload, else none)")
    parser.add_argument("--sleep-level", type=int, default=1, help="with --colocate: vLLM sleep level while "
                        "training (1 or 2; 0: engines never sleep); a recipe's rollout.sleep_level wins")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6,
                        help="with --colocate and --gpu: the engines' share of the GPU (a recipe's value wins)")
    parser.add_argument("--kv-cache-gib", type=float, help="with --colocate: KV cache per GPU instead of what "
                        "--gpu-memory-utilization leaves")
    parser.add_argument("--engine-overhead-gib", type=float, default=1.0, help="with --colocate: what an engine "
                        "keeps asleep (CUDA context, graph pools; an assumption, not a measurement)")
    args = parser.parse_args(argv)
    try:
        if args.recipe:
            meta, layout, batch = _from_recipe(args.recipe, args.trainer_gpus)
            model = args.model or meta["model"]
        else:
            layout = Layout(args.tp, args.pp, args.trainer_gpus, engines=args.engines, rollout_tp=args.rollout_tp,
                            params_dtype=args.dtype, reference_model=not args.no_reference,
                            sequence_parallel=args.sequence_parallel, context_parallel=args.cp,
                            recompute=args.recompute, recompute_num_layers=args.recompute_num_layers,
                            remove_padding=args.remove_padding, dynamic_bsz=args.dynamic_bsz,
                            fused_kernels=args.fused_kernels, critic=args.critic)
            batch = Batch(args.train_batch_size, args.n, args.prompt_length, args.response_length, args.micro_batch,
                          token_budget=args.token_budget)
            model = args.model
        batch.mean_response_length = args.mean_response_length
        if args.sequence_lengths:
            batch.sequence_lengths = [int(n) for n in json.loads(Path(args.sequence_lengths).read_text())]
        if args.unfused_attention:
            layout.fused_attention = False
        if args.lora_rank is not None:
            layout.lora_rank = args.lora_rank
            layout.reference_model = layout.reference_model and not args.lora_rank
        layout.ep = args.ep or layout.ep
        layout.etp = args.etp or layout.etp
        config_path = Path(model or "") / "config.json" if not str(model).endswith(".json") else Path(model)
        if not config_path.is_file():
            raise ValueError(f"no HF config at {config_path}; pass --model with a local model directory")
        shape = ModelShape.from_hf_config(json.loads(config_path.read_text()))
        if shape.is_moe and shape.num_experts % layout.ep:
            raise ValueError(f"EP={layout.ep} does not divide the model's {shape.num_experts} experts")
        trainer = trainer_memory(shape, layout, batch)
        report = {"params": shape.total_params(), "active_params": shape.active_params(), "dp": layout.dp,
                  "memory_gib": {k: v / GIB for k, v in trainer.items()}}
        if args.colocate:
            report["colocated_gib"] = {k: v / GIB for k, v in _colocate_report(args, shape, layout, trainer).items()}
        if args.gpu:
            report["step_time_s"] = step_time(shape, layout, batch, args.gpu, args.mfu)
            report["gpu_memory_gib"] = GPUS[args.gpu][2]
    except (ValueError, KeyError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"layout": asdict(layout), "batch": asdict(batch), **report}, indent=1))
        return 0
    on = {True: "on", False: "off"}
    active = f" ({report['active_params'] / 1e9:.3f} B active per token)" if shape.is_moe else ""
    experts = (f" EP={layout.ep} ETP={layout.etp or layout.tp} EDP={layout.expert_dp}" if shape.is_moe else "")
    print(f"{report['params'] / 1e9:.3f} B parameters{active}; TP={layout.tp} PP={layout.pp} DP={layout.dp}"
          + (f" CP={layout.context_parallel}" if layout.context_parallel > 1 else "") + experts)
    print(f"  SP {on[layout.sequence_parallel]}, recompute {layout.recompute or 'off'}, remove_padding "
          f"{on[layout.remove_padding]}, dynamic_bsz {on[layout.dynamic_bsz]}, "
          f"fused_kernels {on[layout.fused_kernels]}; "
          f"{batch.extra_forwards} log-prob pass(es) per step" + ("; a critic" if layout.critic else "")
          + (f"; LoRA rank {layout.lora_rank}" if layout.lora_rank else ""))
    for name, value in report["memory_gib"].items():
        print(f"  {name:<28}{value:10.3f} GiB")
    for name, value in report.get("colocated_gib", {}).items():
        print(f"  {'colocated/' + name:<36}{value:10.3f} GiB")
    for name, value in report.get("step_time_s", {}).items():
        print(f"  time/{name:<23}{value:10.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
