"""Overlong responses: DAPO's soft overlong punishment.

DAPO (Yu et al., 2025) penalises a response linearly once it enters the last `buffer_len` tokens of the length
budget: `min(0, -(length - (max_len - buffer_len)) / buffer_len * penalty_factor)`, added to its reward. Its
settings are `reward.overlong_buffer` (`OverlongBufferConfig`, config.py).
"""
import torch


def overlong_reward_penalty(
    response_lengths: torch.Tensor, max_response_length: int, buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """DAPO overlong penalty per response (<= 0), Tensor[N]; add it to the sequence reward."""
    if not 0 < buffer_len <= max_response_length:
        raise ValueError(
            f"overlong_buffer.len={buffer_len} must be in (0, max_response_length={max_response_length}]"
        )
    if penalty_factor < 0:
        raise ValueError(f"overlong_buffer.penalty_factor={penalty_factor} must be >= 0")
    expected = max_response_length - buffer_len
    exceed = response_lengths.float() - expected
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)

