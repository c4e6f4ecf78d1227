"""Runs in each of 2 spawned gloo processes: HF options, vocabulary padding and foreign checkpoints at TP=2, TP=1, PP=2
and TP=2 again.

One run collects every number (spawning and importing Megatron-Core dominates the cost on 2 cores); the tests in
test_checkpoints_and_options.py assert on them.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.foundation.layout_worker import max_diff, switch_layout

# Models whose logits must equal transformers': Llama with each bias flag alone, Llama with linear RoPE scaling, Qwen2
# with a sliding window on its second layer, a Qwen2 whose vocabulary (101) does not divide by TP=2, and the same
# saved in bfloat16 (its config says so).
OPTION_MODELS = ("llama_attention_bias", "llama_mlp_bias", "llama_linear_rope", "qwen2_sliding_window")
VOCAB_MODEL, BF16_MODEL = "qwen2_vocab101", "qwen2_bf16"


def _export_equal(model, hf_dir: str) -> dict:
    """The HF names this rank exported and whether each equals the HF file's tensor bit for bit."""
    from megatron_cpo.models import iter_hf_weights

    hf = load_file(Path(hf_dir) / "model.safetensors")
    exported = {name: tensor.clone() for name, tensor in iter_hf_weights(model, model.hf_config)}
    return {"names": sorted(exported), "all_equal": all(torch.equal(t, hf[n].float()) for n, t in exported.items())}


def _loaded(hf_dir: str):
    from megatron_cpo.models import build_gpt_model, load_hf_config, load_hf_weights

    model = build_gpt_model(load_hf_config(hf_dir))
    load_hf_weights(model, hf_dir)
    return model


def _error(call) -> str | None:
    try:
        call()
    except ValueError as error:
        return str(error)
    return None


def _megatron_lm_model(hf_dir: str, padded_vocab_size: int = 128):
    """The model as a TP=1 Megatron-LM run holds it: the vocabulary padded to a multiple of 128
    (make_vocab_size_divisible_by), the padding rows holding anything (here: random), every other weight the HF
    one."""
    import copy

    from megatron_cpo.models import build_gpt_model

    source = _loaded(hf_dir)
    config = copy.deepcopy(source.hf_config)
    config.vocab_size = padded_vocab_size
    padded = build_gpt_model(config)
    with torch.no_grad():
        for (_, param), (_, real) in zip(padded.named_parameters(), source.named_parameters(), strict=True):
            param[:real.shape[0]].copy_(real)  # vocabulary tables keep random rows past the real vocabulary
    return padded


def _save_like_megatron_lm(model, out: Path, iteration: int) -> None:
    """What Megatron-LM's save_checkpoint writes for a GPTModel with the torch_dist format: the model's sharded state
    dict beside pickled run arguments, in `iter_<7 digits>/` with a tracker file, and none of our metadata."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    target = out / f"iter_{iteration:07d}"
    if dist.get_rank() == 0:
        target.mkdir(parents=True)
    dist.barrier()
    state = {"model": model.sharded_state_dict(), "iteration": iteration, "checkpoint_version": 3.0,
             "args": argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                        make_vocab_size_divisible_by=128, params_dtype=torch.float32,
                                        ckpt_format="torch_dist")}
    dist_checkpointing.save(state, str(target))
    if dist.get_rank() == 0:
        (out / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    dist.barrier()


def check_options_and_checkpoints(rank: int, world_size: int, hf_dirs: dict, work_dir: str,
                                  input_ids: torch.Tensor) -> dict:
    """All checks; returns {layout: {case: result}}. Layouts in turn: TP=2, TP=1 (DP=2), PP=2, TP=2 again."""
    from megatron.core import dist_checkpointing

    from megatron_cpo import platform
    from megatron_cpo.models import (
        build_gpt_model,
        forward_logits,
        load_checkpoint,
        load_hf_config,
        load_hf_weights,
        save_checkpoint,
    )
    from megatron_cpo.models.conversion_commands import convert_hf_to_mcore, convert_mcore_to_hf

    work = Path(work_dir)
    hf_logits = torch.load(work / "hf_logits.pt")
    quiet = {"log": lambda _: None}
    results: dict = {"tp2": {}, "tp1": {}, "pp2": {}, "tp2_again": {}}

    def load_and_compare(config_dir: str, checkpoint: str, logits_of: str, export: bool = False) -> dict:
        model = build_gpt_model(load_hf_config(config_dir))
        load_checkpoint(model, work / checkpoint)
        result = {"hf_diff": max_diff(forward_logits(model, input_ids), hf_logits[logits_of])}
        return {**result, "export": _export_equal(model, config_dir)} if export else result

    platform.init_distributed(tensor_model_parallel_size=2)
    for case in OPTION_MODELS:
        model = _loaded(hf_dirs[case])
        results["tp2"][case] = {"hf_diff": max_diff(forward_logits(model, input_ids), hf_logits[case]),
                                "export": _export_equal(model, hf_dirs[case])}
    undeclared = build_gpt_model(load_hf_config(hf_dirs["llama_bias_not_in_config"]))
    results["tp2"]["left_over_error"] = _error(lambda: load_hf_weights(undeclared, hf_dirs["llama_bias_not_in_config"]))
    convert_hf_to_mcore(hf_dirs[VOCAB_MODEL], work / "mcore_vocab101_tp2", tp=2, **quiet)  # rows padded to 102
    convert_hf_to_mcore(hf_dirs[BF16_MODEL], work / "mcore_bf16_tp2", tp=2, **quiet)
    results["tp2"]["bf16_saved_dtypes"] = sorted({str(t.dtype) for t in dist_checkpointing.load_tensors_metadata(
        str(work / "mcore_bf16_tp2")).values()})

    switch_layout(tp=1, pp=1)
    vocab_dir = hf_dirs[VOCAB_MODEL]
    results["tp1"]["vocab101_tp2_checkpoint"] = load_and_compare(vocab_dir, "mcore_vocab101_tp2", VOCAB_MODEL, True)
    _save_like_megatron_lm(_megatron_lm_model(vocab_dir), work / "megatron_lm_vocab101", iteration=7)  # 128 rows
    results["tp1"]["megatron_lm_checkpoint"] = load_and_compare(vocab_dir, "megatron_lm_vocab101", VOCAB_MODEL, True)
    save_checkpoint(_loaded(vocab_dir), work / "mcore_vocab101_tp1")  # rows not padded
    results["tp1"]["bf16_checkpoint"] = load_and_compare(hf_dirs[BF16_MODEL], "mcore_bf16_tp2", BF16_MODEL)
    wrong = build_gpt_model(load_hf_config(hf_dirs["llama_attention_bias"]))
    results["tp1"]["wrong_architecture_error"] = _error(lambda: load_checkpoint(wrong, work / "megatron_lm_vocab101"))

    switch_layout(tp=1, pp=2)
    results["pp2"]["vocab101_tp2_checkpoint"] = load_and_compare(vocab_dir, "mcore_vocab101_tp2", VOCAB_MODEL)
    for case, checkpoint, hf_dir in (("vocab101_round_trip", "mcore_vocab101_tp2", vocab_dir),
                                     ("megatron_lm_round_trip", "megatron_lm_vocab101", vocab_dir),
                                     ("bf16_round_trip", "mcore_bf16_tp2", hf_dirs[BF16_MODEL])):
        results["pp2"][case] = str(convert_mcore_to_hf(work / checkpoint, work / f"hf_{case}", hf_dir, pp=2, **quiet))

    switch_layout(tp=2, pp=1)
    for case, checkpoint in (("vocab101_tp1_checkpoint", "mcore_vocab101_tp1"),
                             ("megatron_lm_checkpoint", "megatron_lm_vocab101")):
        results["tp2_again"][case] = load_and_compare(vocab_dir, checkpoint, VOCAB_MODEL)
    platform.destroy_distributed()
    return results
