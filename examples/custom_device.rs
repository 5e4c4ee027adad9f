//! Writing your own device: a PCI function with a few registers and an MSI interrupt, served
//! to a VMM over vfio-user.
//!
//! ```sh
//! cargo run --example custom_device -- /tmp/custom.sock
//! qemu-system-x86_64 ... -device '{"driver":"vfio-user-pci","socket":{"type":"unix","path":"/tmp/custom.sock"}}'
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

use std::sync::{Arc, Mutex};

use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use umdev_mdev::irq::IrqHandle;
use umdev_mdev::pci::{
    Bar, ClassCode, ConfigSpaceBuilder, MsiCap, PciDevice, PciIds, Reg, RegMap, SimpleFunction,
};
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

/// Step 1: what the guest's PCI scan sees. The framework emulates config space from it (BAR
/// sizing, the capability list, MSI); 0x1234 is the vendor ID of QEMU's test devices.
fn config() -> ConfigSpaceBuilder {
    let id = 0xc0de;
    let class = ClassCode { base: 0xff, sub: 0, prog_if: 0 }; // unclassified
    let ids = PciIds {
        vendor_id: 0x1234,
        device_id: id,
        subsystem_vendor_id: 0x1234,
        subsystem_id: id,
        revision: 1,
        class,
    };
    ConfigSpaceBuilder::new(ids).bar(0, Bar::mem32(4096)).msi(MsiCap {
        vectors: 1,
        per_vector_mask: false,
        addr64: true,
    })
}

/// Step 2: the function: plain fields and `&mut self`, since the framework serializes calls.
/// The [`RegMap`] checks every access (width, alignment, bounds, read-only and write-only
/// registers) and hands over register accesses.
pub struct Doorbell {
    irq: IrqHandle,
    map: RegMap<R>,
    scratch: u32,
    counter: u32,
}

impl SimpleFunction for Doorbell {
    fn bar_read(&mut self, _bar: u8, offset: u64, data: &mut [u8]) -> Result<(), DeviceError> {
        self.map.read(offset, data, |hit| match hit.key {
            R::Id => 0x504d_5845,
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
            R::Id | R::Counter => {} // read-only: the map never passes them
        })?;
        if rang {
            self.counter = self.counter.wrapping_add(1);
            // On whatever the guest enabled (here MSI, or nothing); a masked vector waits.
            self.irq.raise(0);
        }
        Ok(())
    }

    /// DEVICE_RESET and every disconnect: back to power-on. Config space and interrupts are
    /// the framework's to reset.
    fn reset(&mut self) {
        (self.scratch, self.counter) = (0, 0);
    }
}

/// Step 3: the two glued into a `VfioDevice`; `Mutex` is how the framework serializes calls.
pub fn device() -> Result<PciDevice<Mutex<Doorbell>>, Box<dyn std::error::Error>> {
    let regs =
        [Reg::ro(R::Id, 0x0), Reg::rw(R::Scratch, 0x4), Reg::ro(R::Counter, 0x8), Reg::wo(R::Doorbell, 0xc)];
    let map = RegMap::builder(0, 4096).build(&regs)?;
    Ok(PciDevice::new(config(), |host| Mutex::new(Doorbell { irq: host.irq, map, scratch: 0, counter: 0 }))?)
}

/// Serve it: `Daemon` hosts any number of devices, each on its own UNIX socket.
#[allow(dead_code)] // when tests/contract.rs includes this file
fn main() -> Result<(), Box<dyn std::error::Error>> {
    env_logger::init(); // RUST_LOG=debug shows every vfio-user message
    let socket = std::env::args_os().nth(1).ok_or("usage: custom_device SOCKET_PATH")?;
    let mut signals = Signals::new([SIGINT, SIGTERM])?; // before serving, so Ctrl-C reaches us
    let daemon = Daemon::new();
    daemon.start(Arc::new(device()?), InstanceConfig::new("custom", &socket))?;
    eprintln!("custom_device: serving on {} (Ctrl-C to stop)", socket.to_string_lossy());
    signals.forever().next();
    daemon.shutdown(); // disconnects the client, stops the instance, removes the socket
    Ok(())
}
