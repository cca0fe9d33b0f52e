//! Fencing tokens for `row_lock` (see the module docs of `row_lock`): taken
//! right after the grant, inside the holder's transaction when the token
//! table is `MEMORY`, with a lifetime epoch that survives server restarts.

use std::sync::atomic::Ordering;

use fenced_api::{Error, FencingToken, Lease, LockKey, Result};
use sqlx::{MySqlConnection, MySqlPool, Row};
use tokio::time::Instant;

use super::{conn::HeldConn, Grant, HeldRow, Locked, RowLock};
use crate::error::{self, SqlResultExt};
use crate::strategy::micros;

/// The `_live` row that opens the current server lifetime (`\x01` cannot
/// appear in a key).
pub(crate) const LIFETIME_KEY: &[u8] = b"\x01lifetime";
/// The `_fence` row counting server lifetimes, durably.
const EPOCH_KEY: &[u8] = b"\x01epoch";
/// Tokens of one lifetime start at `epoch << EPOCH_SHIFT`.
const EPOCH_SHIFT: u32 = 40;

/// MySQL's refusal of a non-transactional write inside a transaction under
/// `enforce_gtid_consistency` (ER_GTID_UNSAFE_NON_TRANSACTIONAL_TABLE).
const GTID_UNSAFE: u16 = 1785;
/// ER_RECORD_FILE_FULL: the `MEMORY` table reached `max_heap_table_size`.
const TABLE_FULL: u16 = 1114;

/// Errors that say the server cannot run the single-statement grant at all
/// (MySQL: no `SET STATEMENT`; GTID consistency refusing the non-transactional
/// write): syntax, unknown variable, not supported, GTID-unsafe.
pub(super) fn refuses_one_statement(e: &sqlx::Error) -> bool {
    matches!(error::number(e), Some(1064 | 1193 | 1235 | GTID_UNSAFE))
}

/// Whether `<live>` (unquoted name) is a `MEMORY` table, i.e. whether tokens
/// may be taken inside the holder's transaction.
pub(crate) async fn live_is_memory(pool: &MySqlPool, live: &str) -> Result<bool> {
    let engine: Option<String> = sqlx::query(
        "SELECT ENGINE FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?",
    )
    .bind(live)
    .fetch_optional(pool)
    .await
    .db()?
    .map(|r| r.try_get::<String, _>(0))
    .transpose()
    .db()?;
    Ok(engine.is_some_and(|e| e.eq_ignore_ascii_case("MEMORY")))
}

/// What became of a fresh grant.
pub(super) enum Granted {
    Lease(Lease),
    /// The token table had no lifetime (a server restart emptied it): one
    /// was opened and the row given back; lock again.
    Retry,
}

enum Token {
    /// The token and the instant the lease counts from.
    Taken(u64, Instant),
    NoLifetime,
    /// Tokens must now be taken in autocommit, which needs a side
    /// connection this grant did not reserve.
    NeedSide,
}

impl RowLock {
    /// Takes the fencing token for a fresh grant and registers the hold.
    /// A hold lost in between (its connection died, or the token took longer
    /// than the TTL) yields an error, never a lease: its burned token is harmless.
    pub(super) async fn register(
        &self,
        key: &LockKey,
        grant: Grant<'_>,
        locked: Locked<'_>,
    ) -> Result<Granted> {
        let Grant { owner, ttl, .. } = grant;
        let Locked {
            mut held,
            sent: lock_sent,
            waited,
            mut side,
            token,
        } = locked;
        let taken = match token {
            // Taken by the locking statement itself, sent without waiting:
            // the hold was alive when it was sent.
            Some(t) => Ok(Token::Taken(t, lock_sent)),
            None => {
                self.take_token(&mut held, side.as_mut(), key, grant, lock_sent, waited)
                    .await
            }
        };
        if let Some(c) = side {
            c.settle(None);
        }
        let (token, start) = match taken {
            Ok(Token::Taken(t, s)) => (t, s),
            Ok(Token::NoLifetime) => {
                self.open_lifetime(held).await?;
                return Ok(Granted::Retry);
            }
            Ok(Token::NeedSide) => {
                self.end_hold(held).await;
                return Ok(Granted::Retry);
            }
            // No token, no lock: the connection is closed (rolling back).
            Err(e) => return Err(e),
        };
        if start + ttl <= Instant::now() {
            return Err(Error::backend(
                error::BACKEND,
                true,
                format!(
                    "the hold on `{key}` may have expired while its token was taken; try again"
                ),
            ));
        }
        self.held.lock().unwrap_or_else(|p| p.into_inner()).insert(
            key.clone(),
            HeldRow {
                owner: owner.clone(),
                token,
                count: 1,
                deadline: start + ttl,
                conn: std::sync::Arc::new(tokio::sync::Mutex::new(Some(held))),
            },
        );
        Ok(Granted::Lease(Lease::new(
            key.clone(),
            owner.clone(),
            FencingToken::new(token),
            ttl,
            start,
        )))
    }

    /// The token statement: inside the holding transaction when possible,
    /// else in autocommit on the reserved side connection.
    async fn take_token(
        &self,
        held: &mut HeldConn,
        mut side: Option<&mut crate::conn::Conn<'_>>,
        key: &LockKey,
        grant: Grant<'_>,
        lock_sent: Instant,
        waited: bool,
    ) -> Result<Token> {
        let conn_id = held.lock_conn()?.id;
        for _ in 0..3 {
            let in_txn = self.token_in_txn.load(Ordering::Relaxed) || side.is_none();
            let q = sqlx::query(self.sql.token.clone())
                .bind(key.as_bytes())
                .bind(grant.owner.as_str().as_bytes())
                .bind(micros(grant.ttl))
                .bind(conn_id)
                .bind(grant.label_param())
                .bind(LIFETIME_KEY);
            let sent = Instant::now();
            let res = match side.as_deref_mut() {
                Some(c) if !in_txn => q.execute(c.conn()).await,
                _ => q.execute(held.conn()?).await,
            };
            match res {
                Ok(done) if done.rows_affected() > 0 => {
                    let token = done.last_insert_id();
                    if in_txn {
                        // A statement on the holding connection after the
                        // grant: the hold was alive when it was sent.
                        return Ok(Token::Taken(token, sent));
                    }
                    if !waited {
                        // NOWAIT: the grant was sent just now; the server's
                        // idle clock started after that send.
                        return Ok(Token::Taken(token, lock_sent));
                    }
                    let proof = Instant::now();
                    sqlx::raw_sql("DO 1")
                        .execute(held.conn()?)
                        .await
                        .map_err(|e| {
                            Error::backend(
                                error::BACKEND,
                                true,
                                format!("the lock connection died right after the grant ({e}); try again"),
                            )
                        })?;
                    return Ok(Token::Taken(token, proof));
                }
                Ok(_) => return Ok(Token::NoLifetime),
                Err(e) if in_txn && error::number(&e) == Some(GTID_UNSAFE) => {
                    // Needs a side connection, reserved before locking: give
                    // this grant up (the caller locks again).
                    tracing::info!("the server refuses non-transactional writes inside transactions; row_lock tokens are taken in autocommit from now on");
                    self.token_in_txn.store(false, Ordering::Relaxed);
                    if side.is_none() {
                        return Ok(Token::NeedSide);
                    }
                }
                Err(e) if error::number(&e) == Some(TABLE_FULL) => {
                    let c = match side.as_deref_mut() {
                        Some(c) if !in_txn => c.conn(),
                        _ => held.conn()?,
                    };
                    if !self.prune(c).await? {
                        return Err(Error::backend(
                            error::BACKEND,
                            true,
                            format!("the row_lock token table is full of live holds ({e}); raise max_heap_table_size"),
                        ));
                    }
                }
                Err(e) => return Err(error::map(e)),
            }
        }
        Err(Error::backend(
            error::BACKEND,
            true,
            "could not take a fencing token (the token table kept filling up)",
        ))
    }

    /// Starts a new token lifetime after a server restart (or on first use),
    /// on the lock connection itself — so no second connection is needed
    /// while a row is held: the row is given back first (`ROLLBACK`), the
    /// epoch bumped durably (`COMMIT`), then the `MEMORY` table's id counter
    /// started at `epoch << 40` with the lifetime row. Concurrent openers are
    /// fine: the first start wins and every epoch bumped is durable before use.
    async fn open_lifetime(&self, mut held: HeldConn) -> Result<()> {
        let opened = async {
            let c = held.conn()?;
            sqlx::raw_sql("ROLLBACK").execute(&mut *c).await.db()?;
            let epoch = sqlx::query(self.sql.epoch.clone())
                .bind(EPOCH_KEY)
                .execute(&mut *c)
                .await
                .db()?
                .last_insert_id();
            sqlx::raw_sql("COMMIT").execute(&mut *c).await.db()?;
            let base = epoch
                .checked_shl(EPOCH_SHIFT)
                .filter(|b| b >> EPOCH_SHIFT == epoch)
                .ok_or_else(|| {
                    Error::backend(error::BACKEND, false, "the row_lock token epoch overflowed")
                })?;
            sqlx::query(self.sql.open_lifetime.clone())
                .bind(base)
                .bind(LIFETIME_KEY)
                .execute(&mut *c)
                .await
                .db()?;
            sqlx::raw_sql("COMMIT").execute(&mut *c).await.db()?;
            Ok::<_, Error>(epoch)
        };
        // On failure `held` is dropped: the connection closes.
        let epoch = opened.await?;
        if let Some(lc) = held.take() {
            self.locks.put(lc, &self.conns);
        }
        tracing::info!(epoch, "row_lock token lifetime opened");
        Ok(())
    }

    /// Removes descriptions of expired holds from the full token table. The
    /// id counter is not affected (it only grows), nor the lifetime row.
    async fn prune(&self, conn: &mut MySqlConnection) -> Result<bool> {
        let n = sqlx::query(self.sql.prune.clone())
            .bind(LIFETIME_KEY)
            .execute(conn)
            .await
            .db()?
            .rows_affected();
        Ok(n > 0)
    }
}
