//! `kvbm-dist-node`: the kvbm-dist worker process, one per GPU /
//! tensor-parallel rank (`kvbm-dist-node worker ...`; see `kvbm_dist::node`
//! for its arguments). Built without this crate's test hooks (features
//! `probe` and `fault-injection`), as a release build is, it has none.

fn main() -> std::process::ExitCode {
    kvbm_dist::node::main()
}
