//! Take the daemons' credentials out of their own `/proc` entries (issue
//! 18, finding 2): once `--token` / `BMX_TOKEN` (and `--api-token` /
//! `BMX_API_TOKEN`, `--store` / `BMX_STORE`) have been parsed, their values are overwritten in the
//! memory `/proc/self/cmdline` and `/proc/self/environ` are read from, the
//! variables are removed from the environment, and the process is made
//! non-dumpable.
//!
//! Why overwriting: `/proc/PID/environ` and `cmdline` are not copies. The
//! kernel reads them, on every open, from the process's own memory: the
//! strings `execve` laid out at the top of the initial stack, between the
//! addresses fields 48-51 of `/proc/self/stat` give (`arg_start`,
//! `arg_end`, `env_start`, `env_end`). `std::env::remove_var` only edits
//! libc's array of pointers; the bytes stay, and a same-user process (code
//! in a session) could read the executor's token there and take its place
//! with the harness. So the bytes themselves are overwritten, the way
//! `setproctitle` rewrites argv.
//!
//! Non-dumpable (`PR_SET_DUMPABLE 0`): `/proc/PID/environ`, `mem`, `maps`,
//! `fd`, ... become root's, and `ptrace` by a same-user process is
//! refused, so the token in the heap cannot be read either (root still
//! can; `--run-as USER` keeps session code from being either: see
//! `process::run_as` and docs/security.md).

use std::io;

/// Flags whose values are secrets (`--store`: a PostgreSQL URL may hold a
/// password).
pub const SECRET_FLAGS: [&str; 3] = ["--token", "--api-token", "--store"];
/// Environment variables whose values are secrets.
pub const SECRET_VARS: [&str; 3] = ["BMX_TOKEN", "BMX_API_TOKEN", "BMX_STORE"];

/// What [`scrub`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Scrubbed {
    /// Secret flags that were given on the command line (their values are
    /// now `*`s): visible to `ps` until this ran, hence a warning.
    pub flags_on_command_line: Vec<&'static str>,
    /// Bytes overwritten in the argument and environment areas.
    pub bytes: usize,
}

/// Scrub [`SECRET_FLAGS`] and [`SECRET_VARS`] from this process, and make
/// it non-dumpable.
///
/// Call it once, after the command line has been parsed (clap copied the
/// values) and **before any other thread exists**: it writes memory libc's
/// `environ` strings live in, and `remove_var` is only sound while no
/// other thread reads the environment.
pub fn scrub() -> io::Result<Scrubbed> {
    let (args, env) = areas()?;
    let mut done = Scrubbed::default();
    // SAFETY: `args` and `env` are the kernel's bounds of this process's
    // argument and environment strings (set by execve, read from
    // /proc/self/stat): mapped, writable stack memory that lives as long
    // as the process and that no Rust value owns (std copies argv and the
    // environment into owned Strings when asked). `areas` checked that
    // the bytes there are exactly what /proc/self/cmdline and environ
    // show. We are single-threaded (the caller's contract), so nothing
    // reads them while they change, and every write stays inside the
    // bounds and keeps each string's length and NUL terminator.
    unsafe {
        if let Some((start, len)) = args {
            let area = std::slice::from_raw_parts_mut(start as *mut u8, len);
            scrub_args(area, &mut done);
        }
        if let Some((start, len)) = env {
            let area = std::slice::from_raw_parts_mut(start as *mut u8, len);
            scrub_env(area, &mut done);
        }
    }
    for var in SECRET_VARS {
        // Single-threaded (the caller's contract): no concurrent getenv.
        std::env::remove_var(var);
    }
    non_dumpable()?;
    Ok(done)
}

/// `PR_SET_DUMPABLE 0` for this process.
pub fn non_dumpable() -> io::Result<()> {
    // SAFETY: prctl with integer arguments only; no memory is passed.
    let r = unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A memory area of this process: start address and length.
type Area = (usize, usize);

/// Start and length of the argument and environment areas, each only if
/// its bytes match what `/proc/self/cmdline` / `environ` show (a process
/// that moved them, e.g. with `PR_SET_MM`, is left alone).
fn areas() -> io::Result<(Option<Area>, Option<Area>)> {
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    let bounds = parse_stat_areas(&stat).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            "no memory areas in /proc/self/stat",
        )
    })?;
    let cmdline = std::fs::read("/proc/self/cmdline")?;
    let environ = std::fs::read("/proc/self/environ")?;
    let check = |(start, end): (usize, usize), shown: &[u8]| {
        let len = end.checked_sub(start)?;
        if start == 0 || len == 0 || len != shown.len() {
            return None;
        }
        // SAFETY: the kernel's bounds of mapped memory of this process
        // (see `scrub`); read only, and compared before any write.
        let here = unsafe { std::slice::from_raw_parts(start as *const u8, len) };
        (here == shown).then_some((start, len))
    };
    Ok((check(bounds.0, &cmdline), check(bounds.1, &environ)))
}

/// `((arg_start, arg_end), (env_start, env_end))` from `/proc/self/stat`
/// (fields 48 to 51; the command name, field 2, may hold spaces and `)`).
fn parse_stat_areas(stat: &str) -> Option<((usize, usize), (usize, usize))> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // `rest` starts at field 3.
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3)?.parse::<usize>().ok();
    Some(((field(48)?, field(49)?), (field(50)?, field(51)?)))
}

/// Overwrite the values of [`SECRET_FLAGS`] in a NUL-separated argv area.
fn scrub_args(area: &mut [u8], done: &mut Scrubbed) {
    let mut secret_next = false;
    for arg in area.split_mut(|b| *b == 0) {
        if secret_next {
            done.bytes += blank(arg);
            secret_next = false;
            continue;
        }
        if arg == b"--" {
            break;
        }
        for flag in SECRET_FLAGS {
            if arg == flag.as_bytes() {
                secret_next = true;
                done.flags_on_command_line.push(flag);
            } else if arg.starts_with(flag.as_bytes()) && arg.get(flag.len()) == Some(&b'=') {
                done.bytes += blank(&mut arg[flag.len() + 1..]);
                done.flags_on_command_line.push(flag);
            }
        }
    }
}

/// Overwrite the values of [`SECRET_VARS`] in a NUL-separated environ area.
fn scrub_env(area: &mut [u8], done: &mut Scrubbed) {
    for entry in area.split_mut(|b| *b == 0) {
        for var in SECRET_VARS {
            if entry.starts_with(var.as_bytes()) && entry.get(var.len()) == Some(&b'=') {
                done.bytes += blank(&mut entry[var.len() + 1..]);
            }
        }
    }
}

fn blank(s: &mut [u8]) -> usize {
    s.fill(b'*');
    s.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_values_are_blanked_in_both_spellings() {
        let mut area = b"bmx\0executor\0--token\0sekrit\0--api-token=abc\0--url\0ws://x\0".to_vec();
        let mut done = Scrubbed::default();
        scrub_args(&mut area, &mut done);
        assert_eq!(
            area,
            b"bmx\0executor\0--token\0******\0--api-token=***\0--url\0ws://x\0".to_vec()
        );
        assert_eq!(done.flags_on_command_line, vec!["--token", "--api-token"]);
        assert_eq!(done.bytes, 9);
    }

    #[test]
    fn a_store_url_is_blanked_too() {
        let mut area = b"bmx\0harness\0--store=postgres://u:pw@h/db\0--tokens-file\0/f\0".to_vec();
        let mut done = Scrubbed::default();
        scrub_args(&mut area, &mut done);
        assert_eq!(
            area,
            b"bmx\0harness\0--store=********************\0--tokens-file\0/f\0".to_vec()
        );
        assert_eq!(done.flags_on_command_line, vec!["--store"]);
    }

    #[test]
    fn only_the_secret_variables_are_blanked() {
        let mut area =
            b"HOME=/root\0BMX_TOKEN=t0k\0BMX_TOKEN_FILE=/f\0BMX_API_TOKEN=\0X=BMX_TOKEN=1\0"
                .to_vec();
        let mut done = Scrubbed::default();
        scrub_env(&mut area, &mut done);
        assert_eq!(
            area,
            b"HOME=/root\0BMX_TOKEN=***\0BMX_TOKEN_FILE=/f\0BMX_API_TOKEN=\0X=BMX_TOKEN=1\0"
                .to_vec()
        );
    }

    #[test]
    fn stat_areas_survive_a_hostile_command_name() {
        let mut stat = String::from("42 (a) b) c) S");
        // Fields 4 to 47, then the four areas, then field 52.
        for n in 4..=47 {
            stat.push_str(&format!(" {n}"));
        }
        stat.push_str(" 100 200 300 400 0");
        assert_eq!(parse_stat_areas(&stat), Some(((100, 200), (300, 400))));
    }
}
