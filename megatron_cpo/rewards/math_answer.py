"""Answer extraction and LaTeX normalisation for math graders.

Extraction takes the last ``\\boxed{...}`` or ``\\fbox{...}`` (braces may nest); without one it falls back to the
answer a solution announces ("the final answer is ...", "Answer: ...") and finally to the last number in the text.
Normalisation (``strip_string``) follows the Hendrycks MATH convention the seed describes, so that answers which
differ only in typesetting compare equal as strings before any numeric or symbolic check runs.
"""
from __future__ import annotations

import re

_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BRACE = re.compile(r"[{}]")
_SPACES_THEN_BRACE = re.compile(r"[ \t\n]*\{")
_SPACE_FORM = re.compile(r" [ \t]*([^\s$]+)")

_ANSWER_PHRASES = re.compile(r"\b(?:final answer|answer)\s*(?:is|:|=)", re.IGNORECASE)
_WHITESPACE = re.compile(r"\s*")
MAX_ANNOUNCED_CHARS = 1000  # an announced answer is one short line; longer text is not inspected further
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_UNIT_WORDS = (
    "units", "unit", "sq", "square", "cubic", "cm", "mm", "km", "m", "meters", "meter", "inches", "inch", "feet",
    "foot", "ft", "yards", "yard", "miles", "mile", "mph", "degrees", "degree", "seconds", "second", "minutes",
    "minute", "hours", "hour", "days", "day", "dollars", "dollar", "cents", "cent", "pounds", "pound", "kg", "g",
    "grams", "gram", "liters", "liter", "ml", "years", "year", "people", "students", "ways", "points", "times",
)
_TRAILING_UNITS = re.compile(
    r"^(?P<value>[-+]?[\d.,]*\d(?:\\%|%)?)\s*(?:\\(?:text|mbox|mathrm)\{\s*(?:" + "|".join(_UNIT_WORDS)
    + r")(?:\^\{?\d\}?)?\s*\}|(?:" + "|".join(_UNIT_WORDS) + r")(?:\^\{?\d\}?)?)(?:\s*\^\{?\d\}?)?$",
    re.IGNORECASE,
)
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")


def _braced_argument(text: str, start: int) -> tuple[str, int] | None:
    """Return the content of the brace group opening at ``text[start]`` and the index after it, or None."""
    if start >= len(text) or text[start] != "{":
        return None
    depth = 0
    for brace in _BRACE.finditer(text, start):
        depth += 1 if brace.group() == "{" else -1
        if depth == 0:
            return text[start + 1:brace.start()], brace.end()
    return None


def _closing_braces(text: str) -> dict[int, int]:
    """Index of the matching ``}`` for every ``{`` of ``text`` that is closed, in one pass over its braces."""
    closing, open_positions = {}, []
    for brace in _BRACE.finditer(text):
        if brace.group() == "{":
            open_positions.append(brace.start())
        elif open_positions:
            closing[open_positions.pop()] = brace.start()
    return closing


def last_boxed_at(text: str) -> tuple[str, int] | None:
    """(content, start index) of the last ``\\boxed{}``/``\\fbox{}`` (nested braces allowed; ``\\boxed 5`` too),
    else None.

    Linear in ``len(text)``: braces are matched in one pass, then the commands are visited from the last one back
    (an unclosed ``\\boxed{`` repeated thousands of times used to rescan the rest of the text for each of them).
    """
    closing: dict[int, int] | None = None
    for command in reversed(list(_BOX_COMMAND.finditer(text))):
        after = command.end()
        opening = _SPACES_THEN_BRACE.match(text, after)
        if opening is not None:
            if closing is None:
                closing = _closing_braces(text)
            brace = opening.end() - 1
            if brace in closing:
                return text[brace + 1:closing[brace]], command.start()
            continue
        bare = _SPACE_FORM.match(text, after)
        if bare is not None:
            return bare.group(1), command.start()
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{}``/``\\fbox{}`` (see ``last_boxed_at``), else None."""
    found = last_boxed_at(text)
    return found[0] if found is not None else None


def announced_answer(text: str) -> str | None:
    """The answer a solution states in words ("The final answer is $x$", "Answer: x"), else None.

    The phrase is found by a regex whose only repetition is followed by a literal, and what follows it (blank space,
    an optional colon, the rest of that line) is read with plain scans, so a failed match never backtracks over
    long runs of whitespace.
    """
    matches = list(_ANSWER_PHRASES.finditer(text))
    last = matches[-1] if matches else None
    if last is None:
        return None
    start = _WHITESPACE.match(text, last.end()).end()
    if text.startswith(":", start):
        start = _WHITESPACE.match(text, start + 1).end()
    line_end = text.find("\n", start)
    candidate = text[start:line_end if line_end >= 0 else len(text)][:MAX_ANNOUNCED_CHARS].strip()
    if not candidate:
        return None
    dollar_span = re.match(r"^\$+(.+?)\$+", candidate)
    if dollar_span:
        candidate = dollar_span.group(1)
    else:
        candidate = candidate.split("\n")[0]
        candidate = re.sub(r"(?<=\d)\.(?!\d).*$", "", candidate)
    candidate = candidate.strip().rstrip(".").strip()
    return candidate or None


def extract_answer(text: str) -> str | None:
    """The final answer of a solution: last boxed, else the announced answer, else the last number."""
    if not isinstance(text, str) or not text.strip():
        return None
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    announced = announced_answer(text)
    if announced is not None:
        return announced
    numbers = _NUMBER.findall(text)
    return numbers[-1].rstrip(",") if numbers else None


def _fix_fracs(text: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}`` and ``\\frac1{2}`` -> ``\\frac{1}{2}``."""
    parts = text.split("\\frac")
    rebuilt = parts[0]
    for part in parts[1:]:
        rebuilt += "\\frac"
        if part.startswith("{"):
            group = _braced_argument(part, 0)
            if group is None:
                rebuilt += part
                continue
            numerator, end = group
            rest = part[end:]
            if rest.startswith("{") or not rest:
                rebuilt += part
            else:
                rebuilt += "{" + numerator + "}{" + rest[0] + "}" + rest[1:]
        elif len(part) >= 2 and not part[1] == "{":
            rebuilt += "{" + part[0] + "}{" + part[1] + "}" + part[2:]
        elif len(part) >= 2:
            rebuilt += "{" + part[0] + "}" + part[1:]
        else:
            rebuilt += part
    return rebuilt


def _fix_sqrt(text: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}``."""
    return re.sub(r"\\sqrt(?![{\[])\s*([A-Za-z0-9])", r"\\sqrt{\1}", text)


def _slash_to_frac(text: str) -> str:
    """``a/b`` of two integers -> ``\\frac{a}{b}``."""
    match = re.fullmatch(r"(-?\d+)/(\d+)", text)
    if match:
        return "\\frac{" + match.group(1) + "}{" + match.group(2) + "}"
    return text


def _unwrap_text(text: str) -> str:
    """``\\text{abc}`` / ``\\mbox{abc}`` / ``\\mathrm{abc}`` -> ``abc``."""
    return re.sub(r"\\(?:text|mbox|mathrm|textbf|mathbf)\{([^{}]*)\}", r"\1", text)


def strip_string(answer: str) -> str:
    """Normalise a LaTeX answer so that typesetting variants of one value compare equal as strings."""
    text = str(answer).strip()
    text = text.replace("\n", "").replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("\\ ", " ")
    text = text.replace("\\\\", "\\")
    text = text.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac")
    text = text.replace("\\left", "").replace("\\right", "")
    text = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|°", "", text)
    text = text.replace("\\$", "").replace("$", "")
    units = _TRAILING_UNITS.match(text.strip())
    if units:
        text = units.group("value")
    text = text.replace("\\%", "").replace("%", "")
    text = _unwrap_text(text)
    text = text.strip()
    if _THOUSANDS.match(text):
        text = text.replace(",", "")
    text = re.sub(r"(^|[\s{(\[,=+\-])\.(\d)", r"\g<1>0.\2", text)
    variable, equals, value = text.partition("=")
    if equals and value and "=" not in value and re.fullmatch(r"[A-Za-z]\s*", variable):
        text = value
    text = _fix_sqrt(text)
    text = text.replace(" ", "")
    text = _fix_fracs(text)
    if text == "0.5":
        text = "\\frac{1}{2}"
    text = _slash_to_frac(text)
    text = text.rstrip(".")
    return text
