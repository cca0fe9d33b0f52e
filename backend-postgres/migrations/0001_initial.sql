-- fenced PostgreSQL schema v1. `{base}` is replaced by the validated base
-- table name. Needs PostgreSQL 12 or later (advisory: 14, see the crate docs).
-- Keys and owners are BYTEA: compared byte for byte whatever the database's
-- encoding or collation. Times are TIMESTAMPTZ written and compared with
-- clock_timestamp() on the server only: client clocks never matter.

-- The fencing tokens of both strategies: a sequence never hands a value out
-- twice, across crashes and restarts (nextval's WAL record is flushed with
-- the commit of the statement that took it; fenced's sessions run with
-- synchronous_commit = on).
CREATE SEQUENCE IF NOT EXISTS "{base}_token" AS BIGINT;

-- lease: one row per key. A row stays after its release (its expiry set to
-- the release time) and is deleted by the reaper only long after, so every
-- grant of a key that was held recently is an UPDATE under that row's lock,
-- and its token (taken in that UPDATE) is larger than every earlier one.
-- No index on expire_at: grants and renewals change only unindexed columns
-- and stay HOT updates (fillfactor leaves the room on the page for them).
CREATE TABLE IF NOT EXISTS "{base}" (
  lock_key BYTEA NOT NULL PRIMARY KEY,
  owner BYTEA NOT NULL,
  token BIGINT NOT NULL,
  reentrant_count INTEGER NOT NULL DEFAULT 1,
  expire_at TIMESTAMPTZ NOT NULL,
  created_at TIMESTAMPTZ NOT NULL,
  label TEXT
) WITH (fillfactor = 70);

-- advisory: the key registry and the holder's description. `hash` is the
-- 64-bit advisory lock key; UNIQUE, so a second key with the same hash
-- cannot be recorded: the collision is reported instead of two keys
-- silently sharing one lock. `pid` is the backend holding the advisory lock
-- (a row whose pid no longer holds it describes a past holder).
CREATE TABLE IF NOT EXISTS "{base}_advisory" (
  lock_key BYTEA NOT NULL PRIMARY KEY,
  hash BIGINT NOT NULL UNIQUE,
  owner BYTEA,
  token BIGINT,
  reentrant_count INTEGER NOT NULL DEFAULT 0,
  expire_at TIMESTAMPTZ,
  created_at TIMESTAMPTZ,
  label TEXT,
  pid INTEGER
) WITH (fillfactor = 70);
