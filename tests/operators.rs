//! What an operator used to mdevctl meets, as real processes: options checked when a device
//! is defined (with the message starting it gives), every option discoverable, `modify`,
//! mdevctl's JSON, overrides only when asked, a dead daemon's leftovers, one daemon per
//! directory, output into a closed pipe, files a user asks for readable by all.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::process::Stdio;

use common::process::{deny_io_uring, status_kib, umdev, ChildGuard, Dirs};

const A: &str = "5a1e4c36-0f8e-4a5e-9d2f-00000000e001";
const B: &str = "5a1e4c36-0f8e-4a5e-9d2f-00000000e002";

fn stderr_of(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).trim().to_string()
}

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// Creates `dir` (and its missing parents) mode 0700 whatever the umask, as umdev makes its
/// directories: under a umask of 002 `create_dir_all` makes them 0775, which a client refuses.
fn private_dir(dir: &std::path::Path) {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).unwrap();
}

fn stop(mut daemon: ChildGuard) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(daemon.id() as i32), nix::sys::signal::Signal::SIGTERM)
        .unwrap();
    assert!(daemon.wait().unwrap().success());
}

#[test]
fn a_bad_option_fails_at_define_with_the_message_start_gives() {
    let env = Dirs::new();
    let daemon = env.daemon(&[]);
    let tiny = env.path().join("tiny.img");
    std::fs::write(&tiny, b"sixby!").unwrap();
    let tiny_ccw = format!("file={}", tiny.display());
    let tiny_nvme = format!("ns1=file:{}", tiny.display());
    let cases: &[(&str, &str, &str)] = &[
        ("nvme", "lba=3", "lba=3: one of 512, 4096"),
        (
            "nvme",
            "foo=bar",
            "unknown option \"foo\" (it takes ns1..ns16, cache1..cache16, aio, fixed_buffers, lba, queues",
        ),
        (
            "nvme",
            "ns1=file:/nonexistent/disk.img",
            "ns1=file:/nonexistent/disk.img: /nonexistent/disk.img: No such file",
        ),
        ("nvme", &tiny_nvme, "6 bytes; a store has at least 4096"),
        ("nvme", "ns1=ram:1000", "ns1=ram:1000: ram:SIZE takes a size from 4K to 1T"),
        ("nvme", "ns1=ram:5000", "ns1=ram:5000: not a whole number of 512-byte blocks"),
        ("nvme", "ns1=ram:1025G", "a size from 4K to 1T"),
        ("nvme", "queues=0", "queues=0: a whole number from 1 to 64"),
        ("ccw", "size=abc", "size=abc: a size from 4K to 64G"),
        ("ccw", "store=file:disk.img", "store=file:disk.img: the file must be an absolute path"),
        ("ccw", "file=disk.img", "file=disk.img: the file must be an absolute path"),
        ("ccw", &tiny_ccw, "6 bytes; a store has at least 4096"),
        ("ccw", "store=ram:1T", "store=ram:1T: ram:SIZE takes a size from 4K to 64G"),
        ("mtty-1", "port1=pty", "unknown option \"port1\" (it takes backend, port0)"),
        ("mtty-2", "backend=serial", "backend=serial: unknown backend \"serial\""),
        ("testdev", "size=1", "unknown option \"size\": this type takes none"),
    ];
    for (ty, opt, want) in cases {
        let defined = env.umdev(&["define", "-t", ty, "--opt", opt]);
        let started = env.umdev(&["start", "-t", ty, "--opt", opt]);
        assert!(!defined.status.success() && !started.status.success(), "{ty} {opt}");
        assert!(stderr_of(&defined).contains(want), "{ty} {opt}: {}", stderr_of(&defined));
        assert_eq!(stderr_of(&defined), stderr_of(&started), "{ty} {opt}: one message");
    }
    assert!(
        !env.state.exists() || std::fs::read_dir(&env.state).unwrap().count() == 0,
        "nothing was written"
    );
    // What the other options keep from applying is refused too, not taken silently; and
    // two namespaces on one file (under any name).
    let image = env.path().join("disk.img");
    std::fs::File::create(&image).unwrap().set_len(1 << 20).unwrap();
    let link = env.path().join("link.img");
    std::os::unix::fs::symlink(&image, &link).unwrap();
    let (ns1, ns2) = (format!("ns1=file:{}", image.display()), format!("ns2=file:{}", link.display()));
    let together: &[(&[&str], &str)] = &[
        (&["ns1=ram:1M", "aio=sync"], "aio=sync cannot apply: no namespace is a file or block device"),
        (&[&ns1, "fixed_buffers=always"], "fixed_buffers=always cannot apply: they carry O_DIRECT transfers"),
        (
            &[&ns1, "cache1=none", "aio=sync", "fixed_buffers=on"],
            "fixed buffers are io_uring's (aio=io_uring)",
        ),
        (&[&ns1, "cache1=none", "fixed_buffers=on"], "they are the kernel's pins (--pin-mode kernel)"),
        (&[&ns1, "ram_pages=2m"], "ram_pages=2m cannot apply: no namespace is a RAM disk"),
        (&["doorbells=mmap", "poll_us=0"], "poll_us=0 cannot apply"),
        (&[&ns1, &ns2], "ns2: the same file or block device as ns1"),
    ];
    for (opts, want) in together {
        let args = |verb: &'static str| {
            let mut args = vec![verb, "-t", "nvme"];
            opts.iter().for_each(|o| args.extend(["--opt", o]));
            args
        };
        let (defined, started) = (env.umdev(&args("define")), env.umdev(&args("start")));
        assert!(!defined.status.success() && !started.status.success(), "{opts:?}");
        assert!(stderr_of(&defined).contains(want), "{opts:?}: {}", stderr_of(&defined));
        assert_eq!(stderr_of(&defined), stderr_of(&started), "{opts:?}: one message");
    }
    // `fixed_buffers=off` asks for nothing: accepted whatever else is given.
    env.ok(&["define", "-t", "nvme", "--opt", "ns1=ram:1M", "--opt", "fixed_buffers=off"]);
    // The T suffix, exact sizes, and the older ccw spellings are accepted.
    env.ok(&["define", "-t", "nvme", "--opt", "ns1=ram:1T", "--opt", "ns2=ram:4096", "--opt", "lba=4096"]);
    env.ok(&["define", "-t", "ccw", "--opt", "size=1M"]);
    env.ok(&["define", "-t", "ccw", "--opt", &format!("store=file:{}", image.display())]);
    assert!(env
        .fails(&["define", "-t", "ccw", "--opt", "size=1M", "--opt", &format!("file={}", image.display())])
        .contains("size and file name the same store"));
    // A key given twice is refused, not the last one taken.
    let twice = env.fails(&["define", "-t", "nvme", "--opt", "lba=512", "--opt", "lba=4096"]);
    assert!(twice.contains("option lba given twice (lba=512 and lba=4096)"), "{twice}");
    // A running device has its file to itself: a second is refused at start (a lock, which
    // only opening finds), and may start once the first has stopped.
    env.ok(&["define", "-u", B, "-t", "nvme", "--opt", &ns1]);
    env.ok(&["start", "-u", A, "-t", "nvme", "--opt", &ns1]);
    let busy = env.fails(&["start", "-u", B]);
    assert!(busy.contains("in use: a lock on it is held elsewhere"), "{busy}");
    env.ok(&["stop", "-u", A]);
    env.ok(&["start", "-u", B]);
    env.ok(&["stop", "-u", B]);
    // A count below its least is refused saying what the least is (not the type's whole range).
    let zero = env.fails(&["daemon", "--max-instances", "0"]);
    assert!(zero.contains("'0' for '--max-instances <MAX_INSTANCES>': must be at least 1"), "{zero}");
    let zero = env.fails(&["run", "-t", "testdev", "--socket", "/tmp/x.sock", "--max-dma-maps", "0"]);
    assert!(zero.contains("must be at least 1") && !zero.contains("4294967295"), "{zero}");
    let small = env.fails(&["run", "-t", "testdev", "--socket", "/tmp/x.sock", "--max-dma-bytes", "4095"]);
    assert!(small.contains("must be at least 4096"), "{small}");
    stop(daemon);
}

#[test]
fn every_option_can_be_found_from_the_cli() {
    let env = Dirs::new();
    let types = json(&env.ok(&["types", "--json"]));
    let verbose = env.ok(&["types", "-v"]);
    // Only the last directory is made: a mistyped path is an error, and makes nothing.
    let dir = env.path().join("man/man1");
    let missing = env.fails(&["man", "--dir", dir.to_str().unwrap()]);
    assert!(
        missing.contains(&format!("its parent {} does not exist", dir.parent().unwrap().display())),
        "{missing}"
    );
    assert!(!dir.parent().unwrap().exists());
    std::fs::create_dir(dir.parent().unwrap()).unwrap();
    env.ok(&["man", "--dir", dir.to_str().unwrap()]);
    let define_page = std::fs::read_to_string(dir.join("umdev-define.1")).unwrap();
    let mut keys = 0;
    for t in types.as_array().unwrap() {
        let name = t["name"].as_str().unwrap();
        let one = env.ok(&["types", name]);
        for o in t["options"].as_array().unwrap() {
            let line = format!("{}={}", o["key"].as_str().unwrap(), o["syntax"].as_str().unwrap());
            assert!(verbose.contains(&line) && one.contains(&line), "{name}: {line} not listed");
            // man renders `-` as `\-`.
            let key = o["key"].as_str().unwrap().replace('-', "\\-");
            assert!(define_page.contains(&key), "umdev-define(1) lacks {name}'s {key}");
            keys += 1;
        }
    }
    assert!(keys >= 14, "{keys} keys");
    assert!(
        verbose.contains("ns1..ns16=ram:SIZE|file:/PATH") && verbose.contains("store=ram:SIZE|file:/PATH")
    );
    // Files asked for are readable by all; the directory made for them too.
    assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o755);
    for page in std::fs::read_dir(&dir).unwrap() {
        let page = page.unwrap().path();
        assert_eq!(
            std::fs::metadata(&page).unwrap().permissions().mode() & 0o777,
            0o644,
            "{}",
            page.display()
        );
    }
    // -p names umdev's one parent.
    env.ok(&["types", "-p", "umdev"]);
    assert!(env.fails(&["types", "-p", "0000:00:02.0"]).contains("one parent"));
    let mdevctl = json(&env.ok(&["types", "--dumpjson"]));
    assert!(mdevctl[0]["umdev"].as_array().unwrap().iter().any(|t| t.get("nvme").is_some()), "{mdevctl}");
}

#[test]
fn types_are_the_daemons_and_follow_its_limit() {
    let env = Dirs::new();
    let none = env.umdev(&["types"]);
    assert!(stderr_of(&none).contains("no daemon runs"), "{}", stderr_of(&none));
    let daemon = env.daemon(&["--max-instances", "2"]);
    let available = |ty: &str| {
        let types = json(&env.ok(&["types", "--json"]));
        types.as_array().unwrap().iter().find(|t| t["name"] == ty).unwrap()["available_instances"]
            .as_u64()
            .unwrap()
    };
    assert_eq!((available("testdev"), available("mtty-2")), (2, 2));
    env.ok(&["start", "-t", "testdev"]);
    assert_eq!((available("testdev"), available("nvme")), (1, 1));
    assert!(stderr_of(&env.umdev(&["types"])).is_empty(), "a daemon answered");
    stop(daemon);
}

#[test]
fn modify_and_mdevctls_json() {
    let env = Dirs::new();
    env.ok(&["define", "-t", "nvme", "-u", A, "--opt", "ns1=ram:16M"]);
    let state = |uuid: &str| {
        let rows = json(&env.ok(&["list", "-d", "--json", "-u", uuid]));
        assert_eq!(rows.as_array().unwrap().len(), 1);
        rows[0].clone()
    };
    assert_eq!(state(A)["start"], "manual");
    // Removing what is not there is refused, a pin mode as any option.
    assert!(env.fails(&["modify", "-u", A, "--delopt", "pin_mode"]).contains("no option \"pin_mode\""));
    assert!(env.fails(&["list", "-t", "bogus"]).contains("unknown device type"));
    env.ok(&["modify", "-u", A, "--auto"]);
    assert_eq!(state(A)["start"], "auto");
    // A change is made even where the daemon cannot be asked whether the device runs (here a
    // bad UMDEV_CONTROL_TIMEOUT_MS): the command says so, and succeeds.
    let out = env
        .command()
        .args(["modify", "-u", A, "--manual", "--opt", "lba=512"])
        .env("UMDEV_CONTROL_TIMEOUT_MS", "soon")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert!(stderr_of(&out).contains("UMDEV_CONTROL_TIMEOUT_MS"), "{}", stderr_of(&out));
    assert_eq!(state(A)["start"], "manual");
    env.ok(&["modify", "-u", A, "--auto"]);
    env.ok(&["modify", "-u", A, "--manual", "--opt", "lba=4096", "--pin-mode", "lock"]);
    let row = state(A);
    assert_eq!(
        (row["start"].as_str(), row["options"]["params"]["lba"].as_str()),
        (Some("manual"), Some("4096"))
    );
    assert_eq!(row["options"]["pin_mode"], "lock");
    // Checked as define checks: the definition is left as it was.
    assert!(env.fails(&["modify", "-u", A, "--opt", "lba=3"]).contains("lba=3: one of 512, 4096"));
    assert!(env.fails(&["modify", "-u", A, "-t", "ccw"]).contains("unknown option \"lba\""));
    assert!(env.fails(&["modify", "-u", A, "--delopt", "queues"]).contains("no option \"queues\""));
    assert!(env.fails(&["modify", "-u", A]).contains("nothing to modify"));
    assert!(env.fails(&["modify", "-u", B, "--auto"]).contains("no device"));
    env.ok(&["modify", "-u", A, "--delopt", "lba", "--delopt", "pin_mode"]);
    assert_eq!(state(A)["options"], json(r#"{"params": {"ns1": "ram:16M"}}"#));

    // One device: mdevctl's config file format, which define --jsonfile takes back.
    let config = env.ok(&["list", "-d", "-u", A, "--dumpjson"]);
    assert_eq!(
        json(&config),
        json(r#"{"mdev_type": "nvme", "start": "manual", "attrs": [{"ns1": "ram:16M"}]}"#)
    );
    let copied = env.with_stdin(&["define", "-u", B, "--jsonfile", "-"], &config);
    assert!(copied.status.success(), "{}", stderr_of(&copied));
    assert_eq!(json(&env.ok(&["list", "-d", "-u", B, "--dumpjson"])), json(&config));
    // All of them: [{parent: [{uuid: config}]}], filtered by type.
    env.ok(&["define", "-t", "testdev"]);
    let all = json(&env.ok(&["list", "-d", "--dumpjson", "-t", "nvme"]));
    let devices = all[0]["umdev"].as_array().unwrap();
    assert_eq!(devices.len(), 2, "{all}");
    assert_eq!(devices[0][A]["mdev_type"], "nvme");
    assert_eq!(env.ok(&["list", "-d", "-t", "testdev"]).lines().count(), 1);
    // A config with a bad value, or a key twice, is refused like --opt.
    let bad =
        env.with_stdin(&["define", "--jsonfile", "-"], r#"{"mdev_type": "nvme", "attrs": [{"lba": "3"}]}"#);
    assert!(stderr_of(&bad).contains("lba=3: one of 512, 4096"));
    let twice = env.with_stdin(
        &["define", "--jsonfile", "-"],
        r#"{"mdev_type": "nvme", "attrs": [{"lba": "512"}, {"lba": "4096"}]}"#,
    );
    assert!(stderr_of(&twice).contains("given twice"));
    // modify --jsonfile replaces the whole definition.
    let replaced = env.with_stdin(
        &["modify", "-u", B, "--jsonfile", "-"],
        r#"{"mdev_type": "ccw", "start": "auto", "attrs": [{"store": "ram:1M"}]}"#,
    );
    assert!(replaced.status.success(), "{}", stderr_of(&replaced));
    assert_eq!(state(B)["mdev_type"], "ccw");
}

/// A modify that changes only the start policy does not check the options again: a
/// definition whose file has gone can still be switched off (or on, with a warning that it
/// cannot start); one that changes an option is checked as define checks.
#[test]
fn the_start_policy_of_a_definition_whose_file_has_gone_can_be_changed() {
    let env = Dirs::new();
    let image = env.path().join("img3");
    std::fs::File::create(&image).unwrap().set_len(1 << 20).unwrap();
    env.ok(&["define", "-t", "nvme", "-u", A, "--auto", "--opt", &format!("ns1=file:{}", image.display())]);
    std::fs::remove_file(&image).unwrap();
    let gone = format!("{}: No such file", image.display());
    let manual = env.umdev(&["modify", "-u", A, "--manual"]);
    assert!(
        manual.status.success() && !stderr_of(&manual).contains("cannot start"),
        "{}",
        stderr_of(&manual)
    );
    // Made --auto as it is, with a warning that it cannot start.
    let auto = env.umdev(&["modify", "-u", A, "--auto"]);
    assert!(auto.status.success(), "{}", stderr_of(&auto));
    let warned = stderr_of(&auto);
    assert!(warned.contains(&format!("{A} is --auto now, but it cannot start as defined")), "{warned}");
    assert!(warned.contains(&gone), "{warned}");
    assert_eq!(json(&env.ok(&["list", "-d", "--json", "-u", A]))[0]["start"], "auto");
    env.ok(&["modify", "-u", A, "--manual"]);
    let rows = json(&env.ok(&["list", "-d", "--json", "-u", A]));
    assert_eq!((rows[0]["start"].as_str(), rows[0]["state"].as_str()), (Some("manual"), Some("invalid")));
    assert!(env.fails(&["modify", "-u", A, "--opt", "lba=4096"]).contains(&gone));
    assert!(env.fails(&["modify", "-u", A, "--auto", "--pin-mode", "lock"]).contains(&gone));
    assert_eq!(json(&env.ok(&["list", "-d", "--json", "-u", A]))[0]["start"], "manual", "nothing written");
}

#[test]
fn a_defined_device_starts_as_defined_unless_overridden() {
    let env = Dirs::new();
    env.ok(&["define", "-t", "nvme", "-u", A, "--opt", "ns1=ram:16M"]);
    let daemon = env.daemon(&[]);
    let extra = env.fails(&["start", "-u", A, "--opt", "queues=2"]);
    assert!(extra.contains("is defined") && extra.contains("--override"), "{extra}");
    assert!(env.fails(&["start", "-u", A, "--pin-mode", "lock"]).contains("--override"));
    assert!(env
        .fails(&["start", "-u", A, "-t", "ccw"])
        .contains(&format!("{A} is defined as a nvme device, not ccw")));
    let started = env.ok(&["start", "-u", A, "-t", "nvme", "--override", "--opt", "queues=2"]);
    assert_eq!(started.lines().nth(1).map(str::trim), Some("over its definition: queues=2"), "{started}");
    let running = json(&env.ok(&["list", "--json", "-u", A]));
    assert_eq!(running[0]["options"]["params"], json(r#"{"ns1": "ram:16M", "queues": "2"}"#));
    let defined = json(&env.ok(&["list", "-d", "--json"]));
    assert_eq!(
        (defined[0]["state"].as_str(), defined[0]["overrides"]["params"]["queues"].as_str()),
        (Some("running"), Some("2"))
    );
    assert!(env.ok(&["list", "-d"]).contains("started with queues=2 over its definition"));
    // Plain starts of it say nothing of overrides.
    env.ok(&["stop", "-u", A]);
    assert_eq!(env.ok(&["start", "-u", A]).lines().count(), 1);
    // A running instance's config keeps its definition's start policy.
    env.ok(&["modify", "-u", A, "--auto"]);
    assert_eq!(json(&env.ok(&["list", "--dumpjson", "-u", A]))["start"], "auto");
    // A start policy is not what the instance runs as: no restart is asked for; an option is.
    let policy = env.umdev(&["modify", "-u", A, "--manual"]);
    assert!(
        policy.status.success() && !stderr_of(&policy).contains("stop and start"),
        "{}",
        stderr_of(&policy)
    );
    let option = env.umdev(&["modify", "-u", A, "--auto", "--opt", "queues=3"]);
    assert!(stderr_of(&option).contains("stop and start it to apply the change"), "{}", stderr_of(&option));
    // --override needs a definition to put options over.
    let none = env.fails(&["start", "-t", "ccw", "--override"]);
    assert!(none.contains("--override puts options over a device's definition"), "{none}");
    stop(daemon);
}

/// mdevctl's habit: `define -u UUID` without a type defines the instance running under that
/// UUID as it runs (its type and options; options given go over them). A UUID nothing runs
/// under, or no daemon to ask, is refused, asking for the type.
#[test]
fn define_without_a_type_defines_a_running_instance_as_it_runs() {
    const C: &str = "5a1e4c36-0f8e-4a5e-9d2f-00000000e003";
    let env = Dirs::new();
    let daemon = env.daemon(&[]);
    env.ok(&["start", "-t", "ccw", "-u", A, "--opt", "subchannels=2", "--pin-mode", "lock"]);
    env.ok(&["start", "-t", "ccw", "-u", B, "--opt", "subchannels=2"]);
    let defined = env.umdev(&["define", "-u", A]);
    assert!(defined.status.success(), "{}", stderr_of(&defined));
    assert_eq!(String::from_utf8_lossy(&defined.stdout).trim(), A);
    assert!(
        stderr_of(&defined).contains(&format!("defined {A} as it runs: ccw pin_mode=lock subchannels=2")),
        "{}",
        stderr_of(&defined)
    );
    let running = json(&env.ok(&["list", "--json", "-u", A]));
    let rows = json(&env.ok(&["list", "-d", "--json"]));
    let row = |uuid: &str| rows.as_array().unwrap().iter().find(|r| r["uuid"] == uuid).unwrap().clone();
    assert_eq!((row(A)["mdev_type"].as_str(), row(A)["start"].as_str()), (Some("ccw"), Some("manual")));
    assert_eq!(row(A)["options"], running[0]["options"], "defined with what it runs with");
    assert_eq!(row(A)["state"], "running", "in sync with its instance");
    // --auto as ever; options given go over the running ones.
    let defined = env.umdev(&["define", "-u", B, "--auto", "--opt", "subchannels=4"]);
    assert!(defined.status.success(), "{}", stderr_of(&defined));
    assert!(
        stderr_of(&defined).contains(&format!(
            "defined {B} from how it runs, with the options given over it (restart it to run so): ccw subchannels=4"
        )),
        "not 'as it runs': {}",
        stderr_of(&defined)
    );
    let rows = json(&env.ok(&["list", "-d", "--json"]));
    let b = rows.as_array().unwrap().iter().find(|r| r["uuid"] == B).unwrap();
    assert_eq!((b["start"].as_str(), b["state"].as_str()), (Some("auto"), Some("changed")), "{b}");
    assert_eq!(b["options"]["params"], json(r#"{"subchannels": "4"}"#), "{b}");
    // Nothing runs under C: the type is asked for, and nothing is defined.
    let err = env.fails(&["define", "-u", C]);
    assert!(err.contains(&format!("no instance with UUID {C} runs on")) && err.contains("-t"), "{err}");
    let err = env.fails(&["define"]);
    assert!(err.contains("give a type (-t TYPE), --jsonfile, or the UUID of a running instance"), "{err}");
    // A UUID already defined is refused as such, running or not: not sent to -t, which would
    // be refused all the same.
    let defined = |uuid: &str| {
        let err = env.fails(&["define", "-u", uuid]);
        assert!(err.contains(&format!("a device with UUID {uuid} is already defined")), "{err}");
        assert!(!err.contains("give its type"), "{err}");
    };
    defined(A);
    env.ok(&["stop", "-u", A]);
    defined(A);
    stop(daemon);
    defined(B);
    let err = env.fails(&["define", "-u", C]);
    assert!(err.contains("daemon is not running") && err.contains("give its type with -t"), "{err}");
    assert_eq!(json(&env.ok(&["list", "-d", "--json"])).as_array().unwrap().len(), 2);
}

#[test]
fn a_definition_that_did_not_start_says_why_and_a_stopped_one_is_stopped() {
    let env = Dirs::new();
    env.ok(&["define", "-t", "testdev", "-u", A, "--auto"]);
    env.ok(&["define", "-t", "testdev", "-u", B, "--auto"]);
    // Room for one: the other auto definition cannot start.
    let daemon = env.daemon(&["--max-instances", "1"]);
    let rows = json(&env.ok(&["list", "-d", "--json"]));
    let state = |uuid: &str| rows.as_array().unwrap().iter().find(|r| r["uuid"] == uuid).unwrap().clone();
    assert_eq!(state(A)["state"], "running");
    assert_eq!(state(B)["state"], "not-started");
    assert!(state(B)["error"].as_str().unwrap().contains("maximum of 1 instances"), "{}", state(B));
    assert!(env
        .ok(&["list", "-d"])
        .contains("not-started  (out of sync: defined with --auto but not running: the daemon"));
    // Stopped on purpose, an auto definition is stopped, not out of sync; B now starts.
    env.ok(&["stop", "-u", A]);
    env.ok(&["start", "-u", B]);
    let rows = json(&env.ok(&["list", "-d", "--json"]));
    let states: Vec<&str> = rows.as_array().unwrap().iter().map(|r| r["state"].as_str().unwrap()).collect();
    assert_eq!(states, ["stopped", "running"]);
    assert!(rows[1].get("error").is_none(), "a start clears the last error");
    // start --jsonfile: a transient device from mdevctl's config.
    env.ok(&["stop", "-u", B]);
    let config = r#"{"mdev_type": "ccw", "attrs": [{"store": "ram:1M"}, {"subchannels": "2"}]}"#;
    let started = env.with_stdin(&["start", "--jsonfile", "-"], config);
    assert!(started.status.success(), "{}", stderr_of(&started));
    let running = json(&env.ok(&["list", "--json", "-t", "ccw"]));
    assert_eq!(running[0]["options"]["params"], json(r#"{"store": "ram:1M", "subchannels": "2"}"#));
    stop(daemon);
}

/// What the daemon warns of while it starts a device reaches the user of `umdev start`, on
/// stderr as the CLI's own warnings, and stays in the daemon's log: an nvme RAM namespace
/// larger than the host's memory and swap starts (it is sparse), with a warning.
#[test]
fn a_starts_warnings_reach_its_user_and_the_daemons_log() {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let kib = |field: &str| -> u64 {
        let line = meminfo.lines().find(|l| l.starts_with(field)).unwrap_or_else(|| panic!("{field}"));
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    if (kib("MemTotal:") + kib("SwapTotal:")) << 10 >= 1 << 40 {
        return eprintln!("SKIPPED: the host has 1 TiB of memory and swap or more; ram:1T warns of nothing");
    }
    let env = Dirs::new();
    let daemon = env.daemon(&[]);
    let started = env.umdev(&["start", "-t", "nvme", "-u", A, "--opt", "ns1=ram:1T"]);
    assert!(started.status.success(), "{}", stderr_of(&started));
    let warning = "umdev: nvme: the RAM namespaces hold 1024.0 GiB and the host has";
    assert!(stderr_of(&started).contains(warning), "{}", stderr_of(&started));
    assert!(stderr_of(&started).contains("where ram_pages=4k takes 4 KiB"), "{}", stderr_of(&started));
    assert!(String::from_utf8_lossy(&started.stdout).starts_with(A), "the start's own output is unchanged");
    let log = std::fs::read_to_string(env.log()).unwrap();
    assert!(log.contains("nvme: the RAM namespaces hold 1024.0 GiB"), "{log}");
    // On 4 KiB pages the warning has no word about huge pages.
    let small = env.umdev(&[
        "start",
        "-t",
        "nvme",
        "-u",
        "5a1e4c36-0f8e-4a5e-9d2f-00000000e004",
        "--opt",
        "ns1=ram:1T",
        "--opt",
        "ram_pages=4k",
    ]);
    assert!(small.status.success(), "{}", stderr_of(&small));
    assert!(
        stderr_of(&small).contains(warning) && !stderr_of(&small).contains("ram_pages"),
        "{}",
        stderr_of(&small)
    );
    // A start without a warning prints none, and other requests carry none.
    let quiet = env.umdev(&["start", "-t", "nvme", "-u", B, "--opt", "ns1=ram:16M"]);
    assert!(quiet.status.success() && stderr_of(&quiet).is_empty(), "{}", stderr_of(&quiet));
    let list = env.umdev(&["list"]);
    assert!(list.status.success() && stderr_of(&list).is_empty(), "{}", stderr_of(&list));
    stop(daemon);
}

/// An nvme RAM namespace's memory is taken by the daemon in the background once the device
/// is made, before any client comes (`ram_populate=background`, the default on `thp`), as its
/// statistics say (`taken_ahead`); with `ram_populate=off` only as the guest writes.
#[test]
fn a_ram_namespace_is_taken_ahead_of_its_writes_unless_asked_not_to() {
    const MIB: u64 = 64;
    let env = Dirs::new();
    let daemon = env.daemon(&[]);
    let ns = format!("ns1=ram:{MIB}M");
    let rss = || status_kib(daemon.id(), "RssAnon:") >> 10;
    let before = rss();
    for (uuid, extra) in [(B, "ram_populate=off"), (A, "ram_populate=background")] {
        let started = env.umdev(&["start", "-t", "nvme", "-u", uuid, "--opt", &ns, "--opt", extra]);
        assert!(started.status.success(), "{}", stderr_of(&started));
    }
    let ahead = |uuid: &str| {
        let out = env.umdev(&["stats", "-u", uuid]);
        assert!(out.status.success(), "{}", stderr_of(&out));
        json(&String::from_utf8_lossy(&out.stdout))["device"]["namespaces"][0]["taken_ahead"].clone()
    };
    // Counts events, not time: the pass ends once it has taken the disk (or found it more
    // than the host can afford, the host's memory taken by the tests beside this one).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(300);
    let on = loop {
        let on = ahead(A);
        if on["state"] != "taking" {
            break on;
        }
        assert!(std::time::Instant::now() < deadline, "{on}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert_eq!(ahead(B), serde_json::Value::Null, "ram_populate=off: no pass");
    if on["state"] == "unaffordable" {
        stop(daemon);
        return eprintln!("SKIPPED: the daemon found {MIB} MiB more than it could afford here: {on}");
    }
    assert_eq!(on, serde_json::json!({"bytes": MIB << 20, "state": "done"}));
    assert!(rss() >= before + MIB, "the daemon holds the disk: RssAnon {} MiB, {before} before", rss());
    stop(daemon);
}

/// Where io_uring is refused (a seccomp filter here: `kernel.io_uring_disabled`, a global
/// sysctl, is not for tests running side by side), `--pin-mode kernel` is refused with why,
/// what to do, and that the other modes need no io_uring, by `umdev run` before it serves and
/// by a daemon's start; the daemon starts other modes as ever.
#[test]
fn kernel_pin_mode_where_io_uring_is_refused_says_why_and_what_to_do() {
    let sysctl = std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled").unwrap_or_default();
    let says = |err: &str| {
        assert!(
            err.contains(
                "pin mode kernel: kernel pins need io_uring buffer registration, and io_uring_setup failed: \
                 Operation not permitted"
            ),
            "{err}"
        );
        assert!(err.contains("; pin modes lock and track need no io_uring (--pin-mode lock)"), "{err}");
        // The filter's doing, unless the host's sysctl refuses io_uring too.
        if matches!(sysctl.trim(), "" | "0") {
            assert!(err.contains("(a seccomp filter or an LSM policy); allow io_uring_setup"), "{err}");
        }
    };
    let env = Dirs::new();
    let socket = env.path().join("kernel.sock");
    let mut run = umdev();
    run.args(["run", "-t", "testdev", "--pin-mode", "kernel", "--socket", socket.to_str().unwrap()]);
    deny_io_uring(&mut run);
    let out = run.output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr_of(&out));
    says(&stderr_of(&out));
    assert!(!socket.exists(), "nothing served");
    let mut command = env.daemon_command(&[]);
    deny_io_uring(&mut command);
    let daemon = env.daemon_from(command);
    let err = env.fails(&["start", "-t", "testdev", "-u", A, "--pin-mode", "kernel"]);
    says(&err);
    assert!(!env.run.join(format!("{A}.sock")).exists());
    env.ok(&["start", "-t", "testdev", "-u", A, "--pin-mode", "lock"]);
    env.ok(&["start", "-t", "testdev", "-u", B, "--pin-mode", "track"]);
    stop(daemon);
}

#[test]
fn an_unusable_definition_is_listed_as_invalid_and_can_be_undefined() {
    let env = Dirs::new();
    env.ok(&["define", "-t", "testdev", "-u", A, "--auto"]);
    // A copy under another name: its file and its content disagree.
    std::fs::copy(env.state.join(format!("{A}.json")), env.state.join(format!("{B}.json"))).unwrap();
    let rows = json(&env.ok(&["list", "-d", "--json"]));
    let b = rows.as_array().unwrap().iter().find(|r| r["uuid"] == B).unwrap();
    assert_eq!(b["state"], "invalid");
    assert!(b["error"].as_str().unwrap().contains(&format!("it holds UUID {A}")), "{b}");
    // What cannot be read is null, not a placeholder; in_sync is there whatever the state,
    // null when it cannot be told (no daemon).
    assert_eq!(
        (&b["mdev_type"], &b["start"], &b["in_sync"]),
        (&json("null"), &json("null"), &json("false")),
        "{b}"
    );
    let a = rows.as_array().unwrap().iter().find(|r| r["uuid"] == A).unwrap();
    assert_eq!((a["state"].as_str(), a.get("in_sync")), (Some("unknown"), Some(&json("null"))), "{a}");
    let daemon = env.daemon(&[]);
    assert!(env.fails(&["start", "-u", B]).contains("holds UUID"));
    let text = env.ok(&["list", "-d"]);
    assert!(
        text.contains(&format!("{B} - - invalid  (out of sync: it cannot be started: definition")),
        "{text}"
    );
    env.ok(&["undefine", "-u", B]);
    assert_eq!(json(&env.ok(&["list", "-d", "--json"])).as_array().unwrap().len(), 1);
    stop(daemon);
}

#[test]
fn a_dead_daemons_sockets_are_named_and_removed_and_one_daemon_holds_its_directories() {
    let env = Dirs::new();
    let mut daemon = env.daemon(&[]);
    let started = env.ok(&["start", "-t", "testdev", "-u", A]);
    let socket = env.run.join(format!("{A}.sock"));
    assert!(started.contains(socket.to_str().unwrap()));
    // A second daemon on the same directories is refused, naming the first.
    let second = env.umdev(&["daemon"]);
    assert!(
        stderr_of(&second).contains(&format!("another umdev daemon (pid {})", daemon.id())),
        "{}",
        stderr_of(&second)
    );
    assert!(!stderr_of(&second).contains("EAGAIN"), "no errno for a lock held: {}", stderr_of(&second));
    let other_run = env.path().join("run2");
    let other = umdev()
        .args([
            "--run-dir",
            other_run.to_str().unwrap(),
            "--state-dir",
            env.state.to_str().unwrap(),
            "daemon",
        ])
        .output()
        .unwrap();
    // Named by its pid though its pid file is in the other run directory; and the run
    // directory this failed daemon made is gone with it.
    let refused = format!("another umdev daemon (pid {}) already uses the definitions in", daemon.id());
    assert!(stderr_of(&other).contains(&refused), "{}", stderr_of(&other));
    assert!(!other_run.exists(), "the refused daemon left the run directory it made");

    daemon.kill().unwrap();
    daemon.wait().unwrap();
    assert!(socket.exists() && env.run.join("control.sock").exists(), "SIGKILL leaves the sockets");
    let list = env.fails(&["list"]);
    assert!(list.contains("stale control socket"), "{list}");
    let daemon = env.daemon(&[]);
    assert!(!socket.exists(), "the dead daemon's instance socket is removed");
    let log = std::fs::read_to_string(env.log()).unwrap();
    assert!(log.contains("removed 2 stale socket(s)"), "{log}");
    assert_eq!(env.ok(&["list"]), "");
    stop(daemon);
}

/// Each failure names what it is about: the UUID nothing has, the control socket that
/// cannot be reached, what is where the control socket should be, the option given twice.
#[test]
fn errors_name_what_they_are_about() {
    let env = Dirs::new();
    env.ok(&["define", "-t", "ccw", "-u", A, "--opt", "subchannels=2"]);
    let unknown = env.fails(&["list", "-d", "--dumpjson", "-u", B]);
    assert!(unknown.contains(&format!("no device with UUID {B} is defined")), "{unknown}");
    // A change that removes a key twice, or sets and removes it, is refused as such.
    let twice = env.fails(&["modify", "-u", A, "--delopt", "subchannels", "--delopt", "subchannels"]);
    assert!(twice.contains("--delopt subchannels given twice"), "{twice}");
    let both = env.fails(&["modify", "-u", A, "--opt", "subchannels=3", "--delopt", "subchannels"]);
    assert!(both.contains("--opt subchannels=3 and --delopt subchannels conflict"), "{both}");
    let mode = env.fails(&["modify", "-u", A, "--pin-mode", "lock", "--delopt", "pin_mode"]);
    assert!(mode.contains("--pin-mode and --delopt pin_mode conflict"), "{mode}");
    assert_eq!(json(&env.ok(&["list", "-d", "--json"]))[0]["options"]["params"]["subchannels"], "2");
    // A control socket that cannot be reached is named (here its directory is a file).
    let file = env.path().join("not-a-dir");
    std::fs::write(&file, "").unwrap();
    let out = umdev().args(["--run-dir", file.to_str().unwrap(), "list"]).output().unwrap();
    let err = stderr_of(&out);
    assert!(
        err.contains(&format!("not asking a daemon through {}/control.sock", file.display()))
            && err.contains("not a directory"),
        "{err}"
    );
    // A directory where the control socket goes: the daemon cannot start, and leaves nothing;
    // a client says what is there.
    private_dir(&env.run);
    std::fs::create_dir(env.run.join("control.sock")).unwrap();
    let daemon = env.fails(&["daemon"]);
    assert!(daemon.contains("not a socket"), "{daemon}");
    assert!(!env.run.join("daemon.pid").exists(), "a daemon that did not start left its pid file");
    let list = env.fails(&["list"]);
    assert!(list.contains("control.sock is a directory, not a socket; remove it"), "{list}");
    assert!(!list.contains("stale"), "{list}");
    std::fs::remove_dir(env.run.join("control.sock")).unwrap();
    let daemon = env.daemon(&[]);
    let unknown = env.fails(&["list", "--dumpjson", "-u", B]);
    assert!(unknown.contains(&format!("no running instance has UUID {B}")), "{unknown}");
    stop(daemon);
}

/// `--run-dir` and `--state-dir` are taken only by the commands that use them: another
/// command refuses one (a usage error, naming the commands that take it) rather than ignore
/// it, wherever on the line it stands. The environment variables reach every command.
#[test]
fn a_directory_option_a_command_does_not_use_is_refused() {
    let env = Dirs::new();
    let (run, state) = (env.run.to_str().unwrap(), env.state.to_str().unwrap());
    let socket = env.path().join("run.sock");
    let config = env.path().join("config.json");
    std::fs::write(&config, r#"{"mdev_type": "testdev", "start": "manual"}"#).unwrap();
    let refused: [(&[&str], &str); 9] = [
        (&["--run-dir", run, "completions", "zsh"], "`umdev completions` does not use --run-dir"),
        // define asks the daemon only for the running instance it defines: given a type or a
        // config, it would ignore the directory.
        (
            &["define", "-t", "testdev", "-u", A, "--run-dir", run],
            "this `umdev define` does not use --run-dir",
        ),
        (
            &["--run-dir", run, "define", "--jsonfile", config.to_str().unwrap()],
            "it asks no daemon (only `umdev define -u UUID` without -t or --jsonfile does",
        ),
        (&["define", "--run-dir", run], "this `umdev define` does not use --run-dir"),
        (&["undefine", "-u", A, "--run-dir", run], "`umdev undefine` does not use --run-dir"),
        (&["--state-dir", state, "stats", "-u", A], "`umdev stats` does not use --state-dir"),
        (&["stop", "--state-dir", state, "-u", A], "`umdev stop` does not use --state-dir"),
        (
            &["--run-dir", run, "run", "-t", "testdev", "--socket", socket.to_str().unwrap()],
            "`umdev run` does not use --run-dir",
        ),
        (&["completions", "bash", "--state-dir", state], "`umdev completions` does not use --state-dir"),
    ];
    for (args, message) in refused {
        // The variables name the test's directories: a command that took what it should
        // refuse would change them (checked below), never the machine's.
        let out = env.command().args(args).stdin(Stdio::null()).output().unwrap();
        let err = stderr_of(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(message), "{args:?}: {err}");
    }
    let err = stderr_of(&umdev().args(["--run-dir", run, "man"]).output().unwrap());
    assert!(
        err.contains(
            "only daemon, types, start, stop, list, define -u UUID without -t or --jsonfile, modify and stats do"
        ),
        "{err}"
    );
    assert!(!env.state.exists() && !socket.exists(), "nothing was done");
    // The form that asks the daemon takes it (over the variable): with none running there,
    // it says so.
    let other = env.path().join("other-run");
    let asked = env.command().args(["define", "-u", A, "--run-dir"]).arg(&other).output().unwrap();
    let err = stderr_of(&asked);
    assert_eq!(asked.status.code(), Some(1), "{err}");
    assert!(err.contains("daemon is not running") && err.contains("give its type with -t"), "{err}");
    assert!(err.contains(&other.join("control.sock").display().to_string()), "{err}");
    assert!(!env.state.exists(), "nothing was defined");
    // The commands that use a directory take its option; the environment reaches them all.
    umdev().args(["--state-dir", state, "define", "-t", "testdev", "-u", A]).output().unwrap();
    assert!(env.ok(&["list", "-d"]).contains(A));
    let listed = umdev().args(["--run-dir", run, "--state-dir", state, "list", "-d"]).output().unwrap();
    assert!(String::from_utf8_lossy(&listed.stdout).contains(A), "{}", stderr_of(&listed));
    env.ok(&["undefine", "-u", A]);
}

/// A shared directory (sticky and writable by others, as /tmp) is refused by every command
/// and never changed; one of the user's own that others may write to is changed only by a
/// command that writes there, and refused, unchanged, by one that only reads.
#[test]
fn a_query_never_changes_a_directorys_mode_and_a_shared_one_is_refused() {
    let env = Dirs::new();
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    let shared = env.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let at = |flag: &str, dir: &std::path::Path, args: &[&str]| {
        let mut all = vec![flag.to_string(), dir.to_str().unwrap().to_string()];
        all.extend(args.iter().map(|a| a.to_string()));
        // The test's own run directory unless a flag names another: a daemon at the machine's
        // default one would otherwise be asked.
        umdev().args(&all).env("UMDEV_RUN_DIR", &env.run).stdin(Stdio::null()).output().unwrap()
    };
    for (flag, args) in [
        ("--state-dir", &["list", "-d"][..]),
        ("--state-dir", &["list", "-d", "--json"]),
        ("--state-dir", &["define", "-t", "testdev"]),
        ("--run-dir", &["daemon"]),
        ("--run-dir", &["list"]),
    ] {
        let mut args = args.to_vec();
        let state = env.state.to_str().unwrap();
        if flag == "--run-dir" && args[0] == "daemon" {
            args.extend(["--state-dir", state]);
        }
        let out = at(flag, &shared, &args);
        let err = stderr_of(&out);
        assert_eq!(mode(&shared), 0o1777, "{args:?} changed the shared directory: {err}");
        assert!(!out.status.success(), "{args:?}");
        assert!(
            err.contains("a shared directory") && err.contains("use a directory of its own"),
            "{args:?}: {err}"
        );
    }
    // One's own directory others may write to: a listing refuses it (anyone could have put
    // a definition there) and leaves its mode; a definition written there takes that write
    // access away, and then it is listed.
    let open = env.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    for args in [&["list", "-d"][..], &["start", "-t", "testdev", "-u", A]] {
        let refused = at("--state-dir", &open, args);
        assert!(!refused.status.success(), "{args:?}");
        let err = stderr_of(&refused);
        assert!(err.contains("its group or others may write to it"), "{args:?}: {err}");
        assert!(err.contains(&format!("chmod go-w {}", open.display())), "{args:?}: {err}");
        assert_eq!(mode(&open), 0o777);
    }
    let defined = at("--state-dir", &open, &["define", "-t", "testdev"]);
    assert!(defined.status.success(), "{}", stderr_of(&defined));
    assert!(stderr_of(&defined).contains("write access removed"), "{}", stderr_of(&defined));
    assert_eq!(mode(&open), 0o755);
    assert!(at("--state-dir", &open, &["list", "-d"]).status.success());
}

/// The daemon's reload (SIGHUP) and its start of a definition refuse a definitions directory
/// its group may write to (a group member could plant an auto definition, `ns1=file:` any
/// path), and change nothing; a start of a type, which needs no definition, is not refused.
/// Once a command that writes there has taken that access away, a reload reads it again.
#[test]
fn a_daemon_refuses_definitions_its_group_may_write() {
    let env = Dirs::new();
    let daemon = env.daemon(&[]);
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    std::fs::set_permissions(&env.state, std::fs::Permissions::from_mode(0o770)).unwrap();
    // A group member's file would be theirs; the test, which cannot give one away, plants one
    // its group may write to, which is refused the same way.
    let planted = serde_json::json!({"uuid": B, "mdev_type": "testdev", "start": "auto"});
    let planted_path = env.state.join(format!("{B}.json"));
    std::fs::write(&planted_path, planted.to_string()).unwrap();
    std::fs::set_permissions(&planted_path, std::fs::Permissions::from_mode(0o664)).unwrap();
    let hup = || {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(daemon.id() as i32),
            nix::sys::signal::Signal::SIGHUP,
        )
        .unwrap()
    };
    let log_shows = |what: &str| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let log = std::fs::read_to_string(env.log()).unwrap_or_default();
            if log.contains(what) {
                return;
            }
            assert!(std::time::Instant::now() < deadline, "the daemon never logged {what:?}: {log}");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    };
    hup();
    log_shows("reloading definitions");
    let log = std::fs::read_to_string(env.log()).unwrap();
    assert!(log.contains(&format!("chmod go-w {}", env.state.display())), "{log}");
    assert_eq!(env.ok(&["list"]), "", "the planted definition did not start");
    let start = env.fails(&["start", "-u", B]);
    assert!(start.contains("its group or others may write to it"), "{start}");
    assert_eq!(mode(&env.state), 0o770);
    // A start of a type under a UUID the client chose needs no definition, and reads none.
    let ad_hoc = env.ok(&["start", "-t", "testdev"]);
    let ad_hoc = ad_hoc.split_whitespace().next().unwrap().to_string();
    assert_eq!(env.ok(&["list"]).lines().filter(|l| !l.starts_with(' ')).count(), 1);
    env.ok(&["stop", "-u", &ad_hoc]);
    assert_eq!(mode(&env.state), 0o770);
    // A definition written there takes the group's write access away; the next reload reads
    // the directory, starts the definition made by `umdev define`, and refuses the planted
    // one: the directory's mode says nothing of files put there before it was fixed.
    env.ok(&["define", "-t", "testdev", "-u", A, "--auto"]);
    assert_eq!(mode(&env.state), 0o750);
    assert_eq!(mode(&env.state.join(format!("{A}.json"))) & 0o022, 0, "a definition's file is private");
    hup();
    log_shows(&format!("started defined device {A}"));
    log_shows(&format!("could not start defined device {B}"));
    let log = std::fs::read_to_string(env.log()).unwrap();
    assert!(
        log.contains(&format!("{}: mode 664: its group or others may write to it", planted_path.display())),
        "{log}"
    );
    let running = env.ok(&["list"]);
    assert!(running.contains(A) && !running.contains(B), "{running}");
    let defined = env.ok(&["list", "--defined"]);
    let b_row = defined.lines().find(|l| l.starts_with(B)).unwrap_or_else(|| panic!("{defined}"));
    assert!(b_row.contains("mode 664: its group or others may write to it"), "{defined}");
    let start = env.fails(&["start", "-u", B]);
    assert!(start.contains(&planted_path.display().to_string()) && start.contains("mode 664"), "{start}");
    assert!(!env.ok(&["list"]).contains(B));
    stop(daemon);
}

/// `list --dumpjson` (which mdevctl's users, as libvirt, run to see every device) shows an
/// instance whose definition file cannot be used as manual, with a warning, rather than
/// failing the whole listing; a definitions directory that may hold others' files fails it.
#[test]
fn one_bad_definition_file_does_not_fail_the_mdevctl_listing() {
    let env = Dirs::new();
    let daemon = env.daemon(&[]);
    env.ok(&["define", "-t", "testdev", "-u", A, "--auto"]);
    env.ok(&["start", "-u", A]);
    env.ok(&["start", "-t", "testdev", "-u", B]);
    let file = env.state.join(format!("{A}.json"));
    std::fs::write(&file, "{ not json").unwrap();
    let out = env.umdev(&["list", "--dumpjson"]);
    assert!(out.status.success(), "{}", stderr_of(&out));
    let listing = json(&String::from_utf8_lossy(&out.stdout));
    let text = listing.to_string();
    assert!(text.contains(A) && text.contains(B), "{text}");
    assert!(!text.contains("auto"), "{text}");
    let err = stderr_of(&out);
    assert!(err.contains(A) && err.contains(&file.display().to_string()), "{err}");
    // A file its group may write to is refused as one, not as the directory.
    let good = serde_json::json!({"uuid": A, "mdev_type": "testdev", "start": "auto"});
    std::fs::write(&file, good.to_string()).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o664)).unwrap();
    let out = env.umdev(&["list", "--dumpjson"]);
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("auto"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(stderr_of(&out).contains("mode 664"), "{}", stderr_of(&out));
    // The directory is checked once, and fails the listing.
    std::fs::set_permissions(&env.state, std::fs::Permissions::from_mode(0o770)).unwrap();
    let err = env.fails(&["list", "--dumpjson"]);
    assert!(err.contains(&format!("chmod go-w {}", env.state.display())), "{err}");
    std::fs::set_permissions(&env.state, std::fs::Permissions::from_mode(0o700)).unwrap();
    stop(daemon);
}

/// A command asks no daemon through a control socket that may be another user's (in a run
/// directory others may write to, as a /tmp/umdev-$UID another user made first; one that is
/// another user's; a socket of another user's): it would read a start's options and could
/// answer with an instance socket of its own. Nothing is sent, and nothing is changed.
#[test]
fn no_daemon_is_asked_through_a_socket_that_may_be_another_users() {
    let env = Dirs::new();
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    private_dir(&env.run);
    let control = env.run.join("control.sock");
    let listener = std::os::unix::net::UnixListener::bind(&control).unwrap();
    listener.set_nonblocking(true).unwrap();
    let commands: [&[&str]; 6] = [
        &["list"],
        &["types"],
        &["start", "-t", "testdev", "--pin-mode", "lock"],
        &["stop", "-u", A],
        &["stats", "-u", A],
        &["list", "--dumpjson"],
    ];
    let refused = |want: &str| {
        for args in commands {
            let err = env.fails(args);
            assert!(
                err.contains(&format!("not asking a daemon through {}", control.display())),
                "{args:?}: {err}"
            );
            assert!(err.contains(want), "{args:?}: {err}");
            let accepted = listener.accept();
            assert!(
                matches!(&accepted, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
                "{args:?} connected: {accepted:?}"
            );
        }
    };
    std::fs::set_permissions(&env.run, std::fs::Permissions::from_mode(0o777)).unwrap();
    refused(&format!("chmod go-w {}", env.run.display()));
    assert_eq!(mode(&env.run), 0o777, "a client changes no mode");
    // A modify is made, and whether the device runs is not asked.
    env.ok(&["define", "-t", "testdev", "-u", A]);
    let out = env.umdev(&["modify", "-u", A, "--pin-mode", "lock"]);
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert!(stderr_of(&out).contains("could not be asked: not asking a daemon"), "{}", stderr_of(&out));
    std::fs::set_permissions(&env.run, std::fs::Permissions::from_mode(0o700)).unwrap();
    if !nix::unistd::geteuid().is_root() {
        return eprintln!("SKIPPED the rest: another user's socket or directory needs root to make");
    }
    let theirs = nix::unistd::Uid::from_raw(65534);
    nix::unistd::chown(&control, Some(theirs), None).unwrap();
    refused("the socket belongs to uid 65534, not 0 (this user's)");
    nix::unistd::chown(&control, Some(nix::unistd::Uid::from_raw(0)), None).unwrap();
    nix::unistd::chown(&env.run, Some(theirs), None).unwrap();
    refused("owned by uid 65534, not 0");
}

/// A definitions directory that is not the running daemon's is refused where it would be
/// used (`start` naming one, `list --defined`, `list --dumpjson`), naming both; the daemon's
/// under another spelling is the daemon's.
#[test]
fn definitions_the_daemon_does_not_read_are_refused() {
    let env = Dirs::new();
    let daemon = env.daemon(&[]);
    let other = env.path().join("other-state");
    let (run, theirs) = (env.run.to_str().unwrap(), env.state.to_str().unwrap());
    let with_state = |state: &str, args: &[&str]| {
        umdev()
            .args(["--run-dir", run, "--state-dir", state])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    for args in [&["start", "-t", "testdev", "-u", B][..], &["list", "-d"], &["list", "--dumpjson"]] {
        let out = with_state(other.to_str().unwrap(), args);
        assert!(!out.status.success(), "{args:?}");
        let err = stderr_of(&out);
        let want =
            format!("reads the definitions in {}, not {} (named here)", env.state.display(), other.display());
        assert!(err.contains(&want) && err.contains(&format!("--state-dir {theirs}")), "{args:?}: {err}");
    }
    assert_eq!(env.ok(&["list"]), "", "nothing was started");
    // A start of a type without -u reads no definition, wherever they are.
    let ad_hoc = with_state(other.to_str().unwrap(), &["start", "-t", "testdev"]);
    assert!(ad_hoc.status.success(), "{}", stderr_of(&ad_hoc));
    let ad_hoc = String::from_utf8_lossy(&ad_hoc.stdout).split_whitespace().next().unwrap().to_string();
    env.ok(&["stop", "-u", &ad_hoc]);
    // The variable names a directory as the option does; a default that is not the daemon's
    // is refused by the listing of definitions.
    let out = env.command().args(["list", "-d"]).env("UMDEV_STATE_DIR", &other).output().unwrap();
    assert!(stderr_of(&out).contains("(named here)"), "{}", stderr_of(&out));
    let config = env.path().join("config");
    let out = umdev()
        .args(["--run-dir", run, "list", "-d"])
        .env_remove("UMDEV_STATE_DIR")
        .env("XDG_CONFIG_HOME", &config)
        .env("HOME", &config)
        .output()
        .unwrap();
    let err = stderr_of(&out);
    assert!(err.contains("(this command's default)") && err.contains(theirs), "{err}");
    // The same directory by another path is the same.
    let again = format!("{theirs}/../state/.");
    let started = with_state(&again, &["start", "-t", "testdev", "-u", A]);
    assert!(started.status.success(), "{}", stderr_of(&started));
    assert!(with_state(&again, &["list", "-d"]).status.success());
    let link = env.path().join("link");
    std::os::unix::fs::symlink(&env.state, &link).unwrap();
    let listed = with_state(link.to_str().unwrap(), &["list", "-d"]);
    assert!(listed.status.success(), "{}", stderr_of(&listed));
    stop(daemon);
}

/// A daemon that takes the request and never answers: the command gives up after the wait
/// `UMDEV_CONTROL_TIMEOUT_MS` sets (60 s by default), naming the socket; a value outside
/// 1..=3600000 ms is refused before anything is sent.
#[test]
fn a_daemon_that_does_not_answer_is_named_after_the_wait_the_environment_sets() {
    let env = Dirs::new();
    private_dir(&env.run);
    let control = env.run.join("control.sock");
    let listener = std::os::unix::net::UnixListener::bind(&control).unwrap();
    let list = |timeout: &str| {
        umdev()
            .arg("--run-dir")
            .arg(&env.run)
            .arg("list")
            .env("UMDEV_CONTROL_TIMEOUT_MS", timeout)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    for bad in ["0", "3600001", "soon", "-5"] {
        let out = list(bad);
        assert!(!out.status.success());
        let err = stderr_of(&out);
        assert!(err.contains(&format!("UMDEV_CONTROL_TIMEOUT_MS=\"{bad}\"")), "{err}");
        assert!(err.contains("from 1 to 3600000"), "{err}");
    }
    // The fake daemon: accepts, holds the connection, answers nothing.
    let (done, wait) = std::sync::mpsc::channel::<()>();
    let fake = std::thread::spawn(move || {
        let (held, _) = listener.accept().unwrap();
        let _ = wait.recv();
        drop(held);
    });
    let out = list("200");
    done.send(()).unwrap();
    // Had the command not connected, this lets the fake's accept return.
    let _ = std::os::unix::net::UnixStream::connect(&control);
    fake.join().unwrap();
    assert!(!out.status.success());
    let err = stderr_of(&out);
    assert!(
        err.contains(&format!("the umdev daemon at {} did not answer within 200ms", control.display())),
        "{err}"
    );
}

/// A start or stop the daemon took but did not answer in time may still happen: the message
/// says so and names the device, whose UUID a start chooses before it asks (so one started
/// without -u can be found). A start of a type asks nothing before (its UUID needs no
/// definition); a start -u asks the daemon's definitions directory first. Hermetic: every
/// directory is the test's, and the fake daemon answers the status a start asks for.
/// Whatever the machine's speed: the status is answered as soon as the fake daemon gets to
/// it, but a command that gave up on it first (the wait is 200 ms) is a failure of that step,
/// not of the test; what each command sent is known without waiting for anything to time out
/// (the test's own request, sent after the command ended, comes last).
#[test]
fn a_start_or_stop_that_is_not_answered_in_time_names_its_device() {
    use std::io::{BufRead, Write};
    let env = Dirs::new();
    private_dir(&env.run);
    let control = env.run.join("control.sock");
    let listener = std::os::unix::net::UnixListener::bind(&control).unwrap();
    // The fake daemon: answers each status (its definitions are the test's), reads every
    // other request and answers none, until the test is done with it.
    let (done, wait) = std::sync::mpsc::channel::<()>();
    let (requests, received) = std::sync::mpsc::channel::<serde_json::Value>();
    let state = env.state.clone();
    let fake = std::thread::spawn(move || {
        let mut held = Vec::new();
        loop {
            let (mut conn, _) = listener.accept().unwrap();
            if wait.try_recv().is_ok() {
                return;
            }
            let mut line = String::new();
            std::io::BufReader::new(&conn).read_line(&mut line).unwrap();
            let request = json(&line);
            if request["op"] == "status" {
                let status = serde_json::json!({"instances": [], "definitions": state});
                // A command that gave up waiting has closed its end.
                let _ = writeln!(conn, "{}", serde_json::json!({"ok": true, "result": status}));
            } else {
                held.push(conn);
            }
            requests.send(request).unwrap();
        }
    });
    // A command's stderr and the requests it sent: connections are accepted in the order they
    // were made, so the test's marker, sent once the command has ended, is received after them.
    let ask = |args: &[&str]| {
        let out = env.command().args(args).env("UMDEV_CONTROL_TIMEOUT_MS", "200").output().unwrap();
        assert!(!out.status.success(), "{args:?}");
        let mut marker = std::os::unix::net::UnixStream::connect(&control).unwrap();
        writeln!(marker, "{}", serde_json::json!({"op": "marker"})).unwrap();
        let mut sent = Vec::new();
        loop {
            let request = received.recv().unwrap();
            if request["op"] == "marker" {
                return (stderr_of(&out), sent);
            }
            sent.push(request);
        }
    };
    let ops = |sent: &[serde_json::Value]| {
        sent.iter().map(|r| r["op"].as_str().unwrap_or("?").to_string()).collect::<Vec<_>>()
    };
    let (err, sent) = ask(&["start", "-t", "testdev"]);
    assert_eq!(ops(&sent), ["start"], "no status asked: {sent:?}");
    let request = &sent[0];
    let uuid = request["uuid"].as_str().expect("a UUID chosen by the client").to_string();
    assert!(uuid::Uuid::parse_str(&uuid).is_ok(), "{request}");
    assert_eq!(request["generated"], true, "the daemon is told to look up no definition: {request}");
    assert!(err.contains("did not answer within 200ms"), "{err}");
    assert!(err.contains(&format!("the device {uuid} may still start: see `umdev list`")), "{err}");
    // The daemon's definitions directory is asked first; the start is sent only if that was
    // answered in time (on a loaded machine it may not have been).
    let (err, sent) = ask(&["start", "-t", "testdev", "-u", A]);
    assert!(err.contains("did not answer within 200ms"), "{err}");
    match ops(&sent).as_slice() {
        [status, start] if status == "status" && start == "start" => {
            assert_eq!(
                (&sent[1]["uuid"], &sent[1]["generated"]),
                (&serde_json::json!(A), &serde_json::json!(false))
            );
            assert!(err.contains(&format!("the device {A} may still start")), "{err}");
        }
        [status] if status == "status" => assert!(!err.contains("may still start"), "{err}"),
        _ => panic!("a status, then a start: {sent:?}"),
    }
    let (err, sent) = ask(&["stop", "-u", A]);
    assert_eq!(ops(&sent), ["stop"], "no status asked: {sent:?}");
    assert_eq!(sent[0]["uuid"].as_str(), Some(A));
    assert!(err.contains(&format!("{A} may still stop: see `umdev list`")), "{err}");
    assert!(!env.state.exists(), "no definition was written");
    done.send(()).unwrap();
    // The fake's accept returns, and it ends.
    let _ = std::os::unix::net::UnixStream::connect(&control);
    fake.join().unwrap();
}

/// `umdev <args>` writing into a pipe nobody reads any more (`umdev ... | head -0`): it must
/// end quietly with status 0.
fn into_a_closed_pipe(env: &Dirs, args: &[&str]) {
    let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
    drop(read);
    let out = env.command().args(args).stdout(Stdio::from(write)).stderr(Stdio::piped()).output().unwrap();
    assert!(out.status.success(), "umdev {args:?} into a closed pipe: {} {}", out.status, stderr_of(&out));
    assert!(!stderr_of(&out).contains("panicked"), "{}", stderr_of(&out));
}

#[test]
fn a_closed_stdout_ends_a_command_quietly() {
    let env = Dirs::new();
    env.ok(&["define", "-t", "testdev", "-u", A]);
    for args in [&["types", "-v"][..], &["list", "-d"], &["completions", "bash"], &["man"], &["--help"]] {
        into_a_closed_pipe(&env, args);
    }
    let daemon = env.daemon(&[]);
    env.ok(&["start", "-u", A]);
    for args in [&["list"][..], &["list", "--json"], &["stats", "-u", A], &["types", "--json"]] {
        into_a_closed_pipe(&env, args);
    }
    stop(daemon);
}

#[test]
fn umdev_run_prints_journal_lines_only() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("m.sock");
    let mut child = common::process::run_with_stderr(
        &socket,
        &["--log-format", "journal", "-t", "mtty-1", "--opt", "backend=pty"],
        Stdio::piped(),
    );
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::Signal::SIGTERM)
        .unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(child.wait().unwrap().success());
    let lines: Vec<&str> = err.lines().collect();
    assert!(lines.len() >= 5, "{err}");
    for line in &lines {
        assert!(
            line.starts_with("<6>") || line.starts_with("<4>") || line.starts_with("<3>"),
            "{line:?} in {err}"
        );
    }
    assert!(err.contains("<6>  port 0: pty /dev/pts/") && err.contains("on exit: {"), "{err}");
}

#[cfg(feature = "bench")]
mod benches {
    use std::path::Path;
    use std::time::{Duration, Instant};

    use super::*;

    #[test]
    fn the_demo_into_a_closed_pipe_cleans_up() {
        let env = Dirs::new();
        into_a_closed_pipe(&env, &["demo"]);
        let left: Vec<String> = std::fs::read_dir(std::env::temp_dir())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().to_string())
            .filter(|n| n.starts_with("umdev-scratch-demo-"))
            .filter(|n| {
                let pid: i32 = n.trim_start_matches("umdev-scratch-demo-").parse().unwrap_or(0);
                // Ours, or another's that is gone: a demo running now may hold its own.
                !Path::new(&format!("/proc/{pid}")).exists()
            })
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn a_benchmark_refuses_nothing_to_do() {
        let env = Dirs::new();
        let only = env.fails(&["nvmebench", "--only", "bogus"]);
        assert!(only.contains("selects no workload (they are 4k-randread"), "{only}");
        assert!(env.fails(&["pinbench", "--rounds", "0"]).contains("0"));
        assert!(env.fails(&["pinbench", "--threads", "1,0"]).contains("0"));
        assert!(env.fails(&["ccwbench", "--mode", "pinned"]).contains("pinned"));
        // Choices a benchmark cannot honour are refused, not ignored.
        assert!(env.fails(&["ccwbench", "--mode", "kernel"]).contains("possible values: track, lock"));
        let both = env.fails(&["pinbench", "--threads", "1", "--svg", "/tmp/never.svg"]);
        assert!(both.contains("cannot be used with"), "{both}");
        // A directory named for the benchmark's files must exist: it is not made.
        // --dir belongs to --fixed-buffers, also beside an option --fixed-buffers refuses.
        let alone = env.fails(&["nvmebench", "--quick", "--dir", "/tmp"]);
        assert!(alone.contains("--fixed-buffers"), "{alone}");
        let beside = env.fails(&["nvmebench", "--quick", "--dir", "/tmp", "--only", "128k"]);
        assert!(beside.contains("give --fixed-buffers with it"), "{beside}");
        let gone = env.fails(&["nvmebench", "--quick", "--fixed-buffers", "--dir", "/nonexistent-umdev/x"]);
        assert!(gone.contains("not a directory"), "{gone}");
        assert!(!std::path::Path::new("/nonexistent-umdev").exists());
        let small = tempfile::NamedTempFile::new().unwrap();
        small.as_file().set_len(64 << 20).unwrap();
        let path = small.path().to_str().unwrap();
        let short = env.fails(&["nvmebench", "--quick", "--fixed-buffers", "--file", path]);
        assert!(short.contains("bytes; the benchmark needs 268435456"), "{short}");
        // The server under test refuses its options: its own words come through.
        let refused = env.fails(&["nvmebench", "--quick", "--opt", "lba=3"]);
        assert!(refused.contains("bad option for type nvme: lba=3: one of 512, 4096"), "{refused}");
        // An option overrides the benchmark's own, but not below what its workloads use.
        let few = env.fails(&["nvmebench", "--quick", "--opt", "queues=1"]);
        assert!(few.contains("the benchmark's workloads need queues=2 at least"), "{few}");
        let small_ram = env.fails(&["nvmebench", "--quick", "--opt", "ns1=ram:64M"]);
        assert!(small_ram.contains("need a namespace of 256 MiB at least"), "{small_ram}");
        let small_file = env.fails(&["nvmebench", "--quick", "--opt", &format!("ns1=file:{path}")]);
        assert!(small_file.contains("need a namespace of 256 MiB at least"), "{small_file}");
        assert!(
            !small_file.contains("[1/") && !small_ram.contains("[1/"),
            "it ran: {small_ram} {small_file}"
        );
    }

    /// `nvmebench --file` with a path relative to the caller's directory (the server takes
    /// absolute ones only) and shadow doorbells: at queue depth 1 a command costs at most
    /// one doorbell message (its SQ tail; the CQ heads go to the shadow page only), where
    /// register doorbells cost two. Every completion at queue depth 1 interrupts, and with
    /// `--poll` (CQs without interrupts) none does.
    #[test]
    fn nvmebench_takes_a_relative_file_and_shadow_doorbells_spare_messages() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::File::create(dir.path().join("ns.img")).unwrap().set_len(256 << 20).unwrap();
        let run = |shadow: bool, poll: bool| {
            let mut cmd = umdev();
            cmd.current_dir(dir.path()).args([
                "nvmebench",
                "--quick",
                "--json",
                "--only",
                "4k-randread",
                "--file",
                "ns.img",
                // Buffered: a tmpfs /tmp has no O_DIRECT.
                "--opt",
                "cache1=writeback",
            ]);
            if shadow {
                cmd.arg("--shadow-doorbells");
            }
            if poll {
                cmd.arg("--poll");
            }
            let out = cmd.output().unwrap();
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            assert_eq!(report["shadow_doorbells"], shadow);
            assert_eq!(report["poll"], poll);
            let rows = report["rows"].as_array().unwrap().clone();
            assert_eq!(rows.len(), 4, "{report}");
            assert!(rows.iter().all(|r| r["iops"].as_f64().unwrap() > 0.0), "{report}");
            for r in &rows {
                let interrupts = r["interrupts_per_io"].as_f64().unwrap();
                if poll {
                    assert!(interrupts == 0.0, "interrupts while polling: {report}");
                } else if r["qd"] == 1 {
                    // Each completion is alone: its own interrupt (about: the run's end may
                    // catch one raised but not yet counted).
                    assert!(interrupts > 0.9, "{report}");
                }
            }
            let qd1 = rows.iter().find(|r| r["qd"] == 1 && r["queues"] == 1).unwrap();
            qd1["doorbell_messages_per_io"].as_f64().unwrap()
        };
        // Two per command but the last (its SQ tail message is not sent: the run ends).
        let registers = run(false, false);
        assert!(registers > 1.0, "{registers} messages per command with register doorbells");
        let shadowed = run(true, false);
        assert!(shadowed <= 1.0, "{shadowed} messages per command with shadow doorbells");
        let polled = run(true, true);
        assert!(polled <= 1.0, "{polled} messages per command with shadow doorbells, polled");
    }

    /// `bench/file-compare` runs both of its clients and the host's fio on one file, and
    /// sets each row against the host's run with as many reads in flight, round by round
    /// (skipped where no fio can be had).
    #[test]
    fn file_compare_sets_nvmebench_beside_the_hosts_fio() {
        // On disk: the file is read with O_DIRECT.
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let img = dir.path().join("ns.img");
        std::fs::File::create(&img).unwrap().set_len(256 << 20).unwrap();
        let report = dir.path().join("report.json");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/file-compare");
        let out = std::process::Command::new(script)
            .args(["--rounds", "1", "--seconds", "1", "--quick", "--umdev", env!("CARGO_BIN_EXE_umdev")])
            .arg("--file")
            .arg(&img)
            .arg("--json")
            .arg(&report)
            .output()
            .unwrap();
        if out.status.code() == Some(77) {
            return eprintln!("SKIPPED: {}", stderr_of(&out));
        }
        assert!(out.status.success(), "{}", stderr_of(&out));
        let text = String::from_utf8_lossy(&out.stdout);
        let printed = text.lines().filter(|l| l.starts_with("interrupts ") || l.starts_with("poll ")).count();
        assert_eq!(printed, 8, "{text}");
        let r = json(&std::fs::read_to_string(&report).unwrap());
        let table = r["table"].as_array().unwrap();
        assert_eq!(table.len(), 8, "{r}");
        let round = &r["rounds"][0];
        for row in table {
            let (side, q, qd) = (row["client"].as_str().unwrap(), &row["queues"], &row["qd"]);
            let umdev = round[side][format!("q{q}-qd{qd}")]["iops"].as_f64().unwrap();
            let host_qd = row["host_qd"].as_u64().unwrap();
            let want = (q.as_u64().unwrap() * qd.as_u64().unwrap()).min(32);
            assert_eq!(host_qd, want, "{row}");
            let host = round["host"][format!("qd{host_qd}")].as_f64().unwrap();
            assert!(umdev > 0.0 && host > 0.0, "{row}");
            let ratio = row["vs_host"].as_f64().unwrap();
            assert!((ratio - umdev / host).abs() < 1e-9, "{row}: {umdev} / {host}");
            // One round: its ratio is the median and the range.
            assert_eq!(
                (row["vs_host_min"].as_f64(), row["vs_host_max"].as_f64()),
                (Some(ratio), Some(ratio))
            );
        }
    }

    /// The pids of `pid`'s children.
    fn children(pid: u32) -> Vec<u32> {
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()
    }

    #[test]
    fn a_stopped_benchmark_leaves_no_server_and_no_directory() {
        use std::io::BufRead;
        for signal in [nix::sys::signal::Signal::SIGINT, nix::sys::signal::Signal::SIGTERM] {
            let mut bench = ChildGuard(
                umdev()
                    .args(["nvmebench", "--quick"])
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap(),
            );
            let pid = bench.id();
            let mut lines = std::io::BufReader::new(bench.stderr.take().unwrap()).lines();
            // Progress shows on stderr while it runs; by the second step both servers run.
            let mut seen = Vec::new();
            while !seen.iter().any(|l: &String| l.contains("[2/")) {
                seen.push(lines.next().expect("progress lines").unwrap());
            }
            assert!(seen[0].starts_with("umdev nvmebench: [1/"), "{seen:?}");
            let servers = children(pid);
            assert_eq!(servers.len(), 2, "two umdev run servers");
            let dir = std::env::temp_dir().join(format!("umdev-scratch-nvmebench-{pid}"));
            assert!(dir.exists());
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), signal).unwrap();
            let rest: Vec<String> = lines.map_while(Result::ok).collect();
            let status = bench.wait().unwrap();
            assert_eq!(status.code(), Some(128 + signal as i32), "{rest:?}");
            assert!(!dir.exists(), "{} left behind", dir.display());
            // The servers are gone (reaped by the benchmark, or by init once it exited).
            let deadline = Instant::now() + Duration::from_secs(20);
            for server in servers {
                while Path::new(&format!("/proc/{server}")).exists()
                    && std::fs::read_to_string(format!("/proc/{server}/stat"))
                        .is_ok_and(|s| !s.contains(") Z "))
                {
                    assert!(Instant::now() < deadline, "server {server} still runs");
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
    }

    /// A pipe already full: a process writing to its write end blocks until the read end
    /// (returned first) is read or closed.
    fn full_pipe() -> (std::os::fd::OwnedFd, std::os::fd::OwnedFd) {
        use std::io::Write;
        let flags = nix::fcntl::OFlag::O_CLOEXEC | nix::fcntl::OFlag::O_NONBLOCK;
        let (read, write) = nix::unistd::pipe2(flags).unwrap();
        let mut filling = std::fs::File::from(write.try_clone().unwrap());
        loop {
            match filling.write(&[b'x'; 4096]) {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("filling the pipe: {e}"),
            }
        }
        nix::fcntl::fcntl(&write, nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::empty())).unwrap();
        (read, write)
    }

    /// A benchmark killed with SIGKILL cleans up nothing: its directory stays, and the next
    /// run (any benchmark, or the demo) removes it, and says so; a live run's stays.
    #[test]
    fn the_directory_a_killed_benchmark_left_is_removed_by_the_next_run() {
        let tmp = tempfile::tempdir().unwrap();
        let protobench = || {
            let mut command = umdev();
            command.args(["protobench", "--quick"]).env("TMPDIR", tmp.path()).stdout(Stdio::null());
            command
        };
        // Its stderr a full pipe: it blocks at its first progress line, its directory made.
        let (read, write) = full_pipe();
        let mut killed = ChildGuard(protobench().stderr(Stdio::from(write)).spawn().unwrap());
        let left = tmp.path().join(format!("umdev-scratch-protobench-{}", killed.id()));
        let deadline = Instant::now() + Duration::from_secs(60);
        while !left.exists() {
            assert!(Instant::now() < deadline, "{} never made", left.display());
            std::thread::sleep(Duration::from_millis(10));
        }
        killed.kill().unwrap();
        killed.wait().unwrap();
        drop(read);
        assert!(left.exists(), "SIGKILL leaves the directory");
        // A run in progress: this test's own pid, a live process's.
        let live = tmp.path().join(format!("umdev-scratch-ccwbench-track-{}", std::process::id()));
        std::fs::create_dir(&live).unwrap();
        std::fs::set_permissions(&live, std::fs::Permissions::from_mode(0o700)).unwrap();
        let next = protobench().output().unwrap();
        assert!(next.status.success(), "{}", stderr_of(&next));
        let removed = format!("removed 1 temporary director(ies) that killed runs left: {}", left.display());
        assert!(stderr_of(&next).contains(&removed), "{}", stderr_of(&next));
        assert!(!left.exists(), "{} left behind", left.display());
        assert!(live.exists(), "a live run's directory is not removed");
        let names: Vec<String> = std::fs::read_dir(tmp.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into())
            .collect();
        assert_eq!(names, [live.file_name().unwrap().to_string_lossy()], "the run removed its own");
    }

    #[test]
    fn a_benchmark_draws_a_bar_on_a_terminal() {
        use std::io::Read;
        let pty = nix::pty::openpty(None, None).unwrap();
        let mut bench = ChildGuard(
            umdev()
                .args(["ccwbench", "--quick", "--mode", "track"])
                .stdout(Stdio::null())
                .stderr(Stdio::from(pty.slave))
                .spawn()
                .unwrap(),
        );
        // The terminal's other end, until the benchmark closes its side (EIO).
        let mut master = std::fs::File::from(pty.master);
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n) = master.read(&mut buf) {
            if n == 0 {
                break;
            }
            seen.extend_from_slice(&buf[..n]);
        }
        assert!(bench.wait().unwrap().success());
        let seen = String::from_utf8_lossy(&seen);
        assert!(seen.contains("ccwbench [") && seen.contains("track:"), "{seen:?}");
        assert!(!seen.contains("umdev ccwbench: [1/"), "lines are for logs, not terminals: {seen:?}");
    }

    /// `--svg` names a file the picture cannot go to: refused before anything is measured
    /// (with --json each row is printed as it is measured: none is); a picture that fails
    /// to be written loses none of the figures, which are printed first.
    #[test]
    fn pinbench_checks_its_picture_first_and_prints_its_figures_whatever_becomes_of_it() {
        let env = Dirs::new();
        let out =
            env.umdev(&["pinbench", "--json", "--rounds", "1", "--svg", "/nonexistent-umdev/dir/x.svg"]);
        assert!(!out.status.success());
        assert!(
            stderr_of(&out).contains("creating /nonexistent-umdev/dir/x.svg: No such file"),
            "{}",
            stderr_of(&out)
        );
        assert!(out.stdout.is_empty() && !stderr_of(&out).contains("[1/"), "it ran: {}", stderr_of(&out));
        let full = std::path::Path::new("/dev/full");
        if !full.exists() {
            return eprintln!("SKIPPED the rest: no /dev/full to fail a write");
        }
        let mode = std::fs::metadata(full).unwrap().permissions().mode();
        let out = env.umdev(&["pinbench", "--rounds", "1", "--batch-us", "1", "--svg", "/dev/full"]);
        assert!(!out.status.success());
        let err = stderr_of(&out);
        assert!(err.contains("writing /dev/full") && err.contains("only the picture is missing"), "{err}");
        assert!(String::from_utf8_lossy(&out.stdout).contains("bookkeeping:"), "no table printed");
        assert!(full.exists() && std::fs::metadata(full).unwrap().permissions().mode() == mode);
    }

    /// `--svg` replaces a picture only with a whole one: a run that fails (its output closed
    /// after the first row) or is stopped (SIGINT while it waits to print, so no destructor
    /// runs) leaves the file that was there as it was, and no temporary file beside it; a run
    /// that ends replaces it, readable by everyone.
    #[test]
    fn pinbench_replaces_a_picture_only_with_a_whole_one() {
        let env = Dirs::new();
        let svg = env.path().join("old.svg");
        std::fs::write(&svg, "the old picture").unwrap();
        let temporary = || -> Vec<String> {
            std::fs::read_dir(env.path())
                .unwrap()
                .flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .filter(|n| n.starts_with(".old.svg."))
                .collect()
        };
        let args = ["pinbench", "--json", "--rounds", "1", "--batch-us", "1", "--svg", svg.to_str().unwrap()];
        into_a_closed_pipe(&env, &args);
        assert_eq!(std::fs::read_to_string(&svg).unwrap(), "the old picture");
        assert!(temporary().is_empty(), "{:?}", temporary());
        // Its output a full pipe: it blocks printing its first row, the picture's file made.
        let (read, write) = full_pipe();
        let log = env.path().join("pinbench.log");
        let mut child = ChildGuard(
            env.command()
                .args(args)
                .stdout(Stdio::from(write))
                .stderr(std::fs::File::create(&log).unwrap())
                .spawn()
                .unwrap(),
        );
        let deadline = Instant::now() + Duration::from_secs(60);
        while temporary().is_empty() {
            assert!(Instant::now() < deadline, "no temporary picture was made");
            std::thread::sleep(Duration::from_millis(10));
        }
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGINT,
        )
        .unwrap();
        assert_eq!(child.wait().unwrap().code(), Some(128 + libc::SIGINT));
        drop(read);
        let said = std::fs::read_to_string(&log).unwrap();
        assert!(said.contains("and 1 temporary file(s)"), "{said}");
        assert_eq!(std::fs::read_to_string(&svg).unwrap(), "the old picture");
        assert!(temporary().is_empty(), "{:?}", temporary());
        // A run that ends replaces it.
        env.ok(&args);
        assert!(std::fs::read_to_string(&svg).unwrap().contains("<svg"));
        assert_eq!(std::fs::metadata(&svg).unwrap().permissions().mode() & 0o777, 0o644);
        assert!(temporary().is_empty(), "{:?}", temporary());
    }

    #[test]
    fn pinbench_writes_a_picture_everyone_can_read_and_stops_at_a_closed_pipe() {
        let env = Dirs::new();
        let svg = env.path().join("grid.svg");
        env.ok(&["pinbench", "--rounds", "1", "--batch-us", "1", "--svg", svg.to_str().unwrap()]);
        assert_eq!(std::fs::metadata(&svg).unwrap().permissions().mode() & 0o777, 0o644);
        into_a_closed_pipe(&env, &["pinbench", "--rounds", "1", "--batch-us", "1", "--json"]);
    }
}

/// The CLI's own warnings read `umdev: ...`, as its other messages do (README, *Logs*), not as
/// env_logger's lines: here the one about a definitions directory others could write to.
#[test]
fn a_cli_warning_reads_as_the_cli_speaks() {
    let env = Dirs::new();
    std::fs::create_dir(&env.state).unwrap();
    std::fs::set_permissions(&env.state, std::fs::Permissions::from_mode(0o770)).unwrap();
    let defined = env.umdev(&["define", "-t", "testdev"]);
    assert!(defined.status.success(), "{}", stderr_of(&defined));
    let stderr = stderr_of(&defined);
    let line =
        stderr.lines().find(|l| l.contains("its group or others could write to it")).unwrap_or_default();
    assert!(line.starts_with("umdev: "), "{stderr}");
}

/// A file where a directory is wanted is named as such, not as "File exists".
#[test]
fn a_file_given_as_a_directory_is_called_no_directory() {
    let env = Dirs::new();
    std::fs::write(&env.state, "").unwrap();
    let err = env.fails(&["define", "-t", "testdev"]);
    assert!(err.contains("not a directory") && !err.contains("File exists"), "{err}");
}
