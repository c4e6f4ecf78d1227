"""Fused log-prob / entropy kernels over vocab-parallel logits, and CPO's hint mutual-information signals.

``impl`` selects the backend explicitly: ``"auto"`` (compiled Triton on CUDA, chunked torch on CPU), ``"triton"``
(on CPU only under ``TRITON_INTERPRET=1``, as in the tests), ``"torch"``, or a ``TritonBackend``/``TorchChunkedBackend``
instance with other tile sizes.
"""
from megatron_cpo.kernels.backends import BACKENDS, KernelBackend, TorchChunkedBackend, TritonBackend
from megatron_cpo.kernels.hint_signals import HintSignals, hint_mi_signals
from megatron_cpo.kernels.log_probs import linear_log_probs_and_entropy, log_probs_and_entropy

__all__ = ["BACKENDS", "HintSignals", "KernelBackend", "TorchChunkedBackend", "TritonBackend", "hint_mi_signals",
           "linear_log_probs_and_entropy", "log_probs_and_entropy"]
