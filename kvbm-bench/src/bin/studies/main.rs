//! `studies`: the cache-policy studies behind `docs/policy-study.md`, each
//! printing its tables (they replay the Mooncake traces from
//! `shared/data/mooncake`, many times over: minutes each, build with
//! `--release`).
//!
//! ```text
//! cargo run --release -p kvbm-bench --bin studies              # list them
//! cargo run --release -p kvbm-bench --bin studies -- NAME...   # run some
//! ```
//!
//! What their conclusions rest on is checked by kvbm-bench's tests
//! (`sim_bounds.rs`, `sim_policy.rs`); these only print.

mod agentic;
mod bounds;
#[path = "../../../tests/bounds_support/mod.rs"]
mod bounds_support;
mod defaults;
mod policy;
#[path = "../../../tests/sim_support.rs"]
mod sim_support;
mod tier_replay;

use std::process::ExitCode;

/// Every study: its name, what it prints, and the function that does it.
const STUDIES: &[(&str, &str, fn())] = &[
    (
        "policy_study",
        "every candidate policy on every tiered configuration",
        policy::policy_study,
    ),
    (
        "reuse_split",
        "diagnostic: hits by prior use count",
        policy::reuse_split,
    ),
    (
        "orphans",
        "diagnostic: orphaned blocks in kvbm's tiers",
        policy::orphans,
    ),
    (
        "bounds_study",
        "how far calibrated reuse probabilities get, against Belady",
        bounds::bounds_study,
    ),
    ("gap_study", "hits by reuse gap", bounds::gap_study),
    (
        "online_study",
        "learned predictors over feature cells",
        bounds::online_study,
    ),
    (
        "predictability_study",
        "how good a predictor must be, how good one can be",
        bounds::predictability_study,
    ),
    (
        "support_sweep",
        "how much support a cell needs before it stops memorising",
        bounds::support_sweep,
    ),
    (
        "long_horizon_study",
        "long horizons for the 20% configuration",
        bounds::long_horizon_study,
    ),
    (
        "g3_capacity_study",
        "how much G3 the winner needs on conversation",
        bounds::g3_capacity_study,
    ),
    (
        "combo_study",
        "coarse feature combinations, in-sample and cross-fitted",
        bounds::combo_study,
    ),
    (
        "mooncake_replay_table",
        "the traces through the real tier engine, bytes checked",
        tier_replay::mooncake_replay_table,
    ),
    (
        "agentic_hints",
        "retention hints of 100/90/70% accuracy on the agentic workload",
        agentic::agentic_hints,
    ),
    (
        "defaults_study",
        "candidate reuse-score defaults against LRU on every workload",
        defaults::defaults_study,
    ),
    (
        "policy_experiments",
        "the reuse score's age exponents ($KVBM_AGE_EXPONENTS) in the engine",
        tier_replay::policy_experiments,
    ),
];

fn main() -> ExitCode {
    let names: Vec<String> = std::env::args().skip(1).collect();
    if names.is_empty() {
        println!("studies (run with: studies NAME...):");
        for (name, what, _) in STUDIES {
            println!("  {name:<22} {what}");
        }
        return ExitCode::SUCCESS;
    }
    let mut chosen = Vec::new();
    for name in &names {
        match STUDIES.iter().find(|(n, _, _)| n == name) {
            Some(study) => chosen.push(study),
            None => {
                eprintln!("studies: no study `{name}` (run without arguments to list them)");
                return ExitCode::from(2);
            }
        }
    }
    for (name, _, study) in chosen {
        println!("== {name}");
        study();
    }
    ExitCode::SUCCESS
}
