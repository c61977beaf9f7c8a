//! CPU time per thread of this process, for what a bench's copies cost the
//! host besides the link.
//!
//! An inference engine's host threads (its scheduler, its tokenizer) share
//! the cores with kvbm's: a copier that polls for completions at line rate
//! takes a core the engine may need. Benches sample every thread's CPU time
//! before and after a timed window (Linux `/proc/self/task/*/schedstat`,
//! nanoseconds on the CPU; `stat`'s clock ticks where schedstat is
//! missing) and report it per thread name, as cores busy over the window.
//! Threads that started or ended inside the window count from zero or not
//! at all.

use std::collections::BTreeMap;
use std::time::Instant;

use serde::Serialize;

/// Every thread's CPU time at one instant.
#[derive(Debug, Clone)]
pub struct CpuSample {
    at: Instant,
    /// Thread id → (name, nanoseconds on the CPU).
    threads: BTreeMap<u32, (String, u64)>,
}

impl CpuSample {
    /// Reads every thread of this process; `None` where `/proc` has no
    /// per-thread times (not Linux).
    pub fn now() -> Option<CpuSample> {
        let at = Instant::now();
        let mut threads = BTreeMap::new();
        for entry in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
            let Some(tid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            let dir = entry.path();
            let Ok(name) = std::fs::read_to_string(dir.join("comm")) else {
                continue; // The thread ended meanwhile.
            };
            let Some(ns) = cpu_ns(&dir) else { continue };
            threads.insert(tid, (name.trim_end().to_string(), ns));
        }
        Some(CpuSample { at, threads })
    }
}

/// A thread's CPU nanoseconds: schedstat's first field, else utime + stime
/// from `stat` in clock ticks.
fn cpu_ns(dir: &std::path::Path) -> Option<u64> {
    if let Ok(s) = std::fs::read_to_string(dir.join("schedstat"))
        && let Some(ns) = s.split_whitespace().next().and_then(|f| f.parse().ok())
    {
        return Some(ns);
    }
    let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
    ticks_ns(&stat)
}

/// utime + stime of a `stat` line in nanoseconds (fields 14 and 15, counted
/// after the parenthesised name, which may hold spaces).
fn ticks_ns(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    // SAFETY: sysconf only reads a configuration value.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let hz = if hz > 0 { hz as u64 } else { 100 };
    Some((utime + stime) * 1_000_000_000 / hz)
}

/// CPU use per thread name over one or more windows.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ThreadCpu {
    /// Seconds of wall clock the windows add up to.
    pub wall_secs: f64,
    /// Thread name → CPU seconds over the windows (threads of one name
    /// summed).
    pub cpu_secs: BTreeMap<String, f64>,
}

impl ThreadCpu {
    /// Adds the window from `before` to `after`.
    pub fn add(&mut self, before: &CpuSample, after: &CpuSample) {
        self.wall_secs += after.at.saturating_duration_since(before.at).as_secs_f64();
        for (tid, (name, ns)) in &after.threads {
            let start = before.threads.get(tid).map_or(0, |(_, b)| *b);
            let secs = ns.saturating_sub(start) as f64 / 1e9;
            *self.cpu_secs.entry(name.clone()).or_default() += secs;
        }
    }

    /// The window from `before` to now (`None` without a sample before).
    pub fn over(before: Option<&CpuSample>) -> Option<ThreadCpu> {
        let after = CpuSample::now()?;
        let mut cpu = ThreadCpu::default();
        cpu.add(before?, &after);
        Some(cpu)
    }

    /// Adds `other`'s windows to these.
    pub fn merge(&mut self, other: &ThreadCpu) {
        self.wall_secs += other.wall_secs;
        for (name, secs) in &other.cpu_secs {
            *self.cpu_secs.entry(name.clone()).or_default() += secs;
        }
    }

    /// All threads' CPU seconds.
    pub fn total_secs(&self) -> f64 {
        self.cpu_secs.values().sum()
    }

    /// The `n` busiest thread names as (name, cores busy over the windows),
    /// busiest first, leaving out those under a hundredth of a core.
    pub fn busiest(&self, n: usize) -> Vec<(String, f64)> {
        let wall = self.wall_secs.max(1e-9);
        let mut v: Vec<(String, f64)> = self
            .cpu_secs
            .iter()
            .map(|(name, s)| (name.clone(), s / wall))
            .filter(|(_, cores)| *cores >= 0.01)
            .collect();
        v.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        v.truncate(n);
        v
    }

    /// One line: total cores, then the busiest threads.
    pub fn summary(&self, n: usize) -> String {
        let mut s = format!("{:.2} cores", self.total_secs() / self.wall_secs.max(1e-9));
        for (name, cores) in self.busiest(n) {
            s += &format!(", {name} {cores:.2}");
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_ticks_skip_a_name_with_spaces_and_parens() {
        // Fields after the name: state, then 10 more, then utime and stime.
        let line = "4242 (kvbm (x) y) S 1 2 3 4 5 6 7 8 9 10 300 200 0 0 20 0";
        // SAFETY: sysconf only reads a configuration value.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
        assert_eq!(ticks_ns(line), Some(500 * 1_000_000_000 / hz));
        assert_eq!(ticks_ns("garbage"), None);
    }

    /// CPU time the calling thread has used.
    fn own_cpu() -> std::time::Duration {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes one timespec, which `ts` is.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        assert_eq!(rc, 0, "the thread CPU clock reads");
        std::time::Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
    }

    #[test]
    fn a_spinning_thread_shows_up_by_name_and_a_sleeping_one_does_not() {
        let Some(before) = CpuSample::now() else {
            println!("skipped: no per-thread times in /proc");
            return;
        };
        // The spinner spins until its own CPU clock says 50 ms (however
        // loaded the machine), says so, then blocks like the sleeper until
        // both are sampled: each is alive at the sample (a thread that
        // ended is gone) and the sleeper has used nothing.
        let (spun_tx, spun_rx) = std::sync::mpsc::channel();
        let (stop_spin, spin_stop) = std::sync::mpsc::channel::<()>();
        let (stop_sleep, sleep_stop) = std::sync::mpsc::channel::<()>();
        let spin = std::thread::Builder::new()
            .name("cpu-test-spin".into())
            .spawn(move || {
                let mut x = 0u64;
                while own_cpu() < std::time::Duration::from_millis(50) {
                    x = std::hint::black_box(x.wrapping_add(1));
                }
                spun_tx.send(()).expect("the test waits");
                let _ = spin_stop.recv();
            })
            .expect("spawn");
        let sleep = std::thread::Builder::new()
            .name("cpu-test-sleep".into())
            .spawn(move || {
                let _ = sleep_stop.recv();
            })
            .expect("spawn");
        spun_rx.recv().expect("the spinner spins");
        let after = CpuSample::now().expect("sampled before");
        drop((stop_spin, stop_sleep));
        spin.join().expect("spin");
        sleep.join().expect("sleep");
        let mut cpu = ThreadCpu::default();
        cpu.add(&before, &after);
        let spun = cpu.cpu_secs.get("cpu-test-spin").copied().unwrap_or(0.0);
        let slept = cpu.cpu_secs.get("cpu-test-sleep").copied().unwrap_or(0.0);
        // The spinner used 50 ms (/proc counts in ticks of 10 ms or less);
        // the sleeper nothing.
        assert!(spun > 0.005, "spinning thread used {spun} s");
        assert!(slept < 0.002, "sleeping thread used {slept} s");
        assert!(cpu.busiest(8).iter().any(|(n, _)| n == "cpu-test-spin"));
        assert!(cpu.summary(3).contains("cpu-test-spin"));
    }
}
