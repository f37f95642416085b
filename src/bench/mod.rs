//! Benchmarks run by `bmx bench`: each measures the raw baseline in the
//! same run and reports the ratio.

pub mod affinity;
pub mod buffering;
pub mod computer;
pub mod events;
pub mod harness;
pub mod http1;
pub mod local;
pub mod mcp;
pub mod peer;
pub mod rfb;
pub mod scale;
pub mod spawn;
pub mod turns;
pub mod visor;

/// CPU time (user + system, every thread) of `/proc/<pid>` (`"self"` for
/// this process), in milliseconds: what a row cost, beside what it took.
/// Clock ticks of 10 ms, so a row should run for seconds.
pub fn cpu_ms(pid: &str) -> Option<f64> {
    let ticks = cpu_ticks(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)?;
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .filter(|&t| t > 0)
        .unwrap_or(100);
    Some(ticks as f64 * 1000.0 / hz as f64)
}

/// `utime + stime` (fields 14 and 15) of a `/proc/<pid>/stat` line. The
/// command name before them is in parentheses and may hold spaces and
/// parentheses itself: the fields start after the last `)`.
fn cpu_ticks(stat: &str) -> Option<u64> {
    let mut fields = stat[stat.rfind(')')? + 1..].split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// The CPU idle driver, and for the KVM guest's `haltpoll` driver its
/// polling window: on a VM, waking a halted virtual CPU costs tens of µs,
/// and a guest that polls before it halts does not pay it, so latencies
/// of small round trips differ severalfold with this setting
/// (docs/benchmarks.md, "Guest halt polling"). `None` where sysfs has no
/// idle driver.
pub fn cpuidle() -> Option<String> {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let driver = read("/sys/devices/system/cpu/cpuidle/current_driver")?;
    let poll = read("/sys/module/haltpoll/parameters/guest_halt_poll_ns");
    Some(describe_cpuidle(&driver, poll.as_deref()))
}

fn describe_cpuidle(driver: &str, poll_ns: Option<&str>) -> String {
    let driver = driver.trim();
    match poll_ns.map(str::trim) {
        Some(ns) if driver == "haltpoll" => format!("haltpoll, guest_halt_poll_ns={ns}"),
        _ => driver.to_owned(),
    }
}

/// Context switches (voluntary and not) of every live thread of this
/// process so far: a thread that went to sleep and was woken counts one.
/// A thread that ended (an idle blocking-pool thread) takes its count
/// with it, so a difference of two readings can only undercount.
pub fn context_switches() -> Option<u64> {
    let mut total = 0;
    for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let Ok(status) = std::fs::read_to_string(task.path().join("status")) else {
            continue; // a thread that ended meanwhile
        };
        total += switches(&status, "voluntary_ctxt_switches")
            + switches(&status, "nonvoluntary_ctxt_switches");
    }
    Some(total)
}

/// How often the main thread of process `pid` went to sleep (its
/// voluntary context switches): a server that handles one call at a time
/// sleeps once per call when its client's next request comes after it
/// is idle, and not at all when the request is already there.
pub fn sleeps(pid: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    Some(switches(&status, "voluntary_ctxt_switches"))
}

/// The `key:` count of a `/proc/.../status` text (0 when missing).
fn switches(status: &str, key: &str) -> u64 {
    status
        .lines()
        .filter_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .filter_map(|v| v.trim().parse::<u64>().ok())
        .sum()
}

/// The pids of this process's children (of every thread's).
pub fn children_of_self() -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|c| {
            c.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

/// `VmRSS` of `/proc/<pid>` (`"self"` for this process), in KiB.
pub fn rss_kib(pid: &str) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_ticks_reads_the_fields_after_the_name() {
        // A name with a space and a `)` of its own, as `/proc` prints it.
        let stat = "4242 (we ird) x) S 1 4242 4242 0 -1 4194304 120 0 0 0 37 5 0 0 20 0 3 0 99 0 0";
        assert_eq!(cpu_ticks(stat), Some(42));
        assert_eq!(cpu_ticks("4242 (short) S 1 2"), None);
        assert_eq!(cpu_ticks("no parenthesis"), None);
    }

    #[test]
    fn switches_reads_the_line_of_its_key_only() {
        let status = "Name:\tnode\nvoluntary_ctxt_switches:\t17\nnonvoluntary_ctxt_switches:\t4\n";
        assert_eq!(switches(status, "voluntary_ctxt_switches"), 17);
        assert_eq!(switches(status, "nonvoluntary_ctxt_switches"), 4);
        assert_eq!(switches("Name:\tx\n", "voluntary_ctxt_switches"), 0);
    }

    #[test]
    fn a_server_waiting_for_each_request_sleeps_once_per_call() {
        use std::io::{BufRead, BufReader, Write};
        let mut cat = std::process::Command::new("cat")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let pid = cat.id().to_string();
        let mut input = cat.stdin.take().unwrap();
        let mut output = BufReader::new(cat.stdout.take().unwrap());
        let before = sleeps(&pid).unwrap();
        // Each request is written well after the previous answer came
        // back, so cat is blocked in read(2) when it arrives.
        for call in 0..5 {
            std::thread::sleep(std::time::Duration::from_millis(10));
            writeln!(input, "call {call}").unwrap();
            let mut line = String::new();
            output.read_line(&mut line).unwrap();
            assert_eq!(line, format!("call {call}\n"));
        }
        let after = sleeps(&pid).unwrap();
        drop(input);
        cat.wait().unwrap();
        assert!(after >= before + 5, "{before} -> {after}");
        assert_eq!(sleeps("0"), None, "no such process");
    }

    #[test]
    fn cpuidle_names_the_driver_and_the_guest_polling_window() {
        assert_eq!(
            describe_cpuidle("haltpoll\n", Some("0\n")),
            "haltpoll, guest_halt_poll_ns=0"
        );
        assert_eq!(describe_cpuidle("intel_idle\n", Some("0\n")), "intel_idle");
        assert_eq!(describe_cpuidle("haltpoll", None), "haltpoll");
    }

    #[test]
    fn this_process_has_cpu_time_and_context_switches() {
        assert!(cpu_ms("self").is_some());
        // This thread's own count: the process's total can fall meanwhile,
        // when another test's thread ends and takes its switches with it.
        let before = sleeps("thread-self").expect("readable /proc/thread-self/status");
        // A sleep is a voluntary switch of this thread.
        std::thread::sleep(std::time::Duration::from_millis(2));
        let after = sleeps("thread-self").expect("readable");
        assert!(after > before, "{before} -> {after}");
        // The process's total holds this thread's.
        assert!(context_switches().expect("readable /proc/self/task") >= after);
    }
}
