"""The driver, on rank 0 only: the prompt stream, the filter-accumulate controller and its admission rule, grading,
the batch it builds for a step, validation and the metric loggers. It talks to the rollout engines and never to
Megatron; `loop.py` hands its batch to the workers."""
