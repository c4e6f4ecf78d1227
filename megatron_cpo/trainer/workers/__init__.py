"""The workers, on every rank: the Megatron actor and reference (and their optimizer, routing replay, offload), the
log-prob / advantage / update steps they run in lockstep, the weight push and the sync probe's scoring."""
