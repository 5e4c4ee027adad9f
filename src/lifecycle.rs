//! Instance lifecycle, after mdevctl: types from a registry, instances by UUID, persistent
//! definitions.
//!
//! The [`Manager`] owns the daemon's instances. Each is created from a type (reserving its
//! capacity) and served on `<run-dir>/<uuid>.sock`; stopping it frees the socket and the
//! capacity. [`Definitions`] are JSON files in a state directory, one per UUID, each checked by
//! [`check_definition`] as starting it would check it. As with mdevctl, defining a device does
//! not start it; `start --uuid` starts a definition as defined (options over it only when the
//! caller asks to override); definitions marked `auto` start with the daemon, and on
//! [`Manager::reload`] (the daemon's SIGHUP) when they are new. [`sync_status`] tells how the
//! definitions and what the daemon runs ([`DaemonStatus`]) differ.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use thiserror::Error;
use umdev_mdev::types::{DeviceType, InstanceOptions, Registry, TypeError};
use uuid::Uuid;

use umdev_pinning::DmaStats;
use umdev_server::daemon::{Daemon, DaemonError, InstanceConfig, InstanceInfo};
use umdev_server::StatsSnapshot;

/// Why a lifecycle operation failed.
#[derive(Debug, Error)]
pub enum LifecycleError {
    /// No such device type.
    #[error("unknown device type {0:?} (see `umdev types`)")]
    UnknownType(String),
    /// The type has no capacity left.
    #[error("type {0} has no available instances")]
    Exhausted(String),
    /// A running instance already has this UUID.
    #[error("an instance with UUID {0} is already running")]
    DuplicateUuid(Uuid),
    /// No running instance has this UUID.
    #[error("no running instance has UUID {0}")]
    UnknownUuid(Uuid),
    /// A definition already has this UUID.
    #[error("a device with UUID {0} is already defined")]
    AlreadyDefined(Uuid),
    /// No definition has this UUID.
    #[error("no device with UUID {0} is defined")]
    NotDefined(Uuid),
    /// The daemon already serves its maximum number of instances.
    #[error("the daemon already serves its maximum of {0} instances (umdev daemon --max-instances)")]
    TooManyInstances(usize),
    /// Neither a type nor a definition to start from.
    #[error("give a type, or the UUID of a defined device")]
    NoType,
    /// A defined device started with another type than its definition's.
    #[error("{uuid} is defined as a {defined} device, not {given}")]
    TypeConflict {
        /// The device.
        uuid: Uuid,
        /// Its definition's type.
        defined: String,
        /// The type asked for.
        given: String,
    },
    /// A defined device started with options, without asking to override its definition's.
    #[error(
        "{0} is defined: it starts with its definition's options (`umdev modify` changes them); \
         add --override to start it once with these on top"
    )]
    ExtraOptions(Uuid),
    /// A definition file that cannot be used.
    #[error("definition {}: {why}", path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// A client is connected and the stop was not forced.
    #[error("instance {0} has a client connected; use --force to disconnect it")]
    Busy(Uuid),
    /// Stopped while its device is still being made.
    #[error("instance {0} is still starting (its device is being made); stop it once `umdev list` shows it")]
    Starting(Uuid),
    /// Kernel pin mode asked for where this process cannot take kernel pins (no io_uring, or
    /// io_uring refused to it): why, what to do, and that the other modes need no io_uring.
    #[error("pin mode kernel: {0}; pin modes lock and track need no io_uring (--pin-mode lock)")]
    KernelPins(#[source] umdev_pinning::KernelPinsUnavailable),
    /// A bad option for the type.
    #[error("{0}")]
    BadOption(String),
    /// The device could not be built, or its socket not served.
    #[error("{0}")]
    Failed(String),
    /// A directory umdev keeps its definitions or sockets in is another user's, or others
    /// may write to it.
    #[error("{}: {why}; umdev keeps its definitions and sockets only in a directory of its own user's that others cannot write to (--run-dir, --state-dir)", path.display())]
    NotPrivate {
        /// The directory.
        path: PathBuf,
        /// Whose it is, or its mode.
        why: String,
    },
    /// A shared directory (sticky, and others may write to it, as `/tmp`): umdev neither
    /// keeps its state there nor takes others' access to it away.
    #[error(
        "{}: mode {mode:o}, a shared directory (sticky, and others may write to it): it cannot hold \
         umdev's definitions or sockets; use a directory of its own (--run-dir, --state-dir, \
         $UMDEV_RUN_DIR, $UMDEV_STATE_DIR), which umdev creates mode 0700", path.display()
    )]
    Shared {
        /// The directory.
        path: PathBuf,
        /// Its mode.
        mode: u32,
    },
    /// A directory of the user's own that its group or others may write to, met by a command
    /// that only reads it or connects there (a query changes no mode): what is in it may have
    /// been put there by someone else.
    #[error(
        "{}: mode {mode:o}: its group or others may write to it, so what is in it may not be its \
         user's; remove that write access (`chmod go-w {}`; `umdev daemon`, and `umdev define` for a \
         definitions directory, take it away from a directory of the user's own)", path.display(),
        path.display()
    )]
    Writable {
        /// The directory.
        path: PathBuf,
        /// Its mode.
        mode: u32,
    },
    /// Reading or writing definitions failed.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
}

impl LifecycleError {
    /// The errno a sysfs-style interface would report.
    pub fn errno(&self) -> i32 {
        match self {
            LifecycleError::UnknownType(_)
            | LifecycleError::UnknownUuid(_)
            | LifecycleError::NotDefined(_) => libc::ENOENT,
            LifecycleError::Exhausted(_) => libc::EUSERS,
            LifecycleError::DuplicateUuid(_) | LifecycleError::AlreadyDefined(_) => libc::EEXIST,
            LifecycleError::Invalid { .. } => libc::EBADMSG,
            LifecycleError::Busy(_) | LifecycleError::Starting(_) => libc::EBUSY,
            LifecycleError::TooManyInstances(_) => libc::ENOSPC,
            LifecycleError::Io { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            // Its errno is public: one made with none (0, which reads as success) is EIO.
            LifecycleError::KernelPins(e) if e.errno == 0 => libc::EIO,
            LifecycleError::KernelPins(e) => e.errno,
            LifecycleError::NotPrivate { .. }
            | LifecycleError::Shared { .. }
            | LifecycleError::Writable { .. } => libc::EACCES,
            _ => libc::EINVAL,
        }
    }

    fn from_type(e: TypeError) -> Self {
        match e {
            TypeError::UnknownType(t) => LifecycleError::UnknownType(t),
            TypeError::Exhausted(t) => LifecycleError::Exhausted(t),
            TypeError::BadOption { .. } => LifecycleError::BadOption(e.to_string()),
            TypeError::Create { .. } => LifecycleError::Failed(e.to_string()),
        }
    }
}

/// Creates `dir` (and its missing parents) mode 0700 if it is missing, then checks it as
/// [`check_private_dir`] does, for a command that writes there: a directory of the user's own
/// that its group or others may write to (not a shared, sticky one) loses that write access,
/// with a warning (an older umdev created them with the umask's mode); who may read it is
/// left as it was.
pub fn private_dir(dir: &Path) -> Result<(), LifecycleError> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(|source| {
        match source.kind() {
            // Something else by that name: say what, not "File exists".
            io::ErrorKind::AlreadyExists => LifecycleError::NotPrivate {
                path: dir.to_path_buf(),
                why: "not a directory (a directory is wanted there)".into(),
            },
            _ => LifecycleError::Io { what: "creating", path: dir.to_path_buf(), source },
        }
    })?;
    let Some(mode) = inspect_dir(dir)? else { return Ok(()) };
    let private = mode & !0o022;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(private)).map_err(|e| {
        LifecycleError::NotPrivate {
            path: dir.to_path_buf(),
            why: format!(
                "mode {mode:o}: its group or others may write to it, and it cannot be changed ({e})"
            ),
        }
    })?;
    log::warn!(
        target: crate::STATUS,
        "{}: its group or others could write to it (mode {mode:o}); write access removed: mode \
         {private:o}. Files already in it may have been put there by others: each is checked as it is \
         read, and one that is not this user's or root's, or that its group or others may write to, is \
         not used",
        dir.display()
    );
    Ok(())
}

/// Refuses `dir` unless it is a directory of this process's effective user (or root's) that
/// neither its group nor others can write to: definitions read from, or sockets put in, a
/// directory another user controls would be that user's to swap (a shared `/tmp` fallback,
/// say; a group member planting an `auto` definition in a `chmod g+w` /etc/umdev.d). A
/// symbolic link is followed only if it is the user's own (one another user planted in
/// `/tmp` is refused). A shared directory (sticky and writable by others, as `/tmp`) is
/// refused whoever owns it: taking others' write access away would break it for them.
///
/// Only looks: a directory of the user's own that others may write to is refused
/// ([`LifecycleError::Writable`]) and left as it is (a command that only reads has no
/// business changing a directory's mode; [`private_dir`], for the commands that write
/// there, takes that access away).
pub fn check_private_dir(dir: &Path) -> Result<(), LifecycleError> {
    match inspect_dir(dir)? {
        Some(mode) => Err(LifecycleError::Writable { path: dir.to_path_buf(), mode }),
        None => Ok(()),
    }
}

/// What [`private_dir`] and [`check_private_dir`] both refuse; `Some(mode)` for a directory
/// of the user's own that its group or others may write to (not a shared one), which the
/// one fixes and the other refuses; `None` for a private one.
fn inspect_dir(dir: &Path) -> Result<Option<u32>, LifecycleError> {
    use std::os::unix::fs::MetadataExt;
    let me = nix::unistd::geteuid().as_raw();
    let io = |what| move |source| LifecycleError::Io { what, path: dir.to_path_buf(), source };
    let not_private = |why: String| LifecycleError::NotPrivate { path: dir.to_path_buf(), why };
    let link = std::fs::symlink_metadata(dir).map_err(io("reading"))?;
    if link.file_type().is_symlink() && link.uid() != me && link.uid() != 0 {
        return Err(not_private(format!("a symbolic link of uid {}, not {me}", link.uid())));
    }
    let meta = std::fs::metadata(dir).map_err(io("reading"))?;
    if !meta.is_dir() {
        return Err(not_private("not a directory".into()));
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 && mode & 0o1000 != 0 {
        return Err(LifecycleError::Shared { path: dir.to_path_buf(), mode });
    }
    if meta.uid() != me && meta.uid() != 0 {
        return Err(not_private(format!("owned by uid {}, not {me}", meta.uid())));
    }
    if mode & 0o022 == 0 {
        return Ok(None);
    }
    if meta.uid() != me {
        return Err(not_private(format!("mode {mode:o}: its group or others may write to it")));
    }
    Ok(Some(mode))
}

/// A definition file's UUID (its name), and its definition or why it cannot be read.
pub type DefinitionFile = (Uuid, Result<Definition, LifecycleError>);

/// A persistent device definition (`<state-dir>/<uuid>.json`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Definition {
    /// The device's UUID.
    pub uuid: Uuid,
    /// Its type.
    pub mdev_type: String,
    /// `auto`: started with the daemon; `manual`: only by `umdev start --uuid`.
    pub start: StartPolicy,
    /// Creation options.
    #[serde(default)]
    pub options: InstanceOptions,
}

/// When a defined device starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StartPolicy {
    /// With the daemon.
    Auto,
    /// On request.
    Manual,
}

/// The definitions in a state directory.
#[derive(Clone, Debug)]
pub struct Definitions {
    dir: PathBuf,
}

impl Definitions {
    /// Definitions kept in `dir` (created when the first is written).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Definitions { dir: dir.into() }
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, uuid: &Uuid) -> PathBuf {
        self.dir.join(format!("{uuid}.json"))
    }

    fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> LifecycleError + 'a {
        move |source| LifecycleError::Io { what, path: path.to_path_buf(), source }
    }

    /// Holds the directory's lock (`.lock` in it, created with the directory if need be):
    /// each change of a definition is made under it, so that two commands changing one
    /// definition at once take turns instead of one losing the other's change.
    fn lock(&self) -> Result<nix::fcntl::Flock<std::fs::File>, LifecycleError> {
        use nix::fcntl::{Flock, FlockArg};
        use std::os::unix::fs::OpenOptionsExt;
        private_dir(&self.dir)?;
        let path = self.dir.join(".lock");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&path)
            .map_err(Self::io("opening", &path))?;
        Flock::lock(file, FlockArg::LockExclusive)
            .map_err(|(_, e)| Self::io("locking", &path)(io::Error::from_raw_os_error(e as i32)))
    }

    /// Writes a new definition; fails if the UUID is already defined.
    pub fn define(&self, def: &Definition) -> Result<(), LifecycleError> {
        let _lock = self.lock()?;
        self.check_undefined(&def.uuid)?;
        self.write(def)
    }

    /// [`LifecycleError::AlreadyDefined`] if `uuid` has a definition (a file by its name,
    /// readable or not), as [`Definitions::define`] would fail: for a caller to find out
    /// before it does other work (the check is made again under the lock when writing).
    /// Nothing is created or changed.
    pub fn check_undefined(&self, uuid: &Uuid) -> Result<(), LifecycleError> {
        if self.path(uuid).exists() {
            return Err(LifecycleError::AlreadyDefined(*uuid));
        }
        Ok(())
    }

    /// Replaces the definition of `def.uuid`; fails if it is not defined.
    pub fn replace(&self, def: &Definition) -> Result<(), LifecycleError> {
        self.update(&def.uuid, |_| Ok(def.clone()))
    }

    /// Reads the definition of `uuid`, changes it with `change` and writes it back, all under
    /// the directory's lock; fails if it is not defined, or with `change`'s error (nothing
    /// is written then).
    pub fn update(
        &self,
        uuid: &Uuid,
        change: impl FnOnce(Definition) -> Result<Definition, LifecycleError>,
    ) -> Result<(), LifecycleError> {
        let _lock = self.lock()?;
        let def = change(self.read(uuid)?)?;
        if def.uuid != *uuid {
            return Err(LifecycleError::Failed(format!(
                "a change of {uuid} cannot rename it to {}",
                def.uuid
            )));
        }
        self.write(&def)
    }

    /// Writes `def` (the caller holds the lock).
    fn write(&self, def: &Definition) -> Result<(), LifecycleError> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let path = self.path(&def.uuid);
        let text = serde_json::to_string_pretty(def).map_err(|e| LifecycleError::Failed(e.to_string()))?;
        // Write then rename: a crash never leaves a half-written definition.
        let tmp = self.dir.join(format!(".{}.tmp", def.uuid));
        // Created afresh, never group- or world-writable whatever the umask: reading refuses
        // such a file (a leftover temporary file would keep its own mode).
        match std::fs::remove_file(&tmp) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(Self::io("removing", &tmp)(e)),
            _ => {}
        }
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&tmp)
            .map_err(Self::io("creating", &tmp))?;
        file.write_all((text + "\n").as_bytes()).map_err(Self::io("writing", &tmp))?;
        // On disk before the rename, and the rename itself after: a power loss then leaves
        // the old definition or the new one, never an empty file under the new name.
        file.sync_all().map_err(Self::io("syncing", &tmp))?;
        drop(file);
        std::fs::rename(&tmp, &path).map_err(Self::io("renaming", &path))?;
        std::fs::File::open(&self.dir).and_then(|d| d.sync_all()).map_err(Self::io("syncing", &self.dir))
    }

    /// Removes a definition (a file that cannot be read as one too: it is named by its UUID),
    /// and any file named by another spelling of the UUID ([`Definitions::entries`] shows
    /// those as invalid).
    pub fn undefine(&self, uuid: &Uuid) -> Result<(), LifecycleError> {
        let path = self.path(uuid);
        if !self.dir.exists() {
            return Err(LifecycleError::NotDefined(*uuid));
        }
        let _lock = self.lock()?;
        let mut removed = match std::fs::remove_file(&path) {
            Ok(()) => true,
            Err(e) if e.kind() == io::ErrorKind::NotFound => false,
            Err(e) => return Err(Self::io("removing", &path)(e)),
        };
        let entries = std::fs::read_dir(&self.dir).map_err(Self::io("reading", &self.dir))?;
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if uuid_of_file_name(&name) == Some(*uuid) {
                match std::fs::remove_file(e.path()) {
                    Ok(()) => removed = true,
                    Err(err) if err.kind() == io::ErrorKind::NotFound => {}
                    Err(err) => return Err(Self::io("removing", &e.path())(err)),
                }
            }
        }
        if removed {
            Ok(())
        } else {
            Err(LifecycleError::NotDefined(*uuid))
        }
    }

    /// The definition of `uuid`. A file whose JSON does not parse, or names another UUID than
    /// its file name, is [`LifecycleError::Invalid`].
    pub fn get(&self, uuid: &Uuid) -> Result<Definition, LifecycleError> {
        if self.dir.exists() {
            check_private_dir(&self.dir)?;
        }
        self.read(uuid)
    }

    /// [`Definitions::get`], the directory checked by the caller.
    ///
    /// The file itself must be as private as the directory: a regular file (not followed if a
    /// symbolic link) of this user's or root's that neither its group nor others may write to.
    /// A private directory says nothing of files put there while it was not (a group member's
    /// `auto` definition in a `chmod g+w` /etc/umdev.d, still there once the mode is fixed).
    fn read(&self, uuid: &Uuid) -> Result<Definition, LifecycleError> {
        use std::io::Read;
        use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
        let path = self.path(uuid);
        let invalid = |why: String| LifecycleError::Invalid { path: path.clone(), why };
        let remedy = format!("check it, then `chmod go-w` it, or `umdev undefine -u {uuid}`");
        // O_NONBLOCK: a FIFO there would otherwise block the open until something writes.
        let opened = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&path);
        let mut file = match opened {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(LifecycleError::NotDefined(*uuid)),
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                return Err(invalid(format!(
                    "a symbolic link; a definition is read only from a regular file in the directory \
                     (put the file there instead, or `umdev undefine -u {uuid}`)"
                )))
            }
            Err(e) => return Err(Self::io("reading", &path)(e)),
        };
        let meta = file.metadata().map_err(Self::io("reading", &path))?;
        if !meta.is_file() {
            return Err(invalid(format!("not a regular file (`umdev undefine -u {uuid}` removes it)")));
        }
        let me = nix::unistd::geteuid().as_raw();
        if meta.uid() != me && meta.uid() != 0 {
            return Err(invalid(format!(
                "owned by uid {}, not {me} or root, so it may have been put there by someone else; it \
                 is not used ({remedy})",
                meta.uid()
            )));
        }
        let mode = meta.mode() & 0o7777;
        if mode & 0o022 != 0 {
            return Err(invalid(format!(
                "mode {mode:o}: its group or others may write to it, so it may not be its user's; it \
                 is not used ({remedy})"
            )));
        }
        let mut text = String::new();
        file.read_to_string(&mut text).map_err(Self::io("reading", &path))?;
        let def: Definition = serde_json::from_str(&text).map_err(|e| invalid(e.to_string()))?;
        if def.uuid != *uuid {
            return Err(invalid(format!(
                "it holds UUID {}; a definition's file is named after its UUID (rename the file, or `umdev \
                 undefine -u {uuid}`)",
                def.uuid
            )));
        }
        Ok(def)
    }

    /// Every definition file (`<uuid>.json`), by UUID, read or with why it cannot be; none
    /// if the directory does not exist yet, an error if it cannot be read.
    pub fn entries(&self) -> Result<Vec<DefinitionFile>, LifecycleError> {
        if !self.dir.exists() {
            return Ok(Vec::new());
        }
        check_private_dir(&self.dir)?;
        let entries = std::fs::read_dir(&self.dir).map_err(Self::io("reading", &self.dir))?;
        let mut all: Vec<DefinitionFile> = Vec::new();
        let mut strays: Vec<DefinitionFile> = Vec::new();
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            let Some(uuid) = uuid_of_file_name(&name) else {
                continue;
            };
            if name == format!("{uuid}.json") {
                all.push((uuid, self.read(&uuid)));
            } else {
                // Another spelling of a UUID (upper case, braces, no hyphens): shown, so that
                // it can be renamed or removed, but never read as the definition.
                let why = format!(
                    "named as no definition is: a definition's file is its UUID in lower case \
                     ({uuid}.json), so this one is not used (rename it, or `umdev undefine -u {uuid}` \
                     removes it)"
                );
                strays.push((uuid, Err(LifecycleError::Invalid { path: self.dir.join(&name), why })));
            }
        }
        // A stray beside the definition it spells differently is left out.
        strays.retain(|(uuid, _)| all.iter().all(|(u, _)| u != uuid));
        strays.sort_by_key(|(uuid, _)| *uuid);
        strays.dedup_by_key(|(uuid, _)| *uuid);
        all.extend(strays);
        all.sort_by_key(|(uuid, _)| *uuid);
        Ok(all)
    }

    /// Every readable definition, by UUID; unreadable files (and an unreadable directory)
    /// are logged and skipped.
    pub fn list(&self) -> Vec<Definition> {
        self.entries()
            .inspect_err(|err| log::warn!("no definitions: {err}"))
            .unwrap_or_default()
            .into_iter()
            .filter_map(|(uuid, def)| {
                def.inspect_err(|err| log::warn!("skipping definition {uuid}: {err}")).ok()
            })
            .collect()
    }
}

/// The UUID a file in the definitions directory is named by, however it is spelt
/// (`<uuid>.json`, the UUID in any form `Uuid::parse_str` reads).
fn uuid_of_file_name(name: &str) -> Option<Uuid> {
    name.strip_suffix(".json").and_then(|u| Uuid::parse_str(u).ok())
}

/// Checks a definition as starting it would: its type exists and takes its options.
pub fn check_definition(registry: &Registry, def: &Definition) -> Result<(), LifecycleError> {
    let ty = registry.find(&def.mdev_type).map_err(LifecycleError::from_type)?;
    ty.check(&def.options).map_err(LifecycleError::from_type)
}

/// `base` with `over`'s pin mode (if set) and parameters on top.
pub fn overlay(base: &InstanceOptions, over: &InstanceOptions) -> InstanceOptions {
    let mut out = base.clone();
    if over.pin_mode.is_some() {
        out.pin_mode = over.pin_mode;
    }
    out.params.extend(over.params.iter().map(|(k, v)| (k.clone(), v.clone())));
    out
}

/// A running instance, as `umdev list` shows it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct InstanceSummary {
    /// UUID.
    pub uuid: Uuid,
    /// Type.
    pub mdev_type: String,
    /// Socket clients connect to.
    pub socket: PathBuf,
    /// A client is connected.
    pub connected: bool,
    /// Options it was created with.
    pub options: InstanceOptions,
    /// What the device shows of itself: a serial port's pty path, say.
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub device: serde_json::Value,
    /// It was started from its definition (`start --uuid`, or `auto`), not ad hoc from a type.
    #[serde(default)]
    pub from_definition: bool,
    /// What `start --override` put over its definition's options.
    #[serde(default, skip_serializing_if = "is_empty_options")]
    pub overrides: InstanceOptions,
    /// With `overrides`: the definition's options it started from, by which a change of the
    /// definition is told even in a key the overrides cover.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub defined_options: Option<InstanceOptions>,
}

/// One instance's counters, as `umdev stats` shows them: named by its `uuid`, as `umdev list`
/// names it.
#[derive(Clone, Debug, Serialize)]
pub struct InstanceStats {
    /// UUID.
    pub uuid: Uuid,
    /// Socket clients connect to.
    pub socket: PathBuf,
    /// A client is connected now.
    pub connected: bool,
    /// Protocol counters: messages per command, errors.
    pub protocol: StatsSnapshot,
    /// Pinning-engine counters of its DMA space: pin calls, runs, pages, locked bytes, ...
    pub dma: DmaStats,
    /// What the device shows of itself (its own counters, a serial port's pty path, ...).
    #[serde(skip_serializing_if = "serde_json::Value::is_null")]
    pub device: serde_json::Value,
}

impl InstanceStats {
    /// The daemon's `info` of the instance `uuid` (which names it by its id, the UUID's text).
    fn of(uuid: Uuid, info: InstanceInfo) -> InstanceStats {
        let InstanceInfo { id: _, socket, connected, protocol, dma, device } = info;
        InstanceStats { uuid, socket, connected, protocol, dma, device }
    }
}

fn is_empty_options(o: &InstanceOptions) -> bool {
    *o == InstanceOptions::default()
}

/// A type, as `umdev types` shows it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct TypeSummary {
    /// Name.
    pub name: String,
    /// Description.
    pub description: String,
    /// Device API.
    pub device_api: String,
    /// Instances that can still be created.
    pub available_instances: u32,
    /// The options it takes (`--opt KEY=VALUE`).
    #[serde(default)]
    pub options: Vec<OptionSummary>,
}

/// One option of a type, as `umdev types` shows it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct OptionSummary {
    /// The key (`lba`, `ns1..ns16`).
    pub key: String,
    /// What a value looks like, with its range.
    pub syntax: String,
    /// The value without the option.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<String>,
    /// What it does.
    pub help: String,
}

impl TypeSummary {
    /// A type's summary, its capacity capped at `room` more instances.
    pub fn of(ty: &dyn DeviceType, room: usize) -> TypeSummary {
        TypeSummary {
            name: ty.name().to_string(),
            description: ty.description().to_string(),
            device_api: ty.device_api().to_string(),
            available_instances: ty.available_instances().min(u32::try_from(room).unwrap_or(u32::MAX)),
            options: ty
                .options()
                .iter()
                .map(|o| OptionSummary {
                    key: o.key_pattern(),
                    syntax: o.syntax(),
                    default: o.default.map(str::to_string),
                    help: o.help.to_string(),
                })
                .collect(),
        }
    }
}

struct Record {
    mdev_type: String,
    options: InstanceOptions,
    socket: PathBuf,
    from_definition: bool,
    overrides: InstanceOptions,
    defined_options: Option<InstanceOptions>,
}

/// What [`Manager::reload`] did and found.
#[derive(Debug, Default)]
pub struct ReloadReport {
    /// `auto` definitions that were not running and have been started.
    pub started: Vec<Uuid>,
    /// `auto` definitions that could not be started, and why.
    pub failed: Vec<(Uuid, LifecycleError)>,
    /// `auto` definitions left stopped because `umdev stop` stopped them.
    pub held_back: Vec<Uuid>,
    /// Instances started from a definition that has been removed since; they keep running.
    pub undefined: Vec<Uuid>,
    /// Instances whose definition's type or options changed since they started; they keep
    /// running as they are.
    pub changed: Vec<Uuid>,
}

/// How a definition and the running instances agree, as `umdev list --defined` shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SyncState {
    /// Running as defined (with `start --override`'s options on top, if any).
    Running,
    /// Not running: a manual definition, or an `auto` one stopped with `umdev stop`.
    Stopped,
    /// An `auto` definition that is not running, though nobody stopped it.
    NotStarted,
    /// Running with another type or other options than its definition has now.
    Changed,
    /// Running from a definition that has been removed since.
    Undefined,
    /// A definition that cannot be started: unreadable, or its type or options refused.
    Invalid,
    /// Unknown: the daemon is not running.
    Unknown,
}

impl SyncState {
    /// Whether the definition and the instance agree; `None` when it cannot be told.
    pub fn in_sync(self) -> Option<bool> {
        match self {
            SyncState::Running | SyncState::Stopped => Some(true),
            SyncState::NotStarted | SyncState::Changed | SyncState::Undefined | SyncState::Invalid => {
                Some(false)
            }
            SyncState::Unknown => None,
        }
    }

    /// Its name in `umdev list --defined`.
    pub fn name(self) -> &'static str {
        match self {
            SyncState::Running => "running",
            SyncState::Stopped => "stopped",
            SyncState::NotStarted => "not-started",
            SyncState::Changed => "changed",
            SyncState::Undefined => "undefined",
            SyncState::Invalid => "invalid",
            SyncState::Unknown => "unknown",
        }
    }

    /// Why it is out of sync, for a person.
    pub fn why(self) -> Option<&'static str> {
        match self {
            SyncState::NotStarted => Some("defined with --auto but not running"),
            SyncState::Changed => Some("its definition changed since it started; stop and start it to apply"),
            SyncState::Undefined => Some("running, but no longer defined"),
            SyncState::Invalid => Some("it cannot be started"),
            _ => None,
        }
    }
}

/// What the daemon says of its instances, for `umdev list --defined`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DaemonStatus {
    /// The running instances.
    pub instances: Vec<InstanceSummary>,
    /// Defined devices stopped with `umdev stop`: a reload leaves them stopped.
    #[serde(default)]
    pub stopped: Vec<Uuid>,
    /// Why a definition's last start failed, by UUID (cleared when it starts).
    #[serde(default)]
    pub errors: BTreeMap<Uuid, String>,
    /// The directory the daemon reads its definitions from (a client reading another one
    /// would compare them with what it does not run).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub definitions: Option<PathBuf>,
}

/// A definition file as `umdev list --defined` sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DefinitionEntry {
    /// The UUID its file is named by.
    pub uuid: Uuid,
    /// The definition, if the file reads as one.
    pub definition: Option<Definition>,
    /// Why it cannot be started (unreadable, or refused by [`check_definition`]).
    pub error: Option<String>,
}

impl DefinitionEntry {
    /// A definition that reads and passes [`check_definition`].
    pub fn valid(definition: Definition) -> Self {
        DefinitionEntry { uuid: definition.uuid, definition: Some(definition), error: None }
    }

    /// Every file of `definitions`, each checked against `registry`.
    pub fn all(
        definitions: &Definitions,
        registry: &Registry,
    ) -> Result<Vec<DefinitionEntry>, LifecycleError> {
        Ok(definitions
            .entries()?
            .into_iter()
            .map(|(uuid, def)| match def {
                Ok(def) => {
                    let error = check_definition(registry, &def).err().map(|e| e.to_string());
                    DefinitionEntry { uuid, definition: Some(def), error }
                }
                Err(e) => DefinitionEntry { uuid, definition: None, error: Some(e.to_string()) },
            })
            .collect())
    }
}

/// One definition (or one instance whose definition is gone) and how it stands.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DefinitionStatus {
    /// The device's UUID.
    pub uuid: Uuid,
    /// The defined type (of an undefined instance: its running type; `None` when the
    /// definition is unreadable).
    pub mdev_type: Option<String>,
    /// The definition's start policy; `None` for an instance whose definition is gone.
    pub start: Option<StartPolicy>,
    /// The defined options (of an undefined instance: its running options).
    pub options: InstanceOptions,
    /// How it stands.
    pub state: SyncState,
    /// [`SyncState::in_sync`] (always in the JSON: `null` when it cannot be told).
    #[serde(default)]
    pub in_sync: Option<bool>,
    /// Why: an invalid definition's fault, or why a not-started one's last start failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// What `start --override` put over the definition, when running so.
    #[serde(default, skip_serializing_if = "is_empty_options")]
    pub overrides: InstanceOptions,
    /// The type it runs with, when [`SyncState::Changed`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running_type: Option<String>,
    /// The options it runs with, when [`SyncState::Changed`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running_options: Option<InstanceOptions>,
}

/// Compares `definitions` with what the daemon runs (`None`: the daemon is not running).
/// One row per definition, then one per instance started from a definition that is gone;
/// instances started ad hoc from a type are not rows.
pub fn sync_status(definitions: &[DefinitionEntry], daemon: Option<&DaemonStatus>) -> Vec<DefinitionStatus> {
    let find = |uuid: &Uuid| daemon.and_then(|d| d.instances.iter().find(|i| i.uuid == *uuid));
    let mut rows: Vec<DefinitionStatus> = definitions
        .iter()
        .map(|entry| {
            let uuid = entry.uuid;
            let instance = find(&uuid);
            let Some(d) = entry.definition.as_ref().filter(|_| entry.error.is_none()) else {
                let d = entry.definition.as_ref();
                return DefinitionStatus {
                    uuid,
                    mdev_type: d.map(|d| d.mdev_type.clone()),
                    start: d.map(|d| d.start),
                    options: d.map(|d| d.options.clone()).unwrap_or_default(),
                    state: SyncState::Invalid,
                    in_sync: SyncState::Invalid.in_sync(),
                    error: entry.error.clone(),
                    overrides: InstanceOptions::default(),
                    running_type: instance.map(|i| i.mdev_type.clone()),
                    running_options: instance.map(|i| i.options.clone()),
                };
            };
            let stopped = daemon.is_some_and(|s| s.stopped.contains(&uuid));
            let state = match (daemon, instance) {
                (None, _) => SyncState::Unknown,
                (Some(_), Some(i))
                    if i.mdev_type == d.mdev_type
                        && match &i.defined_options {
                            // Started over its definition: has the definition changed since?
                            Some(at_start) => *at_start == d.options,
                            None => i.options == overlay(&d.options, &i.overrides),
                        } =>
                {
                    SyncState::Running
                }
                (Some(_), Some(_)) => SyncState::Changed,
                (Some(_), None) if d.start == StartPolicy::Auto && !stopped => SyncState::NotStarted,
                (Some(_), None) => SyncState::Stopped,
            };
            let changed = instance.filter(|_| state == SyncState::Changed);
            let error = match state {
                SyncState::NotStarted | SyncState::Stopped => {
                    daemon.and_then(|s| s.errors.get(&uuid).cloned())
                }
                _ => None,
            };
            DefinitionStatus {
                uuid,
                mdev_type: Some(d.mdev_type.clone()),
                start: Some(d.start),
                options: d.options.clone(),
                state,
                in_sync: state.in_sync(),
                error,
                overrides: instance
                    .filter(|_| state == SyncState::Running)
                    .map(|i| i.overrides.clone())
                    .unwrap_or_default(),
                running_type: changed.map(|i| i.mdev_type.clone()),
                running_options: changed.map(|i| i.options.clone()),
            }
        })
        .collect();
    let defined: BTreeSet<Uuid> = definitions.iter().map(|d| d.uuid).collect();
    let running = daemon.map(|d| d.instances.as_slice()).unwrap_or_default();
    for i in running.iter().filter(|i| i.from_definition && !defined.contains(&i.uuid)) {
        rows.push(DefinitionStatus {
            uuid: i.uuid,
            mdev_type: Some(i.mdev_type.clone()),
            start: None,
            options: i.options.clone(),
            state: SyncState::Undefined,
            in_sync: SyncState::Undefined.in_sync(),
            error: None,
            overrides: InstanceOptions::default(),
            running_type: None,
            running_options: None,
        });
    }
    rows
}

/// The daemon's instances and the types they come from.
pub struct Manager {
    registry: Registry,
    daemon: Daemon,
    run_dir: PathBuf,
    definitions: Definitions,
    instances: Mutex<BTreeMap<Uuid, Record>>,
    /// UUIDs whose device is being made (outside the `instances` lock, which is taken first
    /// when both are): counted against `max_instances`, refused to a second start.
    starting: Mutex<BTreeSet<Uuid>>,
    /// Set under the `instances` lock by `shutdown`: a start whose device was being made
    /// meanwhile starts no instance after it.
    shut_down: std::sync::atomic::AtomicBool,
    /// Instances `stop` stopped: a reload does not start their `auto` definitions again.
    stopped: Mutex<BTreeSet<Uuid>>,
    /// Why each definition's last start failed (until it starts).
    errors: Mutex<BTreeMap<Uuid, String>>,
    /// Counts starts and stops, for [`Manager::wait_change`].
    changes: (Mutex<u64>, Condvar),
    /// Applied to every instance (limits, timeouts); id, socket and pin mode are set per instance.
    template: InstanceConfig,
    max_instances: usize,
}

impl Manager {
    /// A manager serving instance sockets in `run_dir`, definitions in `definitions`.
    pub fn new(
        registry: Registry,
        run_dir: impl Into<PathBuf>,
        definitions: Definitions,
        template: InstanceConfig,
    ) -> Self {
        Manager {
            registry,
            daemon: Daemon::new(),
            run_dir: run_dir.into(),
            definitions,
            instances: Mutex::new(BTreeMap::new()),
            starting: Mutex::new(BTreeSet::new()),
            shut_down: std::sync::atomic::AtomicBool::new(false),
            stopped: Mutex::new(BTreeSet::new()),
            errors: Mutex::new(BTreeMap::new()),
            changes: (Mutex::new(0), Condvar::new()),
            template,
            max_instances: 256,
        }
    }

    /// Serves at most `max` instances (default 256); each has at most one client.
    pub fn with_max_instances(mut self, max: usize) -> Self {
        self.max_instances = max;
        self
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<Uuid, Record>> {
        umdev_pinning::sync::lock(&self.instances)
    }

    /// The definitions store.
    pub fn definitions(&self) -> &Definitions {
        &self.definitions
    }

    /// The registry of types.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The types and their capacity now: a type's own, capped by the instances this daemon
    /// may still start (`--max-instances`).
    pub fn types(&self) -> Vec<TypeSummary> {
        let taken = {
            let instances = self.lock();
            instances.len() + umdev_pinning::sync::lock(&self.starting).len()
        };
        let room = self.max_instances.saturating_sub(taken);
        self.registry.types().iter().map(|t| TypeSummary::of(t.as_ref(), room)).collect()
    }

    /// Starts an instance: of `mdev_type` with `options`, or the definition of `uuid`.
    ///
    /// A defined `uuid` starts as its definition says; `mdev_type`, if given, must be the
    /// definition's, and `options` are refused unless `override_definition`, which puts them
    /// over the definition's for this start (the summary's `overrides`). A UUID that is not
    /// defined starts ad hoc from `mdev_type`; a missing one is generated.
    pub fn start(
        &self,
        mdev_type: Option<&str>,
        uuid: Option<Uuid>,
        options: InstanceOptions,
        override_definition: bool,
    ) -> Result<InstanceSummary, LifecycleError> {
        let defined = match uuid.map(|u| self.definitions.get(&u)) {
            None | Some(Err(LifecycleError::NotDefined(_))) => None,
            Some(Ok(def)) => Some(def),
            Some(Err(e)) => return Err(e),
        };
        let (mdev_type, uuid, options, overrides) = match (defined, mdev_type, uuid) {
            (Some(def), given, _) => {
                if let Some(given) = given.filter(|t| *t != def.mdev_type) {
                    return Err(LifecycleError::TypeConflict {
                        uuid: def.uuid,
                        defined: def.mdev_type,
                        given: given.to_string(),
                    });
                }
                if options != InstanceOptions::default() && !override_definition {
                    return Err(LifecycleError::ExtraOptions(def.uuid));
                }
                let result = self.start_instance(
                    &def.mdev_type,
                    def.uuid,
                    overlay(&def.options, &options),
                    Some(def.options.clone()),
                    options,
                );
                let mut errors = umdev_pinning::sync::lock(&self.errors);
                match &result {
                    Ok(_) => errors.remove(&def.uuid),
                    // Already running: this start failed, the device did not.
                    Err(LifecycleError::DuplicateUuid(_)) => None,
                    Err(e) => errors.insert(def.uuid, e.to_string()),
                };
                return result;
            }
            (None, Some(_), uuid) if override_definition => {
                let what = uuid.map_or("no UUID was given".to_string(), |u| format!("{u} is not defined"));
                return Err(LifecycleError::Failed(format!(
                    "--override puts options over a device's definition, and {what}"
                )));
            }
            (None, Some(t), uuid) => {
                (t.to_string(), uuid.unwrap_or_else(Uuid::new_v4), options, InstanceOptions::default())
            }
            (None, None, Some(uuid)) => return Err(LifecycleError::NotDefined(uuid)),
            (None, None, None) => return Err(LifecycleError::NoType),
        };
        self.start_instance(&mdev_type, uuid, options, None, overrides)
    }

    /// Starts an instance of `mdev_type` with `options` under `uuid`, a new UUID (chosen by
    /// the client), not a definition's: no definition is looked up, so a definitions
    /// directory that cannot be read keeps no ad hoc start from starting.
    pub fn start_new(
        &self,
        mdev_type: &str,
        uuid: Uuid,
        options: InstanceOptions,
    ) -> Result<InstanceSummary, LifecycleError> {
        self.start_instance(mdev_type, uuid, options, None, InstanceOptions::default())
    }

    fn start_instance(
        &self,
        mdev_type: &str,
        uuid: Uuid,
        options: InstanceOptions,
        defined: Option<InstanceOptions>,
        overrides: InstanceOptions,
    ) -> Result<InstanceSummary, LifecycleError> {
        let from_definition = defined.is_some();
        // Kept only where the overrides hide some of it: else it is what runs.
        let defined_options = defined.filter(|_| overrides != InstanceOptions::default());
        let reserved = {
            let instances = self.lock();
            self.refuse_if_shut_down()?;
            let mut starting = umdev_pinning::sync::lock(&self.starting);
            if instances.contains_key(&uuid) || starting.contains(&uuid) {
                return Err(LifecycleError::DuplicateUuid(uuid));
            }
            if instances.len() + starting.len() >= self.max_instances {
                return Err(LifecycleError::TooManyInstances(self.max_instances));
            }
            starting.insert(uuid);
            Starting { starting: &self.starting, uuid }
        };
        // The device is made outside the table's lock: opening a backing file or setting up
        // a large RAM namespace can take a while, and `list`, `stop` and other starts go on
        // meanwhile. The UUID stays reserved until the instance is in the table or failed.
        let ty = self.registry.find(mdev_type).map_err(LifecycleError::from_type)?;
        if options.pin_mode() == umdev_pinning::PinMode::Kernel {
            umdev_pinning::kernel_pins_available().map_err(LifecycleError::KernelPins)?;
        }
        let device = ty.create(&options).map_err(LifecycleError::from_type)?;
        let mut instances = self.lock();
        self.refuse_if_shut_down()?;
        let socket = self.run_dir.join(format!("{uuid}.sock"));
        let mut config = self.template.clone();
        config.id = uuid.to_string();
        config.socket = socket.clone();
        config.dma.mode = options.pin_mode();
        self.daemon.start(device, config).map_err(|e| LifecycleError::Failed(e.to_string()))?;
        log::info!("started {mdev_type} instance {uuid} on {}", socket.display());
        instances.insert(
            uuid,
            Record {
                mdev_type: mdev_type.to_string(),
                options: options.clone(),
                socket: socket.clone(),
                from_definition,
                overrides: overrides.clone(),
                defined_options: defined_options.clone(),
            },
        );
        // In the table now: counted there, not twice.
        drop(reserved);
        drop(instances);
        umdev_pinning::sync::lock(&self.stopped).remove(&uuid);
        self.changed();
        let device = self.daemon.info(&uuid.to_string()).map(|i| i.device).unwrap_or_default();
        Ok(InstanceSummary {
            uuid,
            mdev_type: mdev_type.to_string(),
            socket,
            connected: false,
            options,
            device,
            from_definition,
            overrides,
            defined_options,
        })
    }

    /// Refuses a start once `shutdown` began: called under the instances lock, which it is
    /// set under, so no instance (and no socket) is started after the daemon stopped them all.
    fn refuse_if_shut_down(&self) -> Result<(), LifecycleError> {
        if self.shut_down.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(LifecycleError::Failed("the daemon is shutting down".into()));
        }
        Ok(())
    }

    fn changed(&self) {
        *umdev_pinning::sync::lock(&self.changes.0) += 1;
        self.changes.1.notify_all();
    }

    /// Waits until an instance starts or stops after `seen` (a value this returned before; 0
    /// at first), or `timeout` passes; returns the count of starts and stops so far.
    pub fn wait_change(&self, seen: u64, timeout: Duration) -> u64 {
        let count = umdev_pinning::sync::lock(&self.changes.0);
        let (count, _) = self
            .changes
            .1
            .wait_timeout_while(count, timeout, |c| *c == seen)
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *count
    }

    /// The instances, and what `umdev list --defined` needs beside them.
    pub fn status(&self) -> DaemonStatus {
        DaemonStatus {
            instances: self.list(),
            stopped: umdev_pinning::sync::lock(&self.stopped).iter().copied().collect(),
            errors: umdev_pinning::sync::lock(&self.errors).clone(),
            definitions: Some(self.definitions.dir().to_path_buf()),
        }
    }

    /// Stops an instance; refused while a client is connected unless `force`, which
    /// disconnects it and resets the device, and while its start is still making its device
    /// ([`LifecycleError::Starting`]). Frees its socket and capacity.
    pub fn stop(&self, uuid: Uuid, force: bool) -> Result<(), LifecycleError> {
        // Out of the table while it stops (cutting a client and joining its threads can take
        // the unmap timeout), so other control requests are not held up meanwhile.
        let record = {
            let mut instances = self.lock();
            match instances.remove(&uuid) {
                Some(record) => record,
                None if umdev_pinning::sync::lock(&self.starting).contains(&uuid) => {
                    return Err(LifecycleError::Starting(uuid))
                }
                None => return Err(LifecycleError::UnknownUuid(uuid)),
            }
        };
        // Marked stopped before it stops: a reload meanwhile must not start it again. Only
        // definitions are ever started by a reload, so only they are remembered: one it was
        // started from, or one written for it while it ran (`umdev define -u UUID --auto`
        // of a running device), which a reload would otherwise start again.
        let remember = record.from_definition || self.definitions.get(&uuid).is_ok();
        if remember {
            umdev_pinning::sync::lock(&self.stopped).insert(uuid);
        }
        let stopped = self.daemon.stop(&uuid.to_string(), force);
        if stopped.is_err() {
            if remember {
                umdev_pinning::sync::lock(&self.stopped).remove(&uuid);
            }
            self.lock().insert(uuid, record);
        }
        match stopped {
            Ok(()) => {
                log::info!("stopped instance {uuid}");
                self.changed();
                Ok(())
            }
            Err(DaemonError::Busy(_)) => Err(LifecycleError::Busy(uuid)),
            Err(e) => Err(LifecycleError::Failed(e.to_string())),
        }
    }

    /// The running instances.
    pub fn list(&self) -> Vec<InstanceSummary> {
        self.lock()
            .iter()
            .map(|(uuid, r)| {
                let info = self.daemon.info(&uuid.to_string());
                InstanceSummary {
                    uuid: *uuid,
                    mdev_type: r.mdev_type.clone(),
                    socket: r.socket.clone(),
                    connected: info.as_ref().is_some_and(|i| i.connected),
                    options: r.options.clone(),
                    device: info.map(|i| i.device).unwrap_or_default(),
                    from_definition: r.from_definition,
                    overrides: r.overrides.clone(),
                    defined_options: r.defined_options.clone(),
                }
            })
            .collect()
    }

    /// One instance's counters.
    pub fn stats(&self, uuid: Uuid) -> Result<InstanceStats, LifecycleError> {
        let info = self.daemon.info(&uuid.to_string()).ok_or(LifecycleError::UnknownUuid(uuid))?;
        Ok(InstanceStats::of(uuid, info))
    }

    /// Starts every `auto` definition; returns what failed.
    pub fn autostart(&self) -> Vec<(Uuid, LifecycleError)> {
        self.reload().failed
    }

    /// Re-reads the definitions: starts the `auto` ones that are not running (unless `stop`
    /// stopped them: an operator's stop outlasts a reload), and reports the instances whose
    /// definition has been removed or changed since they started. Nothing running is stopped
    /// or restarted: a connected guest would lose its device.
    pub fn reload(&self) -> ReloadReport {
        let entries = match DefinitionEntry::all(&self.definitions, &self.registry) {
            Ok(entries) => entries,
            Err(e) => {
                // Nothing is known of the definitions: nothing is started or forgotten.
                log::error!("reloading definitions: {e}");
                return ReloadReport::default();
            }
        };
        // A definition removed since its instance was stopped need not be remembered.
        umdev_pinning::sync::lock(&self.stopped).retain(|uuid| entries.iter().any(|d| d.uuid == *uuid));
        umdev_pinning::sync::lock(&self.errors).retain(|uuid, _| entries.iter().any(|d| d.uuid == *uuid));
        let status = self.status();
        let mut report = ReloadReport::default();
        for (row, entry) in sync_status(&entries, Some(&status))
            .into_iter()
            .zip(entries.iter().map(Some).chain(std::iter::repeat(None)))
        {
            match row.state {
                SyncState::Stopped if row.start == Some(StartPolicy::Auto) => report.held_back.push(row.uuid),
                // Being started by a `umdev start` right now: not a failure to report.
                SyncState::NotStarted if umdev_pinning::sync::lock(&self.starting).contains(&row.uuid) => {}
                SyncState::NotStarted => {
                    match self.start(None, Some(row.uuid), InstanceOptions::default(), false) {
                        Ok(_) => report.started.push(row.uuid),
                        // Started (or being started) by a `umdev start` since the status above.
                        Err(LifecycleError::DuplicateUuid(_)) => {}
                        Err(e) => report.failed.push((row.uuid, e)),
                    }
                }
                // An auto definition that cannot start is a failure to report; a manual one
                // waits for its `umdev start`, which will say why.
                SyncState::Invalid
                    if entry
                        .and_then(|e| e.definition.as_ref())
                        .is_none_or(|d| d.start == StartPolicy::Auto)
                        && status.instances.iter().all(|i| i.uuid != row.uuid) =>
                {
                    let why = row.error.unwrap_or_default();
                    umdev_pinning::sync::lock(&self.errors).insert(row.uuid, why.clone());
                    report.failed.push((row.uuid, LifecycleError::Failed(why)));
                }
                SyncState::Undefined => report.undefined.push(row.uuid),
                SyncState::Changed => report.changed.push(row.uuid),
                _ => {}
            }
        }
        report
    }

    /// Stops everything; starts under way start nothing.
    pub fn shutdown(&self) {
        {
            let _instances = self.lock();
            self.shut_down.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        self.daemon.shutdown();
        self.lock().clear();
    }
}

/// A UUID reserved while its device is made ([`Manager::start`]); released on drop.
struct Starting<'a> {
    starting: &'a Mutex<BTreeSet<Uuid>>,
    uuid: Uuid,
}

impl Drop for Starting<'_> {
    fn drop(&mut self) {
        umdev_pinning::sync::lock(self.starting).remove(&self.uuid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Kernel pins refused with an errno answer with it; with none (0, a failure that was not
    /// the kernel's), with EIO: an answer's errno 0 would read as success.
    #[test]
    fn a_kernel_pins_failure_answers_with_an_errno() {
        let refused = |errno| {
            LifecycleError::KernelPins(umdev_pinning::KernelPinsUnavailable {
                step: "io_uring_setup",
                errno,
                reason: "why".into(),
            })
        };
        assert_eq!(refused(libc::EPERM).errno(), libc::EPERM);
        assert_eq!(refused(0).errno(), libc::EIO);
    }

    #[test]
    fn definitions_round_trip_and_refuse_duplicates() {
        let dir = std::env::temp_dir().join(format!("umdev-defs-{}", std::process::id()));
        let defs = Definitions::new(&dir);
        let uuid = Uuid::new_v4();
        let def = Definition {
            uuid,
            mdev_type: "testdev".into(),
            start: StartPolicy::Auto,
            options: Default::default(),
        };
        assert!(defs.check_undefined(&uuid).is_ok() && !dir.exists(), "a check creates nothing");
        defs.define(&def).unwrap();
        assert!(matches!(defs.define(&def), Err(LifecycleError::AlreadyDefined(_))));
        assert!(matches!(defs.check_undefined(&uuid), Err(LifecycleError::AlreadyDefined(u)) if u == uuid));
        assert_eq!(defs.get(&uuid).unwrap(), def);
        assert_eq!(defs.list(), vec![def]);
        // A stray file is skipped, not fatal.
        std::fs::write(dir.join("junk.json"), "{").unwrap();
        assert_eq!(defs.list().len(), 1);
        defs.undefine(&uuid).unwrap();
        assert!(matches!(defs.undefine(&uuid), Err(LifecycleError::NotDefined(_))));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A file named by another spelling of a UUID (upper case, say, written by hand) is shown
    /// as an invalid definition naming the file, not read as one, and `undefine` removes it.
    #[test]
    fn a_definition_file_spelt_otherwise_is_shown_invalid_and_can_be_undefined() {
        let dir = tempfile::tempdir().unwrap();
        let defs = Definitions::new(dir.path());
        let d = def(0xabcd, StartPolicy::Auto);
        let upper = format!("{}.json", d.uuid.to_string().to_uppercase());
        let text = serde_json::to_string(&d).unwrap();
        defs.define(&def(1, StartPolicy::Manual)).unwrap();
        std::fs::write(dir.path().join(&upper), &text).unwrap();
        let entries = defs.entries().unwrap();
        assert_eq!(entries.len(), 2);
        let (uuid, stray) = &entries[1];
        assert_eq!(*uuid, d.uuid);
        match stray {
            Err(LifecycleError::Invalid { path, why }) => {
                assert_eq!(path, &dir.path().join(&upper));
                assert!(why.contains(&format!("{}.json", d.uuid)), "{why}");
            }
            other => panic!("{other:?}"),
        }
        assert!(
            matches!(defs.get(&d.uuid), Err(LifecycleError::NotDefined(_))),
            "never read as the definition"
        );
        // Beside the definition it spells differently, it is left out.
        defs.define(&d).unwrap();
        let entries = defs.entries().unwrap();
        assert_eq!(entries.iter().filter(|(u, _)| *u == d.uuid).count(), 1);
        assert_eq!(entries[1].1.as_ref().unwrap(), &d);
        // Undefined, both go; the other definition stays.
        defs.undefine(&d.uuid).unwrap();
        assert!(!dir.path().join(&upper).exists());
        assert_eq!(defs.list(), vec![def(1, StartPolicy::Manual)]);
        std::fs::write(dir.path().join(&upper), &text).unwrap();
        defs.undefine(&d.uuid).unwrap();
        assert!(matches!(defs.undefine(&d.uuid), Err(LifecycleError::NotDefined(_))));
        assert_eq!(defs.entries().unwrap().len(), 1);
    }

    #[test]
    fn changes_made_at_once_each_keep_the_others() {
        // Each update reads, changes and writes under the directory's lock: eight threads
        // adding an option each, five times over, leave all eight.
        let dir = tempfile::tempdir().unwrap();
        let defs = Definitions::new(dir.path());
        let d = def(7, StartPolicy::Manual);
        defs.define(&d).unwrap();
        std::thread::scope(|s| {
            for t in 0..8 {
                let defs = defs.clone();
                s.spawn(move || {
                    for round in 0..5 {
                        defs.update(&d.uuid, |mut d| {
                            d.options.params.insert(format!("k{t}"), round.to_string());
                            Ok(d)
                        })
                        .unwrap();
                    }
                });
            }
        });
        let got = defs.get(&d.uuid).unwrap();
        assert_eq!(got.options.params.len(), 8, "{:?}", got.options.params);
        assert!(got.options.params.values().all(|v| v == "4"));
        // A refused change writes nothing; an unreadable directory is an error, not "none".
        assert!(defs.update(&d.uuid, |_| Err(LifecycleError::Failed("no".into()))).is_err());
        assert_eq!(defs.get(&d.uuid).unwrap(), got);
        assert_eq!(defs.entries().unwrap().len(), 1);
        let missing = Definitions::new(dir.path().join("none"));
        assert_eq!(missing.entries().unwrap().len(), 0);
        let not_a_dir = Definitions::new(dir.path().join(".lock"));
        assert!(not_a_dir.entries().is_err());
    }

    #[test]
    fn directories_must_be_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let fresh = dir.path().join("a/b");
        private_dir(&fresh).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&fresh), 0o700);
        // One's own directory that others may write to is made private (an older umdev
        // created them with the umask's mode).
        std::fs::set_permissions(&fresh, std::fs::Permissions::from_mode(0o777)).unwrap();
        private_dir(&fresh).unwrap();
        assert_eq!(mode(&fresh), 0o755);
        // Reading refuses it (a group member could have put a definition there) and leaves
        // the mode alone; the message says how to fix it.
        std::fs::set_permissions(&fresh, std::fs::Permissions::from_mode(0o775)).unwrap();
        for err in [
            check_private_dir(&fresh).unwrap_err(),
            Definitions::new(&fresh).entries().unwrap_err(),
            Definitions::new(&fresh).get(&Uuid::from_u128(1)).unwrap_err(),
        ] {
            assert!(matches!(err, LifecycleError::Writable { mode: 0o775, .. }), "{err}");
            assert!(err.to_string().contains(&format!("chmod go-w {}", fresh.display())), "{err}");
            assert_eq!(err.errno(), libc::EACCES);
        }
        assert!(Definitions::new(&fresh).list().is_empty());
        assert_eq!(mode(&fresh), 0o775);
        // Writing a definition there takes the write access away; then it reads.
        Definitions::new(&fresh).define(&def(1, StartPolicy::Manual)).unwrap();
        assert_eq!(mode(&fresh), 0o755);
        assert_eq!(Definitions::new(&fresh).entries().unwrap().len(), 1);
        Definitions::new(&fresh).undefine(&Uuid::from_u128(1)).unwrap();
        // A shared directory (sticky, others may write, as /tmp) is refused, read or written,
        // and never changed.
        let shared = dir.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let full_mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        for err in [
            private_dir(&shared).unwrap_err(),
            check_private_dir(&shared).unwrap_err(),
            Definitions::new(&shared).entries().unwrap_err(),
            Definitions::new(&shared).define(&def(1, StartPolicy::Auto)).unwrap_err(),
        ] {
            assert!(matches!(err, LifecycleError::Shared { mode: 0o1777, .. }), "{err}");
            assert!(err.to_string().contains("use a directory of its own"), "{err}");
        }
        assert_eq!(full_mode(&shared), 0o1777);
        // A sticky directory nobody else may write to is a private one.
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1700)).unwrap();
        private_dir(&shared).unwrap();
        assert_eq!(full_mode(&shared), 0o1700);
        let file = dir.path().join("f");
        std::fs::write(&file, "").unwrap();
        assert!(matches!(
            private_dir(&file),
            Err(LifecycleError::Io { .. } | LifecycleError::NotPrivate { .. })
        ));
        if !nix::unistd::geteuid().is_root() {
            return eprintln!("SKIPPED the rest: another user's directory needs root to make");
        }
        // Another user's directory, or a symbolic link another user planted, is refused, and
        // definitions in it are neither read nor written.
        let theirs = nix::unistd::Uid::from_raw(65534);
        nix::unistd::chown(&fresh, Some(theirs), None).unwrap();
        let err = check_private_dir(&fresh).unwrap_err();
        assert!(matches!(err, LifecycleError::NotPrivate { .. }), "{err}");
        let defs = Definitions::new(&fresh);
        assert!(matches!(defs.entries(), Err(LifecycleError::NotPrivate { .. })));
        assert!(matches!(defs.get(&Uuid::from_u128(1)), Err(LifecycleError::NotPrivate { .. })));
        assert!(matches!(defs.define(&def(1, StartPolicy::Auto)), Err(LifecycleError::NotPrivate { .. })));
        let link = dir.path().join("link");
        std::os::unix::fs::symlink("/", &link).unwrap();
        nix::unistd::fchownat(
            nix::fcntl::AT_FDCWD,
            &link,
            Some(theirs),
            None,
            nix::unistd::FchownatFlags::AT_SYMLINK_NOFOLLOW,
        )
        .unwrap();
        let err = check_private_dir(&link).unwrap_err();
        assert!(format!("{err}").contains("symbolic link"), "{err}");
    }

    fn def(n: u128, start: StartPolicy) -> Definition {
        Definition {
            uuid: Uuid::from_u128(n),
            mdev_type: "testdev".into(),
            start,
            options: Default::default(),
        }
    }

    /// A manager of testdev instances with its run directory made at `run`, definitions at `state`.
    fn testdev_manager(run: &Path, state: &Path) -> Manager {
        private_dir(run).unwrap();
        let registry =
            Registry::with_types(vec![std::sync::Arc::new(umdev_devices::testdev::TestDevType::new(8))]);
        Manager::new(registry, run, Definitions::new(state), InstanceConfig::new("", ""))
    }

    /// testdev, whose `create` waits until the test opens its gate.
    struct Gated {
        inner: umdev_devices::testdev::TestDevType,
        /// (creates entered, gate open)
        state: Mutex<(u32, bool)>,
        changed: Condvar,
    }

    impl Gated {
        fn new() -> std::sync::Arc<Gated> {
            std::sync::Arc::new(Gated {
                inner: umdev_devices::testdev::TestDevType::new(8),
                state: Mutex::new((0, false)),
                changed: Condvar::new(),
            })
        }

        fn wait_entered(&self, n: u32) {
            let st = self.state.lock().unwrap();
            drop(self.changed.wait_while(st, |st| st.0 < n).unwrap());
        }

        fn open(&self) {
            self.state.lock().unwrap().1 = true;
            self.changed.notify_all();
        }
    }

    impl DeviceType for Gated {
        fn name(&self) -> &str {
            self.inner.name()
        }
        fn description(&self) -> &str {
            self.inner.description()
        }
        fn available_instances(&self) -> u32 {
            self.inner.available_instances()
        }
        fn create(
            &self,
            options: &InstanceOptions,
        ) -> Result<std::sync::Arc<dyn umdev_mdev::VfioDevice>, TypeError> {
            let mut st = self.state.lock().unwrap();
            st.0 += 1;
            self.changed.notify_all();
            drop(self.changed.wait_while(st, |st| !st.1).unwrap());
            self.inner.create(options)
        }
    }

    /// Runs `f` on a thread of its own; its result, or None if it has not returned in 60 s
    /// (it waits for a lock a slow start holds).
    fn answered<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(Duration::from_secs(60)).ok()
    }

    /// A start whose device takes long to make (a large backing file, say) holds up no other
    /// control request, and one cut short by a shutdown starts nothing and leaves no socket.
    #[test]
    fn a_slow_start_holds_up_no_other_request_and_a_shutdown_ends_it() {
        let dir = tempfile::tempdir().unwrap();
        let (run, state) = (dir.path().join("run"), dir.path().join("state"));
        private_dir(&run).unwrap();
        let gated = Gated::new();
        let registry = Registry::with_types(vec![gated.clone() as std::sync::Arc<dyn DeviceType>]);
        let manager = std::sync::Arc::new(
            Manager::new(registry, &run, Definitions::new(&state), InstanceConfig::new("", ""))
                .with_max_instances(2),
        );
        let (first, second) = (Uuid::from_u128(1), Uuid::from_u128(2));
        let starter = {
            let m = manager.clone();
            std::thread::spawn(move || m.start_new("testdev", first, InstanceOptions::default()))
        };
        gated.wait_entered(1);
        let m = manager.clone();
        let meanwhile = answered(move || {
            let listed = m.list().len();
            let again = m.start_new("testdev", first, InstanceOptions::default()).map(|_| ());
            let room = m.types()[0].available_instances;
            let stop = m.stop(first, true);
            (listed, again, room, stop)
        });
        let Some((listed, again, room, stop)) = meanwhile else {
            gated.open();
            panic!("list and start waited for a start making its device");
        };
        assert_eq!(listed, 0, "not listed until it runs");
        assert!(matches!(again, Err(LifecycleError::DuplicateUuid(u)) if u == first), "{again:?}");
        assert_eq!(room, 1, "the start under way takes capacity");
        assert!(matches!(stop, Err(LifecycleError::Starting(u)) if u == first), "{stop:?}");
        // The daemon shuts down while both make their devices: neither starts.
        let late = {
            let m = manager.clone();
            std::thread::spawn(move || m.start_new("testdev", second, InstanceOptions::default()))
        };
        gated.wait_entered(2);
        let m = manager.clone();
        assert!(answered(move || m.shutdown()).is_some(), "the shutdown waited for the starts");
        gated.open();
        for start in [starter, late] {
            let err = start.join().unwrap().map(|_| ()).unwrap_err();
            assert!(err.to_string().contains("shutting down"), "{err}");
        }
        assert!(manager.list().is_empty());
        let left: Vec<_> = std::fs::read_dir(&run).unwrap().flatten().map(|e| e.file_name()).collect();
        assert!(left.is_empty(), "sockets left after the shutdown: {left:?}");
    }

    fn running(d: &Definition, from_definition: bool) -> InstanceSummary {
        InstanceSummary {
            uuid: d.uuid,
            mdev_type: d.mdev_type.clone(),
            socket: PathBuf::from(format!("/run/umdev/{}.sock", d.uuid)),
            connected: false,
            options: d.options.clone(),
            device: serde_json::Value::Null,
            from_definition,
            overrides: InstanceOptions::default(),
            defined_options: None,
        }
    }

    #[test]
    fn sync_status_tells_every_way_definitions_and_instances_differ() {
        let (up, auto_down, manual_down) =
            (def(1, StartPolicy::Auto), def(2, StartPolicy::Auto), def(3, StartPolicy::Manual));
        let mut changed = def(4, StartPolicy::Manual);
        let gone = def(5, StartPolicy::Auto);
        let ad_hoc = def(6, StartPolicy::Auto);
        let held = def(7, StartPolicy::Auto);
        let mut overridden = def(8, StartPolicy::Manual);
        let mut instances = vec![running(&up, true), running(&changed, true), running(&gone, true)];
        instances.push(running(&ad_hoc, false));
        let mut with_override = running(&overridden, true);
        with_override.overrides.pin_mode = Some(umdev_mdev::types::PinModeName::Lock);
        with_override.options.pin_mode = Some(umdev_mdev::types::PinModeName::Lock);
        instances.push(with_override);
        changed.options.pin_mode = Some(umdev_mdev::types::PinModeName::Lock);
        overridden.options.params.insert("x".into(), "1".into());
        let status = DaemonStatus {
            instances,
            stopped: vec![held.uuid],
            errors: [(auto_down.uuid, "no room".to_string())].into(),
            definitions: None,
        };
        let mut entries: Vec<DefinitionEntry> =
            [up, auto_down, manual_down, changed, held].into_iter().map(DefinitionEntry::valid).collect();
        entries.push(DefinitionEntry {
            uuid: Uuid::from_u128(9),
            definition: None,
            error: Some("bad JSON".into()),
        });
        let rows = sync_status(&entries, Some(&status));
        let states: Vec<(u128, SyncState, Option<bool>)> =
            rows.iter().map(|r| (r.uuid.as_u128(), r.state, r.in_sync)).collect();
        assert_eq!(
            states,
            vec![
                (1, SyncState::Running, Some(true)),
                (2, SyncState::NotStarted, Some(false)),
                (3, SyncState::Stopped, Some(true)),
                (4, SyncState::Changed, Some(false)),
                // An auto definition stopped on purpose is stopped, not out of sync.
                (7, SyncState::Stopped, Some(true)),
                (9, SyncState::Invalid, Some(false)),
                // Started from a definition that is gone; the ad hoc instance 6 is no row.
                (5, SyncState::Undefined, Some(false)),
                // Running from a definition that is gone, with an override: still undefined.
                (8, SyncState::Undefined, Some(false)),
            ]
        );
        assert_eq!(rows[1].error.as_deref(), Some("no room"), "a not-started definition's last error");
        assert_eq!(rows[3].running_options, Some(InstanceOptions::default()), "what it runs with");
        assert_eq!(rows[5].error.as_deref(), Some("bad JSON"));
        assert_eq!(rows[6].start, None);
        // An override over a definition is running as asked, not changed.
        let entries = [DefinitionEntry::valid(def(8, StartPolicy::Manual))];
        let rows = sync_status(&entries, Some(&status));
        assert_eq!(rows[0].state, SyncState::Running);
        assert_eq!(rows[0].overrides.pin_mode, Some(umdev_mdev::types::PinModeName::Lock));
        // Started with x=2 over a definition with x=1: running while the definition says x=1,
        // changed once it says x=3 (a change in a key the override covers) or y=1.
        let mut started = def(10, StartPolicy::Manual);
        started.options.params.insert("x".into(), "1".into());
        let mut instance = running(&started, true);
        instance.overrides.params.insert("x".into(), "2".into());
        instance.options.params.insert("x".into(), "2".into());
        instance.defined_options = Some(started.options.clone());
        let status =
            DaemonStatus { instances: vec![instance], stopped: vec![], errors: [].into(), definitions: None };
        let state_with = |key: &str, value: &str| {
            let mut now = started.clone();
            now.options.params.insert(key.into(), value.into());
            sync_status(&[DefinitionEntry::valid(now)], Some(&status))[0].state
        };
        assert_eq!(state_with("x", "1"), SyncState::Running);
        assert_eq!(state_with("x", "3"), SyncState::Changed, "a change under the override");
        assert_eq!(state_with("y", "1"), SyncState::Changed);
        // Without a daemon nothing can be told.
        assert!(sync_status(&entries, None)
            .iter()
            .all(|r| r.state == SyncState::Unknown && r.in_sync.is_none()));
    }

    #[test]
    fn reload_starts_new_auto_definitions_and_leaves_running_ones_alone() {
        let dir = std::env::temp_dir().join(format!("umdev-reload-{}", std::process::id()));
        let (run, state) = (dir.join("run"), dir.join("state"));
        let manager = testdev_manager(&run, &state);
        let (a, b) = (def(0xa, StartPolicy::Auto), def(0xb, StartPolicy::Auto));
        manager.definitions().define(&a).unwrap();
        assert!(manager.autostart().is_empty());
        assert!(run.join(format!("{}.sock", a.uuid)).exists());

        // A new auto definition starts; a removed one is reported and keeps running.
        manager.definitions().define(&b).unwrap();
        manager.definitions().undefine(&a.uuid).unwrap();
        let report = manager.reload();
        assert_eq!((report.started, report.undefined), (vec![b.uuid], vec![a.uuid]));
        assert!(report.failed.is_empty() && report.changed.is_empty());
        assert_eq!(manager.list().len(), 2);

        // An auto instance stopped on purpose is not brought back by a reload.
        manager.stop(b.uuid, false).unwrap();
        let report = manager.reload();
        assert_eq!((report.started, report.held_back), (vec![], vec![b.uuid]));
        manager.start(None, Some(b.uuid), InstanceOptions::default(), false).unwrap();

        // A changed definition is reported; the instance runs on as it was.
        manager.definitions().undefine(&b.uuid).unwrap();
        let mut b2 = b.clone();
        b2.options.pin_mode = Some(umdev_mdev::types::PinModeName::Lock);
        manager.definitions().define(&b2).unwrap();
        assert_eq!(manager.reload().changed, vec![b.uuid]);
        manager.shutdown();
        assert_eq!(std::fs::read_dir(&run).unwrap().count(), 0, "every socket removed");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A device started from its type and defined while it runs (`umdev define -u UUID --auto`,
    /// the README's way to keep a device across restarts) stays stopped after `umdev stop`
    /// through a reload, as one started from its definition does.
    #[test]
    fn a_device_defined_while_it_ran_stays_stopped_through_a_reload() {
        let dir = std::env::temp_dir().join(format!("umdev-reload-defined-{}", std::process::id()));
        let (run, state) = (dir.join("run"), dir.join("state"));
        let manager = testdev_manager(&run, &state);
        let c = def(0xc, StartPolicy::Auto);
        manager.start(Some("testdev"), Some(c.uuid), InstanceOptions::default(), false).unwrap();
        manager.definitions().define(&c).unwrap();
        manager.stop(c.uuid, false).unwrap();
        let report = manager.reload();
        assert_eq!((report.started, report.held_back), (vec![], vec![c.uuid]));
        assert!(manager.list().is_empty());
        manager.shutdown();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Starting a defined device that already runs fails that start, not the device: no
    /// "last start failed" is kept for it.
    #[test]
    fn a_second_start_of_a_running_definition_records_no_failure() {
        let dir = std::env::temp_dir().join(format!("umdev-second-start-{}", std::process::id()));
        let (run, state) = (dir.join("run"), dir.join("state"));
        let manager = testdev_manager(&run, &state);
        let d = def(0xd, StartPolicy::Manual);
        manager.definitions().define(&d).unwrap();
        manager.start(None, Some(d.uuid), InstanceOptions::default(), false).unwrap();
        let again = manager.start(None, Some(d.uuid), InstanceOptions::default(), false);
        assert!(matches!(again, Err(LifecycleError::DuplicateUuid(_))));
        manager.stop(d.uuid, false).unwrap();
        assert!(manager.status().errors.is_empty(), "{:?}", manager.status().errors);
        manager.shutdown();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A definitions directory its group may write to (a `chmod g+w` /etc/umdev.d) is read by
    /// neither a reload nor a start of a definition: a group member could have planted an
    /// auto definition there. Nothing running is stopped, and the mode is left as it is.
    #[test]
    fn a_reload_or_start_refuses_definitions_its_group_may_write() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let (run, state) = (dir.path().join("run"), dir.path().join("state"));
        let manager = testdev_manager(&run, &state);
        let (a, b) = (def(0xa, StartPolicy::Auto), def(0xb, StartPolicy::Auto));
        manager.definitions().define(&a).unwrap();
        assert!(manager.autostart().is_empty());
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o770)).unwrap();
        let planted = serde_json::to_string(&b).unwrap();
        std::fs::write(state.join(format!("{}.json", b.uuid)), planted).unwrap();
        let report = manager.reload();
        assert!(report.started.is_empty() && report.failed.is_empty() && report.undefined.is_empty());
        assert_eq!(manager.list().iter().map(|i| i.uuid).collect::<Vec<_>>(), vec![a.uuid]);
        let err = manager.start(None, Some(b.uuid), InstanceOptions::default(), false).unwrap_err();
        assert!(matches!(err, LifecycleError::Writable { mode: 0o770, .. }), "{err}");
        assert_eq!(std::fs::metadata(&state).unwrap().permissions().mode() & 0o7777, 0o770);
        manager.shutdown();
    }

    /// A definition file is used only if it is as private as its directory must be: a group
    /// member's file planted while the directory was writable stays after its mode is fixed.
    #[test]
    fn a_definition_file_others_may_have_written_is_not_used() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let defs = Definitions::new(&state);
        defs.define(&def(1, StartPolicy::Auto)).unwrap();
        let one = state.join(format!("{}.json", Uuid::from_u128(1)));
        // A leftover temporary file's mode is not kept: what define writes, it reads back.
        let stale = state.join(format!(".{}.tmp", Uuid::from_u128(2)));
        std::fs::write(&stale, "").unwrap();
        std::fs::set_permissions(&stale, std::fs::Permissions::from_mode(0o666)).unwrap();
        defs.define(&def(2, StartPolicy::Auto)).unwrap();
        let two = state.join(format!("{}.json", Uuid::from_u128(2)));
        assert_eq!(std::fs::metadata(&two).unwrap().permissions().mode() & 0o022, 0);
        assert_eq!(defs.list().len(), 2);
        for mode in [0o664, 0o646] {
            std::fs::set_permissions(&one, std::fs::Permissions::from_mode(mode)).unwrap();
            let err = defs.get(&Uuid::from_u128(1)).unwrap_err();
            assert!(matches!(&err, LifecycleError::Invalid { path, .. } if *path == one), "{err}");
            let text = err.to_string();
            assert!(text.contains(&format!("mode {mode:o}: its group or others may write to it")), "{text}");
            assert!(text.contains(&one.display().to_string()), "{text}");
            assert_eq!(defs.list().iter().map(|d| d.uuid).collect::<Vec<_>>(), vec![Uuid::from_u128(2)]);
        }
        // A symbolic link is not followed, even to a good definition of the user's own.
        std::fs::remove_file(&one).unwrap();
        std::fs::copy(&two, dir.path().join("elsewhere")).unwrap();
        std::os::unix::fs::symlink(dir.path().join("elsewhere"), &one).unwrap();
        let err = defs.get(&Uuid::from_u128(1)).unwrap_err();
        assert!(
            matches!(&err, LifecycleError::Invalid { .. }) && err.to_string().contains("a symbolic link"),
            "{err}"
        );
        std::fs::remove_file(&one).unwrap();
        // Another user's file (only root can make one here).
        if nix::unistd::geteuid().is_root() {
            std::fs::write(&one, serde_json::to_string(&def(1, StartPolicy::Auto)).unwrap()).unwrap();
            std::fs::set_permissions(&one, std::fs::Permissions::from_mode(0o644)).unwrap();
            nix::unistd::chown(&one, Some(nix::unistd::Uid::from_raw(12345)), None).unwrap();
            let err = defs.get(&Uuid::from_u128(1)).unwrap_err();
            assert!(err.to_string().contains("owned by uid 12345"), "{err}");
        }
    }
}
