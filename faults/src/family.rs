//! What a client of a family cell does differently from a mutex client:
//! which grant it asks for (a permit, a read, a write), and how it uses the
//! resource with it ([`Primitive`] says why each differs). Shared by the
//! in-process clients (`scenario.rs`) and the client processes
//! (`procs/child.rs`, through the hub).

use std::time::Duration;

use fenced_api::{LockClient, LockGuard, Result};

use crate::model::{Primitive, SEMAPHORE_PERMITS};

/// The grant a client asks for on one hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The mutex, or a reader-writer lock's writer.
    Exclusive,
    /// A reader of a reader-writer lock.
    Shared,
    /// One of a semaphore's permits.
    Permit,
}

impl Role {
    /// Whether it is `read`, `write` or `permit` in the history (the
    /// acquire's detail; empty for the mutex, as before the family).
    pub fn detail(self, primitive: Primitive) -> &'static str {
        match (primitive, self) {
            (Primitive::Mutex, _) => "",
            (_, Role::Exclusive) => "write",
            (_, Role::Shared) => "read",
            (_, Role::Permit) => "permit",
        }
    }

    /// The role an acquire's detail names (see [`Role::detail`]).
    pub fn from_detail(detail: &str) -> Role {
        match detail {
            "read" => Role::Shared,
            "permit" => Role::Permit,
            _ => Role::Exclusive,
        }
    }

    /// The next hold's role: a writer one time in three on a reader-writer
    /// lock, except the victim's hold that suffers the fault, which is a
    /// writer on even seeds and a reader on odd ones (so both a stale writer
    /// and a stale reader are tried across a cell's runs).
    pub fn pick(
        primitive: Primitive,
        faulted_hold: bool,
        seed: u64,
        rng: &mut fastrand::Rng,
    ) -> Role {
        match primitive {
            Primitive::Mutex => Role::Exclusive,
            Primitive::Semaphore => Role::Permit,
            Primitive::ReadWrite if faulted_hold => {
                if seed.is_multiple_of(2) {
                    Role::Exclusive
                } else {
                    Role::Shared
                }
            }
            Primitive::ReadWrite => {
                if rng.u8(0..3) == 0 {
                    Role::Exclusive
                } else {
                    Role::Shared
                }
            }
        }
    }
}

/// Acquires what `role` names on `key` (the client's wait policy).
pub async fn acquire(
    client: &LockClient,
    key: &str,
    primitive: Primitive,
    role: Role,
) -> Result<LockGuard> {
    match (primitive, role) {
        (Primitive::Mutex, _) => client.acquire(key).await,
        (_, Role::Permit) => client.semaphore(key, SEMAPHORE_PERMITS)?.acquire().await,
        (_, Role::Shared) => client.rw_lock(key)?.read().await,
        (_, Role::Exclusive) => client.rw_lock(key)?.write().await,
    }
}

/// How long a semaphore holder's permit must still be safely held for it to
/// start using the resource: more than the longest work (5 ms) with room
/// for a late wake-up.
pub const PERMIT_USE_MIN: Duration = Duration::from_millis(20);

/// Whether a semaphore holder may use the resource now: its permit is safely
/// held for at least [`PERMIT_USE_MIN`] more (the check a semaphore's user
/// makes before a side effect; skipped with fencing off).
pub fn permit_still_held(guard: &LockGuard, fencing: bool) -> bool {
    !fencing || guard.valid_for() > PERMIT_USE_MIN
}

/// The capacity the resource allows at once in a semaphore cell.
pub fn capacity() -> usize {
    SEMAPHORE_PERMITS as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_round_trip_through_the_history_detail() {
        for role in [Role::Exclusive, Role::Shared, Role::Permit] {
            assert_eq!(Role::from_detail(role.detail(Primitive::ReadWrite)), role);
        }
        assert_eq!(Role::Exclusive.detail(Primitive::Mutex), "");
        let mut rng = fastrand::Rng::with_seed(1);
        assert_eq!(
            Role::pick(Primitive::ReadWrite, true, 2, &mut rng),
            Role::Exclusive
        );
        assert_eq!(
            Role::pick(Primitive::ReadWrite, true, 3, &mut rng),
            Role::Shared
        );
        let writers = (0..300)
            .filter(|_| Role::pick(Primitive::ReadWrite, false, 0, &mut rng) == Role::Exclusive)
            .count();
        assert!((50..150).contains(&writers), "{writers} writers of 300");
    }
}
