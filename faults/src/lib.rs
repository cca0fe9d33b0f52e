//! Fault injection for `fenced`: the tools that break things on
//! purpose, so the safety suite can show the locks still hold.
//!
//! * [`proxy`] — a TCP fault proxy between a client and a server (latency,
//!   one-way delay, blackhole without RST, connection cut, refused
//!   connections, a dropped reply);
//! * [`private`] — private server instances (MariaDB, redis-server, etcd
//!   single and 3-member, ZooKeeper standalone and a 3-member ensemble,
//!   PostgreSQL) on their own ports and data directories, so destructive
//!   tests never disturb the shared services;
//! * [`procs`] — client *processes* (the `fenced-faults-client` binary) for
//!   SIGSTOP, SIGKILL and skewed clocks, sharing the fenced resource and the
//!   history through a small TCP hub in the parent;
//! * [`servers`] — the server faults (restart, leader kill of an etcd
//!   cluster or a ZooKeeper ensemble, `KILL` of a MySQL lock connection or
//!   `pg_terminate_backend` of a PostgreSQL advisory holder, lock-conflict
//!   storms) on private servers;
//! * [`mutant`] — deliberately broken locks for control runs.
//!
//! Everything here targets loopback only and is bounded in count and time.
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

pub mod checks;
pub mod family;
pub mod history;
mod model;
pub mod mutant;
pub mod procs;
pub mod proxy;
pub mod report;
pub mod resource;
mod run;
pub mod scenario;
pub mod servers;
pub mod truth;

/// Private server instances and a throw-away certificate authority for the
/// TLS cases: the test-server kit's ([`fenced_testkit::private`]).
pub mod private {
    pub use fenced_testkit::private::{
        cluster_slot_owner, find_binary, free_port, send_signal, EtcdMember, EtcdOptions,
        MariaDbOptions, PostgresOptions, PrivateEtcd, PrivateMariaDb, PrivatePostgres,
        PrivateRedis, PrivateRedisCluster, PrivateSentinelGroup, PrivateZooKeeper, RedisOptions,
        RedisPersistence, TestCa, TlsFiles, ZooKeeperMember, ZooKeeperOptions, START_TIMEOUT,
    };
}
