"""LaTeX text from untrusted strings: every character TeX gives a meaning is escaped, so a record's
field (a variant named `\\input{/etc/passwd}`, a task with `$` or `#`) is printed, never run."""

from __future__ import annotations

# Each special character and the text that prints it: one pass over the string, so an escape's own
# backslash or braces are never escaped again.
LATEX_SPECIALS = {
    "\\": r"\textbackslash{}",
    "{": r"\{",
    "}": r"\}",
    "$": r"\$",
    "&": r"\&",
    "#": r"\#",
    "^": r"\textasciicircum{}",
    "_": r"\_",
    "~": r"\textasciitilde{}",
    "%": r"\%",
    "<": r"\textless{}",
    ">": r"\textgreater{}",
    "|": r"\textbar{}",
}


def latex_escape(text: object) -> str:
    """`text` (made a string) with every LaTeX special character escaped; line breaks become spaces
    (a table cell or caption is one line)."""
    flat = " ".join(str(text).splitlines())
    return "".join(LATEX_SPECIALS.get(char, char) for char in flat)
