//! The adapter with a minimal function: routing, bounds, mmap checks, config-driven
//! interrupts and lifecycle forwarding.

use std::sync::Arc;

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::*;
use crate::device::{IrqAction, IrqData, SparseArea};
use crate::irq::Delivery;
use crate::pci::regs::{COMMAND, MSI_CTRL_ENABLE, STATUS, STATUS_INTERRUPT};
use crate::pci::{Bar, ClassCode, MsiCap, PciIds};
use crate::{VFIO_PCI_MSI_IRQ_INDEX, VFIO_PCI_ROM_REGION_INDEX, VFIO_PCI_VGA_REGION_INDEX};

/// BAR0: 16 KiB of memory the function stores, MSI-X table at 0x2000 and PBA at 0x3000.
/// BAR2: 64 KiB, mmap-able as `mmap` says.
#[derive(Default)]
struct Memory {
    bytes: Mutex<Vec<u8>>,
    log: Mutex<Vec<String>>,
    mmap: Option<RegionMmap>,
}

impl PciFunction for Memory {
    fn bar_read(&self, bar: u8, offset: u64, data: &mut [u8]) -> Result<(), DeviceError> {
        self.log.lock().unwrap().push(format!("read {bar} {offset:#x} {}", data.len()));
        let bytes = self.bytes.lock().unwrap();
        data.copy_from_slice(&bytes[offset as usize..offset as usize + data.len()]);
        Ok(())
    }

    fn bar_write(&self, bar: u8, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        self.log.lock().unwrap().push(format!("write {bar} {offset:#x} {}", data.len()));
        self.bytes.lock().unwrap()[offset as usize..offset as usize + data.len()].copy_from_slice(data);
        Ok(())
    }

    fn bar_mmap(&self, bar: u8) -> Option<RegionMmap> {
        if bar == 0 || bar == 2 {
            self.mmap.clone()
        } else {
            None
        }
    }

    fn offer_mmap(&self, bar: u8, hello: &ClientHello) -> bool {
        // BAR2's mapping only for clients that announce capabilities.
        bar != 2 || hello.capabilities
    }

    fn reset(&self) {
        self.log.lock().unwrap().push("reset".into());
    }

    fn detach(&self) {
        self.log.lock().unwrap().push("detach".into());
    }

    fn dma_unmap(&self, iova: u64, len: u64) {
        self.log.lock().unwrap().push(format!("unmap {iova:#x} {len:#x}"));
    }
}

fn builder() -> ConfigSpaceBuilder {
    let ids = PciIds {
        vendor_id: 0x1234,
        device_id: 0x2,
        subsystem_vendor_id: 0,
        subsystem_id: 0,
        revision: 0,
        class: ClassCode { base: 0xff, sub: 0, prog_if: 0 },
    };
    ConfigSpaceBuilder::new(ids)
        .bar(0, Bar::mem32(0x4000))
        .bar(2, Bar::mem64(0x10000))
        .interrupt_pin(1)
        .msi(MsiCap { vectors: 4, per_vector_mask: true, addr64: false })
        .msix(MsixCap { vectors: 4, table_bar: 0, table_offset: 0x2000, pba_bar: 0, pba_offset: 0x3000 })
}

fn device(mmap: Option<RegionMmap>) -> Result<PciDevice<Memory>, PciDeviceError> {
    PciDevice::new(builder(), |_| Memory { bytes: Mutex::new(vec![0; 0x4000]), log: Mutex::default(), mmap })
}

fn mmap(areas: Vec<SparseArea>) -> Option<RegionMmap> {
    let fd = nix::sys::memfd::memfd_create(c"pci-test", nix::sys::memfd::MFdFlags::empty()).unwrap();
    Some(RegionMmap { fd: Arc::new(fd), offset: 0, areas })
}

fn area(offset: u64, size: u64) -> SparseArea {
    SparseArea { offset, size }
}

fn log(dev: &PciDevice<Memory>) -> Vec<String> {
    std::mem::take(&mut *dev.function().log.lock().unwrap())
}

fn read_config(dev: &PciDevice<Memory>, offset: u64, len: usize) -> u32 {
    let mut b = [0; 4];
    dev.region_read(VFIO_PCI_CONFIG_REGION_INDEX, offset, &mut b[..len]).unwrap();
    u32::from_le_bytes(b)
}

#[test]
fn mmap_descriptions_are_checked() {
    let bad = |m| matches!(device(m), Err(PciDeviceError::BadMmap { .. }));
    // BAR0 holds the MSI-X table and PBA: no whole-BAR mmap, no area over their pages.
    assert!(bad(mmap(vec![])));
    assert!(bad(mmap(vec![area(0x2000, 0x1000)])));
    assert!(bad(mmap(vec![area(0, 0x4000)])));
    assert!(bad(mmap(vec![area(0x800, 0x1000)])), "not page aligned");
    assert!(bad(mmap(vec![area(0, 0)])), "empty");
    assert!(bad(mmap(vec![area(0x3000, 0x2000)])), "past BAR0's end, and over the PBA");
    let dev = device(mmap(vec![area(0, 0x2000)])).unwrap();
    let info = dev.region_info(0).unwrap();
    assert!(info.flags.contains(RegionFlags::MMAP));
    assert_eq!(info.mmap.unwrap().areas, [area(0, 0x2000)]);
    // BAR2 got the same description and holds no MSI-X structure.
    assert!(dev.region_info(2).unwrap().flags.contains(RegionFlags::MMAP));
    assert!(!dev.region_info(1).unwrap().flags.contains(RegionFlags::MMAP));
    // A client chosen per connection: BAR2's mmap is withheld from one without capabilities
    // and offered again to the next that has them; BAR0's is offered to both.
    dev.client_version(&ClientHello { minor: 1, capabilities: false });
    let bar2 = dev.region_info(2).unwrap();
    assert!(!bar2.flags.contains(RegionFlags::MMAP) && bar2.mmap.is_none());
    assert!(dev.region_info(0).unwrap().flags.contains(RegionFlags::MMAP));
    dev.client_version(&ClientHello { minor: 0, capabilities: true });
    assert!(dev.region_info(2).unwrap().flags.contains(RegionFlags::MMAP));
    // Config errors come through.
    let err = PciDevice::new(builder().bar(5, Bar::mem64(16)), |_| Memory::default()).unwrap_err();
    assert!(matches!(err, PciDeviceError::Config(ConfigError::Mem64NoUpperSlot { index: 5 })));
}

#[test]
fn accesses_are_routed_and_bounded() {
    let dev = device(None).unwrap();
    dev.region_write(0, 0x10, &[1, 2, 3, 4]).unwrap();
    let mut b = [0; 4];
    dev.region_read(0, 0x10, &mut b).unwrap();
    assert_eq!(b, [1, 2, 3, 4]);
    assert_eq!(log(&dev), ["write 0 0x10 4", "read 0 0x10 4"]);

    // The MSI-X table and PBA never reach the function.
    dev.region_write(0, 0x2000 + 12, &0u32.to_le_bytes()).unwrap();
    dev.region_read(0, 0x2000, &mut [0; 8]).unwrap();
    dev.region_read(0, 0x3000, &mut [0; 8]).unwrap();
    dev.region_write(0, 0x3000, &[0xff; 8]).unwrap();
    assert!(log(&dev).is_empty());
    // Straddling the table, or past the PBA's bytes: refused.
    assert!(dev.region_read(0, 0x1ffc, &mut [0; 8]).is_err());
    assert!(dev.region_read(0, 0x2000 + 4 * 16 - 4, &mut [0; 8]).is_err());
    // Just after the table (inside the BAR) is the function's.
    dev.region_read(0, 0x2040, &mut [0; 4]).unwrap();
    assert_eq!(log(&dev), ["read 0 0x2040 4"]);

    let no_region = |r| matches!(r, Err(DeviceError::NoSuchRegion(_)));
    assert!(no_region(dev.region_read(1, 0, &mut [0; 4])), "empty slot");
    assert!(no_region(dev.region_read(3, 0, &mut [0; 4])), "upper half of BAR2");
    assert!(no_region(dev.region_read(VFIO_PCI_ROM_REGION_INDEX, 0, &mut [0; 4])));
    assert!(no_region(dev.region_write(VFIO_PCI_VGA_REGION_INDEX, 0, &[0; 4])));
    assert!(no_region(dev.region_read(9, 0, &mut [0; 4])));
    let bad = |r| matches!(r, Err(DeviceError::BadAccess { .. }));
    assert!(bad(dev.region_read(0, 0x3ffc, &mut [0; 8])));
    assert!(bad(dev.region_read(0, u64::MAX - 2, &mut [0; 8])));
    assert!(bad(dev.region_read(VFIO_PCI_CONFIG_REGION_INDEX, 0xfe, &mut [0; 4])));
    assert!(log(&dev).is_empty());

    // An access of no bytes in the MSI-X table (whose writes are otherwise aligned dwords or
    // qwords) or the PBA is accepted and does nothing; elsewhere in the BAR it is the
    // function's to judge.
    for offset in [0x2000, 0x2000 + 6, 0x3000] {
        dev.region_write(0, offset, &[]).unwrap();
        dev.region_read(0, offset, &mut []).unwrap();
    }
    assert!(log(&dev).is_empty());
    dev.region_write(0, 0x10, &[]).unwrap();
    assert_eq!(log(&dev), ["write 0 0x10 0"]);
    assert!(bad(dev.region_write(0, 0x4001, &[])), "past the BAR's end");
}

#[test]
fn config_writes_drive_interrupts() {
    let dev = device(None).unwrap();
    let irq = dev.irq_handle();
    let (msi_at, _) = dev.config().msi().unwrap();
    let msi_at = msi_at as u64;
    let fd = EventFd::new(EFD_NONBLOCK).unwrap();
    let data = IrqData::Eventfds(vec![fd.try_clone().unwrap()]);
    let req = SetIrqs { index: VFIO_PCI_MSI_IRQ_INDEX, start: 0, count: 1, action: IrqAction::Trigger, data };
    dev.set_irqs(req).unwrap();

    // INTx mode: asserting shows in STATUS.
    irq.intx_assert();
    assert_ne!(read_config(&dev, STATUS as u64, 2) & u32::from(STATUS_INTERRUPT), 0);
    irq.intx_deassert();

    // The guest enables MSI, with bus mastering still off: the message is held (it is a
    // bus-master write) and sent when the guest turns bus mastering on.
    dev.region_write(VFIO_PCI_CONFIG_REGION_INDEX, msi_at + 2, &MSI_CTRL_ENABLE.to_le_bytes()).unwrap();
    assert_eq!(irq.raise(0), Delivery::Pending);
    assert!(fd.read().is_err(), "no MSI with bus mastering off");
    assert!(!dev.bus_master());
    dev.region_write(VFIO_PCI_CONFIG_REGION_INDEX, COMMAND as u64, &[0x4, 0]).unwrap();
    assert!(dev.bus_master());
    assert_eq!(fd.read().unwrap(), 1, "delivered once bus mastering is on");
    assert_eq!(irq.raise(0), Delivery::Signalled);
    assert_eq!(fd.read().unwrap(), 1);

    // The guest masks vector 0 (mask register at +0xc for 32-bit MSI): pending shows at +0x10.
    dev.region_write(VFIO_PCI_CONFIG_REGION_INDEX, msi_at + 0xc, &1u32.to_le_bytes()).unwrap();
    assert_eq!(irq.raise(0), Delivery::Pending);
    assert_eq!(read_config(&dev, msi_at + 0x10, 4), 1);
    dev.region_write(VFIO_PCI_CONFIG_REGION_INDEX, msi_at + 0xc, &0u32.to_le_bytes()).unwrap();
    assert_eq!(fd.read().unwrap(), 1);
    assert_eq!(read_config(&dev, msi_at + 0x10, 4), 0);

    // A SET_IRQS MASK shows in the mask register, and a later config write that updates
    // the interrupt control (INTX_DISABLE here) keeps it.
    let req = SetIrqs {
        index: VFIO_PCI_MSI_IRQ_INDEX,
        start: 2,
        count: 1,
        action: IrqAction::Mask,
        data: IrqData::None,
    };
    dev.set_irqs(req).unwrap();
    assert_eq!(read_config(&dev, msi_at + 0xc, 4), 0b100);
    dev.region_write(VFIO_PCI_CONFIG_REGION_INDEX, COMMAND as u64, &[0x6, 0x4]).unwrap();
    assert_eq!(read_config(&dev, msi_at + 0xc, 4), 0b100);
    assert_eq!(dev.irq_handle().stats().msi, 3);
    // A reset clears COMMAND: bus mastering is off again.
    dev.reset().unwrap();
    assert!(!dev.bus_master());
}

#[test]
fn lifecycle_is_forwarded() {
    let dev = device(None).unwrap();
    let info = dev.device_info();
    assert_eq!(info.flags, DeviceFlags::PCI | DeviceFlags::RESET);
    dev.region_write(VFIO_PCI_CONFIG_REGION_INDEX, COMMAND as u64, &[0x7, 0]).unwrap();
    dev.irq_handle().intx_assert();

    dev.reset().unwrap();
    assert_eq!(log(&dev), ["reset"]);
    assert_eq!(read_config(&dev, COMMAND as u64, 2), 0);
    assert!(!dev.irq_handle().intx_asserted());

    dev.dma_unmap(0x1000, 0x2000);
    dev.detach();
    assert_eq!(log(&dev), ["unmap 0x1000 0x2000", "detach", "reset"]);
}

/// A client whose guest memory reads as zeros and takes every write.
struct Zeros;

impl crate::ClientDma for Zeros {
    fn read(
        &self,
        _iova: u64,
        buf: &mut [u8],
        _may_send: &dyn Fn(u64) -> bool,
    ) -> Result<(), crate::ClientDmaError> {
        buf.fill(0);
        Ok(())
    }
    fn write(
        &self,
        _iova: u64,
        _data: &[u8],
        _may_send: &dyn Fn(u64) -> bool,
    ) -> Result<(), crate::ClientDmaError> {
        Ok(())
    }
}

/// A request that reports nothing.
struct Quiet;

impl crate::request::Completion for Quiet {
    type Outcome = ();
    type Shared = ();
    fn complete(self, (): (), _ctx: &DeviceContext, (): &()) {}
    fn fail(self, _ctx: &DeviceContext, (): &()) {}
}

#[test]
fn a_reset_cancels_every_request_while_bus_mastering_is_still_on() {
    let mut requests = None;
    let dev = PciDevice::new(builder(), |host| {
        requests = Some(host.requests.clone());
        Memory::default()
    })
    .unwrap();
    let requests = requests.unwrap();
    dev.attach(DeviceContext::new(umdev_pinning::DmaSpace::default(), Arc::new(Zeros)));
    dev.region_write(VFIO_PCI_CONFIG_REGION_INDEX, COMMAND as u64, &4u16.to_le_bytes()).unwrap();
    // The lane's wake runs as the reset cancels its request: it notes whether bus mastering
    // was still on then. Off first, a guest access failing in between would be a request's
    // that was not yet cancelled, and reported (nvme logged it as a Data Transfer Error).
    let switch = requests.context().unwrap().bus_master_switch();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let lane = {
        let seen = seen.clone();
        requests.lane(move || seen.lock().unwrap().push(switch.enabled()))
    };
    let permit = lane.begin(Quiet).unwrap();
    assert!(permit.ctx().bus_master());
    dev.reset().unwrap();
    assert_eq!(permit.cancelled(), Some(crate::request::Cancel::Reset));
    assert_eq!(*seen.lock().unwrap(), [true], "cancelled while bus mastering was on");
    assert!(!permit.ctx().bus_master(), "and off after the reset");
}

/// A function that begins a request during its own reset, as a worker fetching the next
/// command of a burst may between the framework's cancellation and the function's reset.
struct BeginsInReset {
    lane: crate::request::Lane,
    seen: Mutex<Vec<Option<crate::request::Cancel>>>,
}

impl PciFunction for BeginsInReset {
    fn bar_read(&self, _bar: u8, _offset: u64, data: &mut [u8]) -> Result<(), DeviceError> {
        data.fill(0);
        Ok(())
    }

    fn bar_write(&self, _bar: u8, _offset: u64, _data: &[u8]) -> Result<(), DeviceError> {
        Ok(())
    }

    fn reset(&self) {
        let permit = self.lane.begin(Quiet).unwrap();
        self.seen.lock().unwrap().push(permit.cancelled());
    }
}

#[test]
fn a_request_begun_before_the_functions_reset_returns_is_cancelled_by_it() {
    let mut requests = None;
    let dev = PciDevice::new(builder(), |host| {
        requests = Some(host.requests.clone());
        BeginsInReset { lane: host.requests.lane(|| {}), seen: Mutex::new(Vec::new()) }
    })
    .unwrap();
    let requests = requests.unwrap();
    dev.attach(DeviceContext::new(umdev_pinning::DmaSpace::default(), Arc::new(Zeros)));
    dev.reset().unwrap();
    assert_eq!(*dev.function().seen.lock().unwrap(), [Some(crate::request::Cancel::Reset)]);
    // After the reset, requests begin as usual.
    let lane = requests.lane(|| {});
    assert_eq!(lane.begin(Quiet).unwrap().cancelled(), None);
}
