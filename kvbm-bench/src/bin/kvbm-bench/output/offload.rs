//! The offload bench's report as tables.

use kvbm_bench::BenchError;
use kvbm_bench::offload::OffloadReport;
use kvbm_bench::svg::format_bytes;
use kvbm_bench::table::Table;
use serde_json::json;

use crate::cli::Cli;

/// The offload bench.
pub fn offload(cli: &Cli, r: &OffloadReport) -> Result<(), BenchError> {
    if super::emit_json(
        cli,
        &json!({
            "benchmark": "offload",
            "report": r,
        }),
    )? {
        return Ok(());
    }
    header(r);
    print!("{}", rows(r).render());
    cpu(r);
    sustained(r);
    timelines(r);
    Ok(())
}

/// The model, the memory and the references the rows are set against.
fn header(r: &OffloadReport) {
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
}

/// One row per measurement: its rate, its ratio to device → pinned, the
/// GEMM beside it and what the engine counted.
fn rows(r: &OffloadReport) -> Table {
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
    t
}

/// The host CPU each row used over its timed reps, where measured.
fn cpu(r: &OffloadReport) {
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
}

/// The sustained offloads beside the GEMM, where measured.
fn sustained(r: &OffloadReport) {
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
}

/// The copier's timelines of each row's last rep, where recorded.
fn timelines(r: &OffloadReport) {
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
}
