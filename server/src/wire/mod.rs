//! The vfio-user wire format: the message header, command numbers, and the limits every
//! message is checked against.
//!
//! Everything here is pure: bytes in, typed values out (and back). The socket layer
//! (the crate's socket module) and the framer ([`framing`]) deliver whole messages; [`request`]
//! parses a client's request; [`reply`] encodes the server's answers; [`version`] handles
//! the capability JSON of VERSION; [`structs`] lays out the fixed parts of messages.

use vm_memory::{ByteValued, Le16, Le32};

pub mod framing;
pub mod reply;
pub mod request;
pub mod structs;
pub mod version;

use structs::{read_struct, RegionAccess, WireHeader, WriteMulti, WriteMultiEntry};

/// Bytes in a message header.
pub const HEADER_SIZE: usize = size_of::<WireHeader>();

/// Header flag bits.
pub mod flags {
    /// Mask of the message type.
    pub const TYPE_MASK: u32 = 0xf;
    /// Type: a command (request).
    pub const TYPE_COMMAND: u32 = 0;
    /// Type: a reply.
    pub const TYPE_REPLY: u32 = 1;
    /// The sender wants no reply.
    pub const NO_REPLY: u32 = 1 << 4;
    /// The reply reports an error; `error` holds the errno.
    pub const ERROR: u32 = 1 << 5;
}

/// The 16-byte header every message starts with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Header {
    /// Chosen by the sender of a command, echoed in the reply.
    pub id: u16,
    /// Command number.
    pub command: u16,
    /// Whole message size, header included.
    pub size: u32,
    /// Type and flag bits.
    pub flags: u32,
    /// errno of an error reply.
    pub error: u32,
}

impl Header {
    /// Decodes a header from its 16 bytes.
    pub fn decode(bytes: &[u8; HEADER_SIZE]) -> Header {
        let h: WireHeader = read_struct(bytes).expect("the array is a whole header");
        Header {
            id: h.id.to_native(),
            command: h.command.to_native(),
            size: h.size.to_native(),
            flags: h.flags.to_native(),
            error: h.error.to_native(),
        }
    }

    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_SIZE] {
        let h = WireHeader {
            id: Le16::from(self.id),
            command: Le16::from(self.command),
            size: Le32::from(self.size),
            flags: Le32::from(self.flags),
            error: Le32::from(self.error),
        };
        let mut b = [0u8; HEADER_SIZE];
        b.copy_from_slice(h.as_slice());
        b
    }

    /// The message type bits.
    pub fn message_type(&self) -> u32 {
        self.flags & flags::TYPE_MASK
    }

    /// A command that asks for no reply.
    pub fn no_reply(&self) -> bool {
        self.flags & flags::NO_REPLY != 0
    }

    /// A reply that reports an error.
    pub fn is_error(&self) -> bool {
        self.flags & flags::ERROR != 0
    }

    /// Payload bytes (the size is validated by the framer before any payload is read).
    pub fn payload_len(&self) -> usize {
        (self.size as usize).saturating_sub(HEADER_SIZE)
    }
}

/// vfio-user command numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Command {
    /// Version and capability negotiation.
    Version = 1,
    /// Map guest memory (with or without an fd).
    DmaMap = 2,
    /// Unmap guest memory.
    DmaUnmap = 3,
    /// Device flags and counts.
    DeviceGetInfo = 4,
    /// One region's description.
    DeviceGetRegionInfo = 5,
    /// ioeventfds/ioregionfds of a region.
    DeviceGetRegionIoFds = 6,
    /// One IRQ index's description.
    DeviceGetIrqInfo = 7,
    /// Configure interrupts.
    DeviceSetIrqs = 8,
    /// Read a region.
    RegionRead = 9,
    /// Write a region.
    RegionWrite = 10,
    /// Server to client: read guest memory.
    DmaRead = 11,
    /// Server to client: write guest memory.
    DmaWrite = 12,
    /// Reset the device.
    DeviceReset = 13,
    /// Dirty page logging (migration v1, removed from the specification).
    DirtyPages = 14,
    /// Many small posted region writes in one message.
    RegionWriteMulti = 15,
    /// VFIO device features (migration v2).
    DeviceFeature = 16,
    /// Migration data out.
    MigDataRead = 17,
    /// Migration data in.
    MigDataWrite = 18,
}

impl Command {
    /// Every command, in number order.
    pub const ALL: [Command; 18] = [
        Command::Version,
        Command::DmaMap,
        Command::DmaUnmap,
        Command::DeviceGetInfo,
        Command::DeviceGetRegionInfo,
        Command::DeviceGetRegionIoFds,
        Command::DeviceGetIrqInfo,
        Command::DeviceSetIrqs,
        Command::RegionRead,
        Command::RegionWrite,
        Command::DmaRead,
        Command::DmaWrite,
        Command::DeviceReset,
        Command::DirtyPages,
        Command::RegionWriteMulti,
        Command::DeviceFeature,
        Command::MigDataRead,
        Command::MigDataWrite,
    ];

    /// The command with this number.
    pub fn from_u16(n: u16) -> Option<Command> {
        Self::ALL.get(usize::from(n).checked_sub(1)?).copied()
    }

    /// A short name for logs and statistics.
    pub fn name(self) -> &'static str {
        match self {
            Command::Version => "version",
            Command::DmaMap => "dma_map",
            Command::DmaUnmap => "dma_unmap",
            Command::DeviceGetInfo => "device_get_info",
            Command::DeviceGetRegionInfo => "device_get_region_info",
            Command::DeviceGetRegionIoFds => "device_get_region_io_fds",
            Command::DeviceGetIrqInfo => "device_get_irq_info",
            Command::DeviceSetIrqs => "device_set_irqs",
            Command::RegionRead => "region_read",
            Command::RegionWrite => "region_write",
            Command::DmaRead => "dma_read",
            Command::DmaWrite => "dma_write",
            Command::DeviceReset => "device_reset",
            Command::DirtyPages => "dirty_pages",
            Command::RegionWriteMulti => "region_write_multi",
            Command::DeviceFeature => "device_feature",
            Command::MigDataRead => "mig_data_read",
            Command::MigDataWrite => "mig_data_write",
        }
    }
}

/// The limits the server enforces, and advertises in VERSION where the protocol has a key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Most bytes of data in one REGION_READ/REGION_WRITE (advertised as
    /// `max_data_xfer_size`; default 1 MiB).
    pub max_data_xfer_size: u32,
    /// Most fds accepted with one message (advertised as `max_msg_fds`; default 16, the most
    /// QEMU accepts).
    pub max_msg_fds: u32,
    /// Most DMA mappings per client (advertised as `max_dma_maps`; default 4096). Every
    /// mapping is a VMA, and the kernel caps VMAs per process (`vm.max_map_count`, 65530 by
    /// default) across all instances: instances × this must stay below it.
    pub max_dma_maps: u32,
    /// Largest message accepted before VERSION is negotiated (default 16 KiB).
    pub max_version_size: u32,
    /// Most entries in one REGION_WRITE_MULTI (default 200, QEMU's maximum).
    pub max_write_multi: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_data_xfer_size: 1 << 20,
            max_msg_fds: 16,
            max_dma_maps: 4096,
            max_version_size: 16 << 10,
            max_write_multi: 200,
        }
    }
}

impl Limits {
    /// Largest message accepted after negotiation: a REGION_WRITE of `max_data_xfer_size`
    /// bytes, or a full REGION_WRITE_MULTI, whichever is larger.
    pub fn max_message_size(&self) -> u32 {
        let write = (HEADER_SIZE + size_of::<RegionAccess>()) as u32 + self.max_data_xfer_size;
        let multi = (HEADER_SIZE + size_of::<WriteMulti>()) as u32
            + size_of::<WriteMultiEntry>() as u32 * self.max_write_multi;
        write.max(multi).max(self.max_version_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips() {
        let h =
            Header { id: 0xbeef, command: 9, size: 32, flags: flags::TYPE_REPLY | flags::ERROR, error: 22 };
        assert_eq!(Header::decode(&h.encode()), h);
        assert_eq!(h.encode()[0..2], [0xef, 0xbe]);
        assert!(h.is_error());
        assert_eq!(h.message_type(), flags::TYPE_REPLY);
    }

    #[test]
    fn command_numbers() {
        assert_eq!(Command::from_u16(0), None);
        assert_eq!(Command::from_u16(1), Some(Command::Version));
        assert_eq!(Command::from_u16(15), Some(Command::RegionWriteMulti));
        assert_eq!(Command::from_u16(18), Some(Command::MigDataWrite));
        assert_eq!(Command::from_u16(19), None);
        for c in Command::ALL {
            assert_eq!(Command::from_u16(c as u16), Some(c));
        }
    }

    #[test]
    fn message_size_limit_covers_the_largest_message() {
        let l = Limits::default();
        assert_eq!(l.max_message_size(), 16 + 16 + (1 << 20));
    }
}
