//! Skips are declared: a case that skips without being listed fails (naming
//! the case and its reason), a listed case that runs fails, and a declared
//! skip passes — through `judge`, `Report::problems`, and the body of every
//! generated test.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{panic::AssertUnwindSafe, sync::Arc, time::Duration};

use async_trait::async_trait;
use fenced_api::{Capabilities, DistributedLock, MemoryLock, Result};
use fenced_conformance::{
    judge, run_case, DeclaredSkip, Failure, Harness, MemoryHarness, Outcome, Report, CASES,
};

const RESTART: &str = "c07_tokens_increase_after_restart";
const FIFO: &str = "c08_waiters_served_in_order";

/// `MemoryLock` declaring no fifo order: its capabilities make the fifo
/// case skip.
#[derive(Debug)]
struct NoFifo(MemoryLock);

#[async_trait]
impl DistributedLock for NoFifo {
    async fn try_acquire(
        &self,
        k: &fenced_api::LockKey,
        o: &fenced_api::LockOptions,
    ) -> Result<Option<fenced_api::Lease>> {
        self.0.try_acquire(k, o).await
    }
    async fn acquire(
        &self,
        k: &fenced_api::LockKey,
        o: &fenced_api::LockOptions,
    ) -> Result<fenced_api::Lease> {
        self.0.acquire(k, o).await
    }
    async fn extend(&self, l: &fenced_api::Lease, ttl: Duration) -> Result<fenced_api::Lease> {
        self.0.extend(l, ttl).await
    }
    async fn release(&self, l: &fenced_api::Lease) -> Result<fenced_api::ReleaseOutcome> {
        self.0.release(l).await
    }
    async fn inspect(&self, k: &fenced_api::LockKey) -> Result<Option<fenced_api::LockInfo>> {
        self.0.inspect(k).await
    }
    async fn force_release(&self, k: &fenced_api::LockKey) -> Result<bool> {
        self.0.force_release(k).await
    }
    fn capabilities(&self) -> Capabilities {
        self.0.capabilities().fifo(false)
    }
}

struct NoFifoHarness(MemoryHarness);

#[async_trait]
impl Harness for NoFifoHarness {
    async fn client(&self) -> Result<Arc<dyn DistributedLock>> {
        Ok(Arc::new(NoFifo(self.0.memory_client())))
    }
    async fn client_in_namespace(&self, suffix: &str) -> Result<Arc<dyn DistributedLock>> {
        self.0.client_in_namespace(suffix).await
    }
    fn base_ttl(&self) -> Duration {
        self.0.base_ttl()
    }
}

fn no_fifo() -> NoFifoHarness {
    NoFifoHarness(MemoryHarness::new())
}

/// The message of a failure, or a panic naming what came instead.
fn failure(result: fenced_conformance::CaseResult) -> String {
    match result {
        Err(Failure(message)) => message,
        other => panic!("expected a failure, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undeclared_skip_fails_naming_the_case_and_the_reason() {
    let h = no_fifo();
    let result = run_case(&h, FIFO).await;
    let Ok(Outcome::Skipped(why)) = &result else {
        panic!("the fifo case should skip on a backend declaring no fifo: {result:?}");
    };
    let message = failure(judge(FIFO, result.clone(), &[]));
    assert!(message.contains(FIFO), "{message}");
    assert!(message.contains(why.as_str()), "{message}");
    assert!(message.contains("without being declared"), "{message}");
    // Declaring another case does not cover it.
    let other = [DeclaredSkip::new(RESTART, "not durable")];
    assert!(judge(FIFO, result, &other).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declared_skip_passes() {
    let h = no_fifo();
    let declared = [DeclaredSkip::new(FIFO, "no fifo declared")];
    let result = run_case(&h, FIFO).await;
    assert!(
        matches!(judge(FIFO, result, &declared), Ok(Outcome::Skipped(_))),
        "a declared skip must pass as a skip"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declared_skip_that_runs_fails() {
    // MemoryLock declares fifo: the case runs and passes, so declaring it
    // skipped is a lie the judge reports.
    let h = MemoryHarness::new();
    let declared = [DeclaredSkip::new(FIFO, "stale declaration")];
    let result = run_case(&h, FIFO).await;
    assert_eq!(result, Ok(Outcome::Passed));
    let message = failure(judge(FIFO, result, &declared));
    assert!(message.contains(FIFO), "{message}");
    assert!(message.contains("stale declaration"), "{message}");
    assert!(message.contains("ran and passed"), "{message}");
    // A declared case that ran and failed keeps its own failure message.
    let failed = Err(Failure("tokens went down".into()));
    let message = failure(judge(FIFO, failed, &declared));
    assert!(message.contains("tokens went down"), "{message}");
    assert!(message.contains("instead of skipping"), "{message}");
}

#[test]
fn report_problems_judge_every_case_and_every_declaration() {
    let case = |name: &str| *CASES.iter().find(|c| c.name == name).unwrap();
    let report = Report {
        results: vec![
            (case("c01_free_key_grants_token"), Ok(Outcome::Passed)),
            (case(RESTART), Ok(Outcome::Skipped("not durable".into()))),
            (case(FIFO), Ok(Outcome::Skipped("no fifo".into()))),
        ],
    };
    let names = |declared: &[DeclaredSkip]| -> Vec<&str> {
        report.problems(declared).iter().map(|(n, _)| *n).collect()
    };
    let restart = DeclaredSkip::new(RESTART, "memory");
    let fifo = DeclaredSkip::new(FIFO, "no fifo");
    assert_eq!(names(&[]), [RESTART, FIFO]);
    assert_eq!(names(&[restart]), [FIFO]);
    assert!(names(&[restart, fifo]).is_empty());
    // Declared but it ran; and a declaration naming no case of the report.
    let c01 = DeclaredSkip::new("c01_free_key_grants_token", "wrong");
    let ghost = DeclaredSkip::new("c99_no_such_case", "typo");
    assert_eq!(
        names(&[restart, fifo, c01, ghost]),
        ["c01_free_key_grants_token", "c99_no_such_case"]
    );
}

/// The body of every generated test panics on an undeclared skip, with the
/// case and the reason in the message, and passes when it is declared.
#[test]
fn a_generated_test_fails_on_an_undeclared_skip() {
    let run = |declared: &'static [DeclaredSkip]| {
        std::panic::catch_unwind(AssertUnwindSafe(|| {
            fenced_conformance::__private::run_test(FIFO, declared, None, || async { no_fifo() })
        }))
    };
    let panic = run(&[]).expect_err("an undeclared skip must fail the test");
    let message = panic.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(message.contains(FIFO), "{message}");
    assert!(
        message.contains("the backend declares no fifo order for waiters"),
        "{message}"
    );
    const DECLARED: &[DeclaredSkip] = &[DeclaredSkip::new(FIFO, "no fifo declared")];
    assert!(run(DECLARED).is_ok(), "a declared skip must pass");
}

/// `without_semaphores` declares every semaphore and reader-writer case of
/// a store that has none skipped, and nothing else.
#[test]
fn without_semaphores_covers_exactly_the_semaphore_cases() {
    const S01: &str = "s01_permits_bound_holders";
    let run = |case: &'static str, none: Option<&'static str>| {
        std::panic::catch_unwind(AssertUnwindSafe(|| {
            fenced_conformance::__private::run_test(case, &[], none, || async { no_fifo() })
        }))
    };
    assert!(
        run(S01, None).is_err(),
        "a store without semaphores must fail s01 undeclared"
    );
    assert!(run(S01, Some("no semaphores here")).is_ok());
    assert!(run("rw03_writer_token_above_every_earlier_grant", Some("none")).is_ok());
    assert!(
        run(FIFO, Some("no semaphores here")).is_err(),
        "it must not cover other cases"
    );
    let semaphore_cases: Vec<&str> = CASES
        .iter()
        .map(|c| c.name)
        .filter(|n| fenced_conformance::is_semaphore_case(n))
        .collect();
    assert!(semaphore_cases.len() >= 16, "{semaphore_cases:?}");
    assert!(semaphore_cases
        .iter()
        .all(|n| n.starts_with('s') || n.starts_with("rw")));
}
