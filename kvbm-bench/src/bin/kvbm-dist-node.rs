//! `kvbm-dist-node`: a kvbm-dist worker process (see `kvbm_dist::node` for
//! its arguments). Built here so that `cargo run -p kvbm-bench` builds it
//! next to `kvbm-bench`, whose tensor-parallel replay starts it.

fn main() -> std::process::ExitCode {
    kvbm_dist::node::main()
}
