"""The wheel folder of an air-gapped GPU machine: install what travels with the code, offline, and say what is missing.

The GPU machine has torch, Triton and transformers but not megatron-core (needed by the actor part) or a peer kernel
package (liger-kernel, optional). Their wheels are fetched on a connected machine into a git-ignored folder beside the
code (`.whl/`, docs/gpu_check.md says how) and installed here with
`pip install --no-index --no-deps --target <folder>/site <wheels>`: nothing is downloaded, the machine's own packages
(torch above all) are never touched, and the check puts `<folder>/site` on `PYTHONPATH`. A wheel already installed
there (same file name) is not installed again.
"""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

# module to import -> (distribution name for `pip download`, what needs it, required)
PACKAGES = {
    "megatron.core": ("megatron-core==0.16.1", "the Megatron actor part", True),
    "liger_kernel": ("liger-kernel", "the peer fused linear cross entropy in the kernel grid", False),
    "numpy": ("numpy", "megatron-core", True),
    "packaging": ("packaging", "megatron-core", True),
    "yaml": ("pyyaml", "megatron_cpo.config", True),
    "safetensors": ("safetensors", "the actor's random HF checkpoint", True),
    "transformers": ("transformers", "the actor's HF config and checkpoint", True),
    # the actor and offload parts import the trainer's update, which imports the reward code (math grading); the
    # first GPU run (2026-11-27, H200) stopped both parts with "No module named 'math_verify'"
    "math_verify": ("math-verify==0.9.0", "megatron_cpo.rewards (the actor and offload parts)", True),
    "latex2sympy2_extended": ("latex2sympy2_extended==1.11.0", "math-verify", True),
    "antlr4": ("antlr4-python3-runtime==4.13.2", "latex2sympy2_extended", True),
}


@dataclass
class WheelPlan:
    """What to install from the folder and what stays missing after it."""

    wheel_dir: Path
    to_install: list[Path] = field(default_factory=list)
    already_installed: list[Path] = field(default_factory=list)

    @property
    def site(self) -> Path:
        return self.wheel_dir / "site"

    @property
    def marker_dir(self) -> Path:
        return self.site / ".installed_wheels"


def plan(wheel_dir: str | Path) -> WheelPlan:
    """The wheels in `wheel_dir` that are not yet installed into `wheel_dir/site`."""
    result = WheelPlan(Path(wheel_dir))
    if not result.wheel_dir.is_dir():
        return result
    for wheel in sorted(result.wheel_dir.glob("*.whl")):
        done = (result.marker_dir / wheel.name).exists()
        (result.already_installed if done else result.to_install).append(wheel)
    return result


def pip_command(wheel_plan: WheelPlan, python: str = sys.executable) -> list[str]:
    """The offline pip command that installs the planned wheels into the folder's `site` directory."""
    return [python, "-m", "pip", "install", "--no-index", "--no-deps", "--disable-pip-version-check",
            "--find-links", str(wheel_plan.wheel_dir), "--target", str(wheel_plan.site), "--upgrade",
            *map(str, wheel_plan.to_install)]


def install(wheel_plan: WheelPlan, python: str = sys.executable) -> None:
    """Run the offline install and mark each wheel installed; raises with pip's last line on failure."""
    if not wheel_plan.to_install:
        return
    proc = subprocess.run(pip_command(wheel_plan, python), capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"offline install from {wheel_plan.wheel_dir} failed: {last[0]}")
    wheel_plan.marker_dir.mkdir(parents=True, exist_ok=True)
    for wheel in wheel_plan.to_install:
        (wheel_plan.marker_dir / wheel.name).touch()


def missing_modules(extra_paths: list[str] = ()) -> dict[str, tuple[str, str, bool]]:
    """PACKAGES entries whose module cannot be found (with `extra_paths` searched first)."""
    sys.path[:0] = [p for p in extra_paths if p not in sys.path]
    missing = {}
    for module, info in PACKAGES.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # parent package missing
            found = False
        if not found:
            missing[module] = info
    return missing


def fetch_hint(distributions: list[str], wheel_dir: str = ".whl") -> str:
    """The command to run on a connected machine to fetch these wheels for the GPU machine's Python 3.12."""
    return (f"pip download {' '.join(distributions)} --python-version 3.12 --platform manylinux_2_28_x86_64 "
            f"--only-binary=:all: --no-deps -d {wheel_dir}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel-dir", default=".whl")
    parser.add_argument("--dry-run", action="store_true", help="print the pip command, install nothing")
    args = parser.parse_args(argv)
    wheel_plan = plan(args.wheel_dir)
    if not wheel_plan.wheel_dir.is_dir():
        print(f"wheels: no folder {wheel_plan.wheel_dir}; using the packages already installed")
    elif wheel_plan.to_install:
        print(f"wheels: installing {len(wheel_plan.to_install)} wheel(s) offline into {wheel_plan.site}: "
              f"{', '.join(w.name for w in wheel_plan.to_install)}")
        if args.dry_run:
            print(" ".join(pip_command(wheel_plan)))
        else:
            try:
                install(wheel_plan)
            except RuntimeError as error:
                print(f"wheels: {error}", file=sys.stderr)
                return 1
    else:
        print(f"wheels: {len(wheel_plan.already_installed)} wheel(s) in {wheel_plan.wheel_dir} already installed")
    missing = missing_modules([str(wheel_plan.site)] if wheel_plan.site.is_dir() else [])
    for module, (distribution, needed_by, required) in missing.items():
        kind = "missing" if required else "optional, missing"
        print(f"wheels: {module} ({kind}, needed by {needed_by}); fetch with: {fetch_hint([distribution])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
