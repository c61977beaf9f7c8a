//! Only the instance's own processes may speak, and the distributed parts
//! shut down cleanly: a leader (this process, or a child process that is
//! killed) and `kvbm-dist-node` worker processes on 127.0.0.1 and IPC,
//! with strangers sending hellos, hijack attempts and frames of another
//! version.

mod common;
mod node_harness;

use std::io::BufRead;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use common::{
    Reaper, WAIT, WorkerSpec, exit_within, hello, is_empty, leader_config, spec, stderr_of,
    stranger, with_version,
};
use kvbm_dist::DistError;
use kvbm_dist::auth::{InstanceSecret, SECRET_ENV};
use kvbm_dist::leader::{PRIVATE_ENDPOINT, PendingLeader};
use kvbm_dist::proto::{self, Message};
use kvbm_pool::Tier;
use kvbm_pool::tier::TierMover;
use kvbm_transfer::CancelToken;

fn strangers_and_hijackers_are_refused_and_the_instance_stays_whole() {
    let dir = tempfile::tempdir().unwrap();
    let instance = 0xa1;
    let pending = PendingLeader::bind(leader_config("tcp://127.0.0.1:*", instance, 2)).unwrap();
    let ep = pending.endpoint().to_owned();
    let secret = pending.secret().clone();
    let key = pending.curve_public().copied();
    let _workers = Reaper(
        (0..2)
            .map(|r| spec(dir.path(), &ep, instance, r, &secret).spawn())
            .collect(),
    );
    let leader = pending.handshake().unwrap();
    assert!(leader.status().is_whole());

    // Hellos for the live rank 1: no MAC, a wrong secret's MAC, and the
    // right secret's MAC copied from another identity. None evicts it.
    let ctx = zmq::Context::new();
    let s = stranger(&ctx, &ep, b"hijacker", key.as_ref());
    let wrong = InstanceSecret::from_bytes([0x42; 32]);
    let zero = InstanceSecret::from_bytes([0; 32]);
    s.send(&hello(instance, 1, 2, b"hijacker", &zero)).unwrap();
    s.send(&hello(instance, 1, 2, b"hijacker", &wrong)).unwrap();
    s.send(&hello(instance, 1, 2, b"the-real-rank-1", &secret))
        .unwrap();
    // And frames only a worker may send.
    s.send(&Message::Pong { seq: 1, rank: 1 }).unwrap();
    for _ in 0..4 {
        let r = s.recv_timeout(20_000).unwrap().expect("an error reply");
        assert!(matches!(r.message, Ok(Message::Error(_))), "{r:?}");
    }
    assert!(
        leader.wait_for(WAIT, |st| st.refused.stranger >= 4),
        "{:?}",
        leader.status()
    );
    let st = leader.status();
    assert!(st.is_whole(), "{st:?}");
    assert!(st.losses.is_empty(), "{st:?}");
    // Still serving copies on both ranks.
    let (tx, rx) = mpsc::channel();
    leader
        .mover()
        .copy(Tier::G1, Tier::G2, vec![(0, 0)], CancelToken::new())
        .on_complete(move |o| {
            let _ = tx.send(o);
        });
    assert_eq!(rx.recv_timeout(WAIT).unwrap().unwrap().blocks, 1);
    assert_eq!(leader.mover().capacity(Tier::G2), Some(4));
    leader.shutdown();
}

fn a_wrong_version_or_instance_during_the_handshake_is_refused_and_it_completes() {
    let dir = tempfile::tempdir().unwrap();
    let instance = 0xa2;
    let pending = PendingLeader::bind(leader_config("tcp://127.0.0.1:*", instance, 2)).unwrap();
    let ep = pending.endpoint().to_owned();
    let secret = pending.secret().clone();
    let key = pending.curve_public().copied();
    let ctx = zmq::Context::new();
    let s = stranger(&ctx, &ep, b"old-build", key.as_ref());
    // Well-formed but of the next version, even with a valid MAC.
    let next = with_version(
        &hello(instance, 0, 2, b"old-build", &secret),
        proto::PROTOCOL_VERSION + 1,
    );
    s.send_raw(next).unwrap();
    s.send(&hello(instance + 1, 0, 2, b"old-build", &secret))
        .unwrap();
    let handle = std::thread::spawn(move || pending.handshake());
    for _ in 0..2 {
        let r = s.recv_timeout(20_000).unwrap().expect("an error reply");
        assert!(matches!(r.message, Ok(Message::Error(_))), "{r:?}");
    }
    let _workers = Reaper(
        (0..2)
            .map(|r| spec(dir.path(), &ep, instance, r, &secret).spawn())
            .collect(),
    );
    let leader = handle.join().unwrap().expect("the handshake completes");
    let st = leader.status();
    assert!(st.is_whole(), "{st:?}");
    assert_eq!(
        (st.refused.wrong_version, st.refused.wrong_instance),
        (1, 1)
    );
    leader.shutdown();
}

fn a_worker_without_a_secret_is_refused_and_one_with_it_takes_the_rank() {
    let dir = tempfile::tempdir().unwrap();
    let instance = 0xa3;
    let mut c = leader_config(kvbm_dist::leader::PRIVATE_ENDPOINT, instance, 2);
    c.handshake_timeout = Duration::from_secs(3);
    let pending = PendingLeader::bind(c).unwrap();
    let ep = pending.endpoint().to_owned();
    assert!(ep.starts_with("ipc://"), "{ep}");
    let sock_dir = std::path::PathBuf::from(ep.trim_start_matches("ipc://"))
        .parent()
        .unwrap()
        .to_owned();
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&sock_dir).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o700, "{}", sock_dir.display());
    let secret = pending.secret().clone();
    let wrong = InstanceSecret::from_bytes([7; 32]);
    let mut workers = Reaper(vec![
        spec(dir.path(), &ep, instance, 0, &secret).spawn(),
        spec(dir.path(), &ep, instance, 1, &wrong).spawn(),
    ]);
    let e = pending.handshake().unwrap_err();
    assert!(
        matches!(&e, DistError::Timeout { phase: "hello", missing, rejected, .. }
            if *missing == [1] && rejected.iter().any(|r| r.contains("stranger"))),
        "{e}"
    );
    // The refused worker was told to exit, the waiting one shut down; the
    // private directory went with the leader.
    for (rank, c) in workers.0.iter_mut().enumerate() {
        let (status, _) = exit_within(c, WAIT).expect("a worker hung");
        let err = stderr_of(c);
        if rank == 0 {
            assert!(status.success(), "rank 0: {status:?} {err}");
        } else {
            assert!(!status.success() && err.contains("refused"), "{err}");
        }
    }
    assert!(!sock_dir.exists(), "{}", sock_dir.display());
}

fn a_worker_with_no_leader_exits_within_its_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let secret = InstanceSecret::generate().unwrap();
    let mut w = WorkerSpec {
        leader_timeout_ms: 2000,
        ..spec(dir.path(), "tcp://127.0.0.1:1", 0xa4, 0, &secret)
    }
    .spawn();
    let (status, took) = exit_within(&mut w, Duration::from_secs(30)).expect("no exit");
    let err = stderr_of(&mut w);
    assert!(!status.success(), "{err}");
    assert!(took < Duration::from_secs(20), "{took:?}");
    assert!(err.contains("no answer from the leader"), "{err}");
}

fn a_worker_without_the_secret_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = WorkerSpec {
        secret: None,
        ..spec(
            dir.path(),
            "tcp://127.0.0.1:1",
            0xa5,
            0,
            &InstanceSecret::from_bytes([0; 32]),
        )
    }
    .spawn();
    let (status, _) = exit_within(&mut w, WAIT).expect("no exit");
    let err = stderr_of(&mut w);
    assert!(!status.success());
    assert!(err.contains(SECRET_ENV), "{err}");
}

fn a_rank_lost_during_the_handshake_is_named_and_the_others_shut_down_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let instance = 0xa6;
    let pending = PendingLeader::bind(leader_config("tcp://127.0.0.1:*", instance, 2)).unwrap();
    let ep = pending.endpoint().to_owned();
    let secret = pending.secret().clone();
    let key = pending.curve_public().copied();
    // Rank 1 says hello (with the secret) and dies before the configure.
    {
        let ctx = zmq::Context::new();
        let fake = stranger(&ctx, &ep, b"rank-1-dies", key.as_ref());
        fake.send(&hello(instance, 1, 2, b"rank-1-dies", &secret))
            .unwrap();
        std::thread::sleep(Duration::from_millis(300));
    }
    let handle = std::thread::spawn(move || pending.handshake());
    std::thread::sleep(Duration::from_millis(500));
    let rank0 = spec(dir.path(), &ep, instance, 0, &secret);
    let g3 = rank0.g3_dir();
    let mut workers = Reaper(vec![rank0.spawn()]);
    let e = handle.join().unwrap().unwrap_err();
    assert!(
        matches!(&e, DistError::Worker { rank: 1, message } if message.contains("unreachable")),
        "{e}"
    );
    // Rank 0 was configured (its G3 file existed), then told to shut down:
    // it exits cleanly and its G3 file is gone.
    let Some((status, _)) = exit_within(&mut workers.0[0], Duration::from_secs(10)) else {
        panic!("rank 0 hung: {}", stderr_of(&mut workers.0[0]));
    };
    let err = stderr_of(&mut workers.0[0]);
    assert!(status.success(), "{status:?} {err}");
    assert!(is_empty(&g3), "G3 left behind in {}", g3.display());
}

fn a_late_rank_is_named_and_the_rank_in_time_is_not_blamed() {
    let dir = tempfile::tempdir().unwrap();
    let instance = 0xa7;
    let mut config = leader_config(PRIVATE_ENDPOINT, instance, 2);
    config.handshake_timeout = Duration::from_secs(3);
    let wait = config.worker_leader_timeout();
    assert!(wait > config.handshake_timeout);
    let pending = PendingLeader::bind(config).unwrap();
    let ep = pending.endpoint().to_owned();
    let secret = pending.secret().clone();
    // Rank 0 comes at once, with the leader timeout the leader gives its
    // workers; rank 1 never does.
    let mut workers = Reaper(vec![
        WorkerSpec {
            leader_timeout_ms: wait.as_millis() as u64,
            ..spec(dir.path(), &ep, instance, 0, &secret)
        }
        .spawn(),
    ]);
    let e = pending.handshake().unwrap_err();
    assert!(
        matches!(&e, DistError::Timeout { phase: "hello", missing, .. } if *missing == [1]),
        "only the late rank is named: {e}"
    );
    // Rank 0 was still waiting: the leader told it to shut down, and it
    // did not report its leader gone.
    let Some((status, _)) = exit_within(&mut workers.0[0], WAIT) else {
        panic!("rank 0 hung: {}", stderr_of(&mut workers.0[0]));
    };
    let err = stderr_of(&mut workers.0[0]);
    assert!(status.success(), "{status:?} {err}");
    assert!(!err.contains("leader gone"), "{err}");
}

/// The leader of [`orphaned_workers_exit`], run in a child process of this
/// test binary (it does nothing unless started that way).
fn leader_process() {
    let Ok(endpoint) = std::env::var("KVBM_TEST_LEADER_ENDPOINT") else {
        return;
    };
    let secret = InstanceSecret::from_hex(&std::env::var(SECRET_ENV).unwrap()).unwrap();
    let mut c = leader_config(&endpoint, 0xa7, 2);
    c.secret = Some(secret);
    let pending = PendingLeader::bind(c).unwrap();
    println!("LEADER BOUND");
    let leader = pending.handshake().unwrap();
    assert!(leader.status().is_whole());
    println!("LEADER READY");
    // Killed by the test from here on.
    std::thread::sleep(Duration::from_secs(120));
}

/// Starts [`leader_process`] and two workers, then sends the leader
/// `signal`: every worker must exit, failing with `expect`, well before
/// its 60 s leader timeout, and leave no G3 file.
fn orphaned_workers_exit(signal: libc::c_int, expect: &str) {
    let dir = tempfile::tempdir().unwrap();
    let endpoint = format!("ipc://{}", dir.path().join("leader.sock").display());
    let secret = InstanceSecret::generate().unwrap();
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "leader_process",
        "--nocapture",
        "--test-threads",
        "1",
    ])
    .env("KVBM_TEST_LEADER_ENDPOINT", &endpoint)
    .stdout(Stdio::piped());
    secret.pass_to(&mut cmd);
    let mut leader = Reaper(vec![cmd.spawn().unwrap()]);
    let (tx, rx) = mpsc::channel();
    let out = std::io::BufReader::new(leader.0[0].stdout.take().unwrap());
    std::thread::spawn(move || {
        for line in out.lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let wait_line = |want: &str| loop {
        let line = rx.recv_timeout(WAIT).expect("the leader process stalled");
        if line.contains(want) {
            break;
        }
    };
    wait_line("LEADER BOUND");
    let specs: Vec<_> = (0..2)
        .map(|r| spec(dir.path(), &endpoint, 0xa7, r, &secret))
        .collect();
    let mut workers = Reaper(specs.iter().map(WorkerSpec::spawn).collect());
    wait_line("LEADER READY");
    let pid = leader.0[0].id() as libc::pid_t;
    // SAFETY: kill(2) on our own child's pid; no memory is involved.
    assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
    for (rank, c) in workers.0.iter_mut().enumerate() {
        let (status, took) = exit_within(c, WAIT).expect("an orphaned worker runs on");
        let err = stderr_of(c);
        assert!(!status.success(), "rank {rank}: {err}");
        assert!(err.contains(expect), "rank {rank}: {err}");
        assert!(took < Duration::from_secs(10), "rank {rank} took {took:?}");
        assert!(is_empty(&specs[rank].g3_dir()), "rank {rank} left G3");
    }
}

fn a_worker_whose_leader_is_killed_exits_at_once() {
    // The kernel closes the dead leader's socket: the workers see the
    // connection drop.
    orphaned_workers_exit(libc::SIGKILL, "connection to the leader");
}

fn a_worker_whose_leader_stalls_exits_within_a_few_heartbeats() {
    // A stopped leader keeps its connections open but sends nothing:
    // heartbeats every 100 ms, 10 missed (at least 1 s) and they exit.
    orphaned_workers_exit(libc::SIGSTOP, "no heartbeat");
}

/// Every test, by name.
const TESTS: [(&str, fn()); 10] = [
    (
        "a_late_rank_is_named_and_the_rank_in_time_is_not_blamed",
        a_late_rank_is_named_and_the_rank_in_time_is_not_blamed,
    ),
    (
        "strangers_and_hijackers_are_refused_and_the_instance_stays_whole",
        strangers_and_hijackers_are_refused_and_the_instance_stays_whole,
    ),
    (
        "a_wrong_version_or_instance_during_the_handshake_is_refused_and_it_completes",
        a_wrong_version_or_instance_during_the_handshake_is_refused_and_it_completes,
    ),
    (
        "a_worker_without_a_secret_is_refused_and_one_with_it_takes_the_rank",
        a_worker_without_a_secret_is_refused_and_one_with_it_takes_the_rank,
    ),
    (
        "a_worker_with_no_leader_exits_within_its_timeout",
        a_worker_with_no_leader_exits_within_its_timeout,
    ),
    (
        "a_worker_without_the_secret_says_so",
        a_worker_without_the_secret_says_so,
    ),
    (
        "a_rank_lost_during_the_handshake_is_named_and_the_others_shut_down_cleanly",
        a_rank_lost_during_the_handshake_is_named_and_the_others_shut_down_cleanly,
    ),
    ("leader_process", leader_process),
    (
        "a_worker_whose_leader_is_killed_exits_at_once",
        a_worker_whose_leader_is_killed_exits_at_once,
    ),
    (
        "a_worker_whose_leader_stalls_exits_within_a_few_heartbeats",
        a_worker_whose_leader_stalls_exits_within_a_few_heartbeats,
    ),
];

fn main() -> std::process::ExitCode {
    node_harness::main(&TESTS)
}
