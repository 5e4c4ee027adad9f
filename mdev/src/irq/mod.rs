//! The VFIO interrupt model of a PCI function: INTx, MSI, MSI-X, ERR and REQ, delivered to
//! the client's eventfds.
//!
//! [`Interrupts`] is the server-facing side (IRQ info, DEVICE_SET_IRQS, config-space
//! control, the MSI-X table, reset); [`IrqHandle`] is the cheap, cloneable device-facing
//! side a function raises interrupts through from any thread.
//!
//! Which mechanism a raise uses follows config space, as on real hardware: MSI-X if its
//! enable bit is set, else MSI, else INTx. Masked vectors go pending and fire when
//! unmasked. INTx is a level with VFIO's automask: asserting signals the eventfd once and
//! masks; nothing more is signalled until the client unmasks (UNMASK or the unmask
//! eventfd), when a still-asserted line fires again and re-masks.
//!
//! One mask bit per vector, whoever changes it: for MSI it is the capability's Mask Bits
//! register (guest config writes and SET_IRQS MASK/UNMASK both land there); for MSI-X it is
//! the table entry's Vector Control bit, which resets to masked as the spec requires.
//! Clients such as QEMU emulate the table themselves and never write ours, so, like the
//! kernel's MSI-X layer programming a physical vector when vfio-pci wires it up, assigning
//! a trigger eventfd to an MSI-X vector unmasks it and de-assigning masks it.
//!
//! All state sits behind one mutex, held for bookkeeping and the eventfd writes only, which
//! do not wait on the client ([`write_nowait`]). Lock order: config space, then this.

pub mod msix;
mod validate;
mod watcher;

use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::{Arc, Mutex, MutexGuard};

use vmm_sys_util::eventfd::EventFd;

use crate::device::{
    DeviceError, IrqAction, IrqData, IrqFlags, IrqInfo, SetIrqs, VFIO_PCI_ERR_IRQ_INDEX,
    VFIO_PCI_INTX_IRQ_INDEX, VFIO_PCI_MSIX_IRQ_INDEX, VFIO_PCI_MSI_IRQ_INDEX, VFIO_PCI_NUM_IRQS,
    VFIO_PCI_REQ_IRQ_INDEX,
};
pub use msix::{MsixEntry, MsixError, MsixTable};
use validate::{validate, IndexShape};
use watcher::UnmaskWatcher;

/// What became of a raised interrupt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// The eventfd was signalled.
    Signalled,
    /// Held: the vector is masked (it fires on unmask), or INTx is masked, disabled or
    /// not in use (the line stays asserted).
    Pending,
    /// Dropped: no eventfd, a vector beyond those enabled, or no mechanism enabled.
    Lost,
}

/// The mechanism a raise uses right now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IrqMode {
    /// INTx (neither MSI nor MSI-X enabled, an interrupt pin declared).
    Intx,
    /// MSI.
    Msi,
    /// MSI-X.
    Msix,
    /// None: no pin, and neither MSI nor MSI-X enabled.
    None,
}

/// Interrupts signalled per index since creation (reset keeps them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IrqStats {
    /// INTx eventfd signals.
    pub intx: u64,
    /// MSI eventfd signals.
    pub msi: u64,
    /// MSI-X eventfd signals.
    pub msix: u64,
    /// ERR eventfd signals.
    pub err: u64,
    /// REQ eventfd signals.
    pub req: u64,
    /// Interrupts that had nowhere to go.
    pub lost: u64,
}

/// The interrupt-relevant state of config space, as the guest last wrote it (the PCI layer
/// derives it from COMMAND and the capabilities).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IrqControl {
    /// COMMAND.INTX_DISABLE is set.
    pub intx_disabled: bool,
    /// COMMAND.BME is set: MSI and MSI-X messages (bus-master writes) may be sent. While it
    /// is clear they are held pending.
    pub bus_master: bool,
    /// MSI is enabled.
    pub msi_enabled: bool,
    /// MSI vectors enabled by Multiple Message Enable (0 without an MSI capability).
    pub msi_vectors: u32,
    /// MSI-X is enabled.
    pub msix_enabled: bool,
    /// MSI-X function mask is set.
    pub msix_function_mask: bool,
}

/// Interrupt state this layer owns that config space shows: the INTx status bit and the
/// MSI mask and pending registers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IrqStatus {
    /// INTx is asserted (STATUS bit 3).
    pub intx_asserted: bool,
    /// MSI per-vector mask bits.
    pub msi_mask: u32,
    /// MSI per-vector pending bits.
    pub msi_pending: u32,
}

/// What a function declares: its INTx pin and its MSI and MSI-X capabilities.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IrqLayout {
    /// An INTx pin is declared.
    pub intx: bool,
    /// MSI: vectors capable and per-vector masking.
    pub msi: Option<MsiLayout>,
    /// MSI-X: table entries.
    pub msix: Option<u16>,
}

/// An MSI capability, as the interrupt layer needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MsiLayout {
    /// Vectors the function is capable of (1 to 32).
    pub vectors: u32,
    /// The capability has Mask Bits and Pending Bits registers.
    pub per_vector_mask: bool,
}

type Layout = IrqLayout;

impl Layout {
    fn vectors(&self, index: u32) -> u32 {
        match index {
            VFIO_PCI_INTX_IRQ_INDEX => u32::from(self.intx),
            VFIO_PCI_MSI_IRQ_INDEX => self.msi.map_or(0, |m| m.vectors),
            VFIO_PCI_MSIX_IRQ_INDEX => self.msix.map_or(0, u32::from),
            VFIO_PCI_ERR_IRQ_INDEX | VFIO_PCI_REQ_IRQ_INDEX => 1,
            _ => 0,
        }
    }

    fn shape(&self, index: u32) -> IndexShape {
        let maskable = match index {
            VFIO_PCI_INTX_IRQ_INDEX | VFIO_PCI_MSIX_IRQ_INDEX => true,
            VFIO_PCI_MSI_IRQ_INDEX => self.msi.is_some_and(|m| m.per_vector_mask),
            _ => false,
        };
        IndexShape { vectors: self.vectors(index), maskable }
    }
}

#[derive(Debug, Default)]
struct Intx {
    trigger: Option<EventFd>,
    masked: bool,
    asserted: bool,
}

#[derive(Debug)]
struct State {
    control: IrqControl,
    intx: Intx,
    msi_fds: Vec<Option<EventFd>>,
    msi_mask: u32,
    msi_pending: u32,
    msix_fds: Vec<Option<EventFd>>,
    msix: MsixTable,
    err: Option<EventFd>,
    req: Option<EventFd>,
    stats: IrqStats,
}

#[derive(Debug)]
struct Shared {
    layout: Layout,
    state: Mutex<State>,
}

/// The server-facing side of a function's interrupts. Dropping it stops the unmask
/// watcher; [`IrqHandle`]s keep working (raising into a disabled state).
#[derive(Debug)]
pub struct Interrupts {
    shared: Arc<Shared>,
    /// The INTx unmask eventfd's watcher, and a handle on the eventfd (to tell it from the
    /// trigger's).
    watcher: Mutex<Option<(UnmaskWatcher, EventFd)>>,
}

/// The device-facing side: raise, assert and deassert interrupts from any thread.
#[derive(Clone, Debug)]
pub struct IrqHandle {
    shared: Arc<Shared>,
}

impl Interrupts {
    /// The interrupts `layout` declares: INTx if it has a pin, its MSI and MSI-X
    /// capabilities, ERR and REQ. Everything starts disabled.
    pub fn new(layout: IrqLayout) -> Self {
        let state = State::new(&layout, IrqStats::default());
        Interrupts {
            shared: Arc::new(Shared { layout, state: Mutex::new(state) }),
            watcher: Mutex::new(None),
        }
    }

    /// A handle for the device.
    pub fn handle(&self) -> IrqHandle {
        IrqHandle { shared: self.shared.clone() }
    }

    /// DEVICE_GET_IRQ_INFO for `index`; `None` at or above [`VFIO_PCI_NUM_IRQS`].
    pub fn info(&self, index: u32) -> Option<IrqInfo> {
        let flags = match index {
            VFIO_PCI_INTX_IRQ_INDEX => IrqFlags::EVENTFD | IrqFlags::MASKABLE | IrqFlags::AUTOMASKED,
            VFIO_PCI_MSI_IRQ_INDEX if self.shared.layout.shape(index).maskable => {
                IrqFlags::EVENTFD | IrqFlags::MASKABLE
            }
            // Not NORESIZE: QEMU then adds MSI-X vectors one at a time without disabling.
            VFIO_PCI_MSIX_IRQ_INDEX => IrqFlags::EVENTFD | IrqFlags::MASKABLE,
            i if i < VFIO_PCI_NUM_IRQS => IrqFlags::EVENTFD,
            _ => return None,
        };
        Some(IrqInfo { flags, count: self.shared.layout.vectors(index) })
    }

    /// DEVICE_SET_IRQS with VFIO semantics; see the module docs.
    pub fn set_irqs(&self, req: SetIrqs) -> Result<(), DeviceError> {
        validate(&req, |i| self.shared.layout.shape(i))?;
        let (index, start, count) = (req.index, req.start, req.count);
        let range = start as usize..(start + count) as usize;
        log::debug!("SET_IRQS index {index} {:?} [{start}, +{count}) {}", req.action, DataKind(&req.data));

        if index == VFIO_PCI_INTX_IRQ_INDEX {
            // The watcher is started and stopped outside the state lock: its callback
            // takes that lock, and stopping waits for the callback.
            match (req.action, req.data) {
                (IrqAction::Unmask, IrqData::Eventfds(mut fds)) => return self.set_unmask_fd(fds.pop()),
                (IrqAction::Trigger, IrqData::Eventfds(fds))
                    if fds.first().is_some_and(|fd| {
                        umdev_pinning::sync::lock(&self.watcher)
                            .as_ref()
                            .is_some_and(|(_, u)| same_file(fd, u))
                    }) =>
                {
                    // Each unmask would signal the trigger, which is the unmask: a loop.
                    log::debug!("SET_IRQS: INTx trigger eventfd is its unmask eventfd: refused");
                    return Err(DeviceError::Errno(libc::EINVAL));
                }
                (IrqAction::Trigger, IrqData::None) if count == 0 => {
                    self.set_unmask_fd(None)?;
                    let mut st = self.shared.lock();
                    st.intx = Intx { asserted: st.intx.asserted, ..Intx::default() };
                    return Ok(());
                }
                (action, data) => return self.shared.set_intx(action, data),
            }
        }

        let mut st = self.shared.lock();
        let st = &mut *st;
        match (req.action, req.data) {
            (IrqAction::Trigger, IrqData::None) if count == 0 => match index {
                VFIO_PCI_MSI_IRQ_INDEX => st.msi_fds.fill_with(|| None),
                VFIO_PCI_MSIX_IRQ_INDEX => {
                    st.msix_fds.fill_with(|| None);
                    (0..st.msix.vectors()).for_each(|v| st.msix.set_masked(v, true));
                }
                VFIO_PCI_ERR_IRQ_INDEX => st.err = None,
                _ => st.req = None,
            },
            (IrqAction::Trigger, IrqData::Eventfds(fds)) => {
                let assign = !fds.is_empty();
                let mut fds = fds.into_iter();
                for v in range {
                    let fd = fds.next();
                    match index {
                        VFIO_PCI_MSI_IRQ_INDEX => st.msi_fds[v] = fd,
                        VFIO_PCI_MSIX_IRQ_INDEX => {
                            st.msix_fds[v] = fd;
                            st.msix.set_masked(v as u16, !assign);
                        }
                        VFIO_PCI_ERR_IRQ_INDEX => st.err = fd,
                        _ => st.req = fd,
                    }
                }
                st.flush();
            }
            (IrqAction::Trigger, data) => {
                // Loopback: signal the named vectors' eventfds, whatever their mask.
                for v in selected(range, &data) {
                    let fd = match index {
                        VFIO_PCI_MSI_IRQ_INDEX => st.msi_fds[v].as_ref(),
                        VFIO_PCI_MSIX_IRQ_INDEX => st.msix_fds[v].as_ref(),
                        VFIO_PCI_ERR_IRQ_INDEX => st.err.as_ref(),
                        _ => st.req.as_ref(),
                    };
                    let delivery = signal(fd);
                    st.count(index, delivery);
                }
            }
            (action, data) => {
                // MASK/UNMASK with NONE/BOOL (validation refused the rest).
                let masked = action == IrqAction::Mask;
                for v in selected(range, &data) {
                    if index == VFIO_PCI_MSI_IRQ_INDEX {
                        st.msi_mask = (st.msi_mask & !(1 << v)) | (u32::from(masked) << v);
                    } else {
                        st.msix.set_masked(v as u16, masked);
                    }
                }
                st.flush();
            }
        }
        Ok(())
    }

    /// Holds every interrupt until [`Interrupts::reset`]: INTx as if disabled, MSI and MSI-X as if
    /// off (nothing raised meanwhile is delivered, then or after). A device's reset or detach
    /// does this first, so that requests ending as they are cancelled raise nothing.
    pub fn quiesce(&self) {
        self.apply_control(IrqControl { intx_disabled: true, ..IrqControl::default() });
    }

    /// Applies the interrupt-relevant config-space state after a config write: mode
    /// changes, MSI mask bits, MSI-X function mask, INTx disable. Fires what became
    /// deliverable.
    pub fn apply_control(&self, control: IrqControl) {
        let mut st = self.shared.lock();
        let old = std::mem::replace(&mut st.control, control);
        if !control.msi_enabled {
            st.msi_pending = 0;
        }
        st.msi_pending &= vector_bits(control.msi_vectors);
        if old.msix_enabled && !control.msix_enabled {
            st.msix.clear_pending();
        }
        if old != control {
            log::debug!("interrupt control {control:?}, mode {:?}", st.mode(&self.shared.layout));
        }
        st.flush();
    }

    /// The guest wrote the MSI Mask Bits register: this layer owns the mask (SET_IRQS MASK
    /// and UNMASK change the same bits), so the write lands here; a newly unmasked pending
    /// vector fires.
    pub fn set_msi_mask(&self, mask: u32) {
        let mut st = self.shared.lock();
        let bits = vector_bits(self.shared.layout.msi.map_or(0, |m| m.vectors));
        st.msi_mask = mask & bits;
        st.flush();
    }

    /// The state config space shows: STATUS.INTERRUPT and the MSI mask/pending bits.
    pub fn status(&self) -> IrqStatus {
        let st = self.shared.lock();
        IrqStatus { intx_asserted: st.intx.asserted, msi_mask: st.msi_mask, msi_pending: st.msi_pending }
    }

    /// Reads the MSI-X table at `offset` from its start.
    pub fn msix_table_read(&self, offset: u64, data: &mut [u8]) -> Result<(), MsixError> {
        self.shared.lock().msix.read_table(offset, data)
    }

    /// Writes the MSI-X table at `offset` from its start; an unmasked vector with its
    /// pending bit set fires.
    pub fn msix_table_write(&self, offset: u64, data: &[u8]) -> Result<(), MsixError> {
        let mut st = self.shared.lock();
        st.msix.write_table(offset, data)?;
        st.flush();
        Ok(())
    }

    /// Reads the MSI-X Pending Bit Array at `offset` from its start (writes are ignored
    /// by the caller: the spec leaves them undefined).
    pub fn msix_pba_read(&self, offset: u64, data: &mut [u8]) -> Result<(), MsixError> {
        self.shared.lock().msix.read_pba(offset, data)
    }

    /// Back to the power-on state: every eventfd dropped (the unmask watcher stopped),
    /// masks, pending bits and the MSI-X table reset, all mechanisms disabled. Statistics
    /// are kept.
    pub fn reset(&self) {
        if let Err(e) = self.set_unmask_fd(None) {
            log::error!("reset: {e}");
        }
        let mut st = self.shared.lock();
        *st = State::new(&self.shared.layout, st.stats);
    }

    #[cfg(test)]
    fn intx_masked(&self) -> bool {
        self.shared.lock().intx.masked
    }

    /// Registers (`Some`) or removes (`None`) the INTx unmask eventfd.
    fn set_unmask_fd(&self, fd: Option<EventFd>) -> Result<(), DeviceError> {
        if fd
            .as_ref()
            .is_some_and(|fd| self.shared.lock().intx.trigger.as_ref().is_some_and(|t| same_file(t, fd)))
        {
            // Each unmask would signal the trigger, which is the unmask: a loop. Refused
            // before anything changes: the unmask eventfd in place stays.
            log::debug!("SET_IRQS: INTx unmask eventfd is its trigger eventfd: refused");
            return Err(DeviceError::Errno(libc::EINVAL));
        }
        let mut slot = umdev_pinning::sync::lock(&self.watcher);
        if let Some((old, _)) = slot.take() {
            old.stop();
        }
        if let Some(fd) = fd {
            let handle =
                fd.try_clone().map_err(|e| DeviceError::Errno(e.raw_os_error().unwrap_or(libc::EIO)))?;
            let shared = self.shared.clone();
            let watcher = UnmaskWatcher::spawn(fd, move || shared.set_intx_masked(false)).map_err(|e| {
                log::error!("cannot watch the INTx unmask eventfd: {e}");
                DeviceError::Errno(e.raw_os_error().unwrap_or(libc::EIO))
            })?;
            *slot = Some((watcher, handle));
        }
        Ok(())
    }
}

/// Whether `a` and `b` are descriptors of one open file (one eventfd, dup'ed or sent twice):
/// by `kcmp`, or where it is missing or refused (a kernel without it, a container's seccomp
/// profile), by the eventfd's id in `/proc/self/fdinfo`; false only where neither can say.
fn same_file(a: &EventFd, b: &EventFd) -> bool {
    use std::os::fd::AsRawFd;
    const KCMP_FILE: libc::c_ulong = 0;
    let pid = libc::c_ulong::from(std::process::id());
    let (fa, fb) = (a.as_raw_fd() as libc::c_ulong, b.as_raw_fd() as libc::c_ulong);
    // SAFETY: kcmp compares two entries of this process's own fd table; it reads no memory
    // of ours and changes nothing. Every argument is passed as the kernel's unsigned long.
    let r = unsafe { libc::syscall(libc::SYS_kcmp, pid, pid, KCMP_FILE, fa, fb) };
    match r {
        0 => true,
        r if r > 0 => false,
        _ => matches!((eventfd_id(a), eventfd_id(b)), (Some(x), Some(y)) if x == y),
    }
}

/// The kernel's id of the eventfd `fd` refers to (`eventfd-id` in its fdinfo, Linux 5.18 and
/// later), the same for every descriptor of it.
fn eventfd_id(fd: &EventFd) -> Option<u64> {
    use std::os::fd::AsRawFd;
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd())).ok()?;
    info.lines().find_map(|l| l.strip_prefix("eventfd-id:")).and_then(|v| v.trim().parse().ok())
}

impl Drop for Interrupts {
    fn drop(&mut self) {
        if let Some((watcher, _)) = self.watcher.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
            watcher.stop();
        }
    }
}

impl IrqHandle {
    /// Raises the function's interrupt `vector` on the mechanism in use: MSI-X vector
    /// `vector`, MSI vector `vector`, or INTx (asserted until [`IrqHandle::intx_deassert`];
    /// `vector` is ignored).
    pub fn raise(&self, vector: u16) -> Delivery {
        let mut st = self.shared.lock();
        let (index, delivery) = match st.mode(&self.shared.layout) {
            IrqMode::Msix => (VFIO_PCI_MSIX_IRQ_INDEX, st.raise_msix(vector)),
            IrqMode::Msi => (VFIO_PCI_MSI_IRQ_INDEX, st.raise_msi(vector)),
            IrqMode::Intx => return st.assert_intx(),
            IrqMode::None => (VFIO_PCI_INTX_IRQ_INDEX, Delivery::Lost),
        };
        if delivery == Delivery::Lost {
            log::debug!("interrupt vector {vector} lost");
        }
        st.count(index, delivery);
        delivery
    }

    /// Asserts INTx (a level: asserting an asserted line does nothing). Signals the
    /// eventfd and masks if INTx is in use, unmasked and not disabled by COMMAND;
    /// otherwise the line stays asserted and fires once that changes.
    pub fn intx_assert(&self) -> Delivery {
        if !self.shared.layout.intx {
            return Delivery::Lost;
        }
        self.shared.lock().assert_intx()
    }

    /// Deasserts INTx.
    pub fn intx_deassert(&self) {
        self.shared.lock().intx.asserted = false;
    }

    /// Signals the ERR eventfd (the client treats it as an unrecoverable device error).
    pub fn signal_err(&self) -> Delivery {
        let mut st = self.shared.lock();
        let delivery = signal(st.err.as_ref());
        st.count(VFIO_PCI_ERR_IRQ_INDEX, delivery);
        delivery
    }

    /// Signals the REQ eventfd (asks the client to release the device).
    pub fn signal_req(&self) -> Delivery {
        let mut st = self.shared.lock();
        let delivery = signal(st.req.as_ref());
        st.count(VFIO_PCI_REQ_IRQ_INDEX, delivery);
        delivery
    }

    /// The mechanism a raise would use now.
    pub fn mode(&self) -> IrqMode {
        self.shared.lock().mode(&self.shared.layout)
    }

    /// Whether INTx is asserted.
    pub fn intx_asserted(&self) -> bool {
        self.shared.lock().intx.asserted
    }

    /// Interrupts signalled so far.
    pub fn stats(&self) -> IrqStats {
        self.shared.lock().stats
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // The state stays consistent across a panic in another holder (every update is
        // a few plain stores), so a poisoned lock is still usable.
        umdev_pinning::sync::lock(&self.state)
    }

    /// INTx TRIGGER and MASK/UNMASK with NONE/BOOL/EVENTFD data (not disable).
    fn set_intx(&self, action: IrqAction, data: IrqData) -> Result<(), DeviceError> {
        let mut st = self.lock();
        match (action, data) {
            (IrqAction::Trigger, IrqData::Eventfds(mut fds)) => {
                let fd = fds.pop();
                if st.intx.trigger.is_none() {
                    st.intx.masked = false; // enabling INTx starts unmasked, as in vfio-pci
                }
                st.intx.trigger = fd;
                st.flush();
            }
            (IrqAction::Trigger, data) => {
                if selected(0..1, &data).next().is_some() {
                    let delivery = signal(st.intx.trigger.as_ref());
                    st.count(VFIO_PCI_INTX_IRQ_INDEX, delivery);
                }
            }
            (action, data) => {
                if selected(0..1, &data).next().is_some() {
                    drop(st);
                    self.set_intx_masked(action == IrqAction::Mask);
                }
            }
        }
        Ok(())
    }

    /// MASK or UNMASK of INTx; an unmasked, still-asserted line fires and re-masks.
    fn set_intx_masked(&self, masked: bool) {
        let mut st = self.lock();
        st.intx.masked = masked;
        st.flush();
    }
}

impl State {
    /// The power-on state: nothing wired, nothing masked but the MSI-X table, all off.
    fn new(layout: &Layout, stats: IrqStats) -> Self {
        State {
            control: IrqControl::default(),
            intx: Intx::default(),
            msi_fds: none_vec(layout.vectors(VFIO_PCI_MSI_IRQ_INDEX)),
            msi_mask: 0,
            msi_pending: 0,
            msix_fds: none_vec(layout.vectors(VFIO_PCI_MSIX_IRQ_INDEX)),
            msix: MsixTable::new(layout.msix.unwrap_or(0)),
            err: None,
            req: None,
            stats,
        }
    }

    fn mode(&self, layout: &Layout) -> IrqMode {
        if self.control.msix_enabled && layout.msix.is_some() {
            IrqMode::Msix
        } else if self.control.msi_enabled && layout.msi.is_some() {
            IrqMode::Msi
        } else if layout.intx {
            IrqMode::Intx
        } else {
            IrqMode::None
        }
    }

    fn raise_msix(&mut self, vector: u16) -> Delivery {
        if vector >= self.msix.vectors() {
            return Delivery::Lost;
        }
        // A message is a bus-master write: held, like a masked one, while BME is off.
        if self.control.msix_function_mask || self.msix.is_masked(vector) || !self.control.bus_master {
            self.msix.set_pending(vector, true);
            return Delivery::Pending;
        }
        signal(self.msix_fds[usize::from(vector)].as_ref())
    }

    fn raise_msi(&mut self, vector: u16) -> Delivery {
        if u32::from(vector) >= self.control.msi_vectors.min(self.msi_fds.len() as u32) {
            return Delivery::Lost;
        }
        if self.msi_mask & (1 << vector) != 0 || !self.control.bus_master {
            self.msi_pending |= 1 << vector;
            return Delivery::Pending;
        }
        signal(self.msi_fds[usize::from(vector)].as_ref())
    }

    fn assert_intx(&mut self) -> Delivery {
        self.intx.asserted = true;
        if self.flush_intx() {
            Delivery::Signalled
        } else {
            Delivery::Pending
        }
    }

    /// Signals INTx if it is asserted and deliverable, and automasks; true if it fired.
    fn flush_intx(&mut self) -> bool {
        let intx = &self.intx;
        let in_use = !self.control.msi_enabled && !self.control.msix_enabled;
        let deliverable = intx.asserted && in_use && !intx.masked && !self.control.intx_disabled;
        if !deliverable {
            return false;
        }
        let Some(fd) = intx.trigger.as_ref() else { return false };
        let fired = signal(Some(fd)) == Delivery::Signalled;
        if fired {
            self.intx.masked = true;
            self.stats.intx += 1;
        }
        fired
    }

    /// Delivers everything that is pending and now deliverable.
    fn flush(&mut self) {
        self.flush_intx();
        if !self.control.bus_master {
            return; // messages wait for bus mastering
        }
        if self.control.msix_enabled && !self.control.msix_function_mask {
            for v in 0..self.msix.vectors() {
                if self.msix.is_pending(v) && !self.msix.is_masked(v) {
                    self.msix.set_pending(v, false);
                    let delivery = signal(self.msix_fds[usize::from(v)].as_ref());
                    self.count(VFIO_PCI_MSIX_IRQ_INDEX, delivery);
                }
            }
        } else if self.control.msi_enabled {
            let mut ready = self.msi_pending & !self.msi_mask;
            self.msi_pending &= !ready;
            while ready != 0 {
                let v = ready.trailing_zeros() as usize;
                ready &= ready - 1;
                let delivery = signal(self.msi_fds.get(v).and_then(Option::as_ref));
                self.count(VFIO_PCI_MSI_IRQ_INDEX, delivery);
            }
        }
    }

    /// Counts a signal on `index`, or a loss; pending interrupts are counted when they fire.
    fn count(&mut self, index: u32, delivery: Delivery) {
        match delivery {
            Delivery::Signalled => {}
            Delivery::Pending => return,
            Delivery::Lost => {
                self.stats.lost += 1;
                return;
            }
        }
        match index {
            VFIO_PCI_INTX_IRQ_INDEX => self.stats.intx += 1,
            VFIO_PCI_MSI_IRQ_INDEX => self.stats.msi += 1,
            VFIO_PCI_MSIX_IRQ_INDEX => self.stats.msix += 1,
            VFIO_PCI_ERR_IRQ_INDEX => self.stats.err += 1,
            _ => self.stats.req += 1,
        }
    }
}

/// Writes 1 to `fd` ([`write_nowait`]).
fn signal(fd: Option<&EventFd>) -> Delivery {
    match fd {
        Some(fd) => match write_nowait(fd) {
            Ok(()) => Delivery::Signalled,
            Err(e) => {
                log::warn!("signalling an interrupt eventfd failed: {e}");
                Delivery::Lost
            }
        },
        None => Delivery::Lost,
    }
}

/// Adds 1 to `fd`'s counter without waiting on the client. An eventfd write waits while the
/// counter is full (2^64 - 2) unless the file is `O_NONBLOCK`, a flag the client shares and
/// may clear, and the client may fill the counter. With the flag set (as `vet` left it) a
/// full counter fails the write with `EAGAIN`, and the reader sees a count all the same.
/// With the flag cleared, a full counter is emptied first (a read that cannot wait:
/// `RWF_NOWAIT`; eventfd writes have no per-call no-wait), so the write finds room and the
/// count is 1. Either way no device thread waits on the client holding the interrupt lock.
/// One window is left: a client that clears the flag, or fills the counter again, between
/// that look and the write (a system call's time) makes the write wait until it reads.
fn write_nowait(fd: &EventFd) -> std::io::Result<()> {
    // SAFETY: F_GETFL reads the flags of a descriptor the EventFd owns; no memory is passed.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if flags & libc::O_NONBLOCK == 0 {
        empty_if_full(fd)?;
    }
    match fd.write(1) {
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(()),
        r => r,
    }
}

/// Empties `fd`'s counter if a write of 1 would wait for room.
fn empty_if_full(fd: &EventFd) -> std::io::Result<()> {
    // SAFETY: the EventFd owns the descriptor and outlives this borrow.
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd.as_raw_fd()) };
    let mut poll = [nix::poll::PollFd::new(borrowed, nix::poll::PollFlags::POLLOUT)];
    if nix::poll::poll(&mut poll, nix::poll::PollTimeout::ZERO)? == 1 {
        return Ok(());
    }
    watcher::read_nowait(borrowed)?;
    log::debug!("an interrupt eventfd's counter was full, O_NONBLOCK cleared: emptied before signalling");
    Ok(())
}

/// The vectors of `range` that `data` selects (all for NONE; where true for BOOL).
fn selected<'a>(range: std::ops::Range<usize>, data: &'a IrqData) -> impl Iterator<Item = usize> + 'a {
    range
        .enumerate()
        .filter(move |&(i, _)| match data {
            IrqData::Bool(flags) => flags.get(i).copied().unwrap_or(false),
            _ => true,
        })
        .map(|(_, v)| v)
}

fn none_vec(n: u32) -> Vec<Option<EventFd>> {
    (0..n).map(|_| None).collect()
}

fn vector_bits(vectors: u32) -> u32 {
    if vectors >= 32 {
        u32::MAX
    } else {
        (1 << vectors) - 1
    }
}

/// Names a SET_IRQS data type for logs.
struct DataKind<'a>(&'a IrqData);

impl std::fmt::Display for DataKind<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            IrqData::None => write!(f, "NONE"),
            IrqData::Bool(flags) => write!(f, "BOOL {flags:?}"),
            IrqData::Eventfds(fds) => write!(f, "EVENTFD x{}", fds.len()),
        }
    }
}

#[cfg(test)]
mod tests;
