"""Forward passes and greedy generation with a (TP/PP-sharded) Megatron model, for checks and the CLI.

These run the whole sequence through Megatron's own pipeline schedule on every step (no KV cache): they exist to check
a converted model and to eyeball its text, not to serve it; rollouts use vLLM.
"""
from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist

from megatron_cpo import platform
from megatron_cpo.models.builder import unwrap_model


@torch.no_grad()
def forward_logits(model: Any, input_ids: torch.Tensor) -> torch.Tensor | None:
    """Logits over the real vocabulary, [batch, seq, hf_vocab_size] float, on the last PP stage (None elsewhere).

    Every rank of the model-parallel group must call it with the same `input_ids` ([batch, seq] token ids). The
    causal mask is Megatron's default; padding tokens are ordinary tokens here. `model` may be wrapped (DDP,
    Float16Module); it runs in eval mode (no dropout; Megatron's MoE layers refuse TP without sequence parallelism in
    train mode only) and is put back in its mode afterwards.
    """
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    vocab_size = unwrap_model(model).hf_vocab_size
    tokens = input_ids.to(platform.device())
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)

    def gather_logits(vocab_parallel_logits: torch.Tensor, non_loss_data: bool = True) -> torch.Tensor:
        full = tensor_parallel.gather_from_tensor_model_parallel_region(vocab_parallel_logits)
        return full[..., :vocab_size].float()

    def forward_step(data_iterator, stage_model):
        batch_tokens = next(data_iterator)
        return stage_model(batch_tokens, positions, attention_mask=None), gather_logits

    training = model.training
    model.eval()
    try:
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([tokens]),
            model=[model],
            num_microbatches=1,
            seq_length=tokens.shape[1],
            micro_batch_size=tokens.shape[0],
            forward_only=True,
            collect_non_loss_data=True,
        )
    finally:
        model.train(training)
    return outputs[0] if parallel_state.is_pipeline_last_stage() else None


@torch.no_grad()
def greedy_generate(model: Any, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    """Greedily extend `prompt_ids` by up to `max_new_tokens` tokens (stopping at EOS); returns the new tokens.

    Collective over the model-parallel group: the last stage picks each token and broadcasts it to the other stages.
    """
    from megatron.core import parallel_state

    tokens = list(prompt_ids)
    new_tokens: list[int] = []
    last_stage_rank = parallel_state.get_pipeline_model_parallel_last_rank()
    for _ in range(max_new_tokens):
        logits = forward_logits(model, torch.tensor([tokens]))
        next_token = torch.zeros(1, dtype=torch.long, device=platform.device())
        if logits is not None:
            next_token[0] = logits[0, -1].argmax()
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(next_token, src=last_stage_rank, group=parallel_state.get_pipeline_model_parallel_group())
        token = int(next_token.item())
        tokens.append(token)
        new_tokens.append(token)
        if token == eos_token_id:
            break
    return new_tokens


def format_generation(prompt_text: str, prompt_ids: list[int], new_tokens: list[int], text: str) -> str:
    """What `generate` prints: the prompt and the continuation, each as text and as the token ids the model saw or
    produced (a tokenizer mismatch or a stray special token shows up in the ids, not in the text)."""
    return (f"prompt ({len(prompt_ids)} tokens): {prompt_text!r}\nprompt token ids: {prompt_ids}\n"
            f"generation ({len(new_tokens)} tokens): {text!r}\ngeneration token ids: {new_tokens}")


def add_generate_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of `megatron-cpo generate`."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", help="Hugging Face model directory to load")
    source.add_argument("--mcore", help="torch_dist checkpoint to load (needs --hf-config)")
    parser.add_argument("--hf-config", help="HF directory with the config and tokenizer of --mcore")
    parser.add_argument("--prompt", default="What is 2 + 3?", help="user message")
    parser.add_argument("--system", default=None, help="optional system message")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="greedy tokens to generate at most")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    return parser


def run_generate(args: argparse.Namespace) -> None:
    """Load a model (HF dir or Megatron checkpoint), score the chat prompt, greedily continue it and print the text
    with its token ids."""
    from megatron.core import parallel_state
    from transformers import AutoTokenizer

    from megatron_cpo.models.builder import build_gpt_model, load_hf_config
    from megatron_cpo.models.checkpoint import load_checkpoint, read_checkpoint_info
    from megatron_cpo.models.weight_mapping import load_hf_weights

    if args.mcore and not args.hf_config:
        raise ValueError("--mcore needs --hf-config DIR (the HF directory with the model's config and tokenizer)")
    hf_dir = args.hf or args.hf_config
    hf_config = load_hf_config(hf_dir)
    if args.mcore:
        read_checkpoint_info(args.mcore)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    messages = ([{"role": "system", "content": args.system}] if args.system else [])
    messages.append({"role": "user", "content": args.prompt})
    prompt_text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    try:
        platform.init_distributed(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
        model = build_gpt_model(hf_config)
        if args.mcore:
            load_checkpoint(model, args.mcore)
        else:
            load_hf_weights(model, hf_dir)
        logits = forward_logits(model, torch.tensor([prompt_ids]))
        if logits is not None and parallel_state.get_tensor_model_parallel_rank() == 0 and \
                parallel_state.get_data_parallel_rank() == 0:
            targets = torch.tensor(prompt_ids[1:], device=logits.device)
            nll = torch.nn.functional.cross_entropy(logits[0, :-1], targets)
            print(f"forward: {len(prompt_ids)} prompt tokens, logits {tuple(logits.shape)}, "
                  f"prompt next-token NLL {nll.item():.4f}", flush=True)
        new_tokens = greedy_generate(model, prompt_ids, args.max_new_tokens, tokenizer.eos_token_id)
        if dist.get_rank() == 0:
            print(format_generation(prompt_text, prompt_ids, new_tokens,
                                    tokenizer.decode(new_tokens, skip_special_tokens=False)), flush=True)
    finally:
        platform.destroy_distributed()
