//! The file tools against a session that swaps a workspace directory for a
//! symlink to the outside while they run (issue 18, finding 1).
//!
//! A racer thread exchanges `ws/d` (a real directory) and `ws/s` (a
//! symlink to a directory outside the workspace) with
//! `renameat2(RENAME_EXCHANGE)` as fast as it can, so every path under `d`
//! flips between inside and outside. `resolve` alone (check, then open by
//! name) lost this race in about one call in five; every access now goes
//! through a handle of the workspace (`tools::beneath`). Each tool runs
//! many times during the race: not one call may read, match, list, create
//! or change anything outside.

use bmx::tools::{Outcome, ToolContext, ToolRegistry};
use serde_json::{json, Value};
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

const SECRET: &str = "SECRET-outside-the-workspace";

struct Race {
    _dirs: (tempfile::TempDir, tempfile::TempDir),
    ws: PathBuf,
    outside: PathBuf,
    stop: Arc<AtomicBool>,
    swaps: Arc<AtomicU64>,
    racer: Option<std::thread::JoinHandle<()>>,
}

impl Race {
    fn start() -> Race {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let ws = std::fs::canonicalize(a.path()).unwrap();
        let outside = std::fs::canonicalize(b.path()).unwrap();
        std::fs::create_dir(ws.join("d")).unwrap();
        std::fs::write(ws.join("d/f"), "inside\n").unwrap();
        std::fs::write(outside.join("f"), format!("{SECRET}\n")).unwrap();
        std::fs::write(outside.join("only-outside"), format!("{SECRET}\n")).unwrap();
        std::os::unix::fs::symlink(&outside, ws.join("s")).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let swaps = Arc::new(AtomicU64::new(0));
        let racer = {
            let (stop, swaps) = (stop.clone(), swaps.clone());
            let d = CString::new(ws.join("d").as_os_str().as_bytes()).unwrap();
            let s = CString::new(ws.join("s").as_os_str().as_bytes()).unwrap();
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    // SAFETY: renameat2 reads the two NUL-terminated paths.
                    let rc = unsafe {
                        libc::renameat2(
                            libc::AT_FDCWD,
                            d.as_ptr(),
                            libc::AT_FDCWD,
                            s.as_ptr(),
                            libc::RENAME_EXCHANGE,
                        )
                    };
                    if rc == 0 {
                        swaps.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        };
        Race {
            _dirs: (a, b),
            ws,
            outside,
            stop,
            swaps,
            racer: Some(racer),
        }
    }

    /// Run `tool` with `input` `n` times during the race.
    async fn calls(&self, tool: &str, input: Value, n: usize) -> Vec<(Outcome, String)> {
        let registry = ToolRegistry::builtin();
        let tool = registry.get(tool).expect("a built-in tool");
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let ctx = ToolContext::new(&self.ws, format!("call-{i}"));
            let r = tool.run(ctx, input.clone()).await;
            out.push((r.outcome, r.text));
        }
        out
    }

    fn outside_names(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(&self.outside)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }
}

impl Drop for Race {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(r) = self.racer.take() {
            let _ = r.join();
        }
    }
}

fn assert_raced(race: &Race, results: &[(Outcome, String)]) {
    // The race really ran: the racer swapped, and some calls saw a path
    // that was not the plain directory (refused or not found), so the
    // test would have caught a tool that follows the swap.
    assert!(
        race.swaps.load(Ordering::Relaxed) > 100,
        "the racer swapped"
    );
    assert!(
        results.iter().any(|(o, _)| *o == Outcome::Succeeded),
        "some calls got through"
    );
}

fn path_in(ws: &Path, rel: &str) -> String {
    ws.join(rel).to_string_lossy().into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_never_returns_outside_content() {
    let race = Race::start();
    let results = race.calls("read", json!({"path": "d/f"}), 3_000).await;
    for (_, text) in &results {
        assert!(!text.contains(SECRET), "read escaped: {text}");
    }
    assert_raced(&race, &results);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grep_never_matches_outside_content() {
    let race = Race::start();
    let results = race
        .calls("grep", json!({"pattern": "SECRET", "path": "d"}), 3_000)
        .await;
    for (_, text) in &results {
        assert!(!text.contains(SECRET), "grep escaped: {text}");
    }
    assert!(race.swaps.load(Ordering::Relaxed) > 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_files_never_lists_outside_names() {
    let race = Race::start();
    let results = race.calls("list_files", json!({"path": "d"}), 3_000).await;
    for (_, text) in &results {
        assert!(!text.contains("only-outside"), "list_files escaped: {text}");
    }
    assert_raced(&race, &results);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_never_creates_outside() {
    let race = Race::start();
    let before = race.outside_names();
    let results = race
        .calls(
            "write",
            json!({"path": path_in(&race.ws, "d/new.txt"), "content": "x"}),
            1_000,
        )
        .await;
    assert_eq!(race.outside_names(), before, "write created a file outside");
    assert_raced(&race, &results);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edit_never_changes_outside() {
    let race = Race::start();
    let mut results = Vec::new();
    let registry = ToolRegistry::builtin();
    let edit = registry.get("edit").unwrap();
    // Only an escaped edit can find the secret; the other two keep a real
    // edit going inside (each fails harmlessly when its text is not there).
    let steps = [
        (SECRET, "overwritten"),
        ("inside", "edited"),
        ("edited", "inside"),
    ];
    for i in 0..1_000 {
        for (j, (old, new)) in steps.iter().enumerate() {
            let ctx = ToolContext::new(&race.ws, format!("edit-{i}-{j}"));
            let r = edit
                .run(
                    ctx,
                    json!({"path": "d/f", "oldString": old, "newString": new}),
                )
                .await;
            results.push((r.outcome, r.text));
        }
    }
    race.stop.store(true, Ordering::Relaxed);
    assert_eq!(
        std::fs::read_to_string(race.outside.join("f")).unwrap(),
        format!("{SECRET}\n"),
        "edit changed a file outside"
    );
    assert_eq!(race.outside_names(), ["f", "only-outside"]);
    assert_raced(&race, &results);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn glob_never_names_outside_entries() {
    // `d` flips with a symlink to the outside while glob walks the
    // workspace: a walk by name would list the outside directory as `d`
    // (and report `d/only-outside`) whenever the swap lands between the
    // listing of the workspace and the listing of `d`.
    let race = Race::start();
    let results = race.calls("glob", json!({"pattern": "**/*"}), 3_000).await;
    for (_, text) in &results {
        assert!(!text.contains("only-outside"), "glob escaped: {text}");
    }
    assert_raced(&race, &results);
}
