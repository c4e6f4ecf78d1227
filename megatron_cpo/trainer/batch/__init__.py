"""The batch a step trains on and its sequence layout: ragged rows (how tokens travel between ranks), prompt +
response sequences, padding-free packing, micro-batches and context-parallel chunks. Used by the driver (which builds
the batch) and the workers (which lay it out for Megatron); imports neither."""
