//! One tool call: runs the tool once, hands the result to its session and
//! ends. The session keeps the result in its outbox and sends `tool.result`
//! until the harness acknowledges it (with backoff, and again after every
//! reconnect), so a result outlives the actor that produced it; a crash of
//! this actor is answered by the session with an error result.
//!
//! A call under `always_ask` (its `permission.mode`, or `--confirm
//! always`) first asks the confirmation actor and waits for its decision;
//! only `Allowed` runs the tool. `deadlineMs` bounds the whole call, the
//! wait included: the tool gets what is left of it.

use super::confirm::ConfirmMsg;
use super::display::{DisplayHandle, DisplayMsg};
use super::session::{safe_name, session_scope, SessionMsg};
use crate::executor::confirm::{self, Decision, Key, Mode};
use crate::executor::Shared;
use crate::tools::{Outcome as ToolOutcome, ToolContext, ToolOutput};
use crate::wire::types::{
    ContentBlock, Outcome, ToolCallParams, ToolProgressParams, ToolResultParams,
};
use crate::wire::Method;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

pub enum ToolMsg {
    /// The tool finished: its result and the content blocks after its
    /// text (a `computer_observe` image).
    Done(ToolOutput, Vec<ContentBlock>),
    Cancel(String),
    /// Test hook: panic in the handler (a crash the tests inject).
    #[doc(hidden)]
    Panic,
}

pub struct ToolArgs {
    pub shared: Arc<Shared>,
    /// Where the result goes.
    pub session: ActorRef<SessionMsg>,
    pub workspace: PathBuf,
    /// The session's sandbox: what a `bash` call starts runs in it.
    pub sandbox: Arc<crate::sandbox::Sandbox>,
    pub params: ToolCallParams,
    /// The session's display, for `computer_*` calls (`None`: it could
    /// not start, and such a call fails with `display_error`).
    pub display: Option<DisplayHandle>,
}

pub struct ToolActor;

pub struct ToolState {
    session: ActorRef<SessionMsg>,
    params: ToolCallParams,
    cancel: CancellationToken,
    /// Cancels the running tool when the state is dropped, which happens
    /// on every way out, a panic included (post_stop does not run then).
    _stop_work: tokio_util::sync::DropGuard,
    started: Instant,
}

fn to_wire(outcome: ToolOutcome) -> Outcome {
    match outcome {
        ToolOutcome::Succeeded => Outcome::Succeeded,
        ToolOutcome::Failed => Outcome::Failed,
        ToolOutcome::Canceled => Outcome::Canceled,
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

/// What an `always_ask` call needs to ask.
struct Gate {
    actor: Option<ActorRef<ConfirmMsg>>,
    request: confirm::Request,
    wait: Duration,
}

/// Slack past the confirmation deadline before the call stops waiting on
/// its own (the actor's timer normally answers first).
const GATE_SLACK: Duration = Duration::from_secs(2);

impl Gate {
    /// Ask and wait: the decision, `Withdrawn` when `cancel` fires first
    /// (the entry is withdrawn so nobody can allow a call that is gone),
    /// `Unavailable` when nobody can answer.
    async fn ask(&self, cancel: &CancellationToken) -> Decision {
        let Some(actor) = &self.actor else {
            return Decision::Unavailable;
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        let asked = actor.send_message(ConfirmMsg::Ask {
            request: self.request.clone(),
            wait: self.wait,
            reply: tx,
        });
        if asked.is_err() {
            return Decision::Unavailable;
        }
        let withdraw = || {
            let _ = actor.send_message(ConfirmMsg::Withdraw(self.request.key.clone()));
        };
        // Cancel first: a call canceled while an allow was in flight
        // never runs.
        tokio::select! {
            biased;
            _ = cancel.cancelled() => {
                withdraw();
                Decision::Withdrawn
            }
            d = rx => d.unwrap_or(Decision::Unavailable),
            _ = tokio::time::sleep(self.wait + GATE_SLACK) => {
                withdraw();
                Decision::Expired
            }
        }
    }
}

/// Run a `computer_*` call on the session's display: its text result and
/// the content blocks after the text (the screen image of an observe).
async fn computer(
    display: Option<DisplayHandle>,
    tool: &str,
    input: serde_json::Value,
) -> (ToolOutput, Vec<ContentBlock>) {
    let failed = |text: String, reason: &str| {
        let out = ToolOutput {
            outcome: ToolOutcome::Failed,
            is_error: true,
            text,
            reason: Some(reason.to_owned()),
        };
        (out, Vec::new())
    };
    let Some(display) = display else {
        return failed(
            "the session's display could not start".into(),
            "display_error",
        );
    };
    let checked = crate::tools::computer::check_display(&input, &display.name).and_then(|()| {
        if tool == "computer_observe" {
            crate::tools::computer::parse_observe(&input)
        } else {
            Ok(())
        }
    });
    if let Err(e) = checked {
        return failed(e.to_string(), "invalid_input");
    }
    let (tx, rx) = tokio::sync::oneshot::channel();
    let msg = if tool == "computer_observe" {
        DisplayMsg::Observe { reply: tx }
    } else {
        DisplayMsg::Act { input, reply: tx }
    };
    if display.actor.send_message(msg).is_err() {
        return failed("the session's display is gone".into(), "display_error");
    }
    // The display answers within its own per-call deadline; this bound
    // only guards against an actor that died with the message queued.
    match tokio::time::timeout(Duration::from_secs(30), rx).await {
        Ok(Ok(out)) => out,
        _ => failed(
            "the session's display did not answer".into(),
            "display_error",
        ),
    }
}

/// The result of a call that did not run.
fn refusal(decision: Decision, wait: Duration) -> ToolOutput {
    let (outcome, text) = match decision {
        Decision::Denied => (
            ToolOutcome::Failed,
            "denied by a person at the executor's machine".to_owned(),
        ),
        Decision::Expired => (
            ToolOutcome::Failed,
            format!(
                "nobody at the executor's machine confirmed the call within {} ms",
                wait.as_millis()
            ),
        ),
        Decision::Withdrawn => (
            ToolOutcome::Canceled,
            "canceled while waiting for local confirmation".to_owned(),
        ),
        Decision::Unavailable | Decision::Allowed => (
            ToolOutcome::Failed,
            "the call needs local confirmation and nobody can give it now".to_owned(),
        ),
    };
    ToolOutput {
        outcome,
        is_error: true,
        text,
        reason: decision.reason().map(str::to_owned),
    }
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
        ctx.env = Arc::new(args.sandbox.child_env(args.shared.config.child_env()));
        ctx.sandbox = Some(args.sandbox.clone());
        ctx.scope = tool_scope(&args.shared.instance, &p.session_id, &p.tool_call_id);
        ctx.progress = Some(progress_tx);
        ctx.inline_limit = args.shared.config.tool_inline_limit;
        ctx.disk = args.shared.config.tool_disk;
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
        let display = args.display;
        let (tool, input, deadline) = (p.tool.clone(), p.input.clone(), p.deadline_ms);
        let (me, c) = (myself.clone(), cancel.clone());
        // Validated by the session before this actor starts; a mode that
        // still does not parse asks (the safe side).
        let mode =
            confirm::effective_mode(p.permission.as_ref(), args.shared.config.confirm_always)
                .unwrap_or(Mode::AlwaysAsk);
        let gate = (mode == Mode::AlwaysAsk).then(|| Gate {
            actor: args.shared.confirm_actor(),
            request: confirm::Request {
                key: Key {
                    session_id: p.session_id.clone(),
                    tool_call_id: p.tool_call_id.clone(),
                },
                tool: p.tool.clone(),
                summary: confirm::summarize(&p.input),
            },
            wait: confirm::wait_for(args.shared.config.confirm_timeout, p.deadline_ms),
        });
        let begun = Instant::now();
        tokio::spawn(async move {
            if let Some(gate) = gate {
                let decision = gate.ask(&c).await;
                if decision != Decision::Allowed {
                    let _ =
                        me.send_message(ToolMsg::Done(refusal(decision, gate.wait), Vec::new()));
                    return;
                }
            }
            // What is left of the call's deadline after the wait.
            let deadline =
                deadline.map(|ms| ms.saturating_sub(begun.elapsed().as_millis() as u64).max(1));
            // A tool that panics is a failed call, never a call that hangs.
            let run = async move {
                use futures_util::FutureExt;
                if tool.starts_with("computer_") {
                    return computer(display, &tool, input).await;
                }
                let out = std::panic::AssertUnwindSafe(tools.run(&tool, ctx, input))
                    .catch_unwind()
                    .await
                    .unwrap_or_else(|_| ToolOutput {
                        outcome: ToolOutcome::Failed,
                        is_error: true,
                        text: "the tool panicked inside the executor".into(),
                        reason: Some("internal_error".into()),
                    });
                (out, Vec::new())
            };
            let out = match deadline {
                Some(ms) => match tokio::time::timeout(Duration::from_millis(ms), run).await {
                    Ok(out) => out,
                    Err(_) => {
                        c.cancel();
                        let out = ToolOutput {
                            outcome: ToolOutcome::Failed,
                            is_error: true,
                            text: format!("deadline of {ms} ms passed"),
                            reason: Some("timeout".into()),
                        };
                        (out, Vec::new())
                    }
                },
                None => run.await,
            };
            let _ = me.send_message(ToolMsg::Done(out.0, out.1));
        });
        Ok(ToolState {
            session: args.session,
            params: p,
            _stop_work: cancel.clone().drop_guard(),
            cancel,
            started: Instant::now(),
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<ToolMsg>,
        state: &mut ToolState,
    ) -> Result<(), ActorProcessingErr> {
        // Stopped before the tool finished (the session ends): stop the work.
        state.cancel.cancel();
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<ToolMsg>,
        msg: ToolMsg,
        state: &mut ToolState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            ToolMsg::Done(out, extra) => {
                let outcome = if state.cancel.is_cancelled()
                    && out.outcome != ToolOutcome::Succeeded
                    && out.reason.as_deref() != Some("timeout")
                {
                    Outcome::Canceled
                } else {
                    to_wire(out.outcome)
                };
                let result = ToolResultParams {
                    session_id: state.params.session_id.clone(),
                    tool_call_id: state.params.tool_call_id.clone(),
                    outcome,
                    is_error: out.is_error,
                    content: std::iter::once(ContentBlock::text(out.text))
                        .chain(extra)
                        .collect(),
                    artifacts: Vec::new(),
                    duration_ms: state.started.elapsed().as_millis() as u64,
                    reason: out.reason,
                };
                let _ = state
                    .session
                    .send_message(SessionMsg::ToolDone(Box::new(result)));
                myself.stop(None);
            }
            ToolMsg::Panic => panic!("injected panic (test hook)"),
            ToolMsg::Cancel(reason) => {
                tracing::info!(tool_call = %state.params.tool_call_id, %reason, "cancel");
                state.cancel.cancel();
            }
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
