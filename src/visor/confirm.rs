//! Tool calls a local executor holds for a person (`always_ask`, issue 20),
//! shown in the visor: each pending confirmation is a `request` event of
//! an observed session, answered with the visor's own `answer`.
//!
//! One bridge actor per executor confirmation socket (a child of the visor
//! root, `permanent`). It keeps one connection open in the socket's
//! `watch` mode (`executor::confirm`): the executor sends the pending list
//! whenever a confirmation is added or resolved. The bridge diffs each
//! list against what it has shown: a new id opens a request (`request`
//! event, the session moves to `waiting`); an id gone (answered with
//! `bmx confirm`, expired, withdrawn by a `tool.cancel` or `session.stop`)
//! closes it (`request_closed`). With no executor listening it tries again
//! every [`RETRY`]; while it is away nothing is shown as pending.
//!
//! The observed session (agent `bmx-executor`, label `source=executor`)
//! is created at the first confirmation, not before: a visor whose user
//! runs no executor shows nothing. Its id routes `answer` here
//! ([`answer`]), which sends `allow` / `deny` over a fresh connection to
//! the same socket and closes the request once the executor took it.
//!
//! Trust: the executor answers only peers of its own uid (`SO_PEERCRED`),
//! so the visor can answer only when it runs as the executor's user: the
//! same boundary as `bmx confirm` (docs/security.md).

use super::session::{AnswerSpec, SessionData};
use super::state::{Input, State};
use super::{Visor, VisorError};
use crate::executor::confirm::{
    client, LocalDecision, LocalRequest, LocalResponse, PendingView, MAX_ANSWER_LINE,
};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

/// Between tries to reach an executor that is not listening.
pub const RETRY: Duration = Duration::from_secs(1);
/// How long an answer waits for the executor.
const ANSWER_WAIT: Duration = Duration::from_secs(5);
/// The agent name of the observed session.
pub const AGENT: &str = "bmx-executor";

/// The executor's default confirmation socket (its default `--work-root`,
/// `$TMPDIR/bmx-work`): what the visor watches unless told otherwise.
pub fn default_socket() -> PathBuf {
    crate::executor::confirm::socket_path(&std::env::temp_dir().join("bmx-work"))
}

pub enum BridgeMsg {
    /// Try to reach the executor.
    Connect,
    /// The executor's pending list now (connection generation).
    Update(u64, Vec<PendingView>),
    /// The watch connection ended (connection generation).
    Lost(u64),
    /// `answer` on the bridge's session. Through the actor, so an answer
    /// and the list that follows it are applied in order.
    Answer(AnswerSpec, ractor::RpcReplyPort<Result<(), VisorError>>),
}

#[derive(Clone)]
pub struct Bridge;

pub struct BridgeState {
    visor: Arc<Visor>,
    socket: PathBuf,
    session: Option<Arc<SessionData>>,
    reader: Option<tokio::task::JoinHandle<()>>,
    /// Which connection the reader's messages are from: a late message of
    /// an older one is ignored.
    generation: u64,
}

impl BridgeState {
    /// The observed session, created at the first confirmation.
    fn session(&mut self, myself: &ActorRef<BridgeMsg>) -> Arc<SessionData> {
        if let Some(d) = &self.session {
            return d.clone();
        }
        let d = open(&self.visor, &self.socket, myself);
        self.session = Some(d.clone());
        d
    }

    /// Show `list`: open what is new, close what is gone.
    fn show(&mut self, myself: &ActorRef<BridgeMsg>, list: &[PendingView]) {
        if list.is_empty() && self.session.is_none() {
            return;
        }
        let d = self.session(myself);
        let shown = shown_ids(&d);
        for id in shown.iter().filter(|id| !list.iter().any(|p| &p.id == *id)) {
            close(&d, id, json!({"requestId": id, "reason": "resolved"}));
        }
        for p in list.iter().filter(|p| !shown.contains(&p.id)) {
            let view = request_view(p);
            if !d.chat().open_as(p.id.clone(), view.clone()) {
                tracing::warn!(confirmation = %p.id, "too many open requests: not shown");
                continue;
            }
            if d.state() == State::Idle {
                let _ = d.apply(Input::Send { can_steer: false });
            }
            let _ = d.apply(Input::Request);
            d.emit("request", json!({"request": view}));
        }
    }

    /// The executor went away: nothing it held is pending any more.
    fn lost(&mut self) {
        if let Some(d) = &self.session {
            for id in shown_ids(d) {
                close(d, &id, json!({"requestId": id, "reason": "executor_gone"}));
            }
        }
    }
}

/// The ids of the requests `d` shows as pending.
fn shown_ids(d: &SessionData) -> Vec<String> {
    d.chat()
        .pending_views()
        .iter()
        .filter_map(|v| v["id"].as_str().map(str::to_owned))
        .collect()
}

/// What a pending confirmation looks like as a visor `Request`.
fn request_view(p: &PendingView) -> Value {
    // The executor sends the call's input as (possibly cut) JSON text.
    let input = serde_json::from_str::<Value>(&p.input).unwrap_or(Value::String(p.input.clone()));
    json!({
        "id": p.id,
        "kind": "permission",
        "source": "executor",
        "tool": {"id": p.tool_call_id, "name": p.tool, "kind": "execute"},
        "input": input,
        "sessionId": p.session_id,
        "expiresInMs": p.expires_in_ms,
        "options": [
            {"id": "allow", "name": "Allow", "kind": "allow_once"},
            {"id": "deny", "name": "Deny", "kind": "reject_once"},
        ],
    })
}

/// Close request `id` of `d` (if open) and publish it.
fn close(d: &SessionData, id: &str, fields: Value) {
    if d.chat().close(id).is_err() {
        return;
    }
    d.emit("request_closed", fields);
    let _ = d.apply(Input::Answer);
    if d.state() == State::Running && d.chat().pending_count() == 0 {
        let _ = d.apply(Input::TurnEnded);
    }
}

/// The observed session of one executor socket.
fn open(v: &Visor, socket: &Path, bridge: &ActorRef<BridgeMsg>) -> Arc<SessionData> {
    let d = super::hooks::observed(
        v,
        super::hooks::Observed {
            agent: AGENT.into(),
            role: "executor",
            title: format!("executor confirmations ({})", socket.display()),
            labels: BTreeMap::from([("source".to_owned(), "executor".to_owned())]),
            cwd: PathBuf::from("/"),
            workdir: None,
            vendor_id: socket.display().to_string(),
        },
    );
    v.confirm_bridges.insert(d.id.clone(), bridge.clone());
    let _ = d.apply(Input::Started { idle: true });
    d
}

/// Read the watch connection; each list line becomes an `Update`.
async fn read_feed(stream: tokio::net::UnixStream, me: ActorRef<BridgeMsg>, generation: u64) {
    let mut read = BufReader::new(stream);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        let got = (&mut read)
            .take(MAX_ANSWER_LINE as u64 + 1)
            .read_until(b'\n', &mut buf)
            .await;
        let list = match got {
            Ok(n) if n > 0 && buf.len() <= MAX_ANSWER_LINE => {
                match serde_json::from_slice::<LocalResponse>(&buf) {
                    Ok(LocalResponse {
                        ok: true,
                        pending: Some(list),
                        ..
                    }) => list,
                    Ok(r) => {
                        tracing::warn!(error = ?r.error, "the executor refused to be watched");
                        break;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "the executor's list is not valid");
                        break;
                    }
                }
            }
            _ => break,
        };
        if me
            .send_message(BridgeMsg::Update(generation, list))
            .is_err()
        {
            return;
        }
    }
    let _ = me.send_message(BridgeMsg::Lost(generation));
}

impl Actor for Bridge {
    type Msg = BridgeMsg;
    type State = BridgeState;
    type Arguments = (Arc<Visor>, PathBuf);

    async fn pre_start(
        &self,
        myself: ActorRef<BridgeMsg>,
        (visor, socket): (Arc<Visor>, PathBuf),
    ) -> Result<BridgeState, ActorProcessingErr> {
        // A restarted bridge takes over the session its previous run made
        // (the one whose vendor id is this socket).
        let name = socket.display().to_string();
        let session = visor
            .confirm_bridges
            .iter()
            .filter_map(|e| visor.sessions.get(e.key()).map(|d| d.clone()))
            .find(|d| d.chat().vendor_id.as_deref() == Some(name.as_str()));
        if let Some(d) = &session {
            visor.confirm_bridges.insert(d.id.clone(), myself.clone());
        }
        myself.send_message(BridgeMsg::Connect)?;
        Ok(BridgeState {
            visor,
            socket,
            session,
            reader: None,
            generation: 0,
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<BridgeMsg>,
        state: &mut BridgeState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(r) = state.reader.take() {
            r.abort();
        }
        state.lost();
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<BridgeMsg>,
        msg: BridgeMsg,
        state: &mut BridgeState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            BridgeMsg::Connect => {
                if state.visor.is_closing() {
                    return Ok(());
                }
                let connected = tokio::time::timeout(ANSWER_WAIT, async {
                    let mut s = tokio::net::UnixStream::connect(&state.socket).await?;
                    s.write_all(b"{\"op\":\"watch\"}\n").await?;
                    Ok::<_, std::io::Error>(s)
                })
                .await;
                match connected {
                    Ok(Ok(s)) => {
                        state.generation += 1;
                        tracing::info!(socket = %state.socket.display(), "watching the executor's confirmations");
                        state.reader =
                            Some(tokio::spawn(read_feed(s, myself.clone(), state.generation)));
                    }
                    _ => {
                        myself.send_after(RETRY, || BridgeMsg::Connect);
                    }
                }
            }
            BridgeMsg::Update(g, list) if g == state.generation => state.show(&myself, &list),
            BridgeMsg::Lost(g) if g == state.generation => {
                tracing::info!(socket = %state.socket.display(), "the executor's confirmations are out of reach");
                state.reader = None;
                state.lost();
                myself.send_after(RETRY, || BridgeMsg::Connect);
            }
            BridgeMsg::Update(..) | BridgeMsg::Lost(_) => {}
            BridgeMsg::Answer(spec, reply) => {
                let r = match &state.session {
                    Some(d) => answer(d, &state.socket, spec).await,
                    None => Err(VisorError::NotFound("no pending request".into())),
                };
                let _ = reply.send(r);
            }
        }
        Ok(())
    }
}

/// `answer` on a bridge's session, through its bridge actor.
///
/// # Errors
/// 404 for a request never shown, 409 for one already closed (answered,
/// expired, withdrawn), 400 for `updatedInput` (a held call runs with the
/// input the harness sent), 503 when the executor or the bridge cannot be
/// reached.
pub async fn ask(bridge: &ActorRef<BridgeMsg>, spec: AnswerSpec) -> Result<(), VisorError> {
    let gone = || VisorError::Unavailable("the executor bridge is restarting".into());
    // The bridge waits at most ANSWER_WAIT for the executor.
    let wait = ANSWER_WAIT + Duration::from_secs(1);
    match bridge
        .call(|reply| BridgeMsg::Answer(spec, reply), Some(wait))
        .await
    {
        Ok(ractor::rpc::CallResult::Success(r)) => r,
        _ => Err(gone()),
    }
}

/// `allow` / `deny` to the executor; the request closed once it took it.
async fn answer(d: &SessionData, socket: &Path, spec: AnswerSpec) -> Result<(), VisorError> {
    if spec.updated_input.is_some() {
        return Err(VisorError::Invalid(
            "updatedInput: an executor's held call runs with the input its harness sent".into(),
        ));
    }
    let id = spec.request_id;
    {
        let chat = d.chat();
        let open = chat.pending_views().iter().any(|v| v["id"] == id.as_str());
        if !open {
            return Err(match chat.was_closed(&id) {
                true => VisorError::State(format!("request {id:?} is already closed")),
                false => VisorError::NotFound(format!("no pending request {id:?}")),
            });
        }
    }
    let decision = match spec.allow {
        true => LocalDecision::Allow,
        false => LocalDecision::Deny,
    };
    let request = LocalRequest::Answer {
        id: id.clone(),
        decision,
    };
    let r = client::request(socket, &request, ANSWER_WAIT)
        .await
        .map_err(|e| VisorError::Unavailable(e.to_string()))?;
    if r.ok {
        close(
            d,
            &id,
            json!({"requestId": id, "reason": "answered", "allow": spec.allow}),
        );
        return Ok(());
    }
    let (code, message) = r
        .error
        .map(|e| (e.code, e.message))
        .unwrap_or_else(|| ("unknown".into(), String::new()));
    match code.as_str() {
        // Gone at the executor (it expired or was withdrawn just now).
        "unknown_id" | "expired" => {
            close(d, &id, json!({"requestId": id, "reason": code}));
            Err(VisorError::State(format!("request {id:?}: {message}")))
        }
        _ => Err(VisorError::Unavailable(format!(
            "the executor: {code}: {message}"
        ))),
    }
}
