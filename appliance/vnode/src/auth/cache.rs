//! The review caches: a map from a SHA-256 key to a verdict with an expiry, and a hard cap on
//! its size. Clients on the network choose what is looked up (a random bearer token per request
//! is a fresh key each time), so the cap is what bounds the memory: at the cap, expired entries
//! go first, then the entry closest to expiry.
//!
//! Keys are digests, never the secret itself: a cached token is not kept in memory.

use sha2::{Digest as _, Sha256};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A SHA-256 digest used as a cache key.
pub type Key = [u8; 32];

/// The digest of `parts`, each length-prefixed (so `("ab", "c")` and `("a", "bc")` differ).
pub fn key<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> Key {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_be_bytes());
        h.update(p);
    }
    h.finalize().into()
}

/// A bounded TTL cache. Callers pass `now`, so it is tested without sleeping.
#[derive(Debug)]
pub struct TtlCache<V> {
    entries: Mutex<HashMap<Key, (V, Instant)>>,
    cap: usize,
}

impl<V: Clone> TtlCache<V> {
    /// A cache holding at most `cap` entries (`0` caches nothing).
    pub fn new(cap: usize) -> TtlCache<V> {
        TtlCache { entries: Mutex::new(HashMap::new()), cap }
    }

    /// The value under `key`, if it has not expired at `now`.
    pub fn get(&self, key: &Key, now: Instant) -> Option<V> {
        let mut entries = self.lock();
        match entries.get(key) {
            Some((v, expires)) if *expires > now => Some(v.clone()),
            Some(_) => {
                entries.remove(key);
                None
            }
            None => None,
        }
    }

    /// Stores `value` under `key` until `now + ttl`, making room first when the cache is full.
    pub fn insert(&self, key: Key, value: V, ttl: Duration, now: Instant) {
        if self.cap == 0 || ttl.is_zero() {
            return;
        }
        let mut entries = self.lock();
        if !entries.contains_key(&key) && entries.len() >= self.cap {
            entries.retain(|_, (_, expires)| *expires > now);
            if entries.len() >= self.cap {
                if let Some(soonest) = entries.iter().min_by_key(|(_, (_, e))| *e).map(|(k, _)| *k) {
                    entries.remove(&soonest);
                }
            }
        }
        entries.insert(key, (value, now + ttl));
    }

    /// Entries held now (expired ones included until they are looked up or evicted).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, (V, Instant)>> {
        // A panic while holding the lock leaves a consistent map (every mutation is one call).
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(n: u32) -> Key {
        key([n.to_be_bytes().as_slice()])
    }

    #[test]
    fn entries_expire_after_their_ttl() {
        let c = TtlCache::new(8);
        let t0 = Instant::now();
        c.insert(k(1), "yes", Duration::from_secs(120), t0);
        c.insert(k(2), "no", Duration::from_secs(30), t0);
        assert_eq!(c.get(&k(1), t0 + Duration::from_secs(119)), Some("yes"));
        assert_eq!(c.get(&k(2), t0 + Duration::from_secs(29)), Some("no"));
        assert_eq!(c.get(&k(2), t0 + Duration::from_secs(30)), None, "expired at its TTL");
        assert_eq!(c.get(&k(1), t0 + Duration::from_secs(120)), None);
        assert!(c.is_empty(), "expired entries are dropped when looked up");
    }

    #[test]
    fn the_cap_holds_under_a_flood_of_fresh_keys() {
        let c = TtlCache::new(100);
        let t0 = Instant::now();
        // A long-lived entry, then a flood of short-lived ones (random tokens).
        c.insert(k(0), 0, Duration::from_secs(300), t0);
        for n in 1..10_000u32 {
            c.insert(k(n), n, Duration::from_secs(30), t0 + Duration::from_millis(u64::from(n)));
            assert!(c.len() <= 100, "the cache grew past its cap: {}", c.len());
        }
        assert_eq!(c.len(), 100);
        assert_eq!(c.get(&k(0), t0 + Duration::from_secs(11)), Some(0), "the entry furthest from expiry survives");
        assert_eq!(c.get(&k(9_999), t0 + Duration::from_secs(11)), Some(9_999), "the newest entry is held");
        assert_eq!(c.get(&k(1), t0 + Duration::from_secs(11)), None, "the soonest to expire went first");
    }

    #[test]
    fn expired_entries_make_room_before_live_ones() {
        let c = TtlCache::new(2);
        let t0 = Instant::now();
        c.insert(k(1), 1, Duration::from_secs(1), t0);
        c.insert(k(2), 2, Duration::from_secs(100), t0);
        c.insert(k(3), 3, Duration::from_secs(50), t0 + Duration::from_secs(2));
        let later = t0 + Duration::from_secs(3);
        assert_eq!((c.get(&k(2), later), c.get(&k(3), later)), (Some(2), Some(3)));
    }

    #[test]
    fn a_zero_cap_or_ttl_caches_nothing_and_keys_are_unambiguous() {
        let t0 = Instant::now();
        let none = TtlCache::new(0);
        none.insert(k(1), 1, Duration::from_secs(10), t0);
        assert!(none.is_empty());
        let c = TtlCache::new(4);
        c.insert(k(1), 1, Duration::ZERO, t0);
        assert!(c.is_empty());
        assert_ne!(key([b"ab".as_slice(), b"c"]), key([b"a".as_slice(), b"bc"]));
    }
}
