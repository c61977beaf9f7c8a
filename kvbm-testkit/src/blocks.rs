//! Block contents for tests and studies that check every byte: bytes that
//! depend on a block's name and on each byte's position, written into and
//! compared with a block of a host [`PhysicalLayout`], and chains of block
//! names.
//!
//! The functions over a layout touch its memory directly: call them only
//! on blocks no transfer is writing (held, unregistered or just loaded),
//! in host memory that outlives the call.

use kvbm_block::SequenceHash;
use kvbm_transfer::PhysicalLayout;

/// Byte `i` of the block named `hash`.
pub fn byte_of(hash: SequenceHash, i: usize) -> u8 {
    let x = hash.0 ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (x ^ (x >> 29) ^ (x >> 47)) as u8
}

/// `len` bytes that depend on `seed` and on their position (xorshift):
/// different seeds give different bytes everywhere.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A chain of `n` block names from `seed`: each depends on the ones
/// before it, and chains of different seeds share none.
pub fn chain(seed: u64, n: usize) -> Vec<SequenceHash> {
    let mut h = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|i| {
            h = (h ^ (i as u64 + 1))
                .wrapping_mul(0xBF58_476D_1CE4_E5B9)
                .rotate_left(17);
            SequenceHash(h)
        })
        .collect()
}

/// Calls `f` with each chunk of block `block` of a host layout, in layer
/// then K/V order, and stops when it returns `false`.
fn visit_chunks(layout: &PhysicalLayout, block: u32, mut f: impl FnMut(&mut [u8]) -> bool) {
    let cfg = *layout.layout().config();
    for layer in 0..cfg.num_layers() {
        for outer in 0..cfg.outer_dim() {
            let c = layout
                .layout()
                .chunk(block as usize, layer, outer)
                .expect("a block of the layout");
            let region = &layout.regions()[c.region];
            let addr = region.addr().expect("a host region") + c.offset;
            // SAFETY: the layout's regions are host memory it keeps alive
            // while it is borrowed here; the chunk lies inside its region
            // (the layout checks it) and is the only slice of it made here;
            // the module's contract keeps transfers off the block meanwhile.
            let chunk = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, c.len as usize) };
            if !f(chunk) {
                return;
            }
        }
    }
}

/// Writes the bytes of the block named `hash` into block `block`.
pub fn fill(layout: &PhysicalLayout, block: u32, hash: SequenceHash) {
    let mut i = 0;
    visit_chunks(layout, block, |chunk| {
        for b in chunk.iter_mut() {
            *b = byte_of(hash, i);
            i += 1;
        }
        true
    });
}

/// Writes junk into block `block`: bytes no named block holds, as an
/// engine's memory may hold anything before a forward pass writes it.
pub fn scribble(layout: &PhysicalLayout, block: u32) {
    visit_chunks(layout, block, |chunk| {
        chunk.fill(0xA5);
        true
    });
}

/// Whether block `block` holds exactly the bytes of the block named `hash`.
pub fn holds(layout: &PhysicalLayout, block: u32, hash: SequenceHash) -> bool {
    let (mut i, mut same) = (0, true);
    visit_chunks(layout, block, |chunk| {
        for b in chunk.iter() {
            if *b != byte_of(hash, i) {
                same = false;
                return false;
            }
            i += 1;
        }
        true
    });
    same
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_patterns_differ_by_seed() {
        let (a, b) = (chain(1, 8), chain(2, 8));
        assert!(a.iter().all(|h| !b.contains(h)));
        assert_eq!(a, chain(1, 8));
        assert_ne!(pattern(1, 64), pattern(2, 64));
        assert_eq!(pattern(3, 64), pattern(3, 64));
        let h = SequenceHash(7);
        assert!((0..64).any(|i| byte_of(h, i) != byte_of(SequenceHash(8), i)));
    }

    #[test]
    fn a_filled_block_holds_its_name_only_until_scribbled() {
        use kvbm_layout::{Layout, LayoutConfig, LayoutKind};
        use kvbm_transfer::memory::SystemAllocator;
        let c = LayoutConfig::new(4, 2, 2, 16, 8, 2).unwrap();
        let l = Layout::new(c, LayoutKind::FullyContiguous).unwrap();
        let layout = PhysicalLayout::allocate_system(l, &SystemAllocator::new()).unwrap();
        let (a, b) = (SequenceHash(11), SequenceHash(12));
        fill(&layout, 1, a);
        fill(&layout, 2, b);
        assert!(holds(&layout, 1, a) && holds(&layout, 2, b));
        assert!(!holds(&layout, 1, b) && !holds(&layout, 2, a));
        scribble(&layout, 1);
        assert!(!holds(&layout, 1, a) && holds(&layout, 2, b));
    }
}
