//! Agents (`<home>/agents.toml`) of the real visor over its socket:
//! `GET /v1/agents`, a session started by agent name (the real ACP test
//! agent), unknown agents refused, a malformed file refused with its line.

use crate::visor_support;
use serde_json::json;
use visor_support::*;

fn recipe(name: &str) -> String {
    let argv = agent_argv();
    format!(
        "[agents.{name}]\nbinary = {:?}\nargs = [{:?}]\nkind = \"wire\"\nenv = {{ TEST_AGENT_LOG = \"0\" }}\ncapabilities = {{ permissions = true, resume = true }}\n",
        argv[0], argv[1]
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_are_listed_and_started_by_name() {
    let v = Visor::start();
    // No file: no agents (no built-in recipes).
    let a = v.ok("GET", "/v1/agents", None).await;
    assert_eq!(a["agents"], json!([]));

    std::fs::write(
        v.home.path().join("agents.toml"),
        format!(
            "{}\n[agents.ghost]\nbinary = \"/nonexistent/bin/ghost\"\nkind = \"pty\"\n",
            recipe("test")
        ),
    )
    .unwrap();
    let a = v.ok("GET", "/v1/agents", None).await;
    let list = a["agents"].as_array().unwrap();
    assert_eq!(list.len(), 2);
    let ghost = list.iter().find(|a| a["name"] == "ghost").unwrap();
    assert_eq!(ghost["found"], false);
    assert_eq!(ghost["kind"], "pty");
    let test = v.ok("GET", "/v1/agents/test", None).await;
    assert_eq!(test["found"], true, "{test}");
    assert_eq!(test["kind"], "wire");
    assert_eq!(test["capabilities"]["resume"], true);
    assert_eq!(test["env"], json!(["TEST_AGENT_LOG"]), "names, not values");
    assert!(
        test["version"].as_str().is_some_and(|s| s.starts_with('v')),
        "node --version: {test}"
    );
    let (status, e) = v.req("GET", "/v1/agents/nope", None).await;
    assert_eq!(
        (status, e["error"]["code"].as_str()),
        (404, Some("not_found"))
    );

    // A session by agent name.
    let dir = tempfile::tempdir().unwrap();
    let s = v
        .ok(
            "POST",
            "/v1/sessions",
            Some(json!({"kind": "wire", "agent": "test", "workingDir": dir.path(), "prompt": "by name"})),
        )
        .await;
    let id = s["id"].as_str().unwrap().to_owned();
    assert_eq!(s["agent"], "test");
    let s = v
        .until(&format!("/v1/sessions/{id}"), "one turn done", |s| {
            s["state"] == "idle" && s["turns"] == 1
        })
        .await;
    assert_eq!(s["agent"], "test");
    let listed = v.ok("GET", "/v1/sessions?agent=test", None).await;
    assert_eq!(listed["sessions"].as_array().unwrap().len(), 1);
    let chat = v
        .ok("GET", &format!("/v1/sessions/{id}/screen"), None)
        .await;
    let last = chat["turns"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["text"], "Hello, you said: by name");

    // Unknown agents, a kind that does not match the recipe, both named.
    let (status, e) = v
        .req(
            "POST",
            "/v1/sessions",
            Some(json!({"kind": "wire", "agent": "nope"})),
        )
        .await;
    assert_eq!(
        (status, e["error"]["code"].as_str()),
        (400, Some("invalid"))
    );
    assert!(e["error"]["message"].as_str().unwrap().contains("nope"));
    let (status, _) = v
        .req(
            "POST",
            "/v1/sessions",
            Some(json!({"kind": "pty", "agent": "test"})),
        )
        .await;
    assert_eq!(status, 400);
    let (status, _) = v
        .req(
            "POST",
            "/v1/sessions",
            Some(json!({"kind": "wire", "agent": "test", "command": ["x"]})),
        )
        .await;
    assert_eq!(status, 400);
    v.ok("POST", &format!("/v1/sessions/{id}/stop"), None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_agents_toml_is_refused_with_its_line() {
    let v = Visor::start();
    let file = v.home.path().join("agents.toml");
    std::fs::write(
        &file,
        format!(
            "{}\n[agents.bad]\nbinary = \"x\"\nkind = \"wire\"\nsteer = true\n",
            recipe("test")
        ),
    )
    .unwrap();
    let line = std::fs::read_to_string(&file)
        .unwrap()
        .lines()
        .position(|l| l.starts_with("steer"))
        .unwrap()
        + 1;
    for (method, path, body) in [
        ("GET", "/v1/agents", None),
        ("GET", "/v1/agents/test", None),
        (
            "POST",
            "/v1/sessions",
            Some(json!({"kind": "wire", "agent": "test"})),
        ),
    ] {
        let (status, e) = v.req(method, path, body).await;
        assert_eq!(
            (status, e["error"]["code"].as_str()),
            (400, Some("invalid")),
            "{path}"
        );
        let m = e["error"]["message"].as_str().unwrap();
        assert!(
            m.contains("agents.toml") && m.contains(&format!("line {line}")),
            "{m}"
        );
    }
    // Not TOML at all.
    std::fs::write(&file, "[agents.x\nbinary = 1\n").unwrap();
    let (status, e) = v.req("GET", "/v1/agents", None).await;
    assert_eq!(status, 400);
    assert!(
        e["error"]["message"].as_str().unwrap().contains("line 1"),
        "{e}"
    );
    // Too big to read.
    std::fs::write(&file, "#".repeat(300 << 10)).unwrap();
    let (status, _) = v.req("GET", "/v1/agents", None).await;
    assert_eq!(status, 400);
}
