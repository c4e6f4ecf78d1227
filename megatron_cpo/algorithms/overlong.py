"""Overlong responses: DAPO's soft overlong punishment.

DAPO (Yu et al., 2025) penalises a response linearly once it enters the last `buffer_len` tokens of the length
budget: `min(0, -(length - (max_len - buffer_len)) / buffer_len * penalty_factor)`, added to its reward.
"""
from dataclasses import dataclass

import torch


@dataclass
class OverlongBufferConfig:
    """`reward.overlong_buffer.*`, DAPO's soft overlong punishment (verl's `reward_model.overlong_buffer`, accepted as
    an alias): a response longer than `data.max_response_length - len` tokens gets
    `-(length - (max - len)) / len * penalty_factor` added to its score, before the group filters and the advantages
    see it (`acc` is unchanged). `log: true` logs `overlong/reward_mean` (mean penalty) and `overlong/frac` (share of
    penalised responses) per step."""
    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0
    log: bool = False

    def __post_init__(self) -> None:
        if self.penalty_factor < 0:
            raise ValueError(f"reward.overlong_buffer.penalty_factor={self.penalty_factor} must be >= 0")
        if self.enable and self.len <= 0:
            raise ValueError(f"reward.overlong_buffer.len={self.len} must be > 0 when the buffer is enabled (tokens "
                             "before data.max_response_length where the penalty ramps up; DAPO uses "
                             "max_response_length / 5)")


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

