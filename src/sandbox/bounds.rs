//! A session's bounds: the executor's (`--session-memory-max`,
//! `--session-pids-max`, `--session-cpu-max`) and what a session asks for
//! in `session.assign.metadata.sandbox`, never above the executor's.
//! Sans-IO: parsing and the rule, property-tested.

use super::cgroup::{Limits, CPU_PERIOD_US};

/// Bounds, in the kernel's units; `None`: unbounded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Bounds {
    pub memory_bytes: Option<u64>,
    pub pids: Option<u64>,
    /// Thousandths of a CPU.
    pub cpu_milli: Option<u64>,
}

impl Bounds {
    pub fn is_empty(&self) -> bool {
        *self == Bounds::default()
    }

    /// The cgroup limits these bounds are.
    pub fn limits(&self) -> Limits {
        Limits {
            memory_bytes: self.memory_bytes,
            pids: self.pids,
            cpu_quota_us: self.cpu_milli.map(|m| m * CPU_PERIOD_US / 1000),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("{0:?} is not a size: a whole number of bytes, or one with K, M, G or T (1024-based)")]
    Size(String),
    #[error("{0:?} is not a CPU count: a positive number such as 2 or 0.5 (at least 0.01)")]
    Cpus(String),
    #[error("{0:?} is not a task count: a whole number from 1")]
    Pids(String),
}

/// `512M`, `2G`, `1048576`, `64KiB`: bytes, 1024-based. Not 0.
///
/// # Errors
/// [`ParseError::Size`] for anything else, or a size past `u64`.
pub fn parse_size(s: &str) -> Result<u64, ParseError> {
    let bad = || ParseError::Size(s.to_owned());
    let t = s.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (digits, shift) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 10),
        Some('M' | 'm') => (&t[..t.len() - 1], 20),
        Some('G' | 'g') => (&t[..t.len() - 1], 30),
        Some('T' | 't') => (&t[..t.len() - 1], 40),
        _ => (t, 0),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let bytes = n.checked_mul(1u64 << shift).ok_or_else(bad)?;
    if bytes == 0 {
        return Err(bad());
    }
    Ok(bytes)
}

/// `2`, `0.5`, `1.25`: thousandths of a CPU, at least 10 (the kernel's
/// smallest quota is 1 ms per 100 ms period), at most 1 000 000.
///
/// # Errors
/// [`ParseError::Cpus`] for anything else.
pub fn parse_cpus(s: &str) -> Result<u64, ParseError> {
    let bad = || ParseError::Cpus(s.to_owned());
    let t = s.trim();
    let (whole, frac) = t.split_once('.').unwrap_or((t, ""));
    if (whole.is_empty() && frac.is_empty())
        || !whole.bytes().all(|b| b.is_ascii_digit())
        || !frac.bytes().all(|b| b.is_ascii_digit())
        || frac.len() > 3
        || whole.len() > 7
    {
        return Err(bad());
    }
    let w: u64 = if whole.is_empty() {
        0
    } else {
        whole.parse().map_err(|_| bad())?
    };
    let mut f: u64 = if frac.is_empty() {
        0
    } else {
        frac.parse().map_err(|_| bad())?
    };
    for _ in frac.len()..3 {
        f *= 10;
    }
    let milli = w * 1000 + f;
    if !(10..=1_000_000).contains(&milli) {
        return Err(bad());
    }
    Ok(milli)
}

/// A task count from 1.
///
/// # Errors
/// [`ParseError::Pids`] otherwise.
pub fn parse_pids(s: &str) -> Result<u64, ParseError> {
    match s.trim().parse::<u64>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(ParseError::Pids(s.to_owned())),
    }
}

/// A refused per-session bound: the field (as the caller wrote it) and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct Refusal {
    pub field: String,
    pub message: String,
}

/// What the kernel lets this executor bound.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Enforceable {
    pub memory: bool,
    pub pids: bool,
    pub cpu: bool,
}

const FIELD: &str = "metadata.sandbox";

/// The bounds of a session: the executor's, lowered where
/// `metadata.sandbox` asks (`memoryMax`: bytes or a size string,
/// `pidsMax`: a count, `cpuMax`: CPUs as a number or string). A bound
/// above the executor's, one the kernel cannot enforce here, an unknown
/// member or a malformed value is refused, naming the field.
///
/// # Errors
/// [`Refusal`] as above.
pub fn for_session(
    executor: &Bounds,
    can: Enforceable,
    asked: Option<&serde_json::Value>,
) -> Result<Bounds, Refusal> {
    let mut out = *executor;
    let Some(asked) = asked else {
        return Ok(out);
    };
    let refuse = |member: &str, message: String| Refusal {
        field: format!("{FIELD}.{member}"),
        message,
    };
    let Some(obj) = asked.as_object() else {
        return Err(Refusal {
            field: FIELD.into(),
            message: "must be an object with memoryMax, pidsMax or cpuMax".into(),
        });
    };
    for (k, v) in obj {
        let (value, cap, enforceable, unit) = match k.as_str() {
            "memoryMax" => {
                let bytes = match v {
                    serde_json::Value::Number(n) => n.as_u64().filter(|&b| b > 0),
                    serde_json::Value::String(s) => parse_size(s).ok(),
                    _ => None,
                }
                .ok_or_else(|| {
                    refuse(
                        k,
                        "a size in bytes (a number, or a string such as \"512M\")".into(),
                    )
                })?;
                (bytes, executor.memory_bytes, can.memory, "bytes")
            }
            "pidsMax" => {
                let n = v
                    .as_u64()
                    .filter(|&n| n >= 1)
                    .ok_or_else(|| refuse(k, "a task count from 1".into()))?;
                (n, executor.pids, can.pids, "tasks")
            }
            "cpuMax" => {
                let milli = match v {
                    serde_json::Value::Number(n) => n.as_f64().and_then(|f| {
                        (f.is_finite() && f > 0.0 && f <= 1000.0)
                            .then(|| (f * 1000.0).round() as u64)
                    }),
                    serde_json::Value::String(s) => parse_cpus(s).ok(),
                    _ => None,
                }
                .filter(|&m| (10..=1_000_000).contains(&m))
                .ok_or_else(|| refuse(k, "a CPU count such as 0.5 or 2".into()))?;
                (milli, executor.cpu_milli, can.cpu, "thousandths of a CPU")
            }
            other => {
                return Err(refuse(
                    other,
                    "unknown member (memoryMax, pidsMax, cpuMax)".into(),
                ))
            }
        };
        if !enforceable {
            return Err(refuse(
                k,
                "this executor cannot enforce it (no such controller)".into(),
            ));
        }
        if let Some(cap) = cap {
            if value > cap {
                return Err(refuse(
                    k,
                    format!("{value} {unit} is above this executor's bound of {cap}"),
                ));
            }
        }
        match k.as_str() {
            "memoryMax" => out.memory_bytes = Some(value),
            "pidsMax" => out.pids = Some(value),
            _ => out.cpu_milli = Some(value),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert_eq!(parse_size("64KiB"), Ok(64 << 10));
        assert_eq!(parse_size("1048576"), Ok(1 << 20));
        assert_eq!(parse_size("1MB"), Ok(1 << 20));
        for bad in ["", "0", "M", "1.5G", "-1", "12X", "99999999999999T", " G"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn cpus() {
        assert_eq!(parse_cpus("2"), Ok(2000));
        assert_eq!(parse_cpus("0.5"), Ok(500));
        assert_eq!(parse_cpus(".25"), Ok(250));
        assert_eq!(parse_cpus("1.125"), Ok(1125));
        for bad in ["", ".", "0", "0.001", "1.2345", "x", "-1", "1e3", "2000000"] {
            assert!(parse_cpus(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_session_lowers_the_executors_bounds_and_never_raises_them() {
        let ex = Bounds {
            memory_bytes: Some(1 << 30),
            pids: Some(256),
            cpu_milli: None,
        };
        let all = Enforceable {
            memory: true,
            pids: true,
            cpu: true,
        };
        let got =
            for_session(&ex, all, Some(&json!({"memoryMax": "256M", "cpuMax": 0.5}))).unwrap();
        assert_eq!(got.memory_bytes, Some(256 << 20));
        assert_eq!(got.pids, Some(256));
        assert_eq!(got.cpu_milli, Some(500));
        let e = for_session(&ex, all, Some(&json!({"pidsMax": 257}))).unwrap_err();
        assert_eq!(e.field, "metadata.sandbox.pidsMax");
        let e = for_session(&ex, all, Some(&json!({"memoryMax": "2G"}))).unwrap_err();
        assert_eq!(e.field, "metadata.sandbox.memoryMax");
        let e = for_session(&ex, all, Some(&json!({"swap": 1}))).unwrap_err();
        assert_eq!(e.field, "metadata.sandbox.swap");
        let none = Enforceable::default();
        let e = for_session(&Bounds::default(), none, Some(&json!({"pidsMax": 5}))).unwrap_err();
        assert!(e.message.contains("cannot enforce"), "{e}");
        assert_eq!(for_session(&ex, none, None), Ok(ex));
    }

    proptest! {
        #[test]
        fn a_size_prints_back(n in 1u64..(1 << 40), unit in 0usize..4) {
            let (suffix, shift) = [("", 0), ("K", 10), ("M", 20), ("G", 30)][unit];
            let n = n >> shift.min(39);
            prop_assume!(n > 0);
            prop_assert_eq!(parse_size(&format!("{n}{suffix}")), Ok(n << shift));
        }

        #[test]
        fn granted_bounds_never_exceed_the_executors(
            cap_mem in proptest::option::of(1u64..1 << 40),
            cap_pids in proptest::option::of(1u64..100_000),
            cap_cpu in proptest::option::of(10u64..100_000),
            mem in proptest::option::of(1u64..1 << 41),
            pids in proptest::option::of(1u64..200_000),
            cpu in proptest::option::of(10u64..200_000),
        ) {
            let ex = Bounds { memory_bytes: cap_mem, pids: cap_pids, cpu_milli: cap_cpu };
            let mut asked = serde_json::Map::new();
            if let Some(m) = mem { asked.insert("memoryMax".into(), json!(m)); }
            if let Some(p) = pids { asked.insert("pidsMax".into(), json!(p)); }
            if let Some(c) = cpu { asked.insert("cpuMax".into(), json!(format!("{}.{:03}", c / 1000, c % 1000))); }
            let all = Enforceable { memory: true, pids: true, cpu: true };
            let asked = serde_json::Value::Object(asked);
            match for_session(&ex, all, Some(&asked)) {
                Ok(b) => {
                    let within = |got: Option<u64>, cap: Option<u64>| match (got, cap) {
                        (Some(g), Some(c)) => g <= c,
                        (None, Some(_)) => false,
                        _ => true,
                    };
                    prop_assert!(within(b.memory_bytes, ex.memory_bytes));
                    prop_assert!(within(b.pids, ex.pids));
                    prop_assert!(within(b.cpu_milli, ex.cpu_milli));
                    if let Some(m) = mem { prop_assert_eq!(b.memory_bytes, Some(m)); }
                }
                Err(r) => {
                    let over = |v: Option<u64>, cap: Option<u64>| matches!((v, cap), (Some(v), Some(c)) if v > c);
                    prop_assert!(over(mem, cap_mem) || over(pids, cap_pids) || over(cpu, cap_cpu), "{}", r);
                }
            }
        }
    }
}
