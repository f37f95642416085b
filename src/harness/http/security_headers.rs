//! The headers that keep what the harness answers from running in a
//! browser on its origin (issue 56, item 1).
//!
//! **Every answer** gets [`apply`]: `nosniff`, no referrer, no framing,
//! and a CSP that allows nothing ([`API_CSP`]). An answer that brings its
//! own CSP keeps it: the console's pages have a stricter one of their own
//! that allows their scripts (`console::CSP`).
//!
//! **Content a session chose** (artifacts, workspace backups, session
//! output files, skill archives) is served as a download
//! ([`session_content`]): `Content-Disposition: attachment` with a
//! filename made safe, and `Content-Security-Policy: sandbox`, so that
//! even a browser that rendered it would give it an opaque origin with no
//! script, no cookie and no same-origin reads. Its `Content-Type` is not
//! the one the session declared unless that is one of a few types no
//! browser runs ([`INERT_TYPES`]); anything else is
//! `application/octet-stream`. The declared type stays in the artifact's
//! JSON (`mimeType`) for clients that want it.
//!
//! Why: an agent wrote `report.html` whose script, opened by a logged-in
//! operator, read the console's CSRF token, created a session and ran `id`
//! on an executor (tests/security/web_content.rs replays it in Chromium).

use http::header::{self, HeaderMap, HeaderValue};

/// The CSP of every answer that has none of its own: nothing may load,
/// nothing may frame it. JSON needs nothing else.
pub const API_CSP: &str = "default-src 'none'; frame-ancestors 'none'";

/// The CSP of content a session chose: also `sandbox` (an opaque origin,
/// no script, no forms, no popups).
pub const SESSION_CONTENT_CSP: &str = "sandbox; default-src 'none'; frame-ancestors 'none'";

/// Declared types served as they are: none of them is run or rendered as
/// a document by a browser. Compared on the essence (`type/subtype`,
/// lower case); parameters are dropped.
pub const INERT_TYPES: [&str; 10] = [
    "text/plain",
    "application/json",
    "image/png",
    "image/jpeg",
    "image/gif",
    "image/webp",
    "application/zip",
    "application/gzip",
    "application/x-tar",
    "application/zstd",
];

/// Add the headers every answer carries; those already set stay (a
/// console page's own CSP).
pub fn apply(h: &mut HeaderMap) {
    for (name, value) in [
        (header::CONTENT_SECURITY_POLICY, API_CSP),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "no-referrer"),
        (header::X_FRAME_OPTIONS, "DENY"),
    ] {
        if !h.contains_key(&name) {
            h.insert(name, HeaderValue::from_static(value));
        }
    }
}

/// The `Content-Type` a download of `declared` is served with.
pub fn served_type(declared: Option<&str>) -> &'static str {
    let essence = declared
        .and_then(|d| d.split(';').next())
        .map(|e| e.trim().to_ascii_lowercase());
    essence
        .and_then(|e| INERT_TYPES.iter().find(|t| **t == e).copied())
        .unwrap_or("application/octet-stream")
}

/// The headers of a download of content a session chose, named `name`
/// (a file name of the session's choosing) with declared type `declared`.
pub fn session_content(h: &mut HeaderMap, name: &str, declared: Option<&str>) {
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(served_type(declared)),
    );
    if let Ok(v) = HeaderValue::from_str(&attachment(name)) {
        h.insert(header::CONTENT_DISPOSITION, v);
    }
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(SESSION_CONTENT_CSP),
    );
    apply(h);
}

/// Longest file name offered (characters of the name before encoding).
const MAX_NAME_CHARS: usize = 128;

/// `attachment; filename="…"; filename*=UTF-8''…` (RFC 6266) for a name
/// of a session's choosing: only the last path component, no control
/// characters; `filename` is its ASCII form (anything else is `_`),
/// `filename*` the UTF-8 name percent-encoded. The result is always a
/// valid header value.
pub fn attachment(name: &str) -> String {
    let base = name.rsplit(['/', '\\']).next().unwrap_or("");
    let clean: String = base
        .chars()
        .filter(|c| !c.is_control() && !is_bidi_control(*c) && *c != '"')
        .take(MAX_NAME_CHARS)
        .collect();
    let clean = clean.trim().trim_start_matches('.');
    let clean = if clean.is_empty() { "download" } else { clean };
    let ascii: String = clean
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | ' ' | '+' | ',') {
                c
            } else {
                '_'
            }
        })
        .collect();
    let mut encoded = String::with_capacity(clean.len() * 3);
    for b in clean.bytes() {
        // RFC 5987 attr-char.
        if b.is_ascii_alphanumeric() || b"!#$&+-.^_`|~".contains(&b) {
            encoded.push(b as char);
        } else {
            encoded.push_str(&format!("%{b:02X}"));
        }
    }
    format!("attachment; filename=\"{ascii}\"; filename*=UTF-8''{encoded}")
}

/// The Unicode bidirectional embedding, override and isolate controls: a
/// name holding them can display as another name.
fn is_bidi_control(c: char) -> bool {
    matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn only_inert_types_are_kept() {
        assert_eq!(served_type(Some("text/plain")), "text/plain");
        assert_eq!(served_type(Some("Text/Plain; charset=utf-8")), "text/plain");
        assert_eq!(served_type(Some("image/png")), "image/png");
        for active in [
            "text/html",
            "image/svg+xml",
            "application/xhtml+xml",
            "text/xml",
            "application/pdf",
            "text/javascript",
            "",
        ] {
            assert_eq!(
                served_type(Some(active)),
                "application/octet-stream",
                "{active}"
            );
        }
        assert_eq!(served_type(None), "application/octet-stream");
    }

    #[test]
    fn names_are_made_safe() {
        assert_eq!(
            attachment("report.html"),
            "attachment; filename=\"report.html\"; filename*=UTF-8''report.html"
        );
        assert_eq!(
            attachment("../../etc/passwd"),
            "attachment; filename=\"passwd\"; filename*=UTF-8''passwd"
        );
        let evil = attachment("a\"; filename=x.html\r\nSet-Cookie: y\u{202e}lmth.txt");
        assert!(!evil.contains('\r') && !evil.contains('\n'), "{evil}");
        assert_eq!(evil.matches('"').count(), 2, "{evil}");
        assert_eq!(attachment(""), attachment("download"));
        assert_eq!(attachment("..."), attachment("download"));
        assert!(attachment("résumé.txt").contains("filename*=UTF-8''r%C3%A9sum%C3%A9.txt"));
    }

    #[test]
    fn apply_keeps_a_csp_already_set() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static("script-src 'self'"),
        );
        apply(&mut h);
        assert_eq!(h[header::CONTENT_SECURITY_POLICY], "script-src 'self'");
        assert_eq!(h[header::X_CONTENT_TYPE_OPTIONS], "nosniff");
        assert_eq!(h[header::X_FRAME_OPTIONS], "DENY");
        let mut d = HeaderMap::new();
        session_content(&mut d, "x.svg", Some("image/svg+xml"));
        assert_eq!(d[header::CONTENT_TYPE], "application/octet-stream");
        assert!(d[header::CONTENT_SECURITY_POLICY]
            .to_str()
            .unwrap()
            .starts_with("sandbox"));
    }

    proptest! {
        /// Whatever the name: a valid header value, one quoted ASCII
        /// filename without quotes or separators inside, and an attachment.
        #[test]
        fn any_name_makes_a_valid_attachment_header(name in ".{0,300}") {
            let v = attachment(&name);
            prop_assert!(HeaderValue::from_str(&v).is_ok());
            prop_assert!(v.starts_with("attachment; filename=\""));
            prop_assert_eq!(v.matches('"').count(), 2);
            let quoted = v.split('"').nth(1).unwrap();
            prop_assert!(!quoted.is_empty());
            prop_assert!(quoted.bytes().all(|b| b.is_ascii_graphic() || b == b' '));
            prop_assert!(!quoted.contains('/') && !quoted.contains('\\'));
        }
    }
}
