//! The terminals supervisor: executor-scoped PTY terminals by `terminalId`.
//!
//! Not built yet: until it is, `terminal` is not advertised and the router
//! answers -32012 before a request gets here.

use crate::executor::Shared;
use crate::wire::types::TerminalCapability;
use crate::wire::types::{
    TerminalAttachParams, TerminalCloseParams, TerminalInputParams, TerminalOpenParams,
    TerminalResizeParams,
};
use crate::wire::{Responder, RpcError};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::sync::Arc;

/// Terminal requests the router hands over (`terminal.input` may be a
/// notification: no responder).
pub enum TerminalRequest {
    Open(TerminalOpenParams),
    Attach(TerminalAttachParams),
    Input(TerminalInputParams),
    Resize(TerminalResizeParams),
    Close(TerminalCloseParams),
}

pub enum TerminalsMsg {
    Request(TerminalRequest, Option<Responder>),
    /// The connection came back: attached streams resume.
    Reconnected,
}

/// What this executor advertises for terminals (`None`: not offered).
pub fn capability(_shared: &Shared) -> Option<TerminalCapability> {
    None
}

pub struct Terminals;

pub struct TerminalsState {
    shared: Arc<Shared>,
}

impl Actor for Terminals {
    type Msg = TerminalsMsg;
    type State = TerminalsState;
    type Arguments = Arc<Shared>;

    async fn pre_start(
        &self,
        myself: ActorRef<TerminalsMsg>,
        shared: Arc<Shared>,
    ) -> Result<TerminalsState, ActorProcessingErr> {
        shared.set_terminals_actor(Some(myself));
        Ok(TerminalsState { shared })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<TerminalsMsg>,
        state: &mut TerminalsState,
    ) -> Result<(), ActorProcessingErr> {
        state.shared.set_terminals_actor(None);
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<TerminalsMsg>,
        msg: TerminalsMsg,
        _state: &mut TerminalsState,
    ) -> Result<(), ActorProcessingErr> {
        if let TerminalsMsg::Request(_, Some(reply)) = msg {
            reply.err(RpcError::capability_unavailable("terminal"));
        }
        Ok(())
    }
}
