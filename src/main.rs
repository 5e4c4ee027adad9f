//! `umdev`: the vfio-user mediated-device server and its tools.

mod demo;
mod pinbench;
mod protobench;
mod run;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "umdev",
    version,
    about = "vfio-user server for mediated devices, with an external page-pinning engine"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The main job: show run-split pinning end to end and verify every byte.
    Demo,
    /// List the device types.
    Types {
        /// JSON instead of text.
        #[arg(long)]
        json: bool,
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
        /// How the instance pins guest pages: track or lock.
        #[arg(long, default_value = "track")]
        pin_mode: String,
        /// Type-specific option, key=value (repeatable).
        #[arg(long = "opt")]
        opts: Vec<String>,
        /// Opt-in adaptive busy-polling after each reply, up to this many microseconds.
        #[arg(long, default_value_t = 0)]
        busy_poll_us: u64,
    },
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
    /// Benchmark run-split pinning against per-page pinning.
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
    },
}

fn main() {
    // Sockets and state files are the daemon's alone.
    // SAFETY: umask only changes this process's file creation mask.
    unsafe { libc::umask(0o077) };
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Demo => demo::run(),
        Command::Protobench { json, quick } => protobench::run(quick).map(|r| {
            if json {
                println!("{}", serde_json::to_string(&r).expect("report serializes"));
            } else {
                protobench::print(&r);
            }
        }),
        Command::Types { json } => run::types(&umdev_mdev::types::Registry::builtin(), json),
        Command::Run { type_name, socket, pin_mode, opts, busy_poll_us } => (|| {
            let mode = match pin_mode.as_str() {
                "track" => umdev_mdev::types::PinModeName::Track,
                "lock" => umdev_mdev::types::PinModeName::Lock,
                other => return Err(format!("unknown pin mode {other:?} (track or lock)")),
            };
            let options = umdev_mdev::types::InstanceOptions {
                pin_mode: Some(mode),
                params: run::parse_params(&opts)?,
            };
            let args = run::RunArgs {
                type_name,
                socket,
                options,
                busy_poll: std::time::Duration::from_micros(busy_poll_us),
            };
            run::run(&umdev_mdev::types::Registry::builtin(), args)
        })(),
        Command::Pinbench { json, rounds, batch_us } => pinbench_cmd(json, rounds, batch_us),
    };
    if let Err(e) = result {
        eprintln!("umdev: {e}");
        std::process::exit(1);
    }
}

fn pinbench_cmd(json: bool, rounds: usize, batch_us: u64) -> Result<(), String> {
    let effort =
        pinbench::Effort { rounds: rounds.max(1), batch: std::time::Duration::from_micros(batch_us.max(1)) };
    let rows = pinbench::run(effort, |row| {
        if json {
            println!("{}", serde_json::to_string(row).expect("rows serialize"));
        }
    })?;
    let memory = pinbench::memory_report()?;
    if json {
        println!("{}", serde_json::to_string(&memory).expect("report serializes"));
    } else {
        pinbench::print_table(&rows);
        println!();
        println!(
            "bookkeeping: {} bytes of heap for 1 GiB pinned ({:.4}% of pinned memory); {} bytes per mapping",
            memory.heap_per_gib_pinned, memory.percent_of_pinned, memory.heap_per_mapping
        );
        println!(
            "map+unmap (engine, no socket): 1 GiB sparse memfd {:.1} us, 64 GiB sparse memfd {:.1} us (medians)",
            memory.map_unmap_1g_ns / 1000.0,
            memory.map_unmap_64g_ns / 1000.0
        );
    }
    Ok(())
}
