//! Other v1.1 methods (PROTOCOL.md §11): workspace backup, skill install, fs.

wire_struct! {
    pub struct WorkspaceBackupParams {
        /// The session whose workspace is backed up (§5: every
        /// session-scoped request names it).
        pub session_id: String,
        pub backup_id: String,
        #[serde(default)]
        pub paths: Vec<String>,
        #[serde(default)]
        pub exclude: Vec<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub skip_if_fingerprint: Option<String>,
        /// Where the archive goes (a bmx extension: the harness's blob
        /// store, docs/protocol.md "Artifacts, backups and skills").
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub upload: Option<super::UploadTarget>,
        /// The harness's size limit for the archive (a bmx extension).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub max_bytes: Option<u64>,
    }
}

wire_struct! {
    pub struct WorkspaceBackupResult {
        pub state: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub digest: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub fingerprint: Option<String>,
        #[serde(default)]
        pub entries: u64,
        #[serde(default)]
        pub size_bytes: u64,
        #[serde(default)]
        pub skipped: bool,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub error: Option<String>,
        /// The archive, stored as an artifact of the session (a bmx
        /// extension; absent when skipped or failed).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub artifact_id: Option<String>,
    }
}

wire_struct! {
    pub struct SkillInstallParams {
        /// The session the skill is installed into (§5).
        pub session_id: String,
        pub skill_id: String,
        pub revision_id: String,
        pub digest: String,
        pub download_token: String,
        pub download_expires_at: String,
        /// Where to fetch the archive with `downloadToken` as bearer (a
        /// bmx extension; docs/protocol.md "Artifacts, backups and skills").
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub download_url: Option<String>,
    }
}

wire_struct! {
    pub struct SkillInstallResult {
        pub state: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub error: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub error_code: Option<String>,
    }
}

wire_struct! {
    /// `fs.mount` / `fs.unmount`: bmx does not offer `fs`, so the params are
    /// kept opaque and the answer is always -32012.
    pub struct FsParams {
        #[serde(flatten)]
        #[cfg_attr(test, proptest(strategy = "super::arb::json_map()"))]
        pub params: super::JsonMap,
    }
}
