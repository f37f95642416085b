//! The PostgreSQL store on its own (issue 17, docs/store.md "PostgreSQL"):
//! migrations raced by replicas starting together, enrollments and
//! credentials, sessions and tool results across a reopen, the database
//! refusing a stale grant's snapshot, and a password kept out of errors.
//!
//! Fresh database per test (`pg_support::fresh`); skips loudly without
//! `BMX_TEST_PG` (fails under CI).

use super::pg_support;
use bmx::harness::enroll::Enrollment;
use bmx::harness::store::durable::{StoredResult, StoredSession};
use bmx::harness::store::{Credential, DurableState, PgStore, Store, StoreError};
use bmx::harness::types::{SessionInfo, SessionState};
use bmx::lease::LeaseStore;
use bmx::wire::types::ToolResultParams;
use std::sync::Arc;
use std::time::Duration;

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn info(id: &str, token: u64, state: SessionState) -> SessionInfo {
    SessionInfo {
        connection_id: Some("c-1".into()),
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

#[test]
fn replicas_starting_together_migrate_once() {
    let Some(db) = pg_support::fresh("migrate") else {
        return;
    };
    let stores: Vec<PgStore> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..6)
            .map(|_| s.spawn(|| PgStore::connect(&db.url)))
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap().expect("every replica starts"))
            .collect()
    });
    for s in &stores {
        assert_eq!(s.schema_version().unwrap(), 4);
    }
    // One row per migration, not one per replica.
    let url = db.url.clone();
    let rows: i64 = std::thread::spawn(move || {
        let mut c = postgres::Client::connect(&url, postgres::NoTls).unwrap();
        c.query_one("SELECT COUNT(*) FROM schema_migrations", &[])
            .unwrap()
            .get(0)
    })
    .join()
    .unwrap();
    assert_eq!(rows, 4);
}

#[test]
fn a_newer_schema_is_refused() {
    let Some(db) = pg_support::fresh("newer") else {
        return;
    };
    drop(PgStore::connect(&db.url).unwrap());
    let url = db.url.clone();
    std::thread::spawn(move || {
        let mut c = postgres::Client::connect(&url, postgres::NoTls).unwrap();
        c.batch_execute("INSERT INTO schema_migrations (version) VALUES (99)")
            .unwrap();
    })
    .join()
    .unwrap();
    assert!(matches!(
        PgStore::connect(&db.url),
        Err(StoreError::TooNew { found: 99, .. })
    ));
}

#[test]
fn enrollments_and_credentials_round_trip() {
    let Some(db) = pg_support::fresh("enroll") else {
        return;
    };
    let s = PgStore::connect(&db.url).unwrap();
    let mut e = Enrollment::new(
        "e1".into(),
        [7; 32],
        "AAAA-BBBB".into(),
        "/ws".into(),
        "laptop".into(),
        "fp".into(),
        1_000,
        60_000,
        500,
    );
    s.put_enrollment(&e).unwrap();
    assert_eq!(
        s.enrollment_by_device_hash(&[7; 32]).unwrap(),
        Some(e.clone())
    );
    assert_eq!(
        s.enrollment_by_user_code("AAAA-BBBB").unwrap(),
        Some(e.clone())
    );
    assert_eq!(s.enrollment_by_user_code("ZZZZ-ZZZZ").unwrap(), None);
    assert_eq!(s.count_pending(2_000).unwrap(), 1);
    assert_eq!(s.enrollments(10).unwrap(), vec![e.clone()]);
    e.approve(2_000, "cred-1".into(), "r-1".into()).unwrap();
    s.put_enrollment(&e).unwrap();
    assert_eq!(s.count_pending(2_000).unwrap(), 0);
    let c = Credential {
        credential_id: "cred-1".into(),
        executor_id: "r-1".into(),
        token_hash: [9; 32],
        enrollment_id: "e1".into(),
        workspace: "/ws".into(),
        display_name: "laptop".into(),
        created_at_ms: 3_000,
        revoked_at_ms: None,
    };
    s.issue(&e, &c).unwrap();
    assert_eq!(s.credentials().unwrap(), vec![c.clone()]);
    // The same token hash twice is refused, and nothing half-written.
    let dup = Credential {
        credential_id: "cred-2".into(),
        executor_id: "r-2".into(),
        ..c.clone()
    };
    assert!(s.issue(&e, &dup).is_err());
    assert_eq!(s.credentials().unwrap().len(), 1);
    // The connection is still good after the failed transaction.
    let revoked = s.revoke("cred-1", 4_000).unwrap().unwrap();
    assert_eq!(revoked.revoked_at_ms, Some(4_000));
    assert_eq!(
        s.revoke("cred-1", 5_000).unwrap().unwrap().revoked_at_ms,
        Some(4_000)
    );
    assert_eq!(s.revoke("nope", 5_000).unwrap(), None);
    // Approved enrollments are never pruned.
    assert_eq!(s.prune_enrollments(u64::MAX >> 2).unwrap(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_and_results_survive_a_reopen_and_stale_grants_lose() {
    let Some(db) = pg_support::fresh("durable") else {
        return;
    };
    // Called from async code: the store moves its blocking calls off the
    // runtime's threads itself.
    let d = DurableState::open(Arc::new(PgStore::connect(&db.url).unwrap())).unwrap();
    let token = d.next_fencing_token("s1").unwrap();
    // A minute from now on this machine's clock; the row keeps it on the
    // database's, and a load moves it back (the same clock here, so it
    // comes back within the time the test takes).
    let deadline = unix_ms() + 60_000;
    d.put_session(StoredSession {
        info: info("s1", token, SessionState::Active),
        lease_expires_at_ms: None,
    });
    d.put_session(StoredSession {
        info: info("s2", token + 1, SessionState::Disconnected),
        lease_expires_at_ms: Some(deadline),
    });
    let result: ToolResultParams = serde_json::from_value(serde_json::json!({
        "sessionId": "s1", "toolCallId": "t1", "outcome": "succeeded",
        "isError": false, "durationMs": 5
    }))
    .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let t = d.put_result(
        StoredResult {
            session_id: "s1".into(),
            fencing_token: token,
            tool_call_id: "t1".into(),
            result: result.clone(),
        },
        Box::new(move || tx.send(()).unwrap()),
    );
    // A result of an older grant is kept but not loaded.
    d.put_result(
        StoredResult {
            session_id: "s1".into(),
            fencing_token: token - 1,
            tool_call_id: "t0".into(),
            result: result.clone(),
        },
        Box::new(|| {}),
    );
    d.wait_durable(t + 1, Duration::from_secs(30))
        .await
        .unwrap();
    rx.recv_timeout(Duration::from_secs(30)).unwrap();

    // Another replica holding a stale snapshot of s2 (an older grant)
    // cannot overwrite it: the upsert's WHERE decides.
    let other = DurableState::open(Arc::new(PgStore::connect(&db.url).unwrap())).unwrap();
    let stale = other.put_session(StoredSession {
        info: info("s2", token, SessionState::Ended),
        lease_expires_at_ms: None,
    });
    other
        .wait_durable(stale, Duration::from_secs(30))
        .await
        .unwrap();
    let d2 = d.clone();
    tokio::task::spawn_blocking(move || d2.shutdown())
        .await
        .unwrap();
    drop(d);

    let d = DurableState::open(Arc::new(PgStore::connect(&db.url).unwrap())).unwrap();
    let (mut sessions, results) = d.load().unwrap();
    sessions.sort_by(|a, b| a.info.session_id.cmp(&b.info.session_id));
    assert_eq!(sessions.len(), 2);
    assert_eq!(sessions[0].info, info("s1", token, SessionState::Active));
    assert_eq!(
        sessions[1].info,
        info("s2", token + 1, SessionState::Disconnected)
    );
    let back = sessions[1].lease_expires_at_ms.unwrap();
    assert!(back.abs_diff(deadline) < 5_000, "{back} against {deadline}");
    assert_eq!(results.len(), 1);
    assert_eq!(results[0].tool_call_id, "t1");
    assert_eq!(results[0].result, result);
    assert_eq!(d.current("s2"), Some(token + 1));
    // New tokens are above everything reserved by both replicas.
    assert!(d.next_fencing_token("s3").unwrap() > token + 1);
    let gone = d.delete_session("s1");
    d.wait_durable(gone, Duration::from_secs(30)).await.unwrap();
    let (sessions, results) = d.load().unwrap();
    assert_eq!(sessions.len(), 1);
    assert!(results.is_empty());
    for s in [d, other] {
        tokio::task::spawn_blocking(move || s.shutdown())
            .await
            .unwrap();
    }
}

#[test]
fn an_unreachable_server_fails_in_time_without_the_password() {
    // Nothing listens on port 1; the error must not echo the password.
    let err = PgStore::connect("postgres://bmx:hunter2@127.0.0.1:1/bmx")
        .unwrap_err()
        .to_string();
    assert!(!err.contains("hunter2"), "{err}");
}

/// `url` with its host replaced and `query` appended (`?` or `&`).
fn tls_url(url: &str, host: &str, query: &str) -> String {
    let url = url.replacen("@127.0.0.1:", &format!("@{host}:"), 1);
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{query}")
}

/// The test server's CA files (scripts/pg.sh), or a loud skip (a failure
/// under CI, which must run them).
fn test_cas() -> Option<(String, String)> {
    match (
        std::env::var("BMX_TEST_PG_CA"),
        std::env::var("BMX_TEST_PG_OTHER_CA"),
    ) {
        (Ok(ca), Ok(other)) => Some((ca, other)),
        _ if std::env::var_os("CI").is_some() => {
            panic!("BMX_TEST_PG_CA is not set under CI: scripts/pg.sh turns TLS on")
        }
        _ => {
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "\n!!! SKIPPED a TLS test: BMX_TEST_PG_CA is not set (scripts/pg.sh) !!!\n"
            );
            None
        }
    }
}

#[test]
fn tls_is_used_as_sslmode_says_and_certificates_are_checked_as_libpq_does() {
    let Some(db) = pg_support::fresh("tls") else {
        return;
    };
    let Some((ca, other)) = test_cas() else {
        return;
    };
    let open = |url: String| PgStore::connect(&url).map(|s| s.encrypted().unwrap());
    // The default (prefer) encrypts when the server offers it, checking
    // nothing; disable never encrypts.
    assert!(open(db.url.clone()).unwrap(), "prefer by default");
    assert!(!open(tls_url(&db.url, "127.0.0.1", "sslmode=disable")).unwrap());
    assert!(open(tls_url(&db.url, "127.0.0.1", "sslmode=require")).unwrap());
    // verify-full: the chain and the name (the certificate is for
    // `localhost` only).
    let full = |host: &str, root: &str| {
        open(tls_url(
            &db.url,
            host,
            &format!("sslmode=verify-full&sslrootcert={root}"),
        ))
    };
    assert!(full("localhost", &ca).unwrap());
    let err = full("127.0.0.1", &ca).unwrap_err().to_string();
    assert!(err.contains("not valid for name"), "{err}");
    let err = full("localhost", &other).unwrap_err().to_string();
    assert!(err.contains("UnknownIssuer"), "{err}");
    // The system's roots do not know the throwaway CA.
    let err = open(tls_url(&db.url, "localhost", "sslmode=verify-full"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("UnknownIssuer"), "{err}");
    // verify-ca: the chain only, so the address passes.
    let ca_only = |root: &str| {
        open(tls_url(
            &db.url,
            "127.0.0.1",
            &format!("sslmode=verify-ca&sslrootcert={root}"),
        ))
    };
    assert!(ca_only(&ca).unwrap());
    assert!(ca_only(&other).is_err());
    // require with roots checks the chain (libpq: a root file makes
    // require behave as verify-ca).
    let err = open(tls_url(
        &db.url,
        "127.0.0.1",
        &format!("sslmode=require&sslrootcert={other}"),
    ))
    .unwrap_err()
    .to_string();
    assert!(err.contains("UnknownIssuer"), "{err}");
    // Pooled connections after the first use the same TLS.
    let s = PgStore::connect(&tls_url(
        &db.url,
        "localhost",
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    ))
    .unwrap();
    std::thread::scope(|sc| {
        for _ in 0..4 {
            sc.spawn(|| assert!(s.encrypted().unwrap()));
        }
    });
}

#[test]
fn a_bad_sslmode_is_refused_before_connecting_and_without_the_password() {
    let err = PgStore::connect("postgres://bmx:hunter2@127.0.0.1:1/bmx?sslmode=verify")
        .unwrap_err()
        .to_string();
    assert!(err.contains("sslmode"), "{err}");
    assert!(!err.contains("hunter2"), "{err}");
}

#[test]
fn the_pool_serves_calls_at_once_and_replaces_killed_connections() {
    let Some(db) = pg_support::fresh("pool") else {
        return;
    };
    let s = PgStore::connect_with(&db.url, 4).unwrap();
    let mut admin = postgres::Client::connect(&db.url, postgres::NoTls).unwrap();
    let name = db.url.rsplit('/').next().unwrap().to_owned();
    let backends = |admin: &mut postgres::Client| -> i64 {
        admin
            .query_one(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE datname = $1 AND application_name = 'bmx-harness'",
                &[&name],
            )
            .unwrap()
            .get(0)
    };
    // The start's own connection (migrations) is closed; wait until its
    // backend has gone, so what is counted below is the pool's.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while backends(&mut admin) > 1 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    // Four callers at once: the store opens more than one connection (the
    // single-connection store queued them all on one), and never more than
    // its bound. A busy machine may run the callers one after another, so
    // a burst that never overlapped is tried again (at most ten bursts).
    let burst = |admin: &mut postgres::Client| {
        let start = std::sync::Barrier::new(4);
        std::thread::scope(|sc| {
            let callers: Vec<_> = (0..4)
                .map(|_| {
                    sc.spawn(|| {
                        start.wait();
                        for _ in 0..300 {
                            s.enrollments(10).unwrap();
                        }
                    })
                })
                .collect();
            let mut peak = 0;
            while !callers.iter().all(|c| c.is_finished()) {
                peak = peak.max(backends(admin));
            }
            peak.max(backends(admin))
        })
    };
    let mut peaks = Vec::new();
    while peaks.len() < 10 && !peaks.iter().any(|p| *p >= 2) {
        peaks.push(burst(&mut admin));
    }
    assert!(
        peaks.iter().any(|p| *p >= 2) && peaks.iter().all(|p| *p <= 4),
        "connections per burst: {peaks:?}"
    );
    // Every connection of the store killed by the server: a call may meet
    // a dead connection (which is then dropped), and the store opens new
    // ones; it never stays broken.
    let version = s.schema_version().unwrap();
    let killed: i64 = admin
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE datname = $1 AND application_name = 'bmx-harness'",
            &[&name],
        )
        .unwrap()
        .get(0);
    assert!(killed >= 1, "{killed}");
    let mut in_a_row = 0;
    for _ in 0..20 {
        match s.schema_version() {
            Ok(v) => {
                assert_eq!(v, version);
                in_a_row += 1;
                if in_a_row == 4 {
                    break;
                }
            }
            Err(_) => in_a_row = 0,
        }
    }
    assert_eq!(in_a_row, 4, "the store did not recover from the kill");
}
