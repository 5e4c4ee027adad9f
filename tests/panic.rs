//! A device that panics on purpose, over a real socket: the request it was handling fails
//! (EIO for a register access; the request's documented failure for a worker's request),
//! and the device, the connection and the server go on; a detach does not wait for a
//! request that can never finish.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::raw::*;
use common::Harness;
use crossbeam::channel::{unbounded, Sender};
use umdev_mdev::irq::IrqHandle;
use umdev_mdev::pci::{Bar, ClassCode, ConfigSpaceBuilder, PciDevice, PciIds, SimpleFunction};
use umdev_mdev::request::{self, Completion, Lane, Permit};
use umdev_mdev::{DeviceContext, DeviceError};

/// The result register: 0 idle, 1 done, 2 failed.
#[derive(Default)]
struct State {
    result: u32,
    scratch: u32,
}

struct Work {
    state: Arc<Mutex<State>>,
    panic: bool,
}

impl Completion for Work {
    type Outcome = ();
    type Shared = ();
    fn complete(self, (): (), _ctx: &DeviceContext, (): &()) {
        umdev_mdev::sync::lock(&self.state).result = 1;
    }
    fn fail(self, _ctx: &DeviceContext, (): &()) {
        umdev_mdev::sync::lock(&self.state).result = 2;
    }
}

/// BAR0: 0x0 panics when written; 0x4 SCRATCH; 0x8 starts a request on the worker (value 1:
/// a request whose handling panics); 0xc the last request's result.
struct Panicky {
    state: Arc<Mutex<State>>,
    lane: Lane,
    work: Sender<Permit<Work>>,
    _irq: IrqHandle,
}

impl SimpleFunction for Panicky {
    fn bar_read(&mut self, _bar: u8, offset: u64, data: &mut [u8]) -> Result<(), DeviceError> {
        let state = umdev_mdev::sync::lock(&self.state);
        let value = match offset {
            0x4 => state.scratch,
            0xc => state.result,
            _ => 0,
        };
        data.copy_from_slice(&value.to_le_bytes()[..data.len()]);
        Ok(())
    }

    fn bar_write(&mut self, _bar: u8, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        let value = u32::from_le_bytes(data.try_into().map_err(|_| DeviceError::Errno(libc::EINVAL))?);
        match offset {
            0x0 => panic!("a register write the device cannot handle, on purpose"),
            0x4 => umdev_mdev::sync::lock(&self.state).scratch = value,
            0x8 => {
                umdev_mdev::sync::lock(&self.state).result = 0;
                if let Ok(permit) = self.lane.begin(Work { state: self.state.clone(), panic: value == 1 }) {
                    let _ = self.work.send(permit);
                }
            }
            _ => {}
        }
        Ok(())
    }
}

fn panicky() -> PciDevice<Mutex<Panicky>> {
    let ids = PciIds {
        vendor_id: 0x1234,
        device_id: 0xdead,
        subsystem_vendor_id: 0,
        subsystem_id: 0,
        revision: 0,
        class: ClassCode { base: 0xff, sub: 0, prog_if: 0 },
    };
    let (tx, rx) = unbounded::<Permit<Work>>();
    std::thread::spawn(move || {
        for permit in rx {
            let work = permit.get();
            let done = request::serve("a panicky request", || {
                if work.panic {
                    panic!("a request the worker cannot finish, on purpose");
                }
            });
            if done.is_some() {
                permit.complete(());
            }
        }
    });
    PciDevice::new(ConfigSpaceBuilder::new(ids).bar(0, Bar::mem32(4096)), |host| {
        let lane = host.requests.lane(|| {});
        Mutex::new(Panicky { state: Arc::default(), lane, work: tx, _irq: host.irq })
    })
    .unwrap()
}

fn read(c: &mut RawClient, offset: u64) -> u32 {
    let r = c.region_read(0, offset, 4).unwrap();
    assert_eq!(r.errno(), 0);
    u32::from_le_bytes(r.payload[16..20].try_into().unwrap())
}

fn wait_result(c: &mut RawClient) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match read(c, 0xc) {
            0 if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(1)),
            r => return r,
        }
    }
}

#[test]
fn a_panicking_device_fails_the_request_and_goes_on() {
    let h = Harness::with_device(Arc::new(panicky()), |_| {});
    let mut c = RawClient::connect(&h.socket).unwrap();
    c.negotiate().unwrap();
    assert_eq!(c.region_write(0, 0x4, &7u32.to_le_bytes()).unwrap().errno(), 0);

    // A register access that panics: that request fails with EIO, nothing else does.
    let r = c.region_write(0, 0x0, &1u32.to_le_bytes()).unwrap();
    assert_eq!(r.errno(), libc::EIO);
    assert_eq!(read(&mut c, 0x4), 7, "the device goes on, its state intact");
    assert!(c.alive());

    // A worker's request that panics: its permit fails it; the next one completes.
    assert_eq!(c.region_write(0, 0x8, &1u32.to_le_bytes()).unwrap().errno(), 0);
    assert_eq!(wait_result(&mut c), 2, "failed, as documented");
    assert_eq!(c.region_write(0, 0x8, &0u32.to_le_bytes()).unwrap().errno(), 0);
    assert_eq!(wait_result(&mut c), 1, "the worker goes on");

    // A detach finds nothing in flight: it does not wait out its bound.
    let started = Instant::now();
    drop(c);
    h.wait_idle();
    assert!(started.elapsed() < Duration::from_secs(2), "detach took {:?}", started.elapsed());
    let mut next = RawClient::connect(&h.socket).unwrap();
    next.negotiate().unwrap();
    assert!(next.alive(), "the server goes on");
    assert_eq!(h.info().protocol.errors, 1, "one failed request");
}

/// A device whose attach panics at its first connection and whose detach panics at its first
/// two: BAR0's 0x0 reads how many times it was attached.
struct Fragile {
    attaches: u32,
}

impl SimpleFunction for Fragile {
    fn bar_read(&mut self, _bar: u8, _offset: u64, data: &mut [u8]) -> Result<(), DeviceError> {
        data.copy_from_slice(&self.attaches.to_le_bytes()[..data.len()]);
        Ok(())
    }

    fn bar_write(&mut self, _bar: u8, _offset: u64, _data: &[u8]) -> Result<(), DeviceError> {
        Ok(())
    }

    fn attach(&mut self, _ctx: &DeviceContext) {
        self.attaches += 1;
        if self.attaches == 1 {
            panic!("an attach the device cannot handle, on purpose");
        }
    }

    fn detach(&mut self) {
        if self.attaches <= 2 {
            panic!("a detach the device cannot handle, on purpose");
        }
    }
}

/// A panic in a device's attach or detach is the device's: the connection is served, the
/// detach's cleanup runs, and the instance takes the next client (it was left taken by a
/// client that had gone).
#[test]
fn a_device_that_panics_in_attach_or_detach_does_not_keep_its_instance() {
    let ids = PciIds {
        vendor_id: 0x1234,
        device_id: 0xdeae,
        subsystem_vendor_id: 0,
        subsystem_id: 0,
        revision: 0,
        class: ClassCode { base: 0xff, sub: 0, prog_if: 0 },
    };
    let device = PciDevice::new(ConfigSpaceBuilder::new(ids).bar(0, Bar::mem32(4096)), |_| {
        Mutex::new(Fragile { attaches: 0 })
    })
    .unwrap();
    let h = Harness::with_device(Arc::new(device), |_| {});
    for attaches in 1..=3u32 {
        let mut c = RawClient::connect(&h.socket).unwrap();
        c.negotiate().unwrap();
        assert_eq!(read(&mut c, 0x0), attaches, "connection {attaches} is served");
        drop(c);
        h.wait_idle();
    }
    let mut c = RawClient::connect(&h.socket).unwrap();
    c.negotiate().unwrap();
    assert!(c.alive());
}
