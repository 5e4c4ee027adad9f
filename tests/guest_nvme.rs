//! nvme in a real Linux guest: Debian 6.1's stock `nvme` driver binds umdev's controller
//! under QEMU 11 (TCG) and uses it as people use a disk: random data at scattered offsets
//! with O_DIRECT and through the page cache, read back after dropping caches; mke2fs, an
//! ext4 mount, files of odd sizes, a remount with the same hashes; a file-backed namespace
//! that keeps its data into a second boot with a new daemon; INTx instead of MSI-X with
//! 4 KiB blocks; 32 concurrent O_DIRECT writers and readers on both I/O queues, verified. The
//! daemon's statistics show what run splitting made of the guest's I/O.
//! Skips only when the guest kernel, busybox or QEMU cannot be fetched, and says so.

mod common;

use std::io::Read;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use common::guest::{self, GuestSpec};
use common::process::{self, ChildGuard};
use umdev_testkit::loop_device::LoopDevice;

/// `umdev run --type nvme` on `socket` with `opts`, stderr kept for the statistics it
/// prints on exit.
fn serve(socket: &Path, opts: &[&str]) -> ChildGuard {
    let mut args = vec!["--type", "nvme"];
    for o in opts {
        args.extend(["--opt", o]);
    }
    process::run_with_stderr(socket, &args, Stdio::piped())
}

/// Stops the daemon with SIGTERM; the device state it printed on exit.
fn stop(mut daemon: ChildGuard) -> serde_json::Value {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(daemon.id() as i32), nix::sys::signal::SIGTERM)
        .unwrap();
    let mut err = String::new();
    daemon.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(daemon.wait().unwrap().success(), "umdev run failed: {err}");
    let line = err.lines().find_map(|l| l.split_once("nvme on exit: ")).map(|(_, j)| j.to_string());
    let line = line.unwrap_or_else(|| panic!("no statistics on exit: {err}"));
    serde_json::from_str(&line).unwrap()
}

/// A file of `bytes` in `dir` as namespace 1: the `--opt` that names it.
fn file_namespace(dir: &Path, bytes: u64) -> String {
    let disk = dir.join("disk.img");
    std::fs::File::create(&disk).unwrap().set_len(bytes).unwrap();
    format!("ns1=file:{}", disk.display())
}

fn line<'a>(console: &'a [String], prefix: &str) -> &'a str {
    console.iter().find(|l| l.starts_with(prefix)).map(String::as_str).unwrap_or("")
}

/// The PCI function at 00:04.0, its driver, the disk and its size.
const IDENTIFY: &str = r#"
dev=/sys/bus/pci/devices/0000:00:04.0
echo "PCI-ID $(cat $dev/vendor) $(cat $dev/device) class $(cat $dev/class)"
echo "DRIVER $(basename $(readlink $dev/driver))"
echo "DISK $(cat /sys/block/nvme0n1/size) $(cat /sys/block/nvme0n1/queue/logical_block_size)"
echo "QUEUES $(ls /sys/block/nvme0n1/mq | wc -l)"
echo "IRQ $(grep -c nvme /proc/interrupts)"
"#;

/// Random data at scattered offsets, O_DIRECT and buffered, read back after dropping the
/// page cache.
const SCATTERED_IO: &str = r#"
head -c 1048576 /dev/urandom > /tmp/r
i=0
for off in 3 1000 77 4099 20000 513; do
  i=$((i + 1))
  if [ $((i % 2)) = 0 ]; then flag=oflag=direct; else flag=conv=fsync; fi
  dd if=/tmp/r of=/dev/nvme0n1 bs=4096 skip=$((i * 16)) seek=$off count=$((i * 5)) conv=notrunc $flag 2>/dev/null
done
sync
echo 3 > /proc/sys/vm/drop_caches
i=0
for off in 3 1000 77 4099 20000 513; do
  i=$((i + 1))
  dd if=/tmp/r of=/tmp/want bs=4096 skip=$((i * 16)) count=$((i * 5)) 2>/dev/null
  if [ $((i % 2)) = 0 ]; then flag=iflag=direct; else flag=; fi
  dd if=/dev/nvme0n1 of=/tmp/got bs=4096 skip=$off count=$((i * 5)) $flag 2>/dev/null
  cmp -s /tmp/want /tmp/got && echo "IO-OK $off" || echo "IO-BAD $off"
done
"#;

#[test]
fn the_guests_nvme_driver_formats_mounts_and_keeps_a_file_namespace_across_boots() {
    if !guest::available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nvme.sock");
    let ns = file_namespace(dir.path(), 256 << 20);
    let modules = vec!["nvme", "ext4"];
    let qemu_args = vec!["-smp", "2"];

    // First boot: raw I/O, then a filesystem.
    let daemon = serve(&socket, &[&ns, "queues=2"]);
    let script = format!(
        r#"set -e
{IDENTIFY}
{SCATTERED_IO}
mke2fs -q -F /dev/nvme0n1
mkdir -p /mnt/d
mount -t ext4 /dev/nvme0n1 /mnt/d
for n in 1 511 4095 4097 65537 1234567 5000001; do head -c $n /dev/urandom > /mnt/d/f$n; done
cd /mnt/d && sha256sum f* > /tmp/sums && cp /tmp/sums /mnt/d/SUMS && cd /
umount /mnt/d
echo 3 > /proc/sys/vm/drop_caches
mount -t ext4 /dev/nvme0n1 /mnt/d
cd /mnt/d && sha256sum -c /tmp/sums | sed 's/^/SUM /' && cd /
umount /mnt/d
"#
    );
    let console = guest::run_ok(&GuestSpec {
        sockets: vec![&socket],
        modules: modules.clone(),
        script: &script,
        qemu_args: qemu_args.clone(),
        timeout: Duration::from_secs(300),
        ..Default::default()
    });
    let stats = stop(daemon);
    assert_eq!(line(&console, "PCI-ID"), "PCI-ID 0x1234 0x75e0 class 0x010802", "{console:?}");
    assert_eq!(line(&console, "DRIVER"), "DRIVER nvme", "the stock driver bound it");
    assert_eq!(line(&console, "DISK"), format!("DISK {} 512", (256 << 20) / 512), "the namespace's size");
    assert_eq!(line(&console, "QUEUES"), "QUEUES 2", "one I/O queue per guest CPU");
    for off in [3, 1000, 77, 4099, 20000, 513] {
        assert!(console.contains(&format!("IO-OK {off}")), "data at block {off} read back: {console:?}");
    }
    for n in [1, 511, 4095, 4097, 65537, 1234567, 5000001] {
        assert!(console.contains(&format!("SUM f{n}: OK")), "f{n} after the remount: {console:?}");
    }
    // What the engine saw: real block-layer I/O, many pages per command, few runs.
    let io = &stats["io"];
    eprintln!("nvme statistics: {io}");
    let (pages, runs, pins) =
        (io["pages"].as_u64().unwrap(), io["runs"].as_u64().unwrap(), io["pin_calls"].as_u64().unwrap());
    assert_eq!(
        pins,
        io["reads"].as_u64().unwrap() + io["writes"].as_u64().unwrap(),
        "one pin call per data command"
    );
    assert!(pages > 2 * pins, "multi-page commands: {io}");
    assert!(runs < pages && runs >= pins, "runs between commands and pages: {io}");
    assert!(io["pages_per_command"].as_object().unwrap().len() > 2, "a histogram: {io}");
    assert_eq!(io["errors"], 0, "{io}");
    // Linux's driver took Doorbell Buffer Config (OACS bit 8): its I/O queues rang through
    // the shadow page.
    assert!(stats["shadow_doorbell_configs"].as_u64().unwrap() >= 1, "{stats}");

    // Second boot, a new daemon on the same file: the filesystem and its files are there.
    let daemon = serve(&socket, &[&ns, "queues=2"]);
    let script = r#"set -e
mkdir -p /mnt/d
mount -t ext4 /dev/nvme0n1 /mnt/d
cd /mnt/d && sha256sum -c SUMS | sed 's/^/KEPT /'
"#;
    let console = guest::run_ok(&GuestSpec {
        sockets: vec![&socket],
        modules,
        script,
        qemu_args,
        timeout: Duration::from_secs(300),
        ..Default::default()
    });
    stop(daemon);
    for n in [1, 511, 4095, 4097, 65537, 1234567, 5000001] {
        assert!(console.contains(&format!("KEPT f{n}: OK")), "f{n} in the second boot: {console:?}");
    }
}

#[test]
fn intx_and_4k_blocks_work_for_the_stock_driver_too() {
    if !guest::available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nvme.sock");
    let daemon = serve(&socket, &["ns1=ram:128M", "ns2=ram:16M", "lba=4096"]);
    let script = format!(
        r#"set -e
{IDENTIFY}
echo "DISK2 $(cat /sys/block/nvme0n2/size)"
grep nvme /proc/interrupts | sed 's/^/INT /'
{SCATTERED_IO}
"#
    );
    let console = guest::run_ok(&GuestSpec {
        sockets: vec![&socket],
        modules: vec!["nvme"],
        script: &script,
        append: "pci=nomsi",
        timeout: Duration::from_secs(300),
        ..Default::default()
    });
    let stats = stop(daemon);
    assert_eq!(line(&console, "DRIVER"), "DRIVER nvme");
    assert_eq!(line(&console, "DISK"), format!("DISK {} 4096", (128 << 20) / 512));
    assert_eq!(line(&console, "DISK2"), format!("DISK2 {}", (16 << 20) / 512));
    assert!(
        console.iter().any(|l| l.starts_with("INT ") && l.contains("IO-APIC")),
        "INTx, not MSI: {console:?}"
    );
    for off in [3, 1000, 77, 4099, 20000, 513] {
        assert!(console.contains(&format!("IO-OK {off}")), "data at block {off} read back: {console:?}");
    }
    assert_eq!(stats["io"]["errors"], 0);
}

#[test]
fn with_the_doorbell_page_mapped_the_guest_rings_without_messages() {
    if !guest::available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nvme.sock");
    let daemon = serve(&socket, &["ns1=ram:128M", "doorbells=mmap"]);
    let script = format!(
        r#"set -e
{IDENTIFY}
{SCATTERED_IO}
"#
    );
    let console = guest::run_ok(&GuestSpec {
        sockets: vec![&socket],
        modules: vec!["nvme"],
        script: &script,
        timeout: Duration::from_secs(300),
        ..Default::default()
    });
    let stats = stop(daemon);
    assert_eq!(line(&console, "DRIVER"), "DRIVER nvme");
    for off in [3, 1000, 77, 4099, 20000, 513] {
        assert!(console.contains(&format!("IO-OK {off}")), "data at block {off} read back: {console:?}");
    }
    assert_eq!(stats["doorbells"], "mmap");
    let commands = stats["io"]["commands"].as_u64().unwrap() + stats["admin_commands"].as_u64().unwrap();
    assert!(commands > 30, "{stats}");
    // QEMU mapped the page into the guest: its doorbell writes do not become messages (a
    // handful during bring-up, before the mapping is in place, do and still work).
    let messages = stats["doorbell_messages"].as_u64().unwrap();
    assert!(messages * 10 < commands, "{messages} doorbell messages for {commands} commands: {stats}");
}

/// `queue_irqs`: each I/O queue's vector and its interrupts so far, a line each. A script
/// that prints `QUEUE-IRQS <vector> <count>` lines per queue for a run is read back by
/// [`interrupts_per_queue`].
const QUEUE_IRQS: &str = r#"
queue_irqs() {
  awk '/nvme0q[1-9]/ { s = 0; for (i = 2; i <= NF; i++) { if ($i !~ /^[0-9]+$/) break; s += $i } print $NF, s }' /proc/interrupts
}
"#;

/// The `QUEUE-IRQS` lines of a run on two I/O queues: both vectors took interrupts (each
/// I/O queue has its own).
fn interrupts_per_queue(console: &[String]) -> Vec<(&str, u64)> {
    let irqs: Vec<(&str, u64)> = console
        .iter()
        .filter_map(|l| l.strip_prefix("QUEUE-IRQS "))
        .filter_map(|l| l.split_once(' ').map(|(q, n)| (q, n.parse().unwrap_or(0))))
        .collect();
    assert_eq!(irqs.len(), 2, "two I/O queue vectors: {console:?}");
    assert!(irqs.iter().all(|&(_, n)| n > 0), "interrupts on both I/O queues: {irqs:?}");
    irqs
}

/// 32 `dd` processes with O_DIRECT, 16 pinned to each of the guest's two CPUs (so to both of
/// the driver's I/O queues, one per CPU), each on its own MiB of the disk with its own block
/// size (4, 16, 64 or 128 KiB): up to 32 commands in flight on two queues at once. They
/// write, then read back and compare; then half of them write new data while the other half
/// read and compare, and the new data is read back. Per I/O queue, the interrupts the run
/// took.
const CONCURRENT_VERIFY: &str = r#"
head -c 33554432 /dev/urandom > /tmp/pat
head -c 16777216 /dev/urandom > /tmp/pat2
queue_irqs > /tmp/irq0
# job J: its MiB at J, its CPU and block size.
job() { j=$1; cpu=$((j % 2)); bs=$((4096 << (2 * ((j / 2) % 4)))); n=$((1048576 / bs)); }
put() {
  job $1
  taskset -c $cpu dd if=$2 of=/dev/nvme0n1 bs=$bs skip=$((($1 - $3) * n)) seek=$(($1 * n)) count=$n \
    oflag=direct conv=notrunc 2>/tmp/err.$1 || echo "DD-FAIL write $1: $(cat /tmp/err.$1)"
}
check() {
  job $1
  taskset -c $cpu dd if=/dev/nvme0n1 of=/tmp/got.$1 bs=$bs skip=$(($1 * n)) count=$n iflag=direct \
    2>/tmp/err.$1 || echo "DD-FAIL read $1: $(cat /tmp/err.$1)"
  if dd if=$2 bs=$bs skip=$((($1 - $3) * n)) count=$n 2>/dev/null | cmp -s - /tmp/got.$1; then
    echo "VERIFY-OK $4 $1"
  else
    echo "VERIFY-BAD $4 $1"
  fi
  rm -f /tmp/got.$1
}
for j in $(seq 0 31); do put $j /tmp/pat 0 & done; wait
for j in $(seq 0 31); do check $j /tmp/pat 0 first & done; wait
for j in $(seq 0 15); do put $j /tmp/pat2 0 & done
for j in $(seq 16 31); do check $j /tmp/pat 0 during & done; wait
for j in $(seq 0 15); do check $j /tmp/pat2 0 second & done; wait
queue_irqs > /tmp/irq1
paste /tmp/irq0 /tmp/irq1 | awk '{ print "QUEUE-IRQS", $1, $4 - $2 }'
"#;

#[test]
fn thirty_two_direct_writers_and_readers_on_two_queues_read_back_what_they_wrote() {
    if !guest::available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nvme.sock");
    let ns = file_namespace(dir.path(), 64 << 20);
    let daemon = serve(&socket, &[&ns, "queues=2"]);
    let script = format!("set -e\n{IDENTIFY}\n{QUEUE_IRQS}\n{CONCURRENT_VERIFY}");
    let console = guest::run_ok(&GuestSpec {
        sockets: vec![&socket],
        modules: vec!["nvme"],
        script: &script,
        qemu_args: vec!["-smp", "2"],
        mem_mib: 512,
        timeout: Duration::from_secs(600),
        ..Default::default()
    });
    let stats = stop(daemon);
    assert_eq!(line(&console, "QUEUES"), "QUEUES 2", "one I/O queue per guest CPU: {console:?}");
    assert!(!console.iter().any(|l| l.starts_with("DD-FAIL") || l.starts_with("VERIFY-BAD")), "{console:?}");
    for (phase, jobs) in [("first", 0..32), ("during", 16..32), ("second", 0..16)] {
        for j in jobs {
            assert!(console.contains(&format!("VERIFY-OK {phase} {j}")), "{phase} {j}: {console:?}");
        }
    }
    // Both I/O queues carried the run.
    let irqs = interrupts_per_queue(&console);
    let io = &stats["io"];
    eprintln!("nvme statistics: {io}; interrupts per queue: {irqs:?}");
    assert_eq!(io["errors"], 0, "{io}");
    assert!(io["bytes_written"].as_u64().unwrap() >= 48 << 20, "{io}");
    assert!(io["bytes_read"].as_u64().unwrap() >= 64 << 20, "{io}");
}

/// fio verify at QD32 on both I/O queues: one job per guest CPU (so per queue), random
/// writes of 4-128 KiB through io_uring with O_DIRECT, each block's CRC32C checked when read
/// back, the jobs on separate ranges.
const FIO_VERIFY: &str = r#"
queue_irqs > /tmp/irq0
cat > /tmp/verify.fio <<'EOF'
[global]
filename=/dev/nvme0n1
direct=1
ioengine=io_uring
iodepth=32
rw=randwrite
bsrange=4k-128k
size=24m
verify=crc32c
verify_fatal=1
do_verify=1
[q0]
cpus_allowed=0
offset=0
[q1]
cpus_allowed=1
offset=32m
EOF
fio /tmp/verify.fio --eta=never --output-format=json --output=/tmp/verify.json
echo "FIO-STATUS $?"
tr -d ' \n' < /tmp/verify.json | grep -o '"error":[0-9]*' | sed 's/^/FIO-JOB-/'
queue_irqs > /tmp/irq1
paste /tmp/irq0 /tmp/irq1 | awk '{ print "QUEUE-IRQS", $1, $4 - $2 }'
"#;

#[test]
fn fio_verify_at_queue_depth_32_on_both_queues_reads_back_what_it_wrote() {
    if !guest::available() {
        return;
    }
    let Some(fio) = guest::fio() else { return };
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nvme.sock");
    let ns = file_namespace(dir.path(), 64 << 20);
    let daemon = serve(&socket, &[&ns, "queues=2", "cache1=none"]);
    let script = format!("{QUEUE_IRQS}\n{FIO_VERIFY}");
    let console = guest::run_ok(&GuestSpec {
        sockets: vec![&socket],
        modules: vec!["nvme"],
        script: &script,
        qemu_args: vec!["-smp", "2"],
        files: vec![&fio],
        mem_mib: 512,
        timeout: Duration::from_secs(600),
        ..Default::default()
    });
    let stats = stop(daemon);
    assert_eq!(line(&console, "FIO-STATUS"), "FIO-STATUS 0", "fio failed: {console:?}");
    let jobs: Vec<&String> = console.iter().filter(|l| l.starts_with("FIO-JOB-")).collect();
    assert_eq!(jobs.len(), 2, "two fio jobs: {console:?}");
    assert!(jobs.iter().all(|l| l.as_str() == r#"FIO-JOB-"error":0"#), "{jobs:?}");
    let irqs = interrupts_per_queue(&console);
    let io = &stats["io"];
    eprintln!("nvme statistics: {io}; interrupts per queue: {irqs:?}");
    assert_eq!(io["errors"], 0, "{io}");
    // Each job wrote its 24 MiB and read all of it back to verify.
    assert!(io["bytes_written"].as_u64().unwrap() >= 48 << 20, "{io}");
    assert!(io["bytes_read"].as_u64().unwrap() >= 48 << 20, "{io}");
}

#[test]
fn in_kernel_pin_mode_a_cache_none_file_namespace_moves_the_guests_io_through_fixed_buffers() {
    if !guest::available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nvme.sock");
    let ns = file_namespace(dir.path(), 256 << 20);
    let args = [
        "--type",
        "nvme",
        "--pin-mode",
        "kernel",
        "--opt",
        &ns,
        "--opt",
        "cache1=none",
        "--opt",
        "fixed_buffers=always",
    ];
    let daemon = process::run_with_stderr(&socket, &args, Stdio::piped());
    // Besides the scattered I/O, 1 MiB in 128 KiB O_DIRECT commands, read back.
    let script = format!(
        r#"set -e
{IDENTIFY}
{SCATTERED_IO}
dd if=/tmp/r of=/dev/nvme0n1 bs=131072 count=8 seek=400 oflag=direct 2>/dev/null
dd if=/dev/nvme0n1 of=/tmp/big bs=131072 count=8 skip=400 iflag=direct 2>/dev/null
cmp -s /tmp/r /tmp/big && echo BIG-OK || echo BIG-BAD
"#
    );
    let console = guest::run_ok(&GuestSpec {
        sockets: vec![&socket],
        modules: vec!["nvme"],
        script: &script,
        timeout: Duration::from_secs(300),
        ..Default::default()
    });
    let stats = stop(daemon);
    assert_eq!(line(&console, "DRIVER"), "DRIVER nvme");
    for off in [3, 1000, 77, 4099, 20000, 513] {
        assert!(console.contains(&format!("IO-OK {off}")), "data at block {off} read back: {console:?}");
    }
    assert!(console.iter().any(|l| l == "BIG-OK"), "128 KiB O_DIRECT data read back: {console:?}");
    let io = &stats["io"];
    eprintln!("nvme statistics: {io}");
    assert_eq!(stats["fixed_buffers"], "always", "{stats}");
    assert_eq!(io["errors"], 0, "{io}");
    assert!(io["fixed_transfers"].as_u64().unwrap() > 0, "the guest's one-run transfers went fixed: {io}");
}

#[test]
fn a_block_device_with_larger_sectors_serves_the_guest_and_is_had_by_one_device() {
    if !guest::available() {
        return;
    }
    // 4 KiB sectors under 512-byte namespace blocks: O_DIRECT where transfers are whole
    // sectors, the page cache elsewhere; discards of parts of sectors zero what they name.
    let Some(disk) = LoopDevice::new(256 << 20, &["--sector-size", "4096"]) else { return };
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nvme.sock");
    let ns = format!("ns1=file:{}", disk.path().display());
    let daemon = serve(&socket, &[&ns, "cache1=none"]);
    // Another device cannot have it meanwhile.
    let other = common::process::umdev()
        .args(["run", "--type", "nvme", "--socket"])
        .arg(dir.path().join("other.sock"))
        .args(["--opt", &ns])
        .output()
        .unwrap();
    let refused = String::from_utf8_lossy(&other.stderr);
    assert!(!other.status.success() && refused.contains("in use"), "{refused}");
    let script = format!(
        r#"set -e
{IDENTIFY}
{SCATTERED_IO}
head -c 65536 /dev/urandom > /tmp/d
dd if=/tmp/d of=/dev/nvme0n1 bs=4096 seek=1000 conv=fsync 2>/dev/null
blkdiscard -o $((1000 * 4096 + 1536)) -l 13312 /dev/nvme0n1
echo 3 > /proc/sys/vm/drop_caches
dd if=/dev/nvme0n1 of=/tmp/back bs=4096 skip=1000 count=16 iflag=direct 2>/dev/null
head -c 1536 /tmp/d > /tmp/want
head -c 13312 /dev/zero >> /tmp/want
tail -c $((65536 - 14848)) /tmp/d >> /tmp/want
cmp -s /tmp/want /tmp/back && echo DISCARD-OK || echo DISCARD-BAD
mke2fs -q -F /dev/nvme0n1
mkdir -p /mnt/d
mount -t ext4 /dev/nvme0n1 /mnt/d
head -c 3000000 /dev/urandom > /mnt/d/f
sha256sum /mnt/d/f > /tmp/sum
umount /mnt/d
echo 3 > /proc/sys/vm/drop_caches
mount -t ext4 /dev/nvme0n1 /mnt/d
sha256sum -c /tmp/sum | sed 's/^/SUM /'
"#
    );
    let console = guest::run_ok(&GuestSpec {
        sockets: vec![&socket],
        modules: vec!["nvme", "ext4"],
        script: &script,
        timeout: Duration::from_secs(300),
        ..Default::default()
    });
    let stats = stop(daemon);
    assert_eq!(line(&console, "DISK"), format!("DISK {} 512", (256 << 20) / 512), "{console:?}");
    for off in [3, 1000, 77, 4099, 20000, 513] {
        assert!(console.contains(&format!("IO-OK {off}")), "data at block {off} read back: {console:?}");
    }
    assert!(console.iter().any(|l| l == "DISCARD-OK"), "{console:?}");
    assert!(console.iter().any(|l| l == "SUM /mnt/d/f: OK"), "{console:?}");
    let ns1 = &stats["namespaces"][0];
    assert_eq!(
        (ns1["backing"].as_str(), ns1["cache"].as_str()),
        (Some("block-device"), Some("none")),
        "{stats}"
    );
    assert_eq!(ns1["direct_alignment"]["offset"], 4096, "{stats}");
    assert_eq!(stats["io"]["errors"], 0, "{stats}");
    // Stopped, it let go: another device has it at once.
    let again = serve(&socket, &[&ns]);
    stop(again);
}
