//! The slot API: one request's life in kvbm, as an engine's scheduler sees
//! it.
//!
//! A [`SlotManager`] owns kvbm's G1 books through a [`TierEngine`] and
//! keeps one slot per request: its block hashes, the G1 blocks that hold
//! its computed prefix, blocks allocated for tokens still to compute, and
//! an onboard in progress. The calls map onto both scheduler interfaces
//! the field uses (see `docs/engine-integration.md` for a walk-through):
//!
//! | slot call | vLLM KV connector | KvbmCacheManager |
//! |---|---|---|
//! | [`create_slot`](SlotManager::create_slot) | `get_num_new_matched_tokens` | `create_slot` + `get_computed_blocks` |
//! | [`allocate_slots`](SlotManager::allocate_slots) | `update_state_after_alloc` | `allocate_slots` |
//! | [`poll_onboard`](SlotManager::poll_onboard) | `build_connector_meta` / `get_finished` | (inside `allocate_slots`) |
//! | [`commit_blocks`](SlotManager::commit_blocks) | `save_kv_layer` / `wait_for_save` | `register computed blocks` |
//! | [`free`](SlotManager::free) | `request_finished` | `free` |
//!
//! A request may carry a retention hint ([`RetentionHint`]: "a follow-up
//! comes within T", "done"), given with
//! [`set_retention`](SlotManager::set_retention) at any time or with
//! [`free_with_hint`](SlotManager::free_with_hint); it applies to every
//! block of the slot (prompt and committed) when the slot is freed.
//!
//! Every call is keyed by the engine's request id and is `Send + Sync`.

use std::collections::HashMap;
use std::sync::Arc;

use kvbm_block::SequenceHash;
use parking_lot::Mutex;

use crate::pool::{ImmutableBlock, MutableBlock};
use crate::tier::{
    G1Lookup, OnboardHandle, OnboardTarget, RequestId, RetentionHint, TierEngine, TierError,
};

/// What kvbm found for a new request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotMatch {
    /// Tokens already in G1 (computed; the engine skips them).
    pub g1_tokens: usize,
    /// Further tokens kvbm will load from G2/G3 (vLLM's
    /// `num_external_computed_tokens`).
    pub external_tokens: usize,
    /// Whether loading is asynchronous (the request must wait for
    /// [`SlotManager::poll_onboard`] to say ready before it runs).
    pub load_async: bool,
}

/// Where a slot's onboard stands.
#[derive(Debug)]
pub enum OnboardState {
    /// Nothing to load, or already loaded: the slot's blocks are usable.
    Ready,
    /// Still copying.
    Pending,
    /// Loading failed: the slot kept only its G1 prefix and the engine
    /// must compute the rest (`computed_tokens` say how far it has).
    Failed {
        /// Tokens the slot still has computed.
        computed_tokens: usize,
        /// Why.
        error: TierError,
    },
}

struct Slot {
    hashes: Vec<SequenceHash>,
    /// G1 blocks holding the computed prefix, in order.
    blocks: Vec<ImmutableBlock>,
    /// Allocated, not yet computed blocks.
    mutable: Vec<MutableBlock>,
    /// Blocks being loaded.
    external: usize,
    onboard: Option<OnboardHandle>,
    onboard_started: bool,
    /// The hint to give the slot's blocks when it is freed.
    retention: Option<RetentionHint>,
}

/// The per-request API over a [`TierEngine`].
#[derive(Debug)]
pub struct SlotManager {
    engine: Arc<TierEngine>,
    slots: Mutex<HashMap<RequestId, Slot>>,
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot")
            .field("blocks", &self.blocks.len())
            .field("mutable", &self.mutable.len())
            .field("external", &self.external)
            .finish()
    }
}

impl SlotManager {
    /// Slots over `engine`.
    pub fn new(engine: Arc<TierEngine>) -> Self {
        Self {
            engine,
            slots: Mutex::default(),
        }
    }

    /// The engine underneath.
    pub fn engine(&self) -> &Arc<TierEngine> {
        &self.engine
    }

    /// A new request with the sequence hashes of its prompt's full blocks
    /// and its prompt length in tokens: matches G1, G2 and G3 and holds
    /// what it found. Calling it again for a live request frees that slot
    /// first (a preempted request starts over).
    pub fn create_slot(
        &self,
        request: impl Into<RequestId>,
        hashes: Vec<SequenceHash>,
        prompt_tokens: usize,
    ) -> Result<SlotMatch, TierError> {
        let request = request.into();
        self.free(&request);
        let m = self
            .engine
            .match_request(&request, &hashes, prompt_tokens, G1Lookup::Pool)?;
        let g1_tokens = m.g1_tokens();
        let external = m.external_blocks();
        let slot = Slot {
            hashes,
            blocks: m.g1.into_blocks(),
            mutable: Vec::new(),
            external,
            onboard: None,
            onboard_started: false,
            retention: None,
        };
        self.slots.lock().insert(request, slot);
        Ok(SlotMatch {
            g1_tokens,
            external_tokens: external * self.engine.block_size(),
            load_async: external > 0,
        })
    }

    /// Makes room for `total_tokens` tokens of the request (prompt and
    /// generated so far plus the next step): allocates G1 blocks for what
    /// is neither computed nor being loaded, and starts loading the
    /// external blocks the match found. All or nothing on G1 space.
    pub fn allocate_slots(
        &self,
        request: impl Into<RequestId>,
        total_tokens: usize,
    ) -> Result<(), TierError> {
        let request = request.into();
        // The slot lock is never held across engine calls: allocating and
        // starting an onboard may wait for the offload worker.
        let (more, start) = {
            let mut slots = self.slots.lock();
            let slot = slots
                .get_mut(&request)
                .ok_or_else(|| TierError::UnknownRequest(request.clone()))?;
            let need = total_tokens.div_ceil(self.engine.block_size());
            let have = slot.blocks.len() + slot.external + slot.mutable.len();
            let start = slot.external > 0 && !slot.onboard_started;
            slot.onboard_started |= start;
            (need.saturating_sub(have), start)
        };
        let blocks = if more > 0 {
            match self.engine.allocate_g1(more) {
                Ok(b) => b,
                Err(e) => {
                    if start && let Some(slot) = self.slots.lock().get_mut(&request) {
                        slot.onboard_started = false;
                    }
                    return Err(e);
                }
            }
        } else {
            Vec::new()
        };
        let handle = if start {
            match self.engine.onboard(&request, OnboardTarget::Pool) {
                Ok(h) => Some(h),
                Err(e) => {
                    if let Some(slot) = self.slots.lock().get_mut(&request) {
                        slot.onboard_started = false;
                        slot.mutable.extend(blocks);
                    }
                    return Err(e);
                }
            }
        } else {
            None
        };
        let mut slots = self.slots.lock();
        let slot = slots
            .get_mut(&request)
            .ok_or_else(|| TierError::UnknownRequest(request.clone()))?;
        slot.mutable.extend(blocks);
        if handle.is_some() {
            slot.onboard = handle;
        }
        Ok(())
    }

    /// Where the request's onboard stands; once ready, its loaded blocks
    /// are part of the slot.
    pub fn poll_onboard(&self, request: impl Into<RequestId>) -> Result<OnboardState, TierError> {
        self.onboard_state(request.into(), false)
    }

    /// Waits for the request's onboard to finish.
    pub fn wait_onboard(&self, request: impl Into<RequestId>) -> Result<OnboardState, TierError> {
        self.onboard_state(request.into(), true)
    }

    fn onboard_state(&self, request: RequestId, block: bool) -> Result<OnboardState, TierError> {
        let handle = {
            let mut slots = self.slots.lock();
            let slot = slots
                .get_mut(&request)
                .ok_or_else(|| TierError::UnknownRequest(request.clone()))?;
            match slot.onboard.take() {
                // Started by a concurrent allocate_slots, handle not yet in.
                None if slot.onboard_started && slot.external > 0 => {
                    return Ok(OnboardState::Pending);
                }
                None => return Ok(OnboardState::Ready),
                Some(h) if !block && !h.is_done() => {
                    slot.onboard = Some(h);
                    return Ok(OnboardState::Pending);
                }
                Some(h) => h,
            }
        };
        let outcome = handle.wait();
        let mut slots = self.slots.lock();
        let slot = slots
            .get_mut(&request)
            .ok_or_else(|| TierError::UnknownRequest(request.clone()))?;
        slot.external = 0;
        match outcome {
            Ok(done) => {
                slot.blocks.extend(done.blocks.into_blocks());
                Ok(OnboardState::Ready)
            }
            Err(error) => Ok(OnboardState::Failed {
                computed_tokens: slot.blocks.len() * self.engine.block_size(),
                error,
            }),
        }
    }

    /// The engine computed the next blocks of the request (prompt blocks
    /// after the matched prefix, then generated ones), named by `hashes`:
    /// they fill the slot's allocated blocks in order and are registered in
    /// G1, which queues them for offload.
    pub fn commit_blocks(
        &self,
        request: impl Into<RequestId>,
        hashes: &[SequenceHash],
    ) -> Result<(), TierError> {
        let request = request.into();
        let mut slots = self.slots.lock();
        let slot = slots
            .get_mut(&request)
            .ok_or_else(|| TierError::UnknownRequest(request.clone()))?;
        if slot.onboard.is_some() || slot.external > 0 {
            return Err(TierError::StillOnboarding(request));
        }
        if hashes.len() > slot.mutable.len() {
            return Err(TierError::NotAllocated {
                request,
                committed: hashes.len(),
                allocated: slot.mutable.len(),
            });
        }
        let mut parent = slot.blocks.last().map(ImmutableBlock::sequence_hash);
        let mut complete = Vec::with_capacity(hashes.len());
        for (block, &h) in slot.mutable.drain(..hashes.len()).zip(hashes) {
            let c = block
                .complete(h, parent)
                .map_err(|e| TierError::InvalidConfig(format!("cannot complete a block: {e}")))?;
            complete.push(c);
            parent = Some(h);
        }
        let at = slot.blocks.len();
        for (i, &h) in hashes.iter().enumerate() {
            if slot.hashes.len() <= at + i {
                slot.hashes.push(h);
            }
        }
        let held = self.engine.register_g1(complete)?;
        slot.blocks.extend(held.into_blocks());
        Ok(())
    }

    /// The request's G1 block table: computed blocks, then allocated ones.
    pub fn block_ids(&self, request: impl Into<RequestId>) -> Result<Vec<u32>, TierError> {
        let request = request.into();
        let slots = self.slots.lock();
        let slot = slots
            .get(&request)
            .ok_or_else(|| TierError::UnknownRequest(request.clone()))?;
        Ok(slot
            .blocks
            .iter()
            .map(ImmutableBlock::block_id)
            .chain(slot.mutable.iter().map(MutableBlock::block_id))
            .collect())
    }

    /// Tokens the request has computed in G1.
    pub fn computed_tokens(&self, request: impl Into<RequestId>) -> Result<usize, TierError> {
        let request = request.into();
        let slots = self.slots.lock();
        let slot = slots
            .get(&request)
            .ok_or_else(|| TierError::UnknownRequest(request.clone()))?;
        Ok(slot.blocks.len() * self.engine.block_size())
    }

    /// The request finished or was preempted: its blocks go back (computed
    /// ones stay cached in G1, and in G2/G3 where offloaded). `false` if
    /// the request was unknown.
    pub fn free(&self, request: impl Into<RequestId>) -> bool {
        self.free_with_hint(request, None)
    }

    /// Sets the retention hint the slot's blocks get when it is freed
    /// (the latest call wins). An error if the request is unknown.
    pub fn set_retention(
        &self,
        request: impl Into<RequestId>,
        hint: RetentionHint,
    ) -> Result<(), TierError> {
        let request = request.into();
        let mut slots = self.slots.lock();
        let slot = slots
            .get_mut(&request)
            .ok_or(TierError::UnknownRequest(request))?;
        slot.retention = Some(hint);
        Ok(())
    }

    /// [`free`](Self::free), giving the slot's blocks `hint` (or the one
    /// set with [`set_retention`](Self::set_retention) when `None`) before
    /// they become evictable.
    pub fn free_with_hint(
        &self,
        request: impl Into<RequestId>,
        hint: Option<RetentionHint>,
    ) -> bool {
        let request = request.into();
        let slot = self.slots.lock().remove(&request);
        match (&slot, hint.or(slot.as_ref().and_then(|s| s.retention))) {
            (Some(s), Some(h)) => self.engine.retain(&s.hashes, h),
            (None, Some(h)) => {
                self.engine.hint_request(&request, h);
            }
            (_, None) => {}
        }
        let known = self.engine.release(&request);
        slot.is_some() || known
    }

    /// Live slots.
    pub fn len(&self) -> usize {
        self.slots.lock().len()
    }

    /// Whether no slot is live.
    pub fn is_empty(&self) -> bool {
        self.slots.lock().is_empty()
    }
}
