//! `umdev`: the vfio-user mediated-device server and its tools.

#[cfg(feature = "bench")]
mod affinity;
#[cfg(feature = "bench")]
mod ccwbench;
#[cfg(feature = "bench")]
mod cleanup;
#[cfg(feature = "bench")]
mod demo;
mod logging;
mod manage;
#[cfg(feature = "bench")]
mod nvmebench;
mod output;
#[cfg(feature = "bench")]
mod pinbench;
#[cfg(feature = "bench")]
mod progress;
#[cfg(feature = "bench")]
mod protobench;
mod run;

use std::path::{Path, PathBuf};

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use output::out;

#[derive(Parser)]
#[command(
    name = "umdev",
    version,
    about = "vfio-user server for mediated devices, with an external page-pinning engine"
)]
struct Cli {
    /// Directory of the daemon's control socket and instance sockets (only the commands of
    /// [`RUN_DIR_USERS`] take it; the help says so, from that list).
    #[arg(long, global = true)]
    run_dir: Option<std::path::PathBuf>,
    /// Directory of persistent device definitions (only the commands of [`STATE_DIR_USERS`]).
    #[arg(long, global = true)]
    state_dir: Option<std::path::PathBuf>,
    /// How log lines look: `terminal` (env_logger, RUST_LOG; warnings and errors by default),
    /// `journal` (sd-daemon `<N>` priority prefixes; info and up by default), or `auto`:
    /// `journal` when stderr is systemd's journal ($JOURNAL_STREAM).
    #[arg(long, global = true, value_enum, default_value_t = logging::LogFormat::Auto)]
    log_format: logging::LogFormat,
    #[command(subcommand)]
    command: Command,
}

/// Resource limits of served instances (defaults in parentheses; see docs/reliability.md).
#[derive(clap::Args, Clone)]
struct LimitArgs {
    /// DMA mappings a client may hold (4096).
    #[arg(long, value_parser = at_least_u32::<1>)]
    max_dma_maps: Option<u32>,
    /// Bytes of DMA mappings with an fd a client may hold (17592186044416: 16 TiB, a quarter of
    /// the process's default budget, so that one client cannot take it all).
    #[arg(long, value_parser = at_least::<4096>)]
    max_dma_bytes: Option<u64>,
    /// DMA mappings all clients of this process may hold together: each is a VMA, a per-process kernel
    /// resource (half of vm.max_map_count: 32765 by default).
    #[arg(long, value_parser = at_least::<1>)]
    max_process_mappings: Option<u64>,
    /// Bytes of address space all clients' DMA mappings may take together: a mapping of a
    /// sparse file costs addresses only, and they must leave the process room for its threads
    /// (70368744177664: 64 TiB, half of x86-64's).
    #[arg(long, value_parser = at_least::<1>)]
    max_process_mapped_bytes: Option<u64>,
    /// Pins a device may hold at once, repeats counted (16777216).
    #[arg(long, value_parser = at_least::<1>)]
    max_pins: Option<u64>,
    /// Bytes one region access or message carries at most, 4096 to 67108864 (1048576; also
    /// bounds the message size; QEMU accepts at most 64 MiB).
    #[arg(long, value_parser = clap::value_parser!(u32).range(4096..=64 << 20))]
    max_data_xfer: Option<u32>,
    /// fds one message may carry, e.g. SET_IRQS eventfds, 1 to 253 (16; QEMU accepts at most 16).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=253))]
    max_msg_fds: Option<u32>,
}

impl LimitArgs {
    fn apply(&self, config: &mut umdev_server::InstanceConfig) -> Result<(), String> {
        let l = &mut config.limits;
        if let Some(n) = self.max_dma_maps {
            l.max_dma_maps = n;
            config.dma.max_mappings = n as usize;
        }
        if let Some(n) = self.max_dma_bytes {
            config.dma.max_mapped_bytes = n;
        }
        if let Some(n) = self.max_process_mappings {
            umdev_pinning::set_process_mapping_limit(n);
        }
        if let Some(n) = self.max_process_mapped_bytes {
            umdev_pinning::set_process_mapped_bytes_limit(n);
        }
        if let Some(n) = self.max_pins {
            config.dma.max_pins = n;
        }
        if let Some(n) = self.max_data_xfer {
            l.max_data_xfer_size = n;
        }
        if let Some(n) = self.max_msg_fds {
            l.max_msg_fds = n;
        }
        Ok(())
    }
}

/// Options of every instance-creating command.
#[derive(clap::Args)]
struct CreateArgs {
    /// How the instance pins guest pages: track, lock or kernel (the kernel's own long-term
    /// pins, through io_uring buffer registration).
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(["track", "lock", "kernel"]), ignore_case = true)]
    pin_mode: Option<String>,
    /// A type's option, KEY=VALUE (repeatable, each key once; `umdev types -v` lists them).
    #[arg(long = "opt", value_name = "KEY=VALUE")]
    opts: Vec<String>,
}

impl CreateArgs {
    fn options(&self) -> Result<umdev_mdev::types::InstanceOptions, String> {
        Ok(umdev_mdev::types::InstanceOptions {
            pin_mode: parse_pin_mode(self.pin_mode.as_deref())?,
            params: parse_params(&self.opts)?,
        })
    }

    fn given(&self) -> bool {
        self.pin_mode.is_some() || !self.opts.is_empty()
    }
}

/// A count or size of at least `MIN`, as clap's value parser: "must be at least 1" where clap's
/// own range parser would print the whole range of the type.
fn at_least<const MIN: u64>(value: &str) -> Result<u64, String> {
    let n: u64 = value.parse().map_err(|e| format!("{e}"))?;
    if n < MIN {
        return Err(format!("must be at least {MIN}"));
    }
    Ok(n)
}

/// [`at_least`] for a 32-bit count.
fn at_least_u32<const MIN: u64>(value: &str) -> Result<u32, String> {
    u32::try_from(at_least::<MIN>(value)?).map_err(|_| format!("must be at most {}", u32::MAX))
}

fn parse_pin_mode(mode: Option<&str>) -> Result<Option<umdev_mdev::types::PinModeName>, String> {
    use umdev_mdev::types::PinModeName;
    // Any case, as clap accepted it.
    match mode.map(str::to_ascii_lowercase).as_deref() {
        None => Ok(None),
        Some("track") => Ok(Some(PinModeName::Track)),
        Some("lock") => Ok(Some(PinModeName::Lock)),
        Some("kernel") => Ok(Some(PinModeName::Kernel)),
        Some(other) => Err(format!("unknown pin mode {other:?} (track, lock or kernel)")),
    }
}

/// `KEY=VALUE` options; a key given twice is refused (which one was meant?).
fn parse_params(pairs: &[String]) -> Result<std::collections::BTreeMap<String, String>, String> {
    let mut params = std::collections::BTreeMap::new();
    for p in pairs {
        let (k, v) = p.split_once('=').ok_or_else(|| format!("option {p:?} is not KEY=VALUE"))?;
        if k.is_empty() {
            return Err(format!("option {p:?} has no key"));
        }
        if let Some(first) = params.insert(k.to_string(), v.to_string()) {
            return Err(format!("option {k} given twice ({k}={first} and {k}={v})"));
        }
    }
    Ok(params)
}

#[derive(Subcommand)]
enum Command {
    /// The main job: show run-split pinning end to end and verify every byte.
    #[cfg(feature = "bench")]
    Demo,
    /// List the device types, their available instances and (-v) their options.
    Types {
        /// Only this type, with its options.
        #[arg(value_name = "TYPE")]
        type_name: Option<String>,
        /// Each type's options too (`--opt KEY=VALUE`).
        #[arg(short, long)]
        verbose: bool,
        /// JSON instead of text (with each type's options).
        #[arg(long, conflicts_with = "dumpjson")]
        json: bool,
        /// mdevctl's JSON (`[{"umdev": [{TYPE: {...}}]}]`).
        #[arg(long)]
        dumpjson: bool,
        /// The parent (umdev has one: `umdev`).
        #[arg(short, long)]
        parent: Option<String>,
    },
    /// Run the daemon: a control socket and every started instance, until SIGINT/SIGTERM.
    ///
    /// SIGHUP re-reads the definitions: new --auto ones start, running instances are left
    /// alone (one whose definition was removed or changed is logged). Under systemd
    /// (contrib/systemd/umdev.service, Type=notify) it reports READY=1 once the control socket
    /// listens and the --auto definitions have started, STATUS= as instances and clients come
    /// and go, and uses $RUNTIME_DIRECTORY and $CONFIGURATION_DIRECTORY as its run and
    /// definitions directories. One daemon per run and definitions directory (each is locked);
    /// sockets a daemon that died left there are removed at start.
    Daemon {
        /// Opt-in adaptive busy-polling after each reply, up to this many microseconds (at most
        /// 10000).
        #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=10_000))]
        busy_poll_us: u64,
        /// Instances (and so vfio-user connections, one each) the daemon serves at most.
        #[arg(long, default_value_t = 256, value_parser = at_least::<1>)]
        max_instances: u64,
        #[command(flatten)]
        limits: LimitArgs,
    },
    /// Start an instance of a type, or a defined device by UUID.
    ///
    /// A defined UUID starts as its definition says: a --type must be the definition's, and
    /// options are refused unless --override puts them over the definition's for this start.
    Start {
        /// Device type (omit to start the definition of --uuid).
        #[arg(short = 't', long = "type")]
        type_name: Option<String>,
        /// The instance's UUID (generated if omitted).
        #[arg(long, short = 'u')]
        uuid: Option<String>,
        /// The parent (umdev has one: `umdev`).
        #[arg(short, long)]
        parent: Option<String>,
        /// The type and options from an mdevctl device config (`-` for standard input).
        #[arg(long, conflicts_with_all = ["type_name", "pin_mode", "opts"])]
        jsonfile: Option<PathBuf>,
        /// Start a defined device with these options over its definition's (this once).
        #[arg(long = "override")]
        override_definition: bool,
        #[command(flatten)]
        create: CreateArgs,
    },
    /// Stop an instance (refused while a client is connected, unless --force).
    Stop {
        /// The instance's UUID.
        #[arg(long, short = 'u')]
        uuid: String,
        /// Disconnect a connected client (the device is reset).
        #[arg(long)]
        force: bool,
    },
    /// List running instances, or with --defined the persistent definitions, one line each.
    ///
    /// A running instance's line: UUID, type, socket, and `(connected)` while a client is. With
    /// --defined each definition's state says whether the daemon agrees with it: running,
    /// stopped (manual, or stopped with `umdev stop`), or out of sync: not-started (--auto but
    /// not running; with its last start error), changed (its definition changed since it
    /// started), undefined (running, no longer defined), invalid (it cannot be started, and why).
    /// --verbose adds indented lines under each, as mdevctl's `list -v`: its options, and a
    /// running instance's host endpoints (an mtty port's pty or socket).
    List {
        /// The definitions instead of running instances.
        #[arg(short, long)]
        defined: bool,
        /// Each device's options, and its host endpoints (mtty ports), on indented lines under it.
        #[arg(short, long, conflicts_with_all = ["json", "dumpjson"])]
        verbose: bool,
        /// JSON instead of text (with every detail).
        #[arg(long, conflicts_with = "dumpjson")]
        json: bool,
        /// mdevctl's JSON: one device's config with -u, else `[{"umdev": [{UUID: config}]}]`.
        #[arg(long)]
        dumpjson: bool,
        /// Only this UUID.
        #[arg(short, long)]
        uuid: Option<String>,
        /// Only this type.
        #[arg(short = 't', long = "type")]
        type_name: Option<String>,
        /// The parent (umdev has one: `umdev`).
        #[arg(short, long)]
        parent: Option<String>,
    },
    /// Define a persistent device (it is not started; --auto starts it with the daemon).
    ///
    /// The definition is checked as starting it would be: an unknown type, key or bad value
    /// fails now, with the message `start` would give. Without --type, --uuid names a running
    /// instance, defined as it runs (its type and options, --opt and --pin-mode over them), as
    /// mdevctl defines a running mdev.
    Define {
        /// Device type (omit it to define the running instance --uuid names, as it runs).
        #[arg(short = 't', long = "type")]
        type_name: Option<String>,
        /// The device's UUID (generated if omitted).
        #[arg(long, short = 'u')]
        uuid: Option<String>,
        /// The parent (umdev has one: `umdev`).
        #[arg(short, long)]
        parent: Option<String>,
        /// Start it whenever the daemon starts.
        #[arg(short, long)]
        auto: bool,
        /// The type, start policy and options from an mdevctl device config (`-` for standard
        /// input), as `umdev list -d -u UUID --dumpjson` prints one.
        #[arg(long, conflicts_with_all = ["type_name", "auto", "pin_mode", "opts"])]
        jsonfile: Option<PathBuf>,
        #[command(flatten)]
        create: CreateArgs,
    },
    /// Change a definition: its type, start policy, options or pin mode.
    ///
    /// Checked as `define` checks one, when its type or options change (a change of the start
    /// policy alone is not: a definition whose file has gone can still be made --manual, and
    /// made --auto with a warning that it cannot start). A running instance keeps what it
    /// started with until it is stopped and started.
    Modify {
        /// The device's UUID.
        #[arg(long, short = 'u')]
        uuid: String,
        /// The parent (umdev has one: `umdev`).
        #[arg(short, long)]
        parent: Option<String>,
        /// Its new type.
        #[arg(short = 't', long = "type")]
        type_name: Option<String>,
        /// Start it with the daemon.
        #[arg(short, long, conflicts_with = "manual")]
        auto: bool,
        /// Start it only on `umdev start -u`.
        #[arg(short, long)]
        manual: bool,
        /// Remove an option (repeatable; `pin_mode` removes the pin mode).
        #[arg(long = "delopt", value_name = "KEY")]
        delopts: Vec<String>,
        /// Replace the whole definition with an mdevctl device config (`-` for standard input).
        #[arg(long, conflicts_with_all = ["type_name", "auto", "manual", "pin_mode", "opts", "delopts"])]
        jsonfile: Option<PathBuf>,
        #[command(flatten)]
        create: CreateArgs,
    },
    /// Remove a persistent definition (a running instance keeps running).
    Undefine {
        /// The device's UUID.
        #[arg(long, short = 'u')]
        uuid: String,
        /// The parent (umdev has one: `umdev`).
        #[arg(short, long)]
        parent: Option<String>,
    },
    /// An instance's counters as JSON: its uuid (as `list --json` names it), messages per
    /// command, errors, pins, runs, pages, ...
    Stats {
        /// The instance's UUID.
        #[arg(long, short = 'u')]
        uuid: String,
    },
    /// Serve one device instance in the foreground on a UNIX socket, until SIGINT, SIGTERM or
    /// SIGHUP (for QEMU's `-device '{"driver":"vfio-user-pci","socket":{"type":"unix","path":...}}'`).
    ///
    /// It prints that -device argument, with the socket's absolute path. SIGHUP stays ignored
    /// if it was when it started (`nohup umdev run ... &` outlives its terminal).
    Run {
        /// Device type (see `umdev types`).
        #[arg(short = 't', long = "type")]
        type_name: String,
        /// Socket path to listen on (created mode 0600, removed on exit).
        #[arg(long)]
        socket: std::path::PathBuf,
        #[command(flatten)]
        create: CreateArgs,
        /// Opt-in adaptive busy-polling after each reply, up to this many microseconds (at most
        /// 10000).
        #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=10_000))]
        busy_poll_us: u64,
        #[command(flatten)]
        limits: LimitArgs,
    },
    #[cfg(feature = "bench")]
    /// Benchmark the vfio-user server: round-trip latency against a bare socket, DMA map cost
    /// by size, isolation between 64 instances.
    Protobench {
        /// One JSON object instead of tables.
        #[arg(long)]
        json: bool,
        /// Fewer samples (for a smoke run).
        #[arg(long)]
        quick: bool,
    },
    #[cfg(feature = "bench")]
    /// Benchmark the ccw device end to end: 2 MiB scattered programs against memcpy, 4 KiB
    /// program latency against a REGION_READ round trip; track and lock modes.
    Ccwbench {
        /// One JSON object instead of tables.
        #[arg(long)]
        json: bool,
        /// Fewer samples (for a smoke run).
        #[arg(long)]
        quick: bool,
        /// Only this pin mode; both by default.
        #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(["track", "lock"]), ignore_case = true)]
        mode: Option<String>,
    },
    #[cfg(feature = "bench")]
    /// Benchmark the nvme controller end to end: 4 KiB random I/O at queue depth 1 and 32 on
    /// 1 and 2 queues, 128 KiB sequential I/O, server CPU per I/O, against memcpy and a
    /// posted-doorbell-to-interrupt floor.
    Nvmebench {
        /// One JSON object instead of tables.
        #[arg(long)]
        json: bool,
        /// Shorter runs (for a smoke run).
        #[arg(long)]
        quick: bool,
        /// Only the workloads whose name starts with this (`4k-randread`, `128k`, ...).
        #[arg(long)]
        only: Option<String>,
        /// An nvme option for the server under test, key=value (repeatable, each key once),
        /// e.g. `poll_us=0` or `doorbells=mmap`. One of the benchmark's own (queues=2,
        /// entries=256, ns1=ram:256M, with --file cache1=none) is overridden by it, within
        /// what the workloads need: queues and entries no fewer, ns1 only without --file and
        /// of 256 MiB at least (the workloads use its first 256 MiB).
        #[arg(long = "opt")]
        opts: Vec<String>,
        /// Instead: a cache1=none file namespace in kernel pin mode, fixed_buffers=always
        /// against off, alternating.
        #[arg(long, conflicts_with_all = ["only", "opts"])]
        fixed_buffers: bool,
        /// With --fixed-buffers: where the namespace's file goes (a filesystem that does
        /// O_DIRECT; default: the temporary directory).
        #[arg(long, requires = "fixed_buffers", conflicts_with = "file")]
        dir: Option<PathBuf>,
        /// An existing file or block device of at least 256 MiB as the namespace instead of
        /// RAM, with cache1=none unless an --opt sets cache1 (its first 256 MiB are
        /// OVERWRITTEN).
        #[arg(long)]
        file: Option<PathBuf>,
        /// Write I/O queue doorbells as Linux's driver does when the controller offers Doorbell
        /// Buffer Config: into a shadow page, and as a message only when the controller's event
        /// index asks for one (default: every doorbell a message, as QEMU relays a driver
        /// without them).
        #[arg(long, conflicts_with = "fixed_buffers")]
        shadow_doorbells: bool,
        /// Poll the I/O completion queues, created without interrupts, instead of sleeping
        /// until an interrupt, as SPDK's initiator and Linux's poll queues do: what the server
        /// serves without a wake-up of the client per completion (the client keeps a CPU busy).
        #[arg(long, conflicts_with = "fixed_buffers")]
        poll: bool,
    },
    /// Print a shell completion script (install it where your shell looks, see the README).
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Print the umdev(1) man page, or with --dir write one page per command (umdev.1,
    /// umdev-daemon.1, ...).
    Man {
        /// Write every page into this directory instead (made, mode 0755, if it is missing;
        /// its parent must exist).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    #[cfg(feature = "bench")]
    /// Benchmark run-split pinning against per-page pinning and plain translation (the grid; --threads for many threads, --svg for a picture).
    Pinbench {
        /// One JSON object per line instead of a table.
        #[arg(long)]
        json: bool,
        /// Rounds per row (medians are taken over them).
        #[arg(long, default_value_t = 31, value_parser = at_least::<1>)]
        rounds: u64,
        /// Target microseconds per timed batch.
        #[arg(long, default_value_t = 400, value_parser = at_least::<1>)]
        batch_us: u64,
        /// Instead of the grid: T threads pinning single pages and 64-entry IDAW lists, on one
        /// mapping and on one mapping each, for each T of this list (e.g. `1,2,4,16`); track
        /// mode, 100 ms batches, at most 15 rounds.
        #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u64).range(1..=1024),
              conflicts_with_all = ["svg", "mode", "batch_us"])]
        threads: Option<Vec<u64>>,
        /// Also draw ns per call against pages (kernel, lock and track modes, per run and per
        /// page, the kernel's floor and the seeds' figures; log-log) into this SVG file. It is
        /// checked before the run and replaced only at its end, by a whole picture (a run that
        /// fails or is stopped leaves what was there).
        #[arg(long)]
        svg: Option<std::path::PathBuf>,
        /// Only this pin mode's rows; all three by default.
        #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(["track", "lock", "kernel"]), ignore_case = true)]
        mode: Option<String>,
    },
    /// `demo` and the benchmarks in a build without them: says how to get them.
    #[cfg(not(feature = "bench"))]
    #[command(name = "demo", hide = true, aliases = ["pinbench", "protobench", "ccwbench", "nvmebench"])]
    NoBench {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
        args: Vec<String>,
    },
}

/// What `umdev demo` and the benchmarks say in a build without them.
#[cfg(not(feature = "bench"))]
const NO_BENCH: &str =
    "this umdev was built without `demo` and the benchmarks (pinbench, protobench, ccwbench, \
     nvmebench): a service build (`cargo install --path . --no-default-features`) leaves out the test \
     clients they drive the devices with. From a checkout: `cargo run --release -- demo`; installed: \
     `cargo install --path .` (feature `bench`, on by default)";

/// The commands that use the run directory (they talk to the daemon, or are it): the others
/// refuse `--run-dir` rather than ignore it. `define` asks the daemon only in one form
/// (`define -u UUID` [`DEFINE_ASKS_DAEMON`]); its others refuse it too
/// ([`define_ignores_run_dir`]).
const RUN_DIR_USERS: [&str; 8] = ["daemon", "types", "start", "stop", "list", "define", "modify", "stats"];
/// What makes `define -u UUID` the form that asks the daemon, and so takes `--run-dir`: the
/// running instance it defines is looked up there.
const DEFINE_ASKS_DAEMON: &str = "without -t or --jsonfile";
/// The commands that use the definitions directory: the others refuse `--state-dir`.
const STATE_DIR_USERS: [&str; 6] = ["daemon", "start", "list", "define", "modify", "undefine"];

/// `a, b and c`.
fn and_list(names: &[&str]) -> String {
    match names {
        [] => String::new(),
        [one] => one.to_string(),
        [rest @ .., last] => format!("{} and {last}", rest.join(", ")),
    }
}

/// [`RUN_DIR_USERS`] as the help and the refusals list them, `define` as the form that takes
/// `--run-dir`.
fn run_dir_users() -> String {
    let define = format!("define -u UUID {DEFINE_ASKS_DAEMON}");
    let names: Vec<&str> =
        RUN_DIR_USERS.iter().map(|&name| if name == "define" { define.as_str() } else { name }).collect();
    and_list(&names)
}

/// Whether `command` is a `define` that does not ask the daemon (given a type or a
/// --jsonfile, or no UUID): it writes a definition from what it was given, so a `--run-dir`
/// would be ignored.
fn define_ignores_run_dir(command: &Command) -> bool {
    matches!(command, Command::Define { type_name, jsonfile, uuid, .. }
        if type_name.is_some() || jsonfile.is_some() || uuid.is_none())
}

/// `--run-dir` or `--state-dir` given to a command that does not use it (which would
/// ignore it): what to say, as a usage error.
fn unused_directory(cli: &Cli, command: &str) -> Option<String> {
    const RUN_ENV: &str = "to set the directory for every command, use $UMDEV_RUN_DIR";
    if cli.run_dir.is_some() && define_ignores_run_dir(&cli.command) {
        // No hint of $UMDEV_RUN_DIR: this define needs no run directory at all.
        return Some(format!(
            "this `umdev define` does not use --run-dir: it asks no daemon (only `umdev define -u UUID` \
             {DEFINE_ASKS_DAEMON} does, for the running instance it defines as it runs)"
        ));
    }
    let dirs = [
        (cli.run_dir.is_some(), "--run-dir", &RUN_DIR_USERS[..], run_dir_users(), RUN_ENV.to_string()),
        (
            cli.state_dir.is_some(),
            "--state-dir",
            &STATE_DIR_USERS[..],
            and_list(&STATE_DIR_USERS),
            "to set the directory for every command, use $UMDEV_STATE_DIR".to_string(),
        ),
    ];
    let (_, flag, _, users, env) =
        dirs.into_iter().find(|(given, _, users, _, _)| *given && !users.contains(&command))?;
    Some(format!("`umdev {command}` does not use {flag}: only {users} do ({env})"))
}

/// The CLI, with every type's options in the help of the commands that take them (and so in
/// their man pages).
fn cli_command() -> clap::Command {
    let mut text = String::from("Device types and their options:\n");
    for summary in type_summaries() {
        text.push_str(&format!("\n{}: {}\n", summary.name, summary.description));
        for line in manage::option_lines(&summary) {
            text.push_str(&line);
            text.push('\n');
        }
    }
    let mut cli = Cli::command()
        .after_help(environment_help())
        .mut_arg("run_dir", |a| {
            a.help(format!(
                "Directory of the daemon's control socket and instance sockets, for {} (other commands \
                 refuse it)",
                run_dir_users()
            ))
        })
        .mut_arg("state_dir", |a| {
            a.help(format!(
                "Directory of persistent device definitions, for {} (other commands refuse it)",
                and_list(&STATE_DIR_USERS)
            ))
        });
    for name in TYPE_OPTION_USERS {
        cli = cli.mut_subcommand(name, |c| c.after_long_help(text.clone()));
    }
    // A global option reaches every subcommand's help and page; one that refuses it gets a
    // hidden copy instead (clap propagates a global option only where the subcommand has none
    // of that name), which still parses, for `unused_directory` to refuse it.
    for (id, users) in [("run_dir", &RUN_DIR_USERS[..]), ("state_dir", &STATE_DIR_USERS[..])] {
        let Some(arg) = cli.get_arguments().find(|a| a.get_id() == id).cloned() else { continue };
        let others: Vec<String> = cli
            .get_subcommands()
            .map(|c| c.get_name().to_string())
            .filter(|name| !users.contains(&name.as_str()))
            .collect();
        for name in others {
            let hidden = arg.clone().hide(true);
            cli = cli.mut_subcommand(name, |c| c.arg(hidden));
        }
    }
    // `define` takes --run-dir in one form only: its help and page say which (a copy of its
    // own, as above, so the others keep the global help).
    let run_dir = cli.get_arguments().find(|a| a.get_id() == "run_dir").cloned();
    if let Some(arg) = run_dir {
        let own = arg.help(format!(
            "Directory of the daemon's control socket, asked for the running instance --uuid names \
             to define it as it runs: only for `umdev define -u UUID` {DEFINE_ASKS_DAEMON} (given \
             --type or --jsonfile, or no --uuid, define asks no daemon and refuses --run-dir)"
        ));
        cli = cli.mut_subcommand("define", |c| c.arg(own));
    }
    cli
}

/// The commands whose help (and page) lists every type's options.
const TYPE_OPTION_USERS: [&str; 5] = ["start", "define", "modify", "run", "types"];

/// Every built-in type, with its options.
fn type_summaries() -> Vec<umdev::lifecycle::TypeSummary> {
    let registry = umdev::builtin_registry();
    registry.types().iter().map(|ty| umdev::lifecycle::TypeSummary::of(ty.as_ref(), usize::MAX)).collect()
}

/// The environment variables umdev reads, and what each does.
fn environment() -> Vec<(String, String)> {
    use umdev::control::{DEFAULT_TIMEOUT, MAX_TIMEOUT_MS, MIN_TIMEOUT_MS, TIMEOUT_ENV};
    vec![
        (
            "UMDEV_RUN_DIR, UMDEV_STATE_DIR".into(),
            "the directories, for every command (--run-dir and --state-dir, where a command takes them, \
             come first)"
                .into(),
        ),
        (
            TIMEOUT_ENV.into(),
            format!(
                "how long a command waits for the daemon's answer, {MIN_TIMEOUT_MS} to {MAX_TIMEOUT_MS} ms \
                 ({} by default)",
                DEFAULT_TIMEOUT.as_millis()
            ),
        ),
        (
            "UMDEV_SLICE_US".into(),
            "the scheduler slice of the threads that wait for a client: unset or auto, 100 us while their \
             waits for a CPU average more than 40 us per turn, else the kernel's; off or 0, the kernel's; N, \
             N us always"
                .into(),
        ),
    ]
}

/// The environment variables, as `umdev --help` lists them.
fn environment_help() -> String {
    let mut text = String::from("Environment:");
    for (name, what) in environment() {
        text.push_str(&format!("\n  {name}  {what}"));
    }
    text
}

fn main() {
    // Sockets and state files are the daemon's alone; files a user names are made 0644
    // explicitly (output::write_file).
    // SAFETY: umask only changes this process's file creation mask.
    unsafe { libc::umask(0o077) };
    let matches = cli_command().get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    if let Some(why) = matches.subcommand_name().and_then(|c| unused_directory(&cli, c)) {
        cli_command().error(clap::error::ErrorKind::ArgumentConflict, why).exit();
    }
    // clap's `requires` takes an unset flag's default for present: checked here.
    #[cfg(feature = "bench")]
    if let Command::Nvmebench { fixed_buffers: false, dir: Some(_), .. } = &cli.command {
        let why =
            "`umdev nvmebench --dir` places the file of --fixed-buffers' namespace: give --fixed-buffers \
                   with it (--file names a namespace of your own)";
        cli_command().error(clap::error::ErrorKind::ArgumentConflict, why).exit();
    }
    logging::init(cli.log_format);
    match umdev_server::client_fd::raise_fd_limit() {
        Ok(limit) => log::debug!("open files at most: {limit}"),
        Err(e) => log::debug!("open files: the limit stays ({e})"),
    }
    let dirs = match cli.command {
        Command::Daemon { .. } => manage::Dirs::for_daemon(cli.run_dir, cli.state_dir),
        _ => manage::Dirs::resolve(cli.run_dir, cli.state_dir),
    };
    let result = dispatch(cli.command, &dirs);
    #[cfg(feature = "bench")]
    cleanup::wait_if_stopping();
    match result {
        // The reader of a pipe went away: what it read was all it wanted.
        Err(_) if output::closed() => std::process::exit(0),
        Err(e) => {
            log::error!(target: logging::STATUS, "{e}");
            std::process::exit(1);
        }
        Ok(()) => {}
    }
}

fn dispatch(command: Command, dirs: &manage::Dirs) -> output::Out {
    #[cfg(feature = "bench")]
    if matches!(
        command,
        Command::Demo
            | Command::Ccwbench { .. }
            | Command::Nvmebench { .. }
            | Command::Protobench { .. }
            | Command::Pinbench { .. }
    ) {
        cleanup::install()?;
    }
    match command {
        #[cfg(feature = "bench")]
        Command::Demo => demo::run(),
        #[cfg(not(feature = "bench"))]
        Command::NoBench { .. } => Err(NO_BENCH.into()),
        #[cfg(feature = "bench")]
        Command::Ccwbench { json, quick, mode } => {
            let only = mode.as_deref().map(str::parse::<umdev_pinning::PinMode>).transpose()?;
            let r = ccwbench::run(quick, only)?;
            if json {
                out!("{}", serde_json::to_string(&r).map_err(|e| e.to_string())?)
            } else {
                ccwbench::print(&r)
            }
        }
        #[cfg(feature = "bench")]
        Command::Nvmebench { json, quick, fixed_buffers: true, dir, file, .. } => {
            let place = match (dir, file) {
                (_, Some(file)) => nvmebench::Backing::Existing(file),
                (Some(dir), None) => nvmebench::Backing::In(dir),
                (None, None) => nvmebench::Backing::Temporary,
            };
            let r = nvmebench::run_fixed(quick, place)?;
            if json {
                out!("{}", serde_json::to_string(&r).map_err(|e| e.to_string())?)
            } else {
                nvmebench::print_fixed(&r)
            }
        }
        #[cfg(feature = "bench")]
        Command::Nvmebench { json, quick, only, opts, file, shadow_doorbells, poll, .. } => {
            let r = nvmebench::run(quick, only.as_deref(), &opts, file.as_deref(), shadow_doorbells, poll)?;
            if json {
                out!("{}", serde_json::to_string(&r).map_err(|e| e.to_string())?)
            } else {
                nvmebench::print(&r)
            }
        }
        #[cfg(feature = "bench")]
        Command::Protobench { json, quick } => {
            let r = protobench::run(quick)?;
            if json {
                out!("{}", serde_json::to_string(&r).map_err(|e| e.to_string())?)
            } else {
                protobench::print(&r)
            }
        }
        Command::Types { type_name, verbose, json, dumpjson, parent } => {
            manage::check_parent(parent.as_deref())?;
            manage::types(dirs, &manage::TypesView { json, dumpjson, verbose, only: type_name })
        }
        Command::Daemon { busy_poll_us, max_instances, limits } => {
            let mut template = umdev_server::InstanceConfig::new("", "");
            template.busy_poll = std::time::Duration::from_micros(busy_poll_us);
            limits.apply(&mut template)?;
            manage::daemon(dirs, template, usize::try_from(max_instances).unwrap_or(usize::MAX))
        }
        Command::Start { type_name, uuid, parent, jsonfile, override_definition, create } => {
            manage::check_parent(parent.as_deref())?;
            let options = create.options()?;
            manage::start(
                dirs,
                manage::StartArgs { mdev_type: type_name, uuid, options, jsonfile, override_definition },
            )
        }
        Command::Stop { uuid, force } => manage::stop(dirs, &uuid, force),
        Command::List { defined, verbose, json, dumpjson, uuid, type_name, parent } => {
            manage::check_parent(parent.as_deref())?;
            manage::list(
                dirs,
                &manage::ListView { defined, verbose, json, dumpjson, uuid, mdev_type: type_name },
            )
        }
        Command::Define { type_name, uuid, parent, auto, jsonfile, create } => {
            manage::check_parent(parent.as_deref())?;
            let options = create.options()?;
            manage::define(dirs, manage::DefineArgs { mdev_type: type_name, uuid, auto, options, jsonfile })
        }
        Command::Modify { uuid, parent, type_name, auto, manual, delopts, jsonfile, create } => {
            use umdev::lifecycle::StartPolicy;
            manage::check_parent(parent.as_deref())?;
            let start = match (auto, manual) {
                (true, _) => Some(StartPolicy::Auto),
                (_, true) => Some(StartPolicy::Manual),
                _ => None,
            };
            if type_name.is_none()
                && start.is_none()
                && !create.given()
                && delopts.is_empty()
                && jsonfile.is_none()
            {
                return Err(
                    "nothing to modify: give -t, --auto, --manual, --opt, --delopt, --pin-mode or --jsonfile"
                        .into(),
                );
            }
            let set = create.options()?;
            manage::modify(
                dirs,
                manage::ModifyArgs { uuid, mdev_type: type_name, start, set, remove: delopts, jsonfile },
            )
        }
        Command::Undefine { uuid, parent } => {
            manage::check_parent(parent.as_deref())?;
            manage::undefine(dirs, &uuid)
        }
        Command::Stats { uuid } => manage::stats(dirs, &uuid),
        Command::Run { type_name, socket, create, busy_poll_us, limits } => {
            let options = create.options()?;
            if options.pin_mode() == umdev_pinning::PinMode::Kernel {
                // Refused before anything is served, with the message a daemon's start gives.
                umdev_pinning::kernel_pins_available()
                    .map_err(|e| umdev::lifecycle::LifecycleError::KernelPins(e).to_string())?;
            }
            let mut config = umdev_server::InstanceConfig::new(type_name.clone(), &socket);
            config.busy_poll = std::time::Duration::from_micros(busy_poll_us);
            config.dma.mode = options.pin_mode();
            limits.apply(&mut config)?;
            run::run(&umdev::builtin_registry(), &type_name, &options, config)
        }
        #[cfg(feature = "bench")]
        Command::Pinbench { json, rounds, batch_us, threads, svg, mode } => {
            let threads = threads.map(|t| t.into_iter().map(|n| n as usize).collect());
            let only = mode.as_deref().map(str::parse::<umdev_pinning::PinMode>).transpose()?;
            pinbench::command(&pinbench::Options {
                json,
                rounds: rounds as usize,
                batch_us,
                threads,
                svg,
                only,
            })
        }
        Command::Completions { shell } => completions(shell),
        Command::Man { dir } => man(dir.as_deref()),
    }
}

/// `umdev completions SHELL`: from the same CLI definition as the parser, with the type
/// names offered for each type argument.
fn completions(shell: clap_complete::Shell) -> output::Out {
    // Only for completion: the parser takes any name and refuses an unknown one itself,
    // with its own message.
    let names: Vec<String> = type_summaries().into_iter().map(|t| t.name).collect();
    let mut cli = cli_command();
    let takers: Vec<String> = cli
        .get_subcommands()
        .filter(|c| c.get_arguments().any(|a| a.get_id() == "type_name"))
        .map(|c| c.get_name().to_string())
        .collect();
    for name in takers {
        let names = names.clone();
        cli = cli.mut_subcommand(name, |c| {
            c.mut_arg("type_name", |a| a.value_parser(clap::builder::PossibleValuesParser::new(names)))
        });
    }
    // Into a buffer first: clap_complete panics on a failed write (a closed pipe, say).
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut cli, "umdev", &mut script);
    output::bytes(&script)
}

/// `umdev man [--dir DIR]`: umdev(1) to stdout, or a page per command into DIR (0644, and
/// DIR 0755 if it is made; its parent must exist).
fn man(dir: Option<&Path>) -> output::Out {
    // No page for clap's `help` subcommand, and so no mention of one (as clap_mangen's own
    // generate_to); `umdev help` still works.
    let mut cli = cli_command().disable_help_subcommand(true);
    // Built, the subcommands know their full names (umdev-daemon) and the global options.
    cli.build();
    let Some(dir) = dir else {
        return output::bytes(&man_page(cli)?);
    };
    output::create_dir(dir)?;
    let subcommands: Vec<clap::Command> =
        cli.get_subcommands().filter(|c| !c.is_hide_set()).cloned().collect();
    for command in std::iter::once(cli).chain(subcommands) {
        let path =
            dir.join(format!("{}.1", command.get_display_name().unwrap_or_else(|| command.get_name())));
        output::write_file(&path, &man_page(command)?)?;
        out!("{}", path.display())?;
    }
    Ok(())
}

/// A command's page: clap_mangen's sections, with what `--help` shows after the options
/// under a heading of its own (clap_mangen's is EXTRA, its text roff reflows): ENVIRONMENT
/// on umdev(1), DEVICE TYPES on the pages of the commands that take options.
fn man_page(command: clap::Command) -> Result<Vec<u8>, String> {
    use roff::{bold, roman, Roff};
    let name = command.get_display_name().unwrap_or_else(|| command.get_name()).to_string();
    let mut extra = Roff::new();
    if command.get_after_help().is_some() || command.get_after_long_help().is_some() {
        if name == "umdev" {
            extra.control("SH", ["ENVIRONMENT"]);
            for (variable, what) in environment() {
                extra.control("TP", []).text([bold(variable)]).text([roman(what)]);
            }
        } else {
            extra.control("SH", ["DEVICE TYPES"]);
            extra.text([roman(
                "Each type's options, given as --opt KEY=VALUE (each key once), and --pin-mode \
                 track|lock|kernel:",
            )]);
            for t in type_summaries() {
                extra.control("SS", [t.name.as_str()]).text([roman(t.description.clone())]);
                if t.options.is_empty() {
                    extra.control("PP", []).text([roman("No options.")]);
                }
                for o in &t.options {
                    let default = o.default.as_deref().map(|d| format!(" (default {d})")).unwrap_or_default();
                    extra
                        .control("TP", [])
                        .text([bold(format!("{}={}", o.key, o.syntax)), roman(default)])
                        .text([roman(o.help.clone())]);
                }
            }
        }
    }
    let command = command.after_help(None::<&str>).after_long_help(None::<&str>);
    // Subcommands have no version of their own: every page names umdev's.
    let page = clap_mangen::Man::new(command).source(concat!("umdev ", env!("CARGO_PKG_VERSION")));
    let mut text = Vec::new();
    page.render(&mut text).map_err(|e| format!("rendering {name}(1): {e}"))?;
    let mut text = String::from_utf8(text).map_err(|e| format!("rendering {name}(1): {e}"))?;
    // Before the VERSION section, where the help's own text stood.
    let at = text.find("\n.SH VERSION\n").map_or(text.len(), |i| i + 1);
    text.insert_str(at, &extra.render());
    Ok(text.into_bytes())
}

/// The documents' commands, as tests/docs.rs reads them.
#[cfg(test)]
#[path = "../tests/common/docs.rs"]
mod docs;

#[cfg(test)]
mod tests {
    use std::path::Path;

    use clap::error::ErrorKind;

    use super::{cli_command, docs};

    /// Every `umdev` command README.md and docs/*.md show, in code blocks and in prose, is one
    /// the CLI takes (tests/docs.rs runs the code blocks' for real). A span in prose may leave
    /// out a required argument (`umdev run --type ccw`), nothing more.
    #[test]
    fn every_umdev_command_the_documents_show_parses() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut failures = Vec::new();
        let mut parsed = 0;
        for line in docs::lines(root) {
            for simple in docs::simple_commands(&line.text) {
                let Some(args) = simple.umdev_args("5a1e4c36-0f8e-4a5e-9d2f-000000000d0c") else { continue };
                parsed += 1;
                match cli_command().try_get_matches_from(std::iter::once("umdev".to_string()).chain(args)) {
                    Ok(_) => {}
                    Err(e) if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) => {}
                    Err(e) if line.inline && e.kind() == ErrorKind::MissingRequiredArgument => {}
                    Err(e) => failures.push(format!(
                        "{}:{}: `{}`: {}",
                        line.file,
                        line.line,
                        line.text,
                        e.to_string().lines().next().unwrap_or_default()
                    )),
                }
            }
        }
        assert!(parsed > 50, "only {parsed} commands found");
        assert!(failures.is_empty(), "commands the CLI refuses:\n{}", failures.join("\n"));
    }

    /// The directory options' lists name commands the CLI has.
    #[test]
    fn the_commands_that_take_a_directory_exist() {
        let cli = cli_command();
        for name in super::RUN_DIR_USERS.iter().chain(&super::STATE_DIR_USERS) {
            assert!(cli.find_subcommand(name).is_some(), "{name}");
        }
        assert_eq!(super::and_list(&["a", "b", "c"]), "a, b and c");
    }

    #[test]
    fn the_extractor_sees_what_a_shell_sees() {
        let cut = docs::simple_commands("umdev man --dir /x && mandb -q | cat > 'a b' &");
        assert_eq!(cut.len(), 3);
        assert_eq!(cut[0].words, ["umdev", "man", "--dir", "/x"]);
        assert_eq!((cut[2].stdout_to.as_deref(), cut[2].background), (Some("a b"), true));
        let quoted = docs::simple_commands(r#"qemu -device '{"a": "b c"}' ..."#);
        assert_eq!(quoted[0].words[2], r#"{"a": "b c"}"#);
        // Assignments before the program are the environment's, as a shell takes them.
        let env = &docs::simple_commands("UMDEV_SLICE_US=100 umdev nvmebench --only=4k")[0];
        assert_eq!(
            (env.program(), env.umdev_args("u")),
            (Some("umdev"), Some(vec!["nvmebench".into(), "--only=4k".into()]))
        );
        // A wrong command is caught: the one docs/nvme.md showed.
        let wrong = docs::simple_commands("umdev stats UUID")[0].umdev_args("u").unwrap();
        assert!(cli_command()
            .try_get_matches_from(std::iter::once("umdev".to_string()).chain(wrong))
            .is_err());
    }
}
