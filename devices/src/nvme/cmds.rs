//! Submission queue entries turned into typed commands before anything runs them.
//!
//! A raw entry ([`Sqe`], NVMe 1.3 §4.2) is guest input: [`AdminCmd::parse`] and
//! [`NvmCmd::parse`] read its dwords once, check what the whole command set refuses alike
//! (fused operations, a data pointer kind the controller does not take), and give the
//! handlers a value with named fields: sizes that are 0's based in the entry are counts here
//! (`entries`, `blocks`, `dwords`), never overflowing. Parsing never panics and never
//! reads guest memory; the data pointer ([`DataPtr`]) stays raw until the handler that moves
//! data resolves it ([`super::prp`]).
//!
//! An opcode the controller does not implement is [`ParseError::InvalidOpcode`], answered
//! with Invalid Command Opcode (not Internal Error).

use thiserror::Error;

use super::spec::{admin_op, nvm_op, Sqe, Status};

/// Why an entry is not a command the controller runs; its status is `Status::from`.
#[derive(Clone, Copy, Debug, Error, PartialEq, Eq)]
pub enum ParseError {
    /// FUSE (CDW0 9:8) is not 00b: fused operations are not supported (FUSES 0).
    #[error("fused operation (FUSE {0})")]
    Fused(u8),
    /// PSDT (CDW0 15:14) names SGLs, which the controller does not offer (SGLS 0).
    #[error("SGL data pointer (PSDT {0})")]
    Sgl(u8),
    /// The opcode is not one the controller implements.
    #[error("invalid opcode {0:#04x}")]
    InvalidOpcode(u8),
}

impl From<ParseError> for Status {
    /// NVMe 1.3 §4.6.1.2.1: Invalid Field in Command for unsupported FUSE or PSDT values,
    /// Invalid Command Opcode otherwise; neither succeeds on a retry.
    fn from(e: ParseError) -> Status {
        match e {
            ParseError::Fused(_) | ParseError::Sgl(_) => Status::INVALID_FIELD.dnr(),
            ParseError::InvalidOpcode(_) => Status::INVALID_OPCODE.dnr(),
        }
    }
}

/// A command's data pointer (NVMe 1.3 §4.2,: DPTR), kept raw until used.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DataPtr {
    prp1: u64,
    prp2: u64,
}

impl DataPtr {
    fn of(sqe: &Sqe) -> DataPtr {
        DataPtr { prp1: sqe.prp1.into(), prp2: sqe.prp2.into() }
    }

    /// PRP entry 1 (§4.3).
    pub fn prp1(&self) -> u64 {
        self.prp1
    }

    /// PRP entry 2, or a PRP list pointer (§4.3).
    pub fn prp2(&self) -> u64 {
        self.prp2
    }
}

/// FUSE and PSDT: the controller runs neither fused operations nor SGLs.
fn plain(sqe: &Sqe) -> Result<(), ParseError> {
    match (sqe.fuse(), sqe.psdt()) {
        (0, 0) => Ok(()),
        (0, psdt) => Err(ParseError::Sgl(psdt)),
        (fuse, _) => Err(ParseError::Fused(fuse)),
    }
}

/// Queue identifier and queue size (0's based in CDW10 31:16, a count here) of a Create
/// command (§5.3, §5.4).
fn queue_id_and_size(sqe: &Sqe) -> (u16, u32) {
    (sqe.dw(10) as u16, (sqe.dw(10) >> 16) + 1)
}

/// Create I/O Completion Queue (NVMe 1.3 §5.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CreateCq {
    /// QID (CDW10 15:0).
    pub qid: u16,
    /// Entries: QSIZE + 1 (1 to 65536).
    pub entries: u32,
    /// PRP1: the queue's base address (physically contiguous queues only).
    pub base: u64,
    /// PC (CDW11 bit 0): physically contiguous.
    pub contiguous: bool,
    /// IEN (CDW11 bit 1): interrupts enabled.
    pub interrupts: bool,
    /// IV (CDW11 31:16): the interrupt vector.
    pub vector: u16,
}

/// Create I/O Submission Queue (NVMe 1.3 §5.4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CreateSq {
    /// QID (CDW10 15:0).
    pub qid: u16,
    /// Entries: QSIZE + 1 (1 to 65536).
    pub entries: u32,
    /// PRP1: the queue's base address.
    pub base: u64,
    /// PC (CDW11 bit 0): physically contiguous.
    pub contiguous: bool,
    /// CQID (CDW11 31:16): the completion queue its commands complete on.
    pub cqid: u16,
}

/// Get Log Page (NVMe 1.3 §5.14).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GetLogPage {
    /// LID (CDW10 7:0).
    pub lid: u8,
    /// RAE (CDW10 bit 15): retain the asynchronous event.
    pub rae: bool,
    /// NUMD + 1: dwords to return (NUMDU in CDW11 15:0, NUMDL in CDW10 31:16).
    pub dwords: u64,
    /// LPOU:LPOL (CDW13:CDW12): byte offset into the page.
    pub offset: u64,
    /// Where the data goes.
    pub data: DataPtr,
}

/// Identify (NVMe 1.3 §5.15).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identify {
    /// CNS (CDW10 7:0).
    pub cns: u8,
    /// NSID.
    pub nsid: u32,
    /// Where the 4 KiB data structure goes.
    pub data: DataPtr,
}

/// Abort (NVMe 1.3 §5.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Abort {
    /// SQID (CDW10 15:0).
    pub sqid: u16,
    /// CID (CDW10 31:16): the command to abort.
    pub cid: u16,
}

/// A feature's value in CDW11 of Set Features (NVMe 1.3 §5.21.1), by Feature Identifier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Feature {
    /// 01h Arbitration (§5.21.1.1): stored as written.
    Arbitration(u32),
    /// 02h Power Management (§5.21.1.2): PS (4:0), WH (7:5).
    PowerManagement {
        /// Power State.
        ps: u8,
        /// PS and WH as written.
        raw: u8,
    },
    /// 04h Temperature Threshold (§5.21.1.4).
    TemperatureThreshold {
        /// TMPTH (15:0), kelvins.
        kelvins: u16,
        /// TMPSEL (19:16): which sensor.
        sensor: u8,
        /// THSEL (21:20): 0 over, 1 under threshold.
        kind: u8,
    },
    /// 05h Error Recovery (§5.21.1.5).
    ErrorRecovery {
        /// TLER (15:0).
        tler: u16,
        /// DULBE (bit 16).
        dulbe: bool,
    },
    /// 06h Volatile Write Cache (§5.21.1.6): WCE (bit 0).
    VolatileWriteCache(bool),
    /// 07h Number of Queues (§5.21.1.7), 0's based as in the entry.
    NumberOfQueues {
        /// NSQR (15:0).
        nsqr: u16,
        /// NCQR (31:16).
        ncqr: u16,
    },
    /// 08h Interrupt Coalescing (§5.21.1.8).
    InterruptCoalescing {
        /// THR (7:0).
        threshold: u8,
        /// TIME (15:8), 100 µs units.
        time: u8,
    },
    /// 09h Interrupt Vector Configuration (§5.21.1.9).
    InterruptVectorConfig {
        /// IV (15:0).
        vector: u16,
        /// CD (bit 16): coalescing disabled.
        disabled: bool,
    },
    /// 0Ah Write Atomicity Normal (§5.21.1.10): DN (bit 0).
    WriteAtomicity(bool),
    /// 0Bh Asynchronous Event Configuration (§5.21.1.11): CDW11 as written.
    AsyncEventConfig(u32),
    /// Any other identifier (not supported).
    Other(u8),
}

impl Feature {
    fn parse(fid: u8, dw11: u32) -> Feature {
        use super::spec::feature as f;
        match fid {
            f::ARBITRATION => Feature::Arbitration(dw11),
            f::POWER_MANAGEMENT => Feature::PowerManagement { ps: (dw11 & 0x1f) as u8, raw: dw11 as u8 },
            f::TEMPERATURE_THRESHOLD => Feature::TemperatureThreshold {
                kelvins: dw11 as u16,
                sensor: ((dw11 >> 16) & 0xf) as u8,
                kind: ((dw11 >> 20) & 3) as u8,
            },
            f::ERROR_RECOVERY => Feature::ErrorRecovery { tler: dw11 as u16, dulbe: dw11 & 1 << 16 != 0 },
            f::VOLATILE_WRITE_CACHE => Feature::VolatileWriteCache(dw11 & 1 != 0),
            f::NUMBER_OF_QUEUES => Feature::NumberOfQueues { nsqr: dw11 as u16, ncqr: (dw11 >> 16) as u16 },
            f::INTERRUPT_COALESCING => {
                Feature::InterruptCoalescing { threshold: dw11 as u8, time: (dw11 >> 8) as u8 }
            }
            f::INTERRUPT_VECTOR_CONFIG => {
                Feature::InterruptVectorConfig { vector: dw11 as u16, disabled: dw11 & 1 << 16 != 0 }
            }
            f::WRITE_ATOMICITY => Feature::WriteAtomicity(dw11 & 1 != 0),
            f::ASYNC_EVENT_CONFIG => Feature::AsyncEventConfig(dw11),
            other => Feature::Other(other),
        }
    }
}

/// Set Features (NVMe 1.3 §5.21).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SetFeatures {
    /// SV (CDW10 bit 31): save across power cycles.
    pub save: bool,
    /// The feature and its new value.
    pub feature: Feature,
}

/// Get Features (NVMe 1.3 §5.13).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GetFeatures {
    /// FID (CDW10 7:0).
    pub fid: u8,
    /// SEL (CDW10 10:8): 0 current, 1 default, 2 saved, 3 supported capabilities.
    pub select: u8,
    /// CDW11: the feature-specific selector (the vector of 09h, the sensor of 04h).
    pub dw11: u32,
}

/// An admin command (NVMe 1.3 §5), parsed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdminCmd {
    /// 00h Delete I/O Submission Queue (§5.6): the QID.
    DeleteSq(u16),
    /// 01h Create I/O Submission Queue (§5.4).
    CreateSq(CreateSq),
    /// 02h Get Log Page (§5.14).
    GetLogPage(GetLogPage),
    /// 04h Delete I/O Completion Queue (§5.5): the QID.
    DeleteCq(u16),
    /// 05h Create I/O Completion Queue (§5.3).
    CreateCq(CreateCq),
    /// 06h Identify (§5.15).
    Identify(Identify),
    /// 08h Abort (§5.1).
    Abort(Abort),
    /// 09h Set Features (§5.21).
    SetFeatures(SetFeatures),
    /// 0Ah Get Features (§5.13).
    GetFeatures(GetFeatures),
    /// 0Ch Asynchronous Event Request (§5.2).
    AsyncEventRequest,
    /// 7Ch Doorbell Buffer Config (§5.10).
    DoorbellBufferConfig(DoorbellBufferConfig),
}

/// Doorbell Buffer Config (NVMe 1.3 §5.10).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DoorbellBufferConfig {
    /// PRP1: the shadow doorbell buffer (a page).
    pub shadow: u64,
    /// PRP2: the event index buffer (a page).
    pub eventidx: u64,
}

impl AdminCmd {
    /// The command `sqe` names.
    pub fn parse(sqe: &Sqe) -> Result<AdminCmd, ParseError> {
        plain(sqe)?;
        let (dw10, dw11) = (sqe.dw(10), sqe.dw(11));
        Ok(match sqe.opcode() {
            admin_op::DELETE_SQ => AdminCmd::DeleteSq(dw10 as u16),
            admin_op::CREATE_SQ => {
                let (qid, entries) = queue_id_and_size(sqe);
                AdminCmd::CreateSq(CreateSq {
                    qid,
                    entries,
                    base: sqe.prp1.into(),
                    contiguous: dw11 & 1 != 0,
                    cqid: (dw11 >> 16) as u16,
                })
            }
            admin_op::GET_LOG_PAGE => AdminCmd::GetLogPage(GetLogPage {
                lid: dw10 as u8,
                rae: dw10 & 1 << 15 != 0,
                dwords: (u64::from(dw11 & 0xffff) << 16 | u64::from(dw10 >> 16)) + 1,
                offset: u64::from(sqe.dw(12)) | u64::from(sqe.dw(13)) << 32,
                data: DataPtr::of(sqe),
            }),
            admin_op::DELETE_CQ => AdminCmd::DeleteCq(dw10 as u16),
            admin_op::CREATE_CQ => {
                let (qid, entries) = queue_id_and_size(sqe);
                AdminCmd::CreateCq(CreateCq {
                    qid,
                    entries,
                    base: sqe.prp1.into(),
                    contiguous: dw11 & 1 != 0,
                    interrupts: dw11 & 2 != 0,
                    vector: (dw11 >> 16) as u16,
                })
            }
            admin_op::IDENTIFY => AdminCmd::Identify(Identify {
                cns: dw10 as u8,
                nsid: sqe.nsid.into(),
                data: DataPtr::of(sqe),
            }),
            admin_op::ABORT => AdminCmd::Abort(Abort { sqid: dw10 as u16, cid: (dw10 >> 16) as u16 }),
            admin_op::SET_FEATURES => AdminCmd::SetFeatures(SetFeatures {
                save: dw10 & 1 << 31 != 0,
                feature: Feature::parse(dw10 as u8, dw11),
            }),
            admin_op::GET_FEATURES => {
                AdminCmd::GetFeatures(GetFeatures { fid: dw10 as u8, select: ((dw10 >> 8) & 7) as u8, dw11 })
            }
            admin_op::ASYNC_EVENT => AdminCmd::AsyncEventRequest,
            admin_op::DOORBELL_BUFFER_CONFIG => AdminCmd::DoorbellBufferConfig(DoorbellBufferConfig {
                shadow: sqe.prp1.into(),
                eventidx: sqe.prp2.into(),
            }),
            other => return Err(ParseError::InvalidOpcode(other)),
        })
    }
}

/// A Read, Write or Compare (NVMe 1.3 §6.4, §6.9, §6.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadWrite {
    /// NSID.
    pub nsid: u32,
    /// SLBA (CDW11:CDW10).
    pub slba: u64,
    /// NLB + 1 (CDW12 15:0 is 0's based): 1 to 65536 blocks.
    pub blocks: u32,
    /// FUA (CDW12 bit 30): durable before completion.
    pub fua: bool,
    /// Where the data is.
    pub data: DataPtr,
}

/// Write Zeroes (NVMe 1.3 §6.11).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteZeroes {
    /// NSID.
    pub nsid: u32,
    /// SLBA (CDW11:CDW10).
    pub slba: u64,
    /// NLB + 1.
    pub blocks: u32,
    /// FUA (CDW12 bit 30): the zeroes durable before the command completes.
    pub fua: bool,
}

/// Dataset Management (NVMe 1.3 §6.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DatasetManagement {
    /// NSID.
    pub nsid: u32,
    /// NR + 1 (CDW10 7:0): ranges in the list, 1 to 256.
    pub ranges: usize,
    /// AD (CDW11 bit 2): deallocate the ranges.
    pub deallocate: bool,
    /// Where the range list is.
    pub data: DataPtr,
}

/// An NVM command (NVMe 1.3 §6), parsed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NvmCmd {
    /// 00h Flush (§6.3): the NSID (FFFFFFFFh: every namespace).
    Flush(u32),
    /// 01h Write (§6.9).
    Write(ReadWrite),
    /// 02h Read (§6.4).
    Read(ReadWrite),
    /// 05h Compare (§6.1): the data pointer's bytes against the blocks (FUA is ignored).
    Compare(ReadWrite),
    /// 08h Write Zeroes (§6.11).
    WriteZeroes(WriteZeroes),
    /// 09h Dataset Management (§6.2).
    DatasetManagement(DatasetManagement),
}

impl NvmCmd {
    /// The command `sqe` names.
    pub fn parse(sqe: &Sqe) -> Result<NvmCmd, ParseError> {
        plain(sqe)?;
        let nsid = u32::from(sqe.nsid);
        let slba = u64::from(sqe.dw(10)) | u64::from(sqe.dw(11)) << 32;
        let blocks = (sqe.dw(12) & 0xffff) + 1;
        let fua = sqe.dw(12) & 1 << 30 != 0;
        let rw = || ReadWrite { nsid, slba, blocks, fua, data: DataPtr::of(sqe) };
        Ok(match sqe.opcode() {
            nvm_op::FLUSH => NvmCmd::Flush(nsid),
            nvm_op::WRITE => NvmCmd::Write(rw()),
            nvm_op::READ => NvmCmd::Read(rw()),
            nvm_op::COMPARE => NvmCmd::Compare(rw()),
            nvm_op::WRITE_ZEROES => NvmCmd::WriteZeroes(WriteZeroes { nsid, slba, blocks, fua }),
            nvm_op::DSM => NvmCmd::DatasetManagement(DatasetManagement {
                nsid,
                ranges: (sqe.dw(10) & 0xff) as usize + 1,
                deallocate: sqe.dw(11) & 1 << 2 != 0,
                data: DataPtr::of(sqe),
            }),
            other => return Err(ParseError::InvalidOpcode(other)),
        })
    }

    /// The namespace the command names.
    pub fn nsid(&self) -> u32 {
        match self {
            NvmCmd::Flush(nsid) => *nsid,
            NvmCmd::Write(rw) | NvmCmd::Read(rw) | NvmCmd::Compare(rw) => rw.nsid,
            NvmCmd::WriteZeroes(wz) => wz.nsid,
            NvmCmd::DatasetManagement(dsm) => dsm.nsid,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sqe(opcode: u8, dws: &[(usize, u32)]) -> Sqe {
        let mut s = Sqe::new(opcode, 7);
        for &(n, v) in dws {
            s.set_dw(n, v);
        }
        s
    }

    #[test]
    fn zero_based_sizes_become_counts_without_overflow() {
        let rw = NvmCmd::parse(&sqe(nvm_op::READ, &[(10, 5), (11, 1), (12, 0xffff | 1 << 30)])).unwrap();
        let NvmCmd::Read(rw) = rw else { panic!("a read") };
        assert_eq!((rw.slba, rw.blocks, rw.fua), (1 << 32 | 5, 65536, true));
        let cq = AdminCmd::parse(&sqe(admin_op::CREATE_CQ, &[(10, 3 | 0xffff << 16), (11, 3 | 9 << 16)]));
        let AdminCmd::CreateCq(cq) = cq.unwrap() else { panic!("a create") };
        assert_eq!((cq.qid, cq.entries, cq.contiguous, cq.interrupts, cq.vector), (3, 65536, true, true, 9));
        // NUMDL in CDW10 31:16, NUMDU in CDW11 15:0 (propolis reads NUMDL from CDW10 11:0).
        let log = AdminCmd::parse(&sqe(admin_op::GET_LOG_PAGE, &[(10, 2 | 127 << 16), (11, 1), (12, 8)]));
        let AdminCmd::GetLogPage(log) = log.unwrap() else { panic!("a log page") };
        assert_eq!((log.lid, log.dwords, log.offset), (2, (1 << 16 | 127) + 1, 8));
        let dsm = NvmCmd::parse(&sqe(nvm_op::DSM, &[(10, 255), (11, 4)])).unwrap();
        assert!(matches!(dsm, NvmCmd::DatasetManagement(d) if d.ranges == 256 && d.deallocate));
    }

    #[test]
    fn fused_sgl_and_unknown_entries_are_refused_with_their_status() {
        let mut fused = sqe(nvm_op::READ, &[]);
        fused.cdw0 = (u32::from(fused.cdw0) | 1 << 8).into();
        assert_eq!(NvmCmd::parse(&fused), Err(ParseError::Fused(1)));
        let mut sgl = sqe(admin_op::IDENTIFY, &[]);
        sgl.cdw0 = (u32::from(sgl.cdw0) | 1 << 14).into();
        assert_eq!(AdminCmd::parse(&sgl), Err(ParseError::Sgl(1)));
        assert_eq!(Status::from(ParseError::Sgl(1)), Status::INVALID_FIELD.dnr());
        assert_eq!(NvmCmd::parse(&sqe(0x7f, &[])), Err(ParseError::InvalidOpcode(0x7f)));
        assert_eq!(AdminCmd::parse(&sqe(0x7f, &[])), Err(ParseError::InvalidOpcode(0x7f)));
        assert_eq!(Status::from(ParseError::InvalidOpcode(1)), Status::INVALID_OPCODE.dnr());
    }
}
