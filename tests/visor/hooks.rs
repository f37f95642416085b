//! Hooks and observed sessions (VISOR.md §6), through the real `bmx visor
//! hook` CLI: a hook posted live opens an observed session and a `hook`
//! event; hooks posted while the visor is down are spooled and replayed
//! once, in order, at its next start.

use crate::visor_support;
use serde_json::{json, Value};
use visor_support::*;

fn hook(v: &Visor, payload: Value, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["hook", "--agent", "claude"];
    args.extend_from_slice(extra);
    cli(v.home.path(), &args, &payload.to_string())
}

async fn observed(v: &Visor) -> Vec<Value> {
    let l = v.ok("GET", "/v1/sessions?kind=observed", None).await;
    l["sessions"].as_array().unwrap().clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_hook_opens_an_observed_session_with_hook_events() {
    let v = Visor::start();
    let cwd = tempfile::tempdir().unwrap();
    let first = json!({"session_id": "vendor-1", "hook_event_name": "UserPromptSubmit",
        "prompt": "hello", "cwd": cwd.path()});
    let out = hook(&v, first, &["--label", "team=a"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.stdout.is_empty(), "a hook prints nothing on success");
    let list = observed(&v).await;
    assert_eq!(list.len(), 1, "{list:?}");
    let s = &list[0];
    let id = s["id"].as_str().unwrap().to_owned();
    assert_eq!(
        (&s["kind"], &s["agent"], &s["vendorId"], &s["state"]),
        (
            &json!("observed"),
            &json!("claude"),
            &json!("vendor-1"),
            &json!("running")
        )
    );
    assert_eq!(s["labels"], json!({"team": "a"}));
    assert_eq!(s["workingDir"], cwd.path().display().to_string());
    assert!(s["pid"].is_null());
    assert_eq!(s["turns"], 1);

    // The same vendor session: the same observed session.
    let out = hook(
        &v,
        json!({"session_id": "vendor-1", "hook_event_name": "Stop"}),
        &[],
    );
    assert!(out.status.success());
    let list = observed(&v).await;
    assert_eq!((list.len(), &list[0]["state"]), (1, &json!("idle")));

    let mut ws = v.ws(&format!("/v1/events?session={id}")).await;
    let seen = events_until(&mut ws, "the Stop hook", |e| {
        e["type"] == "hook" && e["hookEvent"] == "Stop"
    })
    .await;
    let types: Vec<&str> = seen.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(types[0], "init", "{seen:?}");
    let hooks: Vec<&Value> = seen.iter().filter(|e| e["type"] == "hook").collect();
    assert_eq!(hooks.len(), 2);
    assert_eq!(hooks[0]["payload"]["prompt"], "hello");
    assert_eq!(hooks[0]["vendorId"], "vendor-1");
    assert!(hooks[0].get("replayed").is_none());
    assert!(seen
        .iter()
        .any(|e| e["type"] == "session_state" && e["state"] == "running"));

    // No process: stop, keys, send are refused, clearly.
    for (route, body) in [
        ("stop", None),
        ("keys", Some(json!({"data": "YQ=="}))),
        ("send", Some(json!({"text": "x"}))),
        ("interrupt", None),
    ] {
        let (st, e) = v
            .req("POST", &format!("/v1/sessions/{id}/{route}"), body)
            .await;
        assert_eq!(
            (st, e["error"]["code"].as_str()),
            (409, Some("state")),
            "{route}: {e}"
        );
        assert!(
            e["error"]["message"].as_str().unwrap().contains("observed"),
            "{e}"
        );
    }

    // SessionEnd ends it; then it can be purged.
    let end = json!({"session_id": "vendor-1", "hook_event_name": "SessionEnd"});
    assert!(hook(&v, end, &[]).status.success());
    v.until_state(&id, "exited").await;
    let p = v
        .ok("POST", "/v1/purge", Some(json!({"session": id})))
        .await;
    assert_eq!(p["purged"], json!([id]));

    // Bad calls: typed errors, nothing opened.
    let out = hook(&v, json!({"hook_event_name": "Stop"}), &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("session"));
    let out = cli(v.home.path(), &["hook", "--agent", "claude"], "not json");
    assert_eq!(out.status.code(), Some(1));
    for body in [
        json!({}),
        json!({"agent": "claude", "session": "", "payload": {}}),
        json!({"agent": "no such", "session": "s", "payload": {}}),
        json!({"agent": "claude", "session": "s", "payload": {}, "extra": 1}),
    ] {
        let (st, e) = v.req("POST", "/v1/hook", Some(body.clone())).await;
        assert_eq!(
            (st, e["error"]["code"].as_str()),
            (400, Some("invalid")),
            "{body}: {e}"
        );
    }
    assert!(observed(&v).await.is_empty());
    assert!(
        !v.home.path().join("hooks/spool").exists(),
        "nothing was spooled"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hooks_while_the_visor_is_down_are_spooled_and_replayed_once_in_order() {
    let mut v = Visor::start();
    let _ = v.stop();
    let spool = v.home.path().join("hooks/spool");
    for (event, prompt) in [("SessionStart", ""), ("UserPromptSubmit", "second")] {
        let p = json!({"session_id": "vendor-2", "hook_event_name": event, "prompt": prompt});
        let out = hook(&v, p, &[]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(String::from_utf8_lossy(&out.stderr).contains("spooled"));
    }
    // Concurrent hooks do not interleave their lines.
    let home = v.home.path().to_owned();
    let many: Vec<_> = (0..6)
        .map(|i| {
            let home = home.clone();
            std::thread::spawn(move || {
                let p = json!({"session_id": format!("other-{i}"), "hook_event_name": "SessionStart",
                    "pad": "x".repeat(20_000)});
                cli(&home, &["hook", "--agent", "claude"], &p.to_string())
            })
        })
        .collect();
    for t in many {
        assert!(t.join().unwrap().status.success());
    }
    let text = std::fs::read_to_string(&spool).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("one whole call per line"))
        .collect();
    assert_eq!(lines.len(), 8);
    assert_eq!(lines[0]["payload"]["hook_event_name"], "SessionStart");
    assert_eq!(lines[1]["payload"]["hook_event_name"], "UserPromptSubmit");

    // The next visor replays them, in order, before it serves.
    v.restart();
    let list = observed(&v).await;
    assert_eq!(list.len(), 7, "{list:?}");
    let s = list.iter().find(|s| s["vendorId"] == "vendor-2").unwrap();
    assert_eq!(s["state"], "running");
    let mut ws = v.ws("/v1/events?types=hook").await;
    let seen = events_until(&mut ws, "the replayed hooks", |e| {
        e["hookEvent"] == "UserPromptSubmit"
    })
    .await;
    let mine: Vec<&Value> = seen
        .iter()
        .filter(|e| e["vendorId"] == "vendor-2")
        .collect();
    assert_eq!(mine.len(), 2, "{seen:?}");
    assert_eq!(mine[0]["hookEvent"], "SessionStart");
    assert_eq!(mine[1]["payload"]["prompt"], "second");
    assert!(mine.iter().all(|e| e["replayed"].as_bool() == Some(true)));
    assert!(mine[0]["seq"].as_u64() < mine[1]["seq"].as_u64());
    assert_eq!(
        std::fs::metadata(&spool).unwrap().len(),
        0,
        "the spool was taken"
    );

    // A live hook after the replay goes to the same observed session.
    let p = json!({"session_id": "vendor-2", "hook_event_name": "Stop"});
    assert!(hook(&v, p, &[]).status.success());
    let list = observed(&v).await;
    assert_eq!(list.len(), 7);

    // Another restart replays nothing again.
    v.restart();
    assert!(observed(&v).await.is_empty());
}
