//! Skills: the platform publishes a skill archive (`POST /v1/skills`,
//! stored in the blob store by digest) and installs it into a session
//! (`POST /v1/sessions/{id}/skills`): the harness mints a **one-time
//! download token** and sends `skill.install`; the executor fetches the
//! archive with it (`GET /v1/skill-downloads/{token id}`), verifies the
//! digest and unpacks it ([`crate::executor::skills`] documents the rules).

use super::artifacts::{self, http_base, lock};
use super::sessions::Session;
use crate::harness::blob::Digest;
use crate::harness::error::ApiError;
use crate::wire::types::{SkillInstallParams, SkillInstallResult};
use crate::wire::{Method, RpcError};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The download route; the token's id follows.
pub const DOWNLOAD_PATH: &str = "/v1/skill-downloads";
/// The largest archive published (the executor's own limit is 64 MiB).
pub const MAX_ARCHIVE_BYTES: usize = 64 << 20;
/// How long a download token is good for.
pub const TOKEN_TTL: Duration = Duration::from_secs(60);
/// Skill revisions and outstanding tokens kept at most.
const MAX_REVISIONS: usize = 10_000;
const MAX_TOKENS: usize = 1024;

/// A published revision.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SkillRevision {
    pub skill_id: String,
    pub revision_id: String,
    pub digest: String,
    pub size_bytes: u64,
}

/// `POST /v1/sessions/{id}/skills`.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InstallSkill {
    pub skill_id: String,
    /// Default: the newest published revision.
    pub revision_id: Option<String>,
}

struct Token {
    secret: String,
    digest: Digest,
    expires: Instant,
}

/// Published revisions and outstanding download tokens, in [`crate::harness::runtime::Shared`]
/// (through [`artifacts::Artifacts`]).
#[derive(Default)]
pub struct Skills {
    /// skillId → revisions, oldest first.
    revisions: Mutex<HashMap<String, Vec<SkillRevision>>>,
    tokens: Mutex<HashMap<String, Token>>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Skills {
    /// Store `bytes` as revision `revision_id` of `skill_id`.
    pub async fn publish(
        &self,
        shared: &crate::harness::runtime::Shared,
        skill_id: &str,
        revision_id: &str,
        bytes: &[u8],
    ) -> Result<SkillRevision, ApiError> {
        crate::wire::id::check("skillId", skill_id).map_err(ApiError::invalid_id)?;
        crate::wire::id::check("revisionId", revision_id).map_err(ApiError::invalid_id)?;
        if bytes.len() > MAX_ARCHIVE_BYTES {
            return Err(ApiError::rpc(RpcError::payload_too_large(format!(
                "a skill archive is at most {MAX_ARCHIVE_BYTES} bytes"
            ))));
        }
        let digest = artifacts::store(shared)?
            .put(bytes)
            .await
            .map_err(artifacts::blob_error)?;
        let r = SkillRevision {
            skill_id: skill_id.to_owned(),
            revision_id: revision_id.to_owned(),
            digest: digest.to_string(),
            size_bytes: bytes.len() as u64,
        };
        let mut all = lock(&self.revisions);
        let count: usize = all.values().map(Vec::len).sum();
        let v = all.entry(skill_id.to_owned()).or_default();
        if let Some(existing) = v.iter().find(|x| x.revision_id == revision_id) {
            if existing.digest != r.digest {
                return Err(ApiError::rpc(RpcError::conflict(
                    "revision_exists",
                    format!("revision {revision_id:?} of {skill_id:?} has other bytes"),
                )));
            }
            return Ok(existing.clone());
        }
        if count >= MAX_REVISIONS {
            return Err(ApiError::rpc(RpcError::resource_unavailable(format!(
                "{MAX_REVISIONS} skill revisions are published"
            ))));
        }
        v.push(r.clone());
        Ok(r)
    }

    fn revision(&self, skill_id: &str, revision_id: Option<&str>) -> Option<SkillRevision> {
        let all = lock(&self.revisions);
        let v = all.get(skill_id)?;
        match revision_id {
            Some(id) => v.iter().find(|r| r.revision_id == id).cloned(),
            None => v.last().cloned(),
        }
    }

    /// A one-time token for the blob `digest`: `(id, bearer)`.
    pub(crate) fn mint(&self, digest: Digest) -> Result<(String, String), ApiError> {
        let now = Instant::now();
        let mut tokens = lock(&self.tokens);
        tokens.retain(|_, t| t.expires > now);
        if tokens.len() >= MAX_TOKENS {
            return Err(ApiError::rpc(
                RpcError::resource_unavailable(format!("{MAX_TOKENS} downloads are pending"))
                    .with_reason("downloads_full"),
            ));
        }
        let id = hex(&rand::random::<[u8; 8]>());
        let secret = hex(&rand::random::<[u8; 32]>());
        tokens.insert(
            id.clone(),
            Token {
                secret: secret.clone(),
                digest,
                expires: now + TOKEN_TTL,
            },
        );
        Ok((id.clone(), format!("{id}.{secret}")))
    }

    /// Take the token `id` if `bearer` is it, whole and unexpired: good
    /// once. A wrong secret leaves it in place (a guess cannot burn it).
    pub(crate) fn redeem(&self, id: &str, bearer: Option<&str>) -> Option<Digest> {
        let (bid, secret) = bearer?.split_once('.')?;
        if !crate::harness::http::same_secret(bid, id) {
            return None;
        }
        let mut tokens = lock(&self.tokens);
        let t = tokens.get(id)?;
        if !crate::harness::http::same_secret(&t.secret, secret) {
            return None;
        }
        let t = tokens.remove(id)?;
        (t.expires > Instant::now()).then_some(t.digest)
    }
}

impl Session {
    /// Install a published skill revision into this session.
    ///
    /// # Errors
    ///
    /// 404 for an unknown skill or revision; 501 without a blob store or
    /// when the executor does not install skills. A failed install is an
    /// answer (`state: failed`, `errorCode`), not an error.
    pub async fn install_skill(&self, req: InstallSkill) -> Result<SkillInstallResult, ApiError> {
        artifacts::store(&self.shared)?;
        let skills = &self.shared.artifacts.skills;
        let rev = skills
            .revision(&req.skill_id, req.revision_id.as_deref())
            .ok_or_else(|| {
                ApiError::not_found(format!("no such skill revision of {:?}", req.skill_id))
            })?;
        let caps = artifacts::executor_caps(&self.shared, &self.id)?;
        if !caps.skills.is_some_and(|s| s.install) {
            return Err(ApiError::rpc(RpcError::capability_unavailable("skills")));
        }
        let digest = Digest::parse(&rev.digest).map_err(artifacts::blob_error)?;
        let (id, bearer) = skills.mint(digest)?;
        let expires =
            time::OffsetDateTime::now_utc() + time::Duration::seconds(TOKEN_TTL.as_secs() as i64);
        let params = SkillInstallParams {
            session_id: self.id.clone(),
            skill_id: rev.skill_id.clone(),
            revision_id: rev.revision_id.clone(),
            digest: rev.digest.clone(),
            download_token: bearer,
            download_expires_at: crate::wire::types::rfc3339(expires),
            download_url: Some(format!("{}{DOWNLOAD_PATH}/{id}", http_base(&self.shared))),
        };
        let timeout = self.shared.config.request_timeout + Duration::from_secs(120);
        self.request::<_, SkillInstallResult>(Method::SkillInstall, &params, timeout)
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn download_tokens_are_good_once_and_not_burnt_by_guesses() {
        let s = Skills::default();
        let d = Digest::of(b"skill");
        let (id, bearer) = s.mint(d.clone()).unwrap();
        assert_eq!(
            s.redeem(&id, Some(&format!("{id}.{}", "0".repeat(64)))),
            None
        );
        assert_eq!(s.redeem(&id, None), None);
        assert_eq!(s.redeem(&id, Some(&bearer)), Some(d));
        assert_eq!(s.redeem(&id, Some(&bearer)), None, "used once");
    }
}
