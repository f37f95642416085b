//! The console's files, embedded in the binary at build time
//! (`include_bytes!`): the page's own plain JavaScript and CSS from
//! `console/src/` and the vendored xterm.js build and noVNC modules
//! ([`novnc`]) from `console/dist/` (made by `scripts/console-assets.sh`,
//! committed so `cargo build` needs no npm).
//!
//! Every asset is served under `/console/assets/<hash>/<path>`, where
//! `<hash>` is a digest of *all* assets: one content hash for the set,
//! rather than one per file, because the page's ES modules import each
//! other by relative path (`./pages/process.js`), and a per-file hash
//! would need a rewriting bundler. Any change to any file changes every
//! URL, so the assets can be cached forever (`immutable`) and `/` (never
//! cached) names the current set.
//!
//! Text assets of 1 KiB or more are also kept gzip-compressed (computed
//! once, at the first request), served to browsers that accept it.

use sha2::{Digest, Sha256};
use std::borrow::Cow;
use std::collections::HashMap;
use std::io::Write;
use std::sync::OnceLock;

mod novnc;

/// Prefix of the hashed asset URLs.
pub const ASSETS_PATH: &str = "/console/assets";

struct Source {
    path: &'static str,
    /// Under `console/`.
    file: &'static str,
    bytes: &'static [u8],
}

macro_rules! source {
    ($path:literal, $file:literal) => {
        Source {
            path: $path,
            file: $file,
            bytes: include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/console/", $file)),
        }
    };
}

/// Every file the page may ask for, by the path it is served at.
const SOURCES: &[Source] = &[
    source!("app.js", "src/app.js"),
    source!("api.js", "src/api.js"),
    source!("ui.js", "src/ui.js"),
    source!("xterm-csp.js", "src/xterm-csp.js"),
    source!("pages/login.js", "src/pages/login.js"),
    source!("pages/executors.js", "src/pages/executors.js"),
    source!("pages/sessions.js", "src/pages/sessions.js"),
    source!("pages/session.js", "src/pages/session.js"),
    source!("pages/process.js", "src/pages/process.js"),
    source!("pages/terminal.js", "src/pages/terminal.js"),
    source!("pages/display.js", "src/pages/display.js"),
    source!("pages/turn.js", "src/pages/turn.js"),
    source!("pages/metrics.js", "src/pages/metrics.js"),
    source!("app.css", "src/app.css"),
    source!("icon.svg", "src/icon.svg"),
    source!("vendor/xterm.mjs", "dist/vendor/xterm.mjs"),
    source!("vendor/xterm.css", "dist/vendor/xterm.css"),
    source!("vendor/addon-fit.mjs", "dist/vendor/addon-fit.mjs"),
];

/// The page, with `{{base}}` standing for the hashed asset prefix.
const INDEX_TEMPLATE: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/console/src/index.html"
));

/// One servable file.
pub struct Asset {
    pub bytes: Cow<'static, [u8]>,
    /// The gzip form, when it is worth it.
    pub gzip: Option<Vec<u8>>,
    pub content_type: &'static str,
}

/// The asset set: its hash, its files and the page naming them.
pub struct Bundle {
    pub hash: String,
    pub index: String,
    pub index_gzip: Option<Vec<u8>>,
    assets: HashMap<&'static str, Asset>,
}

impl Bundle {
    pub fn get(&self, path: &str) -> Option<&Asset> {
        self.assets.get(path)
    }

    /// `/console/assets/<hash>`.
    pub fn base(&self) -> String {
        format!("{ASSETS_PATH}/{}", self.hash)
    }
}

/// The bundle, built at the first request.
pub fn bundle() -> &'static Bundle {
    static BUNDLE: OnceLock<Bundle> = OnceLock::new();
    BUNDLE.get_or_init(build)
}

/// A development aid: with `BMX_CONSOLE_DEV_DIR=<repo>/console` the
/// files are read from there when the bundle is built (once per process)
/// instead of the embedded copies, so editing the page's JavaScript needs
/// a harness restart, not a rebuild. Unset in production and in the tests.
fn load(s: &Source, dev: Option<&std::path::Path>) -> Cow<'static, [u8]> {
    if let Some(dir) = dev {
        match std::fs::read(dir.join(s.file)) {
            Ok(b) => return Cow::Owned(b),
            Err(e) => {
                tracing::warn!(file = s.file, error = %e, "BMX_CONSOLE_DEV_DIR: using the embedded copy")
            }
        }
    }
    Cow::Borrowed(s.bytes)
}

fn build() -> Bundle {
    let dev = std::env::var_os("BMX_CONSOLE_DEV_DIR").map(std::path::PathBuf::from);
    let loaded: Vec<(&Source, Cow<'static, [u8]>)> = SOURCES
        .iter()
        .chain(novnc::SOURCES)
        .map(|s| (s, load(s, dev.as_deref())))
        .collect();
    let mut h = Sha256::new();
    for (s, bytes) in &loaded {
        h.update(s.path.as_bytes());
        h.update((bytes.len() as u64).to_be_bytes());
        h.update(bytes);
    }
    let digest = h.finalize();
    let hash: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    let assets = loaded
        .into_iter()
        .map(|(s, bytes)| {
            let content_type = content_type(s.path);
            let gzip = if content_type.starts_with("text/") || content_type.contains("svg") {
                gzip(&bytes)
            } else {
                None
            };
            (
                s.path,
                Asset {
                    bytes,
                    gzip,
                    content_type,
                },
            )
        })
        .collect();
    let template = dev
        .as_deref()
        .and_then(|d| std::fs::read_to_string(d.join("src/index.html")).ok())
        .unwrap_or_else(|| INDEX_TEMPLATE.to_owned());
    let index = template.replace("{{base}}", &format!("{ASSETS_PATH}/{hash}"));
    let index_gzip = gzip(index.as_bytes());
    Bundle {
        hash,
        index,
        index_gzip,
        assets,
    }
}

/// The gzip form of `bytes` when they are 1 KiB or more and it is
/// smaller (below that, the header costs more than it saves).
fn gzip(bytes: &[u8]) -> Option<Vec<u8>> {
    if bytes.len() < 1024 {
        return None;
    }
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    enc.write_all(bytes).ok()?;
    let out = enc.finish().ok()?;
    (out.len() < bytes.len()).then_some(out)
}

/// By extension; every served path is in [`SOURCES`].
pub fn content_type(path: &str) -> &'static str {
    match path.rsplit_once('.').map(|(_, e)| e) {
        Some("js" | "mjs") => "text/javascript; charset=utf-8",
        Some("css") => "text/css; charset=utf-8",
        Some("html") => "text/html; charset=utf-8",
        Some("svg") => "image/svg+xml",
        Some("png") => "image/png",
        _ => "application/octet-stream",
    }
}

/// `Accept-Encoding` allows gzip (`q=0` refuses it).
pub fn accepts_gzip(accept_encoding: Option<&str>) -> bool {
    accept_encoding.is_some_and(|v| {
        v.split(',').any(|part| {
            let mut it = part.split(';');
            let name = it.next().unwrap_or("").trim();
            let refused = it.any(|p| {
                p.trim()
                    .strip_prefix("q=")
                    .and_then(|q| q.trim().parse::<f32>().ok())
                    .is_some_and(|q| q == 0.0)
            });
            (name.eq_ignore_ascii_case("gzip") || name == "*") && !refused
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_names_the_hashed_assets_and_they_exist() {
        let b = bundle();
        assert_eq!(b.hash.len(), 16);
        assert!(!b.index.contains("{{"), "every placeholder is filled");
        for needed in ["app.js", "app.css", "vendor/xterm.css"] {
            assert!(
                b.index.contains(&format!("{}/{needed}", b.base())),
                "index.html loads {needed}"
            );
        }
        // No inline script or style in the page (the CSP forbids them).
        assert!(!b.index.contains("<script>") && !b.index.contains("<style"));
        assert!(!b.index.contains(" style="));
        let xterm = b.get("vendor/xterm.mjs").unwrap();
        assert_eq!(xterm.content_type, "text/javascript; charset=utf-8");
        let gz = xterm.gzip.as_ref().expect("xterm.js is compressed");
        assert!(gz.len() < xterm.bytes.len() / 2);
        let mut back = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&gz[..]), &mut back).unwrap();
        assert_eq!(&back[..], &xterm.bytes[..]);
        assert!(b.get("../Cargo.toml").is_none());
    }

    /// The relative module specifiers (`from './x.js'`, `import '../y.js'`)
    /// in a JavaScript file.
    fn relative_imports(js: &str) -> Vec<&str> {
        let mut out = Vec::new();
        for key in ["from ", "import "] {
            for (at, _) in js.match_indices(key) {
                let rest = js[at + key.len()..].trim_start();
                let Some(q) = rest.chars().next().filter(|c| *c == '\'' || *c == '"') else {
                    continue;
                };
                let Some(end) = rest[1..].find(q) else {
                    continue;
                };
                let spec = &rest[1..1 + end];
                if spec.starts_with("./") || spec.starts_with("../") {
                    out.push(spec);
                }
            }
        }
        out
    }

    /// `spec` relative to the file at `from` (both asset paths).
    fn resolve(from: &str, spec: &str) -> Option<String> {
        let mut parts: Vec<&str> = from.split('/').collect();
        parts.pop();
        for p in spec.split('/') {
            match p {
                "." => {}
                ".." => {
                    parts.pop()?;
                }
                p => parts.push(p),
            }
        }
        Some(parts.join("/"))
    }

    /// Every relative import of every module resolves to an embedded
    /// file: the hashed prefix keeps the tree, so noVNC's
    /// `core/rfb.js` → `../vendor/pako/lib/zlib/inflate.js` and the
    /// page's `./pages/display.js` → `../vendor/novnc/core/rfb.js` work.
    #[test]
    fn every_relative_import_resolves_to_an_embedded_file() {
        let b = bundle();
        let mut checked = 0;
        for s in SOURCES.iter().chain(novnc::SOURCES) {
            if !(s.path.ends_with(".js") || s.path.ends_with(".mjs")) {
                continue;
            }
            let js = std::str::from_utf8(s.bytes).unwrap();
            for spec in relative_imports(js) {
                let target = resolve(s.path, spec)
                    .unwrap_or_else(|| panic!("{}: {spec} leaves the asset root", s.path));
                assert!(
                    b.get(&target).is_some(),
                    "{} imports {spec}: {target} is not embedded",
                    s.path
                );
                checked += 1;
            }
        }
        assert!(checked > 100, "only {checked} imports seen");
        assert!(b.get("vendor/novnc/core/rfb.js").is_some());
        assert!(b
            .get("vendor/novnc/vendor/pako/lib/zlib/inflate.js")
            .is_some());
    }

    /// The noVNC list and the files `scripts/console-assets.sh` copied
    /// agree, both ways (a new noVNC release adds or drops modules).
    #[test]
    fn every_vendored_novnc_module_is_embedded() {
        fn walk(dir: &std::path::Path, out: &mut Vec<String>) {
            for e in std::fs::read_dir(dir).unwrap().flatten() {
                let p = e.path();
                if p.is_dir() {
                    walk(&p, out);
                } else if p.extension().is_some_and(|x| x == "js") {
                    out.push(p.to_string_lossy().into_owned());
                }
            }
        }
        let console = concat!(env!("CARGO_MANIFEST_DIR"), "/console/");
        let mut on_disk = Vec::new();
        walk(
            std::path::Path::new(&format!("{console}dist/vendor/novnc")),
            &mut on_disk,
        );
        let mut on_disk: Vec<String> = on_disk
            .into_iter()
            .map(|p| p.trim_start_matches(console).to_owned())
            .collect();
        on_disk.sort();
        let mut listed: Vec<String> = novnc::SOURCES.iter().map(|s| s.file.to_owned()).collect();
        listed.sort();
        assert_eq!(
            listed, on_disk,
            "src/harness/http/console/assets/novnc.rs is out of date"
        );
        assert!(listed.len() > 40);
    }

    #[test]
    fn accept_encoding() {
        assert!(accepts_gzip(Some("gzip, deflate, br")));
        assert!(accepts_gzip(Some("br;q=1.0, gzip;q=0.8")));
        assert!(accepts_gzip(Some("*")));
        assert!(!accepts_gzip(Some("gzip;q=0")));
        assert!(!accepts_gzip(Some("br")));
        assert!(!accepts_gzip(None));
    }
}
