//! `artifact.upload` (a bmx extension, docs/protocol.md "Artifacts, backups
//! and skills"): the harness asks the executor to upload a file of a
//! session's workspace; the bytes travel over a side HTTP upload to the
//! harness (resumable, by digest), the answer is the stored artifact.

wire_struct! {
    /// A file stored by the harness (`ArtifactRef` of the seed).
    pub struct ArtifactRef {
        pub artifact_id: String,
        pub name: String,
        pub mime_type: String,
        pub size_bytes: u64,
        /// `sha256:<64 hex>`.
        pub digest: String,
        /// RFC 3339, UTC.
        pub created_at: String,
    }
}

wire_struct! {
    /// Where the executor sends the bytes: `url` with
    /// `Authorization: Bearer <ticket>`.
    pub struct UploadTarget {
        pub url: String,
        pub ticket: String,
    }
}

wire_struct! {
    /// `artifact.upload {sessionId, path, name?, mimeType?, maxBytes?, upload}`.
    pub struct ArtifactUploadParams {
        pub session_id: String,
        /// A path in the session's workspace (the tools' boundary rules).
        pub path: String,
        /// The artifact's name (default: the file name of `path`).
        #[serde(skip_serializing_if = "Option::is_none")]
        pub name: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub mime_type: Option<String>,
        /// The harness's limit; the executor applies the smaller of it and
        /// its own, before reading the file.
        #[serde(skip_serializing_if = "Option::is_none")]
        pub max_bytes: Option<u64>,
        pub upload: UploadTarget,
    }
}

wire_struct! {
    /// The answer of `artifact.upload`.
    pub struct ArtifactUploadResult {
        pub artifact: ArtifactRef,
    }
}

wire_struct! {
    /// Body of `POST <upload url>`: what is about to be sent.
    pub struct UploadBegin {
        pub digest: String,
        pub size_bytes: u64,
        #[serde(default)]
        pub name: String,
        #[serde(default)]
        pub mime_type: String,
    }
}

wire_struct! {
    /// Answer of `POST` / `PATCH <upload url>`: bytes the harness holds;
    /// `artifact` once the whole blob is stored and verified.
    pub struct UploadStatus {
        pub offset: u64,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub artifact: Option<ArtifactRef>,
    }
}
