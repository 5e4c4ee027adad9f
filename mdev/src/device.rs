//! The device boundary: what the vfio-user server asks of a device, and what a device gets
//! from the server.
//!
//! The server validates every request against the device's own description (region sizes
//! and flags, IRQ counts) before calling in, so a device sees only well-formed accesses;
//! devices still check what they depend on. All methods take `&self`: the server calls them
//! from its connection thread while the device's own threads run.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use bitflags::bitflags;
use thiserror::Error;
use vmm_sys_util::eventfd::EventFd;

use crate::guest::DeviceContext;

/// SET_IRQS flags, for a test or client that wires a device's interrupts.
pub use vfio_bindings::bindings::vfio::{
    VFIO_IRQ_SET_ACTION_MASK, VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_ACTION_UNMASK,
    VFIO_IRQ_SET_DATA_BOOL, VFIO_IRQ_SET_DATA_EVENTFD, VFIO_IRQ_SET_DATA_NONE,
};
pub use vfio_bindings::bindings::vfio::{
    VFIO_PCI_BAR0_REGION_INDEX, VFIO_PCI_CONFIG_REGION_INDEX, VFIO_PCI_ERR_IRQ_INDEX,
    VFIO_PCI_INTX_IRQ_INDEX, VFIO_PCI_MSIX_IRQ_INDEX, VFIO_PCI_MSI_IRQ_INDEX, VFIO_PCI_NUM_IRQS,
    VFIO_PCI_NUM_REGIONS, VFIO_PCI_REQ_IRQ_INDEX, VFIO_PCI_ROM_REGION_INDEX, VFIO_PCI_VGA_REGION_INDEX,
};

bitflags! {
    /// `VFIO_DEVICE_FLAGS_*`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct DeviceFlags: u32 {
        /// The device supports DEVICE_RESET.
        const RESET = vfio_bindings::bindings::vfio::VFIO_DEVICE_FLAGS_RESET;
        /// A PCI device (regions and IRQs follow the `VFIO_PCI_*` indexes).
        const PCI = vfio_bindings::bindings::vfio::VFIO_DEVICE_FLAGS_PCI;
    }

    /// `VFIO_REGION_INFO_FLAG_*` (CAPS is the server's business).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct RegionFlags: u32 {
        /// The client may read the region.
        const READ = vfio_bindings::bindings::vfio::VFIO_REGION_INFO_FLAG_READ;
        /// The client may write the region.
        const WRITE = vfio_bindings::bindings::vfio::VFIO_REGION_INFO_FLAG_WRITE;
        /// The client may mmap the region through [`RegionMmap::fd`].
        const MMAP = vfio_bindings::bindings::vfio::VFIO_REGION_INFO_FLAG_MMAP;
    }

    /// `VFIO_IRQ_INFO_*`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct IrqFlags: u32 {
        /// Signalled through eventfds.
        const EVENTFD = vfio_bindings::bindings::vfio::VFIO_IRQ_INFO_EVENTFD;
        /// Can be masked and unmasked.
        const MASKABLE = vfio_bindings::bindings::vfio::VFIO_IRQ_INFO_MASKABLE;
        /// Masked by the device when it fires (INTx): the client unmasks.
        const AUTOMASKED = vfio_bindings::bindings::vfio::VFIO_IRQ_INFO_AUTOMASKED;
        /// The vector count cannot change without disabling all vectors first.
        const NORESIZE = vfio_bindings::bindings::vfio::VFIO_IRQ_INFO_NORESIZE;
    }
}

/// DEVICE_GET_INFO's answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device flags.
    pub flags: DeviceFlags,
    /// Regions (for PCI, [`VFIO_PCI_NUM_REGIONS`]).
    pub num_regions: u32,
    /// IRQ indexes (for PCI, [`VFIO_PCI_NUM_IRQS`]).
    pub num_irqs: u32,
}

/// An area of a region the client may mmap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SparseArea {
    /// Offset within the region.
    pub offset: u64,
    /// Size in bytes.
    pub size: u64,
}

/// A memfd of `size` bytes for a region a client maps ([`RegionMmap::fd`]), sealed so that
/// the client can neither shrink it (the device's own mapping or reads of it would fault, or
/// come up short) nor grow it. A device gives each client a file of its own (a fresh one at
/// each detach), so that a client that left cannot reach what the next one maps.
pub fn region_memfd(name: &std::ffi::CStr, size: u64) -> std::io::Result<std::fs::File> {
    use nix::fcntl::{fcntl, FcntlArg, SealFlag};
    use nix::sys::memfd::MFdFlags;
    let flags = MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING;
    // Not executable (where `vm.memfd_noexec=2` a memfd must say so); kernels before 6.3 do not
    // know the flag.
    let noexec = flags | MFdFlags::from_bits_retain(libc::MFD_NOEXEC_SEAL);
    let fd = match nix::sys::memfd::memfd_create(name, noexec) {
        Err(nix::errno::Errno::EINVAL) => nix::sys::memfd::memfd_create(name, flags)?,
        made => made?,
    };
    let file = std::fs::File::from(fd);
    file.set_len(size)?;
    let seals = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL;
    fcntl(&file, FcntlArg::F_ADD_SEALS(seals))?;
    Ok(file)
}

/// How a region can be mmapped by the client.
#[derive(Clone, Debug)]
pub struct RegionMmap {
    /// The fd the client mmaps, sent with the region info.
    pub fd: Arc<OwnedFd>,
    /// File offset of the region's first byte within `fd`.
    pub offset: u64,
    /// The mmap-able areas; empty means the whole region (no sparse-mmap capability).
    pub areas: Vec<SparseArea>,
}

/// DEVICE_GET_REGION_INFO's answer for one region.
#[derive(Clone, Debug)]
pub struct RegionInfo {
    /// Size in bytes (0: the region does not exist). PCI BARs must be powers of two.
    pub size: u64,
    /// Access the client has.
    pub flags: RegionFlags,
    /// Set when `flags` holds MMAP.
    pub mmap: Option<RegionMmap>,
}

impl RegionInfo {
    /// A region that does not exist (size 0, no access).
    pub fn absent() -> Self {
        RegionInfo { size: 0, flags: RegionFlags::empty(), mmap: None }
    }

    /// A read-write region accessed by messages only.
    pub fn read_write(size: u64) -> Self {
        RegionInfo { size, flags: RegionFlags::READ | RegionFlags::WRITE, mmap: None }
    }
}

/// DEVICE_GET_IRQ_INFO's answer for one index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IrqInfo {
    /// How the index's vectors are signalled and masked.
    pub flags: IrqFlags,
    /// Vectors in the index (0: not supported).
    pub count: u32,
}

/// What DEVICE_SET_IRQS does to the vectors it names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IrqAction {
    /// `VFIO_IRQ_SET_ACTION_MASK`.
    Mask,
    /// `VFIO_IRQ_SET_ACTION_UNMASK`.
    Unmask,
    /// `VFIO_IRQ_SET_ACTION_TRIGGER`.
    Trigger,
}

/// The data of a DEVICE_SET_IRQS request.
#[derive(Debug)]
pub enum IrqData {
    /// `DATA_NONE`: apply the action to every named vector (with TRIGGER and count 0:
    /// disable the whole index).
    None,
    /// `DATA_BOOL`: apply the action where the flag is true; one flag per vector.
    Bool(Vec<bool>),
    /// `DATA_EVENTFD`: one eventfd per vector (for TRIGGER: the eventfd signalled when the
    /// vector fires; for UNMASK: an eventfd whose signal unmasks). Empty: de-assign.
    Eventfds(Vec<EventFd>),
}

/// A DEVICE_SET_IRQS request the server has checked for structure: exactly one action and
/// one data type, `Bool` holds `count` flags, `Eventfds` holds `count` fds or none.
/// Whether `index`, `start` and `count` fit the device is for the device to check.
#[derive(Debug)]
pub struct SetIrqs {
    /// IRQ index (`VFIO_PCI_*_IRQ_INDEX`).
    pub index: u32,
    /// First vector named.
    pub start: u32,
    /// Vectors named, from `start`.
    pub count: u32,
    /// What is done to them.
    pub action: IrqAction,
    /// Which of them, or the eventfds they signal.
    pub data: IrqData,
}

/// Why a device refused a request; carries the errno the client sees.
#[derive(Debug, Error)]
pub enum DeviceError {
    /// No such region index.
    #[error("no region {0}")]
    NoSuchRegion(u32),
    /// The access falls outside the region, or has a size the region does not accept.
    #[error("region {region}: access of {len} bytes at {offset:#x} is out of bounds or misaligned")]
    BadAccess {
        /// Region index.
        region: u32,
        /// Offset of the access.
        offset: u64,
        /// Length of the access.
        len: u64,
    },
    /// The region does not permit this direction of access.
    #[error("region {region} does not permit {what}")]
    NotPermitted {
        /// Region index.
        region: u32,
        /// "reads" or "writes".
        what: &'static str,
    },
    /// No such IRQ index, or it has no vectors.
    #[error("no IRQ index {0}")]
    NoSuchIrq(u32),
    /// `start`/`count` do not fit the index, or the action/data combination is not
    /// allowed for it.
    #[error("invalid SET_IRQS on index {index}: {why}")]
    InvalidIrqs {
        /// IRQ index.
        index: u32,
        /// What is wrong.
        why: &'static str,
    },
    /// The device does not implement this.
    #[error("not supported: {0}")]
    Unsupported(&'static str),
    /// The device failed with this errno.
    #[error("device error (errno {0})")]
    Errno(i32),
}

impl DeviceError {
    /// The errno the client sees.
    pub fn errno(&self) -> i32 {
        match self {
            DeviceError::Unsupported(_) => libc::ENOTSUP,
            DeviceError::NotPermitted { .. } => libc::EPERM,
            DeviceError::Errno(e) => *e,
            _ => libc::EINVAL,
        }
    }
}

/// Why a server-to-client DMA transfer failed.
#[derive(Debug, Error)]
pub enum ClientDmaError {
    /// The client refused it with this errno.
    #[error("client refused the transfer (errno {0})")]
    Refused(i32),
    /// The client is gone or did not answer in time.
    #[error("no client to transfer with: {0}")]
    Disconnected(&'static str),
    /// Called from the thread that serves the client: it cannot wait for the client's
    /// answer, since it is the thread that would read it.
    #[error("server-to-client DMA must be issued from a device thread, not the connection thread")]
    WouldDeadlock,
    /// The client's reply did not match the request.
    #[error("malformed reply from the client")]
    BadReply,
    /// Stopped before a piece: the transfer's `may_send` said no (the guest memory was
    /// unmapped, or bus mastering turned off, while the transfer ran).
    #[error("the guest memory may no longer be reached: stopped before the next piece")]
    Withdrawn,
}

/// Server-to-client DMA (vfio-user DMA_READ/DMA_WRITE), for guest memory the client mapped
/// without an fd. Implemented by the server; safe to call from any device thread.
///
/// A transfer goes in pieces (messages). Before each, with no other message of the connection
/// going out meanwhile, the implementation asks `may_send` of the piece's first byte, and on
/// `false` stops with [`ClientDmaError::Withdrawn`]. A reply that withdraws the guest's
/// permission (a DMA_UNMAP's, a DEVICE_RESET's) is sent after the permission is gone, so no
/// piece can follow it in the stream: the client never gets a request for memory it unmapped.
pub trait ClientDma: Send + Sync {
    /// Reads `buf.len()` bytes of guest memory at `iova` through the client.
    fn read(&self, iova: u64, buf: &mut [u8], may_send: &dyn Fn(u64) -> bool) -> Result<(), ClientDmaError>;
    /// Writes `data` to guest memory at `iova` through the client.
    fn write(&self, iova: u64, data: &[u8], may_send: &dyn Fn(u64) -> bool) -> Result<(), ClientDmaError>;
}

/// A [`ClientDma`] with no client behind it: every transfer is refused (ENODEV). For a device
/// attached in process, without a vfio-user connection, whose guest memory is all shared with
/// fds (tests, benchmarks, tools).
#[derive(Clone, Copy, Debug, Default)]
pub struct NoClient;

impl ClientDma for NoClient {
    fn read(&self, _: u64, _: &mut [u8], _: &dyn Fn(u64) -> bool) -> Result<(), ClientDmaError> {
        Err(ClientDmaError::Refused(libc::ENODEV))
    }

    fn write(&self, _: u64, _: &[u8], _: &dyn Fn(u64) -> bool) -> Result<(), ClientDmaError> {
        Err(ClientDmaError::Refused(libc::ENODEV))
    }
}

/// What a client said of itself in its VERSION request, for a device that serves different
/// clients differently ([`VfioDevice::client_version`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClientHello {
    /// The client's minor protocol version.
    pub minor: u16,
    /// The client sent a `capabilities` object. QEMU and rust-vmm's client do; SPDK's
    /// `nvme_vfio_user` initiator, a user-space driver that polls, sends none.
    pub capabilities: bool,
}

/// A device as the vfio-user server sees it.
pub trait VfioDevice: Send + Sync {
    /// DEVICE_GET_INFO.
    fn device_info(&self) -> DeviceInfo;
    /// DEVICE_GET_REGION_INFO; `None` for an index at or above `num_regions`.
    fn region_info(&self, index: u32) -> Option<RegionInfo>;
    /// REGION_READ of `data.len()` bytes at `offset`, within the region and permitted.
    fn region_read(&self, index: u32, offset: u64, data: &mut [u8]) -> Result<(), DeviceError>;
    /// REGION_WRITE of `data` at `offset`, within the region and permitted.
    fn region_write(&self, index: u32, offset: u64, data: &[u8]) -> Result<(), DeviceError>;
    /// DEVICE_GET_IRQ_INFO; `None` for an index at or above `num_irqs`.
    fn irq_info(&self, index: u32) -> Option<IrqInfo>;
    /// DEVICE_SET_IRQS.
    fn set_irqs(&self, request: SetIrqs) -> Result<(), DeviceError>;
    /// DEVICE_RESET: back to the power-on state, interrupts disabled, no pins held.
    fn reset(&self) -> Result<(), DeviceError>;
    /// A client connected: its DMA space and DMA channel.
    fn attach(&self, context: DeviceContext);
    /// The connected client's VERSION, before it may ask for any region info: a device may
    /// shape its regions for this client (which BAR areas are mappable, say). Region info
    /// must not change for the rest of the connection. The default does nothing.
    fn client_version(&self, hello: &ClientHello) {
        let _ = hello;
    }
    /// The client is gone: reset, stop all work, drop every pin and every eventfd. The
    /// server unmaps the DMA space right after.
    fn detach(&self);
    /// `[iova, iova + len)` is being unmapped while pins are held in it: stop using it and
    /// drop those pins promptly (the unmap waits a bounded time). Called with no engine lock
    /// held, on the connection thread.
    fn dma_unmap(&self, iova: u64, len: u64);
    /// The client unmapped `[iova, iova + len)` (a DMA_UNMAP that succeeded; with its ALL
    /// flag, the whole space): called on the connection thread before the reply, whether or
    /// not pins were held there (if they were, [`VfioDevice::dma_unmap`] came first), so that
    /// work reaching that memory through brief pins only (a
    /// [`crate::request::Permit::claim`]) stops too, before the client can map anything else
    /// there. By default nothing.
    fn dma_unmapped(&self, iova: u64, len: u64) {
        let _ = (iova, len);
    }

    /// Device state an operator wants to see (`umdev list --json` shows it as `device`): host
    /// endpoints such as a serial port's pty, counters. `Null` when there is nothing to show.
    fn describe(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
}
