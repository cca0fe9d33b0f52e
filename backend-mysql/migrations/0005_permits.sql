-- fenced schema v5: semaphores and reader-writer locks (the line model of
-- `fenced_api::permits`), one implementation for every strategy, a
-- namespace beside the mutexes. New tables only. Portable: MariaDB 10.3+
-- and MySQL 8.0+. `{base}` is replaced by the validated base table name.

-- One row per key ever used, with the key's last token: arrivals on a key
-- lock it first (SELECT … FOR UPDATE), so they take turns, and the counter
-- commits with the entry it numbered (tokens only grow, across restarts).
CREATE TABLE IF NOT EXISTS `{base}_permit_keys` (
  lock_key VARBINARY(255) NOT NULL,
  last_token BIGINT UNSIGNED NOT NULL DEFAULT 0,
  PRIMARY KEY (lock_key)
) ENGINE=InnoDB;

-- One row per entry of a key's line, holder or waiter; `id` is its place in
-- the line and its fencing token. Only the primary key: every statement
-- finds its rows by key (and id), and a secondary index on the expiry would
-- let a purge lock index entries in the other order than the renewals that
-- update them (a deadlock).
CREATE TABLE IF NOT EXISTS `{base}_permits` (
  lock_key VARBINARY(255) NOT NULL,
  id BIGINT UNSIGNED NOT NULL,
  owner VARBINARY(128) NOT NULL,
  capacity INT UNSIGNED NOT NULL,
  weight INT UNSIGNED NOT NULL,
  reentrant_count INT UNSIGNED NOT NULL DEFAULT 1,
  expire_time DATETIME(6) NOT NULL,
  create_time DATETIME(6) NOT NULL,
  label VARBINARY(128) NULL,
  PRIMARY KEY (lock_key, id)
) ENGINE=InnoDB
