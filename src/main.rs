//! `umdev`: the vfio-user mediated-device server and its tools.

#[cfg(feature = "bench")]
mod affinity;
#[cfg(feature = "bench")]
mod ccwbench;
#[cfg(feature = "bench")]
mod demo;
mod logging;
mod manage;
#[cfg(feature = "bench")]
mod nvmebench;
#[cfg(feature = "bench")]
mod pinbench;
#[cfg(feature = "bench")]
mod protobench;
mod run;

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::{CommandFactory, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "umdev",
    version,
    about = "vfio-user server for mediated devices, with an external page-pinning engine"
)]
struct Cli {
    /// Directory of the daemon's control socket and instance sockets.
    #[arg(long, global = true)]
    run_dir: Option<std::path::PathBuf>,
    /// Directory of persistent device definitions.
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
    #[arg(long)]
    max_dma_maps: Option<u32>,
    /// DMA mappings all clients of this process may hold together: each is a VMA, a per-process kernel
    /// resource (half of vm.max_map_count: 32765 by default).
    #[arg(long)]
    max_process_mappings: Option<u64>,
    /// Pins a device may hold at once, repeats counted (16777216).
    #[arg(long)]
    max_pins: Option<u64>,
    /// Bytes one region access or message carries at most (1048576; also bounds the message size).
    #[arg(long)]
    max_data_xfer: Option<u32>,
    /// fds one message may carry, e.g. SET_IRQS eventfds (16; QEMU accepts at most 16).
    #[arg(long)]
    max_msg_fds: Option<u32>,
}

impl LimitArgs {
    fn apply(&self, config: &mut umdev_server::InstanceConfig) -> Result<(), String> {
        let l = &mut config.limits;
        if let Some(n) = self.max_dma_maps {
            l.max_dma_maps = n.max(1);
            config.dma.max_mappings = n.max(1) as usize;
        }
        if let Some(n) = self.max_process_mappings {
            umdev_pinning::set_process_mapping_limit(n);
        }
        if let Some(n) = self.max_pins {
            config.dma.max_pins = n.max(1);
        }
        if let Some(n) = self.max_data_xfer {
            if !(4096..=64 << 20).contains(&n) {
                return Err("--max-data-xfer must be 4096 to 64 MiB (QEMU accepts at most 64 MiB)".into());
            }
            l.max_data_xfer_size = n;
        }
        if let Some(n) = self.max_msg_fds {
            if !(1..=253).contains(&n) {
                return Err("--max-msg-fds must be 1 to 253".into());
            }
            l.max_msg_fds = n;
        }
        Ok(())
    }
}

/// Options of every instance-creating command.
#[derive(clap::Args)]
struct CreateArgs {
    /// How the instance pins guest pages: track or lock.
    #[arg(long)]
    pin_mode: Option<String>,
    /// Type-specific option, key=value (repeatable).
    #[arg(long = "opt")]
    opts: Vec<String>,
}

impl CreateArgs {
    fn options(&self) -> Result<umdev_mdev::types::InstanceOptions, String> {
        use umdev_mdev::types::PinModeName;
        let pin_mode = match self.pin_mode.as_deref() {
            None => None,
            Some("track") => Some(PinModeName::Track),
            Some("lock") => Some(PinModeName::Lock),
            Some(other) => return Err(format!("unknown pin mode {other:?} (track or lock)")),
        };
        Ok(umdev_mdev::types::InstanceOptions { pin_mode, params: run::parse_params(&self.opts)? })
    }
}

#[derive(Subcommand)]
enum Command {
    /// The main job: show run-split pinning end to end and verify every byte.
    #[cfg(feature = "bench")]
    Demo,
    /// List the device types and their available instances.
    Types {
        /// JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Run the daemon: a control socket and every started instance, until SIGINT/SIGTERM.
    ///
    /// SIGHUP re-reads the definitions: new --auto ones start, running instances are left
    /// alone (one whose definition was removed or changed is logged). Under systemd
    /// (contrib/systemd/umdev.service, Type=notify) it reports READY=1 once the control socket
    /// listens and the --auto definitions have started, and uses $RUNTIME_DIRECTORY and
    /// $CONFIGURATION_DIRECTORY as its run and definitions directories.
    Daemon {
        /// Opt-in adaptive busy-polling after each reply, up to this many microseconds.
        #[arg(long, default_value_t = 0)]
        busy_poll_us: u64,
        /// Instances (and so vfio-user connections, one each) the daemon serves at most.
        #[arg(long, default_value_t = 256)]
        max_instances: usize,
        #[command(flatten)]
        limits: LimitArgs,
    },
    /// Start an instance of a type, or a defined device by UUID.
    Start {
        /// Device type (omit to start the definition of --uuid).
        #[arg(long = "type")]
        type_name: Option<String>,
        /// The instance's UUID (generated if omitted).
        #[arg(long, short = 'u')]
        uuid: Option<String>,
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
    /// List running instances, or with --defined the persistent definitions.
    ///
    /// With --defined each definition's state says whether the daemon agrees with it: running,
    /// stopped (manual), or out of sync: not-started (--auto but not running), changed (its
    /// definition changed since it started), undefined (running, no longer defined).
    List {
        /// The definitions instead of running instances.
        #[arg(long)]
        defined: bool,
        /// JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Define a persistent device (it is not started; --auto starts it with the daemon).
    Define {
        /// Device type.
        #[arg(long = "type")]
        type_name: String,
        /// The device's UUID (generated if omitted).
        #[arg(long, short = 'u')]
        uuid: Option<String>,
        /// Start it whenever the daemon starts.
        #[arg(long)]
        auto: bool,
        #[command(flatten)]
        create: CreateArgs,
    },
    /// Remove a persistent definition (a running instance keeps running).
    Undefine {
        /// The device's UUID.
        #[arg(long, short = 'u')]
        uuid: String,
    },
    /// An instance's counters as JSON: messages per command, errors, pins, runs, pages, ...
    Stats {
        /// The instance's UUID.
        #[arg(long, short = 'u')]
        uuid: String,
    },
    /// Serve one device instance in the foreground on a UNIX socket (for QEMU's
    /// `-device vfio-user-pci,socket=...`).
    Run {
        /// Device type (see `umdev types`).
        #[arg(long = "type")]
        type_name: String,
        /// Socket path to listen on (created mode 0600, removed on exit).
        #[arg(long)]
        socket: std::path::PathBuf,
        #[command(flatten)]
        create: CreateArgs,
        /// Opt-in adaptive busy-polling after each reply, up to this many microseconds.
        #[arg(long, default_value_t = 0)]
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
        /// Only this pin mode (track or lock); both by default.
        #[arg(long)]
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
        /// An nvme option for the server under test, key=value (repeatable), e.g.
        /// `poll_us=0` or `doorbells=mmap`.
        #[arg(long = "opt")]
        opts: Vec<String>,
    },
    /// Print a shell completion script (install it where your shell looks, see the README).
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Print the umdev(1) man page, or with --dir write one page per command (umdev.1,
    /// umdev-daemon.1, ...).
    Man {
        /// Write every page into this directory instead.
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
        #[arg(long, default_value_t = 31)]
        rounds: usize,
        /// Target microseconds per timed batch.
        #[arg(long, default_value_t = 400)]
        batch_us: u64,
        /// Instead of the grid: T threads pinning single pages and 64-entry IDAW lists, on one
        /// mapping and on one mapping each, for each T of this list (e.g. `1,2,4,16`).
        #[arg(long, value_delimiter = ',')]
        threads: Option<Vec<usize>>,
        /// Also draw ns per call against pages (runs, per-page, translate; log-log) into this
        /// SVG file.
        #[arg(long)]
        svg: Option<std::path::PathBuf>,
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

fn main() {
    // Sockets and state files are the daemon's alone.
    // SAFETY: umask only changes this process's file creation mask.
    unsafe { libc::umask(0o077) };
    let cli = Cli::parse();
    logging::init(cli.log_format);
    let dirs = match cli.command {
        Command::Daemon { .. } => manage::Dirs::for_daemon(cli.run_dir, cli.state_dir),
        _ => manage::Dirs::resolve(cli.run_dir, cli.state_dir),
    };
    let result = match cli.command {
        #[cfg(feature = "bench")]
        Command::Demo => demo::run(),
        #[cfg(not(feature = "bench"))]
        Command::NoBench { .. } => Err(NO_BENCH.into()),
        #[cfg(feature = "bench")]
        Command::Ccwbench { json, quick, mode } => mode
            .as_deref()
            .map(str::parse::<umdev_pinning::PinMode>)
            .transpose()
            .and_then(|only| ccwbench::run(quick, only))
            .map(|r| {
                if json {
                    println!("{}", serde_json::to_string(&r).expect("report serializes"));
                } else {
                    ccwbench::print(&r);
                }
            }),
        #[cfg(feature = "bench")]
        Command::Nvmebench { json, quick, only, opts } => {
            nvmebench::run(quick, only.as_deref(), &opts).map(|r| {
                if json {
                    println!("{}", serde_json::to_string(&r).expect("report serializes"));
                } else {
                    nvmebench::print(&r);
                }
            })
        }
        #[cfg(feature = "bench")]
        Command::Protobench { json, quick } => protobench::run(quick).map(|r| {
            if json {
                println!("{}", serde_json::to_string(&r).expect("report serializes"));
            } else {
                protobench::print(&r);
            }
        }),
        Command::Types { json } => manage::types(&dirs, json),
        Command::Daemon { busy_poll_us, max_instances, limits } => {
            let mut template = umdev_server::InstanceConfig::new("", "");
            template.busy_poll = std::time::Duration::from_micros(busy_poll_us);
            limits.apply(&mut template).and_then(|()| manage::daemon(&dirs, template, max_instances))
        }
        Command::Start { type_name, uuid, create } => {
            create.options().and_then(|o| manage::start(&dirs, type_name, uuid.as_deref(), o))
        }
        Command::Stop { uuid, force } => manage::stop(&dirs, &uuid, force),
        Command::List { defined, json } => manage::list(&dirs, defined, json),
        Command::Define { type_name, uuid, auto, create } => {
            create.options().and_then(|o| manage::define(&dirs, &type_name, uuid.as_deref(), auto, o))
        }
        Command::Undefine { uuid } => manage::undefine(&dirs, &uuid),
        Command::Stats { uuid } => manage::stats(&dirs, &uuid),
        Command::Run { type_name, socket, create, busy_poll_us, limits } => {
            create.options().and_then(|options| {
                let mut config = umdev_server::InstanceConfig::new(type_name.clone(), &socket);
                config.busy_poll = std::time::Duration::from_micros(busy_poll_us);
                config.dma.mode = options.pin_mode();
                limits.apply(&mut config)?;
                run::run(&umdev::builtin_registry(), &type_name, &options, config)
            })
        }
        #[cfg(feature = "bench")]
        Command::Pinbench { json, rounds, batch_us, threads, svg } => {
            pinbench::command(&pinbench::Options { json, rounds, batch_us, threads, svg })
        }
        Command::Completions { shell } => completions(shell),
        Command::Man { dir } => man(dir.as_deref()),
    };
    if let Err(e) = result {
        log::error!(target: logging::STATUS, "{e}");
        std::process::exit(1);
    }
}

/// `umdev completions SHELL`: from the same CLI definition as the parser.
fn completions(shell: clap_complete::Shell) -> Result<(), String> {
    // Into a buffer first: clap_complete panics on a failed write (a closed pipe, say).
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), "umdev", &mut script);
    std::io::stdout().write_all(&script).map_err(|e| format!("writing the completion script: {e}"))
}

/// `umdev man [--dir DIR]`: umdev(1) to stdout, or a page per command into DIR.
fn man(dir: Option<&Path>) -> Result<(), String> {
    let mut cli = Cli::command();
    // Built, the subcommands know their full names (umdev-daemon) and the global options.
    cli.build();
    let Some(dir) = dir else {
        let mut page = Vec::new();
        clap_mangen::Man::new(cli).render(&mut page).map_err(|e| format!("rendering umdev(1): {e}"))?;
        return std::io::stdout().write_all(&page).map_err(|e| format!("writing umdev(1): {e}"));
    };
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let subcommands: Vec<clap::Command> =
        cli.get_subcommands().filter(|c| c.get_name() != "help" && !c.is_hide_set()).cloned().collect();
    for command in std::iter::once(cli).chain(subcommands) {
        // Subcommands have no version of their own: every page names umdev's.
        let page = clap_mangen::Man::new(command).source(concat!("umdev ", env!("CARGO_PKG_VERSION")));
        let path = dir.join(page.get_filename());
        let mut text = Vec::new();
        page.render(&mut text).map_err(|e| format!("rendering {}: {e}", path.display()))?;
        std::fs::write(&path, text).map_err(|e| format!("writing {}: {e}", path.display()))?;
        println!("{}", path.display());
    }
    Ok(())
}
