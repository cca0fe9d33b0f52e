//! The SQL of `advisory`, built once per table.
//!
//! Parameters are bound in the same roles everywhere: the 64-bit advisory
//! key (`hash`), the lock key and owner as bytes, the token, the TTL in
//! microseconds. The session's `idle_session_timeout` is always set from
//! the row's new `expire_at` (milliseconds, rounded up): the server ends a
//! silent holder's session — and so frees its lock — only after the expiry
//! it recorded.

use fenced_sql::sql;
use sqlx::SqlStr;

use crate::config::TableName;

/// `now + $n` on the server's clock, `$n` a TTL in whole microseconds.
macro_rules! plus_us {
    ($n:literal) => {
        concat!("clock_timestamp() + $", $n, " * interval '1 microsecond'")
    };
}

/// The `idle_session_timeout` that ends the session at the row's
/// `expire_at`: its distance from now in whole milliseconds, at least 1.
const IDLE_UNTIL_EXPIRY: &str = "set_config('idle_session_timeout', \
     GREATEST(1, ceil(EXTRACT(EPOCH FROM (expire_at - clock_timestamp())) * 1000))::bigint::text, \
     false)";

/// The `pg_locks` row of a granted session lock on the 64-bit key `hash`
/// (alias `a`) held by `a.pid`, in this database: `classid` is the high
/// half of the key, `objid` the low half (unsigned), `objsubid` 1.
pub(super) const HELD_BY_PID: &str = "l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 \
     AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
     AND l.pid = a.pid \
     AND ((l.classid::bigint << 32) | l.objid::bigint) = a.hash";

/// Lets this statement's transaction commit without waiting for the WAL
/// flush: for writes nothing relies on after a crash (a crash ends every
/// session, and with it every lock; the row of a released or renewed hold
/// only describes it). Grants keep `synchronous_commit = on`: their token
/// must never be handed out twice. (The registry is unlogged, so a grant
/// waits for a flush only when its `nextval` logged the sequence, and then
/// it must; with the audit triggers of the fault suite, which write a
/// logged table, every statement here writes WAL.)
const NO_FLUSH: &str = "set_config('synchronous_commit', 'off', true)";

/// The remaining TTL of a row in whole microseconds (may be ≤ 0 for a
/// holder whose session the server is about to end).
const REMAINING_US: &str =
    "(EXTRACT(EPOCH FROM (a.expire_at - clock_timestamp())) * 1000000)::bigint";

/// The columns a grant sets in the registry row (`UPDATE … SET` list):
/// `$3` owner, `$4` ttl µs, `$5` label; the token from the sequence, the
/// holder this session.
pub(crate) fn grant(table: &TableName) -> String {
    format!(
        "owner = $3, token = nextval('{seq}'), reentrant_count = 1, \
         expire_at = {ttl}, created_at = clock_timestamp(), label = $5, \
         pid = pg_backend_pid()",
        seq = table.quoted("_token"),
        ttl = plus_us!(4)
    )
}

/// The statements of `advisory`. The registry's and the lock's
/// (`register`, `registered_with`, `try_lock`, `wait_lock`, `owner_holds`)
/// are also those of the transaction-scoped lock on this strategy.
#[derive(Debug)]
pub(crate) struct Sql {
    /// `$1` key, `$2` hash: records the key (a hash taken by another key
    /// raises a unique violation on `hash`).
    pub(crate) register: SqlStr,
    /// `$1` hash: the key recorded with that hash.
    pub(crate) registered_with: SqlStr,
    /// `$1` hash, `$2` key, `$3` owner, `$4` ttl µs, `$5` label: one try
    /// (`got`), and only if granted the token (`token`, NULL when the
    /// registry row is missing).
    pub(crate) try_lock: SqlStr,
    /// `$1` hash, `$2` lock_timeout ms for this statement ('0' = none),
    /// `$3` idle_session_timeout ms: waits in the server's queue.
    pub(crate) wait_lock: SqlStr,
    /// `$1` hash, `$2` key, `$3` owner, `$4` ttl µs, `$5` label: the token
    /// of a lock just granted by `wait_lock`.
    pub(super) take_token: SqlStr,
    /// `$1` hash: gives up a lock whose registry row was missing.
    pub(super) unlock: SqlStr,
    /// `$1` ttl µs, `$2` key, `$3` token, `$4` owner: renews the hold of
    /// this session (pid); a re-entered hold never shortens its expiry.
    pub(super) extend: SqlStr,
    /// As `extend`, counting one more entry.
    pub(super) reenter: SqlStr,
    /// `$1` key, `$2` token, `$3` owner: one entry fewer (not the last).
    pub(super) leave: SqlStr,
    /// `$1` hash, `$2` key, `$3` token, `$4` idle ms: the last release.
    pub(super) release: SqlStr,
    /// `$1` key, `$2` token, `$3` owner: the live holder's pid, if that lease
    /// is current (for a lease held through another handle).
    pub(super) holder_pid: SqlStr,
    /// `$1` key, `$2` owner: whether that owner holds the key.
    pub(crate) owner_holds: SqlStr,
    /// `$1` hash, `$2` wait ms: ends every session holding that key.
    pub(super) terminate_holders: SqlStr,
    /// `$1` pid, `$2` wait ms: ends one session.
    pub(super) terminate: SqlStr,
    /// `$1` key: the live holder.
    pub(super) inspect: SqlStr,
    /// `$1` limit: the live holders in key order.
    pub(super) list: SqlStr,
}

impl Sql {
    pub(crate) fn new(table: &TableName) -> Self {
        let t = &table.quoted("_advisory");
        let grant = grant(table);
        Sql {
            register: sql!(
                "INSERT INTO {t} (lock_key, hash) SELECT $1, $2 FROM (SELECT {NO_FLUSH}) s \
                 ON CONFLICT (lock_key) DO NOTHING"
            ),
            registered_with: sql!("SELECT lock_key FROM {t} WHERE hash = $1"),
            // `l` is evaluated once, before the update that reads it: the
            // token is taken only once the lock is held.
            try_lock: sql!(
                "WITH l AS (SELECT pg_try_advisory_lock($1) AS got), \
                 u AS (UPDATE {t} SET {grant} FROM l WHERE l.got AND lock_key = $2 AND hash = $1 \
                 RETURNING token, {IDLE_UNTIL_EXPIRY}) \
                 SELECT l.got, u.token FROM l LEFT JOIN u ON true"
            ),
            // `s` is materialised before the lock is asked for. The
            // `lock_timeout` is local to this statement; the idle timeout
            // stays, so a client that freezes right after the grant still
            // loses the lock after its TTL. A refusal (55P03) rolls both back.
            wait_lock: sql!(
                "WITH s AS MATERIALIZED (SELECT set_config('lock_timeout', $2, true), \
                 set_config('idle_session_timeout', $3, false)) \
                 SELECT pg_advisory_lock($1) FROM s"
            ),
            take_token: sql!(
                "UPDATE {t} SET {grant} WHERE lock_key = $2 AND hash = $1 \
                 RETURNING token, {IDLE_UNTIL_EXPIRY}"
            ),
            unlock: sql!("SELECT pg_advisory_unlock($1)"),
            extend: sql!(
                "UPDATE {t} SET expire_at = CASE WHEN reentrant_count > 1 \
                 THEN GREATEST(expire_at, {ttl}) ELSE {ttl} END \
                 WHERE lock_key = $2 AND token = $3 AND owner = $4 AND pid = pg_backend_pid() \
                 RETURNING {IDLE_UNTIL_EXPIRY}, {NO_FLUSH}",
                ttl = plus_us!(1)
            ),
            reenter: sql!(
                "UPDATE {t} SET reentrant_count = reentrant_count + 1, \
                 expire_at = GREATEST(expire_at, {ttl}) \
                 WHERE lock_key = $2 AND token = $3 AND owner = $4 AND pid = pg_backend_pid() \
                 RETURNING {IDLE_UNTIL_EXPIRY}, {NO_FLUSH}",
                ttl = plus_us!(1)
            ),
            leave: sql!(
                "UPDATE {t} SET reentrant_count = reentrant_count - 1 \
                 WHERE lock_key = $1 AND token = $2 AND owner = $3 AND pid = pg_backend_pid() \
                 AND reentrant_count > 1 RETURNING reentrant_count, {NO_FLUSH}"
            ),
            // The row is marked released and the lock given up in one
            // statement. PostgreSQL runs a data-modifying CTE that nothing
            // reads after the main query, so the unlock comes first and a
            // waiter may be granted and write the row before this UPDATE
            // does; the UPDATE matches this hold's token and backend only,
            // so it then changes nothing and never clears a successor's row.
            release: sql!(
                "WITH u AS (UPDATE {t} SET reentrant_count = 0, expire_at = clock_timestamp(), \
                 pid = NULL WHERE lock_key = $2 AND token = $3 AND pid = pg_backend_pid() \
                 RETURNING 1) \
                 SELECT pg_advisory_unlock($1), set_config('idle_session_timeout', $4, false), \
                 {NO_FLUSH}"
            ),
            holder_pid: sql!(
                "SELECT a.pid FROM {t} a JOIN pg_locks l ON {HELD_BY_PID} \
                 WHERE a.lock_key = $1 AND a.token = $2 AND a.owner = $3"
            ),
            owner_holds: sql!(
                "SELECT 1 FROM {t} a JOIN pg_locks l ON {HELD_BY_PID} \
                 WHERE a.lock_key = $1 AND a.owner = $2"
            ),
            // Whoever holds the key, with or without a row (a session that
            // took the lock by the documented formula, outside fenced).
            terminate_holders: sql!(
                "SELECT COALESCE(bool_or(pg_terminate_backend(l.pid, $2)), false) \
                 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted \
                 AND l.objsubid = 1 \
                 AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
                 AND ((l.classid::bigint << 32) | l.objid::bigint) = $1"
            ),
            terminate: sql!("SELECT pg_terminate_backend($1, $2)"),
            inspect: sql!(
                "SELECT a.owner, a.token, a.reentrant_count, {REMAINING_US}, a.label \
                 FROM {t} a JOIN pg_locks l ON {HELD_BY_PID} WHERE a.lock_key = $1"
            ),
            list: sql!(
                "SELECT a.owner, a.token, a.reentrant_count, {REMAINING_US}, a.label, a.lock_key \
                 FROM {t} a JOIN pg_locks l ON {HELD_BY_PID} ORDER BY a.lock_key LIMIT $1"
            ),
        }
    }
}
