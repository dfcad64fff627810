"""Entries in SQLite (the source of truth, embeddings included) and an HNSW index (hnswlib) beside
it, saved to `<path>.hnsw`. The index is rebuilt from SQLite whenever its file is missing, stale or
unreadable, so a crash between the two writes never serves a wrong entry: every candidate the index
returns is checked against its row."""
from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time

import numpy as np

from kvserve.semantic_cache.base import Row, Store, entry_bytes

logger = logging.getLogger("kvserve.semantic_cache")

_SCHEMA = """CREATE TABLE IF NOT EXISTS entries (
    id INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL, tenant TEXT NOT NULL, query TEXT NOT NULL,
    response TEXT NOT NULL, embedding BLOB NOT NULL, created REAL NOT NULL, expires REAL NOT NULL,
    last_used REAL NOT NULL, seconds REAL NOT NULL, nbytes INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS entries_key ON entries(key);
CREATE INDEX IF NOT EXISTS entries_tenant ON entries(tenant);"""


class SQLiteStore(Store):
    """path None: in memory (nothing survives the process)."""

    def __init__(self, path: str | None, dim: int):
        import hnswlib
        self._hnswlib, self.dim, self.path = hnswlib, dim, path
        self.lock = threading.RLock()
        self.db = self._open(path)
        self.index = self._load_index()

    def _open(self, path: str | None) -> sqlite3.Connection:
        target = path or ":memory:"
        try:
            db = sqlite3.connect(target, check_same_thread=False)
            db.executescript(_SCHEMA)
            db.execute("SELECT count(*) FROM entries").fetchone()
            return db
        except sqlite3.DatabaseError as e:
            moved = f"{path}.corrupt-{int(time.time())}"
            logger.warning("semantic cache store %s is unreadable (%s): moved to %s, starting empty", path, e, moved)
            os.replace(path, moved)
            db = sqlite3.connect(target, check_same_thread=False)
            db.executescript(_SCHEMA)
            return db

    def _new_index(self, capacity: int):
        index = self._hnswlib.Index(space="ip", dim=self.dim)
        index.init_index(max_elements=max(capacity, 1024), ef_construction=100, M=16, allow_replace_deleted=True)
        index.set_ef(64)
        return index

    def _load_index(self):
        ids = [r[0] for r in self.db.execute("SELECT id FROM entries")]
        file = f"{self.path}.hnsw" if self.path else None
        if file and os.path.exists(file):
            try:
                index = self._hnswlib.Index(space="ip", dim=self.dim)
                index.load_index(file, max_elements=max(len(ids) * 2, 1024), allow_replace_deleted=True)
                index.set_ef(64)
                # deleted labels may linger in the file; the lookup filters on live rows anyway
                if set(ids) <= set(index.get_ids_list()):
                    return index
                logger.warning("semantic cache index %s does not match its store: rebuilding it", file)
            except Exception as e:  # a truncated or foreign file: the rows are the truth
                logger.warning("semantic cache index %s is unreadable (%s): rebuilding it", file, e)
        index = self._new_index(len(ids) * 2)
        rows = self.db.execute("SELECT id, embedding FROM entries").fetchall()
        if rows:
            index.add_items(np.stack([np.frombuffer(e, np.float32) for _, e in rows]), [i for i, _ in rows])
        return index

    def add(self, key: str, tenant: str, query: str, response: str, embedding: np.ndarray, ttl: float,
            seconds: float) -> int:
        now = time.time()
        vec = np.asarray(embedding, np.float32).reshape(-1)
        nbytes = entry_bytes(query, response, vec)
        with self.lock:
            cur = self.db.execute(
                "INSERT INTO entries (key, tenant, query, response, embedding, created, expires, last_used, seconds, "
                "nbytes) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (key, tenant, query, response, vec.tobytes(), now, now + ttl, now, seconds, nbytes))
            self.db.commit()
            if self.index.get_current_count() >= self.index.get_max_elements():
                self.index.resize_index(self.index.get_max_elements() * 2)
            self.index.add_items(vec[None], [cur.lastrowid], replace_deleted=True)
            return cur.lastrowid

    def nearest(self, key: str, embedding: np.ndarray, now: float) -> tuple[Row, float] | None:
        with self.lock:
            ids = {r[0] for r in self.db.execute("SELECT id FROM entries WHERE key=? AND expires>?", (key, now))}
            if not ids:
                return None
            vec = np.asarray(embedding, np.float32).reshape(1, -1)
            labels, _ = self.index.knn_query(vec, k=1, filter=lambda label: label in ids)
            row = self.row(int(labels[0][0]))
            if row is None or row.key != key:
                return None
            # the similarity from the row, not the index: exact, and a stale index cannot lie about it
            return row, float(row.embedding @ vec[0])

    def row(self, id: int) -> Row | None:
        with self.lock:
            r = self.db.execute("SELECT id, key, tenant, query, response, embedding, created, expires, seconds FROM "
                                "entries WHERE id=?", (id,)).fetchone()
        if r is None:
            return None
        return Row(r[0], r[1], r[2], r[3], r[4], np.frombuffer(r[5], np.float32), r[6], r[7], r[8])

    def touch(self, id: int, now: float) -> None:
        with self.lock:
            self.db.execute("UPDATE entries SET last_used=? WHERE id=?", (now, id))
            self.db.commit()

    def delete(self, where: str, args: tuple = ()) -> int:
        with self.lock:
            ids = [r[0] for r in self.db.execute(f"SELECT id FROM entries WHERE {where}", args)]
            for i in ids:
                self.db.execute("DELETE FROM entries WHERE id=?", (i,))
                self.index.mark_deleted(i)
            self.db.commit()
            return len(ids)

    def expire(self, now: float) -> int:
        return self.delete("expires<=?", (now,))

    def evict_oldest(self, n: int) -> int:
        return self.delete("id IN (SELECT id FROM entries ORDER BY last_used LIMIT ?)", (n,))

    def clear(self, tenant: str) -> int:
        return self.delete("tenant=?", (tenant,))

    def totals(self, tenant: str | None = None) -> tuple[int, int]:
        where, args = ("", ()) if tenant is None else (" WHERE tenant=?", (tenant,))
        with self.lock:
            r = self.db.execute(f"SELECT count(*), coalesce(sum(nbytes), 0) FROM entries{where}", args).fetchone()
        return int(r[0]), int(r[1])

    def save(self) -> None:
        if self.path:
            with self.lock:
                self.index.save_index(f"{self.path}.hnsw")

    def close(self) -> None:
        self.save()
        with self.lock:
            self.db.close()
