//! Test servers for fenced's own tests.
//!
//! * [`services`]: where the shared test services are (`FENCED_TEST_*`
//!   variables, defaulting to what `scripts/services.sh` starts) and their
//!   reachability probes;
//! * [`shared`]: a shared service's address once its probe passed, or the
//!   message (naming `scripts/services.sh`) a test fails with;
//! * [`private`]: private server instances (MariaDB, redis-server, etcd,
//!   ZooKeeper, PostgreSQL, and a throw-away certificate authority for TLS)
//!   on their own ports and data directories, for tests that restart, kill
//!   or reconfigure a server;
//! * [`run_name`] and [`namespace_suffix`]: names that keep one test
//!   process's data apart from every other's on a shared server.
//!
//! The server kinds are features (`mysql`, `redis`, `etcd`, `zookeeper`,
//! `postgres`, `tls`), so a backend's tests compile the client crate of
//! their own store only.

pub mod private;
pub mod shared;

/// The shared services' addresses and reachability probes.
pub use fenced_conformance::services;

use std::{
    collections::HashMap,
    sync::{Mutex, OnceLock, PoisonError},
};

/// Twelve hex digits drawn once per process.
fn run_id() -> &'static str {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| uuid::Uuid::new_v4().simple().to_string()[..12].to_owned())
}

/// `prefix` followed by an id drawn once per test process: the same string
/// on every call in one process, a different one in every other process.
/// For a table name or key prefix that keeps a test binary's data apart on a
/// shared server.
pub fn run_name(prefix: &str) -> &'static str {
    static NAMES: Mutex<Option<HashMap<String, &'static str>>> = Mutex::new(None);
    let mut names = NAMES.lock().unwrap_or_else(PoisonError::into_inner);
    names
        .get_or_insert_with(HashMap::new)
        .entry(prefix.to_owned())
        // One small string per distinct prefix, kept for the process.
        .or_insert_with(|| Box::leak(format!("{prefix}{}", run_id()).into_boxed_str()))
}

/// `suffix` with every character but ASCII letters and digits replaced by
/// `_`: safe in a table name, a key prefix or a URL.
pub fn namespace_suffix(suffix: &str) -> String {
    suffix
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_names_are_stable_per_prefix() {
        let a = run_name("fenced_t_");
        assert_eq!(a, run_name("fenced_t_"));
        assert!(
            a.starts_with("fenced_t_") && a.len() == "fenced_t_".len() + 12,
            "{a}"
        );
        let b = run_name("fenced-t-");
        assert_eq!(a["fenced_t_".len()..], b["fenced-t-".len()..]);
    }

    #[test]
    fn namespace_suffixes_keep_letters_and_digits_only() {
        assert_eq!(namespace_suffix("C7/a-b.c9"), "C7_a_b_c9");
        assert_eq!(namespace_suffix(""), "");
        assert_eq!(namespace_suffix("é"), "_");
    }
}
