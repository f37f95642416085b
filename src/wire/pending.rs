//! The requests a connection has sent and not yet seen answered, and
//! whether the connection is closed, as **one** state.
//!
//! Why one state: a request registered after the reader has failed the
//! waiting requests would wait out its whole timeout for an answer that
//! cannot come (issue 19: a read left unanswered for 25 s during drops).
//! With `closed` and the map behind one lock, [`Pending::insert`] refuses
//! once [`Pending::close`] has run, and `close` hands back every entry it
//! found, so each inserted request is either answered (taken by its id) or
//! failed by the close — never left. Sans-IO: no clock, no channel; the
//! [`Link`](super::Link) keeps it in a mutex and drops what `close` returns
//! (which fails the waiters).

use std::collections::HashMap;
use std::hash::Hash;

/// Waiters of requests in flight on one connection, keyed by request id.
#[derive(Debug)]
pub struct Pending<K, W> {
    closed: bool,
    map: HashMap<K, W>,
}

impl<K, W> Default for Pending<K, W> {
    fn default() -> Self {
        Pending {
            closed: false,
            map: HashMap::new(),
        }
    }
}

/// [`Pending::insert`] after [`Pending::close`]: the waiter comes back.
#[derive(Debug, thiserror::Error)]
#[error("the connection is closed")]
pub struct PendingClosed<W>(pub W);

impl<K: Hash + Eq, W> Pending<K, W> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Register a waiter for `id`.
    ///
    /// # Errors
    ///
    /// [`PendingClosed`] with the waiter when the connection is closed:
    /// the caller fails the request at once instead of sending it.
    pub fn insert(&mut self, id: K, waiter: W) -> Result<(), PendingClosed<W>> {
        if self.closed {
            return Err(PendingClosed(waiter));
        }
        self.map.insert(id, waiter);
        Ok(())
    }

    /// The waiter of `id`, removed: an answer arrived, or its caller gave
    /// up (timeout) or could not send.
    pub fn take(&mut self, id: &K) -> Option<W> {
        self.map.remove(id)
    }

    /// The connection is gone: refuse every later insert and hand back
    /// every waiter still registered, to be failed. Idempotent: a second
    /// close returns nothing.
    pub fn close(&mut self) -> Vec<W> {
        self.closed = true;
        self.map.drain().map(|(_, w)| w).collect()
    }

    pub fn is_closed(&self) -> bool {
        self.closed
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}
