//! Byte access to guest memory for devices, whichever way the client mapped it.
//!
//! fd-backed memory is reached by a short pin (pin, copy, unpin) through the DMA space;
//! memory the client mapped without an fd goes through the client ([`crate::ClientDma`]). Devices
//! moving bulk data should pin their pages themselves and keep the guard for the transfer.

use thiserror::Error;
use umdev_pinning::{AccessError, PinError, Prot, PAGE_SIZE};

use crate::device::{ClientDmaError, DeviceContext};

/// Why a guest memory access failed.
#[derive(Debug, Error)]
pub enum GuestError {
    /// The address range wraps or is empty of mappings.
    #[error("guest range [{iova:#x}, +{len:#x}) is not mapped")]
    NotMapped {
        /// First byte.
        iova: u64,
        /// Length.
        len: u64,
    },
    /// The client truncated the file behind the memory during the access: a read saw
    /// zeros, a write was lost.
    #[error("guest memory at {iova:#x} was truncated by the client")]
    Truncated {
        /// The piece's first byte.
        iova: u64,
    },
    /// Pinning the fd-backed part failed.
    #[error(transparent)]
    Pin(#[from] PinError),
    /// The client refused or could not do the transfer.
    #[error(transparent)]
    Client(#[from] ClientDmaError),
}

impl DeviceContext {
    /// Reads `buf.len()` bytes of guest memory at `iova`.
    pub fn read_guest(&self, iova: u64, buf: &mut [u8]) -> Result<(), GuestError> {
        self.access(iova, buf.len(), Prot::READ, |piece_iova, at, n, pinned| match pinned {
            Some(pins) => pins
                .read(piece_iova % PAGE_SIZE, &mut buf[at..at + n])
                .map_err(|e| access_error(e, piece_iova)),
            None => self.client_dma.read(piece_iova, &mut buf[at..at + n]).map_err(GuestError::from),
        })
    }

    /// Writes `data` to guest memory at `iova`.
    pub fn write_guest(&self, iova: u64, data: &[u8]) -> Result<(), GuestError> {
        self.access(iova, data.len(), Prot::WRITE, |piece_iova, at, n, pinned| match pinned {
            Some(pins) => {
                pins.write(piece_iova % PAGE_SIZE, &data[at..at + n]).map_err(|e| access_error(e, piece_iova))
            }
            None => self.client_dma.write(piece_iova, &data[at..at + n]).map_err(GuestError::from),
        })
    }

    /// Splits `[iova, iova + len)` at mapping boundaries and calls `f(iova, offset, len,
    /// pins)` per piece; `pins` is `Some` for fd-backed pieces (pinned from the piece's page).
    fn access(
        &self,
        iova: u64,
        len: usize,
        prot: Prot,
        mut f: impl FnMut(u64, usize, usize, Option<&umdev_pinning::PinnedPages>) -> Result<(), GuestError>,
    ) -> Result<(), GuestError> {
        let not_mapped = || GuestError::NotMapped { iova, len: len as u64 };
        if len == 0 {
            return Ok(());
        }
        iova.checked_add(len as u64 - 1).ok_or_else(not_mapped)?;
        let mut done = 0usize;
        while done < len {
            let here = iova + done as u64;
            let mapping = self.dma.lookup(here).ok_or_else(not_mapped)?;
            let mapping_end = mapping.iova + (mapping.size - 1);
            let n = ((mapping_end - here) as usize + 1).min(len - done);
            if mapping.has_memory {
                let first = here / PAGE_SIZE;
                let last = (here + n as u64 - 1) / PAGE_SIZE;
                let pins = self.dma.pin_range(first * PAGE_SIZE, last - first + 1, prot)?;
                f(here, done, n, Some(&pins))?;
            } else {
                f(here, done, n, None)?;
            }
            done += n;
        }
        Ok(())
    }
}

fn access_error(e: AccessError, iova: u64) -> GuestError {
    match e {
        AccessError::Poisoned => GuestError::Truncated { iova },
        // The pin covers exactly the pages of the piece with the access asked for, so the
        // guard accepts the copy; reaching this means an engine bug, reported rather than
        // panicking.
        AccessError::OutOfRange { .. } | AccessError::ReadOnly => GuestError::NotMapped { iova: 0, len: 0 },
    }
}
