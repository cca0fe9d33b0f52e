//! The statements of `row_lock`, written once per base table (what each
//! carries: the module docs of `row_lock`).

use sqlx::SqlStr;

use crate::sql::sql;

/// The physical tables of a `row_lock` store: the key rows, the fence
/// (token counter) and the live-grant table.
pub(crate) struct Tables {
    pub(crate) rows: String,
    pub(crate) fence: String,
    pub(crate) live: String,
}

/// SQL for one base table, built once.
pub(super) struct Sql {
    pub(super) lock_token: SqlStr,
    pub(super) ensure_row: SqlStr,
    pub(super) row_exists: SqlStr,
    pub(super) lock_nowait: SqlStr,
    pub(super) lock_wait: SqlStr,
    pub(super) token: SqlStr,
    pub(super) touch: SqlStr,
    pub(super) read_live: SqlStr,
    pub(super) list_in_trx: SqlStr,
    pub(super) list_described: SqlStr,
    pub(super) moved_on: SqlStr,
    pub(super) same_owner_described: SqlStr,
    pub(super) same_owner: SqlStr,
    pub(super) epoch: SqlStr,
    pub(super) open_lifetime: SqlStr,
    pub(super) prune: SqlStr,
}

impl Sql {
    pub(super) fn new(tables: &Tables) -> Self {
        let Tables { rows, fence, live } = tables;
        let now_plus = "UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND";
        Sql {
        // MariaDB's per-statement setting makes InnoDB refuse at once
        // (like NOWAIT) while the MEMORY table lock is still waited
        // for; NOWAIT itself would also refuse when another holder's
        // token statement has that table for a few microseconds.
        lock_token: sql!(
            "SET STATEMENT innodb_lock_wait_timeout = 0 FOR \
             REPLACE INTO {live} (lock_key, owner, hold_count, expire_time, conn_id, label) \
             SELECT ?, ?, 1, {now_plus}, CONNECTION_ID(), ? \
             FROM {rows} r JOIN {live} l ON l.lock_key = ? WHERE r.lock_key = ? FOR UPDATE"
        ),
        ensure_row: sql!("INSERT IGNORE INTO {rows} (lock_key) VALUES (?)"),
        row_exists: sql!("SELECT 1 FROM {rows} WHERE lock_key = ?"),
        lock_nowait: sql!(
            "SELECT lock_key, CONNECTION_ID() FROM {rows} WHERE lock_key = ? FOR UPDATE NOWAIT"
        ),
        lock_wait: sql!(
            "SELECT lock_key, CONNECTION_ID() FROM {rows} WHERE lock_key = ? FOR UPDATE"
        ),
        // Writes only while the lifetime row exists (0 rows otherwise);
        // the new AUTO_INCREMENT id comes back in the OK packet.
        token: sql!(
            "REPLACE INTO {live} (lock_key, owner, hold_count, expire_time, conn_id, label) \
             SELECT ?, ?, 1, {now_plus}, ?, ? FROM {live} WHERE lock_key = ?"
        ),
        touch: sql!(
            "UPDATE {live} SET expire_time = {now_plus}, hold_count = ? WHERE lock_key = ? AND id = ?"
        ),
        read_live: sql!(
            "SELECT owner, id, hold_count, \
             COALESCE(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expire_time), 0), label, \
             conn_id FROM {live} WHERE lock_key = ?"
        ),
        // Candidates for `list` (see `list.rs`): each key's latest
        // grant whose connection has not gone on to a later grant,
        // in key order — with `INNODB_TRX` (needs `PROCESS`) only
        // those whose connection is inside a transaction.
        list_in_trx: sql!(
            "SELECT l.owner, l.id, l.hold_count, \
             COALESCE(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), l.expire_time), 0), l.label, \
             l.lock_key FROM {live} l JOIN information_schema.INNODB_TRX t ON t.trx_mysql_thread_id = l.conn_id \
             WHERE l.lock_key <> ? AND l.owner IS NOT NULL \
             AND NOT EXISTS (SELECT 1 FROM {live} m WHERE m.conn_id = l.conn_id AND m.id > l.id) \
             ORDER BY l.lock_key"
        ),
        list_described: sql!(
            "SELECT l.owner, l.id, l.hold_count, \
             COALESCE(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), l.expire_time), 0), l.label, \
             l.lock_key FROM {live} l WHERE l.lock_key <> ? AND l.owner IS NOT NULL \
             AND NOT EXISTS (SELECT 1 FROM {live} m WHERE m.conn_id = l.conn_id AND m.id > l.id) \
             ORDER BY l.lock_key"
        ),
        moved_on: sql!("SELECT 1 FROM {live} WHERE conn_id = ? AND id > ? LIMIT 1"),
        // The key's latest grant is this owner's, unexpired, and
        // its connection has not gone on to a later grant.
        same_owner_described: sql!(
            "SELECT 1 FROM {live} l \
             WHERE l.lock_key = ? AND l.owner = ? AND l.expire_time > UTC_TIMESTAMP(6) \
             AND NOT EXISTS (SELECT 1 FROM {live} m WHERE m.conn_id = l.conn_id AND m.id > l.id) \
             LIMIT 1"
        ),
        // The same, and that connection is still inside a
        // transaction: that transaction holds the key.
        same_owner: sql!(
            "SELECT 1 FROM {live} l \
             JOIN information_schema.INNODB_TRX t ON t.trx_mysql_thread_id = l.conn_id \
             WHERE l.lock_key = ? AND l.owner = ? AND l.expire_time > UTC_TIMESTAMP(6) \
             AND NOT EXISTS (SELECT 1 FROM {live} m WHERE m.conn_id = l.conn_id AND m.id > l.id) \
             LIMIT 1"
        ),
        epoch: sql!(
            "INSERT INTO {fence} (lock_key, fence) VALUES (?, LAST_INSERT_ID(1)) \
             ON DUPLICATE KEY UPDATE fence = LAST_INSERT_ID(fence + 1)"
        ),
        open_lifetime: sql!(
            "INSERT IGNORE INTO {live} (id, lock_key, hold_count) VALUES (?, ?, 0)"
        ),
        prune: sql!(
            "DELETE FROM {live} WHERE lock_key <> ? AND expire_time < UTC_TIMESTAMP(6) LIMIT 1000"
            ),
        }
    }
}
