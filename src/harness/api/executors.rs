//! `GET /v1/executors` over several replicas (docs/store.md, "Several
//! replicas"). A harness alone lists its own connections. A replica also
//! lists the executors connected to the other live replicas, from the
//! database (`connections` joined with `replicas`, the liveness rule of
//! the forwarding): one query, no fan-out to the other replicas, and no
//! partial answer when one of them is slow. The database knows only which
//! connection is where and since when, and which sessions it holds, so
//! such an entry carries only that (and `replica`); the holding replica
//! has the rest (name, version, heartbeats, capabilities, a drain).

use crate::harness::store::pg_replicas::ExecutorRow;
use crate::harness::types::ExecutorView;
use std::collections::BTreeMap;

/// The entry of an executor another replica holds, from its row: `ready`
/// (a drain is known only to the holding replica), no name, version,
/// heartbeat, protocol or capabilities (not in the database).
pub fn from_row(row: ExecutorRow) -> ExecutorView {
    let ms = i128::from(row.connected_at_ms) * 1_000_000;
    let connected_at = time::OffsetDateTime::from_unix_timestamp_nanos(ms)
        .map(crate::wire::types::rfc3339)
        .unwrap_or_default();
    ExecutorView {
        executor_id: row.executor_id,
        connection_id: row.connection_id,
        state: "ready".into(),
        name: String::new(),
        version: String::new(),
        active_sessions: row.active_sessions,
        connected_at,
        last_heartbeat_at: None,
        protocol: None,
        capabilities: Default::default(),
        replica: Some(row.replica),
    }
}

/// The listing of replica `me`: its own connections (`local`, each marked
/// `me`) and the ones the database places on other replicas (`stored`),
/// one entry per executor id, by id in byte order. Without I/O.
///
/// This replica's own view wins for an executor it holds: it is live (the
/// database's row lags a register, and may already name a newer
/// connection elsewhere that is closing this one with 4004). A row naming
/// this replica but not held here is a connection that ended (its
/// blanking not written yet): left out.
pub fn merge(local: Vec<ExecutorView>, stored: Vec<ExecutorView>, me: &str) -> Vec<ExecutorView> {
    let mut all: BTreeMap<String, ExecutorView> = BTreeMap::new();
    for mut e in local {
        e.replica = Some(me.to_owned());
        all.insert(e.executor_id.clone(), e);
    }
    for e in stored {
        if e.replica.as_deref().is_none_or(|r| r == me) {
            continue;
        }
        all.entry(e.executor_id.clone()).or_insert(e);
    }
    all.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn view(id: &str, conn: &str, replica: Option<&str>) -> ExecutorView {
        let mut v = from_row(ExecutorRow {
            executor_id: id.into(),
            connection_id: conn.into(),
            replica: String::new(),
            connected_at_ms: 1_767_225_600_000,
            active_sessions: vec!["s1".into()],
        });
        v.replica = replica.map(str::to_owned);
        v
    }

    #[test]
    fn a_row_reads_as_a_ready_entry_of_its_replica() {
        let v = from_row(ExecutorRow {
            executor_id: "e1".into(),
            connection_id: "c-1".into(),
            replica: "b".into(),
            connected_at_ms: 1_767_225_600_000,
            active_sessions: vec!["s1".into(), "s2".into()],
        });
        assert_eq!(v.connected_at, "2026-01-01T00:00:00Z");
        assert_eq!(v.state, "ready");
        assert_eq!(v.replica.as_deref(), Some("b"));
        assert_eq!(v.active_sessions, ["s1", "s2"]);
        let json = serde_json::to_value(&v).unwrap();
        assert_eq!(json["replica"], "b");
        assert!(json.get("lastHeartbeatAt").is_none());
    }

    #[test]
    fn own_view_wins_and_rows_of_this_replica_are_left_out() {
        let local = vec![view("e2", "c-local", None), view("e1", "c-1", None)];
        let stored = vec![
            // Held here too: the row lags (or names a newer connection
            // on b that is replacing this one).
            view("e1", "c-newer", Some("b")),
            // Ended here: the blanking was not written yet.
            view("e3", "c-3", Some("a")),
            view("e4", "c-4", Some("b")),
            // No replica: never from the database; left out.
            view("e5", "c-5", None),
        ];
        let got = merge(local, stored, "a");
        let ids: Vec<(&str, &str, Option<&str>)> = got
            .iter()
            .map(|e| {
                (
                    e.executor_id.as_str(),
                    e.connection_id.as_str(),
                    e.replica.as_deref(),
                )
            })
            .collect();
        assert_eq!(
            ids,
            [
                ("e1", "c-1", Some("a")),
                ("e2", "c-local", Some("a")),
                ("e4", "c-4", Some("b")),
            ]
        );
    }

    proptest::proptest! {
        /// Every own executor once, as held here; every executor of
        /// another replica once, unless held here; nothing else; by id.
        #[test]
        fn every_executor_listed_once_own_first(
            local in proptest::collection::btree_map("[a-f]", 0u8..3, 0..6),
            stored in proptest::collection::vec(("[a-f]", 0u8..3, 0u8..3), 0..10),
        ) {
            let replicas = ["me", "r1", "r2"];
            let local_views: Vec<ExecutorView> = local
                .iter()
                .map(|(id, c)| view(id, &format!("local-{c}"), None))
                .collect();
            let stored_views: Vec<ExecutorView> = stored
                .iter()
                .map(|(id, c, r)| view(id, &format!("row-{c}"), Some(replicas[usize::from(*r)])))
                .collect();
            let got = merge(local_views, stored_views, "me");
            proptest::prop_assert!(got.windows(2).all(|w| w[0].executor_id < w[1].executor_id));
            let elsewhere: BTreeSet<&str> = stored
                .iter()
                .filter(|(_, _, r)| *r != 0)
                .map(|(id, _, _)| id.as_str())
                .collect();
            let want: BTreeSet<&str> = local.keys().map(String::as_str).chain(elsewhere.iter().copied()).collect();
            let ids: BTreeSet<&str> = got.iter().map(|e| e.executor_id.as_str()).collect();
            proptest::prop_assert_eq!(ids, want);
            for e in &got {
                match local.get(&e.executor_id) {
                    Some(c) => {
                        proptest::prop_assert_eq!(&e.connection_id, &format!("local-{c}"));
                        proptest::prop_assert_eq!(e.replica.as_deref(), Some("me"));
                    }
                    None => {
                        proptest::prop_assert!(e.connection_id.starts_with("row-"));
                        proptest::prop_assert!(e.replica.as_deref().is_some_and(|r| r != "me"));
                    }
                }
            }
        }
    }
}
