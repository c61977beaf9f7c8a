//! Remote G2 → G2 pulls over UCX: one NIXL agent per kvbm instance.
//!
//! An instance wraps its G2 [`PhysicalLayout`] (host memory) in a
//! [`NixlRemote`], which registers every region with a UCX backend. It
//! describes itself with [`NixlRemote::describe`] / [`NixlRemote::export`]
//! (a [`RemotePeer`]: NIXL metadata + layout + regions, as bytes); another
//! instance imports those bytes with [`NixlRemote::import`], and reads the
//! peer's blocks into its own with [`NixlRemote::pull`], by `(remote block,
//! local block)` pairs.
//!
//! Nothing is read before everything is checked:
//! - at import, the description itself (see [`RemotePeer::import`]);
//! - at connect, that the peer's blocks are shaped like ours, that its
//!   memory is host memory, that the agent name in the NIXL metadata is the
//!   one described, and — through NIXL's `checkRemoteMD` — that every
//!   described region lies inside memory the peer really registered, so a
//!   forged length or address is refused before it can name bytes the peer
//!   never exposed;
//! - at every pull, that every block id is in range on both sides, that no
//!   local block is written twice, and that every chunk of every requested
//!   remote block lies inside its region.
//!
//! A pull is cut into batches of [`RemoteConfig::batch_blocks`] blocks, one
//! NIXL request each, so a failure names which pairs landed (the batches
//! that completed) and which did not, like the executor's transfers.
//!
//! The peer must keep its [`NixlRemote`] (and so its registrations and
//! memory) alive while anyone may read from it; with TCP as UCX's
//! transport, the serving side's NIXL progress thread answers the reads.
//!
//! On TCP, UCX moves a read in segments of `UCX_TCP_TX_SEG_SIZE` /
//! `UCX_TCP_RX_SEG_SIZE` (8 KiB by default); larger segments (256 KiB)
//! mean far fewer segments, each with its own fixed cost, per block pulled,
//! and made pulls several times faster (measured on loopback in
//! `docs/benchmarks.md`, "Remote G2 pulls (NIXL over UCX)"). They are UCX
//! environment variables, read when the backend starts, so they are the
//! deployment's to set.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kvbm_layout::plan_copy;
use nixl_sys::{Agent, Backend, MemType, RegistrationHandle, XferDescList, XferOp};
use parking_lot::Mutex;

use super::desc::{Posted, RawDesc, agent_with_backend};
use super::error::{NixlUnavailable, RemoteError, nixl_err};
use super::peer::{PeerRegion, RegionKind, RemotePeer};
use super::poller::Poller;
use crate::completion::{Completer, Completion, completion_pair};
use crate::error::TransferError;
use crate::executor::{TransferFailure, TransferOutcome, TransferReport};
use crate::memory::MemoryKind;
use crate::physical::PhysicalLayout;

/// Settings for [`NixlRemote`].
#[derive(Debug, Clone)]
pub struct RemoteConfig {
    /// Blocks per NIXL request (the unit that lands or fails together).
    pub batch_blocks: usize,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        RemoteConfig { batch_blocks: 64 }
    }
}

/// A peer that passed every connect-time check; pass it to
/// [`NixlRemote::pull`]. Cheap to clone.
#[derive(Debug, Clone)]
pub struct ConnectedPeer {
    peer: Arc<RemotePeer>,
}

impl ConnectedPeer {
    /// The peer's description.
    pub fn peer(&self) -> &RemotePeer {
        &self.peer
    }
}

static NEXT_AGENT: AtomicU64 = AtomicU64::new(0);

/// This instance's NIXL agent for remote pulls; see the
/// [module documentation](self).
pub struct NixlRemote {
    // Dropped first: waits until no pull is in flight.
    poller: Poller,
    _registrations: Vec<RegistrationHandle>,
    peers: Mutex<HashMap<String, Arc<RemotePeer>>>,
    local: PhysicalLayout,
    agent: Agent,
    _backend: Backend,
    name: String,
    config: RemoteConfig,
}

fn region_kind(kind: MemoryKind) -> Option<RegionKind> {
    match kind {
        MemoryKind::System => Some(RegionKind::System),
        MemoryKind::Pinned => Some(RegionKind::Pinned),
        MemoryKind::Device(d) => Some(RegionKind::Device(d)),
        MemoryKind::Disk => None,
    }
}

impl NixlRemote {
    /// Creates an agent (named `name` plus the process id, so two
    /// instances on one host never collide) with a UCX backend, and
    /// registers every region of `local`, which must be host memory.
    pub fn new(
        name: &str,
        local: PhysicalLayout,
        config: RemoteConfig,
    ) -> Result<Self, RemoteError> {
        if !local.kind().is_host() {
            return Err(RemoteError::UnsupportedMemory {
                region: 0,
                kind: format!("{:?}", local.kind()),
            });
        }
        if config.batch_blocks == 0 {
            return Err(RemoteError::Malformed(
                "batch_blocks must be at least 1".into(),
            ));
        }
        let name = format!(
            "{name}-{}-{}",
            std::process::id(),
            NEXT_AGENT.fetch_add(1, Ordering::Relaxed)
        );
        let (agent, backend) = agent_with_backend(&name, "UCX", &[], true)?;
        let mut registrations = Vec::with_capacity(local.regions().len());
        for r in local.regions().iter() {
            let desc = RawDesc {
                // Host regions always have an address (checked above).
                addr: r.addr().unwrap_or_default(),
                len: r.len(),
                dev_id: 0,
                mem_type: MemType::Dram,
            };
            let h = agent
                .register_memory(&desc, None)
                .map_err(|e| RemoteError::Nixl {
                    what: "registering local G2",
                    detail: e.to_string(),
                })?;
            registrations.push(h);
        }
        let poller = Poller::new("kvbm-nixl-ucx").map_err(|e| NixlUnavailable::Setup {
            what: "poller thread",
            detail: e.to_string(),
        })?;
        Ok(NixlRemote {
            poller,
            _registrations: registrations,
            peers: Mutex::new(HashMap::new()),
            local,
            agent,
            _backend: backend,
            name,
            config,
        })
    }

    /// This agent's name.
    pub fn agent_name(&self) -> &str {
        &self.name
    }

    /// The local G2 layout pulls write into.
    pub fn local(&self) -> &PhysicalLayout {
        &self.local
    }

    /// Describes this instance for peers.
    pub fn describe(&self) -> Result<RemotePeer, RemoteError> {
        let metadata = self.agent.get_local_md().map_err(|e| RemoteError::Nixl {
            what: "exporting local metadata",
            detail: e.to_string(),
        })?;
        let regions = self
            .local
            .regions()
            .iter()
            .map(|r| PeerRegion {
                addr: r.addr().unwrap_or_default(),
                len: r.len(),
                kind: region_kind(r.kind()).unwrap_or(RegionKind::System),
            })
            .collect();
        RemotePeer::new(self.name.clone(), metadata, self.local.layout(), regions)
    }

    /// [`NixlRemote::describe`] as bytes.
    pub fn export(&self) -> Result<Vec<u8>, RemoteError> {
        Ok(self.describe()?.export())
    }

    /// Decodes a peer's bytes and connects to it.
    pub fn import(&self, bytes: &[u8]) -> Result<ConnectedPeer, RemoteError> {
        self.connect(&RemotePeer::import(bytes)?)
    }

    /// Checks a peer against our layout and against what it registered
    /// (see the [module documentation](self)) and loads its metadata.
    pub fn connect(&self, peer: &RemotePeer) -> Result<ConnectedPeer, RemoteError> {
        if let Some((i, r)) = peer
            .regions()
            .iter()
            .enumerate()
            .find(|(_, r)| !r.kind.is_host())
        {
            return Err(RemoteError::UnsupportedMemory {
                region: i,
                kind: format!("{:?}", r.kind),
            });
        }
        peer.layout()
            .config()
            .same_block_shape(self.local.layout().config())
            .map_err(|e| RemoteError::ShapeMismatch(e.to_string()))?;
        if peer.agent_name() == self.name {
            return Err(RemoteError::Malformed(
                "a peer cannot be this instance".into(),
            ));
        }
        if let Some(known) = self.peers.lock().get(peer.agent_name()) {
            // Loading metadata again (and invalidating it on a refusal)
            // would disturb the live connection: same description or none.
            return if **known == *peer {
                Ok(ConnectedPeer {
                    peer: known.clone(),
                })
            } else {
                Err(RemoteError::Malformed(format!(
                    "peer {} is connected with another description; disconnect it first",
                    peer.agent_name()
                )))
            };
        }
        let loaded = self
            .agent
            .load_remote_md(peer.nixl_metadata())
            .map_err(|e| RemoteError::Nixl {
                what: "the peer's metadata",
                detail: e.to_string(),
            })?;
        let refuse = |e: RemoteError| {
            let _ = self.agent.invalidate_remote_md(&loaded);
            Err(e)
        };
        if loaded != peer.agent_name() {
            return refuse(RemoteError::Malformed(format!(
                "metadata is agent {loaded:?}, the description says {:?}",
                peer.agent_name()
            )));
        }
        for (i, r) in peer.regions().iter().enumerate() {
            let mut list = match XferDescList::new(MemType::Dram) {
                Ok(l) => l,
                Err(e) => {
                    return refuse(RemoteError::Nixl {
                        what: "a descriptor list",
                        detail: e.to_string(),
                    });
                }
            };
            list.add_desc(r.addr as usize, r.len as usize, 0);
            if !self.agent.check_remote_metadata(&loaded, Some(&list)) {
                return refuse(RemoteError::NotRegistered {
                    agent: loaded.clone(),
                    region: i,
                    addr: r.addr,
                    len: r.len,
                });
            }
        }
        let peer = Arc::new(peer.clone());
        self.peers.lock().insert(loaded, peer.clone());
        Ok(ConnectedPeer { peer })
    }

    /// Forgets a peer: later pulls from it are refused.
    pub fn disconnect(&self, peer: &ConnectedPeer) -> Result<(), RemoteError> {
        let name = peer.peer.agent_name();
        if self.peers.lock().remove(name).is_none() {
            return Err(RemoteError::UnknownPeer(name.to_string()));
        }
        self.agent
            .invalidate_remote_md(name)
            .map_err(|e| RemoteError::Nixl {
                what: "disconnecting",
                detail: e.to_string(),
            })
    }

    fn check_pairs(&self, peer: &RemotePeer, pairs: &[(usize, usize)]) -> Result<(), RemoteError> {
        let local_blocks = self.local.layout().config().num_blocks();
        let mut seen = std::collections::HashSet::with_capacity(pairs.len());
        for &(r, l) in pairs {
            // Checks the id and that every chunk lies inside its region.
            peer.block_extents(r)?;
            if l >= local_blocks {
                return Err(RemoteError::BlockOutOfRange {
                    side: "local",
                    block: l,
                    num_blocks: local_blocks,
                });
            }
            if !seen.insert(l) {
                return Err(RemoteError::DuplicateDestination(l));
            }
        }
        Ok(())
    }

    /// Reads remote block `r` of `peer` into local block `l` for every
    /// `(r, l)` in `pairs`. Every check runs before anything is posted; a
    /// refused request is an error here, and nothing was read. The
    /// completion reports, on failure, which pairs landed.
    pub fn pull(
        &self,
        peer: &ConnectedPeer,
        pairs: &[(usize, usize)],
    ) -> Result<Completion<TransferOutcome>, RemoteError> {
        let peer = &peer.peer;
        if !self.peers.lock().contains_key(peer.agent_name()) {
            return Err(RemoteError::UnknownPeer(peer.agent_name().to_string()));
        }
        self.check_pairs(peer, pairs)?;
        let _span =
            tracing::debug_span!("nixl-pull", peer = peer.agent_name(), blocks = pairs.len())
                .entered();
        if pairs.is_empty() {
            return Ok(Completion::ready(Ok(TransferReport::default())));
        }
        let batches: Vec<&[(usize, usize)]> = pairs.chunks(self.config.batch_blocks).collect();
        let (completer, completion) = completion_pair();
        let gather = Arc::new(Gather {
            state: Mutex::new(GatherState {
                remaining: batches.len(),
                completed: Vec::new(),
                failed: Vec::new(),
                error: None,
                bytes: 0,
            }),
            completer: Mutex::new(Some(completer)),
        });
        for batch in batches {
            let (done, bytes) = match self.post_batch(peer, batch) {
                Ok(x) => x,
                Err(e) => (Completion::ready(Err(e)), 0),
            };
            let g = gather.clone();
            let batch = batch.to_vec();
            done.on_complete(move |r| g.batch_done(batch, bytes, r));
        }
        Ok(completion)
    }

    fn post_batch(
        &self,
        peer: &RemotePeer,
        batch: &[(usize, usize)],
    ) -> Result<(Completion, u64), TransferError> {
        let plan = plan_copy(peer.layout(), self.local.layout(), batch)?;
        let bytes = plan.total_bytes();
        let mut local =
            XferDescList::new(MemType::Dram).map_err(|e| nixl_err("descriptor list", e))?;
        let mut remote =
            XferDescList::new(MemType::Dram).map_err(|e| nixl_err("descriptor list", e))?;
        let regions = self.local.regions();
        for run in plan.runs() {
            let dst = regions[run.dst_region as usize].addr().unwrap_or_default() + run.dst_offset;
            let src = peer.regions()[run.src_region as usize].addr + run.src_offset;
            local.add_desc(dst as usize, run.len as usize, 0);
            remote.add_desc(src as usize, run.len as usize, 0);
        }
        let request = self
            .agent
            .create_xfer_req(XferOp::Read, &local, &remote, peer.agent_name(), None)
            .map_err(|e| nixl_err("creating a UCX read", e))?;
        let in_progress = self
            .agent
            .post_xfer_req(&request, None)
            .map_err(|e| nixl_err("posting a UCX read", e))?;
        if !in_progress {
            return Ok((Completion::ready(Ok(())), bytes));
        }
        let (done, completion) = completion_pair();
        self.poller.watch(Box::new(Posted {
            agent: self.agent.clone(),
            request: Some(request),
            done: Some(done),
            _keep: self.local.clone(),
            what: "UCX read",
        }));
        Ok((completion, bytes))
    }
}

struct GatherState {
    remaining: usize,
    completed: Vec<(usize, usize)>,
    failed: Vec<(usize, usize)>,
    error: Option<TransferError>,
    bytes: u64,
}

/// Collects the batches of one pull into its outcome.
struct Gather {
    state: Mutex<GatherState>,
    completer: Mutex<Option<Completer<TransferOutcome>>>,
}

impl Gather {
    fn batch_done(&self, batch: Vec<(usize, usize)>, bytes: u64, r: crate::error::Result<()>) {
        let outcome = {
            let mut st = self.state.lock();
            match r {
                Ok(()) => {
                    st.completed.extend_from_slice(&batch);
                    st.bytes += bytes;
                }
                Err(e) => {
                    st.error.get_or_insert(e);
                    st.failed.extend_from_slice(&batch);
                }
            }
            st.remaining -= 1;
            if st.remaining > 0 {
                return;
            }
            match st.error.take() {
                None => Ok(TransferReport {
                    blocks: st.completed.len(),
                    bytes: st.bytes,
                }),
                Some(error) => Err(Box::new(TransferFailure {
                    error,
                    completed: std::mem::take(&mut st.completed),
                    failed: std::mem::take(&mut st.failed),
                    culprit: None,
                })),
            }
        };
        if let Some(c) = self.completer.lock().take() {
            c.complete(outcome);
        }
    }
}
