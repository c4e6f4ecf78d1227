"""Kernel correctness on the device against float64: both kernels, forward and both gradients, fp32 and bf16.

Every case uses awkward sizes (no multiple of any tile), tokens with `ignore_index`, a padded vocabulary (columns or
lm-head rows past `vocab_size`), a temperature other than 1, random upstream gradients for both outputs; the
"extreme" cases put logits at +-1e4. The float64 reference is the materialised softmax over the real vocabulary
(`kernels/reference.py` on float64 copies of the same inputs). On CUDA the kernels run as users get them
(`impl="auto"`: compiled Triton, shipped tile sizes); with `--tiny` (the CPU smoke test) they run under the Triton
interpreter with small tiles, and through the chunked torch backend.

    python -m benchmarks.gpu.check_kernels --out kernels.jsonl            # on the GPU
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from benchmarks.gpu.report import append_record
from megatron_cpo.kernels import TorchChunkedBackend, TritonBackend, linear_log_probs_and_entropy, log_probs_and_entropy
from megatron_cpo.kernels.reference import materialized_log_probs_and_entropy

IGNORE = -100
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # max |error| / max |float64 value|


@dataclass(frozen=True)
class Case:
    kernel: str  # "logits" or "linear"
    dtype: torch.dtype
    extreme: bool
    n: int
    h: int
    v: int
    pad: int
    temperature: float


def cases(tiny: bool) -> list[Case]:
    """GPU sizes cross several tiles, vocabulary splits and backward token chunks; tiny ones run interpreted."""
    n, h, v, pad = (29, 40, 203, 5) if tiny else (3001, 576, 50021, 107)
    dtypes = (torch.float32, torch.bfloat16)
    return [Case(kernel, dtype, extreme, n, h, v, pad, 1.0 if extreme else (0.7 if dtype == torch.float32 else 1.3))
            for kernel in ("logits", "linear") for dtype in dtypes for extreme in (False, True)]


def backends(device: torch.device, tiny: bool) -> dict[str, object]:
    if device.type == "cuda":
        return {"auto": "auto"}
    small_triton = TritonBackend(logits_block_v=64, block_n=16, block_v=32, block_k=16, min_programs=8,
                                 grad_chunk_bytes=16 * 128 * 4)
    return {"triton-interpreted": small_triton, "torch": TorchChunkedBackend(tile_elements=7 * 64, vocab_tile=64)}


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


def _targets(gen: torch.Generator, case: Case, device: torch.device) -> torch.Tensor:
    targets = torch.randint(0, case.v, (case.n,), generator=gen)
    targets[:: 7] = IGNORE
    return targets.to(device)


def _linear_inputs(gen: torch.Generator, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 hidden [N, H] and lm-head [V + pad, H], exactly representable in the case's dtype.

    "extreme": small integers (x 1/4) plus a +-1e4 component on every fifth vocabulary row: every partial sum of the
    matmul is exact in float32, the logits reach +-1e4 and the softmax is not degenerate."""
    rows = case.v + case.pad
    if not case.extreme:
        hidden = torch.randn(case.n, case.h, generator=gen, dtype=torch.float64)
        weight = torch.randn(rows, case.h, generator=gen, dtype=torch.float64) * 4 / case.h ** 0.5
    else:
        hidden = torch.randint(-2, 3, (case.n, case.h), generator=gen).double()
        weight = torch.randint(-1, 2, (rows, case.h), generator=gen).double() / 4
        hidden[:, 0] = torch.where(torch.arange(case.n) % 2 == 0, 1e4, -1e4)
        weight[:, 0] = (torch.arange(rows) % 5 == 0).double()
    return hidden.to(case.dtype).double(), weight.to(case.dtype).double()


def _logits(gen: torch.Generator, case: Case) -> torch.Tensor:
    logits = torch.randn(case.n, case.v + case.pad, generator=gen, dtype=torch.float64) * 3
    if case.extreme:
        logits[::3, 5] = 1e4
        logits[::4, 7] = 1e4
        logits[1::2, 20:60] = -1e4
    return logits.to(case.dtype).double()


def _errors(lp, ent, grads, ref_lp, ref_ent, ref_grads, case: Case) -> dict[str, float | None]:
    return {"log_probs": rel_error(lp, ref_lp), "entropy": rel_error(ent, ref_ent),
            "grad_input": rel_error(grads[0], ref_grads[0]),
            "grad_weight": rel_error(grads[1], ref_grads[1]) if case.kernel == "linear" else None}


def _plain_torch(inputs64: list[torch.Tensor], targets: torch.Tensor, grad_lp: torch.Tensor, grad_ent: torch.Tensor,
                 case: Case) -> tuple:
    """The materialised computation in the case's dtype (matmul, softmax, autograd): what plain torch gets."""
    inputs = [t.to(case.dtype).requires_grad_() for t in inputs64]
    logits = inputs[0] if case.kernel == "logits" else inputs[0] @ inputs[1].T
    lp, ent = materialized_log_probs_and_entropy(logits[:, : case.v], targets, case.temperature, IGNORE)
    grads = torch.autograd.grad((lp.double() * grad_lp).sum() + (ent.double() * grad_ent).sum(), inputs)
    return lp, ent, grads


def check(case: Case, impl: object, device: torch.device, seed: int = 0) -> dict:
    """Errors of log-probs, entropy and the input gradients against float64, relative to the float64 magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    targets = _targets(gen, case, device)
    grad_lp = torch.randn(case.n, generator=gen, dtype=torch.float64).to(device)
    grad_ent = torch.randn(case.n, generator=gen, dtype=torch.float64).to(device)
    if case.kernel == "logits":
        inputs64 = [_logits(gen, case).to(device)]
    else:
        inputs64 = [t.to(device) for t in _linear_inputs(gen, case)]
    ref_inputs = [t.clone().requires_grad_() for t in inputs64]
    ref_logits = ref_inputs[0] if case.kernel == "logits" else ref_inputs[0] @ ref_inputs[1].T
    ref_lp, ref_ent = materialized_log_probs_and_entropy(ref_logits[:, : case.v], targets, case.temperature, IGNORE)
    ref_grads = torch.autograd.grad((ref_lp * grad_lp).sum() + (ref_ent * grad_ent).sum(), ref_inputs)

    inputs = [t.to(case.dtype).requires_grad_() for t in inputs64]
    if case.kernel == "logits":
        lp, ent = log_probs_and_entropy(inputs[0], targets, case.temperature, ignore_index=IGNORE, vocab_size=case.v,
                                       impl=impl)
    else:
        lp, ent = linear_log_probs_and_entropy(inputs[0], inputs[1], targets, case.temperature, ignore_index=IGNORE,
                                              vocab_size=case.v, impl=impl)
    grads = torch.autograd.grad((lp.double() * grad_lp).sum() + (ent.double() * grad_ent).sum(), inputs)
    errors = _errors(lp, ent, grads, ref_lp, ref_ent, ref_grads, case)
    torch_errors = _errors(*_plain_torch(inputs64, targets, grad_lp, grad_ent, case), ref_lp, ref_ent, ref_grads, case)
    tolerance = TOLERANCE[case.dtype]
    finite = all(bool(torch.isfinite(t).all()) for t in (lp, ent, *grads))
    # the bar: the dtype's tolerance; in float32, or twice the error of plain torch's float32 computation where that
    # is larger (a float32 reduction over 50k vocabulary entries is off by ~1e-5 in any summation order). In bf16
    # plain torch rounds the logits themselves (its error reaches 1 on +-1e4 logits): no bar to measure against.
    passed = finite and all(e < (max(tolerance, 2 * torch_errors[k]) if case.dtype == torch.float32 else tolerance)
                            for k, e in errors.items() if e is not None)
    padding_grad_zero = bool((grads[0][:, case.v:] == 0).all()) if case.kernel == "logits" else \
        bool((grads[1][case.v:] == 0).all())
    return {"kernel": "log_probs_and_entropy" if case.kernel == "logits" else "linear_log_probs_and_entropy",
            "dtype": str(case.dtype).replace("torch.", ""), "case": "+-1e4 logits" if case.extreme else "random",
            "n": case.n, "h": case.h if case.kernel == "linear" else None, "v": case.v, "pad": case.pad,
            "temperature": case.temperature, "ignored_tokens": int((targets == IGNORE).sum()),
            **{f"err_{k}": v for k, v in errors.items()}, "tolerance": tolerance,
            **{f"torch_err_{k}": v for k, v in torch_errors.items()},
            "padding_grad_zero": padding_grad_zero, "passed": passed and padding_grad_zero}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="append one JSON line per case here")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="small shapes (the CPU smoke test)")
    parser.add_argument("--deadline", type=float, default=float("inf"), help="unix time to stop starting cases")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    failures = 0
    for backend_name, impl in backends(device, args.tiny).items():
        for case in cases(args.tiny):
            if time.time() > args.deadline:
                append_record(args.out, {"backend": backend_name, "status": "skipped", "note": "time budget"})
                continue
            start = time.perf_counter()
            try:
                record = {"backend": backend_name, **check(case, impl, device)}
                record["status"] = "ok" if record["passed"] else "failed"
            except Exception as error:  # noqa: BLE001  (one failing case must not hide the others)
                record = {"backend": backend_name, "kernel": case.kernel, "dtype": str(case.dtype),
                          "status": "failed", "note": f"{type(error).__name__}: {error}"[:300]}
            record["seconds"] = time.perf_counter() - start
            failures += record["status"] == "failed"
            append_record(args.out, record)
            print(record, flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
