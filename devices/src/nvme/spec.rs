//! The NVMe structures and numbers the controller implements (NVM Express Base
//! Specification 1.3, "§" below), as `#[repr(C)]` types laid out exactly as in guest memory.
//!
//! Every structure is plain little-endian data with its size asserted (and, for the big
//! ones, the offsets a driver relies on): read and written whole with `read_obj`/`write_obj`,
//! never by offset arithmetic in the device.

use vm_memory::{ByteValued, Le16, Le32, Le64};

/// PCI vendor ID (QEMU's test range: not one the Linux driver keeps quirks for), also
/// Identify's VID and SSVID.
pub const VENDOR_ID: u16 = 0x1234;
/// PCI device ID.
pub const DEVICE_ID: u16 = 0x75e0;

/// Bytes of a memory page (CC.MPS = 0: the only page size the controller supports).
pub const PAGE: u64 = 4096;
/// Bytes of a submission queue entry (CC.IOSQES = 6).
pub const SQE_SIZE: u64 = 64;
/// Bytes of a completion queue entry (CC.IOCQES = 4).
pub const CQE_SIZE: u64 = 16;

macro_rules! plain_data {
    ($($t:ty = $size:expr),* $(,)?) => {$(
        const _: () = assert!(size_of::<$t>() == $size);
        // SAFETY: plain old data: little-endian integers and byte arrays only, no padding
        // (the size is the sum of the field sizes, asserted above), and every bit pattern
        // is a valid value.
        unsafe impl ByteValued for $t {}
    )*};
}

/// Controller registers (BAR0 offsets, §3.1).
pub mod reg {
    /// Controller Capabilities (64-bit, RO).
    pub const CAP: u64 = 0x00;
    /// Version (RO).
    pub const VS: u64 = 0x08;
    /// Interrupt Mask Set (RW1S).
    pub const INTMS: u64 = 0x0c;
    /// Interrupt Mask Clear (RW1C).
    pub const INTMC: u64 = 0x10;
    /// Controller Configuration.
    pub const CC: u64 = 0x14;
    /// Controller Status (RO).
    pub const CSTS: u64 = 0x1c;
    /// NVM Subsystem Reset (not supported: reads 0, writes ignored).
    pub const NSSR: u64 = 0x20;
    /// Admin Queue Attributes.
    pub const AQA: u64 = 0x24;
    /// Admin Submission Queue base address (64-bit).
    pub const ASQ: u64 = 0x28;
    /// Admin Completion Queue base address (64-bit).
    pub const ACQ: u64 = 0x30;
    /// Controller Memory Buffer location (none: 0).
    pub const CMBLOC: u64 = 0x38;
    /// Controller Memory Buffer size (none: 0).
    pub const CMBSZ: u64 = 0x3c;
    /// The first doorbell (SQ 0 tail); queue y's SQ tail is at `DOORBELLS + 8y`, its CQ
    /// head at `DOORBELLS + 8y + 4` (CAP.DSTRD = 0).
    pub const DOORBELLS: u64 = 0x1000;

    /// The version the controller claims: 1.3.0.
    pub const VERSION_1_3: u32 = 0x0001_0300;

    /// CC.EN.
    pub const CC_EN: u32 = 1 << 0;
    /// CC.SHN, shift and mask (01b normal, 10b abrupt shutdown notification).
    pub const CC_SHN_SHIFT: u32 = 14;
    /// CSTS.RDY.
    pub const CSTS_RDY: u32 = 1 << 0;
    /// CSTS.CFS (controller fatal status).
    pub const CSTS_CFS: u32 = 1 << 1;
    /// CSTS.SHST shift (00b normal, 01b shutdown occurring, 10b shutdown complete).
    pub const CSTS_SHST_SHIFT: u32 = 2;
    /// CSTS.SHST = 10b.
    pub const CSTS_SHST_COMPLETE: u32 = 2 << CSTS_SHST_SHIFT;
}

/// Admin command opcodes (§5).
pub mod admin_op {
    /// Delete I/O Submission Queue.
    pub const DELETE_SQ: u8 = 0x00;
    /// Create I/O Submission Queue.
    pub const CREATE_SQ: u8 = 0x01;
    /// Get Log Page.
    pub const GET_LOG_PAGE: u8 = 0x02;
    /// Delete I/O Completion Queue.
    pub const DELETE_CQ: u8 = 0x04;
    /// Create I/O Completion Queue.
    pub const CREATE_CQ: u8 = 0x05;
    /// Identify.
    pub const IDENTIFY: u8 = 0x06;
    /// Abort.
    pub const ABORT: u8 = 0x08;
    /// Set Features.
    pub const SET_FEATURES: u8 = 0x09;
    /// Get Features.
    pub const GET_FEATURES: u8 = 0x0a;
    /// Asynchronous Event Request.
    pub const ASYNC_EVENT: u8 = 0x0c;
    /// Doorbell Buffer Config.
    pub const DOORBELL_BUFFER_CONFIG: u8 = 0x7c;
}

/// NVM command set opcodes (§6).
pub mod nvm_op {
    /// Flush.
    pub const FLUSH: u8 = 0x00;
    /// Write.
    pub const WRITE: u8 = 0x01;
    /// Read.
    pub const READ: u8 = 0x02;
    /// Compare.
    pub const COMPARE: u8 = 0x05;
    /// Write Zeroes.
    pub const WRITE_ZEROES: u8 = 0x08;
    /// Dataset Management.
    pub const DSM: u8 = 0x09;
}

/// Identify CNS values (§5.15).
pub mod cns {
    /// The namespace data structure of NSID.
    pub const NAMESPACE: u8 = 0x00;
    /// The controller data structure.
    pub const CONTROLLER: u8 = 0x01;
    /// Active namespace IDs above NSID.
    pub const ACTIVE_NAMESPACES: u8 = 0x02;
    /// Namespace identification descriptors of NSID.
    pub const NS_DESCRIPTORS: u8 = 0x03;
}

/// Feature identifiers (§5.21.1).
pub mod feature {
    /// Arbitration.
    pub const ARBITRATION: u8 = 0x01;
    /// Power Management.
    pub const POWER_MANAGEMENT: u8 = 0x02;
    /// Temperature Threshold.
    pub const TEMPERATURE_THRESHOLD: u8 = 0x04;
    /// Error Recovery.
    pub const ERROR_RECOVERY: u8 = 0x05;
    /// Volatile Write Cache.
    pub const VOLATILE_WRITE_CACHE: u8 = 0x06;
    /// Number of Queues.
    pub const NUMBER_OF_QUEUES: u8 = 0x07;
    /// Interrupt Coalescing.
    pub const INTERRUPT_COALESCING: u8 = 0x08;
    /// Interrupt Vector Configuration.
    pub const INTERRUPT_VECTOR_CONFIG: u8 = 0x09;
    /// Write Atomicity Normal.
    pub const WRITE_ATOMICITY: u8 = 0x0a;
    /// Asynchronous Event Configuration.
    pub const ASYNC_EVENT_CONFIG: u8 = 0x0b;
}

/// Log page identifiers (§5.14.1).
pub mod log_page {
    /// Error Information.
    pub const ERROR: u8 = 0x01;
    /// SMART / Health Information.
    pub const SMART: u8 = 0x02;
    /// Firmware Slot Information.
    pub const FIRMWARE_SLOT: u8 = 0x03;
    /// Commands Supported and Effects.
    pub const COMMAND_EFFECTS: u8 = 0x05;
}

/// Commands Supported and Effects data structure bits (§5.14.1.5): one dword per opcode.
pub mod effects {
    /// CSUPP: the command is supported.
    pub const CSUPP: u32 = 1 << 0;
    /// LBCC: the command may change logical block content.
    pub const LBCC: u32 = 1 << 1;
}

/// Asynchronous event types and information (§5.2.1: completion dword 0 of an Asynchronous
/// Event Request: type in bits 2:0, information in 15:8, the log page to read in 23:16).
pub mod event {
    /// Error status.
    pub const TYPE_ERROR: u32 = 0;
    /// SMART / health status.
    pub const TYPE_SMART: u32 = 1;
    /// Error: write to an invalid doorbell register.
    pub const INVALID_DOORBELL_REGISTER: u32 = 0x00;
    /// Error: invalid doorbell write value.
    pub const INVALID_DOORBELL_VALUE: u32 = 0x01;
    /// SMART: temperature above an over or below an under temperature threshold.
    pub const TEMPERATURE_THRESHOLD: u32 = 0x01;
}

/// A completion status: status code type and status code (§4.6.1, the 15-bit status field
/// of a completion entry, without the phase tag, DNR included).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Status(pub u16);

impl Status {
    const fn generic(sc: u8) -> Status {
        Status(sc as u16)
    }
    const fn specific(sc: u8) -> Status {
        Status(1 << 8 | sc as u16)
    }
    /// Successful completion.
    pub const SUCCESS: Status = Status(0);
    /// Invalid Command Opcode.
    pub const INVALID_OPCODE: Status = Status::generic(0x01);
    /// Invalid Field in Command.
    pub const INVALID_FIELD: Status = Status::generic(0x02);
    /// Data Transfer Error.
    pub const DATA_TRANSFER_ERROR: Status = Status::generic(0x04);
    /// Internal Error (the controller failed inside).
    pub const INTERNAL_ERROR: Status = Status::generic(0x06);
    /// Command Abort Requested.
    pub const ABORT_REQUESTED: Status = Status::generic(0x07);
    /// Command Aborted due to SQ Deletion.
    pub const ABORTED_SQ_DELETION: Status = Status::generic(0x08);
    /// Invalid Namespace or Format.
    pub const INVALID_NAMESPACE: Status = Status::generic(0x0b);
    /// Command Sequence Error.
    pub const COMMAND_SEQUENCE_ERROR: Status = Status::generic(0x0c);
    /// PRP Offset Invalid.
    pub const PRP_OFFSET_INVALID: Status = Status::generic(0x13);
    /// LBA Out of Range.
    pub const LBA_OUT_OF_RANGE: Status = Status::generic(0x80);
    /// Capacity Exceeded (the backing store is out of space: a sparse file on a full
    /// filesystem).
    pub const CAPACITY_EXCEEDED: Status = Status::generic(0x81);
    /// Namespace Not Ready: not accessible now; a retry may succeed (DNR clear).
    pub const NAMESPACE_NOT_READY: Status = Status::generic(0x82);
    /// Completion Queue Invalid.
    pub const CQ_INVALID: Status = Status::specific(0x00);
    /// Invalid Queue Identifier.
    pub const INVALID_QUEUE_ID: Status = Status::specific(0x01);
    /// Invalid Queue Size.
    pub const INVALID_QUEUE_SIZE: Status = Status::specific(0x02);
    /// Abort Command Limit Exceeded.
    pub const ABORT_LIMIT: Status = Status::specific(0x03);
    /// Asynchronous Event Request Limit Exceeded.
    pub const AER_LIMIT: Status = Status::specific(0x05);
    /// Invalid Interrupt Vector.
    pub const INVALID_VECTOR: Status = Status::specific(0x08);
    /// Invalid Log Page.
    pub const INVALID_LOG_PAGE: Status = Status::specific(0x09);
    /// Invalid Queue Deletion.
    pub const INVALID_QUEUE_DELETION: Status = Status::specific(0x0c);
    /// Feature Identifier Not Saveable.
    pub const FEATURE_NOT_SAVEABLE: Status = Status::specific(0x0d);
    /// Unrecovered Read Error (a media error: the backing store failed).
    pub const UNRECOVERED_READ_ERROR: Status = Status(2 << 8 | 0x81);
    /// Write Fault (a media error: the backing store failed).
    pub const WRITE_FAULT: Status = Status(2 << 8 | 0x80);
    /// Compare Failure (the data differ, §6.1).
    pub const COMPARE_FAILURE: Status = Status(2 << 8 | 0x85);

    /// The status with Do Not Retry set (the command would fail again).
    pub const fn dnr(self) -> Status {
        Status(self.0 | 1 << 14)
    }

    /// Whether the command succeeded.
    pub fn ok(self) -> bool {
        self.0 & 0x3ff == 0
    }

    /// Status code type (bits 10:8 of the status field).
    pub fn sct(self) -> u8 {
        ((self.0 >> 8) & 7) as u8
    }

    /// Status code.
    pub fn sc(self) -> u8 {
        self.0 as u8
    }
}

impl std::fmt::Display for Status {
    /// `status SCT/SC` in hex, and `DNR` when set: `status 0/02h DNR`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "status {}/{:02x}h", self.sct(), self.sc())?;
        if self.0 & 1 << 14 != 0 {
            f.write_str(" DNR")?;
        }
        Ok(())
    }
}

/// A submission queue entry (§4.2).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sqe {
    /// Opcode (7:0), fused operation (9:8), PRP or SGL (15:14), command identifier (31:16).
    pub cdw0: Le32,
    /// Namespace identifier.
    pub nsid: Le32,
    /// Command dword 2.
    pub cdw2: Le32,
    /// Command dword 3.
    pub cdw3: Le32,
    /// Metadata pointer.
    pub mptr: Le64,
    /// PRP entry 1.
    pub prp1: Le64,
    /// PRP entry 2 (or a PRP list pointer).
    pub prp2: Le64,
    /// Command dwords 10 to 15.
    pub cdw: [Le32; 6],
}

impl Sqe {
    /// The opcode.
    pub fn opcode(&self) -> u8 {
        u32::from(self.cdw0) as u8
    }
    /// The command identifier.
    pub fn cid(&self) -> u16 {
        (u32::from(self.cdw0) >> 16) as u16
    }
    /// PSDT: 0 for PRPs.
    pub fn psdt(&self) -> u8 {
        ((u32::from(self.cdw0) >> 14) & 3) as u8
    }
    /// FUSE: 0 for a normal command.
    pub fn fuse(&self) -> u8 {
        ((u32::from(self.cdw0) >> 8) & 3) as u8
    }
    /// Command dword `n` (10 to 15).
    pub fn dw(&self, n: usize) -> u32 {
        self.cdw[n - 10].into()
    }
    /// A command with `opcode` and `cid`, the rest zero (for drivers and tests).
    pub fn new(opcode: u8, cid: u16) -> Sqe {
        Sqe { cdw0: (u32::from(opcode) | u32::from(cid) << 16).into(), ..Sqe::default() }
    }
    /// Sets command dword `n` (10 to 15).
    pub fn set_dw(&mut self, n: usize, value: u32) {
        self.cdw[n - 10] = value.into();
    }
}

/// A completion queue entry (§4.6).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cqe {
    /// Command specific result.
    pub dw0: Le32,
    /// Reserved.
    pub dw1: Le32,
    /// Submission queue head pointer.
    pub sqhd: Le16,
    /// Submission queue identifier.
    pub sqid: Le16,
    /// Command identifier.
    pub cid: Le16,
    /// Phase tag (bit 0) and status field (15:1).
    pub status: Le16,
}

impl Cqe {
    /// The phase tag.
    pub fn phase(&self) -> bool {
        u16::from(self.status) & 1 != 0
    }
    /// The status field.
    pub fn status(&self) -> Status {
        Status(u16::from(self.status) >> 1)
    }
}

/// A power state descriptor (§5.15).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(missing_docs)] // fields named as in the specification
pub struct PowerState {
    /// Maximum power, in centiwatts.
    pub mp: Le16,
    /// Reserved.
    pub rsvd2: u8,
    /// Max power scale (bit 0), non-operational state (bit 1).
    pub flags: u8,
    /// Entry latency, microseconds.
    pub enlat: Le32,
    /// Exit latency, microseconds.
    pub exlat: Le32,
    /// Relative read throughput.
    pub rrt: u8,
    /// Relative read latency.
    pub rrl: u8,
    /// Relative write throughput.
    pub rwt: u8,
    /// Relative write latency.
    pub rwl: u8,
    /// Idle power.
    pub idlp: Le16,
    /// Idle power scale.
    pub ips: u8,
    /// Reserved.
    pub rsvd19: u8,
    /// Active power.
    pub actp: Le16,
    /// Active power workload and scale.
    pub apw_aps: u8,
    /// Reserved.
    pub rsvd23: [u8; 9],
}

/// The Identify Controller data structure (CNS 01h; §5.15).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[allow(missing_docs)] // fields named as in the specification
pub struct IdentifyController {
    pub vid: Le16,
    pub ssvid: Le16,
    pub sn: [u8; 20],
    pub mn: [u8; 40],
    pub fr: [u8; 8],
    pub rab: u8,
    pub ieee: [u8; 3],
    pub cmic: u8,
    pub mdts: u8,
    pub cntlid: Le16,
    pub ver: Le32,
    pub rtd3r: Le32,
    pub rtd3e: Le32,
    pub oaes: Le32,
    pub ctratt: Le32,
    pub rsvd100: [u8; 156],
    pub oacs: Le16,
    pub acl: u8,
    pub aerl: u8,
    pub frmw: u8,
    pub lpa: u8,
    pub elpe: u8,
    pub npss: u8,
    pub avscc: u8,
    pub apsta: u8,
    pub wctemp: Le16,
    pub cctemp: Le16,
    pub mtfa: Le16,
    pub hmpre: Le32,
    pub hmmin: Le32,
    pub tnvmcap: [u8; 16],
    pub unvmcap: [u8; 16],
    pub rpmbs: Le32,
    pub edstt: Le16,
    pub dsto: u8,
    pub fwug: u8,
    pub kas: Le16,
    pub hctma: Le16,
    pub mntmt: Le16,
    pub mxtmt: Le16,
    pub sanicap: Le32,
    pub rsvd332: [u8; 180],
    pub sqes: u8,
    pub cqes: u8,
    pub maxcmd: Le16,
    pub nn: Le32,
    pub oncs: Le16,
    pub fuses: Le16,
    pub fna: u8,
    pub vwc: u8,
    pub awun: Le16,
    pub awupf: Le16,
    pub nvscc: u8,
    pub rsvd531: u8,
    pub acwu: Le16,
    pub rsvd534: Le16,
    pub sgls: Le32,
    pub rsvd540: [u8; 228],
    pub subnqn: [u8; 256],
    pub rsvd1024: [u8; 1024],
    pub psd: [PowerState; 32],
    pub vendor: [u8; 1024],
}

/// An LBA format: metadata size (15:0), LBA data size as a power of two (23:16), relative
/// performance (25:24).
pub type LbaFormat = Le32;

/// The Identify Namespace data structure (CNS 00h; §5.15).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[allow(missing_docs)] // fields named as in the specification
pub struct IdentifyNamespace {
    pub nsze: Le64,
    pub ncap: Le64,
    pub nuse: Le64,
    pub nsfeat: u8,
    pub nlbaf: u8,
    pub flbas: u8,
    pub mc: u8,
    pub dpc: u8,
    pub dps: u8,
    pub nmic: u8,
    pub rescap: u8,
    pub fpi: u8,
    pub dlfeat: u8,
    pub nawun: Le16,
    pub nawupf: Le16,
    pub nacwu: Le16,
    pub nabsn: Le16,
    pub nabo: Le16,
    pub nabspf: Le16,
    pub noiob: Le16,
    pub nvmcap: [u8; 16],
    pub rsvd64: [u8; 40],
    pub nguid: [u8; 16],
    pub eui64: [u8; 8],
    pub lbaf: [LbaFormat; 16],
    pub rsvd192: [u8; 3904],
}

/// The SMART / Health Information log page (§5.14.1.2).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[allow(missing_docs)] // fields named as in the specification
pub struct SmartLog {
    pub critical_warning: u8,
    /// Composite temperature, kelvins (unaligned in the page: bytes).
    pub temperature: [u8; 2],
    pub available_spare: u8,
    pub available_spare_threshold: u8,
    pub percentage_used: u8,
    pub rsvd6: [u8; 26],
    /// 128-bit counters, little-endian.
    pub data_units_read: [u8; 16],
    pub data_units_written: [u8; 16],
    pub host_reads: [u8; 16],
    pub host_writes: [u8; 16],
    pub controller_busy_time: [u8; 16],
    pub power_cycles: [u8; 16],
    pub power_on_hours: [u8; 16],
    pub unsafe_shutdowns: [u8; 16],
    pub media_errors: [u8; 16],
    pub error_log_entries: [u8; 16],
    pub warning_temp_time: Le32,
    pub critical_temp_time: Le32,
    pub temp_sensors: [Le16; 8],
    pub rsvd216: [u8; 296],
}

/// An entry of the Error Information log page (§5.14.1.1).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(missing_docs)] // fields named as in the specification
pub struct ErrorLogEntry {
    pub error_count: Le64,
    pub sqid: Le16,
    pub cid: Le16,
    /// Status field (15:1) and phase tag (0) of the command's completion.
    pub status: Le16,
    pub parameter_location: Le16,
    pub lba: Le64,
    pub nsid: Le32,
    pub vendor: u8,
    pub rsvd29: [u8; 3],
    pub command_specific: Le64,
    pub rsvd40: [u8; 24],
}

/// The Firmware Slot Information log page (§5.14.1.3).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[allow(missing_docs)] // fields named as in the specification
pub struct FirmwareSlotLog {
    /// Active firmware info: the slot running (2:0).
    pub afi: u8,
    pub rsvd1: [u8; 7],
    /// Firmware revision of slots 1 to 7.
    pub frs: [[u8; 8]; 7],
    pub rsvd64: [u8; 448],
}

/// A namespace identification descriptor's header (§5.15); the identifier
/// follows.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(missing_docs)] // fields named as in the specification
pub struct NsDescriptorHeader {
    /// Identifier type (2: NGUID, 3: UUID).
    pub nidt: u8,
    /// Identifier length.
    pub nidl: u8,
    pub rsvd: Le16,
}

/// A Dataset Management range (§6.2).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(missing_docs)] // fields named as in the specification
pub struct DsmRange {
    pub attributes: Le32,
    /// Logical blocks in the range (not 0-based).
    pub nlb: Le32,
    pub slba: Le64,
}

/// The range list of a Dataset Management command (up to 256 ranges, §6.2).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DsmRanges {
    /// The ranges; the command's NR + 1 first are used.
    pub ranges: [DsmRange; 256],
}

plain_data!(
    Sqe = 64,
    Cqe = 16,
    PowerState = 32,
    IdentifyController = 4096,
    IdentifyNamespace = 4096,
    SmartLog = 512,
    ErrorLogEntry = 64,
    FirmwareSlotLog = 512,
    NsDescriptorHeader = 4,
    DsmRange = 16,
    DsmRanges = 4096,
);

// The offsets drivers read, against the specification's figures.
const _: () = {
    use std::mem::offset_of;
    assert!(offset_of!(IdentifyController, mdts) == 77);
    assert!(offset_of!(IdentifyController, ver) == 80);
    assert!(offset_of!(IdentifyController, oacs) == 256);
    assert!(offset_of!(IdentifyController, wctemp) == 266);
    assert!(offset_of!(IdentifyController, kas) == 320);
    assert!(offset_of!(IdentifyController, sqes) == 512);
    assert!(offset_of!(IdentifyController, nn) == 516);
    assert!(offset_of!(IdentifyController, oncs) == 520);
    assert!(offset_of!(IdentifyController, vwc) == 525);
    assert!(offset_of!(IdentifyController, sgls) == 536);
    assert!(offset_of!(IdentifyController, subnqn) == 768);
    assert!(offset_of!(IdentifyController, psd) == 2048);
    assert!(offset_of!(IdentifyNamespace, dlfeat) == 33);
    assert!(offset_of!(IdentifyNamespace, noiob) == 46);
    assert!(offset_of!(IdentifyNamespace, nguid) == 104);
    assert!(offset_of!(IdentifyNamespace, lbaf) == 128);
    assert!(offset_of!(SmartLog, data_units_read) == 32);
    assert!(offset_of!(SmartLog, error_log_entries) == 176);
    assert!(offset_of!(SmartLog, temp_sensors) == 200);
    assert!(offset_of!(ErrorLogEntry, lba) == 16);
    assert!(offset_of!(ErrorLogEntry, command_specific) == 32);
    assert!(offset_of!(FirmwareSlotLog, frs) == 8);
};

/// `s` as a space-padded ASCII field (serial number, model, firmware revision).
pub fn ascii<const N: usize>(s: &str) -> [u8; N] {
    let mut out = [b' '; N];
    for (o, c) in out.iter_mut().zip(s.bytes().filter(|c| c.is_ascii_graphic() || *c == b' ')) {
        *o = c;
    }
    out
}

/// A 128-bit little-endian counter.
pub fn u128_le(v: u64) -> [u8; 16] {
    u128::from(v).to_le_bytes()
}
