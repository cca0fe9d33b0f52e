//! Fencing floors: the least a lock must do on the server to hand out a
//! fencing token and refuse a stale release, and nothing else — no wait
//! queue, no re-entry, no label, no reaper, no client-side policy. Where
//! fenced trails a peer that hands out no token (rslock, the naive
//! INSERT/DELETE lock), the floor splits the gap in two: what the token and
//! the owner check cost on the server (peer → floor), and what fenced costs
//! on top of them (floor → fenced).
//!
//! * Redis: one script per call. Acquire reads the key's state, takes the
//!   server's clock, and — the key being free or its lease over — writes
//!   `token|expiry|owner` with the token `max(last + 1, now in µs)`, as
//!   fenced's tokens are. Release checks owner, token and expiry on the
//!   server's clock and writes the state back free, keeping the token (the
//!   fence a later grant must pass).
//! * MySQL: a row per held key whose `AUTO_INCREMENT` id is the token,
//!   inserted in the bulk form (`INSERT … SELECT … FROM DUAL`) that keeps
//!   ids granted in order under contention, the expiry on the server's
//!   clock; release deletes it by key, token and owner while it is current.
//!
//! Both run on one dedicated connection per task, and only in the cells
//! without contention (uncontended, parallel keys): a taken key is polled
//! every 100 ms, as the naive lock does.

use std::collections::HashMap;

use async_trait::async_trait;
use sqlx::{Connection, MySqlConnection};
use tokio::time::Instant;

use super::{exec, PeerKind, PEER_TTL};
use crate::{runner::Locker, stats::Servers, BenchError};

/// How long a free key's state (its last token) is kept, as fenced keeps it.
const RETAIN_MS: u64 = 604_800_000;

/// Grants when the key is free or its lease is over. KEYS[1] the state,
/// ARGV[1] owner, ARGV[2] ttl ms, ARGV[3] how long the state is kept (ms).
/// Returns the token (a string), or 0 when held.
const ACQUIRE: &str = r"
local v = redis.call('GET', KEYS[1])
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local last = 0
if v then
  local tok, exp, own = string.match(v, '^(%d+)|(%d+)|(.*)$')
  if own ~= '' and tonumber(exp) > now_ms then
    return 0
  end
  last = tonumber(tok)
end
local tok = math.max(last + 1, tonumber(t[1]) * 1000000 + tonumber(t[2]))
local s = string.format('%.0f', tok)
redis.call('SET', KEYS[1], s .. '|' .. (now_ms + tonumber(ARGV[2])) .. '|' .. ARGV[1], 'PX', ARGV[3])
return s
";

/// Frees the key when ARGV[1] (owner) holds it with token ARGV[2] and the
/// lease is current; keeps the token (for ARGV[3] ms). Returns 1 when
/// released, 0 otherwise.
const RELEASE: &str = r"
local v = redis.call('GET', KEYS[1])
if not v then
  return 0
end
local tok, exp, own = string.match(v, '^(%d+)|(%d+)|(.*)$')
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if own ~= ARGV[1] or tok ~= ARGV[2] or tonumber(exp) <= now_ms then
  return 0
end
redis.call('SET', KEYS[1], tok .. '|0|', 'PX', ARGV[3])
return 1
";

/// The table of the MySQL fencing floor of the run `id`.
pub(super) fn mysql_table(id: &str) -> String {
    format!("fb_{id}_fencing")
}

/// The Redis key prefix of the run `id` (one hash tag, as fenced's keys).
fn redis_prefix(id: &str) -> String {
    format!("{{fb{id}}}:fx:")
}

pub(super) async fn locker(
    kind: PeerKind,
    servers: &Servers,
    id: &str,
) -> Result<Box<dyn Locker>, BenchError> {
    let owner = uuid::Uuid::new_v4().simple().to_string();
    Ok(match kind {
        PeerKind::RedisFencing => {
            let client = redis::Client::open(servers.redis.as_str())?;
            Box::new(RedisFencing {
                conn: client.get_multiplexed_async_connection().await?,
                acquire: redis::Script::new(ACQUIRE),
                release: redis::Script::new(RELEASE),
                prefix: redis_prefix(id),
                owner,
                held: HashMap::new(),
            })
        }
        PeerKind::MySqlFencing => {
            let table = mysql_table(id);
            let mut conn = MySqlConnection::connect(&servers.mysql).await?;
            exec(
                &mut conn,
                &format!(
                    "CREATE TABLE IF NOT EXISTS `{table}` (lock_key VARCHAR(255) NOT NULL PRIMARY KEY, \
                     id BIGINT UNSIGNED NOT NULL AUTO_INCREMENT UNIQUE, owner VARCHAR(64) NOT NULL, \
                     expire_time DATETIME(6) NOT NULL) ENGINE=InnoDB"
                ),
            )
            .await?;
            Box::new(MySqlFencing {
                conn,
                insert: format!(
                    "INSERT INTO `{table}` (lock_key, owner, expire_time) \
                     SELECT ?, ?, UTC_TIMESTAMP(6) + INTERVAL {} SECOND FROM DUAL",
                    PEER_TTL.as_secs()
                ),
                delete: format!(
                    "DELETE FROM `{table}` WHERE lock_key = ? AND id = ? AND owner = ? \
                     AND expire_time > UTC_TIMESTAMP(6)"
                ),
                owner,
                held: HashMap::new(),
            })
        }
        other => return Err(BenchError::new(format!("{other:?} is not a fencing floor"))),
    })
}

struct RedisFencing {
    conn: redis::aio::MultiplexedConnection,
    acquire: redis::Script,
    release: redis::Script,
    prefix: String,
    owner: String,
    /// Key → token.
    held: HashMap<String, String>,
}

#[async_trait]
impl Locker for RedisFencing {
    async fn acquire(&mut self, key: &str, give_up: Instant) -> Result<bool, BenchError> {
        let state = format!("{}{key}", self.prefix);
        loop {
            let token: redis::Value = self
                .acquire
                .key(&state)
                .arg(&self.owner)
                .arg(PEER_TTL.as_millis() as u64)
                .arg(RETAIN_MS)
                .invoke_async(&mut self.conn)
                .await?;
            match token {
                redis::Value::BulkString(t) => {
                    let t = String::from_utf8(t).map_err(|_| {
                        BenchError::new("redis fencing floor: a token not in UTF-8")
                    })?;
                    self.held.insert(key.to_owned(), t);
                    return Ok(true);
                }
                redis::Value::Int(0) => {}
                other => {
                    return Err(BenchError::new(format!(
                        "redis fencing floor: unexpected acquire reply {other:?}"
                    )))
                }
            }
            if !super::pause_before_retry(give_up).await {
                return Ok(false);
            }
        }
    }

    async fn release(&mut self, key: &str) -> Result<(), BenchError> {
        let token = crate::runner::take_held(&mut self.held, key)?;
        let released: i64 = self
            .release
            .key(format!("{}{key}", self.prefix))
            .arg(&self.owner)
            .arg(&token)
            .arg(RETAIN_MS)
            .invoke_async(&mut self.conn)
            .await?;
        if released == 1 {
            Ok(())
        } else {
            Err(BenchError::new(format!(
                "redis fencing floor: `{key}` (token {token}) was no longer held at release"
            )))
        }
    }
}

struct MySqlFencing {
    conn: MySqlConnection,
    insert: String,
    delete: String,
    owner: String,
    /// Key → token.
    held: HashMap<String, u64>,
}

#[async_trait]
impl Locker for MySqlFencing {
    async fn acquire(&mut self, key: &str, give_up: Instant) -> Result<bool, BenchError> {
        loop {
            let done = sqlx::query(sqlx::AssertSqlSafe(self.insert.clone()))
                .bind(key)
                .bind(&self.owner)
                .execute(&mut self.conn)
                .await;
            match done {
                Ok(d) => {
                    self.held.insert(key.to_owned(), d.last_insert_id());
                    return Ok(true);
                }
                Err(sqlx::Error::Database(e)) if e.is_unique_violation() => {}
                Err(e) => return Err(e.into()),
            }
            if !super::pause_before_retry(give_up).await {
                return Ok(false);
            }
        }
    }

    async fn release(&mut self, key: &str) -> Result<(), BenchError> {
        let token = crate::runner::take_held(&mut self.held, key)?;
        let done = sqlx::query(sqlx::AssertSqlSafe(self.delete.clone()))
            .bind(key)
            .bind(token)
            .bind(&self.owner)
            .execute(&mut self.conn)
            .await?;
        if done.rows_affected() == 1 {
            Ok(())
        } else {
            Err(BenchError::new(format!(
                "mysql fencing floor: `{key}` (token {token}) was no longer held at release"
            )))
        }
    }
}
