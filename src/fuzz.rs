//! Fuzz entry points (issue 18, "keep it closed").
//!
//! Each function takes arbitrary bytes, feeds them to one decoder or state
//! machine that sees untrusted input, and panics only when an invariant
//! breaks, which is what a fuzzer looks for. The same functions run two
//! ways, so a regression shows up in CI and not only in a campaign:
//!
//! - `fuzz/` holds cargo-fuzz targets (nightly, libFuzzer), one per
//!   function, for long campaigns (`scripts/fuzz.sh`, docs/security.md);
//! - `tests/misc/fuzz.rs` runs every function under `cargo test` on stable
//!   for a bounded number of generated and mutated cases (proptest).
//!
//! Functions never touch the network. [`tool_input`] touches only a
//! scratch directory it is given.

use crate::process::ring::OutputRing;
use crate::terminal::{frame as tframe, scrollback::Scrollback};
use crate::tools::{ToolContext, ToolRegistry};
use crate::wire::frame::{FrameError, Inbound, OutError, JSONRPC};
use crate::wire::types::*;
use crate::wire::{Codec, Method};
use bytes::Bytes;
use std::collections::VecDeque;
use std::path::Path;

/// Reads fuzz "choices" off the front of the input; an exhausted input
/// reads as zeros, so every input is a valid program.
struct Choices<'a>(&'a [u8]);

impl<'a> Choices<'a> {
    fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((b, rest)) => {
                self.0 = rest;
                *b
            }
            None => 0,
        }
    }
    fn u16(&mut self) -> u16 {
        u16::from(self.u8()) << 8 | u16::from(self.u8())
    }
    fn take(&mut self, n: usize) -> &'a [u8] {
        let n = n.min(self.0.len());
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        head
    }
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// One WebSocket frame as the executor or the harness reads it: the
/// envelope, then the typed params of the method it names (what the
/// routers do next). A frame that does not decode must still produce an
/// error answer that encodes.
pub fn frame(codec: Codec, data: &[u8]) {
    match Inbound::parse(codec, Bytes::copy_from_slice(data)) {
        Ok(inbound) => {
            let _ = inbound.id();
            if let Some(method) = inbound.method().and_then(Method::from_name) {
                typed_params(method, &inbound);
            }
            let _ = inbound.params::<JsonMap>();
            let _ = inbound.result::<serde_json::Value>();
        }
        Err(e) => answer_encodes(codec, &e),
    }
}

/// [`frame`] in MessagePack, also fed the MessagePack form of input that
/// happens to be JSON: the seeds are JSON, and libFuzzer's byte mutations
/// rarely build a valid MessagePack map from nothing.
pub fn frame_msgpack(data: &[u8]) {
    frame(Codec::MsgPack, data);
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) {
        if let Ok(mp) = rmp_serde::to_vec_named(&v) {
            frame(Codec::MsgPack, &mp);
        }
    }
}

fn answer_encodes(codec: Codec, e: &FrameError) {
    let (id, error) = e.to_rpc();
    assert!(
        (-32768..=-32000).contains(&error.code),
        "error code {} outside JSON-RPC's reserved range",
        error.code
    );
    let out = OutError {
        jsonrpc: JSONRPC,
        id: id.as_ref(),
        error: &error,
    };
    if let Err(err) = codec.encode(&out) {
        panic!("the error answer to a bad frame does not encode: {err}");
    }
}

/// Decodes the params of `method` into its wire type, as its owner does.
/// The match is exhaustive on purpose: a new method must name its type here.
fn typed_params(method: Method, f: &Inbound) {
    macro_rules! decode {
        ($($m:ident => $t:ty),* $(,)?) => {
            match method {
                $(Method::$m => { let _ = f.params::<$t>(); })*
            }
        };
    }
    decode! {
        ExecutorRegister => RegisterParams,
        ExecutorHeartbeat => HeartbeatParams,
        ExecutorTokenRefresh => TokenRefreshParams,
        ExecutorCapabilitiesUpdate => CapabilitiesUpdateParams,
        ExecutorClose => CloseParams,
        ExecutorDrain => DrainParams,
        SessionAssign => AssignParams,
        SessionReady => ReadyParams,
        SessionStop => StopParams,
        SessionEnded => EndedParams,
        SessionStatus => StatusParams,
        SessionClose => SessionCloseParams,
        ToolCall => ToolCallParams,
        ToolResult => ToolResultParams,
        ToolCancel => ToolCancelParams,
        ToolProgress => ToolProgressParams,
        ProcessStart => ProcessStartParams,
        ProcessRead => ProcessReadParams,
        ProcessWrite => ProcessWriteParams,
        ProcessInterrupt => ProcessRefParams,
        ProcessTerminate => ProcessTerminateParams,
        ProcessList => SessionRefParams,
        ProcessStatus => ProcessStatusParams,
        TerminalOpen => TerminalOpenParams,
        TerminalAttach => TerminalAttachParams,
        TerminalClose => TerminalCloseParams,
        TerminalResize => TerminalResizeParams,
        TerminalInput => TerminalInputParams,
        TerminalOutput => TerminalOutputParams,
        TerminalExited => TerminalExitedParams,
        McpOpen => McpOpenParams,
        McpClose => McpCloseParams,
        McpFrame => McpFrameParams,
        TurnStart => TurnStartParams,
        TurnInput => TurnInputParams,
        TurnCancel => TurnCancelParams,
        SessionEvent => SessionEventParams,
        SessionEventDelta => EventDeltaParams,
        InteractionRequest => InteractionRequestParams,
        InteractionCancel => InteractionCancelParams,
        InteractionResponse => InteractionResponseParams,
        WorkspaceBackup => WorkspaceBackupParams,
        SkillInstall => SkillInstallParams,
        FsMount => FsParams,
        FsUnmount => FsParams,
        ArtifactUpload => ArtifactUploadParams,
        DisplayRfb => DisplayRfbParams,
    }
}

/// A body of the harness's HTTP API: the first byte picks the route, the
/// rest is the body, decoded exactly as that route decodes it.
pub fn api_body(data: &[u8]) {
    let (sel, body) = data.split_first().unwrap_or((&0, &[]));
    crate::harness::http::decode_body_for_fuzz(*sel, &Bytes::copy_from_slice(body));
}

/// The binary frames of a terminal stream: every frame that parses
/// re-encodes to the same bytes; a short one is refused, never read past.
pub fn terminal_frame(data: &[u8]) {
    let input = Bytes::copy_from_slice(data);
    match tframe::parse(&input) {
        Some((op, seq, body)) => {
            assert_eq!(tframe::frame(op, seq, &body), input, "frame round trip");
        }
        None => assert!(data.len() < tframe::HEADER_LEN, "a full header was refused"),
    }
    // Replayed output goes through the query filter: it only removes.
    let filtered = crate::terminal::scrollback::strip_terminal_replies(data);
    assert!(filtered.len() <= data.len());
}

/// The terminal scrollback against a model: a budget of `max` bytes, seqs
/// consecutive from 1, whole chunks kept newest first, replay from any seq
/// returns exactly the retained chunks at or after it and reports the gap.
pub fn scrollback(data: &[u8]) {
    let mut c = Choices(data);
    let max = usize::from(c.u16() % 4096);
    let mut sb = Scrollback::new(max);
    let max = max.max(1);
    // The model: every chunk ever pushed (bounded by the input's length).
    let mut pushed: Vec<Bytes> = Vec::new();
    while !c.is_empty() {
        match c.u8() % 3 {
            0 | 1 => {
                let n = usize::from(c.u16() % 6000);
                let chunk = Bytes::copy_from_slice(c.take(n));
                let seq = sb.push(chunk.clone());
                pushed.push(chunk);
                assert_eq!(seq, pushed.len() as u64, "seqs are consecutive from 1");
            }
            _ => {
                let from = u64::from(c.u16()) % (pushed.len() as u64 + 3);
                let replay = sb.replay(from);
                let earliest = sb.earliest_seq();
                let expect_gap = (from.max(1) < earliest).then_some((from, earliest));
                assert_eq!(replay.gap, expect_gap, "gap for a replay from {from}");
                let start = from.max(earliest).max(1);
                for (i, (seq, chunk)) in replay.chunks.iter().enumerate() {
                    assert_eq!(*seq, start + i as u64, "replayed seqs are consecutive");
                    let original = &pushed[(*seq - 1) as usize];
                    assert!(
                        original.ends_with(chunk),
                        "a replayed chunk is not (the tail of) what was pushed"
                    );
                    if chunk.len() != original.len() {
                        assert!(
                            original.len() > max && chunk.len() == max,
                            "only an oversize chunk is cut, to the budget"
                        );
                    }
                }
            }
        }
        assert!(
            sb.bytes() <= max,
            "{} bytes over a budget of {max}",
            sb.bytes()
        );
        assert_eq!(sb.latest_seq(), pushed.len() as u64);
        assert_eq!(sb.earliest_seq(), model_earliest(&pushed, max));
    }
}

/// The first seq a budget of `max` bytes keeps: the longest run of newest
/// chunks that fits, or the newest alone (cut) when it does not fit.
///
/// Each chunk counts at the size it is kept at, and an oversize chunk
/// replaced everything pushed before it (`Scrollback::push`). The first
/// long campaigns found the model wrong on both counts:
/// `[0, 0, 0, 0, 2, 10, 50, 10]` (a 2-byte chunk on a 1-byte budget, kept
/// cut, then an empty chunk: the cut chunk stays) and
/// `[0, 0, 0, 0, 0, 0, 113, 135, 122, 42, 133]` (an empty chunk, then an
/// oversize one: the empty one is gone).
fn model_earliest(pushed: &[Bytes], max: usize) -> u64 {
    let floor = pushed.iter().rposition(|c| c.len() > max).unwrap_or(0);
    let mut total = 0;
    let mut first = pushed.len();
    for (i, chunk) in pushed.iter().enumerate().skip(floor).rev() {
        // The newest always fits: it is kept at most `max` bytes.
        let kept = chunk.len().min(max);
        if total + kept > max {
            break;
        }
        total += kept;
        first = i;
    }
    first as u64 + 1
}

/// The process output ring against a model (a deque of the newest
/// `capacity` bytes): writes, zero-copy slots, reads at any cursor.
pub fn ring(data: &[u8]) {
    let mut c = Choices(data);
    let cap = usize::from(c.u16() % 5000);
    let mut ring = OutputRing::new(cap);
    let cap = cap.max(1);
    let mut model: VecDeque<u8> = VecDeque::new();
    let mut end: u64 = 0;
    let mut counter: u8 = 0;
    let mut next_bytes = |n: usize| -> Vec<u8> {
        (0..n)
            .map(|_| {
                counter = counter.wrapping_add(1);
                counter
            })
            .collect()
    };
    while !c.is_empty() {
        match c.u8() % 4 {
            0 => {
                let bytes = next_bytes(usize::from(c.u16() % 9000));
                ring.write(&bytes);
                end += bytes.len() as u64;
                model.extend(bytes);
            }
            1 => {
                let max = usize::from(c.u16() % 9000);
                let commit = usize::from(c.u16() % 9000);
                let bytes;
                {
                    let slot = ring.write_slot(max);
                    assert!(slot.len() <= max);
                    assert!(max == 0 || !slot.is_empty(), "an empty slot for max {max}");
                    // As read(2) does: only the bytes about to be
                    // committed are written (the rest of a slot over a
                    // full ring still holds old output).
                    bytes = next_bytes(commit.min(slot.len()));
                    slot[..bytes.len()].copy_from_slice(&bytes);
                }
                ring.commit(commit);
                end += bytes.len() as u64;
                model.extend(&bytes);
            }
            2 => {
                // A cursor anywhere from before the start to past the end.
                let cursor = (u64::from(c.u16()) * 7) % (end + 3);
                let max = usize::from(c.u16() % 9000);
                let mut out = Vec::new();
                let earliest = end - model.len().min(cap) as u64;
                match ring.read_into(cursor, max, &mut out) {
                    Ok(span) => {
                        assert!(cursor <= end);
                        assert_eq!(span.gap, cursor < earliest);
                        assert_eq!(span.from, cursor.max(earliest));
                        assert_eq!(span.next, span.from + out.len() as u64);
                        let skip = (span.from - earliest) as usize;
                        let want: Vec<u8> = model.iter().skip(skip).take(max).copied().collect();
                        assert_eq!(out, want, "bytes read differ from the model");
                        assert_eq!(span.truncated, span.next < end);
                    }
                    Err(_) => assert!(cursor > end, "cursor {cursor} refused at end {end}"),
                }
            }
            _ => {
                let keep = u64::from(c.u16()) % (end + 2);
                let room = ring.room_keeping(keep);
                assert!(room <= cap);
            }
        }
        while model.len() > cap {
            model.pop_front();
        }
        assert_eq!(ring.end(), end);
        assert_eq!(ring.len(), model.len());
        assert_eq!(ring.earliest(), end - model.len() as u64);
    }
}

/// The file tools' argument parsing and path resolution with arbitrary
/// input, run for real in `scratch`: `scratch/ws` is the workspace (holding
/// a file, a directory and a symlink that points outside), `scratch/out`
/// holds a secret. Whatever the input, no result may show the secret and
/// nothing outside the workspace may change. The first byte picks the tool
/// (`bash` is left out: running commands is its purpose); the rest is the
/// input as JSON, or, when that does not parse, a string for its main field.
pub fn tool_input(scratch: &Path, data: &[u8]) {
    const SECRET: &str = "FUZZ-OUTSIDE-SECRET";
    const TOOLS: [(&str, &str); 6] = [
        ("read", "path"),
        ("write", "path"),
        ("edit", "path"),
        ("glob", "pattern"),
        ("grep", "pattern"),
        ("list_files", "path"),
    ];
    let (sel, body) = data.split_first().unwrap_or((&0, &[]));
    let (tool, field) = TOOLS[usize::from(*sel) % TOOLS.len()];
    let input: serde_json::Value = serde_json::from_slice(body).unwrap_or_else(|_| {
        let text = String::from_utf8_lossy(body).into_owned();
        serde_json::json!({ field: text, "content": SECRET, "oldString": "a", "newString": SECRET })
    });
    let ws = scratch.join("ws");
    let out = scratch.join("out");
    if !ws.exists() {
        std::fs::create_dir_all(ws.join("dir")).expect("scratch workspace");
        std::fs::create_dir_all(&out).expect("scratch outside");
        std::fs::write(ws.join("a.txt"), "a\nb\n").expect("scratch file");
        std::fs::write(out.join("secret.txt"), SECRET).expect("scratch secret");
        std::os::unix::fs::symlink(&out, ws.join("link")).expect("scratch link");
        std::os::unix::fs::symlink(out.join("secret.txt"), ws.join("dir/s")).expect("link");
    }
    let before = listing(&out);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let ctx = ToolContext::new(ws.canonicalize().unwrap_or(ws.clone()), "fuzz");
    let result = rt.block_on(ToolRegistry::builtin().run(tool, ctx, input.clone()));
    // `write` and `edit` may echo their input (which holds the secret) in
    // their result; for them only the disk matters.
    let writes = tool == "write" || tool == "edit";
    assert!(
        writes || !result.text.contains(SECRET),
        "{tool} {input} showed the outside secret: {}",
        result.text
    );
    assert_eq!(listing(&out), before, "{tool} {input} changed the outside");
}

/// Names, sizes and contents of the files directly in `dir`.
fn listing(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| {
                    let bytes = std::fs::read(e.path()).unwrap_or_default();
                    (e.file_name().to_string_lossy().into_owned(), bytes)
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}
