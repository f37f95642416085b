//! Every thread of this process on one CPU for a while (`bmx bench
//! buffering`'s pinned pairs).
//!
//! Why: on two cores the scheduler puts a pipe's producer and reader on
//! the same core in one run and on different cores in the next, and the
//! throughput of a 1 GiB pipe differs by more than the ring's whole cost
//! between those placements (docs/benchmarks.md, "Pinned pairs"). A pair
//! measured with both rows on one core compares the rows, not the
//! placements. The reader of one row is a thread of this process (a tokio
//! worker, the executor's pump), so the whole process is pinned, not one
//! thread; threads and children started meanwhile inherit the mask.

use std::io;

/// Restores the mask every thread had when dropped.
pub struct Pinned {
    before: libc::cpu_set_t,
}

/// The first CPU this process may run on.
pub fn first_cpu() -> io::Result<usize> {
    let set = mask_of(0)?;
    // SAFETY: CPU_ISSET reads a bit of an initialised set, in bounds.
    (0..libc::CPU_SETSIZE as usize)
        .find(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .ok_or_else(|| io::Error::other("no CPU in this process's mask"))
}

/// Pin every thread of the process to `cpu` until the guard drops.
pub fn pin_process(cpu: usize) -> io::Result<Pinned> {
    let before = mask_of(0)?;
    // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET writes one bit
    // in bounds (checked by the caller's `first_cpu`, and the kernel
    // refuses a CPU it does not have).
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    unsafe { libc::CPU_SET(cpu, &mut set) };
    set_all(&set)?;
    Ok(Pinned { before })
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if let Err(e) = set_all(&self.before) {
            tracing::warn!(error = %e, "restoring the CPU mask after a pinned run failed");
        }
    }
}

fn mask_of(tid: libc::pid_t) -> io::Result<libc::cpu_set_t> {
    // SAFETY: a zeroed cpu_set_t is valid; the kernel fills it in.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: plain syscall on a stack value of the size given.
    if unsafe { libc::sched_getaffinity(tid, size, &mut set) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(set)
}

/// `set` on every thread listed in /proc/self/task. A thread that ended
/// meanwhile (ESRCH) is skipped.
fn set_all(set: &libc::cpu_set_t) -> io::Result<()> {
    let size = std::mem::size_of::<libc::cpu_set_t>();
    for entry in std::fs::read_dir("/proc/self/task")? {
        let Some(tid) = entry?
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<libc::pid_t>().ok())
        else {
            continue;
        };
        // SAFETY: plain syscall on a borrowed, initialised set.
        if unsafe { libc::sched_setaffinity(tid, size, set) } != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ESRCH) {
                return Err(e);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_thread_is_pinned_and_then_restored() {
        let before = mask_of(0).unwrap();
        let cpu = first_cpu().unwrap();
        let other = std::thread::spawn(|| {
            std::thread::park();
            mask_of(0).unwrap()
        });
        {
            let _pinned = pin_process(cpu).unwrap();
            let born = std::thread::spawn(|| mask_of(0).unwrap()).join().unwrap();
            for m in [mask_of(0).unwrap(), born] {
                // SAFETY: reading bits of initialised sets.
                assert_eq!(unsafe { libc::CPU_COUNT(&m) }, 1);
                assert!(unsafe { libc::CPU_ISSET(cpu, &m) });
            }
        }
        other.thread().unpark();
        let after_other = other.join().unwrap();
        let after = mask_of(0).unwrap();
        // SAFETY: as above.
        unsafe {
            assert_eq!(libc::CPU_COUNT(&after), libc::CPU_COUNT(&before));
            assert_eq!(libc::CPU_COUNT(&after_other), libc::CPU_COUNT(&before));
        }
    }
}
