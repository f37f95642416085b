//! Wire (ACP) sessions of the real visor over its socket, with the real
//! offline ACP agent (tests/peers/agent/test-agent.mjs, on the official
//! SDK): prompt → streamed chunks → result; a permission request answered;
//! `send` while busy held and delivered at the next idle; `interrupt`;
//! `stop` with no process left; `restart: resume` after a crash mid-turn.

use crate::visor_support;
use serde_json::{json, Value};
use visor_support::*;

fn of<'a>(evs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    evs.iter().filter(|e| e["type"] == kind).collect()
}

fn is_result(e: &Value) -> bool {
    e["type"] == "result"
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_streams_its_reply_and_ends_the_turn() {
    let v = Visor::start();
    let dir = tempfile::tempdir().unwrap();
    let id = v.start_wire(dir.path(), json!({"title": "agent"})).await;
    let s = v.until_state(&id, "idle").await;
    assert_eq!(s["kind"], "wire");
    assert_eq!(s["role"], "agent");
    let vendor = s["vendorId"].as_str().unwrap().to_owned();
    assert!(vendor.starts_with("ta-"), "{s}");

    let mut ws = v.ws(&format!("/v1/events?session={id}")).await;
    assert_eq!(v.send(&id, "hi").await, "prompted");
    let evs = events_until(&mut ws, "result", is_result).await;

    let init = &of(&evs, "init")[0];
    assert_eq!(init["kind"], "wire");
    let users = of(&evs, "user");
    assert_eq!(users.len(), 1);
    assert_eq!(users[0]["text"], "hi");
    // Streamed text: deltas that join into the whole message, then it.
    let deltas: String = of(&evs, "assistant")
        .iter()
        .filter(|e| e["delta"] == true)
        .map(|e| e["text"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, "Hello, you said: hi");
    let whole: Vec<_> = of(&evs, "assistant")
        .into_iter()
        .filter(|e| e["delta"] == false)
        .collect();
    assert_eq!(whole.len(), 1);
    assert_eq!(whole[0]["text"], "Hello, you said: hi");
    assert!(of(&evs, "thought")
        .iter()
        .any(|e| e["delta"] == false && e["text"] == "thinking about hi"));
    let tools = of(&evs, "tool");
    assert_eq!(tools[0]["tool"]["id"], "tc-1");
    assert_eq!(tools[0]["tool"]["name"], "read a file");
    assert_eq!(tools[0]["tool"]["status"], "pending");
    assert_eq!(tools[0]["tool"]["input"]["path"], "note.txt");
    assert_eq!(tools[1]["tool"]["status"], "completed");
    assert_eq!(tools[1]["tool"]["name"], "read a file");
    let result = evs.last().unwrap();
    assert_eq!(result["result"]["isError"], false);
    assert_eq!(result["result"]["text"], "Hello, you said: hi");
    assert_eq!(result["result"]["stopReason"], "end_turn");
    let states: Vec<&str> = of(&evs, "session_state")
        .iter()
        .map(|e| e["state"].as_str().unwrap())
        .collect();
    // Opened (idle), then the turn; the result comes before the move back
    // to idle.
    assert_eq!(states, ["idle", "running"]);
    // Seqs rise by one through the session's events.
    let seqs: Vec<u64> = evs.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");

    let s = v.until_state(&id, "idle").await;
    assert_eq!(s["turns"], 1);
    assert_eq!(s["vendorId"], vendor.as_str());

    // The chat view: the conversation, bounded, in order.
    let chat = v
        .ok("GET", &format!("/v1/sessions/{id}/screen?view=chat"), None)
        .await;
    let roles: Vec<&str> = chat["turns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["user", "assistant", "tool", "result"]);
    assert_eq!(chat["turns"][2]["tool"]["status"], "completed");
    assert_eq!(chat["turns"][3]["text"], "Hello, you said: hi");
    // A wire session has no terminal.
    let (status, e) = v
        .req(
            "POST",
            &format!("/v1/sessions/{id}/keys"),
            Some(json!({"data": "YQ=="})),
        )
        .await;
    assert_eq!((status, e["error"]["code"].as_str()), (409, Some("state")));
    let (status, _) = v
        .req(
            "GET",
            &format!("/v1/sessions/{id}/screen?view=terminal"),
            None,
        )
        .await;
    assert_eq!(status, 409);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permission_request_is_answered_and_held_input_follows() {
    let v = Visor::start();
    let dir = tempfile::tempdir().unwrap();
    let id = v.start_wire(dir.path(), json!({})).await;
    v.until_state(&id, "idle").await;
    let mut ws = v.ws(&format!("/v1/events?session={id}")).await;

    assert_eq!(v.send(&id, "permission please").await, "prompted");
    let evs = events_until(&mut ws, "request", |e| e["type"] == "request").await;
    let req = &evs.last().unwrap()["request"];
    assert_eq!(req["kind"], "permission");
    assert_eq!(req["tool"]["id"], "tc-perm");
    assert_eq!(req["input"]["path"], "out.txt");
    let rid = req["id"].as_str().unwrap().to_owned();
    let s = v.until_state(&id, "waiting").await;
    assert_eq!(s["pending"][0]["id"], rid.as_str());
    let chat = v
        .ok("GET", &format!("/v1/sessions/{id}/screen"), None)
        .await;
    assert_eq!(chat["pending"][0]["id"], rid.as_str());

    // Input while the turn waits: held, not lost.
    assert_eq!(v.send(&id, "second").await, "held");

    let answer = format!("/v1/sessions/{id}/answer");
    let (status, e) = v
        .req(
            "POST",
            &answer,
            Some(json!({"requestId": "r-999", "allow": true})),
        )
        .await;
    assert_eq!(
        (status, e["error"]["code"].as_str()),
        (404, Some("not_found"))
    );
    let (status, _) = v.req("POST", &answer, Some(json!({"allow": true}))).await;
    assert_eq!(status, 400);
    v.ok(
        "POST",
        &answer,
        Some(json!({"requestId": rid, "allow": true})),
    )
    .await;
    let (status, e) = v
        .req(
            "POST",
            &answer,
            Some(json!({"requestId": rid, "allow": true})),
        )
        .await;
    assert_eq!((status, e["error"]["code"].as_str()), (409, Some("state")));

    // The agent goes on: allowed, its tool completed, the turn ends…
    let evs = events_until(&mut ws, "first result", is_result).await;
    let closed = &of(&evs, "request_closed")[0];
    assert_eq!(closed["requestId"], rid.as_str());
    assert_eq!(closed["allow"], true);
    assert!(of(&evs, "tool")
        .iter()
        .any(|t| t["tool"]["id"] == "tc-perm" && t["tool"]["status"] == "completed"));
    assert_eq!(evs.last().unwrap()["result"]["text"], "allowed");
    // …and the held message is the next turn.
    let evs = events_until(&mut ws, "second result", is_result).await;
    assert_eq!(of(&evs, "user")[0]["text"], "second");
    assert_eq!(
        evs.last().unwrap()["result"]["text"],
        "Hello, you said: second"
    );

    // A denial reaches the agent too.
    v.until_state(&id, "idle").await;
    assert_eq!(v.send(&id, "permission again").await, "prompted");
    let evs = events_until(&mut ws, "request", |e| e["type"] == "request").await;
    let rid = evs.last().unwrap()["request"]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    v.ok(
        "POST",
        &answer,
        Some(json!({"requestId": rid, "allow": false})),
    )
    .await;
    let evs = events_until(&mut ws, "denied", is_result).await;
    assert_eq!(evs.last().unwrap()["result"]["text"], "denied");
    let s = v.until_state(&id, "idle").await;
    assert_eq!(s["turns"], 3);
    assert_eq!(s["pending"], json!([]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interrupt_cancels_the_turn() {
    let v = Visor::start();
    let dir = tempfile::tempdir().unwrap();
    let id = v.start_wire(dir.path(), json!({})).await;
    v.until_state(&id, "idle").await;
    let interrupt = format!("/v1/sessions/{id}/interrupt");
    let (status, _) = v.req("POST", &interrupt, None).await;
    assert_eq!(status, 409, "no turn to interrupt");

    let mut ws = v.ws(&format!("/v1/events?session={id}")).await;
    assert_eq!(v.send(&id, "slow").await, "prompted");
    events_until(&mut ws, "a tick", |e| {
        e["type"] == "assistant" && e["text"].as_str().is_some_and(|t| t.contains("tick"))
    })
    .await;
    v.ok("POST", &interrupt, None).await;
    let evs = events_until(&mut ws, "result", is_result).await;
    assert_eq!(evs.last().unwrap()["result"]["stopReason"], "cancelled");
    v.until_state(&id, "idle").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_leaves_no_process_and_is_final() {
    let v = Visor::start();
    let dir = tempfile::tempdir().unwrap();
    let id = v.start_wire(dir.path(), json!({})).await;
    v.until_state(&id, "idle").await;
    assert!(!session_pids(&id).is_empty(), "the agent runs");
    assert_eq!(v.send(&id, "slow").await, "prompted");
    v.until_state(&id, "running").await;
    let s = v.ok("POST", &format!("/v1/sessions/{id}/stop"), None).await;
    assert_eq!(s["state"], "exited");
    eventually("no process of the session", || session_pids(&id).is_empty()).await;
    let (status, _) = v
        .req("POST", &format!("/v1/sessions/{id}/stop"), None)
        .await;
    assert_eq!(status, 409);
    let (status, _) = v
        .req(
            "POST",
            &format!("/v1/sessions/{id}/send"),
            Some(json!({"text": "x"})),
        )
        .await;
    assert_eq!(status, 409);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_without_restart_ends_the_session() {
    let v = Visor::start();
    let dir = tempfile::tempdir().unwrap();
    let id = v.start_wire(dir.path(), json!({"prompt": "crash"})).await;
    let s = v.until_state(&id, "exited").await;
    assert_eq!(s["exitCode"], 3, "{s}");
    assert!(s["error"].as_str().is_some(), "{s}");
    assert_eq!(s["turns"], 1, "the spec's prompt is the first turn");
    let chat = v
        .ok("GET", &format!("/v1/sessions/{id}/screen"), None)
        .await;
    let last = chat["turns"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["role"], "result");
    eventually("no process of the session", || session_pids(&id).is_empty()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_after_a_crash_loads_the_same_vendor_session() {
    let v = Visor::start();
    let dir = tempfile::tempdir().unwrap();
    let id = v
        .start_wire(
            dir.path(),
            json!({"restart": {"mode": "resume", "prompt": "history"}}),
        )
        .await;
    let s = v.until_state(&id, "idle").await;
    let vendor = s["vendorId"].as_str().unwrap().to_owned();
    let mut ws = v.ws(&format!("/v1/events?session={id}")).await;
    v.send(&id, "hello").await;
    events_until(&mut ws, "first result", is_result).await;

    // Crash mid-turn: the turn fails, the run is lost, a new one resumes.
    v.until_state(&id, "idle").await;
    assert_eq!(v.send(&id, "crash").await, "prompted");
    // Held while the doomed turn runs: delivered by the next run.
    assert_eq!(v.send(&id, "after").await, "held");
    let evs = events_until(&mut ws, "restarting", |e| e["type"] == "restarting").await;
    assert!(of(&evs, "assistant")
        .iter()
        .any(|e| e["text"] == "about to crash"));
    assert_eq!(
        evs.iter().rfind(|e| is_result(e)).unwrap()["result"]["isError"],
        true
    );
    assert_eq!(of(&evs, "exit")[0]["exitCode"], 3);
    assert!(of(&evs, "session_state")
        .iter()
        .any(|e| e["state"] == "lost"));

    // The restart prompt runs in the loaded session: the agent counts the
    // prompts of the session before the crash (hello, crash) and this one.
    let evs = events_until(&mut ws, "restart prompt", is_result).await;
    assert_eq!(of(&evs, "user")[0]["text"], "history");
    assert_eq!(evs.last().unwrap()["result"]["text"], "prompts so far: 3");
    let evs = events_until(&mut ws, "held prompt", is_result).await;
    assert_eq!(of(&evs, "user")[0]["text"], "after");
    assert_eq!(
        evs.last().unwrap()["result"]["text"],
        "Hello, you said: after"
    );
    let s = v.until_state(&id, "idle").await;
    assert_eq!(s["vendorId"], vendor.as_str());
    assert_eq!(s["restarts"], 1);
    assert_eq!(s["turns"], 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wire_specs_are_checked() {
    let v = Visor::start();
    let dir = tempfile::tempdir().unwrap();
    let (status, e) = v
        .req(
            "POST",
            "/v1/sessions",
            Some(json!({"kind": "pty", "command": ["sh"], "restart": {"mode": "resume"}})),
        )
        .await;
    assert_eq!(
        (status, e["error"]["code"].as_str()),
        (400, Some("invalid"))
    );
    let (status, _) = v
        .req(
            "POST",
            "/v1/sessions",
            Some(json!({"kind": "wire", "command": ["/nonexistent/agent"], "workingDir": dir.path()})),
        )
        .await;
    assert_eq!(status, 400);
    // A resume id the agent does not know: a new session, said so.
    let id = v
        .start_wire(dir.path(), json!({"resumeId": "ta-unknown"}))
        .await;
    let s = v.until_state(&id, "idle").await;
    assert_ne!(s["vendorId"], "ta-unknown");
    let mut ws = v.ws(&format!("/v1/events?session={id}&types=error")).await;
    let e = next_json(&mut ws).await;
    assert!(e["error"].as_str().unwrap().contains("ta-unknown"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chat_view_streams_turns_and_takes_send_from_the_writer() {
    let v = Visor::start();
    let dir = tempfile::tempdir().unwrap();
    let id = v.start_wire(dir.path(), json!({})).await;
    v.until_state(&id, "idle").await;
    let mut a = v.ws(&format!("/v1/sessions/{id}/attach?view=chat")).await;
    let mut b = v.ws(&format!("/v1/sessions/{id}/attach?view=chat")).await;
    let att = next_json(&mut a).await;
    assert_eq!(
        (att["type"].as_str(), att["view"].as_str()),
        (Some("attached"), Some("chat"))
    );
    assert_eq!(next_json(&mut a).await["turns"], json!([]));
    next_json(&mut b).await;
    next_json(&mut b).await;

    // Input only from the lease holder.
    send_json(&mut b, json!({"type": "send", "text": "from b"})).await;
    let e = next_json(&mut b).await;
    assert_eq!(e["code"], "not_writer", "{e}");
    send_json(&mut a, json!({"type": "control"})).await;
    let mut out = Vec::new();
    until_json(&mut a, &mut out, "lease you", |f| {
        f["type"] == "lease" && f["holder"] == "you"
    })
    .await;
    send_json(&mut a, json!({"type": "send", "text": "from a"})).await;
    let sent = until_json(&mut a, &mut out, "sent", |f| f["type"] == "sent").await;
    assert_eq!(sent["delivery"], "prompted");

    // Both views see the turn's turns as they come, ending with the result.
    for ws in [&mut a, &mut b] {
        let mut roles = Vec::new();
        let mut last = Value::Null;
        while !roles.contains(&"result".to_owned()) {
            let f = until_json(ws, &mut out, "turns", |f| f["type"] == "turns").await;
            for t in f["turns"].as_array().unwrap() {
                roles.push(t["role"].as_str().unwrap().to_owned());
                last = t.clone();
            }
        }
        assert_eq!(roles, ["user", "assistant", "tool", "result"]);
        assert_eq!(last["text"], "Hello, you said: from a");
    }
    // A terminal view of a wire session does not exist.
    let (status, _) = v
        .req(
            "GET",
            &format!("/v1/sessions/{id}/attach?view=terminal"),
            None,
        )
        .await;
    assert_eq!(status, 400);
}
