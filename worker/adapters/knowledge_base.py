"""A local knowledge base: text and markdown files split into passages, in SQLite FTS5, ranked by BM25.

An index is one SQLite file, written beside its final name and renamed into place, so a reader
never sees half of one; readers notice a rebuilt file and reopen it on their next search.
"""

from __future__ import annotations

import os
import re
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

SUFFIXES = {".txt", ".md", ".markdown", ".rst"}
MAX_PASSAGE_CHARS = 1200
WORD = re.compile(r"\w+", re.UNICODE)


class KnowledgeBaseError(Exception):
    pass


@dataclass(frozen=True)
class Passage:
    source: str
    text: str
    score: float


def split_passages(text: str) -> list[str]:
    """Paragraphs (blank-line separated), merged while short and cut where over the limit."""
    passages, current = [], ""
    for paragraph in (p.strip() for p in re.split(r"\n\s*\n", text)):
        if not paragraph:
            continue
        if current and len(current) + len(paragraph) + 2 > MAX_PASSAGE_CHARS:
            passages.append(current)
            current = ""
        current = f"{current}\n\n{paragraph}" if current else paragraph
        while len(current) > MAX_PASSAGE_CHARS:
            cut = current.rfind(" ", 0, MAX_PASSAGE_CHARS)
            cut = cut if cut > 0 else MAX_PASSAGE_CHARS
            passages.append(current[:cut].strip())
            current = current[cut:].strip()
    if current:
        passages.append(current)
    return passages


def build_index(folder: Path, target: Path, progress: Callable[[int, int, int], None] | None = None) -> int:
    """Indexes every text file under `folder` into `target`; returns the number of passages.
    `progress(files_done, files_total, passages)` is called after each file."""
    if not folder.is_dir():
        raise KnowledgeBaseError(f"{folder} is not a directory")
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES)
    if not files:
        raise KnowledgeBaseError(f"{folder} holds no {', '.join(sorted(SUFFIXES))} files")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    partial.unlink(missing_ok=True)
    count = 0
    with sqlite3.connect(partial) as db:
        db.execute("CREATE VIRTUAL TABLE passages USING fts5(source UNINDEXED, text, tokenize='porter unicode61')")
        for done, path in enumerate(files, 1):
            text = path.read_text(encoding="utf-8", errors="replace")
            rows = [(str(path.relative_to(folder)), passage) for passage in split_passages(text)]
            db.executemany("INSERT INTO passages (source, text) VALUES (?, ?)", rows)
            count += len(rows)
            if progress:
                progress(done, len(files), count)
    os.replace(partial, target)
    return count


class KnowledgeBase:
    """Searches one index file, reopening it when it was rebuilt."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._identity: tuple[int, int] | None = None

    def search(self, query: str, k: int) -> list[Passage]:
        words = [w for w in WORD.findall(query.lower()) if len(w) > 1]
        # Each word quoted (FTS5 syntax characters in a prompt must not be read as operators).
        match = " OR ".join('"' + w.replace('"', '""') + '"' for w in dict.fromkeys(words))
        with self._lock:
            db = self._connection()
            if not words:
                return []
            rows = db.execute("SELECT source, text, bm25(passages) FROM passages WHERE passages MATCH ? "
                              "ORDER BY bm25(passages) LIMIT ?", (match, k)).fetchall()
        return [Passage(source, text, -score) for source, text, score in rows]

    def _connection(self) -> sqlite3.Connection:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            raise KnowledgeBaseError(f"knowledge base {self.path} does not exist; build it with "
                                     f"`cy-llm kb index DIR --name {self.path.stem}`") from None
        identity = (stat.st_ino, stat.st_mtime_ns)
        if self._db is None or identity != self._identity:
            if self._db is not None:
                self._db.close()
            self._db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=False)
            self._identity = identity
        return self._db

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
