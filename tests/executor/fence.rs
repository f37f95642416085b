//! Issue 54: the executor enforces the fence on every session-scoped
//! request, not only on `session.assign`. A request carrying the bmx
//! extension `fencingToken` below the newest grant the executor took for
//! its session is refused with -32009 `stale_fencing_token` and does
//! nothing; one without it (a seed peer) is served as before; the
//! reconnecting register's `resume` carries each session's token.

use crate::support;
use bmx::executor::Executor;
use bmx::wire::request::Fenced;
use bmx::wire::types::*;
use bmx::wire::{CloseCode, ErrorCode, Method};
use support::*;

/// `params` sent under grant `token`.
fn at<P: serde::Serialize>(token: u64, params: &P) -> Fenced<'_, P> {
    Fenced {
        params,
        fencing_token: token,
    }
}

fn stale(e: &bmx::wire::RpcError) -> bool {
    e.code == ErrorCode::Conflict.code() && e.reason() == Some("stale_fencing_token")
}

#[tokio::test]
async fn every_session_request_is_fenced_by_the_newest_grant() {
    let mut s = stand_in(Options::default()).await;
    let work = tempfile::tempdir().unwrap();
    let exec = Executor::start(s.config(work.path())).await.unwrap();
    let mut conn = s.next_conn().await;
    conn.register_as("exec-f", "conn-a", 10_000, 30_000).await;
    let (served, _events) = conn.serve();
    let sid = "fenced";
    let r: AssignResult = served
        .call(Method::SessionAssign, &assign_params(sid, 4098))
        .await
        .unwrap();
    assert!(r.accepted);
    let counter = [
        "sh",
        "-c",
        "i=0; while :; do echo $i; i=$((i+1)); sleep 0.05; done",
    ];
    // Under the current grant: served.
    let start = start_params(sid, "count", &counter);
    let st: ProcessState = served
        .call(Method::ProcessStart, &at(4098, &start))
        .await
        .unwrap();
    assert_eq!(st.state, ProcState::Running);
    // Another replica takes the session over: a newer grant renews it in
    // place.
    let r: AssignResult = served
        .call(Method::SessionAssign, &assign_params(sid, 8194))
        .await
        .unwrap();
    assert!(r.accepted);

    // Everything sent under the old grant is refused and does nothing.
    let late = start_params(sid, "late", &["sh", "-c", "echo late"]);
    let e = served
        .call::<_, ProcessState>(Method::ProcessStart, &at(4098, &late))
        .await
        .unwrap_err();
    assert!(stale(&e), "process.start under 4098: {e:?}");
    let read = read_params(sid, "count", Stream::Stdout, 0, 0);
    let e = served
        .call::<_, serde_json::Value>(Method::ProcessRead, &at(4098, &read))
        .await
        .unwrap_err();
    assert!(stale(&e), "process.read under 4098: {e:?}");
    let call = ToolCallParams {
        session_id: sid.into(),
        tool_call_id: "t-old".into(),
        tool: "bash".into(),
        input: serde_json::json!({"command": "echo never"}),
        deadline_ms: None,
        permission: None,
    };
    let e = served
        .call::<_, serde_json::Value>(Method::ToolCall, &at(4098, &call))
        .await
        .unwrap_err();
    assert!(stale(&e), "tool.call under 4098: {e:?}");
    let list = SessionRefParams {
        session_id: sid.into(),
    };
    let e = served
        .call::<_, serde_json::Value>(Method::ProcessList, &at(4098, &list))
        .await
        .unwrap_err();
    assert!(stale(&e), "process.list under 4098: {e:?}");
    let stop = StopParams {
        session_id: sid.into(),
        reason: "lease_expired".into(),
        deadline_ms: None,
        keep_workspace: false,
    };
    let e = served
        .call::<_, serde_json::Value>(Method::SessionStop, &at(4098, &stop))
        .await
        .unwrap_err();
    assert!(stale(&e), "session.stop under 4098: {e:?}");
    let e = served
        .call::<_, serde_json::Value>(
            Method::ProcessTerminate,
            &at(
                4098,
                &ProcessTerminateParams {
                    session_id: sid.into(),
                    process_id: "count".into(),
                    grace_ms: None,
                },
            ),
        )
        .await
        .unwrap_err();
    assert!(stale(&e), "process.terminate under 4098: {e:?}");

    // The session and its counter live on: listed under the new grant,
    // and under no token at all (a seed harness).
    let listed: ProcessListResult = served
        .call(Method::ProcessList, &at(8194, &list))
        .await
        .unwrap();
    let ids: Vec<&str> = listed
        .processes
        .iter()
        .map(|p| p.process_id.as_str())
        .collect();
    assert_eq!(ids, vec!["count"], "nothing ran under the stale grant");
    assert_eq!(listed.processes[0].state, ProcState::Running);
    let listed: ProcessListResult = served.call(Method::ProcessList, &list).await.unwrap();
    assert_eq!(listed.processes.len(), 1);
    // A token above the newest seen (its assign still on the way) passes.
    let ahead = Fenced {
        params: &list,
        fencing_token: 9999,
    };
    let _: ProcessListResult = served.call(Method::ProcessList, &ahead).await.unwrap();
    // A bad token type is -32602, not a panic.
    let e = served
        .call::<_, serde_json::Value>(
            Method::ProcessList,
            &serde_json::json!({"sessionId": sid, "fencingToken": "x"}),
        )
        .await
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidParams.code());

    // The reconnecting register carries the newest token of the session.
    served.link.close(CloseCode::GoingAway, "flap");
    let mut conn = s.next_conn().await;
    let p = conn.register_as("exec-f", "conn-b", 10_000, 30_000).await;
    let resume = p.resume.expect("resume on reconnect");
    assert_eq!(resume.active_sessions, vec![sid.to_owned()]);
    assert_eq!(resume.fencing_tokens.get(sid), Some(&8194));
    let (served, _events) = conn.serve();

    // A stop under the current grant is served: the session ends.
    let _: serde_json::Value = served
        .call(Method::SessionStop, &at(8194, &stop))
        .await
        .unwrap();
    exec.shutdown().await;
}
