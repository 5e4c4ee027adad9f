//! mtty in a real Linux guest: Debian 6.1's stock `8250_pci` binds umdev's mtty under QEMU 11
//! (TCG), as it binds the kernel sample, and uses it as people use that sample: open the tty,
//! write, read it back. Then ports with host backends: a shell on a pty-backed port driven
//! from the host, 64 KiB through the pty both ways, 4 KiB through a socket-backed port.
//! Skips only when the guest kernel, busybox or QEMU cannot be fetched, and says so.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::guest::{self, Guest, GuestSpec};
use common::process::{run, umdev, ChildGuard};
use common::raw::RawClient;

/// The PCI serial card at 00:04.0 and its ttys, in port order.
const FIND_PORTS: &str = r#"
dev=/sys/bus/pci/devices/0000:00:04.0
echo "PCI-ID $(cat $dev/vendor) $(cat $dev/device) class $(cat $dev/class)"
echo "DRIVER $(basename $(readlink $dev/driver))"
ports=$(ls $dev/tty | sort)
echo PORTS $ports
"#;

#[test]
fn the_guests_8250_driver_reads_back_what_it_writes_on_every_port() {
    if !guest::available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("mtty.sock");
    let _umdev = run(&socket, &["--type", "mtty-2"]);
    let script = format!(
        r#"{FIND_PORTS}
dmesg | grep -E 'ttyS[0-9]+ at I/O' || true
dd if=/dev/urandom of=/tmp/in bs=4096 count=1 2>/dev/null
for t in $ports; do
  exec 3<>/dev/$t
  stty raw -echo <&3
  timeout 300 head -c 4096 <&3 > /tmp/out.$t &
  reader=$!
  cat /tmp/in >&3
  wait $reader
  exec 3>&-
  if cmp -s /tmp/in /tmp/out.$t; then echo "LOOPBACK-OK $t"; else echo "LOOPBACK-BAD $t $(wc -c < /tmp/out.$t) bytes"; exit 1; fi
done
grep 16550A /proc/tty/driver/serial | sed 's/^/SERIAL /'
"#
    );
    let console = guest::run_ok(&GuestSpec { sockets: vec![&socket], script: &script, ..Default::default() });
    let line = |prefix: &str| console.iter().find(|l| l.starts_with(prefix)).cloned().unwrap_or_default();
    assert_eq!(line("PCI-ID"), "PCI-ID 0x4348 0x3253 class 0x070002", "{console:?}");
    assert_eq!(line("DRIVER"), "DRIVER serial", "8250_pci bound it");
    let ports_line = line("PORTS");
    let ports: Vec<&str> = ports_line.split_whitespace().skip(1).collect();
    assert_eq!(ports.len(), 2, "two ttys: {console:?}");
    for port in &ports {
        assert!(
            console.iter().any(|l| l.contains(&format!("{port} at I/O")) && l.contains("is a 16550A")),
            "{port} probed as a 16550A"
        );
        assert!(
            console.contains(&format!("LOOPBACK-OK {port}")),
            "{port}: 4 KiB read back whole and in order"
        );
    }
    // The driver's own counters: 4096 out and 4096 in on both ports, no overrun or break.
    for port in &ports {
        let n = port.trim_start_matches("ttyS");
        let l = line(&format!("SERIAL {n}: "));
        assert!(l.contains(" tx:4096 rx:4096 "), "{port}: {l}");
        assert!(!l.contains("oe:") && !l.contains("brk:") && !l.contains("bo:"), "{l}");
    }
}

/// Starts `umdev run` with `opts`; returns it and the host endpoint lines it printed
/// (`port N: pty /dev/pts/M`).
fn run_with_endpoints(
    socket: &std::path::Path,
    opts: &[&str],
    endpoints: usize,
) -> (ChildGuard, Vec<String>) {
    let mut cmd = umdev();
    cmd.arg("run").arg("--socket").arg(socket).args(opts).stderr(Stdio::piped());
    let mut child = ChildGuard(cmd.spawn().unwrap());
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut lines = Vec::new();
    while lines.len() < endpoints {
        let mut line = String::new();
        assert!(stderr.read_line(&mut line).unwrap() > 0, "umdev run exited: {lines:?}");
        if line.trim_start().starts_with("port ") {
            lines.push(line.trim().to_string());
        }
    }
    std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
    let deadline = Instant::now() + Duration::from_secs(60);
    while RawClient::connect(socket).is_err() {
        assert!(Instant::now() < deadline, "umdev run never listened");
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(20));
    (child, lines)
}

/// Reads from `r` until `want` returns true of what came, or `timeout`.
fn read_until(r: &mut impl Read, timeout: Duration, want: impl Fn(&[u8]) -> bool) -> Vec<u8> {
    let deadline = Instant::now() + timeout;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !want(&got) {
        assert!(
            Instant::now() < deadline,
            "timed out; got {} bytes: {:?}",
            got.len(),
            String::from_utf8_lossy(&got)
        );
        match r.read(&mut buf) {
            Ok(0) => std::thread::sleep(Duration::from_millis(5)),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => panic!("read: {e}"),
        }
    }
    got
}

/// Writes all of `data` to a non-blocking `w`.
fn write_all_nonblocking(w: &mut impl Write, data: &[u8], timeout: Duration) {
    let deadline = Instant::now() + timeout;
    let mut sent = 0;
    while sent < data.len() {
        assert!(Instant::now() < deadline, "timed out writing: {sent} of {} bytes", data.len());
        match w.write(&data[sent..]) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(2))
            }
            Err(e) => panic!("write: {e}"),
        }
    }
}

fn pattern(len: usize, seed: u32) -> Vec<u8> {
    let mut x = seed;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

#[test]
fn host_backends_reach_a_shell_and_carry_64_kib_both_ways() {
    if !guest::available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("mtty.sock");
    let tty0 = dir.path().join("tty0.sock");
    let port0 = format!("port0=socket:{}", tty0.display());
    let (_umdev, endpoints) =
        run_with_endpoints(&socket, &["--type", "mtty-2", "--opt", &port0, "--opt", "port1=pty"], 2);
    assert_eq!(endpoints[0], format!("port 0: socket {}", tty0.display()));
    let pty = PathBuf::from(endpoints[1].strip_prefix("port 1: pty ").expect("a pty path"));
    assert!(pty.starts_with("/dev/pts"));
    let mut host_tty = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOCTTY | libc::O_NONBLOCK)
        .open(&pty)
        .unwrap();

    let script = format!(
        r#"{FIND_PORTS}
set -- $ports
sock=$1 pty=$2
setsid sh -c "exec sh -i </dev/$pty >/dev/$pty 2>&1" &
shell=$!
echo "SHELL-ON $pty"
# The shell leads a session whose controlling terminal is the port, so its exit hangs the
# port up (tty_vhangup_session), and a descriptor opened before that is dead. Open the port
# only once the shell is gone, not when its last command has merely run.
wait $shell
[ -e /tmp/shell-done ] || {{ echo "no shell-done"; exit 1; }}
exec 3<>/dev/$pty
stty raw -echo <&3
printf ECHO-MARK >&3 || {{ echo "ECHO-MARK not written"; exit 1; }}
echo "ECHO-READY $pty"
timeout 600 head -c 65536 <&3 > /tmp/rx
echo "ECHO-RECEIVED $(wc -c < /tmp/rx)"
cat /tmp/rx >&3
exec 3>&-
echo "ECHO-SENT"
exec 4<>/dev/$sock
stty raw -echo <&4
echo "SOCK-READY $sock"
timeout 600 head -c 4096 <&4 > /tmp/srx
cat /tmp/srx >&4
exec 4>&-
echo "SOCK-SENT"
grep 16550A /proc/tty/driver/serial | sed 's/^/SERIAL /'
"#
    );
    let mut g = Guest::boot(&GuestSpec {
        sockets: vec![&socket],
        script: &script,
        timeout: Duration::from_secs(900),
        ..Default::default()
    });
    g.wait_for("SHELL-ON", Duration::from_secs(300));

    // A shell on the guest's port, driven from the host's pty.
    // One hang guard for all the attempts: each waits for the answer or the next prompt.
    let deadline = Instant::now() + Duration::from_secs(300);
    let answer = loop {
        write_all_nonblocking(&mut host_tty, b"echo $((6*7))\n", Duration::from_secs(60));
        let got = read_until(&mut host_tty, deadline.saturating_duration_since(Instant::now()), |b| {
            String::from_utf8_lossy(b).contains("\n42\r\n") || String::from_utf8_lossy(b).contains("# ")
        });
        let text = String::from_utf8_lossy(&got).to_string();
        if text.contains("\n42\r\n") {
            break text;
        }
        // The prompt came before our line was read: ask again.
        assert!(Instant::now() < deadline, "no answer from the guest shell: {text:?}");
    };
    assert!(answer.contains("42"), "{answer:?}");
    // The pause between the mark and the exit holds open the window in which a script that
    // took the mark for the shell's end would open a port about to be hung up.
    write_all_nonblocking(&mut host_tty, b"touch /tmp/shell-done; sleep 1; exit\n", Duration::from_secs(60));

    // 64 KiB host -> guest, then the guest sends it back: both directions intact.
    g.wait_for("ECHO-READY", Duration::from_secs(300));
    // Whatever the shell still printed is not part of the transfer: it ends at the mark the
    // guest wrote once its line was raw.
    let _ = read_until(&mut host_tty, Duration::from_secs(300), |b| b.ends_with(b"ECHO-MARK"));
    let data = pattern(65536, 0x9e37_79b9);
    let started = Instant::now();
    let mut writer_tty = host_tty.try_clone().unwrap();
    let to_send = data.clone();
    let writer = std::thread::spawn(move || {
        write_all_nonblocking(&mut writer_tty, &to_send, Duration::from_secs(600))
    });
    let back = read_until(&mut host_tty, Duration::from_secs(600), |b| b.len() >= data.len());
    writer.join().unwrap();
    let elapsed = started.elapsed();
    assert!(
        back == data,
        "the guest returned {} bytes, {} differ",
        back.len(),
        back.iter().zip(&data).filter(|(a, b)| a != b).count()
    );
    eprintln!("64 KiB through the pty and back in {:.1} s", elapsed.as_secs_f64());
    g.wait_for("ECHO-SENT", Duration::from_secs(300));

    // 4 KiB through the socket-backed port and back.
    g.wait_for("SOCK-READY", Duration::from_secs(300));
    let mut host_sock = UnixStream::connect(&tty0).unwrap();
    host_sock.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    let data = pattern(4096, 7);
    host_sock.write_all(&data).unwrap();
    let back = read_until(&mut host_sock, Duration::from_secs(300), |b| b.len() >= data.len());
    assert!(back == data, "socket: {} bytes back", back.len());
    let (status, console) = g.finish();
    assert!(status.success(), "{status}: {}", console.join("\n"));
    assert!(console.iter().any(|l| l == "ECHO-RECEIVED 65536"), "{console:?}");
    // The guest driver saw no overrun, break or buffer overrun on either port.
    let serial: Vec<&String> =
        console.iter().filter(|l| l.starts_with("SERIAL") && !l.contains("port:000003F8")).collect();
    assert_eq!(serial.len(), 2, "{console:?}");
    for l in serial {
        assert!(!l.contains("oe:") && !l.contains("brk:") && !l.contains("bo:"), "{l}");
    }
}
