"""The source tree cites nothing a reader cannot follow from a checkout.

No comment, docstring, test or help text refers to a file outside the repository (a spec,
notes or guides kept elsewhere) or to an issue number, and no Python file narrates the history
of its own writing: that belongs in commit messages. Markdown may name other projects' pull
requests (a credit, an upstream fix to watch); Python may not name any.

Every tracked text file is scanned (`git ls-files`) except binary files, the generated stubs in
shared/pb/ and this file, which has to spell the patterns out.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()
GENERATED = "shared/pb/"

# Anywhere: files that are not in the repository, and issue numbers.
EVERYWHERE: dict[str, re.Pattern[str]] = {
    "spec §": re.compile(r"\bspec\s*§", re.I),
    "spec section": re.compile(r"\bspec\s+section", re.I),
    "performance-notes": re.compile(r"performance-notes", re.I),
    "style.md": re.compile(r"\bstyle\.md", re.I),
    "peers.md": re.compile(r"\bpeers\.md", re.I),
    "data-plane.md": re.compile(r"\bdata-plane\.md", re.I),
    "background.md": re.compile(r"\bbackground\.md", re.I),
    "../shared": re.compile(r"\.\./shared"),
    "shared/design": re.compile(r"\bshared/design"),
    "shared/seed": re.compile(r"\bshared/seed"),
    "issue #": re.compile(r"\bissues?\s*#", re.I),
    "(issue ": re.compile(r"\(issues?\s", re.I),
}
# In Python only: pull request numbers, bare #N references, and history narration.
PYTHON_ONLY: dict[str, re.Pattern[str]] = {
    "PR #N": re.compile(r"\b(?:PR|PRs|pull request|pull)\s*#\d+", re.I),
    "#N": re.compile(r"(?<![\w&:{\\/#])#\d+\b"),
    "seed's lesson": re.compile(r"\bseed's lesson", re.I),
    "the seed": re.compile(r"\bthe seed\b", re.I),
    "session": re.compile(
        r"\b(?:this|that|last|previous|earlier|first|second|third|later|next)\s+session\b",
        re.I,
    ),
}


def tracked_text_files() -> dict[str, str]:
    """Path -> text of every tracked file that is text, except the generated stubs and this
    file."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True
    ).stdout.decode()
    files: dict[str, str] = {}
    for path in filter(None, listed.split("\0")):
        if path == SELF or path.startswith(GENERATED):
            continue
        full = ROOT / path
        if not full.is_file():  # deleted in the work tree, not yet in the index
            continue
        raw = full.read_bytes()
        if b"\0" in raw:
            continue
        try:
            files[path] = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
    return files


def offenders(files: dict[str, str], patterns: dict[str, re.Pattern[str]]) -> list[str]:
    found = []
    for path, text in sorted(files.items()):
        for number, line in enumerate(text.splitlines(), start=1):
            labels = [label for label, pattern in patterns.items() if pattern.search(line)]
            if labels:
                found.append(f"{path}:{number}: [{', '.join(labels)}] {line.strip()[:100]}")
    return found


def test_no_file_cites_files_outside_the_repository_or_issue_numbers() -> None:
    found = offenders(tracked_text_files(), EVERYWHERE)
    assert not found, f"{len(found)} line(s) cite what a checkout does not hold:\n" + "\n".join(
        found
    )


def test_python_names_no_pull_requests_and_narrates_no_history() -> None:
    python = {p: t for p, t in tracked_text_files().items() if p.endswith((".py", ".pyi"))}
    assert python, "no tracked Python files found: is this a git checkout?"
    found = offenders(python, PYTHON_ONLY)
    assert not found, f"{len(found)} line(s) in Python name a PR or narrate history:\n" + "\n".join(
        found
    )
