//! A `unique_key` store at schema version 2 with a lock held in it, for the
//! tests of what `connect` and `migrate` make of it.

use fenced_api::LockKey;

/// Runs the statements of a migration template (`{base}` replaced by
/// `base`, comment lines dropped).
pub(crate) async fn run_template(pool: &sqlx::MySqlPool, template: &str, base: &str) {
    let sql: String = template
        .lines()
        .filter(|l| !l.trim_start().starts_with("--"))
        .collect::<Vec<_>>()
        .join("\n");
    for stmt in sql.split(';').map(str::trim).filter(|s| !s.is_empty()) {
        sqlx::query(sqlx::AssertSqlSafe(stmt.replace("{base}", base)))
            .execute(pool)
            .await
            .unwrap();
    }
}

/// Creates the tables of versions 1 and 2 under `base`, logs both versions
/// as applied, and inserts a `unique_key` row for `held` owned by `owner`
/// (a literal without quotes) that expires in 60 s. Returns its token.
pub(crate) async fn install_with_holder(
    pool: &sqlx::MySqlPool,
    base: &str,
    held: &LockKey,
    owner: &str,
) -> u64 {
    run_template(
        pool,
        include_str!("../../migrations/0001_initial.sql"),
        base,
    )
    .await;
    run_template(
        pool,
        include_str!("../../migrations/0002_row_lock_live.sql"),
        base,
    )
    .await;
    for sql in [
        format!(
            "CREATE TABLE `{base}_migrations` (version INT UNSIGNED NOT NULL PRIMARY KEY, \
             name VARCHAR(100) NOT NULL, applied_at DATETIME(6) NOT NULL) ENGINE=InnoDB"
        ),
        format!(
            "INSERT INTO `{base}_migrations` VALUES (1, 'initial', UTC_TIMESTAMP(6)), \
             (2, 'row_lock_live', UTC_TIMESTAMP(6))"
        ),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(pool)
            .await
            .unwrap();
    }
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO `{base}` (lock_key, owner, reentrant_count, expire_time, create_time) \
         VALUES (?, '{owner}', 1, UTC_TIMESTAMP(6) + INTERVAL 60 SECOND, UTC_TIMESTAMP(6))"
    )))
    .bind(held.as_bytes())
    .execute(pool)
    .await
    .unwrap()
    .last_insert_id()
}
