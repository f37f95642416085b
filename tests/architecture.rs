//! The architecture invariants of docs/architecture.md, checked on the
//! source text: which layer may import which, and that runtime actors are
//! only spawned by the supervisors. A grep, deliberately: these are rules
//! about where code lives, and they must fail the build when broken.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Lines of code (not comments) in `dir` that mention one of `needles`.
fn offenders(dir: &Path, needles: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    let files = if dir.is_file() {
        vec![dir.to_path_buf()]
    } else {
        rust_files(dir)
    };
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        for (n, line) in text.lines().enumerate() {
            let code = line.trim_start();
            if code.starts_with("//") {
                continue;
            }
            if needles.iter().any(|needle| code.contains(needle)) {
                out.push(format!("{}:{}: {}", f.display(), n + 1, code));
            }
        }
    }
    out
}

#[test]
fn the_cores_import_no_side() {
    for core in [
        "wire",
        "supervisor",
        "lease",
        "mcp",
        "acp",
        "process",
        "terminal",
        "tools",
        "client.rs",
    ] {
        let bad = offenders(
            &src().join(core),
            &[
                "crate::executor",
                "crate::harness",
                "crate::cli",
                "crate::bench",
            ],
        );
        assert!(bad.is_empty(), "{core} imports a side:\n{}", bad.join("\n"));
    }
}

#[test]
fn the_sides_do_not_import_each_other() {
    let bad = offenders(&src().join("executor"), &["crate::harness"]);
    assert!(bad.is_empty(), "executor → harness:\n{}", bad.join("\n"));
    let bad = offenders(&src().join("harness"), &["crate::executor"]);
    assert!(bad.is_empty(), "harness → executor:\n{}", bad.join("\n"));
}

#[test]
fn the_library_does_not_export_the_binary() {
    let lib = std::fs::read_to_string(src().join("lib.rs")).unwrap();
    for line in lib.lines().map(str::trim) {
        for m in ["pub mod cli;", "pub mod bench;", "mod cli;", "mod bench;"] {
            assert_ne!(line, m, "lib.rs must not declare the binary's modules");
        }
    }
}

#[test]
fn actors_are_spawned_only_by_supervisors() {
    let mut bad = Vec::new();
    for f in rust_files(&src()) {
        if f.starts_with(src().join("supervisor")) {
            continue;
        }
        bad.extend(offenders(&f, &["Actor::spawn(", "spawn_linked("]));
    }
    assert!(
        bad.is_empty(),
        "actors spawned outside src/supervisor:\n{}",
        bad.join("\n")
    );
}

#[test]
fn method_names_live_in_the_method_table() {
    // A method name as a string literal outside src/wire means a second
    // source of truth. (Tests and docs may quote them.)
    let table = std::fs::read_to_string(src().join("wire/method.rs")).unwrap();
    let names: Vec<String> = table
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let (_, rest) = l.split_once("= \"")?;
            let (name, _) = rest.split_once('"')?;
            name.contains('.').then(|| name.to_owned())
        })
        .collect();
    assert!(
        names.len() > 30,
        "the method table was read ({})",
        names.len()
    );
    let mut bad = Vec::new();
    for f in rust_files(&src()) {
        if f.starts_with(src().join("wire")) {
            continue;
        }
        let quoted: Vec<String> = names.iter().map(|n| format!("\"{n}\"")).collect();
        let needles: Vec<&str> = quoted.iter().map(String::as_str).collect();
        bad.extend(offenders(&f, &needles));
    }
    assert!(
        bad.is_empty(),
        "method names outside the table:\n{}",
        bad.join("\n")
    );
}
