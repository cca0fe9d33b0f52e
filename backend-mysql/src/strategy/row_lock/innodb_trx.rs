//! Reading `information_schema.INNODB_TRX` — and knowing whether what it
//! said is current.
//!
//! `row_lock` asks `INNODB_TRX` which connections are inside a transaction
//! (a hold *is* an open transaction) for two answers: the same owner
//! holding through another instance ([`local`](super::local)) and which
//! described keys are held ([`list`](super::list)). InnoDB does not read its
//! transaction list for every such `SELECT`: it serves a cached copy and
//! refills it only when the cache was last **read** more than 0.1 s ago
//! (`CACHE_MIN_IDLE_TIME` in InnoDB's `trx0i_s`, so that one `SELECT`
//! joining several of its tables sees one version). A transaction started
//! within the last 0.1 s — or much longer ago, while anyone on the server
//! keeps reading the table more often than every 0.1 s — is missing from
//! what a `SELECT` sees. Measured here: with one session reading it every
//! 20 ms, a transaction held 1.5 s never appeared; a CI run of the
//! same-owner test missed a hold granted a few milliseconds earlier.
//!
//! So every read carries a **witness**: it runs inside a transaction of its
//! own (`START TRANSACTION WITH CONSISTENT SNAPSHOT`, read-only, rolled
//! back), begun after the moment the caller cares about, and first asks
//! whether that transaction is in the cache — running the asking statement
//! itself, recognised by a nonce in its text (a stale copy can show an
//! earlier transaction of the same pooled connection, so the connection id
//! alone would be fooled). If it is, the cache was filled after the caller's
//! moment and so lists every transaction that started before it and is
//! still open; the query that follows reads that copy or a newer one. If
//! it is not, the answer is stale and the read is repeated ([`TRIES`] times
//! in all), then reported as stale and the caller falls back (see each
//! caller). The reads of one process take turns, each just over 0.1 s
//! after the previous one ([`GATE`]), so that they do not keep each other
//! from refills.
//!
//! The witness costs three statements more than the bare query (start,
//! witness, rollback) — paid only on these two paths, never per acquire.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use fenced_api::Result;
use sqlx::mysql::{MySqlArguments, MySqlRow};
use sqlx::query::Query;
use sqlx::MySql;
use tokio::time::Instant;

use super::RowLock;
use crate::error;

/// ER_SPECIFIC_ACCESS_DENIED_ERROR / ER_TABLEACCESS_DENIED_ERROR: no
/// `PROCESS` privilege for `information_schema.INNODB_TRX`.
const ACCESS_DENIED: [u16; 2] = [1227, 1142];

/// Numbers the witnesses of this process: with the connection id (one
/// process's connection) that names each one.
static NONCE: AtomicU64 = AtomicU64::new(0);

/// Whether this session's own transaction is in the cache, running this
/// very statement: `nonce` (new per read) tells it from an earlier
/// transaction of the same connection that a stale copy may still show.
/// Sent as text, not prepared, so that each nonce is not a cached
/// statement — and so that the cache's copy of the statement has the
/// nonce itself, not a placeholder.
fn witness(nonce: u64) -> String {
    format!(
        "SELECT 1 FROM information_schema.INNODB_TRX \
         WHERE trx_mysql_thread_id = CONNECTION_ID() AND trx_query LIKE '%fenced-witness-{nonce}%'"
    )
}

/// Reads before a stale answer is reported: under a second in all when
/// nobody else in this process is reading (see [`GATE`]).
pub(super) const TRIES: u32 = 5;

/// This process's reads of `INNODB_TRX`, one at a time, each [`spacing`]
/// after the previous one ends, with when that was. Without it, readers in
/// one process starve each other: any read less than 0.1 s after another
/// is served the old copy and puts off the next refill — measured with
/// four same-owner checks started 35 ms apart, re-reading every
/// 110–210 ms each: 5 runs of 6 ended with checks that never saw a fresh
/// copy. Spaced, every read is one that may refill. One gate for the
/// process, not per server: these reads are rare (a same-owner refusal, a
/// `list`), so serialising them across servers costs little.
static GATE: tokio::sync::Mutex<Option<Instant>> = tokio::sync::Mutex::const_new(None);

/// How long one caller waits for turns at the [`GATE`] (at most a quarter
/// of the operation timeout): the whole `try_acquire` or `list` around it
/// is bounded by that timeout, and running into it would report a silent
/// server, which this is not.
const TURN_BUDGET: Duration = Duration::from_secs(2);

/// Just over InnoDB's 0.1 s, plus up to 30 ms of jitter so that readers in
/// different processes (which the gate does not order) do not settle into
/// a fixed offset that keeps each other's reads too recent.
fn spacing() -> Duration {
    Duration::from_millis(110 + fastrand::u64(0..=30))
}

/// What a read through `INNODB_TRX` gave.
pub(super) enum TrxView {
    /// The query's rows; `fresh` if the witness showed the cache current.
    /// Stale and empty if the reads did not get their turn in time.
    Rows { rows: Vec<MySqlRow>, fresh: bool },
    /// The account may not read `INNODB_TRX` (no `PROCESS` privilege).
    Denied(sqlx::Error),
}

impl RowLock {
    /// Runs `query` (which reads `INNODB_TRX`) with a witness, repeating it
    /// while the cache is stale — unless `enough` accepts a stale answer
    /// (a positive answer can be good enough where a negative is not).
    /// Waiting for turns at the [`GATE`] is bounded by [`TURN_BUDGET`] (then
    /// the answer is stale and empty), each read by the operation timeout.
    pub(super) async fn read_innodb_trx<'q>(
        &self,
        query: impl Fn() -> Query<'q, MySql, MySqlArguments>,
        enough: impl Fn(&[MySqlRow]) -> bool,
    ) -> Result<TrxView> {
        let give_up = Instant::now() + TURN_BUDGET.min(self.op_timeout / 4);
        let mut attempt = 0;
        loop {
            attempt += 1;
            let Ok(mut last) = tokio::time::timeout_at(give_up, GATE.lock()).await else {
                tracing::debug!(
                    attempt,
                    "no turn to read INNODB_TRX in time: answering from no read"
                );
                return Ok(TrxView::Rows {
                    rows: Vec::new(),
                    fresh: false,
                });
            };
            if let Some(t) = *last {
                tokio::time::sleep_until(t + spacing()).await;
            }
            let read = error::bounded(
                "reading INNODB_TRX",
                self.op_timeout,
                self.witnessed(&query),
            )
            .await;
            *last = Some(Instant::now());
            drop(last);
            let (rows, fresh) = match read? {
                Ok(read) => read,
                Err(e) if error::number(&e).is_some_and(|n| ACCESS_DENIED.contains(&n)) => {
                    return Ok(TrxView::Denied(e))
                }
                Err(e) => return Err(error::map(e)),
            };
            if fresh || attempt >= TRIES || enough(&rows) {
                if !fresh {
                    tracing::debug!(
                        attempt,
                        "information_schema.INNODB_TRX stayed stale (read more often than every 0.1 s?)"
                    );
                }
                return Ok(TrxView::Rows { rows, fresh });
            }
        }
    }

    /// One read: the witness, then `query`, in a snapshot transaction of
    /// their own on a plain connection, rolled back.
    async fn witnessed<'q>(
        &self,
        query: &impl Fn() -> Query<'q, MySql, MySqlArguments>,
    ) -> Result<std::result::Result<(Vec<MySqlRow>, bool), sqlx::Error>> {
        let mut c = self.plain().await?;
        let r = async {
            sqlx::raw_sql("START TRANSACTION WITH CONSISTENT SNAPSHOT")
                .execute(c.conn())
                .await?;
            let nonce = NONCE.fetch_add(1, Ordering::Relaxed);
            let fresh = sqlx::raw_sql(sqlx::AssertSqlSafe(witness(nonce)))
                .fetch_optional(c.conn())
                .await?
                .is_some();
            let rows = query().fetch_all(c.conn()).await?;
            Ok::<_, sqlx::Error>((rows, fresh))
        }
        .await;
        // Never give back a connection inside a transaction: roll back,
        // and close it if even that fails.
        let rolled_back = sqlx::raw_sql("ROLLBACK").execute(c.conn()).await;
        match &r {
            Err(e) if rolled_back.is_ok() => c.settle(Some(e)),
            _ => c.finish(&rolled_back),
        }
        Ok(r)
    }
}
