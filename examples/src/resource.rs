//! fenced_resource and transactional_row_lock.

use std::{sync::Mutex, time::Duration};

use fenced::{
    mysql::{sqlx, MySqlLock},
    DistributedLock, FencingToken, LockKey, LockOptions,
};

use crate::BoxError;

/// A stand-in for the resource a lock protects (a database row, a file, an
/// object store key) that does the one thing fencing needs: it remembers the
/// highest token it has seen and rejects writes carrying a lower one.
///
/// In SQL this is `UPDATE t SET v = ?, fence = ? WHERE id = ? AND fence <= ?`
/// — see [`fenced_resource`].
///
/// ```
/// use fenced::FencingToken;
/// use fenced_examples::FencedResource;
///
/// let r = FencedResource::default();
/// r.write(FencingToken::new(2), "from the new holder")?;
/// assert!(r.write(FencingToken::new(1), "from a paused ex-holder").is_err());
/// assert_eq!(r.values(), vec!["from the new holder".to_string()]);
/// # Ok::<(), String>(())
/// ```
#[derive(Debug, Default)]
pub struct FencedResource {
    state: Mutex<(u64, Vec<String>)>,
}

impl FencedResource {
    /// Applies `value` if `token` is at least the highest token seen so far.
    ///
    /// # Errors
    ///
    /// A message naming both tokens when the write is stale.
    pub fn write(&self, token: FencingToken, value: &str) -> Result<(), String> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if token.get() < state.0 {
            return Err(format!(
                "rejected stale write with token {token}: token {} was already seen",
                state.0
            ));
        }
        state.0 = token.get();
        state.1.push(value.to_owned());
        Ok(())
    }

    /// The accepted values, in order.
    pub fn values(&self) -> Vec<String> {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .1
            .clone()
    }
}

/// A protected MySQL table that rejects stale tokens: holder A takes the
/// lock and pauses past its TTL, B takes over and writes, then A wakes up
/// and writes too. Returns (A's write accepted?, B's write accepted?, final
/// value): `(false, true, "B")`.
///
/// # Errors
///
/// Whatever connecting, locking or SQL fails with.
pub async fn fenced_resource(
    lock_url: &str,
    db_url: &str,
) -> Result<(bool, bool, String), BoxError> {
    let lock = fenced::connect(lock_url).await?;
    let db = sqlx::MySqlPool::connect(db_url).await?;
    let table = format!(
        "fenced_example_orders_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE `{table}` (id INT PRIMARY KEY, state VARCHAR(20), fence BIGINT UNSIGNED NOT NULL DEFAULT 0); \
         INSERT INTO `{table}` VALUES (1001, 'new', 0)"
    )))
    .execute(&db)
    .await?;
    // The fenced write: applies only if no higher token was seen.
    let write = |state: &'static str, token: FencingToken| {
        let (db, table) = (db.clone(), table.clone());
        async move {
            let done = sqlx::query(sqlx::AssertSqlSafe(format!(
                "UPDATE `{table}` SET state = ?, fence = ? WHERE id = 1001 AND fence <= ?"
            )))
            .bind(state)
            .bind(token.get())
            .bind(token.get())
            .execute(&db)
            .await?;
            Ok::<bool, BoxError>(done.rows_affected() == 1)
        }
    };
    let key = LockKey::new(format!("order:1001:{table}"))?;
    let short = LockOptions::builder().ttl(Duration::from_secs(1)).build()?;
    let a = lock
        .try_acquire(&key, &short)
        .await?
        .ok_or("the key should be free")?;
    // A pauses (GC, SIGSTOP…) past its TTL; B takes over and writes.
    let wait = LockOptions::builder()
        .ttl(Duration::from_secs(10))
        .wait_timeout(Duration::from_secs(10))
        .build()?;
    let b = lock.acquire(&key, &wait).await?;
    let b_ok = write("B", b.token).await?;
    // A wakes up and writes with its old token: rejected by the table.
    let a_ok = write("A", a.token).await?;
    lock.release(&b).await?;
    let state: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT state FROM `{table}` WHERE id = 1001"
    )))
    .fetch_one(&db)
    .await?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE `{table}`")))
        .execute(&db)
        .await?;
    Ok((a_ok, b_ok, state))
}

/// MySQL `row_lock`'s transaction-scoped API: a business write and the
/// release commit atomically; a rollback undoes both. Returns the rows
/// written by (the committed, the rolled-back) transaction: `(1, 0)`.
///
/// # Errors
///
/// Whatever connecting, locking or SQL fails with.
pub async fn transactional_row_lock(mysql_url: &str) -> Result<(i64, i64), BoxError> {
    let url = format!("{mysql_url}?strategy=row_lock&table=fenced_example_tx");
    MySqlLock::migrate(&url).await?;
    let lock = MySqlLock::connect(&url).await?;
    let db = sqlx::MySqlPool::connect(mysql_url).await?;
    let table = format!(
        "fenced_example_ledger_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE `{table}` (id INT PRIMARY KEY, fence BIGINT UNSIGNED)"
    )))
    .execute(&db)
    .await?;
    let key = LockKey::new(format!("ledger:{table}"))?;
    let opts = LockOptions::builder()
        .ttl(Duration::from_secs(10))
        .build()?;
    let insert = format!("INSERT INTO `{table}` (id, fence) VALUES (?, ?)");

    let mut tx = lock.lock_in_transaction(&key, &opts).await?;
    sqlx::query(sqlx::AssertSqlSafe(insert.clone()))
        .bind(1)
        .bind(tx.token().get())
        .execute(tx.connection()?)
        .await?;
    tx.commit().await?; // the write and the release, together

    let mut tx = lock.lock_in_transaction(&key, &opts).await?;
    sqlx::query(sqlx::AssertSqlSafe(insert))
        .bind(2)
        .bind(tx.token().get())
        .execute(tx.connection()?)
        .await?;
    tx.rollback().await?; // neither the write nor the lock survive

    let count = |id: i32| {
        let (db, table) = (db.clone(), table.clone());
        async move {
            let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT COUNT(*) FROM `{table}` WHERE id = ?"
            )))
            .bind(id)
            .fetch_one(&db)
            .await?;
            Ok::<i64, BoxError>(n)
        }
    };
    let result = (count(1).await?, count(2).await?);
    // Free again after both: the lock went with the transaction.
    let free = lock
        .try_acquire(&key, &opts)
        .await?
        .ok_or("the key should be free")?;
    lock.release(&free).await?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE `{table}`")))
        .execute(&db)
        .await?;
    Ok(result)
}
