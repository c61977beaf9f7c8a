//! Requests as the engine names them.

use std::fmt;
use std::sync::Arc;

/// An engine-given request id: a number or a string (vLLM's request ids are
/// strings, TensorRT-LLM's numbers). Cheap to clone.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(Arc<str>);

impl RequestId {
    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", &*self.0)
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for RequestId {
    fn from(s: &str) -> Self {
        Self(s.into())
    }
}

impl From<String> for RequestId {
    fn from(s: String) -> Self {
        Self(s.into())
    }
}

impl From<u64> for RequestId {
    fn from(n: u64) -> Self {
        Self(n.to_string().into())
    }
}

impl From<&RequestId> for RequestId {
    fn from(id: &RequestId) -> Self {
        id.clone()
    }
}
