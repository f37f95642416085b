//! Browser authentication for the console, as a sans-IO core: the table of
//! console sessions (cookie → CSRF token, bounded, with expiry) and the
//! rule that decides whether a request may pass ([`decide`]), given the
//! facts read from its headers and an explicit `now`.
//!
//! Why a cookie at all: a browser cannot put `Authorization` on a
//! WebSocket, so the terminal relay could not be reached from a page with
//! the Bearer token alone. A cookie is ambient authority, though: any site
//! the operator visits could make the browser send it. Hence the three
//! rules that only apply to cookie-authenticated requests:
//!
//! * the cookie is `HttpOnly; SameSite=Strict` (never readable by a
//!   script, never sent on a cross-site request);
//! * a WebSocket upgrade also needs an `Origin` equal to the harness's own
//!   origin (browsers always send it on WebSockets; `SameSite` says
//!   nothing about same-*site* but cross-*origin* pages);
//! * a state-changing request needs the session's CSRF token in
//!   [`CSRF_HEADER`] (a header no cross-origin page can set without a
//!   CORS preflight, which the harness never grants).
//!
//! Bearer requests are not ambient (the caller holds the token) and skip
//! all three. Without an API token (the local `bmx up`, loopback only)
//! there is nothing to log in with, and being on loopback is the only
//! protection; [`open_mode`] then refuses, on every route and method
//! (WebSocket upgrades included), a request whose `Origin` is another
//! origin than this harness (a cross-site page), and a request whose
//! `Host` is not a loopback name (`localhost`, `127.x.x.x`, `[::1]`, with
//! any port): a DNS-rebinding page's requests carry its own name, which
//! resolved to 127.0.0.1 but is not a loopback name (issue 56, item 3).

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Name of the session cookie.
pub const COOKIE: &str = "bmx_console";
/// Header carrying the CSRF token on state-changing cookie requests.
pub const CSRF_HEADER: &str = "x-csrf-token";
/// Console sessions kept at most; a login past it evicts the oldest.
pub const MAX_SESSIONS: usize = 64;
/// How long a console session lives (absolute, from the login).
pub const SESSION_TTL: Duration = Duration::from_secs(12 * 3600);
/// Length of a session id and of a CSRF token: 32 random bytes in hex.
pub const SECRET_HEX_LEN: usize = 64;

struct Entry {
    csrf: String,
    expires: Instant,
    /// Login order, for eviction.
    serial: u64,
}

/// Console sessions: id → CSRF token. Bounded by `max`; entries expire
/// `ttl` after their login.
pub struct SessionTable {
    max: usize,
    ttl: Duration,
    serial: u64,
    entries: HashMap<String, Entry>,
}

impl SessionTable {
    pub fn new(max: usize, ttl: Duration) -> SessionTable {
        SessionTable {
            max: max.max(1),
            ttl,
            serial: 0,
            entries: HashMap::new(),
        }
    }

    /// Record a login with a freshly minted `id` and `csrf` (the caller
    /// draws them from a CSPRNG: this core does no I/O). Expired entries
    /// go first; at the cap, the oldest login is evicted.
    pub fn insert(&mut self, id: String, csrf: String, now: Instant) {
        self.entries.retain(|_, e| e.expires > now);
        while self.entries.len() >= self.max {
            let oldest = self
                .entries
                .iter()
                .min_by_key(|(_, e)| e.serial)
                .map(|(k, _)| k.clone());
            match oldest {
                Some(k) => {
                    self.entries.remove(&k);
                }
                None => break,
            }
        }
        self.serial += 1;
        self.entries.insert(
            id,
            Entry {
                csrf,
                expires: now + self.ttl,
                serial: self.serial,
            },
        );
    }

    /// The CSRF token of a live session `id` (an expired one is removed).
    pub fn csrf(&mut self, id: &str, now: Instant) -> Option<&str> {
        if self.entries.get(id).is_some_and(|e| e.expires <= now) {
            self.entries.remove(id);
        }
        self.entries.get(id).map(|e| e.csrf.as_str())
    }

    /// Seconds a live session has left.
    pub fn remaining(&self, id: &str, now: Instant) -> Option<Duration> {
        self.entries
            .get(id)
            .and_then(|e| e.expires.checked_duration_since(now))
            .filter(|d| !d.is_zero())
    }

    pub fn remove(&mut self, id: &str) {
        self.entries.remove(id);
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// What the harness is configured with.
#[derive(Debug, Clone, Copy)]
pub struct Policy<'a> {
    /// `--api-token`.
    pub token: Option<&'a str>,
    /// The origin of `--public-url` (`https://h.example`), accepted as
    /// the harness's own besides the one its `Host` header names.
    pub public_origin: Option<&'a str>,
    /// `--allow-open-api`: the token-less API is served on the network by
    /// choice, so `Host` names whatever the clients dial; only the
    /// `Origin` rule holds then.
    pub open_network: bool,
}

/// What a request shows, read from its headers.
#[derive(Debug, Clone, Copy, Default)]
pub struct Facts<'a> {
    /// Not GET, HEAD or OPTIONS.
    pub unsafe_method: bool,
    /// A WebSocket upgrade.
    pub websocket: bool,
    pub bearer: Option<&'a str>,
    /// The [`COOKIE`] value.
    pub cookie: Option<&'a str>,
    /// The [`CSRF_HEADER`] value.
    pub csrf: Option<&'a str>,
    pub origin: Option<&'a str>,
    pub host: Option<&'a str>,
    /// Came over the API's Unix socket, which no browser page can reach.
    pub local_socket: bool,
}

/// Why a request is refused with 403.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// `Origin` names another origin than this harness.
    CrossOrigin,
    /// A cookie WebSocket upgrade without `Origin`.
    NoOrigin,
    /// A state-changing cookie request without the right CSRF token.
    Csrf,
    /// No API token: a browser request from a host name that is not a
    /// loopback name.
    NotLoopback,
}

impl Refusal {
    pub fn reason(self) -> &'static str {
        match self {
            Refusal::CrossOrigin => "cross_origin",
            Refusal::NoOrigin => "origin_required",
            Refusal::Csrf => "csrf",
            Refusal::NotLoopback => "not_loopback",
        }
    }

    pub fn message(self) -> &'static str {
        match self {
            Refusal::CrossOrigin => "the Origin of this request is not the harness's own",
            Refusal::NoOrigin => "a WebSocket authenticated by cookie needs an Origin header",
            Refusal::Csrf => {
                "a state-changing request authenticated by cookie needs its x-csrf-token"
            }
            Refusal::NotLoopback => {
                "without an API token the harness answers only requests to a loopback host name"
            }
        }
    }
}

/// The decision on one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Let it through: it showed a credential (or there is none to
    /// show), so its connection also leaves the unauthenticated list.
    Pass,
    /// 401: no valid credential.
    Unauthorized,
    /// 403.
    Forbidden(Refusal),
}

/// Decide on a request to a route that needs the API credential.
/// `csrf_of` looks a cookie's session up (the caller's
/// [`SessionTable::csrf`] at its `now`); it is only called for a request
/// that relies on a cookie, so Bearer traffic never touches the table.
pub fn decide(
    policy: Policy<'_>,
    f: Facts<'_>,
    csrf_of: impl FnOnce(&str) -> Option<String>,
) -> Verdict {
    let Some(token) = policy.token else {
        return open_mode(policy, f, false);
    };
    if let Some(b) = f.bearer {
        return if super::super::same_secret(b, token) {
            Verdict::Pass
        } else {
            Verdict::Unauthorized
        };
    }
    let Some(expected) = f.cookie.and_then(csrf_of) else {
        return Verdict::Unauthorized;
    };
    match f.origin {
        Some(o) if !same_origin(o, f.host, policy.public_origin) => {
            return Verdict::Forbidden(Refusal::CrossOrigin)
        }
        None if f.websocket => return Verdict::Forbidden(Refusal::NoOrigin),
        _ => {}
    }
    if f.unsafe_method
        && !f
            .csrf
            .is_some_and(|c| super::super::same_secret(c, &expected))
    {
        return Verdict::Forbidden(Refusal::Csrf);
    }
    Verdict::Pass
}

/// The rule of a harness without an API token, for every request: a
/// browser page of another origin is refused (`cross_origin`), and so is
/// a request whose `Host` is not a loopback name (`not_loopback`), unless
/// the host does not matter: `host_exempt` (a route that checks a secret
/// of its own: the executors' connect, relays, upload and download
/// tickets; being on loopback is not what protects those), the API's
/// Unix socket, or `--allow-open-api`. A request without `Host` (HTTP/1.0)
/// is not known to be for a loopback name and is refused.
pub fn open_mode(policy: Policy<'_>, f: Facts<'_>, host_exempt: bool) -> Verdict {
    if let Some(o) = f.origin {
        if !same_origin(o, f.host, policy.public_origin) {
            return Verdict::Forbidden(Refusal::CrossOrigin);
        }
    }
    let host_matters = !(host_exempt || f.local_socket || policy.open_network);
    if host_matters && !f.host.is_some_and(is_loopback_host) {
        return Verdict::Forbidden(Refusal::NotLoopback);
    }
    Verdict::Pass
}

/// `origin` is this harness: `http(s)://` + the request's `Host`, or the
/// public URL's origin. Compared case-insensitively (host names are).
pub fn same_origin(origin: &str, host: Option<&str>, public_origin: Option<&str>) -> bool {
    let o = origin.trim().to_ascii_lowercase();
    if public_origin.is_some_and(|p| p.eq_ignore_ascii_case(&o)) {
        return true;
    }
    let Some(host) = host.map(str::trim).filter(|h| !h.is_empty()) else {
        return false;
    };
    let rest = o
        .strip_prefix("http://")
        .or_else(|| o.strip_prefix("https://"));
    rest.is_some_and(|r| r.eq_ignore_ascii_case(host))
}

/// `Host` (with or without a port) names the loopback: `localhost`,
/// `127.x.x.x` or `[::1]`.
pub fn is_loopback_host(host: &str) -> bool {
    let host = host.trim();
    let name = if let Some(rest) = host.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else {
        host.rsplit_once(':').map_or(host, |(h, _)| h)
    };
    if name.eq_ignore_ascii_case("localhost") {
        return true;
    }
    name.parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_loopback())
}

/// The origin (`scheme://host[:port]`) of a `--public-url`, if it has an
/// http(s) or ws(s) scheme (ws is read as http, wss as https).
pub fn origin_of(url: &str) -> Option<String> {
    let u = url.trim();
    let (scheme, rest) = u.split_once("://")?;
    let scheme = match scheme.to_ascii_lowercase().as_str() {
        "http" | "ws" => "http",
        "https" | "wss" => "https",
        _ => return None,
    };
    let host = rest.split(['/', '?', '#']).next().unwrap_or("");
    (!host.is_empty()).then(|| format!("{scheme}://{}", host.to_ascii_lowercase()))
}

/// The value of the [`COOKIE`] cookie among `Cookie` header values; only
/// a well-formed id (hex of [`SECRET_HEX_LEN`]) is returned.
pub fn cookie_value<'a>(headers: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    headers
        .into_iter()
        .flat_map(|h| h.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(k, _)| *k == COOKIE)
        .map(|(_, v)| v.trim().trim_matches('"'))
        .filter(|v| is_secret(v))
}

/// A session id or CSRF token as minted: lowercase hex of the right length.
pub fn is_secret(v: &str) -> bool {
    v.len() == SECRET_HEX_LEN && v.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// A fresh session id or CSRF token (32 bytes from the thread's CSPRNG).
pub fn mint() -> String {
    rand::random::<[u8; 32]>()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The `Set-Cookie` of a login; `Secure` when the harness is reached over
/// https (its public URL says so).
pub fn set_cookie(id: &str, ttl: Duration, secure: bool) -> String {
    format!(
        "{COOKIE}={id}; Path=/; HttpOnly; SameSite=Strict; Max-Age={}{}",
        ttl.as_secs(),
        if secure { "; Secure" } else { "" }
    )
}

/// The `Set-Cookie` that removes the session cookie.
pub fn clear_cookie(secure: bool) -> String {
    format!(
        "{COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0{}",
        if secure { "; Secure" } else { "" }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "the-api-token";
    const HOST: &str = "127.0.0.1:7070";
    const SELF: &str = "http://127.0.0.1:7070";

    fn with_token() -> Policy<'static> {
        Policy {
            token: Some(TOKEN),
            public_origin: None,
            open_network: false,
        }
    }

    fn open() -> Policy<'static> {
        Policy {
            token: None,
            public_origin: None,
            open_network: false,
        }
    }

    fn logged_in(now: Instant) -> (SessionTable, String, String) {
        let mut t = SessionTable::new(4, Duration::from_secs(60));
        let (id, csrf) = (mint(), mint());
        t.insert(id.clone(), csrf.clone(), now);
        (t, id, csrf)
    }

    fn run(p: Policy<'_>, f: Facts<'_>, t: &mut SessionTable, now: Instant) -> Verdict {
        decide(p, f, |id| t.csrf(id, now).map(str::to_owned))
    }

    fn facts<'a>(cookie: &'a str) -> Facts<'a> {
        Facts {
            cookie: Some(cookie),
            host: Some(HOST),
            ..Facts::default()
        }
    }

    #[test]
    fn bearer_passes_without_csrf_or_origin() {
        let now = Instant::now();
        let mut t = SessionTable::new(4, Duration::from_secs(60));
        let f = Facts {
            unsafe_method: true,
            websocket: true,
            bearer: Some(TOKEN),
            origin: Some("https://evil.example"),
            host: Some(HOST),
            ..Facts::default()
        };
        assert_eq!(run(with_token(), f, &mut t, now), Verdict::Pass);
        let wrong = Facts {
            bearer: Some("nope"),
            ..f
        };
        assert_eq!(run(with_token(), wrong, &mut t, now), Verdict::Unauthorized);
        // A wrong Bearer is not rescued by a cookie.
        let (mut t, id, _) = logged_in(now);
        let both = Facts {
            bearer: Some("nope"),
            ..facts(&id)
        };
        assert_eq!(run(with_token(), both, &mut t, now), Verdict::Unauthorized);
    }

    #[test]
    fn a_cookie_reads_but_writes_only_with_its_csrf_token() {
        let now = Instant::now();
        let (mut t, id, csrf) = logged_in(now);
        assert_eq!(run(with_token(), facts(&id), &mut t, now), Verdict::Pass);
        let post = Facts {
            unsafe_method: true,
            ..facts(&id)
        };
        assert_eq!(
            run(with_token(), post, &mut t, now),
            Verdict::Forbidden(Refusal::Csrf)
        );
        let other = mint();
        let wrong = Facts {
            csrf: Some(&other),
            ..post
        };
        assert_eq!(
            run(with_token(), wrong, &mut t, now),
            Verdict::Forbidden(Refusal::Csrf)
        );
        let right = Facts {
            csrf: Some(&csrf),
            origin: Some(SELF),
            ..post
        };
        assert_eq!(run(with_token(), right, &mut t, now), Verdict::Pass);
        // Nobody's cookie, or none: 401.
        let stranger = mint();
        assert_eq!(
            run(with_token(), facts(&stranger), &mut t, now),
            Verdict::Unauthorized
        );
        assert_eq!(
            run(with_token(), Facts::default(), &mut t, now),
            Verdict::Unauthorized
        );
    }

    #[test]
    fn a_cookie_websocket_needs_the_harness_origin() {
        let now = Instant::now();
        let (mut t, id, _) = logged_in(now);
        let ws = Facts {
            websocket: true,
            ..facts(&id)
        };
        assert_eq!(
            run(with_token(), ws, &mut t, now),
            Verdict::Forbidden(Refusal::NoOrigin)
        );
        let foreign = Facts {
            origin: Some("http://evil.example"),
            ..ws
        };
        assert_eq!(
            run(with_token(), foreign, &mut t, now),
            Verdict::Forbidden(Refusal::CrossOrigin)
        );
        // Same host, other port: another origin.
        let port = Facts {
            origin: Some("http://127.0.0.1:7071"),
            ..ws
        };
        assert_eq!(
            run(with_token(), port, &mut t, now),
            Verdict::Forbidden(Refusal::CrossOrigin)
        );
        let own = Facts {
            origin: Some(SELF),
            ..ws
        };
        assert_eq!(run(with_token(), own, &mut t, now), Verdict::Pass);
        // Behind a proxy: the public URL's origin is the harness's too.
        let proxied = Policy {
            token: Some(TOKEN),
            public_origin: Some("https://bmx.example"),
            open_network: false,
        };
        let via = Facts {
            origin: Some("https://bmx.example"),
            host: Some("10.0.0.5:7070"),
            ..ws
        };
        assert_eq!(run(proxied, via, &mut t, now), Verdict::Pass);
    }

    #[test]
    fn sessions_expire_and_are_bounded() {
        let now = Instant::now();
        let mut t = SessionTable::new(2, Duration::from_secs(60));
        let ids: Vec<String> = (0..3).map(|_| mint()).collect();
        t.insert(ids[0].clone(), mint(), now);
        t.insert(ids[1].clone(), mint(), now);
        t.insert(ids[2].clone(), mint(), now);
        assert_eq!(t.len(), 2);
        assert!(t.csrf(&ids[0], now).is_none(), "the oldest was evicted");
        assert!(t.csrf(&ids[1], now).is_some());
        let later = now + Duration::from_secs(61);
        assert!(t.csrf(&ids[1], later).is_none(), "expired");
        assert_eq!(t.len(), 1, "an expired entry is dropped when seen");
        assert_eq!(
            run(with_token(), facts(&ids[2]), &mut t, later),
            Verdict::Unauthorized
        );
        assert!(t.is_empty());
        t.insert(ids[0].clone(), mint(), later);
        t.remove(&ids[0]);
        assert!(t.csrf(&ids[0], later).is_none(), "logged out");
    }

    #[test]
    fn without_a_token_only_pages_of_a_loopback_harness_pass() {
        let now = Instant::now();
        let mut t = SessionTable::new(2, Duration::from_secs(60));
        let cli = Facts {
            unsafe_method: true,
            host: Some(HOST),
            ..Facts::default()
        };
        assert_eq!(run(open(), cli, &mut t, now), Verdict::Pass);
        let page = Facts {
            origin: Some(SELF),
            websocket: true,
            ..cli
        };
        assert_eq!(run(open(), page, &mut t, now), Verdict::Pass);
        let evil = Facts {
            origin: Some("https://evil.example"),
            ..cli
        };
        assert_eq!(
            run(open(), evil, &mut t, now),
            Verdict::Forbidden(Refusal::CrossOrigin)
        );
        // DNS rebinding: the page and the Host agree, but the name is not
        // a loopback name.
        let rebound = Facts {
            origin: Some("http://rebind.example:7070"),
            host: Some("rebind.example:7070"),
            ..cli
        };
        assert_eq!(
            run(open(), rebound, &mut t, now),
            Verdict::Forbidden(Refusal::NotLoopback)
        );
        let localhost = Facts {
            origin: Some("http://localhost:7070"),
            host: Some("localhost:7070"),
            ..cli
        };
        assert_eq!(run(open(), localhost, &mut t, now), Verdict::Pass);
    }

    #[test]
    fn without_a_token_the_host_must_be_a_loopback_name_on_every_method() {
        let now = Instant::now();
        let mut t = SessionTable::new(2, Duration::from_secs(60));
        // No Origin at all (curl, or a rebound page's simple GET): the
        // Host alone decides.
        for unsafe_method in [false, true] {
            for websocket in [false, true] {
                let rebound = Facts {
                    unsafe_method,
                    websocket,
                    host: Some("evil.example:7070"),
                    ..Facts::default()
                };
                assert_eq!(
                    run(open(), rebound, &mut t, now),
                    Verdict::Forbidden(Refusal::NotLoopback)
                );
                let local = Facts {
                    host: Some("[::1]:7070"),
                    ..rebound
                };
                assert_eq!(run(open(), local, &mut t, now), Verdict::Pass);
            }
        }
        let no_host = Facts::default();
        assert_eq!(
            run(open(), no_host, &mut t, now),
            Verdict::Forbidden(Refusal::NotLoopback)
        );
        // Routes with a secret of their own, the Unix socket and
        // --allow-open-api do not look at the Host; the Origin rule holds.
        let evil = Facts {
            host: Some("evil.example"),
            ..Facts::default()
        };
        assert_eq!(open_mode(open(), evil, true), Verdict::Pass);
        let unix = Facts {
            local_socket: true,
            ..evil
        };
        assert_eq!(open_mode(open(), unix, false), Verdict::Pass);
        let network = Policy {
            open_network: true,
            ..open()
        };
        assert_eq!(open_mode(network, evil, false), Verdict::Pass);
        let cross = Facts {
            origin: Some("http://other.example"),
            ..evil
        };
        assert_eq!(
            open_mode(network, cross, true),
            Verdict::Forbidden(Refusal::CrossOrigin)
        );
    }

    #[test]
    fn header_parsing() {
        let id = mint();
        let line = format!("a=b; {COOKIE}={id}; c=d");
        assert_eq!(cookie_value([line.as_str()]), Some(id.as_str()));
        assert_eq!(
            cookie_value(["x=1", &format!("{COOKIE}={id}")]),
            Some(id.as_str())
        );
        assert_eq!(cookie_value([&format!("{COOKIE}=short") as &str]), None);
        assert_eq!(
            cookie_value([&format!("{COOKIE}={}", id.to_uppercase()) as &str]),
            None
        );
        assert!(is_loopback_host("127.0.0.1:7070"));
        assert!(is_loopback_host("127.8.9.1"));
        assert!(is_loopback_host("[::1]:80"));
        assert!(is_loopback_host("LOCALHOST:1"));
        assert!(!is_loopback_host("10.0.0.1:7070"));
        assert!(!is_loopback_host("localhost.evil.example"));
        assert!(same_origin(
            "HTTP://LocalHost:7070",
            Some("localhost:7070"),
            None
        ));
        assert!(!same_origin("null", Some(HOST), None));
        assert!(!same_origin(SELF, None, None));
        assert_eq!(
            origin_of("https://bmx.example/console/x").as_deref(),
            Some("https://bmx.example")
        );
        assert_eq!(origin_of("wss://H:1").as_deref(), Some("https://h:1"));
        assert_eq!(origin_of("ftp://x"), None);
        let c = set_cookie(&id, SESSION_TTL, true);
        assert!(c.contains("HttpOnly") && c.contains("SameSite=Strict") && c.ends_with("Secure"));
        assert!(clear_cookie(false).contains("Max-Age=0"));
    }
}
