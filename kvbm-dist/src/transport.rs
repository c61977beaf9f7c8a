//! ZeroMQ sockets, wrapped to speak [`Message`]s.
//!
//! The leader binds a ROUTER; every worker connects a DEALER whose identity
//! is unique per process (`instance/rank/random nonce`), so the leader
//! addresses a worker by identity and a restarted worker is a new peer. The
//! ROUTER is *mandatory* (sending to a vanished peer is an error, which
//! tells the leader a worker is gone without waiting for its heartbeat to
//! lapse) and never hands a connected identity over to a second connection:
//! a stranger claiming a live worker's identity is dropped by ZeroMQ, so a
//! frame from a worker's identity comes from the connection that
//! authenticated it.
//!
//! On one host the leader listens by default on an IPC socket inside a
//! private directory ([`PrivateDir`], mode 0700): only its user can even
//! connect. On TCP both ends speak CURVE where this build has it
//! ([`crate::curve`]). Peer identities are attacker-chosen bytes; [`peer_name`] is the
//! only form in which they reach a log or an error.
//!
//! ZeroMQ sockets are not thread-safe, so each one is used by exactly one
//! thread: its event loop. Other threads (transfer callbacks, API callers)
//! hand work to a loop through a channel and wake it with an inproc
//! wake-up pair ([`wake_pair`]), which the loop polls together with its network socket —
//! nothing wakes on a timer to look for work.

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::curve::{LeaderKey, LeaderPublicKey};
use crate::error::{DistError, Result};
use crate::proto::{self, Message, ProtoError};

/// Most frames buffered towards one peer before sends fail.
const HIGH_WATER_MARK: i32 = 10_000;

/// A received frame: who sent it and what it decoded to.
#[derive(Debug)]
pub struct Received {
    /// The sender's ZeroMQ identity (empty on a DEALER).
    pub peer: Vec<u8>,
    /// The message, or why the frame was refused.
    pub message: std::result::Result<Message, ProtoError>,
}

/// The leader's ROUTER socket.
pub struct RouterSocket {
    socket: zmq::Socket,
    endpoint: String,
}

impl RouterSocket {
    /// Binds `endpoint` (`tcp://host:port`, `tcp://127.0.0.1:*` for an
    /// ephemeral port, or `ipc:///path`), as a CURVE server with `curve`
    /// when given.
    pub fn bind(ctx: &zmq::Context, endpoint: &str, curve: Option<&LeaderKey>) -> Result<Self> {
        let socket = ctx
            .socket(zmq::ROUTER)
            .map_err(DistError::zmq("router socket"))?;
        socket
            .set_router_mandatory(true)
            .map_err(DistError::zmq("router mandatory"))?;
        set_frame_limits(&socket)?;
        if let Some(key) = curve {
            key.serve(&socket)?;
        }
        socket.bind(endpoint).map_err(DistError::zmq("bind"))?;
        let endpoint = match socket.get_last_endpoint() {
            Ok(Ok(e)) => e,
            _ => endpoint.to_owned(),
        };
        Ok(RouterSocket { socket, endpoint })
    }

    /// The endpoint workers connect to (the bound port filled in).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Sends `message` to `peer`. An unreachable peer is an error
    /// (`EHOSTUNREACH`).
    pub fn send(&self, peer: &[u8], message: &Message) -> Result<()> {
        let frame = proto::encode(message)?;
        self.socket
            .send(peer, zmq::SNDMORE | zmq::DONTWAIT)
            .map_err(DistError::zmq("send identity"))?;
        self.socket
            .send(frame, zmq::DONTWAIT)
            .map_err(DistError::zmq("send"))
    }

    /// Receives one frame without blocking; `None` when nothing is queued.
    /// Multipart messages other than `[identity, frame]` are refused.
    pub fn try_recv(&self) -> Result<Option<Received>> {
        let parts = match self.socket.recv_multipart(zmq::DONTWAIT) {
            Ok(p) => p,
            Err(zmq::Error::EAGAIN) => return Ok(None),
            Err(e) => return Err(DistError::zmq("receive")(e)),
        };
        let mut parts = parts.into_iter();
        let peer = parts.next().unwrap_or_default();
        let message = match (parts.next(), parts.next()) {
            (Some(frame), None) => proto::decode(&frame),
            (None, _) => Err(ProtoError::Truncated {
                what: "frame",
                need: proto::HEADER_BYTES,
                left: 0,
            }),
            (Some(_), Some(_)) => Err(ProtoError::Invalid {
                what: "frame",
                reason: "more than one part".into(),
            }),
        };
        Ok(Some(Received { peer, message }))
    }

    pub(crate) fn raw(&self) -> &zmq::Socket {
        &self.socket
    }

    /// Lets frames already queued (a `Shutdown` to every worker) leave for
    /// up to `ms` when the socket closes, instead of dropping them.
    pub(crate) fn flush_on_close(&self, ms: i32) {
        let _ = self.socket.set_linger(ms);
    }
}

/// The printable form of a peer's ZeroMQ identity: ASCII escapes for every
/// byte that is not printable ASCII (so a newline or a terminal escape in
/// an identity cannot forge a log line), cut to 128 characters.
pub fn peer_name(peer: &[u8]) -> String {
    let mut s = peer.escape_ascii().to_string();
    if s.len() > 128 {
        s.truncate(128);
        s.push_str("...");
    }
    s
}

/// The printable form of text a peer sent (an error text, a reason that
/// quotes its frame): every control character, and every character that
/// reorders what a terminal shows (bidirectional overrides), as its
/// escape (`\n`, `\u{1b}`), so a peer's text cannot start a log line of
/// its own or colour one. Escaping twice changes nothing: the escaped
/// text holds no such character. Every peer-supplied string goes through
/// this before it reaches a log line or an error.
pub fn printable(text: &str) -> String {
    let hostile =
        |c: char| c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
    if !text.contains(hostile) {
        return text.to_owned();
    }
    let mut s = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if hostile(c) {
            s.extend(c.escape_default());
        } else {
            s.push(c);
        }
    }
    s
}

pub use crate::private_dir::PrivateDir;

/// True for a TCP endpoint whose host is not a loopback address (frames to
/// it cross a network).
pub(crate) fn is_remote_tcp(endpoint: &str) -> bool {
    let Some(rest) = endpoint.strip_prefix("tcp://") else {
        return false;
    };
    let host = match rest.rfind(':') {
        Some(i) => &rest[..i],
        None => rest,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    !(host == "localhost" || host == "::1" || host.starts_with("127."))
}

/// What both ends set: no linger on close, a bounded send queue, and no
/// message larger than the biggest valid frame (libzmq drops the peer
/// rather than buffering it).
fn set_frame_limits(socket: &zmq::Socket) -> Result<()> {
    socket.set_linger(0).map_err(DistError::zmq("linger"))?;
    socket
        .set_sndhwm(HIGH_WATER_MARK)
        .map_err(DistError::zmq("send high-water mark"))?;
    socket
        .set_maxmsgsize(proto::MAX_FRAME_BYTES as i64)
        .map_err(DistError::zmq("max message size"))
}

/// A worker's DEALER socket.
pub struct DealerSocket {
    socket: zmq::Socket,
}

impl DealerSocket {
    /// Connects to the leader at `endpoint` with `identity`, as a CURVE
    /// client of the leader holding `leader` when given.
    pub fn connect(
        ctx: &zmq::Context,
        endpoint: &str,
        identity: &[u8],
        leader: Option<&LeaderPublicKey>,
    ) -> Result<Self> {
        let socket = ctx
            .socket(zmq::DEALER)
            .map_err(DistError::zmq("dealer socket"))?;
        socket
            .set_identity(identity)
            .map_err(DistError::zmq("identity"))?;
        set_frame_limits(&socket)?;
        if let Some(key) = leader {
            key.connect_as_client(&socket)?;
        }
        socket
            .connect(endpoint)
            .map_err(DistError::zmq("connect"))?;
        Ok(DealerSocket { socket })
    }

    /// Sends `message` to the leader.
    pub fn send(&self, message: &Message) -> Result<()> {
        let frame = proto::encode(message)?;
        self.send_raw(frame)
    }

    /// Sends pre-encoded bytes (tests send hostile frames this way).
    pub fn send_raw(&self, frame: Vec<u8>) -> Result<()> {
        self.socket.send(frame, 0).map_err(DistError::zmq("send"))
    }

    /// Receives one frame without blocking; `None` when nothing is queued.
    pub fn try_recv(&self) -> Result<Option<Received>> {
        match self.socket.recv_bytes(zmq::DONTWAIT) {
            Ok(frame) => Ok(Some(Received {
                peer: Vec::new(),
                message: proto::decode(&frame),
            })),
            Err(zmq::Error::EAGAIN) => Ok(None),
            Err(e) => Err(DistError::zmq("receive")(e)),
        }
    }

    /// Waits up to `timeout_ms` for a frame.
    pub fn recv_timeout(&self, timeout_ms: i64) -> Result<Option<Received>> {
        let mut items = [self.socket.as_poll_item(zmq::POLLIN)];
        zmq::poll(&mut items, timeout_ms).map_err(DistError::zmq("poll"))?;
        if items[0].is_readable() {
            self.try_recv()
        } else {
            Ok(None)
        }
    }

    pub(crate) fn raw(&self) -> &zmq::Socket {
        &self.socket
    }

    /// A socket on `ctx` that becomes readable when the connection to the
    /// leader drops (the socket's disconnect events); read it with
    /// [`drain_disconnects`].
    pub(crate) fn watch_disconnects(&self, ctx: &zmq::Context) -> Result<zmq::Socket> {
        let name = format!(
            "inproc://kvbm-dist-monitor-{}-{}",
            std::process::id(),
            NEXT_WAKER.fetch_add(1, Ordering::Relaxed)
        );
        self.socket
            .monitor(&name, zmq::SocketEvent::DISCONNECTED as i32)
            .map_err(DistError::zmq("monitor"))?;
        let pair = ctx.socket(zmq::PAIR).map_err(DistError::zmq("monitor"))?;
        pair.set_linger(0).map_err(DistError::zmq("linger"))?;
        pair.connect(&name)
            .map_err(DistError::zmq("monitor connect"))?;
        Ok(pair)
    }
}

/// Reads every pending event of a [`DealerSocket::watch_disconnects`]
/// socket; true if the connection dropped.
pub(crate) fn drain_disconnects(monitor: &zmq::Socket) -> bool {
    let mut dropped = false;
    while let Ok(parts) = monitor.recv_multipart(zmq::DONTWAIT) {
        if let Some(event) = parts.first().and_then(|f| f.get(..2)) {
            dropped |=
                u16::from_ne_bytes([event[0], event[1]]) == zmq::SocketEvent::DISCONNECTED as u16;
        }
    }
    dropped
}

static NEXT_WAKER: AtomicU64 = AtomicU64::new(0);

/// Wakes an event loop from any thread.
pub struct WakeSender {
    push: Mutex<zmq::Socket>,
}

/// The end of a wake-up pair an event loop polls.
pub struct WakeReceiver {
    pull: zmq::Socket,
}

/// A connected inproc pair on `ctx`: senders wake the loop that polls the
/// receiver.
pub fn wake_pair(ctx: &zmq::Context) -> Result<(WakeSender, WakeReceiver)> {
    let name = format!(
        "inproc://kvbm-dist-waker-{}-{}",
        std::process::id(),
        NEXT_WAKER.fetch_add(1, Ordering::Relaxed)
    );
    let pull = ctx.socket(zmq::PULL).map_err(DistError::zmq("waker"))?;
    pull.bind(&name).map_err(DistError::zmq("waker bind"))?;
    let push = ctx.socket(zmq::PUSH).map_err(DistError::zmq("waker"))?;
    push.set_linger(0).map_err(DistError::zmq("linger"))?;
    push.connect(&name)
        .map_err(DistError::zmq("waker connect"))?;
    Ok((
        WakeSender {
            push: Mutex::new(push),
        },
        WakeReceiver { pull },
    ))
}

impl WakeSender {
    /// Wakes the loop (never blocks; a full queue already means "awake").
    pub fn wake(&self) {
        let _ = self.push.lock().send(&[][..], zmq::DONTWAIT);
    }
}

impl WakeReceiver {
    /// Drains pending wake-ups.
    pub fn drain(&self) {
        while self.pull.recv_bytes(zmq::DONTWAIT).is_ok() {}
    }

    /// The socket the loop polls.
    pub fn socket(&self) -> &zmq::Socket {
        &self.pull
    }
}
