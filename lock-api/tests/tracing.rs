//! The tracing `LockClient` emits around waiting: a `fenced.wait` span when
//! an acquire may wait, and a debug event with `waited_ms` when it times out.
//! Recorded with a small `tracing_subscriber` layer, on a paused clock.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    fmt::Write as _,
    sync::{Arc, Mutex},
    time::Duration,
};

use fenced_api::{Error, LockClient, MemoryLock, WaitPolicy};
use tracing::{
    field::{Field, Visit},
    span, Event, Subscriber,
};
use tracing_subscriber::{layer::Context, prelude::*, Layer};

/// Spans opened and events emitted, as `name: field=value …` lines.
#[derive(Clone, Default)]
struct Recorder {
    spans: Arc<Mutex<Vec<String>>>,
    events: Arc<Mutex<Vec<String>>>,
}

#[derive(Default)]
struct Fields(String);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, " {}={:?}", field.name(), value);
    }
}

impl<S: Subscriber> Layer<S> for Recorder {
    fn on_new_span(&self, attrs: &span::Attributes<'_>, _: &span::Id, _: Context<'_, S>) {
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        let line = format!("{}:{}", attrs.metadata().name(), fields.0);
        self.spans.lock().unwrap().push(line);
    }

    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        let line = format!("{}:{}", event.metadata().level(), fields.0);
        self.events.lock().unwrap().push(line);
    }
}

/// Runs `body` on a paused current-thread runtime with the recorder installed.
fn recorded<F: std::future::Future<Output = ()>>(body: impl FnOnce() -> F) -> Recorder {
    let recorder = Recorder::default();
    let subscriber = tracing_subscriber::registry().with(recorder.clone());
    let _default = tracing::subscriber::set_default(subscriber);
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap()
        .block_on(body());
    recorder
}

fn client(store: &MemoryLock, wait: WaitPolicy) -> LockClient {
    LockClient::builder(Arc::new(store.clone()))
        .ttl(Duration::from_secs(30))
        .wait(wait)
        .build()
        .unwrap()
}

fn lines(v: &Arc<Mutex<Vec<String>>>) -> Vec<String> {
    v.lock().unwrap().clone()
}

#[test]
fn a_timed_out_wait_has_a_wait_span_and_a_debug_event_with_waited_ms() {
    let rec = recorded(|| async {
        let store = MemoryLock::new();
        let holder = client(&store, WaitPolicy::Forever)
            .acquire("k")
            .await
            .unwrap();
        let waiter = client(&store, WaitPolicy::Timeout(Duration::from_secs(2)));
        match waiter.acquire("k").await {
            Err(Error::Timeout { .. }) => {}
            other => panic!("expected a timeout, got {other:?}"),
        }
        holder.release().await.unwrap();
    });
    let spans = lines(&rec.spans);
    let waits: Vec<&String> = spans
        .iter()
        .filter(|s| s.starts_with("fenced.wait:"))
        .collect();
    // The holder's uncontended acquire may wait too (policy Forever), so
    // two wait spans; the waiter's carries its bound.
    assert!(
        waits
            .iter()
            .any(|s| s.contains("key=k") && s.contains("timeout_ms=2000")),
        "{spans:#?}"
    );
    let events = lines(&rec.events);
    let timed_out: Vec<&String> = events
        .iter()
        .filter(|e| e.contains("lock acquire timed out"))
        .collect();
    assert_eq!(timed_out.len(), 1, "{events:#?}");
    let event = timed_out[0];
    assert!(event.starts_with("DEBUG:"), "{event}");
    assert!(event.contains("key=k"), "{event}");
    let waited: u64 = event
        .split(" waited_ms=")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no waited_ms in {event}"));
    assert!(waited >= 2000, "{event}");
}

#[test]
fn try_acquire_and_nowait_open_no_wait_span() {
    let rec = recorded(|| async {
        let store = MemoryLock::new();
        let c = client(&store, WaitPolicy::NoWait);
        let g = c.try_acquire("k").await.unwrap().unwrap();
        let other = client(&store, WaitPolicy::NoWait);
        assert!(other.try_acquire("k").await.unwrap().is_none());
        assert!(matches!(
            other.acquire("k").await,
            Err(Error::Timeout { .. })
        ));
        g.release().await.unwrap();
    });
    let spans = lines(&rec.spans);
    assert!(
        spans.iter().any(|s| s.starts_with("fenced.acquire:")),
        "{spans:#?}"
    );
    assert!(
        !spans.iter().any(|s| s.starts_with("fenced.wait:")),
        "{spans:#?}"
    );
    // A NoWait acquire that finds the key held is a timeout too.
    let events = lines(&rec.events);
    assert_eq!(
        events
            .iter()
            .filter(|e| e.contains("lock acquire timed out"))
            .count(),
        1,
        "{events:#?}"
    );
}

#[test]
fn a_wait_that_ends_in_a_grant_has_a_wait_span_and_no_timeout_event() {
    let rec = recorded(|| async {
        let store = MemoryLock::new();
        let holder = client(&store, WaitPolicy::NoWait)
            .acquire("k")
            .await
            .unwrap();
        let waiter = client(&store, WaitPolicy::Forever);
        let task = tokio::spawn(async move { waiter.acquire("k").await.map(|g| g.token()) });
        tokio::time::sleep(Duration::from_secs(1)).await;
        holder.release().await.unwrap();
        task.await.unwrap().unwrap();
    });
    let spans = lines(&rec.spans);
    assert!(
        spans
            .iter()
            .any(|s| s.starts_with("fenced.wait:") && s.contains("key=k")),
        "{spans:#?}"
    );
    let events = lines(&rec.events);
    assert!(
        !events.iter().any(|e| e.contains("timed out")),
        "{events:#?}"
    );
}
