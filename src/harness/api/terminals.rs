//! Executor-scoped terminals through the harness (PROTOCOL.md §8):
//! `terminal.open`, `terminal.close`, `terminal.resize`, and the harness's
//! own registry of the terminals it opened.
//!
//! The protocol has no `terminal.list`, so the harness remembers every
//! terminal opened through it (by executor id and terminal id), with the
//! spec it was opened with. The spec matters: re-sending the same
//! `terminal.open` is idempotent on the executor and answers the current
//! state (`epoch`, `earliestSeq`, `latestSeq`), which is how the harness
//! learns where the scrollback starts and which writer epoch is current
//! before an attach. `terminal.exited` marks an entry exited; `DELETE` (and
//! an executor that answers -32004 for it) removes it.

use crate::harness::error::ApiError;
use crate::harness::runtime::Shared;
use crate::wire::types::{
    Accepted, TerminalCloseParams, TerminalCloseResult, TerminalOpenParams, TerminalOpenResult,
    TerminalResizeParams,
};
use crate::wire::{CallError, ErrorCode, Link, Method, RpcError, Version};
use dashmap::DashMap;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Longest terminal id the API takes (the id rule's, docs/protocol.md).
pub const MAX_TERMINAL_ID: usize = crate::wire::id::MAX_ID_LEN;
/// Largest `cols`/`rows` the API takes.
pub const MAX_DIMENSION: u16 = 4096;

/// What `POST /v1/executors/{id}/terminals` takes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OpenTerminal {
    /// Default: a fresh `t-<uuid>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub terminal_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// The program and its arguments (default: `shell`, else the login shell).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub argv: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shell: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<BTreeMap<String, String>>,
    /// Default 80.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cols: Option<u16>,
    /// Default 24.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows: Option<u16>,
}

/// Where a terminal is in its life, as the harness last heard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TerminalState {
    Running,
    /// `terminal.exited` arrived; the executor keeps it (replay works)
    /// until it is closed.
    Exited,
}

/// One terminal (`GET /v1/executors/{id}/terminals`, and the `POST` answer).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TerminalView {
    /// The executor's last open answer: id, pid, size, creation time and
    /// scrollback bounds, except `epoch`, which is the highest writer epoch
    /// the harness has seen or allocated.
    #[serde(flatten)]
    pub open: TerminalOpenResult,
    pub executor_id: String,
    pub state: TerminalState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// Viewers attached through this harness now.
    pub viewers: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub argv: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shell: Option<String>,
}

/// How a terminal's life ended, published to the relays watching it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TerminalEnd {
    Running,
    /// The program ended by itself (`terminal.exited`).
    Exited(i32),
    /// Closed (`DELETE`, or the executor no longer knows it).
    Closed,
}

struct Entry {
    spec: TerminalOpenParams,
    view: TerminalView,
    end: watch::Sender<TerminalEnd>,
}

type Key = (String, String);

/// The harness's registry of terminals opened through it.
#[derive(Default)]
pub struct TerminalRegistry {
    map: DashMap<Key, Entry>,
}

fn key(executor_id: &str, terminal_id: &str) -> Key {
    (executor_id.to_owned(), terminal_id.to_owned())
}

impl TerminalRegistry {
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Record an open answer (new entry, or refresh of an existing one).
    fn opened(&self, executor_id: &str, spec: TerminalOpenParams, r: &TerminalOpenResult) {
        let k = key(executor_id, &r.terminal_id);
        let mut e = self.map.entry(k).or_insert_with(|| Entry {
            spec: spec.clone(),
            view: TerminalView {
                open: r.clone(),
                executor_id: executor_id.to_owned(),
                state: TerminalState::Running,
                exit_code: None,
                viewers: 0,
                argv: spec.argv.clone(),
                shell: spec.shell.clone(),
            },
            end: watch::Sender::new(TerminalEnd::Running),
        });
        // A different pid or creation time: the executor restarted the id
        // (it was closed and opened again): a new life.
        if e.view.open.pid != r.pid || e.view.open.created_at != r.created_at {
            e.view.state = TerminalState::Running;
            e.view.exit_code = None;
            e.end.send_replace(TerminalEnd::Running);
        }
        e.spec = spec;
        e.view.open = TerminalOpenResult {
            epoch: e.view.open.epoch.max(r.epoch),
            ..r.clone()
        };
    }

    /// `terminal.exited` from `executor_id`; unknown terminals are ignored.
    pub fn exited(&self, executor_id: &str, terminal_id: &str, exit_code: i32) {
        if let Some(mut e) = self.map.get_mut(&key(executor_id, terminal_id)) {
            e.view.state = TerminalState::Exited;
            e.view.exit_code = Some(exit_code);
            e.end.send_replace(TerminalEnd::Exited(exit_code));
        }
    }

    /// Forget a terminal and tell its relays it is closed.
    pub fn remove(&self, executor_id: &str, terminal_id: &str) -> bool {
        match self.map.remove(&key(executor_id, terminal_id)) {
            Some((_, e)) => {
                e.end.send_replace(TerminalEnd::Closed);
                true
            }
            None => false,
        }
    }

    pub fn contains(&self, executor_id: &str, terminal_id: &str) -> bool {
        self.map.contains_key(&key(executor_id, terminal_id))
    }

    pub fn has_executor(&self, executor_id: &str) -> bool {
        self.map.iter().any(|e| e.key().0 == executor_id)
    }

    pub fn view(&self, executor_id: &str, terminal_id: &str) -> Option<TerminalView> {
        self.map
            .get(&key(executor_id, terminal_id))
            .map(|e| e.view.clone())
    }

    /// The terminals of one executor, by id.
    pub fn list(&self, executor_id: &str) -> Vec<TerminalView> {
        let mut v: Vec<TerminalView> = self
            .map
            .iter()
            .filter(|e| e.key().0 == executor_id)
            .map(|e| e.view.clone())
            .collect();
        v.sort_by(|a, b| a.open.terminal_id.cmp(&b.open.terminal_id));
        v
    }

    fn spec(&self, executor_id: &str, terminal_id: &str) -> Option<TerminalOpenParams> {
        self.map
            .get(&key(executor_id, terminal_id))
            .map(|e| e.spec.clone())
    }

    /// Watch how the terminal ends.
    pub fn watch(
        &self,
        executor_id: &str,
        terminal_id: &str,
    ) -> Option<watch::Receiver<TerminalEnd>> {
        self.map
            .get(&key(executor_id, terminal_id))
            .map(|e| e.end.subscribe())
    }

    /// A new writer epoch, greater than every epoch seen or allocated for
    /// this terminal (and than `at_least`).
    pub fn next_epoch(&self, executor_id: &str, terminal_id: &str, at_least: u64) -> Option<u64> {
        let mut e = self.map.get_mut(&key(executor_id, terminal_id))?;
        e.view.open.epoch = e.view.open.epoch.max(at_least) + 1;
        Some(e.view.open.epoch)
    }

    /// The highest writer epoch known: a relay whose epoch is below it has
    /// lost the writer role.
    pub fn epoch(&self, executor_id: &str, terminal_id: &str) -> Option<u64> {
        self.map
            .get(&key(executor_id, terminal_id))
            .map(|e| e.view.open.epoch)
    }

    fn observe(&self, executor_id: &str, r: &TerminalOpenResult) {
        if let Some(mut e) = self.map.get_mut(&key(executor_id, &r.terminal_id)) {
            e.view.open.epoch = e.view.open.epoch.max(r.epoch);
            e.view.open.earliest_seq = r.earliest_seq;
            e.view.open.latest_seq = r.latest_seq;
        }
    }

    pub(crate) fn observe_epoch(&self, executor_id: &str, terminal_id: &str, epoch: u64) {
        if let Some(mut e) = self.map.get_mut(&key(executor_id, terminal_id)) {
            e.view.open.epoch = e.view.open.epoch.max(epoch);
        }
    }

    fn resized(&self, executor_id: &str, terminal_id: &str, cols: u16, rows: u16) {
        if let Some(mut e) = self.map.get_mut(&key(executor_id, terminal_id)) {
            e.view.open.cols = cols;
            e.view.open.rows = rows;
        }
    }

    /// One more (or one fewer) viewer attached.
    pub(crate) fn viewers(&self, executor_id: &str, terminal_id: &str, delta: i32) {
        if let Some(mut e) = self.map.get_mut(&key(executor_id, terminal_id)) {
            e.view.viewers = e.view.viewers.saturating_add_signed(delta);
        }
    }
}

/// The terminals of one harness, by executor.
#[derive(Clone)]
pub struct Terminals {
    pub(crate) shared: Arc<Shared>,
}

/// `-32004` with `reason: unknown_terminal`.
pub fn unknown_terminal(executor_id: &str, terminal_id: &str) -> ApiError {
    ApiError::rpc(
        RpcError::not_found(format!(
            "executor {executor_id:?} has no terminal {terminal_id:?} opened through this harness"
        ))
        .with_reason("unknown_terminal"),
    )
}

/// 404 `unknown_executor`: no executor of that id is connected.
pub(crate) fn unknown_executor(executor_id: &str) -> ApiError {
    ApiError::rpc(
        RpcError::not_found(format!("no executor {executor_id:?} is connected"))
            .with_reason("unknown_executor"),
    )
}

fn executor_disconnected(executor_id: &str) -> ApiError {
    ApiError::with_status(
        503,
        RpcError::new(
            ErrorCode::ExecutorBusy,
            format!("executor {executor_id:?} is disconnected"),
        )
        .with_reason("executor_disconnected")
        .with_retryable(true),
    )
}

fn check_dimensions(cols: u16, rows: u16) -> Result<(), ApiError> {
    if cols == 0 || rows == 0 || cols > MAX_DIMENSION || rows > MAX_DIMENSION {
        return Err(ApiError::bad_request(format!(
            "cols and rows must be 1 to {MAX_DIMENSION}"
        )));
    }
    Ok(())
}

impl Terminals {
    /// The control link of a connected executor that speaks v1.1 and
    /// offers terminals.
    pub(crate) fn link(&self, executor_id: &str) -> Result<Link, ApiError> {
        let shared = &self.shared;
        let conn = shared.executors.get(executor_id).map(|c| *c);
        // Registered: its capabilities are known (a resumed connection is
        // in the registry a moment before its register is answered).
        let entry = conn
            .and_then(|c| shared.conns.get(&c).map(|e| e.clone()))
            .filter(|e| e.registered);
        let Some(entry) = entry else {
            return Err(if shared.terminals.has_executor(executor_id) {
                executor_disconnected(executor_id)
            } else {
                unknown_executor(executor_id)
            });
        };
        if entry.link.version() < Version::V1_1 {
            return Err(ApiError::rpc(
                RpcError::new(
                    ErrorCode::UnsupportedProtocol,
                    "terminals need protocol 1.1; this executor negotiated 1",
                )
                .with_reason("unsupported_protocol"),
            ));
        }
        if !entry
            .capabilities
            .terminal
            .as_ref()
            .is_some_and(|t| t.enabled)
        {
            return Err(ApiError::rpc(RpcError::capability_unavailable("terminal")));
        }
        Ok(entry.link)
    }

    /// A request on the executor's link; -32004 for `terminal_id` also
    /// removes it from the registry (the executor forgot it: restarted, or
    /// closed by someone else).
    async fn request<P: Serialize, R: serde::de::DeserializeOwned>(
        &self,
        executor_id: &str,
        terminal_id: &str,
        method: Method,
        params: &P,
        timeout: Duration,
    ) -> Result<R, ApiError> {
        let link = self.link(executor_id)?;
        match link.request(method, params, timeout).await {
            Ok(r) => Ok(r),
            Err(CallError::Rpc(e)) if e.kind() == Some(ErrorCode::NotFound) => {
                self.shared.terminals.remove(executor_id, terminal_id);
                Err(unknown_terminal(executor_id, terminal_id).with_detail_of(&e.message))
            }
            Err(e) => Err(ApiError::from_call(e)),
        }
    }

    /// A request deduped by the executor (`terminal.open` by
    /// `terminalId` and spec): when the connection is lost before the
    /// answer, it is sent again once the executor is back (terminals
    /// outlive its connections), at most a lease TTL later.
    ///
    /// # Errors
    ///
    /// As a plain request; 502 `executor_lost` when the executor does not
    /// come back in time.
    async fn request_resending<P: Serialize, R: serde::de::DeserializeOwned>(
        &self,
        executor_id: &str,
        method: Method,
        params: &P,
    ) -> Result<R, ApiError> {
        let timeout = self.shared.config.request_timeout;
        let deadline = tokio::time::Instant::now()
            + timeout
            + Duration::from_millis(self.shared.config.lease_ttl_ms);
        let mut link = self.link(executor_id)?;
        loop {
            match link.request(method, params, timeout).await {
                Err(CallError::Closed) => {}
                r => return r.map_err(ApiError::from_call),
            }
            let mut changes = self.shared.route_changes();
            link = loop {
                changes.borrow_and_update();
                match self.link(executor_id) {
                    Ok(l) if !l.is_closed() => break l,
                    Ok(_) => {}
                    // It was connected a moment ago: wait for it.
                    Err(e)
                        if matches!(
                            e.error.reason(),
                            Some("executor_disconnected" | "unknown_executor")
                        ) => {}
                    Err(e) => return Err(e),
                }
                match tokio::time::timeout_at(deadline, changes.changed()).await {
                    Ok(Ok(())) => {}
                    _ => return Err(ApiError::from_call(CallError::Closed)),
                }
            };
        }
    }

    /// `terminal.open`; records the terminal in the registry.
    pub async fn open(
        &self,
        executor_id: &str,
        req: OpenTerminal,
    ) -> Result<TerminalView, ApiError> {
        let terminal_id = req
            .terminal_id
            .unwrap_or_else(|| format!("t-{}", uuid::Uuid::new_v4().simple()));
        crate::wire::id::check("terminalId", &terminal_id).map_err(ApiError::invalid_id)?;
        if req.argv.as_ref().is_some_and(Vec::is_empty) {
            return Err(ApiError::bad_request("argv must not be empty"));
        }
        let (cols, rows) = (req.cols.unwrap_or(80), req.rows.unwrap_or(24));
        check_dimensions(cols, rows)?;
        let registry = &self.shared.terminals;
        if !registry.contains(executor_id, &terminal_id)
            && registry.len() >= self.shared.config.max_terminals
        {
            return Err(ApiError::rpc(
                RpcError::resource_unavailable(format!(
                    "the harness tracks at most {} terminals",
                    self.shared.config.max_terminals
                ))
                .with_reason("terminal_registry_full"),
            ));
        }
        let spec = TerminalOpenParams {
            terminal_id: terminal_id.clone(),
            kind: req.kind,
            argv: req.argv,
            shell: req.shell,
            cwd: req.cwd,
            env: req.env,
            cols,
            rows,
        };
        let r: TerminalOpenResult = self
            .request_resending(executor_id, Method::TerminalOpen, &spec)
            .await?;
        registry.opened(executor_id, spec, &r);
        registry
            .view(executor_id, &terminal_id)
            .ok_or_else(|| ApiError::internal("the terminal vanished"))
    }

    /// The terminals opened through this harness on `executor_id`.
    pub fn list(&self, executor_id: &str) -> Result<Vec<TerminalView>, ApiError> {
        let known = self.shared.executors.contains_key(executor_id)
            || self.shared.terminals.has_executor(executor_id);
        if !known {
            return Err(unknown_executor(executor_id));
        }
        Ok(self.shared.terminals.list(executor_id))
    }

    /// The executor's current state of a registered terminal: the same
    /// `terminal.open` again (idempotent), which answers the scrollback
    /// bounds and the writer epoch.
    pub async fn snapshot(
        &self,
        executor_id: &str,
        terminal_id: &str,
    ) -> Result<TerminalOpenResult, ApiError> {
        let spec = self
            .shared
            .terminals
            .spec(executor_id, terminal_id)
            .ok_or_else(|| unknown_terminal(executor_id, terminal_id))?;
        let r: TerminalOpenResult = self
            .request(
                executor_id,
                terminal_id,
                Method::TerminalOpen,
                &spec,
                self.shared.config.request_timeout,
            )
            .await?;
        self.shared.terminals.observe(executor_id, &r);
        Ok(r)
    }

    /// `terminal.close`: the program gets SIGHUP, then SIGKILL after the
    /// executor's grace; the registry forgets the terminal.
    pub async fn close(
        &self,
        executor_id: &str,
        terminal_id: &str,
    ) -> Result<TerminalCloseResult, ApiError> {
        let params = TerminalCloseParams {
            terminal_id: terminal_id.to_owned(),
            reason: "closed through the harness API".into(),
        };
        // The executor answers once the program is gone (its grace is 2 s
        // by default): allow for that on top of the usual timeout.
        let timeout = self.shared.config.request_timeout + Duration::from_secs(10);
        let r: TerminalCloseResult = self
            .request(
                executor_id,
                terminal_id,
                Method::TerminalClose,
                &params,
                timeout,
            )
            .await?;
        self.shared.terminals.remove(executor_id, terminal_id);
        Ok(r)
    }

    /// `terminal.resize` for the stream `stream_id` (the writer role is
    /// checked by the executor), or without a stream while nobody writes.
    pub async fn resize(
        &self,
        executor_id: &str,
        terminal_id: &str,
        cols: u16,
        rows: u16,
        stream: Option<(String, u64)>,
    ) -> Result<(), ApiError> {
        check_dimensions(cols, rows)?;
        let (stream_id, epoch) = match stream {
            Some((s, e)) => (Some(s), Some(e)),
            None => (None, None),
        };
        let params = TerminalResizeParams {
            terminal_id: terminal_id.to_owned(),
            cols,
            rows,
            stream_id,
            epoch,
        };
        let _: Accepted = self
            .request(
                executor_id,
                terminal_id,
                Method::TerminalResize,
                &params,
                self.shared.config.request_timeout,
            )
            .await?;
        self.shared
            .terminals
            .resized(executor_id, terminal_id, cols, rows);
        Ok(())
    }
}

trait WithDetail {
    fn with_detail_of(self, detail: &str) -> Self;
}

impl WithDetail for ApiError {
    fn with_detail_of(mut self, detail: &str) -> Self {
        self.error = self.error.with_detail(detail.to_owned());
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(id: &str, pid: u32, epoch: u64) -> TerminalOpenResult {
        TerminalOpenResult {
            terminal_id: id.into(),
            pid,
            cols: 80,
            rows: 24,
            created_at: format!("2025-01-01T00:00:0{pid}Z"),
            epoch,
            earliest_seq: 1,
            latest_seq: 0,
        }
    }

    fn spec(id: &str) -> TerminalOpenParams {
        TerminalOpenParams {
            terminal_id: id.into(),
            kind: None,
            argv: Some(vec!["sh".into()]),
            shell: None,
            cwd: None,
            env: None,
            cols: 80,
            rows: 24,
        }
    }

    #[test]
    fn epochs_only_grow_and_exits_are_published() {
        let r = TerminalRegistry::default();
        r.opened("e", spec("t"), &result("t", 1, 3));
        let mut end = r.watch("e", "t").unwrap();
        assert_eq!(r.next_epoch("e", "t", 0), Some(4));
        assert_eq!(r.next_epoch("e", "t", 10), Some(11));
        r.observe_epoch("e", "t", 5);
        assert_eq!(r.epoch("e", "t"), Some(11));
        // Re-open answers do not move the epoch back.
        r.opened("e", spec("t"), &result("t", 1, 2));
        assert_eq!(r.epoch("e", "t"), Some(11));
        r.exited("e", "t", 3);
        assert!(end.has_changed().unwrap());
        assert_eq!(*end.borrow_and_update(), TerminalEnd::Exited(3));
        assert_eq!(r.view("e", "t").unwrap().state, TerminalState::Exited);
        // Another executor's terminal of the same id is another terminal.
        r.exited("other", "t", 1);
        assert!(!r.has_executor("other"));
        assert!(r.remove("e", "t"));
        assert_eq!(*end.borrow(), TerminalEnd::Closed);
        assert!(r.list("e").is_empty());
    }

    #[test]
    fn a_new_life_resets_the_exit() {
        let r = TerminalRegistry::default();
        r.opened("e", spec("t"), &result("t", 1, 0));
        r.exited("e", "t", 0);
        r.opened("e", spec("t"), &result("t", 2, 0));
        let v = r.view("e", "t").unwrap();
        assert_eq!(
            (v.state, v.exit_code, v.open.pid),
            (TerminalState::Running, None, 2)
        );
    }
}
