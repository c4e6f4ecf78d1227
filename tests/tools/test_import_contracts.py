"""The import contracts of `.importlinter` hold: the layers of the package and no import cycle inside any package,
function-local imports included (`lint-imports`, import-linter's checker, from the repository root)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def test_import_contracts_hold():
    """A broken contract fails with import-linter's report: the contract, and each import that breaks it."""
    done = subprocess.run([sys.executable, "-c", LINT_IMPORTS, "--no-cache", "--no-logo"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout, done.stdout
