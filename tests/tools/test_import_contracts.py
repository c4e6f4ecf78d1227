"""The import contracts of `.importlinter` hold: the layers of the package and no import cycle inside any package,
function-local imports included (import-linter's `lint-imports`, run here in-process from the repository root)."""
import logging
from pathlib import Path

from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_hold(monkeypatch, capsys):
    """A broken contract fails with import-linter's report: the contract, and each import that breaks it."""
    monkeypatch.chdir(ROOT)
    for logger in list(logging.Logger.manager.loggerDict.values()):  # lint-imports' dictConfig disables them all
        if isinstance(logger, logging.Logger):
            monkeypatch.setattr(logger, "disabled", logger.disabled)
    status = lint_imports(config_filename=str(ROOT / ".importlinter"), no_cache=True, no_logo=True)
    report = capsys.readouterr()
    assert status == 0, report.out + report.err
    assert "0 broken" in report.out, report.out
