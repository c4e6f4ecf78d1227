"""torch's fused attention for the layer spec (megatron_cpo/models/attention.py) against an explicit softmax, and which
core attention each `attention_backend` value gives. The whole model through the actor: tests/trainer/
test_attention_backends.py."""
import math

import pytest
import torch

from megatron_cpo.models.attention import (
    causal_attention,
    core_attention_kind,
    packing_layout,
    per_sequence_attention,
    window_mask,
)


def _reference(query, key, value, allowed):
    """Softmax attention written out in float64: `query` [..., H, L, d], `key`/`value` [..., G, L, d] (each key/value
    head shared by H / G query heads), `allowed` [L, L] or [..., 1, L, L] (True = may attend)."""
    groups = query.shape[-3] // key.shape[-3]
    key, value = key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)
    scores = query.double() @ key.double().transpose(-1, -2) / math.sqrt(query.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ value.double()).to(query.dtype)


def _qkv(*lead, length, heads=4, groups=2, width=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*lead, count, length, width, generator=generator, requires_grad=True)
            for count in (heads, groups, groups)]


@pytest.mark.parametrize("window_left", [None, 3])
def test_causal_attention_shares_kv_heads_and_honours_the_window(window_left):
    query, key, value = _qkv(2, length=11)
    got = causal_attention(query, key, value, 1 / math.sqrt(8), window_left)
    expected = _reference(query, key, value, window_mask(11, window_left))
    assert torch.allclose(got, expected, atol=1e-6)
    grads = torch.autograd.grad(got.square().sum(), (query, key, value))
    expected_grads = torch.autograd.grad(expected.square().sum(), (query, key, value))
    assert all(torch.allclose(g, e, atol=1e-5) for g, e in zip(grads, expected_grads))


def test_a_mask_hides_keys_on_top_of_the_causal_one():
    query, key, value = _qkv(2, length=6)
    allowed = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    allowed[1, :, :, :3] = False
    allowed[1, :, :3, :3] = True  # the first three queries still see the first three keys
    got = causal_attention(query, key, value, 1 / math.sqrt(8), allowed=allowed)
    assert torch.allclose(got, _reference(query, key, value, allowed & window_mask(6, None)), atol=1e-6)


def test_window_mask_lets_query_i_see_the_left_keys_before_it():
    assert window_mask(4, 1).int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    assert window_mask(3, None).int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


@pytest.mark.parametrize("short", [1, 6, 100])  # every sequence alone, the short ones together, all together
@pytest.mark.parametrize("window_left", [None, 2])
def test_packed_sequences_never_see_each_other(short, window_left):
    lengths = [5, 9, 0, 3, 8, 1]
    total = sum(lengths)
    # THD: [T, heads, d]
    query, key, value = (t.detach().transpose(0, 1).contiguous().requires_grad_() for t in _qkv(length=total))
    got = per_sequence_attention(query, key, value, lengths, 1 / math.sqrt(8), window_left, short=short)
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    start = torch.tensor([0, *lengths]).cumsum(0)[segment]
    position = torch.arange(total) - start  # each token's position inside its sequence
    allowed = (segment[:, None] == segment[None, :]) & (position[None, :] <= position[:, None])
    if window_left is not None:
        allowed &= position[:, None] - position[None, :] <= window_left
    expected = _reference(*(t.transpose(0, 1) for t in (query, key, value)), allowed).transpose(0, 1)
    assert got.shape == query.shape and torch.allclose(got, expected, atol=1e-6)
    grads = torch.autograd.grad(got.square().sum(), (query, key, value))
    expected_grads = torch.autograd.grad(expected.square().sum(), (query, key, value))
    assert all(torch.allclose(g, e, atol=1e-5) for g, e in zip(grads, expected_grads))


@pytest.mark.parametrize("backend,engine,kind", [
    ("auto", False, "torch"), ("flash", False, "torch"), ("fused", False, "torch"), ("local", False, "local"),
    ("auto", True, "te"), ("flash", True, "te"), ("unfused", True, "te"), ("local", True, "local")])
def test_each_backend_names_one_core_attention(backend, engine, kind):
    assert core_attention_kind(backend, transformer_engine=engine) == kind
    assert packing_layout(kind) == ("rows" if kind == "local" else "thd")


def test_backends_that_cannot_run_here_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"attention_backend=unfused is Transformer Engine's .* set it to local"):
        core_attention_kind("unfused", transformer_engine=False)
    with pytest.raises(ValueError, match=r"attention_backend='sdpa' is unknown; choose from"):
        core_attention_kind("sdpa", transformer_engine=False)


def test_verl_spelling_sets_the_actor_and_the_critic_must_agree():
    from megatron_cpo.config import build_config

    key = "actor_rollout_ref.actor.megatron.override_transformer_config.attention_backend"
    assert build_config({}, [f"{key}=local"]).actor_rollout_ref.actor.megatron.attention_backend == "local"
    assert build_config({}).actor_rollout_ref.actor.megatron.attention_backend == "auto"
    with pytest.raises(ValueError, match="attention_backend"):
        build_config({}, ["actor_rollout_ref.actor.megatron.attention_backend=sdpa"])
    with pytest.raises(ValueError, match="critic.megatron.override_transformer_config.attention_backend"):
        build_config({}, ["critic.megatron.override_transformer_config.attention_backend=local"])
