//! Consistency checks across the lines of a trace.
//!
//! A line can be well-formed on its own and still contradict the lines
//! before it. `hash_ids` are chained prefix hashes: block `i` of a prompt
//! is named by a hash of everything up to and including it, so one id
//! names one prefix. It therefore always sits at the same position, and
//! always follows the same parent (the id before it in the chain, none at
//! position 0). A trace in which an id moves, or changes parent, was not
//! produced by prefix hashing (or was corrupted), and replaying it would
//! report hits on blocks that no engine could share. Requests are also in
//! arrival order, so timestamps never decrease.
//!
//! [`ChainValidator`] keeps one small record per distinct id, so it can
//! follow a streamed trace of any length (the Mooncake reader feeds it).

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use super::{BlockId, Request};

/// How one line contradicts the lines before it (or itself).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    /// A block id at a second position.
    #[error(
        "hash id {id} at position {position}, but line {first_line} has it at position {first_position}: a chained hash names one prefix, so one position"
    )]
    Position {
        /// The id.
        id: BlockId,
        /// Its position on this line (0-based).
        position: usize,
        /// The line that first placed it (1-based; may be this line).
        first_line: usize,
        /// Where that line placed it.
        first_position: usize,
    },
    /// A block id after a second parent.
    #[error(
        "hash id {id} at position {position} follows {parent}, but on line {first_line} it follows {first_parent}: a chained hash has one parent"
    )]
    Parent {
        /// The id.
        id: BlockId,
        /// Its position (0-based).
        position: usize,
        /// Its parent on this line.
        parent: BlockId,
        /// The line that first placed it (1-based).
        first_line: usize,
        /// Its parent there.
        first_parent: BlockId,
    },
    /// A timestamp earlier than the line before.
    #[error(
        "timestamp {timestamp} is earlier than {previous} on line {previous_line}: requests must be in arrival order"
    )]
    TimeTravel {
        /// This line's timestamp (ms).
        timestamp: u64,
        /// The previous request's timestamp (ms).
        previous: u64,
        /// The previous request's line (1-based).
        previous_line: usize,
    },
}

/// Where an id was first seen.
#[derive(Debug, Clone, Copy)]
struct Seen {
    position: u32,
    /// The parent, `u64::MAX` standing for none when `position == 0`.
    parent: BlockId,
    line: u32,
}

/// Checks that the requests of a trace agree with each other: every id at
/// one position under one parent, timestamps never decreasing.
#[derive(Debug, Default)]
pub struct ChainValidator {
    seen: HashMap<BlockId, Seen>,
    last: Option<(u64, usize)>,
    requests: usize,
}

impl ChainValidator {
    /// A validator that has seen nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Requests accepted so far.
    pub fn requests(&self) -> usize {
        self.requests
    }

    /// Checks `request`, read from 1-based line `line`, against everything
    /// accepted so far, and accepts it if it agrees.
    pub fn check(&mut self, line: usize, request: &Request) -> Result<(), ChainError> {
        if let Some((previous, previous_line)) = self.last
            && request.timestamp_ms < previous
        {
            return Err(ChainError::TimeTravel {
                timestamp: request.timestamp_ms,
                previous,
                previous_line,
            });
        }
        // Check the whole line before recording any of it, so a rejected
        // line leaves no trace in the records.
        let mut fresh: HashMap<BlockId, Seen> = HashMap::new();
        let line32 = u32::try_from(line).unwrap_or(u32::MAX);
        for (position, &id) in request.hash_ids.iter().enumerate() {
            let parent = match position {
                0 => u64::MAX,
                p => request.hash_ids[p - 1],
            };
            let here = Seen {
                position: u32::try_from(position).unwrap_or(u32::MAX),
                parent,
                line: line32,
            };
            let first = match self.seen.get(&id) {
                Some(s) => *s,
                None => match fresh.entry(id) {
                    Entry::Occupied(o) => *o.get(),
                    Entry::Vacant(v) => {
                        v.insert(here);
                        continue;
                    }
                },
            };
            if first.position != here.position {
                return Err(ChainError::Position {
                    id,
                    position,
                    first_line: first.line as usize,
                    first_position: first.position as usize,
                });
            }
            if first.parent != parent {
                // Same position, so not 0: both parents exist.
                return Err(ChainError::Parent {
                    id,
                    position,
                    parent,
                    first_line: first.line as usize,
                    first_parent: first.parent,
                });
            }
        }
        self.seen.extend(fresh);
        self.last = Some((request.timestamp_ms, line));
        self.requests += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(ts: u64, ids: &[u64]) -> Request {
        Request {
            timestamp_ms: ts,
            input_length: ids.len() as u32 * 512,
            output_length: 1,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn shared_prefixes_pass() {
        let mut v = ChainValidator::new();
        v.check(1, &req(0, &[0, 1, 2])).unwrap();
        v.check(2, &req(0, &[0, 1, 3])).unwrap();
        v.check(3, &req(5, &[0, 4])).unwrap();
        v.check(4, &req(5, &[7])).unwrap();
        assert_eq!(v.requests(), 4);
    }

    #[test]
    fn an_id_at_two_positions_is_named_with_both_lines() {
        let mut v = ChainValidator::new();
        v.check(1, &req(0, &[0, 1, 2])).unwrap();
        let e = v.check(3, &req(0, &[2, 5])).unwrap_err();
        assert_eq!(
            e,
            ChainError::Position {
                id: 2,
                position: 0,
                first_line: 1,
                first_position: 2
            }
        );
        // Within one line too.
        let e = v.check(4, &req(0, &[9, 9])).unwrap_err();
        assert!(
            matches!(
                e,
                ChainError::Position {
                    id: 9,
                    first_line: 4,
                    ..
                }
            ),
            "{e}"
        );
        // The rejected lines recorded nothing.
        v.check(5, &req(0, &[5])).unwrap();
        v.check(6, &req(0, &[9])).unwrap();
    }

    #[test]
    fn an_id_under_two_parents_is_an_error() {
        let mut v = ChainValidator::new();
        v.check(1, &req(0, &[0, 1, 2])).unwrap();
        let e = v.check(2, &req(0, &[0, 3, 2])).unwrap_err();
        assert_eq!(
            e,
            ChainError::Parent {
                id: 2,
                position: 2,
                parent: 3,
                first_line: 1,
                first_parent: 1
            }
        );
        assert!(e.to_string().contains("follows 3"), "{e}");
    }

    #[test]
    fn time_runs_forward() {
        let mut v = ChainValidator::new();
        v.check(1, &req(10, &[0])).unwrap();
        let e = v.check(2, &req(9, &[0])).unwrap_err();
        assert!(matches!(
            e,
            ChainError::TimeTravel {
                previous_line: 1,
                ..
            }
        ));
    }
}
