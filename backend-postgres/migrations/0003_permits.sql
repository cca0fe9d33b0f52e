-- fenced PostgreSQL schema v3: semaphores and reader-writer locks (the
-- line model of `fenced_api::permits`), for both strategies, a namespace
-- beside the mutexes. New tables only: processes of v2 builds keep working.

-- One row per key ever used: arrivals on a key lock it first, so they take
-- turns and each sees every earlier entry.
CREATE TABLE IF NOT EXISTS "{base}_permit_keys" (
  lock_key BYTEA NOT NULL PRIMARY KEY
);

-- One row per entry of a key's line, holder or waiter. `id` is a value of
-- the token sequence: the entry's place in line and its fencing token.
CREATE TABLE IF NOT EXISTS "{base}_permits" (
  id BIGINT NOT NULL PRIMARY KEY,
  lock_key BYTEA NOT NULL,
  owner BYTEA NOT NULL,
  capacity INTEGER NOT NULL CHECK (capacity >= 1),
  weight INTEGER NOT NULL CHECK (weight >= 1 AND weight <= capacity),
  reentrant_count INTEGER NOT NULL DEFAULT 1 CHECK (reentrant_count >= 1),
  expire_at TIMESTAMPTZ NOT NULL,
  created_at TIMESTAMPTZ NOT NULL,
  label TEXT
);

CREATE INDEX IF NOT EXISTS "{base}_permits_line" ON "{base}_permits" (lock_key, id);
