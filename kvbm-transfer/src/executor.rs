//! The executor: turns "copy these blocks from this physical layout to
//! that one" into backend work.
//!
//! One transfer: validate the request, pick the strategy from the table,
//! split the block pairs into batches of at most `max_blocks_per_batch`,
//! plan each batch with kvbm-layout's copy planner, and run it on a
//! registered one-hop file route if it takes the batch, else directly on
//! one backend or as a two-hop pipeline. A limit per direction (source
//! kind → destination kind) bounds the batches in flight across all
//! transfers that way; batches beyond it wait in a FIFO and are started by
//! the completion that frees a permit. Each direction has a limit of its
//! own so that a transfer one way (an onboard a request waits for) never
//! queues behind another way's batches (a large offload), whose copies run
//! on other links or engines.
//!
//! The caller's thread plans and starts a transfer's first batch; the
//! executor's planning thread plans and starts the others meanwhile. So a
//! transfer of many batches returns once its first copy is under way, not
//! after every batch was planned: less time in the caller (an engine's
//! step), and an onboard asked for right after an offload starts sooner.
//!
//! The transfer resolves when every batch has; a failure reports which
//! blocks did land, which did not, and the first error — it never reports
//! success.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use kvbm_layout::{RunOrder, plan_copy_ordered};
use parking_lot::Mutex;

use crate::backend::{BackendKind, TransferBackend, TransferJob};
use crate::bounce::BouncePool;
#[cfg(feature = "diagnostics")]
use crate::bounce::trace::ChunkTrace;
use crate::completion::{CancelToken, Completer, Completion, Outcome, completion_pair};
use crate::disk::route::FileRoute;
use crate::error::{Result, TransferError};
use crate::limiter::{Limiter, Permit};
use crate::memory::{Location, MemoryKind};
use crate::physical::PhysicalLayout;
use crate::pipeline::{TraceSink, two_hop};
use crate::pool::WorkerPool;
use crate::strategy::{Capabilities, Strategy, select_strategy};

/// Executor settings.
#[derive(Debug, Clone)]
pub struct ExecutorConfig {
    /// Largest number of blocks planned and submitted as one unit.
    pub max_blocks_per_batch: usize,
    /// Batches in flight at once in each direction (source kind →
    /// destination kind), over all transfers that way.
    pub max_batches_in_flight: usize,
    /// Bounce slots one two-hop batch may hold at once (2 = double
    /// buffering).
    pub bounce_slots_per_batch: usize,
}

impl Default for ExecutorConfig {
    fn default() -> Self {
        ExecutorConfig {
            max_blocks_per_batch: 64,
            max_batches_in_flight: 8,
            bounce_slots_per_batch: 4,
        }
    }
}

/// Builds an [`Executor`].
#[derive(Default)]
pub struct ExecutorBuilder {
    backends: Vec<Arc<dyn TransferBackend>>,
    bounce: Vec<Arc<BouncePool>>,
    config: ExecutorConfig,
    trace: TraceSink,
    route: Option<Arc<dyn FileRoute>>,
}

impl ExecutorBuilder {
    /// Registers a backend; a later one of the same kind replaces an earlier
    /// one.
    pub fn backend(mut self, backend: Arc<dyn TransferBackend>) -> Self {
        self.backends.retain(|b| b.kind() != backend.kind());
        self.backends.push(backend);
        self
    }

    /// Registers the bounce pool for its memory kind.
    pub fn bounce_pool(mut self, pool: Arc<BouncePool>) -> Self {
        self.bounce.retain(|b| b.kind() != pool.kind());
        self.bounce.push(pool);
        self
    }

    /// Registers a one-hop route out of files (the CUDA file-window route:
    /// the GPU's DMA reads the page cache). Each batch whose pair it serves
    /// is offered to it first; a batch it declines (an `O_DIRECT` file,
    /// refused page-locking) takes the strategy table's row as before.
    pub fn file_route(mut self, route: Arc<dyn FileRoute>) -> Self {
        self.route = Some(route);
        self
    }

    /// Sets the configuration.
    pub fn config(mut self, config: ExecutorConfig) -> Self {
        self.config = config;
        self
    }

    /// Records every two-hop chunk's slot and hop events into `trace`
    /// (benchmarks and diagnosis; off by default).
    #[cfg(feature = "diagnostics")]
    pub fn chunk_trace(mut self, trace: Arc<ChunkTrace>) -> Self {
        self.trace = Some(trace);
        self
    }

    /// Builds the executor.
    pub fn build(self) -> Result<Executor> {
        let c = &self.config;
        if c.max_blocks_per_batch == 0
            || c.max_batches_in_flight == 0
            || c.bounce_slots_per_batch == 0
        {
            return Err(TransferError::InvalidRequest(
                "executor limits must be at least 1".into(),
            ));
        }
        // Bounce slots take part in every two-hop transfer: register them
        // with every backend that can use that (io_uring fixed buffers).
        for pool in &self.bounce {
            for b in &self.backends {
                b.register_memory(pool.region())?;
            }
        }
        let caps = Capabilities {
            backends: self.backends.iter().map(|b| b.kind()).collect(),
            bounce_pools: self.bounce.iter().map(|b| b.kind()).collect(),
        };
        let planner = WorkerPool::new("kvbm-plan", 1).map_err(|source| TransferError::Alloc {
            what: "the executor's planning thread".into(),
            source,
        })?;
        Ok(Executor {
            inner: Arc::new(Inner {
                limiters: Mutex::new(HashMap::new()),
                planner,
                backends: self.backends,
                bounce: self.bounce,
                caps,
                config: self.config,
                trace: self.trace,
                route: self.route,
            }),
        })
    }
}

struct Inner {
    backends: Vec<Arc<dyn TransferBackend>>,
    bounce: Vec<Arc<BouncePool>>,
    caps: Capabilities,
    config: ExecutorConfig,
    /// The in-flight limit of each direction, made when first used.
    limiters: Mutex<HashMap<(MemoryKind, MemoryKind), Arc<Limiter>>>,
    /// Plans and starts every batch of a transfer but its first.
    planner: WorkerPool,
    trace: TraceSink,
    route: Option<Arc<dyn FileRoute>>,
}

impl Inner {
    /// The in-flight limit of transfers from `src` to `dst`.
    fn limiter(&self, src: MemoryKind, dst: MemoryKind) -> Arc<Limiter> {
        self.limiters
            .lock()
            .entry((src, dst))
            .or_insert_with(|| Limiter::new(self.config.max_batches_in_flight))
            .clone()
    }

    fn backend(&self, kind: BackendKind) -> Result<&Arc<dyn TransferBackend>> {
        self.backends
            .iter()
            .find(|b| b.kind() == kind)
            .ok_or_else(|| TransferError::InvalidRequest(format!("no {kind:?} backend registered")))
    }

    fn pool(&self, kind: MemoryKind) -> Result<&Arc<BouncePool>> {
        self.bounce
            .iter()
            .find(|b| b.kind() == kind)
            .ok_or_else(|| {
                TransferError::InvalidRequest(format!("no {kind:?} bounce pool registered"))
            })
    }
}

/// Moves blocks between physical layouts. Cheap to clone; clones share
/// backends, bounce pools, the in-flight limits and the planning thread.
#[derive(Clone)]
pub struct Executor {
    inner: Arc<Inner>,
}

/// What a successful transfer moved (the default: nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TransferReport {
    /// Blocks copied.
    pub blocks: usize,
    /// Bytes copied.
    pub bytes: u64,
}

/// A transfer that did not fully succeed.
#[derive(Debug)]
pub struct TransferFailure {
    /// The first error (or [`TransferError::Cancelled`]).
    pub error: TransferError,
    /// `(src, dst)` block pairs whose bytes all landed.
    pub completed: Vec<(usize, usize)>,
    /// Pairs whose destination must be treated as garbage.
    pub failed: Vec<(usize, usize)>,
    /// The pair whose bytes the failing request carried, when it can be
    /// told from the error (I/O errors name a file range).
    pub culprit: Option<(usize, usize)>,
}

impl fmt::Display for TransferFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.culprit {
            Some((s, d)) => write!(f, "transfer of block {s} -> {d} failed: {}", self.error)?,
            None => write!(f, "transfer failed: {}", self.error)?,
        }
        write!(
            f,
            " ({} blocks landed, {} did not)",
            self.completed.len(),
            self.failed.len()
        )
    }
}

impl std::error::Error for TransferFailure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// How a transfer ended.
pub type TransferOutcome = std::result::Result<TransferReport, Box<TransferFailure>>;

impl Outcome for TransferOutcome {
    fn abandoned() -> Self {
        Err(Box::new(TransferFailure {
            error: TransferError::Abandoned("transfer driver dropped"),
            completed: Vec::new(),
            failed: Vec::new(),
            culprit: None,
        }))
    }
}

/// A transfer in progress: a future (or [`TransferHandle::wait`]) for its
/// outcome, and a way to cancel it.
#[must_use = "dropping the handle does not cancel the transfer; wait for it or cancel it"]
pub struct TransferHandle {
    completion: Completion<TransferOutcome>,
    cancel: CancelToken,
    limiter: Option<Arc<Limiter>>,
}

impl TransferHandle {
    /// Blocks until the transfer ends.
    pub fn wait(self) -> TransferOutcome {
        self.completion.wait()
    }

    /// When the transfer is due and how long a blocked waiter polls after
    /// that, once its copies said (see [`Completion::due`]).
    pub fn due(&self) -> Option<(Instant, Duration)> {
        self.completion.due()
    }

    /// Cancels and waits until nothing of the transfer is in flight any more;
    /// after this returns nothing more is written to the destination and all
    /// bounce slots are back. Reports which blocks did land.
    pub fn cancel(self) -> TransferOutcome {
        self.request_cancel();
        self.completion.wait()
    }

    /// Cancels without waiting: batches not started yet are dropped at once
    /// (even those queued behind other transfers' batches for the in-flight
    /// limit); started ones stop at their next unit of work.
    pub fn request_cancel(&self) {
        self.cancel.cancel();
        if let Some(l) = &self.limiter {
            l.flush_cancelled();
        }
    }

    /// The cancellation token. Setting it directly also cancels, but batches
    /// queued for the in-flight limit leave only when a permit reaches them;
    /// [`TransferHandle::request_cancel`] flushes them at once.
    pub fn cancel_token(&self) -> &CancelToken {
        &self.cancel
    }

    /// The completion, for callers that chain on callbacks or join several.
    pub fn into_completion(self) -> Completion<TransferOutcome> {
        self.completion
    }
}

impl std::future::Future for TransferHandle {
    type Output = TransferOutcome;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<TransferOutcome> {
        std::pin::Pin::new(&mut self.completion).poll(cx)
    }
}

fn failed_now(error: TransferError, pairs: &[(usize, usize)]) -> TransferHandle {
    TransferHandle {
        completion: Completion::ready(Err(Box::new(TransferFailure {
            error,
            completed: Vec::new(),
            failed: pairs.to_vec(),
            culprit: None,
        }))),
        cancel: CancelToken::new(),
        limiter: None,
    }
}

impl Executor {
    /// A builder with no backends.
    pub fn builder() -> ExecutorBuilder {
        ExecutorBuilder::default()
    }

    /// Registers the regions of a long-lived physical layout (a host tier's
    /// pool) with every backend that can make later transfers cheaper with
    /// it (io_uring fixed buffers, page-locking). Returns how many
    /// (backend, region) registrations were taken up.
    pub fn register(&self, layout: &PhysicalLayout) -> Result<usize> {
        let mut used = 0;
        for region in layout.regions().iter() {
            for b in &self.inner.backends {
                used += usize::from(b.register_memory(region)?);
            }
        }
        Ok(used)
    }

    /// The strategy this executor uses between two kinds.
    pub fn strategy(&self, src: MemoryKind, dst: MemoryKind) -> Result<Strategy> {
        select_strategy(src, dst, &self.inner.caps)
    }

    /// Copies block `s` of `src` into block `d` of `dst` for every `(s, d)`
    /// in `pairs`.
    pub fn transfer(
        &self,
        src: &PhysicalLayout,
        dst: &PhysicalLayout,
        pairs: &[(usize, usize)],
    ) -> TransferHandle {
        self.transfer_with(src, dst, pairs, CancelToken::new())
    }

    /// [`Executor::transfer`] with a caller-provided cancellation token.
    pub fn transfer_with(
        &self,
        src: &PhysicalLayout,
        dst: &PhysicalLayout,
        pairs: &[(usize, usize)],
        cancel: CancelToken,
    ) -> TransferHandle {
        let _span = tracing::debug_span!("transfer", blocks = pairs.len(), src = ?src.kind(), dst = ?dst.kind()).entered();
        if let Err(e) = validate(src, dst, pairs) {
            return failed_now(e, pairs);
        }
        let strategy = match self.strategy(src.kind(), dst.kind()) {
            Ok(s) => s,
            Err(e) => return failed_now(e, pairs),
        };
        if pairs.is_empty() {
            return TransferHandle {
                completion: Completion::ready(Ok(TransferReport::default())),
                cancel,
                limiter: None,
            };
        }
        let batches: Vec<Vec<(usize, usize)>> = pairs
            .chunks(self.inner.config.max_blocks_per_batch)
            .map(<[_]>::to_vec)
            .collect();
        let (completer, completion) = completion_pair();
        let driver = Arc::new_cyclic(|this| Driver {
            exec: self.inner.clone(),
            src: src.clone(),
            dst: dst.clone(),
            strategy,
            cancel: cancel.clone(),
            state: Mutex::new(DriverState {
                remaining: batches.len(),
                completed: Vec::new(),
                failed: Vec::new(),
                error: None,
                culprit: None,
                bytes: 0,
                due: None,
            }),
            completer: Mutex::new(Some(completer)),
            this: this.clone(),
        });
        let limiter = self.inner.limiter(src.kind(), dst.kind());
        for (i, batch) in batches.into_iter().enumerate() {
            let d = driver.clone();
            limiter.acquire(&cancel, move |permit| {
                if i == 0 {
                    d.run_batch(batch, permit);
                } else {
                    let exec = Arc::clone(&d.exec);
                    exec.planner.spawn(move || d.run_batch(batch, permit));
                }
            });
        }
        TransferHandle {
            completion,
            cancel,
            limiter: Some(limiter),
        }
    }
}

fn validate(src: &PhysicalLayout, dst: &PhysicalLayout, pairs: &[(usize, usize)]) -> Result<()> {
    src.layout()
        .config()
        .same_block_shape(dst.layout().config())?;
    let (ns, nd) = (
        src.layout().config().num_blocks(),
        dst.layout().config().num_blocks(),
    );
    let mut seen = HashSet::with_capacity(pairs.len());
    for &(s, d) in pairs {
        if s >= ns || d >= nd {
            return Err(TransferError::InvalidRequest(format!(
                "block pair ({s}, {d}) out of range ({ns} source, {nd} destination blocks)"
            )));
        }
        if !seen.insert(d) {
            return Err(TransferError::InvalidRequest(format!(
                "destination block {d} appears twice"
            )));
        }
    }
    Ok(())
}

struct DriverState {
    remaining: usize,
    completed: Vec<(usize, usize)>,
    failed: Vec<(usize, usize)>,
    error: Option<TransferError>,
    culprit: Option<(usize, usize)>,
    bytes: u64,
    /// The latest time a batch said it is due (see [`Driver::due_at`]).
    due: Option<Instant>,
}

struct Driver {
    exec: Arc<Inner>,
    src: PhysicalLayout,
    dst: PhysicalLayout,
    strategy: Strategy,
    cancel: CancelToken,
    state: Mutex<DriverState>,
    completer: Mutex<Option<Completer<TransferOutcome>>>,
    this: Weak<Driver>,
}

impl Driver {
    /// Runs one batch; `None` means it was flushed out of the limiter's
    /// queue by a cancel.
    fn run_batch(&self, batch: Vec<(usize, usize)>, permit: Option<Permit>) {
        let stop = self.cancel.is_cancelled() || self.state.lock().error.is_some();
        let Some(permit) = permit.filter(|_| !stop) else {
            return self.batch_done(batch, 0, Err(TransferError::Cancelled));
        };
        // An onboard into the GPU reads its host side with large DMA
        // transfers: its runs follow the host's addresses, so the copy
        // path finds them in order.
        let order = if self.src.kind().is_host() && matches!(self.dst.kind(), MemoryKind::Device(_))
        {
            RunOrder::Source
        } else {
            RunOrder::Destination
        };
        let plan = match plan_copy_ordered(self.src.layout(), self.dst.layout(), &batch, order) {
            Ok(p) => p,
            Err(e) => {
                drop(permit);
                return self.batch_done(batch, 0, Err(e.into()));
            }
        };
        let bytes = plan.total_bytes();
        let job = TransferJob::new(
            self.src.regions().clone(),
            self.dst.regions().clone(),
            plan.into_runs().into(),
            self.cancel.clone(),
        );
        let completion = match self.start(job) {
            Ok(c) => c,
            Err(e) => Completion::ready(Err(e)),
        };
        if let Some((at, spin)) = completion.due() {
            self.due_at(at, spin);
        }
        let Some(me) = self.this.upgrade() else {
            return;
        };
        completion.on_complete(move |r| {
            drop(permit);
            me.batch_done(batch, bytes, r);
        });
    }

    fn start(&self, job: TransferJob) -> Result<Completion> {
        let exec = &self.exec;
        if let Some(route) = &exec.route {
            match route.refusal(&job) {
                None => return Ok(route.submit(job)),
                Some(why) => {
                    tracing::debug!(route = route.name(), %why, "file route declined; using the strategy table")
                }
            }
        }
        match self.strategy {
            Strategy::Direct(kind) => Ok(exec.backend(kind)?.submit(job)),
            Strategy::TwoHop {
                first,
                bounce,
                second,
            } => Ok(two_hop(
                job,
                exec.backend(first)?.clone(),
                exec.backend(second)?.clone(),
                exec.pool(bounce)?.clone(),
                exec.config.bounce_slots_per_batch,
                exec.trace.clone(),
            )),
        }
    }

    /// A batch said when it is due: the transfer is due no earlier than
    /// its latest batch, so a blocked waiter polls from then.
    fn due_at(&self, at: Instant, spin: Duration) {
        let latest = {
            let mut st = self.state.lock();
            let latest = st.due.map_or(at, |d| d.max(at));
            st.due = Some(latest);
            latest
        };
        if let Some(c) = self.completer.lock().as_ref() {
            c.due_at(latest, spin);
        }
    }

    fn batch_done(&self, batch: Vec<(usize, usize)>, bytes: u64, r: Result<()>) {
        let finished = {
            let mut st = self.state.lock();
            match r {
                Ok(()) => {
                    st.completed.extend_from_slice(&batch);
                    st.bytes += bytes;
                }
                Err(e) => {
                    let real = !matches!(e, TransferError::Cancelled);
                    if st.error.is_none()
                        || (real && matches!(st.error, Some(TransferError::Cancelled)))
                    {
                        st.culprit = self.culprit(&batch, &e);
                        st.error = Some(e);
                    }
                    st.failed.extend_from_slice(&batch);
                }
            }
            st.remaining -= 1;
            if st.remaining == 0 {
                Some(match st.error.take() {
                    None => Ok(TransferReport {
                        blocks: st.completed.len(),
                        bytes: st.bytes,
                    }),
                    Some(error) => Err(Box::new(TransferFailure {
                        error,
                        completed: std::mem::take(&mut st.completed),
                        failed: std::mem::take(&mut st.failed),
                        culprit: st.culprit,
                    })),
                })
            } else {
                None
            }
        };
        if let Some(outcome) = finished
            && let Some(c) = self.completer.lock().take()
        {
            c.complete(outcome);
        }
    }

    /// For an I/O error, the pair of `batch` whose chunk on the failing
    /// file range it was.
    fn culprit(&self, batch: &[(usize, usize)], e: &TransferError) -> Option<(usize, usize)> {
        let TransferError::Io {
            path, offset, len, ..
        } = e
        else {
            return None;
        };
        let cfg = self.src.layout().config();
        let hit = |phys: &PhysicalLayout, block: usize| {
            (0..cfg.num_layers()).any(|layer| {
                (0..cfg.outer_dim()).any(|outer| {
                    let Ok(c) = phys.layout().chunk(block, layer, outer) else {
                        return false;
                    };
                    match phys.regions()[c.region].location() {
                        Location::File { file, offset: base } => {
                            let start = base + c.offset;
                            file.path() == path.as_path()
                                && start < offset + len
                                && *offset < start + c.len
                        }
                        Location::Address(_) => false,
                    }
                })
            })
        };
        batch
            .iter()
            .copied()
            .find(|&(s, d)| hit(&self.src, s) || hit(&self.dst, d))
    }
}
