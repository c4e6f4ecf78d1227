"""Pure tensor math of the RL algorithms: advantages, losses, CPO shaping, group filters.

Torch only: no I/O, no torch.distributed, no Python loop over samples, groups or tokens. Prompt groups are given as
`group: LongTensor[N]` of indices 0..G-1.
"""
