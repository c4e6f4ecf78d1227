"""Runs in each of 2 spawned gloo processes: one Megatron import, then every check at TP=2, TP=1, PP=2 and (for the
mixture-of-experts families) EP=2 in turn.

Spawning and importing Megatron-Core costs tens of seconds on a 2-core machine, so one run collects all the numbers
and the tests in test_parallel_layouts.py assert on them.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from megatron_cpo.models.families import FAMILIES as REGISTERED

# every registered family (models/families), so that a new one is checked in every layout without being listed here
FAMILIES = tuple(REGISTERED)
MOE_FAMILIES = tuple(name for name, family in REGISTERED.items() if family.expert_names is not None)


def switch_layout(tp: int, pp: int, ep: int = 1, etp: int | None = None) -> None:
    from megatron.core import parallel_state

    from megatron_cpo import platform

    parallel_state.destroy_model_parallel()
    platform.init_distributed(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)


def max_diff(logits: torch.Tensor | None, reference: torch.Tensor) -> float | None:
    return None if logits is None else (logits - reference).abs().max().item()


def _exported_matches(model, hf_dir: Path) -> dict:
    """Names this rank exported, and whether each equals the HF file's tensor bit for bit (dtype included)."""
    from megatron_cpo.models import iter_hf_weights

    hf = load_file(hf_dir / "model.safetensors")
    exported = {name: tensor.clone() for name, tensor in iter_hf_weights(model, model.hf_config)}
    return {"names": sorted(exported),
            "all_equal": all(torch.equal(t, hf[n]) and t.dtype == hf[n].dtype for n, t in exported.items())}


def check_layouts(rank: int, world_size: int, hf_dirs: dict, work_dir: str, input_ids: torch.Tensor,
                  prompt_ids: list[int], max_new_tokens: int) -> dict:
    """All layout checks; returns {layout: {family: results}} plus the converter outputs' paths. At EP=2 (TP=1, two
    data-parallel ranks, two experts each) the MoE families load from HF and from the TP=2 checkpoint, convert HF ->
    Megatron at EP=2 and the TP=2 checkpoint back to HF at EP=2. At TP=2 with EP=2 and ETP=1 (each rank two whole
    experts) and the alltoall token dispatcher they load the EP=2 checkpoint and convert it back to HF."""
    from megatron_cpo import platform
    from megatron_cpo.models import (
        build_gpt_model,
        forward_logits,
        greedy_generate,
        load_checkpoint,
        load_hf_config,
        load_hf_weights,
    )
    from megatron_cpo.models.conversion_commands import convert_hf_to_mcore, convert_mcore_to_hf

    work = Path(work_dir)
    configs = {family: load_hf_config(hf_dirs[family]) for family in FAMILIES}
    hf_logits = torch.load(work / "hf_logits.pt")
    results: dict = {"tp2": {}, "tp1": {}, "pp2": {}, "ep2": {}, "tp2_ep2": {}}

    platform.init_distributed(tensor_model_parallel_size=2)
    for family in FAMILIES:
        checkpoint = convert_hf_to_mcore(hf_dirs[family], work / f"mcore_tp2_{family}", tp=2, log=lambda _: None)
        model = build_gpt_model(configs[family])
        load_hf_weights(model, hf_dirs[family])
        results["tp2"][family] = {"hf_diff": max_diff(forward_logits(model, input_ids), hf_logits[family]),
                                  "export": _exported_matches(model, Path(hf_dirs[family])),
                                  "checkpoint": str(checkpoint)}
    try:
        build_gpt_model(load_hf_config(hf_dirs["one_kv_head"]))
        results["tp2"]["one_kv_head_error"] = None
    except ValueError as error:
        results["tp2"]["one_kv_head_error"] = str(error)

    def from_hf_then_tp2_checkpoint(family: str) -> tuple[object, dict]:
        """The model loaded from HF (logits, export), then from the TP=2 checkpoint (logits)."""
        model = build_gpt_model(configs[family])
        load_hf_weights(model, hf_dirs[family])
        checks = {"hf_diff": max_diff(forward_logits(model, input_ids), hf_logits[family]),
                  "export": _exported_matches(model, Path(hf_dirs[family]))}
        load_checkpoint(model, work / f"mcore_tp2_{family}")
        return model, {**checks, "checkpoint_diff": max_diff(forward_logits(model, input_ids), hf_logits[family])}

    switch_layout(tp=1, pp=1)
    for family in FAMILIES:
        results["tp1"][family] = from_hf_then_tp2_checkpoint(family)[1]
    other = build_gpt_model(configs["llama"])
    try:
        load_checkpoint(other, work / "mcore_tp2_qwen2")
        results["tp1"]["wrong_checkpoint_error"] = None
    except ValueError as error:
        results["tp1"]["wrong_checkpoint_error"] = str(error)

    switch_layout(tp=1, pp=2)
    for family in FAMILIES:
        model, checks = from_hf_then_tp2_checkpoint(family)
        results["pp2"][family] = {
            **checks,
            "greedy": greedy_generate(model, prompt_ids, max_new_tokens, eos_token_id=None),
            "round_trip": str(convert_mcore_to_hf(work / f"mcore_tp2_{family}", work / f"hf_round_trip_{family}",
                                                  hf_dirs[family], pp=2, log=lambda _: None)),
        }

    switch_layout(tp=1, pp=1, ep=2)
    for family in MOE_FAMILIES:
        results["ep2"][family] = {
            **from_hf_then_tp2_checkpoint(family)[1],
            "checkpoint": str(convert_hf_to_mcore(hf_dirs[family], work / f"mcore_ep2_{family}", ep=2,
                                                  log=lambda _: None)),
            "round_trip": str(convert_mcore_to_hf(work / f"mcore_tp2_{family}", work / f"hf_round_trip_ep2_{family}",
                                                  hf_dirs[family], ep=2, log=lambda _: None)),
        }

    switch_layout(tp=2, pp=1, ep=2, etp=1)
    for family in MOE_FAMILIES:
        model = build_gpt_model(configs[family], moe_token_dispatcher_type="alltoall")
        load_checkpoint(model, work / f"mcore_ep2_{family}")
        results["tp2_ep2"][family] = {
            "hf_diff": max_diff(forward_logits(model, input_ids), hf_logits[family]),
            "export": _exported_matches(model, Path(hf_dirs[family])),
            "round_trip": str(convert_mcore_to_hf(work / f"mcore_ep2_{family}", work / f"hf_round_trip_tp2_{family}",
                                                  hf_dirs[family], tp=2, ep=2, etp=1, log=lambda _: None)),
        }
    platform.destroy_distributed()
    return results
