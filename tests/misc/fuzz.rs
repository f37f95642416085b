//! The fuzz targets of [`bmx::fuzz`], run under `cargo test` on stable for a
//! bounded number of cases, so CI exercises every target on every change
//! (long campaigns: `scripts/fuzz.sh`, nightly and libFuzzer).
//!
//! Inputs are of three kinds: raw random bytes; structured ones (a JSON-RPC
//! envelope with a real method name and random params, in JSON and in
//! MessagePack) so the decoders get past the first byte; and the seed
//! corpus in `fuzz/seeds/` with random bytes flipped, inserted and cut.
//! `BMX_FUZZ_CASES` raises the count (default 512 per target).

use bmx::wire::{Codec, METHODS};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use serde_json::{json, Value};
use std::path::PathBuf;

fn cases(default: u32) -> u32 {
    std::env::var("BMX_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn runner(n: u32) -> TestRunner {
    TestRunner::new(Config {
        cases: cases(n),
        failure_persistence: None,
        ..Config::default()
    })
}

fn seeds(kind: &str) -> Vec<Vec<u8>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/seeds")
        .join(kind);
    let mut v: Vec<Vec<u8>> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .map(|e| std::fs::read(e.path()).unwrap())
        .collect();
    v.sort();
    assert!(!v.is_empty(), "no seeds in {}", dir.display());
    v
}

/// A seed with up to 8 edits: a byte replaced, inserted or removed.
fn mutated(seeds: Vec<Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
    let n = seeds.len();
    (
        0..n,
        prop::collection::vec((0u8..3, any::<usize>(), any::<u8>()), 0..8),
    )
        .prop_map(move |(i, edits)| {
            let mut b = seeds[i].clone();
            for (op, at, byte) in edits {
                let at = if b.is_empty() { 0 } else { at % b.len() };
                match op {
                    0 if !b.is_empty() => b[at] = byte,
                    1 => b.insert(at, byte),
                    _ if !b.is_empty() => {
                        b.remove(at);
                    }
                    _ => {}
                }
            }
            b
        })
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| json!(f)),
        "[a-zA-Z0-9_./:-]{0,12}".prop_map(Value::from),
        any::<String>().prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 48, 8, |inner| {
        let key = prop_oneof![
            Just("sessionId".to_string()),
            Just("processId".to_string()),
            Just("fencingToken".to_string()),
            Just("argv".to_string()),
            Just("data".to_string()),
            Just("cursor".to_string()),
            Just("input".to_string()),
            Just("tool".to_string()),
            Just("capabilities".to_string()),
            "[a-zA-Z]{1,10}",
        ];
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
            prop::collection::btree_map(key, inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A JSON-RPC envelope with a real method name (or none), an id of any
/// JSON type, and random params, result or error.
fn envelope() -> impl Strategy<Value = Value> {
    let method = prop_oneof![
        (0..METHODS.len()).prop_map(|i| Some(METHODS[i].name.to_string())),
        Just(None),
        "[a-z.]{0,16}".prop_map(Some),
    ];
    (
        method,
        prop::option::of(json_value()),
        json_value(),
        0u8..4,
        prop_oneof![Just("2.0"), Just("1.0"), Just("")],
    )
        .prop_map(|(method, id, body, shape, version)| {
            let mut o = serde_json::Map::new();
            o.insert("jsonrpc".into(), version.into());
            if let Some(m) = method {
                o.insert("method".into(), m.into());
            }
            if let Some(id) = id {
                o.insert("id".into(), id);
            }
            match shape {
                0 => o.insert("params".into(), body),
                1 => o.insert("result".into(), body),
                2 => o.insert("error".into(), json!({"code": -32000, "message": body})),
                _ => None,
            };
            Value::Object(o)
        })
}

fn frames(codec: Codec) -> impl Strategy<Value = Vec<u8>> {
    let structured = envelope().prop_map(move |v| match codec {
        Codec::Json => serde_json::to_vec(&v).unwrap(),
        Codec::MsgPack => rmp_serde::to_vec_named(&v).unwrap(),
    });
    let seeds: Vec<Vec<u8>> = seeds("frame")
        .into_iter()
        .map(|s| match codec {
            Codec::Json => s,
            Codec::MsgPack => {
                let v: Value = serde_json::from_slice(&s).unwrap();
                rmp_serde::to_vec_named(&v).unwrap()
            }
        })
        .collect();
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..256),
        structured,
        mutated(seeds),
    ]
}

#[test]
fn frame_json() {
    runner(1024)
        .run(&frames(Codec::Json), |b| {
            bmx::fuzz::frame(Codec::Json, &b);
            Ok(())
        })
        .unwrap();
}

#[test]
fn frame_msgpack() {
    runner(1024)
        .run(&frames(Codec::MsgPack), |b| {
            bmx::fuzz::frame(Codec::MsgPack, &b);
            Ok(())
        })
        .unwrap();
}

#[test]
fn api_body() {
    let structured = (any::<u8>(), json_value()).prop_map(|(sel, v)| {
        let mut b = vec![sel];
        b.extend(serde_json::to_vec(&v).unwrap());
        b
    });
    let inputs = prop_oneof![
        prop::collection::vec(any::<u8>(), 0..256),
        structured,
        mutated(seeds("api_body")),
    ];
    runner(1024)
        .run(&inputs, |b| {
            bmx::fuzz::api_body(&b);
            Ok(())
        })
        .unwrap();
}

#[test]
fn terminal_frame() {
    runner(1024)
        .run(&prop::collection::vec(any::<u8>(), 0..64), |b| {
            bmx::fuzz::terminal_frame(&b);
            Ok(())
        })
        .unwrap();
}

#[test]
fn scrollback() {
    // Found by the first long campaigns (the model was wrong, see
    // `fuzz::model_earliest`): a cut chunk followed by an empty one, and
    // an empty chunk followed by an oversize one.
    bmx::fuzz::scrollback(&[0, 0, 0, 0, 2, 10, 50, 10]);
    bmx::fuzz::scrollback(&[0, 0, 0, 0, 0, 0, 113, 135, 122, 42, 133]);
    runner(512)
        .run(&prop::collection::vec(any::<u8>(), 0..2048), |b| {
            bmx::fuzz::scrollback(&b);
            Ok(())
        })
        .unwrap();
}

#[test]
fn ring() {
    runner(512)
        .run(&prop::collection::vec(any::<u8>(), 0..2048), |b| {
            bmx::fuzz::ring(&b);
            Ok(())
        })
        .unwrap();
}

#[test]
fn tool_input() {
    let scratch = tempfile::tempdir().unwrap();
    let paths = prop_oneof![
        Just("link/secret.txt".to_string()),
        Just("../out/secret.txt".to_string()),
        Just("dir/s".to_string()),
        Just("link".to_string()),
        Just("a.txt".to_string()),
        Just("dir/../../out/secret.txt".to_string()),
        Just("**/*".to_string()),
        "[a-z./*]{0,20}",
    ];
    // The exact fields of each tool (they refuse unknown ones), sometimes
    // with one more: read, write, edit, glob, grep, list_files.
    let structured =
        (0u8..6, paths, any::<bool>(), json_value()).prop_map(|(sel, path, extra, value)| {
            let mut input = match sel {
                0 | 5 => json!({ "path": path }),
                1 => json!({ "path": path, "content": "x" }),
                2 => json!({ "path": path, "oldString": "a", "newString": "b" }),
                3 => json!({ "pattern": path }),
                _ => json!({ "pattern": "SECRET", "path": path }),
            };
            if extra {
                input["extra"] = value;
            }
            let mut b = vec![sel];
            b.extend(serde_json::to_vec(&input).unwrap());
            b
        });
    let inputs = prop_oneof![prop::collection::vec(any::<u8>(), 0..64), structured];
    runner(256)
        .run(&inputs, |b| {
            bmx::fuzz::tool_input(scratch.path(), &b);
            Ok(())
        })
        .unwrap();
}
