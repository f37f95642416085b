#![no_main]

use std::sync::OnceLock;

/// One scratch directory for the whole run: the target only reads and
/// writes inside it (and checks that it never reaches the outside part).
fn scratch() -> &'static std::path::Path {
    static DIR: OnceLock<std::path::PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("bmx-fuzz-tools-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        dir
    })
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    bmx::fuzz::tool_input(scratch(), data);
});
