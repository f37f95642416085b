//! A fresh PostgreSQL database per test (issue 17, docs/store.md).
//!
//! `scripts/test.sh` starts a throwaway server and exports `BMX_TEST_PG`,
//! a URL of a database to create others from. Each test gets a database
//! of its own (created here, dropped when the guard goes), so tests run in
//! parallel. Without `BMX_TEST_PG` a test skips with a loud message
//! (written past the test harness's capture),
//! except under CI (`CI` set), where it fails: CI must run them.

#![allow(dead_code)]

use std::sync::atomic::{AtomicU64, Ordering};

/// A database that exists while this lives.
pub struct TestDb {
    admin: String,
    name: String,
    pub url: String,
}

/// A new empty database, or `None` (after saying so) when there is no
/// server to test against.
pub fn fresh(label: &str) -> Option<TestDb> {
    let Ok(admin) = std::env::var("BMX_TEST_PG") else {
        if std::env::var_os("CI").is_some() {
            panic!("BMX_TEST_PG is not set under CI: scripts/test.sh starts PostgreSQL");
        }
        // Straight to the stderr handle, not `eprintln!`: the test
        // harness captures the macro's output of a passing test, and a
        // skip must be seen.
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "\n!!! SKIPPED {label}: BMX_TEST_PG is not set (scripts/test.sh starts a \
             throwaway PostgreSQL and sets it) !!!\n"
        );
        return None;
    };
    static N: AtomicU64 = AtomicU64::new(0);
    let name = format!(
        "bmx_{}_{}_{}",
        label
            .to_ascii_lowercase()
            .replace(|c: char| !c.is_ascii_alphanumeric(), "_"),
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    );
    let admin_c = admin.clone();
    let create = format!("CREATE DATABASE {name}");
    // The blocking client refuses a tokio thread: its own thread.
    std::thread::spawn(move || {
        let mut c =
            postgres::Client::connect(&admin_c, postgres::NoTls).expect("connect BMX_TEST_PG");
        c.batch_execute(&create).expect("create a test database");
    })
    .join()
    .unwrap();
    let url = match admin.rfind('/') {
        Some(i) if admin[..i].contains("://") && admin[i..].len() > 1 => {
            let rest = &admin[i + 1..];
            let query = rest.find('?').map_or("", |q| &rest[q..]);
            format!("{}/{name}{query}", &admin[..i])
        }
        _ => panic!("BMX_TEST_PG must be a postgres://…/db URL"),
    };
    Some(TestDb { admin, name, url })
}

impl TestDb {
    /// Let clients connect to this database, or not: off also ends every
    /// session on it, so a store sees an outage (its connections broken,
    /// new ones refused) while the rest of the server goes on serving the
    /// other tests' databases.
    pub fn set_reachable(&self, on: bool) {
        let admin = self.admin.clone();
        let sql = if on {
            format!("ALTER DATABASE {} ALLOW_CONNECTIONS true", self.name)
        } else {
            format!(
                "ALTER DATABASE {0} ALLOW_CONNECTIONS false; \
                 SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{0}'",
                self.name
            )
        };
        std::thread::spawn(move || {
            let mut c =
                postgres::Client::connect(&admin, postgres::NoTls).expect("connect BMX_TEST_PG");
            c.batch_execute(&sql).expect("change the test database");
        })
        .join()
        .unwrap();
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let admin = self.admin.clone();
        let drop = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name);
        // Best effort: the whole server is thrown away after the run.
        let _ = std::thread::spawn(move || {
            if let Ok(mut c) = postgres::Client::connect(&admin, postgres::NoTls) {
                let _ = c.batch_execute(&drop);
            }
        })
        .join();
    }
}
