//! Hooks and observed sessions (VISOR.md §6): an agent CLI started outside
//! the visor reports through its hooks (`bmx visor hook --agent NAME`, one
//! JSON payload on stdin) and the visor keeps a session of kind
//! `observed` for it, keyed by the agent and the vendor's session id, with
//! a `hook` event per call.
//!
//! - [`HookCall`] is what `POST /v1/hook` takes and what the spool holds.
//! - [`inputs`] is the sans-IO rule from a hook's event name to the
//!   session state machine's inputs (property-tested: it only ever feeds
//!   inputs the machine accepts).
//! - The spool: when the visor is down, the CLI appends the call to
//!   `<home>/hooks/spool` ([`spool_append`]: one JSON line, `O_APPEND`
//!   under an exclusive `flock`, bounded). The visor takes the spool at
//!   its start ([`spool_take`]: read whole and truncated under the same
//!   lock *before* any of it is applied) and replays it in order. A line
//!   is therefore applied at most once: a visor that dies mid-replay loses
//!   the rest of what it took together with the rest of its in-memory
//!   state, and never replays it twice.

use super::session::SessionData;
use super::state::{Input, State};
use super::types::{Checked, Kind, RestartSpec, SessionView, StartSpec};
use super::{Visor, VisorError};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Largest hook payload the CLI reads (the whole call must fit the HTTP
/// body limit).
pub const MAX_PAYLOAD: usize = 512 << 10;
/// Largest payload copied into a `hook` event; past it the event says
/// `payloadBytes` and keeps the event and tool names only.
pub const EVENT_PAYLOAD: usize = 16 << 10;
/// Largest spool file.
pub const MAX_SPOOL: u64 = 16 << 20;
/// Live observed sessions at once.
pub const MAX_OBSERVED: usize = 256;
/// How long the spool's lock is waited for.
const LOCK_WAIT: Duration = Duration::from_secs(5);
const MAX_LABELS: usize = 64;
const MAX_LABEL_BYTES: usize = 256;
const MAX_SESSION_ID: usize = 256;

/// `POST /v1/hook`, and one line of the spool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HookCall {
    pub agent: String,
    /// The vendor's session id.
    pub session: String,
    pub payload: Value,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

fn invalid(m: impl Into<String>) -> VisorError {
    VisorError::Invalid(m.into())
}

/// The vendor's session id in a hook payload: `session_id` (Claude Code
/// and its followers), else `sessionId`, else `session.id`; a string.
pub fn vendor_session(payload: &Value) -> Option<&str> {
    payload
        .get("session_id")
        .or_else(|| payload.get("sessionId"))
        .or_else(|| payload.get("session").and_then(|s| s.get("id")))
        .and_then(Value::as_str)
}

/// The hook's event name: `hook_event_name`, else `hookEventName`, else
/// `event`.
pub fn event_name(payload: &Value) -> Option<&str> {
    payload
        .get("hook_event_name")
        .or_else(|| payload.get("hookEventName"))
        .or_else(|| payload.get("event"))
        .and_then(Value::as_str)
}

impl HookCall {
    /// The call `bmx visor hook` makes of a payload read on stdin.
    ///
    /// # Errors
    /// `invalid`: not JSON, no session id, bad labels or agent name.
    pub fn from_payload(
        agent: &str,
        bytes: &[u8],
        labels: &[String],
    ) -> Result<HookCall, VisorError> {
        if bytes.len() > MAX_PAYLOAD {
            return Err(invalid(format!(
                "the hook payload is larger than {MAX_PAYLOAD} bytes"
            )));
        }
        let payload: Value = serde_json::from_slice(bytes)
            .map_err(|e| invalid(format!("the hook payload is not JSON: {e}")))?;
        let session = vendor_session(&payload)
            .ok_or_else(|| {
                invalid("the hook payload names no session (session_id, sessionId or session.id)")
            })?
            .to_owned();
        let labels = labels
            .iter()
            .map(|l| {
                l.split_once('=')
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
                    .ok_or_else(|| invalid(format!("label {l:?} is not k=v")))
            })
            .collect::<Result<_, _>>()?;
        let call = HookCall {
            agent: agent.to_owned(),
            session,
            payload,
            labels,
        };
        call.check()?;
        Ok(call)
    }

    /// Bounds and names.
    ///
    /// # Errors
    /// `invalid`, saying which.
    pub fn check(&self) -> Result<(), VisorError> {
        if !super::agents::valid_name(&self.agent) {
            return Err(invalid("agent is 1-64 of A-Z a-z 0-9 - _ ."));
        }
        if self.session.is_empty()
            || self.session.len() > MAX_SESSION_ID
            || self.session.chars().any(char::is_control)
        {
            return Err(invalid(format!(
                "session is 1..={MAX_SESSION_ID} bytes without control characters"
            )));
        }
        if self.labels.len() > MAX_LABELS
            || self.labels.iter().any(|(k, v)| {
                k.is_empty() || k.len() + v.len() > MAX_LABEL_BYTES || k.contains('=')
            })
        {
            return Err(invalid(format!(
                "at most {MAX_LABELS} labels, each a non-empty key without '=' and at most {MAX_LABEL_BYTES} bytes"
            )));
        }
        Ok(())
    }
}

/// What a hook event does to its observed session (sans-IO): the first
/// hook opens it (`starting → idle`); `UserPromptSubmit`, `PreToolUse`,
/// `PostToolUse` mean a turn runs (`idle → running`); `Stop` ends the
/// turn (`→ idle`); `SessionEnd` ends the session (`exited`). Other
/// events (`SessionStart`, `Notification`, `PreCompact`, `SubagentStop`,
/// unknown names) move nothing. An exited session takes no input.
pub fn inputs(event: Option<&str>, state: State) -> Vec<Input> {
    let mut out = Vec::new();
    let mut now = state;
    match now {
        State::Exited => return out,
        State::Starting => {
            out.push(Input::Started { idle: true });
            now = State::Idle;
        }
        _ => {}
    }
    match event {
        Some("SessionEnd") => out.push(Input::Exit { restart: false }),
        Some("UserPromptSubmit" | "PreToolUse" | "PostToolUse") if now == State::Idle => {
            out.push(Input::Send { can_steer: false })
        }
        Some("Stop") if matches!(now, State::Running | State::Waiting) => {
            out.push(Input::TurnEnded)
        }
        _ => {}
    }
    out
}

/// The `hook` event's fields: the payload itself when small, else its
/// size and the names that say what it was.
fn event_fields(call: &HookCall, replayed: bool) -> Value {
    let size = serde_json::to_string(&call.payload).map_or(0, |s| s.len());
    let mut f = json!({"agent": call.agent, "vendorId": call.session,
        "hookEvent": event_name(&call.payload)});
    if size <= EVENT_PAYLOAD {
        f["payload"] = call.payload.clone();
    } else {
        f["payloadBytes"] = size.into();
        if let Some(t) = call.payload.get("tool_name").and_then(Value::as_str) {
            f["toolName"] = t.into();
        }
    }
    if replayed {
        f["replayed"] = true.into();
    }
    f
}

/// Take one hook call: find (or open) its observed session, publish a
/// `hook` event, move its state. Calls are taken one at a time, so two
/// first hooks of one session open one session.
///
/// # Errors
/// `invalid` for a bad call; `busy` past [`MAX_OBSERVED`]; `closed` while
/// the visor shuts down.
pub async fn intake(v: &Visor, call: HookCall, replayed: bool) -> Result<SessionView, VisorError> {
    call.check()?;
    if v.is_closing() {
        return Err(VisorError::Closed("the visor is shutting down".into()));
    }
    let _one = v.hooks.lock().await;
    let found = v
        .sessions
        .iter()
        .find(|d| {
            d.checked.spec.kind == Kind::Observed
                && d.state().live()
                && !v.confirm_bridges.contains_key(&d.id)
                && d.checked.spec.agent.as_deref() == Some(call.agent.as_str())
                && d.chat().vendor_id.as_deref() == Some(call.session.as_str())
        })
        .map(|d| d.clone());
    let d = match found {
        Some(d) => d,
        None => open(v, &call).await?,
    };
    let event = event_name(&call.payload).map(str::to_owned);
    if event.as_deref() == Some("UserPromptSubmit") {
        d.chat().prompts += 1;
    }
    d.emit("hook", event_fields(&call, replayed));
    for input in inputs(event.as_deref(), d.state()) {
        let _ = d.apply(input);
    }
    Ok(d.view())
}

/// A new observed session for `call`: its working directory is the
/// payload's `cwd` when that is an absolute directory (else `/`), and its
/// workdir the active workdir that holds it, if any.
async fn open(v: &Visor, call: &HookCall) -> Result<Arc<SessionData>, VisorError> {
    let live = v
        .sessions
        .iter()
        .filter(|d| d.checked.spec.kind == Kind::Observed && d.state().live())
        .count();
    if live >= MAX_OBSERVED {
        return Err(VisorError::Busy(format!(
            "at most {MAX_OBSERVED} live observed sessions"
        )));
    }
    let cwd = call
        .payload
        .get("cwd")
        .and_then(Value::as_str)
        .map(PathBuf::from)
        .filter(|p| p.is_absolute() && p.is_dir())
        .unwrap_or_else(|| PathBuf::from("/"));
    let workdir = v
        .workdirs
        .lock()
        .await
        .registry()
        .containing(&cwd)
        .map(|w| w.id.clone());
    let d = observed(
        v,
        Observed {
            agent: call.agent.clone(),
            role: "agent",
            title: format!("{} {}", call.agent, call.session),
            labels: call.labels.clone(),
            cwd,
            workdir,
            vendor_id: call.session.clone(),
        },
    );
    Ok(d)
}

/// What an observed session is made of.
pub struct Observed {
    pub agent: String,
    pub role: &'static str,
    pub title: String,
    pub labels: BTreeMap<String, String>,
    pub cwd: PathBuf,
    pub workdir: Option<String>,
    pub vendor_id: String,
}

/// A new observed session (no process: a record fed from outside, by
/// hooks or by an executor's confirmations), registered and announced
/// with its `init` event.
pub fn observed(v: &Visor, o: Observed) -> Arc<SessionData> {
    let spec = StartSpec {
        kind: Kind::Observed,
        command: None,
        agent: Some(o.agent.clone()),
        title: None,
        role: Some(o.role.into()),
        labels: o.labels,
        env: None,
        workdir: o.workdir,
        working_dir: Some(o.cwd.display().to_string()),
        prompt: None,
        cols: None,
        rows: None,
        restart: RestartSpec::default(),
        resume_id: None,
        mcp_servers: None,
        model: None,
    };
    let checked = Checked {
        spec,
        argv: Vec::new(),
        resume_args: Vec::new(),
        role: o.role.into(),
        title: o.title,
        cwd: o.cwd,
        cols: 120,
        rows: 40,
    };
    let id = format!("s-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let scope = format!("{}/{id}/", v.scope_prefix());
    let d = SessionData::new(id.clone(), checked, scope, Vec::new(), v.hub.clone());
    d.chat().vendor_id = Some(o.vendor_id.clone());
    v.sessions.insert(id, d.clone());
    d.emit(
        "init",
        json!({"kind": "observed", "agent": o.agent, "vendorId": o.vendor_id}),
    );
    d
}

#[derive(Debug, thiserror::Error)]
pub enum SpoolError {
    #[error("hook spool {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the hook spool {0} is full ({max} bytes); this hook is not kept", max = MAX_SPOOL)]
    Full(PathBuf),
    #[error("the hook spool {0} stayed locked for {wait:?}", wait = LOCK_WAIT)]
    Locked(PathBuf),
}

/// `<home>/hooks/spool`.
pub fn spool_path(home: &Path) -> PathBuf {
    home.join("hooks").join("spool")
}

/// Take the file's exclusive `flock`, waiting at most [`LOCK_WAIT`].
fn lock_file(file: &std::fs::File, path: &Path) -> Result<(), SpoolError> {
    let deadline = Instant::now() + LOCK_WAIT;
    loop {
        // SAFETY: flock on a descriptor we own; no memory is passed.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc == 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(SpoolError::Io {
                path: path.to_owned(),
                source: err,
            });
        }
        if Instant::now() > deadline {
            return Err(SpoolError::Locked(path.to_owned()));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Append one call to the spool (the CLI, when no visor answers): one
/// JSON line, written with `O_APPEND` under the spool's lock so that
/// concurrent hooks never interleave, then synced.
///
/// # Errors
/// The spool cannot be written, is full, or stays locked.
pub fn spool_append(home: &Path, call: &HookCall) -> Result<PathBuf, SpoolError> {
    let path = spool_path(home);
    let io = |source| SpoolError::Io {
        path: path.clone(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io)?;
    }
    let mut line = serde_json::to_vec(call).map_err(|e| io(std::io::Error::other(e)))?;
    line.push(b'\n');
    let mut file = OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .open(&path)
        .map_err(io)?;
    lock_file(&file, &path)?;
    let len = file.metadata().map_err(io)?.len();
    if len + line.len() as u64 > MAX_SPOOL {
        return Err(SpoolError::Full(path.clone()));
    }
    file.write_all(&line).map_err(io)?;
    file.sync_data().map_err(io)?;
    Ok(path)
}

/// Take the spool's lines (the visor, at its start): read whole and
/// truncated under the lock, before any is applied.
///
/// # Errors
/// The spool cannot be read or truncated (it is then left as it was).
pub fn spool_take(home: &Path) -> Result<Vec<String>, SpoolError> {
    let path = spool_path(home);
    let io = |source| SpoolError::Io {
        path: path.clone(),
        source,
    };
    let mut file = match OpenOptions::new().read(true).write(true).open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io(e)),
    };
    lock_file(&file, &path)?;
    let mut bytes = Vec::new();
    (&mut file)
        .take(MAX_SPOOL + MAX_PAYLOAD as u64 * 2)
        .read_to_end(&mut bytes)
        .map_err(io)?;
    file.set_len(0).map_err(io)?;
    file.sync_all().map_err(io)?;
    Ok(String::from_utf8_lossy(&bytes)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_owned)
        .collect())
}

/// Replay the spool at the visor's start, in order; a line that is not a
/// call, or that the visor refuses, is logged (with its number) and
/// skipped. A second pass takes what hooks appended during the first.
pub async fn replay_spool(v: &Visor) {
    for _pass in 0..2 {
        let home = v.home.clone();
        let lines = match tokio::task::spawn_blocking(move || spool_take(&home)).await {
            Ok(Ok(l)) => l,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "cannot take the hook spool");
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot take the hook spool");
                return;
            }
        };
        if lines.is_empty() {
            return;
        }
        let (mut done, mut skipped) = (0usize, 0usize);
        for (n, line) in lines.iter().enumerate() {
            let r = match serde_json::from_str::<HookCall>(line) {
                Ok(call) => intake(v, call, true).await.map(|_| ()),
                Err(e) => Err(invalid(format!("not a hook call: {e}"))),
            };
            match r {
                Ok(()) => done += 1,
                Err(e) => {
                    skipped += 1;
                    tracing::warn!(line = n + 1, error = %e, "spooled hook skipped");
                }
            }
        }
        tracing::info!(replayed = done, skipped, "hook spool replayed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::visor::state::Machine;
    use proptest::prelude::*;

    #[test]
    fn session_ids_and_event_names() {
        let p = json!({"session_id": "abc", "hook_event_name": "Stop"});
        assert_eq!(
            (vendor_session(&p), event_name(&p)),
            (Some("abc"), Some("Stop"))
        );
        let p = json!({"sessionId": "x", "hookEventName": "PreToolUse"});
        assert_eq!(
            (vendor_session(&p), event_name(&p)),
            (Some("x"), Some("PreToolUse"))
        );
        let p = json!({"session": {"id": "y"}, "event": "e"});
        assert_eq!((vendor_session(&p), event_name(&p)), (Some("y"), Some("e")));
        assert_eq!(vendor_session(&json!({"session_id": 3})), None);
    }

    #[test]
    fn calls_are_checked() {
        let ok =
            HookCall::from_payload("claude", br#"{"session_id":"s1"}"#, &["k=v".into()]).unwrap();
        assert_eq!(ok.session, "s1");
        assert_eq!(ok.labels["k"], "v");
        for (agent, body, labels) in [
            ("claude", &b"not json"[..], vec![]),
            ("claude", &br#"{"x":1}"#[..], vec![]),
            ("a b", &br#"{"session_id":"s"}"#[..], vec![]),
            (
                "claude",
                &br#"{"session_id":"s"}"#[..],
                vec!["nolabel".to_owned()],
            ),
            ("claude", &br#"{"session_id":""}"#[..], vec![]),
        ] {
            assert!(
                HookCall::from_payload(agent, body, &labels).is_err(),
                "{agent} {labels:?}"
            );
        }
    }

    #[test]
    fn the_spool_keeps_order_and_is_taken_once() {
        let home = tempfile::tempdir().unwrap();
        assert!(spool_take(home.path()).unwrap().is_empty());
        for i in 0..3 {
            let c =
                HookCall::from_payload("a", format!(r#"{{"session_id":"s{i}"}}"#).as_bytes(), &[])
                    .unwrap();
            spool_append(home.path(), &c).unwrap();
        }
        let lines = spool_take(home.path()).unwrap();
        let ids: Vec<String> = lines
            .iter()
            .map(|l| serde_json::from_str::<HookCall>(l).unwrap().session)
            .collect();
        assert_eq!(ids, ["s0", "s1", "s2"]);
        assert!(spool_take(home.path()).unwrap().is_empty());
    }

    fn event() -> impl Strategy<Value = Option<&'static str>> {
        prop_oneof![
            Just(None),
            Just(Some("SessionStart")),
            Just(Some("UserPromptSubmit")),
            Just(Some("PreToolUse")),
            Just(Some("PostToolUse")),
            Just(Some("Notification")),
            Just(Some("Stop")),
            Just(Some("SubagentStop")),
            Just(Some("SessionEnd")),
            Just(Some("whatever")),
        ]
    }

    proptest! {
        /// Whatever hooks arrive, in whatever order, the mapping feeds the
        /// state machine only inputs it accepts; the session leaves
        /// `starting` at its first hook and `SessionEnd` ends it.
        #[test]
        fn hooks_only_feed_accepted_inputs(events in proptest::collection::vec(event(), 1..60)) {
            let mut m = Machine::new(Duration::ZERO);
            for (i, e) in events.into_iter().enumerate() {
                for input in inputs(e, m.state()) {
                    prop_assert!(m.apply(input, Duration::from_millis(i as u64)).is_ok(), "{:?} in {:?}", input, m.state());
                }
                prop_assert!(m.state() != State::Starting);
                if e == Some("SessionEnd") {
                    prop_assert_eq!(m.state(), State::Exited);
                }
            }
        }
    }
}
