//! What one kvbm instance tells another so that it can read its G2 blocks:
//! a versioned, validated byte format with no NIXL call in it.
//!
//! A [`RemotePeer`] holds the peer's NIXL agent name and metadata (opaque
//! bytes from `getLocalMD`, which carry its UCX address and registrations),
//! its G2 layout as a kvbm-layout [`LayoutDescriptor`], and the regions it
//! registered (address, length, memory kind). Block `b`'s extents follow
//! from the layout: chunk `(b, layer, k/v)` lies at
//! `regions[chunk.region].addr + chunk.offset`, `chunk.len` bytes
//! ([`RemotePeer::block_extents`]).
//!
//! [`RemotePeer::export`] and [`RemotePeer::import`] put it behind plain
//! bytes so any transport can carry it (kvbm-dist's leaders carry it as
//! opaque per-rank metadata). Import treats the bytes as hostile: every
//! length is bounded before anything is allocated, the version is checked
//! before the body is parsed, the layout is rebuilt through kvbm-layout's
//! validating constructors, and every region must be at least as large as
//! the layout says and must not wrap the address space. Whether the peer
//! really registered those regions is checked again, against the NIXL
//! metadata itself, when the peer is connected
//! ([`NixlRemote::connect`](super::NixlRemote::connect)).
//!
//! Wire format, version 1 (integers little-endian):
//! `"KVBMPEER"` · version `u16` · reserved `u16` (0) · metadata length
//! `u32` · metadata · body length `u32` · body (JSON: agent name, layout
//! descriptor, regions) — and nothing after it.

use kvbm_layout::{Layout, LayoutDescriptor};
use serde::{Deserialize, Serialize};

use super::error::RemoteError;

/// The format version [`RemotePeer::export`] writes and
/// [`RemotePeer::import`] reads.
pub const PEER_FORMAT_VERSION: u16 = 1;

/// Largest description accepted (and so the largest a valid one can be):
/// 4 MiB, so that it fits kvbm-dist's opaque per-rank NIXL metadata field.
pub const MAX_PEER_BYTES: usize = 4 << 20;

const MAGIC: &[u8; 8] = b"KVBMPEER";
/// Header: magic, version, reserved, two length fields.
const HEADER_BYTES: u64 = 8 + 2 + 2 + 4 + 4;
const MAX_METADATA: u64 = 3 << 20;
const MAX_BODY: u64 = MAX_PEER_BYTES as u64 - MAX_METADATA - HEADER_BYTES;
const MAX_AGENT_NAME: usize = 255;
const MAX_REGIONS: usize = 1 << 16;

/// The kind of memory a peer region is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RegionKind {
    /// Pageable host memory.
    System,
    /// Page-locked host memory.
    Pinned,
    /// GPU memory of a device ordinal.
    Device(u32),
}

impl RegionKind {
    /// True for host memory, the only kind remote pulls read today.
    pub fn is_host(self) -> bool {
        matches!(self, RegionKind::System | RegionKind::Pinned)
    }
}

/// One registered region of a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerRegion {
    /// Start address in the peer's address space.
    pub addr: u64,
    /// Length in bytes (as registered with NIXL).
    pub len: u64,
    /// Memory kind.
    pub kind: RegionKind,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Body {
    agent: String,
    layout: LayoutDescriptor,
    regions: Vec<PeerRegion>,
}

/// A peer instance as another instance sees it; see the
/// [module documentation](self).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemotePeer {
    agent: String,
    metadata: Vec<u8>,
    layout: Layout,
    regions: Vec<PeerRegion>,
}

impl RemotePeer {
    /// Describes a peer, validating everything [`RemotePeer::import`]
    /// validates.
    pub fn new(
        agent: impl Into<String>,
        metadata: Vec<u8>,
        layout: &Layout,
        regions: Vec<PeerRegion>,
    ) -> Result<Self, RemoteError> {
        let peer = RemotePeer {
            agent: agent.into(),
            metadata,
            layout: layout.clone(),
            regions,
        };
        peer.validate()?;
        Ok(peer)
    }

    fn validate(&self) -> Result<(), RemoteError> {
        let malformed = |m: String| Err(RemoteError::Malformed(m));
        if self.agent.is_empty() || self.agent.len() > MAX_AGENT_NAME || self.agent.contains('\0') {
            return malformed(format!(
                "agent name must be 1 to {MAX_AGENT_NAME} bytes without NUL ({} bytes)",
                self.agent.len()
            ));
        }
        if self.metadata.is_empty() {
            return malformed("empty NIXL metadata".into());
        }
        if self.metadata.len() as u64 > MAX_METADATA {
            return Err(RemoteError::TooLarge {
                field: "NIXL metadata",
                len: self.metadata.len() as u64,
                limit: MAX_METADATA,
            });
        }
        if self.regions.len() != self.layout.num_regions() {
            return malformed(format!(
                "{} regions described, the layout has {}",
                self.regions.len(),
                self.layout.num_regions()
            ));
        }
        for (i, r) in self.regions.iter().enumerate() {
            let need = self
                .layout
                .region_size(i)
                .map_err(|e| RemoteError::Malformed(e.to_string()))?;
            if r.addr == 0 || r.addr.checked_add(r.len).is_none() {
                return malformed(format!(
                    "region {i} [{:#x}, +{}) is not a valid address range",
                    r.addr, r.len
                ));
            }
            if r.len < need {
                return malformed(format!(
                    "region {i} is {} bytes, the layout needs {need}",
                    r.len
                ));
            }
        }
        Ok(())
    }

    /// The peer's NIXL agent name.
    pub fn agent_name(&self) -> &str {
        &self.agent
    }

    /// The peer's NIXL metadata (opaque).
    pub fn nixl_metadata(&self) -> &[u8] {
        &self.metadata
    }

    /// The peer's G2 layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The peer's registered regions, indexed like its layout's regions.
    pub fn regions(&self) -> &[PeerRegion] {
        &self.regions
    }

    /// Where block `block`'s chunks lie in the peer's memory: `(address,
    /// length)` for every `(layer, k/v)`, each checked to lie inside its
    /// region.
    pub fn block_extents(&self, block: usize) -> Result<Vec<(u64, u64)>, RemoteError> {
        let cfg = self.layout.config();
        if block >= cfg.num_blocks() {
            return Err(RemoteError::BlockOutOfRange {
                side: "remote",
                block,
                num_blocks: cfg.num_blocks(),
            });
        }
        let mut out = Vec::with_capacity(cfg.num_layers() * cfg.outer_dim());
        for layer in 0..cfg.num_layers() {
            for outer in 0..cfg.outer_dim() {
                let c = self
                    .layout
                    .chunk(block, layer, outer)
                    .map_err(|e| RemoteError::Malformed(e.to_string()))?;
                let region = self.regions.get(c.region).ok_or_else(|| {
                    RemoteError::Malformed(format!("chunk names region {}", c.region))
                })?;
                if c.offset
                    .checked_add(c.len)
                    .is_none_or(|end| end > region.len)
                {
                    return Err(RemoteError::ExtentOutsideRegion {
                        block,
                        region: c.region,
                        offset: c.offset,
                        len: c.len,
                        region_len: region.len,
                    });
                }
                out.push((region.addr + c.offset, c.len));
            }
        }
        Ok(out)
    }

    /// Encodes in the current format.
    pub fn export(&self) -> Vec<u8> {
        let body = Body {
            agent: self.agent.clone(),
            layout: self.layout.descriptor(),
            regions: self.regions.clone(),
        };
        // Plain structs of strings, integers and enums always serialise.
        let body = serde_json::to_vec(&body).unwrap_or_default();
        let mut out = Vec::with_capacity(24 + self.metadata.len() + body.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&PEER_FORMAT_VERSION.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.metadata);
        out.extend_from_slice(&(body.len() as u32).to_le_bytes());
        out.extend_from_slice(&body);
        out
    }

    /// Decodes and validates; any malformed input is an error, never a
    /// panic, and nothing is allocated beyond the bounded field limits.
    pub fn import(bytes: &[u8]) -> Result<Self, RemoteError> {
        if bytes.len() > MAX_PEER_BYTES {
            return Err(RemoteError::TooLarge {
                field: "peer description",
                len: bytes.len() as u64,
                limit: MAX_PEER_BYTES as u64,
            });
        }
        let mut r = Reader { bytes };
        if r.take(MAGIC.len())? != MAGIC {
            return Err(RemoteError::BadMagic);
        }
        let version = u16::from_le_bytes(r.array()?);
        if version != PEER_FORMAT_VERSION {
            return Err(RemoteError::UnsupportedVersion {
                found: version,
                supported: PEER_FORMAT_VERSION,
            });
        }
        if u16::from_le_bytes(r.array()?) != 0 {
            return Err(RemoteError::Malformed("reserved field is not zero".into()));
        }
        let metadata = r.field("NIXL metadata", MAX_METADATA)?.to_vec();
        let body = r.field("body", MAX_BODY)?;
        if !r.bytes.is_empty() {
            return Err(RemoteError::Malformed(format!(
                "{} bytes after the body",
                r.bytes.len()
            )));
        }
        let body: Body =
            serde_json::from_slice(body).map_err(|e| RemoteError::Malformed(e.to_string()))?;
        if body.regions.len() > MAX_REGIONS {
            return Err(RemoteError::TooLarge {
                field: "regions",
                len: body.regions.len() as u64,
                limit: MAX_REGIONS as u64,
            });
        }
        let layout = body
            .layout
            .to_layout()
            .map_err(|e| RemoteError::Malformed(format!("layout: {e}")))?;
        RemotePeer::new(body.agent, metadata, &layout, body.regions)
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], RemoteError> {
        if self.bytes.len() < n {
            return Err(RemoteError::Truncated {
                needed: n as u64,
                available: self.bytes.len() as u64,
            });
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], RemoteError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn field(&mut self, name: &'static str, limit: u64) -> Result<&'a [u8], RemoteError> {
        let len = u32::from_le_bytes(self.array()?) as u64;
        if len > limit {
            return Err(RemoteError::TooLarge {
                field: name,
                len,
                limit,
            });
        }
        self.take(len as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbm_layout::{BlockOrder, LayoutConfig, LayoutKind};
    use proptest::prelude::*;

    fn layout() -> Layout {
        let c = LayoutConfig::new(6, 2, 2, 16, 64, 2).unwrap();
        Layout::new(c, LayoutKind::LayerSeparate(BlockOrder::OuterFirst)).unwrap()
    }

    fn peer() -> RemotePeer {
        let l = layout();
        let regions = (0..l.num_regions())
            .map(|i| PeerRegion {
                addr: 0x7f00_0000_0000 + (i as u64) * (1 << 30),
                len: l.region_size(i).unwrap(),
                kind: RegionKind::Pinned,
            })
            .collect();
        RemotePeer::new("peer-a", vec![7u8; 300], &l, regions).unwrap()
    }

    #[test]
    fn round_trip() {
        let p = peer();
        assert_eq!(RemotePeer::import(&p.export()).unwrap(), p);
    }

    #[test]
    fn extents_follow_the_layout_and_stay_inside() {
        let p = peer();
        let e = p.block_extents(5).unwrap();
        assert_eq!(e.len(), 4);
        for (i, &(addr, len)) in e.iter().enumerate() {
            let c = p.layout().chunk(5, i / 2, i % 2).unwrap();
            assert_eq!(addr, p.regions()[c.region].addr + c.offset);
            assert_eq!(len, c.len);
        }
        assert!(matches!(
            p.block_extents(6),
            Err(RemoteError::BlockOutOfRange { block: 6, .. })
        ));
    }

    #[test]
    fn short_regions_and_bad_names_are_refused() {
        let l = layout();
        let mut regions = peer().regions().to_vec();
        regions[1].len -= 1;
        assert!(matches!(
            RemotePeer::new("p", vec![1], &l, regions),
            Err(RemoteError::Malformed(_))
        ));
        let mut regions = peer().regions().to_vec();
        regions[0].addr = u64::MAX - 10;
        assert!(RemotePeer::new("p", vec![1], &l, regions).is_err());
        let regions = peer().regions().to_vec();
        assert!(RemotePeer::new("", vec![1], &l, regions.clone()).is_err());
        assert!(RemotePeer::new("a\0b", vec![1], &l, regions.clone()).is_err());
        assert!(RemotePeer::new("a", vec![], &l, regions.clone()).is_err());
        assert!(RemotePeer::new("a", vec![1], &l, regions[..1].to_vec()).is_err());
    }

    #[test]
    fn header_errors_are_named() {
        let bytes = peer().export();
        assert_eq!(
            RemotePeer::import(b"NOTAPEERxxxx"),
            Err(RemoteError::BadMagic)
        );
        let mut v = bytes.clone();
        v[8] = 9;
        assert!(matches!(
            RemotePeer::import(&v),
            Err(RemoteError::UnsupportedVersion { found: 9, .. })
        ));
        let mut v = bytes.clone();
        v[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            RemotePeer::import(&v),
            Err(RemoteError::TooLarge { .. })
        ));
        let mut v = bytes.clone();
        v.push(0);
        assert!(matches!(
            RemotePeer::import(&v),
            Err(RemoteError::Malformed(_))
        ));
        assert!(matches!(
            RemotePeer::import(&bytes[..bytes.len() - 1]),
            Err(RemoteError::Truncated { .. })
        ));
    }

    #[test]
    fn forged_body_is_refused() {
        let p = peer();
        let forge = |f: &dyn Fn(&mut serde_json::Value)| {
            let bytes = p.export();
            let md_len = u32::from_le_bytes(bytes[12..16].try_into().unwrap()) as usize;
            let body_at = 16 + md_len + 4;
            let mut body: serde_json::Value = serde_json::from_slice(&bytes[body_at..]).unwrap();
            f(&mut body);
            let body = serde_json::to_vec(&body).unwrap();
            let mut out = bytes[..16 + md_len].to_vec();
            out.extend_from_slice(&(body.len() as u32).to_le_bytes());
            out.extend_from_slice(&body);
            RemotePeer::import(&out)
        };
        // A region shorter than the layout needs.
        assert!(forge(&|b| b["regions"][0]["len"] = 4096.into()).is_err());
        // A layout with more blocks than the regions hold.
        assert!(forge(&|b| b["layout"]["config"]["num_blocks"] = 600.into()).is_err());
        // Unknown fields.
        assert!(forge(&|b| b["extra"] = 1.into()).is_err());
        // Nothing changed: accepted.
        assert_eq!(forge(&|_| ()).unwrap(), p);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn truncations_never_panic_and_never_pass(cut in 0usize..2000) {
            let bytes = peer().export();
            let cut = cut.min(bytes.len() - 1);
            prop_assert!(RemotePeer::import(&bytes[..cut]).is_err());
        }

        #[test]
        fn mutations_never_panic(
            flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8)
        ) {
            let mut bytes = peer().export();
            for (i, b) in flips {
                let i = i.index(bytes.len());
                bytes[i] ^= b | 1;
            }
            // Either refused, or a still-consistent description.
            if let Ok(p) = RemotePeer::import(&bytes) {
                prop_assert!(p.validate().is_ok());
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = RemotePeer::import(&bytes);
            let mut framed = MAGIC.to_vec();
            framed.extend_from_slice(&bytes);
            let _ = RemotePeer::import(&framed);
        }
    }
}
