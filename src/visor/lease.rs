//! The writer lease of an attached session (VISOR.md §4), sans-IO.
//!
//! Any number of clients watch; at most one writes. `control` takes the
//! lease (the previous holder is told), `release` and a disconnect give it
//! back. Every change bumps `epoch`, so a stale decision can be told apart.

/// Who holds the lease, as one client sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    You,
    Other,
    None,
}

impl Holder {
    pub fn as_str(self) -> &'static str {
        match self {
            Holder::You => "you",
            Holder::Other => "other",
            Holder::None => "none",
        }
    }
}

/// The lease: the holding client's id and a change counter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Lease {
    holder: Option<u64>,
    epoch: u64,
}

impl Lease {
    pub fn holder(&self) -> Option<u64> {
        self.holder
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// `client` takes the lease. Returns whether anything changed.
    pub fn control(&mut self, client: u64) -> bool {
        if self.holder == Some(client) {
            return false;
        }
        self.holder = Some(client);
        self.epoch += 1;
        true
    }

    /// `client` gives the lease back if it holds it.
    pub fn release(&mut self, client: u64) -> bool {
        if self.holder != Some(client) {
            return false;
        }
        self.holder = None;
        self.epoch += 1;
        true
    }

    /// `client` went away: same as a release.
    pub fn disconnect(&mut self, client: u64) -> bool {
        self.release(client)
    }

    /// Whether `client` may write (input, resize).
    pub fn may_write(&self, client: u64) -> bool {
        self.holder == Some(client)
    }

    /// A writer that is not an attached client (the HTTP `keys` endpoint)
    /// may only write while nobody holds the lease.
    pub fn free(&self) -> bool {
        self.holder.is_none()
    }

    pub fn seen_by(&self, client: u64) -> Holder {
        match self.holder {
            None => Holder::None,
            Some(h) if h == client => Holder::You,
            Some(_) => Holder::Other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Control(u64),
        Release(u64),
        Disconnect(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u64..4).prop_map(Op::Control),
            (0u64..4).prop_map(Op::Release),
            (0u64..4).prop_map(Op::Disconnect),
        ]
    }

    proptest! {
        /// At most one writer; the last `control` wins; a non-holder's
        /// release changes nothing; the epoch moves exactly on changes.
        #[test]
        fn one_writer_at_most(ops in proptest::collection::vec(op(), 0..60)) {
            let mut l = Lease::default();
            for o in ops {
                let before = l;
                let changed = match o {
                    Op::Control(c) => { let ch = l.control(c); prop_assert!(l.may_write(c)); ch }
                    Op::Release(c) | Op::Disconnect(c) => { let ch = l.release(c); prop_assert!(!l.may_write(c)); ch }
                };
                prop_assert_eq!(changed, before != l);
                prop_assert_eq!(l.epoch() > before.epoch(), changed);
                let writers = (0..4).filter(|c| l.may_write(*c)).count();
                prop_assert!(writers <= 1);
                prop_assert_eq!(writers == 0, l.free());
            }
        }
    }

    #[test]
    fn views() {
        let mut l = Lease::default();
        assert_eq!(l.seen_by(1), Holder::None);
        l.control(1);
        assert_eq!((l.seen_by(1), l.seen_by(2)), (Holder::You, Holder::Other));
        l.control(2);
        assert!(!l.may_write(1) && l.may_write(2));
        assert!(l.disconnect(2));
        assert_eq!(l.seen_by(1), Holder::None);
    }
}
