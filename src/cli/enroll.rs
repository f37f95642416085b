//! `bmx enroll` (the device side of enrollment) and `bmx enrollments
//! ls|approve|deny` plus `bmx credentials ls|revoke` (the operator side).
//! See docs/runner.md.

use bmx::client::{encode_component, ApiClient};
use bmx::runner::credentials::{
    bmx_home, CredentialStore, HarnessCredentials, LocalCredential, PendingEnrollment,
};
use bmx::runner::envelope::Response;
use clap::{Args, Subcommand};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use super::text::{cell, say, say_json, warn_line};

/// Exit statuses of `bmx enroll`, one per terminal outcome.
pub const EXIT_DENIED: u8 = 10;
pub const EXIT_EXPIRED: u8 = 11;
pub const EXIT_SUPERSEDED: u8 = 12;
pub const EXIT_ACTIVE_CREDENTIAL: u8 = 13;

/// Enroll this machine's executor for a workspace with a harness: print a
/// code for an operator to approve, wait, save the credential. Exit
/// status: 0 enrolled, 10 denied, 11 expired, 12 superseded by a newer
/// local enrollment, 13 already enrolled (use --replace), 2 bad
/// arguments, 1 other errors.
#[derive(Debug, Args)]
pub struct EnrollArgs {
    /// The harness API, e.g. http://127.0.0.1:7070.
    #[arg(long, env = "BMX_HARNESS")]
    pub harness: String,
    /// The workspace the executor will be bound to.
    #[arg(long, value_name = "DIR")]
    pub workspace: PathBuf,
    /// Name shown to the operator (default: the host name).
    #[arg(long)]
    pub name: Option<String>,
    /// Replace an active local credential (and supersede a pending
    /// enrollment) for this harness and workspace.
    #[arg(long)]
    pub replace: bool,
}

/// Operator commands on enrollments.
#[derive(Debug, Subcommand)]
pub enum EnrollmentsCommand {
    /// List enrollments (pending by default).
    Ls(OperatorArgs),
    /// Approve the enrollment with this user code.
    Approve(DecideArgs),
    /// Deny the enrollment with this user code.
    Deny(DecideArgs),
}

/// Operator commands on enrollment-issued credentials.
#[derive(Debug, Subcommand)]
pub enum CredentialsCommand {
    /// List credentials.
    Ls(OperatorArgs),
    /// Revoke one: its executor's connection is closed (4001) and its
    /// next connect refused.
    Revoke(RevokeArgs),
}

#[derive(Debug, Args)]
pub struct OperatorArgs {
    #[arg(long, env = "BMX_HARNESS", default_value = "http://127.0.0.1:7070")]
    pub harness: String,
    #[arg(long, env = "BMX_API_TOKEN", hide_env_values = true)]
    pub api_token: Option<String>,
    /// `pending` (default), `approved`, `denied`, `expired`, `consumed` or `all`.
    #[arg(long, default_value = "pending")]
    pub status: String,
    /// Print the answer as one `--json` envelope line.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct DecideArgs {
    /// The user code the device printed (e.g. WDJB-MJHT).
    pub code: String,
    #[arg(long, env = "BMX_HARNESS", default_value = "http://127.0.0.1:7070")]
    pub harness: String,
    #[arg(long, env = "BMX_API_TOKEN", hide_env_values = true)]
    pub api_token: Option<String>,
}

#[derive(Debug, Args)]
pub struct RevokeArgs {
    pub credential_id: String,
    #[arg(long, env = "BMX_HARNESS", default_value = "http://127.0.0.1:7070")]
    pub harness: String,
    #[arg(long, env = "BMX_API_TOKEN", hide_env_values = true)]
    pub api_token: Option<String>,
}

fn client(harness: &str, token: Option<String>) -> Result<ApiClient, ExitCode> {
    ApiClient::new(harness)
        .map(|c| c.token(token).timeout(Duration::from_secs(30)))
        .map_err(|e| {
            warn_line!("bmx: {harness}: {e}");
            ExitCode::from(2)
        })
}

fn api_message(v: &Value) -> String {
    match (v["error"].as_str(), v["message"].as_str()) {
        (Some(c), Some(m)) => format!("{m} ({c})"),
        _ => match v.get("error") {
            Some(e) if e.is_object() => e["message"].as_str().unwrap_or("error").to_owned(),
            _ => v.to_string(),
        },
    }
}

pub async fn run_enrollments(cmd: EnrollmentsCommand) -> ExitCode {
    match cmd {
        EnrollmentsCommand::Ls(a) => {
            let c = match client(&a.harness, a.api_token) {
                Ok(c) => c,
                Err(e) => return e,
            };
            let path = format!("/v1/enrollments?status={}", encode_component(&a.status));
            match c.get(&path).await {
                Ok((200, v)) => {
                    if a.json {
                        say_json(&Response::success(&v, None).to_line());
                    } else {
                        say!(
                            "{:<10} {:<10} {:<20} {:<20} WORKSPACE",
                            "CODE",
                            "STATUS",
                            "NAME",
                            "EXPIRES"
                        );
                        for e in v["enrollments"].as_array().into_iter().flatten() {
                            // Escaped per cell, so the columns stay aligned
                            // (an unauthenticated device chose displayName).
                            say!(
                                "{:<10} {:<10} {:<20} {:<20} {}",
                                cell(&e["userCode"], "-"),
                                cell(&e["status"], "-"),
                                cell(&e["displayName"], "-"),
                                cell(&e["expiresAt"], "-"),
                                cell(&e["workspace"], "-"),
                            );
                        }
                    }
                    ExitCode::SUCCESS
                }
                Ok((_, v)) => failed(a.json, "enrollments ls", api_message(&v)),
                Err(e) => failed(a.json, "enrollments ls", format!("{}: {e}", a.harness)),
            }
        }
        EnrollmentsCommand::Approve(a) => decide(a, "approve").await,
        EnrollmentsCommand::Deny(a) => decide(a, "deny").await,
    }
}

async fn decide(a: DecideArgs, verb: &str) -> ExitCode {
    let c = match client(&a.harness, a.api_token) {
        Ok(c) => c,
        Err(e) => return e,
    };
    match c
        .post(
            &format!("/v1/enrollments/{verb}"),
            &json!({"userCode": a.code}),
        )
        .await
    {
        Ok((200, v)) => {
            say!(
                "{} {} ({}, workspace {})",
                if verb == "approve" {
                    "approved"
                } else {
                    "denied"
                },
                v["userCode"].as_str().unwrap_or(&a.code),
                v["displayName"].as_str().unwrap_or("-"),
                v["workspace"].as_str().unwrap_or("-")
            );
            ExitCode::SUCCESS
        }
        Ok((_, v)) => {
            warn_line!("bmx enrollments {verb}: {}", api_message(&v));
            ExitCode::from(1)
        }
        Err(e) => {
            warn_line!("bmx enrollments {verb}: {}: {e}", a.harness);
            ExitCode::from(1)
        }
    }
}

pub async fn run_credentials(cmd: CredentialsCommand) -> ExitCode {
    match cmd {
        CredentialsCommand::Ls(a) => {
            let c = match client(&a.harness, a.api_token) {
                Ok(c) => c,
                Err(e) => return e,
            };
            match c.get("/v1/credentials").await {
                Ok((200, v)) if a.json => {
                    say_json(&Response::success(&v, None).to_line());
                    ExitCode::SUCCESS
                }
                Ok((200, v)) => {
                    say_json(&v.to_string());
                    ExitCode::SUCCESS
                }
                Ok((_, v)) => failed(a.json, "credentials ls", api_message(&v)),
                Err(e) => failed(a.json, "credentials ls", format!("{}: {e}", a.harness)),
            }
        }
        CredentialsCommand::Revoke(a) => {
            let c = match client(&a.harness, a.api_token) {
                Ok(c) => c,
                Err(e) => return e,
            };
            let path = format!("/v1/credentials/{}", encode_component(&a.credential_id));
            match c.delete(&path).await {
                Ok((200, v)) => {
                    say!(
                        "revoked {} (executor {}, {} connection(s) closed)",
                        a.credential_id,
                        v["executorId"].as_str().unwrap_or("-"),
                        v["connectionsClosed"]
                    );
                    ExitCode::SUCCESS
                }
                Ok((_, v)) => {
                    warn_line!("bmx credentials revoke: {}", api_message(&v));
                    ExitCode::from(1)
                }
                Err(e) => {
                    warn_line!("bmx credentials revoke: {}: {e}", a.harness);
                    ExitCode::from(1)
                }
            }
        }
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Run `f` on the harness's file under the store lock, saving what it returns.
fn update<T>(
    store: &CredentialStore,
    url: &str,
    f: impl FnOnce(&mut HarnessCredentials) -> T,
) -> Result<T, String> {
    let _g = store.lock().map_err(|e| e.to_string())?;
    let mut c = store.load(url).map_err(|e| e.to_string())?;
    c.harness = url.to_owned();
    let out = f(&mut c);
    store.save(url, &c).map_err(|e| e.to_string())?;
    Ok(out)
}

pub async fn run_enroll(args: EnrollArgs) -> ExitCode {
    let url = args.harness.trim_end_matches('/').to_owned();
    let workspace = match std::fs::canonicalize(&args.workspace) {
        Ok(p) if p.is_dir() => p.to_string_lossy().into_owned(),
        _ => {
            warn_line!(
                "bmx enroll: --workspace {}: not a directory",
                args.workspace.display()
            );
            return ExitCode::from(2);
        }
    };
    let api = match client(&url, None) {
        Ok(c) => c,
        Err(e) => return e,
    };
    let store = CredentialStore::new(&bmx_home());
    if let Err(e) = store.path_for(&url) {
        warn_line!("bmx enroll: {e}");
        return ExitCode::from(2);
    }
    let existing = match store.load(&url) {
        Ok(c) => c,
        Err(e) => {
            warn_line!("bmx enroll: {e}");
            return ExitCode::from(1);
        }
    };
    if existing.credentials.contains_key(&workspace) && !args.replace {
        warn_line!("bmx enroll: this executor already has an active local credential for {url} and {workspace} (use --replace to enroll again)");
        return ExitCode::from(EXIT_ACTIVE_CREDENTIAL);
    }
    let resumable = existing
        .pending
        .get(&workspace)
        .filter(|p| p.expires_at_ms > now_ms() && !args.replace)
        .cloned();
    let (pending, resumed) = match resumable {
        Some(p) => (p, true),
        None => {
            let name = args
                .name
                .clone()
                .unwrap_or_else(bmx::executor::config::hostname);
            let body = json!({
                "workspace": workspace,
                "displayName": name,
                "fingerprint": fingerprint(),
            });
            let v = match api.post("/v1/enrollments", &body).await {
                Ok((201, v)) => v,
                Ok((_, v)) => {
                    warn_line!("bmx enroll: the harness refused: {}", api_message(&v));
                    return ExitCode::from(1);
                }
                Err(e) => {
                    warn_line!("bmx enroll: {url}: {e}");
                    return ExitCode::from(1);
                }
            };
            let interval = v["pollIntervalMs"].as_u64().unwrap_or(5000);
            let expires = v["expiresAt"]
                .as_str()
                .and_then(|s| {
                    time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339)
                        .ok()
                })
                .map(|t| (t.unix_timestamp_nanos() / 1_000_000) as u64);
            let (Some(device), Some(user), Some(expires)) =
                (v["deviceCode"].as_str(), v["userCode"].as_str(), expires)
            else {
                warn_line!("bmx enroll: the harness answered an unexpected enrollment");
                return ExitCode::from(1);
            };
            let p = PendingEnrollment {
                enrollment_id: v["enrollmentId"].as_str().unwrap_or_default().to_owned(),
                device_code: device.to_owned(),
                user_code: user.to_owned(),
                verification_url: v["verificationUrl"].as_str().unwrap_or_default().to_owned(),
                verification_url_complete: v["verificationUrlComplete"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                expires_at_ms: expires,
                poll_interval_ms: interval,
            };
            // Persisted before the first poll: a killed enroll resumes it.
            let saved = update(&store, &url, |c| {
                c.pending.insert(workspace.clone(), p.clone());
            });
            if let Err(e) = saved {
                warn_line!("bmx enroll: cannot save the pending enrollment: {e}");
                return ExitCode::from(1);
            }
            (p, false)
        }
    };
    say!(
        "bmx enroll: {} enrollment {} — to approve, run: bmx enrollments approve {} --harness {url}   (or see {})",
        if resumed { "resumed" } else { "pending" },
        pending.enrollment_id,
        pending.user_code,
        pending.verification_url_complete
    );
    say_json(
        &json!({"userCode": pending.user_code, "enrollmentId": pending.enrollment_id, "resumed": resumed})
            .to_string(),
    );
    poll_until_done(&api, &store, &url, &workspace, pending).await
}

/// An operator command failed: the message on stderr and, under `--json`,
/// one `TARGET_EXEC_FAILED` envelope line on stdout; exit 1.
fn failed(json: bool, command: &str, message: String) -> ExitCode {
    use bmx::runner::envelope::{ErrorCode, ResponseError};
    warn_line!("bmx {command}: {message}");
    if json {
        let error = ResponseError::new(ErrorCode::TargetExecFailed, message);
        say_json(&Response::failure(error, None).to_line());
    }
    ExitCode::from(1)
}

/// A stable, non-secret label of this machine for the operator.
fn fingerprint() -> String {
    use sha2::Digest;
    let id = std::fs::read_to_string("/etc/machine-id").unwrap_or_default();
    let h = sha2::Sha256::digest(format!(
        "{}:{}",
        id.trim(),
        bmx::executor::config::hostname()
    ));
    h.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

async fn poll_until_done(
    api: &ApiClient,
    store: &CredentialStore,
    url: &str,
    workspace: &str,
    pending: PendingEnrollment,
) -> ExitCode {
    let mut interval = Duration::from_millis(pending.poll_interval_ms.clamp(100, 60_000));
    let forget = |store: &CredentialStore| {
        let _ = update(store, url, |c| {
            if c.pending.get(workspace).map(|p| &p.enrollment_id) == Some(&pending.enrollment_id) {
                c.pending.remove(workspace);
            }
        });
    };
    loop {
        // A little past the harness's deadline: its answer is the authority.
        if now_ms() > pending.expires_at_ms.saturating_add(30_000) {
            forget(store);
            warn_line!("bmx enroll: the enrollment expired before it was approved (and the harness could not be reached to confirm)");
            return ExitCode::from(EXIT_EXPIRED);
        }
        tokio::time::sleep(interval).await;
        match store.load(url) {
            Ok(c)
                if c.pending.get(workspace).map(|p| &p.enrollment_id)
                    != Some(&pending.enrollment_id) =>
            {
                warn_line!("bmx enroll: this enrollment was superseded by a newer local enrollment for {workspace}");
                return ExitCode::from(EXIT_SUPERSEDED);
            }
            Ok(_) => {}
            Err(e) => {
                warn_line!("bmx enroll: {e}");
                return ExitCode::from(1);
            }
        }
        let answer = api
            .post(
                "/v1/enrollments/poll",
                &json!({"deviceCode": pending.device_code}),
            )
            .await;
        let v = match answer {
            Ok((200, v)) => v,
            Ok((429, _)) => {
                interval = (interval + Duration::from_secs(1)).min(Duration::from_secs(60));
                continue;
            }
            Ok((404, _)) => {
                forget(store);
                warn_line!("bmx enroll: the harness does not know this enrollment (was its data directory reset?)");
                return ExitCode::from(1);
            }
            Ok((status, v)) => {
                tracing::warn!(status, "poll refused: {}", api_message(&v));
                continue;
            }
            Err(e) => {
                // The harness went away: keep the pending state, retry.
                tracing::warn!(error = %e, "harness unreachable; retrying");
                continue;
            }
        };
        match v["status"].as_str() {
            Some("pending") => continue,
            Some("approved") => {
                let (Some(cid), Some(xid), Some(token)) = (
                    v["credentialId"].as_str(),
                    v["executorId"].as_str(),
                    v["token"].as_str(),
                ) else {
                    warn_line!("bmx enroll: the harness answered an approval without a credential");
                    return ExitCode::from(1);
                };
                let cred = LocalCredential {
                    credential_id: cid.to_owned(),
                    executor_id: xid.to_owned(),
                    token: token.to_owned(),
                    issued_at: bmx::harness::api::enrollments::rfc3339_ms(now_ms()),
                };
                let saved = update(store, url, |c| {
                    c.credentials.insert(workspace.to_owned(), cred);
                    c.pending.remove(workspace);
                });
                if let Err(e) = saved {
                    warn_line!("bmx enroll: approved, but the credential could not be saved: {e}");
                    return ExitCode::from(1);
                }
                say!("bmx enroll: approved: credential {cid}, executor {xid}; run: bmx executor --harness {url} --workspace {workspace}");
                return ExitCode::SUCCESS;
            }
            Some("denied") => {
                forget(store);
                warn_line!("bmx enroll: the enrollment was denied by the operator");
                return ExitCode::from(EXIT_DENIED);
            }
            Some("expired") => {
                forget(store);
                warn_line!("bmx enroll: the enrollment expired before it was approved");
                return ExitCode::from(EXIT_EXPIRED);
            }
            Some("consumed") => {
                forget(store);
                warn_line!("bmx enroll: the credential of this enrollment was already handed out (to an earlier run that did not save it); enroll again");
                return ExitCode::from(1);
            }
            _ => {
                warn_line!("bmx enroll: unexpected answer {}", v["status"]);
                return ExitCode::from(1);
            }
        }
    }
}
