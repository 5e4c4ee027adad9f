//! The device contract, as a test any [`VfioDevice`] can be run through: what `device.rs`
//! asks of a device, checked rather than written down.
//!
//! **Only with the `contract` feature** (this page is documented without it): a device's
//! tests turn it on with `umdev-mdev = { path = "...", features = ["contract"] }` under
//! `[dev-dependencies]`.
//!
//! [`check`] attaches the device to a DMA space with real guest RAM (a memfd) and a client
//! that counts server-to-client DMA, wires eventfds to every interrupt, and checks:
//!
//! 1. **Accesses.** Out-of-bounds and odd-width accesses to every region are refused, the
//!    declared widths accepted. Each register is written with `0x5a` bytes at each width it
//!    declares, doorbells included: a device that starts work on such a write must cope (its
//!    `make_busy` and the later checks come after a reset).
//! 2. **Reset** returns every readable register (but the ones the device names volatile:
//!    read side effects) and config space to their power-on values, disables interrupts
//!    (COMMAND, MSI and MSI-X enables back to 0) and drops the interrupt eventfds.
//! 3. **Bus mastering.** With COMMAND.BME clear, asking the device to reach guest memory
//!    (the device's [`Contract::touch_guest`]) pins nothing, copies nothing, sends no
//!    client DMA, and leaves guest RAM as it was.
//! 4. **DMA unmap.** With the device busy on guest memory ([`Contract::make_busy`]), an
//!    unmap of that memory lets go (the device drops its pins when notified) within a
//!    second.
//! 5. **Detach** drops every pin, every eventfd the device was given and every thread it
//!    started for the client.
//!
//! Fd and thread counts are process-wide: run the devices of one test one after the other
//! (as tests/contract.rs does), never beside other tests in the same process.

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use umdev_pinning::{DmaSpace, DmaSpaceConfig, Prot};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::device::{
    ClientDma, ClientDmaError, IrqAction, IrqData, SetIrqs, VfioDevice, VFIO_PCI_CONFIG_REGION_INDEX,
    VFIO_PCI_INTX_IRQ_INDEX, VFIO_PCI_MSIX_IRQ_INDEX, VFIO_PCI_MSI_IRQ_INDEX, VFIO_PCI_NUM_REGIONS,
};
use crate::guest::DeviceContext;

/// Guest RAM the check maps at IOVA 0.
pub const RAM_SIZE: u64 = 64 << 20;

/// A device's own way of doing something to guest memory, for the check to call.
pub type Hook = Box<dyn Fn(&Probe<'_>)>;

/// What a device tells the check about itself.
pub struct Contract {
    /// Accepted access widths of each BAR (region index), as documented; a region not
    /// listed is not probed for widths.
    pub widths: Vec<(u32, &'static [usize])>,
    /// Registers whose reads have side effects, as `(region, offset, len)`: not compared
    /// across a reset.
    pub volatile: Vec<(u32, u64, u64)>,
    /// Asks the device to reach guest memory (a command that reads or writes RAM), in the
    /// device's own way; used with bus mastering on and off.
    pub touch_guest: Option<Hook>,
    /// Makes the device hold pins in guest RAM (a long transfer), returning once it does;
    /// `None` if the device never holds pins across calls.
    pub make_busy: Option<Hook>,
}

/// The check's handles, for a device's hooks.
pub struct Probe<'a> {
    /// The device.
    pub device: &'a dyn VfioDevice,
    /// The client's DMA space.
    pub dma: &'a DmaSpace,
    /// Guest RAM, mapped at IOVA 0.
    pub ram: &'a File,
}

impl Probe<'_> {
    /// Writes a register of `region`.
    pub fn write(&self, region: u32, offset: u64, data: &[u8]) {
        self.device
            .region_write(region, offset, data)
            .unwrap_or_else(|e| panic!("write {region}@{offset:#x}: {e}"));
    }

    /// Reads a register of `region`.
    pub fn read(&self, region: u32, offset: u64, data: &mut [u8]) {
        self.device
            .region_read(region, offset, data)
            .unwrap_or_else(|e| panic!("read {region}@{offset:#x}: {e}"));
    }

    /// Writes a 32-bit little-endian register.
    pub fn write32(&self, region: u32, offset: u64, value: u32) {
        self.write(region, offset, &value.to_le_bytes());
    }

    /// Reads a 32-bit little-endian register.
    pub fn read32(&self, region: u32, offset: u64) -> u32 {
        let mut b = [0u8; 4];
        self.read(region, offset, &mut b);
        u32::from_le_bytes(b)
    }

    /// Waits up to 5 s for `done`.
    pub fn wait(&self, what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !done() {
            assert!(Instant::now() < deadline, "{what}: timed out");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// A client that counts the server-to-client DMA a device asks for, and refuses it.
#[derive(Default)]
struct CountingClient {
    requests: AtomicU64,
}

impl ClientDma for CountingClient {
    fn read(
        &self,
        _iova: u64,
        _buf: &mut [u8],
        _may_send: &dyn Fn(u64) -> bool,
    ) -> Result<(), ClientDmaError> {
        self.requests.fetch_add(1, Ordering::Relaxed);
        Err(ClientDmaError::Refused(libc::EIO))
    }
    fn write(&self, _iova: u64, _data: &[u8], _may_send: &dyn Fn(u64) -> bool) -> Result<(), ClientDmaError> {
        self.requests.fetch_add(1, Ordering::Relaxed);
        Err(ClientDmaError::Refused(libc::EIO))
    }
}

fn count_dir(dir: &str) -> usize {
    std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}

fn config_read(device: &dyn VfioDevice, offset: u64, len: usize) -> u64 {
    let mut b = [0u8; 8];
    device.region_read(VFIO_PCI_CONFIG_REGION_INDEX, offset, &mut b[..len]).expect("config read");
    u64::from_le_bytes(b)
}

fn config_write(device: &dyn VfioDevice, offset: u64, len: usize, value: u64) {
    device
        .region_write(VFIO_PCI_CONFIG_REGION_INDEX, offset, &value.to_le_bytes()[..len])
        .expect("config write");
}

/// The capabilities on the config space's list: `(id, offset)`.
fn capabilities(device: &dyn VfioDevice) -> Vec<(u8, u64)> {
    let mut caps = Vec::new();
    if config_read(device, 6, 2) & 0x10 == 0 {
        return caps;
    }
    let mut ptr = config_read(device, 0x34, 1);
    while ptr != 0 && caps.len() < 48 {
        caps.push((config_read(device, ptr, 1) as u8, ptr));
        ptr = config_read(device, ptr + 1, 1);
    }
    caps
}

/// Every readable byte of config space and the BARs (message-accessed parts), but the
/// volatile registers.
fn snapshot(device: &dyn VfioDevice, contract: &Contract) -> Vec<(u32, u64, u8)> {
    let mut bytes = Vec::new();
    for region in 0..VFIO_PCI_NUM_REGIONS {
        let Some(info) = device.region_info(region) else { continue };
        let Some(&(_, widths)) = contract.widths.iter().find(|(r, _)| *r == region) else { continue };
        if info.size == 0 || region == VFIO_PCI_CONFIG_REGION_INDEX {
            continue;
        }
        let width = *widths.iter().max().unwrap_or(&4) as u64;
        let mut offset = 0;
        while offset + width <= info.size {
            let volatile = contract
                .volatile
                .iter()
                .any(|&(r, o, l)| r == region && offset < o + l && o < offset + width);
            let mut b = vec![0u8; width as usize];
            if !volatile && device.region_read(region, offset, &mut b).is_ok() {
                bytes.extend(b.iter().enumerate().map(|(i, &v)| (region, offset + i as u64, v)));
            }
            offset += width;
        }
    }
    let size = device.region_info(VFIO_PCI_CONFIG_REGION_INDEX).map_or(256, |i| i.size);
    for offset in (0..size).step_by(4) {
        let v = config_read(device, offset, 4) as u32;
        bytes.extend(
            v.to_le_bytes()
                .iter()
                .enumerate()
                .map(|(i, &b)| (VFIO_PCI_CONFIG_REGION_INDEX, offset + i as u64, b)),
        );
    }
    bytes
}

fn eventfds(device: &dyn VfioDevice) -> Vec<(u32, EventFd)> {
    let mut wired = Vec::new();
    for index in [VFIO_PCI_INTX_IRQ_INDEX, VFIO_PCI_MSI_IRQ_INDEX, VFIO_PCI_MSIX_IRQ_INDEX] {
        let count = device.irq_info(index).map_or(0, |i| i.count);
        if count == 0 {
            continue;
        }
        let fds: Vec<EventFd> = (0..count).map(|_| EventFd::new(EFD_NONBLOCK).expect("eventfd")).collect();
        let data = IrqData::Eventfds(fds.iter().map(|f| f.try_clone().expect("dup")).collect());
        device
            .set_irqs(SetIrqs { index, start: 0, count, action: IrqAction::Trigger, data })
            .expect("wiring interrupts");
        wired.extend(fds.into_iter().map(|f| (index, f)));
    }
    wired
}

/// Runs `device` through the contract. Panics with what was broken.
pub fn check(device: Arc<dyn VfioDevice>, contract: &Contract) {
    let name = format!("{:?}", device.device_info());
    let baseline = (count_dir("/proc/self/fd"), count_dir("/proc/self/task"));

    let ram = File::from(
        nix::sys::memfd::memfd_create(c"umdev-contract-ram", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
            .expect("memfd"),
    );
    ram.set_len(RAM_SIZE).expect("RAM");
    let dma = DmaSpace::new(DmaSpaceConfig { unmap_timeout: Duration::from_secs(1), ..Default::default() });
    dma.map(0, RAM_SIZE, ram.as_fd(), 0, Prot::READ_WRITE).expect("mapping RAM");
    let client = Arc::new(CountingClient::default());
    let weak = Arc::downgrade(&device);
    dma.set_unmap_notifier(Some(Arc::new(move |iova, len| {
        if let Some(d) = weak.upgrade() {
            d.dma_unmap(iova, len);
        }
    })));
    device.attach(DeviceContext::new(dma.clone(), client.clone()));
    let probe = Probe { device: &*device, dma: &dma, ram: &ram };

    // 1. Accesses: bounds and widths.
    for region in 0..VFIO_PCI_NUM_REGIONS {
        let Some(info) = device.region_info(region) else { continue };
        if info.size == 0 {
            continue;
        }
        let mut b = [0u8; 16];
        assert!(
            device.region_read(region, info.size, &mut b[..1]).is_err(),
            "{name}: region {region}: a read past the end"
        );
        assert!(
            device.region_write(region, info.size - 1, &b[..2]).is_err(),
            "{name}: region {region}: a write across the end"
        );
        assert!(
            device.region_read(region, u64::MAX, &mut b[..1]).is_err(),
            "{name}: region {region}: a wrapping read"
        );
        if let Some(&(_, widths)) = contract.widths.iter().find(|(r, _)| *r == region) {
            for len in 1..=16usize {
                if len as u64 > info.size {
                    break;
                }
                let ok = device.region_read(region, 0, &mut b[..len]).is_ok();
                assert_eq!(ok, widths.contains(&len), "{name}: region {region}: a {len}-byte read at 0");
            }
        }
    }

    // 2. Reset: power-on registers, interrupts off, eventfds dropped.
    let power_on = snapshot(&*device, contract);
    let wired = eventfds(&*device);
    config_write(&*device, 4, 2, 0x0007);
    for (id, at) in capabilities(&*device) {
        match id {
            0x05 => config_write(&*device, at + 2, 2, 0x0001), // MSI enable
            0x11 => config_write(&*device, at + 2, 2, 0x8000), // MSI-X enable
            _ => {}
        }
    }
    for &(region, widths) in &contract.widths {
        let Some(info) = device.region_info(region) else { continue };
        let width = *widths.iter().max().unwrap_or(&4);
        let mut offset = 0u64;
        while offset + width as u64 <= info.size.min(0x800) {
            let volatile = contract
                .volatile
                .iter()
                .any(|&(r, o, l)| r == region && offset < o + l && o < offset + width as u64);
            if !volatile {
                let _ = device.region_write(region, offset, &vec![0x5a; width]);
            }
            offset += width as u64;
        }
    }
    if let Some(touch) = &contract.touch_guest {
        touch(&probe);
    }
    device.reset().expect("DEVICE_RESET");
    let after = snapshot(&*device, contract);
    assert_eq!(
        power_on.len(),
        after.len(),
        "{name}: the registers readable at power-on and after reset differ"
    );
    for (a, b) in power_on.iter().zip(&after) {
        assert_eq!(a, b, "{name}: region {} byte {:#x} after reset (power-on {:#04x})", b.0, b.1, a.2);
    }
    assert_eq!(config_read(&*device, 4, 2), 0, "{name}: COMMAND after reset");
    for (id, at) in capabilities(&*device) {
        if id == 0x05 || id == 0x11 {
            let control = config_read(&*device, at + 2, 2);
            let enable = if id == 0x05 { 0x0001 } else { 0x8000 };
            assert_eq!(control & enable, 0, "{name}: capability {id:#x} enabled after reset");
        }
    }
    // The eventfds were dropped: whatever the device raises now reaches none of them.
    for (_, fd) in &wired {
        let _ = fd.read();
    }
    config_write(&*device, 4, 2, 0x0007);
    if let Some(touch) = &contract.touch_guest {
        touch(&probe);
    }
    for (index, fd) in &wired {
        assert!(fd.read().is_err(), "{name}: an eventfd of IRQ index {index} survived the reset");
    }
    drop(wired);

    // 3. Bus mastering off: no guest access at all.
    if let Some(touch) = &contract.touch_guest {
        device.reset().expect("DEVICE_RESET");
        config_write(&*device, 4, 2, 0x0003); // I/O and memory decode, no bus master
        let mut before = vec![0u8; 1 << 20];
        ram.read_exact_at(&mut before, 0).expect("RAM");
        let (pins, requests) = (dma.stats().pin_calls, client.requests.load(Ordering::Relaxed));
        touch(&probe);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(dma.stats().pin_calls, pins, "{name}: pinned with bus mastering off");
        assert_eq!(
            client.requests.load(Ordering::Relaxed),
            requests,
            "{name}: client DMA with bus mastering off"
        );
        let mut now = vec![0u8; 1 << 20];
        ram.read_exact_at(&mut now, 0).expect("RAM");
        assert!(now == before, "{name}: guest RAM changed with bus mastering off");
    }

    // 4. DMA unmap while busy: the device lets go within its bound.
    if let Some(busy) = &contract.make_busy {
        device.reset().expect("DEVICE_RESET");
        config_write(&*device, 4, 2, 0x0007);
        busy(&probe);
        // A hook that returns once the work is done tests nothing below.
        assert!(dma.stats().pins_held > 0, "{name}: make_busy returned with no pin held");
        let started = Instant::now();
        let unmapped = dma.unmap(0, RAM_SIZE);
        assert!(unmapped.is_ok(), "{name}: unmap of memory in use: {unmapped:?}");
        assert!(started.elapsed() < Duration::from_secs(1), "{name}: the unmap took {:?}", started.elapsed());
        dma.map(0, RAM_SIZE, ram.as_fd(), 0, Prot::READ_WRITE).expect("remapping RAM");
        config_write(&*device, 4, 2, 0x0007);
        busy(&probe);
    }

    // 5. Detach: no pin, eventfd or client thread left.
    let wired = eventfds(&*device);
    device.detach();
    dma.set_unmap_notifier(None);
    assert_eq!(dma.stats().pins_held, 0, "{name}: pins held after detach");
    for (_, fd) in &wired {
        let _ = fd.read();
    }
    drop(wired);
    dma.unmap_all().expect("unmapping RAM");
    drop((dma, ram, client));
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let now = (count_dir("/proc/self/fd"), count_dir("/proc/self/task"));
        if now.0 <= baseline.0 && now.1 <= baseline.1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{name}: after detach {now:?} fds and threads, {baseline:?} before attach"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}
