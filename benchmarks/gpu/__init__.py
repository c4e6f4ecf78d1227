"""The one-command GPU check (`scripts/gpu_check.sh`): kernel correctness, the kernel grid and the Megatron actor."""
