//! This harness as one of several live replicas over one PostgreSQL
//! database (docs/store.md, "Several replicas"). Only a harness over the
//! PostgreSQL store has one; with SQLite or in memory nothing here runs
//! and the 4004 rule is the leases actor's alone.
//!
//! **The 4004 rule across replicas.** The database numbers the
//! connections of each executor id ([`PgReplicas::claim_connection`]);
//! the highest generation is the one that may live. This module keeps,
//! per executor id, the highest generation seen (from this replica's own
//! claims, every replica's notifications and the poll) and this replica's
//! connections with theirs, under one lock per executor id
//! ([`Replica::admit`], [`Replica::observed`]). Whichever of "a newer
//! generation is seen" and "an older connection is admitted" comes
//! second under that lock sees the other, so no older connection
//! survives a newer one it has heard of; a lost notification is covered
//! by the next poll (one heartbeat interval). A connection admitted on
//! this replica is handed to the leases actor *under* the lock, so two
//! connections of one executor on this replica reach it in generation
//! order, and its own local 4004 replacement agrees with the database.
//!
//! Memory: one entry per executor id ever connected to this replica (a
//! generation and this replica's live connections of it).

use crate::harness::runtime::Shared;
use crate::harness::store::pg_replicas::Generation;
use crate::harness::store::PgReplicas;
use crate::lease::ConnId;
use crate::wire::CloseCode;
use dashmap::DashMap;
use std::sync::{Arc, Weak};

/// What this replica knows of one executor id.
#[derive(Default)]
struct ExecGens {
    /// The highest generation seen from any replica.
    latest: i64,
    /// This replica's connections of the executor, with their generation.
    local: Vec<(ConnId, i64)>,
}

/// The generation rule, without I/O: per executor id the highest
/// generation seen and this replica's connections with theirs, one lock
/// per executor id.
#[derive(Default)]
pub struct Generations {
    gens: DashMap<String, ExecGens>,
}

impl Generations {
    /// Connection `conn` of `executor_id` was numbered `generation`: if no
    /// newer one is known, record it and run `register` (hand it to the
    /// leases actor) while still holding the executor's lock, and return
    /// what `register` returned. `false` without running it: a newer
    /// connection exists; this one must close with 4004.
    pub fn admit(
        &self,
        executor_id: &str,
        conn: ConnId,
        generation: i64,
        register: impl FnOnce() -> bool,
    ) -> bool {
        let mut e = self.gens.entry(executor_id.to_owned()).or_default();
        if generation < e.latest {
            return false;
        }
        e.latest = generation;
        e.local.push((conn, generation));
        register()
    }

    /// `generation` of `executor_id` was announced (or polled): `close`
    /// each of this replica's connections of it that is older (under the
    /// lock), and forget them.
    pub fn observed(&self, executor_id: &str, generation: i64, mut close: impl FnMut(ConnId, i64)) {
        let mut e = self.gens.entry(executor_id.to_owned()).or_default();
        e.latest = e.latest.max(generation);
        let latest = e.latest;
        e.local.retain(|&(conn, g)| {
            if g >= latest {
                return true;
            }
            close(conn, g);
            false
        });
    }

    /// The highest generation of `executor_id` seen (0: none).
    pub fn latest(&self, executor_id: &str) -> i64 {
        self.gens.get(executor_id).map_or(0, |e| e.latest)
    }

    /// `conn` is gone.
    pub fn forget(&self, executor_id: &str, conn: ConnId) {
        if let Some(mut e) = self.gens.get_mut(executor_id) {
            e.local.retain(|&(c, _)| c != conn);
        }
    }

    /// The executor ids with a connection on this replica (what the poll
    /// reads).
    pub fn local_executors(&self) -> Vec<String> {
        self.gens
            .iter()
            .filter(|e| !e.local.is_empty())
            .map(|e| e.key().clone())
            .collect()
    }
}

/// The replica state of one harness.
pub struct Replica {
    pub db: Arc<PgReplicas>,
    pub gens: Generations,
    /// Forwarded API calls go out on it (`crate::harness::http::forward`).
    pub http: reqwest::Client,
}

impl Replica {
    pub fn new(db: Arc<PgReplicas>) -> Replica {
        Replica {
            db,
            gens: Generations::default(),
            http: crate::harness::http::forward::client(),
        }
    }

    /// See [`Generations::admit`].
    pub fn admit(
        &self,
        executor_id: &str,
        conn: ConnId,
        generation: i64,
        register: impl FnOnce() -> bool,
    ) -> bool {
        self.gens.admit(executor_id, conn, generation, register)
    }

    /// A generation was announced (or polled): close every connection of
    /// this replica of that executor that is older, with 4004.
    pub fn observed(&self, shared: &Shared, g: &Generation) {
        self.gens
            .observed(&g.executor_id, g.generation, |conn, generation| {
                if let Some(link) = shared.link_of(conn) {
                    link.close(CloseCode::Replaced, "replaced");
                    shared.metrics.replacements.inc();
                    tracing::info!(executor_id = %g.executor_id, replaced = %conn, generation,
                        by = g.generation,
                        "connection replaced by a newer one on another replica (4004)");
                }
            });
    }

    /// See [`Generations::latest`].
    pub fn latest(&self, executor_id: &str) -> i64 {
        self.gens.latest(executor_id)
    }

    /// See [`Generations::forget`].
    pub fn forget(&self, executor_id: &str, conn: ConnId) {
        self.gens.forget(executor_id, conn);
    }

    /// See [`Generations::local_executors`].
    pub fn local_executors(&self) -> Vec<String> {
        self.gens.local_executors()
    }
}

/// Start listening for other replicas' registrations: notifications go
/// through a channel to a task of the harness's runtime, which applies
/// them ([`Replica::observed`]). Both end when the listener stops.
///
/// # Errors
///
/// The listener thread cannot be started.
pub(crate) fn watch(shared: &Arc<Shared>, url: String) -> Result<(), std::io::Error> {
    let Some(replica) = shared.replica.get() else {
        return Ok(());
    };
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Generation>();
    let weak: Weak<Shared> = Arc::downgrade(shared);
    let local = {
        let weak = weak.clone();
        move || {
            weak.upgrade()
                .and_then(|s| s.replica.get().map(|r| r.local_executors()))
                .unwrap_or_default()
        }
    };
    let poll = std::time::Duration::from_millis(shared.config.heartbeat_interval_ms.max(50));
    replica
        .db
        .watch(poll, url, local, move |g| {
            let _ = tx.send(g);
        })
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    tokio::spawn(async move {
        while let Some(g) = rx.recv().await {
            let Some(shared) = weak.upgrade() else { return };
            if let Some(r) = shared.replica.get() {
                r.observed(&shared, &g);
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_older_connection_never_outlives_a_newer_one_it_heard_of() {
        let g = Generations::default();
        // Admitted, then a newer generation from another replica: closed.
        assert!(g.admit("e", ConnId(1), 1, || true));
        let mut closed = Vec::new();
        g.observed("e", 2, |c, gen| closed.push((c, gen)));
        assert_eq!(closed, vec![(ConnId(1), 1)]);
        assert!(g.local_executors().is_empty());
        // Heard of first, admitted after: refused, `register` never runs.
        assert!(!g.admit("e", ConnId(2), 1, || panic!(
            "registered an older connection"
        )));
        // Its own generation, or an older announcement: kept.
        assert!(g.admit("e", ConnId(3), 3, || true));
        g.observed("e", 3, |c, _| panic!("closed {c}"));
        g.observed("e", 2, |c, _| panic!("closed {c}"));
        assert_eq!(g.latest("e"), 3);
        assert_eq!(g.local_executors(), vec!["e".to_owned()]);
        // Another executor id is another lock and another count.
        assert!(g.admit("f", ConnId(4), 1, || true));
        g.forget("e", ConnId(3));
        assert_eq!(g.local_executors(), vec!["f".to_owned()]);
    }
}
