"""The commit rule of CONTRIBUTING.md as ``make hooks`` installs it: a real git repository
whose commit-msg hook is ``scripts/hooks/commit-msg``, real commits accepted or refused,
and ``scripts/commit_rule.py`` over a range of them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RULE = ROOT / "scripts" / "commit_rule.py"
BODY = "Why: the numbers went from 3 to 2.\n"


def git(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.org",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.org"}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=check,
                          capture_output=True, text=True)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    git(tmp_path, "init", "-q")
    # What `make hooks` sets, pointing at this checkout's hook.
    git(tmp_path, "config", "core.hooksPath", str(ROOT / "scripts" / "hooks"))
    return tmp_path


def commit(repo: Path, message: str, *extra: str) -> subprocess.CompletedProcess[str]:
    (repo / "f").write_text(message)  # every commit changes the file
    git(repo, "add", "f")
    return git(repo, "commit", "-q", "--cleanup=strip", "-m", message, *extra, check=False)


def commits(repo: Path) -> int:
    out = git(repo, "rev-list", "--all", "--count", check=False).stdout.strip()
    return int(out or 0)


def test_the_hook_accepts_a_72_character_subject_with_a_body(repo: Path) -> None:
    subject = "Keep " + "x" * 67  # 5 + 67 = 72 characters
    assert commit(repo, f"{subject}\n\n{BODY}").returncode == 0
    assert commits(repo) == 1


@pytest.mark.parametrize(("message", "says"), [
    ("Keep " + "x" * 68 + "\n\n" + BODY, "the subject has 73 characters (at most 72)"),
    ("Keep the subject short\n", "there is no body"),
    ("Keep the subject short\n\n# only a comment, dropped by git\n", "there is no body"),
    ("Keep the subject short\nand a second line glued to it\n", "the second line is not blank"),
])
def test_the_hook_refuses_a_message_that_breaks_the_rule(repo: Path, message: str,
                                                          says: str) -> None:
    done = commit(repo, message)
    assert done.returncode != 0
    assert says in done.stderr
    assert commits(repo) == 0


def test_a_range_check_names_each_commit_that_breaks_the_rule(repo: Path) -> None:
    assert commit(repo, f"Add the first file\n\n{BODY}").returncode == 0
    base = git(repo, "rev-parse", "HEAD").stdout.strip()
    assert commit(repo, f"Change it with a reason\n\n{BODY}").returncode == 0
    assert commit(repo, "Change it without one\n", "--no-verify").returncode == 0
    bad = git(repo, "rev-parse", "--short", "HEAD").stdout.strip()
    done = subprocess.run([sys.executable, str(RULE), f"{base}..HEAD"], cwd=repo,
                          capture_output=True, text=True)
    assert done.returncode == 1
    assert "2 commits checked, 1 problems" in done.stdout
    assert done.stderr.startswith(f"{bad} 'Change it without one': there is no body")


def test_a_range_git_cannot_read_is_a_clear_error(repo: Path) -> None:
    done = subprocess.run([sys.executable, str(RULE), "nosuch..HEAD"], cwd=repo,
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.startswith("git log nosuch..HEAD:")
