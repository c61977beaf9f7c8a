//! Strategy choice as data.
//!
//! [`STRATEGY_TABLE`] lists, in order of preference, how bytes move from one
//! kind of memory to another: directly with one backend, or in two hops
//! through a bounce buffer. [`select_strategy`] takes the first row that
//! matches the pair and whose backends (and bounce pool) the executor has.
//! A faster path for an existing pair (say GPUDirect Storage for
//! device ↔ disk) is a row placed above the slower one; when its backend is
//! not registered the next row is used. A faster path that only some jobs
//! of a pair can take (the GPU's DMA reading a buffered file's page cache,
//! not an `O_DIRECT` file) is a one-hop file route instead
//! ([`crate::disk::route`]): the executor offers it each batch first and
//! uses the table's row for the batches it declines.

use crate::backend::BackendKind;
use crate::error::{Result, TransferError};
use crate::memory::MemoryKind;

/// Matches memory kinds in a table row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KindPattern {
    /// System or pinned host memory.
    Host,
    /// Device memory of any ordinal.
    Device,
    /// A disk file.
    Disk,
}

impl KindPattern {
    /// Whether `kind` matches.
    pub fn matches(self, kind: MemoryKind) -> bool {
        match self {
            KindPattern::Host => kind.is_host(),
            KindPattern::Device => matches!(kind, MemoryKind::Device(_)),
            KindPattern::Disk => kind == MemoryKind::Disk,
        }
    }
}

/// How one transfer is carried out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// One backend moves the bytes.
    Direct(BackendKind),
    /// Source → bounce buffer with `first`, bounce buffer → destination with
    /// `second`, pipelined chunk by chunk.
    TwoHop {
        /// Backend for hop 1 (source → bounce).
        first: BackendKind,
        /// Kind of the bounce buffers (`System` or `Pinned`).
        bounce: MemoryKind,
        /// Backend for hop 2 (bounce → destination).
        second: BackendKind,
    },
}

/// One row: a source/destination pattern and the strategy for it.
#[derive(Debug, Clone, Copy)]
pub struct StrategyRow {
    /// Source pattern.
    pub src: KindPattern,
    /// Destination pattern.
    pub dst: KindPattern,
    /// What to do.
    pub strategy: Strategy,
}

const fn row(src: KindPattern, dst: KindPattern, strategy: Strategy) -> StrategyRow {
    StrategyRow { src, dst, strategy }
}

use BackendKind as B;
use KindPattern as K;

/// The table, in order of preference.
pub const STRATEGY_TABLE: &[StrategyRow] = &[
    row(K::Host, K::Host, Strategy::Direct(B::Memcpy)),
    row(K::Host, K::Disk, Strategy::Direct(B::Disk)),
    row(K::Disk, K::Host, Strategy::Direct(B::Disk)),
    row(
        K::Disk,
        K::Disk,
        Strategy::TwoHop {
            first: B::Disk,
            bounce: MemoryKind::System,
            second: B::Disk,
        },
    ),
    row(K::Host, K::Device, Strategy::Direct(B::Cuda)),
    row(K::Device, K::Host, Strategy::Direct(B::Cuda)),
    row(K::Device, K::Device, Strategy::Direct(B::Cuda)),
    row(
        K::Device,
        K::Disk,
        Strategy::TwoHop {
            first: B::Cuda,
            bounce: MemoryKind::Pinned,
            second: B::Disk,
        },
    ),
    row(
        K::Disk,
        K::Device,
        Strategy::TwoHop {
            first: B::Disk,
            bounce: MemoryKind::Pinned,
            second: B::Cuda,
        },
    ),
];

/// What an executor has to work with.
#[derive(Debug, Clone, Default)]
pub struct Capabilities {
    /// Registered backends.
    pub backends: Vec<BackendKind>,
    /// Kinds of the configured bounce pools.
    pub bounce_pools: Vec<MemoryKind>,
}

impl Capabilities {
    fn can(&self, strategy: &Strategy) -> bool {
        match strategy {
            Strategy::Direct(b) => self.backends.contains(b),
            Strategy::TwoHop {
                first,
                bounce,
                second,
            } => {
                self.backends.contains(first)
                    && self.backends.contains(second)
                    && self.bounce_pools.contains(bounce)
            }
        }
    }
}

/// Picks the strategy for moving `src` memory to `dst` memory from `table`
/// given `caps`: the first matching row the capabilities allow. Unsupported
/// pairs are an error value.
pub fn select_strategy_in(
    table: &[StrategyRow],
    src: MemoryKind,
    dst: MemoryKind,
    caps: &Capabilities,
) -> Result<Strategy> {
    table
        .iter()
        .find(|r| r.src.matches(src) && r.dst.matches(dst) && caps.can(&r.strategy))
        .map(|r| r.strategy)
        .ok_or(TransferError::UnsupportedPair { src, dst })
}

/// [`select_strategy_in`] over [`STRATEGY_TABLE`].
pub fn select_strategy(src: MemoryKind, dst: MemoryKind, caps: &Capabilities) -> Result<Strategy> {
    select_strategy_in(STRATEGY_TABLE, src, dst, caps)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(backends: &[BackendKind], bounce: &[MemoryKind]) -> Capabilities {
        Capabilities {
            backends: backends.to_vec(),
            bounce_pools: bounce.to_vec(),
        }
    }

    const KINDS: [MemoryKind; 5] = [
        MemoryKind::System,
        MemoryKind::Pinned,
        MemoryKind::Device(0),
        MemoryKind::Device(1),
        MemoryKind::Disk,
    ];

    #[test]
    fn cpu_only_executor() {
        let c = caps(&[B::Memcpy, B::Disk], &[MemoryKind::System]);
        assert_eq!(
            select_strategy(MemoryKind::System, MemoryKind::Pinned, &c).unwrap(),
            Strategy::Direct(B::Memcpy)
        );
        assert_eq!(
            select_strategy(MemoryKind::Disk, MemoryKind::System, &c).unwrap(),
            Strategy::Direct(B::Disk)
        );
        assert_eq!(
            select_strategy(MemoryKind::Disk, MemoryKind::Disk, &c).unwrap(),
            Strategy::TwoHop {
                first: B::Disk,
                bounce: MemoryKind::System,
                second: B::Disk
            }
        );
        for (s, d) in [
            (MemoryKind::Device(0), MemoryKind::System),
            (MemoryKind::Disk, MemoryKind::Device(0)),
        ] {
            assert!(matches!(
                select_strategy(s, d, &c),
                Err(TransferError::UnsupportedPair { .. })
            ));
        }
    }

    #[test]
    fn two_hop_needs_its_bounce_pool() {
        let c = caps(&[B::Cuda, B::Disk], &[MemoryKind::System]);
        assert!(select_strategy(MemoryKind::Device(0), MemoryKind::Disk, &c).is_err());
        let c = caps(&[B::Cuda, B::Disk], &[MemoryKind::Pinned]);
        assert_eq!(
            select_strategy(MemoryKind::Device(0), MemoryKind::Disk, &c).unwrap(),
            Strategy::TwoHop {
                first: B::Cuda,
                bounce: MemoryKind::Pinned,
                second: B::Disk
            }
        );
    }

    #[test]
    fn earlier_rows_win_and_missing_backends_fall_through() {
        let fast = row(K::Device, K::Disk, Strategy::Direct(B::Memcpy));
        let mut table = vec![fast];
        table.extend_from_slice(STRATEGY_TABLE);
        let with = caps(&[B::Memcpy, B::Cuda, B::Disk], &[MemoryKind::Pinned]);
        let without = caps(&[B::Cuda, B::Disk], &[MemoryKind::Pinned]);
        assert_eq!(
            select_strategy_in(&table, MemoryKind::Device(0), MemoryKind::Disk, &with).unwrap(),
            Strategy::Direct(B::Memcpy)
        );
        assert!(matches!(
            select_strategy_in(&table, MemoryKind::Device(0), MemoryKind::Disk, &without).unwrap(),
            Strategy::TwoHop { .. }
        ));
    }

    #[test]
    fn every_pair_is_covered_with_all_backends_and_never_panics() {
        let all = caps(
            &[B::Memcpy, B::Disk, B::Cuda],
            &[MemoryKind::System, MemoryKind::Pinned],
        );
        let none = Capabilities::default();
        for s in KINDS {
            for d in KINDS {
                assert!(select_strategy(s, d, &all).is_ok(), "{s:?} -> {d:?}");
                assert!(matches!(
                    select_strategy(s, d, &none),
                    Err(TransferError::UnsupportedPair { .. })
                ));
            }
        }
    }
}
