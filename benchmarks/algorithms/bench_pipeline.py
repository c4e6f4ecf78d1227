"""Time the advantage + CPO shaping + policy-loss path, vectorised vs a per-sample Python loop of the same math.

The batch is 1,024 responses x 2,048 tokens in 128 prompt groups of 8 (random lengths, CPU). One pass is: GRPO
advantages, difficulty mask, hint signals, `negonly_mi3` shaping, then the clip-higher token-mean policy loss and its
backward. The loop rendering computes each response on its own, as code without group/batch vectorisation would. Both
give the same loss and gradient (checked before timing).

Run: python benchmarks/algorithms/bench_pipeline.py [--responses 1024 --tokens 2048 --repeats 5]
"""
import argparse
import statistics
import time

import torch

from megatron_cpo.algorithms.advantages import grpo_advantages
from megatron_cpo.algorithms.cpo import ShapingInputs, difficulty_mask, shape_advantages
from megatron_cpo.algorithms.cpo_rules import CPOConfig
from megatron_cpo.algorithms.losses import PolicyLossConfig, policy_loss
from megatron_cpo.kernels import hint_mi_signals

POS_ALPHA, NEG_ALPHA, CLIP_LOW, CLIP_HIGH, CLIP_C = 0.1, 0.1, 0.2, 0.28, 3.0


def make_batch(n: int, t: int, group_size: int = 8, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(t // 8, t + 1, (n,), generator=gen)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    old = -2.0 * torch.rand(n, t, generator=gen)
    return dict(
        scores=(torch.rand(n, generator=gen) > 0.6).float(),
        group=torch.arange(n // group_size).repeat_interleave(group_size),
        mask=mask,
        old_log_probs=old,
        log_probs=old + 0.05 * torch.randn(n, t, generator=gen),
        hint_log_probs=-2.0 * torch.rand(n, t, generator=gen),
        entropy=3.0 * torch.rand(n, t, generator=gen),
    )


def vectorised(b: dict) -> tuple[torch.Tensor, torch.Tensor]:
    correct = b["scores"] > 0.5
    adv = grpo_advantages(b["scores"], b["group"], b["mask"])
    signals = hint_mi_signals(b["old_log_probs"], b["hint_log_probs"], b["entropy"], b["mask"])
    adv = shape_advantages(CPOConfig("negonly_mi3", pos_alpha=POS_ALPHA, neg_alpha=NEG_ALPHA, cpo_lambda=5.0),
                           ShapingInputs(adv, b["mask"], b["old_log_probs"], b["entropy"], b["hint_log_probs"], signals,
                                         correct, difficulty_mask(correct, b["group"])))
    log_probs = b["log_probs"].clone().requires_grad_(True)
    config = PolicyLossConfig(clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, clip_ratio_c=CLIP_C)
    loss, _ = policy_loss(log_probs, b["old_log_probs"], adv, b["mask"], config)
    loss.backward()
    return loss.detach(), log_probs.grad


def per_sample_loop(b: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The same math, one response at a time (what the reference implementation's style amounts to)."""
    n = b["scores"].shape[0]
    log_probs = b["log_probs"].clone().requires_grad_(True)
    total = torch.zeros(())
    tokens = b["mask"].sum()
    for i in range(n):
        peers = b["group"] == b["group"][i]
        peer_scores = b["scores"][peers]
        correct = bool(b["scores"][i] > 0.5)
        if peer_scores.numel() > 1:
            a = float((b["scores"][i] - peer_scores.mean()) / (peer_scores.std() + 1e-6))
        else:
            a = 0.0
        all_wrong = not bool((peer_scores > 0.5).any())
        m = b["mask"][i] > 0
        lp, lp_h, h = b["old_log_probs"][i][m], b["hint_log_probs"][i][m], b["entropy"][i][m]
        mi = torch.exp(lp_h) * (lp_h - lp)
        u = (h - h.min()) / (h.max() - h.min() + 1e-8)
        adv = torch.full_like(lp, a)
        if correct:
            adv = adv + POS_ALPHA * u
        elif all_wrong:
            adv = adv + torch.where(mi >= 0, NEG_ALPHA * mi * u, NEG_ALPHA * mi * (1 - u))
        log_ratio = torch.clamp(log_probs[i][m] - lp, -20, 20)
        ratio = torch.exp(log_ratio)
        loss_ppo = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH))
        token_loss = torch.where(adv < 0, torch.minimum(-adv * CLIP_C, loss_ppo), loss_ppo)
        total = total + token_loss.sum()
    loss = total / tokens
    loss.backward()
    return loss.detach(), log_probs.grad


def time_it(fn, batch: dict, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(batch)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--responses", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--loop-repeats", type=int, default=2)
    args = parser.parse_args()
    batch = make_batch(args.responses, args.tokens)
    loss_v, grad_v = vectorised(batch)
    loss_l, grad_l = per_sample_loop(batch)
    torch.testing.assert_close(loss_v, loss_l, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grad_v, grad_l, rtol=1e-4, atol=1e-9)
    vec = time_it(vectorised, batch, args.repeats)
    loop = time_it(per_sample_loop, batch, args.loop_repeats)
    vec_med, loop_med = statistics.median(vec), statistics.median(loop)
    print(f"batch {args.responses} x {args.tokens}, torch threads {torch.get_num_threads()}")
    print(f"vectorised: median {vec_med * 1e3:.1f} ms over {args.repeats} (min {min(vec) * 1e3:.1f} ms)")
    print(f"per-sample loop: median {loop_med * 1e3:.1f} ms over {args.loop_repeats} (min {min(loop) * 1e3:.1f} ms)")
    print(f"speed-up: {loop_med / vec_med:.1f}x")


if __name__ == "__main__":
    main()
