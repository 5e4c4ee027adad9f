//! Parsing a client's request: a pure function from header, payload and fds to a typed
//! [`Request`], checking every size, count and flag against the wire format and the limits.
//!
//! Checks that need the device (region and IRQ indexes, bounds) or the session (was VERSION
//! negotiated) are the dispatcher's. A [`ParseError`] always leaves the stream in sync: the
//! framer has consumed the whole message, so the connection answers with the errno and goes on.

use crate::client_fd::ClientFd;
use std::mem::offset_of;

use smallvec::SmallVec;
use thiserror::Error;
use umdev_mdev::IrqAction;
use umdev_pinning::Prot;
use vm_memory::ByteValued;

use super::structs::{
    read_struct, DeviceInfo, DmaMap, DmaUnmap, IrqInfo, IrqSet, RegionAccess, RegionInfo, RegionIoFds,
    WriteMulti, WriteMultiEntry,
};
use super::version::{self, ClientCaps};
use super::{Command, Header, Limits};

pub use super::structs::MULTI_DATA_MAX;

/// A malformed request; the reply carries `errno`.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("{command}: {what} (errno {errno})")]
pub struct ParseError {
    /// The errno for the error reply.
    pub errno: i32,
    /// The command, by name (or number when unknown).
    pub command: String,
    /// What is wrong.
    pub what: String,
}

/// SET_IRQS data as it arrived: fds are vetted as eventfds by the dispatcher.
#[derive(Debug)]
pub enum WireIrqData {
    /// `DATA_NONE`.
    None,
    /// `DATA_BOOL`: one flag per vector.
    Bool(Vec<bool>),
    /// `DATA_EVENTFD`: `count` fds, or none to de-assign.
    Fds(Vec<ClientFd>),
}

/// One entry of REGION_WRITE_MULTI.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MultiWrite<'a> {
    /// Region index.
    pub region: u32,
    /// Offset within the region.
    pub offset: u64,
    /// The bytes (at most 8).
    pub data: &'a [u8],
}

/// A well-formed request.
#[derive(Debug)]
pub enum Request<'a> {
    /// VERSION.
    Version(ClientCaps),
    /// DMA_MAP; `fd` is `None` for a message-only region.
    DmaMap {
        /// IOVA.
        iova: u64,
        /// Size.
        size: u64,
        /// File offset.
        offset: u64,
        /// Access.
        prot: Prot,
        /// The backing fd.
        fd: Option<ClientFd>,
    },
    /// DMA_UNMAP; the fields are echoed in the reply.
    DmaUnmap {
        /// Client buffer size.
        argsz: u32,
        /// Flags (0 or UNMAP_ALL).
        flags: u32,
        /// IOVA.
        iova: u64,
        /// Size.
        size: u64,
    },
    /// DEVICE_GET_INFO.
    DeviceGetInfo,
    /// DEVICE_GET_REGION_INFO.
    RegionInfo {
        /// Region index.
        index: u32,
        /// Room the client has for the reply payload.
        argsz: u32,
    },
    /// DEVICE_GET_REGION_IO_FDS.
    RegionIoFds {
        /// Region index.
        index: u32,
    },
    /// DEVICE_GET_IRQ_INFO.
    IrqInfo {
        /// IRQ index.
        index: u32,
    },
    /// DEVICE_SET_IRQS.
    SetIrqs {
        /// IRQ index.
        index: u32,
        /// First vector.
        start: u32,
        /// Vectors.
        count: u32,
        /// Action.
        action: IrqAction,
        /// Data.
        data: WireIrqData,
    },
    /// REGION_READ.
    RegionRead {
        /// Region index.
        region: u32,
        /// Offset.
        offset: u64,
        /// Bytes.
        count: u32,
    },
    /// REGION_WRITE.
    RegionWrite {
        /// Region index.
        region: u32,
        /// Offset.
        offset: u64,
        /// Bytes.
        data: &'a [u8],
    },
    /// REGION_WRITE_MULTI.
    RegionWriteMulti(SmallVec<[MultiWrite<'a>; 4]>),
    /// DEVICE_RESET.
    DeviceReset,
}

/// `VFIO_DMA_UNMAP_FLAG_GET_DIRTY_BITMAP`.
pub const UNMAP_FLAG_DIRTY_BITMAP: u32 = 1 << 0;
/// `VFIO_DMA_UNMAP_FLAG_ALL`.
pub const UNMAP_FLAG_ALL: u32 = 1 << 1;
/// Entry size of REGION_WRITE_MULTI.
pub const MULTI_ENTRY_SIZE: usize = size_of::<WriteMultiEntry>();

/// The fixed part `T` at the start of `payload`, which must hold it. The error is the EINVAL
/// reason.
fn fixed<T: ByteValued + Default>(payload: &[u8]) -> Result<T, String> {
    read_struct(payload)
        .ok_or_else(|| format!("payload of {} bytes, expected at least {}", payload.len(), size_of::<T>()))
}

/// A query's fixed part, which starts with `argsz`, the size of the client's buffer.
trait Query: ByteValued + Default {
    fn argsz(&self) -> u32;
}

macro_rules! query {
    ($($t:ty),*) => {$(
        impl Query for $t {
            fn argsz(&self) -> u32 {
                self.argsz.to_native()
            }
        }
    )*};
}
query!(DmaMap, DmaUnmap, DeviceInfo, RegionInfo, RegionIoFds, IrqInfo);

/// Checks a query's `argsz` against its fixed part and the payload, and returns it.
///
/// The fixed part may be followed by the rest of the client's argsz-sized buffer:
/// libvfio-user's client sends the room it has for the reply (capabilities) along with the
/// request, and its server accepts that. The extra bytes are ignored; beyond argsz they would
/// be a different, malformed message.
fn within_argsz<T: Query>(fixed: &T, payload: &[u8]) -> Result<u32, String> {
    let (argsz, min) = (fixed.argsz(), size_of::<T>() as u32);
    if argsz < min {
        return Err(format!("argsz {argsz} below {min}"));
    }
    if payload.len() > argsz as usize {
        return Err(format!("payload of {} bytes, longer than its argsz {argsz}", payload.len()));
    }
    Ok(argsz)
}

/// A query's fixed part, its `argsz` checked ([`within_argsz`]).
fn query<T: Query>(payload: &[u8]) -> Result<(T, u32), String> {
    let f = fixed::<T>(payload)?;
    let argsz = within_argsz(&f, payload)?;
    Ok((f, argsz))
}

/// Parses one request. `fds` came with the message; they are consumed (closed on error).
pub fn parse<'a>(
    header: &Header,
    payload: &'a [u8],
    fds: Vec<ClientFd>,
    limits: &Limits,
) -> Result<Request<'a>, ParseError> {
    // Named only on failure: a request that parses allocates nothing here.
    let name = || match Command::from_u16(header.command) {
        Some(c) => c.name().to_string(),
        None => format!("command {}", header.command),
    };
    let fail = |errno: i32, what: String| ParseError { errno, command: name(), what };
    let einval = |what: &str| fail(libc::EINVAL, what.to_string());
    let invalid = |what: String| fail(libc::EINVAL, what);
    let Some(command) = Command::from_u16(header.command) else {
        return Err(fail(libc::ENOSYS, "unknown command".into()));
    };
    // DMA_UNMAP may come with the fd of the mapping it removes (SPDK's client attaches it);
    // like libvfio-user, the server does not use it and closes it.
    let takes_fds = matches!(command, Command::DmaMap | Command::DmaUnmap | Command::DeviceSetIrqs);
    if !takes_fds && !fds.is_empty() {
        return Err(einval(&format!("{} unexpected fds", fds.len())));
    }
    if fds.len() > limits.max_msg_fds as usize {
        return Err(einval(&format!("{} fds, more than the {} allowed", fds.len(), limits.max_msg_fds)));
    }
    let exact = |len: usize| {
        if payload.len() == len {
            Ok(())
        } else {
            Err(einval(&format!("payload of {} bytes, expected {len}", payload.len())))
        }
    };
    match command {
        Command::Version => version::parse_client(payload, header.size as usize)
            .map(Request::Version)
            .map_err(|e| fail(e.errno(), e.to_string())),
        Command::DmaMap => {
            let (f, _) = query::<DmaMap>(payload).map_err(invalid)?;
            let flags = f.flags.to_native();
            if flags & !Prot::READ_WRITE.bits() != 0 {
                return Err(einval(&format!("unknown flags {flags:#x}")));
            }
            if fds.len() > 1 {
                return Err(einval(&format!("{} fds for one mapping", fds.len())));
            }
            Ok(Request::DmaMap {
                offset: f.offset.to_native(),
                iova: f.addr.to_native(),
                size: f.size.to_native(),
                prot: Prot::from_bits_truncate(flags),
                fd: fds.into_iter().next(),
            })
        }
        Command::DmaUnmap => {
            let f = fixed::<DmaUnmap>(payload).map_err(invalid)?;
            let flags = f.flags.to_native();
            if flags & !(UNMAP_FLAG_DIRTY_BITMAP | UNMAP_FLAG_ALL) != 0 {
                return Err(einval(&format!("unknown flags {flags:#x}")));
            }
            if flags & UNMAP_FLAG_DIRTY_BITMAP != 0 {
                return Err(fail(libc::ENOTSUP, "dirty page tracking is not supported".into()));
            }
            let argsz = within_argsz(&f, payload).map_err(invalid)?;
            let (iova, size) = (f.addr.to_native(), f.size.to_native());
            if flags & UNMAP_FLAG_ALL != 0 && (iova != 0 || size != 0) {
                return Err(einval("UNMAP_ALL with an address or size"));
            }
            if !fds.is_empty() {
                log::debug!("dma_unmap: closing {} fd(s) that came with it", fds.len());
            }
            drop(fds);
            Ok(Request::DmaUnmap { argsz, flags, iova, size })
        }
        Command::DeviceGetInfo => {
            query::<DeviceInfo>(payload).map_err(invalid)?;
            Ok(Request::DeviceGetInfo)
        }
        Command::DeviceGetRegionInfo => {
            let (f, argsz) = query::<RegionInfo>(payload).map_err(invalid)?;
            Ok(Request::RegionInfo { index: f.index.to_native(), argsz })
        }
        Command::DeviceGetRegionIoFds => {
            let (f, _) = query::<RegionIoFds>(payload).map_err(invalid)?;
            if f.flags.to_native() != 0 || f.count.to_native() != 0 {
                return Err(einval("flags and count must be 0"));
            }
            Ok(Request::RegionIoFds { index: f.index.to_native() })
        }
        Command::DeviceGetIrqInfo => {
            let (f, _) = query::<IrqInfo>(payload).map_err(invalid)?;
            Ok(Request::IrqInfo { index: f.index.to_native() })
        }
        Command::DeviceSetIrqs => parse_set_irqs(payload, fds, &fail),
        Command::RegionRead => {
            // No argsz here; bytes past the fixed part are ignored, as libvfio-user does.
            let f = fixed::<RegionAccess>(payload).map_err(invalid)?;
            let count = f.count.to_native();
            if count > limits.max_data_xfer_size {
                return Err(fail(libc::E2BIG, format!("{count} bytes, more than max_data_xfer_size")));
            }
            Ok(Request::RegionRead { offset: f.offset.to_native(), region: f.region.to_native(), count })
        }
        Command::RegionWrite => {
            let f = fixed::<RegionAccess>(payload).map_err(invalid)?;
            let count = f.count.to_native();
            if count > limits.max_data_xfer_size {
                return Err(fail(libc::E2BIG, format!("{count} bytes, more than max_data_xfer_size")));
            }
            let data = &payload[size_of::<RegionAccess>()..];
            if data.len() != count as usize {
                return Err(einval(&format!("count {count} but {} data bytes", data.len())));
            }
            Ok(Request::RegionWrite { offset: f.offset.to_native(), region: f.region.to_native(), data })
        }
        Command::RegionWriteMulti => {
            let n = fixed::<WriteMulti>(payload).map_err(invalid)?.count.to_native();
            if n == 0 || n > u64::from(limits.max_write_multi) {
                return Err(fail(
                    libc::E2BIG,
                    format!("{n} writes; 1 to {} allowed", limits.max_write_multi),
                ));
            }
            let n = n as usize;
            exact(size_of::<WriteMulti>() + n * MULTI_ENTRY_SIZE)?;
            // On the stack for short batches; a longer one allocates once.
            let mut writes = SmallVec::with_capacity(n);
            for entry in payload[size_of::<WriteMulti>()..].chunks_exact(MULTI_ENTRY_SIZE) {
                let e: WriteMultiEntry = read_struct(entry).expect("chunks of the entry size");
                let count = e.count.to_native() as usize;
                if count > MULTI_DATA_MAX {
                    return Err(einval(&format!("entry of {count} bytes, at most {MULTI_DATA_MAX}")));
                }
                // The data borrowed from the payload, not from the copy `e`.
                let data = &entry[offset_of!(WriteMultiEntry, data)..][..count];
                writes.push(MultiWrite { offset: e.offset.to_native(), region: e.region.to_native(), data });
            }
            Ok(Request::RegionWriteMulti(writes))
        }
        Command::DeviceReset => {
            exact(0)?;
            Ok(Request::DeviceReset)
        }
        Command::DmaRead | Command::DmaWrite => Err(einval("a server-to-client command sent to the server")),
        Command::DeviceFeature => Err(fail(libc::ENOTTY, "no device features are supported".into())),
        Command::DirtyPages | Command::MigDataRead | Command::MigDataWrite => {
            Err(fail(libc::ENOTSUP, "migration is not supported".into()))
        }
    }
}

/// `VFIO_IRQ_SET_DATA_*` and `VFIO_IRQ_SET_ACTION_*`.
mod irq_flags {
    pub const DATA_NONE: u32 = 1 << 0;
    pub const DATA_BOOL: u32 = 1 << 1;
    pub const DATA_EVENTFD: u32 = 1 << 2;
    pub const ACTION_MASK: u32 = 1 << 3;
    pub const ACTION_UNMASK: u32 = 1 << 4;
    pub const ACTION_TRIGGER: u32 = 1 << 5;
}

fn parse_set_irqs<'a>(
    payload: &[u8],
    fds: Vec<ClientFd>,
    fail: &dyn Fn(i32, String) -> ParseError,
) -> Result<Request<'a>, ParseError> {
    use irq_flags::*;
    let einval = |what: String| fail(libc::EINVAL, what);
    let f = fixed::<IrqSet>(payload).map_err(einval)?;
    let [argsz, flags, index, start, count] =
        [f.argsz, f.flags, f.index, f.start, f.count].map(|v| v.to_native());
    let min = size_of::<IrqSet>() as u32;
    if argsz < min {
        return Err(einval(format!("argsz {argsz} below {min}")));
    }
    if flags & !0x3f != 0 {
        return Err(einval(format!("unknown flags {flags:#x}")));
    }
    let action = match flags & (ACTION_MASK | ACTION_UNMASK | ACTION_TRIGGER) {
        ACTION_MASK => IrqAction::Mask,
        ACTION_UNMASK => IrqAction::Unmask,
        ACTION_TRIGGER => IrqAction::Trigger,
        _ => return Err(einval(format!("flags {flags:#x} must name exactly one action"))),
    };
    // Bytes past the fixed part carry data only for DATA_BOOL; otherwise they are the rest of
    // the client's buffer and are ignored (QEMU sends its whole argsz-sized `vfio_irq_set` for
    // DATA_NONE). Here argsz sizes the request, and clients disagree on whether it counts
    // the data, so, like libvfio-user's server, only its minimum is checked.
    let data_bytes = &payload[size_of::<IrqSet>()..];
    let data = match flags & (DATA_NONE | DATA_BOOL | DATA_EVENTFD) {
        DATA_NONE | DATA_BOOL if !fds.is_empty() => {
            return Err(einval(format!("{} fds without DATA_EVENTFD", fds.len())))
        }
        DATA_NONE => WireIrqData::None,
        DATA_BOOL if data_bytes.len() == count as usize => {
            WireIrqData::Bool(data_bytes.iter().map(|&b| b != 0).collect())
        }
        DATA_BOOL => return Err(einval(format!("{} bools for count {count}", data_bytes.len()))),
        DATA_EVENTFD if fds.is_empty() || fds.len() == count as usize => WireIrqData::Fds(fds),
        DATA_EVENTFD => return Err(einval(format!("{} fds for count {count}", fds.len()))),
        _ => return Err(einval(format!("flags {flags:#x} must name exactly one data type"))),
    };
    Ok(Request::SetIrqs { index, start, count, action, data })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::wire::framing::Framer;
    use crate::wire::{flags, HEADER_SIZE};

    fn header(command: u16, payload: &[u8]) -> Header {
        Header {
            id: 1,
            command,
            size: (HEADER_SIZE + payload.len()) as u32,
            flags: flags::TYPE_COMMAND,
            error: 0,
        }
    }

    fn errno_of(command: Command, payload: &[u8]) -> i32 {
        let h = header(command as u16, payload);
        parse(&h, payload, Vec::new(), &Limits::default()).map(|_| 0).unwrap_or_else(|e| e.errno)
    }

    fn set_irqs(flags: u32, count: u32, data: &[u8]) -> Vec<u8> {
        [
            &20u32.to_le_bytes()[..],
            &flags.to_le_bytes(),
            &0u32.to_le_bytes(),
            &0u32.to_le_bytes(),
            &count.to_le_bytes(),
            data,
        ]
        .concat()
    }

    #[test]
    fn a_dma_unmap_with_the_mappings_fd_is_served_and_the_fd_closed() {
        let mut unmap = [0u8; 24];
        unmap[0..4].copy_from_slice(&24u32.to_le_bytes());
        unmap[8..16].copy_from_slice(&0x1000u64.to_le_bytes());
        unmap[16..24].copy_from_slice(&0x1000u64.to_le_bytes());
        let (r, w) = nix::unistd::pipe().unwrap();
        let h = header(Command::DmaUnmap as u16, &unmap);
        let parsed = parse(&h, &unmap, vec![w.into()], &Limits::default()).unwrap();
        assert!(matches!(parsed, Request::DmaUnmap { iova: 0x1000, size: 0x1000, .. }));
        // The write end is closed: the read end sees end of file.
        let mut buf = [0u8; 1];
        assert_eq!(nix::unistd::read(&r, &mut buf).unwrap(), 0);
        // Other commands without fds in their ABI still refuse them.
        let (_r, w) = nix::unistd::pipe().unwrap();
        let info = [16u8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        let h = header(Command::DeviceGetInfo as u16, &info);
        assert_eq!(
            parse(&h, &info, vec![w.into()], &Limits::default()).map(|_| 0).unwrap_or_else(|e| e.errno),
            libc::EINVAL
        );
    }

    #[test]
    fn sizes_flags_and_counts_are_checked() {
        assert_eq!(errno_of(Command::DmaMap, &[0; 31]), libc::EINVAL);
        let mut map = [0u8; 32];
        map[0..4].copy_from_slice(&32u32.to_le_bytes());
        map[4..8].copy_from_slice(&4u32.to_le_bytes());
        assert_eq!(errno_of(Command::DmaMap, &map), libc::EINVAL, "VADDR flag");
        let mut unmap = [0u8; 24];
        unmap[0..4].copy_from_slice(&24u32.to_le_bytes());
        unmap[4..8].copy_from_slice(&1u32.to_le_bytes());
        assert_eq!(errno_of(Command::DmaUnmap, &unmap), libc::ENOTSUP, "dirty bitmap");
        unmap[4..8].copy_from_slice(&2u32.to_le_bytes());
        unmap[8] = 1;
        assert_eq!(errno_of(Command::DmaUnmap, &unmap), libc::EINVAL, "ALL with an address");
        unmap[0..4].copy_from_slice(&8u32.to_le_bytes());
        assert_eq!(errno_of(Command::DmaUnmap, &unmap), libc::EINVAL, "argsz");
        let mut read = [0u8; 16];
        read[12..16].copy_from_slice(&((1u32 << 20) + 1).to_le_bytes());
        assert_eq!(errno_of(Command::RegionRead, &read), libc::E2BIG);
        let mut write = vec![0u8; 20];
        write[12..16].copy_from_slice(&5u32.to_le_bytes());
        assert_eq!(errno_of(Command::RegionWrite, &write), libc::EINVAL, "count vs data");
        // REGION_WRITE_MULTI: 1 to 200 writes of 24-byte entries (offset, region, count, 8
        // data bytes).
        let multi = |n: u64| {
            let mut p = n.to_le_bytes().to_vec();
            for _ in 0..n {
                p.extend_from_slice(
                    &[&0u64.to_le_bytes()[..], &0u32.to_le_bytes(), &4u32.to_le_bytes(), &[0; 8]].concat(),
                );
            }
            p
        };
        assert_eq!(errno_of(Command::RegionWriteMulti, &multi(0)), libc::E2BIG, "no writes");
        assert_eq!(errno_of(Command::RegionWriteMulti, &multi(201)), libc::E2BIG, "201 writes");
        assert_eq!(errno_of(Command::RegionWriteMulti, &multi(200)), 0, "200 writes");
        assert_eq!(
            errno_of(Command::DeviceSetIrqs, &set_irqs(0x21 | 0x08, 0, &[])),
            libc::EINVAL,
            "two actions"
        );
        assert_eq!(errno_of(Command::DeviceSetIrqs, &set_irqs(0x23, 0, &[])), libc::EINVAL, "two data types");
        assert_eq!(errno_of(Command::DeviceSetIrqs, &set_irqs(0x22, 2, &[1])), libc::EINVAL, "bools");
        assert_eq!(errno_of(Command::DeviceSetIrqs, &set_irqs(0x22, 2, &[1, 0])), 0);
        assert_eq!(
            errno_of(Command::DeviceSetIrqs, &set_irqs(0x21, 0, &[1, 2, 3, 4])),
            0,
            "NONE, bytes ignored"
        );
        assert_eq!(
            errno_of(Command::DeviceGetInfo, &[16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]),
            libc::EINVAL,
            "past argsz"
        );
        let mut info = [0u8; 24];
        info[0] = 24;
        assert_eq!(errno_of(Command::DeviceGetInfo, &info), 0, "room up to argsz");
        assert_eq!(errno_of(Command::DeviceReset, &[0]), libc::EINVAL);
        assert_eq!(errno_of(Command::DeviceFeature, &[0; 8]), libc::ENOTTY);
        assert_eq!(errno_of(Command::MigDataRead, &[0; 8]), libc::ENOTSUP);
        let h = header(99, &[]);
        assert_eq!(parse(&h, &[], Vec::new(), &Limits::default()).unwrap_err().errno, libc::ENOSYS);
    }

    #[test]
    fn fds_where_none_belong_are_refused_and_closed() {
        let (r, w) = nix::unistd::pipe().unwrap();
        let h = header(Command::DeviceGetInfo as u16, &[16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        let payload = [16u8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        let err = parse(&h, &payload, vec![w.into()], &Limits::default()).unwrap_err();
        assert_eq!(err.errno, libc::EINVAL);
        // The write end was closed by the refusal: reading the pipe sees end-of-file.
        let mut b = [0u8; 1];
        assert_eq!(nix::unistd::read(&r, &mut b).unwrap(), 0);
    }

    proptest! {
        #[test]
        fn any_payload_parses_or_fails_cleanly(command in 0u16..24, payload in prop::collection::vec(any::<u8>(), 0..200)) {
            let h = header(command, &payload);
            let _ = parse(&h, &payload, Vec::new(), &Limits::default());
        }

        #[test]
        fn any_stream_frames_without_panic_or_unbounded_growth(
            chunks in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..300), 0..20),
        ) {
            let mut f = Framer::new(4096, 16);
            for chunk in chunks {
                f.push(&chunk, Vec::new());
                while let Ok(Some(frame)) = f.next_frame() {
                    let payload = f.payload(&frame).to_vec();
                    let _ = parse(&frame.header, &payload, Vec::new(), &Limits::default());
                }
                prop_assert!(f.buffered() <= 4096 + 300 * 20);
            }
        }
    }
}
