//! The handshake: every rank says `Hello`, the leader checks the ranks
//! agree, sizes G2 and G3 from its byte budgets, sends `Configure`, and
//! waits until every rank is `Ready`.
//!
//! Configuration errors that waiting cannot fix fail at once and name the
//! culprit: a peer of another protocol version, of another instance or
//! world size, two peers claiming one rank, a rank whose block shape
//! differs from rank 0's, a rank that reports an error instead of
//! `Ready`. A hostile or garbled frame is answered with an error and
//! noted, and the wait goes on; if the deadline passes the error names the
//! missing ranks and what was refused meanwhile.

use std::collections::BTreeMap;
use std::time::Instant;

use crate::error::{DistError, Result};
use crate::proto::{Configure, ErrorReply, Hello, Message, ProtoError, truncate};
use crate::transport::RouterSocket;

use super::{Cluster, LeaderConfig};

pub(crate) fn run(router: &RouterSocket, config: &LeaderConfig) -> Result<Cluster> {
    let _span = tracing::info_span!("handshake", instance = config.instance).entered();
    let result = run_inner(router, config);
    if let Err(e) = &result {
        tracing::warn!("handshake failed: {e}");
    }
    result
}

fn peer_name(peer: &[u8]) -> String {
    String::from_utf8_lossy(peer).into_owned()
}

/// Refuses `peer` and tells it to exit.
fn dismiss(router: &RouterSocket, peer: &[u8], message: String) {
    refuse(router, peer, message);
    let _ = router.send(peer, &Message::Shutdown);
}

fn refuse(router: &RouterSocket, peer: &[u8], message: String) {
    let _ = router.send(
        peer,
        &Message::Error(ErrorReply {
            transfer_id: None,
            message: truncate(message),
        }),
    );
}

/// Tells every peer that said hello to exit, then returns `e`.
fn abort(
    router: &RouterSocket,
    hellos: &BTreeMap<u32, (Vec<u8>, Hello)>,
    e: DistError,
) -> DistError {
    for (peer, _) in hellos.values() {
        let _ = router.send(peer, &Message::Shutdown);
    }
    e
}

fn wait(router: &RouterSocket, deadline: Instant) -> Result<bool> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Ok(false);
    }
    let mut items = [router.raw().as_poll_item(zmq::POLLIN)];
    zmq::poll(&mut items, left.as_millis().max(1) as i64).map_err(DistError::zmq("poll"))?;
    Ok(true)
}

fn run_inner(router: &RouterSocket, config: &LeaderConfig) -> Result<Cluster> {
    let world = config.world_size;
    let mut hellos: BTreeMap<u32, (Vec<u8>, Hello)> = BTreeMap::new();
    let mut rejected: Vec<String> = Vec::new();
    let started = Instant::now();
    let deadline = started + config.handshake_timeout;
    while hellos.len() < world as usize {
        if !wait(router, deadline)? {
            let missing = (0..world).filter(|r| !hellos.contains_key(r)).collect();
            return Err(abort(
                router,
                &hellos,
                DistError::Timeout {
                    phase: "hello",
                    waited_ms: started.elapsed().as_millis() as u64,
                    missing,
                    rejected,
                },
            ));
        }
        while let Some(r) = router.try_recv()? {
            let name = peer_name(&r.peer);
            match r.message {
                Err(ProtoError::UnsupportedVersion { found, supported }) => {
                    refuse(
                        router,
                        &r.peer,
                        format!("unsupported protocol version {found}"),
                    );
                    return Err(abort(
                        router,
                        &hellos,
                        DistError::VersionMismatch {
                            peer: name,
                            found,
                            supported,
                        },
                    ));
                }
                Err(e) => {
                    tracing::warn!(peer = %name, "refused a frame: {e}");
                    refuse(router, &r.peer, format!("refused frame: {e}"));
                    rejected.push(format!("{name}: {e}"));
                }
                Ok(Message::Hello(h)) => {
                    if h.instance != config.instance || h.world_size != world {
                        let reason = format!(
                            "instance {:x} of world {} (this leader: instance {:x}, world {world})",
                            h.instance, h.world_size, config.instance
                        );
                        dismiss(router, &r.peer, reason.clone());
                        return Err(abort(
                            router,
                            &hellos,
                            DistError::Foreign { peer: name, reason },
                        ));
                    }
                    match hellos.get(&h.rank) {
                        Some((first, _)) if *first == r.peer => {} // a repeated hello
                        Some((first, _)) => {
                            let e = DistError::DuplicateRank {
                                rank: h.rank,
                                first: peer_name(first),
                                second: name,
                            };
                            dismiss(router, &r.peer, e.to_string());
                            return Err(abort(router, &hellos, e));
                        }
                        None => {
                            tracing::info!(peer = %name, rank = h.rank, "hello");
                            hellos.insert(h.rank, (r.peer, h));
                        }
                    }
                }
                Ok(other) => {
                    tracing::warn!(peer = %name, kind = ?other.kind(), "expected a hello");
                    refuse(
                        router,
                        &r.peer,
                        format!("expected a hello, got {:?}", other.kind()),
                    );
                    rejected.push(format!("{name}: unexpected {:?}", other.kind()));
                }
            }
        }
    }

    // Every rank must have rank 0's block shape and G1 layout.
    let reference = hellos[&0].1.clone();
    for (&rank, (_, h)) in &hellos {
        if let Some(reason) = shape_difference(&reference, h) {
            return Err(abort(
                router,
                &hellos,
                DistError::ShapeMismatch { rank, reason },
            ));
        }
    }
    let bytes_per_block = reference.bytes_per_block;
    let per_block_all = bytes_per_block.saturating_mul(u64::from(world));
    let configure = Configure {
        g2_blocks: (config.g2_bytes / per_block_all).min(crate::proto::MAX_TIER_BLOCKS),
        g3_blocks: (config.g3_bytes / per_block_all).min(crate::proto::MAX_TIER_BLOCKS),
        block_size: config.block_size,
        heartbeat_ms: config
            .heartbeat_interval
            .as_millis()
            .clamp(1, u32::MAX as u128) as u32,
    };
    tracing::info!(
        g2 = configure.g2_blocks,
        g3 = configure.g3_blocks,
        "configuring {world} workers"
    );
    for (peer, _) in hellos.values() {
        router.send(peer, &Message::Configure(configure))?;
    }

    let mut ready = vec![false; world as usize];
    let started = Instant::now();
    let deadline = started + config.handshake_timeout;
    let rank_of = |peer: &[u8]| hellos.iter().find(|(_, (p, _))| p == peer).map(|(&r, _)| r);
    while ready.iter().any(|r| !r) {
        if !wait(router, deadline)? {
            let missing = (0..world).filter(|&r| !ready[r as usize]).collect();
            return Err(abort(
                router,
                &hellos,
                DistError::Timeout {
                    phase: "ready",
                    waited_ms: started.elapsed().as_millis() as u64,
                    missing,
                    rejected,
                },
            ));
        }
        while let Some(r) = router.try_recv()? {
            let name = peer_name(&r.peer);
            let rank = rank_of(&r.peer);
            match (rank, r.message) {
                (Some(rank), Ok(Message::Ready(m))) if m.rank == rank => {
                    if m.g2_blocks != configure.g2_blocks || m.g3_blocks != configure.g3_blocks {
                        let e = DistError::Worker {
                            rank,
                            message: format!(
                                "ready with {}/{} G2/G3 blocks, {}/{} configured",
                                m.g2_blocks, m.g3_blocks, configure.g2_blocks, configure.g3_blocks
                            ),
                        };
                        return Err(abort(router, &hellos, e));
                    }
                    tracing::info!(rank, "ready");
                    ready[rank as usize] = true;
                }
                (Some(rank), Ok(Message::Error(e))) => {
                    let e = DistError::Worker {
                        rank,
                        message: e.message,
                    };
                    return Err(abort(router, &hellos, e));
                }
                (Some(_), Ok(Message::Hello(_))) => {} // a repeated hello
                (_, Err(e)) => {
                    tracing::warn!(peer = %name, "refused a frame: {e}");
                    refuse(router, &r.peer, format!("refused frame: {e}"));
                    rejected.push(format!("{name}: {e}"));
                }
                (_, Ok(other)) => {
                    tracing::warn!(peer = %name, kind = ?other.kind(), "expected ready");
                    refuse(
                        router,
                        &r.peer,
                        format!("expected ready, got {:?}", other.kind()),
                    );
                    rejected.push(format!("{name}: unexpected {:?}", other.kind()));
                }
            }
        }
    }
    Ok(Cluster {
        identities: hellos.values().map(|(p, _)| p.clone()).collect(),
        reference,
        configure,
    })
}

/// Why `h` does not match `reference`, if it does not.
pub(crate) fn shape_difference(reference: &Hello, h: &Hello) -> Option<String> {
    if h.bytes_per_block != reference.bytes_per_block {
        return Some(format!(
            "{} bytes per block, rank 0 has {}",
            h.bytes_per_block, reference.bytes_per_block
        ));
    }
    if h.device_blocks != reference.device_blocks {
        return Some(format!(
            "{} device blocks, rank 0 has {}",
            h.device_blocks, reference.device_blocks
        ));
    }
    if h.layout != reference.layout {
        return Some(format!(
            "layout {:?} / {:?}, rank 0 has {:?} / {:?}",
            h.layout.kind, h.layout.config, reference.layout.kind, reference.layout.config
        ));
    }
    None
}
