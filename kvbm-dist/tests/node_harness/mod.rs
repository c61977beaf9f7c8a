//! The `main` of a test binary that doubles as the worker process,
//! `kvbm-dist-node` (so it needs no path to that executable, and runs
//! wherever it is copied): started with `worker ...` it runs the one worker
//! entry point, [`kvbm_dist::node::main`]; otherwise it runs its tests.

use std::process::ExitCode;

/// `worker ...`: the worker process. Otherwise the tests whose names
/// contain any of the arguments that are not flags (all without one;
/// `--exact` for whole names, `--list` to list them), one after another,
/// reported the way libtest reports them.
pub fn main(tests: &[(&str, fn())]) -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("worker") {
        return kvbm_dist::node::main();
    }
    let flag = |f: &str| args.iter().any(|a| a == f);
    let filters: Vec<&str> = args
        .iter()
        .map(String::as_str)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let chosen: Vec<_> = tests
        .iter()
        .filter(|(name, _)| {
            filters.is_empty()
                || filters.iter().any(|f| {
                    if flag("--exact") {
                        name == f
                    } else {
                        name.contains(f)
                    }
                })
        })
        .collect();
    if flag("--list") {
        for (name, _) in &chosen {
            println!("{name}: test");
        }
        return ExitCode::SUCCESS;
    }
    let plural = if chosen.len() == 1 { "" } else { "s" };
    println!("\nrunning {} test{plural}", chosen.len());
    let mut failed = Vec::new();
    for (name, test) in &chosen {
        let ok = std::panic::catch_unwind(test).is_ok();
        println!("test {name} ... {}", if ok { "ok" } else { "FAILED" });
        if !ok {
            failed.push(*name);
        }
    }
    let passed = chosen.len() - failed.len();
    let filtered = tests.len() - chosen.len();
    if failed.is_empty() {
        println!(
            "\ntest result: ok. {passed} passed; 0 failed; 0 ignored; 0 measured; {filtered} filtered out\n"
        );
        ExitCode::SUCCESS
    } else {
        println!("\nfailures:\n    {}", failed.join("\n    "));
        println!(
            "\ntest result: FAILED. {passed} passed; {} failed; 0 ignored; 0 measured; {filtered} filtered out\n",
            failed.len()
        );
        ExitCode::FAILURE
    }
}
