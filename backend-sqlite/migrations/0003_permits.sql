-- fenced SQLite schema v3: semaphores and reader-writer locks (the line
-- model of `fenced_api::permits`), a namespace beside the mutex table.
-- One row per entry of a key's line, holder or waiter; `id` is its place in
-- line and its fencing token (AUTOINCREMENT: never handed out twice). A new
-- table only, so processes of v2 builds keep working beside it.
CREATE TABLE IF NOT EXISTS "{base}_permits" (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  lock_key BLOB NOT NULL,
  owner BLOB NOT NULL,
  capacity INTEGER NOT NULL CHECK (capacity >= 1),
  weight INTEGER NOT NULL CHECK (weight >= 1 AND weight <= capacity),
  reentrant_count INTEGER NOT NULL DEFAULT 1 CHECK (reentrant_count >= 1),
  expire_at INTEGER NOT NULL,
  created_at INTEGER NOT NULL,
  label TEXT
) STRICT;

CREATE INDEX IF NOT EXISTS "{base}_permits_line" ON "{base}_permits" (lock_key, id);

CREATE INDEX IF NOT EXISTS "{base}_permits_expire_at" ON "{base}_permits" (expire_at);
