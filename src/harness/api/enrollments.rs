//! Enrollments and enrollment-issued credentials, as a platform calls them
//! (the HTTP routes in `http::enrollments` are a thin layer over this).
//!
//! Drives the sans-IO core ([`crate::harness::enroll`]) against the
//! [`Store`]: load, apply with `now`, save. One mutex serializes these
//! read-modify-writes so two polls of one device code cannot both issue.
//! Live credentials are also cached in memory (by token hash), so the
//! executors' upgrade route authenticates without touching the disk.
//!
//! Secrets: device codes and tokens are 256-bit random values; only their
//! SHA-256 hashes are stored or cached, hashes are compared with `subtle`,
//! and no secret is ever passed to `tracing`.

use crate::harness::enroll::{DecisionError, Enrollment, Poll, Status};
use crate::harness::store::{Credential, Store, StoreError};
use dashmap::DashMap;
use rand::RngCore;
use serde::Serialize;
use sha2::{Digest, Sha256};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use subtle::ConstantTimeEq;

/// Longest `workspace` accepted (a path).
pub const MAX_WORKSPACE_BYTES: usize = 4096;
/// Longest `displayName` / `fingerprint`.
pub const MAX_LABEL_BYTES: usize = 256;
/// Longest device code / token accepted for lookup (ours are 69 bytes).
pub const MAX_SECRET_BYTES: usize = 128;
/// Enrollments listed at most.
pub const MAX_LISTED: usize = 1000;
/// Pending (unexpired) enrollments at most: past it, creation answers 429
/// `too_many_pending`, so an unauthenticated create flood cannot fill the
/// store (each one lives only `ttl` anyway).
pub const MAX_PENDING: usize = 1000;
/// How long an enrollment that ended without a credential is kept past its
/// expiry (a late poll still hears `expired`), then pruned.
pub const PRUNE_AFTER: Duration = Duration::from_secs(3600);

/// Letters a person types without confusion (RFC 8628 §6.1: no vowels, no
/// look-alikes).
const USER_CODE_ALPHABET: &[u8] = b"BCDFGHJKLMNPQRSTVWXZ";

/// Why an enrollment call failed (mapped to HTTP statuses by the route).
#[derive(Debug, thiserror::Error)]
pub enum EnrollError {
    #[error("{0}")]
    BadRequest(String),
    #[error("no such {0}")]
    NotFound(&'static str),
    #[error("slow_down")]
    SlowDown,
    /// [`MAX_PENDING`] enrollments are waiting already.
    #[error("too many pending enrollments ({0}): try again later")]
    TooManyPending(usize),
    /// The caller's source has its own cap of pending enrollments waiting
    /// already ([`Enrollments::create_from`]).
    #[error("too many pending enrollments from this address ({0}): ask an operator to approve or deny them, or wait for them to expire")]
    TooManyPendingHere(usize),
    #[error(transparent)]
    Decision(#[from] DecisionError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// What `POST /v1/enrollments` answers (the device code in clear, once).
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Created {
    pub enrollment_id: String,
    pub device_code: String,
    pub user_code: String,
    pub verification_url: String,
    pub verification_url_complete: String,
    pub expires_at: String,
    pub poll_interval_ms: u64,
}

/// What a poll answers.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PollAnswer {
    pub status: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub credential_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub executor_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

/// An enrollment as operators see it (no secrets).
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EnrollmentView {
    pub enrollment_id: String,
    pub user_code: String,
    pub status: Status,
    pub workspace: String,
    pub display_name: String,
    pub fingerprint: String,
    pub created_at: String,
    pub expires_at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub credential_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub executor_id: Option<String>,
}

#[derive(Clone)]
struct Live {
    executor_id: String,
    hash: [u8; 32],
}

/// Pending enrollments by the source that created them, so one source
/// cannot fill the table for everyone (issue 56). In memory: after a
/// restart the enrollments made before it count only against the global
/// cap. Bounded by it too: an entry exists only for a pending enrollment.
#[derive(Default)]
struct BySource {
    /// Source → (enrollment id, expiry in Unix ms) of its pending ones.
    pending: std::collections::HashMap<String, Vec<(String, u64)>>,
}

impl BySource {
    /// Pending enrollments of `source` as of `now` (expired ones dropped,
    /// for every source).
    fn count(&mut self, source: &str, now: u64) -> usize {
        self.pending.retain(|_, v| {
            v.retain(|(_, exp)| *exp > now);
            !v.is_empty()
        });
        self.pending.get(source).map_or(0, Vec::len)
    }

    fn add(&mut self, source: &str, id: &str, expires_ms: u64) {
        self.pending
            .entry(source.to_owned())
            .or_default()
            .push((id.to_owned(), expires_ms));
    }

    /// Enrollment `id` is pending no more.
    fn decided(&mut self, id: &str) {
        self.pending.retain(|_, v| {
            v.retain(|(e, _)| e != id);
            !v.is_empty()
        });
    }
}

/// The enrollment service of one harness.
pub struct Enrollments {
    store: Arc<dyn Store>,
    /// Token hash → live (unrevoked) credential.
    live: DashMap<[u8; 32], Live>,
    /// Serializes every read-modify-write, and holds the pending
    /// enrollments by source.
    rmw: Mutex<BySource>,
    ttl: Duration,
    interval: Duration,
    max_pending: usize,
}

/// SHA-256 of a secret.
pub fn hash_secret(secret: &str) -> [u8; 32] {
    Sha256::digest(secret.as_bytes()).into()
}

fn random_secret(prefix: &str) -> String {
    let mut b = [0u8; 32];
    rand::rng().fill_bytes(&mut b);
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("{prefix}{hex}")
}

fn user_code() -> String {
    let mut b = [0u8; 8];
    rand::rng().fill_bytes(&mut b);
    let c: Vec<char> = b
        .iter()
        .map(|x| USER_CODE_ALPHABET[*x as usize % USER_CODE_ALPHABET.len()] as char)
        .collect();
    format!(
        "{}-{}",
        c[..4].iter().collect::<String>(),
        c[4..].iter().collect::<String>()
    )
}

/// `wdjb mjht`, `WDJBMJHT`, `wdjb-mjht` → `WDJB-MJHT`; `None` if it cannot
/// be a user code.
pub fn normalize_user_code(code: &str) -> Option<String> {
    if code.len() > 32 {
        return None;
    }
    let letters: String = code
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .map(|c| c.to_ascii_uppercase())
        .collect();
    (letters.len() == 8).then(|| format!("{}-{}", &letters[..4], &letters[4..]))
}

/// Unix milliseconds now.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// RFC 3339 of Unix milliseconds.
pub fn rfc3339_ms(ms: u64) -> String {
    time::OffsetDateTime::from_unix_timestamp_nanos(ms as i128 * 1_000_000)
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_default()
}

fn short_id(prefix: &str) -> String {
    format!(
        "{prefix}{}",
        &uuid::Uuid::new_v4().simple().to_string()[..16]
    )
}

fn view(e: &Enrollment, now: u64) -> EnrollmentView {
    EnrollmentView {
        enrollment_id: e.id.clone(),
        user_code: e.user_code.clone(),
        status: e.status_at(now),
        workspace: e.workspace.clone(),
        display_name: e.display_name.clone(),
        fingerprint: e.fingerprint.clone(),
        created_at: rfc3339_ms(e.created_at_ms),
        expires_at: rfc3339_ms(e.expires_at_ms),
        credential_id: e.credential_id.clone(),
        executor_id: e.executor_id.clone(),
    }
}

impl Enrollments {
    /// The service over `store`; loads the live credentials.
    ///
    /// # Errors
    ///
    /// The store cannot be read.
    pub fn new(
        store: Arc<dyn Store>,
        ttl: Duration,
        interval: Duration,
    ) -> Result<Enrollments, StoreError> {
        let live = DashMap::new();
        for c in store.credentials()? {
            if c.revoked_at_ms.is_none() {
                live.insert(
                    c.token_hash,
                    Live {
                        executor_id: c.executor_id,
                        hash: c.token_hash,
                    },
                );
            }
        }
        Ok(Enrollments {
            store,
            live,
            rmw: Mutex::new(BySource::default()),
            ttl,
            interval,
            max_pending: MAX_PENDING,
        })
    }

    /// Another cap on pending enrollments than [`MAX_PENDING`].
    pub fn with_max_pending(mut self, max: usize) -> Enrollments {
        self.max_pending = max;
        self
    }

    fn guard(&self) -> std::sync::MutexGuard<'_, BySource> {
        self.rmw
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The executor id of an enrollment-issued, unrevoked token.
    pub fn authenticate(&self, token: &str) -> Option<String> {
        if token.len() > MAX_SECRET_BYTES {
            return None;
        }
        let hash = hash_secret(token);
        let live = self.live.get(&hash)?;
        bool::from(live.hash.ct_eq(&hash)).then(|| live.executor_id.clone())
    }

    /// `POST /v1/enrollments`. `api_base` is where operators reach the API.
    ///
    /// # Errors
    ///
    /// Oversized or empty fields; [`MAX_PENDING`] enrollments pending; the
    /// store fails.
    pub fn create(
        &self,
        workspace: &str,
        display_name: &str,
        fingerprint: &str,
        api_base: &str,
    ) -> Result<Created, EnrollError> {
        self.create_from(None, workspace, display_name, fingerprint, api_base)
    }

    /// [`create`](Self::create) for a caller from `from = (source, cap)`:
    /// `source` is an opaque key of where the request came from (the HTTP
    /// layer passes the peer's address), and at most `cap` enrollments of
    /// one source may be pending at once, so one source cannot lock the
    /// others out by filling the global cap.
    ///
    /// # Errors
    ///
    /// As [`create`](Self::create); [`EnrollError::TooManyPendingHere`]
    /// past the source's cap.
    pub fn create_from(
        &self,
        from: Option<(&str, usize)>,
        workspace: &str,
        display_name: &str,
        fingerprint: &str,
        api_base: &str,
    ) -> Result<Created, EnrollError> {
        if workspace.is_empty() || workspace.len() > MAX_WORKSPACE_BYTES {
            return Err(EnrollError::BadRequest(format!(
                "workspace must be 1..={MAX_WORKSPACE_BYTES} bytes"
            )));
        }
        if display_name.len() > MAX_LABEL_BYTES || fingerprint.len() > MAX_LABEL_BYTES {
            return Err(EnrollError::BadRequest(format!(
                "displayName and fingerprint must be at most {MAX_LABEL_BYTES} bytes"
            )));
        }
        let now = unix_ms();
        let device_code = random_secret("bmxd_");
        let mut book = self.guard();
        if let Some((source, cap)) = from {
            if book.count(source, now) >= cap {
                return Err(EnrollError::TooManyPendingHere(cap));
            }
        }
        let pruned = self
            .store
            .prune_enrollments(now.saturating_sub(PRUNE_AFTER.as_millis() as u64))?;
        if pruned > 0 {
            tracing::info!(pruned, "pruned ended enrollments");
        }
        if self.store.count_pending(now)? >= self.max_pending {
            return Err(EnrollError::TooManyPending(self.max_pending));
        }
        // A user code is 20^8 ≈ 2.6e10: a clash is rare; retry a few times.
        for _ in 0..8 {
            let code = user_code();
            if self.store.enrollment_by_user_code(&code)?.is_some() {
                continue;
            }
            let e = Enrollment::new(
                short_id("enr-"),
                hash_secret(&device_code),
                code.clone(),
                workspace.to_owned(),
                display_name.to_owned(),
                fingerprint.to_owned(),
                now,
                self.ttl.as_millis() as u64,
                self.interval.as_millis() as u64,
            );
            self.store.put_enrollment(&e)?;
            if let Some((source, _)) = from {
                book.add(source, &e.id, e.expires_at_ms);
            }
            tracing::info!(enrollment = %e.id, user_code = %e.user_code, "enrollment created");
            let url = format!("{api_base}/v1/enrollments?status=pending");
            return Ok(Created {
                enrollment_id: e.id,
                device_code,
                verification_url_complete: format!("{url}&userCode={code}"),
                verification_url: url,
                user_code: code,
                expires_at: rfc3339_ms(e.expires_at_ms),
                poll_interval_ms: e.interval_ms,
            });
        }
        Err(EnrollError::BadRequest(
            "cannot allocate a user code".into(),
        ))
    }

    /// `POST /v1/enrollments/poll`.
    ///
    /// # Errors
    ///
    /// Unknown device code (404), too fast (`SlowDown`), the store fails.
    pub fn poll(&self, device_code: &str) -> Result<PollAnswer, EnrollError> {
        if device_code.is_empty() || device_code.len() > MAX_SECRET_BYTES {
            return Err(EnrollError::NotFound("enrollment"));
        }
        let hash = hash_secret(device_code);
        let now = unix_ms();
        let _g = self.guard();
        let mut e = self
            .store
            .enrollment_by_device_hash(&hash)?
            .filter(|e| bool::from(e.device_code_hash.ct_eq(&hash)))
            .ok_or(EnrollError::NotFound("enrollment"))?;
        let before = e.clone();
        let outcome = e.poll(now);
        let answer = |status| PollAnswer {
            status,
            credential_id: None,
            executor_id: None,
            token: None,
        };
        let out = match outcome {
            Poll::SlowDown => return Err(EnrollError::SlowDown),
            Poll::Pending => answer("pending"),
            Poll::Consumed => answer("consumed"),
            Poll::Denied => answer("denied"),
            Poll::Expired => answer("expired"),
            Poll::Issue {
                credential_id,
                executor_id,
            } => {
                let token = random_secret("bmxe_");
                let c = Credential {
                    credential_id: credential_id.clone(),
                    executor_id: executor_id.clone(),
                    token_hash: hash_secret(&token),
                    enrollment_id: e.id.clone(),
                    workspace: e.workspace.clone(),
                    display_name: e.display_name.clone(),
                    created_at_ms: now,
                    revoked_at_ms: None,
                };
                self.store.issue(&e, &c)?;
                self.live.insert(
                    c.token_hash,
                    Live {
                        executor_id: executor_id.clone(),
                        hash: c.token_hash,
                    },
                );
                tracing::info!(enrollment = %e.id, credential = %credential_id, executor = %executor_id, "credential issued");
                return Ok(PollAnswer {
                    status: "approved",
                    credential_id: Some(credential_id),
                    executor_id: Some(executor_id),
                    token: Some(token),
                });
            }
        };
        if e != before {
            self.store.put_enrollment(&e)?;
        }
        Ok(out)
    }

    fn decide(&self, user_code: &str, approve: bool) -> Result<EnrollmentView, EnrollError> {
        let code = normalize_user_code(user_code).ok_or(EnrollError::NotFound("user code"))?;
        let now = unix_ms();
        let mut book = self.guard();
        let mut e = self
            .store
            .enrollment_by_user_code(&code)?
            .ok_or(EnrollError::NotFound("user code"))?;
        let r = if approve {
            e.approve(now, short_id("cred-"), short_id("runner-"))
        } else {
            e.deny(now)
        };
        if let Err(err) = r {
            // Expiry found by the decision is worth keeping.
            if e.status == Status::Expired {
                self.store.put_enrollment(&e)?;
            }
            return Err(err.into());
        }
        self.store.put_enrollment(&e)?;
        book.decided(&e.id);
        tracing::info!(enrollment = %e.id, approved = approve, "enrollment decided");
        Ok(view(&e, now))
    }

    /// `POST /v1/enrollments/approve`.
    ///
    /// # Errors
    ///
    /// Unknown code (404), not pending (409), the store fails.
    pub fn approve(&self, user_code: &str) -> Result<EnrollmentView, EnrollError> {
        self.decide(user_code, true)
    }

    /// `POST /v1/enrollments/deny`.
    ///
    /// # Errors
    ///
    /// As [`approve`](Self::approve).
    pub fn deny(&self, user_code: &str) -> Result<EnrollmentView, EnrollError> {
        self.decide(user_code, false)
    }

    /// `GET /v1/enrollments[?status=S]`.
    ///
    /// # Errors
    ///
    /// The store fails.
    pub fn list(&self, status: Option<Status>) -> Result<Vec<EnrollmentView>, EnrollError> {
        let now = unix_ms();
        Ok(self
            .store
            .enrollments(MAX_LISTED)?
            .iter()
            .map(|e| view(e, now))
            .filter(|v| status.is_none_or(|s| v.status == s))
            .collect())
    }

    /// `GET /v1/credentials`.
    ///
    /// # Errors
    ///
    /// The store fails.
    pub fn credentials(&self) -> Result<Vec<Credential>, EnrollError> {
        Ok(self.store.credentials()?)
    }

    /// `DELETE /v1/credentials/{id}`: revoke; returns it (with its
    /// executor id, whose connection the caller closes with 4001).
    ///
    /// # Errors
    ///
    /// Unknown id (404), the store fails.
    pub fn revoke(&self, credential_id: &str) -> Result<Credential, EnrollError> {
        let _g = self.guard();
        let c = self
            .store
            .revoke(credential_id, unix_ms())?
            .ok_or(EnrollError::NotFound("credential"))?;
        self.live.remove(&c.token_hash);
        tracing::info!(credential = %c.credential_id, executor = %c.executor_id, "credential revoked");
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::store::SqliteStore;

    fn service() -> Enrollments {
        Enrollments::new(
            Arc::new(SqliteStore::in_memory().unwrap()),
            Duration::from_secs(60),
            Duration::from_millis(0),
        )
        .unwrap()
    }

    #[test]
    fn codes_have_the_documented_shape() {
        let c = user_code();
        assert_eq!(normalize_user_code(&c).as_deref(), Some(c.as_str()));
        assert_eq!(
            normalize_user_code("wdjb mjht").as_deref(),
            Some("WDJB-MJHT")
        );
        assert_eq!(normalize_user_code("short"), None);
        let d = random_secret("bmxd_");
        assert_eq!(d.len(), 5 + 64);
    }

    #[test]
    fn approve_poll_authenticate_revoke() {
        let s = service();
        let c = s.create("/w", "laptop", "fp", "http://h").unwrap();
        assert_eq!(s.poll(&c.device_code).unwrap().status, "pending");
        assert!(matches!(s.poll("bmxd_nope"), Err(EnrollError::NotFound(_))));
        let v = s.approve(&c.user_code.to_lowercase()).unwrap();
        assert_eq!(v.status, Status::Approved);
        assert!(matches!(
            s.approve(&c.user_code),
            Err(EnrollError::Decision(_))
        ));
        let a = s.poll(&c.device_code).unwrap();
        assert_eq!(a.status, "approved");
        let token = a.token.unwrap();
        assert_eq!(s.poll(&c.device_code).unwrap().status, "consumed");
        assert_eq!(s.authenticate(&token), a.executor_id);
        assert_eq!(s.authenticate("bmxe_wrong"), None);
        s.revoke(a.credential_id.as_deref().unwrap()).unwrap();
        assert_eq!(s.authenticate(&token), None);
        // Stored hashed only.
        let cred = &s.credentials().unwrap()[0];
        assert_eq!(cred.token_hash, hash_secret(&token));
    }

    #[test]
    fn one_source_cannot_fill_the_table_for_the_others() {
        let s = service();
        for i in 0..3 {
            s.create_from(
                Some(("198.51.100.7", 3)),
                &format!("/w{i}"),
                "",
                "",
                "http://h",
            )
            .unwrap();
        }
        assert!(matches!(
            s.create_from(Some(("198.51.100.7", 3)), "/w", "", "", "http://h"),
            Err(EnrollError::TooManyPendingHere(3))
        ));
        // Another source still gets through.
        let other = s
            .create_from(Some(("203.0.113.9", 3)), "/w", "", "", "http://h")
            .unwrap();
        assert_eq!(other.poll_interval_ms, 0);
        // A decision frees the source's slot.
        let pending = s.list(Some(Status::Pending)).unwrap();
        let first = pending.iter().find(|e| e.workspace == "/w0").unwrap();
        s.deny(&first.user_code).unwrap();
        s.create_from(Some(("198.51.100.7", 3)), "/w3", "", "", "http://h")
            .unwrap();
    }

    #[test]
    fn pending_enrollments_are_capped_and_ended_ones_pruned() {
        let store = Arc::new(SqliteStore::in_memory().unwrap());
        let s = Enrollments::new(store.clone(), Duration::from_secs(60), Duration::ZERO)
            .unwrap()
            .with_max_pending(2);
        let a = s.create("/a", "", "", "http://h").unwrap();
        s.create("/b", "", "", "http://h").unwrap();
        assert!(matches!(
            s.create("/c", "", "", "http://h"),
            Err(EnrollError::TooManyPending(2))
        ));
        // A decision frees a slot.
        s.deny(&a.user_code).unwrap();
        s.create("/c", "", "", "http://h").unwrap();
        assert_eq!(store.count_pending(unix_ms()).unwrap(), 2);
        // Nothing has expired long enough ago to be pruned.
        assert_eq!(store.prune_enrollments(unix_ms()).unwrap(), 0);
        // Far in the future: every one that ended without a credential
        // goes, and the pending ones too (they expired by then).
        let later = unix_ms() + 3_600_000;
        assert_eq!(store.prune_enrollments(later).unwrap(), 3);
        assert!(s.list(None).unwrap().is_empty());
    }
}
