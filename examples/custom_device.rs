//! Writing your own device: a complete PCI function with a few registers and an MSI
//! interrupt, served to a VMM over vfio-user.
//!
//! ```sh
//! cargo run --example custom_device -- /tmp/custom.sock
//! qemu-system-x86_64 ... \
//!   -device '{"driver":"vfio-user-pci","socket":{"type":"unix","path":"/tmp/custom.sock"}}'
//! ```
//!
//! The guest sees a PCI device `1234:c0de` with one 4 KiB memory BAR:
//!
//! | offset | name     | access | meaning                                        |
//! |--------|----------|--------|------------------------------------------------|
//! | 0x0    | ID       | RO     | `0x504d5845`: the bytes "EXMP"                 |
//! | 0x4    | SCRATCH  | RW     | any value                                      |
//! | 0x8    | COUNTER  | RO     | doorbell rings since reset                     |
//! | 0xc    | DOORBELL | WO     | any write: COUNTER += 1 and raise MSI vector 0 |
//!
//! Three pieces make a device:
//! 1. a [`ConfigSpaceBuilder`] declaring what the guest's PCI scan sees (IDs, BARs,
//!    capabilities) — the framework emulates config space from it, sizing and all;
//! 2. a [`PciFunction`]: your BAR registers and reset;
//! 3. a [`PciDevice`] gluing the two into a `VfioDevice` the server can serve.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use umdev_mdev::irq::IrqHandle;
use umdev_mdev::pci::{Bar, ClassCode, ConfigSpaceBuilder, PciDevice, PciFunction, PciIds};
use umdev_mdev::DeviceError;
use umdev_server::{Daemon, InstanceConfig};

// The register map of BAR0 (see the table above).
const REG_ID: u64 = 0x0;
const REG_SCRATCH: u64 = 0x4;
const REG_COUNTER: u64 = 0x8;
const REG_DOORBELL: u64 = 0xc;
const ID_VALUE: u32 = 0x504d_5845;
/// BARs are powers of two; 4 KiB is the smallest that a guest maps on its own page.
const BAR0_SIZE: u64 = 4096;

/// Step 1: the config space. Everything here is read-only to the guest except what PCI
/// makes writable (COMMAND, BAR addresses, the MSI capability's control fields, ...).
fn config() -> ConfigSpaceBuilder {
    let ids = PciIds {
        // 0x1234 is the vendor ID QEMU's own test devices use; take your own for real work.
        vendor_id: 0x1234,
        device_id: 0xc0de,
        subsystem_vendor_id: 0x1234,
        subsystem_id: 0xc0de,
        revision: 1,
        class: ClassCode { base: 0xff, sub: 0, prog_if: 0 }, // "unclassified"
    };
    ConfigSpaceBuilder::new(ids)
        // BAR0: 4 KiB of 32-bit memory space holding our registers.
        .bar(0, Bar::mem32(BAR0_SIZE))
        // An MSI capability with 1 vector and 64-bit addresses. No INTx pin is declared,
        // so interrupts only flow once the guest enables MSI.
        .msi(1, false, true)
}

/// Step 2: the function. Methods take `&self` (the server may call in while your own
/// threads run), so state sits in atomics or a mutex.
struct Doorbell {
    /// How the function raises interrupts; handed over by `PciDevice::new`.
    irq: IrqHandle,
    scratch: AtomicU32,
    counter: AtomicU32,
}

impl Doorbell {
    /// We accept aligned 32-bit accesses only. The adapter has already checked that the
    /// access lies inside the BAR, but the guest chooses size and alignment: refuse
    /// anything else with an error (the client sees EINVAL) rather than panicking.
    fn check(bar: u8, offset: u64, len: usize) -> Result<(), DeviceError> {
        if bar != 0 || len != 4 || offset % 4 != 0 {
            return Err(DeviceError::BadAccess { region: u32::from(bar), offset, len: len as u64 });
        }
        Ok(())
    }
}

impl PciFunction for Doorbell {
    fn bar_read(&self, bar: u8, offset: u64, data: &mut [u8]) -> Result<(), DeviceError> {
        Self::check(bar, offset, data.len())?;
        let value = match offset {
            REG_ID => ID_VALUE,
            REG_SCRATCH => self.scratch.load(Ordering::Relaxed),
            REG_COUNTER => self.counter.load(Ordering::Relaxed),
            _ => 0, // DOORBELL is write-only; unused offsets read 0, as on most hardware
        };
        data.copy_from_slice(&value.to_le_bytes()); // PCI registers are little-endian
        Ok(())
    }

    fn bar_write(&self, bar: u8, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        Self::check(bar, offset, data.len())?;
        let mut bytes = [0u8; 4];
        bytes.copy_from_slice(data);
        let value = u32::from_le_bytes(bytes);
        match offset {
            REG_SCRATCH => self.scratch.store(value, Ordering::Relaxed),
            REG_DOORBELL => {
                self.counter.fetch_add(1, Ordering::Relaxed);
                // `raise` picks the mechanism the guest enabled in config space (here:
                // MSI, or nothing). A masked vector is held pending and sent on unmask.
                let delivery = self.irq.raise(0);
                eprintln!("custom_device: doorbell rung, interrupt {delivery:?}");
            }
            _ => {} // writes to read-only or unused registers are ignored
        }
        Ok(())
    }

    /// DEVICE_RESET, and every client disconnect: back to the power-on state. The
    /// adapter resets config space and interrupts right after.
    fn reset(&self) {
        self.scratch.store(0, Ordering::Relaxed);
        self.counter.store(0, Ordering::Relaxed);
    }
}

/// Step 3: serve it. `umdev_server::Daemon` hosts any number of devices, each on its own
/// UNIX socket; this is what `umdev run` does for the built-in types.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    env_logger::init(); // RUST_LOG=debug shows every vfio-user message
    let Some(socket) = std::env::args_os().nth(1) else {
        return Err("usage: custom_device SOCKET_PATH".into());
    };

    // `PciDevice::new` builds the config space, then calls us back with the interrupt
    // handle to build the function: the device and its interrupts are wired together.
    let device = PciDevice::new(config(), |irq| Doorbell {
        irq,
        scratch: AtomicU32::new(0),
        counter: AtomicU32::new(0),
    })?;

    // Take the signals before serving, so Ctrl-C always reaches us.
    let mut signals = Signals::new([SIGINT, SIGTERM])?;
    let daemon = Daemon::new();
    daemon.start(Arc::new(device), InstanceConfig::new("custom", &socket))?;
    eprintln!("custom_device: serving on {} (Ctrl-C to stop)", socket.to_string_lossy());

    signals.forever().next();
    // Disconnects the client, stops the instance and removes the socket.
    daemon.shutdown();
    Ok(())
}
