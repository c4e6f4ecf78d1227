"""Converted Megatron models equal transformers at TP=1, TP=2, PP=2 and EP=2 (2 real gloo processes, real
Megatron-Core): the contract every model family (megatron_cpo/models/families/) passes.

One spawned run (layout_worker.check_layouts) does all the work; the tests below assert on its results, for a tiny
model of each family (random norms: a swapped or dropped norm shows): Qwen2 (qkv bias, untied), Llama (tied), Qwen3
(q/k norms), Qwen3-MoE (4 experts, top-2, renormalised, every second layer routes), Qwen2-MoE (shared expert with its
gate, no renormalisation, a dense first layer) and Mixtral:
- logits equal transformers' (float32, max abs diff <= 1e-5);
- `iter_hf_weights` gives back the HF tensors bit for bit at every layout, on each stage's exporting rank only;
- a checkpoint written at TP=2 by the HF->Megatron converter loads at TP=1, PP=2 and EP=2 with equal logits, and one
  written at EP=2 loads at TP=2 x EP=2 with ETP=1 (whole experts per rank) and the alltoall token dispatcher;
- the Megatron->HF converter writes a directory transformers loads, bit-identical to the original: from the TP=2
  checkpoint at PP=2 and at EP=2, and from the checkpoint written at EP=2 back at TP=2 x EP=2 (ETP=1);
- greedy generation through Megatron's pipeline matches transformers' greedy tokens.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_cpo.models.tiny import write_tiny_model
from tests.foundation.layout_worker import FAMILIES, MOE_FAMILIES, check_layouts
from tests.multiprocess import run_processes

TOLERANCE = 1e-5
MAX_NEW_TOKENS = 6


def _hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
    tokens = list(prompt_ids)
    for _ in range(max_new_tokens):
        tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
        if tokens[-1] == eos_token_id:
            break
    return tokens[len(prompt_ids):]


@pytest.fixture(scope="session")
def layout_run(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    work = tmp_path_factory.mktemp("layouts")
    hf_dirs = {family: str(write_tiny_model(work / f"hf_{family}", family, seed=3, random_norms=True))
               for family in FAMILIES}
    hf_dirs["one_kv_head"] = str(write_tiny_model(work / "hf_one_kv_head", "qwen2", num_key_value_heads=1))
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 128, (2, 19), generator=generator)
    prompt_ids = input_ids[0, :7].tolist()
    hf_logits, hf_greedy = {}, {}
    with torch.no_grad():
        for family in FAMILIES:
            model = AutoModelForCausalLM.from_pretrained(hf_dirs[family], dtype=torch.float32).eval()
            hf_logits[family] = model(input_ids).logits
            hf_greedy[family] = _hf_greedy(model, prompt_ids, MAX_NEW_TOKENS)
    torch.save(hf_logits, work / "hf_logits.pt")
    results = run_processes(check_layouts, 2, hf_dirs, str(work), input_ids, prompt_ids, MAX_NEW_TOKENS)
    return {"ranks": results, "hf_dirs": hf_dirs, "hf_greedy": hf_greedy, "work": work}


def _load_hf_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory, whether saved as one file or as indexed shards."""
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def _per_rank(run, layout: str, family: str, key: str) -> list:
    return [rank_results[layout][family][key] for rank_results in run["ranks"]]


LAYOUTS = [(layout, family) for layout in ("tp1", "tp2", "pp2") for family in FAMILIES]
LAYOUTS += [(layout, family) for layout in ("ep2", "tp2_ep2") for family in MOE_FAMILIES]
# Megatron -> HF conversions, by the layout they ran at: from the TP=2 checkpoint at PP=2 (every family) and at EP=2,
# and from the checkpoint written at EP=2 back at TP=2 x EP=2 with ETP=1 (MoE families)
ROUND_TRIPS = [("pp2", family) for family in FAMILIES]
ROUND_TRIPS += [(layout, family) for layout in ("ep2", "tp2_ep2") for family in MOE_FAMILIES]


@pytest.mark.parametrize("layout, family", LAYOUTS)
def test_logits_equal_transformers(layout_run, layout, family):
    diffs = [d for d in _per_rank(layout_run, layout, family, "hf_diff") if d is not None]
    expected_ranks_with_logits = 1 if layout == "pp2" else 2
    assert len(diffs) == expected_ranks_with_logits
    assert max(diffs) <= TOLERANCE, f"{layout} {family}: max abs logit diff {max(diffs)}"
    print(f"{layout} {family}: max |Megatron - transformers| logit difference {max(diffs):.1e}")


@pytest.mark.parametrize("layout, family", LAYOUTS)
def test_exported_weights_are_bit_identical(layout_run, layout, family):
    exports = _per_rank(layout_run, layout, family, "export")
    assert all(export["all_equal"] for export in exports)
    hf_names = set(load_file(Path(layout_run["hf_dirs"][family]) / "model.safetensors"))
    if layout != "pp2":  # only TP rank 0 of the first data-parallel replica yields (experts gathered over EP)
        assert set(exports[0]["names"]) == hf_names and exports[1]["names"] == []
    else:
        first, last = (set(export["names"]) for export in exports)
        assert first.isdisjoint(last) and first | last == hf_names
        assert "model.embed_tokens.weight" in first and "model.norm.weight" in last


@pytest.mark.parametrize("layout, family", [(layout, family) for layout, family in LAYOUTS
                                            if layout in ("tp1", "pp2", "ep2")])
def test_tp2_checkpoint_loads_at_other_layouts(layout_run, layout, family):
    diffs = [d for d in _per_rank(layout_run, layout, family, "checkpoint_diff") if d is not None]
    assert diffs and max(diffs) <= TOLERANCE


@pytest.mark.parametrize("layout, family", ROUND_TRIPS)
def test_hf_megatron_hf_round_trip_is_bit_identical(layout_run, layout, family):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    original_dir = Path(layout_run["hf_dirs"][family])
    (round_trip_dir,) = {path for path in _per_rank(layout_run, layout, family, "round_trip")}
    original = _load_hf_tensors(original_dir)
    round_trip = _load_hf_tensors(Path(round_trip_dir))
    if layout == "pp2":
        assert (Path(round_trip_dir) / "model.safetensors.index.json").is_file()  # one shard per pipeline stage
    assert sorted(round_trip) == sorted(original)
    assert all(torch.equal(round_trip[n], original[n]) and round_trip[n].dtype == original[n].dtype for n in original)
    reloaded = AutoModelForCausalLM.from_pretrained(round_trip_dir, dtype=torch.float32)
    assert reloaded.config.model_type == family
    tokenizer = AutoTokenizer.from_pretrained(round_trip_dir)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "1+1"}], tokenize=False)
    assert chat.startswith("<|im_start|>user\n1+1<|im_end|>")


@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_greedy_generation_matches_transformers(layout_run, family):
    greedy = _per_rank(layout_run, "pp2", family, "greedy")
    assert greedy[0] == greedy[1] == layout_run["hf_greedy"][family]


def test_tp_not_dividing_kv_heads_is_a_clear_error(layout_run):
    message = layout_run["ranks"][0]["tp2"]["one_kv_head_error"]
    assert message is not None and "TP=2" in message and "num_key_value_heads=1" in message


def test_checkpoint_of_another_architecture_is_a_clear_error(layout_run):
    message = layout_run["ranks"][0]["tp1"]["wrong_checkpoint_error"]
    assert message is not None and "model_type='qwen2'" in message and "'llama'" in message


def test_cli_generate_from_checkpoint_matches_transformers(layout_run):
    """`megatron-cpo generate` as one plain process (no torchrun): loads the TP=2 checkpoint at TP=1 and greedily
    continues a chat prompt exactly as transformers does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir = layout_run["hf_dirs"]["qwen2"]
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False,
                                           add_generation_prompt=True)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = _hf_greedy(model, tokenizer(prompt, add_special_tokens=False)["input_ids"], MAX_NEW_TOKENS,
                              tokenizer.eos_token_id)
    repo = Path(__file__).resolve().parents[2]
    env = {key: value for key, value in os.environ.items() if key not in ("WORLD_SIZE", "RANK", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-m", "megatron_cpo.cli", "generate", "--mcore",
                           str(layout_run["work"] / "mcore_tp2_qwen2"), "--hf-config", hf_dir, "--prompt", "2+2?",
                           "--max-new-tokens", str(MAX_NEW_TOKENS)], capture_output=True, text=True, timeout=600,
                          env={**env, "PYTHONPATH": str(repo)}, cwd=repo)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "forward: " in done.stdout and "prompt next-token NLL" in done.stdout
    generated = tokenizer.decode(expected, skip_special_tokens=False)
    assert f"generation ({len(expected)} tokens): {generated!r}" in done.stdout, done.stdout
    assert f"generation token ids: {expected}" in done.stdout, "generate prints the token ids beside the text"
