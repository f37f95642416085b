//! One tool call: runs the tool once, keeps the result, and sends
//! `tool.result` until the harness acknowledges it: 5 attempts per
//! connection with backoff from 500 ms, then again after every reconnect,
//! for as long as the session lives. A result that could never be delivered
//! is logged when the session ends, never dropped silently.

use super::session::{safe_name, session_scope};
use crate::executor::Shared;
use crate::tools::{Outcome as ToolOutcome, ToolContext, ToolOutput};
use crate::wire::types::{
    ContentBlock, Outcome, ToolCallParams, ToolProgressParams, ToolResultParams,
};
use crate::wire::{CallError, Method};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Attempts per connection before waiting for a reconnect.
const ATTEMPTS_PER_CONNECTION: u32 = 5;
const FIRST_RETRY: Duration = Duration::from_millis(500);

pub enum ToolMsg {
    /// The tool finished.
    Done(ToolOutput),
    /// The same toolCallId arrived again: re-send the result if any.
    Repeat,
    Cancel(String),
    Reconnected,
    Delivered,
    DeliveryFailed,
}

pub struct ToolArgs {
    pub shared: Arc<Shared>,
    pub workspace: PathBuf,
    pub params: ToolCallParams,
}

pub struct ToolActor;

pub struct ToolState {
    shared: Arc<Shared>,
    params: ToolCallParams,
    cancel: CancellationToken,
    started: Instant,
    result: Option<ToolResultParams>,
    acked: bool,
    delivering: bool,
}

fn to_wire(outcome: ToolOutcome) -> Outcome {
    match outcome {
        ToolOutcome::Succeeded => Outcome::Succeeded,
        ToolOutcome::Failed => Outcome::Failed,
        ToolOutcome::Canceled => Outcome::Canceled,
    }
}

impl ToolState {
    fn deliver(&mut self, myself: &ActorRef<ToolMsg>) {
        let Some(result) = self.result.clone() else {
            return;
        };
        if self.delivering {
            return;
        }
        let Some(link) = self.shared.link() else {
            return;
        };
        self.delivering = true;
        let (me, timeout) = (myself.clone(), self.shared.config.request_timeout);
        tokio::spawn(async move {
            let mut delay = FIRST_RETRY;
            for attempt in 1..=ATTEMPTS_PER_CONNECTION {
                match link
                    .request::<_, serde_json::Value>(Method::ToolResult, &result, timeout)
                    .await
                {
                    Ok(_) => {
                        let _ = me.send_message(ToolMsg::Delivered);
                        return;
                    }
                    Err(CallError::Closed) => break,
                    Err(e) => {
                        tracing::warn!(tool_call = %result.tool_call_id, attempt, error = %e, "tool.result not acknowledged");
                        if attempt < ATTEMPTS_PER_CONNECTION {
                            tokio::time::sleep(delay).await;
                            delay *= 2;
                        }
                    }
                }
            }
            let _ = me.send_message(ToolMsg::DeliveryFailed);
        });
    }
}

/// The `BMX_SCOPE` of a tool call's processes: under its session's scope,
/// so the session's end kills whatever a call left running, even outside
/// its process group. The trailing `/` keeps one call's scope from being a
/// prefix of another's (`tool-a/` is not a prefix of `tool-ab/`).
pub fn tool_scope(instance: &str, session_id: &str, tool_call_id: &str) -> String {
    format!(
        "{}tool-{}/",
        session_scope(instance, session_id),
        safe_name(tool_call_id)
    )
}

impl Actor for ToolActor {
    type Msg = ToolMsg;
    type State = ToolState;
    type Arguments = ToolArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<ToolMsg>,
        args: ToolArgs,
    ) -> Result<ToolState, ActorProcessingErr> {
        let p = args.params;
        let cancel = CancellationToken::new();
        let (progress_tx, mut progress_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        let mut ctx = ToolContext::new(args.workspace, p.tool_call_id.clone());
        ctx.cancel = cancel.clone();
        ctx.env = Arc::new(args.shared.config.child_env());
        ctx.scope = tool_scope(&args.shared.instance, &p.session_id, &p.tool_call_id);
        ctx.progress = Some(progress_tx);
        ctx.inline_limit = args.shared.config.tool_inline_limit;
        let (shared, session_id, call_id) = (
            args.shared.clone(),
            p.session_id.clone(),
            p.tool_call_id.clone(),
        );
        tokio::spawn(async move {
            while let Some(message) = progress_rx.recv().await {
                if let Some(link) = shared.link() {
                    let _ = link.notify(
                        Method::ToolProgress,
                        &ToolProgressParams {
                            session_id: session_id.clone(),
                            tool_call_id: call_id.clone(),
                            message,
                        },
                    );
                }
            }
        });
        let tools = args.shared.tools.clone();
        let (tool, input, deadline) = (p.tool.clone(), p.input.clone(), p.deadline_ms);
        let (me, c) = (myself.clone(), cancel.clone());
        tokio::spawn(async move {
            let run = tools.run(&tool, ctx, input);
            let out = match deadline {
                Some(ms) => match tokio::time::timeout(Duration::from_millis(ms), run).await {
                    Ok(out) => out,
                    Err(_) => {
                        c.cancel();
                        ToolOutput {
                            outcome: ToolOutcome::Failed,
                            is_error: true,
                            text: format!("deadline of {ms} ms passed"),
                            reason: Some("timeout".into()),
                        }
                    }
                },
                None => run.await,
            };
            let _ = me.send_message(ToolMsg::Done(out));
        });
        Ok(ToolState {
            shared: args.shared,
            params: p,
            cancel,
            started: Instant::now(),
            result: None,
            acked: false,
            delivering: false,
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<ToolMsg>,
        state: &mut ToolState,
    ) -> Result<(), ActorProcessingErr> {
        state.cancel.cancel();
        if let Some(r) = &state.result {
            if !state.acked {
                tracing::error!(
                    session = %r.session_id,
                    tool_call = %r.tool_call_id,
                    outcome = ?r.outcome,
                    "tool.result was never acknowledged; giving up as the session ends"
                );
            }
        }
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<ToolMsg>,
        msg: ToolMsg,
        state: &mut ToolState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            ToolMsg::Done(out) => {
                let outcome = if state.cancel.is_cancelled()
                    && out.outcome != ToolOutcome::Succeeded
                    && out.reason.as_deref() != Some("timeout")
                {
                    Outcome::Canceled
                } else {
                    to_wire(out.outcome)
                };
                state.result = Some(ToolResultParams {
                    session_id: state.params.session_id.clone(),
                    tool_call_id: state.params.tool_call_id.clone(),
                    outcome,
                    is_error: out.is_error,
                    content: vec![ContentBlock::text(out.text)],
                    artifacts: Vec::new(),
                    duration_ms: state.started.elapsed().as_millis() as u64,
                    reason: out.reason,
                });
                state.deliver(&myself);
            }
            ToolMsg::Repeat => {
                state.delivering = false;
                state.deliver(&myself);
            }
            ToolMsg::Cancel(reason) => {
                tracing::info!(tool_call = %state.params.tool_call_id, %reason, "cancel");
                state.cancel.cancel();
            }
            ToolMsg::Reconnected => {
                if !state.acked {
                    state.delivering = false;
                    state.deliver(&myself);
                }
            }
            ToolMsg::Delivered => {
                state.delivering = false;
                state.acked = true;
            }
            ToolMsg::DeliveryFailed => state.delivering = false,
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tool_scope_lies_under_its_session_and_no_call_prefixes_another() {
        let a = tool_scope("inst", "s", "a");
        assert!(a.starts_with(&session_scope("inst", "s")), "{a}");
        assert!(!tool_scope("inst", "s", "ab").starts_with(&a));
        let hostile = tool_scope("inst", "s", "../x\n");
        assert!(!hostile.contains(['\n', '\0']), "{hostile}");
        assert_eq!(hostile.matches('/').count(), a.matches('/').count());
    }
}
