//! `process.*` methods (PROTOCOL.md §7).

use super::JsonMap;
use crate::wire::Blob;
use std::collections::BTreeMap;

wire_enum! {
    #[derive(Default)]
    pub enum StdinMode { Open, #[default] Closed }
}

wire_enum! {
    #[derive(Default)]
    pub enum StderrMode { #[default] Separate, Merge }
}

wire_enum! {
    #[derive(Default)]
    pub enum IoMode { #[default] Pipe, Pty }
}

wire_enum! {
    /// What a stream's ring does when it is full (bmx extension,
    /// docs/protocol.md): `ring` drops the oldest bytes (PROTOCOL.md's
    /// rule, the default); `lossless` stops reading the pipe until a
    /// `process.read` has returned them, so the process blocks on its
    /// writes the way it would on a full pipe and no byte is ever dropped.
    #[derive(Default)]
    pub enum OutputPolicy { #[default] Ring, Lossless }
}

fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

wire_struct! {
    pub struct ProcessStartParams {
        pub session_id: String,
        pub process_id: String,
        /// Empty (or absent) with `packageInstall`: the executor builds
        /// the argv then (docs/protocol.md, "Files, packages and git
        /// credentials").
        #[serde(default)]
        pub argv: Vec<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub cwd: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub env: Option<BTreeMap<String, String>>,
        #[serde(default, skip_serializing_if = "is_default")]
        pub stdin: StdinMode,
        #[serde(default, skip_serializing_if = "is_default")]
        pub stderr: StderrMode,
        #[serde(default, skip_serializing_if = "is_default")]
        pub io_mode: IoMode,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub timeout_ms: Option<u64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub wait_ms: Option<u64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        #[cfg_attr(test, proptest(strategy = "super::arb::opt_json_map()"))]
        pub metadata: Option<JsonMap>,
        /// PTY size for `ioMode: "pty"` (bmx extension; default 80x24).
        #[serde(skip_serializing_if = "Option::is_none")]
        pub cols: Option<u16>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub rows: Option<u16>,
        /// `ring` (default) or `lossless` (bmx extension).
        #[serde(default, skip_serializing_if = "is_default")]
        pub output_policy: OutputPolicy,
        /// Install packages with one of the allowed managers; the
        /// executor maps it to an argv (never a shell string).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub package_install: Option<ProcessPackageInstall>,
        /// Run with a `GIT_ASKPASS` helper holding the executor's granted
        /// git credential, for this process only.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        pub git_credentials: bool,
        /// Copy one file between the harness and the workspace instead of
        /// running a program (the seed's `ProcessFileTransfer`); `argv`
        /// must then be empty (docs/protocol.md, "File transfers").
        #[serde(default, skip_serializing_if = "Option::is_none")]
        /// Boxed: it is large, and most processes have none.
        pub file_transfer: Option<Box<ProcessFileTransfer>>,
    }
}

wire_struct! {
    /// `process.start.fileTransfer`: the seed's `{direction, localPath}`
    /// plus the data path the harness fills in (bmx extensions,
    /// docs/protocol.md). `direction` is a string so that an unknown one
    /// is refused with a reason, not a decode error.
    #[derive(Default)]
    pub struct ProcessFileTransfer {
        /// `download` (harness → workspace) or `upload` (workspace →
        /// harness).
        pub direction: String,
        /// A path in the session's workspace (the tools' boundary rules,
        /// and no `..` at all).
        pub local_path: String,
        /// The conflict check: the digest the caller expects the local
        /// file to have now (`""`: it must not exist). Another digest →
        /// error `conflict` with `currentDigest`, nothing transferred.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub expected_digest: Option<String>,
        /// Download: the digest the bytes must hash to (`sha256:<hex>`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub digest: Option<String>,
        /// Download: where to `GET` the bytes, with `downloadToken` as
        /// the bearer (the harness's one-time download route).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub download_url: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub download_token: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub download_expires_at: Option<String>,
        /// Upload: where to send the bytes (the artifact upload ticket).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub upload: Option<super::UploadTarget>,
        /// The most bytes transferred; more is error `too_large`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub max_bytes: Option<u64>,
        /// Harness API only: download this artifact (the harness turns it
        /// into `digest` and a download token; executors ignore it).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub artifact_id: Option<String>,
    }
}

impl ProcessFileTransfer {
    /// The spec without its one-time data path (tokens, URLs): what a
    /// repeated `process.start` must match to be the same transfer.
    pub fn without_credentials(&self) -> Self {
        ProcessFileTransfer {
            download_url: None,
            download_token: None,
            download_expires_at: None,
            upload: None,
            ..self.clone()
        }
    }
}

wire_struct! {
    /// How a file transfer ended (the seed's `FileTransferResult`), in
    /// `process.read.fileTransfer` once the transfer process has ended.
    pub struct FileTransferResult {
        /// The workspace path, as given.
        pub path: String,
        /// The digest of the bytes transferred (empty when it failed
        /// before any were).
        pub digest: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub size_bytes: Option<u64>,
        /// Upload: the artifact the harness stored (bmx extension).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub artifact_id: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub error: Option<FileTransferError>,
    }
}

wire_struct! {
    /// Why a transfer failed: `code` (docs/protocol.md lists them), the
    /// local file's digest when the conflict check failed.
    pub struct FileTransferError {
        pub code: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub current_digest: Option<String>,
        pub message: String,
    }
}

wire_struct! {
    /// `process.start.packageInstall` (the seed's `ProcessPackageInstall`):
    /// `manager` is `apt`, `pip` or `npm`; a string rather than an enum so
    /// an unknown manager is refused with a reason, not a decode error.
    pub struct ProcessPackageInstall {
        pub manager: String,
        pub packages: Vec<String>,
    }
}

wire_enum! {
    pub enum ProcState { Running, Exited, Failed, Killed }
}

impl ProcState {
    pub fn is_final(self) -> bool {
        !matches!(self, ProcState::Running)
    }
}

wire_struct! {
    #[derive(Default, Copy)]
    pub struct Cursors {
        pub stdout: u64,
        pub stderr: u64,
    }
}

wire_struct! {
    /// The process state: the answer of start, interrupt, terminate, and the
    /// rows of `process.list`.
    pub struct ProcessState {
        pub accepted: bool,
        pub process_id: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub pid: Option<u32>,
        pub state: ProcState,
        pub started_at: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub ended_at: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub exit_code: Option<i32>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub exit_signal: Option<i32>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub reason: Option<String>,
        /// A human-readable message (spawn failures).
        #[serde(skip_serializing_if = "Option::is_none")]
        pub message: Option<String>,
        pub cursors: Cursors,
    }
}

wire_enum! {
    pub enum Stream { Stdout, Stderr }
}

wire_struct! {
    pub struct ProcessReadParams {
        pub session_id: String,
        pub process_id: String,
        pub stream: Stream,
        pub cursor: u64,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub max_bytes: Option<u64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub wait_ms: Option<u64>,
    }
}

/// The answer of `process.read`. Generic over the payload so the executor
/// can encode it from a borrowed slice of its ring ([`crate::wire::BlobRef`])
/// while everyone else decodes an owned [`Blob`].
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[serde(rename_all = "camelCase")]
pub struct ProcessReadResult<D = Blob> {
    pub process_id: String,
    pub stream: Stream,
    pub data: D,
    pub from_cursor: u64,
    pub next_cursor: u64,
    pub earliest_cursor: u64,
    pub gap: bool,
    pub truncated: bool,
    pub eof: bool,
    pub state: ProcState,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_signal: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// A file-transfer process's result, once it has ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_transfer: Option<FileTransferResult>,
}

wire_struct! {
    pub struct ProcessWriteParams {
        pub session_id: String,
        pub process_id: String,
        #[serde(default)]
        pub data: Blob,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        pub close_stdin: bool,
    }
}

wire_struct! {
    /// `{sessionId, processId}`: `process.interrupt`.
    pub struct ProcessRefParams {
        pub session_id: String,
        pub process_id: String,
    }
}

wire_struct! {
    pub struct ProcessTerminateParams {
        pub session_id: String,
        pub process_id: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub grace_ms: Option<u64>,
    }
}

wire_struct! {
    /// `{sessionId}`: `process.list` and other session-wide requests.
    pub struct SessionRefParams {
        pub session_id: String,
    }
}

wire_struct! {
    pub struct ProcessListResult {
        pub processes: Vec<ProcessState>,
    }
}

wire_struct! {
    pub struct ProcessStatusParams {
        pub session_id: String,
        pub process_id: String,
        pub state: ProcState,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub exit_code: Option<i32>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub exit_signal: Option<i32>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub ended_at: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub reason: Option<String>,
        pub observed_at: String,
    }
}
