//! The provider kit: the plumbing every [`Provider`](crate::Provider) repeats beside its own
//! logic, written once (vk-sandbox and vk-cocoon both stand on it).
//!
//! - [`Locked`]: the provider's pod table (and whatever it keeps beside it) behind one std
//!   mutex that no `await` ever holds, so a poisoned lock (a panic elsewhere) still guards whole
//!   data and is taken anyway.
//! - [`Notifier`]: where pushed status goes: the [`PodNotifier`] the runtime hands over in
//!   `notify_pods`, and a push made before that is dropped (logged).
//! - [`BackgroundLoops`]: the provider's periodic tasks; dropping the value stops them (what
//!   backs the Pods is never touched by a stop). [`interval`] is their one tick schedule.
//! - [`reported`]: a provider call's typed error as the runtime shows it (the whole chain as one
//!   message, [`ProviderError::reported`]).
//! - [`uid_of`]: a Pod's UID, empty when it has none.

use std::future::Future;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use tokio::task::JoinHandle;
use tracing::Instrument;

use crate::provider::{PodNotifier, ProviderError};

/// State behind a std mutex that is never held across an `await`: the data is whole at every
/// unlock, so [`Locked::lock`] takes a poisoned lock too.
#[derive(Debug, Default)]
pub struct Locked<T>(Mutex<T>);

impl<T> Locked<T> {
    pub fn new(value: T) -> Locked<T> {
        Locked(Mutex::new(value))
    }

    /// The guard; hold it for no `await`.
    pub fn lock(&self) -> MutexGuard<'_, T> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The provider's end of pushed status: empty until the runtime calls `notify_pods`.
#[derive(Debug, Default)]
pub struct Notifier(Locked<Option<PodNotifier>>);

impl Notifier {
    /// Stores the runtime's notifier (`Provider::notify_pods`).
    pub fn set(&self, notifier: PodNotifier) {
        *self.0.lock() = Some(notifier);
    }

    /// Pushes `pod` (a copy with its new status and annotations); dropped, and logged at debug,
    /// when no notifier was handed over yet.
    pub fn notify(&self, pod: Pod) {
        let n = self.0.lock().clone();
        match n {
            Some(n) => n.notify(pod),
            None => tracing::debug!("no notifier yet; status push dropped"),
        }
    }
}

/// The provider's background tasks; dropping this aborts them.
#[derive(Debug, Default)]
pub struct BackgroundLoops(Vec<JoinHandle<()>>);

impl BackgroundLoops {
    /// Spawns `task` on the current tokio runtime, in `span`.
    pub fn spawn(&mut self, span: tracing::Span, task: impl Future<Output = ()> + Send + 'static) {
        self.0.push(tokio::spawn(task.instrument(span)));
    }

    /// Runs `pass` every `period` (the first one period from now; see [`interval`]), in `span`,
    /// until dropped.
    pub fn every<F, Fut>(&mut self, period: Duration, span: tracing::Span, mut pass: F)
    where
        F: FnMut() -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send,
    {
        let mut tick = interval(period);
        self.spawn(span, async move {
            loop {
                tick.tick().await;
                pass().await;
            }
        });
    }

    /// How many tasks run.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl Drop for BackgroundLoops {
    fn drop(&mut self) {
        for h in &self.0 {
            h.abort();
        }
    }
}

/// A background loop's schedule: the first tick one `period` from now, then every `period`; a
/// pass that overruns delays the next tick rather than bunching them.
pub fn interval(period: Duration) -> tokio::time::Interval {
    let mut i = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    i
}

/// A provider call's result as the runtime takes it: the error's whole chain as one message.
pub fn reported<T, E: std::error::Error>(r: Result<T, E>) -> Result<T, ProviderError> {
    r.map_err(|e| ProviderError::reported(&e))
}

/// The Pod's UID (empty when it has none).
pub fn uid_of(pod: &Pod) -> String {
    pod.metadata.uid.clone().unwrap_or_default()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[test]
    fn a_poisoned_table_is_still_readable() {
        let t = Arc::new(Locked::new(7));
        let t2 = t.clone();
        let _ = std::thread::spawn(move || {
            let _g = t2.lock();
            panic!("poison it");
        })
        .join();
        assert_eq!(*t.lock(), 7);
    }

    #[tokio::test]
    async fn pushes_before_the_notifier_are_dropped_then_delivered() {
        let n = Notifier::default();
        n.notify(Pod::default());
        let (tx, mut rx) = PodNotifier::channel();
        n.set(tx);
        let mut p = Pod::default();
        p.metadata.uid = Some("u1".into());
        n.notify(p);
        assert_eq!(rx.try_recv().map(|p| uid_of(&p)).unwrap(), "u1");
        assert!(rx.try_recv().is_err(), "the early push was not queued");
    }

    #[tokio::test(start_paused = true)]
    async fn loops_tick_after_one_period_and_stop_when_dropped() {
        let runs = Arc::new(AtomicUsize::new(0));
        let mut loops = BackgroundLoops::default();
        let r = runs.clone();
        loops.every(Duration::from_secs(10), tracing::info_span!("t"), move || {
            let r = r.clone();
            async move {
                r.fetch_add(1, Ordering::SeqCst);
            }
        });
        assert_eq!(loops.len(), 1);
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(runs.load(Ordering::SeqCst), 0, "not at once");
        tokio::time::sleep(Duration::from_secs(21)).await;
        assert_eq!(runs.load(Ordering::SeqCst), 2);
        drop(loops);
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(runs.load(Ordering::SeqCst), 2, "stopped");
    }

    #[test]
    fn errors_are_reported_as_their_chain() {
        #[derive(Debug, thiserror::Error)]
        #[error("outer")]
        struct Outer(#[source] std::io::Error);
        let e = reported::<(), _>(Err(Outer(std::io::Error::other("inner")))).unwrap_err();
        assert_eq!(e.to_string(), "outer: inner");
    }
}
