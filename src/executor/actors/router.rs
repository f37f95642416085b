//! The executor's frame router: parse the envelope, decode the params once
//! into the owning actor's request ([`crate::wire::request`], generated from
//! the method table), one map lookup by the owner's key, one cast. It holds
//! no business state: nothing awaited.

use super::connection::ConnMsg;
use super::mcp::McpMsg;
use super::process::ProcessMsg;
use super::session::SessionMsg;
use super::sessions::SessionsMsg;
use super::terminals::TerminalsMsg;
use crate::executor::Shared;
use crate::wire::request::{
    self, ConnectionRequest, McpRequest, ProcessRequest, SessionRequest, SessionsRequest,
    TerminalRequest, TurnRequest,
};
use crate::wire::{Dispatch, Inbound, Method, Request, Responder, RpcError, Version};
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

/// The capability a method needs that no executor offers yet: these have
/// no owner actor ([`request::routed`] is `None`) and are refused before
/// their params are read.
fn not_built(method: Method) -> Option<&'static str> {
    use Method::*;
    match method {
        FsMount | FsUnmount => Some("fs"),
        _ => None,
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
        McpOpen | McpClose | McpFrame => (shared.config.mcp_max_servers == 0).then_some("mcp"),
        TurnStart | TurnInput | TurnCancel | InteractionResponse | SessionClose => {
            shared.config.agents.is_empty().then_some("agent")
        }
        ArtifactUpload => (!crate::executor::artifacts::ENABLED).then_some("artifacts"),
        DisplayRfb => (!super::display::rfb_available()).then_some("display"),
        WorkspaceBackup => (!crate::executor::artifacts::ENABLED).then_some("workspace"),
        SkillInstall => (!crate::executor::artifacts::ENABLED).then_some("skills"),
        other => not_built(other),
    }
}

fn answer(reply: Option<Responder>, error: RpcError) {
    match reply {
        Some(r) => r.err(error),
        None => tracing::warn!(error = %error, "notification refused"),
    }
}

impl Dispatch for ExecutorRouter {
    fn dispatch(&self, frame: Inbound, reply: Option<Responder>) {
        let Some(method) = frame.method().and_then(Method::from_name) else {
            return;
        };
        let span = tracing::debug_span!("frame", %method, id = ?frame.id());
        let _g = span.enter();
        if !method.executor_receives() || method.since() > self.version {
            return answer(reply, RpcError::method_not_found(method.as_str()));
        }
        if method.is_notification() && reply.is_some() {
            return answer(reply, RpcError::notification_as_request(method.as_str()));
        }
        if let Some(cap) = missing_capability(&self.shared, method) {
            return answer(reply, RpcError::capability_unavailable(cap));
        }
        let request = match request::decode(method, &frame) {
            Ok(request) => request,
            Err(e) => return answer(reply, e),
        };
        if let Err(e) = self.fence(&request, &frame) {
            return answer(reply, e);
        }
        match (request, reply) {
            // `terminal.input` may come as a notification.
            (Request::Terminal(r), reply) => self.terminal(r, reply),
            // `mcp.frame` is a notification.
            (Request::Mcp(r), reply) => self.mcp(r, reply),
            // No other request is answered as a notification: nobody to
            // answer, so it is dropped (as it always was).
            (_, None) => {}
            (Request::Process(r), Some(reply)) => self.process(r, reply),
            (Request::Session(r), Some(reply)) => self.session(r, reply),
            (Request::Turn(r), Some(reply)) => self.turn(r, reply),
            (Request::Connection(ConnectionRequest::ExecutorDrain(p)), Some(reply)) => {
                if let Err(e) = self.connection.send_message(ConnMsg::Drain(p, reply)) {
                    tracing::warn!(error = %e, "connection actor gone");
                }
            }
            (Request::Sessions(SessionsRequest::SessionAssign(p)), Some(reply)) => {
                let unavailable = || RpcError::internal("sessions supervisor unavailable");
                match self.shared.sessions_actor() {
                    Some(s) => {
                        if let Err(ractor::MessagingErr::SendErr(SessionsMsg::Assign(_, r))) =
                            s.send_message(SessionsMsg::Assign(p, reply))
                        {
                            r.err(unavailable());
                        }
                    }
                    None => reply.err(unavailable()),
                }
            }
        }
    }
}

impl ExecutorRouter {
    /// The fence on every session-scoped request (bmx extension,
    /// docs/protocol.md "Fencing on every session request"): a request
    /// carrying a `fencingToken` below the highest grant the sessions
    /// supervisor took for its session is refused with -32009
    /// `stale_fencing_token`, before any actor sees it. A request without
    /// one (a seed peer) passes; so does a higher one (its assign may still
    /// be on its way), and one about a session this executor does not run
    /// (its owner answers -32011 as before).
    fn fence(&self, request: &Request, frame: &Inbound) -> Result<(), RpcError> {
        let Some(session_id) = request.fenced_session() else {
            return Ok(());
        };
        let Some(given) = frame.fencing_token()? else {
            return Ok(());
        };
        match self.shared.fences.get(session_id).map(|h| *h) {
            Some(highest) if given < highest => {
                tracing::info!(session = %session_id, given, highest, method = %request.method(),
                    "request under a superseded grant refused (stale_fencing_token)");
                Err(request::stale_fencing_token(session_id, given, highest))
            }
            _ => Ok(()),
        }
    }

    fn terminal(&self, request: TerminalRequest, reply: Option<Responder>) {
        let unavailable = || RpcError::internal("terminals supervisor unavailable");
        match self.shared.terminals_actor() {
            Some(t) => {
                if let Err(ractor::MessagingErr::SendErr(TerminalsMsg::Request(_, reply))) =
                    t.send_message(TerminalsMsg::Request(request, reply))
                {
                    answer(reply, unavailable());
                }
            }
            None => answer(reply, unavailable()),
        }
    }

    /// The hot path: `process.read` and `process.write` go straight to the
    /// process actor. A process the map does not hold (yet: its start may
    /// still be in the session's mailbox) goes through its session, which
    /// serializes it after the start or answers that it does not exist.
    fn process(&self, request: ProcessRequest, reply: Responder) {
        let key = crate::executor::runtime::process_key(request.session_id(), request.process_id());
        let Some(actor) = self.shared.processes.get(&key).map(|a| a.clone()) else {
            return self.session(SessionRequest::Process(request), reply);
        };
        let msg = match request {
            ProcessRequest::ProcessRead(p) => ProcessMsg::Read(p, reply),
            ProcessRequest::ProcessWrite(p) => ProcessMsg::Write(p, reply),
        };
        if let Err(ractor::MessagingErr::SendErr(msg)) = actor.send_message(msg) {
            // The process actor stopped: its session is ending.
            let session_id = match &msg {
                ProcessMsg::Read(p, _) => p.session_id.as_str(),
                ProcessMsg::Write(p, _) => p.session_id.as_str(),
                _ => "",
            }
            .to_owned();
            msg.fail(RpcError::session_not_active(&session_id));
        }
    }

    /// `mcp.*` straight to the server's actor; a server the map does not
    /// hold (unknown, unavailable, restarting) is answered by its session.
    fn mcp(&self, request: McpRequest, reply: Option<Responder>) {
        let key = crate::executor::runtime::process_key(request.session_id(), request.server_key());
        if matches!(request, McpRequest::McpFrame(_)) {
            // A `service` server's answer, from the harness.
            if let Some(t) = self.shared.mcp_tunnels.get(&key).map(|t| t.clone()) {
                if let McpRequest::McpFrame(p) = request {
                    if let Some(r) = reply {
                        r.ok(&crate::wire::types::Accepted::YES);
                    }
                    t.from_harness(p.payload);
                }
                return;
            }
        }
        if let Some(actor) = self.shared.mcp.get(&key).map(|a| a.clone()) {
            match actor.send_message(McpMsg::Request(request, reply)) {
                Ok(()) => return,
                Err(ractor::MessagingErr::SendErr(McpMsg::Request(r, reply))) => {
                    return self.mcp_via_session(r, reply)
                }
                Err(_) => return,
            }
        }
        self.mcp_via_session(request, reply)
    }

    fn mcp_via_session(&self, request: McpRequest, reply: Option<Responder>) {
        let session_id = request.session_id().to_owned();
        let Some(session) = self.shared.sessions.get(&session_id).map(|s| s.clone()) else {
            return answer(reply, RpcError::session_not_active(&session_id));
        };
        if let Err(ractor::MessagingErr::SendErr(SessionMsg::Mcp(_, reply))) =
            session.send_message(SessionMsg::Mcp(request, reply))
        {
            answer(reply, RpcError::session_not_active(&session_id));
        }
    }

    /// Turns are their session's: one at a time, the session knows which.
    fn turn(&self, request: TurnRequest, reply: Responder) {
        let session_id = request.session_id().to_owned();
        let Some(session) = self.shared.sessions.get(&session_id).map(|s| s.clone()) else {
            return reply.err(RpcError::session_not_active(&session_id));
        };
        if let Err(ractor::MessagingErr::SendErr(SessionMsg::Turn(_, reply))) =
            session.send_message(SessionMsg::Turn(request, reply))
        {
            reply.err(RpcError::session_not_active(&session_id));
        }
    }

    fn session(&self, request: SessionRequest, reply: Responder) {
        let Some(session) = self
            .shared
            .sessions
            .get(request.session_id())
            .map(|s| s.clone())
        else {
            return reply.err(RpcError::session_not_active(request.session_id()));
        };
        if let Err(ractor::MessagingErr::SendErr(SessionMsg::Request(request, reply))) =
            session.send_message(SessionMsg::Request(request, reply))
        {
            reply.err(RpcError::session_not_active(request.session_id()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::METHODS;

    /// Every method an executor receives is either routed to the owner the
    /// table names or refused as not built, never both, never neither.
    #[test]
    fn every_received_method_is_routed_to_its_owner_or_refused() {
        for spec in METHODS {
            let (routed, refused) = (request::routed(spec.method), not_built(spec.method));
            if spec.method.executor_receives() {
                assert!(
                    routed.is_some() != refused.is_some(),
                    "{}: routed {routed:?}, refused {refused:?}",
                    spec.name
                );
                if let Some(owner) = routed {
                    assert_eq!(owner, spec.owner, "{}", spec.name);
                }
            } else {
                assert_eq!(routed, None, "{} is not the executor's", spec.name);
            }
        }
    }
}
