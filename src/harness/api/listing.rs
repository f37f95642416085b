//! `GET /v1/sessions` one page at a time (docs/api.md). A harness alone
//! lists what it holds; over several replicas (docs/store.md, "Several
//! replicas") the database holds every replica's sessions, so a replica
//! lists from it, with its own sessions (fresher: the database lags its
//! writer) in place of their rows. Pages go by session id (keyset: a
//! session created or forgotten between two pages moves no other one),
//! and are bounded: the database may hold far more than one harness.

use crate::harness::types::SessionInfo;
use std::collections::BTreeMap;

/// Sessions listed per page at most (`?limit=`), and by default.
pub const PAGE_MAX: usize = 1000;

/// One page of a listing by session id.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Page {
    pub sessions: Vec<SessionInfo>,
    /// The id to ask the next page after (`?after=`); `None`: this was
    /// the last.
    pub next: Option<String>,
}

/// The page of at most `limit` sessions (clamped to `1..=PAGE_MAX`) with
/// ids above `after`, by id in byte order, from this harness's own view
/// (`local`) and the database's (`stored`: the first rows above `after`
/// in the same order, at most `limit`; empty without a shared database).
/// Without I/O.
///
/// A session in both is the one of the newer grant, this harness's own
/// when the same (the row lags what the harness holds). A full page of
/// rows ends at its last id: rows beyond it were not read, so local
/// sessions beyond it wait for the next page rather than skip those.
pub fn merge_page(
    local: impl IntoIterator<Item = SessionInfo>,
    stored: Vec<SessionInfo>,
    after: Option<&str>,
    limit: usize,
) -> Page {
    let limit = limit.clamp(1, PAGE_MAX);
    let above = |id: &str| after.is_none_or(|a| id > a);
    let stored_full = stored.len() >= limit;
    let stored_last = stored.last().map(|s| s.session_id.clone());
    let beyond = |id: &str| stored_full && stored_last.as_deref().is_some_and(|last| id > last);
    let mut all: BTreeMap<String, SessionInfo> = stored
        .into_iter()
        .filter(|s| above(&s.session_id))
        .map(|s| (s.session_id.clone(), s))
        .collect();
    for s in local {
        if !above(&s.session_id) || beyond(&s.session_id) {
            continue;
        }
        if all
            .get(&s.session_id)
            .is_some_and(|row| row.fencing_token > s.fencing_token)
        {
            continue;
        }
        all.insert(s.session_id.clone(), s);
    }
    let more = stored_full || all.len() > limit;
    let sessions: Vec<SessionInfo> = all.into_values().take(limit).collect();
    let next = if more {
        sessions.last().map(|s| s.session_id.clone())
    } else {
        None
    };
    Page { sessions, next }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::types::SessionState;

    fn info(id: &str, token: u64, state: SessionState) -> SessionInfo {
        SessionInfo {
            connection_id: None,
            ready: true,
            ..SessionInfo::new(
                id.into(),
                "e1".into(),
                token,
                format!("lease-{id}-{token}"),
                state,
                "2026-01-01T00:00:00Z".into(),
            )
        }
    }

    fn ids(p: &Page) -> Vec<&str> {
        p.sessions.iter().map(|s| s.session_id.as_str()).collect()
    }

    #[test]
    fn local_alone_pages_by_id() {
        let local = ["c", "a", "b"].map(|id| info(id, 1, SessionState::Active));
        let p = merge_page(local.clone(), Vec::new(), None, 2);
        assert_eq!(ids(&p), ["a", "b"]);
        assert_eq!(p.next.as_deref(), Some("b"));
        let p = merge_page(local.clone(), Vec::new(), Some("b"), 2);
        assert_eq!(ids(&p), ["c"]);
        assert_eq!(p.next, None);
        // Exactly one page: no next.
        let p = merge_page(local, Vec::new(), None, 3);
        assert_eq!(p.next, None);
    }

    #[test]
    fn rows_and_local_merge_newer_grant_first() {
        use SessionState::*;
        let stored = vec![
            info("a", 5, Ended),
            info("b", 1, Active),
            info("d", 1, Active),
        ];
        // Local "a" is an older grant (another replica granted it anew
        // since); local "b" is the same grant, fresher; "c" is not
        // written yet.
        let local = vec![
            info("a", 3, Active),
            info("b", 1, Stopping),
            info("c", 2, Assigning),
        ];
        let p = merge_page(local, stored, None, 10);
        assert_eq!(ids(&p), ["a", "b", "c", "d"]);
        assert_eq!(p.sessions[0].fencing_token, 5);
        assert_eq!(p.sessions[1].state, Stopping);
        assert_eq!(p.next, None);
    }

    #[test]
    fn a_full_page_of_rows_never_skips_rows_beyond_it() {
        use SessionState::*;
        // The database returned its first two rows above "a"; a local
        // session beyond the last of them waits for the next page.
        let stored = vec![info("b", 1, Active), info("c", 1, Active)];
        let local = vec![info("a", 1, Active), info("z", 1, Active)];
        let p = merge_page(local, stored, Some("a"), 2);
        assert_eq!(ids(&p), ["b", "c"]);
        assert_eq!(p.next.as_deref(), Some("c"));
        // The limit is clamped: never zero, never above the maximum.
        let p = merge_page(vec![info("a", 1, Active)], Vec::new(), None, 0);
        assert_eq!(ids(&p), ["a"]);
        let many: Vec<SessionInfo> = (0..PAGE_MAX + 5)
            .map(|i| info(&format!("s{i:05}"), 1, Active))
            .collect();
        let p = merge_page(many, Vec::new(), None, usize::MAX);
        assert_eq!(p.sessions.len(), PAGE_MAX);
        assert!(p.next.is_some());
    }

    proptest::proptest! {
        /// Walking the pages of the database's rows and a local view
        /// lists every session once, in id order, with the newer grant
        /// of each.
        #[test]
        fn pages_cover_every_session_once(
            rows in proptest::collection::btree_map("[a-e]{1,2}", 1u64..4, 0..20),
            local in proptest::collection::btree_map("[a-e]{1,2}", 1u64..4, 0..20),
            limit in 1usize..6,
        ) {
            let want: BTreeMap<String, u64> = rows
                .iter()
                .chain(local.iter())
                .fold(BTreeMap::new(), |mut m, (k, &t)| {
                    let e = m.entry(k.clone()).or_insert(t);
                    *e = (*e).max(t);
                    m
                });
            let mut got = Vec::new();
            let mut after: Option<String> = None;
            for _ in 0..100 {
                let stored: Vec<SessionInfo> = rows
                    .iter()
                    .filter(|(k, _)| after.as_deref().is_none_or(|a| k.as_str() > a))
                    .take(limit)
                    .map(|(k, &t)| info(k, t, SessionState::Active))
                    .collect();
                let mine = local.iter().map(|(k, &t)| info(k, t, SessionState::Active));
                let p = merge_page(mine, stored, after.as_deref(), limit);
                proptest::prop_assert!(p.sessions.len() <= limit);
                got.extend(p.sessions.iter().map(|s| (s.session_id.clone(), s.fencing_token)));
                match p.next {
                    Some(n) => after = Some(n),
                    None => break,
                }
            }
            let got_map: BTreeMap<String, u64> = got.iter().cloned().collect();
            proptest::prop_assert_eq!(got.len(), got_map.len(), "a session listed twice");
            proptest::prop_assert!(got.windows(2).all(|w| w[0].0 < w[1].0));
            proptest::prop_assert_eq!(got_map, want);
        }
    }
}
