-- fenced schema v2: row_lock fencing tokens without a durable write per acquire.
-- `{base}` is replaced by the validated base table name.
--
-- A MEMORY table is not transactional: the token a holder takes inside its
-- locking transaction survives that transaction's rollback (release, KILL,
-- crash of the client), and taking it costs no log flush. The AUTO_INCREMENT
-- id is the token. A server restart empties the table; the lifetime row
-- (`\x01lifetime`, written with id = epoch << 40 after a durable bump of the
-- `\x01epoch` row in `{base}_fence`) must exist before any token is taken, so
-- every token of a new lifetime exceeds every token of the previous ones.
-- The other columns describe the latest grant of each key (for inspect and
-- force_release); they are not cleared at release. From this version on,
-- `{base}_rows.holder_conn` and the per-key rows of `{base}_fence` are no
-- longer written (`{base}_fence` keeps only the `\x01epoch` counter).
-- If MEMORY is unavailable the server substitutes another engine (or the
-- statement fails under NO_ENGINE_SUBSTITUTION); fenced checks the engine on
-- connect and then takes tokens in autocommit instead.
CREATE TABLE IF NOT EXISTS `{base}_live` (
  id BIGINT UNSIGNED NOT NULL AUTO_INCREMENT,
  lock_key VARBINARY(255) NOT NULL,
  owner VARBINARY(128) NULL,
  hold_count INT UNSIGNED NOT NULL DEFAULT 0,
  expire_time DATETIME(6) NULL,
  conn_id BIGINT UNSIGNED NULL,
  PRIMARY KEY (lock_key),
  UNIQUE KEY uk_id (id),
  KEY idx_conn (conn_id)
) ENGINE=MEMORY
