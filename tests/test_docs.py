"""The docs cannot rot silently: every cy-llm, sidecar and bench command in a fenced shell block of
README.md, CONTRIBUTING.md or docs/ names only flags its --help knows, and every relative link and
image points at a file that exists."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(bash|sh|shell)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def shell_commands(page: Path) -> list[list[str]]:
    """Each simple command of the page's shell blocks, as words: lines joined at a trailing
    backslash, comments dropped, split at &&, ||, ;, | and &, subshell parentheses removed."""
    commands = []
    for _, block in FENCE.findall(page.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            command: list[str] = []
            for word in words + [";"]:
                if word in ("&&", "||", ";", "|", "&") or word.endswith(";"):
                    if word.endswith(";") and word != ";":
                        command.append(word[:-1])
                    if command:
                        commands.append([w.strip("()") for w in command if w.strip("()")])
                    command = []
                else:
                    command.append(word)
    return commands


@cache
def help_text(program: tuple[str, ...]) -> str:
    reply = subprocess.run([*program, "--help"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert reply.returncode == 0, (program, reply.stderr[-2000:])
    return reply.stdout


def our_program(words: list[str], sidecar: Path) -> tuple[tuple[str, ...], list[str]] | None:
    """(the program and subcommands whose --help lists the flags, the words after them), for
    commands of this repository; None for others (curl, docker, cargo, ...)."""
    name = Path(words[0]).name
    if name == "cy-llm":
        program, rest = [str(Path(sys.executable).parent / "cy-llm")], words[1:]
        while rest and not rest[0].startswith("-") and re.search(rf"\{{[\w,-]*\b{rest[0]}\b", help_text(tuple(program))):
            program.append(rest.pop(0))  # a subcommand: its own --help lists its flags
        return tuple(program), rest
    if name == "cy-llm-sidecar":
        return (str(sidecar),), words[1:]
    if name.startswith("python") and len(words) > 1 and words[1].startswith(("bench/", "tests/container/")):
        return (sys.executable, words[1]), words[2:]
    return None


def test_the_pages_show_commands():
    assert sum(len(shell_commands(page)) for page in PAGES) > 15


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_flag_shown_exists(page, sidecar_binary):
    checked = 0
    for words in shell_commands(page):
        found = our_program(words, sidecar_binary)
        if found is None:
            continue
        program, rest = found
        known = help_text(program)
        for flag in (w.split("=", 1)[0] for w in rest if w.startswith("--")):
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", known), f"{page.name}: {' '.join(program)} has no {flag}"
        checked += 1
    if page.name in ("README.md", "CONTRIBUTING.md"):
        assert checked, f"{page.name} shows no command of ours"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_exists(page):
    for target in LINK.findall(page.read_text()):
        if "://" not in target:
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"
