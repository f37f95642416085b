//! TLS to PostgreSQL (docs/store.md, "TLS"): libpq's `sslmode` and
//! `sslrootcert` in the `--store` URL, on rustls.
//!
//! tokio-postgres knows only `disable`, `prefer` and `require`, and never
//! checks a certificate itself (that is the TLS connector's job), so the
//! two keys are taken off the URL here and turned into a mode for the
//! client plus a certificate verifier, with libpq's meanings, so a URL
//! that works with `psql` means the same thing to bmx:
//!
//! | `sslmode` | TLS | certificate checked |
//! | --- | --- | --- |
//! | `disable` | never | — |
//! | `allow`, `prefer` (default) | if the server offers it | only with `sslrootcert` (chain, as `verify-ca`) |
//! | `require` | always | only with `sslrootcert` (chain, as `verify-ca`) |
//! | `verify-ca` | always | chain up to the roots |
//! | `verify-full` | always | chain and host name |
//!
//! The roots are the PEM file `sslrootcert` names, or the system's trust
//! store when it is absent or `system` (libpq's `sslrootcert=system`).
//! libpq's other default, `~/.postgresql/root.crt`, is not read: a daemon
//! should not depend on its user's home directory. Client certificates
//! (`sslcert`, `sslkey`) are not supported; the client refuses the URL.
//!
//! Even unchecked, the handshake's signatures are verified, so the server
//! proves it holds the key of the certificate it showed: what `prefer`
//! and `require` give up is only *whose* key that is (an active
//! man-in-the-middle), as with libpq. `verify-full` is what to use across
//! a network you do not control.

use postgres::config::SslMode;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};
use std::sync::Arc;
use tokio_postgres_rustls::MakeRustlsConnect;

/// The TLS connector every connection of the store uses.
pub type Tls = MakeRustlsConnect;

/// What the URL asked for, with the two keys taken off it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsUrl {
    /// The URL without `sslmode` and `sslrootcert`, for tokio-postgres.
    pub rest: String,
    pub mode: Mode,
    /// `sslrootcert`: a PEM file, or `system`.
    pub root_cert: Option<String>,
}

/// libpq's `sslmode` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Disable,
    Allow,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl Mode {
    fn parse(s: &str) -> Option<Mode> {
        Some(match s {
            "disable" => Mode::Disable,
            "allow" => Mode::Allow,
            "prefer" => Mode::Prefer,
            "require" => Mode::Require,
            "verify-ca" => Mode::VerifyCa,
            "verify-full" => Mode::VerifyFull,
            _ => return None,
        })
    }

    /// What tokio-postgres is told: whether TLS is tried and whether it
    /// is required. `allow` (plain first, TLS if refused) has no match
    /// there; it is taken as `prefer`, which encrypts more, not less.
    pub fn client_mode(self) -> SslMode {
        match self {
            Mode::Disable => SslMode::Disable,
            Mode::Allow | Mode::Prefer => SslMode::Prefer,
            Mode::Require | Mode::VerifyCa | Mode::VerifyFull => SslMode::Require,
        }
    }

    /// The name logs show.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Disable => "disable",
            Mode::Allow => "allow",
            Mode::Prefer => "prefer",
            Mode::Require => "require",
            Mode::VerifyCa => "verify-ca",
            Mode::VerifyFull => "verify-full",
        }
    }
}

/// Why the TLS part of a URL cannot be used. Never holds the URL (it may
/// hold a password), only the offending key's value.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("sslmode `{0}` is not one of disable, allow, prefer, require, verify-ca, verify-full")]
    BadMode(String),
    #[error("`{0}` given twice")]
    Twice(&'static str),
    #[error("a value is not valid percent-encoded UTF-8")]
    Encoding,
    #[error("sslrootcert {path}: {reason}")]
    RootCert { path: String, reason: String },
    #[error("no usable certificate in the system's trust store")]
    NoSystemRoots,
    #[error("TLS set-up: {0}")]
    Rustls(#[from] rustls::Error),
}

/// Take `sslmode` and `sslrootcert` off `url`'s query.
///
/// # Errors
///
/// A key given twice, a value that does not decode, an unknown mode.
pub fn split(url: &str) -> Result<TlsUrl, TlsError> {
    let (head, fragment) = match url.split_once('#') {
        Some((h, f)) => (h, Some(f)),
        None => (url, None),
    };
    let (base, query) = match head.split_once('?') {
        Some((b, q)) => (b, q),
        None => (head, ""),
    };
    let mut mode = None;
    let mut root_cert = None;
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let decoded = || {
            percent_encoding::percent_decode_str(value)
                .decode_utf8()
                .map(|v| v.into_owned())
                .map_err(|_| TlsError::Encoding)
        };
        match key {
            "sslmode" => {
                let v = decoded()?;
                let m = Mode::parse(&v).ok_or(TlsError::BadMode(v))?;
                if mode.replace(m).is_some() {
                    return Err(TlsError::Twice("sslmode"));
                }
            }
            "sslrootcert" => {
                if root_cert.replace(decoded()?).is_some() {
                    return Err(TlsError::Twice("sslrootcert"));
                }
            }
            _ => kept.push(pair),
        }
    }
    let mut rest = base.to_owned();
    if !kept.is_empty() {
        rest.push('?');
        rest.push_str(&kept.join("&"));
    }
    if let Some(f) = fragment {
        rest.push('#');
        rest.push_str(f);
    }
    Ok(TlsUrl {
        rest,
        mode: mode.unwrap_or(Mode::Prefer),
        root_cert,
    })
}

/// The connector for `mode` and `root_cert` (see the module's table).
///
/// # Errors
///
/// The root file cannot be read or holds no certificate; the system's
/// store has none.
pub fn connector(mode: Mode, root_cert: Option<&str>) -> Result<Tls, TlsError> {
    // ring, not aws-lc-rs: no C library of a few hundred thousand lines to
    // build (aws-lc-sys) for one database connection. rustls deprecates
    // ring's provider because it has no post-quantum key exchange; that
    // is the trade taken (docs/store.md, "TLS").
    #[allow(deprecated)]
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let check = match (mode, root_cert) {
        (Mode::Disable, _) => Check::Nothing,
        (Mode::Allow | Mode::Prefer | Mode::Require, None) => Check::Nothing,
        (Mode::Allow | Mode::Prefer | Mode::Require | Mode::VerifyCa, Some(_))
        | (Mode::VerifyCa, None) => Check::Chain,
        (Mode::VerifyFull, _) => Check::Full,
    };
    let verifier: Arc<dyn ServerCertVerifier> = match check {
        Check::Nothing => Arc::new(Unchecked(provider.clone())),
        Check::Chain | Check::Full => {
            let roots = Arc::new(roots(root_cert)?);
            let inner = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
                .build()
                .map_err(|e| TlsError::Rustls(rustls::Error::General(e.to_string())))?;
            if check == Check::Full {
                inner
            } else {
                Arc::new(ChainOnly(inner))
            }
        }
    };
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    Ok(MakeRustlsConnect::new(config))
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Check {
    Nothing,
    Chain,
    Full,
}

fn roots(root_cert: Option<&str>) -> Result<RootCertStore, TlsError> {
    let mut store = RootCertStore::empty();
    match root_cert {
        None | Some("system") => {
            // Unreadable entries are skipped: one bad file in
            // /etc/ssl/certs must not make every other root unusable.
            let found = rustls_native_certs::load_native_certs();
            let (added, _) = store.add_parsable_certificates(found.certs);
            if added == 0 {
                return Err(TlsError::NoSystemRoots);
            }
        }
        Some(path) => {
            let bad = |reason: String| TlsError::RootCert {
                path: path.to_owned(),
                reason,
            };
            let certs = CertificateDer::pem_file_iter(path)
                .map_err(|e| bad(e.to_string()))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| bad(e.to_string()))?;
            if certs.is_empty() {
                return Err(bad("no certificate in the file".into()));
            }
            for c in certs {
                store.add(c).map_err(|e| bad(e.to_string()))?;
            }
        }
    }
    Ok(store)
}

/// `prefer`/`require` without roots: any certificate, but the handshake's
/// signatures are still checked against it.
#[derive(Debug)]
struct Unchecked(Arc<CryptoProvider>);

impl ServerCertVerifier for Unchecked {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `verify-ca`: the full check, but a certificate that is good except for
/// the host name passes.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_two_keys_come_off_and_the_rest_stays_in_order() {
        let t = split(
            "postgres://u:pw@db:5432/x?application_name=a&sslmode=verify-full\
             &sslrootcert=%2Fetc%2Fca.pem&connect_timeout=3",
        )
        .unwrap();
        assert_eq!(
            t.rest,
            "postgres://u:pw@db:5432/x?application_name=a&connect_timeout=3"
        );
        assert_eq!(t.mode, Mode::VerifyFull);
        assert_eq!(t.root_cert.as_deref(), Some("/etc/ca.pem"));
    }

    #[test]
    fn no_query_means_prefer_and_an_untouched_url() {
        let t = split("postgresql://db/x").unwrap();
        assert_eq!(t.rest, "postgresql://db/x");
        assert_eq!(t.mode, Mode::Prefer);
        assert_eq!(t.root_cert, None);
        let t = split("postgres://db/x?sslmode=disable").unwrap();
        assert_eq!(
            (t.rest.as_str(), t.mode),
            ("postgres://db/x", Mode::Disable)
        );
    }

    #[test]
    fn bad_modes_and_repeats_are_refused_without_the_url() {
        let e = split("postgres://u:secret@db/x?sslmode=verify").unwrap_err();
        assert!(matches!(e, TlsError::BadMode(ref m) if m == "verify"));
        assert!(!e.to_string().contains("secret"));
        assert!(matches!(
            split("postgres://db/x?sslmode=require&sslmode=disable"),
            Err(TlsError::Twice("sslmode"))
        ));
        assert!(matches!(
            split("postgres://db/x?sslrootcert=%FF"),
            Err(TlsError::Encoding)
        ));
    }

    #[test]
    fn modes_map_onto_the_clients_three() {
        assert_eq!(Mode::Allow.client_mode(), SslMode::Prefer);
        assert_eq!(Mode::VerifyCa.client_mode(), SslMode::Require);
        assert_eq!(Mode::Disable.client_mode(), SslMode::Disable);
    }

    #[test]
    fn a_missing_or_empty_root_file_is_an_error_naming_it() {
        let Err(e) = connector(Mode::VerifyFull, Some("/nonexistent/ca.pem")) else {
            panic!("a missing root file was taken");
        };
        assert!(e.to_string().contains("/nonexistent/ca.pem"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "").unwrap();
        let Err(e) = connector(Mode::VerifyCa, empty.to_str()) else {
            panic!("an empty root file was taken");
        };
        assert!(e.to_string().contains("no certificate"), "{e}");
        assert!(connector(Mode::Require, None).is_ok());
    }
}
