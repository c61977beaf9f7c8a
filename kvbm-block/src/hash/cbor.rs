//! Canonical CBOR (RFC 8949), the subset vLLM's block hashes serialize.
//!
//! vLLM hashes `cbor2.dumps(obj, canonical=True)`; to get its bytes without
//! Python we encode the same values the same way. The subset: `None`, bools,
//! integers (including negative and beyond 64 bits, which cbor2 writes as
//! bignums: tag 2 or 3 around the big-endian magnitude with no leading
//! zeros), byte strings, text strings, and arrays (Python tuples and lists
//! both become definite-length arrays). Every head uses the shortest
//! argument encoding. Maps and floats never occur in vLLM's block keys and
//! are left out. `tests/vllm_compat.rs` pins every case against cbor2.
//!
//! Encoding writes into a [`CborSink`], so the hot path can stream straight
//! into a SHA-256 state without building a buffer.

/// Where encoded CBOR bytes go.
pub trait CborSink {
    /// Appends `bytes`.
    fn write(&mut self, bytes: &[u8]);
}

impl CborSink for Vec<u8> {
    fn write(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

/// A value of the CBOR subset used by vLLM block keys.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum CborValue {
    /// Python `None`.
    Null,
    /// Python `True` / `False`.
    Bool(bool),
    /// A Python `int` in `i128` range.
    Int(i128),
    /// Python `bytes`.
    Bytes(Vec<u8>),
    /// Python `str`.
    Text(String),
    /// A Python tuple or list.
    Array(Vec<CborValue>),
}

impl From<&str> for CborValue {
    fn from(s: &str) -> Self {
        Self::Text(s.to_owned())
    }
}

impl From<String> for CborValue {
    fn from(s: String) -> Self {
        Self::Text(s)
    }
}

impl From<i64> for CborValue {
    fn from(v: i64) -> Self {
        Self::Int(v.into())
    }
}

impl From<Vec<CborValue>> for CborValue {
    fn from(items: Vec<CborValue>) -> Self {
        Self::Array(items)
    }
}

pub(crate) const MAJOR_UINT: u8 = 0;
pub(crate) const MAJOR_NEGINT: u8 = 1;
pub(crate) const MAJOR_BYTES: u8 = 2;
pub(crate) const MAJOR_TEXT: u8 = 3;
pub(crate) const MAJOR_ARRAY: u8 = 4;
const MAJOR_TAG: u8 = 6;
pub(crate) const NULL: u8 = 0xf6;
const FALSE: u8 = 0xf4;
const TRUE: u8 = 0xf5;
const TAG_POS_BIGNUM: u64 = 2;
const TAG_NEG_BIGNUM: u64 = 3;

/// Writes a head: major type and argument, in the shortest form.
#[inline]
pub(crate) fn write_head(sink: &mut impl CborSink, major: u8, arg: u64) {
    let m = major << 5;
    if arg < 24 {
        sink.write(&[m | arg as u8]);
    } else if arg <= u8::MAX as u64 {
        sink.write(&[m | 24, arg as u8]);
    } else if arg <= u16::MAX as u64 {
        let b = (arg as u16).to_be_bytes();
        sink.write(&[m | 25, b[0], b[1]]);
    } else if arg <= u32::MAX as u64 {
        let b = (arg as u32).to_be_bytes();
        sink.write(&[m | 26, b[0], b[1], b[2], b[3]]);
    } else {
        let b = arg.to_be_bytes();
        sink.write(&[m | 27, b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
    }
}

/// Writes an integer as cbor2 does: major 0/1 within 64 bits, else a bignum.
pub(crate) fn write_int(sink: &mut impl CborSink, v: i128) {
    // Negative n is encoded through its magnitude -1 - n (never overflows).
    let (major, tag, magnitude) = if v >= 0 {
        (MAJOR_UINT, TAG_POS_BIGNUM, v as u128)
    } else {
        (MAJOR_NEGINT, TAG_NEG_BIGNUM, (-1 - v) as u128)
    };
    match u64::try_from(magnitude) {
        Ok(small) => write_head(sink, major, small),
        Err(_) => {
            write_head(sink, MAJOR_TAG, tag);
            let be = magnitude.to_be_bytes();
            let skip = (magnitude.leading_zeros() / 8) as usize;
            write_head(sink, MAJOR_BYTES, (be.len() - skip) as u64);
            sink.write(&be[skip..]);
        }
    }
}

/// Writes a byte string.
pub(crate) fn write_bytes(sink: &mut impl CborSink, bytes: &[u8]) {
    write_head(sink, MAJOR_BYTES, bytes.len() as u64);
    sink.write(bytes);
}

/// Writes a text string.
pub(crate) fn write_text(sink: &mut impl CborSink, text: &str) {
    write_head(sink, MAJOR_TEXT, text.len() as u64);
    sink.write(text.as_bytes());
}

/// Encodes `value` as canonical CBOR (byte-identical to
/// `cbor2.dumps(value, canonical=True)`) into `sink`.
pub fn encode_canonical(value: &CborValue, sink: &mut impl CborSink) {
    match value {
        CborValue::Null => sink.write(&[NULL]),
        CborValue::Bool(b) => sink.write(&[if *b { TRUE } else { FALSE }]),
        CborValue::Int(v) => write_int(sink, *v),
        CborValue::Bytes(b) => write_bytes(sink, b),
        CborValue::Text(s) => write_text(sink, s),
        CborValue::Array(items) => {
            write_head(sink, MAJOR_ARRAY, items.len() as u64);
            for item in items {
                encode_canonical(item, sink);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(value: CborValue) -> String {
        let mut out = Vec::new();
        encode_canonical(&value, &mut out);
        out.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn heads_use_the_shortest_form() {
        assert_eq!(hex(CborValue::Int(23)), "17");
        assert_eq!(hex(CborValue::Int(24)), "1818");
        assert_eq!(hex(CborValue::Int(256)), "190100");
        assert_eq!(hex(CborValue::Int(-25)), "3818");
    }

    #[test]
    fn bignums_strip_leading_zeros() {
        assert_eq!(hex(CborValue::Int(1 << 64)), "c249010000000000000000");
        assert_eq!(
            hex(CborValue::Int(-(1 << 64) - 1)),
            "c349010000000000000000"
        );
        assert_eq!(
            hex(CborValue::Int(i128::MIN)),
            "c3507fffffffffffffffffffffffffffffff"
        );
    }
}
