//! Skill install through the real harness (library, filesystem blob
//! store) and the real `bmx executor` binary: a published archive is
//! fetched with a one-time token, its digest checked, and unpacked into
//! `.skills/<skillId>`; crafted malicious archives fail with an
//! `errorCode` and write nothing, in the workspace or outside it.

use crate::support;
use bmx::client::ApiClient;
use bmx::harness::blob::FsBlobStore;
use bmx::harness::Harness;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

/// A tar entry written byte by byte (`tar::Builder` refuses `..`).
fn entry(out: &mut Vec<u8>, name: &str, kind: tar::EntryType, data: &[u8], link: &str) {
    let mut h = tar::Header::new_old();
    {
        let old = h.as_old_mut();
        old.name[..name.len()].copy_from_slice(name.as_bytes());
        old.linkname[..link.len()].copy_from_slice(link.as_bytes());
    }
    h.set_entry_type(kind);
    h.set_size(data.len() as u64);
    h.set_mode(0o644);
    h.set_cksum();
    out.extend_from_slice(h.as_bytes());
    out.extend_from_slice(data);
    out.resize(out.len().div_ceil(512) * 512, 0);
}

fn finish(mut out: Vec<u8>) -> Vec<u8> {
    out.extend_from_slice(&[0u8; 1024]);
    out
}

async fn publish(h: &bmx::harness::HarnessHandle, skill: &str, rev: &str, body: Vec<u8>) -> Value {
    let r = reqwest::Client::new()
        .post(format!(
            "{}/v1/skills?skillId={skill}&revisionId={rev}",
            h.api_url()
        ))
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    r.json().await.unwrap()
}

async fn bash(api: &ApiClient, sid: &str, command: &str) -> String {
    let (s, v) = api
        .post(
            &format!("/v1/sessions/{sid}/tools"),
            &json!({"tool": "bash", "input": {"command": command}}),
        )
        .await
        .unwrap();
    assert_eq!(s, 200, "{v}");
    v["content"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skills_install_and_malicious_archives_fail_cleanly() {
    let blobs = tempfile::tempdir().unwrap();
    let h = Harness::builder()
        .listen("127.0.0.1:0".parse().unwrap())
        .token("exec-sk", support::TOKEN)
        .blob_store(Arc::new(FsBlobStore::open(blobs.path(), 64 << 20).unwrap()))
        .build()
        .await
        .expect("harness");
    let work = tempfile::tempdir().unwrap();
    let _executor = support::executor_command(&h.executor_url(), work.path())
        .spawn()
        .expect("bmx executor");
    assert!(
        h.wait_for_executor(Some("exec-sk"), Duration::from_secs(20))
            .await
    );
    let api = ApiClient::new(&h.api_url())
        .unwrap()
        .timeout(Duration::from_secs(60));
    let (_, v) = api.get("/v1/executors").await.unwrap();
    assert_eq!(
        v["executors"][0]["capabilities"]["skills"]["install"], true,
        "{v}"
    );
    let (s, v) = api.post("/v1/sessions", &json!({})).await.unwrap();
    assert_eq!(s, 201, "{v}");
    let sid = v["sessionId"].as_str().unwrap().to_owned();

    let mut t = Vec::new();
    entry(&mut t, "SKILL.md", tar::EntryType::Regular, b"# greet", "");
    entry(&mut t, "bin/", tar::EntryType::Directory, b"", "");
    entry(
        &mut t,
        "bin/greet",
        tar::EntryType::Regular,
        b"echo hello",
        "",
    );
    let p = publish(&h, "greet", "r1", finish(t)).await;
    assert!(p["skill"]["digest"]
        .as_str()
        .unwrap()
        .starts_with("sha256:"));
    let (s, r) = api
        .post(
            &format!("/v1/sessions/{sid}/skills"),
            &json!({"skillId": "greet"}),
        )
        .await
        .unwrap();
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["state"], "installed", "{r}");
    let out = bash(
        &api,
        &sid,
        "cat .skills/greet/SKILL.md .skills/greet/bin/greet",
    )
    .await;
    assert!(
        out.contains("# greet") && out.contains("echo hello"),
        "{out}"
    );

    let marker = work.path().join("evil");
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("path_traversal", {
            let mut t = Vec::new();
            entry(&mut t, "fine.txt", tar::EntryType::Regular, b"ok", "");
            entry(&mut t, "../../evil", tar::EntryType::Regular, b"x", "");
            finish(t)
        }),
        ("absolute_path", {
            let mut t = Vec::new();
            entry(
                &mut t,
                &marker.to_string_lossy(),
                tar::EntryType::Regular,
                b"x",
                "",
            );
            finish(t)
        }),
        ("symlink_escape", {
            let mut t = Vec::new();
            entry(
                &mut t,
                "out",
                tar::EntryType::Symlink,
                b"",
                work.path().to_str().unwrap(),
            );
            entry(&mut t, "out/evil", tar::EntryType::Regular, b"x", "");
            finish(t)
        }),
        ("hard_link", {
            let mut t = Vec::new();
            entry(&mut t, "pw", tar::EntryType::Link, b"", "/etc/passwd");
            finish(t)
        }),
        ("special_file", {
            let mut t = Vec::new();
            entry(&mut t, "null", tar::EntryType::Char, b"", "");
            finish(t)
        }),
    ];
    for (i, (code, archive)) in cases.into_iter().enumerate() {
        let skill = format!("bad{i}");
        publish(&h, &skill, "r1", archive).await;
        let (s, r) = api
            .post(
                &format!("/v1/sessions/{sid}/skills"),
                &json!({"skillId": skill}),
            )
            .await
            .unwrap();
        assert_eq!(s, 200, "{r}");
        assert_eq!(r["state"], "failed", "{code}: {r}");
        assert_eq!(r["errorCode"], code, "{r}");
        assert!(!marker.exists(), "{code}: wrote outside");
        let ls = bash(&api, &sid, &format!("ls -a .skills/{skill} 2>&1; ls ..")).await;
        assert!(ls.contains("No such file"), "{code}: {ls}");
        assert!(!ls.contains("evil"), "{code}: {ls}");
    }

    // Unknown revision; a download token cannot be guessed or reused.
    let (s, _) = api
        .post(
            &format!("/v1/sessions/{sid}/skills"),
            &json!({"skillId": "greet", "revisionId": "nope"}),
        )
        .await
        .unwrap();
    assert_eq!(s, 404);
    let r = reqwest::Client::new()
        .get(format!(
            "{}/v1/skill-downloads/0123456789abcdef",
            h.api_url()
        ))
        .bearer_auth("0123456789abcdef.00")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
}
