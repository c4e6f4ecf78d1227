"""The driver: one interface on every rank (`interface.py`). Rank 0's `LeadDriver` runs the prompt stream, the
filter-accumulate controller and its admission rule, grading, the batch it builds for a step, validation and the metric
loggers, and broadcasts its decisions; the other ranks' `FollowerDriver` receives them. It talks to the rollout engines
and never to Megatron; `loop.py` hands its batch to the workers."""
