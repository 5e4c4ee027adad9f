//! Device types and how instances are made from them: the mdev "parent" side.
//!
//! A type has a name, a description, the device API it offers (`vfio-pci`), and a number
//! of instances still available. Creating an instance reserves capacity that is given back
//! when the instance's device is dropped, so `available_instances` follows creation and
//! removal the way the kernel's mdev sysfs does.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use serde::Serialize;
use thiserror::Error;
use umdev_pinning::PinMode;

use crate::device::VfioDevice;

/// Why an instance could not be created.
#[derive(Debug, Error)]
pub enum TypeError {
    /// No type has this name.
    #[error("unknown device type {0:?}")]
    UnknownType(String),
    /// The type has no instances left.
    #[error("type {0} has no available instances")]
    Exhausted(String),
    /// An option is unknown or has a bad value.
    #[error("bad option for type {ty}: {why}")]
    BadOption {
        /// The type.
        ty: String,
        /// What is wrong.
        why: String,
    },
    /// The device could not be built.
    #[error("creating a {ty} device failed: {why}")]
    Create {
        /// The type.
        ty: String,
        /// What failed.
        why: String,
    },
}

impl TypeError {
    /// The errno a sysfs `create` would return.
    pub fn errno(&self) -> i32 {
        match self {
            TypeError::Exhausted(_) => libc::EUSERS,
            TypeError::UnknownType(_) => libc::ENOENT,
            _ => libc::EINVAL,
        }
    }
}

/// Options for creating an instance.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct InstanceOptions {
    /// How the instance's DMA space pins pages.
    #[serde(default, skip_serializing_if = "is_default_mode")]
    pub pin_mode: Option<PinModeName>,
    /// Type-specific options (`key=value`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub params: BTreeMap<String, String>,
}

fn is_default_mode(m: &Option<PinModeName>) -> bool {
    m.is_none()
}

/// A pin mode as stored in definitions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PinModeName {
    /// [`PinMode::Track`].
    Track,
    /// [`PinMode::Lock`].
    Lock,
}

impl From<PinModeName> for PinMode {
    fn from(m: PinModeName) -> Self {
        match m {
            PinModeName::Track => PinMode::Track,
            PinModeName::Lock => PinMode::Lock,
        }
    }
}

impl InstanceOptions {
    /// The pin mode to use (track unless set).
    pub fn pin_mode(&self) -> PinMode {
        self.pin_mode.map(PinMode::from).unwrap_or_default()
    }

    /// Fails if a parameter other than `known` is given.
    pub fn only(&self, ty: &str, known: &[&str]) -> Result<(), TypeError> {
        match self.params.keys().find(|k| !known.contains(&k.as_str())) {
            Some(k) => Err(TypeError::BadOption { ty: ty.into(), why: format!("unknown parameter {k:?}") }),
            None => Ok(()),
        }
    }
}

/// A kind of device instances can be created from.
pub trait DeviceType: Send + Sync {
    /// The type's name (`umdev start --type NAME`).
    fn name(&self) -> &str;
    /// One line for `umdev types`.
    fn description(&self) -> &str;
    /// The device API (`vfio-pci`).
    fn device_api(&self) -> &str {
        "vfio-pci"
    }
    /// Instances that can still be created.
    fn available_instances(&self) -> u32;
    /// Creates an instance, reserving its capacity until the device is dropped.
    fn create(&self, options: &InstanceOptions) -> Result<Arc<dyn VfioDevice>, TypeError>;
}

/// A count of units of capacity shared by types (mtty's 24 ports, say).
#[derive(Debug)]
pub struct Pool {
    free: AtomicU32,
}

/// Units taken from a [`Pool`], returned on drop.
#[derive(Debug)]
pub struct Reservation {
    pool: Arc<Pool>,
    units: u32,
}

impl Pool {
    /// A pool of `units`.
    pub fn new(units: u32) -> Arc<Pool> {
        Arc::new(Pool { free: AtomicU32::new(units) })
    }

    /// Units free now.
    pub fn free(&self) -> u32 {
        self.free.load(Ordering::Acquire)
    }

    /// Takes `units`, if that many are free.
    pub fn reserve(self: &Arc<Self>, units: u32) -> Option<Reservation> {
        self.free
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |free| free.checked_sub(units))
            .ok()
            .map(|_| Reservation { pool: self.clone(), units })
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.pool.free.fetch_add(self.units, Ordering::AcqRel);
    }
}

/// Wraps a device with the capacity it holds, so dropping the device gives it back.
pub struct Reserved<D: VfioDevice> {
    /// The device.
    pub device: D,
    _reservation: Reservation,
}

impl<D: VfioDevice> Reserved<D> {
    /// `device`, holding `reservation` for its lifetime.
    pub fn new(device: D, reservation: Reservation) -> Self {
        Reserved { device, _reservation: reservation }
    }
}

impl<D: VfioDevice> VfioDevice for Reserved<D> {
    fn device_info(&self) -> crate::DeviceInfo {
        self.device.device_info()
    }
    fn region_info(&self, index: u32) -> Option<crate::RegionInfo> {
        self.device.region_info(index)
    }
    fn region_read(&self, index: u32, offset: u64, data: &mut [u8]) -> Result<(), crate::DeviceError> {
        self.device.region_read(index, offset, data)
    }
    fn region_write(&self, index: u32, offset: u64, data: &[u8]) -> Result<(), crate::DeviceError> {
        self.device.region_write(index, offset, data)
    }
    fn irq_info(&self, index: u32) -> Option<crate::IrqInfo> {
        self.device.irq_info(index)
    }
    fn set_irqs(&self, request: crate::SetIrqs) -> Result<(), crate::DeviceError> {
        self.device.set_irqs(request)
    }
    fn reset(&self) -> Result<(), crate::DeviceError> {
        self.device.reset()
    }
    fn attach(&self, context: crate::DeviceContext) {
        self.device.attach(context)
    }
    fn detach(&self) {
        self.device.detach()
    }
    fn dma_unmap(&self, iova: u64, len: u64) {
        self.device.dma_unmap(iova, len)
    }
    fn describe(&self) -> serde_json::Value {
        self.device.describe()
    }
}

/// The test device type: capacity 64.
struct TestDevType {
    pool: Arc<Pool>,
}

impl DeviceType for TestDevType {
    fn name(&self) -> &str {
        crate::samples::testdev::TYPE_NAME
    }
    fn description(&self) -> &str {
        "test device: registers, DMA through pins or the client, INTx/MSI/MSI-X, sparse-mmap BAR (docs/testdev.md)"
    }
    fn available_instances(&self) -> u32 {
        self.pool.free()
    }
    fn create(&self, options: &InstanceOptions) -> Result<Arc<dyn VfioDevice>, TypeError> {
        options.only(self.name(), &[])?;
        let reservation = self.pool.reserve(1).ok_or_else(|| TypeError::Exhausted(self.name().into()))?;
        let device = crate::samples::testdev::create()
            .map_err(|e| TypeError::Create { ty: self.name().into(), why: e.to_string() })?;
        Ok(Arc::new(Reserved::new(device, reservation)))
    }
}

/// The parent: every type this build offers.
pub struct Registry {
    types: Vec<Arc<dyn DeviceType>>,
}

impl Registry {
    /// The built-in types.
    pub fn builtin() -> Registry {
        // mtty-1 and mtty-2 draw on one pool of ports, as in the kernel's mtty sample.
        let mtty_ports = Pool::new(crate::samples::mtty::MAX_PORTS);
        Registry {
            types: vec![
                Arc::new(TestDevType { pool: Pool::new(64) }),
                Arc::new(crate::samples::mtty::MttyType::single(mtty_ports.clone())),
                Arc::new(crate::samples::mtty::MttyType::dual(mtty_ports)),
                Arc::new(crate::samples::ccw::CcwType::new(64)),
            ],
        }
    }

    /// A registry of exactly `types` (for embedding umdev with one's own devices).
    pub fn with_types(types: Vec<Arc<dyn DeviceType>>) -> Registry {
        Registry { types }
    }

    /// Every type, in registration order.
    pub fn types(&self) -> &[Arc<dyn DeviceType>] {
        &self.types
    }

    /// The type named `name`.
    pub fn find(&self, name: &str) -> Result<&Arc<dyn DeviceType>, TypeError> {
        self.types.iter().find(|t| t.name() == name).ok_or_else(|| TypeError::UnknownType(name.into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_follows_creation_and_removal() {
        let registry = Registry::builtin();
        let ty = registry.find("testdev").unwrap();
        let before = ty.available_instances();
        let a = ty.create(&InstanceOptions::default()).unwrap();
        assert_eq!(ty.available_instances(), before - 1);
        drop(a);
        assert_eq!(ty.available_instances(), before);
        assert!(matches!(registry.find("nope"), Err(TypeError::UnknownType(_))));
        let mut bad = InstanceOptions::default();
        bad.params.insert("size".into(), "1".into());
        assert!(matches!(ty.create(&bad), Err(TypeError::BadOption { .. })));
    }

    #[test]
    fn a_pool_refuses_when_exhausted() {
        let pool = Pool::new(3);
        let two = pool.reserve(2).unwrap();
        assert!(pool.reserve(2).is_none());
        let one = pool.reserve(1).unwrap();
        assert_eq!(pool.free(), 0);
        drop((two, one));
        assert_eq!(pool.free(), 3);
    }
}
