"""The generated config reference is up to date, and the docs pages link only to files that exist."""
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


def test_docs_links_resolve():
    for page in (ROOT / "docs").glob("*.md"):
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith("http"):
                assert (page.parent / target).exists(), f"{page.name} links to missing {target}"
        for path in re.findall(r"`((?:examples|tools|megatron_cpo)/[\w./-]+\.(?:py|sh|yaml|sbatch))`", page.read_text()):
            assert (ROOT / path).exists(), f"{page.name} mentions missing {path}"
