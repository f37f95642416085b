//! Draining an executor (`POST /v1/executors/{id}/drain`, PROTOCOL.md §2
//! step 8): the harness sends `executor.drain` over the executor's live
//! connection, and from then on places no new session there. The executor
//! refuses new assigns itself (-32029, `draining`), lets its sessions run
//! until the deadline, stops the rest and closes with 1001.
//!
//! The mark is on the connection (`ConnEntry::draining`), not the executor
//! id: a drained executor that comes back on a new connection is a fresh
//! process and takes sessions again.

use super::super::error::ApiError;
use super::super::runtime::Shared;
use crate::wire::types::{DrainParams, DrainResult};
use crate::wire::Method;
use serde::{Deserialize, Serialize};

/// The longest drain deadline the API passes on (a day).
pub const MAX_DEADLINE_MS: u64 = 24 * 60 * 60 * 1000;

/// Characters of a drain reason, at most.
pub const MAX_REASON_CHARS: usize = 256;

/// `POST /v1/executors/{id}/drain` body.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DrainRequest {
    /// Why (default `operator`); shown in the executor's log.
    #[serde(default)]
    pub reason: Option<String>,
    /// How long running sessions may go on (default: the executor's own).
    #[serde(default)]
    pub deadline_ms: Option<u64>,
}

/// Drain `executor_id`.
///
/// # Errors
///
/// 400 for a bad reason or deadline, 404 when no such executor is
/// connected, and the executor's own error (or a timeout) otherwise.
pub async fn drain(
    shared: &Shared,
    executor_id: &str,
    req: DrainRequest,
) -> Result<DrainResult, ApiError> {
    let reason = req.reason.unwrap_or_else(|| "operator".into());
    if reason.is_empty()
        || reason.chars().count() > MAX_REASON_CHARS
        || reason.chars().any(char::is_control)
    {
        return Err(ApiError::bad_request(format!(
            "reason must be 1 to {MAX_REASON_CHARS} characters, no control characters"
        )));
    }
    if req.deadline_ms.is_some_and(|ms| ms > MAX_DEADLINE_MS) {
        return Err(ApiError::bad_request(format!(
            "deadlineMs must be at most {MAX_DEADLINE_MS}"
        )));
    }
    let conn = shared.executors.get(executor_id).map(|c| *c);
    let link = conn
        .and_then(|c| shared.conns.get(&c).map(|e| e.clone()))
        .filter(|e| e.registered)
        .map(|e| e.link)
        .ok_or_else(|| super::terminals::unknown_executor(executor_id))?;
    let params = DrainParams {
        reason,
        deadline_ms: req.deadline_ms,
    };
    let r: DrainResult = link
        .request(
            Method::ExecutorDrain,
            &params,
            shared.config.request_timeout,
        )
        .await
        .map_err(ApiError::from_call)?;
    if r.accepted {
        if let Some(mut e) = conn.and_then(|c| shared.conns.get_mut(&c)) {
            e.draining = true;
        }
        tracing::info!(executor = executor_id, "executor draining");
    }
    Ok(r)
}
