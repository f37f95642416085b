//! Where fencing counters live.
//!
//! A fencing token is only useful if it is never reused for a session id:
//! an executor that saw token 7 must refuse anything at or below 7 from a
//! stale assignment, even if the harness restarted in between or the
//! session ended and an id was assigned again. So the counter is kept
//! outside [`LeaseTable`](super::LeaseTable), behind a trait a platform can
//! back with durable storage.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Issues fencing tokens, strictly increasing per session id.
///
/// Implementations must never hand out the same or a lower token twice for
/// one session id, for the lifetime of the deployment (not only of one
/// process), or a stale executor could pass the executor-side fence.
pub trait LeaseStore: Send + Sync {
    /// Issues and records the next token for `session_id`; strictly greater
    /// than every token issued before for that id. The first token is 1, so
    /// 0 can stand for "none yet".
    ///
    /// `None` when no token can be issued right now without risking reuse
    /// (a durable store whose reserved range ran out before its next write
    /// completed): the grant is refused and may be retried, rather than
    /// the caller blocking on a disk write.
    fn next_fencing_token(&self, session_id: &str) -> Option<u64>;

    /// The last token issued for `session_id`, if any was.
    fn current(&self, session_id: &str) -> Option<u64>;
}

/// In-process [`LeaseStore`]: tokens survive a rebuilt
/// [`LeaseTable`](super::LeaseTable) that shares the store, but not a
/// process restart.
///
/// Entries are never removed: forgetting a session's counter would allow a
/// token to be reused, which is exactly what fencing forbids. One `u64` per
/// session id ever leased is the price.
#[derive(Debug, Default)]
pub struct MemoryLeaseStore {
    last: Mutex<HashMap<String, u64>>,
}

impl MemoryLeaseStore {
    /// An empty store: every session starts at token 1.
    pub fn new() -> Self {
        Self::default()
    }

    /// A poisoned lock only means another thread panicked while holding it;
    /// every update below is a single insert, so the map is still
    /// consistent and refusing to serve tokens would not help anyone.
    fn map(&self) -> MutexGuard<'_, HashMap<String, u64>> {
        self.last.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl LeaseStore for MemoryLeaseStore {
    fn next_fencing_token(&self, session_id: &str) -> Option<u64> {
        let mut map = self.map();
        let next = map.get(session_id).map_or(1, |last| last.saturating_add(1));
        map.insert(session_id.to_owned(), next);
        Some(next)
    }

    fn current(&self, session_id: &str) -> Option<u64> {
        self.map().get(session_id).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_start_at_one_and_increase_per_session() {
        let store = MemoryLeaseStore::new();
        assert_eq!(store.current("a"), None);
        assert_eq!(store.next_fencing_token("a"), Some(1));
        assert_eq!(store.next_fencing_token("a"), Some(2));
        assert_eq!(store.next_fencing_token("b"), Some(1));
        assert_eq!(store.current("a"), Some(2));
        assert_eq!(store.current("b"), Some(1));
    }

    #[test]
    fn poisoned_lock_still_serves_tokens() {
        let store = std::sync::Arc::new(MemoryLeaseStore::new());
        assert_eq!(store.next_fencing_token("a"), Some(1));
        let poisoner = std::sync::Arc::clone(&store);
        let joined = std::thread::spawn(move || {
            let _guard = poisoner.last.lock();
            panic!("poison the lock on purpose");
        })
        .join();
        assert!(joined.is_err());
        assert_eq!(store.next_fencing_token("a"), Some(2));
    }
}
