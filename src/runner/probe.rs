//! Looking at processes and sockets: is a pid a live process, does a
//! control socket answer, which processes are left in a session. Small,
//! blocking, each with a timeout: `bmx env` is a short-lived command.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// How long one reachability probe may take.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// A live process, zombies excluded: a runtime killed but not yet reaped
/// by its parent still answers signal 0, and must read as dead.
pub fn pid_running(pid: u32) -> bool {
    if !super::lock::pid_alive(pid) {
        return false;
    }
    match proc_stat(pid) {
        Some(stat) => stat.state != 'Z' && stat.state != 'X',
        // /proc unreadable (hidepid): trust signal 0.
        None => true,
    }
}

/// The fields of `/proc/PID/stat` bmx needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    pub state: char,
    pub session: i32,
}

/// Parse `/proc/PID/stat` (the command name may hold spaces and `)`: the
/// fields start after the last `)`).
pub fn parse_stat(text: &str) -> Option<ProcStat> {
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let _ppid = fields.next()?;
    let _pgrp = fields.next()?;
    let session = fields.next()?.parse().ok()?;
    Some(ProcStat { state, session })
}

fn proc_stat(pid: u32) -> Option<ProcStat> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Live processes (zombies excluded) whose session id is `sid`: what a
/// daemon started with `setsid` leaves behind if its children outlive it.
pub fn session_members(sid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            matches!(proc_stat(*pid), Some(s) if i64::from(s.session) == i64::from(sid) && s.state != 'Z' && s.state != 'X')
        })
        .collect()
}

/// `GET /v1/health` on `addr` (`HOST:PORT`) answers `200`.
pub fn http_health(addr: &str, timeout: Duration) -> bool {
    let Some(sock) = addr.to_socket_addrs().ok().and_then(|mut a| a.next()) else {
        return false;
    };
    let Ok(mut s) = TcpStream::connect_timeout(&sock, timeout) else {
        return false;
    };
    if s.set_read_timeout(Some(timeout)).is_err() || s.set_write_timeout(Some(timeout)).is_err() {
        return false;
    }
    let req = format!("GET /v1/health HTTP/1.0\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    if s.write_all(req.as_bytes()).is_err() {
        return false;
    }
    let mut head = [0u8; 12];
    let mut got = 0;
    while got < head.len() {
        match s.read(&mut head[got..]) {
            Ok(0) | Err(_) => return false,
            Ok(n) => got += n,
        }
    }
    head.starts_with(b"HTTP/1.") && &head[9..12] == b"200"
}

/// A connect to the Unix socket at `path` succeeds.
pub fn unix_connects(path: &Path) -> bool {
    UnixStream::connect(path).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_parse_with_odd_names() {
        let s = parse_stat("123 (a) b)) S 1 123 123 0 -1 4194560").unwrap();
        assert_eq!(
            s,
            ProcStat {
                state: 'S',
                session: 123
            }
        );
        assert!(parse_stat("garbage").is_none());
        assert!(parse_stat("1 (x) Z").is_none());
        let me = proc_stat(std::process::id()).unwrap();
        assert_ne!(me.state, 'Z');
        assert!(pid_running(std::process::id()));
        assert!(!pid_running(0));
    }

    #[test]
    fn probes_of_nothing_fail() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        drop(l);
        assert!(!http_health(&addr, Duration::from_millis(500)));
        assert!(!http_health("not an address", Duration::from_millis(500)));
        assert!(!unix_connects(Path::new("/nonexistent/sock")));
    }

    #[test]
    fn a_silent_listener_is_unreachable() {
        // Accepts (the kernel's backlog) but never answers: a stopped
        // runtime looks like this.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        assert!(!http_health(&addr, Duration::from_millis(300)));
    }
}
