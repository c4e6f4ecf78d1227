"""Fused log-prob / entropy kernels over vocab-parallel logits (of one target per token, or of k ids per token: the
student's log-probs at a teacher's top-k), the top-k ids themselves, and CPO's hint mutual-information signals.

``impl`` selects the backend explicitly: ``"auto"`` (compiled Triton on CUDA, chunked torch on CPU), ``"triton"``
(on CPU only under ``TRITON_INTERPRET=1``, as in the tests), ``"torch"``, or a ``TritonBackend``/``TorchChunkedBackend``
instance with other tile sizes.
"""
from megatron_cpo.kernels.backends import BACKENDS, KernelBackend, TorchChunkedBackend, TritonBackend
from megatron_cpo.kernels.hint_signals import HintSignals, hint_mi_signals
from megatron_cpo.kernels.log_probs import linear_log_probs_and_entropy, log_probs_and_entropy
from megatron_cpo.kernels.top_k import linear_top_k, logits_top_k

__all__ = ["BACKENDS", "HintSignals", "KernelBackend", "TorchChunkedBackend", "TritonBackend", "hint_mi_signals",
           "linear_log_probs_and_entropy", "linear_top_k", "log_probs_and_entropy", "logits_top_k"]
