//! Workspace backups: the platform asks
//! (`POST /v1/sessions/{id}/backups`), the harness sends
//! `workspace.backup` with an upload ticket, the executor archives the
//! workspace and uploads the archive like an artifact
//! ([`super::artifacts`]). The backups of a session are listed with
//! their fingerprints, so the next request can say `skipIfFingerprint`.
//! Idempotent by `backupId`: a completed backup is answered from here
//! without asking the executor again.

use super::artifacts::{self, http_base, lock, UPLOAD_PATH};
use super::sessions::Session;
use crate::harness::error::ApiError;
use crate::wire::types::{UploadTarget, WorkspaceBackupParams, WorkspaceBackupResult};
use crate::wire::{Method, RpcError};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Backups remembered per session (oldest forgotten first).
const MAX_PER_SESSION: usize = 256;
/// `paths` and `exclude` entries at most.
const MAX_PATTERNS: usize = 256;

/// `POST /v1/sessions/{id}/backups`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BackupRequest {
    /// Default: a fresh `b-<uuid>`.
    pub backup_id: Option<String>,
    #[serde(default)]
    pub paths: Vec<String>,
    #[serde(default)]
    pub exclude: Vec<String>,
    pub skip_if_fingerprint: Option<String>,
}

/// A backup as the API lists it: the executor's result plus its id and
/// when it was taken.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct BackupView {
    pub backup_id: String,
    pub created_at: String,
    #[serde(flatten)]
    pub result: WorkspaceBackupResult,
}

fn check_list(what: &str, v: &[String]) -> Result<(), ApiError> {
    if v.len() > MAX_PATTERNS
        || v.iter()
            .any(|p| p.is_empty() || p.len() > 4096 || p.contains('\0'))
    {
        return Err(ApiError::bad_request(format!(
            "{what}: at most {MAX_PATTERNS} entries of 1..4096 bytes, no NUL"
        )));
    }
    Ok(())
}

impl Session {
    /// Back up this session's workspace (or `req.paths` of it).
    ///
    /// # Errors
    ///
    /// 501 without a blob store or when the executor does not offer
    /// `workspace.backup`; the executor's refusal (-32602
    /// `workspace_boundary`, a bad pattern). A backup that ran and failed
    /// is an answer (`state: failed`), not an error.
    pub async fn backup(&self, req: BackupRequest) -> Result<BackupView, ApiError> {
        let blobs = artifacts::store(&self.shared)?;
        check_list("paths", &req.paths)?;
        check_list("exclude", &req.exclude)?;
        let backup_id = req
            .backup_id
            .unwrap_or_else(|| format!("b-{}", uuid::Uuid::new_v4().simple()));
        crate::wire::id::check("backupId", &backup_id).map_err(ApiError::invalid_id)?;
        if let Some(done) = lock(&self.shared.artifacts.backups)
            .get(&self.id)
            .and_then(|v| v.iter().find(|b| b.backup_id == backup_id).cloned())
        {
            return Ok(done);
        }
        let caps = artifacts::executor_caps(&self.shared, &self.id)?;
        if !caps.workspace.is_some_and(|w| w.backup) {
            return Err(ApiError::rpc(RpcError::capability_unavailable("workspace")));
        }
        let timeout = self.shared.config.tool_timeout;
        let ttl = timeout + Duration::from_millis(self.shared.config.lease_ttl_ms);
        let (id, bearer) = self.shared.artifacts.mint(&self.id, ttl)?;
        let params = WorkspaceBackupParams {
            session_id: self.id.clone(),
            backup_id: backup_id.clone(),
            paths: req.paths,
            exclude: req.exclude,
            skip_if_fingerprint: req.skip_if_fingerprint,
            upload: Some(UploadTarget {
                url: format!("{}{UPLOAD_PATH}/{id}", http_base(&self.shared)),
                ticket: bearer,
            }),
            max_bytes: Some(blobs.max_bytes()),
        };
        let r = self
            .request_resending::<_, WorkspaceBackupResult>(
                Method::WorkspaceBackup,
                &params,
                timeout,
            )
            .await;
        self.shared.artifacts.forget_upload(&id);
        let view = BackupView {
            backup_id,
            created_at: crate::wire::types::now_rfc3339(),
            result: r?,
        };
        if view.result.state == "completed" {
            let mut all = lock(&self.shared.artifacts.backups);
            let v = all.entry(self.id.clone()).or_default();
            if v.len() >= MAX_PER_SESSION {
                v.remove(0);
            }
            v.push(view.clone());
        }
        Ok(view)
    }

    /// The completed backups of this session, oldest first.
    ///
    /// # Errors
    ///
    /// 404 for a session the harness does not know.
    pub fn backups(&self) -> Result<Vec<BackupView>, ApiError> {
        let v = lock(&self.shared.artifacts.backups)
            .get(&self.id)
            .cloned()
            .unwrap_or_default();
        if v.is_empty() && !self.shared.sessions.contains_key(&self.id) {
            return Err(ApiError::unknown_session(&self.id));
        }
        Ok(v)
    }
}
