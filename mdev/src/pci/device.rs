//! [`PciFunction`], what a device author writes, and [`PciDevice`], the adapter that turns
//! it into a [`VfioDevice`] with config space, interrupts and MSI-X emulated.
//!
//! Locking: config space has its own mutex, the interrupts theirs (taken after the config
//! lock when a config write changes interrupt control, never the other way round), and the
//! function its own. No lock of the adapter is held while the function runs, so a
//! function's worker threads may raise interrupts while the server thread is in a region
//! access.

use std::sync::{Mutex, MutexGuard};

use thiserror::Error;
use umdev_pinning::PAGE_SIZE;

use super::caps::MsixCap;
use super::config::{ConfigChanges, ConfigError, ConfigSpace, ConfigSpaceBuilder};
use super::regs::{NUM_BARS, STATUS, STATUS_INTERRUPT};
use crate::device::{
    ClientHello, DeviceError, DeviceFlags, DeviceInfo, IrqInfo, RegionFlags, RegionInfo, RegionMmap, SetIrqs,
    VfioDevice, VFIO_PCI_CONFIG_REGION_INDEX, VFIO_PCI_NUM_IRQS, VFIO_PCI_NUM_REGIONS,
};
use crate::guest::{BusMaster, DeviceContext};
use crate::irq::{Interrupts, IrqHandle, IrqLayout, MsiLayout};
use crate::request::Requests;

/// How long a detach waits for the function's requests to end.
const DETACH_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// What the framework builds a function with: its interrupts, and the tracker of its
/// requests (which also holds the client's context while one is attached).
#[derive(Clone, Debug)]
pub struct Host {
    /// Raises the function's interrupts on whatever the guest enabled.
    pub irq: IrqHandle,
    /// The function's requests: hand each worker a [`Requests::lane`].
    pub requests: Requests,
}

/// The device-specific part of a PCI function: its BARs' registers and its work.
///
/// BAR accesses arrive bounds-checked against the BAR's size and never for the MSI-X
/// table or PBA, which the adapter emulates; every other offset of the BAR that holds them
/// does arrive (see [`ConfigSpaceBuilder::msix`]). All methods take `&self` and may be called
/// while the function's own threads run. They run on the instance's connection thread, the
/// one that reads the client's messages: none may reach memory the client mapped without an
/// fd (its reply would come through this thread; the copy fails with
/// `ClientDmaError::WouldDeadlock`).
pub trait PciFunction: Send + Sync + 'static {
    /// Reads `data.len()` bytes at `offset` in BAR `bar`.
    fn bar_read(&self, bar: u8, offset: u64, data: &mut [u8]) -> Result<(), DeviceError>;

    /// Writes `data` at `offset` in BAR `bar`.
    fn bar_write(&self, bar: u8, offset: u64, data: &[u8]) -> Result<(), DeviceError>;

    /// How the client may mmap BAR `bar`, if at all. Asked at construction, where the layout
    /// is checked (the areas must be page aligned and keep clear of the MSI-X table and PBA
    /// pages), and again at each region-info request for the file to send: a device gives
    /// each client a file of its own ([`crate::region_memfd`], a new one at
    /// [`PciFunction::detach`]), so that a client that left cannot reach the next one's. The
    /// offset and areas must stay as they were at construction; `None` at a region-info
    /// request (a new file could not be made) offers that client no mmap of the BAR.
    fn bar_mmap(&self, bar: u8) -> Option<RegionMmap> {
        let _ = bar;
        None
    }

    /// A client connected and sent its VERSION (`hello`), before it may ask for any region
    /// info; [`PciFunction::offer_mmap`] is asked right after. The default does nothing.
    fn client_version(&self, hello: &ClientHello) {
        let _ = hello;
    }

    /// Whether the client that just sent `hello` is offered BAR `bar`'s mmap (one
    /// [`PciFunction::bar_mmap`] described). Asked at each client's VERSION, for each BAR with
    /// an mmap; the answer holds for the whole connection. Without a VERSION (a device driven
    /// in process) every mmap is offered. The default offers it to every client.
    fn offer_mmap(&self, bar: u8, hello: &ClientHello) -> bool {
        let _ = (bar, hello);
        true
    }

    /// DEVICE_RESET (also run on detach): stop work, back to the power-on state. Every
    /// request in flight is already cancelled, and reports nothing when it ends
    /// ([`crate::request`], "What a request cancelled by a reset reports"); so is every
    /// request a worker begins until this returns (make the old work stale here); the adapter
    /// resets config space and interrupts right after.
    fn reset(&self) {}

    /// A client connected. Its context is the framework's ([`Host::requests`] hands it to
    /// each request); this is for devices with state of their own to set up.
    fn attach(&self, ctx: &DeviceContext) {
        let _ = ctx;
    }

    /// The client is gone: every request is cancelled and no new one can start; stop the
    /// work that is not a request (queues, timers). The framework then waits (boundedly) for
    /// the requests to end, and a reset follows.
    fn detach(&self) {}

    /// The mapping `[iova, iova + len)` is being unmapped while pins are held in it (called
    /// only then, and with the whole mapping, which may be larger than the range the client
    /// unmapped). Requests holding pins or claims in it are already cancelled; this is for
    /// pins the device keeps outside requests (a ring it keeps pinned, say): drop them
    /// promptly. Runs on the connection thread.
    fn dma_unmap(&self, iova: u64, len: u64) {
        let _ = (iova, len);
    }

    /// What `umdev list --json` shows of the device (see [`VfioDevice::describe`]).
    fn describe(&self) -> serde_json::Value {
        serde_json::Value::Null
    }

    /// The guest turned bus mastering on or off (COMMAND.BME). Guest access is already
    /// gated by the context; a device whose workers wait for it to come back wakes them.
    fn bus_master_changed(&self, on: bool) {
        let _ = on;
    }
}

/// Why a [`PciDevice`] cannot be built.
#[derive(Debug, Error)]
pub enum PciDeviceError {
    /// The config-space declaration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A BAR's mmap description is unusable.
    #[error("BAR {bar}: mmap {why}")]
    BadMmap {
        /// The BAR.
        bar: u8,
        /// What is wrong.
        why: &'static str,
    },
}

/// A [`PciFunction`] with emulated config space, interrupts and MSI-X table/PBA, serving
/// the [`VfioDevice`] interface.
pub struct PciDevice<F> {
    config: Mutex<ConfigSpace>,
    /// COMMAND.BME, shared with every context handed to the function.
    bus_master: BusMaster,
    irqs: Interrupts,
    requests: Requests,
    function: F,
    regions: Vec<RegionInfo>,
    /// BARs whose mmap the current client is not offered (bit per BAR).
    mmap_withheld: std::sync::atomic::AtomicU8,
    msix: Option<MsixCap>,
    /// Held for the device's life and dropped with it: the capacity an instance takes from
    /// its type's pool ([`crate::types::Reservation`]), say.
    held: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl<F: PciFunction> PciDevice<F> {
    /// Builds the config space, the interrupts, and the function (`make` receives its
    /// [`Host`]).
    pub fn new(builder: ConfigSpaceBuilder, make: impl FnOnce(Host) -> F) -> Result<Self, PciDeviceError> {
        Self::try_new(builder, |host| Ok::<_, PciDeviceError>(make(host)))
    }

    /// As [`PciDevice::new`], for functions whose construction can fail.
    pub fn try_new<E: From<PciDeviceError>>(
        builder: ConfigSpaceBuilder,
        make: impl FnOnce(Host) -> Result<F, E>,
    ) -> Result<Self, E> {
        let config = builder.build().map_err(PciDeviceError::from)?;
        let irqs = Interrupts::new(IrqLayout {
            intx: config.interrupt_pin() != 0,
            msi: config
                .msi()
                .map(|(_, m)| MsiLayout { vectors: m.vectors, per_vector_mask: m.per_vector_mask }),
            msix: config.msix().map(|(_, m)| m.vectors),
        });
        let requests = Requests::new();
        let function = make(Host { irq: irqs.handle(), requests: requests.clone() })?;
        let msix = config.msix().map(|(_, m)| m);
        let mut regions: Vec<RegionInfo> = (0..VFIO_PCI_NUM_REGIONS).map(|_| RegionInfo::absent()).collect();
        for (index, region) in regions.iter_mut().enumerate().take(NUM_BARS) {
            let Some(bar) = config.bar(index) else { continue };
            *region = RegionInfo::read_write(bar.size());
            if let Some(mmap) = function.bar_mmap(index as u8) {
                check_mmap(index as u8, bar.size(), bar.is_io(), &mmap, msix.as_ref()).map_err(E::from)?;
                // Only the flag is kept: the file is asked for at each region-info request
                // (a function gives each client its own; holding the first would keep it open).
                region.flags |= RegionFlags::MMAP;
            }
        }
        regions[VFIO_PCI_CONFIG_REGION_INDEX as usize] = RegionInfo::read_write(config.size() as u64);
        let bus_master = BusMaster::new(config.bus_master());
        Ok(PciDevice {
            config: Mutex::new(config),
            bus_master,
            irqs,
            requests,
            function,
            regions,
            mmap_withheld: std::sync::atomic::AtomicU8::new(0),
            msix,
            held: None,
        })
    }

    /// The device, keeping `value` alive until it drops (an instance's share of its type's
    /// capacity, released when the instance goes).
    pub fn holding(mut self, value: impl std::any::Any + Send + Sync) -> Self {
        self.held = Some(Box::new(value));
        self
    }

    /// The function.
    pub fn function(&self) -> &F {
        &self.function
    }

    /// Another interrupt handle (for tests and statistics).
    pub fn irq_handle(&self) -> IrqHandle {
        self.irqs.handle()
    }

    fn config(&self) -> MutexGuard<'_, ConfigSpace> {
        // Config space is plain bytes, consistent after any panic of a holder.
        umdev_pinning::sync::lock(&self.config)
    }

    /// Reads config space; the registers the interrupt layer owns (STATUS.INTERRUPT, MSI
    /// Mask and Pending Bits) are answered from it.
    fn config_read(&self, offset: u64, data: &mut [u8]) -> Result<(), DeviceError> {
        let config = self.config();
        config
            .read(offset, data)
            .map_err(|_| bad_access(VFIO_PCI_CONFIG_REGION_INDEX, offset, data.len()))?;
        let status = self.irqs.status();
        let mut sts = config.status() & !STATUS_INTERRUPT;
        if status.intx_asserted {
            sts |= STATUS_INTERRUPT;
        }
        overlay(data, offset, STATUS as u64, &sts.to_le_bytes());
        let owned = config.irq_registers();
        if let Some(at) = owned.msi_mask {
            overlay(data, offset, at as u64, &(status.msi_mask & owned.msi_vector_bits).to_le_bytes());
        }
        if let Some(at) = owned.msi_pending {
            overlay(data, offset, at as u64, &(status.msi_pending & owned.msi_vector_bits).to_le_bytes());
        }
        Ok(())
    }

    /// Writes config space; a write to the MSI Mask Bits goes to the interrupt layer, which
    /// owns them (config space stores none of their bits).
    fn config_write(&self, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        let mut config = self.config();
        let changes = config
            .write(offset, data)
            .map_err(|_| bad_access(VFIO_PCI_CONFIG_REGION_INDEX, offset, data.len()))?;
        if let Some(at) = config.irq_registers().msi_mask {
            let mut mask = self.irqs.status().msi_mask.to_le_bytes();
            if underlay(&mut mask, offset, at as u64, data) {
                self.irqs.set_msi_mask(u32::from_le_bytes(mask));
            }
        }
        let bus_master_changed = changes.contains(ConfigChanges::COMMAND) && {
            let (was, is) = (self.bus_master.enabled(), config.bus_master());
            self.bus_master.set(is);
            was != is
        };
        if changes.affects_interrupts() {
            self.irqs.apply_control(config.irq_control());
        }
        if changes.contains(ConfigChanges::POWER_STATE) {
            log::debug!("power state D{}", config.power_state());
        }
        let on = config.bus_master();
        drop(config);
        if bus_master_changed {
            self.function.bus_master_changed(on);
        }
        Ok(())
    }

    /// Routes a BAR access: bounds, then the MSI-X table or PBA, then the function.
    fn bar_access(&self, index: u32, offset: u64, access: Access<'_>) -> Result<(), DeviceError> {
        let size = self.regions[index as usize].size;
        let len = access.len();
        if size == 0 {
            return Err(DeviceError::NoSuchRegion(index));
        }
        let end = offset.checked_add(len as u64).filter(|&end| end <= size);
        let Some(end) = end else { return Err(bad_access(index, offset, len)) };
        if let Some(msix) = self.msix {
            let table = (msix.table_bar, u64::from(msix.table_offset), msix.table_size());
            let pba = (msix.pba_bar, u64::from(msix.pba_offset), msix.pba_size());
            for (is_table, (bar, start, size)) in [(true, table), (false, pba)] {
                if u32::from(bar) != index || offset >= start + size {
                    continue;
                }
                if len == 0 {
                    // No bytes at an offset in the table or the PBA: nothing to do
                    // (docs/vfio-user.md); elsewhere the function's rules apply.
                    if offset >= start {
                        return Ok(());
                    }
                    continue;
                }
                if end <= start {
                    continue;
                }
                if offset < start || end > start + size {
                    return Err(bad_access(index, offset, len)); // straddles the structure
                }
                let at = offset - start;
                let result = match (is_table, access) {
                    (true, Access::Read(data)) => self.irqs.msix_table_read(at, data),
                    (true, Access::Write(data)) => self.irqs.msix_table_write(at, data),
                    (false, Access::Read(data)) => self.irqs.msix_pba_read(at, data),
                    (false, Access::Write(_)) => {
                        log::debug!("ignoring a write to the MSI-X PBA at {at:#x}");
                        Ok(())
                    }
                };
                return result.map_err(|_| bad_access(index, offset, len));
            }
        }
        match access {
            Access::Read(data) => self.function.bar_read(index as u8, offset, data),
            Access::Write(data) => self.function.bar_write(index as u8, offset, data),
        }
    }

    /// Bus mastering off and every interrupt held, until the reset that follows: from here on
    /// the function starts no guest access (its requests stop at their next block) and
    /// raises nothing, whatever its requests do as they end.
    fn quiesce(&self) {
        self.bus_master.set(false);
        self.irqs.quiesce();
    }

    fn reset_all(&self) {
        // Cancelled before bus mastering goes off: a request whose guest access fails from
        // then on is one the reset cancelled, which reports nothing (a Data Transfer Error
        // in nvme's error log, say, for a command the guest reset away). So is one a worker
        // begins before the function's reset below makes its work stale.
        let resetting = self.requests.resetting();
        self.quiesce();
        // A panic here still ends the window (the guard's drop).
        self.function.reset();
        drop(resetting);
        self.irqs.reset();
        let mut config = self.config();
        config.reset();
        self.bus_master.set(config.bus_master());
    }

    /// Whether the guest has bus mastering on (COMMAND.BME).
    pub fn bus_master(&self) -> bool {
        self.bus_master.enabled()
    }
}

/// Copies the bytes of register `reg` (at `reg_at`) that fall inside an access of
/// `data.len()` bytes at `offset` into `data`.
fn overlay(data: &mut [u8], offset: u64, reg_at: u64, reg: &[u8]) {
    for (i, byte) in data.iter_mut().enumerate() {
        let at = offset + i as u64;
        if at >= reg_at && at < reg_at + reg.len() as u64 {
            *byte = reg[(at - reg_at) as usize];
        }
    }
}

/// The opposite of [`overlay`]: takes the bytes of a write of `data` at `offset` that fall
/// inside register `reg` (at `reg_at`); true if any did.
fn underlay(reg: &mut [u8], offset: u64, reg_at: u64, data: &[u8]) -> bool {
    let mut hit = false;
    for (i, &byte) in data.iter().enumerate() {
        let at = offset + i as u64;
        if at >= reg_at && at < reg_at + reg.len() as u64 {
            reg[(at - reg_at) as usize] = byte;
            hit = true;
        }
    }
    hit
}

/// A region access's direction and buffer.
enum Access<'a> {
    Read(&'a mut [u8]),
    Write(&'a [u8]),
}

impl Access<'_> {
    fn len(&self) -> usize {
        match self {
            Access::Read(data) => data.len(),
            Access::Write(data) => data.len(),
        }
    }
}

fn bad_access(region: u32, offset: u64, len: usize) -> DeviceError {
    DeviceError::BadAccess { region, offset, len: len as u64 }
}

/// Checks a function's mmap description of BAR `bar`.
fn check_mmap(
    bar: u8,
    bar_size: u64,
    is_io: bool,
    mmap: &RegionMmap,
    msix: Option<&MsixCap>,
) -> Result<(), PciDeviceError> {
    let bad = |why| Err(PciDeviceError::BadMmap { bar, why });
    if is_io {
        return bad("of an I/O BAR");
    }
    // The MSI-X structures in this BAR, rounded out to pages: no area may map them.
    let reserved: Vec<(u64, u64)> = msix
        .map(|m| [(m.table_bar, m.table_offset, m.table_size()), (m.pba_bar, m.pba_offset, m.pba_size())])
        .into_iter()
        .flatten()
        .filter(|&(b, _, _)| b == bar)
        .map(|(_, offset, size)| {
            let start = u64::from(offset) / PAGE_SIZE * PAGE_SIZE;
            (start, (u64::from(offset) + size).next_multiple_of(PAGE_SIZE))
        })
        .collect();
    if mmap.areas.is_empty() {
        if !reserved.is_empty() {
            return bad("covers the whole BAR, which holds the MSI-X table or PBA: list sparse areas");
        }
        return Ok(());
    }
    for area in &mmap.areas {
        if area.offset % PAGE_SIZE != 0 || area.size % PAGE_SIZE != 0 || area.size == 0 {
            return bad("area is empty or not page aligned");
        }
        let Some(end) = area.offset.checked_add(area.size).filter(|&end| end <= bar_size) else {
            return bad("area extends past the BAR");
        };
        if reserved.iter().any(|&(start, stop)| area.offset < stop && start < end) {
            return bad("area covers the MSI-X table or PBA");
        }
    }
    Ok(())
}

impl<F: PciFunction> VfioDevice for PciDevice<F> {
    fn device_info(&self) -> DeviceInfo {
        DeviceInfo {
            flags: DeviceFlags::PCI | DeviceFlags::RESET,
            num_regions: VFIO_PCI_NUM_REGIONS,
            num_irqs: VFIO_PCI_NUM_IRQS,
        }
    }

    fn region_info(&self, index: u32) -> Option<RegionInfo> {
        let mut info = self.regions.get(index as usize).cloned()?;
        let withheld = self.mmap_withheld.load(std::sync::atomic::Ordering::Acquire);
        if (index as usize) < NUM_BARS && withheld & 1 << index != 0 {
            info.flags.remove(RegionFlags::MMAP);
            info.mmap = None;
        }
        // The file as the function has it now: it may give each client its own.
        if info.flags.contains(RegionFlags::MMAP) {
            info.mmap = self.function.bar_mmap(index as u8);
            if info.mmap.is_none() {
                info.flags.remove(RegionFlags::MMAP);
            }
        }
        Some(info)
    }

    fn client_version(&self, hello: &ClientHello) {
        self.function.client_version(hello);
        let mut withheld = 0u8;
        for (bar, region) in self.regions.iter().enumerate().take(NUM_BARS) {
            if region.flags.contains(RegionFlags::MMAP) && !self.function.offer_mmap(bar as u8, hello) {
                withheld |= 1 << bar;
            }
        }
        self.mmap_withheld.store(withheld, std::sync::atomic::Ordering::Release);
    }

    fn region_read(&self, index: u32, offset: u64, data: &mut [u8]) -> Result<(), DeviceError> {
        match index {
            VFIO_PCI_CONFIG_REGION_INDEX => self.config_read(offset, data),
            i if (i as usize) < NUM_BARS => self.bar_access(i, offset, Access::Read(data)),
            i => Err(DeviceError::NoSuchRegion(i)),
        }
    }

    fn region_write(&self, index: u32, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        match index {
            VFIO_PCI_CONFIG_REGION_INDEX => self.config_write(offset, data),
            i if (i as usize) < NUM_BARS => self.bar_access(i, offset, Access::Write(data)),
            i => Err(DeviceError::NoSuchRegion(i)),
        }
    }

    fn irq_info(&self, index: u32) -> Option<IrqInfo> {
        self.irqs.info(index)
    }

    fn set_irqs(&self, request: SetIrqs) -> Result<(), DeviceError> {
        self.irqs.set_irqs(request)
    }

    fn reset(&self) -> Result<(), DeviceError> {
        self.reset_all();
        Ok(())
    }

    fn attach(&self, context: DeviceContext) {
        // Every guest access the function makes through this context follows COMMAND.BME.
        let context = context.with_bus_master(self.bus_master.clone());
        self.requests.attach(context.clone());
        // A function that panics here is logged, and the connection is served all the same:
        // the framework's side of the attach is done.
        crate::request::serve("the device's attach", || self.function.attach(&context));
    }

    fn detach(&self) {
        // What a cancelled request does before it ends must not reach the guest: the
        // connection's memory and eventfds are still there until the reset below. Cancelled
        // first, as in a reset: what fails once they are cut off was cancelled, and reports
        // nothing.
        self.requests.detach();
        self.quiesce();
        // A panic here must not skip the wait and the reset below.
        crate::request::serve("the device's detach", || self.function.detach());
        // Cancelled requests end at their next block, and client DMA fails at once now that
        // the connection is closed: wait for them to let go of the client's context, so
        // nothing of the connection outlives it.
        if !self.requests.wait_idle(DETACH_WAIT) {
            log::warn!(
                "{} request(s) still running {DETACH_WAIT:?} after a detach",
                self.requests.in_flight()
            );
        }
        self.reset_all();
    }

    fn dma_unmapped(&self, iova: u64, len: u64) {
        // Requests that only claimed the range hold no pins for the engine to report.
        self.requests.cancel_overlapping(iova, len);
    }

    fn dma_unmap(&self, iova: u64, len: u64) {
        self.requests.cancel_overlapping(iova, len);
        // Called from inside the engine's unmap: a panic must not unwind through it.
        crate::request::serve("the device's dma_unmap", || self.function.dma_unmap(iova, len));
    }

    fn describe(&self) -> serde_json::Value {
        self.function.describe()
    }
}

impl<F> std::fmt::Debug for PciDevice<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PciDevice").field("regions", &self.regions.len()).finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests;
