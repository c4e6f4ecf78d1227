"""The core attention alone on CPU: Megatron-Core's local attention against torch's fused one, padded and packed.

One attention layer of SmolLM2-135M (9 query heads, 3 key/value heads, head_dim 64, float32), forward + backward
(gradients of q, k, v), on micro-batches of a token budget holding sequences of three length mixes. The ways a packed
micro-batch can run are timed against each other:
- `local_rows`: Megatron's `DotProductAttention` on bin-packed rows with a block-diagonal mask (before this change);
- `fused_rows_mask`: torch's `scaled_dot_product_attention` on the same rows and mask;
- `fused_one_row_mask`: one row of every token, one block-diagonal mask;
- `fused_per_sequence`: THD, one fused causal call per sequence;
- `fused_thd`: THD as shipped (`models.attention.per_sequence_attention`): one call per sequence of at least
  `SHORT_SEQUENCE` tokens, one for all shorter ones together as right-padded rows;
- `nested_jagged` and `flex_attention`: tried, and recorded with torch's reason when they cannot train on CPU;
and, for the padded mode, `local_padded` / `fused_padded` (every sequence in its own right-padded row).
Each case times `--repeats` runs after one warm-up and keeps the median of CPU seconds (user + system of the
process) and of wall seconds; the load average before and after goes with the results.

    python benchmarks/attention/bench_packed_attention.py --out benchmarks/attention/packed_results.json
    python benchmarks/attention/bench_packed_attention.py --markdown benchmarks/attention/packed_results.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform as host
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "learning"))

from machine import machine_record  # noqa: E402

MODEL = ROOT / "examples/smollm2-135m/model"
# name: (token budget of the micro-batch, prompt length, response lengths drawn evenly from this range)
MIXES = {"short": (4096, 52, (24, 128)), "medium": (8192, 52, (128, 1024)), "long": (8192, 52, (1024, 4096))}
WAYS = ("local_rows", "fused_rows_mask", "fused_one_row_mask", "fused_per_sequence", "fused_thd", "nested_jagged",
        "flex_attention", "local_padded", "fused_padded")


def cpu_name() -> str:
    """The CPU's model name and vector extensions that matter to torch's kernels."""
    machine = machine_record()
    return (f"{machine['cpu'] or host.processor() or 'unknown'} ({', '.join(machine['cpu_flags']) or 'no AVX2'}), "
            f"{machine['cores']} cores")


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def lengths_of(mix: str) -> list[int]:
    """Sequence lengths (prompt + response) filling the mix's token budget, responses spread evenly over its range."""
    budget, prompt, (low, high) = MIXES[mix]
    lengths: list[int] = []
    step = 0
    while True:
        response = low + (high - low) * ((step * 7) % 11) // 10  # a fixed, uneven spread over the range
        if sum(lengths) + prompt + response > budget:
            return lengths or [budget]
        lengths.append(prompt + response)
        step += 1


def _modules():
    """The local and the fused core attention of one SmolLM2 layer (TP=1), built as the layer spec builds them."""
    import torch
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_cpo.models.attention import TorchFusedAttention
    from megatron_cpo.models.builder import load_hf_config, transformer_config

    config = transformer_config(load_hf_config(MODEL), torch.float32)
    args = (config, 1, AttnMaskType.causal, "self")
    return DotProductAttention(*args), TorchFusedAttention(*args), config


def _inputs(tokens_shape: tuple[int, ...], config, generator):
    import torch

    heads, groups, width = config.num_attention_heads, config.num_query_groups, config.kv_channels
    q = torch.randn(*tokens_shape, heads, width, generator=generator, requires_grad=True)
    k = torch.randn(*tokens_shape, groups, width, generator=generator, requires_grad=True)
    v = torch.randn(*tokens_shape, groups, width, generator=generator, requires_grad=True)
    return q, k, v


def _case(way: str, lengths: list[int], local, fused, config):
    """A closure running one forward + backward of `way` over sequences of `lengths`."""
    import torch
    import torch.nn.functional as F

    from megatron_cpo.models.attention import SHORT_SEQUENCE, per_sequence_attention
    from megatron_cpo.trainer.batch.packing import pack_rows
    from megatron_cpo.trainer.batch.sequences import pack_sequences

    generator = torch.Generator().manual_seed(0)
    seqs = pack_sequences([[5] * n for n in lengths], [[] for _ in lengths], 0, 1)
    if way in ("local_rows", "fused_rows_mask"):
        packed = pack_rows(seqs, "rows")
        q, k, v = _inputs((packed.width, packed.rows), config, generator)
        mask, module = packed.attention_mask(), (local if way == "local_rows" else fused)
        return lambda: module(q, k, v, mask).sum().backward()
    if way == "fused_one_row_mask":
        segments = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        hidden = (segments[:, None] != segments[None, :])[None, None]
        q, k, v = _inputs((sum(lengths), 1), config, generator)
        return lambda: fused(q, k, v, hidden).sum().backward()
    if way in ("fused_per_sequence", "fused_thd"):
        q, k, v = _inputs((sum(lengths),), config, generator)
        short = 1 if way == "fused_per_sequence" else SHORT_SEQUENCE
        return lambda: per_sequence_attention(q, k, v, lengths, fused.scale, short=short).sum().backward()
    if way in ("local_padded", "fused_padded"):
        q, k, v = _inputs((max(lengths), len(lengths)), config, generator)
        module = local if way == "local_padded" else fused
        return lambda: module(q, k, v, None).sum().backward()
    q, k, v = _inputs((sum(lengths),), config, generator)
    parts = [[t[start:start + n] for start, n in zip(torch.tensor([0, *lengths]).cumsum(0).tolist(), lengths)]
             for t in (q, k, v)]
    if way == "nested_jagged":
        nested = [torch.nested.as_nested_tensor(p, layout=torch.jagged).transpose(1, 2) for p in parts]
        attend = F.scaled_dot_product_attention
        return lambda: attend(*nested, is_causal=True, enable_gqa=True).values().sum().backward()
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    segments = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    block_mask = create_block_mask(lambda b, h, i, j: (segments[i] == segments[j]) & (j <= i), 1, 1,
                                   sum(lengths), sum(lengths), device="cpu")
    heads_first = [t.transpose(0, 1)[None] for t in (q, k, v)]
    return lambda: flex_attention(*heads_first, block_mask=block_mask, enable_gqa=True).sum().backward()


def measure(ways: list[str], mixes: list[str], repeats: int, threads: int) -> dict:
    import torch

    from megatron_cpo import platform

    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29641"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    platform.init_distributed(1, 1)
    local, fused, config = _modules()
    results = {"cpu": cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads(),
               "cpu_capability": torch.backends.cpu.get_cpu_capability(), "load_before": os.getloadavg(),
               "repeats": repeats, "cases": []}
    for mix in mixes:
        lengths = lengths_of(mix)
        for way in ways:
            case = {"mix": mix, "way": way, "sequences": len(lengths), "tokens": sum(lengths),
                    "longest": max(lengths)}
            try:
                run = _case(way, lengths, local, fused, config)
                run()  # warm-up
            except Exception as error:  # torch refuses this way here: record why
                case["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                results["cases"].append(case)
                print(json.dumps(case), flush=True)
                continue
            walls, cpus = [], []
            for _ in range(repeats):
                start_wall, start_cpu = time.perf_counter(), cpu_seconds()
                run()
                walls.append(time.perf_counter() - start_wall)
                cpus.append(cpu_seconds() - start_cpu)
            case.update(cpu_s=round(statistics.median(cpus), 4), wall_s=round(statistics.median(walls), 4))
            results["cases"].append(case)
            print(json.dumps(case), flush=True)
    results["load_after"] = os.getloadavg()
    results["max_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    platform.destroy_distributed()
    return results


def markdown(results: dict) -> str:
    """The table of README.md: CPU (wall) seconds per mix and way, and each way against the local rows."""
    lines = [f"{results['cpu']}, torch {results['torch']} ({results['cpu_capability']}), {results['threads']} "
             f"threads; load {results['load_before'][0]:.1f} before, {results['load_after'][0]:.1f} after; median "
             f"of {results['repeats']} runs", "",
             "| mix | sequences | tokens | longest | way | CPU s | wall s | CPU s vs local_rows |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    base = {c["mix"]: c.get("cpu_s") for c in results["cases"] if c["way"] == "local_rows"}
    for c in results["cases"]:
        head = f"| {c['mix']} | {c['sequences']} | {c['tokens']} | {c['longest']} | {c['way']} |"
        if "error" in c:
            lines.append(f"{head} - | - | not available: {c['error']} |")
            continue
        ratio = f"{c['cpu_s'] / base[c['mix']]:.2f}x" if base.get(c["mix"]) else ""
        lines.append(f"{head} {c['cpu_s']:.3f} | {c['wall_s']:.3f} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    parser.add_argument("--mixes", nargs="+", default=list(MIXES), choices=sorted(MIXES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch's intra-op threads")
    parser.add_argument("--out", help="write the results JSON here")
    parser.add_argument("--markdown", metavar="RESULTS", help="print the table of a results JSON and exit")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return
    if not (MODEL / "config.json").is_file():
        sys.exit(f"error: no model at {MODEL}; fetch it once with python tools/fetch_smollm2.py")
    results = measure(args.ways, args.mixes, args.repeats, args.threads)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(results))


if __name__ == "__main__":
    main()
