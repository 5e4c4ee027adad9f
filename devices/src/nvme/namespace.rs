//! Namespaces: a backing store cut into logical blocks.

use std::path::PathBuf;

use crate::store::{Store, StoreKind};

/// The most namespaces a controller has (NSIDs 1 to 16).
pub const MAX_NAMESPACES: u32 = 16;

/// What a namespace is made of, as the options name it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backing {
    /// A RAM disk (a sparse memfd) of this many bytes.
    Ram(u64),
    /// A host file or block device, read and written in place.
    File(PathBuf),
}

/// One active namespace.
#[derive(Debug)]
pub struct Namespace {
    /// Its NSID.
    pub id: u32,
    /// The bytes.
    pub store: Store,
    /// log2 of the LBA size (9 or 12).
    pub lba_shift: u32,
    /// Logical blocks (NSZE).
    pub blocks: u64,
    /// Where the store is, for `describe` (`None` for RAM).
    pub path: Option<PathBuf>,
    /// A stable unique identifier (NGUID and UUID descriptors).
    pub nguid: [u8; 16],
}

impl Namespace {
    /// Opens or creates the namespace's store.
    pub fn new(id: u32, backing: &Backing, lba_shift: u32, nguid: [u8; 16]) -> Result<Namespace, String> {
        let (store, path) = match backing {
            Backing::Ram(size) => (Store::ram(*size).map_err(|e| format!("ns{id}: RAM disk: {e}"))?, None),
            Backing::File(path) => (
                Store::open(path).map_err(|e| format!("ns{id}: {}: {e}", path.display()))?,
                Some(path.clone()),
            ),
        };
        let blocks = store.size() >> lba_shift;
        if blocks == 0 {
            return Err(format!("ns{id}: smaller than one {}-byte block", 1u64 << lba_shift));
        }
        Ok(Namespace { id, store, lba_shift, blocks, path, nguid })
    }

    /// Bytes per logical block.
    pub fn lba_size(&self) -> u64 {
        1 << self.lba_shift
    }

    /// Bytes the namespace exposes.
    pub fn size(&self) -> u64 {
        self.blocks << self.lba_shift
    }

    /// `ram`, `file` or `block-device`.
    pub fn backing_name(&self) -> &'static str {
        match self.store.kind() {
            StoreKind::Ram => "ram",
            StoreKind::File => "file",
            StoreKind::BlockDevice => "block-device",
        }
    }

    /// Whether `[slba, slba + nlb)` lies inside the namespace.
    pub fn in_range(&self, slba: u64, nlb: u64) -> bool {
        slba.checked_add(nlb).is_some_and(|end| end <= self.blocks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_namespace_is_whole_blocks() {
        let ns = Namespace::new(1, &Backing::Ram(10_000), 12, [0; 16]).unwrap();
        assert_eq!((ns.blocks, ns.size(), ns.lba_size()), (2, 8192, 4096));
        assert!(ns.in_range(1, 1) && !ns.in_range(1, 2) && !ns.in_range(u64::MAX, 2));
        assert!(Namespace::new(1, &Backing::Ram(100), 9, [0; 16]).is_err());
    }
}
