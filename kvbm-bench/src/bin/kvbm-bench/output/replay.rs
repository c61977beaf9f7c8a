//! The replay's report as tables, and its plot.

use kvbm_bench::BenchError;
use kvbm_bench::replay::{ReplayReport, RestartReport};
use kvbm_bench::svg::{LinePlot, Series, format_bytes};
use kvbm_bench::table::Table;

use crate::cli::Cli;

/// The replay report.
pub fn replay(cli: &Cli, r: &ReplayReport) -> Result<(), BenchError> {
    plot(cli, r)?;
    let value = serde_json::to_value(r)
        .map_err(|e| BenchError::Config(format!("cannot encode JSON: {e}")))?;
    if super::emit_json(cli, &value)? {
        return Ok(());
    }
    header(r);
    hit_rates(r);
    savings(r);
    failures(r);
    paths(r);
    sweep(r);
    println!("  replay wall time {:.1} s", r.wall_s);
    if let Some(rs) = &r.restarts {
        restarts(r, rs);
    }
    Ok(())
}

/// The hit rate against capacity: the sweep's simulators when there is
/// one (else LRU and Belady at the measured capacity), and the replay.
fn plot(cli: &Cli, r: &ReplayReport) -> Result<(), BenchError> {
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
    super::write_svg(
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
    )
}

/// The workload, the model and what holds the tiers.
fn header(r: &ReplayReport) {
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
}

/// Hits per tier, then the replay's hit rate against the simulators' at
/// the same total capacity.
fn hit_rates(r: &ReplayReport) {
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
}

/// What the hits saved in prefill, what the onboards cost, and the G3
/// onboard rate against the disk's own.
fn savings(r: &ReplayReport) {
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
}

/// Declined loads, skipped offloads and copy failures.
fn failures(r: &ReplayReport) {
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
}

/// Bytes and speed of each path, then of all onboards and offloads.
fn paths(r: &ReplayReport) {
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
}

/// The simulators over the capacity sweep, when there was one.
fn sweep(r: &ReplayReport) {
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
    print!("{}", restart_table(rs).render());
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

/// One row per restart: the hit rate of its span against the reference's,
/// what G3 kept and recovered, and how long the restart took.
fn restart_table(rs: &RestartReport) -> Table {
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
    t
}
