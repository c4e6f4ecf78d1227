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


QUOTE = re.compile(r"<!-- quoted from (\S+) -->\n(.*?)<!-- end of quote -->", re.S)
CHECKED_ROWS = re.compile(r"<!-- numbers from the linked page -->\n((?:\|.*\n)+)")
NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?%?")
LINK = re.compile(r"\[[^\]]*\]\(([^)#]+)(?:#[^)]*)?\)")


def quoted_lines_missing_from_their_source(text: str, page: Path) -> list[str]:
    """Lines of `text`'s quote blocks that their source does not hold as they are ("..." marks a cut)."""
    missing = []
    for source, block in QUOTE.findall(text):
        lines = set((page.parent / source).read_text().splitlines())
        missing += [f"{source}: {line}" for line in block.splitlines() if line not in ("", "...") and line not in lines]
    return missing


def numbers_missing_from_the_linked_page(text: str, page: Path) -> list[str]:
    """Numbers of the checked table rows in `text` that the page each row links to does not contain."""
    missing = []
    for table in CHECKED_ROWS.findall(text):
        for row in table.splitlines()[2:]:  # below the header and its separator
            targets = LINK.findall(row)
            assert len(targets) == 1, f"{page.name}: a checked row links to one page: {row}"
            source = (page.parent / targets[0]).read_text()
            found = set(NUMBER.findall(source))
            missing += [f"{targets[0]}: {n} ({row})" for n in NUMBER.findall(LINK.sub("", row)) if n not in found]
    return missing


def test_numbers_the_readme_quotes_agree_with_their_source():
    """The README's quoted run output and timings are lines of docs/status.md as they are, and every number of its
    results table is in the page its row links to: a number changed on one side only fails here."""
    readme = ROOT / "README.md"
    text = readme.read_text()
    assert len(QUOTE.findall(text)) >= 3 and CHECKED_ROWS.search(text), "the README's quoted blocks have their markers"
    assert not quoted_lines_missing_from_their_source(text, readme)
    assert not numbers_missing_from_the_linked_page(text, readme)


def test_a_changed_number_is_caught():
    readme = ROOT / "README.md"
    text = readme.read_text()
    quoted = QUOTE.search(text).group(2).splitlines()
    line = next(line for line in quoted if re.search(r"\d", line))
    changed = text.replace(line, re.sub(r"\d", lambda digit: str((int(digit.group()) + 1) % 10), line, count=1), 1)
    assert quoted_lines_missing_from_their_source(changed, readme)
    row = CHECKED_ROWS.search(text).group(1).splitlines()[2]
    cell = row.split("|")[2]
    assert numbers_missing_from_the_linked_page(text.replace(cell, cell.replace("%", "1%", 1), 1), readme)


DURATION = re.compile(r"(?:(\d+) min )?(\d+) s\b")


def seconds(text: str) -> list[int]:
    return [int(minutes or 0) * 60 + int(secs) for minutes, secs in DURATION.findall(text)]


def timing_rows() -> list[list[str]]:
    status = (ROOT / "docs" / "status.md").read_text()
    block = status.split("<!-- timings:start -->", 1)[1].split("<!-- timings:end -->", 1)[0]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in block.strip().splitlines()[2:]]


def test_each_timing_row_adds_up():
    """Environment setup plus the job's parts is the total, in every row of docs/status.md's timing table."""
    rows = [cells for cells in timing_rows() if seconds(cells[2])]
    assert len(rows) >= 5
    for command, cpu, setup, job, total in rows:
        assert seconds(setup)[0] + sum(seconds(job)) == seconds(total)[0], f"{command} on {cpu}"


def test_the_quickstart_timings_agree_with_the_recorded_run():
    """docs/status.md's timing row of its recorded quickstart run says what the run printed on its last line."""
    status = (ROOT / "docs" / "status.md").read_text()
    done = re.search(r"quickstart done: environment (\d+) s, training (\d+) s, conversion and answer (\d+) s, "
                     r"total (\d+) s", status)
    assert done, "docs/status.md holds the recorded quickstart run's last line"
    printed = [int(value) for value in done.groups()]
    row = next(cells for cells in timing_rows() if "quickstart.sh" in cells[0] and "AMD EPYC" in cells[1])
    assert [seconds(row[2])[0], *seconds(row[3]), seconds(row[4])[0]] == printed, row
