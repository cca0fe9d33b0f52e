-- fenced SQLite schema v1. `{base}` is replaced by the validated table name.
-- Keys and owners are BLOBs: compared byte for byte (memcmp), so `Lock`/`lock`,
-- `a`/`a ` and NFC/NFD spellings never collide (no collation, no NOCASE).
-- Times are integer microseconds since the Unix epoch, always computed inside
-- SQL from SQLite's clock (the host's wall clock), never sent by a client.

-- One row per held key. `id` is the fencing token: AUTOINCREMENT keeps the
-- high-water mark in `sqlite_sequence`, so an id is never handed out twice,
-- even after the newest rows were deleted (plain INTEGER PRIMARY KEY would
-- reuse max(id) + 1).
CREATE TABLE IF NOT EXISTS "{base}" (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  lock_key BLOB NOT NULL UNIQUE,
  owner BLOB NOT NULL,
  reentrant_count INTEGER NOT NULL DEFAULT 1 CHECK (reentrant_count >= 1),
  expire_at INTEGER NOT NULL,
  created_at INTEGER NOT NULL
) STRICT;

CREATE INDEX IF NOT EXISTS "{base}_expire_at" ON "{base}" (expire_at);
