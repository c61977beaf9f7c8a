//! Reader for the Mooncake JSONL traces.
//!
//! One JSON object per line: `timestamp` (ms from the start), `input_length`,
//! `output_length`, `hash_ids` (512-token prefix blocks). The reader streams:
//! it holds one line at a time, so an hour of production traffic costs no
//! more memory than its caller keeps.
//!
//! A line is at most [`MAX_LINE_BYTES`] long: a longer one (a binary file,
//! `/dev/zero`) is refused with its line number as soon as the limit is
//! read, instead of growing a buffer until memory runs out.
//!
//! Validation is strict: `hash_ids.len()` must equal
//! `ceil(input_length / 512)`. Every line of both published files satisfies
//! it (12,031 + 3,993 lines checked), so a mismatch means the file was
//! produced with another block size or is corrupt; replaying it would
//! silently misstate hit rates, which is worse than stopping. Blank lines
//! are skipped; unknown fields are ignored so that richer traces still load.
//!
//! Beyond each line on its own: a prompt has at least one token, numbers
//! are non-negative integers (a bad one is named by its field, e.g.
//! `hash_ids[3]`), the lines agree with each other ([`ChainValidator`]:
//! one position and one parent per hash id, timestamps in order), and a
//! file with no request at all is an error rather than an empty replay.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::validate::{ChainError, ChainValidator};
use super::{MOONCAKE_BLOCK_TOKENS, Request};

/// What is wrong with one line of a trace.
#[derive(Debug, thiserror::Error)]
pub enum LineError {
    /// The line is not a JSON object with the expected fields and types.
    #[error("not a Mooncake request object: {}", json_message(.0))]
    Json(#[from] serde_json::Error),
    /// A field holds a number that cannot be what it stands for.
    #[error("{field} is {value}, not {want}")]
    BadNumber {
        /// The field, e.g. `input_length` or `hash_ids[3]`.
        field: String,
        /// The value as written.
        value: String,
        /// What it must be.
        want: &'static str,
    },
    /// `input_length` is 0: a request without a prompt.
    #[error("input_length is 0: a request has at least one prompt token")]
    EmptyPrompt,
    /// The line contradicts earlier lines (or itself).
    #[error(transparent)]
    Chain(#[from] ChainError),
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

/// The longest trace line read, in bytes (its newline included): room
/// for about 800,000 hash ids, a prompt of 400 million tokens.
pub const MAX_LINE_BYTES: usize = 16 << 20;

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
    /// A line is longer than [`MAX_LINE_BYTES`].
    #[error("{path}:{line}: line longer than {limit} bytes (the limit of one trace line); is this a Mooncake JSONL trace?", path = path.display())]
    LineTooLong {
        /// The trace file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The limit, in bytes.
        limit: usize,
    },
    /// The file holds no request (it is empty or has only blank lines).
    #[error("{path}: no requests in the trace ({lines} lines, none a request)", path = path.display())]
    Empty {
        /// The trace file.
        path: PathBuf,
        /// Lines read.
        lines: usize,
    },
}

/// Where the published Mooncake traces are kept: this directory under a
/// checkout's root, or under any directory above it (a checkout may live
/// deeper than the data).
pub const MOONCAKE_DATA_DIR: &str = "shared/data/mooncake";

/// Set to `1`, this makes a Mooncake trace a test needs and does not find
/// a failure instead of a skip: a run that must cover the traces (CI)
/// then fails when they went missing.
pub const REQUIRE_TRACES_ENV: &str = "KVBM_REQUIRE_TRACES";

/// The line a test prints when it skips for lack of a trace.
pub const TRACE_SKIP_LINE: &str = "skipped: trace data not found";

/// A Mooncake trace a test needs is not there, and
/// [`REQUIRE_TRACES_ENV`] says that is a failure.
#[derive(Debug, thiserror::Error)]
#[error(
    "{REQUIRE_TRACES_ENV}=1, but {file} is not in {MOONCAKE_DATA_DIR} under {} or any directory above it",
    from.display()
)]
pub struct MissingTrace {
    /// The trace file looked for, e.g. `conversation_trace.jsonl`.
    pub file: String,
    /// Where the search started.
    pub from: PathBuf,
}

/// The file of the published Mooncake trace `name`, e.g.
/// `conversation_trace.jsonl` for `conversation`.
pub fn mooncake_file_name(name: &str) -> String {
    format!("{name}_trace.jsonl")
}

/// The Mooncake trace directory seen from `start`: [`MOONCAKE_DATA_DIR`]
/// under `start` or the nearest directory above it where it holds the
/// conversation trace.
pub fn find_mooncake_dir(start: &Path) -> Option<PathBuf> {
    start
        .ancestors()
        .map(|dir| dir.join(MOONCAKE_DATA_DIR))
        .find(|dir| dir.join(mooncake_file_name("conversation")).is_file())
}

/// The published Mooncake trace `name` for a test that runs from `start`
/// (its crate's directory): `<name>_trace.jsonl` in [`MOONCAKE_DATA_DIR`]
/// under `start` or the nearest directory above it that has it. When it
/// is nowhere, the test skips: this prints [`TRACE_SKIP_LINE`] and returns
/// `Ok(None)`; but with [`REQUIRE_TRACES_ENV`] set to `1` it returns the
/// error for the test to fail with. Every test that reads a published
/// trace finds it through this function.
pub fn mooncake_trace_or_skip(start: &Path, name: &str) -> Result<Option<PathBuf>, MissingTrace> {
    let required = std::env::var(REQUIRE_TRACES_ENV).as_deref() == Ok("1");
    trace_or_skip(start, name, required)
}

/// [`mooncake_trace_or_skip`], told whether the trace is required.
fn trace_or_skip(
    start: &Path,
    name: &str,
    required: bool,
) -> Result<Option<PathBuf>, MissingTrace> {
    let file = mooncake_file_name(name);
    let found = start
        .ancestors()
        .map(|dir| dir.join(MOONCAKE_DATA_DIR).join(&file))
        .find(|path| path.is_file());
    match found {
        Some(path) => Ok(Some(path)),
        None if required => Err(MissingTrace {
            file,
            from: start.to_path_buf(),
        }),
        None => {
            println!("{TRACE_SKIP_LINE} ({file} in {MOONCAKE_DATA_DIR})");
            Ok(None)
        }
    }
}

/// serde_json's message without its position, which counts lines inside
/// the one line given to it (always line 1); the column stays.
fn json_message(e: &serde_json::Error) -> String {
    let text = e.to_string();
    match text.rfind(" at line ") {
        Some(at) if e.column() > 0 => format!("{} (column {})", &text[..at], e.column()),
        _ => text,
    }
}

/// Names the first field of a line that failed to parse as a number of the
/// expected kind, when that is why it failed.
fn bad_number(text: &str) -> Option<LineError> {
    let value: serde_json::Value = serde_json::from_str(text).ok()?;
    let obj = value.as_object()?;
    let check = |field: String, v: &serde_json::Value, max: u64| -> Option<LineError> {
        let n = v.as_number()?;
        let want = if max == u64::from(u32::MAX) {
            "an integer from 0 to 4294967295"
        } else {
            "a non-negative integer"
        };
        match n.as_u64() {
            Some(x) if x <= max => None,
            _ => Some(LineError::BadNumber {
                field,
                value: n.to_string(),
                want,
            }),
        }
    };
    for (field, max) in [
        ("timestamp", u64::MAX),
        ("input_length", u64::from(u32::MAX)),
        ("output_length", u64::from(u32::MAX)),
    ] {
        if let Some(e) = obj.get(field).and_then(|v| check(field.into(), v, max)) {
            return Some(e);
        }
    }
    obj.get("hash_ids")?
        .as_array()?
        .iter()
        .enumerate()
        .find_map(|(i, v)| check(format!("hash_ids[{i}]"), v, u64::MAX))
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
    let raw: RawRequest = match serde_json::from_str(text) {
        Ok(raw) => raw,
        Err(e) => return Err(bad_number(text).unwrap_or(LineError::Json(e))),
    };
    if raw.input_length == 0 {
        return Err(LineError::EmptyPrompt);
    }
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
/// Yields `Err` once for the first bad line (or, at the end, for a file
/// without requests: [`TraceError::Empty`]) and then stops.
#[derive(Debug)]
pub struct MooncakeReader<R> {
    input: R,
    path: PathBuf,
    line: usize,
    buf: String,
    done: bool,
    chains: ChainValidator,
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
            chains: ChainValidator::new(),
        }
    }
}

impl<R: BufRead> Iterator for MooncakeReader<R> {
    type Item = Result<Request, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        while !self.done {
            self.buf.clear();
            self.line += 1;
            let limit = MAX_LINE_BYTES as u64;
            match (&mut self.input).take(limit).read_line(&mut self.buf) {
                Ok(n) if n as u64 == limit && !self.buf.ends_with('\n') => {
                    self.done = true;
                    self.buf = String::new();
                    return Some(Err(TraceError::LineTooLong {
                        path: self.path.clone(),
                        line: self.line,
                        limit: MAX_LINE_BYTES,
                    }));
                }
                Ok(0) => {
                    self.done = true;
                    if self.chains.requests() == 0 {
                        return Some(Err(TraceError::Empty {
                            path: self.path.clone(),
                            lines: self.line - 1,
                        }));
                    }
                }
                Ok(_) => {
                    let text = self.buf.trim();
                    if text.is_empty() {
                        continue;
                    }
                    let line = self.line;
                    let item = parse_line(text)
                        .and_then(|r| {
                            self.chains.check(line, &r)?;
                            Ok(r)
                        })
                        .map_err(|error| TraceError::Line {
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

#[cfg(test)]
mod tests {
    use super::*;

    const LINE: &str =
        "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [1, 2]}\n";

    #[test]
    fn an_endless_line_is_refused_with_its_number() {
        // Like `/dev/zero`: no newline, ever.
        let input = LINE.as_bytes().chain(std::io::repeat(0));
        let mut r = MooncakeReader::new(BufReader::new(input), "zeros");
        assert!(r.next().unwrap().is_ok());
        match r.next().unwrap() {
            Err(TraceError::LineTooLong { line: 2, limit, .. }) => {
                assert_eq!(limit, MAX_LINE_BYTES);
            }
            other => panic!("{other:?}"),
        }
        assert!(r.next().is_none());
        let e = MooncakeReader::new(BufReader::new(std::io::repeat(b'7')), "sevens")
            .next()
            .unwrap()
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("sevens:1: line longer than 16777216 bytes"),
            "{e}"
        );
    }

    #[test]
    fn a_line_of_exactly_the_limit_is_read() {
        // Padding after the object, then the newline: MAX_LINE_BYTES in all.
        let mut line = LINE.trim_end().to_owned();
        line.push_str(&" ".repeat(MAX_LINE_BYTES - line.len() - 1));
        line.push('\n');
        assert_eq!(line.len(), MAX_LINE_BYTES);
        let text = format!("{line}{LINE}");
        let r = MooncakeReader::new(text.as_bytes(), "limit");
        assert_eq!(r.collect::<Result<Vec<_>, _>>().unwrap().len(), 2);
    }

    #[test]
    fn a_trace_is_found_above_the_start_and_missing_fails_only_when_required() {
        let root = tempfile::tempdir().unwrap();
        let start = root.path().join("checkout/crate");
        std::fs::create_dir_all(&start).unwrap();
        let data = root.path().join(MOONCAKE_DATA_DIR);
        std::fs::create_dir_all(&data).unwrap();
        let conversation = data.join(mooncake_file_name("conversation"));
        std::fs::write(&conversation, "").unwrap();
        for required in [false, true] {
            assert_eq!(
                trace_or_skip(&start, "conversation", required).unwrap(),
                Some(conversation.clone())
            );
        }
        assert_eq!(find_mooncake_dir(&start), Some(data));
        // The synthetic trace is not there: a skip, or the error that
        // names it and where the search began.
        assert_eq!(trace_or_skip(&start, "synthetic", false).unwrap(), None);
        let e = trace_or_skip(&start, "synthetic", true).unwrap_err();
        assert_eq!(e.file, "synthetic_trace.jsonl");
        assert_eq!(e.from, start);
        let message = e.to_string();
        assert!(
            message.starts_with(
                "KVBM_REQUIRE_TRACES=1, but synthetic_trace.jsonl is not in shared/data/mooncake"
            ),
            "{message}"
        );
    }
}
