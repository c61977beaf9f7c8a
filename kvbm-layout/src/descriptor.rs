//! Layout descriptors: what a peer needs to rebuild and check our layout.
//!
//! Before a remote instance reads our blocks (G4) it must know where each
//! chunk lives in the memory we registered. A [`LayoutDescriptor`] carries
//! the config, kind, strides and region sizes; the receiver rebuilds the
//! [`Layout`] through the same validating constructors and rejects a
//! descriptor whose recorded region sizes disagree with the rebuilt layout,
//! so a corrupted or mismatched descriptor becomes an error, never a wrong
//! address. The version field is checked before anything else, so a future
//! format fails with a clear "unsupported version" instead of a parse error.

use serde::{Deserialize, Serialize};

use crate::config::LayoutConfig;
use crate::error::{LayoutError, Result};
use crate::layout::{Layout, LayoutKind, LayoutStrides};

/// The descriptor format this build writes and reads.
pub const LAYOUT_DESCRIPTOR_VERSION: u32 = 1;

/// A versioned, serialisable description of a [`Layout`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayoutDescriptor {
    /// Format version; [`LAYOUT_DESCRIPTOR_VERSION`] when written here.
    pub version: u32,
    /// The block shape (validated when deserialised).
    pub config: LayoutConfig,
    /// The layout kind.
    pub kind: LayoutKind,
    /// Byte strides inside a region.
    pub strides: LayoutStrides,
    /// Size in bytes of each region, padding included.
    pub region_sizes: Vec<u64>,
}

/// Just enough of a descriptor to read its version.
#[derive(Deserialize)]
struct VersionProbe {
    version: u32,
}

impl LayoutDescriptor {
    /// Describes `layout`.
    pub fn from_layout(layout: &Layout) -> LayoutDescriptor {
        LayoutDescriptor {
            version: LAYOUT_DESCRIPTOR_VERSION,
            config: *layout.config(),
            kind: layout.kind(),
            strides: layout.strides(),
            region_sizes: vec![layout.uniform_region_size(); layout.num_regions()],
        }
    }

    /// Rebuilds the layout and checks that it matches everything recorded.
    pub fn to_layout(&self) -> Result<Layout> {
        if self.version != LAYOUT_DESCRIPTOR_VERSION {
            return Err(LayoutError::UnsupportedDescriptorVersion {
                found: self.version,
                supported: LAYOUT_DESCRIPTOR_VERSION,
            });
        }
        let layout = Layout::with_strides(self.config, self.kind, self.strides)?;
        if self.region_sizes.len() != layout.num_regions() {
            return Err(LayoutError::InconsistentDescriptor(format!(
                "{} region sizes recorded, the layout has {} regions",
                self.region_sizes.len(),
                layout.num_regions()
            )));
        }
        let expected = layout.uniform_region_size();
        if let Some((i, &size)) = self
            .region_sizes
            .iter()
            .enumerate()
            .find(|&(_, &s)| s != expected)
        {
            return Err(LayoutError::InconsistentDescriptor(format!(
                "region {i} recorded as {size} bytes, the layout needs {expected}"
            )));
        }
        Ok(layout)
    }

    /// Encodes as JSON.
    pub fn to_json(&self) -> String {
        // Serialising plain structs of integers and unit enums to a string
        // cannot fail (no maps with non-string keys, no I/O).
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Decodes JSON, checking the version first; garbage is an error.
    pub fn from_json(text: &str) -> Result<LayoutDescriptor> {
        Self::from_json_slice(text.as_bytes())
    }

    /// Decodes JSON bytes, checking the version first; garbage is an error.
    pub fn from_json_slice(bytes: &[u8]) -> Result<LayoutDescriptor> {
        let probe: VersionProbe = serde_json::from_slice(bytes)
            .map_err(|e| LayoutError::MalformedDescriptor(e.to_string()))?;
        if probe.version != LAYOUT_DESCRIPTOR_VERSION {
            return Err(LayoutError::UnsupportedDescriptorVersion {
                found: probe.version,
                supported: LAYOUT_DESCRIPTOR_VERSION,
            });
        }
        serde_json::from_slice(bytes).map_err(|e| LayoutError::MalformedDescriptor(e.to_string()))
    }
}

impl Layout {
    /// This layout's descriptor, for a peer.
    pub fn descriptor(&self) -> LayoutDescriptor {
        LayoutDescriptor::from_layout(self)
    }

    /// Rebuilds a layout from a peer's descriptor, validating it.
    pub fn from_descriptor(descriptor: &LayoutDescriptor) -> Result<Layout> {
        descriptor.to_layout()
    }
}

impl TryFrom<&LayoutDescriptor> for Layout {
    type Error = LayoutError;

    fn try_from(descriptor: &LayoutDescriptor) -> Result<Layout> {
        descriptor.to_layout()
    }
}

impl From<&Layout> for LayoutDescriptor {
    fn from(layout: &Layout) -> LayoutDescriptor {
        LayoutDescriptor::from_layout(layout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::BlockOrder;

    fn layout() -> Layout {
        let c = LayoutConfig::new(10, 3, 2, 16, 128, 2)
            .unwrap()
            .with_alignment(4096)
            .unwrap();
        Layout::new(c, LayoutKind::LayerSeparate(BlockOrder::OuterFirst)).unwrap()
    }

    #[test]
    fn json_round_trip() {
        let l = layout();
        let d = l.descriptor();
        let back = LayoutDescriptor::from_json(&d.to_json()).unwrap();
        assert_eq!(back, d);
        assert_eq!(back.to_layout().unwrap(), l);
    }

    #[test]
    fn garbage_is_an_error() {
        for text in ["", "null", "{", "[1,2]", "{\"version\":1}", "\u{0}\u{1}"] {
            assert!(
                matches!(
                    LayoutDescriptor::from_json(text),
                    Err(LayoutError::MalformedDescriptor(_))
                ),
                "{text:?}"
            );
        }
    }

    #[test]
    fn future_version_is_named() {
        let json = layout()
            .descriptor()
            .to_json()
            .replace("\"version\":1", "\"version\":7");
        assert_eq!(
            LayoutDescriptor::from_json(&json),
            Err(LayoutError::UnsupportedDescriptorVersion {
                found: 7,
                supported: 1
            })
        );
        let mut d = layout().descriptor();
        d.version = 0;
        assert!(matches!(
            d.to_layout(),
            Err(LayoutError::UnsupportedDescriptorVersion { found: 0, .. })
        ));
    }

    #[test]
    fn invalid_config_inside_is_an_error() {
        let json = layout()
            .descriptor()
            .to_json()
            .replace("\"dtype_bytes\":2", "\"dtype_bytes\":3");
        assert!(matches!(
            LayoutDescriptor::from_json(&json),
            Err(LayoutError::MalformedDescriptor(m)) if m.contains("dtype_bytes")
        ));
    }

    #[test]
    fn inconsistent_region_sizes_are_errors() {
        let mut d = layout().descriptor();
        d.region_sizes[1] += 1;
        assert!(matches!(
            d.to_layout(),
            Err(LayoutError::InconsistentDescriptor(_))
        ));
        let mut d = layout().descriptor();
        d.region_sizes.pop();
        assert!(matches!(
            d.to_layout(),
            Err(LayoutError::InconsistentDescriptor(_))
        ));
        let mut d = layout().descriptor();
        d.strides.block = 1;
        assert!(matches!(
            d.to_layout(),
            Err(LayoutError::InvalidStrides { .. })
        ));
    }
}
