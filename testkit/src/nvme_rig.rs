//! The nvme controller in-process, for tests and the fuzz harness: a [`Rig`] serves it through
//! [`VfioDevice`] against a real [`DmaSpace`] over a memfd, with eventfds for interrupts, and
//! the testkit's NVMe `Driver` drives it.

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::FileExt;
use std::time::Duration;

use umdev_pinning::{DmaSpace, Prot};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use std::sync::Arc;

use crate::nvme_driver::{Driver, Transport};
use crate::NoClient;
use umdev_devices::nvme::ctrl::Ctrl;
use umdev_devices::nvme::namespace::Backing;
use umdev_devices::nvme::*;
use umdev_mdev::pci::regs::{
    CAPABILITY_LIST, CAP_ID_MSIX, COMMAND, COMMAND_MASTER, COMMAND_MEMORY, MSIX_CTRL_ENABLE,
};
use umdev_mdev::pci::PciDevice;
use umdev_mdev::{DeviceContext, IrqAction, IrqData, SetIrqs, VfioDevice};
use umdev_mdev::{VFIO_PCI_CONFIG_REGION_INDEX as CONFIG, VFIO_PCI_INTX_IRQ_INDEX, VFIO_PCI_MSIX_IRQ_INDEX};

/// Guest RAM: 128 MiB at IOVA 0.
pub const RAM_SIZE: u64 = 128 << 20;
/// Read-only guest memory, mapped after RAM.
pub const RO: u64 = RAM_SIZE;
/// Where the tests put command data in guest RAM.
pub const DATA: u64 = Driver::<Rig>::DATA;

/// The device, its guest RAM and DMA space, and one eventfd per MSI-X vector (or INTx).
pub struct Rig {
    /// The device, as the server holds it.
    pub dev: Arc<PciDevice<Nvme>>,
    /// Guest RAM, at IOVA 0.
    pub ram: File,
    /// Guest memory the device may read but not write, at [`RO`].
    pub ro: File,
    /// The client's DMA space.
    pub dma: DmaSpace,
    /// One eventfd per MSI-X vector, or the INTx one.
    pub irqs: Vec<EventFd>,
    /// MSI-X (else INTx).
    pub msix: bool,
}

/// A memfd of `size` bytes.
pub fn memfd(name: &std::ffi::CStr, size: u64) -> File {
    let file =
        File::from(nix::sys::memfd::memfd_create(name, nix::sys::memfd::MFdFlags::MFD_CLOEXEC).unwrap());
    file.set_len(size).unwrap();
    file
}

impl Rig {
    /// The device of `config`, its memory mapped, bus mastering and interrupts on (MSI-X with
    /// a vector per queue, or INTx), a client attached.
    pub fn with(config: NvmeConfig, msix: bool) -> Rig {
        Rig::with_dma(config, msix, DmaSpace::default())
    }

    /// The device on `dma` (a space in another pin mode, say).
    pub fn with_dma(config: NvmeConfig, msix: bool, dma: DmaSpace) -> Rig {
        let dev = Arc::new(create(config).unwrap());
        let ram = memfd(c"nvme-test-ram", RAM_SIZE);
        dma.map(0, RAM_SIZE, ram.as_fd(), 0, Prot::READ_WRITE).unwrap();
        let ro = memfd(c"nvme-test-ro", 1 << 20);
        dma.map(RO, 1 << 20, ro.as_fd(), 0, Prot::READ).unwrap();
        let command = u64::from(COMMAND_MEMORY | COMMAND_MASTER);
        dev.region_write(CONFIG, COMMAND as u64, &command.to_le_bytes()[..2]).unwrap();
        let mut rig = Rig { dev, ram, ro, dma, irqs: Vec::new(), msix };
        let vectors = if msix { u32::from(rig.dev.function().controller().io_queues()) + 1 } else { 1 };
        if msix {
            let cap = rig.cap(CAP_ID_MSIX);
            rig.dev.region_write(CONFIG, cap + 2, &MSIX_CTRL_ENABLE.to_le_bytes()).unwrap();
        }
        rig.irqs = (0..vectors).map(|_| EventFd::new(EFD_NONBLOCK).unwrap()).collect();
        let data = IrqData::Eventfds(rig.irqs.iter().map(|e| e.try_clone().unwrap()).collect());
        let index = if msix { VFIO_PCI_MSIX_IRQ_INDEX } else { VFIO_PCI_INTX_IRQ_INDEX };
        rig.dev
            .set_irqs(SetIrqs { index, start: 0, count: vectors, action: IrqAction::Trigger, data })
            .unwrap();
        rig.dev.attach(DeviceContext::new(rig.dma.clone(), Arc::new(NoClient)));
        // As the server does: an unmap of memory the device holds pins in tells the device.
        let weak = Arc::downgrade(&rig.dev);
        rig.dma.set_unmap_notifier(Some(Arc::new(move |iova, len| {
            if let Some(dev) = weak.upgrade() {
                dev.dma_unmap(iova, len);
            }
        })));
        rig
    }

    /// A controller with one 64 MiB RAM namespace and MSI-X.
    pub fn new() -> Rig {
        let config = NvmeConfig { namespaces: vec![Some(Backing::Ram(64 << 20))], ..NvmeConfig::default() };
        Rig::with(config, true)
    }

    /// The config-space offset of capability `id`.
    pub fn cap(&self, id: u8) -> u64 {
        let read = |at: u64| {
            let mut b = [0u8; 1];
            self.dev.region_read(CONFIG, at, &mut b).unwrap();
            u64::from(b[0])
        };
        let mut at = read(CAPABILITY_LIST as u64);
        while at != 0 {
            if read(at) == u64::from(id) {
                return at;
            }
            at = read(at + 1);
        }
        panic!("no capability {id:#x}");
    }

    /// Forgets interrupts so far and unmasks INTx, as the guest's handler does.
    pub fn eoi(&mut self) {
        for e in &self.irqs {
            let _ = e.read();
        }
        if !self.msix {
            let unmask = SetIrqs {
                index: VFIO_PCI_INTX_IRQ_INDEX,
                start: 0,
                count: 1,
                action: IrqAction::Unmask,
                data: IrqData::None,
            };
            self.dev.set_irqs(unmask).unwrap();
        }
    }

    /// The controller.
    pub fn ctrl(&self) -> &Ctrl {
        self.dev.function().controller()
    }
}

impl Default for Rig {
    fn default() -> Rig {
        Rig::new()
    }
}

impl Transport for Rig {
    fn read32(&mut self, offset: u64) -> Result<u32, String> {
        let mut b = [0u8; 4];
        self.dev.region_read(0, offset, &mut b).map_err(|e| e.to_string())?;
        Ok(u32::from_le_bytes(b))
    }
    fn write32(&mut self, offset: u64, value: u32) -> Result<(), String> {
        self.dev.region_write(0, offset, &value.to_le_bytes()).map_err(|e| e.to_string())
    }
    fn put(&mut self, addr: u64, bytes: &[u8]) -> Result<(), String> {
        self.ram.write_all_at(bytes, addr).map_err(|e| e.to_string())
    }
    fn get(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), String> {
        self.ram.read_exact_at(buf, addr).map_err(|e| e.to_string())
    }
    fn wait_interrupt(&mut self, vector: u16, timeout: Duration) -> Option<bool> {
        let efd = self.irqs.get(usize::from(vector)).or(self.irqs.first())?;
        // SAFETY: the eventfd outlives the borrow.
        let fd = unsafe { BorrowedFd::borrow_raw(efd.as_raw_fd()) };
        let mut fds = [nix::poll::PollFd::new(fd, nix::poll::PollFlags::POLLIN)];
        let ms = nix::poll::PollTimeout::try_from(timeout).unwrap_or(nix::poll::PollTimeout::MAX);
        let ready = nix::poll::poll(&mut fds, ms).unwrap_or(0) == 1;
        if ready {
            // INTx is masked when it fires (VFIO's automask): the guest's EOI unmasks.
            self.eoi();
        }
        Some(ready)
    }
}

/// A driver over `rig` with the controller enabled and `queues` I/O queue pairs of 64 entries.
pub fn up(rig: Rig, queues: u16) -> Driver<Rig> {
    let mut d = Driver::new(rig);
    d.enable().unwrap();
    if queues > 0 {
        d.create_io_queues(queues, 64, false).unwrap();
    }
    d
}

/// `len` bytes of a pattern that differs with `seed` and along the buffer.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 9) as u8).collect()
}
