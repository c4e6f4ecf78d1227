"""The one place that knows whether we run on CUDA (NCCL) or on CPU (gloo).

Without CUDA, `init_distributed` / `apply_cpu_adaptations` point Megatron-Core's device queries, RNG tracker and
hard-coded `device="cuda"` factories at the CPU (and replace the attention's causal-mask helpers, which activation
recompute runs outside that per-thread mode); `apply_moe_adaptations` does the same for MoE layers. With CUDA all
of this is skipped. The rest of the package calls `device()`, `backend()`, `megatron_config_kwargs()` (DEVELOPERS.md).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import socket
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

_CPU_ADAPTED = False
_THREAD_STATE = threading.local()  # holds this thread's device-redirecting TorchFunctionMode once entered


def has_cuda() -> bool:
    """Whether this process runs on a GPU."""
    return torch.cuda.is_available()


def backend() -> str:
    """The torch.distributed backend for this machine: "nccl" with CUDA, "gloo" without."""
    return "nccl" if has_cuda() else "gloo"


def device() -> torch.device:
    """The device this process computes on: its local GPU, or the CPU."""
    if has_cuda():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def megatron_config_kwargs() -> dict:
    """`TransformerConfig` settings this platform needs: on CPU, build weights on the CPU, send pipeline activations
    with plain isend/irecv (gloo has no batched point-to-point) and run experts one by one (grouped GEMMs need a GPU);
    nothing on a GPU."""
    if has_cuda():
        return {}
    return {"use_cpu_initialization": True, "batch_p2p_comm": False, "moe_grouped_gemm": False}


def _is_cuda(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.split(":")[0] == "cuda"
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites `device="cuda"` (and `.cuda()` / `.to("cuda")`) to the CPU for code written for GPUs only."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _cpu_rng_tracker_class():
    """A Megatron RNG-states tracker that keeps its named states on the CPU generator."""
    from megatron.core.tensor_parallel import random as mpu_random

    class CpuRNGStatesTracker(mpu_random.CudaRNGStatesTracker):
        """Same contract as Megatron's tracker (named seeded streams, `fork`), over `torch`'s CPU generator."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise ValueError(f"RNG seed {seed} is already tracked; every named stream needs its own seed")
            if name in self.states_:
                raise ValueError(f"RNG state {name!r} is already tracked")
            self.seeds_.add(seed)
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

        @contextlib.contextmanager
        def fork(self, name: str = mpu_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise KeyError(f"RNG state {name!r} was never added; call model_parallel_cuda_manual_seed first")
            saved = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

    return CpuRNGStatesTracker


def _cpu_get_rng_state(device: Any = None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = None, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    """Megatron's `get_default_causal_mask` on the CPU: True above the diagonal (hidden)."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_sliding_window_mask(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
    """Megatron's `get_sliding_window_causal_mask` on the CPU."""
    ones = torch.ones(sq, skv, dtype=torch.bool)
    upper = torch.triu(ones, diagonal=skv - sq - window_size[0])
    return ~torch.tril(upper, diagonal=skv - sq + window_size[1])


def _split_counts_on_cpu(tensor: Any) -> Any:
    """The alltoall dispatcher's split counts as the numpy array its GPU path copies them into."""
    return tensor.numpy() if torch.is_tensor(tensor) else tensor


def _cpu_alltoall_split_counts(self, point: str, tokens_per_expert: torch.Tensor | None = None):
    """`MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize` on the CPU: the counts are already on the host, so no
    side stream and no event; the split sizes become numpy arrays, as the GPU path makes them."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        self.input_splits = _split_counts_on_cpu(self.input_splits)
        self.output_splits = _split_counts_on_cpu(self.output_splits)
        self.output_splits_tp = _split_counts_on_cpu(self.output_splits_tp)
    return tokens_per_expert


def apply_moe_adaptations() -> None:
    """Let Megatron-Core's mixture-of-experts layers run without Transformer Engine and, on the CPU, the alltoall token
    dispatcher; idempotent.

    Without TE, `moe_utils` never defines `te_general_gemm`, which the router's gating reads (a NameError): it is set
    to None, the plain-torch path. On the CPU, the alltoall dispatcher would create a CUDA stream at construction and
    copy its split counts to the host on it: a placeholder stream is registered and the counts are converted in place.
    """
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if has_cuda():
        return
    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher
    if dispatcher.cuda_dtoh_stream is None:
        dispatcher.cuda_dtoh_stream = "cpu"  # read only by the method replaced below
    dispatcher._maybe_dtoh_and_synchronize = _cpu_alltoall_split_counts


def apply_cpu_adaptations() -> None:
    """Make Megatron-Core run on the CPU (see the module docstring); idempotent, and a no-op when CUDA is present.

    The patches are process-wide; torch keeps function modes per thread, so a thread other than the one that called
    `init_distributed` and runs Megatron code calls this once itself.
    """
    global _CPU_ADAPTED
    if has_cuda():
        return
    if not _CPU_ADAPTED:
        from megatron.core.fusions import fused_softmax
        from megatron.core.tensor_parallel import random as mpu_random
        from megatron.core.transformer import utils as transformer_utils

        for module in (transformer_utils, fused_softmax):  # fused_softmax imported the helpers by name
            module.get_default_causal_mask = _cpu_causal_mask
            module.get_sliding_window_causal_mask = _cpu_sliding_window_mask
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.synchronize = lambda device=None: None
        mpu_random.CudaRNGStatesTracker = _cpu_rng_tracker_class()
        mpu_random._get_cuda_rng_state = _cpu_get_rng_state
        mpu_random._set_cuda_rng_state = _cpu_set_rng_state
        mpu_random.initialize_rng_tracker(force_reset=True)
        _CPU_ADAPTED = True
    if getattr(_THREAD_STATE, "device_mode", None) is None:
        _THREAD_STATE.device_mode = _CudaToCpuMode()
        _THREAD_STATE.device_mode.__enter__()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _CudaTypeNamesMode(TorchFunctionMode):
    """`tensor.type()` (no arguments) reports CPU tensors as their CUDA counterparts; everything else unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


_CPU_TYPE_NAMES_MODE: _CudaTypeNamesMode | None = None


def apply_cpu_optimizer_adaptation() -> None:
    """Let Megatron-Core's optimizers accept CPU parameters; idempotent, and a no-op when CUDA is present.

    The distributed optimizer and gradient clipping select tensors by their legacy type string
    (`param.type() == "torch.cuda.FloatTensor"`); on the CPU that query answers with the CUDA name. Only the trainer's
    optimizer needs this, so it is separate from `apply_cpu_adaptations` (per thread, like the device mode).
    """
    global _CPU_TYPE_NAMES_MODE
    if has_cuda() or _CPU_TYPE_NAMES_MODE is not None:
        return
    _CPU_TYPE_NAMES_MODE = _CudaTypeNamesMode()
    _CPU_TYPE_NAMES_MODE.__enter__()


def init_distributed(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                     seed: int = 1234, context_parallel_size: int = 1, expert_model_parallel_size: int = 1,
                     expert_tensor_parallel_size: int | None = None) -> None:
    """Join the process group torchrun describes (or a one-process group), then set up Megatron's TP/PP/CP groups and
    its expert groups (EP experts per rank group, each expert split over ETP ranks; ETP None = TP).

    Reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT / LOCAL_RANK as torchrun sets them; without WORLD_SIZE the
    process runs alone on a free loopback port. Seeds Megatron's model-parallel RNG streams with `seed`. Calling it
    again with the same sizes is a no-op; with different sizes, call `destroy_distributed()` first.
    """
    from megatron.core import parallel_state, tensor_parallel

    apply_cpu_adaptations()
    apply_moe_adaptations()
    etp = expert_tensor_parallel_size or tensor_model_parallel_size
    wanted = (tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size, etp)
    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_expert_model_parallel_world_size(),
                parallel_state.get_expert_tensor_parallel_world_size())
        if have != wanted:
            names = ("TP", "PP", "EP", "ETP")
            raise RuntimeError(f"model parallelism is already initialised with "
                               f"{', '.join(f'{n}={v}' for n, v in zip(names, have))}; call destroy_distributed() "
                               f"before initialising {', '.join(f'{n}={v}' for n, v in zip(names, wanted))}")
        return
    if not dist.is_initialized():
        if has_cuda():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = datetime.timedelta(minutes=30)
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend=backend(), timeout=timeout)
        else:
            dist.init_process_group(backend=backend(), init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                                    world_size=1, timeout=timeout)
    world_size = dist.get_world_size()
    model_parallel = tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size
    if world_size % model_parallel:
        raise ValueError(f"world size {world_size} is not divisible by TP={tensor_model_parallel_size} x "
                         f"PP={pipeline_model_parallel_size} x CP={context_parallel_size} = {model_parallel}; launch a "
                         f"multiple of {model_parallel} processes (torchrun --nproc-per-node) or change --tp/--pp/--cp")
    expert_parallel = etp * expert_model_parallel_size * pipeline_model_parallel_size
    if world_size % expert_parallel:
        raise ValueError(f"world size {world_size} is not divisible by ETP={etp} x EP={expert_model_parallel_size} x "
                         f"PP={pipeline_model_parallel_size} = {expert_parallel}; choose expert sizes whose product "
                         f"with PP divides the number of processes")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_model_parallel_size,
                                             pipeline_model_parallel_size=pipeline_model_parallel_size,
                                             context_parallel_size=context_parallel_size,
                                             expert_model_parallel_size=expert_model_parallel_size,
                                             expert_tensor_parallel_size=etp)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_distributed() -> None:
    """Tear down Megatron's model-parallel groups and the default process group (safe to call twice)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
