//! Namespaces (NVMe 1.3 §1.6.20): a backing store cut into logical blocks.

use std::path::{Path, PathBuf};

use thiserror::Error;
use umdev_mdev::log_budget::LogBudget;

use crate::store::{Cache, RamPages, Store, StoreKind};

/// The most namespaces a controller has (NSIDs 1 to 16).
pub const MAX_NAMESPACES: u32 = 16;

/// What a namespace is made of, as the options name it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backing {
    /// A RAM disk of this many bytes, on transparent huge pages where the host gives them
    /// (`ram_pages=thp`, the default).
    Ram(u64),
    /// A RAM disk on 4 KiB pages only (a sparse memfd: `ram_pages=4k`) of this many bytes.
    SmallRam(u64),
    /// A RAM disk on 2 MiB huge pages (a hugetlb memfd) of this many bytes.
    HugeRam(u64),
    /// A host file or block device, read and written in place, in a cache mode.
    File(PathBuf, Cache),
}

/// Why a namespace could not be made.
#[derive(Debug, Error)]
pub enum NamespaceError {
    /// The RAM disk could not be made.
    #[error("ns{id}: RAM disk: {source}")]
    Ram {
        /// The NSID.
        id: u32,
        /// What failed.
        source: std::io::Error,
    },
    /// The host's hugetlb pool has too few free 2 MiB pages for a RAM disk on them.
    #[error(
        "ns{id}: RAM disk on 2 MiB pages (ram_pages=2m): it needs {needed} pages and the host's pool has \
         {free} free (sysctl vm.nr_hugepages sets the pool's size)"
    )]
    HugePool {
        /// The NSID.
        id: u32,
        /// Pages the namespace needs.
        needed: u64,
        /// Pages free and unreserved in the pool when it was asked.
        free: u64,
    },
    /// The file or block device could not be opened.
    #[error("ns{id}: {}: {source}", path.display())]
    File {
        /// The NSID.
        id: u32,
        /// The path.
        path: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
    /// The store holds no whole block.
    #[error("ns{id}: smaller than one {block}-byte block")]
    TooSmall {
        /// The NSID.
        id: u32,
        /// Bytes per block.
        block: u64,
    },
}

/// One active namespace.
#[derive(Debug)]
pub struct Namespace {
    id: u32,
    store: Store,
    lba_shift: u32,
    blocks: u64,
    /// Where the store is, for `describe` (`None` for RAM).
    path: Option<PathBuf>,
    /// A stable unique identifier (NGUID and UUID descriptors).
    nguid: [u8; 16],
    /// The backing's failures a guest's commands meet, logged within a budget.
    log: LogBudget,
}

impl Namespace {
    /// Opens or creates the namespace's store.
    pub fn new(
        id: u32,
        backing: &Backing,
        lba_shift: u32,
        nguid: [u8; 16],
    ) -> Result<Namespace, NamespaceError> {
        let (store, path) = match backing {
            Backing::Ram(size) | Backing::SmallRam(size) => {
                let pages = if matches!(backing, Backing::SmallRam(_)) {
                    RamPages::Small
                } else {
                    RamPages::Transparent
                };
                (Store::ram_with(*size, pages).map_err(|source| NamespaceError::Ram { id, source })?, None)
            }
            Backing::HugeRam(size) => {
                let store = Store::ram_huge(*size).map_err(|source| {
                    match (source.raw_os_error(), huge_pages_free()) {
                        (Some(libc::ENOMEM), Some(free)) => {
                            NamespaceError::HugePool { id, needed: size / crate::store::HUGE_PAGE, free }
                        }
                        _ => NamespaceError::Ram { id, source },
                    }
                })?;
                (store, None)
            }
            Backing::File(path, cache) => (
                Store::open_with(path, *cache).map_err(|source| NamespaceError::File {
                    id,
                    path: path.clone(),
                    source,
                })?,
                Some(path.clone()),
            ),
        };
        let blocks = store.size() >> lba_shift;
        if blocks == 0 {
            return Err(NamespaceError::TooSmall { id, block: 1u64 << lba_shift });
        }
        Ok(Namespace {
            id,
            store,
            lba_shift,
            blocks,
            path,
            nguid,
            log: LogBudget::of(module_path!(), "this namespace's further failures"),
        })
    }

    /// Starts taking a sparse RAM namespace's memory ahead of the guest's writes
    /// ([`Store::populate`]); a namespace that cannot is served sparse, as said at debug.
    pub fn populate(&mut self) {
        if let Err(e) = self.store.populate() {
            log::debug!("ns{}: RAM disk left sparse: {e}", self.id);
        }
    }

    /// Its NSID.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// Logs a failure of the backing that a guest's command met: at warning level within
    /// the namespace's budget ([`LogBudget`]), so that a guest repeating the command cannot
    /// flood the log; at debug level beyond it.
    pub fn warn(&self, what: std::fmt::Arguments<'_>) {
        self.log.warn(what);
    }

    /// The bytes.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// log2 of the LBA size (9 or 12).
    pub fn lba_shift(&self) -> u32 {
        self.lba_shift
    }

    /// Logical blocks (NSZE).
    pub fn blocks(&self) -> u64 {
        self.blocks
    }

    /// The backing file or device, if not RAM.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The NGUID.
    pub fn nguid(&self) -> [u8; 16] {
        self.nguid
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

    /// Whether the store is a host file or block device (moved through io_uring when the
    /// controller has it), not RAM.
    pub fn is_file(&self) -> bool {
        self.store.kind() != StoreKind::Ram
    }

    /// The store's cache mode.
    pub fn cache(&self) -> Cache {
        self.store.cache()
    }

    /// Whether `[slba, slba + nlb)` lies inside the namespace.
    pub fn in_range(&self, slba: u64, nlb: u64) -> bool {
        slba.checked_add(nlb).is_some_and(|end| end <= self.blocks)
    }
}

/// 2 MiB pages of the host's hugetlb pool free and not reserved for a mapping, if sysfs says.
fn huge_pages_free() -> Option<u64> {
    let read = |name: &str| {
        std::fs::read_to_string(format!("/sys/kernel/mm/hugepages/hugepages-2048kB/{name}"))
            .ok()?
            .trim()
            .parse::<u64>()
            .ok()
    };
    Some(read("free_hugepages")?.saturating_sub(read("resv_hugepages")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_namespace_is_whole_blocks() {
        let ns = Namespace::new(1, &Backing::Ram(10_000), 12, [0; 16]).unwrap();
        assert_eq!((ns.blocks(), ns.size(), ns.lba_size()), (2, 8192, 4096));
        assert!(ns.in_range(1, 1) && !ns.in_range(1, 2) && !ns.in_range(u64::MAX, 2));
        assert!(Namespace::new(1, &Backing::Ram(100), 9, [0; 16]).is_err());
    }
}
