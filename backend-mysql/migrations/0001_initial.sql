-- fenced schema v1. `{base}` is replaced by the validated base table name.
-- Portable: runs unchanged on MariaDB 10.3+ and MySQL 8.0+.
-- Keys and owners are VARBINARY: compared byte for byte, so `Lock`/`lock`,
-- `a`/`a ` and NFC/NFD spellings never collide (no collation, no PAD SPACE).
-- Times are DATETIME(6) written and compared with UTC_TIMESTAMP(6) on the
-- server only: client clocks and session time zones never matter.

-- unique_key: one row per held key; the AUTO_INCREMENT id is the fencing token.
CREATE TABLE IF NOT EXISTS `{base}` (
  id BIGINT UNSIGNED NOT NULL AUTO_INCREMENT,
  lock_key VARBINARY(255) NOT NULL,
  owner VARBINARY(128) NOT NULL,
  reentrant_count INT UNSIGNED NOT NULL DEFAULT 1,
  expire_time DATETIME(6) NOT NULL,
  create_time DATETIME(6) NOT NULL,
  PRIMARY KEY (id),
  UNIQUE KEY uk_lock_key (lock_key),
  KEY idx_expire_time (expire_time)
) ENGINE=InnoDB;

-- optimistic: one permanent row per key; `version` is the fencing token.
CREATE TABLE IF NOT EXISTS `{base}_optimistic` (
  lock_key VARBINARY(255) NOT NULL,
  holder VARBINARY(128) NULL,
  version BIGINT UNSIGNED NOT NULL DEFAULT 0,
  reentrant_count INT UNSIGNED NOT NULL DEFAULT 0,
  expire_time DATETIME(6) NULL,
  PRIMARY KEY (lock_key)
) ENGINE=InnoDB;

-- row_lock: the rows that SELECT … FOR UPDATE locks (created before locking,
-- never locked while missing: no gap locks).
CREATE TABLE IF NOT EXISTS `{base}_rows` (
  lock_key VARBINARY(255) NOT NULL,
  -- Written (uncommitted) by the holder inside its locking transaction, so
  -- it names the holding connection exactly while the lock is held and
  -- vanishes with the rollback: what force_release may KILL.
  holder_conn BIGINT UNSIGNED NULL,
  PRIMARY KEY (lock_key)
) ENGINE=InnoDB;

-- row_lock: the fencing counter and holder description, written in autocommit
-- so a rolled-back holder transaction never takes its token back.
CREATE TABLE IF NOT EXISTS `{base}_fence` (
  lock_key VARBINARY(255) NOT NULL,
  fence BIGINT UNSIGNED NOT NULL,
  owner VARBINARY(128) NULL,
  hold_count INT UNSIGNED NOT NULL DEFAULT 0,
  expire_time DATETIME(6) NULL,
  conn_id BIGINT UNSIGNED NULL,
  PRIMARY KEY (lock_key)
) ENGINE=InnoDB;
