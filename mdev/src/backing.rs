//! Host files and block devices as the backing of a device's store: what an option check
//! can learn of one without opening it for writing ([`check`]), and a block device's facts
//! ([`block_device`]), which the check and the store that opens it share.
//!
//! What it is not: the store itself (`umdev-devices`' `store` opens, locks and moves data).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;

/// `BLKROGET`, `_IO(0x12, 94)` in linux/fs.h. libc has `BLKSSZGET`, `_IO(0x12, 104)`, whose
/// encoding differs from this one in the number only, on every architecture.
const BLKROGET: libc::Ioctl = libc::BLKSSZGET - 10;

/// What a block device is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockDevice {
    /// Bytes.
    pub size: u64,
    /// Set read-only (`blockdev --setro`, a write-protected disk): writes fail, though
    /// opening it for writing does not.
    pub read_only: bool,
    /// Bytes of its logical block (`BLKSSZGET`): the unit it zeroes, and O_DIRECT's.
    pub logical_block: u64,
}

/// The facts of the block device open as `file`.
pub fn block_device(file: &File) -> io::Result<BlockDevice> {
    // A block device's size is where its end is.
    let end = nix::unistd::lseek(file, 0, nix::unistd::Whence::SeekEnd)?;
    let mut ro: libc::c_int = 0;
    // SAFETY: BLKROGET writes one int through the pointer, which points at one.
    if unsafe { libc::ioctl(file.as_raw_fd(), BLKROGET, &mut ro) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut lbs: libc::c_int = 0;
    // SAFETY: BLKSSZGET writes one int through the pointer, which points at one.
    if unsafe { libc::ioctl(file.as_raw_fd(), libc::BLKSSZGET, &mut lbs) } != 0 || lbs <= 0 {
        lbs = 512;
    }
    Ok(BlockDevice { size: end as u64, read_only: ro != 0, logical_block: lbs as u64 })
}

/// Whether `path` can back a store of at least `min` bytes that is read and written: a
/// regular file the caller may write (not on a read-only filesystem, not immutable) or a
/// block device that is not read-only, of at least `min` bytes either way. Nothing is
/// opened for writing (closing a block device opened so makes udev probe it again); what
/// only opening can tell (a lock another program holds, a mounted block device, O_DIRECT)
/// is the store's to find when the device is made.
pub fn check(path: &Path, min: u64) -> Result<(), String> {
    let shown = path.display();
    let meta = std::fs::metadata(path).map_err(|e| format!("{shown}: {e}"))?;
    let block = meta.file_type().is_block_device();
    if !block && !meta.is_file() {
        return Err(format!("{shown}: not a regular file or a block device"));
    }
    // As this process may, by its effective ids (a daemon's are not its caller's).
    nix::unistd::faccessat(
        nix::fcntl::AT_FDCWD,
        path,
        nix::unistd::AccessFlags::R_OK | nix::unistd::AccessFlags::W_OK,
        nix::fcntl::AtFlags::AT_EACCESS,
    )
    .map_err(|e| format!("{shown}: cannot be read and written: {}", io::Error::from(e)))?;
    let size = if block {
        let file = File::open(path).map_err(|e| format!("{shown}: {e}"))?;
        let dev = block_device(&file).map_err(|e| format!("{shown}: {e}"))?;
        if dev.read_only {
            return Err(format!("{shown}: a read-only block device (blockdev --setrw makes it writable)"));
        }
        dev.size
    } else {
        meta.len()
    };
    if size < min {
        return Err(format!("{shown}: {size} bytes; a store has at least {min}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_checked_for_its_size_and_for_writing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        File::create(&path).unwrap().set_len(4096).unwrap();
        assert_eq!(check(&path, 4096), Ok(()));
        let small = check(&path, 8192).unwrap_err();
        assert!(small.ends_with("4096 bytes; a store has at least 8192"), "{small}");
        assert!(check(dir.path(), 4096).unwrap_err().ends_with("not a regular file or a block device"));
        assert!(check(&dir.path().join("none"), 4096).unwrap_err().contains("No such file"));
        // Read-only to its owner: refused, except to root, which may write it anyway.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o444)).unwrap();
        if nix::unistd::geteuid().is_root() {
            assert_eq!(check(&path, 4096), Ok(()));
        } else {
            assert!(check(&path, 4096).unwrap_err().contains("cannot be read and written"));
        }
    }
}
