//! Device types and how instances are made from them: the mdev "parent" side.
//!
//! A type has a name, a description, the device API it offers (`vfio-pci`), and a number
//! of instances still available. Creating an instance reserves capacity that is given back
//! when the instance's device is dropped, so `available_instances` follows creation and
//! removal the way the kernel's mdev sysfs does.
//!
//! A type also describes its options once ([`OptionSpec`]: key, value syntax, range, default,
//! help). [`parse_options`] checks a set of `key=value` options against that description;
//! [`DeviceType::check`] runs the type's whole check without creating anything, so a tool that
//! writes a definition refuses a bad one with the message `create` would give.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use serde::Serialize;
use thiserror::Error;
use umdev_pinning::PinMode;

use crate::device::VfioDevice;
use crate::pci::{PciDevice, PciFunction};
use crate::sync::AtomicUpdate;

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
    /// [`PinMode::Kernel`].
    Kernel,
}

impl From<PinModeName> for PinMode {
    fn from(m: PinModeName) -> Self {
        match m {
            PinModeName::Track => PinMode::Track,
            PinModeName::Lock => PinMode::Lock,
            PinModeName::Kernel => PinMode::Kernel,
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
    /// The options the type takes (none by default).
    fn options(&self) -> Vec<OptionSpec> {
        Vec::new()
    }
    /// Checks `options` as [`DeviceType::create`] does, creating nothing: unknown keys, each
    /// value against [`DeviceType::options`], and whatever the type checks across keys. The
    /// message is the one `create` gives for the same options. By default, the schema alone.
    fn check(&self, options: &InstanceOptions) -> Result<(), TypeError> {
        parse_options(&self.options(), &options.params)
            .map(drop)
            .map_err(|why| TypeError::BadOption { ty: self.name().into(), why })
    }
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
            .update_with(Ordering::AcqRel, Ordering::Acquire, |free| free.checked_sub(units))
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

/// Parses a byte count: digits with an optional K, M, G or T suffix (powers of 1024, either
/// case). `None` for anything else, or past `u64::MAX`.
pub fn parse_size(text: &str) -> Option<u64> {
    let (digits, shift) = match text.as_bytes().last()? {
        b'K' | b'k' => (&text[..text.len() - 1], 10),
        b'M' | b'm' => (&text[..text.len() - 1], 20),
        b'G' | b'g' => (&text[..text.len() - 1], 30),
        b'T' | b't' => (&text[..text.len() - 1], 40),
        _ => (text, 0),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse::<u64>().ok()?.checked_mul(1 << shift)
}

/// A byte count as [`parse_size`] reads it, in the largest unit that divides it (`64M`, `1T`,
/// `1000`).
pub fn format_size(bytes: u64) -> String {
    for (shift, unit) in [(40, "T"), (30, "G"), (20, "M"), (10, "K")] {
        if bytes != 0 && bytes.is_multiple_of(1 << shift) {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

/// How an option's value is written, and what it may be.
#[derive(Clone, Copy, Debug)]
pub enum ValueSyntax {
    /// A whole number from `min` to `max`.
    Integer {
        /// Smallest.
        min: u64,
        /// Largest.
        max: u64,
    },
    /// One of these words.
    Choice(&'static [&'static str]),
    /// A byte count ([`parse_size`]) from `min` to `max`.
    Size {
        /// Smallest.
        min: u64,
        /// Largest.
        max: u64,
    },
    /// Where a device keeps its bytes: `ram:SIZE`, a RAM disk of SIZE bytes ([`parse_size`],
    /// `min` to `max_ram`), or `file:/absolute/path`, an existing regular file of at least `min`
    /// bytes or a block device, used in place.
    Store {
        /// Smallest store.
        min: u64,
        /// Largest RAM disk.
        max_ram: u64,
    },
    /// Printable ASCII (no spaces), 1 to `max_len` characters.
    Text {
        /// Longest.
        max_len: usize,
    },
    /// Checked by the type's own function; `syntax` says what it takes.
    Custom {
        /// What a value looks like, for help (`loopback|null|pty|socket:/PATH`).
        syntax: &'static str,
        /// Why a value is refused.
        check: fn(&str) -> Result<(), String>,
    },
}

/// One option of a device type: `--opt KEY=VALUE`.
#[derive(Clone, Copy, Debug)]
pub struct OptionSpec {
    /// The key; with [`OptionSpec::numbered`], the prefix of the numbered keys (`ns`).
    pub key: &'static str,
    /// The key is `key` followed by a number from the first to the second (`ns1`..`ns16`).
    pub numbered: Option<(u32, u32)>,
    /// How the value is written.
    pub value: ValueSyntax,
    /// The value without the option, as written (`None`: nothing, the help says what then).
    pub default: Option<&'static str>,
    /// One line for a person.
    pub help: &'static str,
}

impl OptionSpec {
    /// An option `key` whose value is written as `value`.
    pub const fn new(
        key: &'static str,
        value: ValueSyntax,
        default: Option<&'static str>,
        help: &'static str,
    ) -> Self {
        OptionSpec { key, numbered: None, value, default, help }
    }

    /// The keys `key` + `first` to `key` + `last` (`ns1`..`ns16`).
    pub const fn numbered(mut self, first: u32, last: u32) -> Self {
        self.numbered = Some((first, last));
        self
    }

    /// Whether `key` is one of this option's keys.
    pub fn matches(&self, key: &str) -> bool {
        match self.numbered {
            None => key == self.key,
            Some((first, last)) => key
                .strip_prefix(self.key)
                .filter(|n| n.bytes().all(|b| b.is_ascii_digit()) && (n.len() == 1 || !n.starts_with('0')))
                .and_then(|n| n.parse::<u32>().ok())
                .is_some_and(|n| (first..=last).contains(&n)),
        }
    }

    /// The key as help shows it: `lba`, `ns1..ns16`.
    pub fn key_pattern(&self) -> String {
        match self.numbered {
            None => self.key.to_string(),
            Some((first, last)) if first == last => format!("{}{first}", self.key),
            Some((first, last)) => format!("{0}{first}..{0}{last}", self.key),
        }
    }

    /// What a value looks like, with its range: `512|4096`, `1-64`, `ram:SIZE|file:/PATH`.
    pub fn syntax(&self) -> String {
        match self.value {
            ValueSyntax::Integer { min, max } => format!("{min}-{max}"),
            ValueSyntax::Choice(words) => words.join("|"),
            ValueSyntax::Size { min, max } => {
                format!("SIZE ({}-{}, K/M/G/T suffixes)", format_size(min), format_size(max))
            }
            ValueSyntax::Store { min, max_ram } => format!(
                "ram:SIZE|file:/PATH (SIZE {}-{}, K/M/G/T suffixes; a file of at least {} bytes, or a block device)",
                format_size(min),
                format_size(max_ram),
                min
            ),
            ValueSyntax::Text { max_len } => format!("TEXT (1-{max_len} printable ASCII characters, no spaces)"),
            ValueSyntax::Custom { syntax, .. } => syntax.to_string(),
        }
    }

    /// Checks one value; the parsed value, or why it is refused (naming `key=value`).
    pub fn parse(&self, key: &str, value: &str) -> Result<OptionValue, String> {
        let bad = |what: String| format!("{key}={value}: {what}");
        match self.value {
            ValueSyntax::Integer { min, max } => value
                .parse::<u64>()
                .ok()
                .filter(|n| (min..=max).contains(n) && !value.starts_with('+'))
                .map(OptionValue::Integer)
                .ok_or_else(|| bad(format!("a whole number from {min} to {max}"))),
            // Any case: `2M` as sizes take it, `NONE`.
            ValueSyntax::Choice(words) => words
                .iter()
                .find(|w| w.eq_ignore_ascii_case(value))
                .map(|w| OptionValue::Word(w))
                .ok_or_else(|| bad(format!("one of {}", words.join(", ")))),
            ValueSyntax::Size { min, max } => parse_size(value)
                .filter(|n| (min..=max).contains(n))
                .map(OptionValue::Size)
                .ok_or_else(|| bad(size_range(min, max))),
            ValueSyntax::Store { min, max_ram } => {
                parse_store(value, min, max_ram).map(OptionValue::Store).map_err(bad)
            }
            ValueSyntax::Text { max_len } => {
                if value.is_empty() || value.len() > max_len || !value.bytes().all(|c| c.is_ascii_graphic()) {
                    Err(bad(format!("1 to {max_len} printable ASCII characters, no spaces")))
                } else {
                    Ok(OptionValue::Text(value.to_string()))
                }
            }
            ValueSyntax::Custom { check, .. } => {
                check(value).map(|()| OptionValue::Text(value.to_string())).map_err(bad)
            }
        }
    }
}

fn size_range(min: u64, max: u64) -> String {
    format!(
        "a size from {} to {} (digits with an optional K, M, G or T suffix: powers of 1024)",
        format_size(min),
        format_size(max)
    )
}

/// `ram:SIZE` or `file:/absolute/path`: the store syntax every block device shares (the
/// word in any case).
fn parse_store(value: &str, min: u64, max_ram: u64) -> Result<StoreSpec, String> {
    let split = value.split_once(':').map(|(word, rest)| (word.to_ascii_lowercase(), rest));
    match split.as_ref().map(|(word, rest)| (word.as_str(), *rest)) {
        Some(("ram", size)) => parse_size(size)
            .filter(|n| (min..=max_ram).contains(n))
            .map(StoreSpec::Ram)
            .ok_or_else(|| format!("ram:SIZE takes {}", size_range(min, max_ram))),
        Some(("file", path)) if !path.starts_with('/') => {
            Err("the file must be an absolute path (the daemon's directory is not yours)".into())
        }
        Some(("file", path)) => {
            crate::backing::check(std::path::Path::new(path), min)?;
            Ok(StoreSpec::File(PathBuf::from(path)))
        }
        _ => Err("ram:SIZE or file:/absolute/path".into()),
    }
}

/// A store as the options name it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreSpec {
    /// A RAM disk of this many bytes.
    Ram(u64),
    /// A host file or block device (an absolute path that existed when it was checked).
    File(PathBuf),
}

/// A checked option value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OptionValue {
    /// [`ValueSyntax::Integer`].
    Integer(u64),
    /// [`ValueSyntax::Choice`].
    Word(&'static str),
    /// [`ValueSyntax::Size`], in bytes.
    Size(u64),
    /// [`ValueSyntax::Store`].
    Store(StoreSpec),
    /// [`ValueSyntax::Text`] and [`ValueSyntax::Custom`], as given.
    Text(String),
}

/// Options checked against a type's schema, by key.
#[derive(Clone, Debug, Default)]
pub struct ParsedOptions {
    values: BTreeMap<String, OptionValue>,
}

impl ParsedOptions {
    /// The value of `key`, if given.
    pub fn get(&self, key: &str) -> Option<&OptionValue> {
        self.values.get(key)
    }

    /// An [`OptionValue::Integer`] or [`OptionValue::Size`].
    pub fn number(&self, key: &str) -> Option<u64> {
        match self.values.get(key)? {
            OptionValue::Integer(n) | OptionValue::Size(n) => Some(*n),
            _ => None,
        }
    }

    /// An [`OptionValue::Word`].
    pub fn word(&self, key: &str) -> Option<&'static str> {
        match self.values.get(key)? {
            OptionValue::Word(w) => Some(w),
            _ => None,
        }
    }

    /// An [`OptionValue::Store`].
    pub fn store(&self, key: &str) -> Option<&StoreSpec> {
        match self.values.get(key)? {
            OptionValue::Store(s) => Some(s),
            _ => None,
        }
    }

    /// An [`OptionValue::Text`].
    pub fn text(&self, key: &str) -> Option<&str> {
        match self.values.get(key)? {
            OptionValue::Text(t) => Some(t),
            _ => None,
        }
    }

    /// Every given key and its value, in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &OptionValue)> {
        self.values.iter().map(|(k, v)| (k.as_str(), v))
    }
}

/// Checks `params` against `schema`: every key known, every value as its option says. The
/// error names the key and what it takes; an unknown key's names every key there is.
pub fn parse_options(
    schema: &[OptionSpec],
    params: &BTreeMap<String, String>,
) -> Result<ParsedOptions, String> {
    let mut values = BTreeMap::new();
    for (key, value) in params {
        let Some(spec) = schema.iter().find(|s| s.matches(key)) else {
            let known: Vec<String> = schema.iter().map(OptionSpec::key_pattern).collect();
            return Err(if known.is_empty() {
                format!("unknown option {key:?}: this type takes none")
            } else {
                format!("unknown option {key:?} (it takes {})", known.join(", "))
            });
        };
        values.insert(key.clone(), spec.parse(key, value)?);
    }
    Ok(ParsedOptions { values })
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
        assert_eq!(parse_size("1T"), Some(1 << 40));
        assert_eq!(parse_size("1024G"), parse_size("1t"));
        assert_eq!(parse_size("+5"), None);
        assert_eq!(parse_size("M"), None);
        assert_eq!(format_size(64 << 20), "64M");
        assert_eq!(format_size(1 << 40), "1T");
        assert_eq!(format_size(1000), "1000");
    }

    #[test]
    fn a_schema_checks_keys_and_values() {
        let schema = [
            OptionSpec::new("lba", ValueSyntax::Choice(&["512", "4096"]), Some("512"), "block size"),
            OptionSpec::new("queues", ValueSyntax::Integer { min: 1, max: 64 }, Some("4"), "queues"),
            OptionSpec::new("ns", ValueSyntax::Store { min: 4096, max_ram: 1 << 40 }, None, "a namespace")
                .numbered(1, 16),
        ];
        let parse = |pairs: &[(&str, &str)]| {
            let params = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            parse_options(&schema, &params)
        };
        let ok = parse(&[("lba", "4096"), ("queues", "64"), ("ns16", "ram:1T")]).unwrap();
        assert_eq!((ok.word("lba"), ok.number("queues")), (Some("4096"), Some(64)));
        assert_eq!(ok.store("ns16"), Some(&StoreSpec::Ram(1 << 40)));
        assert_eq!(parse(&[("lba", "3")]).unwrap_err(), "lba=3: one of 512, 4096");
        assert!(parse(&[("queues", "0")]).unwrap_err().starts_with("queues=0: a whole number from 1 to 64"));
        assert!(parse(&[("queues", "+3")]).is_err());
        let unknown = parse(&[("foo", "bar")]).unwrap_err();
        assert_eq!(unknown, r#"unknown option "foo" (it takes lba, queues, ns1..ns16)"#);
        let port = OptionSpec::new("port", ValueSyntax::Choice(&["pty"]), None, "").numbered(0, 1);
        // A choice in any case is the word it names.
        assert_eq!(port.parse("port0", "PTY"), Ok(OptionValue::Word("pty")));
        assert!(
            port.matches("port0")
                && port.matches("port1")
                && !port.matches("port00")
                && !port.matches("port2")
        );
        for key in ["ns0", "ns17", "ns01", "ns", "nsx"] {
            assert!(parse(&[(key, "ram:1M")]).unwrap_err().starts_with("unknown option"), "{key}");
        }
        assert!(parse(&[("ns1", "ram:1025G")]).unwrap_err().contains("4K to 1T"));
        assert!(parse(&[("ns1", "ram:1000")]).is_err(), "under the minimum");
        assert!(parse(&[("ns1", "RAM:1M")]).is_ok(), "the word in any case");
        assert!(parse(&[("ns1", "file:rel.img")]).unwrap_err().contains("absolute"));
        assert!(parse(&[("ns1", "file:/nonexistent/x.img")]).unwrap_err().contains("No such file"));
        assert!(parse(&[("ns1", "file:/")]).unwrap_err().contains("not a regular file"));
        let dir = std::env::temp_dir().join(format!("umdev-types-{}", std::process::id()));
        std::fs::write(&dir, b"sixby").unwrap();
        let small = format!("file:{}", dir.display());
        assert!(parse(&[("ns1", &small)]).unwrap_err().contains("5 bytes; a store has at least 4096"));
        std::fs::write(&dir, vec![0u8; 4096]).unwrap();
        assert_eq!(parse(&[("ns1", &small)]).unwrap().store("ns1"), Some(&StoreSpec::File(dir.clone())));
        std::fs::remove_file(&dir).unwrap();
        assert_eq!(schema[2].key_pattern(), "ns1..ns16");
        assert!(parse_options(&[], &[("a".to_string(), "b".to_string())].into())
            .unwrap_err()
            .contains("takes none"));
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
