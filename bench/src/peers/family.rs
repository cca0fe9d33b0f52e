//! Semaphore peers on Redis and MySQL/MariaDB: what users write without a
//! library that has semaphores. Neither fences (no token) and neither
//! brings a dead holder's permit back by itself; neither has a
//! reader-writer lock, so they run the semaphore cells only.

use std::{collections::HashMap, time::Duration};

use async_trait::async_trait;
use sqlx::{MySqlConnection, Row};
use tokio::time::Instant;

use crate::{
    runner::{Locker, Role},
    BenchError,
};

/// How often a waiter of the Redis counter looks again.
const REDIS_POLL: Duration = Duration::from_millis(5);

/// Takes a permit if fewer than `ARGV[1]` are taken (Redisson's
/// `RSemaphore` in spirit: one counter per key, changed by a script).
const TAKE: &str = "local n = tonumber(redis.call('get', KEYS[1]) or '0') \
                    if n < tonumber(ARGV[1]) then redis.call('incr', KEYS[1]) return 1 end \
                    return 0";

/// The Redis counter semaphore: a script takes a permit when the count of
/// taken ones is below N, `DECR` gives it back; a waiter polls every 5 ms.
pub(super) struct RedisCounter {
    pub(super) conn: redis::aio::MultiplexedConnection,
    pub(super) prefix: String,
}

#[async_trait]
impl Locker for RedisCounter {
    async fn acquire(&mut self, key: &str, give_up: Instant) -> Result<bool, BenchError> {
        self.acquire_as(key, Role::Permit(1), give_up).await
    }

    async fn acquire_as(
        &mut self,
        key: &str,
        role: Role,
        give_up: Instant,
    ) -> Result<bool, BenchError> {
        let Role::Permit(n) = role else {
            return Err(BenchError::new(
                "the Redis counter has no reader-writer lock",
            ));
        };
        let name = format!("{}{key}", self.prefix);
        let script = redis::Script::new(TAKE);
        loop {
            let got: i64 = script
                .key(&name)
                .arg(n)
                .invoke_async(&mut self.conn)
                .await?;
            if got == 1 {
                return Ok(true);
            }
            if Instant::now() >= give_up {
                return Ok(false);
            }
            tokio::time::sleep(REDIS_POLL).await;
        }
    }

    async fn release(&mut self, key: &str) -> Result<(), BenchError> {
        let name = format!("{}{key}", self.prefix);
        let left: i64 = redis::cmd("DECR")
            .arg(&name)
            .query_async(&mut self.conn)
            .await?;
        if left < 0 {
            return Err(BenchError::new(
                "DECR below zero: a permit given back twice",
            ));
        }
        Ok(())
    }
}

/// MySQL named locks as N slots: `GET_LOCK(slot, 0)` on each slot in turn;
/// all taken: `GET_LOCK(slot, wait)` on one slot (chosen by turns) in the
/// server's queue; `RELEASE_LOCK(slot)`.
pub(super) struct GetLockSlots {
    pub(super) conn: MySqlConnection,
    pub(super) prefix: String,
    pub(super) held: HashMap<String, String>,
    pub(super) turn: u32,
}

impl GetLockSlots {
    async fn get_lock(&mut self, name: &str, wait_s: f64) -> Result<bool, BenchError> {
        let row = sqlx::query("SELECT GET_LOCK(?, ?)")
            .bind(name)
            .bind(wait_s)
            .fetch_one(&mut self.conn)
            .await?;
        Ok(row.try_get::<Option<i64>, _>(0)? == Some(1))
    }
}

#[async_trait]
impl Locker for GetLockSlots {
    async fn acquire(&mut self, key: &str, give_up: Instant) -> Result<bool, BenchError> {
        self.acquire_as(key, Role::Permit(1), give_up).await
    }

    async fn acquire_as(
        &mut self,
        key: &str,
        role: Role,
        give_up: Instant,
    ) -> Result<bool, BenchError> {
        let Role::Permit(n) = role else {
            return Err(BenchError::new("GET_LOCK has no shared mode"));
        };
        let n = n.max(1);
        for slot in 0..n {
            let name = format!("{}{key}#{slot}", self.prefix);
            if self.get_lock(&name, 0.0).await? {
                self.held.insert(key.to_owned(), name);
                return Ok(true);
            }
        }
        self.turn = (self.turn + 1) % n;
        let name = format!("{}{key}#{}", self.prefix, self.turn);
        let wait = give_up.saturating_duration_since(Instant::now());
        if self.get_lock(&name, wait.as_secs_f64()).await? {
            self.held.insert(key.to_owned(), name);
            return Ok(true);
        }
        Ok(false)
    }

    async fn release(&mut self, key: &str) -> Result<(), BenchError> {
        let name = crate::runner::take_held(&mut self.held, key)?;
        let row = sqlx::query("SELECT RELEASE_LOCK(?)")
            .bind(&name)
            .fetch_one(&mut self.conn)
            .await?;
        if row.try_get::<Option<i64>, _>(0)? == Some(1) {
            Ok(())
        } else {
            Err(BenchError::new("RELEASE_LOCK: the slot was not held"))
        }
    }
}
