//! Fault injection (feature `fault-injection`): tests change a slot's
//! bytes at rest, in G2 or in G3, to see that a load refuses them.

use super::{PagedWorker, invalid};
use crate::error::Result;

impl PagedWorker {
    /// Changes every byte of G2 slot `slot` (a test's stand-in for memory
    /// that changed at rest; each call moves the bytes further from what
    /// was stored).
    pub fn corrupt_slot(&self, slot: usize) -> Result<()> {
        let region = &self.shared.region.regions()[0];
        let addr = region
            .addr()
            .ok_or_else(|| invalid("slots without an address"))?;
        if slot >= self.slots() {
            return Err(invalid(format!("slot {slot} beyond {}", self.slots())));
        }
        // SAFETY: the slot lies inside the region (checked), host memory
        // the region owns; a test calls this while no job copies the slot.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(
                (addr + slot as u64 * self.stride) as *mut u8,
                self.stride as usize,
            )
        };
        for b in bytes {
            *b = b.wrapping_add(0x41);
        }
        Ok(())
    }

    /// Overwrites G3 slot `slot` with zeros (a test's stand-in for a disk
    /// that changed at rest).
    pub fn corrupt_disk_slot(&self, slot: usize) -> Result<()> {
        let disk = self.shared.disk.as_ref().ok_or_else(|| invalid("no G3"))?;
        if slot >= disk.slots {
            return Err(invalid(format!("G3 slot {slot} beyond {}", disk.slots)));
        }
        let zeros = [(self.shared.zero_slot(), slot)];
        self.shared
            .executor
            .transfer(&self.shared.region, &disk.file, &zeros)
            .wait()
            .map_err(|f| invalid(format!("overwriting G3 slot {slot}: {f}")))?;
        Ok(())
    }
}
