"""Convert a GGUF file (llama.cpp's format, e.g. Q4_1-quantized) of a supported family into a Hugging Face model
directory the trainer, the converters and vLLM load: config, de-quantized safetensors weights, tokenizer, README.

    python tools/gguf_to_hf.py --gguf FILE --out DIR [--dtype float32|bfloat16|float16] [--force]

Needs the `gguf` and `accelerate` packages (`pip install 'megatron-cpo[real-model]'`).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_cpo.models.gguf import DTYPES, ONE_LINE_ERRORS, gguf_to_hf  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--gguf", required=True, help="the .gguf file")
    parser.add_argument("--out", required=True, help="the HF model directory to write")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                        help="dtype of the saved weights (float32 keeps the de-quantized values exactly)")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    args = parser.parse_args(argv)
    try:
        out = gguf_to_hf(args.gguf, args.out, dtype=args.dtype, force=args.force)
    except ONE_LINE_ERRORS as error:
        sys.exit(f"error: {error}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
