#!/usr/bin/env python3
"""Fails on a relative link in the repository's Markdown that points nowhere: a
missing file, or a `#anchor` that no heading of the target Markdown file makes.

Links are `[text](target)` and `[text]: target` outside code (fenced blocks,
indented blocks and `code spans` are skipped). Targets with a scheme (`https:`,
`mailto:` …) are not checked. Anchors are made from headings as GitHub makes them:
lower case, punctuation other than `-` and `_` dropped, spaces turned into `-`, and
`-1`, `-2` … appended to repeats.
"""

import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFDEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text):
    """(line number, line) outside fenced and indented code blocks, code spans blanked."""
    fence = None
    prev_blank = True
    in_indented = False
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
            continue
        if m:
            fence = m.group(1)
            continue
        blank = not line.strip()
        if (line.startswith("    ") or line.startswith("\t")) and (prev_blank or in_indented):
            in_indented = True
            prev_blank = blank
            continue
        if not blank:
            in_indented = False
        prev_blank = blank
        yield n, re.sub(r"(`+)(?:(?!\1).)+?\1", "``", line)


def slug(heading):
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path, cache={}):
    if path not in cache:
        found = set()
        counts = {}
        text = path.read_text(encoding="utf-8")
        raw = text.splitlines()
        # A heading's code spans are part of its anchor (blanked only for links).
        for n, _ in prose_lines(text):
            m = HEADING.match(raw[n - 1])
            if not m:
                continue
            s = slug(m.group(2))
            k = counts.get(s, 0)
            counts[s] = k + 1
            found.add(s if k == 0 else f"{s}-{k}")
        # Explicit HTML anchors.
        found.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", path.read_text(encoding="utf-8")))
        cache[path] = found
    return cache[path]


SKIP_DIRS = {"target", "node_modules"}


def markdown_files():
    try:
        out = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "*.md"],
            cwd=ROOT, check=True, capture_output=True, text=True,
        ).stdout.split("\n")
        return [ROOT / p for p in out if p and (ROOT / p).is_file()]
    except (OSError, subprocess.CalledProcessError):
        # Not a git checkout (an unpacked archive): every Markdown file outside build
        # output and hidden folders.
        return sorted(
            p for p in ROOT.rglob("*.md")
            if not any(part in SKIP_DIRS or part.startswith(".")
                       for part in p.relative_to(ROOT).parts[:-1])
        )


def check(md):
    problems = []
    for n, line in prose_lines(md.read_text(encoding="utf-8")):
        targets = [m.group(1) for m in INLINE.finditer(line)]
        m = REFDEF.match(line)
        if m:
            targets.append(m.group(1))
        for t in targets:
            if SCHEME.match(t) or t.startswith("//"):
                continue
            file_part, _, anchor = t.partition("#")
            file_part = unquote(file_part)
            if file_part.startswith("/"):
                target = ROOT / file_part.lstrip("/")
            elif file_part:
                target = (md.parent / file_part).resolve()
            else:
                target = md
            where = f"{md.relative_to(ROOT)}:{n}"
            if not target.exists():
                problems.append(f"{where}: link to a missing file: {t}")
                continue
            if anchor and target.is_file() and target.suffix == ".md":
                if unquote(anchor).lower() not in anchors(target):
                    problems.append(f"{where}: no heading makes the anchor #{anchor} in "
                                    f"{target.relative_to(ROOT)}: {t}")
    return problems


def main():
    files = markdown_files()
    problems = [p for md in files for p in check(md)]
    for p in problems:
        print(f"check-docs: {p}", file=sys.stderr)
    if problems:
        return 1
    print(f"check-docs: {len(files)} Markdown files, every relative link resolves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
