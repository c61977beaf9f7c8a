//! The worker as a trust boundary: a stand-in leader (a raw ROUTER)
//! sends it hostile and out-of-range requests.

use std::time::Duration;

use kvbm_layout::{Layout, LayoutConfig, LayoutKind};
use kvbm_pool::Tier;
use kvbm_transfer::PhysicalLayout;
use kvbm_transfer::memory::SystemAllocator;

use super::*;
use crate::proto::{Message, Transfer};
use crate::transport::{Received, RouterSocket};

fn recv(router: &RouterSocket) -> Received {
    for _ in 0..200 {
        let mut items = [router.raw().as_poll_item(zmq::POLLIN)];
        zmq::poll(&mut items, 100).unwrap();
        if let Some(r) = router.try_recv().unwrap() {
            return r;
        }
    }
    panic!("the worker did not answer");
}

#[test]
fn hostile_requests_are_refused_and_the_worker_carries_on() {
    let dir = tempfile::tempdir().unwrap();
    let ctx = zmq::Context::new();
    let router = RouterSocket::bind(
        &ctx,
        &format!("ipc://{}", dir.path().join("l").display()),
        None,
    )
    .unwrap();
    let c = LayoutConfig::new(4, 1, 2, 4, 32, 2).unwrap();
    let g1 = PhysicalLayout::allocate_system(
        Layout::new(c, LayoutKind::FullyContiguous).unwrap(),
        &SystemAllocator::new(),
    )
    .unwrap();
    let secret = crate::auth::InstanceSecret::from_bytes([1; 32]);
    let mut config = WorkerConfig::new(router.endpoint(), 1, 0, 1, g1, secret.clone());
    config.leader_timeout = Duration::from_secs(30);
    let worker = std::thread::spawn(move || run(config));
    let hello = recv(&router);
    let Ok(Message::Hello(h)) = &hello.message else {
        panic!("{hello:?}");
    };
    // The hello carries the MAC of the secret over its own identity.
    assert_eq!(
        h.auth,
        crate::auth::hello_mac(&secret, 1, 0, 1, &hello.peer)
    );
    let peer = hello.peer;
    let send = |m: &Message| router.send(&peer, m).unwrap();

    // Before Configure there is no G2: a transfer into it is refused.
    let t = |id, src, dst, pairs| {
        Message::Transfer(Transfer {
            id,
            src,
            dst,
            pairs,
            labels: Vec::new(),
        })
    };
    send(&t(1, Tier::G1, Tier::G2, vec![(0, 0)]));
    let r = recv(&router);
    assert!(
        matches!(&r.message, Ok(Message::Ack(a)) if a.transfer_id == 1 && a.completed.is_empty() && a.failure.as_ref().is_some_and(|f| f.failed == [(0, 0)])),
        "{r:?}"
    );
    send(&Message::Configure(crate::proto::Configure {
        g2_blocks: 2,
        g3_blocks: 0,
        block_size: 4,
        heartbeat_ms: 100,
        verify: false,
    }));
    assert!(matches!(recv(&router).message, Ok(Message::Ready(_))));
    // Out of range, duplicate destinations, an absent G3: refused by name.
    for (id, m, needle) in [
        (2, t(2, Tier::G1, Tier::G2, vec![(4, 0)]), "outside G1"),
        (3, t(3, Tier::G1, Tier::G2, vec![(0, 2)]), "outside G2"),
        (4, t(4, Tier::G1, Tier::G2, vec![(0, 1), (1, 1)]), "twice"),
        (5, t(5, Tier::G2, Tier::G3, vec![(0, 0)]), "outside G3"),
    ] {
        send(&m);
        let r = recv(&router);
        assert!(
            matches!(&r.message, Ok(Message::Ack(a)) if a.transfer_id == id && a.completed.is_empty() && a.failure.as_ref().is_some_and(|f| f.error.contains(needle))),
            "{needle}: {r:?}"
        );
    }
    // Garbage gets an error reply.
    router.raw().send(&peer[..], zmq::SNDMORE).unwrap();
    router.raw().send(&b"not a frame"[..], 0).unwrap();
    assert!(matches!(recv(&router).message, Ok(Message::Error(_))));
    // And a good transfer still works.
    send(&t(6, Tier::G1, Tier::G2, vec![(3, 1)]));
    let r = recv(&router);
    assert!(
        matches!(&r.message, Ok(Message::Ack(a)) if a.transfer_id == 6 && a.completed == [(3, 1)] && a.failure.is_none()),
        "{r:?}"
    );
    send(&Message::Ping { seq: 9 });
    assert!(matches!(
        recv(&router).message,
        Ok(Message::Pong { seq: 9, rank: 0 })
    ));
    send(&Message::Shutdown);
    worker.join().unwrap().unwrap();
}
