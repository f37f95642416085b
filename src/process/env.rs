//! The one environment policy for everything the executor starts:
//! processes, terminals and the `bash` tool.
//!
//! Why one policy: three copies drifted apart (one set `TERM` only when the
//! executor had none, one let the `bash` tool run without the scope tag, so
//! a `setsid` escapee of a tool call outlived its session). Here every child
//! gets the same rules:
//!
//! * the base is the executor's environment minus every `BMX_*` variable
//!   (the executor's own configuration and secrets — `BMX_TOKEN`,
//!   `BMX_API_TOKEN`, ... — are never a child's business) and minus the
//!   deny list;
//! * variables a caller supplies are checked first and refused with a typed
//!   [`EnvError`]: a denied name, the scope tag itself (a child that could
//!   pick its tag could hide from the kill of its scope), a name that is
//!   empty or holds `=` or NUL, a value with NUL, and sizes past what
//!   `execve` accepts;
//! * a PTY child gets `TERM=xterm-256color` unless the caller set `TERM`
//!   (the executor's own `TERM` describes whatever terminal the daemon was
//!   started from, not the PTY bmx made);
//! * the scope tag [`SCOPE_ENV`] is always set, last, so descendants that
//!   leave their process group are still found and killed with their owner
//!   (see [`super::sys::kill_tree`]).
//!
//! The rules are pure: the base environment is handed in ([`ChildEnv::new`]);
//! only [`ChildEnv::from_process`] reads this process's own environment.

use super::sys::SCOPE_ENV;
use std::collections::BTreeMap;

/// Prefix of the executor's own variables, never inherited by a child.
pub const EXECUTOR_PREFIX: &str = "BMX_";

/// `TERM` of a PTY child whose caller set none.
pub const PTY_TERM: &str = "xterm-256color";

/// Caller-supplied variables per child, at most.
pub const MAX_VARS: usize = 1024;

/// Bytes of one `NAME=value` string, at most: the kernel's own limit on a
/// single `execve` string (`MAX_ARG_STRLEN`, 32 pages), NUL included.
pub const MAX_VAR_BYTES: usize = 128 * 1024;

/// Bytes of all caller-supplied `NAME=value` strings together, at most
/// (half of the usual 2 MiB `ARG_MAX`, leaving room for argv and the base).
pub const MAX_TOTAL_BYTES: usize = 1024 * 1024;

/// Why a caller's variables were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    /// The name is on the deny list.
    #[error("environment variable {0:?} is denied")]
    Denied(String),
    /// The scope tag is the executor's to set.
    #[error("environment variable {SCOPE_ENV:?} is set by the executor")]
    Scope,
    /// Empty, or holds `=` or a NUL byte.
    #[error("invalid environment variable name {0:?}")]
    BadName(String),
    /// The value holds a NUL byte.
    #[error("value of environment variable {0:?} contains a NUL byte")]
    NulInValue(String),
    #[error("{count} environment variables (at most {MAX_VARS})")]
    TooMany { count: usize },
    #[error("environment variable {name:?} is {bytes} bytes (at most {MAX_VAR_BYTES})")]
    TooLong { name: String, bytes: usize },
    #[error("environment variables take {bytes} bytes (at most {MAX_TOTAL_BYTES})")]
    TooLarge { bytes: usize },
    /// A child without a scope could never be found again; an empty scope
    /// would match every tagged process. A bug of the caller, not input.
    #[error("a child needs a non-empty scope")]
    NoScope,
}

impl EnvError {
    /// True for a refusal of policy (the name is not the caller's to set),
    /// false for malformed input.
    pub fn is_denied(&self) -> bool {
        matches!(self, EnvError::Denied(_) | EnvError::Scope)
    }

    /// The machine-readable reason the executor reports.
    pub fn reason(&self) -> &'static str {
        if self.is_denied() {
            "denied_env"
        } else {
            "invalid_env"
        }
    }
}

/// What the child's standard streams are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tty {
    /// Pipes or `/dev/null`: `TERM` is left as the base has it.
    No,
    /// A PTY bmx made: `TERM` describes it.
    Pty,
}

/// One deny-list entry: an exact name, or a prefix written `PREFIX*`.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Rule {
    Exact(String),
    Prefix(String),
}

impl Rule {
    fn parse(entry: &str) -> Rule {
        match entry.strip_suffix('*') {
            Some(prefix) => Rule::Prefix(prefix.to_owned()),
            None => Rule::Exact(entry.to_owned()),
        }
    }

    fn matches(&self, name: &str) -> bool {
        match self {
            Rule::Exact(n) => n == name,
            Rule::Prefix(p) => name.starts_with(p.as_str()),
        }
    }
}

/// The environment policy: a filtered base and the deny list.
#[derive(Debug, Clone)]
pub struct ChildEnv {
    /// The inherited part, already filtered, in the base's order.
    base: Vec<(String, String)>,
    deny: Vec<Rule>,
    /// Whether [`ChildEnv::build`] adds the scope tag: not for a session
    /// whose processes its cgroup finds (issue 48; the tag is the
    /// fallback where no cgroup can be made).
    tagged: bool,
}

impl ChildEnv {
    /// A policy over `base` (usually the executor's environment) and the
    /// deny list (`NAME`, or `PREFIX*` for every name that starts so).
    pub fn new<I, K, V>(base: I, deny: &[String]) -> ChildEnv
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<String>,
    {
        let deny: Vec<Rule> = deny.iter().map(|d| Rule::parse(d)).collect();
        let base = base
            .into_iter()
            .map(|(k, v)| (k.into(), v.into()))
            .filter(|(k, _): &(String, String)| {
                !k.starts_with(EXECUTOR_PREFIX) && !deny.iter().any(|r| r.matches(k))
            })
            .collect();
        ChildEnv {
            base,
            deny,
            tagged: true,
        }
    }

    /// The same policy with `vars` in the base, replacing what it had
    /// under those names (a sandboxed session's own `TMPDIR` and `HOME`);
    /// a caller's variables still win over them.
    pub fn with_base_vars(mut self, vars: impl IntoIterator<Item = (String, String)>) -> ChildEnv {
        for (k, v) in vars {
            self.base.retain(|(name, _)| *name != k);
            self.base.push((k, v));
        }
        self
    }

    /// A variable of the base.
    pub fn base_var(&self, name: &str) -> Option<&str> {
        self.base
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The same policy without the scope tag (see `tagged`).
    pub fn untagged(mut self) -> ChildEnv {
        self.tagged = false;
        self
    }

    /// A policy over this process's own environment, as it is now. A
    /// variable that is not UTF-8 cannot be named on the wire either; such
    /// variables are left out rather than mangled.
    pub fn from_process(deny: &[String]) -> ChildEnv {
        ChildEnv::new(
            std::env::vars_os()
                .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?))),
            deny,
        )
    }

    /// Whether `name` is on the deny list.
    pub fn denies(&self, name: &str) -> bool {
        self.deny.iter().any(|r| r.matches(name))
    }

    /// Check caller-supplied variables without building anything (for a
    /// refusal before any work starts).
    pub fn check(&self, vars: Option<&BTreeMap<String, String>>) -> Result<(), EnvError> {
        let Some(vars) = vars else {
            return Ok(());
        };
        if vars.len() > MAX_VARS {
            return Err(EnvError::TooMany { count: vars.len() });
        }
        let mut total = 0usize;
        for (name, value) in vars {
            if name.is_empty() || name.contains(['=', '\0']) {
                return Err(EnvError::BadName(name.clone()));
            }
            if name == SCOPE_ENV {
                return Err(EnvError::Scope);
            }
            if self.denies(name) {
                return Err(EnvError::Denied(name.clone()));
            }
            if value.contains('\0') {
                return Err(EnvError::NulInValue(name.clone()));
            }
            let bytes = name.len() + 1 + value.len() + 1;
            if bytes > MAX_VAR_BYTES {
                return Err(EnvError::TooLong {
                    name: name.clone(),
                    bytes,
                });
            }
            total += bytes;
        }
        if total > MAX_TOTAL_BYTES {
            return Err(EnvError::TooLarge { bytes: total });
        }
        Ok(())
    }

    /// The child's whole environment (for `env_clear().envs(..)`): the base,
    /// the caller's variables over it, `TERM` for a PTY, the scope tag.
    pub fn build(
        &self,
        vars: Option<&BTreeMap<String, String>>,
        tty: Tty,
        scope: &str,
    ) -> Result<Vec<(String, String)>, EnvError> {
        self.check(vars)?;
        if self.tagged && scope.is_empty() {
            return Err(EnvError::NoScope);
        }
        let given = |name: &str| vars.is_some_and(|v| v.contains_key(name));
        // What the caller sets, and a PTY's TERM, replace the base's.
        let replaced = |name: &str| given(name) || (tty == Tty::Pty && name == "TERM");
        let mut out: Vec<(String, String)> = self
            .base
            .iter()
            .filter(|(k, _)| !replaced(k))
            .cloned()
            .collect();
        if let Some(vars) = vars {
            out.extend(vars.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        if tty == Tty::Pty && !given("TERM") {
            out.push(("TERM".into(), PTY_TERM.into()));
        }
        if self.tagged {
            out.push((SCOPE_ENV.into(), scope.to_owned()));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn base() -> Vec<(&'static str, &'static str)> {
        vec![
            ("PATH", "/usr/bin:/bin"),
            ("HOME", "/root"),
            ("TERM", "screen"),
            ("BMX_TOKEN", "t"),
            ("BMX_TOKEN_FILE", "/run/token"),
            ("BMX_API_TOKEN", "a"),
            ("BMX_ANYTHING", "x"),
            ("BMX_SCOPE", "outer/scope"),
            ("AWS_SECRET", "s"),
            ("AWS_REGION", "r"),
            ("LOCAL_SECRET", "l"),
        ]
    }

    fn policy() -> ChildEnv {
        ChildEnv::new(base(), &["LOCAL_SECRET".into(), "AWS_*".into()])
    }

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn get<'a>(env: &'a [(String, String)], name: &str) -> Vec<&'a str> {
        env.iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }

    #[test]
    fn the_base_loses_every_bmx_variable_and_the_deny_list() {
        let env = policy().build(None, Tty::No, "i/s/p").unwrap();
        let names: Vec<&str> = env.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(names, ["PATH", "HOME", "TERM", "BMX_SCOPE"]);
        assert_eq!(get(&env, "BMX_SCOPE"), ["i/s/p"], "ours, not the outer one");
    }

    #[test]
    fn caller_variables_override_the_base() {
        let vars = map(&[("HOME", "/work"), ("NEW", "1")]);
        let env = policy().build(Some(&vars), Tty::No, "i/s/p").unwrap();
        assert_eq!(get(&env, "HOME"), ["/work"]);
        assert_eq!(get(&env, "NEW"), ["1"]);
        assert_eq!(get(&env, "PATH"), ["/usr/bin:/bin"]);
    }

    #[test]
    fn term_is_the_pty_s_unless_the_caller_sets_it() {
        let p = policy();
        let env = p.build(None, Tty::Pty, "x").unwrap();
        assert_eq!(get(&env, "TERM"), [PTY_TERM], "not the executor's");
        let env = p.build(None, Tty::No, "x").unwrap();
        assert_eq!(get(&env, "TERM"), ["screen"], "pipes inherit it");
        let vars = map(&[("TERM", "dumb")]);
        let env = p.build(Some(&vars), Tty::Pty, "x").unwrap();
        assert_eq!(get(&env, "TERM"), ["dumb"]);
        let env = ChildEnv::new(Vec::<(String, String)>::new(), &[])
            .build(None, Tty::Pty, "x")
            .unwrap();
        assert_eq!(get(&env, "TERM"), [PTY_TERM], "set with no base TERM");
    }

    #[test]
    fn refusals_are_typed() {
        let p = policy();
        let check = |pairs: &[(&str, &str)]| p.check(Some(&map(pairs)));
        assert_eq!(
            check(&[("LOCAL_SECRET", "x")]),
            Err(EnvError::Denied("LOCAL_SECRET".into()))
        );
        assert_eq!(
            check(&[("AWS_KEY", "x")]),
            Err(EnvError::Denied("AWS_KEY".into()))
        );
        assert_eq!(check(&[("BMX_SCOPE", "mine")]), Err(EnvError::Scope));
        for bad in ["", "A=B", "A\0B", "="] {
            assert_eq!(check(&[(bad, "x")]), Err(EnvError::BadName(bad.into())));
        }
        assert_eq!(
            check(&[("A", "x\0y")]),
            Err(EnvError::NulInValue("A".into()))
        );
        assert!(check(&[("A", "")]).is_ok(), "empty values are fine");
        assert!(check(&[("BMX_CALLER_VAR", "x")]).is_ok(), "not denied");
        assert!(EnvError::Scope.is_denied());
        assert_eq!(EnvError::Denied("x".into()).reason(), "denied_env");
        assert_eq!(EnvError::BadName("".into()).reason(), "invalid_env");
        assert_eq!(
            p.build(None, Tty::No, ""),
            Err(EnvError::NoScope),
            "never untagged"
        );
    }

    #[test]
    fn sizes_are_bounded() {
        let p = policy();
        let many: BTreeMap<String, String> = (0..=MAX_VARS)
            .map(|i| (format!("V{i}"), String::new()))
            .collect();
        assert_eq!(
            p.check(Some(&many)),
            Err(EnvError::TooMany {
                count: MAX_VARS + 1
            })
        );
        let long = map(&[("A", &"x".repeat(MAX_VAR_BYTES))]);
        assert!(matches!(
            p.check(Some(&long)),
            Err(EnvError::TooLong { .. })
        ));
        let fits = map(&[("A", &"x".repeat(MAX_VAR_BYTES - 3))]);
        assert!(
            p.check(Some(&fits)).is_ok(),
            "A=...\\0 exactly at the limit"
        );
        let big: BTreeMap<String, String> = (0..20)
            .map(|i| (format!("V{i}"), "x".repeat(MAX_VAR_BYTES / 2)))
            .collect();
        assert!(matches!(
            p.check(Some(&big)),
            Err(EnvError::TooLarge { .. })
        ));
    }

    proptest! {
        /// Whatever the caller supplies, an accepted environment has the
        /// scope tag exactly once and last, no `BMX_*` but the tag, nothing
        /// denied, and every name and value `execve` can carry.
        #[test]
        fn an_accepted_environment_is_always_tagged_and_clean(
            vars in proptest::collection::btree_map("[A-Z_=\\x00]{0,6}", "[a-z\\x00]{0,4}", 0..8),
            pty in any::<bool>(),
            scope in "[a-z/]{1,12}",
        ) {
            let p = policy();
            let tty = if pty { Tty::Pty } else { Tty::No };
            match p.build(Some(&vars), tty, &scope) {
                Ok(env) => {
                    let (last_k, last_v) = env.last().unwrap();
                    prop_assert_eq!(last_k, SCOPE_ENV);
                    prop_assert_eq!(last_v, &scope);
                    prop_assert_eq!(get(&env, SCOPE_ENV).len(), 1);
                    for (k, v) in &env {
                        prop_assert!(!k.is_empty() && !k.contains(['=', '\0']));
                        prop_assert!(!v.contains('\0'));
                        prop_assert!(!p.denies(k));
                        prop_assert!(k == SCOPE_ENV || !k.starts_with(EXECUTOR_PREFIX) || vars.contains_key(k));
                        prop_assert_eq!(get(&env, k).len(), 1, "{} twice", k);
                    }
                    if pty {
                        prop_assert_eq!(get(&env, "TERM").len(), 1);
                    }
                }
                Err(e) => {
                    let refused_for_cause = vars.iter().any(|(k, v)| {
                        k.is_empty() || k.contains(['=', '\0']) || k == SCOPE_ENV
                            || p.denies(k) || v.contains('\0')
                    });
                    prop_assert!(refused_for_cause, "{e}");
                }
            }
        }
    }
}
