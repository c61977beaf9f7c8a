//! The io_uring engine.
//!
//! One completion thread owns the ring. It takes queued operations, keeps up
//! to `queue_depth` of them in flight, and sleeps in `io_uring_enter`
//! (`submit_and_wait`) until the kernel completes one — no polling. New work
//! wakes it through an eventfd that always has a read armed in the ring.
//! Files are used as fixed files (registered while they have operations
//! queued or in flight, so an idle file is never held open), and host memory
//! registered through [`IoEngine::register_memory`] is used as fixed
//! buffers, which saves pinning pages on every request. On machines with
//! cores to spare (at least [`PUNT_BUFFERED_MIN_CPUS`]), requests on
//! buffered files (page-cache copies) are marked `IOSQE_ASYNC`, so that
//! io_uring's worker threads copy in parallel instead of this thread copying
//! them one by one inside `io_uring_enter`; on a 2-vCPU machine that only
//! added hand-offs, so there they stay inline. By default buffered files
//! do not come here at all where there are cores to spare: they go to the
//! mapped engine ([`BufferedIo`](super::BufferedIo)), because in a page
//! cache → GPU pipeline the punted reads slow to a fraction of their rate
//! alone, with every completion on the ring thread's CPU.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::mpsc;
use std::thread::JoinHandle;

use io_uring::{IoUring, opcode, squeue, types};
use parking_lot::Mutex;

use super::engine::{IoDir, IoEngine, IoOp, cancelled};
use crate::error::{Result, TransferError};
use crate::memory::MemoryRegion;

const FILE_SLOTS: u32 = 256;
const BUFFER_SLOTS: u32 = 64;
/// The kernel refuses fixed buffers larger than this.
const MAX_FIXED_BUFFER: u64 = 1 << 30;
const WAKE_TOKEN: u64 = u64::MAX;
/// Buffered requests are handed to io_uring's workers (parallel page-cache
/// copies) only when the process may use at least this many CPUs. With
/// fewer, the workers compete with the ring thread and the pipeline's other
/// hop for the same cores: parallel copies move no more bytes than one,
/// and the hand-offs make a pipeline both slower and costlier in CPU time
/// than copying inline.
const PUNT_BUFFERED_MIN_CPUS: usize = 4;

type Reply = mpsc::Sender<Result<bool>>;

#[derive(Default)]
struct Requests {
    ops: Vec<IoOp>,
    registrations: Vec<(MemoryRegion, Reply)>,
    shutdown: bool,
}

struct Shared {
    requests: Mutex<Requests>,
    wake_fd: OwnedFd,
}

impl Shared {
    fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live local to an eventfd we own.
        let rc = unsafe { libc::write(self.wake_fd.as_raw_fd(), (&raw const one).cast(), 8) };
        if rc != 8 {
            // The counter can only overflow after 2^64 - 1 unread wake-ups;
            // a failed write still leaves the counter non-zero.
            tracing::debug!(error = %io::Error::last_os_error(), "eventfd write");
        }
    }
}

/// io_uring-backed positional I/O: one ring for reads and one for writes,
/// each with its own completion thread, so that CPU-heavy buffered reads
/// (page-cache copies happen inline in `io_uring_enter`) never hold up the
/// submission of writes — the two hops of a disk → disk pipeline overlap.
pub struct UringEngine {
    read: Ring,
    write: Ring,
}

impl UringEngine {
    /// Creates the rings, each with room for `queue_depth` operations in
    /// flight, and starts their completion threads.
    pub fn new(queue_depth: u32) -> Result<Self> {
        Ok(UringEngine {
            read: Ring::new(queue_depth, "kvbm-uring-rd")?,
            write: Ring::new(queue_depth, "kvbm-uring-wr")?,
        })
    }
}

impl IoEngine for UringEngine {
    fn name(&self) -> &'static str {
        "io_uring"
    }

    fn submit(&self, ops: Vec<IoOp>) {
        let (reads, writes): (Vec<_>, Vec<_>) =
            ops.into_iter().partition(|op| op.dir == IoDir::Read);
        self.read.submit(reads);
        self.write.submit(writes);
    }

    fn register_memory(&self, region: &MemoryRegion) -> Result<bool> {
        let r = self.read.register_memory(region)?;
        let w = self.write.register_memory(region)?;
        Ok(r && w)
    }
}

/// One ring and the thread that owns it.
struct Ring {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Ring {
    /// Creates a ring with room for `queue_depth` operations in flight and
    /// starts its completion thread.
    fn new(queue_depth: u32, name: &str) -> Result<Self> {
        let qd = queue_depth.clamp(1, 4096);
        let err = |source| TransferError::Alloc {
            what: "io_uring".into(),
            source,
        };
        let ring: IoUring = IoUring::new((qd + 1).next_power_of_two()).map_err(err)?;
        let fixed_files = ring.submitter().register_files_sparse(FILE_SLOTS).is_ok();
        let fixed_buffers = ring
            .submitter()
            .register_buffers_sparse(BUFFER_SLOTS)
            .is_ok();
        if !fixed_files || !fixed_buffers {
            tracing::warn!(
                fixed_files,
                fixed_buffers,
                "io_uring registration unavailable; using plain descriptors"
            );
        }
        // SAFETY: plain syscall; the result is checked before use.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(err(io::Error::last_os_error()));
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        let wake_fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let shared = Arc::new(Shared {
            requests: Mutex::new(Requests::default()),
            wake_fd,
        });
        let mut worker = RingThread {
            ring,
            shared: shared.clone(),
            queue_depth: qd as usize,
            pending: VecDeque::new(),
            inflight: Vec::new(),
            free_slots: Vec::new(),
            inflight_count: 0,
            files: HashMap::new(),
            free_files: if fixed_files {
                (0..FILE_SLOTS).rev().collect()
            } else {
                Vec::new()
            },
            buffers: Vec::new(),
            fixed_buffers,
            wake_buf: Box::new(0),
            wake_armed: false,
            punt_buffered: std::thread::available_parallelism().map_or(1, |n| n.get())
                >= PUNT_BUFFERED_MIN_CPUS,
        };
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || worker.run())
            .map_err(err)?;
        Ok(Ring {
            shared,
            thread: Some(thread),
        })
    }
}

impl Ring {
    fn submit(&self, ops: Vec<IoOp>) {
        if ops.is_empty() {
            return;
        }
        self.shared.requests.lock().ops.extend(ops);
        self.shared.wake();
    }

    fn register_memory(&self, region: &MemoryRegion) -> Result<bool> {
        if region.addr().is_none() || !region.kind().is_host() {
            return Ok(false);
        }
        let (tx, rx) = mpsc::channel();
        self.shared
            .requests
            .lock()
            .registrations
            .push((region.clone(), tx));
        self.shared.wake();
        rx.recv()
            .unwrap_or(Err(TransferError::Abandoned("io_uring thread stopped")))
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        self.shared.requests.lock().shutdown = true;
        self.shared.wake();
        if let Some(t) = self.thread.take() {
            // The last handle can be dropped by a completion callback on the
            // ring thread itself; it then leaves its loop on its own once
            // the callback returns, and joining would deadlock.
            if t.thread().id() != std::thread::current().id() {
                // A panicked ring thread already reported itself.
                let _ = t.join();
            }
        }
    }
}

struct Inflight {
    op: IoOp,
    file_id: Option<u64>,
}

struct FixedBuffer {
    start: u64,
    end: u64,
    index: u16,
    _keep: MemoryRegion,
}

struct RingThread {
    ring: IoUring,
    shared: Arc<Shared>,
    queue_depth: usize,
    pending: VecDeque<IoOp>,
    inflight: Vec<Option<Inflight>>,
    free_slots: Vec<usize>,
    inflight_count: usize,
    /// file id → (fixed slot, queued + in-flight operations using it)
    files: HashMap<u64, (u32, usize)>,
    free_files: Vec<u32>,
    buffers: Vec<FixedBuffer>,
    fixed_buffers: bool,
    wake_buf: Box<u64>,
    wake_armed: bool,
    /// Whether buffered requests go to io_uring's workers (see [`PUNT_BUFFERED_MIN_CPUS`]).
    punt_buffered: bool,
}

impl RingThread {
    fn run(&mut self) {
        self.limit_workers();
        loop {
            let shutdown = self.take_requests();
            if shutdown && self.pending.is_empty() && self.inflight_count == 0 {
                return;
            }
            self.start_pending();
            if !self.wake_armed {
                let e = opcode::Read::new(
                    types::Fd(self.shared.wake_fd.as_raw_fd()),
                    (&raw mut *self.wake_buf).cast(),
                    8,
                )
                .build()
                .user_data(WAKE_TOKEN);
                self.push(&e);
                self.wake_armed = true;
            }
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY)
                    ) => {}
                Err(e) => tracing::error!(error = %e, "io_uring_enter failed"),
            }
            self.reap();
        }
    }

    /// Caps io_uring's workers for this thread's requests (the buffered
    /// ones run there) at the CPUs this process may use: more copy threads
    /// than cores only take turns, and crowd out the other hop of a
    /// pipeline. The cap belongs to the submitting thread, so it is set
    /// here, on the ring thread.
    fn limit_workers(&self) {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let cap = cpus.min(self.queue_depth) as u32;
        // [bounded, unbounded]; 0 leaves the unbounded pool as it is.
        let mut max = [cap, 0];
        if let Err(e) = self.ring.submitter().register_iowq_max_workers(&mut max) {
            tracing::debug!(error = %e, "io_uring worker cap unavailable");
        }
    }

    fn take_requests(&mut self) -> bool {
        let (ops, regs, shutdown) = {
            let mut r = self.shared.requests.lock();
            (
                std::mem::take(&mut r.ops),
                std::mem::take(&mut r.registrations),
                r.shutdown,
            )
        };
        for (region, reply) in regs {
            // The caller may have given up waiting; nothing to do then.
            let _ = reply.send(self.register(region));
        }
        for op in ops {
            if let Some((_, refs)) = self.files.get_mut(&op.file.id()) {
                *refs += 1;
            } else if let Some(slot) = self.free_files.pop() {
                match self
                    .ring
                    .submitter()
                    .register_files_update(slot, &[op.file.raw_fd()])
                {
                    Ok(_) => {
                        self.files.insert(op.file.id(), (slot, 1));
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "fixed file registration failed");
                        self.free_files.push(slot);
                    }
                }
            }
            self.pending.push_back(op);
        }
        shutdown
    }

    fn register(&mut self, region: MemoryRegion) -> Result<bool> {
        let Some(addr) = region.addr() else {
            return Ok(false);
        };
        if !self.fixed_buffers {
            return Ok(false);
        }
        let mut off = 0;
        while off < region.len() {
            let len = (region.len() - off).min(MAX_FIXED_BUFFER);
            let index = self.buffers.len() as u32;
            if index >= BUFFER_SLOTS {
                tracing::warn!("io_uring fixed buffer table full; remaining memory uses plain I/O");
                return Ok(off > 0);
            }
            let iov = libc::iovec {
                iov_base: (addr + off) as *mut libc::c_void,
                iov_len: len as usize,
            };
            // SAFETY: the iovec describes live host memory owned by `region`,
            // which `FixedBuffer::_keep` holds until the ring is dropped, so
            // it stays valid for as long as it is registered.
            let r = unsafe {
                self.ring
                    .submitter()
                    .register_buffers_update(index, &[iov], None)
            };
            if let Err(source) = r {
                return Err(TransferError::Alloc {
                    what: format!("io_uring fixed buffer of {len} bytes"),
                    source,
                });
            }
            self.buffers.push(FixedBuffer {
                start: addr + off,
                end: addr + off + len,
                index: index as u16,
                _keep: region.clone(),
            });
            off += len;
        }
        Ok(true)
    }

    fn release_file(&mut self, id: u64) {
        if let Some((slot, refs)) = self.files.get_mut(&id) {
            *refs -= 1;
            if *refs == 0 {
                let slot = *slot;
                self.files.remove(&id);
                if let Err(e) = self.ring.submitter().register_files_update(slot, &[-1]) {
                    tracing::warn!(error = %e, "could not release a fixed file slot");
                } else {
                    self.free_files.push(slot);
                }
            }
        }
    }

    fn start_pending(&mut self) {
        while self.inflight_count < self.queue_depth {
            let Some(op) = self.pending.pop_front() else {
                break;
            };
            let fixed_file = self.files.get(&op.file.id()).map(|(slot, _)| *slot);
            if !op.sink.wanted() {
                if fixed_file.is_some() {
                    self.release_file(op.file.id());
                }
                op.sink.complete(op.token, Err(cancelled()));
                continue;
            }
            let slot = self.free_slots.pop().unwrap_or_else(|| {
                self.inflight.push(None);
                self.inflight.len() - 1
            });
            let entry = self.build(&op, fixed_file).user_data(slot as u64);
            self.inflight[slot] = Some(Inflight {
                file_id: fixed_file.map(|_| op.file.id()),
                op,
            });
            self.inflight_count += 1;
            self.push(&entry);
        }
    }

    fn build(&self, op: &IoOp, fixed_file: Option<u32>) -> squeue::Entry {
        let buf = self
            .buffers
            .iter()
            .find(|b| op.addr >= b.start && op.addr + op.len as u64 <= b.end)
            .map(|b| b.index);
        let ptr = op.addr as *mut u8;
        macro_rules! entry {
            ($fd:expr) => {
                match (op.dir, buf) {
                    (IoDir::Read, Some(i)) => opcode::ReadFixed::new($fd, ptr, op.len, i)
                        .offset(op.file_offset)
                        .build(),
                    (IoDir::Write, Some(i)) => opcode::WriteFixed::new($fd, ptr, op.len, i)
                        .offset(op.file_offset)
                        .build(),
                    (IoDir::Read, None) => opcode::Read::new($fd, ptr, op.len)
                        .offset(op.file_offset)
                        .build(),
                    (IoDir::Write, None) => opcode::Write::new($fd, ptr, op.len)
                        .offset(op.file_offset)
                        .build(),
                }
            };
        }
        let entry = match fixed_file {
            Some(slot) => entry!(types::Fixed(slot)),
            None => entry!(types::Fd(op.file.raw_fd())),
        };
        if op.file.is_direct() || !self.punt_buffered {
            entry
        } else {
            // A buffered request is a CPU copy to or from the page cache.
            // Issued inline, the kernel does it inside this thread's
            // `io_uring_enter`, so every buffered request of the ring is
            // copied one after another on one core, and the ring stops
            // reaping and submitting meanwhile. Punted, io_uring's workers
            // copy up to the queue depth in parallel.
            entry.flags(squeue::Flags::ASYNC)
        }
    }

    fn push(&mut self, entry: &squeue::Entry) {
        loop {
            // SAFETY: every buffer an entry points at stays valid until its
            // completion is reaped: operation buffers are guaranteed by the
            // submitter (`IoEngine::submit`) and kept alive by the `IoOp`
            // stored in `inflight`; the wake-up buffer is owned by `self`.
            if unsafe { self.ring.submission().push(entry) }.is_ok() {
                return;
            }
            // The queue holds queue_depth + 1 entries and we never have more
            // than that unsubmitted, but submit to make room regardless.
            if let Err(e) = self.ring.submit() {
                tracing::warn!(error = %e, "io_uring submit failed while making room");
            }
        }
    }

    fn reap(&mut self) {
        let done: Vec<(u64, i32)> = self
            .ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (token, res) in done {
            if token == WAKE_TOKEN {
                self.wake_armed = false;
                continue;
            }
            let Some(Inflight { op, file_id }) =
                self.inflight.get_mut(token as usize).and_then(Option::take)
            else {
                continue;
            };
            self.free_slots.push(token as usize);
            self.inflight_count -= 1;
            if let Some(id) = file_id {
                self.release_file(id);
            }
            let result = if res < 0 {
                Err(io::Error::from_raw_os_error(-res))
            } else {
                Ok(res as usize)
            };
            op.sink.complete(op.token, result);
        }
    }
}
