//! PCI configuration-space register offsets and bits (PCI Local Bus 3.0, PCIe Base 4.0)
//! that the emulation and device authors refer to.

/// Vendor ID (16 bits).
pub const VENDOR_ID: usize = 0x00;
/// Device ID (16 bits).
pub const DEVICE_ID: usize = 0x02;
/// Command register (16 bits).
pub const COMMAND: usize = 0x04;
/// Status register (16 bits).
pub const STATUS: usize = 0x06;
/// Revision ID (8 bits).
pub const REVISION_ID: usize = 0x08;
/// Class code: programming interface (8 bits), then subclass and base class.
pub const CLASS_PROG_IF: usize = 0x09;
/// Cache line size (8 bits).
pub const CACHE_LINE_SIZE: usize = 0x0c;
/// Header type (8 bits).
pub const HEADER_TYPE: usize = 0x0e;
/// First base address register; BAR `n` is at `BAR0 + 4 * n`.
pub const BAR0: usize = 0x10;
/// Subsystem vendor ID (16 bits).
pub const SUBSYSTEM_VENDOR_ID: usize = 0x2c;
/// Subsystem ID (16 bits).
pub const SUBSYSTEM_ID: usize = 0x2e;
/// Expansion ROM base address (32 bits).
pub const ROM_ADDRESS: usize = 0x30;
/// Capabilities pointer (8 bits).
pub const CAPABILITY_LIST: usize = 0x34;
/// Interrupt line (8 bits, read-write scratch for the guest).
pub const INTERRUPT_LINE: usize = 0x3c;
/// Interrupt pin (8 bits: 0 none, 1-4 INTA#-INTD#).
pub const INTERRUPT_PIN: usize = 0x3d;
/// End of the type-0 header; capabilities live in `[HEADER_END, 256)`.
pub const HEADER_END: usize = 0x40;
/// Size of conventional PCI configuration space.
pub const CONFIG_SPACE_SIZE: usize = 256;
/// Size of PCI Express extended configuration space.
pub const PCIE_CONFIG_SPACE_SIZE: usize = 4096;
/// Number of BAR slots in a type-0 header.
pub const NUM_BARS: usize = 6;

/// COMMAND: I/O space decoding.
pub const COMMAND_IO: u16 = 1 << 0;
/// COMMAND: memory space decoding.
pub const COMMAND_MEMORY: u16 = 1 << 1;
/// COMMAND: bus master (the function may issue DMA and MSI writes).
pub const COMMAND_MASTER: u16 = 1 << 2;
/// COMMAND: INTx emulation disable.
pub const COMMAND_INTX_DISABLE: u16 = 1 << 10;

/// STATUS: INTx is asserted by the function (read-only).
pub const STATUS_INTERRUPT: u16 = 1 << 3;
/// STATUS: the capability list at [`CAPABILITY_LIST`] is valid (read-only).
pub const STATUS_CAP_LIST: u16 = 1 << 4;
/// STATUS: master data parity error (write 1 to clear).
pub const STATUS_PARITY: u16 = 1 << 8;
/// STATUS: signaled target abort (write 1 to clear).
pub const STATUS_SIG_TARGET_ABORT: u16 = 1 << 11;
/// STATUS: received target abort (write 1 to clear).
pub const STATUS_REC_TARGET_ABORT: u16 = 1 << 12;
/// STATUS: received master abort (write 1 to clear).
pub const STATUS_REC_MASTER_ABORT: u16 = 1 << 13;
/// STATUS: signaled system error (write 1 to clear).
pub const STATUS_SIG_SYSTEM_ERROR: u16 = 1 << 14;
/// STATUS: detected parity error (write 1 to clear).
pub const STATUS_DETECTED_PARITY: u16 = 1 << 15;
/// STATUS: every write-1-to-clear error bit.
pub const STATUS_W1C: u16 = STATUS_PARITY
    | STATUS_SIG_TARGET_ABORT
    | STATUS_REC_TARGET_ABORT
    | STATUS_REC_MASTER_ABORT
    | STATUS_SIG_SYSTEM_ERROR
    | STATUS_DETECTED_PARITY;

/// BAR bit 0: an I/O BAR.
pub const BAR_IO: u32 = 1 << 0;
/// Memory BAR type field (bits 2:1) value for a 64-bit BAR.
pub const BAR_MEM_64: u32 = 0b10 << 1;
/// Memory BAR: prefetchable.
pub const BAR_PREFETCH: u32 = 1 << 3;

/// Capability ID: power management.
pub const CAP_ID_PM: u8 = 0x01;
/// Capability ID: MSI.
pub const CAP_ID_MSI: u8 = 0x05;
/// Capability ID: PCI Express.
pub const CAP_ID_EXP: u8 = 0x10;
/// Capability ID: MSI-X.
pub const CAP_ID_MSIX: u8 = 0x11;

/// MSI Message Control: MSI enable.
pub const MSI_CTRL_ENABLE: u16 = 1 << 0;
/// MSI Message Control: Multiple Message Capable field shift (3 bits, log2 vectors).
pub const MSI_CTRL_MMC_SHIFT: u16 = 1;
/// MSI Message Control: Multiple Message Enable field shift (3 bits, log2 vectors).
pub const MSI_CTRL_MME_SHIFT: u16 = 4;
/// MSI Message Control: Multiple Message Enable field.
pub const MSI_CTRL_MME_MASK: u16 = 0b111 << MSI_CTRL_MME_SHIFT;
/// MSI Message Control: 64-bit address capable.
pub const MSI_CTRL_64BIT: u16 = 1 << 7;
/// MSI Message Control: per-vector masking capable.
pub const MSI_CTRL_PER_VECTOR_MASK: u16 = 1 << 8;

/// MSI-X Message Control: table size minus one (bits 10:0).
pub const MSIX_CTRL_TABLE_SIZE_MASK: u16 = 0x07ff;
/// MSI-X Message Control: function mask.
pub const MSIX_CTRL_FUNCTION_MASK: u16 = 1 << 14;
/// MSI-X Message Control: MSI-X enable.
pub const MSIX_CTRL_ENABLE: u16 = 1 << 15;
/// MSI-X Table/PBA offset register: BAR indicator bits.
pub const MSIX_BIR_MASK: u32 = 0b111;

/// PMCSR: power state field (bits 1:0).
pub const PM_CTRL_STATE_MASK: u16 = 0b11;
/// PMCSR: No_Soft_Reset (state kept across D3hot to D0).
pub const PM_CTRL_NO_SOFT_RESET: u16 = 1 << 3;

/// Extended capability area start (PCI Express only).
pub const EXT_CAP_START: usize = 0x100;
