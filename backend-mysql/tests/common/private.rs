//! A private MariaDB server (own datadir, own port) for tests that restart,
//! kill or reconfigure a server — never the shared one other tests use: the
//! test-server kit's [`PrivateMariaDb`](fenced_testkit::private::PrivateMariaDb),
//! started with extra server options instead of a full option set.

use fenced_api::Result;
use fenced_testkit::private::{self as kit, MariaDbOptions};

/// The kit's server (`url`, `restart`, `set_read_only`… through `Deref`).
pub struct PrivateMariaDb(kit::PrivateMariaDb);

impl PrivateMariaDb {
    /// Initialises a datadir and starts `mariadbd` on a free port.
    pub async fn start() -> Result<Self> {
        Self::start_with(&[]).await
    }

    /// As [`start`](Self::start), with extra server options.
    pub async fn start_with(extra: &[&str]) -> Result<Self> {
        let options = MariaDbOptions {
            extra: extra.iter().map(|s| (*s).to_owned()).collect(),
            ..MariaDbOptions::default()
        };
        kit::PrivateMariaDb::start(options).await.map(Self)
    }
}

impl std::ops::Deref for PrivateMariaDb {
    type Target = kit::PrivateMariaDb;

    fn deref(&self) -> &Self::Target {
        &self.0
    }
}
