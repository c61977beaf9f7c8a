//! The soak run's report as tables.

use kvbm_bench::BenchError;
use kvbm_bench::soak::{ProcSample, SoakReport};
use kvbm_bench::table::Table;

use crate::cli::Cli;

/// The soak run.
pub fn soak(cli: &Cli, r: &SoakReport) -> Result<(), BenchError> {
    let value = serde_json::to_value(r)
        .map_err(|e| BenchError::Config(format!("cannot encode JSON: {e}")))?;
    if super::emit_json(cli, &value)? {
        return Ok(());
    }
    summary(r);
    kills(r);
    print!("{}", processes(r).render());
    Ok(())
}

/// What the soak served and verified, its failures by cause and the
/// offloads skipped.
fn summary(r: &SoakReport) {
    println!("kvbm soak — {}", r.workload);
    println!(
        "  {} worker processes, {:.0} s, {} pass(es) over the trace, {} kills",
        r.workers,
        r.wall_s,
        r.passes,
        r.kills.len()
    );
    println!(
        "  requests served {}, abandoned {}; blocks verified on every rank {}; mismatches {}",
        r.requests_served, r.requests_failed, r.blocks_verified, r.mismatches
    );
    let mut t = Table::new(["failure", "count"]);
    for (cause, n) in &r.failures {
        t.row([cause.clone(), n.to_string()]);
    }
    if r.failures.is_empty() {
        t.row(["(none)".to_string(), "0".into()]);
    }
    print!("{}", t.render());
    if !r.offloads_skipped.is_empty() {
        let skipped: Vec<String> = r
            .offloads_skipped
            .iter()
            .map(|(k, n)| format!("{k} {n}"))
            .collect();
        println!("  offloads skipped by policy: {}", skipped.join(", "));
    }
}

/// The kills, one row each (no table without any).
fn kills(r: &SoakReport) {
    let mut t = Table::new([
        "kill at s",
        "rank",
        "killed pid",
        "new pid",
        "rejoined in s",
        "stale files",
    ]);
    for k in &r.kills {
        t.row([
            format!("{:.1}", k.at_s),
            k.rank.to_string(),
            k.killed_pid.to_string(),
            k.new_pid.to_string(),
            k.rejoin_s.map_or("never".into(), |s| format!("{s:.2}")),
            k.stale_files_removed.to_string(),
        ]);
    }
    if !r.kills.is_empty() {
        print!("{}", t.render());
    }
}

/// Memory and open files of every process at the start, once warm, and
/// at the end.
fn processes(r: &SoakReport) -> Table {
    let mut t = Table::new([
        "process",
        "start pid",
        "start RSS MiB",
        "start fds",
        "warm RSS MiB",
        "warm fds",
        "end pid",
        "end RSS MiB",
        "end fds",
    ]);
    let find = |v: &[ProcSample], role: &str| v.iter().find(|s| s.role == role).cloned();
    let mib = |s: &Option<ProcSample>| {
        s.as_ref()
            .map_or("-".into(), |s| format!("{:.1}", s.rss_kib as f64 / 1024.0))
    };
    let fds = |s: &Option<ProcSample>| s.as_ref().map_or("-".into(), |s| s.open_files.to_string());
    let pid = |s: &Option<ProcSample>| s.as_ref().map_or("-".into(), |s| s.pid.to_string());
    for role in r.start.iter().map(|s| s.role.clone()) {
        let (a, w, b) = (
            find(&r.start, &role),
            find(&r.warm, &role),
            find(&r.end, &role),
        );
        t.row([
            role.clone(),
            pid(&a),
            mib(&a),
            fds(&a),
            mib(&w),
            fds(&w),
            pid(&b),
            mib(&b),
            fds(&b),
        ]);
    }
    t
}
