//! The ccw device's backing store: a RAM disk (a memfd) or a file, mmapped shared.

use std::fs::File;
use std::io;
use std::path::Path;

use vm_memory::mmap::MmapRegion;
use vm_memory::{FileOffset, VolatileMemory, VolatileSlice};

/// Bytes of the store, addressed by position.
#[derive(Debug)]
pub struct Store {
    region: MmapRegion,
    size: u64,
}

impl Store {
    /// A zero-filled RAM disk of `size` bytes (sparse: memory is used as it is written).
    pub fn ram(size: u64) -> io::Result<Store> {
        let fd = nix::sys::memfd::memfd_create(c"umdev-ccw-store", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)?;
        let file = File::from(fd);
        file.set_len(size)?;
        Self::map(file, size)
    }

    /// The file at `path`, read and written in place; its size is the store's.
    pub fn file(path: &Path) -> io::Result<Store> {
        let file = std::fs::OpenOptions::new().read(true).write(true).open(path)?;
        let size = file.metadata()?.len();
        if size == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "the backing file is empty"));
        }
        Self::map(file, size)
    }

    fn map(file: File, size: u64) -> io::Result<Store> {
        let len = usize::try_from(size)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "store too large"))?;
        let region = MmapRegion::from_file(FileOffset::new(file, 0), len).map_err(io::Error::other)?;
        Ok(Store { region, size })
    }

    /// Bytes in the store.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// `len` bytes at `pos`, if inside the store.
    pub fn slice(&self, pos: u64, len: usize) -> Option<VolatileSlice<'_>> {
        let end = pos.checked_add(len as u64)?;
        if end > self.size {
            return None;
        }
        self.region.get_slice(pos as usize, len).ok()
    }
}
