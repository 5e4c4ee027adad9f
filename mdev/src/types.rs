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
use crate::pci::{PciDevice, PciFunction};

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

impl Pool {
    /// An instance of type `ty` holding `units` of this pool for as long as it lives: the
    /// units are reserved (else [`TypeError::Exhausted`]), then `make` builds the device (its
    /// error becomes [`TypeError::Create`]).
    pub fn instance<F: PciFunction, E: std::fmt::Display>(
        self: &Arc<Self>,
        ty: &str,
        units: u32,
        make: impl FnOnce() -> Result<PciDevice<F>, E>,
    ) -> Result<Arc<dyn VfioDevice>, TypeError> {
        let reservation = self.reserve(units).ok_or_else(|| TypeError::Exhausted(ty.into()))?;
        let device = make().map_err(|e| TypeError::Create { ty: ty.into(), why: e.to_string() })?;
        Ok(Arc::new(device.holding(reservation)))
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.pool.free.fetch_add(self.units, Ordering::AcqRel);
    }
}

/// The parent: the types a server offers.
pub struct Registry {
    types: Vec<Arc<dyn DeviceType>>,
}

impl Registry {
    /// A registry of exactly `types`. The framework knows no device: a binary lists the
    /// types it serves (umdev's own list is `umdev::builtin_registry`).
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

/// Parses a size with an optional K, M or G suffix (powers of 1024).
pub fn parse_size(text: &str) -> Option<u64> {
    let (digits, shift) = match text.as_bytes().last()? {
        b'K' | b'k' => (&text[..text.len() - 1], 10),
        b'M' | b'm' => (&text[..text.len() - 1], 20),
        b'G' | b'g' => (&text[..text.len() - 1], 30),
        _ => (text, 0),
    };
    digits.parse::<u64>().ok()?.checked_mul(1 << shift)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_are_checked_by_name() {
        let mut options = InstanceOptions::default();
        assert!(options.only("t", &["size"]).is_ok());
        options.params.insert("size".into(), "1".into());
        assert!(options.only("t", &["size"]).is_ok());
        assert!(matches!(options.only("t", &[]), Err(TypeError::BadOption { .. })));
        assert_eq!(TypeError::Exhausted("t".into()).errno(), libc::EUSERS);
        assert_eq!(TypeError::UnknownType("t".into()).errno(), libc::ENOENT);
        let registry = Registry::with_types(Vec::new());
        assert!(matches!(registry.find("nope"), Err(TypeError::UnknownType(_))));
    }

    #[test]
    fn sizes_parse_with_suffixes() {
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("64M"), Some(64 << 20));
        assert_eq!(parse_size("2g"), Some(2 << 30));
        assert_eq!(parse_size("1K"), Some(1024));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_size(""), None);
        assert_eq!(parse_size("99999999999999999G"), None);
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
