//! The executor's frame router: decodes a frame's params into the type its
//! method names and casts it to the actor that owns it (by the method table).
//! It holds no business state: a lookup, a cast, nothing awaited.

use super::connection::ConnMsg;
use super::process::ProcessMsg;
use super::session::{SessionMsg, SessionRequest};
use super::sessions::SessionsMsg;
use super::terminals::{TerminalRequest, TerminalsMsg};
use crate::executor::Shared;
use crate::wire::types::SessionRefParams;
use crate::wire::{decode_params, Dispatch, Inbound, Method, Owner, Responder, RpcError, Version};
use ractor::ActorRef;
use std::sync::Arc;

pub struct ExecutorRouter {
    shared: Arc<Shared>,
    connection: ActorRef<ConnMsg>,
    /// The negotiated protocol version of this connection.
    version: Version,
}

impl ExecutorRouter {
    pub fn new(shared: Arc<Shared>, connection: ActorRef<ConnMsg>, version: Version) -> Self {
        ExecutorRouter {
            shared,
            connection,
            version,
        }
    }
}

/// The capability a method needs that this executor does not offer.
fn missing_capability(shared: &Shared, method: Method) -> Option<&'static str> {
    use Method::*;
    match method {
        TerminalOpen | TerminalAttach | TerminalClose | TerminalResize | TerminalInput => {
            super::terminals::capability(shared)
                .is_none()
                .then_some("terminal")
        }
        McpOpen | McpClose | McpFrame => Some("mcp"),
        TurnStart | TurnInput | TurnCancel | InteractionResponse | SessionClose => Some("agent"),
        WorkspaceBackup => Some("workspace"),
        SkillInstall => Some("skills"),
        FsMount | FsUnmount => Some("fs"),
        _ => None,
    }
}

fn answer(reply: Option<Responder>, error: RpcError) {
    match reply {
        Some(r) => r.err(error),
        None => tracing::warn!(error = %error, "notification refused"),
    }
}

impl Dispatch for ExecutorRouter {
    fn dispatch(&self, frame: Inbound, mut reply: Option<Responder>) {
        let Some(method) = frame.method().and_then(Method::from_name) else {
            return;
        };
        let span = tracing::debug_span!("frame", %method, id = ?frame.id());
        let _g = span.enter();
        if !method.executor_receives() || method.since() > self.version {
            return answer(reply, RpcError::method_not_found(method.as_str()));
        }
        if let Some(cap) = missing_capability(&self.shared, method) {
            return answer(reply, RpcError::capability_unavailable(cap));
        }
        match method.owner() {
            Owner::Connection => {
                if method == Method::ExecutorDrain {
                    let (Some(p), Some(r)) = (decode_params(&frame, &mut reply), reply.take())
                    else {
                        return;
                    };
                    if let Err(e) = self.connection.send_message(ConnMsg::Drain(p, r)) {
                        tracing::warn!(error = %e, "connection actor gone");
                    }
                }
            }
            Owner::Sessions => {
                let (Some(p), Some(r)) = (decode_params(&frame, &mut reply), reply.take()) else {
                    return;
                };
                match self.shared.sessions_actor() {
                    Some(s) => {
                        if let Err(ractor::MessagingErr::SendErr(SessionsMsg::Assign(_, r))) =
                            s.send_message(SessionsMsg::Assign(Box::new(p), r))
                        {
                            r.err(RpcError::internal("sessions supervisor unavailable"));
                        }
                    }
                    None => r.err(RpcError::internal("sessions supervisor unavailable")),
                }
            }
            Owner::Terminal => self.terminal(method, &frame, reply),
            _ => self.session_scoped(method, &frame, reply),
        }
    }
}

impl ExecutorRouter {
    fn terminal(&self, method: Method, frame: &Inbound, mut reply: Option<Responder>) {
        let request = match method {
            Method::TerminalOpen => decode_params(frame, &mut reply).map(TerminalRequest::Open),
            Method::TerminalAttach => decode_params(frame, &mut reply).map(TerminalRequest::Attach),
            Method::TerminalInput => decode_params(frame, &mut reply).map(TerminalRequest::Input),
            Method::TerminalResize => decode_params(frame, &mut reply).map(TerminalRequest::Resize),
            Method::TerminalClose => decode_params(frame, &mut reply).map(TerminalRequest::Close),
            other => return answer(reply, RpcError::method_not_found(other.as_str())),
        };
        let Some(request) = request else { return };
        match self.shared.terminals_actor() {
            Some(t) => {
                if let Err(ractor::MessagingErr::SendErr(TerminalsMsg::Request(_, reply))) =
                    t.send_message(TerminalsMsg::Request(request, reply))
                {
                    answer(
                        reply,
                        RpcError::internal("terminals supervisor unavailable"),
                    );
                }
            }
            None => answer(
                reply,
                RpcError::internal("terminals supervisor unavailable"),
            ),
        }
    }

    fn session_scoped(&self, method: Method, frame: &Inbound, mut reply: Option<Responder>) {
        let Some(SessionRefParams { session_id }) = decode_params(frame, &mut reply) else {
            return;
        };
        let request = match method {
            Method::SessionStop => decode_params(frame, &mut reply).map(SessionRequest::Stop),
            Method::ProcessStart => {
                decode_params(frame, &mut reply).map(SessionRequest::ProcessStart)
            }
            Method::ProcessRead => {
                decode_params(frame, &mut reply).map(SessionRequest::ProcessRead)
            }
            Method::ProcessWrite => {
                decode_params(frame, &mut reply).map(SessionRequest::ProcessWrite)
            }
            Method::ProcessInterrupt => {
                decode_params(frame, &mut reply).map(SessionRequest::ProcessInterrupt)
            }
            Method::ProcessTerminate => {
                decode_params(frame, &mut reply).map(SessionRequest::ProcessTerminate)
            }
            Method::ProcessList => Some(SessionRequest::ProcessList),
            Method::ToolCall => decode_params(frame, &mut reply).map(SessionRequest::ToolCall),
            Method::ToolCancel => decode_params(frame, &mut reply).map(SessionRequest::ToolCancel),
            other => {
                return answer(reply, RpcError::method_not_found(other.as_str()));
            }
        };
        let (Some(request), Some(reply)) = (request, reply) else {
            return;
        };
        // The hot path: reads and writes go straight to the process actor.
        let direct = match request {
            SessionRequest::ProcessRead(p) => {
                Ok((p.process_id.clone(), ProcessMsg::Read(p, reply)))
            }
            SessionRequest::ProcessWrite(p) => {
                Ok((p.process_id.clone(), ProcessMsg::Write(p, reply)))
            }
            other => Err((other, reply)),
        };
        let (request, reply) = match direct {
            Ok((process_id, msg)) => {
                let key = crate::executor::runtime::process_key(&session_id, &process_id);
                let actor = self.shared.processes.get(&key).map(|a| a.clone());
                match actor {
                    Some(actor) => {
                        if let Err(ractor::MessagingErr::SendErr(msg)) = actor.send_message(msg) {
                            msg.fail(RpcError::session_not_active(&session_id));
                        }
                        return;
                    }
                    None => match msg {
                        ProcessMsg::Read(p, reply) => (SessionRequest::ProcessRead(p), reply),
                        ProcessMsg::Write(p, reply) => (SessionRequest::ProcessWrite(p), reply),
                        _ => return,
                    },
                }
            }
            Err(pair) => pair,
        };
        let Some(session) = self.shared.sessions.get(&session_id).map(|s| s.clone()) else {
            return reply.err(RpcError::session_not_active(&session_id));
        };
        if let Err(ractor::MessagingErr::SendErr(SessionMsg::Request(_, reply))) =
            session.send_message(SessionMsg::Request(request, reply))
        {
            reply.err(RpcError::session_not_active(&session_id));
        }
    }
}
