//! Printing results: tables on the terminal, JSON for machines, SVG plots
//! written next to them.

use std::path::{Path, PathBuf};

use kvbm_bench::BenchError;
use kvbm_bench::matrix::{MatrixConfig, MatrixRow};
use kvbm_bench::offload::OffloadReport;
use kvbm_bench::replay::{ReplayReport, RestartReport};
use kvbm_bench::soak::{ProcSample, SoakReport};
use kvbm_bench::svg::{LinePlot, Series, format_bytes};
use kvbm_bench::table::Table;
use serde_json::json;

use crate::cli::Cli;

/// Checks, before a command runs, that the files `--json-file` and `--svg`
/// name can be written (creating `--svg`'s directory, as writing the plot
/// would), so a bad path fails at once, naming its flag, instead of after
/// the run.
pub fn check_paths(cli: &Cli) -> Result<(), BenchError> {
    if let Some(path) = &cli.json_file {
        probe("--json-file", path)?;
    }
    if let Some(path) = cli.svg.as_ref().filter(|_| !cli.no_svg) {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|source| BenchError::OutputFlag {
                flag: "--svg",
                path: path.clone(),
                source,
            })?;
        }
        probe("--svg", path)?;
    }
    Ok(())
}

/// Opens `path` for writing without changing it, and removes it again
/// when it did not exist.
fn probe(flag: &'static str, path: &Path) -> Result<(), BenchError> {
    let existed = std::fs::symlink_metadata(path).is_ok();
    match std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
    {
        Ok(_) => {
            if !existed {
                let _ = std::fs::remove_file(path);
            }
            Ok(())
        }
        Err(source) => Err(BenchError::OutputFlag {
            flag,
            path: path.to_path_buf(),
            source,
        }),
    }
}

fn write_svg(cli: &Cli, default_name: &str, plot: &LinePlot) -> Result<(), BenchError> {
    if cli.no_svg {
        return Ok(());
    }
    let path: PathBuf = cli
        .svg
        .clone()
        .unwrap_or_else(|| cli.dir.join(default_name));
    let io = |source| match &cli.svg {
        Some(_) => BenchError::OutputFlag {
            flag: "--svg",
            path: path.clone(),
            source,
        },
        None => BenchError::Output {
            path: path.clone(),
            source,
        },
    };
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(io)?;
    }
    std::fs::write(&path, plot.render()).map_err(io)?;
    if !cli.quiet {
        eprintln!("plot written to {}", path.display());
    }
    Ok(())
}

/// Writes `value` to `--json-file` when given, and prints it with `--json`.
/// Returns whether it was printed (then the table is not).
fn emit_json(cli: &Cli, value: &serde_json::Value) -> Result<bool, BenchError> {
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| BenchError::Config(format!("cannot encode JSON: {e}")))?;
    // Printed first: a file that cannot be written still leaves the
    // results on stdout.
    if cli.json {
        println!("{text}");
    }
    if let Some(path) = &cli.json_file {
        std::fs::write(path, format!("{text}\n")).map_err(|source| BenchError::OutputFlag {
            flag: "--json-file",
            path: path.clone(),
            source,
        })?;
    }
    Ok(cli.json)
}

/// The transfer matrix.
pub fn matrix(cli: &Cli, config: &MatrixConfig, rows: &[MatrixRow]) -> Result<(), BenchError> {
    let max_batch = config.blocks_per_batch.iter().copied().max().unwrap_or(1);
    let mut series: Vec<Series> = Vec::new();
    for r in rows
        .iter()
        .filter(|r| r.blocks_per_batch == max_batch && r.blocks > 0)
    {
        let name = format!("{} {}->{}", r.path, r.src_layout, r.dst_layout);
        let point = (r.block_bytes as f64, r.gbps.median);
        match series.iter_mut().find(|s| s.name == name) {
            Some(s) => s.points.push(point),
            None => series.push(Series {
                name,
                points: vec![point],
            }),
        }
    }
    write_svg(
        cli,
        "transfer.svg",
        &LinePlot {
            title: format!(
                "kvbm transfer bandwidth, {} ({} blocks per batch)",
                config.model.name, max_batch
            ),
            x_label: "block size".into(),
            y_label: "GB/s".into(),
            log2_x: true,
            x_as_bytes: true,
            series,
        },
    )?;
    if emit_json(
        cli,
        &json!({
            "benchmark": "transfer",
            "model": config.model,
            "bytes_per_rep": config.bytes_per_rep,
            "reps": config.reps,
            "memcpy_threads": config.memcpy_threads,            "rows": rows,
        }),
    )? {
        return Ok(());
    }
    println!(
        "kvbm transfer matrix — model {} ({} per token), {} per repetition, median of {} (min–max)",
        config.model.name,
        format_bytes(config.model.bytes_per_token() as f64),
        format_bytes(config.bytes_per_rep as f64),
        config.reps
    );
    let mut t = Table::new([
        "path",
        "layouts",
        "tok/blk",
        "block",
        "batch",
        "GB/s",
        "min–max",
        "reference",
        "ref GB/s",
        "ratio",
        "checked",
        "status",
    ]);
    for r in rows {
        let ok = r.blocks > 0;
        let num = |v: f64| if ok { format!("{v:.2}") } else { String::new() };
        t.row([
            r.path.to_string(),
            format!("{}->{}", r.src_layout, r.dst_layout),
            r.tokens_per_block.to_string(),
            format_bytes(r.block_bytes as f64),
            r.blocks_per_batch.to_string(),
            num(r.gbps.median),
            if ok {
                format!("{:.2}–{:.2}", r.gbps.min, r.gbps.max)
            } else {
                String::new()
            },
            r.reference.to_string(),
            num(r.reference_gbps.median),
            num(r.ratio),
            if r.verified { "yes" } else { "" }.to_string(),
            r.status.clone(),
        ]);
    }
    print!("{}", t.render());
    Ok(())
}

/// The replay report.
pub fn replay(cli: &Cli, r: &ReplayReport) -> Result<(), BenchError> {
    let measured_x = r.tiers.iter().map(|t| t.capacity_blocks).sum::<usize>() as f64
        / r.unique_blocks.max(1) as f64
        * 100.0;
    let mut series = Vec::new();
    if !r.sweep.is_empty() {
        let line = |name: &str, f: &dyn Fn(&kvbm_bench::replay::SweepPoint) -> f64| Series {
            name: name.to_string(),
            points: r.sweep.iter().map(|p| (p.fraction * 100.0, f(p))).collect(),
        };
        series.push(line("tiered reuse-score (sim)", &|p| p.tiered_reuse_pct));
        series.push(line("tiered LRU victim (sim)", &|p| p.tiered_lru_pct));
        series.push(line("single LRU", &|p| p.lru_pct));
        series.push(line("Belady optimum", &|p| p.belady_pct));
    } else {
        series.push(Series {
            name: "single LRU".into(),
            points: vec![(measured_x, r.lru_hit_rate_pct)],
        });
        series.push(Series {
            name: "Belady optimum".into(),
            points: vec![(measured_x, r.belady_hit_rate_pct)],
        });
    }
    series.push(Series {
        name: "kvbm replay (measured)".into(),
        points: vec![(measured_x, r.hit_rate_pct)],
    });
    write_svg(
        cli,
        "replay.svg",
        &LinePlot {
            title: format!("hit rate against capacity — {}", r.workload),
            x_label: "total capacity G1+G2+G3, % of distinct blocks".into(),
            y_label: "prompt blocks hit, %".into(),
            log2_x: false,
            x_as_bytes: false,
            series,
        },
    )?;
    let value = serde_json::to_value(r)
        .map_err(|e| BenchError::Config(format!("cannot encode JSON: {e}")))?;
    if emit_json(cli, &value)? {
        return Ok(());
    }
    println!("kvbm replay — {}", r.workload);
    println!(
        "  {} requests, {} block references, {} distinct blocks of {} tokens",
        r.requests, r.block_references, r.unique_blocks, r.block_tokens
    );
    println!(
        "  model {} ({} per token), scale 1/{}: {} tokens stored per block, {} per block",
        r.model.name,
        format_bytes(r.model.bytes_per_token() as f64),
        r.scale,
        r.stored_tokens_per_block,
        format_bytes(r.block_bytes as f64)
    );
    println!("  G1: {}", r.g1_memory);
    println!("  placement: {}", r.placement);
    println!();
    let mut t = Table::new(["tier", "capacity (blocks)", "hits", "hit rate %"]);
    for h in &r.tiers {
        t.row([
            h.tier.to_string(),
            h.capacity_blocks.to_string(),
            h.hits.to_string(),
            format!("{:.2}", h.hit_rate_pct),
        ]);
    }
    t.row([
        "all".to_string(),
        r.tiers
            .iter()
            .map(|h| h.capacity_blocks)
            .sum::<usize>()
            .to_string(),
        r.tiers.iter().map(|h| h.hits).sum::<u64>().to_string(),
        format!("{:.2}", r.hit_rate_pct),
    ]);
    print!("{}", t.render());
    println!();
    let mut t = Table::new(["same total capacity", "hit rate %"]);
    t.row([
        "kvbm replay (measured)".to_string(),
        format!("{:.2}", r.hit_rate_pct),
    ]);
    t.row([
        "tiered reuse-score (sim)".to_string(),
        format!("{:.2}", r.sim_reuse_hit_rate_pct),
    ]);
    t.row([
        "tiered LRU victim (sim)".to_string(),
        format!("{:.2}", r.sim_lru_tiers_hit_rate_pct),
    ]);
    t.row([
        "single LRU".to_string(),
        format!("{:.2}", r.lru_hit_rate_pct),
    ]);
    t.row([
        "Belady optimum".to_string(),
        format!("{:.2}", r.belady_hit_rate_pct),
    ]);
    print!("{}", t.render());
    println!();
    println!(
        "  prefill avoided: {} tokens by G1, {} tokens by kvbm (of {} prompt tokens)",
        r.tokens_avoided_g1, r.tokens_avoided_kvbm, r.prompt_tokens
    );
    println!(
        "  modelled TTFT saving: {:.1} s of prefill at {:.0} tokens/s, for {:.2} s of onboarding",
        r.modelled_ttft_saving_s, r.prefill_tokens_per_s, r.onboard_total_s
    );
    let c = &r.onboard_cost;
    println!(
        "  onboard latency (match -> landed in G1): p50 {:.3} ms, p99 {:.3} ms over {} onboards; {} blocks verified byte for byte",
        r.onboard_p50_ms, r.onboard_p99_ms, r.onboards, r.verified_blocks
    );
    println!(
        "  recomputing the same stored tokens at {:.0} tokens/s: p50 {:.3} ms, p99 {:.3} ms; {} onboards were slower",
        r.prefill_tokens_per_s, c.recompute_p50_ms, c.recompute_p99_ms, c.slower_than_recompute
    );
    if c.raw_read_gbps > 0.0 {
        println!(
            "  G3 onboards ({} served from G3 alone{}): {:.2} GB/s match -> landed ({:.0} % of it until G1 was allocated); raw O_DIRECT sequential read, same disk, same run: {:.2} GB/s; ratio {:.2}",
            c.g3_onboards,
            if r.g3_staging_blocks > 0 {
                format!(
                    ", prefetched at match into {} staging blocks",
                    r.g3_staging_blocks
                )
            } else {
                ", read into G1 at onboard".to_string()
            },
            c.g3_gbps,
            c.g3_alloc_share * 100.0,
            c.raw_read_gbps,
            c.g3_vs_raw
        );
    }
    if let Some(why) = &c.raw_read_skipped {
        println!("  raw O_DIRECT read reference skipped: {why}");
    }
    if r.decline_slow_loads {
        println!(
            "  blocks the engine's cost model left to recompute (slower to load): {}",
            r.declined_blocks
        );
    }
    println!(
        "  offloads skipped by the engine's policy: {}",
        r.offloads_skipped
    );
    if r.copy_failures.is_empty() && r.failed_onboards == 0 {
        println!("  copy failures: none");
    } else {
        println!(
            "  COPY FAILURES: {} blocks failed to offload, {} to onboard; {} onboards failed and were computed again",
            r.offload_failures, r.onboard_failures, r.failed_onboards
        );
        let mut t = Table::new(["failed path", "errno", "blocks"]);
        for f in &r.copy_failures {
            t.row([f.path.to_string(), f.errno.clone(), f.blocks.to_string()]);
        }
        print!("{}", t.render());
    }
    println!();
    let mut t = Table::new(["path", "blocks", "bytes", "GB/s (single-path phases)"]);
    for p in &r.paths {
        t.row([
            p.path.to_string(),
            p.blocks.to_string(),
            format_bytes(p.bytes as f64),
            if p.gbps > 0.0 {
                format!("{:.2}", p.gbps)
            } else {
                "-".to_string()
            },
        ]);
    }
    print!("{}", t.render());
    println!(
        "  all onboard phases: {:.2} GB/s; all offload phases (G1->G2->G3 drained per request): {:.2} GB/s",
        r.onboard_gbps, r.offload_gbps
    );
    if !r.sweep.is_empty() {
        println!();
        let mut t = Table::new([
            "capacity % distinct",
            "blocks",
            "tiered reuse %",
            "tiered LRU %",
            "single LRU %",
            "Belady %",
        ]);
        for p in &r.sweep {
            t.row([
                format!("{:.0}", p.fraction * 100.0),
                p.capacity_blocks.to_string(),
                format!("{:.2}", p.tiered_reuse_pct),
                format!("{:.2}", p.tiered_lru_pct),
                format!("{:.2}", p.lru_pct),
                format!("{:.2}", p.belady_pct),
            ]);
        }
        print!("{}", t.render());
    }
    println!("  replay wall time {:.1} s", r.wall_s);
    if let Some(rs) = &r.restarts {
        restarts(r, rs);
    }
    Ok(())
}

/// A ratio, or `-` where the reference hit nothing.
fn ratio(r: Option<f64>) -> String {
    r.map_or_else(|| "-".to_string(), |v| format!("{v:.3}"))
}

/// The restarts of a replay against its uninterrupted reference.
fn restarts(r: &ReplayReport, rs: &RestartReport) {
    println!();
    println!(
        "restarts: {} whole-instance crashes (every worker SIGKILLed, leader and engine dropped unflushed), {}; {}",
        rs.rows.len(),
        match rs.seed {
            Some(seed) => format!("points drawn from seed {seed}"),
            None => "points spread evenly".to_string(),
        },
        if rs.g2_kept {
            "G2 and G3 kept, G1 lost"
        } else {
            "G3 kept, G1 and G2 lost"
        }
    );
    println!(
        "  reference: the same configuration without restarts, same invocation: {:.2} % over the trace ({:.2} % with restarts), {} blocks verified, wall {:.1} s",
        rs.reference_hit_rate_pct,
        r.hit_rate_pct,
        rs.reference_verified_blocks,
        rs.reference_wall_s
    );
    let mut t = Table::new([
        "at",
        "requests",
        "hit %",
        "reference %",
        "ratio",
        "G3 hits",
        "ref G3 hits",
        "G3 held",
        "recovered",
        "rejected",
        "recov. wanted / hit / evicted unused",
        "first after",
        "1st req G3 / kept",
        "verified",
        "kill -> ready s (restore)",
        "G3 open ms (ranks)",
    ]);
    for row in &rs.rows {
        let s = &row.span;
        t.row([
            format!("{:.3} (#{})", row.at_fraction, s.first_request),
            s.requests.to_string(),
            format!("{:.2}", s.hit_rate_pct),
            format!("{:.2}", s.reference_hit_rate_pct),
            ratio(s.ratio),
            s.g3_hits.to_string(),
            s.reference_g3_hits.to_string(),
            row.g3_held_at_crash.to_string(),
            if row.g2_recovered > 0 {
                format!("{} + G2 {}", row.g3_recovered, row.g2_recovered)
            } else {
                row.g3_recovered.to_string()
            },
            row.g3_rejected.to_string(),
            format!(
                "{} / {} / {}",
                row.recovered_referenced, row.recovered_hits, row.recovered_evicted_unreferenced
            ),
            row.first_recovered_hit_after
                .map_or_else(|| "-".to_string(), |n| n.to_string()),
            format!(
                "{} / {}",
                row.first_request_g3_hits, row.first_request_kept_prefix
            ),
            row.verified_blocks.to_string(),
            format!("{:.3} ({:.3})", row.restart_s, row.restore_s),
            row.g3_open_ms
                .iter()
                .map(|ms| format!("{ms:.1}"))
                .collect::<Vec<_>>()
                .join(" / "),
        ]);
    }
    print!("{}", t.render());
    for row in &rs.rows {
        let parts: Vec<String> = row.recovery.iter().map(|&r| ratio(r)).collect();
        println!(
            "  restart at #{}: ratio by tenth of its span: {}",
            row.span.first_request,
            parts.join(" ")
        );
    }
    let b = &rs.before_first_restart;
    println!(
        "  before the first restart ({} requests): {:.2} % against {:.2} %, ratio {}",
        b.requests,
        b.hit_rate_pct,
        b.reference_hit_rate_pct,
        ratio(b.ratio)
    );
    let a = &rs.after_first_restart;
    println!(
        "  from the first restart to the end ({} requests): {:.2} % against {:.2} %, ratio {}",
        a.requests,
        a.hit_rate_pct,
        a.reference_hit_rate_pct,
        ratio(a.ratio)
    );
    let d = &rs.g3_disk_end;
    println!(
        "  G3 directories after the run: {} directories, {} files, {} on disk ({} apparent); configured G3 {} of data ({} as laid out) + {} of records; {} blocks unreadable",
        d.directories,
        d.files,
        format_bytes(d.allocated_bytes as f64),
        format_bytes(d.apparent_bytes as f64),
        format_bytes(rs.g3_configured_bytes as f64),
        format_bytes(rs.g3_data_file_bytes as f64),
        format_bytes(rs.g3_record_bytes as f64),
        rs.g3_unreadable
    );
}

/// The offload bench.
pub fn offload(cli: &Cli, r: &OffloadReport) -> Result<(), BenchError> {
    if emit_json(
        cli,
        &json!({
            "benchmark": "offload",
            "report": r,
        }),
    )? {
        return Ok(());
    }
    println!(
        "kvbm tier engine offload G1 -> G2 — model {} ({} per token), median of {} reps after a warm-up (min–max)",
        r.model.name,
        format_bytes(r.model.bytes_per_token() as f64),
        r.reps
    );
    println!("{}", r.memory);
    for reference in [&r.reference_h2d, &r.reference_d2h] {
        println!(
            "reference: {} of {}: {:.2} GB/s ({:.2}–{:.2})",
            reference.what,
            format_bytes(reference.bytes as f64),
            reference.gbps.median,
            reference.gbps.min,
            reference.gbps.max
        );
    }
    for note in &r.notes {
        println!("note: {note}");
    }
    let mut t = Table::new([
        "tok/blk",
        "chunk",
        "load",
        "batch",
        "in flight",
        "blocks",
        "per rep",
        "GB/s",
        "min–max",
        "÷ D2H",
        "GEMM alone",
        "GEMM during",
        "loss %",
        "copied",
        "skipped",
        "checked",
        "status",
    ]);
    for row in &r.rows {
        let ok = row.gbps.median > 0.0;
        let num = |v: f64| if ok { format!("{v:.2}") } else { String::new() };
        t.row([
            row.tokens_per_block.to_string(),
            format_bytes(row.chunk_bytes as f64),
            match &row.backend_load {
                Some(told) if told != row.load.name() => {
                    format!("{} (backend told {told})", row.load.name())
                }
                _ => row.load.name().to_string(),
            },
            if row.batch_run == row.batch || row.batch_run == 0 {
                row.batch.to_string()
            } else {
                format!("{} (ran {})", row.batch, row.batch_run)
            },
            row.in_flight.to_string(),
            row.blocks.to_string(),
            format_bytes(row.bytes_per_rep as f64),
            num(row.gbps.median),
            if ok {
                format!("{:.2}–{:.2}", row.gbps.min, row.gbps.max)
            } else {
                String::new()
            },
            num(row.ratio_to_d2h),
            row.gemm_alone_tflops
                .map_or(String::new(), |t| format!("{:.0}", t.median)),
            row.gemm_during_tflops.map_or(String::new(), |t| {
                format!("{:.0} ({:.0}–{:.0})", t.median, t.min, t.max)
            }),
            row.gemm_loss_pct
                .map_or(String::new(), |l| format!("{l:.1}")),
            row.copied_blocks.to_string(),
            row.skipped_blocks.to_string(),
            row.verified_blocks.to_string(),
            row.status.clone(),
        ]);
    }
    print!("{}", t.render());
    let with_cpu: Vec<_> = r
        .rows
        .iter()
        .filter_map(|row| row.cpu.as_ref().map(|c| (row, c)))
        .collect();
    if !with_cpu.is_empty() {
        println!("\nhost CPU over the timed reps (cores busy: all threads, then the busiest):");
        for (row, cpu) in with_cpu {
            println!(
                "  {} tok/blk, {}, batch {}, {} in flight: {}",
                row.tokens_per_block,
                row.load.name(),
                row.batch_run,
                row.in_flight,
                cpu.summary(5)
            );
        }
    }
    let sustained: Vec<_> = r
        .rows
        .iter()
        .filter_map(|row| row.sustained.as_ref().map(|s| (row, s)))
        .collect();
    if !sustained.is_empty() {
        println!(
            "\nsustained beside the GEMM: offloads streaming (each round queued before the last is waited for), against as long of the GEMM alone before and after"
        );
        let mut t = Table::new([
            "tok/blk",
            "batch",
            "in flight",
            "seconds",
            "rounds",
            "GB/s",
            "÷ D2H",
            "GEMM alone",
            "GEMM during",
            "loss %",
            "host CPU",
        ]);
        let opt =
            |v: Option<f64>, digits: usize| v.map_or(String::new(), |x| format!("{x:.digits$}"));
        for (row, s) in sustained {
            t.row([
                row.tokens_per_block.to_string(),
                row.batch_run.to_string(),
                row.in_flight.to_string(),
                format!("{:.2}", s.secs),
                s.rounds.to_string(),
                format!("{:.2}", s.gbps),
                format!("{:.2}", s.ratio_to_d2h),
                opt(s.gemm_alone_tflops, 0),
                opt(s.gemm_during_tflops, 0),
                opt(s.gemm_loss_pct, 1),
                s.cpu.as_ref().map_or(String::new(), |c| c.summary(3)),
            ]);
        }
        print!("{}", t.render());
    }
    for row in &r.rows {
        if let Some(tl) = &row.timeline {
            println!(
                "\ntimelines of the last rep: {} tokens per block, batch {}, {} in flight, {}:\n{tl}",
                row.tokens_per_block,
                row.batch_run,
                row.in_flight,
                row.load.name()
            );
        }
    }
    Ok(())
}

/// The soak run.
pub fn soak(cli: &Cli, r: &SoakReport) -> Result<(), BenchError> {
    let value = serde_json::to_value(r)
        .map_err(|e| BenchError::Config(format!("cannot encode JSON: {e}")))?;
    if emit_json(cli, &value)? {
        return Ok(());
    }
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
    print!("{}", t.render());
    Ok(())
}
