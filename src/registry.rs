//! Choosing the store by URL: an explicit list of the drivers compiled in.

use std::sync::Arc;

use fenced_api::{DistributedLock, Driver, Error, MemoryLock, Result};

/// Every scheme fenced knows, with the cargo feature that provides it.
const KNOWN: &[(&str, &str)] = &[
    ("memory", "(always built in)"),
    ("sqlite", "sqlite"),
    ("mysql", "mysql"),
    ("mariadb", "mysql"),
    ("redis", "redis"),
    ("rediss", "redis"),
    ("redis+sentinel", "redis"),
    ("redis+cluster", "redis"),
    ("rediss+cluster", "redis"),
    ("etcd", "etcd"),
    ("etcds", "etcd"),
    ("zk", "zookeeper"),
    ("zookeeper", "zookeeper"),
    ("zks", "zookeeper"),
    ("zookeeper+tls", "zookeeper"),
    ("postgres", "postgres"),
    ("postgresql", "postgres"),
];

/// The drivers compiled into this build (by cargo feature).
pub fn drivers() -> Vec<Driver> {
    #[allow(unused_mut)]
    let mut list = vec![MemoryLock::driver()];
    #[cfg(feature = "sqlite")]
    list.push(fenced_sqlite::driver());
    #[cfg(feature = "mysql")]
    list.push(fenced_mysql::driver());
    #[cfg(feature = "redis")]
    list.push(fenced_redis::driver());
    #[cfg(feature = "etcd")]
    list.push(fenced_etcd::driver());
    #[cfg(feature = "zookeeper")]
    list.push(fenced_zookeeper::driver());
    #[cfg(feature = "postgres")]
    list.push(fenced_postgres::driver());
    list
}

/// The driver for `url`, or an error that says which feature to enable.
///
/// # Errors
///
/// [`Error::Config`] for a URL without a scheme, an unknown scheme, or a
/// scheme whose backend was not compiled in (naming the cargo feature).
pub fn driver_for(url: &str) -> Result<Driver> {
    driver_for_in(drivers(), url)
}

/// [`driver_for`] over an explicit list of drivers: the lookup itself, kept
/// apart from the build's features so that its "enable the feature" errors
/// are tested in every build.
fn driver_for_in(drivers: Vec<Driver>, url: &str) -> Result<Driver> {
    let Some((scheme, _)) = url.split_once("://") else {
        // Not echoed: a malformed URL may still carry a password.
        return Err(Error::config(
            "the store URL has no scheme; expected e.g. sqlite:///var/lib/app/locks.db, \
             mysql://user@host/db, redis://host, etcd://host:2379/prefix",
        ));
    };
    if let Some(d) = drivers.into_iter().find(|d| d.schemes.contains(&scheme)) {
        return Ok(d);
    }
    match KNOWN.iter().find(|(s, _)| *s == scheme) {
        Some((_, feature)) => Err(Error::config(format!(
            "the `{scheme}://` store needs fenced built with the `{feature}` cargo feature"
        ))),
        None => Err(Error::config(format!(
            "unknown store scheme `{scheme}`; known: {}",
            KNOWN.iter().map(|(s, _)| *s).collect::<Vec<_>>().join(", ")
        ))),
    }
}

/// Connects to the store named by `url` and returns it behind the trait.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> fenced::Result<()> {
/// let store = fenced::connect("memory://").await?;
/// let client = fenced::LockClient::new(store);
/// let guard = client.acquire("job").await?;
/// # guard.release().await?;
/// # Ok(()) }
/// ```
///
/// # Errors
///
/// As [`driver_for`], then whatever the backend's connect returns
/// (`Error::Backend` when the store is unreachable, `Error::Config` for a
/// missing schema, naming the migrate command).
pub async fn connect(url: &str) -> Result<Arc<dyn DistributedLock>> {
    let driver = driver_for(url)?;
    (driver.connect)(url.to_owned()).await
}

/// Creates or upgrades the schema of the store named by `url` (SQL stores;
/// for the others it only checks the URL and returns `Ok(false)`). Idempotent.
///
/// # Errors
///
/// As [`connect`].
pub async fn migrate(url: &str) -> Result<bool> {
    let driver = driver_for(url)?;
    match driver.migrate {
        Some(m) => m(url.to_owned()).await.map(|()| true),
        None => {
            // Nothing to create, but a malformed URL is still an error: a
            // deployment script that runs `fenced migrate` first should
            // learn about a typo there, not at the first lock.
            check_url(driver.name, url)?;
            Ok(false)
        }
    }
}

/// Parses the URL of a store without a schema, without connecting.
fn check_url(driver: &str, url: &str) -> Result<()> {
    match driver {
        "memory" => MemoryLock::check_url(url),
        #[cfg(feature = "redis")]
        "redis" => fenced_redis::RedisConfig::from_url(url).map(drop),
        #[cfg(feature = "etcd")]
        "etcd" => fenced_etcd::EtcdConfig::from_url(url).map(drop),
        #[cfg(feature = "zookeeper")]
        "zookeeper" => fenced_zookeeper::ZkConfig::from_url(url).map(drop),
        _ => Ok(()),
    }
}

/// The store used when no URL is configured: `$FENCED_URL`, else the
/// per-user embedded SQLite file (see `fenced_sqlite::SqliteLock::default_path`).
///
/// # Errors
///
/// [`Error::Config`] when neither is available (no `sqlite` feature and no
/// `FENCED_URL`, or no home directory to put the file in), or when
/// `FENCED_URL` is set but not valid UTF-8.
pub fn default_url() -> Result<String> {
    match std::env::var("FENCED_URL") {
        Ok(url) if !url.trim().is_empty() => return Ok(url),
        // Set but unreadable: falling back to the local file would silently
        // split the fleet between two stores.
        Err(std::env::VarError::NotUnicode(_)) => {
            return Err(Error::config(
                "FENCED_URL is not valid UTF-8; fix the variable (the URL is not shown: it may hold a password)",
            ))
        }
        _ => {}
    }
    #[cfg(feature = "sqlite")]
    {
        fenced_sqlite::SqliteLock::default_url()
    }
    #[cfg(not(feature = "sqlite"))]
    {
        Err(Error::config(
            "no store configured: set FENCED_URL (this build has no `sqlite` feature for the embedded default)",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fenced_api::url::redact;

    #[test]
    fn schemes_table() {
        // (url, Ok(driver name) | Err(substring of the message))
        let cases: &[(&str, std::result::Result<&str, &str>)] = &[
            ("memory://", Ok("memory")),
            #[cfg(feature = "mysql")]
            (
                "mysql://root@127.0.0.1:3306/test?strategy=row_lock",
                Ok("mysql"),
            ),
            #[cfg(feature = "mysql")]
            ("mariadb://root@h/db", Ok("mysql")),
            #[cfg(feature = "etcd")]
            ("etcd://h1:2379,h2:2379/prefix", Ok("etcd")),
            #[cfg(feature = "etcd")]
            ("etcds://h1:2379/prefix", Ok("etcd")),
            #[cfg(not(feature = "etcd"))]
            ("etcds://h1:2379/prefix", Err("`etcd` cargo feature")),
            #[cfg(feature = "redis")]
            ("redis://127.0.0.1:6379/0", Ok("redis")),
            #[cfg(feature = "sqlite")]
            ("sqlite:///var/lib/app/locks.db?table=jobs", Ok("sqlite")),
            #[cfg(not(feature = "etcd"))]
            ("etcd://h:2379/p", Err("`etcd` cargo feature")),
            #[cfg(feature = "redis")]
            ("rediss://:pw@cache:6380", Ok("redis")),
            #[cfg(feature = "redis")]
            ("redis+sentinel://s1:26379,s2/mymaster", Ok("redis")),
            #[cfg(feature = "redis")]
            ("redis+cluster://h1:7000,h2:7001", Ok("redis")),
            #[cfg(feature = "redis")]
            ("rediss+cluster://h1:7000,h2:7001", Ok("redis")),
            #[cfg(not(feature = "mysql"))]
            ("mysql://h/db", Err("`mysql` cargo feature")),
            #[cfg(feature = "zookeeper")]
            ("zookeeper://h", Ok("zookeeper")),
            #[cfg(feature = "zookeeper")]
            ("zk://h1:2181,h2/apps/locks", Ok("zookeeper")),
            #[cfg(feature = "zookeeper")]
            (
                "zks://h1:2281/apps/locks?ca=/etc/zk/ca.pem",
                Ok("zookeeper"),
            ),
            #[cfg(feature = "zookeeper")]
            ("zookeeper+tls://h1:2281?ca=/etc/zk/ca.pem", Ok("zookeeper")),
            #[cfg(not(feature = "zookeeper"))]
            ("zk://h:2181", Err("`zookeeper` cargo feature")),
            #[cfg(not(feature = "zookeeper"))]
            ("zks://h:2281", Err("`zookeeper` cargo feature")),
            #[cfg(feature = "postgres")]
            (
                "postgres://app@db:5432/locks?strategy=advisory",
                Ok("postgres"),
            ),
            #[cfg(feature = "postgres")]
            ("postgresql://app@db/locks", Ok("postgres")),
            #[cfg(not(feature = "postgres"))]
            ("postgresql://db/locks", Err("`postgres` cargo feature")),
            ("consul://h", Err("unknown store scheme `consul`")),
            ("just-a-path", Err("has no scheme")),
            ("", Err("has no scheme")),
        ];
        for (url, want) in cases {
            match (driver_for(url), want) {
                (Ok(d), Ok(name)) => assert_eq!(d.name, *name, "{url}"),
                (Err(e), Err(msg)) => assert!(e.to_string().contains(msg), "{url}: {e}"),
                (got, want) => panic!("{url}: got {got:?}, want {want:?}"),
            }
        }
    }

    /// The errors of a build without a backend, in every build: the lookup
    /// over a list that lacks drivers names the feature to enable.
    #[test]
    fn a_scheme_whose_driver_is_not_built_names_its_feature() {
        let only_memory = || vec![MemoryLock::driver()];
        for (url, feature) in [
            ("sqlite:///tmp/locks.db", "sqlite"),
            ("mysql://u:hunter2@h/db", "mysql"),
            ("mariadb://h/db", "mysql"),
            ("redis://h", "redis"),
            ("rediss://h", "redis"),
            ("redis+sentinel://s1/mymaster", "redis"),
            ("redis+cluster://h1:7000", "redis"),
            ("rediss+cluster://h1:7000", "redis"),
            ("etcd://h:2379/p", "etcd"),
            ("etcds://h:2379/p", "etcd"),
            ("zk://h:2181/p", "zookeeper"),
            ("zks://h:2281/p", "zookeeper"),
            ("zookeeper+tls://h:2281/p", "zookeeper"),
            ("postgres://u:hunter2@h/db", "postgres"),
            ("postgresql://h/db", "postgres"),
        ] {
            let e = driver_for_in(only_memory(), url).unwrap_err().to_string();
            assert!(
                e.contains(&format!(
                    "needs fenced built with the `{feature}` cargo feature"
                )),
                "{url}: {e}"
            );
            assert!(!e.contains("hunter2"), "{e}");
        }
        assert_eq!(
            driver_for_in(only_memory(), "memory://").unwrap().name,
            "memory"
        );
        // Every scheme a compiled-in driver serves is in the table of known
        // schemes, so a build without it gets the feature error, not
        // "unknown scheme".
        for d in drivers() {
            for scheme in d.schemes {
                assert!(
                    KNOWN.iter().any(|(s, _)| s == scheme),
                    "`{scheme}` of {} is missing from KNOWN",
                    d.name
                );
            }
        }
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(redact("mysql://u:hunter2@h/db"), "mysql://u:***@h/db");
        assert_eq!(redact("redis://:hunter2@h:6379/0"), "redis://:***@h:6379/0");
        assert_eq!(redact("etcd://h:2379/p"), "etcd://h:2379/p");
        let e = driver_for("nope://u:hunter2@h").unwrap_err().to_string();
        assert!(!e.contains("hunter2"), "{e}");
        let e = driver_for("u:hunter2@h").unwrap_err().to_string();
        assert!(!e.contains("hunter2"), "{e}");
    }

    #[tokio::test]
    async fn memory_connects_and_migrate_is_a_no_op() {
        let store = connect("memory://").await.unwrap();
        assert_eq!(store.capabilities().backend_name(), "memory");
        assert!(!migrate("memory://").await.unwrap());
    }
}
