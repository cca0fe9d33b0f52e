//! Every example, run against the real stores (`scripts/services.sh`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use fenced_conformance::services;

fn increasing(tokens: &[u64]) -> bool {
    tokens.windows(2).all(|w| w[1] > w[0])
}

async fn sqlite_url() -> String {
    let dir =
        std::env::temp_dir().join(format!("fenced-examples-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    format!("sqlite://{}/locks.db", dir.display())
}

async fn mysql(strategy: &str) -> String {
    let base = services::mysql_url();
    services::probe_mysql(&base)
        .await
        .unwrap_or_else(|m| panic!("{m}"));
    let url = format!(
        "{base}?strategy={strategy}&table=fenced_ex_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    fenced::migrate(&url).await.unwrap();
    url
}

async fn redis() -> String {
    let base = services::redis_url();
    services::probe_redis(&base)
        .await
        .unwrap_or_else(|m| panic!("{m}"));
    format!(
        "{base}/0?prefix=fenced-ex-{}",
        uuid::Uuid::new_v4().simple()
    )
}

/// Every shareable store compiled in (not `memory://`: each connect to it
/// makes a new, private store). The swap-by-config example runs on each.
async fn every_store() -> Vec<String> {
    let mut urls = vec![sqlite_url().await];
    for s in ["unique_key", "row_lock", "optimistic"] {
        urls.push(mysql(s).await);
    }
    urls.push(redis().await);
    if fenced::drivers().iter().any(|d| d.name == "etcd") {
        let base = services::etcd_url();
        services::probe_etcd(&base)
            .await
            .unwrap_or_else(|m| panic!("{m}"));
        let hp = services::host_port(&base, 2379).unwrap();
        urls.push(format!(
            "etcd://{hp}/fenced-ex-{}",
            uuid::Uuid::new_v4().simple()
        ));
    }
    urls
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quickstart_on_the_embedded_default() {
    let url = sqlite_url().await;
    let first = fenced_examples::quickstart(&url).await.unwrap();
    let second = fenced_examples::quickstart(&url).await.unwrap();
    assert!(second > first);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swap_by_config_runs_unchanged_on_every_store() {
    for url in every_store().await {
        let tokens = fenced_examples::swap_by_config(&url, 4, 3)
            .await
            .unwrap_or_else(|e| panic!("{url}: {e}"));
        assert_eq!(tokens.len(), 12, "{url}");
        assert!(increasing(&tokens), "{url}: {tokens:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cron_job_runs_exactly_once_per_tick() {
    for url in [sqlite_url().await, redis().await, mysql("unique_key").await] {
        let ran = fenced_examples::cron_job(&url, 5, 4).await.unwrap();
        assert_eq!(ran, vec![1, 1, 1, 1], "{url}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_mysql_to_redis_keeps_exclusion_and_increasing_tokens() {
    let phases =
        fenced_examples::migrate_mysql_to_redis(&mysql("unique_key").await, &redis().await, 3)
            .await
            .unwrap();
    assert_eq!(phases.len(), 5);
    let all: Vec<u64> = phases.iter().flat_map(|p| p.tokens.clone()).collect();
    assert_eq!(all.len(), 5 * 6);
    assert!(increasing(&all), "{phases:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_row_lock_commits_and_rolls_back_with_the_release() {
    let base = services::mysql_url();
    services::probe_mysql(&base)
        .await
        .unwrap_or_else(|m| panic!("{m}"));
    assert_eq!(
        fenced_examples::transactional_row_lock(&base)
            .await
            .unwrap(),
        (1, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_resource_rejects_the_paused_ex_holder() {
    let base = services::mysql_url();
    services::probe_mysql(&base)
        .await
        .unwrap_or_else(|m| panic!("{m}"));
    for lock in [redis().await, mysql("unique_key").await] {
        let (a, b, state) = fenced_examples::fenced_resource(&lock, &base)
            .await
            .unwrap();
        assert_eq!((a, b, state.as_str()), (false, true, "B"), "{lock}");
    }
}
