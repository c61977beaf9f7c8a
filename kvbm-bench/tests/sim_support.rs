//! Shared helpers of the simulator tests (included with `mod`).
#![allow(dead_code)]

use kvbm_testkit::trace::{Request, TraceFacts, mooncake_trace_or_skip, read_mooncake};

/// Reads the published trace `name` (`<name>_trace.jsonl`), found by
/// [`mooncake_trace_or_skip`]: `None` when it is not there (the skip line
/// is printed), a failure instead with `KVBM_REQUIRE_TRACES=1`.
pub fn load(name: &str) -> Option<(Vec<Request>, TraceFacts)> {
    let path = mooncake_trace_or_skip(env!("CARGO_MANIFEST_DIR").as_ref(), name)
        .unwrap_or_else(|missing| panic!("{missing}"))?;
    let requests = read_mooncake(&path).expect("the published trace parses");
    let facts = TraceFacts::of(&requests);
    Some((requests, facts))
}
