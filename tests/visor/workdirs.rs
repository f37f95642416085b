//! Workdirs and projects (VISOR.md §5) on real git repositories: a
//! worktree made, used by a session, refused removal while live,
//! archived (its folder gone, its branch kept), restored; uncommitted
//! changes; idempotency; bad projects; the registry across a restart; the
//! CLI.

use crate::visor_support;
use serde_json::{json, Value};
use std::path::PathBuf;
use visor_support::*;

fn code(e: &Value) -> &str {
    e["error"]["code"].as_str().unwrap_or("")
}

fn canon(p: &std::path::Path) -> String {
    std::fs::canonicalize(p).unwrap().display().to_string()
}

async fn create(v: &Visor, body: Value) -> Value {
    let (st, w) = v.req("POST", "/v1/workdirs", Some(body)).await;
    assert_eq!(st, 201, "{w}");
    w
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worktree_is_used_refused_removal_while_live_archived_and_restored() {
    let v = Visor::start();
    let repo = repo();
    let project = repo.path().display().to_string();
    let spec = json!({"project": project, "kind": "worktree", "name": "feat"});
    let w = create(&v, spec.clone()).await;
    let id = w["id"].as_str().unwrap().to_owned();
    let path = PathBuf::from(w["path"].as_str().unwrap());
    assert_eq!(
        (&w["kind"], &w["state"], &w["branch"]),
        (&json!("worktree"), &json!("active"), &json!("bmx/feat"))
    );
    assert_eq!(w["project"], canon(repo.path()));
    assert!(path.starts_with(v.home.path().canonicalize().unwrap()));
    assert!(path.join("README").is_file(), "the worktree is checked out");
    let list = git(repo.path(), &["worktree", "list", "--porcelain"]);
    assert!(list.contains("branch refs/heads/bmx/feat"), "{list}");

    // Idempotent by project + kind + name: the same workdir, 200.
    let (st, again) = v.req("POST", "/v1/workdirs", Some(spec)).await;
    assert_eq!((st, &again["id"]), (200, &json!(id)), "{again}");

    // A session in it.
    let s = v
        .ok(
            "POST",
            "/v1/sessions",
            Some(json!({"kind": "pty", "command": ["sh", "-c", "pwd; exec sleep 600"], "workdir": id})),
        )
        .await;
    let sid = s["id"].as_str().unwrap().to_owned();
    assert_eq!(s["workdir"], id);
    assert_eq!(s["workingDir"], path.display().to_string());
    let want = path.display().to_string();
    v.until(&format!("/v1/sessions/{sid}/output"), "pwd", |o| {
        o["text"].as_str().is_some_and(|t| t.contains(&want))
    })
    .await;
    let by_workdir = v
        .ok("GET", &format!("/v1/sessions?workdir={id}"), None)
        .await;
    assert_eq!(by_workdir["sessions"].as_array().unwrap().len(), 1);

    // Refused while the session lives: delete and archive.
    for (method, route) in [
        ("DELETE", format!("/v1/workdirs/{id}")),
        ("POST", format!("/v1/workdirs/{id}/archive")),
    ] {
        let (st, e) = v.req(method, &route, None).await;
        assert_eq!((st, code(&e)), (409, "state"), "{method} {route}: {e}");
        assert!(
            e["error"]["message"].as_str().unwrap().contains(&sid),
            "{e}"
        );
    }
    assert!(path.join("README").is_file());

    // Stopped: archived, the folder gone, the branch kept.
    v.ok("POST", &format!("/v1/sessions/{sid}/stop"), None)
        .await;
    let a = v
        .ok("POST", &format!("/v1/workdirs/{id}/archive"), None)
        .await;
    assert_eq!(a["state"], "archived");
    assert!(!path.exists(), "the worktree's folder is removed");
    git(
        repo.path(),
        &["rev-parse", "--verify", "refs/heads/bmx/feat"],
    );
    let (st, e) = v
        .req("POST", &format!("/v1/workdirs/{id}/archive"), None)
        .await;
    assert_eq!((st, code(&e)), (409, "state"));
    // No session starts in an archived workdir.
    let (st, e) = v
        .req(
            "POST",
            "/v1/sessions",
            Some(json!({"kind": "pty", "command": ["true"], "workdir": id})),
        )
        .await;
    assert_eq!((st, code(&e)), (409, "state"), "{e}");

    // Restored on its branch.
    let r = v
        .ok("POST", &format!("/v1/workdirs/{id}/restore"), None)
        .await;
    assert_eq!(r["state"], "active");
    assert!(path.join("README").is_file());
    let head = git(&path, &["symbolic-ref", "--short", "HEAD"]);
    assert_eq!(head.trim(), "bmx/feat");
    let (st, _) = v
        .req("POST", &format!("/v1/workdirs/{id}/restore"), None)
        .await;
    assert_eq!(st, 409);

    let list = v.ok("GET", "/v1/workdirs", None).await;
    assert!(list["workdirs"]
        .as_array()
        .unwrap()
        .iter()
        .any(|w| w["id"] == id));
    let projects = v.ok("GET", "/v1/projects", None).await;
    let p = &projects["projects"][0];
    assert_eq!(
        (&p["path"], &p["workdirs"]),
        (&json!(canon(repo.path())), &json!(1))
    );

    // Removed: the folder goes, the branch stays.
    v.ok("DELETE", &format!("/v1/workdirs/{id}"), None).await;
    assert!(!path.exists());
    git(
        repo.path(),
        &["rev-parse", "--verify", "refs/heads/bmx/feat"],
    );
    let (st, _) = v.req("GET", &format!("/v1/workdirs/{id}"), None).await;
    assert_eq!(st, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uncommitted_changes_refuse_removal_unless_forced() {
    let v = Visor::start();
    let repo = repo();
    let w = create(
        &v,
        json!({"project": repo.path(), "kind": "worktree", "name": "dirty", "branch": "work/dirty"}),
    )
    .await;
    assert_eq!(w["branch"], "work/dirty");
    let id = w["id"].as_str().unwrap().to_owned();
    let path = PathBuf::from(w["path"].as_str().unwrap());
    std::fs::write(path.join("new.txt"), "not committed\n").unwrap();
    for (method, route) in [
        ("DELETE", format!("/v1/workdirs/{id}")),
        ("POST", format!("/v1/workdirs/{id}/archive")),
        ("DELETE", format!("/v1/workdirs/{id}?force=false")),
    ] {
        let (st, e) = v.req(method, &route, None).await;
        assert_eq!((st, code(&e)), (409, "state"), "{method} {route}: {e}");
        assert!(
            e["error"]["message"]
                .as_str()
                .unwrap()
                .contains("uncommitted"),
            "{e}"
        );
    }
    assert!(path.join("new.txt").is_file(), "nothing was removed");
    let (st, e) = v
        .req("DELETE", &format!("/v1/workdirs/{id}?force=maybe"), None)
        .await;
    assert_eq!((st, code(&e)), (400, "invalid"));
    // Committed, it goes without force.
    git(&path, &["add", "new.txt"]);
    git(&path, &["commit", "-q", "-m", "work"]);
    let a = v
        .ok("POST", &format!("/v1/workdirs/{id}/archive"), None)
        .await;
    assert_eq!(a["state"], "archived");
    v.ok("POST", &format!("/v1/workdirs/{id}/restore"), None)
        .await;
    std::fs::write(path.join("README"), "changed\n").unwrap();
    let (st, _) = v.req("DELETE", &format!("/v1/workdirs/{id}"), None).await;
    assert_eq!(st, 409);
    let gone = v
        .ok("DELETE", &format!("/v1/workdirs/{id}?force=true"), None)
        .await;
    assert_eq!(gone["removed"]["id"], id);
    assert!(!path.exists());
    // The commit made in the worktree is kept on its branch.
    let log = git(repo.path(), &["log", "--format=%s", "work/dirty"]);
    assert!(log.contains("work"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn folder_and_main_workdirs_and_bad_projects() {
    let v = Visor::start();
    let repo = repo();
    let plain = tempfile::tempdir().unwrap();
    let f = create(&v, json!({"project": plain.path(), "kind": "folder"})).await;
    assert_eq!(f["path"], canon(plain.path()));
    assert!(f.get("branch").is_none());
    let m = create(&v, json!({"project": repo.path(), "kind": "main"})).await;
    assert_eq!(
        (&m["path"], &m["branch"]),
        (&json!(canon(repo.path())), &json!("main"))
    );
    // The main workdir of a linked worktree's folder is the main one.
    let w = create(&v, json!({"project": repo.path(), "kind": "worktree"})).await;
    assert!(w["name"].as_str().unwrap().starts_with("wt-"));
    let m2 = create(
        &v,
        json!({"project": w["path"], "kind": "main", "name": "via-wt"}),
    )
    .await;
    assert_eq!(m2["path"], canon(repo.path()));
    // Without a name, each worktree is a new one.
    let w2 = create(&v, json!({"project": repo.path(), "kind": "worktree"})).await;
    assert_ne!(w["id"], w2["id"]);
    // A folder workdir's archive touches no file.
    v.ok(
        "POST",
        &format!("/v1/workdirs/{}/archive", f["id"].as_str().unwrap()),
        None,
    )
    .await;
    assert!(plain.path().is_dir());

    let file = plain.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    let not_git = tempfile::tempdir().unwrap();
    for (body, needle) in [
        (
            json!({"project": "/no/such/dir", "kind": "folder"}),
            "not a directory",
        ),
        (
            json!({"project": file, "kind": "folder"}),
            "not a directory",
        ),
        (
            json!({"project": "relative/dir", "kind": "folder"}),
            "absolute",
        ),
        (
            json!({"project": not_git.path(), "kind": "worktree", "name": "x"}),
            "git",
        ),
        (json!({"project": not_git.path(), "kind": "main"}), "git"),
        (
            json!({"project": repo.path(), "kind": "worktree", "name": "../x"}),
            "name",
        ),
        (
            json!({"project": repo.path(), "kind": "folder", "branch": "b"}),
            "branch",
        ),
        (
            json!({"project": repo.path(), "kind": "worktree", "name": "y", "branch": "-x"}),
            "branch",
        ),
        (json!({"project": repo.path(), "kind": "tree"}), "variant"),
        (
            json!({"project": repo.path(), "kind": "folder", "bogus": 1}),
            "bogus",
        ),
        (json!({"kind": "folder"}), "project"),
    ] {
        let (st, e) = v.req("POST", "/v1/workdirs", Some(body.clone())).await;
        assert_eq!((st, code(&e)), (400, "invalid"), "{body}: {e}");
        assert!(
            e["error"]["message"].as_str().unwrap().contains(needle),
            "{body}: {e}"
        );
    }
    assert!(
        std::fs::read_dir(not_git.path()).unwrap().next().is_none(),
        "nothing was made in the non-git folder"
    );
    for (method, path, status) in [
        ("GET", "/v1/workdirs/w-nope", 404),
        ("POST", "/v1/workdirs/w-nope/archive", 404),
        ("POST", "/v1/workdirs/w-nope/restore", 404),
        ("DELETE", "/v1/workdirs/w-nope", 404),
        ("DELETE", "/v1/projects/p-nope", 404),
    ] {
        let (st, e) = v.req(method, path, None).await;
        assert_eq!(st, status, "{method} {path}: {e}");
    }
    let (st, e) = v
        .req(
            "POST",
            "/v1/sessions",
            Some(json!({"kind": "pty", "command": ["true"], "workdir": "w-nope"})),
        )
        .await;
    assert_eq!((st, code(&e)), (400, "invalid"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_registry_survives_a_restart_and_projects_are_forgotten() {
    let mut v = Visor::start();
    let repo = repo();
    let w = create(
        &v,
        json!({"project": repo.path(), "kind": "worktree", "name": "keep"}),
    )
    .await;
    let id = w["id"].as_str().unwrap().to_owned();
    let path = PathBuf::from(w["path"].as_str().unwrap());
    let a = v
        .ok("POST", &format!("/v1/workdirs/{id}/archive"), None)
        .await;
    let before = v.ok("GET", "/v1/workdirs", None).await;
    let projects = v.ok("GET", "/v1/projects", None).await;
    v.restart();
    let after = v.ok("GET", "/v1/workdirs", None).await;
    assert_eq!(after, before);
    assert_eq!(after["workdirs"][0], a);
    assert_eq!(v.ok("GET", "/v1/projects", None).await, projects);
    // Still a working record: restored after the restart.
    v.ok("POST", &format!("/v1/workdirs/{id}/restore"), None)
        .await;
    assert!(path.join("README").is_file());

    // Forgotten: the records go, the files stay.
    let pid = projects["projects"][0]["id"].as_str().unwrap().to_owned();
    let f = v.ok("DELETE", &format!("/v1/projects/{pid}"), None).await;
    assert_eq!(f["workdirs"], json!([id]));
    assert!(path.join("README").is_file(), "files untouched");
    assert_eq!(
        v.ok("GET", "/v1/workdirs", None).await["workdirs"],
        json!([])
    );
    assert_eq!(
        v.ok("GET", "/v1/projects", None).await["projects"],
        json!([])
    );
    v.restart();
    assert_eq!(
        v.ok("GET", "/v1/workdirs", None).await["workdirs"],
        json!([])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workdir_cli() {
    let v = Visor::start();
    let repo = repo();
    let home = v.home.path();
    let project = repo.path().display().to_string();
    let out = cli(
        home,
        &[
            "--json",
            "workdir",
            "create",
            "--project",
            &project,
            "--name",
            "cli",
        ],
        "",
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let env: Value = serde_json::from_slice(&out.stdout).unwrap();
    let w = &env["data"];
    let id = w["id"].as_str().unwrap().to_owned();
    assert_eq!(w["branch"], "bmx/cli");
    let out = cli(home, &["workdir", "ls"], "");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(text.lines().next().unwrap().starts_with("ID"), "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with(&id) && l.contains("active") && l.contains("bmx/cli")),
        "{text}"
    );
    let out = cli(home, &["workdir", "archive", &id], "");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("archived"));
    let out = cli(home, &["workdir", "restore", &id], "");
    assert!(out.status.success());
    let path = PathBuf::from(w["path"].as_str().unwrap());
    // A session started in it from the CLI holds it.
    let out = cli(home, &["start", "--workdir", &id, "--", "sleep", "600"], "");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let sid = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let s = v.session(&sid).await;
    assert_eq!((&s["workdir"], &s["workingDir"]), (&json!(id), &w["path"]));
    let out = cli(home, &["workdir", "rm", &id], "");
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains(&sid));
    assert!(cli(home, &["stop", &sid], "").status.success());
    std::fs::write(path.join("scratch"), "x").unwrap();
    let out = cli(home, &["workdir", "rm", &id], "");
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("uncommitted"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = cli(home, &["workdir", "rm", "--force", &id], "");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("removed"));
    assert!(!path.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observed_session_in_a_workdir_holds_it_and_its_project() {
    let v = Visor::start();
    let repo = repo();
    let w = create(
        &v,
        json!({"project": repo.path(), "kind": "worktree", "name": "obs"}),
    )
    .await;
    let id = w["id"].as_str().unwrap().to_owned();
    let sub = PathBuf::from(w["path"].as_str().unwrap()).join("src");
    std::fs::create_dir(&sub).unwrap();
    let call = |event: &str| {
        json!({"agent": "claude", "session": "obs-1",
            "payload": {"session_id": "obs-1", "hook_event_name": event, "cwd": sub}})
    };
    let s = v.ok("POST", "/v1/hook", Some(call("SessionStart"))).await;
    assert_eq!(
        (&s["kind"], &s["workdir"]),
        (&json!("observed"), &json!(id))
    );
    let projects = v.ok("GET", "/v1/projects", None).await;
    let pid = projects["projects"][0]["id"].as_str().unwrap().to_owned();
    for (method, route) in [
        ("DELETE", format!("/v1/workdirs/{id}")),
        ("DELETE", format!("/v1/projects/{pid}")),
    ] {
        let (st, e) = v.req(method, &route, None).await;
        assert_eq!((st, code(&e)), (409, "state"), "{route}: {e}");
    }
    v.ok("POST", "/v1/hook", Some(call("SessionEnd"))).await;
    let f = v.ok("DELETE", &format!("/v1/projects/{pid}"), None).await;
    assert_eq!(f["workdirs"], json!([id]));
    assert!(sub.is_dir(), "forgetting touches no file");
}
