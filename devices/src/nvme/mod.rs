//! `nvme`: an NVMe controller (NVM Express 1.3, PCIe) that a stock guest driver binds,
//! formats and mounts, with every command's data pinned with ONE call.
//!
//! A Read or Write names its data with PRPs: PRP1, then PRP2 or a PRP list, the same
//! shape as a channel program's IDAW list. The controller turns them into one array of
//! guest page numbers ([`prp`]), pins it with one call to the engine, which cuts it into
//! contiguous runs, and moves the data between the runs and the namespace's store with
//! one vectored call ([`crate::store`]): `preadv2`/`pwritev2` for a host file or block
//! device, one copy per run for a RAM disk. Statistics show what run splitting made of the
//! guest's real I/O (pages, runs and pin calls per command).
//!
//! Every submission queue, the admin queue's included, has a worker thread ([`worker`]);
//! doorbells arrive as posted REGION_WRITEs (or, for a client that maps it, through a page the
//! guest writes directly and the workers poll). The ABI, the options and what is not
//! implemented are in docs/nvme.md.
//!
//! # Modules, and what each imports
//!
//! Each module imports only those below it; `tests::no_import_circle` reads the sources and
//! fails if an import is missing from this list or the list has a circle. The controller
//! starts queue workers through a function it is given ([`ctrl::Spawn`]), not by importing
//! the worker.
//!
//! - `worker` (a queue's fetch loop) → completion, cx, admin, io, cmds, ctrl, queue, spec
//! - `admin` (admin command handlers) → cx, completion, cmds, ctrl, state, namespace, prp, queue, stats, spec
//! - `io` (NVM command handlers) → cx, completion, cmds, ctrl, namespace, prp, stats, spec
//! - `cx` (what a handler sees) → cmds, completion, ctrl, prp, queue, spec
//! - `completion` (posting completions) → ctrl, queue, spec, stats
//! - `ctrl` (registers, queue table, events) → namespace, queue, state, stats, spec
//! - `state` (features, events, error log) → queue, spec
//! - `cmds` (typed commands) → spec
//! - `prp` (data pointers) → spec
//! - `queue` (doorbells, rings, SQ, CQ) → spec
//! - `namespace`, `stats`, `spec` → nothing of nvme

mod admin;
pub mod cmds;
mod completion;
pub mod ctrl;
mod cx;
mod io;
pub mod namespace;
pub mod prp;
pub mod queue;
pub mod spec;
mod state;
pub mod stats;
mod worker;

use std::fs::File;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use serde_json::json;
use thiserror::Error;

pub use self::ctrl::{AioMode, FixedBuffers};
use self::ctrl::{ControllerConfig, Ctrl, DoorbellMode, Doorbells};
use self::namespace::{Backing, Namespace, MAX_NAMESPACES};
use self::queue::DoorbellPage;
use self::spec::reg;
use self::stats::Totals;
use crate::store::Cache;
use umdev_mdev::pci::{
    Bar, ClassCode, ConfigSpaceBuilder, MsiCap, MsixCap, PciDevice, PciFunction, PciIds, Reg, RegMap,
};
use umdev_mdev::types::{parse_options, OptionSpec, OptionValue, ParsedOptions, StoreSpec, ValueSyntax};
use umdev_mdev::{DeviceError, RegionMmap, SparseArea};

pub use self::spec::{DEVICE_ID, VENDOR_ID};

/// The type's name.
pub const TYPE_NAME: &str = "nvme";
/// BAR0: registers, doorbells, the MSI-X table and PBA.
pub const BAR0_SIZE: u64 = 0x4000;
/// The MSI-X table's offset in BAR0.
pub const MSIX_TABLE_OFFSET: u32 = 0x2000;
/// The MSI-X PBA's offset in BAR0.
pub const MSIX_PBA_OFFSET: u32 = 0x3000;
/// I/O queue pairs by default, and at most.
pub const DEFAULT_IO_QUEUES: u16 = 4;
/// See [`DEFAULT_IO_QUEUES`].
pub const MAX_IO_QUEUES: u16 = 64;
/// Entries per queue by default (CAP.MQES + 1), and at most.
pub const DEFAULT_ENTRIES: u32 = 1024;
/// See [`DEFAULT_ENTRIES`].
pub const MAX_ENTRIES: u32 = 4096;
/// What a file backing that stops answering may hold by default (`max_held`): four stopped
/// lifetimes of a queue kept full.
pub const DEFAULT_MAX_HELD: usize = 4 * worker::MAX_IN_FLIGHT as usize;
/// The most `max_held` may be.
pub const MAX_HELD: usize = 65_536;
/// How long a worker watches its doorbell after a lone command, by default (`poll_us`).
pub const DEFAULT_POLL: std::time::Duration = std::time::Duration::from_micros(200);

/// Why an nvme device could not be made, or its options are refused.
#[derive(Debug, Error)]
pub enum NvmeError {
    /// The options break the type's schema (`umdev types nvme`).
    #[error("{0}")]
    Options(String),
    /// A RAM namespace that is not whole blocks.
    #[error("{key}=ram:{size}: not a whole number of {block}-byte blocks (lba={block})")]
    RamNotWholeBlocks {
        /// The option's key (`ns1`).
        key: String,
        /// The size as given.
        size: String,
        /// Bytes per block.
        block: u32,
    },
    /// A RAM namespace on huge pages that is not whole huge pages.
    #[error("{key}=ram:{size}: not a whole number of 2 MiB pages (ram_pages=2m)")]
    RamNotWholeHugePages {
        /// The option's key (`ns1`).
        key: String,
        /// The size as given.
        size: String,
    },
    /// A cache mode given for a namespace that is not a file.
    #[error("{key}: ns{nsid} is not a file namespace (a cache mode is for files and block devices)")]
    CacheWithoutFile {
        /// The option's key (`cache1`).
        key: String,
        /// The namespace.
        nsid: usize,
    },
    /// Two namespaces on one file or block device.
    #[error("{key}: the same file or block device as {first} (a backing serves one namespace)")]
    SameBacking {
        /// The later namespace's key (`ns2`).
        key: String,
        /// The earlier one's.
        first: String,
    },
    /// An option given that cannot apply to the device as the other options make it.
    #[error("{key}={value} cannot apply: {why}")]
    NoEffect {
        /// The option's key.
        key: &'static str,
        /// Its value (a choice as its canonical word).
        value: String,
        /// Why.
        why: &'static str,
    },
    /// A config made without options is out of range.
    #[error("{what} {value}: {range}")]
    OutOfRange {
        /// The field.
        what: &'static str,
        /// Its value.
        value: u64,
        /// What it may be.
        range: String,
    },
    /// A namespace could not be made.
    #[error(transparent)]
    Namespace(#[from] namespace::NamespaceError),
    /// The doorbell page could not be made.
    #[error("doorbell page: {0}")]
    DoorbellPage(std::io::Error),
    /// The BAR0 register map could not be built.
    #[error("register map: {0}")]
    RegisterMap(String),
    /// The PCI function could not be built.
    #[error(transparent)]
    Pci(#[from] umdev_mdev::pci::device::PciDeviceError),
}

/// How to build an nvme device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmeConfig {
    /// Namespace `i + 1`'s backing, if active.
    pub namespaces: Vec<Option<Backing>>,
    /// log2 of the LBA size (9: 512 bytes, 12: 4 KiB).
    pub lba_shift: u32,
    /// I/O queue pairs.
    pub io_queues: u16,
    /// Entries per queue at most.
    pub max_entries: u32,
    /// How doorbells arrive.
    pub doorbells: Doorbells,
    /// Serial number; `None`: derived from the file namespaces' paths, or random.
    pub serial: Option<String>,
    /// How long a queue's worker watches its doorbell after a lone command before sleeping.
    pub poll: std::time::Duration,
    /// How file namespaces' data moves.
    pub aio: AioMode,
    /// In kernel pin mode, which O_DIRECT transfers of file namespaces move through the
    /// kernel's pinned runs as fixed buffers (`READ_FIXED`/`WRITE_FIXED`).
    pub fixed_buffers: FixedBuffers,
    /// How much a file backing that does not answer may hold before its namespace's new
    /// commands fail at once with Namespace Not Ready (`max_held`; docs/nvme.md).
    pub max_held: usize,
    /// Whether sparse RAM namespaces' memory is taken ahead of the guest's writes, where the
    /// host can afford it (`ram_populate`; [`crate::populate`]); `None`: on transparent huge
    /// pages (`ram_pages=thp`), not on 4 KiB ones (`4k`, chosen to take no more than is
    /// written).
    pub ram_populate: Option<bool>,
}

impl Default for NvmeConfig {
    fn default() -> Self {
        NvmeConfig {
            namespaces: vec![Some(Backing::Ram(1 << 30))],
            lba_shift: 9,
            io_queues: DEFAULT_IO_QUEUES,
            max_entries: DEFAULT_ENTRIES,
            doorbells: Doorbells::Auto,
            serial: None,
            poll: DEFAULT_POLL,
            aio: AioMode::default(),
            fixed_buffers: FixedBuffers::default(),
            max_held: DEFAULT_MAX_HELD,
            ram_populate: None,
        }
    }
}

impl NvmeConfig {
    /// The type's options (docs/nvme.md), as `umdev types -v` lists them.
    pub fn option_specs() -> Vec<OptionSpec> {
        vec![
            OptionSpec::new(
                "ns",
                ValueSyntax::Store { min: 4096, max_ram: 1 << 40 },
                None,
                "namespace N: a RAM disk (a whole number of blocks) or a host file or block device, used in \
                 place (its size rounded down to whole blocks); ns1=ram:1G when no namespace is given",
            )
            .numbered(1, MAX_NAMESPACES),
            OptionSpec::new(
                "cache",
                ValueSyntax::Choice(&["writeback", "none"]),
                Some("writeback"),
                "file namespace N's cache mode: writeback (through the host's page cache) or none (O_DIRECT, \
                 straight between the disk and guest memory; transfers not aligned as the host needs go through \
                 the page cache). Either way Flush makes writes durable and FUA makes one durable at once",
            )
            .numbered(1, MAX_NAMESPACES),
            OptionSpec::new(
                "aio",
                ValueSyntax::Choice(&["io_uring", "sync"]),
                Some("io_uring"),
                "how file namespaces' data moves: io_uring (an io_uring per I/O queue, up to 256 commands in \
                 flight each, completed as the host finishes them) or sync (one synchronous call per command, \
                 in order)",
            ),
            OptionSpec::new(
                "fixed_buffers",
                ValueSyntax::Choice(&["on", "off", "always"]),
                Some("on"),
                "with --pin-mode kernel and aio=io_uring: an O_DIRECT transfer of at least 64 KiB (always: of \
                 any size) whose memory is one pinned run moves through the kernel's pin of that run as a fixed \
                 buffer (READ_FIXED/WRITE_FIXED), so the host takes no page pins of its own for it; off: plain \
                 reads and writes. on and always are refused without aio=io_uring, a cacheN=none namespace and \
                 --pin-mode kernel",
            ),
            OptionSpec::new(
                "lba",
                ValueSyntax::Choice(&["512", "4096"]),
                Some("512"),
                "bytes per logical block",
            ),
            OptionSpec::new(
                "queues",
                ValueSyntax::Integer { min: 1, max: MAX_IO_QUEUES as u64 },
                Some("4"),
                "I/O queue pairs offered",
            ),
            OptionSpec::new(
                "entries",
                ValueSyntax::Integer { min: 2, max: MAX_ENTRIES as u64 },
                Some("1024"),
                "entries per queue at most",
            ),
            OptionSpec::new(
                "doorbells",
                ValueSyntax::Choice(&["auto", "message", "mmap"]),
                Some("auto"),
                "message: doorbells as posted REGION_WRITEs; mmap: on a page the client maps; auto: per client, \
                 messages for one that announces VERSION capabilities (a VMM), the page for one that announces \
                 none (a polling driver such as SPDK's)",
            ),
            OptionSpec::new(
                "ram_pages",
                ValueSyntax::Choice(&["thp", "4k", "2m"]),
                Some("thp"),
                "pages of the RAM namespaces: thp (memory taken as written, 2 MiB at a time on transparent huge \
                 pages where the host gives them), 4k (a sparse memfd, taken 4 KiB at a time) or 2m (the host's \
                 hugetlb pool, which must hold them: sizes in whole 2 MiB, all reserved at creation)",
            ),
            OptionSpec::new(
                "ram_populate",
                ValueSyntax::Choice(&["background", "off"]),
                None,
                "memory of the RAM namespaces on thp or 4k pages: background (taken by a thread of the daemon \
                 right after the device is made, so that the guest's first writes find it there, 64 MiB at a time \
                 while what every such pass of the daemon has left to take is at most half the memory available \
                 beyond 256 MiB) or off (taken only as the guest writes) (default: background on thp, off on 4k)"
            ),
            OptionSpec::new(
                "serial",
                ValueSyntax::Text { max_len: 20 },
                None,
                "Identify serial number (default: derived from the file namespaces' paths, else random)",
            ),
            OptionSpec::new(
                "poll_us",
                ValueSyntax::Integer { min: 0, max: 10_000 },
                Some("200"),
                "microseconds a queue's worker watches its doorbell after a lone command before it sleeps",
            ),
            OptionSpec::new(
                "max_held",
                ValueSyntax::Integer { min: 1, max: MAX_HELD as u64 },
                Some("1024"),
                "how much a file backing that stops answering may hold (transfers left in the kernel by \
                 stopped queues per namespace; queue workers left blocked in a synchronous call to it, per \
                 controller) before the namespace's new commands fail at once with Namespace Not Ready, until \
                 it answers again (a threshold: what live queues had in flight then still joins)",
            ),
        ]
    }

    /// Parses the type's options (docs/nvme.md): the schema of [`NvmeConfig::option_specs`],
    /// then what spans keys (a RAM namespace is whole blocks of `lba`).
    pub fn from_options(options: &umdev_mdev::types::InstanceOptions) -> Result<NvmeConfig, NvmeError> {
        let p = parse_options(&Self::option_specs(), &options.params).map_err(NvmeError::Options)?;
        let mut config = NvmeConfig { namespaces: Vec::new(), ..NvmeConfig::default() };
        if let Some(v) = p.word("lba") {
            config.lba_shift = if v == "4096" { 12 } else { 9 };
        }
        let (huge, small) = (p.word("ram_pages") == Some("2m"), p.word("ram_pages") == Some("4k"));
        for (key, value) in p.iter() {
            let (Some(n), OptionValue::Store(store)) = (key.strip_prefix("ns"), value) else { continue };
            // The schema let only ns1..ns16 through.
            let index = n.parse::<usize>().map_err(|e| NvmeError::Options(format!("{key}: {e}")))? - 1;
            let backing = match store {
                StoreSpec::Ram(bytes) if !bytes.is_multiple_of(1 << config.lba_shift) => {
                    return Err(NvmeError::RamNotWholeBlocks {
                        key: key.to_string(),
                        size: umdev_mdev::types::format_size(*bytes),
                        block: 1u32 << config.lba_shift,
                    })
                }
                StoreSpec::Ram(bytes) if huge && !bytes.is_multiple_of(crate::store::HUGE_PAGE) => {
                    return Err(NvmeError::RamNotWholeHugePages {
                        key: key.to_string(),
                        size: umdev_mdev::types::format_size(*bytes),
                    })
                }
                StoreSpec::Ram(bytes) if huge => Backing::HugeRam(*bytes),
                StoreSpec::Ram(bytes) if small => Backing::SmallRam(*bytes),
                StoreSpec::Ram(bytes) => Backing::Ram(*bytes),
                StoreSpec::File(path) => Backing::File(path.clone(), Cache::default()),
            };
            if config.namespaces.len() <= index {
                config.namespaces.resize(index + 1, None);
            }
            config.namespaces[index] = Some(backing);
        }
        for (key, value) in p.iter() {
            let (Some(n), OptionValue::Word(mode)) = (key.strip_prefix("cache"), value) else { continue };
            let nsid = n.parse::<usize>().map_err(|e| NvmeError::Options(format!("{key}: {e}")))?;
            let cache = if *mode == "none" { Cache::None } else { Cache::Writeback };
            match config.namespaces.get_mut(nsid - 1) {
                Some(Some(Backing::File(_, c))) => *c = cache,
                _ => return Err(NvmeError::CacheWithoutFile { key: key.to_string(), nsid }),
            }
        }
        if config.namespaces.is_empty() {
            // The default namespace: 1 GiB of RAM, on the pages asked for (a whole number of
            // huge pages).
            config.namespaces = NvmeConfig::default().namespaces;
            if huge {
                config.namespaces = vec![Some(Backing::HugeRam(1 << 30))];
            } else if small {
                config.namespaces = vec![Some(Backing::SmallRam(1 << 30))];
            }
        }
        if p.word("aio") == Some("sync") {
            config.aio = AioMode::Sync;
        }
        match p.word("fixed_buffers") {
            Some("off") => config.fixed_buffers = FixedBuffers::Off,
            Some("always") => config.fixed_buffers = FixedBuffers::Always,
            _ => {}
        }
        if let Some(n) = p.number("queues") {
            config.io_queues = n as u16;
        }
        if let Some(n) = p.number("entries") {
            config.max_entries = n as u32;
        }
        if let Some(v) = p.word("doorbells") {
            config.doorbells = match v {
                "mmap" => Doorbells::Mapped,
                "message" => Doorbells::Message,
                _ => Doorbells::Auto,
            };
        }
        if let Some(us) = p.number("poll_us") {
            config.poll = std::time::Duration::from_micros(us);
        }
        if let Some(n) = p.number("max_held") {
            config.max_held = n as usize;
        }
        config.ram_populate = p.word("ram_populate").map(|w| w == "background");
        if let Some(v) = p.text("serial") {
            config.serial = Some(v.to_string());
        }
        config.refuse_shared_backings()?;
        config.refuse_inapplicable(&p, options.pin_mode())?;
        // The default `on` where nothing could go fixed is off, as the statistics say.
        if config.why_nothing_goes_fixed(options.pin_mode()).is_some() {
            config.fixed_buffers = FixedBuffers::Off;
        }
        Ok(config)
    }

    /// Why no transfer of this configuration could move through a fixed buffer, if none
    /// could.
    fn why_nothing_goes_fixed(&self, pin_mode: umdev_pinning::PinMode) -> Option<&'static str> {
        if self.aio != AioMode::IoUring {
            return Some("fixed buffers are io_uring's (aio=io_uring)");
        }
        if !self.namespaces.iter().flatten().any(|b| matches!(b, Backing::File(_, Cache::None))) {
            return Some("they carry O_DIRECT transfers, and no namespace has cacheN=none");
        }
        if pin_mode != umdev_pinning::PinMode::Kernel {
            return Some("they are the kernel's pins (--pin-mode kernel)");
        }
        None
    }

    /// Refuses two namespaces on one file or block device (by its identity, whatever
    /// the paths): each would take it for its own, so the second could not be opened.
    fn refuse_shared_backings(&self) -> Result<(), NvmeError> {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        let mut seen: Vec<((u64, u64), usize)> = Vec::new();
        for (i, b) in self.namespaces.iter().enumerate() {
            let Some(Backing::File(path, _)) = b else { continue };
            // Checked by the options; if it is gone since, making the device says so.
            let Ok(meta) = std::fs::metadata(path) else { continue };
            let id = if meta.file_type().is_block_device() {
                (u64::MAX, meta.rdev())
            } else {
                (meta.dev(), meta.ino())
            };
            if let Some(&(_, first)) = seen.iter().find(|(s, _)| *s == id) {
                return Err(NvmeError::SameBacking {
                    key: format!("ns{}", i + 1),
                    first: format!("ns{}", first + 1),
                });
            }
            seen.push((id, i));
        }
        Ok(())
    }

    /// Refuses an option given that the rest of the config keeps from applying, rather than
    /// taking it silently.
    fn refuse_inapplicable(
        &self,
        p: &ParsedOptions,
        pin_mode: umdev_pinning::PinMode,
    ) -> Result<(), NvmeError> {
        let refuse = |key: &'static str, why: &'static str| {
            let value = p.word(key).map(str::to_string).or_else(|| p.number(key).map(|n| n.to_string()));
            Err(NvmeError::NoEffect { key, value: value.unwrap_or_default(), why })
        };
        let files = self.namespaces.iter().flatten().any(|b| matches!(b, Backing::File(..)));
        if p.get("aio").is_some() && !files {
            return refuse("aio", "no namespace is a file or block device");
        }
        // `off` asks for nothing, and may stay in a definition whatever else changes.
        if p.word("fixed_buffers").is_some_and(|w| w != "off") {
            if let Some(why) = self.why_nothing_goes_fixed(pin_mode) {
                return refuse("fixed_buffers", why);
            }
        }
        let ram = self.namespaces.iter().flatten().any(|b| !matches!(b, Backing::File(..)));
        if p.get("ram_pages").is_some() && !ram {
            return refuse("ram_pages", "no namespace is a RAM disk");
        }
        // `off` asks for nothing, as above.
        let sparse =
            self.namespaces.iter().flatten().any(|b| matches!(b, Backing::Ram(_) | Backing::SmallRam(_)));
        if p.word("ram_populate") == Some("background") && !sparse {
            return refuse(
                "ram_populate",
                "no namespace is a RAM disk on thp or 4k pages (ram_pages=2m takes all its memory when made)",
            );
        }
        if p.get("poll_us").is_some() && self.doorbells == Doorbells::Mapped {
            return refuse(
                "poll_us",
                "it is how long a worker watches after a doorbell message (doorbells=message or auto)",
            );
        }
        Ok(())
    }

    /// Checks what [`create`] relies on, for configs not made by [`NvmeConfig::from_options`]
    /// (which refuses the same with option-specific messages).
    pub fn validate(&self) -> Result<(), NvmeError> {
        let out = |what, value: u64, range: String| Err(NvmeError::OutOfRange { what, value, range });
        if ![9, 12].contains(&self.lba_shift) {
            return out("lba_shift", self.lba_shift.into(), "9 or 12".into());
        }
        if !(1..=MAX_IO_QUEUES).contains(&self.io_queues) {
            return out("io_queues", self.io_queues.into(), format!("1 to {MAX_IO_QUEUES}"));
        }
        if !(2..=MAX_ENTRIES).contains(&self.max_entries) {
            return out("max_entries", self.max_entries.into(), format!("2 to {MAX_ENTRIES}"));
        }
        if self.namespaces.len() > MAX_NAMESPACES as usize {
            return out("namespaces", self.namespaces.len() as u64, format!("at most {MAX_NAMESPACES}"));
        }
        if !(1..=MAX_HELD).contains(&self.max_held) {
            return out("max_held", self.max_held as u64, format!("1 to {MAX_HELD}"));
        }
        Ok(())
    }
}

/// A serial number: stable for a device whose namespaces are files (derived from their
/// canonical paths), random otherwise; unique per device either way (a running device has
/// its files to itself).
fn default_serial(config: &NvmeConfig) -> String {
    let files: Vec<_> = config.namespaces.iter().flatten().filter_map(canonical_file).collect();
    let value = if files.is_empty() {
        let mut bytes = [0u8; 8];
        random_bytes(&mut bytes);
        u64::from_le_bytes(bytes)
    } else {
        files.iter().fold(StableHash::new(), |h, p| h.bytes(p.as_os_str().as_encoded_bytes()).bytes(&[0])).0
    };
    format!("UMDEV{:012X}", value & 0xffff_ffff_ffff)
}

/// A file namespace's path as its identity: a regular file's canonical path (the same file
/// whatever link names it), a block device's path as given (`/dev/disk/by-id/...` names the
/// same disk after a reboot; the `/dev/sdX` it leads to may not).
fn canonical_file(b: &Backing) -> Option<std::path::PathBuf> {
    use std::os::unix::fs::FileTypeExt;
    match b {
        Backing::File(p, _) if std::fs::metadata(p).is_ok_and(|m| m.file_type().is_block_device()) => {
            Some(p.clone())
        }
        Backing::File(p, _) => Some(std::fs::canonicalize(p).unwrap_or_else(|_| p.clone())),
        Backing::Ram(_) | Backing::SmallRam(_) | Backing::HugeRam(_) => None,
    }
}

/// FNV-1a, 64 bits: identities derived from it (serial numbers, NGUIDs) stay what they were
/// across builds and toolchains, where std's hasher promises nothing.
#[derive(Clone, Copy)]
struct StableHash(u64);

impl StableHash {
    fn new() -> StableHash {
        StableHash(0xcbf2_9ce4_8422_2325)
    }

    fn bytes(self, bytes: &[u8]) -> StableHash {
        StableHash(bytes.iter().fold(self.0, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)))
    }
}

/// Sparse RAM namespaces take the host's memory as the guest writes them: more of them than
/// the host has (memory and swap) is allowed, and said, since a guest that fills them takes
/// the host's memory (and every other instance's) with it.
fn warn_if_ram_exceeds_host(config: &NvmeConfig) {
    let ram: u64 = config
        .namespaces
        .iter()
        .flatten()
        .map(|b| match b {
            Backing::Ram(n) | Backing::SmallRam(n) => *n,
            Backing::HugeRam(_) | Backing::File(..) => 0, // reserved up front, or on disk
        })
        .sum();
    let Ok(info) = nix::sys::sysinfo::sysinfo() else { return };
    let host = info.ram_total().saturating_add(info.swap_total());
    if ram > host {
        // A disk that large is meant to be written sparsely, where 2 MiB pages take up to
        // 512 times what is written.
        let transparent = config.namespaces.iter().flatten().any(|b| matches!(b, Backing::Ram(_)));
        log::warn!(
            "nvme: the RAM namespaces hold {:.1} GiB and the host has {:.1} GiB of memory and swap: a guest \
             that fills them exhausts it{}",
            ram as f64 / f64::from(1 << 30),
            host as f64 / f64::from(1 << 30),
            if transparent {
                "; on transparent huge pages (ram_pages=thp, the default) a first write takes 2 MiB of memory \
                 however small it is, where ram_pages=4k takes 4 KiB"
            } else {
                ""
            }
        );
    }
}

fn random_bytes(buf: &mut [u8]) {
    // SAFETY: getrandom writes at most `buf.len()` bytes into the buffer it is given.
    let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n != buf.len() as isize {
        // No entropy source: fall back on time and pid (unique enough for a serial).
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let v = t.as_nanos() as u64 ^ u64::from(std::process::id()) << 40;
        for (b, v) in buf.iter_mut().zip(v.to_le_bytes().iter().cycle()) {
            *b = *v;
        }
    }
}

/// A namespace's NGUID: a file namespace's from its file's path ([`canonical_file`]) and the
/// serial if one was given (the file keeps its identity whatever else the device has; the
/// same path on two hosts is told apart by their serials), a RAM namespace's from the serial
/// number and the NSID.
fn nguid(serial: &str, given: Option<&str>, nsid: u32, backing: &Backing) -> [u8; 16] {
    let seed = match canonical_file(backing) {
        Some(path) => StableHash::new()
            .bytes(b"file\0")
            .bytes(given.unwrap_or("").as_bytes())
            .bytes(&[0])
            .bytes(path.as_os_str().as_encoded_bytes()),
        None => StableHash::new().bytes(serial.as_bytes()).bytes(&[0]).bytes(&nsid.to_le_bytes()),
    };
    let mut out = [0u8; 16];
    for (i, half) in out.chunks_exact_mut(8).enumerate() {
        half.copy_from_slice(&seed.bytes(&[i as u8]).0.to_le_bytes());
    }
    out
}

/// The nvme device's config space.
pub fn config(io_queues: u16) -> ConfigSpaceBuilder {
    let ids = PciIds {
        vendor_id: VENDOR_ID,
        device_id: DEVICE_ID,
        subsystem_vendor_id: VENDOR_ID,
        subsystem_id: DEVICE_ID,
        revision: 1,
        // Mass storage, non-volatile memory, NVM Express.
        class: ClassCode { base: 0x01, sub: 0x08, prog_if: 0x02 },
    };
    ConfigSpaceBuilder::new(ids)
        .bar(0, Bar::mem64(BAR0_SIZE))
        .interrupt_pin(1)
        .power_management()
        .msi(MsiCap { vectors: 1, per_vector_mask: true, addr64: true })
        .msix(MsixCap {
            vectors: io_queues + 1,
            table_bar: 0,
            table_offset: MSIX_TABLE_OFFSET,
            pba_bar: 0,
            pba_offset: MSIX_PBA_OFFSET,
        })
        .pcie()
}

/// Creates an nvme device.
pub fn create(config: NvmeConfig) -> Result<PciDevice<Nvme>, NvmeError> {
    config.validate()?;
    warn_if_ram_exceeds_host(&config);
    let serial = config.serial.clone().unwrap_or_else(|| default_serial(&config));
    let namespaces = config
        .namespaces
        .iter()
        .enumerate()
        .map(|(i, b)| {
            b.as_ref()
                .map(|b| {
                    let id = nguid(&serial, config.serial.as_deref(), i as u32 + 1, b);
                    let mut ns = Namespace::new(i as u32 + 1, b, config.lba_shift, id)?;
                    if config.ram_populate.unwrap_or(matches!(b, Backing::Ram(_))) {
                        ns.populate();
                    }
                    Ok::<_, namespace::NamespaceError>(ns)
                })
                .transpose()
        })
        .collect::<Result<Vec<_>, _>>()?;
    let (mmap, page) = match config.doorbells {
        Doorbells::Message => (None, None),
        Doorbells::Mapped | Doorbells::Auto => {
            let file = doorbell_file().map_err(NvmeError::DoorbellPage)?;
            let page = DoorbellPage::new(file.try_clone().map_err(NvmeError::DoorbellPage)?, reg::DOORBELLS)
                .map_err(NvmeError::DoorbellPage)?;
            (Some(arc_swap::ArcSwapOption::from_pointee(OwnedFd::from(file))), Some(page))
        }
    };
    let files = namespaces.iter().flatten().any(|ns| ns.is_file());
    let aio = match config.aio {
        AioMode::IoUring if files => match crate::aio::available() {
            Ok(()) => AioMode::IoUring,
            Err(e) => {
                log::warn!(
                    "nvme: no io_uring here ({e}): file namespaces are served synchronously (aio=sync)"
                );
                AioMode::Sync
            }
        },
        _ => AioMode::Sync,
    };
    let controller = ControllerConfig {
        namespaces,
        io_queues: config.io_queues,
        max_entries: config.max_entries,
        doorbells: config.doorbells,
        serial,
        poll: config.poll,
        aio,
        // Fixed buffers are io_uring's: off where file data moves synchronously after all.
        fixed_buffers: if aio == AioMode::IoUring { config.fixed_buffers } else { FixedBuffers::Off },
        max_held: config.max_held,
    };
    let regs: Vec<Reg<u64>> = [
        (reg::CAP, false),
        (reg::CAP + 4, false),
        (reg::VS, false),
        (reg::INTMS, true),
        (reg::INTMC, true),
        (reg::CC, true),
        (reg::CSTS, false),
        (reg::NSSR, true),
        (reg::AQA, true),
        (reg::ASQ, true),
        (reg::ASQ + 4, true),
        (reg::ACQ, true),
        (reg::ACQ + 4, true),
        (reg::CMBLOC, false),
        (reg::CMBSZ, false),
    ]
    .iter()
    .map(|&(o, rw)| if rw { Reg::rw(o, o) } else { Reg::ro(o, o) })
    .collect();
    let map = RegMap::builder(0, reg::DOORBELLS)
        .widths(&[4, 8])
        .build(&regs)
        .map_err(|e| NvmeError::RegisterMap(e.to_string()))?;
    Ok(PciDevice::new(self::config(config.io_queues), |host| Nvme {
        ctrl: Arc::new(Ctrl::new(host, controller, page, worker::spawn)),
        map,
        mmap,
    })?)
}

/// BAR0's file for a client to map (the doorbell page at 0x1000): sealed, so that the client
/// cannot shrink it under the workers' mapping of the page.
fn doorbell_file() -> std::io::Result<File> {
    #[cfg(test)]
    if tests::NO_FDS.get() {
        return Err(std::io::Error::from_raw_os_error(libc::EMFILE));
    }
    umdev_mdev::region_memfd(c"umdev-nvme-bar0", BAR0_SIZE)
}

/// The nvme PCI function (serve it through [`PciDevice`]; see [`create`]).
#[derive(Debug)]
pub struct Nvme {
    ctrl: Arc<Ctrl>,
    map: RegMap<u64>,
    /// BAR0's backing for `doorbells=mmap` and `auto` (the doorbell page at 0x1000): a new
    /// file at each detach, so that a client that left cannot ring the next one's queues.
    /// Inner `None` after a detach that could not make one (no fd to spare): the page is the
    /// process's own meanwhile, and BAR0 offers no mmap until a file can be made.
    mmap: Option<arc_swap::ArcSwapOption<OwnedFd>>,
}

impl Nvme {
    /// The controller (for tests and statistics).
    pub fn controller(&self) -> &Arc<Ctrl> {
        &self.ctrl
    }

    /// What the controller did so far.
    pub fn totals(&self) -> Totals {
        Totals::of(self.ctrl.all_stats().iter().skip(1))
    }

    /// A new doorbell file, mapped at the workers' page from now on.
    fn new_doorbell_file(&self) -> std::io::Result<Arc<OwnedFd>> {
        let file = doorbell_file()?;
        self.ctrl.replace_doorbell_page(&file)?;
        Ok(Arc::new(OwnedFd::from(file)))
    }
}

impl PciFunction for Nvme {
    fn bar_read(&self, bar: u8, offset: u64, data: &mut [u8]) -> Result<(), DeviceError> {
        if bar != 0 {
            return Err(DeviceError::NoSuchRegion(u32::from(bar)));
        }
        if offset < reg::DOORBELLS {
            return self.map.read(offset, data, |hit| u64::from(self.ctrl.read_register(hit.key)));
        }
        if offset < 2 * reg::DOORBELLS {
            check_doorbell_access(offset, data.len())?;
        }
        data.fill(0); // doorbells are write-only; the rest of the BAR is reserved
        Ok(())
    }

    fn bar_write(&self, bar: u8, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        if bar != 0 {
            return Err(DeviceError::NoSuchRegion(u32::from(bar)));
        }
        if offset < reg::DOORBELLS {
            return self
                .map
                .write(offset, data, |hit, value, _| self.ctrl.write_register(hit.key, value as u32));
        }
        if offset < 2 * reg::DOORBELLS {
            check_doorbell_access(offset, data.len())?;
            let value = u32::from_le_bytes(data.try_into().expect("a 4-byte access"));
            self.ctrl.doorbell((offset - reg::DOORBELLS) / 4, value);
        }
        Ok(())
    }

    fn bar_mmap(&self, bar: u8) -> Option<RegionMmap> {
        let slot = self.mmap.as_ref().filter(|_| bar == 0)?;
        let fd = match slot.load_full() {
            Some(fd) => fd,
            None => {
                let fd = self
                    .new_doorbell_file()
                    .map_err(|e| log::debug!("nvme: still no doorbell page: {e}"))
                    .ok()?;
                slot.store(Some(fd.clone()));
                fd
            }
        };
        Some(RegionMmap {
            fd,
            offset: 0,
            areas: vec![SparseArea { offset: reg::DOORBELLS, size: reg::DOORBELLS }],
        })
    }

    fn client_version(&self, hello: &umdev_mdev::ClientHello) {
        self.ctrl.client_version(hello);
    }

    fn offer_mmap(&self, bar: u8, _hello: &umdev_mdev::ClientHello) -> bool {
        bar == 0 && self.ctrl.doorbell_mode() == DoorbellMode::Mapped
    }

    fn reset(&self) {
        self.ctrl.reset();
    }

    fn detach(&self) {
        self.ctrl.reset();
        // The next client maps a page of its own; the workers read it from now on.
        if let Some(slot) = &self.mmap {
            match self.new_doorbell_file() {
                Ok(fd) => slot.store(Some(fd)),
                Err(e) => {
                    log::error!(
                        "nvme: no new doorbell page for the next client ({e}); BAR0 offers no mmap until one can be made"
                    );
                    slot.store(None);
                    if let Err(e) = self.ctrl.isolate_doorbell_page() {
                        log::error!("nvme: the doorbell page stays the last client's ({e})");
                    }
                }
            }
        }
    }

    fn dma_unmap(&self, iova: u64, len: u64) {
        self.ctrl.dma_unmap(iova, len);
    }

    fn bus_master_changed(&self, on: bool) {
        if on {
            self.ctrl.wake_all();
        }
    }

    fn describe(&self) -> serde_json::Value {
        let c = &self.ctrl;
        let files = c.namespaces().any(|ns| ns.is_file());
        let namespaces: Vec<_> = c
            .namespaces()
            .map(|ns| {
                json!({
                    "nsid": ns.id(),
                    "backing": ns.backing_name(),
                    "path": ns.path().map(|p| p.display().to_string()),
                    "cache": ns.is_file().then(|| ns.cache().name()),
                    "direct_alignment": ns.store().direct_alignment().map(|(mem, offset)| json!({"memory": mem, "offset": offset})),
                    "bytes": ns.size(),
                    "lba_size": ns.lba_size(),
                    // Transfers of stopped queues its backing has not finished (max_held).
                    "held_by_backing": ns.is_file().then(|| c.held_by_backing(ns.id()).0),
                    // A RAM disk's memory taken ahead of the guest's writes (ram_populate).
                    // State first (Acquire): an ended pass's bytes are then its last.
                    "taken_ahead": ns.store().populater().map(|p| {
                        let state = p.state();
                        json!({"bytes": p.done(), "state": state.name()})
                    }),
                })
            })
            .collect();
        let state = if c.fatal() {
            "fatal"
        } else if c.ready() {
            "ready"
        } else {
            "disabled"
        };
        json!({
            "serial": c.config().serial,
            "state": state,
            "namespaces": namespaces,
            "io_queues": c.io_queues(),
            "queues_live": c.live_queues(),
            "doorbells": c.config().doorbells.name(),
            // What applies: no mode where no namespace is a file.
            "aio": files.then(|| c.config().aio.name()),
            "fixed_buffers": files.then(|| c.config().fixed_buffers.name()),
            "doorbells_now": c.chosen_doorbell_mode().map(|m| match m {
                DoorbellMode::Message => "message",
                DoorbellMode::Mapped => "mmap",
            }),
            "admin_commands": Totals::of(c.all_stats().iter().take(1)).commands,
            "doorbell_messages": c.doorbell_messages(),
            "admin_nudges": c.admin_nudges(),
            "shadow_doorbells": c.shadowed(),
            "shadow_doorbell_configs": c.shadow_configs(),
            // Queue workers that did not stop, blocked in a backing (aio=sync; max_held).
            "workers_held_by_backing": files.then(|| c.held_by_backing(0).1),
            "io": self.totals().to_json(),
        })
    }
}

/// Doorbells take aligned 32-bit writes only.
fn check_doorbell_access(offset: u64, len: usize) -> Result<(), DeviceError> {
    if len != 4 || !offset.is_multiple_of(4) {
        return Err(DeviceError::BadAccess { region: 0, offset, len: len as u64 });
    }
    Ok(())
}

impl Drop for Nvme {
    fn drop(&mut self) {
        self.ctrl.reset();
    }
}

/// The `nvme` device type; its options are [`NvmeConfig::option_specs`].
pub struct NvmeType {
    pool: Arc<umdev_mdev::types::Pool>,
}

impl NvmeType {
    /// The type, with room for `capacity` instances.
    pub fn new(capacity: u32) -> Self {
        NvmeType { pool: umdev_mdev::types::Pool::new(capacity) }
    }
}

impl umdev_mdev::types::DeviceType for NvmeType {
    fn name(&self) -> &str {
        TYPE_NAME
    }

    fn description(&self) -> &str {
        "NVMe controller (NVMe 1.3): RAM or file namespaces, every command's PRP list pinned with one call"
    }

    fn available_instances(&self) -> u32 {
        self.pool.free()
    }

    fn create(
        &self,
        options: &umdev_mdev::types::InstanceOptions,
    ) -> Result<Arc<dyn umdev_mdev::VfioDevice>, umdev_mdev::types::TypeError> {
        let config = NvmeConfig::from_options(options).map_err(bad_option)?;
        self.pool.instance(TYPE_NAME, 1, || create(config))
    }

    fn options(&self) -> Vec<OptionSpec> {
        NvmeConfig::option_specs()
    }

    fn check(
        &self,
        options: &umdev_mdev::types::InstanceOptions,
    ) -> Result<(), umdev_mdev::types::TypeError> {
        NvmeConfig::from_options(options).map(drop).map_err(bad_option)
    }
}

fn bad_option(why: NvmeError) -> umdev_mdev::types::TypeError {
    umdev_mdev::types::TypeError::BadOption { ty: TYPE_NAME.into(), why: why.to_string() }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use super::*;

    #[test]
    fn ram_pages_applies_to_the_default_namespace_too() {
        let config = |opts: &[(&str, &str)]| {
            let mut options = umdev_mdev::types::InstanceOptions::default();
            options.params.extend(opts.iter().map(|(k, v)| (k.to_string(), v.to_string())));
            NvmeConfig::from_options(&options).unwrap().namespaces
        };
        assert!(matches!(config(&[("ram_pages", "2m")])[..], [Some(Backing::HugeRam(0x4000_0000))]));
        assert!(matches!(config(&[])[..], [Some(Backing::Ram(0x4000_0000))]));
        assert!(matches!(config(&[("ram_pages", "thp")])[..], [Some(Backing::Ram(0x4000_0000))]));
        assert!(matches!(config(&[("ram_pages", "4k")])[..], [Some(Backing::SmallRam(0x4000_0000))]));
        let two = [("ns1", "ram:4m"), ("ns2", "ram:2m"), ("ram_pages", "4k")];
        assert!(matches!(
            config(&two)[..],
            [Some(Backing::SmallRam(0x40_0000)), Some(Backing::SmallRam(0x20_0000))]
        ));
    }

    #[test]
    fn ram_populate_is_the_pages_default_unless_given_and_background_is_refused_where_nothing_is_sparse() {
        let parse = |opts: &[(&str, &str)]| {
            let mut options = umdev_mdev::types::InstanceOptions::default();
            options.params.extend(opts.iter().map(|(k, v)| (k.to_string(), v.to_string())));
            NvmeConfig::from_options(&options).map(|c| c.ram_populate)
        };
        assert_eq!(parse(&[]).unwrap(), None);
        assert_eq!(parse(&[("ram_populate", "background")]).unwrap(), Some(true));
        assert_eq!(parse(&[("ram_populate", "off")]).unwrap(), Some(false));
        assert_eq!(parse(&[("ram_populate", "background"), ("ram_pages", "4k")]).unwrap(), Some(true));
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("disk.img");
        std::fs::File::create(&img).unwrap().set_len(1 << 20).unwrap();
        let file = format!("file:{}", img.display());
        for nothing_sparse in [("ram_pages", "2m"), ("ns1", file.as_str())] {
            let e = parse(&[nothing_sparse, ("ram_populate", "background")]).unwrap_err().to_string();
            assert!(e.contains("ram_populate=background cannot apply"), "{e}");
            // `off` asks for nothing, and may stay in a definition whatever else changes.
            assert_eq!(parse(&[nothing_sparse, ("ram_populate", "off")]).unwrap(), Some(false));
        }
    }

    thread_local! {
        /// Makes this thread's doorbell files fail as with the fd table full.
        pub(super) static NO_FDS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    /// A detach that cannot make the next client a doorbell file never leaves it the old
    /// one's: BAR0 offers no mmap (doorbells then come as messages) until a file can be made.
    #[test]
    fn the_doorbell_page_is_never_the_last_clients_when_no_file_can_be_made() {
        use umdev_mdev::{RegionFlags, VfioDevice};
        let mut options = umdev_mdev::types::InstanceOptions::default();
        for (k, v) in [("ns1", "ram:1m"), ("doorbells", "mmap")] {
            options.params.insert(k.into(), v.into());
        }
        let dev = create(NvmeConfig::from_options(&options).unwrap()).unwrap();
        let old = dev.region_info(0).unwrap().mmap.unwrap().fd;
        NO_FDS.set(true);
        dev.detach();
        let info = dev.region_info(0).unwrap();
        assert!(info.mmap.is_none() && !info.flags.contains(RegionFlags::MMAP), "{info:?}");
        NO_FDS.set(false);
        let fresh = dev.region_info(0).unwrap().mmap.unwrap().fd;
        assert!(!Arc::ptr_eq(&old, &fresh), "a new file once one can be made");
        assert!(Arc::ptr_eq(&dev.region_info(0).unwrap().mmap.unwrap().fd, &fresh), "and kept");
    }

    #[test]
    fn max_held_is_taken_in_its_range_and_refused_outside_it() {
        let parse = |v: &str| {
            let mut options = umdev_mdev::types::InstanceOptions::default();
            options.params.insert("max_held".into(), v.into());
            NvmeConfig::from_options(&options).map(|c| c.max_held)
        };
        assert_eq!(NvmeConfig::default().max_held, DEFAULT_MAX_HELD);
        assert_eq!(parse("1").unwrap(), 1);
        assert_eq!(parse("65536").unwrap(), MAX_HELD);
        assert!(parse("0").is_err());
        assert!(parse("65537").is_err());
        assert!(NvmeConfig { max_held: 0, ..NvmeConfig::default() }.validate().is_err());
    }

    #[test]
    fn fixed_buffers_are_off_where_nothing_can_go_fixed() {
        let file = tempfile::NamedTempFile::new().unwrap();
        file.as_file().set_len(1 << 20).unwrap();
        use umdev_mdev::types::PinModeName;
        let mode = |pin: Option<PinModeName>, cache: &str| {
            let mut options = umdev_mdev::types::InstanceOptions { pin_mode: pin, ..Default::default() };
            options.params.insert("ns1".into(), format!("file:{}", file.path().display()));
            options.params.insert("cache1".into(), cache.into());
            NvmeConfig::from_options(&options).unwrap().fixed_buffers
        };
        assert_eq!(mode(Some(PinModeName::Kernel), "none"), FixedBuffers::On);
        assert_eq!(mode(None, "none"), FixedBuffers::Off);
        assert_eq!(mode(Some(PinModeName::Kernel), "writeback"), FixedBuffers::Off);
    }

    #[test]
    fn identities_are_derived_the_same_way_by_every_build() {
        // FNV-1a's published values: a toolchain's hasher cannot move them.
        assert_eq!(StableHash::new().0, 0xcbf2_9ce4_8422_2325);
        assert_eq!(StableHash::new().bytes(b"a").0, 0xaf63_dc4c_8601_ec8c);
        let file = |p: &str| Backing::File(p.into(), Cache::None);
        let config = |ns: Vec<Option<Backing>>| NvmeConfig { namespaces: ns, ..NvmeConfig::default() };
        let one = config(vec![Some(file("/nonexistent/a.img"))]);
        assert_eq!(default_serial(&one), default_serial(&one.clone()));
        assert_eq!(
            default_serial(&one),
            "UMDEV".to_string()
                + &format!(
                    "{:012X}",
                    StableHash::new().bytes(b"/nonexistent/a.img").bytes(&[0]).0 & 0xffff_ffff_ffff
                )
        );
        // A file namespace's NGUID follows its file, not the serial or its NSID.
        let a = file("/nonexistent/a.img");
        assert_eq!(nguid("S1", None, 1, &a), nguid("S2", None, 3, &a));
        assert_ne!(nguid("S1", None, 1, &a), nguid("S1", None, 1, &file("/nonexistent/b.img")));
        // A serial given tells the same path on two hosts apart.
        assert_ne!(nguid("S1", Some("S1"), 1, &a), nguid("S2", Some("S2"), 1, &a));
        // A RAM namespace's follows the serial and the NSID.
        let ram = Backing::Ram(1 << 20);
        assert_ne!(nguid("S1", None, 1, &ram), nguid("S1", None, 2, &ram));
        assert_ne!(nguid("S1", None, 1, &ram), nguid("S2", None, 1, &ram));
    }

    /// The sources of the nvme modules, without their test modules.
    fn sources() -> BTreeMap<&'static str, &'static str> {
        let all = [
            ("mod", include_str!("mod.rs")),
            ("admin", include_str!("admin.rs")),
            ("cmds", include_str!("cmds.rs")),
            ("completion", include_str!("completion.rs")),
            ("ctrl", include_str!("ctrl.rs")),
            ("cx", include_str!("cx.rs")),
            ("io", include_str!("io.rs")),
            ("namespace", include_str!("namespace.rs")),
            ("prp", include_str!("prp.rs")),
            ("queue", include_str!("queue.rs")),
            ("spec", include_str!("spec.rs")),
            ("state", include_str!("state.rs")),
            ("stats", include_str!("stats.rs")),
            ("worker", include_str!("worker.rs")),
        ];
        all.into_iter().map(|(name, src)| (name, src.split("#[cfg(test)]").next().unwrap_or(src))).collect()
    }

    /// What each module's code (not its comments) names through `super::`: other modules, or
    /// `mod` for an item of the parent.
    fn imports(modules: &BTreeSet<&str>, src: &str) -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        for line in src.lines().map(str::trim_start).filter(|l| !l.starts_with("//")) {
            for (at, _) in line.match_indices("super::") {
                let rest = &line[at + "super::".len()..];
                // `super::{a, b::C}` names several.
                let names: Vec<&str> = match rest.strip_prefix('{') {
                    Some(list) => list.split('}').next().unwrap_or("").split(',').collect(),
                    None => vec![rest],
                };
                for name in names {
                    let name: String =
                        name.trim().chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                    if name.is_empty() {
                        continue;
                    }
                    out.insert(if modules.contains(name.as_str()) { name } else { "mod".into() });
                }
            }
        }
        out
    }

    /// The graph the module docs of mod.rs write down.
    fn documented() -> BTreeMap<String, BTreeSet<String>> {
        let mut graph = BTreeMap::new();
        for line in include_str!("mod.rs").lines().filter_map(|l| l.strip_prefix("//! - ")) {
            let Some((from, to)) = line.split_once(" → ") else { continue };
            let targets: BTreeSet<String> = if to.starts_with("nothing") {
                BTreeSet::new()
            } else {
                to.split(", ").map(|t| t.trim().to_string()).collect()
            };
            // `name` (what it is), or `a`, `b`: the names are the backquoted words.
            let from = from.split(" (").next().unwrap_or(from);
            for from in from.split(", ") {
                let name = from.split('`').nth(1).unwrap_or(from).to_string();
                graph.insert(name, targets.clone());
            }
        }
        graph
    }

    #[test]
    fn no_import_circle() {
        let sources = sources();
        let modules: BTreeSet<&str> = sources.keys().copied().filter(|m| *m != "mod").collect();
        let graph: BTreeMap<String, BTreeSet<String>> = sources
            .iter()
            .filter(|(m, _)| **m != "mod")
            .map(|(m, src)| (m.to_string(), imports(&modules, src)))
            .collect();
        assert_eq!(graph, documented(), "the module graph in mod.rs's docs is not what the code imports");
        // No module imports the parent (which imports them all), and the rest is acyclic:
        // repeatedly remove modules that import nothing left.
        let mut left = graph.clone();
        while !left.is_empty() {
            let free: Vec<String> = left
                .iter()
                .filter(|(_, to)| to.iter().all(|t| !left.contains_key(t)))
                .map(|(m, _)| m.clone())
                .collect();
            assert!(!free.is_empty(), "an import circle among {:?}", left.keys().collect::<Vec<_>>());
            for m in free {
                left.remove(&m);
            }
        }
        assert!(graph.values().all(|to| !to.contains("mod")), "a module imports from mod.rs: {graph:?}");
    }
}
