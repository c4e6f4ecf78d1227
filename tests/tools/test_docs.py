"""The generated config reference is up to date, and the docs, the READMEs and the code's comments point only to files
that exist."""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from gen_config_reference import PAGE, render  # noqa: E402

from megatron_cpo.config import Config, known_names  # noqa: E402


def test_config_reference_is_generated_from_the_current_config():
    assert PAGE.read_text() == render(), "run python tools/gen_config_reference.py"
    for name in known_names(Config):
        assert f"`{name}`" in PAGE.read_text()


PAGES = [*(ROOT / "docs").glob("*.md"), ROOT / "README.md", ROOT / "DEVELOPERS.md"]
SOURCES = [*(ROOT / "megatron_cpo").rglob("*.py"), *(ROOT / "tools").glob("*.py"), *(ROOT / "benchmarks").rglob("*.py"),
           *(ROOT / "benchmarks").rglob("*.md")]
PACKAGES = ("algorithms", "data", "kernels", "models", "rewards", "rollout", "trainer")
ROOTED = re.compile(r"(?<![\w/.-])((?:docs|benchmarks|examples|tools|megatron_cpo|tests|scripts)/[\w./-]*\w"
                    r"\.(?:py|md|sh|yaml|sbatch))")
IN_PACKAGE = re.compile(rf"(?<![\w/.-])((?:{'|'.join(PACKAGES)})/\w+\.py)")  # e.g. `rollout/modes.py`
MARKDOWN = re.compile(r"(?<![\w/.-])([A-Za-z_]+\.md)\b")  # e.g. DEVELOPERS.md, cpo.md
WRITTEN_BY_A_RUN = {"results.md"}  # the GPU check's report, written where it runs


def test_docs_links_resolve():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith("http"):
                assert (page.parent / target).exists(), f"{page.name} links to missing {target}"
        mentioned = re.findall(r"`((?:examples|tools|megatron_cpo)/[\w./-]+\.(?:py|sh|yaml|sbatch))`", page.read_text())
        for path in mentioned:
            assert (ROOT / path).exists(), f"{page.name} mentions missing {path}"


def test_files_named_in_code_and_docs_exist():
    """A file a docstring, comment or page names (`docs/cpo.md`, `trainer/loop.py`, `DEVELOPERS.md`) exists: from the
    repository root, the package, or the naming file's folder."""
    missing = []
    for source in SOURCES + PAGES:
        text = source.read_text()
        places = (ROOT, ROOT / "megatron_cpo", ROOT / "docs", source.parent)
        for name in {*ROOTED.findall(text), *IN_PACKAGE.findall(text), *MARKDOWN.findall(text)} - WRITTEN_BY_A_RUN:
            if not any((place / name).exists() for place in places):
                missing.append(f"{source.relative_to(ROOT)}: {name}")
    assert not missing, missing
