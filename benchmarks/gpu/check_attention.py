"""The actor's core attention on the device against float64: torch's fused attention and Megatron's local one.

Qwen2.5-1.5B's attention (12 query heads, 2 key/value heads, head_dim 128), causal, on padded rows and on packed THD
sequences (torch's variable-length kernel on CUDA in 16-bit, one fused call per sequence otherwise: the path the
trainer takes is recorded), with and without a sliding window, float32 and bfloat16. Errors: max |error| / max
|float64 value| of the output and the three input gradients (random upstream gradient); tolerance 1e-5 in float32,
1e-2 in bfloat16. The local attention's errors on the same padded rows go beside them, and both attentions' forward +
backward milliseconds and extra peak memory.

    python -m benchmarks.gpu.check_attention --out attention.jsonl            # on the GPU
"""
from __future__ import annotations

import argparse
import math
import os
import time

import torch

from benchmarks.gpu.report import append_record

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
GPU_SHAPE = dict(heads=12, groups=2, width=128, rows=2, length=2048, packed=(1500, 23, 700, 301, 1024))
TINY_SHAPE = dict(heads=4, groups=2, width=16, rows=2, length=24, packed=(7, 3, 11))


def reference(query, key, value, allowed):
    """Float64 softmax attention; `query` [..., H, L, d], `key`/`value` [..., G, L, d], `allowed` [..., L, L]."""
    groups = query.shape[-3] // key.shape[-3]
    key, value = key.double().repeat_interleave(groups, -3), value.double().repeat_interleave(groups, -3)
    scores = (query.double() @ key.transpose(-1, -2) / math.sqrt(query.shape[-1])).masked_fill(~allowed, -math.inf)
    return scores.softmax(-1) @ value


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


def _modules(shape: dict, window: int | None, dtype: torch.dtype):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_cpo import platform
    from megatron_cpo.models.attention import TorchFusedAttention

    config = TransformerConfig(num_layers=1, hidden_size=shape["heads"] * shape["width"],
                               num_attention_heads=shape["heads"], num_query_groups=shape["groups"],
                               kv_channels=shape["width"], params_dtype=dtype, bf16=dtype == torch.bfloat16,
                               window_size=(window, 0) if window else None, attention_dropout=0.0,
                               hidden_dropout=0.0, masked_softmax_fusion=False,
                               **platform.megatron_config_kwargs())
    args = (config, 1, AttnMaskType.causal, "self")
    return TorchFusedAttention(*args), DotProductAttention(*args)


def _timed(run, device: torch.device) -> tuple[float, float | None]:
    """(ms of one forward + backward after a warm-up, extra peak GiB on CUDA)."""
    run()
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3, (torch.cuda.max_memory_allocated() - base) / 2**30
    return (time.perf_counter() - start) * 1e3, None


def check(layout: str, window: int | None, dtype: torch.dtype, shape: dict, device: torch.device) -> dict:
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_cpo.models.attention import varlen_applies, window_mask

    fused, local = _modules(shape, window, dtype)
    generator = torch.Generator(device=device).manual_seed(0)
    heads, groups, width = shape["heads"], shape["groups"], shape["width"]
    if layout == "padded":
        lead, length = (shape["length"], shape["rows"]), shape["length"]
    else:
        lead, length = (sum(shape["packed"]),), sum(shape["packed"])
    q, k, v = (torch.randn(*lead, count, width, generator=generator, device=device, dtype=dtype).requires_grad_()
               for count in (heads, groups, groups))
    upstream = torch.randn(*lead, heads * width, generator=generator, device=device, dtype=dtype)
    left = window
    if layout == "padded":
        allowed = window_mask(length, left, device)
        expected = reference(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), allowed).permute(2, 0, 1, 3).flatten(2)
        params, path = None, "padded"
    else:
        lengths = torch.tensor(shape["packed"], device=device)
        segment = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
        position = torch.arange(length, device=device) - (lengths.cumsum(0) - lengths)[segment]
        allowed = (segment[:, None] == segment[None, :]) & (position[None, :] <= position[:, None])
        if left is not None:
            allowed &= position[:, None] - position[None, :] <= left
        expected = reference(*(t.transpose(0, 1) for t in (q, k, v)), allowed).transpose(0, 1).flatten(1)
        cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).int()
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=int(lengths.max()), max_seqlen_kv=int(lengths.max()))
        path = "varlen" if varlen_applies(q, left) else "per_sequence"
    expected_grads = torch.autograd.grad((expected * upstream.double()).sum(), (q, k, v))
    record = {"layout": layout, "window": window, "dtype": str(dtype).replace("torch.", ""), "path": path,
              "tokens": q.shape[0] * (q.shape[1] if layout == "padded" else 1)}
    attentions = {"fused": lambda: fused(q, k, v, None, packed_seq_params=params)}
    if layout == "padded":
        attentions["local"] = lambda: local(q, k, v, None)
    for name, attend in attentions.items():
        output = attend()
        grads = torch.autograd.grad(output, (q, k, v), upstream)
        record[f"{name}_err"] = max(rel_error(output, expected),
                                    *(rel_error(g, e) for g, e in zip(grads, expected_grads)))
        record[f"{name}_ms"], record[f"{name}_extra_gib"] = _timed(
            lambda attend=attend: torch.autograd.grad(attend(), (q, k, v), upstream), device)
    record["tolerance"] = TOLERANCE[dtype]
    record["passed"] = record["fused_err"] <= TOLERANCE[dtype]
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="append one JSON line per case here")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="small shapes (the CPU smoke test)")
    parser.add_argument("--deadline", type=float, default=float("inf"), help="unix time to stop starting cases")
    args = parser.parse_args(argv)
    from megatron_cpo import platform

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29655"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    platform.init_distributed(1, 1)
    device, shape = platform.device(), TINY_SHAPE if args.tiny else GPU_SHAPE
    failures = 0
    for dtype in (torch.float32, torch.bfloat16):
        for layout in ("padded", "packed"):
            for window in (None, 5 if args.tiny else 512):
                base = {"layout": layout, "window": window, "dtype": str(dtype).replace("torch.", "")}
                if time.time() > args.deadline:
                    append_record(args.out, {**base, "status": "skipped", "note": "time budget"})
                    continue
                try:
                    record = check(layout, window, dtype, shape, device)
                    record["status"] = "ok" if record["passed"] else "failed"
                except Exception as error:  # noqa: BLE001  (one failing case must not hide the others)
                    record = {**base, "status": "failed", "note": f"{type(error).__name__}: {error}"[:300]}
                failures += record["status"] == "failed"
                append_record(args.out, record)
                print(record, flush=True)
    platform.destroy_distributed()
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
