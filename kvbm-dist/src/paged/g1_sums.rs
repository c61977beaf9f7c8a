//! A job's checksums taken on the GPU, where the engine's pages are device
//! memory.
//!
//! With checksums on (verify mode, or a kept G2), a store records the sum
//! of each block it wrote into a slot, and a load checks the block it
//! read. Summed on the host, that is a second pass over every byte at a
//! fraction of the copy's rate. With the pages on a GPU the worker sums
//! the G1 side instead, a pass over HBM beside the copy: a store's source
//! pages (stable while the job runs) while its copy runs, a load's
//! destination pages once its copy landed, so a load checks what reached
//! the engine, not only what was in the slot. The sums are those the
//! host takes over a slot (same chunks, same order), so a slot written on
//! the GPU is checked by a host read and the other way round. When the
//! GPU cannot sum (its kernel did not load, a launch failed), the host
//! sums the slots as without a GPU.

use kvbm_transfer::PhysicalLayout;

use super::PageCopy;
use crate::verify::{DeviceSums, Prepared};

/// The G1 blocks of a job's copies, ready to be summed on the GPU: per
/// KV cache group, the copies' indexes and their blocks' chunk table.
pub(super) struct G1Sums {
    groups: Vec<(Vec<usize>, Prepared)>,
    copies: usize,
}

impl G1Sums {
    /// Works out the chunks of every copy's G1 block (cheap host work, done
    /// while the copies run).
    pub(super) fn prepare(
        device: &DeviceSums,
        g1: &[PhysicalLayout],
        copies: &[PageCopy],
    ) -> Result<Self, String> {
        let mut groups = Vec::new();
        for (group, layout) in g1.iter().enumerate() {
            let indexes: Vec<usize> = (0..copies.len())
                .filter(|&i| copies[i].group == group)
                .collect();
            if indexes.is_empty() {
                continue;
            }
            let blocks: Vec<usize> = indexes.iter().map(|&i| copies[i].block).collect();
            groups.push((indexes, device.prepare(layout, &blocks)?));
        }
        Ok(G1Sums {
            groups,
            copies: copies.len(),
        })
    }

    /// The sum of each copy's G1 block, indexed like the copies. Waits for
    /// the GPU; the blocks must not be written while it sums them.
    pub(super) fn take(&self, device: &DeviceSums) -> Result<Vec<u64>, String> {
        let mut sums = vec![0; self.copies];
        for (indexes, prepared) in &self.groups {
            for (&i, sum) in indexes.iter().zip(device.sums_of(prepared)?) {
                sums[i] = sum;
            }
        }
        Ok(sums)
    }
}
