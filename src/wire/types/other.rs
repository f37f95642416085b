//! Other v1.1 methods (PROTOCOL.md §11): workspace backup, skill install, fs.

wire_struct! {
    pub struct WorkspaceBackupParams {
        pub backup_id: String,
        #[serde(default)]
        pub paths: Vec<String>,
        #[serde(default)]
        pub exclude: Vec<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub skip_if_fingerprint: Option<String>,
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
    }
}

wire_struct! {
    pub struct SkillInstallParams {
        pub skill_id: String,
        pub revision_id: String,
        pub digest: String,
        pub download_token: String,
        pub download_expires_at: String,
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
