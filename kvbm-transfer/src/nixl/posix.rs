//! Host ↔ disk through NIXL's POSIX plugin.
//!
//! The backend fills the [`BackendKind::Disk`] slot of the strategy table,
//! so it is selected by registering it in place of the io_uring
//! [`DiskBackend`](crate::DiskBackend) (the executor keeps one backend per
//! kind, the later one winning):
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use kvbm_transfer::{Executor, nixl::{NixlDiskBackend, NixlDiskConfig}};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let exec = Executor::builder()
//!     .backend(Arc::new(NixlDiskBackend::new(&NixlDiskConfig::default())?))
//!     .build()?;
//! # Ok(()) }
//! ```
//!
//! Everything else — strategy choice, two-hop pipelines through bounce
//! buffers, batching — is the executor's, unchanged; io_uring stays the
//! default because it completes without polling.
//!
//! A job becomes one NIXL request: host memory and files are registered
//! with the agent the first time they take part (or eagerly through
//! [`TransferBackend::register_memory`]) and stay registered, and alive,
//! as long as the backend; runs are cut into requests of at most
//! `max_io_bytes`; each must be 4 KiB aligned in the file, in length and in
//! memory (`O_DIRECT`), which is checked here before NIXL sees it, because
//! NIXL only reports "an io completed short" afterwards. A failed request
//! fails its whole job; the executor then reports which block pairs of the
//! transfer did land (the other batches).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use nixl_sys::{Agent, Backend, MemType, RegistrationHandle, XferDescList, XferOp};
use parking_lot::Mutex;

use super::desc::{Posted, RawDesc, agent_with_backend};
use super::error::{NixlUnavailable, nixl_err};
use super::poller::Poller;
use crate::backend::{
    BackendKind, Side, TransferBackend, TransferJob, accepted_kinds, host_disk_pair,
};
use crate::completion::{Completion, completion_pair};
use crate::disk::disk_extents;
use crate::error::{Result, TransferError};
use crate::memory::{DISK_ALIGNMENT, DiskFile, MemoryKind, MemoryRegion};

/// Which kernel interface the POSIX plugin submits I/O through (its
/// parameters `use_aio`, `use_uring`, `use_posix_aio`, exactly one set).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PosixIo {
    /// Linux AIO (`io_submit`), the plugin's default.
    #[default]
    Aio,
    /// io_uring (the plugin's own ring).
    Uring,
    /// POSIX AIO (`aio_read`/`aio_write`, glibc threads).
    PosixAio,
}

impl PosixIo {
    fn params(self) -> [(&'static str, &'static str); 3] {
        let on = |x: bool| if x { "true" } else { "false" };
        [
            ("use_aio", on(self == PosixIo::Aio)),
            ("use_uring", on(self == PosixIo::Uring)),
            ("use_posix_aio", on(self == PosixIo::PosixAio)),
        ]
    }
}

/// Settings for [`NixlDiskBackend`].
#[derive(Debug, Clone)]
pub struct NixlDiskConfig {
    /// The plugin's I/O interface.
    pub io: PosixIo,
    /// Largest single I/O; longer runs are split (rounded down to 4 KiB).
    pub max_io_bytes: u32,
}

impl Default for NixlDiskConfig {
    fn default() -> Self {
        NixlDiskConfig {
            io: PosixIo::default(),
            max_io_bytes: 2 << 20,
        }
    }
}

struct Registered<T> {
    // Field order: the registration is dropped (deregistered) before what
    // it describes.
    _handle: RegistrationHandle,
    keep: T,
}

static NEXT_AGENT: AtomicU64 = AtomicU64::new(0);

/// Host ↔ disk transfers through NIXL's POSIX plugin; see the
/// [module documentation](self).
pub struct NixlDiskBackend {
    // Dropped first: waits until no request is in flight.
    poller: Poller,
    memory: Mutex<Vec<Registered<MemoryRegion>>>,
    files: Mutex<HashMap<u64, Registered<Arc<DiskFile>>>>,
    agent: Agent,
    _backend: Backend,
    agent_name: String,
    max_io_bytes: u64,
}

impl NixlDiskBackend {
    /// Creates an agent with a POSIX backend. Fails with a
    /// [`NixlUnavailable`] inside the error when the runtime or the plugin is
    /// missing — never aborts.
    pub fn new(config: &NixlDiskConfig) -> std::result::Result<Self, NixlUnavailable> {
        let agent_name = format!(
            "kvbm-posix-{}-{}",
            std::process::id(),
            NEXT_AGENT.fetch_add(1, Ordering::Relaxed)
        );
        let params = config.io.params();
        let (agent, backend) = agent_with_backend(&agent_name, "POSIX", &params, false)?;
        let poller = Poller::new("kvbm-nixl-posix").map_err(|e| NixlUnavailable::Setup {
            what: "poller thread",
            detail: e.to_string(),
        })?;
        let max = (config.max_io_bytes as u64 / DISK_ALIGNMENT).max(1) * DISK_ALIGNMENT;
        Ok(NixlDiskBackend {
            poller,
            memory: Mutex::new(Vec::new()),
            files: Mutex::new(HashMap::new()),
            agent,
            _backend: backend,
            agent_name,
            max_io_bytes: max,
        })
    }

    fn ensure_memory(&self, region: &MemoryRegion) -> Result<()> {
        let (Some(addr), true) = (region.addr(), region.kind().is_host()) else {
            return Err(TransferError::InvalidRequest(
                "NIXL POSIX moves host memory only".into(),
            ));
        };
        let end = addr + region.len();
        let mut memory = self.memory.lock();
        let covered = memory.iter().any(|r| {
            r.keep
                .addr()
                .is_some_and(|a| a <= addr && end <= a + r.keep.len())
        });
        if covered {
            return Ok(());
        }
        let desc = RawDesc {
            addr,
            len: region.len(),
            dev_id: 0,
            mem_type: MemType::Dram,
        };
        let handle = self
            .agent
            .register_memory(&desc, None)
            .map_err(|e| nixl_err("registering host memory", e))?;
        memory.push(Registered {
            _handle: handle,
            keep: region.clone(),
        });
        Ok(())
    }

    fn ensure_file(&self, file: &Arc<DiskFile>) -> Result<()> {
        let mut files = self.files.lock();
        if files.contains_key(&file.id()) {
            return Ok(());
        }
        let desc = RawDesc {
            addr: 0,
            len: file.len(),
            dev_id: file.raw_fd() as u64,
            mem_type: MemType::File,
        };
        let handle = self
            .agent
            .register_memory(&desc, None)
            .map_err(|e| nixl_err("registering a file", e))?;
        files.insert(
            file.id(),
            Registered {
                _handle: handle,
                keep: file.clone(),
            },
        );
        Ok(())
    }

    /// Builds the two descriptor lists of a job: host (address, length)
    /// and file (offset, length, descriptor), split and alignment-checked.
    fn describe(
        &self,
        job: &TransferJob,
        op: XferOp,
    ) -> Result<(XferDescList<'static>, XferDescList<'static>)> {
        let mem_side = match op {
            XferOp::Write => Side::Source,
            XferOp::Read => Side::Destination,
        };
        let extents = disk_extents(job, matches!(op, XferOp::Read))?;
        for region in job.regions(mem_side) {
            self.ensure_memory(region)?;
        }
        let mut host =
            XferDescList::new(MemType::Dram).map_err(|e| nixl_err("descriptor list", e))?;
        let mut file_list =
            XferDescList::new(MemType::File).map_err(|e| nixl_err("descriptor list", e))?;
        for e in &extents {
            self.ensure_file(&e.file)?;
            let mut off = 0;
            while off < e.len {
                let len = (e.len - off).min(self.max_io_bytes);
                host.add_desc((e.addr + off) as usize, len as usize, 0);
                file_list.add_desc(
                    (e.file_offset + off) as usize,
                    len as usize,
                    e.file.raw_fd() as u64,
                );
                off += len;
            }
        }
        Ok((host, file_list))
    }
}

impl TransferBackend for NixlDiskBackend {
    fn name(&self) -> &'static str {
        "nixl-posix"
    }

    fn kind(&self) -> BackendKind {
        BackendKind::Disk
    }

    fn supports(&self, src: MemoryKind, dst: MemoryKind) -> bool {
        host_disk_pair(src, dst)
    }

    fn register_memory(&self, region: &MemoryRegion) -> Result<bool> {
        if region.addr().is_none() || !region.kind().is_host() {
            return Ok(false);
        }
        self.ensure_memory(region)?;
        Ok(true)
    }

    fn submit(&self, job: TransferJob) -> Completion {
        let _span = tracing::trace_span!("nixl-posix", runs = job.runs.len()).entered();
        let dst = match accepted_kinds(self, &job) {
            Ok((_, dst)) => dst,
            Err(e) => return Completion::ready(Err(e)),
        };
        if job.runs.is_empty() || job.total_bytes() == 0 {
            return Completion::ready(Ok(()));
        }
        let op = if dst == MemoryKind::Disk {
            XferOp::Write
        } else {
            XferOp::Read
        };
        let (host, files) = match self.describe(&job, op) {
            Ok(lists) => lists,
            Err(e) => return Completion::ready(Err(e)),
        };
        if job.cancel.is_cancelled() {
            return Completion::ready(Err(TransferError::Cancelled));
        }
        let request = match self
            .agent
            .create_xfer_req(op, &host, &files, &self.agent_name, None)
        {
            Ok(r) => r,
            Err(e) => return Completion::ready(Err(nixl_err("creating a POSIX request", e))),
        };
        let finished = match self.agent.post_xfer_req(&request, None) {
            Ok(in_progress) => !in_progress,
            Err(e) => return Completion::ready(Err(nixl_err("posting a POSIX request", e))),
        };
        if finished {
            return Completion::ready(Ok(()));
        }
        let (done, completion) = completion_pair();
        self.poller.watch(Box::new(Posted {
            agent: self.agent.clone(),
            request: Some(request),
            done: Some(done),
            _keep: job,
            what: "POSIX transfer",
        }));
        completion
    }
}
