//! Encoding and decoding of frames.
//!
//! [`Reader`] is the only way bytes of a received frame are read: every
//! access is checked against the frame's end, every announced length is
//! checked against its limit *and* against the bytes left before anything
//! is allocated, so a hostile length field costs nothing.

use kvbm_layout::LayoutDescriptor;
use kvbm_pool::Tier;

use super::error::ProtoError;
use super::schema::{
    Ack, AckFailure, BlockLabel, BlockPair, Configure, ErrorReply, Hello, Message, MessageKind,
    PeerInfo, PeerRank, Ready, RemotePull, Transfer,
};
#[cfg(feature = "probe")]
use super::schema::{Probe, ProbeOp, ProbeReply};
use super::validate;
use super::{
    HEADER_BYTES, MAGIC, MAX_DESCRIPTOR_BYTES, MAX_FRAME_BYTES, MAX_NIXL_METADATA_BYTES, MAX_PAIRS,
    MAX_TEXT_BYTES, MAX_WORLD_SIZE, PROTOCOL_VERSION,
};
use crate::transport::printable;

/// Encodes `message` as one frame. Fails (instead of sending something the
/// peer would refuse) when a field is over its limit or the message does
/// not pass the checks the decoder makes.
pub fn encode(message: &Message) -> Result<Vec<u8>, ProtoError> {
    encode_with_version(message, PROTOCOL_VERSION)
}

/// [`encode`] with an explicit header version (tests speak other versions).
pub(crate) fn encode_with_version(message: &Message, version: u16) -> Result<Vec<u8>, ProtoError> {
    validate::message(message)?;
    let mut w = Writer::default();
    w.buf.extend_from_slice(&MAGIC);
    w.u16(version);
    w.u8(message.kind() as u8);
    w.u8(0);
    w.u32(0); // body length, patched below
    body(&mut w, message)?;
    let len = w.buf.len();
    if len > MAX_FRAME_BYTES {
        return Err(ProtoError::FrameTooLarge {
            len,
            max: MAX_FRAME_BYTES,
        });
    }
    let body_len = u32::try_from(len - HEADER_BYTES).map_err(|_| ProtoError::FrameTooLarge {
        len,
        max: MAX_FRAME_BYTES,
    })?;
    w.buf[8..12].copy_from_slice(&body_len.to_le_bytes());
    Ok(w.buf)
}

/// Writes the body of `message`, field by field, in wire order.
fn body(w: &mut Writer, message: &Message) -> Result<(), ProtoError> {
    match message {
        Message::Hello(h) => {
            w.u64(h.instance);
            w.u32(h.rank);
            w.u32(h.world_size);
            w.u64(h.device_blocks);
            w.u64(h.bytes_per_block);
            w.descriptor(&h.layout)?;
            w.buf.extend_from_slice(&h.auth);
        }
        Message::Configure(c) => {
            w.u64(c.g2_blocks);
            w.u64(c.g3_blocks);
            w.u32(c.block_size);
            w.u32(c.heartbeat_ms);
            w.u8(u8::from(c.verify));
        }
        Message::Ready(r) => {
            w.u32(r.rank);
            w.u64(r.g2_blocks);
            w.u64(r.g3_blocks);
            w.kept(&r.recovered, "recovered blocks")?;
            w.u64(r.rejected);
            w.kept(&r.recovered_g2, "recovered G2 blocks")?;
            w.u64(r.rejected_g2);
            w.u64(r.g3_open_us);
        }
        Message::Error(e) => {
            w.opt_u64(e.transfer_id);
            w.bytes(e.message.as_bytes(), MAX_TEXT_BYTES, "error text")?;
        }
        Message::Transfer(t) => {
            w.u64(t.id);
            w.u8(tier_code(t.src));
            w.u8(tier_code(t.dst));
            w.pairs(&t.pairs)?;
            w.count(t.labels.len(), MAX_PAIRS, "block labels")?;
            for &label in &t.labels {
                w.label(label);
            }
        }
        Message::Ack(a) => encode_ack(w, a)?,
        Message::Ping { seq } => w.u64(*seq),
        Message::Pong { seq, rank } => {
            w.u64(*seq);
            w.u32(*rank);
        }
        Message::Cancel { transfer_id } => w.u64(*transfer_id),
        Message::Shutdown | Message::ExportPeer | Message::StopKeeping => {}
        Message::PeerInfo(p) => encode_peer_info(w, p)?,
        Message::RemotePull(r) => {
            w.u64(r.id);
            w.u64(r.peer);
            w.u8(tier_code(r.src));
            w.u8(tier_code(r.dst));
            w.pairs(&r.pairs)?;
        }
        #[cfg(feature = "probe")]
        Message::Probe(p) => encode_probe(w, p)?,
        #[cfg(feature = "probe")]
        Message::ProbeReply(r) => encode_probe_reply(w, r)?,
    }
    Ok(())
}

/// Writes the body of an `Ack`: the pairs that landed, then the failure
/// (flag, text, failed pairs, OS error, checksum mismatches) if any.
fn encode_ack(w: &mut Writer, a: &Ack) -> Result<(), ProtoError> {
    w.u64(a.transfer_id);
    w.u32(a.rank);
    w.pairs(&a.completed)?;
    match &a.failure {
        None => w.u8(0),
        Some(f) => {
            w.u8(1);
            w.bytes(f.error.as_bytes(), MAX_TEXT_BYTES, "ack error text")?;
            w.pairs(&f.failed)?;
            // 0: none (no OS error is numbered 0).
            w.u32(f.os_error.map_or(0, |e| e.max(0) as u32));
            w.u32(f.checksum_mismatches);
        }
    }
    Ok(())
}

/// Writes the body of a `PeerInfo`: the instance, then each rank's NIXL
/// metadata and G2 layout.
fn encode_peer_info(w: &mut Writer, p: &PeerInfo) -> Result<(), ProtoError> {
    w.u64(p.instance);
    w.count(p.ranks.len(), MAX_WORLD_SIZE as usize, "peer ranks")?;
    for r in &p.ranks {
        w.bytes(&r.nixl_metadata, MAX_NIXL_METADATA_BYTES, "nixl metadata")?;
        w.descriptor(&r.layout)?;
    }
    Ok(())
}

/// Writes the body of a `Probe`: its id, the operation, then each block
/// with its seed.
#[cfg(feature = "probe")]
fn encode_probe(w: &mut Writer, p: &Probe) -> Result<(), ProtoError> {
    w.u64(p.id);
    w.u8(match p.op {
        ProbeOp::Fill => 1,
        ProbeOp::Check => 2,
    });
    w.count(p.blocks.len(), MAX_PAIRS, "probe blocks")?;
    for &(b, seed) in &p.blocks {
        w.u32(b);
        w.u64(seed);
    }
    Ok(())
}

/// Writes the body of a `ProbeReply`: its id and rank, the blocks that did
/// not match, then the error (flag and text) if any.
#[cfg(feature = "probe")]
fn encode_probe_reply(w: &mut Writer, r: &ProbeReply) -> Result<(), ProtoError> {
    w.u64(r.id);
    w.u32(r.rank);
    w.count(r.mismatched.len(), MAX_PAIRS, "mismatched blocks")?;
    for &b in &r.mismatched {
        w.u32(b);
    }
    match &r.error {
        None => w.u8(0),
        Some(e) => {
            w.u8(1);
            w.bytes(e.as_bytes(), MAX_TEXT_BYTES, "probe error text")?;
        }
    }
    Ok(())
}

/// Fewest bytes of a [`BlockLabel`] on the wire (a hash, no parent).
const LABEL_BYTES: usize = 9;

/// Decodes and validates one frame.
pub fn decode(frame: &[u8]) -> Result<Message, ProtoError> {
    if frame.len() > MAX_FRAME_BYTES {
        return Err(ProtoError::FrameTooLarge {
            len: frame.len(),
            max: MAX_FRAME_BYTES,
        });
    }
    let mut r = Reader::new(frame);
    let magic = r.array::<4>("magic")?;
    if magic != MAGIC {
        return Err(ProtoError::BadMagic { found: magic });
    }
    let version = r.u16("version")?;
    if version != PROTOCOL_VERSION {
        return Err(ProtoError::UnsupportedVersion {
            found: version,
            supported: PROTOCOL_VERSION,
        });
    }
    let kind_byte = r.u8("kind")?;
    let kind = MessageKind::from_byte(kind_byte).ok_or(ProtoError::UnknownKind(kind_byte))?;
    let flags = r.u8("flags")?;
    if flags != 0 {
        return Err(ProtoError::ReservedFlags(flags));
    }
    let announced = r.u32("body length")?;
    if announced as usize != r.left() {
        return Err(ProtoError::BodyLength {
            announced,
            actual: r.left(),
        });
    }
    let message = decode_body(&mut r, kind)?;
    if r.left() != 0 {
        return Err(ProtoError::TrailingBytes(r.left()));
    }
    validate::message(&message)?;
    Ok(message)
}

/// Reads the body of a message of `kind`, field by field, in wire order.
fn decode_body(r: &mut Reader<'_>, kind: MessageKind) -> Result<Message, ProtoError> {
    Ok(match kind {
        MessageKind::Hello => Message::Hello(Hello {
            instance: r.u64("instance")?,
            rank: r.u32("rank")?,
            world_size: r.u32("world size")?,
            device_blocks: r.u64("device blocks")?,
            bytes_per_block: r.u64("bytes per block")?,
            layout: r.descriptor()?,
            auth: r.array("hello mac")?,
        }),
        MessageKind::Configure => Message::Configure(Configure {
            g2_blocks: r.u64("g2 blocks")?,
            g3_blocks: r.u64("g3 blocks")?,
            block_size: r.u32("block size")?,
            heartbeat_ms: r.u32("heartbeat")?,
            verify: match r.u8("verify flag")? {
                0 => false,
                1 => true,
                other => {
                    return Err(ProtoError::Invalid {
                        what: "verify flag",
                        reason: format!("{other} is neither 0 nor 1"),
                    });
                }
            },
        }),
        MessageKind::Ready => Message::Ready(Ready {
            rank: r.u32("rank")?,
            g2_blocks: r.u64("g2 blocks")?,
            g3_blocks: r.u64("g3 blocks")?,
            recovered: r.kept("recovered blocks")?,
            rejected: r.u64("rejected records")?,
            recovered_g2: r.kept("recovered G2 blocks")?,
            rejected_g2: r.u64("rejected G2 records")?,
            g3_open_us: r.u64("G3 open time")?,
        }),
        MessageKind::Error => Message::Error(ErrorReply {
            transfer_id: r.opt_u64("transfer id")?,
            message: r.text(MAX_TEXT_BYTES, "error text")?,
        }),
        MessageKind::Transfer => Message::Transfer(Transfer {
            id: r.u64("transfer id")?,
            src: r.tier("source tier")?,
            dst: r.tier("destination tier")?,
            pairs: r.pairs("pairs")?,
            labels: {
                let n = r.count(MAX_PAIRS, LABEL_BYTES, "block labels")?;
                (0..n)
                    .map(|_| r.label())
                    .collect::<Result<_, ProtoError>>()?
            },
        }),
        MessageKind::Ack => Message::Ack(decode_ack(r)?),
        MessageKind::Ping => Message::Ping { seq: r.u64("seq")? },
        MessageKind::Pong => Message::Pong {
            seq: r.u64("seq")?,
            rank: r.u32("rank")?,
        },
        MessageKind::Cancel => Message::Cancel {
            transfer_id: r.u64("transfer id")?,
        },
        MessageKind::Shutdown => Message::Shutdown,
        MessageKind::ExportPeer => Message::ExportPeer,
        MessageKind::StopKeeping => Message::StopKeeping,
        MessageKind::PeerInfo => Message::PeerInfo(decode_peer_info(r)?),
        MessageKind::RemotePull => Message::RemotePull(RemotePull {
            id: r.u64("transfer id")?,
            peer: r.u64("peer instance")?,
            src: r.tier("source tier")?,
            dst: r.tier("destination tier")?,
            pairs: r.pairs("pairs")?,
        }),
        #[cfg(feature = "probe")]
        MessageKind::Probe => Message::Probe(decode_probe(r)?),
        #[cfg(feature = "probe")]
        MessageKind::ProbeReply => Message::ProbeReply(decode_probe_reply(r)?),
    })
}

/// Reads the body of an `Ack` (see [`encode_ack`]).
fn decode_ack(r: &mut Reader<'_>) -> Result<Ack, ProtoError> {
    let transfer_id = r.u64("transfer id")?;
    let rank = r.u32("rank")?;
    let completed = r.pairs("completed pairs")?;
    let failure = match r.u8("failure flag")? {
        0 => None,
        1 => Some(AckFailure {
            error: r.text(MAX_TEXT_BYTES, "ack error text")?,
            failed: r.pairs("failed pairs")?,
            os_error: match r.u32("ack OS error")? {
                0 => None,
                n => Some(i32::try_from(n).map_err(|_| ProtoError::Invalid {
                    what: "ack OS error",
                    reason: format!("{n} is not an error number"),
                })?),
            },
            checksum_mismatches: r.u32("ack checksum mismatches")?,
        }),
        other => {
            return Err(ProtoError::Invalid {
                what: "failure flag",
                reason: format!("{other} is neither 0 nor 1"),
            });
        }
    };
    Ok(Ack {
        transfer_id,
        rank,
        completed,
        failure,
    })
}

/// Reads the body of a `PeerInfo` (see [`encode_peer_info`]).
fn decode_peer_info(r: &mut Reader<'_>) -> Result<PeerInfo, ProtoError> {
    let instance = r.u64("instance")?;
    // Each rank takes at least 8 bytes (two length fields).
    let n = r.count(MAX_WORLD_SIZE as usize, 8, "peer ranks")?;
    let mut ranks = Vec::with_capacity(n);
    for _ in 0..n {
        ranks.push(PeerRank {
            nixl_metadata: r.bytes(MAX_NIXL_METADATA_BYTES, "nixl metadata")?.to_vec(),
            layout: r.descriptor()?,
        });
    }
    Ok(PeerInfo { instance, ranks })
}

/// Reads the body of a `Probe` (see [`encode_probe`]).
#[cfg(feature = "probe")]
fn decode_probe(r: &mut Reader<'_>) -> Result<Probe, ProtoError> {
    let id = r.u64("probe id")?;
    let op = match r.u8("probe op")? {
        1 => ProbeOp::Fill,
        2 => ProbeOp::Check,
        other => {
            return Err(ProtoError::Invalid {
                what: "probe op",
                reason: format!("unknown op {other}"),
            });
        }
    };
    let n = r.count(MAX_PAIRS, 12, "probe blocks")?;
    let mut blocks = Vec::with_capacity(n);
    for _ in 0..n {
        blocks.push((r.u32("probe block")?, r.u64("probe seed")?));
    }
    Ok(Probe { id, op, blocks })
}

/// Reads the body of a `ProbeReply` (see [`encode_probe_reply`]).
#[cfg(feature = "probe")]
fn decode_probe_reply(r: &mut Reader<'_>) -> Result<ProbeReply, ProtoError> {
    let id = r.u64("probe id")?;
    let rank = r.u32("rank")?;
    let n = r.count(MAX_PAIRS, 4, "mismatched blocks")?;
    let mut mismatched = Vec::with_capacity(n);
    for _ in 0..n {
        mismatched.push(r.u32("mismatched block")?);
    }
    let error = match r.u8("probe error flag")? {
        0 => None,
        1 => Some(r.text(MAX_TEXT_BYTES, "probe error text")?),
        other => {
            return Err(ProtoError::Invalid {
                what: "probe error flag",
                reason: format!("{other} is neither 0 nor 1"),
            });
        }
    };
    Ok(ProbeReply {
        id,
        rank,
        mismatched,
        error,
    })
}

/// The wire code of a tier.
pub(crate) fn tier_code(tier: Tier) -> u8 {
    match tier {
        Tier::G1 => 1,
        Tier::G2 => 2,
        Tier::G3 => 3,
        Tier::G4 => 4,
    }
}

#[derive(Default)]
struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    fn opt_u64(&mut self, v: Option<u64>) {
        match v {
            None => self.u8(0),
            Some(v) => {
                self.u8(1);
                self.u64(v);
            }
        }
    }
    fn count(&mut self, n: usize, max: usize, what: &'static str) -> Result<(), ProtoError> {
        if n > max {
            return Err(ProtoError::TooMany {
                what,
                value: n as u64,
                max: max as u64,
            });
        }
        // n <= max, and every max passed here fits in u32.
        self.u32(n as u32);
        Ok(())
    }
    fn bytes(&mut self, b: &[u8], max: usize, what: &'static str) -> Result<(), ProtoError> {
        self.count(b.len(), max, what)?;
        self.buf.extend_from_slice(b);
        Ok(())
    }
    fn label(&mut self, label: BlockLabel) {
        self.u64(label.hash);
        self.opt_u64(label.parent);
    }
    /// A kept tier's blocks: `(slot, label)` each.
    fn kept(&mut self, blocks: &[(u32, BlockLabel)], what: &'static str) -> Result<(), ProtoError> {
        self.count(blocks.len(), MAX_PAIRS, what)?;
        for &(slot, label) in blocks {
            self.u32(slot);
            self.label(label);
        }
        Ok(())
    }
    fn pairs(&mut self, pairs: &[BlockPair]) -> Result<(), ProtoError> {
        self.count(pairs.len(), MAX_PAIRS, "pairs")?;
        self.buf.reserve(pairs.len() * 8);
        for &(s, d) in pairs {
            self.u32(s);
            self.u32(d);
        }
        Ok(())
    }
    fn descriptor(&mut self, d: &LayoutDescriptor) -> Result<(), ProtoError> {
        self.bytes(
            d.to_json().as_bytes(),
            MAX_DESCRIPTOR_BYTES,
            "layout descriptor",
        )
    }
}

/// A bounds-checked cursor over a received frame.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    fn left(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], ProtoError> {
        let left = self.left();
        if n > left {
            return Err(ProtoError::Truncated {
                what,
                need: n,
                left,
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], ProtoError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, ProtoError> {
        Ok(self.array::<1>(what)?[0])
    }
    fn u16(&mut self, what: &'static str) -> Result<u16, ProtoError> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, ProtoError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, ProtoError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn opt_u64(&mut self, what: &'static str) -> Result<Option<u64>, ProtoError> {
        match self.u8(what)? {
            0 => Ok(None),
            1 => Ok(Some(self.u64(what)?)),
            other => Err(ProtoError::Invalid {
                what,
                reason: format!("option tag {other} is neither 0 nor 1"),
            }),
        }
    }

    /// A count of items of at least `item_bytes` each: at most `max`, and
    /// no more than the bytes left could hold.
    fn count(
        &mut self,
        max: usize,
        item_bytes: usize,
        what: &'static str,
    ) -> Result<usize, ProtoError> {
        let n = self.u32(what)? as usize;
        if n > max {
            return Err(ProtoError::TooMany {
                what,
                value: n as u64,
                max: max as u64,
            });
        }
        let need = n.saturating_mul(item_bytes);
        if need > self.left() {
            return Err(ProtoError::Truncated {
                what,
                need,
                left: self.left(),
            });
        }
        Ok(n)
    }

    fn bytes(&mut self, max: usize, what: &'static str) -> Result<&'a [u8], ProtoError> {
        let n = self.count(max, 1, what)?;
        self.take(n, what)
    }

    fn text(&mut self, max: usize, what: &'static str) -> Result<String, ProtoError> {
        let b = self.bytes(max, what)?;
        std::str::from_utf8(b)
            .map(printable)
            .map_err(|e| ProtoError::Invalid {
                what,
                reason: e.to_string(),
            })
    }

    fn pairs(&mut self, what: &'static str) -> Result<Vec<BlockPair>, ProtoError> {
        let n = self.count(MAX_PAIRS, 8, what)?;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push((self.u32(what)?, self.u32(what)?));
        }
        Ok(v)
    }

    fn label(&mut self) -> Result<BlockLabel, ProtoError> {
        Ok(BlockLabel {
            hash: self.u64("block hash")?,
            parent: self.opt_u64("parent hash")?,
        })
    }

    /// What [`Writer::kept`] wrote.
    fn kept(&mut self, what: &'static str) -> Result<Vec<(u32, BlockLabel)>, ProtoError> {
        let n = self.count(MAX_PAIRS, 4 + LABEL_BYTES, what)?;
        (0..n)
            .map(|_| Ok((self.u32("kept slot")?, self.label()?)))
            .collect()
    }

    fn tier(&mut self, what: &'static str) -> Result<Tier, ProtoError> {
        match self.u8(what)? {
            1 => Ok(Tier::G1),
            2 => Ok(Tier::G2),
            3 => Ok(Tier::G3),
            4 => Ok(Tier::G4),
            code => Err(ProtoError::BadTier { what, code }),
        }
    }

    fn descriptor(&mut self) -> Result<LayoutDescriptor, ProtoError> {
        let b = self.bytes(MAX_DESCRIPTOR_BYTES, "layout descriptor")?;
        // The JSON decoder's message quotes the peer's text (an unknown
        // variant's name, say): escaped, like every text a peer sends.
        let d = LayoutDescriptor::from_json_slice(b).map_err(|e| ProtoError::Invalid {
            what: "layout descriptor",
            reason: printable(&e.to_string()),
        })?;
        // A descriptor that decodes but does not rebuild is refused here,
        // so nothing past the decoder sees an impossible layout.
        d.to_layout().map_err(|e| ProtoError::Invalid {
            what: "layout descriptor",
            reason: printable(&e.to_string()),
        })?;
        Ok(d)
    }
}
