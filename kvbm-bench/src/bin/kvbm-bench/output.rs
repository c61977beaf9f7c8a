//! Printing results: tables on the terminal, JSON for machines, SVG plots
//! written next to them.

use std::path::{Path, PathBuf};

use kvbm_bench::BenchError;
use kvbm_bench::matrix::{MatrixConfig, MatrixRow};
use kvbm_bench::svg::{LinePlot, Series, format_bytes};
use kvbm_bench::table::Table;
use serde_json::json;

use crate::cli::Cli;

mod offload;
mod replay;
mod soak;

pub use offload::offload;
pub use replay::replay;
pub use soak::soak;

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
    matrix_plot(cli, config, rows)?;
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
    print!("{}", matrix_table(rows).render());
    Ok(())
}

/// GB/s against block size at the largest batch, one line per path and
/// layout pair.
fn matrix_plot(cli: &Cli, config: &MatrixConfig, rows: &[MatrixRow]) -> Result<(), BenchError> {
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
    )
}

/// One row per cell: its rate, its reference's, their ratio and status.
fn matrix_table(rows: &[MatrixRow]) -> Table {
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
    t
}
