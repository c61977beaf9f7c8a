//! Shared helpers of the simulator tests (included with `mod`).
#![allow(dead_code)]

use std::path::PathBuf;

use kvbm_testkit::trace::{Request, TraceFacts, read_mooncake};

/// The Mooncake trace directory, if present: `shared/data/mooncake` in the
/// workspace root or in any directory above it (a checkout may live deeper
/// than the data).
pub fn mooncake_dir() -> Option<PathBuf> {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.ancestors()
        .map(|dir| dir.join("shared/data/mooncake"))
        .find(|p| p.join("conversation_trace.jsonl").is_file())
}

/// Reads `<name>_trace.jsonl`, or prints the skip line and returns `None`.
pub fn load(name: &str) -> Option<(Vec<Request>, TraceFacts)> {
    let Some(dir) = mooncake_dir() else {
        println!("skipped: trace data not found");
        return None;
    };
    let path = dir.join(format!("{name}_trace.jsonl"));
    let requests = read_mooncake(&path).expect("the published trace parses");
    let facts = TraceFacts::of(&requests);
    Some((requests, facts))
}
