//! Every `--json` line the runner tests see is checked against the
//! schemas in `docs/schemas/` (the envelope, and the command's `data`).

use serde_json::{json, Value};
use std::process::Output;

const BASE: &str = "https://bmx.invalid/schemas/";
const FILES: &[&str] = &[
    "envelope",
    "target",
    "targets",
    "runtime",
    "environment-status",
    "status",
    "ps",
];

fn load(name: &str) -> Value {
    let path = format!("{}/docs/schemas/{name}.json", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The schema of an envelope whose `data` (when `ok`) is `data_schema`
/// (a file name without `.json`, or `None` for any object). The files
/// reference each other by `$id`, so all are embedded under `$defs`.
pub fn schema_for(data_schema: Option<&str>) -> Value {
    let defs: serde_json::Map<String, Value> =
        FILES.iter().map(|f| (f.to_string(), load(f))).collect();
    let mut all = vec![json!({"$ref": format!("{BASE}envelope.json")})];
    if let Some(d) = data_schema {
        all.push(json!({
            "if": {"properties": {"ok": {"const": true}}},
            "then": {"properties": {"data": {"$ref": format!("{BASE}{d}.json")}}}
        }));
    }
    json!({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$defs": defs,
        "allOf": all,
    })
}

/// The validation errors of `instance` (empty: valid).
pub fn errors(data_schema: Option<&str>, instance: &Value) -> Vec<String> {
    let schema = schema_for(data_schema);
    let v = jsonschema::validator_for(&schema).unwrap_or_else(|e| panic!("bad schema: {e}"));
    v.iter_errors(instance)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect()
}

/// Stdout of `out` must be exactly one JSON line, valid against the
/// envelope and `data_schema`; returns it.
pub fn line(out: &Output, data_schema: &str) -> Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.ends_with('\n') && stdout.matches('\n').count() == 1,
        "not exactly one line on stdout: {stdout:?} (stderr: {})",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_str(stdout.trim_end())
        .unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"));
    let errs = errors(Some(data_schema), &v);
    assert!(errs.is_empty(), "{stdout} is not valid: {errs:#?}");
    // The exit status follows `ok` (RUNNER.md §3).
    assert_eq!(
        out.status.success(),
        v["ok"] == true,
        "exit status {:?} for {stdout}",
        out.status
    );
    v
}
