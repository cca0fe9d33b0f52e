//! Private etcd processes on free loopback ports with their own data dirs:
//! the test-server kit's [`PrivateEtcd`](fenced_testkit::private::PrivateEtcd),
//! started by member count.

use fenced_api::Result;
use fenced_testkit::private::{self as kit, EtcdOptions};

pub use fenced_testkit::private::EtcdMember as Member;

/// A private etcd (1 or 3 members). Processes die with it; `start_member`
/// and `restart` come from the kit's server through `Deref`.
pub struct PrivateEtcd {
    server: kit::PrivateEtcd,
    pub members: Vec<Member>,
}

impl PrivateEtcd {
    pub async fn start() -> Result<Self> {
        Self::start_cluster(1).await
    }

    pub async fn start_cluster(n: usize) -> Result<Self> {
        let server = kit::PrivateEtcd::start(EtcdOptions {
            members: n,
            ..EtcdOptions::default()
        })
        .await?;
        let members = server.members().to_vec();
        Ok(PrivateEtcd { server, members })
    }

    /// `h1:p1,h2:p2,…` of the client ports.
    pub fn hostport(&self) -> String {
        self.server.hostports()
    }

    /// SIGKILLs member `i`.
    pub async fn kill(&self, i: usize) {
        self.server.kill(i);
    }
}

impl std::ops::Deref for PrivateEtcd {
    type Target = kit::PrivateEtcd;

    fn deref(&self) -> &Self::Target {
        &self.server
    }
}
