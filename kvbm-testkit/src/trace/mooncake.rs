//! Reader for the Mooncake JSONL traces.
//!
//! One JSON object per line: `timestamp` (ms from the start), `input_length`,
//! `output_length`, `hash_ids` (512-token prefix blocks). The reader streams:
//! it holds one line at a time, so an hour of production traffic costs no
//! more memory than its caller keeps.
//!
//! Validation is strict: `hash_ids.len()` must equal
//! `ceil(input_length / 512)`. Every line of both published files satisfies
//! it (12,031 + 3,993 lines checked), so a mismatch means the file was
//! produced with another block size or is corrupt; replaying it would
//! silently misstate hit rates, which is worse than stopping. Blank lines
//! are skipped; unknown fields are ignored so that richer traces still load.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::{MOONCAKE_BLOCK_TOKENS, Request};

/// What is wrong with one line of a trace.
#[derive(Debug, thiserror::Error)]
pub enum LineError {
    /// The line is not a JSON object with the expected fields and types.
    #[error("not a Mooncake request object: {0}")]
    Json(#[from] serde_json::Error),
    /// `hash_ids` does not cover the prompt in 512-token blocks.
    #[error(
        "input_length {input_length} needs {expected} blocks of {block_tokens} tokens, hash_ids has {found}"
    )]
    BlockCount {
        /// Prompt length in tokens.
        input_length: u32,
        /// Tokens per block.
        block_tokens: u32,
        /// `ceil(input_length / block_tokens)`.
        expected: usize,
        /// `hash_ids.len()`.
        found: usize,
    },
}

/// Error reading a Mooncake trace.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be opened or read.
    #[error("{path}: {source}", path = path.display())]
    Io {
        /// The trace file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// One line is malformed.
    #[error("{path}:{line}: {error}", path = path.display())]
    Line {
        /// The trace file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        error: LineError,
    },
}

#[derive(Deserialize)]
struct RawRequest {
    timestamp: u64,
    input_length: u32,
    output_length: u32,
    hash_ids: Vec<u64>,
}

/// Parses one trace line (without its newline).
pub fn parse_line(text: &str) -> Result<Request, LineError> {
    let raw: RawRequest = serde_json::from_str(text)?;
    let expected = Request::blocks_for(raw.input_length, MOONCAKE_BLOCK_TOKENS);
    if raw.hash_ids.len() != expected {
        return Err(LineError::BlockCount {
            input_length: raw.input_length,
            block_tokens: MOONCAKE_BLOCK_TOKENS,
            expected,
            found: raw.hash_ids.len(),
        });
    }
    Ok(Request {
        timestamp_ms: raw.timestamp,
        input_length: raw.input_length,
        output_length: raw.output_length,
        hash_ids: raw.hash_ids,
    })
}

/// Streaming iterator over the requests of a Mooncake JSONL trace.
///
/// Yields `Err` once for the first bad line and then stops.
#[derive(Debug)]
pub struct MooncakeReader<R> {
    input: R,
    path: PathBuf,
    line: usize,
    buf: String,
    done: bool,
}

impl MooncakeReader<BufReader<File>> {
    /// Opens the trace at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, TraceError> {
        let path = path.as_ref().to_path_buf();
        match File::open(&path) {
            Ok(f) => Ok(Self::new(BufReader::new(f), path)),
            Err(source) => Err(TraceError::Io { path, source }),
        }
    }
}

impl<R: BufRead> MooncakeReader<R> {
    /// Reads from `input`; `path` names the source in errors.
    pub fn new(input: R, path: impl Into<PathBuf>) -> Self {
        Self {
            input,
            path: path.into(),
            line: 0,
            buf: String::new(),
            done: false,
        }
    }
}

impl<R: BufRead> Iterator for MooncakeReader<R> {
    type Item = Result<Request, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        while !self.done {
            self.buf.clear();
            self.line += 1;
            match self.input.read_line(&mut self.buf) {
                Ok(0) => self.done = true,
                Ok(_) => {
                    let text = self.buf.trim();
                    if text.is_empty() {
                        continue;
                    }
                    let item = parse_line(text).map_err(|error| TraceError::Line {
                        path: self.path.clone(),
                        line: self.line,
                        error,
                    });
                    self.done = item.is_err();
                    return Some(item);
                }
                Err(source) => {
                    self.done = true;
                    return Some(Err(TraceError::Io {
                        path: self.path.clone(),
                        source,
                    }));
                }
            }
        }
        None
    }
}

/// Reads a whole Mooncake trace into memory.
pub fn read_mooncake(path: impl AsRef<Path>) -> Result<Vec<Request>, TraceError> {
    MooncakeReader::open(path)?.collect()
}
