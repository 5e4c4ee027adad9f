//! `umdev`: the vfio-user mediated-device server and its tools.

mod demo;
mod pinbench;

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
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Demo => demo::run(),
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
