//! The pod controller's work queue: keyed, deduplicating, with per-key exponential backoff and
//! a shared token bucket (client-go's `DefaultControllerRateLimiter` semantics as
//! virtual-kubelet uses them).
//!
//! - A key is queued at most once; adding a queued key keeps the earlier due time.
//! - A key is handed to one worker at a time. Adding it while a worker has it marks it dirty:
//!   it is queued again when the worker calls [`WorkQueue::done`].
//! - [`WorkQueue::retry`] records a failure and requeues the key after [`backoff`] (5 ms
//!   doubling to 1000 s) until it failed [`MAX_RETRIES`] times in a row, then drops it (the
//!   caller logs); [`WorkQueue::forget`] resets the count after a success.
//! - Every item handed out first takes a token from the queue's bucket ([`bucket_spec`]:
//!   qps < 0 = no bucket, qps 0 = client-go's 5/10).
//!
//! [`State`] is the pure bookkeeping (time passed in); [`WorkQueue`] wraps it for async workers.

use governor::clock::{Clock, DefaultClock};
use governor::middleware::NoOpMiddleware;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::hash::Hash;
use std::num::NonZeroU32;
use std::sync::{Mutex, OnceLock};

use prometheus_client::metrics::histogram::Histogram;
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

/// Failures in a row after which a key is dropped (virtual-kubelet `MaxRetries`).
pub const MAX_RETRIES: u32 = 20;
/// The first retry delay.
pub const BACKOFF_BASE: Duration = Duration::from_millis(5);
/// The longest retry delay.
pub const BACKOFF_MAX: Duration = Duration::from_secs(1000);

/// The delay before the retry that follows `failures` earlier failures: 5 ms × 2^failures,
/// capped at 1000 s.
pub fn backoff(failures: u32) -> Duration {
    let factor = 2u64.checked_pow(failures).unwrap_or(u64::MAX);
    let ms = 5u64.saturating_mul(factor);
    Duration::from_millis(ms).min(BACKOFF_MAX)
}

/// A token bucket's rate and burst.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BucketSpec {
    pub qps: f64,
    pub burst: u32,
}

/// The bucket for `--kube-api-qps`/`--kube-api-burst`: `qps < 0` → none (per-key backoff
/// only); `qps == 0` (or NaN) → client-go's default 5 qps / burst 10; otherwise `qps` with
/// `burst` (at least 1).
pub fn bucket_spec(qps: f64, burst: u32) -> Option<BucketSpec> {
    if qps < 0.0 {
        None
    } else if qps == 0.0 || qps.is_nan() {
        Some(BucketSpec { qps: 5.0, burst: 10 })
    } else {
        Some(BucketSpec { qps, burst: burst.max(1) })
    }
}

/// A token bucket (governor's GCRA) that says how long until the next token.
pub struct Bucket<C: Clock = DefaultClock> {
    limiter: RateLimiter<NotKeyed, InMemoryState, C, NoOpMiddleware<C::Instant>>,
}

impl Bucket<DefaultClock> {
    pub fn new(spec: BucketSpec) -> Bucket<DefaultClock> {
        Bucket::with_clock(spec, DefaultClock::default())
    }
}

impl<C: Clock> Bucket<C> {
    pub fn with_clock(spec: BucketSpec, clock: C) -> Bucket<C> {
        // One token every 1/qps, clamped to [1 ns, 1 day] so any finite or infinite rate works.
        let period = Duration::try_from_secs_f64(1.0 / spec.qps)
            .unwrap_or(Duration::from_secs(86_400))
            .clamp(Duration::from_nanos(1), Duration::from_secs(86_400));
        let burst = NonZeroU32::new(spec.burst).unwrap_or(NonZeroU32::MIN);
        let quota = Quota::with_period(period).unwrap_or_else(|| Quota::per_second(NonZeroU32::MIN));
        Bucket { limiter: RateLimiter::direct_with_clock(quota.allow_burst(burst), clock) }
    }

    /// Takes a token now, or says how long until one is available (nothing taken then).
    pub fn try_take(&self) -> Result<(), Duration> {
        self.limiter.check().map_err(|not_until| not_until.wait_time_from(self.limiter.clock().now()))
    }
}

/// What [`State::pop`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Pop<K> {
    /// A key, now marked as being processed.
    Key(K),
    /// Nothing due before this instant.
    WaitUntil(Instant),
    /// Nothing queued.
    Empty,
    /// The queue was shut down.
    Shutdown,
}

/// What happens to a key after a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// Requeued; due after this delay.
    After(Duration),
    /// Dropped after this many failures in a row.
    Dropped { failures: u32 },
}

/// The queue's bookkeeping, with time passed in (pure, unit-tested).
#[derive(Debug)]
pub struct State<K> {
    ready: VecDeque<K>,
    ready_set: HashSet<K>,
    delayed: BTreeMap<(Instant, u64), K>,
    delayed_at: HashMap<K, (Instant, u64)>,
    processing: HashSet<K>,
    /// Added while processing: queue again at this time once done.
    dirty: HashMap<K, Instant>,
    failures: HashMap<K, u32>,
    /// When each queued key became (or becomes) due: the start of its wait.
    due: HashMap<K, Instant>,
    seq: u64,
    shut: bool,
}

impl<K: Clone + Eq + Hash> Default for State<K> {
    fn default() -> Self {
        State {
            ready: VecDeque::new(),
            ready_set: HashSet::new(),
            delayed: BTreeMap::new(),
            delayed_at: HashMap::new(),
            processing: HashSet::new(),
            dirty: HashMap::new(),
            failures: HashMap::new(),
            due: HashMap::new(),
            seq: 0,
            shut: false,
        }
    }
}

impl<K: Clone + Eq + Hash> State<K> {
    /// Queues `key` to be due at `when`. Returns whether a waiting worker may have something
    /// new to look at.
    pub fn add_at(&mut self, key: K, when: Instant, now: Instant) -> bool {
        if self.shut {
            return false;
        }
        if self.processing.contains(&key) {
            let at = self.dirty.entry(key).or_insert(when);
            *at = (*at).min(when);
            return false;
        }
        if self.ready_set.contains(&key) {
            return false;
        }
        if let Some(&(at, seq)) = self.delayed_at.get(&key) {
            if when >= at {
                return false;
            }
            self.delayed.remove(&(at, seq));
            self.delayed_at.remove(&key);
        }
        self.due.insert(key.clone(), when);
        if when <= now {
            self.ready_set.insert(key.clone());
            self.ready.push_back(key);
        } else {
            self.seq += 1;
            self.delayed_at.insert(key.clone(), (when, self.seq));
            self.delayed.insert((when, self.seq), key);
        }
        true
    }

    /// Hands out the next due key (marking it processing), or says when to look again.
    pub fn pop(&mut self, now: Instant) -> Pop<K> {
        if self.shut {
            return Pop::Shutdown;
        }
        while let Some(entry) = self.delayed.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let key = entry.remove();
            self.delayed_at.remove(&key);
            self.ready_set.insert(key.clone());
            self.ready.push_back(key);
        }
        if let Some(key) = self.ready.pop_front() {
            self.ready_set.remove(&key);
            self.processing.insert(key.clone());
            return Pop::Key(key);
        }
        match self.delayed.keys().next() {
            Some(&(at, _)) => Pop::WaitUntil(at),
            None => Pop::Empty,
        }
    }

    /// The worker finished `key`; a dirty key is queued again. Returns whether it was.
    pub fn done(&mut self, key: &K, now: Instant) -> bool {
        self.processing.remove(key);
        match self.dirty.remove(key) {
            Some(when) => self.add_at(key.clone(), when, now),
            None => false,
        }
    }

    /// Records a failure of `key` and requeues it after the backoff, or drops it after
    /// [`MAX_RETRIES`] requeues.
    pub fn fail(&mut self, key: &K, now: Instant) -> Retry {
        let failures = self.failures.get(key).copied().unwrap_or(0);
        if failures >= MAX_RETRIES {
            self.failures.remove(key);
            return Retry::Dropped { failures: failures + 1 };
        }
        let delay = backoff(failures);
        self.failures.insert(key.clone(), failures + 1);
        self.add_at(key.clone(), now + delay, now);
        Retry::After(delay)
    }

    /// When the key [`State::pop`] just handed out became due (once per hand-out).
    pub fn take_due(&mut self, key: &K) -> Option<Instant> {
        self.due.remove(key)
    }

    /// Resets `key`'s failure count.
    pub fn forget(&mut self, key: &K) {
        self.failures.remove(key);
    }

    /// Failures of `key` since its last success.
    pub fn failures(&self, key: &K) -> u32 {
        self.failures.get(key).copied().unwrap_or(0)
    }

    /// Keys queued (ready or delayed), not counting those being processed.
    pub fn len(&self) -> usize {
        self.ready.len() + self.delayed.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn shutdown(&mut self) {
        self.shut = true;
    }
}

/// [`State`] behind a lock, with a wake-up for idle workers and the token bucket.
pub struct WorkQueue<K> {
    name: &'static str,
    state: Mutex<State<K>>,
    wake: Notify,
    bucket: Option<Bucket>,
    /// Where each handed-out key's wait (due → handed out, the bucket included) is observed.
    wait: OnceLock<Histogram>,
}

impl<K: Clone + Eq + Hash> WorkQueue<K> {
    pub fn new(name: &'static str, bucket: Option<BucketSpec>) -> WorkQueue<K> {
        WorkQueue {
            name,
            state: Mutex::new(State::default()),
            wake: Notify::new(),
            bucket: bucket.map(Bucket::new),
            wait: OnceLock::new(),
        }
    }

    /// Observes every key's wait in `h` from now on (the first call wins).
    pub fn observe_waits(&self, h: Histogram) {
        let _ = self.wait.set(h);
    }

    pub fn name(&self) -> &'static str {
        self.name
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State<K>> {
        // The state's methods do not panic midway, so a poisoned lock still holds consistent data.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `key` now (deduplicated).
    pub fn add(&self, key: K) {
        self.add_after(key, Duration::ZERO);
    }

    /// Queues `key` to be due after `delay` (an earlier due time wins).
    pub fn add_after(&self, key: K, delay: Duration) {
        let now = Instant::now();
        if self.state().add_at(key, now + delay, now) {
            self.wake.notify_waiters();
        }
    }

    /// The next due key (after taking a bucket token), or `None` once shut down. The caller
    /// must call [`WorkQueue::done`] with it.
    pub async fn get(&self) -> Option<K> {
        let (key, due) = loop {
            let notified = self.wake.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let (pop, due) = {
                let mut st = self.state();
                let pop = st.pop(Instant::now());
                let due = if let Pop::Key(k) = &pop { st.take_due(k) } else { None };
                (pop, due)
            };
            match pop {
                Pop::Key(key) => break (key, due),
                Pop::Shutdown => return None,
                Pop::Empty => notified.await,
                Pop::WaitUntil(at) => {
                    tokio::select! {
                        _ = &mut notified => {}
                        _ = tokio::time::sleep_until(at) => {}
                    }
                }
            }
        };
        if let Some(bucket) = &self.bucket {
            while let Err(wait) = bucket.try_take() {
                let notified = self.wake.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if self.state().shut {
                    self.done(&key);
                    return None;
                }
                tokio::select! {
                    _ = &mut notified => {}
                    _ = tokio::time::sleep(wait) => {}
                }
            }
        }
        if let (Some(h), Some(due)) = (self.wait.get(), due) {
            h.observe(Instant::now().saturating_duration_since(due).as_secs_f64());
        }
        Some(key)
    }

    /// The worker is finished with `key`.
    pub fn done(&self, key: &K) {
        if self.state().done(key, Instant::now()) {
            self.wake.notify_waiters();
        }
    }

    /// Records a failure of `key` (call before [`WorkQueue::done`]).
    pub fn retry(&self, key: &K) -> Retry {
        self.state().fail(key, Instant::now())
    }

    /// Resets `key`'s failure count after a success.
    pub fn forget(&self, key: &K) {
        self.state().forget(key);
    }

    pub fn len(&self) -> usize {
        self.state().len()
    }

    pub fn is_empty(&self) -> bool {
        self.state().is_empty()
    }

    /// Workers get `None` from now on (the item a worker holds is still finished by it).
    pub fn shutdown(&self) {
        self.state().shutdown();
        self.wake.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use governor::clock::FakeRelativeClock;
    use std::sync::Arc;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_key_is_queued_once_and_keeps_the_earlier_due_time() {
        let t0 = Instant::now();
        let mut s = State::default();
        assert!(s.add_at("a", t0 + ms(100), t0));
        assert!(!s.add_at("a", t0 + ms(200), t0), "a later due time must not requeue");
        assert_eq!(s.len(), 1);
        assert!(s.add_at("a", t0 + ms(50), t0), "an earlier due time moves the key up");
        assert_eq!(s.len(), 1);
        assert_eq!(s.pop(t0), Pop::WaitUntil(t0 + ms(50)));
        assert_eq!(s.pop(t0 + ms(50)), Pop::Key("a"));
        // Ready keys are not duplicated either.
        s.done(&"a", t0);
        assert!(s.add_at("b", t0, t0));
        assert!(!s.add_at("b", t0, t0));
        assert!(!s.add_at("b", t0 + ms(5), t0));
        assert_eq!(s.len(), 1);
        assert_eq!(s.pop(t0), Pop::Key("b"));
        assert_eq!(s.pop(t0), Pop::Empty);
    }

    #[test]
    fn a_keys_wait_starts_when_it_is_due() {
        let t0 = Instant::now();
        let mut s = State::default();
        s.add_at("now", t0, t0);
        s.add_at("later", t0 + ms(40), t0);
        assert!(s.add_at("later", t0 + ms(10), t0), "moved up");
        assert_eq!(s.pop(t0), Pop::Key("now"));
        assert_eq!(s.take_due(&"now"), Some(t0));
        assert_eq!(s.take_due(&"now"), None, "once per hand-out");
        // Added while processing: its wait starts at that add, not at the next hand-out.
        s.add_at("now", t0 + ms(1), t0 + ms(1));
        s.done(&"now", t0 + ms(30));
        assert_eq!(s.pop(t0 + ms(30)), Pop::Key("now"));
        assert_eq!(s.take_due(&"now"), Some(t0 + ms(1)));
        assert_eq!(s.pop(t0 + ms(30)), Pop::Key("later"));
        assert_eq!(s.take_due(&"later"), Some(t0 + ms(10)), "a delayed key waits from its due time");
    }

    #[test]
    fn keys_come_out_in_due_order_then_fifo() {
        let t0 = Instant::now();
        let mut s = State::default();
        s.add_at("late", t0 + ms(20), t0);
        s.add_at("x", t0, t0);
        s.add_at("early", t0 + ms(10), t0);
        s.add_at("y", t0, t0);
        let now = t0 + ms(30);
        let order: Vec<_> = std::iter::from_fn(|| match s.pop(now) {
            Pop::Key(k) => Some(k),
            _ => None,
        })
        .collect();
        assert_eq!(order, ["x", "y", "early", "late"]);
    }

    #[test]
    fn a_key_added_while_processing_is_processed_again_after_done() {
        let t0 = Instant::now();
        let mut s = State::default();
        s.add_at("a", t0, t0);
        assert_eq!(s.pop(t0), Pop::Key("a"));
        // Re-added (twice) while a worker holds it: not handed to a second worker.
        assert!(!s.add_at("a", t0, t0));
        assert!(!s.add_at("a", t0, t0));
        assert_eq!(s.pop(t0), Pop::Empty);
        assert!(s.done(&"a", t0), "the dirty key must be queued again");
        assert_eq!(s.pop(t0), Pop::Key("a"));
        assert!(!s.done(&"a", t0), "a clean key is not queued again");
        assert_eq!(s.pop(t0), Pop::Empty);
    }

    #[test]
    fn backoff_doubles_from_5ms_and_caps_at_1000s() {
        assert_eq!(backoff(0), ms(5));
        assert_eq!(backoff(1), ms(10));
        assert_eq!(backoff(2), ms(20));
        assert_eq!(backoff(10), ms(5 * 1024));
        assert_eq!(backoff(17), ms(655_360));
        assert_eq!(backoff(18), BACKOFF_MAX, "5 ms × 2^18 = 1310 s is capped");
        assert_eq!(backoff(64), BACKOFF_MAX);
        assert_eq!(backoff(u32::MAX), BACKOFF_MAX);
    }

    #[test]
    fn failures_back_off_and_drop_after_max_retries() {
        let t0 = Instant::now();
        let mut s = State::default();
        let mut now = t0;
        s.add_at("p", now, now);
        for i in 0..MAX_RETRIES {
            assert_eq!(s.pop(now), Pop::Key("p"), "attempt {i}");
            let r = s.fail(&"p", now);
            assert_eq!(r, Retry::After(backoff(i)));
            s.done(&"p", now);
            assert_eq!(s.failures(&"p"), i + 1);
            // Not due before the backoff elapsed.
            let due = now + backoff(i);
            if backoff(i) > Duration::ZERO {
                assert_eq!(s.pop(now), Pop::WaitUntil(due));
            }
            now = due;
        }
        assert_eq!(s.pop(now), Pop::Key("p"));
        assert_eq!(s.fail(&"p", now), Retry::Dropped { failures: MAX_RETRIES + 1 });
        s.done(&"p", now);
        assert_eq!(s.pop(now + BACKOFF_MAX), Pop::Empty, "a dropped key is not requeued");
        assert_eq!(s.failures(&"p"), 0, "a dropped key starts afresh when added again");
    }

    #[test]
    fn success_resets_the_backoff() {
        let t0 = Instant::now();
        let mut s = State::default();
        s.add_at("p", t0, t0);
        s.pop(t0);
        s.fail(&"p", t0);
        s.done(&"p", t0);
        s.pop(t0 + ms(5));
        s.fail(&"p", t0);
        assert_eq!(s.failures(&"p"), 2);
        s.forget(&"p");
        assert_eq!(s.failures(&"p"), 0);
        s.done(&"p", t0);
        let now = t0 + ms(100);
        assert_eq!(s.pop(now), Pop::Key("p"));
        assert_eq!(s.fail(&"p", now), Retry::After(ms(5)), "after a success the backoff starts at 5 ms");
    }

    #[test]
    fn a_new_event_during_a_failed_attempt_is_not_delayed_by_the_backoff() {
        let t0 = Instant::now();
        let mut s = State::default();
        s.add_at("p", t0, t0);
        s.pop(t0);
        s.add_at("p", t0, t0); // new event while processing
        s.failures.insert("p", 10);
        assert_eq!(s.fail(&"p", t0), Retry::After(backoff(10)));
        s.done(&"p", t0);
        assert_eq!(s.pop(t0), Pop::Key("p"));
    }

    #[test]
    fn shutdown_stops_handing_out_keys() {
        let t0 = Instant::now();
        let mut s = State::default();
        s.add_at("a", t0, t0);
        s.shutdown();
        assert_eq!(s.pop(t0), Pop::Shutdown);
        assert!(!s.add_at("b", t0, t0));
    }

    #[test]
    fn qps_rules() {
        assert_eq!(bucket_spec(-1.0, 400), None, "qps < 0: per-key backoff only");
        assert_eq!(bucket_spec(0.0, 400), Some(BucketSpec { qps: 5.0, burst: 10 }), "qps 0: client-go 5/10");
        assert_eq!(bucket_spec(f64::NAN, 1), Some(BucketSpec { qps: 5.0, burst: 10 }));
        assert_eq!(bucket_spec(200.0, 400), Some(BucketSpec { qps: 200.0, burst: 400 }));
        assert_eq!(bucket_spec(10.0, 0), Some(BucketSpec { qps: 10.0, burst: 1 }), "burst is at least 1");
    }

    #[test]
    fn the_bucket_allows_a_burst_then_the_rate() {
        let clock = FakeRelativeClock::default();
        let bucket = Bucket::with_clock(BucketSpec { qps: 10.0, burst: 3 }, clock.clone());
        for i in 0..3 {
            assert_eq!(bucket.try_take(), Ok(()), "token {i} of the burst");
        }
        let wait = bucket.try_take().expect_err("the burst is spent");
        assert!(wait > ms(90) && wait <= ms(100), "one token per 100 ms at 10 qps, got {wait:?}");
        clock.advance(ms(100));
        assert_eq!(bucket.try_take(), Ok(()));
        assert!(bucket.try_take().is_err());
        // After a long idle period the burst refills, but not beyond it.
        clock.advance(Duration::from_secs(60));
        for _ in 0..3 {
            assert_eq!(bucket.try_take(), Ok(()));
        }
        assert!(bucket.try_take().is_err());
    }

    #[test]
    fn extreme_rates_do_not_panic() {
        let clock = FakeRelativeClock::default();
        let fast = Bucket::with_clock(BucketSpec { qps: f64::INFINITY, burst: 1 }, clock.clone());
        assert_eq!(fast.try_take(), Ok(()));
        let slow = Bucket::with_clock(BucketSpec { qps: 1e-300, burst: 1 }, clock);
        assert_eq!(slow.try_take(), Ok(()));
        assert!(slow.try_take().is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn workers_never_share_a_key_and_redirty_is_processed() {
        let q = Arc::new(WorkQueue::<&'static str>::new("t", None));
        q.add("a");
        let first = q.get().await;
        assert_eq!(first, Some("a"));
        // While "a" is held, a second worker waits even though "a" is re-added.
        q.add("a");
        let q2 = q.clone();
        let second = tokio::spawn(async move { q2.get().await });
        tokio::time::sleep(ms(50)).await;
        assert!(!second.is_finished(), "a key held by one worker was handed to another");
        q.done(&"a");
        let got = tokio::time::timeout(ms(10), second).await.expect("redirtied key handed out").expect("join");
        assert_eq!(got, Some("a"));
    }

    #[tokio::test(start_paused = true)]
    async fn retry_waits_for_the_backoff() {
        let q = WorkQueue::<&'static str>::new("t", None);
        q.add("a");
        let k = q.get().await.expect("key");
        for _ in 0..4 {
            q.retry(&k);
            q.done(&k);
            q.get().await;
        }
        // Fifth failure: 5 ms × 2^4 = 80 ms.
        assert_eq!(q.retry(&k), Retry::After(ms(80)));
        q.done(&k);
        let start = Instant::now();
        assert_eq!(q.get().await, Some("a"));
        assert_eq!(start.elapsed(), ms(80));
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_wakes_idle_workers() {
        let q = Arc::new(WorkQueue::<&'static str>::new("t", None));
        let q2 = q.clone();
        let w = tokio::spawn(async move { q2.get().await });
        tokio::time::sleep(ms(10)).await;
        q.shutdown();
        assert_eq!(w.await.expect("join"), None);
    }

    #[tokio::test]
    async fn the_bucket_throttles_handing_out() {
        // Real clock (governor's), 20 qps burst 2: five keys take at least 3 × 50 ms.
        let q = WorkQueue::<u32>::new("t", Some(BucketSpec { qps: 20.0, burst: 2 }));
        for i in 0..5 {
            q.add(i);
        }
        let start = std::time::Instant::now();
        for _ in 0..5 {
            let k = q.get().await.expect("key");
            q.done(&k);
        }
        let took = start.elapsed();
        assert!(took >= ms(140), "5 items at 20 qps / burst 2 took only {took:?}");
        assert!(took < ms(2000), "{took:?}");
    }
}
