//! Checksums of G1 blocks in GPU memory, taken on the GPU.
//!
//! With feature `cuda` and a G1 on a GPU, verify mode sums the G1 side of
//! every copy there: an offload's source as it leaves, an onboard's
//! destination once it landed. The host never reads those bytes, and the
//! pass over GPU memory costs little beside the copy itself. Without
//! either, the host paths of the parent module apply.

use kvbm_transfer::PhysicalLayout;

use super::End;

/// Sums blocks of one GPU's memory.
#[cfg(feature = "cuda")]
pub(crate) struct DeviceSums {
    sums: kvbm_transfer::cuda::DeviceChecksums,
    kind: kvbm_transfer::MemoryKind,
}

/// Sums blocks of one GPU's memory (none without feature `cuda`).
#[cfg(not(feature = "cuda"))]
pub(crate) enum DeviceSums {}

#[cfg(feature = "cuda")]
impl DeviceSums {
    /// The summer for `g1`'s GPU, when G1 is device memory and its kernel
    /// loads; otherwise `None`, and a line says why when it should have.
    pub(crate) fn for_g1(g1: &PhysicalLayout) -> Option<Self> {
        let kvbm_transfer::MemoryKind::Device(ordinal) = g1.kind() else {
            return None;
        };
        let made = kvbm_transfer::cuda::CudaDevice::open(ordinal as usize)
            .and_then(|d| kvbm_transfer::cuda::DeviceChecksums::new(&d));
        match made {
            Ok(sums) => Some(DeviceSums {
                sums,
                kind: g1.kind(),
            }),
            Err(e) => {
                tracing::warn!(
                    "verify: G1 blocks cannot be summed on GPU {ordinal} ({e}); \
                     the host sums what lands in G2 instead"
                );
                None
            }
        }
    }

    /// Whether `end`'s memory is this GPU's.
    pub(crate) fn covers(&self, end: &End) -> bool {
        end.layout.kind() == self.kind
    }

    /// The checksums of `blocks` of `layout`, in order.
    pub(crate) fn sums(
        &self,
        layout: &PhysicalLayout,
        blocks: &[usize],
    ) -> Result<Vec<u64>, String> {
        self.sums_of(&self.prepare(layout, blocks)?)
    }

    /// What [`DeviceSums::sums_of`] needs for `blocks` of `layout`, worked
    /// out ahead (while a copy into them runs).
    pub(crate) fn prepare(
        &self,
        layout: &PhysicalLayout,
        blocks: &[usize],
    ) -> Result<Prepared, String> {
        self.sums
            .table(layout, blocks)
            .map_err(|e| format!("summing on the GPU: {e}"))
    }

    /// The checksums of the blocks `prepared` names, in order.
    pub(crate) fn sums_of(&self, prepared: &Prepared) -> Result<Vec<u64>, String> {
        self.sums
            .sums(prepared)
            .map_err(|e| format!("summing on the GPU: {e}"))
    }
}

/// Blocks ready to be summed on the GPU.
#[cfg(feature = "cuda")]
pub(crate) type Prepared = kvbm_transfer::cuda::ChunkTable;

/// Blocks ready to be summed on the GPU (none without feature `cuda`).
#[cfg(not(feature = "cuda"))]
pub(crate) enum Prepared {}

#[cfg(not(feature = "cuda"))]
impl DeviceSums {
    /// Without feature `cuda` there is no GPU to sum on.
    pub(crate) fn for_g1(_g1: &PhysicalLayout) -> Option<Self> {
        None
    }

    /// Never called: no value exists.
    pub(crate) fn covers(&self, _end: &End) -> bool {
        match *self {}
    }

    /// Never called: no value exists.
    pub(crate) fn sums(
        &self,
        _layout: &PhysicalLayout,
        _blocks: &[usize],
    ) -> Result<Vec<u64>, String> {
        match *self {}
    }

    /// Never called: no value exists.
    pub(crate) fn prepare(
        &self,
        _layout: &PhysicalLayout,
        _blocks: &[usize],
    ) -> Result<Prepared, String> {
        match *self {}
    }

    /// Never called: no value exists.
    pub(crate) fn sums_of(&self, _prepared: &Prepared) -> Result<Vec<u64>, String> {
        match *self {}
    }
}
