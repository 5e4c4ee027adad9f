//! Writing your own device: a complete PCI function with a few registers and an MSI
//! interrupt, served to a VMM over vfio-user.
//!
//! ```sh
//! cargo run --example custom_device -- /tmp/custom.sock
//! qemu-system-x86_64 ... \
//!   -device '{"driver":"vfio-user-pci","socket":{"type":"unix","path":"/tmp/custom.sock"}}'
//! ```
//!
//! The guest sees a PCI device `1234:c0de` with one 4 KiB memory BAR of 32-bit registers
//! (aligned 32-bit accesses only; other offsets read 0):
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
//! 2. a [`SimpleFunction`]: your registers (declared in a [`RegMap`]) and reset. It gets
//!    `&mut self`: the framework serializes calls, so there is no locking to write;
//! 3. a [`PciDevice`] gluing the two into a `VfioDevice` the server can serve.

use std::sync::{Arc, Mutex};

use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use umdev_mdev::irq::IrqHandle;
use umdev_mdev::pci::{Bar, ClassCode, ConfigSpaceBuilder, PciDevice, PciIds, Reg, RegMap, SimpleFunction};
use umdev_mdev::DeviceError;
use umdev_server::{Daemon, InstanceConfig};

/// BAR0's registers (see the table above).
#[derive(Clone, Copy)]
enum R {
    Id,
    Scratch,
    Counter,
    Doorbell,
}
const ID_VALUE: u64 = 0x504d_5845;

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
    // BAR0: 4 KiB of 32-bit memory space (a BAR is a power of two; 4 KiB is the smallest a
    // guest maps on a page of its own) and MSI with 1 vector. No INTx pin is declared, so
    // interrupts flow once the guest enables MSI.
    ConfigSpaceBuilder::new(ids).bar(0, Bar::mem32(4096)).msi(1, false, true)
}

/// Step 2: the function: plain fields, `&mut self` everywhere.
pub struct Doorbell {
    /// How the function raises interrupts; handed over by `PciDevice::new`.
    irq: IrqHandle,
    /// Checks every access (width, alignment, bounds, read-only and write-only registers)
    /// and hands us register accesses.
    map: RegMap<R>,
    scratch: u32,
    counter: u32,
}

impl SimpleFunction for Doorbell {
    fn bar_read(&mut self, _bar: u8, offset: u64, data: &mut [u8]) -> Result<(), DeviceError> {
        self.map.read(offset, data, |hit| match hit.key {
            R::Id => ID_VALUE,
            R::Scratch => u64::from(self.scratch),
            R::Counter => u64::from(self.counter),
            R::Doorbell => 0, // write-only: the map never asks
        })
    }

    fn bar_write(&mut self, _bar: u8, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        let mut rang = false;
        let scratch = &mut self.scratch;
        self.map.write(offset, data, |hit, value, _mask| match hit.key {
            R::Scratch => *scratch = value as u32,
            R::Doorbell => rang = true,
            R::Id | R::Counter => {} // read-only: the map never calls with them
        })?;
        if rang {
            self.counter = self.counter.wrapping_add(1);
            // `raise` picks the mechanism the guest enabled in config space (here: MSI, or
            // nothing). A masked vector is held pending and sent on unmask.
            let delivery = self.irq.raise(0);
            eprintln!("custom_device: doorbell rung, interrupt {delivery:?}");
        }
        Ok(())
    }

    /// DEVICE_RESET, and every client disconnect: back to the power-on state. The
    /// framework resets config space and interrupts right after.
    fn reset(&mut self) {
        (self.scratch, self.counter) = (0, 0);
    }
}

/// Steps 1 and 2 together: the device, ready to serve.
pub fn device() -> Result<PciDevice<Mutex<Doorbell>>, Box<dyn std::error::Error>> {
    let regs =
        [Reg::ro(R::Id, 0x0), Reg::rw(R::Scratch, 0x4), Reg::ro(R::Counter, 0x8), Reg::wo(R::Doorbell, 0xc)];
    let map = RegMap::new(0, 4096, 4, &[4], true, &regs)?;
    // `PciDevice::new` builds the config space, then calls us back with the interrupt
    // handle; the `Mutex` is how the framework serializes a `SimpleFunction`'s calls.
    Ok(PciDevice::new(config(), |irq| Mutex::new(Doorbell { irq, map, scratch: 0, counter: 0 }))?)
}

/// Step 3: serve it. `umdev_server::Daemon` hosts any number of devices, each on its own
/// UNIX socket; this is what `umdev run` does for the built-in types.
#[allow(dead_code)] // when tests/contract.rs includes this file
fn main() -> Result<(), Box<dyn std::error::Error>> {
    env_logger::init(); // RUST_LOG=debug shows every vfio-user message
    let Some(socket) = std::env::args_os().nth(1) else {
        return Err("usage: custom_device SOCKET_PATH".into());
    };
    // Take the signals before serving, so Ctrl-C always reaches us.
    let mut signals = Signals::new([SIGINT, SIGTERM])?;
    let daemon = Daemon::new();
    daemon.start(Arc::new(device()?), InstanceConfig::new("custom", &socket))?;
    eprintln!("custom_device: serving on {} (Ctrl-C to stop)", socket.to_string_lossy());
    signals.forever().next();
    daemon.shutdown(); // disconnects the client, stops the instance, removes the socket
    Ok(())
}
