"""The commit rule of CONTRIBUTING.md, checked: a subject of at most 72 characters, a blank
line, then a body.

    python3 scripts/commit_rule.py --message .git/COMMIT_EDITMSG   # one message (the hook)
    python3 scripts/commit_rule.py main..HEAD                       # a branch before it lands

``make hooks`` makes ``scripts/hooks/commit-msg`` the clone's commit-msg hook, so a commit
that breaks the rule is refused with the reason and the message kept in
``.git/COMMIT_EDITMSG`` for ``git commit -e -F .git/COMMIT_EDITMSG``.

A message is read as git stores it after its default clean-up: lines starting with ``#``
dropped, trailing blank lines ignored. Merge commits are held to the same rule (git's
"Merge branch 'x'" alone says nothing about why). Whether the subject is in the imperative
is left to the reviewer.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

MAX_SUBJECT = 72


def problems(message: str) -> list[str]:
    """What ``message`` breaks of the rule; empty when it keeps it."""
    lines = [line.rstrip() for line in message.splitlines() if not line.startswith("#")]
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    if not lines:
        return ["the message is empty"]
    found = []
    subject = lines[0]
    if len(subject) > MAX_SUBJECT:
        found.append(f"the subject has {len(subject)} characters (at most {MAX_SUBJECT})")
    if len(lines) == 1:  # (blank lines at both ends are gone: a body is a non-blank line)
        found.append("there is no body: say why, and the numbers (CONTRIBUTING.md)")
    elif lines[1]:
        found.append("the second line is not blank: the subject is one line, then a blank line")
    return found


def _range_messages(revisions: str) -> list[tuple[str, str]]:
    out = subprocess.run(["git", "log", "--format=%h%x00%B%x01", revisions],
                         check=True, capture_output=True, text=True).stdout
    commits = []
    for record in out.split("\x01"):
        record = record.lstrip("\n")
        if record:
            sha, _, message = record.partition("\x00")
            commits.append((sha, message))
    return commits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--message", metavar="FILE", help="check one commit message file")
    group.add_argument("revisions", nargs="?", help="check every commit of a git range")
    opts = parser.parse_args(argv)
    if opts.message:
        found = problems(Path(opts.message).read_text(encoding="utf-8"))
        for problem in found:
            print(f"commit message: {problem}", file=sys.stderr)
        return 1 if found else 0
    try:
        commits = _range_messages(opts.revisions)
    except subprocess.CalledProcessError as err:
        print(f"git log {opts.revisions}: {err.stderr.strip()}", file=sys.stderr)
        return 2
    bad = 0
    for sha, message in commits:
        for problem in problems(message):
            print(f"{sha} {message.splitlines()[0][:60]!r}: {problem}", file=sys.stderr)
            bad += 1
    print(f"{len(commits)} commits checked, {bad} problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
