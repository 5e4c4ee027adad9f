#!/usr/bin/env python3
"""ccw_contract.py: a contract test of `umdev run --type ccw`, from the outside.

What it is
    An independent channel-I/O driver for umdev's `ccw` device (Python 3, standard library
    only), written from umdev's documentation alone: docs/ccw.md, docs/vfio-user.md and
    README.md, plus public s390 channel I/O documentation (z/Architecture Principles of
    Operation: CCW, IDAW, SCSW; Linux's vfio-ccw.rst) for what the docs name but do not spell
    out. It reads none of the server's code. The vfio-user client itself (framing, VERSION,
    DMA_MAP, SET_IRQS, eventfds, the harness) is imported from testdev_contract.py, the
    docs-only client next to this file.

    It starts its own servers (`umdev run --type ccw` with every option ccw.md documents:
    store=ram:SIZE, store=file:/PATH, the older size= and file= spellings, subchannels=1..16,
    every --pin-mode; and one `umdev daemon` for the doc's `umdev start` example), maps memfd
    guest memory (and memory without an fd, served by this client's DMA_READ/DMA_WRITE
    replies), and drives the device as a guest driver would: config space, BAR0 registers,
    channel programs (command chaining, TIC, SLI, IDA and IDA_2K lists scattered across guest
    memory and across mappings), every command (WRITE, READ, NOP, SENSE, SEEK, TIC), every
    byte of data verified, the status block and registers, MSI-X, MSI and INTx, every reason
    code, the order of the checks, halts, bus mastering, DMA_UNMAP during programs, truncated
    memory, reset and disconnect: about 570 checks, about 7 s on a 2-CPU machine. Each check
    cites the doc file and section it pins, e.g.
    "ccw.md § IDAW lists: Alignment"; "a + b" cites both.

    The doc's model differs from vfio-ccw's: there is no ORB, no I/O region and no
    CSCH/HSCH/SSCH instruction; a subchannel is a block of BAR0 registers (CPA, STATUS,
    DOORBELL 1 = start, 2 = halt; STATE; ACK), the "SCSW" is a 32-byte status block in guest
    memory plus registers, CCWs are 16 bytes (command, flags, reserved, count, 64-bit
    address) and IDAWs 8 bytes. This driver follows the doc.

What it checks (one group per doc area; --list names them)
    cli       Instance options: refusals at `umdev run` and `umdev define`; `umdev types ccw`
    pci       PCI identity: IDs, class, BAR0, capabilities, MSI/MSI-X layout, regions, IRQ info
    regs      Registers: values, access widths, unimplemented offsets, read-only writes, decode
    prog      data moves verified byte for byte, the doc's example program, position, NOP,
              SENSE, BYTES, the status block, the interrupt order
    chain     command chaining, TIC, loops, the 256-CCW limit, CPA out, CCWS, residuals,
              BadCcw/BadCommand/BadCount and their order
    idaw      4K and 2K IDAW lists, scattered pages, first-IDAW offsets, repeated blocks, exact
              list reads, lists and data across adjacent mappings, 16 MiB with 4097 IDAWs
    errors    every IDAW/data/store reason and the order of checks 2-3
    seek      SEEK's counts, SLI, incorrect length, positions at and past the store's end
    status    where the status block goes (none, unaligned, read-only, end of RAM, unmapped)
    fdless    memory mapped without an fd: data, CCWs, lists, status; partial transfers,
              read-only, the client's refusal
    start     start/halt semantics: busy, ignored starts, CPA taken at start, halts, ACK
    irq       MSI-X per subchannel, masking, PBA, MSI, INTx level and automask, BME holding
    bme       bus mastering off at start and mid-program
    unmap     DMA_UNMAP during a CCW, between CCWs, mid-transfer of fd-backed memory
    trunc     memory the client truncated (DeviceError), partway
    reset     DEVICE_RESET and disconnect, idle and mid-program; config power-on state
    store     RAM sizes (4K, 5000 bytes, 64G), file stores, their lock, older spellings
    modes     every pin mode: PIN_MODE, scattered transfers, unmap mid-transfer
    multi     16 subchannels at once, 1 subchannel
    daemon    the doc's `umdev start --type ccw ...` example through a daemon, `umdev stats`

Speed independence (as testdev_contract.py)
    - Nothing asserts on elapsed time. Every wait is for an event (an interrupt eventfd, a
      register reaching a value, a reply) with a generous bound (--timeout, 30 s).
    - A check that something does NOT happen (no interrupt, a start ignored) first makes a
      round trip (the server handles a connection's messages in arrival order), then looks
      for a short window: a slow machine can only miss a violation, never invent one.
    - A program is held mid-way deterministically, never by racing it: its data lies in
      memory mapped without an fd, and this client holds the server's DMA request for a
      block while it halts, unmaps, resets, clears bus mastering or disconnects. The server
      waits 5 s for such a reply; an attempt in which this client held one over 4 s is void
      and run again.
    - Where a race cannot be avoided (a DMA_UNMAP of pinned memfd memory during a 16 MiB
      READ), every outcome the doc allows is accepted and the doc's invariants are checked
      for whichever happened (BYTES + residual = count, exactly the blocks before the stop
      moved, in IDAW order).
    - Doc-given times (the unmap completing within milliseconds) are not checked.
    - Not checked (no way to reach them from a client, or a wall clock needed): PIN_MODE "0 with
      no client" and "with no client connected, a start is ignored" (registers are read
      through a client); DeviceError from a worker's panic, the lock limit or an mlock failure
      (this runs as root with CAP_IPC_LOCK; --max-pins stands in for "could not pin"); "nothing
      the device raises is delivered" during a reset; an unmap that finds a CCW's pins just as
      it completes; block-device stores.

How to run
    python3 ccw_contract.py --bin target/release/umdev
    python3 ccw_contract.py --bin /path/to/umdev --socket-dir /tmp --only idaw,errors

    --bin PATH         the umdev binary (default: $UMDEV_BIN, else target/release/umdev)
    --socket-dir DIR   where this run makes its own fresh directory (sockets, logs, store
                       files, the daemon's dirs); removed at exit, whatever happened
    --only A,B         run only these test groups (--list shows them)
    --timeout S        the bound on every wait for an event (default 30)
    -q, --quiet        print only FAIL and NOTE lines and the summary

    Exit status: 0 when every check passed; 1 when a check failed (the FAIL lines are repeated
    after the summary, with the last lines of the servers' logs); 2 when it could not start;
    130 when interrupted. NOTE lines (doc gaps, outcomes the doc leaves open) never fail a
    run. Servers are stopped and files removed on every exit path.
"""
import errno as E
import fcntl
import json
import mmap
import os
import random
import re
import signal
import struct
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import testdev_contract as vu  # noqa: E402
from testdev_contract import (  # noqa: E402
    R, Ev, SetupError, VfioErr, wait_until, new_session, memfd, errname, both, cite, VU, RM,
    BAR0, BAR1, BAR2, BAR3, BAR4, BAR5, ROM, CONFIG, VGA, INTX, MSI, MSIX, ERR, REQ,
    REGION_READ, REGION_WRITE, SET_IRQS, DMA_READ, DMA_WRITE,
    DATA_NONE, DATA_EVENTFD, ACTION_MASK, ACTION_UNMASK, ACTION_TRIGGER,
    RI_READ, RI_WRITE, II_EVENTFD, II_MASKABLE, II_AUTOMASKED, DMA_R, DMA_W)

POLL = 0.002
PAGE = 4096
MiB = 1 << 20
GiB = 1 << 30
U64 = (1 << 64) - 1


# ======================================================================
# Citations
# ======================================================================
def CC(section, item=None):
    return cite('ccw.md', section, item)


S_OPT = 'Instance options'
S_PCI = 'PCI identity'
S_REG = 'Registers (BAR0)'
S_CCW = 'CCW (16 bytes, 8-byte aligned)'
S_IDAW = 'IDAW lists'
S_EXEC = 'Execution'
S_SB = 'Status block (32 bytes, at STATUS)'
S_RC = 'Reason codes, and the status each ends with'
S_ORD = 'Order of the checks'
S_PART = 'A CCW that stops partway'
S_UNMAP = 'DMA unmap during I/O'
S_LIM = 'Limits'
S_LAY = 'A program, laid out'


# ======================================================================
# The device's ABI (ccw.md)
# ======================================================================
# global registers (ccw.md § Registers (BAR0))
ID, VERSION, SUBCHANNELS, PIN_MODE, STORE_LO, STORE_HI, IRQ_STATUS = 0x000, 0x004, 0x008, 0x00c, 0x010, 0x014, 0x018
CCW_ID = 0x21776363
# subchannel block n at 0x100 + 0x40 n
CPA_LO, CPA_HI, ST_LO, ST_HI, DOORBELL, STATE, ACK, DSTAT_CSTAT, RESIDUAL, REASON, CCWS, PROGRAMS, \
    BYTES_LO, BYTES_HI, CPAOUT_LO, CPAOUT_HI = range(0, 0x40, 4)
SC_REGS = ['CPA_LO', 'CPA_HI', 'STATUS_LO', 'STATUS_HI', 'DOORBELL', 'STATE', 'ACK', 'DSTAT_CSTAT', 'RESIDUAL', 'REASON',
           'CCWS', 'PROGRAMS', 'BYTES_LO', 'BYTES_HI', 'CPA_OUT_LO', 'CPA_OUT_HI']
DB_START, DB_HALT = 1, 2
IDLE, BUSY, PENDING = 0, 1, 2
MSIX_TABLE, MSIX_PBA = 0x800, 0xc00


def SC(n, off=0):
    return 0x100 + 0x40 * n + off


# commands and flags (ccw.md § CCW)
C_WRITE, C_READ, C_NOP, C_SENSE, C_SEEK, C_TIC = 0x01, 0x02, 0x03, 0x04, 0x07, 0x08
F_CD, F_CC, F_SLI, F_IDA, F_2K = 0x80, 0x40, 0x20, 0x04, 0x02
# device / subchannel status (ccw.md § Status block)
CE, DE, UC, UE = 0x08, 0x04, 0x02, 0x01
IL, PC, PROT, CCC = 0x40, 0x20, 0x10, 0x04
# reason codes (ccw.md § Reason codes)
REASONS = ['Ok', 'CcwMisaligned', 'CcwUnmapped', 'BadCcw', 'BadCommand', 'BadCount', 'ChainTooLong', 'TicToTic', 'TicLoop',
           'IdalMisaligned', 'IdalUnmapped', 'IdawMisaligned', 'DataUnmapped', 'DataReadOnly', 'EndOfStore',
           'SeekOutOfRange', 'Unmapped', 'Halted', 'DeviceError', 'BusMasterOff']
(OK, CCW_MISALIGNED, CCW_UNMAPPED, BAD_CCW, BAD_COMMAND, BAD_COUNT, CHAIN_TOO_LONG, TIC_TO_TIC, TIC_LOOP,
 IDAL_MISALIGNED, IDAL_UNMAPPED, IDAW_MISALIGNED, DATA_UNMAPPED, DATA_READ_ONLY, END_OF_STORE,
 SEEK_OUT_OF_RANGE, UNMAPPED, HALTED, DEVICE_ERROR, BUS_MASTER_OFF) = range(20)
# the subchannel-status class each reason ends with (ccw.md § Reason codes: the status column)
PROGRAM_CHECK = {CCW_MISALIGNED, CCW_UNMAPPED, BAD_CCW, BAD_COUNT, CHAIN_TOO_LONG, TIC_TO_TIC, TIC_LOOP, IDAL_MISALIGNED,
                 IDAL_UNMAPPED, IDAW_MISALIGNED, DATA_UNMAPPED}
UNIT_CHECK = {BAD_COMMAND, END_OF_STORE, SEEK_OUT_OF_RANGE, DEVICE_ERROR}
UNIT_EXCEPTION = {UNMAPPED, HALTED}


def ccw(cmd, flags=0, count=0, addr=0, rsv=0):
    """One CCW (ccw.md § CCW): command, flags, reserved (2 bytes), count (4), address (8)."""
    return struct.pack('<BBHIQ', cmd, flags, rsv, count, addr & U64)


def idaws(addrs):
    return b''.join(struct.pack('<Q', a & U64) for a in addrs)


def pattern(n, seed):
    return random.Random(seed).randbytes(n)


# guest memory layout (iovas)
RAM = 0x0                  # fd-backed guest RAM: [0, RAM_SIZE)
RAM_SIZE = 72 * MiB
ALLOC_LO, ALLOC_HI = 8 * MiB, 32 * MiB     # the page allocator's range
BIG_SRC, BIG_DST = 32 * MiB, 50 * MiB      # two 16 MiB (+) areas for the big transfers
HOLE = 0x10000000          # never mapped
RO_IOVA = 0x20000000       # fd-backed, read-only
NOFD_IOVA = 0x30000000     # mapped without an fd, read-write
NOFD_RO_IOVA = 0x31000000  # mapped without an fd, read-only
ADJ_A, ADJ_B = 0x40000000, 0x40010000      # two adjacent fd mappings of 64 KiB (distinct memfds)
EXTRA = 0x50000000         # per-test mappings (truncated memfds, lists at a mapping's end, ...)
BIG_MAP = 0x60000000       # a separate 16 MiB + 4 KiB memfd mapping for unmap-mid-transfer


class Map:
    def __init__(self, iova, size, flags, fd, buf):
        self.iova, self.size, self.flags, self.fd, self.buf = iova, size, flags, fd, buf
        self.mapped = True

    def has(self, a, n):
        return self.iova <= a and a + n <= self.iova + self.size


class Mem:
    """Guest memory: the client's mappings, by iova (memfds, or bytearrays served by the
    client's DMA_READ/DMA_WRITE replies)."""

    def __init__(self, c):
        self.c = c
        self.maps = []

    def map_fd(self, iova, size, flags=DMA_R | DMA_W, fd=None):
        fd = memfd(size) if fd is None else fd
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.c.dma_map(iova, size, flags=flags, fd=fd)
        m = Map(iova, size, flags, fd, mm)
        self.maps.append(m)
        return m

    def map_nofd(self, iova, size, flags=DMA_R | DMA_W):
        buf = bytearray(size)
        self.c.dma_map(iova, size, flags=flags)
        self.c.mem.append((iova, buf))
        m = Map(iova, size, flags, None, buf)
        self.maps.append(m)
        return m

    def unmap(self, m, forget=True):
        """DMA_UNMAP a mapping; its memory stays readable here. forget=False keeps a
        fd-less buffer served to the server's DMA (a request held before the unmap)."""
        self.c.dma_unmap(m.iova, m.size)
        m.mapped = False
        if forget and m.fd is None:
            self.c.mem = [(b, buf) for b, buf in self.c.mem if buf is not m.buf]

    def _find(self, a, n):
        for m in self.maps:
            if m.has(a, n):
                return m
        raise KeyError('%#x+%#x is in no mapping of this client' % (a, n))

    def _pieces(self, a, n):
        """(mapping, offset, length) pieces covering [a, a + n), across adjacent mappings."""
        out = []
        while n:
            m = next((x for x in self.maps if x.iova <= a < x.iova + x.size), None)
            if m is None:
                raise KeyError('%#x is in no mapping of this client' % a)
            k = min(n, m.iova + m.size - a)
            out.append((m, a - m.iova, k))
            a += k
            n -= k
        return out

    def write(self, a, data):
        o = 0
        for m, off, k in self._pieces(a, len(data)):
            m.buf[off:off + k] = data[o:o + k]
            o += k

    def read(self, a, n):
        return b''.join(bytes(m.buf[off:off + k]) for m, off, k in self._pieces(a, n))

    def fill(self, a, n, byte=0):
        self.write(a, bytes([byte]) * n)

    def close(self):
        for m in self.maps:
            if m.fd is not None:
                try:
                    m.buf.close()
                except (BufferError, ValueError):
                    pass
                try:
                    os.close(m.fd)
                except OSError:
                    pass
        self.maps = []


# ======================================================================
# Observations gathered over the whole run (checked in t_whole_run)
# ======================================================================
OBS = {
    'programs': 0,          # programs completed with an interrupt awaited
    'irq_not_one': [],      # (what, signals) where a completion did not raise exactly one
    'irq_state': [],        # (what, STATE, IRQ_STATUS) at the interrupt, not pending / bit clear
    'sb_vs_regs': [],       # (what, block, registers): the status block differs from the registers
    'sb_checked': 0,
    'dma_outside': [],      # server DMA requests outside this client's fd-less mappings
    'dma_into_ro': [],      # server DMA_WRITEs into memory mapped read-only
    'dma_reqs': 0,
    'status_seen': {},      # reason -> {(dstat, cstat)}: the exact status each reason came with
}


def watch_client(c, mem):
    """Wrap the client's DMA answering: log requests outside the fd-less mappings and writes
    into read-only ones (ccw.md § Execution: No access outside the mappings)."""
    orig = c.answer

    def answer(m, pol='answer'):
        if m.cmd in (DMA_READ, DMA_WRITE) and len(m.payload) >= 16:
            addr, count = struct.unpack_from('<QQ', m.payload)
            OBS['dma_reqs'] += 1
            inside = [x for x in mem.maps if x.fd is None and x.has(addr, count)]
            if not inside:
                OBS['dma_outside'].append((m.cmd, hex(addr), count))
            elif m.cmd == DMA_WRITE and not (inside[0].flags & DMA_W):
                OBS['dma_into_ro'].append((hex(addr), count))
                c.send_raw(vu.HDR.pack(m.id, m.cmd, 16, vu.T_REPLY | vu.F_ERROR, E.EPERM))
                return
        orig(m, pol)
    c.answer = answer


# ======================================================================
# The driver
# ======================================================================
class Res(dict):
    """A program's outcome: registers (and the status block when there was one)."""

    def show(self, keys=None):
        keys = keys or ['reason', 'dstat', 'cstat', 'residual', 'ccws', 'bytes', 'cpa_out']
        return fmtd({k: self[k] for k in keys if k in self})


def fmtd(d):
    out = []
    for k, v in d.items():
        if k == 'reason' and isinstance(v, int):
            v = '%d(%s)' % (v, REASONS[v] if v < len(REASONS) else '?')
        elif isinstance(v, int) and not isinstance(v, bool):
            v = hex(v) if v > 9 else str(v)
        out.append('%s=%s' % (k, v))
    return '{' + ', '.join(out) + '}'


class Dev:
    """A connected driver: guest RAM mapped, bus mastering on, MSI-X wired (by default)."""

    def __init__(self, sock, irq='msix', bme=True, ram=RAM_SIZE, extra_maps=True):
        self.c = new_session(sock)
        self.mem = Mem(self.c)
        watch_client(self.c, self.mem)
        self.ram = self.mem.map_fd(RAM, ram)
        self.ram_size = ram
        self.nsc = self.r(SUBCHANNELS)
        self.next = ALLOC_LO
        self.ev = [Ev() for _ in range(max(self.nsc, 1))]
        self.intx = Ev()
        self.msi = Ev()
        self.caps = {}
        cfg = self.c.region_read(CONFIG, 0, 256)
        p = cfg[0x34] & 0xfc
        seen = set()
        while p and p not in seen:
            seen.add(p)
            self.caps[cfg[p]] = p
            p = cfg[p + 1] & 0xfc
        self.irq = irq
        if irq == 'msix':
            self.msix_on()
        elif irq == 'msi':
            self.msi_on()
        elif irq == 'intx':
            self.intx_on()
        if bme:
            self.command(0x0006)

    # ---- registers ----
    def r(self, off):
        return self.c.rd(BAR0, off, 4)

    def w(self, off, v):
        self.c.wr(BAR0, off, v & 0xffffffff, 4)

    def r64(self, off):
        return self.r(off) | (self.r(off + 4) << 32)

    def sr(self, n, off):
        return self.r(SC(n, off))

    def sw(self, n, off, v):
        self.w(SC(n, off), v)

    def cfg_rd(self, off, size):
        return self.c.rd(CONFIG, off, size)

    def cfg_wr(self, off, v, size):
        self.c.wr(CONFIG, off, v, size)

    def command(self, v):
        self.cfg_wr(0x04, v, 2)

    # ---- interrupts ----
    def msix_on(self, wire=True, unmask=True):
        if wire:
            self.c.set_irqs(MSIX, DATA_EVENTFD | ACTION_TRIGGER, 0, self.nsc, fds=[e.fd for e in self.ev[:self.nsc]])
        cap = self.caps[0x11]
        self.cfg_wr(cap + 2, 0x8000, 2)
        if unmask:
            for n in range(self.nsc):
                self.c.wr(BAR0, MSIX_TABLE + 16 * n + 12, 0, 4)

    def msix_off(self):
        self.cfg_wr(self.caps[0x11] + 2, 0, 2)

    def vec_mask(self, n, masked):
        self.c.wr(BAR0, MSIX_TABLE + 16 * n + 12, 1 if masked else 0, 4)

    def msi_on(self, wire=True):
        if wire:
            self.c.set_irqs(MSI, DATA_EVENTFD | ACTION_TRIGGER, 0, 1, fds=[self.msi.fd])
        cap = self.caps[0x05]
        self.cfg_wr(cap + 4, 0xfee00000, 4)
        self.cfg_wr(cap + 8, 0, 4)
        self.cfg_wr(cap + 12, 0x4021, 2)
        self.cfg_wr(cap + 2, 0x0001, 2)

    def msi_off(self):
        self.cfg_wr(self.caps[0x05] + 2, 0, 2)

    def intx_on(self):
        self.c.set_irqs(INTX, DATA_EVENTFD | ACTION_TRIGGER, 0, 1, fds=[self.intx.fd])

    def intx_unmask(self):
        self.c.set_irqs(INTX, DATA_NONE | ACTION_UNMASK, 0, 1)

    def ev_of(self, n):
        return {'msix': self.ev[n] if n < len(self.ev) else None, 'msi': self.msi, 'intx': self.intx}.get(self.irq)

    # ---- memory ----
    def alloc(self, npages=1):
        if self.next + npages * PAGE > ALLOC_HI:
            self.next = ALLOC_LO
        a = self.next
        self.next += npages * PAGE
        self.mem.fill(a, npages * PAGE)
        return a

    def prog(self, ccws, at=None):
        """Write a channel program (a list of CCWs) to guest memory; returns its address."""
        data = b''.join(ccws)
        if at is None:
            at = self.alloc((len(data) + PAGE - 1) // PAGE)
        self.mem.write(at, data)
        return at

    def status_area(self, fill=0xee):
        a = self.alloc(1)
        self.mem.fill(a, 64, fill)
        return a

    # ---- programs ----
    def start(self, n, cpa, status=0, write_regs=True):
        if write_regs:
            self.sw(n, CPA_LO, cpa & 0xffffffff)
            self.sw(n, CPA_HI, cpa >> 32)
            self.sw(n, ST_LO, status & 0xffffffff)
            self.sw(n, ST_HI, status >> 32)
        self.sw(n, DOORBELL, DB_START)

    def regs(self, n):
        ds = self.sr(n, DSTAT_CSTAT)
        state = self.sr(n, STATE)
        if state == PENDING:
            OBS['status_seen'].setdefault(self.sr(n, REASON), set()).add((ds & 0xff, (ds >> 8) & 0xff))
        return Res(state=state, irq_status=self.r(IRQ_STATUS), dstat=ds & 0xff, cstat=(ds >> 8) & 0xff,
                   dstat_cstat=ds, residual=self.sr(n, RESIDUAL), reason=self.sr(n, REASON), ccws=self.sr(n, CCWS),
                   programs=self.sr(n, PROGRAMS), bytes=self.r64(SC(n, BYTES_LO)), cpa_out=self.r64(SC(n, CPAOUT_LO)))

    def wait_pending(self, n):
        return wait_until(lambda: self.sr(n, STATE) == PENDING)

    def finish(self, n, status=0, what='', irq=True, ack=True):
        """Wait for the end of subchannel n's program: its interrupt (irq=True, as the driver's
        interrupt handler does) or STATE pending; return its registers and status block."""
        ev = self.ev_of(n) if irq else None
        if ev is not None:
            got = ev.take(1)
            OBS['programs'] += 1
            if got != 1:
                OBS['irq_not_one'].append((what, got))
            if got == 0:
                self.wait_pending(n)
        else:
            self.wait_pending(n)
        res = self.regs(n)
        if ev is not None and (res['state'] != PENDING or not res['irq_status'] & (1 << n)):
            OBS['irq_state'].append((what, res['state'], hex(res['irq_status'])))
        if status:
            sb = parse_sb(self.mem.read(status, 32))
            res['sb'] = sb
            OBS['sb_checked'] += 1
            regs = dict(dstat=res['dstat'], cstat=res['cstat'], rsv=0, residual=res['residual'], cpa_out=res['cpa_out'],
                        reason=res['reason'], ccws=res['ccws'], bytes=res['bytes'])
            if sb != regs:
                OBS['sb_vs_regs'].append((what, fmtd(sb), fmtd(regs)))
        if ack:
            self.sw(n, ACK, 1)
        return res

    def run(self, cpa, n=0, status=None, what='', irq=True, ack=True):
        """Start a program at cpa on subchannel n and wait for its end. status=None puts the
        status block in a fresh area; 0 asks for none."""
        if status is None:
            status = self.status_area()
        self.start(n, cpa, status)
        return self.finish(n, status, what, irq=irq, ack=ack)

    def runp(self, ccws, n=0, what='', **kw):
        return self.run(self.prog(ccws), n=n, what=what, **kw)

    # ---- the store, through programs ----
    def store_write(self, pos, data, n=0):
        buf = self._scratch(len(data))
        self.mem.write(buf, data)
        opnd = self.alloc(1)
        self.mem.write(opnd, struct.pack('<Q', pos))
        r = self.runp([ccw(C_SEEK, F_CC, 8, opnd), ccw(C_WRITE, 0, len(data), buf)], n=n, what='store write', status=0)
        return r

    def store_read(self, pos, count, n=0):
        buf = self._scratch(count)
        opnd = self.alloc(1)
        self.mem.write(opnd, struct.pack('<Q', pos))
        r = self.runp([ccw(C_SEEK, F_CC, 8, opnd), ccw(C_READ, 0, count, buf)], n=n, what='store read', status=0)
        if r['reason'] != OK:
            return None
        return self.mem.read(buf, count)

    def _scratch(self, n):
        if n > 4 * MiB:
            return BIG_SRC
        return self.alloc((n + PAGE - 1) // PAGE)

    def close(self):
        try:
            self.c.close()
        except Exception:
            pass
        self.mem.close()
        for e in self.ev + [self.intx, self.msi]:
            try:
                e.close()
            except OSError:
                pass


def parse_sb(b):
    dstat, cstat, rsv, residual, cpa_out, reason, ccws_, nbytes = struct.unpack('<BBHIQIIQ', b)
    return dict(dstat=dstat, cstat=cstat, rsv=rsv, residual=residual, cpa_out=cpa_out, reason=reason, ccws=ccws_, bytes=nbytes)


def status_of(reason):
    """(device status, subchannel status) the doc gives a reason, where it gives one exactly."""
    return {OK: (CE | DE, 0)}.get(reason)


def expect(res, want, ref, what, sink=None):
    """Check a program's outcome: the fields of want, and the status class of its reason."""
    sink = sink or R
    got = {k: res.get(k) for k in want}
    ok = got == want
    return sink.check(ok, ref, '%s -> %s' % (what, fmtd(want)), fmtd(got))


def expect_reason(res, reason, ref, what, sink=None, **more):
    """The reason, the status class the reason table gives it, and any further fields."""
    sink = sink or R
    want = {'reason': reason}
    want.update(more)
    got = {k: res.get(k) for k in want}
    ok = got == want and status_ok(res, reason)
    return sink.check(ok, ref, '%s -> %s, %s' % (what, fmtd(want), status_name(reason)),
                      '%s, dstat %#x cstat %#x' % (fmtd(got), res.get('dstat', -1), res.get('cstat', -1)))


def status_name(reason):
    if reason == OK:
        return 'CE|DE'
    if reason in PROGRAM_CHECK:
        return 'program check'
    if reason in UNIT_CHECK:
        return 'unit check'
    if reason in UNIT_EXCEPTION:
        return 'unit exception'
    if reason == DATA_READ_ONLY:
        return 'protection check'
    if reason == BUS_MASTER_OFF:
        return 'channel-control check'
    return '?'


def status_ok(res, reason):
    d, c = res['dstat'], res['cstat']
    if reason == OK:
        return d == CE | DE and c & ~IL == 0
    if reason in PROGRAM_CHECK:
        return c & PC and not d & (UC | UE)
    if reason in UNIT_CHECK:
        return d & UC and not d & UE and c == 0
    if reason in UNIT_EXCEPTION:
        return d & UE and not d & UC and c == 0
    if reason == DATA_READ_ONLY:
        return c & PROT and not d & (UC | UE)
    if reason == BUS_MASTER_OFF:
        return c & CCC and not d & (UC | UE)
    return False


# ======================================================================
# The harness
# ======================================================================
class Env(vu.Harness):
    def __init__(self, binary, socket_dir):
        super().__init__(binary, socket_dir)
        self.servers = {}
        self.n = 0
        self.daemon = None

    def start(self, opts=(), extra=(), name=None):
        """`umdev run --type ccw --opt ...`; returns the process (.sock, .name)."""
        self.n += 1
        name = name or 'ccw%d' % self.n
        sock = self.path(name + '.sock')
        args = ['run', '--type', 'ccw', '--socket', sock] + list(extra)
        for o in opts:
            args += ['--opt', o]
        p = self.spawn(args, name)
        if not wait_until(lambda: p.poll() is not None or os.path.exists(sock)) or p.poll() is not None:
            raise SetupError('ccw server %s %s did not start (rc %s): %s' % (list(opts), list(extra), p.poll(), self.log_tail(name)))
        p.sock, p.name = sock, name
        return p

    def try_start(self, opts=(), extra=(), name=None):
        """Like start, but (None, its output) when the server refuses to start."""
        try:
            return self.start(opts, extra, name), ''
        except SetupError as e:
            return None, str(e)

    def server(self, key):
        """Shared servers: main (the defaults), small (store=ram:1M), s16 (16 subchannels)."""
        if key not in self.servers:
            opts = {'main': (), 'small': ('store=ram:1M',), 's16': ('subchannels=16',)}[key]
            self.servers[key] = self.start(opts, name=key)
        p = self.servers[key]
        if p.poll() is not None:
            raise SetupError('server %s exited (status %s)' % (key, p.returncode))
        return p.sock

    def refused(self, opts, extra=()):
        """Run a server that must refuse to start: (refused?, its output)."""
        self.n += 1
        sock = self.path('r%d.sock' % self.n)
        args = [self.bin, 'run', '--type', 'ccw', '--socket', sock] + list(extra)
        for o in opts:
            args += ['--opt', o]
        p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        ok = wait_until(lambda: p.poll() is not None or os.path.exists(sock))
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            out = p.communicate(timeout=vu.WAIT)[0]
        except subprocess.TimeoutExpired:
            p.kill()
            out = p.communicate()[0]
        started = os.path.exists(sock)
        if started:
            os.unlink(sock)
        return (not started and p.returncode != 0 and ok), out.strip().replace('\n', ' | ')[:300]

    def umdev(self, *args):
        p = subprocess.run([self.bin] + list(args), capture_output=True, text=True, timeout=vu.WAIT + 30)
        return p.returncode, p.stdout, p.stderr

    def stop_server(self, p):
        rc = self.stop(p)
        for k, v in list(self.servers.items()):
            if v is p:
                del self.servers[k]
        return rc


def quiet():
    time.sleep(vu.QUIET)


def no_signal(dev, ev):
    """No interrupt on ev: a round trip first, then a short window."""
    dev.c.barrier()
    return ev.take(0) == 0


def teardown(*devs):
    for d in devs:
        if d is not None:
            d.close()


def call_async(fn, *args, **kw):
    """Run fn in a thread; returns a holder: .done (Event), .result, .error."""
    class H:
        pass
    h = H()
    h.done = threading.Event()
    h.result = h.error = None

    def body():
        try:
            h.result = fn(*args, **kw)
        except Exception as e:   # noqa: BLE001 - reported by the caller
            h.error = e
        h.done.set()
    threading.Thread(target=body, daemon=True).start()
    return h


# ######################################################################
# ccw.md § Instance options
# ######################################################################
def t_cli(env):
    R.sec('Instance options (ccw.md § Instance options)')
    ref = CC(S_OPT)
    small = env.path('small.img')
    with open(small, 'wb') as f:
        f.write(b'\0' * 4095)
    ok_file = env.path('ok.img')
    with open(ok_file, 'wb') as f:
        f.write(b'\0' * 8192)
    cases = [
        (['store=ram:4095'], 'a RAM store below 4K'),
        (['store=ram:65G'], 'a RAM store above 64G'),
        (['store=ram:1T'], 'a RAM store of 1T (above 64G)'),
        (['store=ram:0'], 'a RAM store of 0'),
        (['size=2K'], 'size= below 4K'),
        (['subchannels=0'], 'subchannels=0 (1-16)'),
        (['subchannels=17'], 'subchannels=17 (1-16)'),
        (['store=file:relative.img'], 'a store file by relative path (absolute path required)'),
        (['store=file:/nonexistent/ccw-store.img'], 'a store file that does not exist'),
        (['store=file:' + small], 'a store file of 4095 bytes (at least 4 KiB)'),
        (['store=ram:1M', 'size=1M'], 'store= and size= together (one of the three at most)'),
        (['size=1M', 'file=' + ok_file], 'size= and file= together'),
        (['store=ram:1M', 'file=' + ok_file], 'store= and file= together'),
        (['store=disk:1M'], 'a store of an unknown kind'),
        (['nosuchkey=1'], 'an unknown option'),
        (['subchannels=2', 'subchannels=3'], 'a key given twice (README: each key once)'),
    ]
    for opts, what in cases:
        ok, out = env.refused(opts)
        R.check(ok, ref if 'README' not in what else both(ref, RM('Serving devices to QEMU', 'Device options')),
                'umdev run refuses %s (%s)' % (what, ' '.join(opts)), out if not ok else '')
    ok, out = env.refused([], extra=['--pin-mode', 'pinned'])
    R.check(ok, ref, 'umdev run refuses --pin-mode pinned (track|lock|kernel)', out if not ok else '')
    # umdev define checks them as umdev start does
    state = env.path('state')
    for opts, what in [(['subchannels=17'], 'subchannels=17'), (['store=ram:65G'], 'store=ram:65G'),
                       (['store=file:' + small], 'a 4095-byte store file'), (['store=ram:1M', 'size=1M'], 'store= and size=')]:
        args = ['define', '-t', 'ccw', '--state-dir', state]
        for o in opts:
            args += ['--opt', o]
        rc, out, err = env.umdev(*args)
        _, run_out = env.refused(opts)
        msg = (err.strip().splitlines() or [''])[-1]
        same = bool(msg) and any(msg.split(':', 1)[-1].strip() in line for line in [run_out])
        R.check(rc != 0, ref, '`umdev define` refuses %s, as `umdev start` does' % what, 'rc %d %s' % (rc, (out + err).strip()[:200]))
        if not same:
            R.note(ref, '`umdev define` and `umdev run` word the refusal of %s differently: %r / %r' % (what, msg[:120], run_out[:160]))
    rc, out, err = env.umdev('define', '-t', 'ccw', '--state-dir', state, '--opt', 'store=ram:1G', '--opt', 'subchannels=8',
                             '--pin-mode', 'lock')
    R.check(rc == 0, ref, '`umdev define -t ccw --opt store=ram:1G --opt subchannels=8 --pin-mode lock` accepted', (out + err).strip()[:200])
    rc, out, err = env.umdev('types', 'ccw')
    R.check(rc == 0 and all(k in out for k in ('store=', 'subchannels=', 'size=', 'file=', 'track|lock|kernel')),
            ref, '`umdev types ccw` lists store=, subchannels=, size=, file= and --pin-mode track|lock|kernel', out.strip()[:300])
    os.unlink(small)
    os.unlink(ok_file)


# ######################################################################
# ccw.md § PCI identity
# ######################################################################
def t_pci(env):
    R.sec('PCI identity (ccw.md § PCI identity; vfio-user.md § Commands)')
    ref = CC(S_PCI)
    d = Dev(env.server('main'), irq=None, bme=False)
    try:
        c = d.c
        cfg = c.region_read(CONFIG, 0, 256)
        u16 = lambda o: struct.unpack_from('<H', cfg, o)[0]   # noqa: E731
        R.eq((u16(0), u16(2)), (0x1234, 0x75cc), ref, 'vendor / device')
        R.eq((u16(0x2c), u16(0x2e)), (0x1234, 0x75cc), ref, 'subsystem vendor / subsystem')
        R.eq((cfg[0x0b], cfg[0x0a], cfg[0x09]), (0x01, 0x80, 0x00), ref, 'class / subclass / prog-if')
        R.eq(cfg[0x08], 1, ref, 'revision')
        R.eq(cfg[0x3d], 1, ref, 'interrupt pin INTA')
        bar0 = struct.unpack_from('<I', cfg, 0x10)[0]
        R.eq(bar0 & 0x7, 0, ref, 'BAR0: memory, 32-bit, not prefetchable (low bits)')
        d.cfg_wr(0x10, 0xffffffff, 4)
        sz = d.cfg_rd(0x10, 4)
        R.eq(sz & 0xfffffff0, 0xfffff000, ref, 'BAR0 sizing: 4 KiB')
        d.cfg_wr(0x10, 0, 4)
        others = []
        for off in (0x14, 0x18, 0x1c, 0x20, 0x24):
            d.cfg_wr(off, 0xffffffff, 4)
            others.append(d.cfg_rd(off, 4))
            d.cfg_wr(off, 0, 4)
        R.eq(others, [0] * 5, ref, 'BAR1-BAR5 absent (size 0 when sized)')
        R.check(cfg[0x06] & 0x10, ref, 'STATUS: capabilities list', hex(cfg[0x06]))
        caps = []
        p = cfg[0x34] & 0xfc
        while p and len(caps) < 16:
            caps.append((cfg[p], p))
            p = cfg[p + 1] & 0xfc
        R.eq(caps, [(0x01, 0x40), (0x05, 0x48), (0x11, 0x58)], ref,
             'capabilities walked from 0x34: power management at 0x40, MSI at 0x48, MSI-X at 0x58 (id, offset)')
        R.check(all(cid != 0x10 for cid, _ in caps), ref, 'no PCI Express capability', caps)
        msi_ctl = u16(0x48 + 2)
        R.check(msi_ctl & 0x80 and not msi_ctl & 0x100 and (msi_ctl >> 1) & 7 == 0, ref,
                'MSI: 64-bit, no per-vector masking, 1 vector (Multiple Message Capable 0)', hex(msi_ctl))
        mx_ctl = u16(0x58 + 2)
        table, pba = struct.unpack_from('<II', cfg, 0x58 + 4)
        R.eq(((mx_ctl & 0x7ff) + 1, table, pba), (4, 0x800, 0xc00), ref,
             'MSI-X: one vector per subchannel (4), table at BAR0 0x800, PBA at BAR0 0xc00 (BIR 0)')
        R.eq([c.rd(BAR0, MSIX_TABLE + 16 * n + 12, 4) & 1 for n in range(4)], [1] * 4, both(ref, CC(S_REG, 'Interrupts: vectors reset masked')),
             'MSI-X vectors masked at power-on (vector control bit 0)')
        R.eq(c.region_info(CONFIG)['size'], 256, ref, 'config space: 256 bytes (region size)')
        flags, nreg, nirq = struct.unpack_from('<III', c.call(vu.DEVICE_GET_INFO, struct.pack('<IIII', 16, 0, 0, 0)).payload, 4)
        R.eq((flags, nreg, nirq), (3, 9, 5), VU('Commands', 'DEVICE_GET_INFO'), 'DEVICE_GET_INFO: flags PCI|RESET, 9 regions, 5 IRQ indexes')
        ri = c.region_info(BAR0)
        for fd in ri['fds']:
            os.close(fd)
        R.eq((ri['size'], ri['flags'] & (RI_READ | RI_WRITE)), (4096, RI_READ | RI_WRITE), ref, 'BAR0 region: 4 KiB, readable and writable')
        sizes = []
        for idx in (BAR1, BAR2, BAR3, BAR4, BAR5, ROM, VGA):
            i = c.region_info(idx)
            for fd in i['fds']:
                os.close(fd)
            sizes.append(i['size'])
        R.eq(sizes, [0] * 7, ref, 'BAR1-BAR5, ROM and VGA regions have size 0')
        want = {INTX: (1, II_EVENTFD | II_MASKABLE | II_AUTOMASKED), MSI: (1, II_EVENTFD), MSIX: (4, II_EVENTFD | II_MASKABLE),
                ERR: (1, II_EVENTFD), REQ: (1, II_EVENTFD)}
        for idx, (cnt, fl) in want.items():
            _argsz, flags, _index, count = c.irq_info(idx)
            R.eq((count, flags), (cnt, fl), both(ref, VU('Commands', 'GET_IRQ_INFO')),
                 'GET_IRQ_INFO %s: (count, flags)' % ['INTx', 'MSI', 'MSI-X', 'ERR', 'REQ'][idx])
        for act, name in ((ACTION_MASK, 'MASK'), (ACTION_UNMASK, 'UNMASK')):
            e = c.errno_of(SET_IRQS, struct.pack('<IIIII', 20, DATA_NONE | act, MSI, 0, 1))
            R.errno(e, E.EINVAL, both(ref, VU('Commands', 'SET_IRQS')), 'SET_IRQS %s on MSI (no per-vector masking)' % name)
        # config space is 256 bytes: nothing at 0x100
        e = c.errno_of(REGION_READ, struct.pack('<QII', 0x100, CONFIG, 4))
        R.errno(e, E.EINVAL, both(ref, VU('Commands', 'REGION_READ')), 'a config read at 0x100 (256-byte config space)')
    finally:
        teardown(d)


# ######################################################################
# ccw.md § Registers (BAR0)
# ######################################################################
def t_regs(env):
    R.sec('Registers (ccw.md § Registers (BAR0))')
    ref = CC(S_REG)
    aw = CC(S_REG, 'Access widths')
    d = Dev(env.server('main'), irq=None, bme=False)
    try:
        c = d.c
        R.eq([d.r(ID), d.r(VERSION), d.r(SUBCHANNELS), d.r(PIN_MODE)], [CCW_ID, 1, 4, 0], ref,
             'ID "ccw!", VERSION 1, SUBCHANNELS 4 (default), PIN_MODE 0 (track, the default)')
        R.eq(d.r64(STORE_LO), 64 * MiB, both(ref, CC(S_OPT)), 'STORE_SIZE: 64 MiB (store=ram:64M by default)')
        R.eq(d.r(IRQ_STATUS), 0, ref, 'IRQ_STATUS 0 with no status pending')
        R.eq([d.sr(n, o) for n in range(4) for o in range(0, 0x40, 4)], [0] * 64, ref,
             'every subchannel register reads 0 before any program')
        # access widths
        bad = []
        for off, size in ((ID, 1), (ID, 2), (ID, 8), (0x002, 4), (SC(0), 8), (SC(0, 1), 4), (SC(0, STATE), 2), (SC(0, 2), 2)):
            e = c.errno_of(REGION_READ, struct.pack('<QII', off, BAR0, size))
            if e != E.EINVAL:
                bad.append(('read', hex(off), size, errname(e)))
        for off, size in ((SC(0, CPA_LO), 1), (SC(0, CPA_LO), 2), (SC(0, CPA_LO), 8), (SC(0, 2), 4), (SC(0, 1), 1)):
            e = c.errno_of(REGION_WRITE, struct.pack('<QII', off, BAR0, size) + b'\x11' * size)
            if e != E.EINVAL:
                bad.append(('write', hex(off), size, errname(e)))
        R.check(not bad, aw, 'registers: 1-, 2- and 8-byte and unaligned accesses refused with EINVAL', bad)
        e0 = [c.errno_of(REGION_READ, struct.pack('<QII', SC(0, STATE), BAR0, 0)),
              c.errno_of(REGION_WRITE, struct.pack('<QII', SC(0, CPA_LO), BAR0, 0))]
        R.eq([errname(e) for e in e0], [errname(E.EINVAL)] * 2, both(aw, VU('Commands', 'Wire details: elsewhere in a BAR it is the device\'s to judge')),
             'a 0-byte REGION_READ and REGION_WRITE at a register (not an aligned 32-bit access): EINVAL')
        d.sw(0, CPA_LO, 0x12345678)
        R.eq(d.sr(0, CPA_LO), 0x12345678, aw, 'CPA_LO: an 8-byte write refused left it as the 4-byte write set it')
        d.sw(0, CPA_LO, 0)
        # MSI-X table and PBA
        ok = []
        for size in (1, 2, 4, 8):
            for off in (MSIX_TABLE, MSIX_TABLE + 3, MSIX_TABLE + 12):
                ok.append(c.errno_of(REGION_READ, struct.pack('<QII', off, BAR0, size)))
            ok.append(c.errno_of(REGION_READ, struct.pack('<QII', MSIX_PBA + (1 if size < 8 else 0), BAR0, size)))
        R.check(all(e == 0 for e in ok), aw, 'the MSI-X table and the PBA read at any width and alignment', [errname(e) for e in ok])
        c.wr(BAR0, MSIX_TABLE + 16, 0xfee01000, 4)
        c.wr(BAR0, MSIX_TABLE + 24, 0x0000_0001_0000_0031, 8)
        R.eq((c.rd(BAR0, MSIX_TABLE + 16, 4), c.rd(BAR0, MSIX_TABLE + 24, 8)), (0xfee01000, 0x0000_0001_0000_0031), aw,
             'MSI-X table: aligned 4- and 8-byte writes take effect')
        bad = []
        for off, size in ((MSIX_TABLE + 16, 2), (MSIX_TABLE + 16, 1), (MSIX_TABLE + 18, 4), (MSIX_TABLE + 20, 8)):
            e = c.errno_of(REGION_WRITE, struct.pack('<QII', off, BAR0, size) + b'\x22' * size)
            if e != E.EINVAL:
                bad.append((hex(off), size, errname(e)))
        R.check(not bad, both(aw, VU('Commands', 'Wire details')), 'MSI-X table: 1- and 2-byte and unaligned writes refused with EINVAL', bad)
        c.wr(BAR0, MSIX_TABLE + 16, 0, 4)
        c.wr(BAR0, MSIX_TABLE + 24, 1, 8)
        pba0 = c.rd(BAR0, MSIX_PBA, 8)
        e = c.errno_of(REGION_WRITE, struct.pack('<QII', MSIX_PBA, BAR0, 8) + b'\xff' * 8)
        R.check(e == 0 and c.rd(BAR0, MSIX_PBA, 8) == pba0, aw, 'a PBA write is accepted and ignored', '%s, PBA %#x' % (errname(e), c.rd(BAR0, MSIX_PBA, 8)))
        # unimplemented offsets read 0
        ranges = [('global area 0x01c-0x0ff', 0x01c, 0x100), ('subchannel blocks 4-15 (0x200-0x4ff)', 0x200, 0x500),
                  ('up to the MSI-X table (0x500-0x7ff)', 0x500, 0x800), ('after the 4-entry table, before the PBA (0x840-0xbff)', 0x840, 0xc00)]
        for name, lo, hi in ranges:
            vals = {hex(o): d.r(o) for o in range(lo, hi, 4)}
            nz = {k: v for k, v in vals.items() if v}
            R.check(not nz, aw, 'unimplemented offsets read 0: %s' % name, list(nz.items())[:4])
        after = []
        for o in range(0xc08, 0x1000, 4):
            m = c.request(REGION_READ, struct.pack('<QII', o, BAR0, 4))
            after.append(m.error if m.is_error else int.from_bytes(m.payload[16:], 'little'))
        if any(after):
            R.note(aw, 'BAR0 after the PBA (0xc08-0xfff) is not named among the unimplemented offsets; reads there gave %s' % sorted(set(after))[:4])
        # writes to read-only registers, unimplemented offsets, absent subchannels: ignored, no error
        errs = []
        for off in (ID, VERSION, SUBCHANNELS, PIN_MODE, STORE_LO, STORE_HI, IRQ_STATUS, 0x01c, 0x0fc, SC(1, STATE), SC(1, DSTAT_CSTAT),
                    SC(1, RESIDUAL), SC(1, REASON), SC(1, CCWS), SC(1, PROGRAMS), SC(1, BYTES_LO), SC(1, BYTES_HI), SC(1, CPAOUT_LO),
                    SC(1, CPAOUT_HI), SC(4, CPA_LO), SC(5, DOORBELL), SC(15, ST_LO), 0x600, 0x7fc, 0x900):
            e = c.errno_of(REGION_WRITE, struct.pack('<QII', off, BAR0, 4) + struct.pack('<I', 0xdeadbeef))
            if e:
                errs.append((hex(off), errname(e)))
        R.check(not errs, aw, 'writes to read-only registers, unimplemented offsets and absent subchannels: no error', errs)
        R.eq([d.r(ID), d.r(VERSION), d.r(SUBCHANNELS), d.r(PIN_MODE), d.r64(STORE_LO), d.r(IRQ_STATUS)],
             [CCW_ID, 1, 4, 0, 64 * MiB, 0], aw, 'read-only global registers unchanged by those writes')
        R.eq([d.sr(1, o) for o in range(STATE, 0x40, 4) if o != ACK], [0] * 10, aw, 'read-only subchannel registers unchanged by those writes')
        R.eq([d.r(0x01c), d.r(0x0fc), d.r(SC(4, CPA_LO)), d.r(SC(15, ST_LO)), d.r(0x600), d.r(0x900)], [0] * 6, aw,
             'unimplemented offsets and absent subchannels still read 0 after writes')
        # RW registers
        d.sw(2, CPA_LO, 0x89abcdef)
        d.sw(2, CPA_HI, 0x01234567)
        d.sw(2, ST_LO, 0x13579bdf)
        d.sw(2, ST_HI, 0x2468ace0)
        R.eq([d.sr(2, o) for o in (CPA_LO, CPA_HI, ST_LO, ST_HI)], [0x89abcdef, 0x01234567, 0x13579bdf, 0x2468ace0], ref,
             'CPA_LO/_HI and STATUS_LO/_HI read back what was written')
        for o in (CPA_LO, CPA_HI, ST_LO, ST_HI):
            d.sw(2, o, 0)
        d.sw(3, DOORBELL, 7)
        d.sw(3, ACK, 1)
        R.eq((d.sr(3, DOORBELL), d.sr(3, ACK)), (0, 0), ref, 'DOORBELL and ACK read 0')
        # memory decode is not checked; D3hot stops nothing
        R.eq(d.cfg_rd(0x04, 2) & 0x2, 0, aw, '(COMMAND memory decode is clear here)')
        R.eq(d.r(ID), CCW_ID, aw, 'BAR0 registers answer with COMMAND memory decode clear')
        pm = d.caps[0x01]
        d.cfg_wr(pm + 4, 3, 2)
        d3 = d.cfg_rd(pm + 4, 2) & 3
        d.command(0x0006)
        d.intx_on()
        d.irq = 'intx'
        r = d.runp([ccw(C_NOP, 0, 0, 0)], what='NOP in D3hot')
        R.check(r['reason'] == OK, aw, 'a power state of D3hot (PMCSR 3, read back %d) stops nothing: a program runs and interrupts' % d3, r.show())
        d.intx_unmask()
        d.cfg_wr(pm + 4, 0, 2)
    finally:
        teardown(d)


# ######################################################################
# Data moves, commands, the example program (ccw.md § Channel programs)
# ######################################################################
def _prog(d):
    mem = d.mem
    # a fresh RAM store is a sparse memfd: it reads zeros
    z = d.store_read(0, 3 * PAGE)
    R.check(z == bytes(3 * PAGE), CC(S_OPT, 'store=ram:SIZE (a sparse memfd)'), 'a fresh RAM store reads zeros', (z or b'')[:16])
    # a WRITE then a READ, direct addresses
    src = d.alloc(2)
    data = pattern(6000, 11)
    mem.write(src, data)
    st = d.status_area()
    cpa = d.prog([ccw(C_WRITE, 0, 6000, src)])
    p0 = d.sr(0, PROGRAMS)
    d.start(0, cpa, st)
    r = d.finish(0, st, 'WRITE 6000', ack=False)
    expect_reason(r, OK, CC(S_RC, 'Ok'), 'WRITE 6000 bytes from a direct address', residual=0, ccws=1, bytes=6000, cpa_out=cpa + 16)
    R.eq((r['state'], r['irq_status'] & 1), (PENDING, 1), CC(S_REG, 'Interrupts'), 'at the interrupt: STATE 2 (status pending), IRQ_STATUS bit 0')
    R.eq(r['sb'], dict(dstat=CE | DE, cstat=0, rsv=0, residual=0, cpa_out=cpa + 16, reason=OK, ccws=1, bytes=6000), CC(S_SB),
         'status block: CE|DE, 0, reserved 0, residual 0, CPA out, reason 0, CCWS 1, BYTES 6000')
    R.eq(mem.read(st + 32, 32), b'\xee' * 32, CC(S_SB), 'the status block is 32 bytes: nothing written after it')
    R.eq(d.sr(0, PROGRAMS), p0 + 1, CC(S_REG, 'PROGRAMS'), 'PROGRAMS counts the completed program')
    d.sw(0, ACK, 1)
    R.eq((d.sr(0, STATE), d.r(IRQ_STATUS) & 1), (IDLE, 0), CC(S_REG, 'ACK'), 'ACK: STATE back to idle, IRQ_STATUS bit clear')
    R.eq([d.sr(0, DSTAT_CSTAT), d.sr(0, REASON), d.sr(0, RESIDUAL), d.sr(0, CCWS), d.r64(SC(0, BYTES_LO)), d.r64(SC(0, CPAOUT_LO))],
         [CE | DE, OK, 0, 1, 6000, cpa + 16], CC(S_REG), 'the last program\'s registers stay readable after ACK')
    dst = d.alloc(2)
    mem.fill(dst, 2 * PAGE, 0x5a)
    r = d.runp([ccw(C_READ, 0, 6000, dst)], what='READ 6000')
    expect_reason(r, OK, CC(S_CCW, 'READ'), 'READ 6000 bytes to a direct address', residual=0, ccws=1, bytes=6000)
    got = mem.read(dst, 2 * PAGE)
    R.check(got[:6000] == data and got[6000:] == b'\x5a' * (2 * PAGE - 6000), CC(S_CCW, 'READ'),
            'READ returns the bytes the WRITE stored, byte for byte, and nothing past its count', '')

    # Position: each program starts at 0; it advances within a program
    small = pattern(100, 12)
    mem.write(src, small)
    d.runp([ccw(C_WRITE, 0, 100, src)], what='WRITE 100')
    got = d.store_read(0, 6000)
    R.check(got == small + data[100:], CC(S_CCW, 'Position'), 'each program starts at store position 0 (a second WRITE of 100 bytes overwrote bytes 0-99)',
            (got or b'')[:8])
    a, b_ = pattern(300, 13), pattern(500, 14)
    mem.write(src, a + b_)
    r = d.runp([ccw(C_WRITE, F_CC, 300, src), ccw(C_WRITE, 0, 500, src + 300)], what='WRITE WRITE')
    expect_reason(r, OK, CC(S_EXEC, 'Order'), 'WRITE 300, CC, WRITE 500', ccws=2, bytes=800, cpa_out=r['cpa_out'])
    got = d.store_read(0, 800)
    R.check(got == a + b_, CC(S_CCW, 'WRITE'), 'the position advances: the second WRITE of a chain lands after the first', (got or b'')[:8])
    d1, d2 = d.alloc(1), d.alloc(1)
    r = d.runp([ccw(C_READ, F_CC, 300, d1), ccw(C_READ, 0, 500, d2)], what='READ READ')
    R.check(r['reason'] == OK and mem.read(d1, 300) == a and mem.read(d2, 500) == b_, CC(S_CCW, 'READ'),
            'the position advances: READ 300 then READ 500 return the two pieces', r.show())

    # the doc's example program, at the doc's addresses
    ex = CC(S_LAY)
    for blk in (0x401000, 0x403000, 0x408000):
        mem.fill(blk, PAGE)
    pos = 0x12345
    mem.write(0x230000, struct.pack('<Q', pos))
    payload = pattern(10000, 15)
    mem.write(0x403180, payload[:0xe80])
    mem.write(0x401000, payload[0xe80:0xe80 + 4096])
    mem.write(0x408000, payload[0xe80 + 4096:])
    mem.write(0x210000, idaws([0x403180, 0x401000, 0x408000]))
    mem.write(0x200000, ccw(C_SEEK, F_CC, 8, 0x230000) + ccw(C_WRITE, F_IDA, 10000, 0x210000))
    st = d.status_area()
    r = d.run(0x200000, status=st, what='the doc\'s example')
    expect_reason(r, OK, ex, 'the example: SEEK, WRITE 10000 bytes through IDAWs 0x403180, 0x401000, 0x408000',
                  residual=0, ccws=2, bytes=10000, cpa_out=0x200020)
    got = d.store_read(pos, 10000)
    R.check(got == payload, both(ex, CC(S_IDAW, 'How the count spreads')),
            'the store holds 0xe80 bytes from 0x403180, 4096 from 0x401000 and the last 2192 from 0x408000, at the SEEK position',
            (got or b'')[:8])

    # NOP
    r = d.runp([ccw(C_NOP, 0, 0, 0)], what='NOP 0')
    expect_reason(r, OK, CC(S_CCW, 'NOP'), 'NOP with count 0', residual=0, ccws=1, bytes=0)
    r = d.runp([ccw(C_NOP, 0, 12345, HOLE)], what='NOP 12345')
    expect_reason(r, OK, CC(S_CCW, 'NOP'), 'NOP with count 12345 and an unmapped address: the count is ignored', residual=0, ccws=1, bytes=0)
    cpa = d.prog([ccw(C_NOP, F_CC, 1), ccw(C_NOP, F_CC, 2), ccw(C_NOP, 0, 3)])
    r = d.run(cpa, what='NOP x3')
    expect_reason(r, OK, CC(S_EXEC, 'Order'), 'three chained NOPs: the program ends after the first CCW without CC',
                  ccws=3, cpa_out=cpa + 48)

    # SENSE
    sref = CC(S_CCW, 'SENSE')
    buf = d.alloc(1)
    mem.fill(buf, 128, 0xff)
    r = d.runp([ccw(C_SENSE, 0, 32, buf)], what='SENSE 32')
    expect_reason(r, OK, sref, 'SENSE 32', residual=0, bytes=32, ccws=1)
    R.eq(mem.read(buf, 40), bytes(32) + b'\xff' * 8, sref, 'SENSE 32: 32 bytes of zeros, nothing after them')
    mem.fill(buf, 128, 0xff)
    cpa = d.prog([ccw(C_SENSE, F_CC, 16, buf), ccw(C_NOP, 0, 0)])
    r = d.run(cpa, what='SENSE 16')
    R.check(r['reason'] == OK and r['dstat'] == CE | DE and r['cstat'] == IL and r['ccws'] == 1 and r['cpa_out'] == cpa + 16
            and r['residual'] == 0 and r['bytes'] == 16, both(CC(S_CCW, 'SLI'), CC(S_RC, 'Incorrect length')),
            'SENSE 16 without SLI: CE|DE with incorrect length, the chain stops at it; residual 0, BYTES 16', r.show() + ' cstat %#x' % r['cstat'])
    R.eq(mem.read(buf, 24), bytes(16) + b'\xff' * 8, sref, 'SENSE 16 writes only the first 16 bytes')
    mem.fill(buf, 128, 0xff)
    cpa = d.prog([ccw(C_SENSE, F_CC | F_SLI, 16, buf), ccw(C_NOP, 0, 0)])
    r = d.run(cpa, what='SENSE 16 SLI')
    expect_reason(r, OK, CC(S_CCW, 'SLI'), 'SENSE 16 with SLI: no incorrect length, the chain goes on', cstat=0, ccws=2)
    mem.fill(buf, 128, 0xff)
    r = d.runp([ccw(C_SENSE, F_SLI, 64, buf)], what='SENSE 64 SLI')
    expect_reason(r, OK, both(sref, CC(S_PART, 'A SENSE writes only the first min(count, 32) bytes')),
                  'SENSE 64 with SLI: no incorrect length, 32 bytes moved', cstat=0, bytes=32)
    R.eq(mem.read(buf, 64), bytes(32) + b'\xff' * 32, sref, 'SENSE 64 writes only the first 32 bytes of its data area')
    R.eq(r['residual'], 32, CC(S_PART, 'a count above 32 leaves a residual of count - 32'), 'SENSE 64 with SLI: residual 32')
    r = d.runp([ccw(C_SENSE, 0, 64, buf)], what='SENSE 64')
    R.check(r['reason'] == OK and r['dstat'] == CE | DE and r['cstat'] == IL, CC(S_RC, 'Incorrect length'),
            'SENSE 64 without SLI: CE|DE with incorrect length', r.show() + ' cstat %#x' % r['cstat'])

    d.runp([ccw(0x05, 0, 10, buf)], what='unit check before sense')
    mem.fill(buf, 64, 0xff)
    r = d.runp([ccw(C_SENSE, 0, 32, buf)], what='SENSE after UC')
    R.check(r['reason'] == OK and mem.read(buf, 32) == bytes(32), sref, 'SENSE after a unit check (BadCommand): still 32 zero bytes (no sense state)', r.show())
    # BYTES counts READ, WRITE and SENSE data, not SEEK's operand
    opnd = d.alloc(1)
    mem.write(opnd, struct.pack('<Q', 4096))
    mem.write(src, pattern(100, 16))
    r = d.runp([ccw(C_SEEK, F_CC, 8, opnd), ccw(C_WRITE, F_CC, 100, src), ccw(C_SENSE, F_CC, 32, buf), ccw(C_READ, F_CC, 50, dst),
                ccw(C_NOP, 0, 999)], what='mixed')
    expect_reason(r, OK, CC(S_RC, 'BYTES'), 'SEEK 8, WRITE 100, SENSE 32, READ 50, NOP 999: BYTES counts 182 (not the SEEK operand)',
                  bytes=182, ccws=5, residual=0)
    # STATUS 0: no status block; the registers hold the status
    cpa = d.prog([ccw(C_NOP, 0, 0)])
    r = d.run(cpa, status=0, what='STATUS 0')
    expect_reason(r, OK, CC(S_REG, 'STATUS'), 'STATUS 0: no status block, the registers hold the status', ccws=1, cpa_out=cpa + 16)


# ######################################################################
# Chains, TICs, limits, CPA out, CCWS, residual (ccw.md § CCW, § Execution, § Reason codes)
# ######################################################################
def _chain(d):
    mem = d.mem
    tic = CC(S_CCW, 'TIC')
    cpo = CC(S_RC, 'CPA out')
    buf = d.alloc(1)
    # TIC
    q = d.prog([ccw(C_NOP, 0, 0)])
    p = d.prog([ccw(C_NOP, F_CC, 0), ccw(C_TIC, 0, 0, q)])
    r = d.run(p, what='NOP TIC NOP')
    expect_reason(r, OK, both(tic, CC(S_EXEC, 'Order')), 'NOP, TIC to another page, NOP: continues at the TIC\'s target; CCWS counts the TIC',
                  ccws=3, cpa_out=q + 16, residual=0)
    p = d.prog([ccw(C_TIC, 0, 0, q)])
    r = d.run(p, what='TIC first')
    expect_reason(r, OK, tic, 'a TIC as the first CCW', ccws=2, cpa_out=q + 16)
    for flags in (F_CC, F_SLI, F_IDA, F_CD, 0x01):
        p = d.prog([ccw(C_TIC, flags, 0, q)])
        r = d.run(p, what='TIC flags %#x' % flags)
        expect_reason(r, BAD_CCW, tic, 'a TIC with flag %#x' % flags, residual=0, ccws=1, cpa_out=p + 16)
    p = d.prog([ccw(C_TIC, 0, 4, q)])
    r = d.run(p, what='TIC count')
    expect_reason(r, BAD_CCW, both(tic, CC(S_RC, 'Residual')), 'a TIC with count 4: residual 0 (a TIC\'s), counted', residual=0, ccws=1, cpa_out=p + 16)
    p = d.prog([ccw(C_TIC, 0, 0, q, rsv=0x0100)])
    r = d.run(p, what='TIC reserved')
    expect_reason(r, BAD_CCW, tic, 'a TIC with reserved bytes 2-3 nonzero', residual=0, ccws=1)
    t2 = d.prog([ccw(C_TIC, 0, 0, q)])
    p = d.prog([ccw(C_NOP, F_CC, 0), ccw(C_TIC, 0, 0, t2)])
    r = d.run(p, what='TIC to TIC')
    expect_reason(r, TIC_TO_TIC, both(CC(S_EXEC, 'Bounds'), cpo), 'a TIC to a TIC: both TICs counted, CPA out past the second',
                  ccws=3, cpa_out=t2 + 16, residual=0)
    p = d.prog([ccw(C_NOP, F_CC, 5), ccw(C_TIC, 0, 0, 0)])
    mem.write(p + 16, ccw(C_TIC, 0, 0, p))
    r = d.run(p, what='loop')
    expect_reason(r, TIC_LOOP, both(CC(S_EXEC, 'Bounds'), CC(S_RC, 'CCWS')),
                  'NOP, TIC back to it: the NOP\'s second execution refused, not counted; CPA out past the CCW refused',
                  ccws=2, cpa_out=p + 16)
    R.eq(r['residual'], 0, CC(S_RC, 'Residual'), 'TicLoop: residual that of the last CCW executed (the TIC: 0)')
    p = d.prog([ccw(C_NOP, F_CC, 0), ccw(C_NOP, F_CC, 0), ccw(C_TIC, 0, 0, 0)])
    mem.write(p + 32, ccw(C_TIC, 0, 0, p + 16))
    r = d.run(p, what='loop 2')
    expect_reason(r, TIC_LOOP, CC(S_EXEC, 'Bounds'), 'a loop back into the middle of the chain', ccws=3, cpa_out=p + 32)

    # 256 CCWs
    lim = CC(S_EXEC, 'Bounds')
    p = d.prog([ccw(C_NOP, F_CC, 0)] * 255 + [ccw(C_NOP, 0, 0)])
    r = d.run(p, what='256 NOPs')
    expect_reason(r, OK, both(lim, CC(S_LIM)), '256 chained CCWs run', ccws=256, cpa_out=p + 256 * 16)
    p = d.prog([ccw(C_NOP, F_CC, 0)] * 256 + [ccw(C_NOP, 0, 0)])
    r = d.run(p, what='257 NOPs')
    expect_reason(r, CHAIN_TOO_LONG, both(lim, cpo), 'a 257th CCW: ChainTooLong, CCWS 256, CPA out past the 257th (not fetched)',
                  ccws=256, cpa_out=p + 256 * 16 + 16, residual=0)
    # TICs count toward 256: 128 x (NOP, TIC to the next pair)
    base = d.alloc(9)
    prog = []
    for i in range(129):
        at = base + i * 32
        prog.append(ccw(C_NOP, F_CC, 0) + ccw(C_TIC, 0, 0, at + 32))
    mem.write(base, b''.join(prog))
    r = d.run(base, what='TICs count')
    expect_reason(r, CHAIN_TOO_LONG, both(lim, CC(S_LIM, 'TICs included')), '128 NOP+TIC pairs then another NOP: the 257th CCW (TICs counted)',
                  ccws=256, cpa_out=base + 256 * 16 + 16)
    # ChainTooLong comes before CcwMisaligned / CcwUnmapped
    base = d.alloc(5)
    mem.write(base, ccw(C_NOP, F_CC, 0) * 255 + ccw(C_TIC, 0, 0, HOLE + 4))
    r = d.run(base, what='257th misaligned')
    expect_reason(r, CHAIN_TOO_LONG, CC(S_ORD), 'the 257th CCW misaligned and unmapped: ChainTooLong first', ccws=256)

    # fetch failures
    p = d.alloc(1) + 8
    mem.write(p, ccw(C_NOP, 0, 0))
    r = d.run(p + 4, what='CPA misaligned')
    expect_reason(r, CCW_MISALIGNED, both(CC(S_RC, 'CcwMisaligned'), cpo), 'CPA not 8-byte aligned: CCWS 0, CPA out = CPA + 16, residual 0',
                  ccws=0, cpa_out=p + 4 + 16, residual=0, bytes=0)
    r = d.run(p, what='CPA 8-aligned')
    expect_reason(r, OK, CC(S_CCW), 'a CCW 8-byte (not 16-byte) aligned runs', ccws=1)
    r = d.run(HOLE + 4, what='CPA misaligned unmapped')
    expect_reason(r, CCW_MISALIGNED, CC(S_ORD, '1'), 'CPA misaligned and unmapped: CcwMisaligned before CcwUnmapped', ccws=0)
    hi = 0x123450000
    m = mem.map_fd(hi, 2 * PAGE)
    mem.write(hi + PAGE, struct.pack('<Q', 0x40))
    mem.write(hi + 0x10, ccw(C_SEEK, F_CC, 8, hi + PAGE) + ccw(C_WRITE, F_CC, 64, hi + PAGE + 8) + ccw(C_TIC, 0, 0, hi + 0x100))
    mem.write(hi + 0x100, ccw(C_READ, 0, 16, hi + PAGE + 0x800))
    mem.fill(hi + 0x200, 48, 0xee)
    d.start(0, hi + 0x10, hi + 0x203)
    r = d.finish(0, hi + 0x203, 'above 4G')
    expect_reason(r, OK, CC(S_REG, 'CPA_LO / _HI, STATUS_LO / _HI, CPA_OUT_LO / _HI'),
                  'a program, its data and its status block above 4 GiB: CPA_HI, STATUS_HI and CPA out\'s high half', ccws=4, bytes=80,
                  cpa_out=hi + 0x110)
    R.eq((d.sr(0, CPAOUT_HI), r['sb']['cpa_out']), (hi >> 32, hi + 0x110), CC(S_SB), 'CPA_OUT_HI and the status block\'s 64-bit CPA out')
    mem.unmap(m)
    r = d.run(HOLE, what='CPA unmapped')
    expect_reason(r, CCW_UNMAPPED, both(CC(S_RC, 'CcwUnmapped'), cpo), 'CPA outside guest memory: CCWS 0, CPA out = CPA + 16',
                  ccws=0, cpa_out=HOLE + 16, residual=0)
    r = d.run(U64 - 7, what='CPA wraps')
    R.check(r['reason'] == CCW_UNMAPPED and status_ok(r, CCW_UNMAPPED) and r['ccws'] == 0, CC(S_RC, 'CcwUnmapped'),
            'a CCW whose 16 bytes wrap (CPA 2^64 - 8): CcwUnmapped', r.show())
    if r['cpa_out'] != 8:
        R.note(cpo, 'CPA out of a CCW at 2^64 - 8 is not said: got %#x' % r['cpa_out'])
    p = d.prog([ccw(C_NOP, F_CC, 0), ccw(C_TIC, 0, 0, q + 4)])
    r = d.run(p, what='TIC misaligned')
    expect_reason(r, CCW_MISALIGNED, cpo, 'a TIC to a misaligned address: CCWS 2, CPA out = the target + 16', ccws=2, cpa_out=q + 4 + 16)
    p = d.prog([ccw(C_NOP, F_CC, 0), ccw(C_TIC, 0, 0, HOLE)])
    r = d.run(p, what='TIC unmapped')
    expect_reason(r, CCW_UNMAPPED, cpo, 'a TIC outside guest memory', ccws=2, cpa_out=HOLE + 16)
    # a chain running off the end of guest memory
    end = d.ram_size
    opnd = d.alloc(1)
    mem.write(opnd, struct.pack('<Q', 0) + b'\0' * 8)
    mem.write(end - 48, ccw(C_NOP, F_CC, 0) + ccw(C_NOP, F_CC, 0) + ccw(C_SEEK, F_CC | F_SLI, 12, opnd))
    r = d.run(end - 48, what='off the end')
    expect_reason(r, CCW_UNMAPPED, both(cpo, CC(S_RC, 'Residual')),
                  'a chain running off the end of guest memory: CCWS = the CCWs before it, CPA out = its address + 16, residual that of the last CCW executed (SEEK 12: 4)',
                  ccws=3, cpa_out=end + 16, residual=4)

    # BadCcw, BadCommand, BadCount
    bc = CC(S_RC, 'BadCcw')
    for flags, name in ((F_CD, 'CD'), (0x01, 'reserved 0x01'), (0x10, 'reserved 0x10 (skip)'), (0x08, 'reserved 0x08 (PCI)')):
        p = d.prog([ccw(C_READ, flags, 100, buf)])
        r = d.run(p, what='flag ' + name)
        expect_reason(r, BAD_CCW, both(CC(S_CCW, 'Flags'), bc), 'READ with flag %s: program check, residual = count' % name,
                      residual=100, ccws=1, cpa_out=p + 16, bytes=0)
    for rsv in (0x0001, 0x0100, 0xffff):
        r = d.runp([ccw(C_WRITE, 0, 100, buf, rsv=rsv)], what='reserved bytes')
        expect_reason(r, BAD_CCW, both(CC(S_CCW, 'bytes 2-3'), bc), 'WRITE with reserved bytes 2-3 = %#06x' % rsv, residual=100)
    r = d.runp([ccw(C_NOP, F_CD, 0)], what='NOP CD')
    expect_reason(r, BAD_CCW, CC(S_ORD), 'a NOP with CD: BadCcw (flags are checked before NOP skips the rest)')
    r = d.runp([ccw(C_NOP, 0x10, 0)], what='NOP skip')
    expect_reason(r, BAD_CCW, CC(S_ORD), 'a NOP with reserved flag 0x10: BadCcw')
    r = d.runp([ccw(C_NOP, F_CC, 0, rsv=1), ccw(C_NOP, 0, 0)], what='NOP rsv')
    expect_reason(r, BAD_CCW, CC(S_CCW, 'The reserved bytes 2-3 must be 0 in every CCW'), 'a NOP with reserved bytes set', ccws=1)
    for code in (0x00, 0x05, 0x06, 0x09, 0x0c, 0x83, 0xff):
        p = d.prog([ccw(code, 0, 77, buf)])
        r = d.run(p, what='code %#x' % code)
        expect_reason(r, BAD_COMMAND, CC(S_RC, 'BadCommand'), 'unknown command code %#04x: unit check, residual = count' % code,
                      residual=77, ccws=1, cpa_out=p + 16)
    for cmd in (C_READ, C_WRITE, C_SENSE, C_SEEK):
        r = d.runp([ccw(cmd, 0, 0, buf)], what='count 0')
        expect_reason(r, BAD_COUNT, CC(S_RC, 'BadCount'), 'command %#x with count 0' % cmd, residual=0, ccws=1)
    r = d.runp([ccw(C_READ, 0, 16 * MiB + 1, BIG_DST)], what='count > 16M')
    expect_reason(r, BAD_COUNT, both(CC(S_RC, 'BadCount'), CC(S_LIM)), 'READ with count 16 MiB + 1: residual = count', residual=16 * MiB + 1)
    r = d.runp([ccw(C_WRITE, F_IDA, 0xffffffff, HOLE + 3)], what='count 4G')
    expect_reason(r, BAD_COUNT, CC(S_ORD), 'WRITE count 2^32-1 with a misaligned, unmapped IDAW list: BadCount before any list check')
    # order on the CCW itself
    ordr = CC(S_ORD)
    r = d.runp([ccw(0xff, 0x01, 0, buf)], what='order 1')
    expect_reason(r, BAD_CCW, ordr, 'unknown code with a reserved flag and count 0: BadCcw first')
    r = d.runp([ccw(0xff, 0, 0, buf)], what='order 2')
    expect_reason(r, BAD_COMMAND, ordr, 'unknown code with count 0: BadCommand before BadCount', residual=0)
    p = d.prog([ccw(C_TIC, 0, 0, q)])
    r = d.runp([ccw(C_TIC, 0, 8, p)], what='order 3')
    expect_reason(r, BAD_CCW, ordr, 'a TIC with a count, to a TIC: BadCcw before TicToTic', ccws=1)
    r = d.runp([ccw(C_NOP, F_IDA | F_2K, 0, HOLE + 3)], what='NOP IDA')
    expect_reason(r, OK, ordr, 'a NOP with IDA|IDA_2K, count 0 and a misaligned unmapped address: its count, IDA flags and address not looked at')
    r = d.runp([ccw(C_NOP, F_SLI, 0xffffffff, U64 - 3)], what='NOP big')
    expect_reason(r, OK, ordr, 'a NOP with count 2^32-1 and an address that wraps: OK')


# ######################################################################
# IDAW lists (ccw.md § IDAW lists, § Limits)
# ######################################################################
def scatter_write_read(d, blocks, first_off, count, bsize, seed, what, ref, n=0):
    """WRITE `count` bytes through an IDAW list of `blocks` (block addresses; the first at
    offset first_off), READ them back contiguously, and READ them again through the same list
    into freshly zeroed blocks; verify both byte for byte. Returns True if all matched."""
    mem = d.mem
    flags = F_IDA | (F_2K if bsize == 2048 else 0)
    # what each IDAW moves: the first up to the end of its block, then whole blocks
    pieces = []
    left = count
    for i, b in enumerate(blocks):
        if not left:
            break
        a = b + (first_off if i == 0 else 0)
        n_ = min(left, bsize - (first_off if i == 0 else 0))
        pieces.append((a, n_))
        left -= n_
    data = pattern(count, seed)
    o = 0
    for a, n_ in pieces:
        mem.write(a, data[o:o + n_])
        o += n_
    lst = d.alloc((len(pieces) * 8 + PAGE - 1) // PAGE)
    mem.write(lst, idaws([pieces[0][0]] + [b for b in blocks[1:len(pieces)]]))
    r = d.runp([ccw(C_WRITE, flags, count, lst)], n=n, what=what + ' WRITE')
    ok1 = expect_reason(r, OK, ref, '%s: WRITE %d bytes through %d IDAWs' % (what, count, len(pieces)), bytes=count, residual=0)
    got = d.store_read(0, count, n=n)
    ok2 = R.check(got == data, ref, '%s: the store holds the blocks\' bytes in IDAW order' % what,
                  'first difference at %s' % next((i for i in range(count) if got is None or got[i] != data[i]), None) if got != data else '')
    for a, n_ in pieces:
        mem.fill(a, n_, 0)
    r = d.runp([ccw(C_READ, flags, count, lst)], n=n, what=what + ' READ')
    back = b''.join(mem.read(a, n_) for a, n_ in pieces)
    ok3 = R.check(r['reason'] == OK and back == data, ref, '%s: READ through the same list scatters them back, byte for byte' % what, r.show())
    return ok1 and ok2 and ok3


def _idaw(d):
    mem = d.mem
    ent = CC(S_IDAW, 'Entries')
    spread = CC(S_IDAW, 'How the count spreads')
    area = d.alloc(12)
    pages = [area + i * PAGE for i in range(12)]
    # [1,5,6,7,9]: pages scattered, runs [1] [5,6,7] [9]
    scatter_write_read(d, [pages[i] for i in (1, 5, 6, 7, 9)], 0, 5 * PAGE, PAGE, 21, 'pages [1,5,6,7,9]', both(ent, spread))
    untouched = [mem.read(pages[i], PAGE) == bytes(PAGE) for i in (0, 2, 3, 4, 8, 10, 11)]
    R.check(all(untouched), CC(S_EXEC, 'No access outside the mappings'), 'pages [1,5,6,7,9]: pages 0, 2, 3, 4, 8, 10, 11 untouched', untouched)
    scatter_write_read(d, [pages[i] for i in (9, 1, 7, 5, 6)], 0, 5 * PAGE - 1000, PAGE, 22, 'pages [9,1,7,5,6], count short of the last block', spread)
    scatter_write_read(d, [pages[i] for i in (3, 0, 11)], 0x123, (PAGE - 0x123) + PAGE + 100, PAGE, 23,
                       'first IDAW at offset 0x123 of its block', both(CC(S_IDAW, 'Alignment'), spread))
    scatter_write_read(d, [pages[4]], 0xff0, 16, PAGE, 24, 'one IDAW, its last 16 bytes', spread)
    scatter_write_read(d, [pages[2] + 0x800, pages[8], pages[8] + 0x800, pages[10] + 0x800], 0x700, 0x100 + 2048 * 2 + 10, 2048, 25,
                       'IDA_2K: first at 0x700 in its 2K block, 2K blocks sharing a page', both(CC(S_IDAW, 'Entries'), CC(S_IDAW, 'Pinning')))
    # IDA_2K without IDA is ignored: a direct address
    src = d.alloc(3)
    data = pattern(9000, 26)
    mem.write(src, data)
    r = d.runp([ccw(C_WRITE, F_2K, 9000, src)], what='2K without IDA')
    got = d.store_read(0, 9000)
    R.check(r['reason'] == OK and got == data, CC(S_IDAW, 'IDA_2K without IDA is ignored'), 'WRITE with IDA_2K but not IDA: a direct address', r.show())
    # a repeated block: READ into the same block twice
    blk = d.alloc(1)
    d.store_write(0, pattern(2 * PAGE, 27))
    lst = d.alloc(1)
    mem.write(lst, idaws([blk, blk]))
    r = d.runp([ccw(C_READ, F_IDA, 2 * PAGE, lst)], what='repeated block')
    R.check(r['reason'] == OK and mem.read(blk, PAGE) == pattern(2 * PAGE, 27)[PAGE:], both(ent, CC(S_PART, 'in IDAW order')),
            'READ 8 KiB through IDAWs [P, P]: P holds the second 4 KiB (blocks move in IDAW order)', r.show())
    # the device reads exactly the IDAWs the count needs: entries after them are never looked at
    rd = CC(S_IDAW, 'Reading the list')
    lst = d.alloc(1)
    blocks = [pages[1], pages[3]]
    mem.write(lst, idaws(blocks + [HOLE + 5, U64 - 7]))
    r = d.runp([ccw(C_WRITE, F_IDA, 2 * PAGE, lst)], what='list garbage after')
    expect_reason(r, OK, rd, 'a list whose entries after the two the count needs are misaligned and unmapped: not read', bytes=2 * PAGE)
    m = mem.map_fd(EXTRA, PAGE)
    mem.write(EXTRA + PAGE - 16, idaws(blocks))
    r = d.runp([ccw(C_WRITE, F_IDA, 2 * PAGE, EXTRA + PAGE - 16)], what='list at the end')
    expect_reason(r, OK, rd, 'a 2-entry list in the last 16 bytes of a mapping with nothing mapped after it', bytes=2 * PAGE)
    r = d.runp([ccw(C_WRITE, F_IDA, 2 * PAGE + 1, EXTRA + PAGE - 16)], what='list past the end')
    expect_reason(r, IDAL_UNMAPPED, rd, 'the same list with count one byte more (a third IDAW needed, past the mapping)', residual=2 * PAGE + 1)
    r = d.runp([ccw(C_WRITE, F_IDA | F_2K, 2 * PAGE, EXTRA + PAGE - 16)], what='2K list past the end')
    expect_reason(r, IDAL_UNMAPPED, rd, 'IDA_2K, 8 KiB: four IDAWs needed, two mapped', residual=2 * PAGE)
    mem.unmap(m)
    # across adjacent mappings (two memfds)
    adj = CC(S_EXEC, 'Guest memory')
    mem.map_fd(ADJ_A, 64 * 1024)
    mem.map_fd(ADJ_B, 64 * 1024)
    data = pattern(8192, 28)
    mem.write(ADJ_B - 2048, data)
    r = d.runp([ccw(C_WRITE, 0, 8192, ADJ_B - 2048)], what='direct across mappings')
    got = d.store_read(0, 8192)
    R.check(r['reason'] == OK and got == data, adj, 'a direct WRITE across two adjacent mappings (2 KiB in one, 6 KiB in the next)', r.show())
    mem.fill(ADJ_B - 2048, 8192)
    r = d.runp([ccw(C_READ, 0, 8192, ADJ_B - 2048)], what='direct READ across mappings')
    R.check(r['reason'] == OK and mem.read(ADJ_B - 2048, 8192) == data, adj, 'a direct READ across the two mappings', r.show())
    blocks = [ADJ_A + 0x3000, ADJ_B + 0x5000, pages[6]]
    mem.write(ADJ_B - 16, idaws(blocks))      # the list straddles the boundary: 2 entries in A, 1 in B
    data = pattern(3 * PAGE, 29)
    for i, b in enumerate(blocks):
        mem.write(b, data[i * PAGE:(i + 1) * PAGE])
    r = d.runp([ccw(C_WRITE, F_IDA, 3 * PAGE, ADJ_B - 16)], what='list across mappings')
    got = d.store_read(0, 3 * PAGE)
    R.check(r['reason'] == OK and got == data, both(adj, ent), 'an IDAW list across two mappings, its blocks in both and in RAM', r.show())
    mem.write(ADJ_B - 16, ccw(C_NOP, F_CC, 0))
    mem.write(ADJ_B, ccw(C_NOP, 0, 0))
    r = d.run(ADJ_B - 16, status=0, what='chain across mappings')
    expect_reason(r, OK, CC(S_EXEC, 'Order'), 'a chain whose CCWs straddle two adjacent mappings', ccws=2, cpa_out=ADJ_B + 16)
    st = ADJ_B - 16
    mem.fill(st, 48, 0xee)
    p = d.prog([ccw(C_NOP, 0, 0)])
    r = d.run(p, status=st, what='status across mappings')
    R.eq(r['sb']['reason'], OK, CC(S_SB, 'the block must lie whole in memory the client mapped writable'),
         'a status block across two adjacent writable mappings is written (reason field)')
    R.eq(mem.read(st + 32, 16), b'\xee' * 16, CC(S_SB), '... and nothing after its 32 bytes')

    # 16 MiB: 4097 IDAWs with the first not on a 4 KiB boundary; scattered
    lim = CC(S_LIM, 'bytes per CCW')
    big = pattern(16 * MiB, 30)
    mem.write(BIG_SRC, big)
    r = d.runp([ccw(C_WRITE, 0, 16 * MiB, BIG_SRC)], what='16M direct')
    expect_reason(r, OK, lim, 'WRITE 16 MiB from a direct address', bytes=16 * MiB, residual=0)
    order = list(range(4097))
    random.Random(31).shuffle(order)
    blocks = [BIG_DST + i * PAGE for i in order]
    mem.fill(BIG_DST, 4097 * PAGE)
    lst = d.alloc(9)
    mem.write(lst, idaws([blocks[0] + 0x800] + blocks[1:]))
    r = d.runp([ccw(C_READ, F_IDA, 16 * MiB, lst)], what='16M 4097 IDAWs')
    expect_reason(r, OK, lim, 'READ 16 MiB through 4097 shuffled IDAWs, the first at offset 0x800', bytes=16 * MiB, residual=0)
    ok = mem.read(blocks[0] + 0x800, 0x800) == big[:0x800]
    o = 0x800
    bad = []
    for i in range(1, 4097):
        n_ = min(PAGE, 16 * MiB - o)
        if mem.read(blocks[i], n_) != big[o:o + n_]:
            bad.append(i)
        o += n_
    ok = ok and not bad and mem.read(blocks[4096] + 0x800, 0x800) == bytes(0x800)
    R.check(ok, both(lim, CC(S_IDAW, 'How the count spreads')),
            '16 MiB scattered back byte for byte: 0x800 bytes in the first block, 4095 whole blocks, 0x800 in the last, the rest untouched',
            'bad IDAWs %s' % bad[:5])
    lst2 = d.alloc(17)
    mem.write(lst2, idaws([BIG_DST + 0x400] + [BIG_DST + 0x800 * i for i in range(1, 1024)]))
    mem.fill(BIG_DST, 2 * MiB + PAGE)
    r = d.runp([ccw(C_READ, F_IDA | F_2K, 2 * MiB - 0x400, lst2)], what='2K 1024 IDAWs')
    R.check(r['reason'] == OK and mem.read(BIG_DST + 0x400, 2 * MiB - 0x400) == big[:2 * MiB - 0x400]
            and mem.read(BIG_DST, 0x400) == bytes(0x400) and mem.read(BIG_DST + 2 * MiB, 16) == bytes(16),
            CC(S_IDAW, 'Entries'), 'IDA_2K: READ through 1024 consecutive 2 KiB IDAWs (two slices of 512) lands contiguously', r.show())


# ######################################################################
# IDAW, data and store errors, and their order (ccw.md § Reason codes, § Order of the checks)
# ######################################################################
def t_errors(env):
    R.sec('Errors of lists, data and the store, and their order (ccw.md § Reason codes, § Order of the checks)')
    d = Dev(env.server('main'))
    try:
        _errors(d)
    finally:
        teardown(d)
    d = Dev(env.server('small'))
    try:
        _errors_store(d)
    finally:
        teardown(d)
    _errors_pins(env)


def _errors(d):
    mem = d.mem
    rc = lambda name: CC(S_RC, name)   # noqa: E731
    ordr = CC(S_ORD)
    area = d.alloc(4)
    blk = [area + i * PAGE for i in range(4)]
    lst = d.alloc(1)
    # IdalMisaligned / IdalUnmapped
    mem.write(lst + 4, idaws(blk[:2]))
    p = d.prog([ccw(C_WRITE, F_IDA, 2 * PAGE, lst + 4)])
    r = d.run(p, what='IdalMisaligned')
    expect_reason(r, IDAL_MISALIGNED, rc('IdalMisaligned'), 'IDAW list at an address not 8-byte aligned', residual=2 * PAGE, ccws=1,
                  cpa_out=p + 16, bytes=0)
    r = d.runp([ccw(C_WRITE, F_IDA, 100, HOLE)], what='IdalUnmapped')
    expect_reason(r, IDAL_UNMAPPED, rc('IdalUnmapped'), 'IDAW list outside guest memory', residual=100)
    r = d.runp([ccw(C_READ, F_IDA, 2 * PAGE, U64 - 7)], what='IdalUnmapped wrap')
    expect_reason(r, IDAL_UNMAPPED, rc('IdalUnmapped'), 'IDAW list of two entries at 2^64 - 8 (wraps)', residual=2 * PAGE)
    end = d.ram_size
    mem.write(end - 8, idaws([blk[0]]))
    r = d.runp([ccw(C_WRITE, F_IDA, 2 * PAGE, end - 8)], what='IdalUnmapped end')
    expect_reason(r, IDAL_UNMAPPED, rc('IdalUnmapped'), 'IDAW list running off the end of guest memory (2nd entry unmapped)', residual=2 * PAGE)
    r = d.runp([ccw(C_WRITE, F_IDA, 100, HOLE + 4)], what='misaligned+unmapped list')
    expect_reason(r, IDAL_MISALIGNED, ordr, 'a list both misaligned and unmapped: IdalMisaligned first')
    # IdawMisaligned
    for second, bs, name in ((blk[1] + 0x800, PAGE, '4K: 2nd IDAW at +0x800'), (blk[1] + 8, PAGE, '4K: 2nd IDAW at +8'),
                             (blk[1] + 0x400, 2048, '2K: 2nd IDAW at +0x400')):
        mem.write(lst, idaws([blk[0], second]))
        r = d.runp([ccw(C_WRITE, F_IDA | (F_2K if bs == 2048 else 0), 2 * bs, lst)], what='IdawMisaligned')
        expect_reason(r, IDAW_MISALIGNED, both(CC(S_IDAW, 'Alignment'), rc('IdawMisaligned')), 'an IDAW after the first not block aligned (%s)' % name,
                      residual=2 * bs, bytes=0)
    mem.write(lst, idaws([blk[0], U64 - 0x7ff]))
    r = d.runp([ccw(C_WRITE, F_IDA, 2 * PAGE, lst)], what='misaligned and wrapping IDAW')
    expect_reason(r, IDAW_MISALIGNED, CC(S_ORD, '2: per IDAW IdawMisaligned and wrapping'), 'a 2nd IDAW both misaligned and wrapping (2^64 - 0x800): IdawMisaligned first')
    mem.write(lst, idaws([blk[0] + 0x7f8, blk[1] + 0x800]))
    r = d.runp([ccw(C_WRITE, F_IDA | F_2K, 8 + 2048, lst)], what='2K aligned')
    expect_reason(r, OK, CC(S_IDAW, 'Alignment'), 'IDA_2K: a first IDAW anywhere, a 2nd on a 2 KiB (not 4 KiB) boundary', bytes=2056)
    mem.write(lst, idaws([blk[0] + 0x801, blk[1] + 0x800, blk[2] + 0x801]))
    r = d.runp([ccw(C_WRITE, F_IDA | F_2K, (0x800 - 1) + 2048 + 10, lst)], what='2K misaligned 3rd')
    expect_reason(r, IDAW_MISALIGNED, CC(S_IDAW, 'Alignment'), 'IDA_2K: the 3rd IDAW not 2 KiB aligned')
    # DataUnmapped
    r = d.runp([ccw(C_READ, 0, 100, HOLE)], what='DataUnmapped')
    expect_reason(r, DATA_UNMAPPED, rc('DataUnmapped'), 'READ to an unmapped direct address', residual=100, bytes=0)
    mem.fill(end - PAGE, PAGE, 0x77)
    r = d.runp([ccw(C_READ, 0, PAGE + 16, end - PAGE)], what='DataUnmapped end')
    expect_reason(r, DATA_UNMAPPED, both(rc('DataUnmapped'), CC(S_PART, 'fails the whole CCW first')),
                  'READ of a page + 16 bytes from the last page of RAM: nothing moves', residual=PAGE + 16, bytes=0)
    R.eq(mem.read(end - PAGE, PAGE), b'\x77' * PAGE, CC(S_PART, 'nothing moves'), '... the mapped page was not written')
    d.store_write(0, pattern(3 * PAGE, 40))
    mem.fill(blk[0], 2 * PAGE, 0x77)
    mem.write(lst, idaws([blk[0], blk[1], HOLE]))
    r = d.runp([ccw(C_READ, F_IDA, 3 * PAGE, lst)], what='DataUnmapped 3rd')
    expect_reason(r, DATA_UNMAPPED, CC(S_PART, 'a page outside the mappings ... fails the whole CCW first'),
                  'READ through IDAWs [mapped, mapped, unmapped]: DataUnmapped, nothing moved, residual = count', residual=3 * PAGE, bytes=0)
    R.eq(mem.read(blk[0], 2 * PAGE), b'\x77' * 2 * PAGE, CC(S_PART, 'nothing moves'), '... the two mapped blocks untouched')
    mem.write(lst, idaws([HOLE]))
    r = d.runp([ccw(C_WRITE, F_IDA, 100, lst)], what='DataUnmapped 1st')
    expect_reason(r, DATA_UNMAPPED, rc('DataUnmapped'), 'WRITE whose first IDAW is unmapped', residual=100)
    r = d.runp([ccw(C_READ, 0, 0x200, U64 - 0xff)], what='DataUnmapped wrap')
    expect_reason(r, DATA_UNMAPPED, rc('DataUnmapped'), 'READ at 2^64 - 0x100 with count 0x200 (the direct address wraps)', residual=0x200)
    mem.write(lst, idaws([blk[0], U64 - 0xfff]))
    r = d.runp([ccw(C_READ, F_IDA, PAGE + PAGE, lst)], what='IDAW wraps')
    expect_reason(r, DATA_UNMAPPED, rc('DataUnmapped'), 'an IDAW at 2^64 - 4096 (its block reaches 2^64)', residual=2 * PAGE)
    # order 2: the first IDAW's block wrapping before the slice read; slices of 512
    mem.write(end - 8, idaws([U64 - 0xfff]))
    r = d.runp([ccw(C_READ, F_IDA, 2 * PAGE, end - 8)], what='first wraps, list unmapped')
    expect_reason(r, IDAL_UNMAPPED, both(ordr, CC(S_ORD, 'one that ends exactly at 2^64 does not')),
                  'list: 1st IDAW at 2^64 - 4096 (its block ends exactly at 2^64: no wrap), 2nd unmapped: IdalUnmapped')
    n = 600
    base = end - 540 * 8
    good = [blk[0]] + [blk[1]] * 539
    lst_bytes = idaws(good)
    mem.write(base, lst_bytes)
    mem.write(base + 5 * 8, idaws([blk[1] + 8]))
    r = d.runp([ccw(C_READ, F_IDA, n * PAGE, base)], what='slice 1 misaligned')
    expect_reason(r, IDAW_MISALIGNED, ordr, '600-IDAW list mapped for 540 entries, the 6th misaligned: IdawMisaligned (first slice of 512 checked before the second is read)')
    mem.write(base, lst_bytes)
    mem.write(base + 515 * 8, idaws([blk[1] + 8]))
    r = d.runp([ccw(C_READ, F_IDA, n * PAGE, base)], what='slice 2 unmapped')
    expect_reason(r, IDAL_UNMAPPED, ordr, 'the same list with the 516th misaligned: IdalUnmapped (the second slice is read whole before any IDAW in it is checked)')
    mem.write(base, lst_bytes)
    r = d.runp([ccw(C_READ, F_IDA, 540 * PAGE, base)], what='540 IDAWs repeated')
    expect_reason(r, OK, CC(S_IDAW, 'Pinning'), '540 IDAWs naming one block 539 times (repeats)', bytes=540 * PAGE)
    # DataReadOnly
    ro = mem.map_fd(RO_IOVA, 64 * 1024, flags=DMA_R)
    mem.fill(RO_IOVA, 64 * 1024, 0x33)
    r = d.runp([ccw(C_READ, 0, 100, RO_IOVA)], what='DataReadOnly')
    expect_reason(r, DATA_READ_ONLY, rc('DataReadOnly'), 'READ into memory mapped read-only: protection check, residual = count', residual=100, bytes=0)
    r = d.runp([ccw(C_SENSE, 0, 32, RO_IOVA)], what='SENSE ro')
    expect_reason(r, DATA_READ_ONLY, rc('DataReadOnly'), 'SENSE into memory mapped read-only', residual=32, bytes=0)
    mem.write(lst, idaws([blk[0], RO_IOVA + PAGE]))
    r = d.runp([ccw(C_READ, F_IDA, 2 * PAGE, lst)], what='ro 2nd')
    expect_reason(r, DATA_READ_ONLY, CC(S_PART, 'or read-only fails the whole CCW first'), 'READ through [RAM, read-only]: nothing moves',
                  residual=2 * PAGE, bytes=0)
    R.eq(mem.read(RO_IOVA, 64 * 1024), b'\x33' * 64 * 1024, rc('DataReadOnly'), 'the read-only mapping was never written')
    data = pattern(PAGE, 41)
    mem.write(RO_IOVA + 2 * PAGE, data)
    r = d.runp([ccw(C_WRITE, 0, PAGE, RO_IOVA + 2 * PAGE)], what='WRITE from ro')
    R.check(r['reason'] == OK and d.store_read(0, PAGE) == data, rc('DataReadOnly'), 'a WRITE from memory mapped read-only is fine', r.show())
    opnd = RO_IOVA + 3 * PAGE
    mem.write(opnd, struct.pack('<Q', 8192))
    r = d.runp([ccw(C_SEEK, 0, 8, opnd)], what='SEEK ro')
    expect_reason(r, OK, rc('DataReadOnly'), 'a SEEK operand in memory mapped read-only')
    mem.write(lst, idaws([HOLE, RO_IOVA]))
    r = d.runp([ccw(C_READ, F_IDA, 2 * PAGE, lst)], what='unmapped+ro')
    expect_reason(r, DATA_UNMAPPED, ordr, 'READ through [unmapped, read-only]: DataUnmapped before DataReadOnly')
    mem.write(lst, idaws([RO_IOVA, HOLE]))
    r = d.runp([ccw(C_READ, F_IDA, 2 * PAGE, lst)], what='ro+unmapped')
    expect_reason(r, DATA_READ_ONLY, both(ordr, CC(S_ORD, 'the pin ... reports that block\'s reason')),
                  'READ through [read-only, unmapped]: the first block the pin cannot take decides: DataReadOnly')
    mem.unmap(ro)
    # SENSE and SEEK with counts above their length: the whole count's list and wrap checked
    sref = CC(S_PART, 'A SENSE writes only the first min(count, 32) bytes ... its whole count is checked as a READ\'s is')
    buf = d.alloc(1)
    mem.write(lst, idaws([buf, blk[2] + 0x800]))
    r = d.runp([ccw(C_SENSE, F_IDA | F_SLI, 2 * PAGE, lst)], what='SENSE IdawMisaligned')
    expect_reason(r, IDAW_MISALIGNED, sref, 'SENSE 8 KiB through [block, misaligned]: IdawMisaligned', residual=2 * PAGE, bytes=0)
    mem.write(end - 8, idaws([buf]))
    r = d.runp([ccw(C_SENSE, F_IDA | F_SLI, 2 * PAGE, end - 8)], what='SENSE IdalUnmapped')
    expect_reason(r, IDAL_UNMAPPED, sref, 'SENSE 8 KiB through a list whose 2nd entry is unmapped: IdalUnmapped')
    r = d.runp([ccw(C_SENSE, F_SLI, 0x200, U64 - 0xff)], what='SENSE wrap')
    expect_reason(r, DATA_UNMAPPED, sref, 'SENSE 0x200 at 2^64 - 0x100 (wraps): DataUnmapped')
    mem.fill(buf, 64, 0xff)
    mem.write(lst, idaws([buf, HOLE]))
    r = d.runp([ccw(C_SENSE, F_IDA | F_SLI, 2 * PAGE, lst)], what='SENSE 2nd unmapped')
    R.check(r['reason'] == OK and r['bytes'] == 32 and mem.read(buf, 33) == bytes(32) + b'\xff', sref,
            'SENSE 8 KiB with SLI through [block, unmapped block]: only the list and wrapping are checked for the rest; 32 bytes written',
            r.show())
    mem.fill(buf, PAGE, 0xff)
    mem.write(lst, idaws([buf + PAGE - 16, HOLE]))
    r = d.runp([ccw(C_SENSE, F_IDA, 32, lst)], what='SENSE 2nd piece unmapped')
    expect_reason(r, DATA_UNMAPPED, CC(S_PART, 'A SENSE delivers its (at most 32) bytes piece by piece ... one that fails on a later piece has written the earlier ones'),
                  'SENSE 32 through [last 16 bytes of a block, unmapped block]: DataUnmapped, BYTES 16, residual 16', bytes=16, residual=16)
    R.eq(mem.read(buf + PAGE - 17, 17), b'\xff' + bytes(16), CC(S_PART, 'has written the earlier ones'), '... the first 16 bytes were written')
    mem.fill(end - 32, 32, 0xff)
    r = d.runp([ccw(C_SENSE, F_SLI, 64, end - 32)], what='SENSE at end')
    R.check(r['reason'] == OK and mem.read(end - 32, 32) == bytes(32), sref,
            'SENSE 64 with SLI in the last 32 bytes of RAM (the rest unmapped, no wrap): 32 bytes written', r.show())
    mem.write(end - 8, struct.pack('<Q', 4096))
    r = d.runp([ccw(C_SEEK, F_SLI, 16, end - 8)], what='SEEK at end')
    R.check(r['reason'] == OK and r['residual'] == 8, CC(S_PART, 'A SEEK with a count above 8 is checked the same way'),
            'SEEK 16 with SLI in the last 8 bytes of RAM: the position moves, residual 8', r.show())
    r = d.runp([ccw(C_SEEK, F_SLI, 0x200, U64 - 0xff)], what='SEEK wrap')
    expect_reason(r, DATA_UNMAPPED, CC(S_PART, 'A SEEK with a count above 8 is checked the same way'), 'SEEK 0x200 at 2^64 - 0x100 (wraps): DataUnmapped')
    mem.write(lst, idaws([buf, blk[2] + 0x10]))
    r = d.runp([ccw(C_SEEK, F_IDA | F_SLI, PAGE + 8, lst)], what='SEEK IdawMisaligned')
    expect_reason(r, IDAW_MISALIGNED, CC(S_PART, 'A SEEK with a count above 8 is checked the same way'), 'SEEK 4104 through [block, misaligned]: IdawMisaligned')


def _errors_pins(env):
    """--max-pins 48: a CCW needing more pins cannot pin: DeviceError (vfio-user.md § Limits; ccw.md § Reason codes)."""
    p, out = env.try_start(extra=['--max-pins', '48'], name='maxpins')
    if p is None:
        R.check(False, VU('Limits'), 'umdev run --type ccw --max-pins 48 starts', out)
        return
    d = Dev(p.sock)
    try:
        ref = both(CC(S_RC, 'DeviceError: the device could not pin'), VU('Limits', 'pins per device (--max-pins)'))
        area = d.alloc(64)
        r = d.runp([ccw(C_READ, 0, 32 * PAGE, area)], what='32 pins')
        expect_reason(r, OK, ref, '--max-pins 48: a READ of 32 pages', bytes=32 * PAGE)
        mem = d.mem
        mem.fill(area, 64 * PAGE, 0x99)
        r = d.runp([ccw(C_READ, 0, 64 * PAGE, area)], what='64 pins')
        expect_reason(r, DEVICE_ERROR, ref, '--max-pins 48: a READ of 64 pages cannot pin: DeviceError, nothing moved', bytes=0, residual=64 * PAGE)
        R.eq(mem.read(area, 64 * PAGE), b'\x99' * 64 * PAGE, ref, '... guest memory untouched')
        lst = d.alloc(1)
        mem.write(lst, idaws([area] * 50))
        r = d.runp([ccw(C_WRITE, F_IDA, 50 * PAGE, lst)], what='repeats')
        expect_reason(r, DEVICE_ERROR, both(ref, CC(S_IDAW, 'Pinning')), '--max-pins 48: 50 IDAWs naming one page (repeats counted): DeviceError')
        r = d.runp([ccw(C_READ, 0, 32 * PAGE, area)], what='32 pins again')
        expect_reason(r, OK, ref, '... and the pins were let go: 32 pages again')
    finally:
        teardown(d)
        env.stop(p)


def _errors_store(d):
    """store=ram:1M: EndOfStore, SeekOutOfRange, and EndOfStore's place in the order."""
    mem = d.mem
    size = MiB
    eos = CC(S_RC, 'EndOfStore')
    R.eq(d.r64(STORE_LO), size, CC(S_OPT, 'store=ram:SIZE'), 'store=ram:1M: STORE_SIZE 1 MiB')
    before = pattern(256, 42)
    d.store_write(size - 256, before)
    src = d.alloc(1)
    mem.write(src, pattern(200, 43))
    opnd = d.alloc(1)
    mem.write(opnd, struct.pack('<Q', size - 100))
    r = d.runp([ccw(C_SEEK, F_CC, 8, opnd), ccw(C_WRITE, 0, 200, src)], what='EndOfStore W')
    expect_reason(r, END_OF_STORE, eos, 'WRITE 200 bytes 100 before the end: unit check, residual = count, nothing moves',
                  residual=200, bytes=0, ccws=2)
    R.eq(d.store_read(size - 256, 256), before, eos, '... the store\'s last 256 bytes unchanged (no short transfer)')
    dst = d.alloc(1)
    mem.fill(dst, 200, 0x44)
    r = d.runp([ccw(C_SEEK, F_CC, 8, opnd), ccw(C_READ, 0, 200, dst)], what='EndOfStore R')
    expect_reason(r, END_OF_STORE, eos, 'READ 200 bytes 100 before the end', residual=200, bytes=0)
    R.eq(mem.read(dst, 200), b'\x44' * 200, eos, '... nothing read into guest memory')
    r = d.runp([ccw(C_SEEK, F_CC, 8, opnd), ccw(C_WRITE, 0, 100, src)], what='to the end')
    expect_reason(r, OK, eos, 'WRITE exactly up to the end of the store', bytes=100)
    r = d.runp([ccw(C_READ, 0, size, BIG_DST)], what='whole store')
    expect_reason(r, OK, eos, 'READ the whole 1 MiB store from position 0', bytes=size)
    r = d.runp([ccw(C_READ, 0, size + 1, BIG_DST)], what='whole store + 1')
    expect_reason(r, END_OF_STORE, eos, 'READ 1 MiB + 1 from position 0', residual=size + 1)
    # EndOfStore comes before the pin (DataUnmapped, DataReadOnly) but after the list checks
    ordr = CC(S_ORD)
    r = d.runp([ccw(C_READ, 0, 2 * MiB, HOLE)], what='EOS before pin')
    expect_reason(r, END_OF_STORE, ordr, 'READ 2 MiB to an unmapped direct address on a 1 MiB store: EndOfStore (before any data is pinned)')
    ro = mem.map_fd(RO_IOVA, 64 * 1024, flags=DMA_R)
    r = d.runp([ccw(C_SEEK, F_CC, 8, opnd), ccw(C_READ, 0, 200, RO_IOVA)], what='EOS before ro')
    expect_reason(r, END_OF_STORE, ordr, 'READ past the end into read-only memory: EndOfStore before DataReadOnly')
    mem.unmap(ro)
    lst = d.alloc(1)
    mem.write(lst, idaws([HOLE, dst + 8]))
    r = d.runp([ccw(C_READ, F_IDA, 2 * MiB, lst)], what='list before EOS')
    expect_reason(r, IDAW_MISALIGNED, ordr, 'READ 2 MiB on a 1 MiB store with a misaligned 2nd IDAW: the list checks come first')
    r = d.runp([ccw(C_SEEK, F_CC, 8, opnd), ccw(C_READ, 0, 0x200, U64 - 0xff)], what='wrap before EOS')
    expect_reason(r, DATA_UNMAPPED, ordr, 'READ past the end at a wrapping direct address: DataUnmapped (wrap) before EndOfStore')

# ######################################################################
# SEEK (ccw.md § Reason codes: SEEK, § Order of the checks 4)
# ######################################################################
def _seek(d):
    mem = d.mem
    sk = CC(S_RC, 'SEEK')
    size = d.r64(STORE_LO)
    base = pattern(64 * 1024, 50)
    d.store_write(0, base)
    opnd = d.alloc(1)
    dst = d.alloc(1)

    def seek_then_read(seek_ccws, n=64):
        mem.fill(dst, n, 0)
        r = d.runp(seek_ccws + [ccw(C_READ, 0, n, dst)], what='seek')
        return r, mem.read(dst, n)

    mem.write(opnd, struct.pack('<Q', 0x1234) + struct.pack('<Q', 0x2222))
    r, got = seek_then_read([ccw(C_SEEK, F_CC, 8, opnd)])
    R.check(r['reason'] == OK and r['cstat'] == 0 and got == base[0x1234:0x1234 + 64], sk, 'SEEK count 8 moves the position: a READ after it starts there',
            r.show())
    r = d.runp([ccw(C_SEEK, 0, 8, opnd)], what='seek 8')
    expect_reason(r, OK, sk, 'SEEK count 8 alone: residual 0, no incorrect length, BYTES 0 (the operand is not counted)',
                  residual=0, cstat=0, bytes=0)
    r, got = seek_then_read([ccw(C_SEEK, F_CC | F_SLI, 12, opnd)])
    R.check(r['reason'] == OK and r['cstat'] == 0 and got == base[0x1234:0x1234 + 64], sk,
            'SEEK count 12 with SLI: the first 8 bytes are the position, the chain goes on', r.show())
    r = d.runp([ccw(C_SEEK, F_SLI, 12, opnd)], what='seek 12 sli')
    expect_reason(r, OK, sk, 'SEEK count 12 with SLI: residual 4 (count - 8), no incorrect length', residual=4, cstat=0)
    p = d.prog([ccw(C_SEEK, F_CC, 12, opnd), ccw(C_READ, 0, 64, dst)])
    r = d.run(p, what='seek 12')
    R.check(r['reason'] == OK and r['dstat'] == CE | DE and r['cstat'] == IL and r['residual'] == 4 and r['ccws'] == 1
            and r['cpa_out'] == p + 16, both(sk, CC(S_RC, 'Incorrect length')),
            'SEEK count 12 without SLI: CE|DE with incorrect length, residual 4, the chain stops at it', r.show() + ' cstat %#x' % r['cstat'])
    # count 1-7: the position does not move
    mem.write(opnd, struct.pack('<Q', 0x2000))
    opnd2 = d.alloc(1)
    mem.write(opnd2, struct.pack('<Q', 0x3000))
    r, got = seek_then_read([ccw(C_SEEK, F_CC, 8, opnd), ccw(C_SEEK, F_CC | F_SLI, 4, opnd2)])
    R.check(r['reason'] == OK and r['cstat'] == 0 and got == base[0x2000:0x2000 + 64], sk,
            'SEEK count 4 with SLI after a SEEK to 0x2000: the position does not move, the chain goes on from it', r.show())
    r = d.runp([ccw(C_SEEK, F_SLI, 4, opnd2)], what='seek 4 sli')
    expect_reason(r, OK, sk, 'SEEK count 4 with SLI: residual 0 (every byte taken), no incorrect length', residual=0, cstat=0, bytes=0)
    r, got = seek_then_read([ccw(C_SEEK, F_CC | F_SLI, 7, opnd2)])
    R.check(r['reason'] == OK and got == base[:64], sk, 'SEEK count 7 with SLI as the first CCW: the position stays 0', r.show())
    p = d.prog([ccw(C_SEEK, F_CC, 4, opnd2), ccw(C_NOP, 0, 0)])
    r = d.run(p, what='seek 4')
    R.check(r['reason'] == OK and r['cstat'] == IL and r['residual'] == 0 and r['ccws'] == 1 and r['cpa_out'] == p + 16, sk,
            'SEEK count 4 without SLI: incorrect length, residual 0, the chain stops', r.show() + ' cstat %#x' % r['cstat'])
    r = d.runp([ccw(C_SEEK, F_SLI, 1, opnd2)], what='seek 1')
    expect_reason(r, OK, sk, 'SEEK count 1 with SLI', residual=0, cstat=0)
    # at and past the end
    mem.write(opnd, struct.pack('<Q', size))
    r = d.runp([ccw(C_SEEK, 0, 8, opnd)], what='seek = size')
    expect_reason(r, OK, sk, 'SEEK to a position equal to the store\'s size is accepted', residual=0, cstat=0)
    for cmd in (C_READ, C_WRITE):
        r = d.runp([ccw(C_SEEK, F_CC, 8, opnd), ccw(cmd, 0, 1, dst)], what='at end')
        expect_reason(r, END_OF_STORE, sk, 'a %s of 1 byte at position = size: EndOfStore' % ('READ' if cmd == C_READ else 'WRITE'),
                      residual=1, ccws=2)
    r = d.runp([ccw(C_SEEK, F_CC, 8, opnd), ccw(C_NOP, F_CC, 0), ccw(C_SENSE, 0, 32, dst)], what='sense at end')
    expect_reason(r, OK, CC(S_CCW, 'SENSE'), 'NOP and SENSE at position = size are fine (no store access)', ccws=3)
    for pos in (size + 1, size + PAGE, U64):
        mem.write(opnd, struct.pack('<Q', pos))
        p = d.prog([ccw(C_SEEK, F_CC, 8, opnd), ccw(C_NOP, 0, 0)])
        r = d.run(p, what='seek oor')
        expect_reason(r, SEEK_OUT_OF_RANGE, both(sk, CC(S_RC, 'SeekOutOfRange')), 'SEEK to %#x (store size %#x): unit check, residual = count' % (pos, size),
                      residual=8, ccws=1, cpa_out=p + 16, cstat=0)
    mem.write(opnd, struct.pack('<Q', size + 1) + b'\0' * 8)
    r = d.runp([ccw(C_SEEK, 0, 12, opnd)], what='seek oor 12')
    expect_reason(r, SEEK_OUT_OF_RANGE, CC(S_ORD, '4'), 'SEEK count 12 without SLI past the end: SeekOutOfRange without incorrect length',
                  cstat=0, residual=12)
    mem.write(opnd, struct.pack('<Q', size + 1))
    r = d.runp([ccw(C_SEEK, F_SLI, 4, opnd)], what='short seek oor')
    expect_reason(r, OK, sk, 'SEEK count 4 with SLI whose 4 bytes name a huge value: the position does not move, so no SeekOutOfRange')
    # operand through IDAWs, split across two blocks
    lst = d.alloc(1)
    a1, a2 = d.alloc(1), d.alloc(1)
    val = struct.pack('<Q', 0x4321)
    mem.write(a1 + PAGE - 3, val[:3])
    mem.write(a2, val[3:])
    mem.write(lst, idaws([a1 + PAGE - 3, a2]))
    r, got = seek_then_read([ccw(C_SEEK, F_CC | F_IDA, 8, lst)])
    R.check(r['reason'] == OK and got == base[0x4321:0x4321 + 64], both(sk, CC(S_IDAW, 'How the count spreads')),
            'SEEK with IDA: an operand split 3 + 5 bytes across two IDAW blocks', r.show())
    mem.write(a1, struct.pack('<Q', 0x100))
    r = d.runp([ccw(C_SEEK, F_CC, 8, HOLE), ccw(C_NOP, 0, 0)], what='seek unmapped')
    expect_reason(r, DATA_UNMAPPED, CC(S_ORD, '4'), 'SEEK whose operand is unmapped: DataUnmapped', residual=8, ccws=1)
    mem.write(opnd, struct.pack('<Q', 0x100))
    r, got = seek_then_read([ccw(C_SEEK, F_CC, 8, opnd), ccw(C_READ, F_CC, 16, dst + 1024), ccw(C_SEEK, F_CC, 8, opnd)])
    R.check(r['reason'] == OK and got == base[0x100:0x100 + 64], sk, 'SEEK, READ, SEEK back to the same position, READ: the same bytes',
            r.show())


# ######################################################################
# The status block's place (ccw.md § Status block: Writing the status block)
# ######################################################################
def _status(d):
    mem = d.mem
    wr = CC(S_SB, 'Writing the status block')
    p = d.prog([ccw(C_NOP, 0, 7)])
    a = d.alloc(1)
    mem.fill(a, 64, 0xee)
    for off in (3, 1, 4095 - 32 - 7):
        mem.fill(a, PAGE, 0xee)
        r = d.run(p, status=a + off, what='unaligned status')
        R.check(r['sb']['reason'] == OK and r['sb']['ccws'] == 1 and mem.read(a, off) == b'\xee' * off
                and mem.read(a + off + 32, 8) == b'\xee' * 8, CC(S_SB, 'STATUS needs no alignment'),
                'STATUS at page offset %#x: the block written whole there, nothing around it' % off, fmtd(r['sb']))
    # across a page boundary inside RAM
    b2 = d.alloc(2)
    mem.fill(b2, 2 * PAGE, 0xee)
    r = d.run(p, status=b2 + PAGE - 13, what='status across pages')
    R.eq(r['sb']['cpa_out'], p + 16, CC(S_SB, 'STATUS needs no alignment'), 'a status block across a page boundary')
    # nothing written: 16 bytes before the end of RAM, unmapped, read-only, wrapping
    end = d.ram_size
    mem.fill(end - 16, 16, 0xee)
    d.w(SC(0, ST_LO), 0)
    d.start(0, p, end - 16)
    r = d.finish(0, 0, 'status at end')
    R.check(mem.read(end - 16, 16) == b'\xee' * 16 and r['reason'] == OK and r['ccws'] == 1, wr,
            'STATUS 16 bytes before the end of RAM: nothing written; the registers hold the status', r.show())
    d.start(0, p, HOLE)
    r = d.finish(0, 0, 'status unmapped')
    R.check(r['reason'] == OK and r['state'] == PENDING, wr, 'STATUS unmapped: the program ends normally, with its interrupt', r.show())
    d.start(0, p, U64 - 15)
    r = d.finish(0, 0, 'status wraps')
    R.check(r['reason'] == OK, wr, 'STATUS at 2^64 - 16 (wraps): the program ends normally', r.show())
    ro = mem.map_fd(RO_IOVA, PAGE, flags=DMA_R)
    mem.fill(RO_IOVA, PAGE, 0xee)
    d.start(0, p, RO_IOVA + 64)
    r = d.finish(0, 0, 'status ro')
    R.check(mem.read(RO_IOVA, PAGE) == b'\xee' * PAGE and r['reason'] == OK and r['dstat'] == CE | DE, wr,
            'STATUS in memory mapped read-only: nothing written; the registers hold the status', r.show())
    # half in RAM, half read-only (adjacent)
    mem.unmap(ro)
    ro = mem.map_fd(end, PAGE, flags=DMA_R)
    mem.fill(end - 16, 16, 0xee)
    mem.fill(end, PAGE, 0xee)
    d.start(0, p, end - 16)
    r = d.finish(0, 0, 'status half ro')
    R.check(mem.read(end - 16, 32) == b'\xee' * 32, wr, 'STATUS half in RAM, half in an adjacent read-only mapping: nothing written', r.show())
    mem.unmap(ro)
    # a failing program's status block, and STATUS taken per start
    st = d.status_area()
    r = d.runp([ccw(C_READ, 0, 10, HOLE)], status=st, what='failing status')
    R.eq(r['sb'], dict(dstat=r['dstat'], cstat=PC, rsv=0, residual=10, cpa_out=r['cpa_out'], reason=DATA_UNMAPPED, ccws=1, bytes=0), CC(S_SB),
         'a failed program\'s status block: program check, residual, reason 12, CCWS 1')
    st2 = d.status_area()
    d.sw(0, CPA_LO, p)
    d.sw(0, CPA_HI, 0)
    d.sw(0, ST_LO, st2)
    d.sw(0, ST_HI, 0)
    d.start(0, p, write_regs=False)
    r = d.finish(0, st2, 'STATUS reg')
    R.check(r['sb']['reason'] == OK and r['sb']['ccws'] == 1, CC(S_REG, 'STATUS'), 'STATUS_LO/_HI name where the block goes', fmtd(r['sb']))
    mem.fill(st2, 32, 0xee)
    d.sw(0, ST_LO, 0)
    d.start(0, p, write_regs=False)
    r = d.finish(0, 0, 'STATUS 0')
    R.eq(mem.read(st2, 32), b'\xee' * 32, CC(S_REG, 'STATUS (0: none)'), 'STATUS 0: no block written anywhere (the previous place untouched)')

# ######################################################################
# Memory mapped without an fd (ccw.md § Execution: Guest memory, § A CCW that stops partway)
# ######################################################################
def nofd_maps(d, size=MiB):
    rw = d.mem.map_nofd(NOFD_IOVA, size)
    ro = d.mem.map_nofd(NOFD_RO_IOVA, 64 * 1024, flags=DMA_R)
    return rw, ro


def _fdless(d):
    mem, c = d.mem, d.c
    gm = CC(S_EXEC, 'Guest memory')
    part = CC(S_PART)
    nofd_maps(d)
    N = NOFD_IOVA
    data = pattern(10000, 60)
    mem.write(N + 0x100, data)
    r = d.runp([ccw(C_WRITE, 0, 10000, N + 0x100)], what='nofd WRITE')
    got = d.store_read(0, 10000)
    R.check(r['reason'] == OK and r['bytes'] == 10000 and got == data, gm, 'WRITE 10000 bytes from memory mapped without an fd', r.show())
    mem.fill(N, 4 * PAGE)
    n0 = len(c.server_reqs)
    r = d.runp([ccw(C_READ, 0, 10000, N + 0x100)], what='nofd READ')
    R.check(r['reason'] == OK and mem.read(N + 0x100, 10000) == data and mem.read(N, 0x100) == bytes(0x100)
            and mem.read(N + 0x100 + 10000, 16) == bytes(16), gm, 'READ 10000 bytes into memory mapped without an fd, byte for byte', r.show())
    reqs = [m for m in c.server_reqs[n0:] if m.cmd == DMA_WRITE]
    spans = [struct.unpack_from('<QQ', m.payload) for m in reqs]
    data_spans = [(a, n) for a, n in spans if N <= a < N + 0x100 + 10000]
    R.check(sum(n for _, n in data_spans) == 10000 and all(n <= PAGE and a // PAGE == (a + n - 1) // PAGE for a, n in data_spans),
            both(part, CC(S_PART, 'memory mapped without an fd ... moves through the client block by block')),
            'its data came as DMA_WRITEs of blocks cut at 4 KiB boundaries', [(hex(a), n) for a, n in data_spans][:6])
    # CCWs, IDAW list, SEEK operand, SENSE data and the status block all without an fd; blocks in both kinds of memory
    prog_at = N + 0x10000
    lst = N + 0x11000
    opnd = N + 0x12000
    sense = N + 0x12100
    st = N + 0x12200 + 5
    blocks = [N + 0x20000 + 0x321, ADJ_B, N + 0x23000, RAM + ALLOC_LO]
    d.next = ALLOC_LO + PAGE
    mem.map_fd(ADJ_B, 64 * 1024)
    data = pattern(3 * PAGE, 61)
    pieces = [(blocks[0], PAGE - 0x321), (blocks[1], PAGE), (blocks[2], PAGE), (blocks[3], 0x321)]
    o = 0
    for a, n in pieces:
        mem.write(a, data[o:o + n])
        o += n
    mem.write(lst, idaws(blocks))
    mem.write(opnd, struct.pack('<Q', 0x8000))
    mem.fill(sense, 40, 0xff)
    mem.fill(st - 5, 48, 0xee)
    mem.write(prog_at, ccw(C_SEEK, F_CC, 8, opnd) + ccw(C_WRITE, F_CC | F_IDA, 3 * PAGE, lst) + ccw(C_SENSE, 0, 32, sense))
    d.start(0, prog_at, st)
    r = d.finish(0, st, 'all nofd')
    R.check(r['reason'] == OK and r['ccws'] == 3 and r['bytes'] == 3 * PAGE + 32 and r['cpa_out'] == prog_at + 48, gm,
            'a program whose CCWs, IDAW list, SEEK operand, SENSE area and status block are all in memory without an fd', r.show())
    R.eq(r['sb']['reason'], OK, gm, 'its status block, at an unaligned address without an fd, was written')
    R.eq(mem.read(st - 5, 5) + mem.read(st + 32, 8), b'\xee' * 13, CC(S_SB), '... and nothing around it')
    R.eq(mem.read(sense, 40), bytes(32) + b'\xff' * 8, CC(S_CCW, 'SENSE'), 'its SENSE wrote 32 zero bytes without an fd')
    got = d.store_read(0x8000, 3 * PAGE)
    R.check(got == data, both(gm, CC(S_IDAW, 'Entries')), 'one CCW\'s IDAWs mixing blocks with and without an fd: the store holds them in IDAW order',
            (got or b'')[:8])
    # status block in read-only memory without an fd: not written
    p = d.prog([ccw(C_NOP, 0, 0)])
    mem.fill(NOFD_RO_IOVA, 64, 0xee)
    d.start(0, p, NOFD_RO_IOVA)
    r = d.finish(0, 0, 'status nofd ro')
    R.check(r['reason'] == OK and mem.read(NOFD_RO_IOVA, 64) == b'\xee' * 64, CC(S_SB, 'Writing the status block'),
            'STATUS in read-only memory without an fd: nothing written', r.show())
    # stops partway: a block outside the mappings or read-only, block by block
    st = d.status_area()
    d.store_write(0, pattern(3 * PAGE, 62))
    want = pattern(3 * PAGE, 62)
    lstr = d.alloc(1)
    for bad, reason, name in ((HOLE, DATA_UNMAPPED, 'unmapped'), (NOFD_RO_IOVA + PAGE, DATA_READ_ONLY, 'read-only without an fd')):
        mem.fill(N + 0x30000, 2 * PAGE)
        mem.write(lstr, idaws([N + 0x30000, N + 0x31000, bad]))
        r = d.runp([ccw(C_READ, F_IDA, 3 * PAGE, lstr)], what='nofd partial ' + name)
        expect_reason(r, reason, CC(S_PART, 'a block outside the client\'s mappings or read-only ends it DataUnmapped or DataReadOnly there'),
                      'READ through [nofd, nofd, %s]: stops at the 3rd block; BYTES 8192, residual 4096' % name, bytes=2 * PAGE, residual=PAGE)
        R.check(mem.read(N + 0x30000, 2 * PAGE) == want[:2 * PAGE], CC(S_PART, 'exactly the blocks before that point have reached guest memory'),
                '... the first two blocks reached guest memory', '')
    d.store_write(0, bytes(3 * PAGE))
    src = pattern(3 * PAGE, 63)
    mem.write(N + 0x30000, src[:2 * PAGE])
    mem.write(lstr, idaws([N + 0x30000, N + 0x31000, HOLE]))
    r = d.runp([ccw(C_WRITE, F_IDA, 3 * PAGE, lstr)], what='nofd partial write')
    expect_reason(r, DATA_UNMAPPED, CC(S_PART), 'WRITE through [nofd, nofd, unmapped]: BYTES 8192, residual 4096', bytes=2 * PAGE, residual=PAGE)
    got = d.store_read(0, 3 * PAGE)
    R.check(got == src[:2 * PAGE] + bytes(PAGE), CC(S_PART, 'exactly the blocks before that point have reached the store'),
            '... exactly the first two blocks reached the store', (got or b'')[2 * PAGE:2 * PAGE + 8])
    # the client's refusal: DeviceError, for data (whole and partway), a CCW, an IDAW list
    c.dma_policy = 'error'
    r = d.runp([ccw(C_READ, 0, 100, N)], what='refused data')
    expect_reason(r, DEVICE_ERROR, CC(S_RC, 'DeviceError'), 'the client refuses the DMA of a READ\'s data: DeviceError', bytes=0, residual=100)
    d.start(0, N + 0x10000, 0)
    r = d.finish(0, 0, 'refused CCW')
    expect_reason(r, DEVICE_ERROR, CC(S_RC, 'DeviceError'), 'the client refuses the DMA that fetches a CCW: DeviceError')
    r = d.runp([ccw(C_WRITE, F_IDA, 100, lst)], what='refused list')
    expect_reason(r, DEVICE_ERROR, CC(S_RC, 'DeviceError'), 'the client refuses the DMA that reads an IDAW list: DeviceError')
    c.dma_policy = 'answer'

    def partial_refusal(a):
        mem.write(lstr, idaws([N + 0x30000, N + 0x31000, N + 0x32000]))
        c.dma_policy = 'hold'
        d.start(0, d.prog([ccw(C_READ, F_IDA, 3 * PAGE, lstr)]), 0)
        if not c.wait_held(1):
            c.dma_policy = 'answer'
            a.check(False, CC(S_PART), 'the first block\'s DMA_WRITE came', '')
            return
        a.held(c.release_held('answer'))
        c.wait_held(1)
        c.dma_policy = 'answer'
        a.held(c.release_held('error'))
        r = d.finish(0, 0, 'partial refusal')
        expect_reason(r, DEVICE_ERROR, CC(S_PART, 'the client\'s refusal of a block DeviceError'),
                      'READ of 3 blocks, the client refusing the 2nd: DeviceError partway, BYTES 4096, residual 8192',
                      sink=a, bytes=PAGE, residual=2 * PAGE)
    vu.attempt(CC(S_PART), 'partial refusal', partial_refusal)
    c.dma_policy = 'answer'
    R.check(d.runp([ccw(C_NOP, 0, 0)], what='after')['reason'] == OK, CC(S_RC), 'the subchannel runs programs after those failures', '')

# ######################################################################
# Starting and halting (ccw.md § Registers (BAR0): Starting and halting)
# ######################################################################
def t_start(env):
    R.sec('Starting and halting (ccw.md § Registers (BAR0): Starting and halting)')
    d = Dev(env.server('main'))
    try:
        nofd_maps(d)
        _start(d)
    finally:
        teardown(d)


def held_start(d, a, n, cpa, status):
    """Start a program whose first data block's DMA this client holds; False if none came."""
    d.c.dma_policy = 'hold'
    d.start(n, cpa, status)
    if not d.c.wait_held(1):
        d.c.dma_policy = 'answer'
        a.check(False, CC(S_PART), 'the program\'s first block reached the client (DMA request held)', '')
        return False
    return True


def release(d, a):
    d.c.dma_policy = 'answer'
    a.held(d.c.release_held('answer'))


def _start(d):
    mem = d.mem
    sh = CC(S_REG, 'Starting and halting')
    N = NOFD_IOVA
    store = pattern(3 * PAGE, 70)
    d.store_write(0, store)

    def busy(a):
        mem.fill(N, 3 * PAGE)
        p1 = d.prog([ccw(C_READ, 0, 3 * PAGE, N)])
        w2 = d.alloc(1)
        mem.write(w2, b'second!!')
        p2 = d.prog([ccw(C_WRITE, 0, 8, w2)])
        s1, s2 = d.status_area(), d.status_area()
        progs = d.sr(0, PROGRAMS)
        if not held_start(d, a, 0, p1, s1):
            return
        ev = d.ev[0]
        a.check(d.sr(0, STATE) == BUSY and not d.r(IRQ_STATUS) & 1, CC(S_REG, 'STATE'), 'while a program runs: STATE 1 (busy), IRQ_STATUS bit clear',
                (d.sr(0, STATE), d.r(IRQ_STATUS)))
        d.sw(0, CPA_LO, p2)
        d.sw(0, ST_LO, s2)
        d.sw(0, DOORBELL, DB_START)
        d.sw(0, ACK, 1)
        a.check(d.sr(0, STATE) == BUSY, sh, 'a start and an ACK while busy: ignored, STATE still 1', d.sr(0, STATE))
        a.check(no_signal(d, ev), CC(S_REG, 'Interrupts'), 'no interrupt while the program runs', '')
        release(d, a)
        r = d.finish(0, s1, 'busy p1')
        expect(r, dict(reason=OK, ccws=1, bytes=3 * PAGE, cpa_out=p1 + 16), sh,
               'the running program ends as its own: CPA and STATUS written while it ran did not affect it', sink=a)
        a.check(r['sb']['cpa_out'] == p1 + 16 and mem.read(s2, 32) == b'\xee' * 32, sh,
                'its status block went to the STATUS taken at its start, none to the new STATUS', fmtd(r['sb']))
        a.check(mem.read(N, 3 * PAGE) == store, CC(S_CCW, 'READ'), 'its data arrived (3 blocks through the client)', '')
        a.check(d.sr(0, PROGRAMS) == progs + 1 and no_signal(d, ev), sh,
                'the start written while busy was ignored: PROGRAMS +1, no second interrupt', d.sr(0, PROGRAMS) - progs)
        a.check(d.store_read(0, 8, n=1) == store[:8], sh, '... and the ignored start\'s WRITE never ran', '')
        d.start(0, 0, write_regs=False)
        r = d.finish(0, s2, 'busy p2')
        a.check(r['reason'] == OK and r['cpa_out'] == p2 + 16 and r['sb']['cpa_out'] == p2 + 16, sh,
                'the next start takes the CPA and STATUS written while the previous program ran', r.show())
        d.store_write(0, store)
    vu.attempt(sh, 'start while busy', busy)

    # a start while status is pending is ignored too
    p = d.prog([ccw(C_NOP, 0, 0)])
    d.start(0, p, 0)
    d.finish(0, 0, 'pending 1', ack=False)
    progs = d.sr(0, PROGRAMS)
    d.sw(0, DOORBELL, DB_START)
    R.check(no_signal(d, d.ev[0]) and d.sr(0, PROGRAMS) == progs and d.sr(0, STATE) == PENDING, sh,
            'a start while status is pending: ignored (no interrupt, PROGRAMS unchanged, still pending)', d.sr(0, PROGRAMS) - progs)
    d.sw(0, ACK, 1)
    R.eq(d.sr(0, STATE), IDLE, sh, 'ACK clears the pending status')
    d.sw(0, ACK, 1)
    R.eq(d.sr(0, STATE), IDLE, sh, 'an ACK while idle does nothing')
    for v in (0, 3, 4, 0xffffffff):
        d.sw(0, DOORBELL, v)
    R.check(no_signal(d, d.ev[0]) and d.sr(0, STATE) == IDLE and d.sr(0, PROGRAMS) == progs, sh,
            'DOORBELL values 0, 3, 4, 0xffffffff are ignored', (d.sr(0, STATE), d.sr(0, PROGRAMS) - progs))
    # halt with no program running: nothing; the next start forgets it
    d.sw(0, DOORBELL, DB_HALT)
    R.check(no_signal(d, d.ev[0]) and d.sr(0, STATE) == IDLE, sh, 'a halt with no program running does nothing', d.sr(0, STATE))
    mem.fill(N, 3 * PAGE)
    r = d.runp([ccw(C_READ, 0, 3 * PAGE, N)], what='after idle halt')
    R.check(r['reason'] == OK and mem.read(N, 3 * PAGE) == store, sh, 'the next start forgets that halt: the program runs to its end', r.show())

    def halt_mid(a):
        mem.fill(N, 3 * PAGE)
        st = d.status_area()
        p = d.prog([ccw(C_READ, F_CC, 3 * PAGE, N), ccw(C_NOP, 0, 0)])
        if not held_start(d, a, 0, p, st):
            return
        d.sw(0, DOORBELL, DB_HALT)
        a.check(d.sr(0, STATE) == BUSY, sh, 'after the HALT doorbell, STATE stays busy until the program notices', d.sr(0, STATE))
        release(d, a)
        r = d.finish(0, st, 'halt mid')
        expect_reason(r, HALTED, both(sh, CC(S_PART)), 'HALT during the 1st block of a 3-block READ: unit exception, Halted at the next block; '
                      'BYTES 4096, residual 8192, CCWS 1, CPA out past the READ', sink=a, bytes=PAGE, residual=2 * PAGE, ccws=1, cpa_out=p + 16)
        a.check(mem.read(N, PAGE) == store[:PAGE] and mem.read(N + PAGE, 2 * PAGE) == bytes(2 * PAGE), CC(S_PART, 'exactly the blocks before that point'),
                'exactly the first block reached guest memory', '')
    vu.attempt(sh, 'halt mid-CCW', halt_mid)

    def halt_between(a):
        mem.fill(N, PAGE)
        st = d.status_area()
        p = d.prog([ccw(C_SEEK, F_CC | F_SLI, 12, d.alloc(1)), ccw(C_READ, F_CC, PAGE, N), ccw(C_NOP, 0, 0)])
        if not held_start(d, a, 0, p, st):
            return
        d.sw(0, DOORBELL, DB_HALT)
        release(d, a)
        r = d.finish(0, st, 'halt between')
        expect_reason(r, HALTED, both(sh, CC(S_RC, 'CPA out')),
                      'HALT during a 1-block READ followed by a NOP: Halted between CCWs; CCWS 2, CPA out past the NOP not fetched, residual the READ\'s (0)',
                      sink=a, bytes=PAGE, residual=0, ccws=2, cpa_out=p + 48)
    vu.attempt(sh, 'halt between CCWs', halt_between)

    def halt_after_sense(a):
        mem.fill(N + 0x100, 64, 0xff)
        st = d.status_area()
        p = d.prog([ccw(C_SENSE, F_CC | F_SLI, 64, N + 0x100), ccw(C_NOP, 0, 0)])
        if not held_start(d, a, 0, p, st):
            return
        d.sw(0, DOORBELL, DB_HALT)
        release(d, a)
        r = d.finish(0, st, 'halt after sense')
        expect_reason(r, HALTED, CC(S_RC, 'Residual: A program stopped between CCWs keeps the residual of the CCW before'),
                      'HALT while a SENSE 64 (SLI) delivers its 32 bytes, before a NOP: Halted between CCWs, residual the SENSE\'s (32)',
                      sink=a, bytes=32, residual=32, ccws=1, cpa_out=p + 32)
    vu.attempt(sh, 'halt after a SENSE', halt_after_sense)

    def halt_after_list(a, past_end):
        lst = N + 0x2000
        mem.write(lst, idaws([d.alloc(1), d.alloc(1)]))
        opnd = d.alloc(1)
        mem.write(opnd, struct.pack('<Q', d.r64(STORE_LO) - PAGE if past_end else 0))
        st = d.status_area()
        p = d.prog([ccw(C_SEEK, F_CC, 8, opnd), ccw(C_READ, F_IDA, 2 * PAGE, lst)])
        if not held_start(d, a, 0, p, st):
            return
        d.sw(0, DOORBELL, DB_HALT)
        release(d, a)
        r = d.finish(0, st, 'halt after list')
        if past_end:
            expect_reason(r, END_OF_STORE, CC(S_ORD, '3'), 'HALT while the READ\'s IDAW list is read, the READ past the store\'s end: EndOfStore before the stop',
                          sink=a, bytes=0, residual=2 * PAGE, ccws=2)
        else:
            expect_reason(r, HALTED, both(CC(S_ORD, '3: a stop (as in 1, looked at again now that the list is read)'), CC(S_RC, 'Residual')),
                          'HALT while the READ\'s IDAW list is read (list without an fd, its DMA held): Halted before any data, residual = count',
                          sink=a, bytes=0, residual=2 * PAGE, ccws=2, cpa_out=p + 32)
    vu.attempt(sh, 'halt during the list read', lambda a: halt_after_list(a, False))
    vu.attempt(sh, 'halt during the list read, past the end', lambda a: halt_after_list(a, True))

    def halt_late(a):
        st = d.status_area()
        p = d.prog([ccw(C_READ, 0, PAGE, N)])
        if not held_start(d, a, 0, p, st):
            return
        d.sw(0, DOORBELL, DB_HALT)
        release(d, a)
        r = d.finish(0, st, 'halt late')
        expect_reason(r, OK, sh, 'HALT during the only block of the last CCW: too late, the program ends with its own status', sink=a,
                      bytes=PAGE, ccws=1)
        r = d.runp([ccw(C_NOP, 0, 0)], what='after late halt')
        expect_reason(r, OK, sh, 'the next start forgets a halt that came too late', sink=a)
    vu.attempt(sh, 'halt too late', halt_late)

    def others(a):
        p = d.prog([ccw(C_READ, 0, 2 * PAGE, N)])
        if not held_start(d, a, 0, p, 0):
            return
        src = d.alloc(1)
        mem.write(src, b'x' * 100)
        r1 = d.runp([ccw(C_WRITE, F_CC, 100, src), ccw(C_NOP, 0, 0)], n=1, what='other sc')
        r3 = d.runp([ccw(C_NOP, 0, 0)], n=3, what='other sc3')
        a.check(r1['reason'] == OK and r3['reason'] == OK and d.sr(0, STATE) == BUSY, CC(S_UNMAP, 'Other programs'),
                'subchannels 1 and 3 run programs to their end while subchannel 0\'s is held', (r1.show(), r3.show()))
        d.sw(0, DOORBELL, DB_HALT)
        release(d, a)
        r = d.finish(0, 0, 'others halt')
        expect_reason(r, HALTED, sh, 'then subchannel 0\'s program halts', sink=a, bytes=PAGE)
    vu.attempt(sh, 'other subchannels', others)

# ######################################################################
# Interrupts (ccw.md § Registers (BAR0): Interrupts; § PCI identity)
# ######################################################################
def t_irq(env):
    R.sec('Interrupts: MSI-X, MSI, INTx (ccw.md § Registers (BAR0): Interrupts)')
    sock = env.server('main')
    d = Dev(sock)
    try:
        _msix(d)
    finally:
        teardown(d)
    d = Dev(sock, irq=None)
    try:
        _msi(d)
    finally:
        teardown(d)
    d = Dev(sock, irq='intx')
    try:
        _intx(d)
    finally:
        teardown(d)


def start_nop(d, n):
    p = d.prog([ccw(C_NOP, 0, n)])
    d.start(n, p, 0)
    return p


def _msix(d):
    ir = CC(S_REG, 'Interrupts')
    nop = d.prog([ccw(C_NOP, 0, 0)])
    got = []
    for n in range(4):
        d.start(n, nop, 0)
        d.finish(n, 0, 'msix %d' % n)
        d.c.barrier()
        got.append([e.take(0) for e in d.ev[:4]])
    R.eq(got, [[0] * 4] * 4, ir, 'MSI-X: subchannel n raises vector n only (no other vector signalled, and no second signal)')
    # the vectors reset masked
    d.msix_off()
    ctl = [d.c.rd(BAR0, MSIX_TABLE + 16 * n + 12, 4) & 1 for n in range(4)]
    R.eq(ctl, [0] * 4, ir, '(vectors unmasked by this driver)')
    # masked vector holds its message
    hold = CC(S_REG, 'Interrupts: An MSI-X vector holds its message while it is masked')
    d.msix_on(wire=False)
    d.vec_mask(0, True)
    start_nop(d, 0)
    d.wait_pending(0)
    R.check(no_signal(d, d.ev[0]), hold, 'a masked vector: no signal at the end of the program', '')
    pba = d.c.rd(BAR0, MSIX_PBA, 8)
    R.check(pba & 1, 'PCI Local Bus 3.0 § MSI-X PBA', 'the PBA shows vector 0 pending while it is masked', hex(pba))
    d.vec_mask(0, False)
    R.eq(d.ev[0].take(1), 1, hold, 'unmasking the vector delivers the held message (one signal)')
    R.eq(d.c.rd(BAR0, MSIX_PBA, 8) & 1, 0, 'PCI Local Bus 3.0 § MSI-X PBA', 'the pending bit clears once the message is sent')
    d.sw(0, ACK, 1)
    # function mask
    cap = d.caps[0x11]
    d.cfg_wr(cap + 2, 0xc000, 2)
    start_nop(d, 1)
    d.wait_pending(1)
    R.check(no_signal(d, d.ev[1]), hold, 'the function masked (MSI-X control bit 14): no signal', '')
    d.cfg_wr(cap + 2, 0x8000, 2)
    R.eq(d.ev[1].take(1), 1, hold, 'clearing the function mask delivers the held message')
    d.sw(1, ACK, 1)
    # INTx is not delivered while MSI-X is enabled
    d.intx_on()
    start_nop(d, 2)
    R.eq(d.ev[2].take(1), 1, ir, 'MSI-X enabled, INTx wired: the vector is signalled')
    R.check(no_signal(d, d.intx), ir, '... and INTx is not', '')
    d.sw(2, ACK, 1)
    # a message pending when MSI-X is disabled is dropped; the pending status then comes as INTx
    d.vec_mask(2, True)
    start_nop(d, 2)
    d.wait_pending(2)
    R.check(no_signal(d, d.ev[2]), hold, 'vector 2 masked: held', '')
    d.msix_off()
    R.eq(d.intx.take(1), 1, ir, 'MSI-X turned off with a status pending: the INTx interrupt comes')
    d.sw(2, ACK, 1)
    d.intx_unmask()
    d.msix_on(wire=False, unmask=False)
    d.vec_mask(2, False)
    R.check(no_signal(d, d.ev[2]), ir, 'the message pending when MSI-X was disabled was dropped: nothing when re-enabled and unmasked', '')
    R.check(no_signal(d, d.intx), ir, 'INTx stays quiet once the status was acknowledged (and MSI-X is on)', '')
    # unwired by SET_IRQS with no fds: masked, so the message is held and sent once wired again
    d.c.set_irqs(MSIX, DATA_EVENTFD | ACTION_TRIGGER, 3, 1)
    start_nop(d, 3)
    d.wait_pending(3)
    d.c.set_irqs(MSIX, DATA_EVENTFD | ACTION_TRIGGER, 3, 1, fds=[d.ev[3].fd])
    R.eq(d.ev[3].take(1), 1, CC(S_REG, 'Interrupts: SET_IRQS ... with no fds unwires the vectors it names and masks them'),
         'a vector unwired by SET_IRQS (no fds) holds its message; wiring it again sends it, once')
    d.sw(3, ACK, 1)
    # BME off holds MSI-X messages
    d.command(0x0002)
    start_nop(d, 1)
    d.wait_pending(1)
    R.check(no_signal(d, d.ev[1]), CC(S_PCI, 'Bus mastering'), 'bus mastering off: the completion\'s MSI-X message waits', '')
    d.command(0x0006)
    R.eq(d.ev[1].take(1), 1, CC(S_PCI, 'Bus mastering'), 'bus mastering on again: the pending message is delivered')
    R.eq(d.sr(1, REASON), BUS_MASTER_OFF, CC(S_PCI, 'Bus mastering'), '(that program ended BusMasterOff)')
    d.sw(1, ACK, 1)
    # a message pending (bus mastering off) when MSI-X is disabled is dropped
    d.command(0x0002)
    start_nop(d, 0)
    d.wait_pending(0)
    d.msix_off()
    R.eq(d.intx.take(1), 1, ir, 'MSI-X turned off with a message held by bus mastering: INTx comes instead')
    d.sw(0, ACK, 1)
    d.intx_unmask()
    d.command(0x0006)
    d.msix_on(wire=False)
    R.check(no_signal(d, d.ev[0]), ir, 'the message held by bus mastering was dropped when MSI-X was disabled', '')
    # IRQ_STATUS with several pending
    for n in (0, 2, 3):
        start_nop(d, n)
    for n in (0, 2, 3):
        d.ev[n].take(1)
        d.wait_pending(n)
    R.eq(d.r(IRQ_STATUS), 0b1101, CC(S_REG, 'IRQ_STATUS'), 'IRQ_STATUS: bits 0, 2 and 3 set while those subchannels have status pending')
    d.sw(2, ACK, 1)
    R.eq(d.r(IRQ_STATUS), 0b1001, CC(S_REG, 'IRQ_STATUS'), 'ACK of subchannel 2 clears bit 2 only')
    d.sw(0, ACK, 1)
    d.sw(3, ACK, 1)
    R.eq(d.r(IRQ_STATUS), 0, CC(S_REG, 'IRQ_STATUS'), 'all acknowledged: 0')


def _msi(d):
    ir = CC(S_REG, 'Interrupts')
    d.msi_on()
    d.intx_on()
    for n in (0, 2):
        start_nop(d, n)
        R.eq(d.msi.take(1), 1, ir, 'MSI enabled (MSI-X off): subchannel %d raises vector 0' % n)
        d.sw(n, ACK, 1)
    R.check(no_signal(d, d.intx), ir, 'INTx is not delivered while MSI is enabled', '')
    # MSI-X takes precedence over MSI
    d.msix_on()
    start_nop(d, 1)
    R.eq(d.ev[1].take(1), 1, ir, 'MSI-X and MSI both enabled: MSI-X vector 1')
    R.check(no_signal(d, d.msi), ir, '... and not MSI', '')
    d.sw(1, ACK, 1)
    d.msix_off()
    # no eventfd wired: lost
    d.c.set_irqs(MSI, DATA_EVENTFD | ACTION_TRIGGER, 0, 1)
    start_nop(d, 0)
    d.wait_pending(0)
    d.c.set_irqs(MSI, DATA_EVENTFD | ACTION_TRIGGER, 0, 1, fds=[d.msi.fd])
    R.check(no_signal(d, d.msi), ir, 'an MSI with no eventfd wired is lost (nothing once wired again)', '')
    d.sw(0, ACK, 1)
    # bus mastering off holds it
    d.command(0x0002)
    start_nop(d, 3)
    d.wait_pending(3)
    R.check(no_signal(d, d.msi), CC(S_PCI, 'Bus mastering'), 'bus mastering off: the MSI message waits', '')
    d.command(0x0006)
    R.eq(d.msi.take(1), 1, CC(S_PCI, 'Bus mastering'), 'bus mastering on: the MSI message is delivered')
    d.sw(3, ACK, 1)
    # held (bus mastering off) then MSI disabled: dropped; INTx comes
    d.command(0x0002)
    start_nop(d, 3)
    d.wait_pending(3)
    d.msi_off()
    R.eq(d.intx.take(1), 1, ir, 'MSI turned off with a status pending: the INTx interrupt comes')
    d.sw(3, ACK, 1)
    d.intx_unmask()
    d.command(0x0006)
    d.msi_on(wire=False)
    R.check(no_signal(d, d.msi), ir, 'the MSI message held when MSI was disabled was dropped', '')


def _intx(d):
    ir = CC(S_REG, 'Interrupts: INTx')
    start_nop(d, 0)
    R.eq(d.intx.take(1), 1, ir, 'neither MSI nor MSI-X enabled: INTx')
    d.wait_pending(0)
    start_nop(d, 1)
    d.wait_pending(1)
    R.check(no_signal(d, d.intx), both(ir, CC(S_PCI, 'GET_IRQ_INFO: INTx AUTOMASKED')),
            'a second completion while INTx is automasked: no signal', '')
    d.sw(0, ACK, 1)
    d.intx_unmask()
    R.eq(d.intx.take(1), 1, ir, 'ACK of one of two pending subchannels, then UNMASK: the level is still asserted, INTx again')
    d.sw(1, ACK, 1)
    d.intx_unmask()
    R.check(no_signal(d, d.intx), ir, 'ACK of the last pending subchannel deasserts INTx: UNMASK brings nothing', '')
    d.command(0x0002)
    start_nop(d, 2)
    R.eq(d.intx.take(1), 1, both(ir, CC(S_PCI, 'Bus mastering: INTx is not affected')), 'bus mastering off: INTx is still delivered')
    R.eq(d.sr(2, REASON), BUS_MASTER_OFF, CC(S_PCI, 'Bus mastering'), '(that program ended BusMasterOff)')
    d.sw(2, ACK, 1)
    d.intx_unmask()
    d.command(0x0006)
    R.check(no_signal(d, d.intx), ir, 'nothing more after the ACK', '')

# ######################################################################
# Bus mastering (ccw.md § PCI identity: Bus mastering)
# ######################################################################
def t_bme(env):
    R.sec('Bus mastering (ccw.md § PCI identity: Bus mastering)')
    d = Dev(env.server('main'), bme=False)
    try:
        nofd_maps(d)
        _bme(d)
    finally:
        teardown(d)


def _bme(d):
    mem, c = d.mem, d.c
    bm = CC(S_PCI, 'Bus mastering')
    N = NOFD_IOVA
    dst = d.alloc(1)
    mem.fill(dst, PAGE, 0x55)
    st = d.status_area()
    p = d.prog([ccw(C_READ, 0, 100, dst)])
    d.start(0, p, st)
    d.wait_pending(0)
    r = d.regs(0)
    expect_reason(r, BUS_MASTER_OFF, both(bm, CC(S_RC, 'BusMasterOff')),
                  'a program started with bus mastering off ends at once: channel-control check, CCWS 0, residual 0, CPA out = CPA + 16',
                  ccws=0, residual=0, bytes=0, cpa_out=p + 16)
    R.check(mem.read(st, 32) == b'\xee' * 32 and mem.read(dst, 100) == b'\x55' * 100, bm, 'nothing written: no status block, no data', '')
    R.check(no_signal(d, d.ev[0]), bm, 'its MSI-X message waits while bus mastering is off', '')
    d.command(0x0006)
    R.eq(d.ev[0].take(1), 1, bm, 'the message comes once bus mastering is on')
    d.sw(0, ACK, 1)
    # nothing read either: CCWs in memory without an fd are not fetched
    d.command(0x0002)
    mem.write(N + 0x10000, ccw(C_NOP, 0, 0))
    n0 = len(c.server_reqs)
    d.start(0, N + 0x10000, N + 0x10100)
    d.wait_pending(0)
    c.barrier()
    R.check(len(c.server_reqs) == n0 and d.sr(0, REASON) == BUS_MASTER_OFF, bm,
            'bus mastering off: a program whose CCWs lie in memory without an fd sends no DMA_READ/DMA_WRITE', len(c.server_reqs) - n0)
    d.sw(0, ACK, 1)
    d.command(0x0006)
    d.ev[0].take(1)
    store = pattern(3 * PAGE, 80)
    d.store_write(0, store)

    def mid(a):
        mem.fill(N, 3 * PAGE)
        st = d.status_area()
        p = d.prog([ccw(C_READ, F_CC, 3 * PAGE, N), ccw(C_NOP, 0, 0)])
        if not held_start(d, a, 0, p, st):
            return
        d.command(0x0002)
        release(d, a)
        d.wait_pending(0)
        r = d.regs(0)
        expect_reason(r, BUS_MASTER_OFF, both(bm, CC(S_PART)),
                      'bus mastering cleared during the 1st block of 3: BusMasterOff at the next block, BYTES 4096, residual 8192',
                      sink=a, bytes=PAGE, residual=2 * PAGE, ccws=1, cpa_out=p + 16)
        a.check(mem.read(st, 32) == b'\xee' * 32, bm, 'no status block written', '')
        a.check(mem.read(N, PAGE) == store[:PAGE] and mem.read(N + PAGE, 2 * PAGE) == bytes(2 * PAGE), CC(S_PART, 'exactly the blocks before'),
                'the block under way completed; nothing after it', '')
        a.check(no_signal(d, d.ev[0]), bm, 'the MSI-X message waits', '')
        d.command(0x0006)
        a.check(d.ev[0].take(1) == 1, bm, 'and comes with bus mastering', '')
        d.sw(0, ACK, 1)
    vu.attempt(bm, 'bus mastering off mid-CCW', mid)

    def between(a):
        st = d.status_area()
        p = d.prog([ccw(C_READ, F_CC, PAGE, N), ccw(C_NOP, 0, 0)])
        if not held_start(d, a, 0, p, st):
            return
        d.command(0x0002)
        release(d, a)
        d.wait_pending(0)
        r = d.regs(0)
        expect_reason(r, BUS_MASTER_OFF, both(bm, CC(S_RC, 'CPA out')),
                      'bus mastering cleared during a 1-block READ followed by a NOP: stopped before the NOP; CCWS 1, residual 0, CPA out past the NOP',
                      sink=a, bytes=PAGE, residual=0, ccws=1, cpa_out=p + 32)
        d.command(0x0006)
        d.ev[0].take(1)
        d.sw(0, ACK, 1)
    vu.attempt(bm, 'bus mastering off between CCWs', between)

    def both_stops(a):
        st = d.status_area()
        p = d.prog([ccw(C_READ, F_CC, 2 * PAGE, N), ccw(C_NOP, 0, 0)])
        if not held_start(d, a, 0, p, st):
            return
        d.sw(0, DOORBELL, DB_HALT)
        d.command(0x0002)
        release(d, a)
        d.wait_pending(0)
        r = d.regs(0)
        expect_reason(r, BUS_MASTER_OFF, CC(S_ORD, '1: a stop (bus mastering off, then a halt or an unmap)'),
                      'a halt and bus mastering off both pending: BusMasterOff is reported', sink=a, bytes=PAGE)
        d.command(0x0006)
        d.ev[0].take(1)
        d.sw(0, ACK, 1)
    vu.attempt(bm, 'bus mastering off and a halt', both_stops)
    r = d.runp([ccw(C_NOP, 0, 0)], what='after bme')
    expect_reason(r, OK, bm, 'with bus mastering on again, programs run')

# ######################################################################
# DMA unmap during I/O (ccw.md § DMA unmap during I/O)
# ######################################################################
def t_unmap(env):
    R.sec('DMA_UNMAP during programs (ccw.md § DMA unmap during I/O; vfio-user.md § Commands: DMA_UNMAP)')
    d = Dev(env.server('main'))
    try:
        nofd_maps(d)
        _unmap_held(d)
        unmap_race(d, 'track')
    finally:
        teardown(d)


def _unmap_held(d):
    mem, c = d.mem, d.c
    um = CC(S_UNMAP)
    store = pattern(3 * PAGE, 90)
    d.store_write(0, store)
    U = EXTRA + 0x200000

    def mid(a):
        m = mem.map_nofd(U, 64 * 1024)
        st = d.status_area()
        p = d.prog([ccw(C_READ, F_CC, 3 * PAGE, U), ccw(C_NOP, 0, 0)])
        if not held_start(d, a, 0, p, st):
            mem.unmap(m)
            return
        h = call_async(mem.unmap, m, forget=False)
        h.done.wait(vu.HOLD_LIMIT)
        replied = h.done.is_set()
        release(d, a)
        h.done.wait(vu.WAIT)
        a.check(h.done.is_set() and h.error is None, both(um, VU('Commands', 'DMA_UNMAP')),
                'DMA_UNMAP of memory without an fd that a held program is copying: succeeds', repr(h.error))
        if not replied:
            a.note(um, 'the DMA_UNMAP was answered only after this client answered the device\'s held DMA request')
        r = d.finish(0, st, 'unmap mid')
        expect_reason(r, DATA_UNMAPPED, both(CC(S_UNMAP, 'Memory without an fd'),
                                             CC(S_PART, 'For memory mapped without an fd ... a block outside the client\'s mappings ... ends it DataUnmapped')),
                      'unmapped during the 1st of 3 blocks: the next block, now outside the mappings, ends it; BYTES 4096, residual 8192',
                      sink=a, bytes=PAGE, residual=2 * PAGE, ccws=1, cpa_out=p + 16)
        c.mem = [(b, buf) for b, buf in c.mem if buf is not m.buf]
        mem.maps.remove(m)
    vu.attempt(um, 'unmap mid-CCW (memory without an fd)', mid)

    F = EXTRA + 0x300000

    def between(a, where):
        f = mem.map_fd(F, 64 * 1024)
        mem.fill(F, 64 * 1024)
        st = d.status_area()
        if where == 'data':
            tail = [ccw(C_READ, 0, 100, F)]
        elif where == 'list':
            mem.write(F, idaws([d.alloc(1)]))
            tail = [ccw(C_READ, F_IDA, 100, F)]
        else:
            mem.write(F + 0x100, ccw(C_NOP, 0, 0))
            tail = [ccw(C_TIC, 0, 0, F + 0x100)]
        p = d.prog([ccw(C_READ, F_CC, PAGE, NOFD_IOVA)] + tail)
        if not held_start(d, a, 0, p, st):
            mem.unmap(f)
            mem.maps.remove(f)
            return
        h = call_async(mem.unmap, f)
        h.done.wait(vu.HOLD_LIMIT)
        answered = h.done.is_set()
        release(d, a)
        h.done.wait(vu.WAIT)
        if not answered:
            a.void = 'the DMA_UNMAP was not answered within the 4 s this client may hold the device\'s DMA request'
            d.finish(0, st, 'void')
            mem.maps.remove(f)
            return
        a.check(h.error is None, CC(S_UNMAP, 'Between CCWs: An unmap between two CCWs of a chain does not wait'),
                'DMA_UNMAP of memory a later CCW needs, while the program is in an earlier CCW: answered while the program is held', repr(h.error))
        r = d.finish(0, st, 'unmap between ' + where)
        want = {'data': (DATA_UNMAPPED, 2), 'list': (IDAL_UNMAPPED, 2), 'ccw': (CCW_UNMAPPED, 2)}[where]
        expect_reason(r, want[0], CC(S_UNMAP, 'Between CCWs'),
                      'the program goes on; the later CCW needing the unmapped %s ends %s, a program check' % (where, REASONS[want[0]]),
                      sink=a, ccws=want[1], bytes=PAGE)
        mem.maps.remove(f)
    for where in ('data', 'list', 'ccw'):
        vu.attempt(um, 'unmap between CCWs (%s)' % where, lambda a: between(a, where))

    def failed_unmap(a):
        m = mem.map_nofd(U, 64 * 1024)
        p = d.prog([ccw(C_READ, 0, 3 * PAGE, U)])
        if not held_start(d, a, 0, p, 0):
            mem.unmap(m)
            return
        e = c.errno_of(vu.DMA_UNMAP, struct.pack('<IIQQ', 24, 0, U, 32 * 1024))
        a.check(e == E.EINVAL, VU('Commands', 'DMA_UNMAP'), 'DMA_UNMAP of half a mapping a program is copying: EINVAL (range cuts a mapping)', errname(e))
        release(d, a)
        r = d.finish(0, 0, 'failed unmap')
        expect_reason(r, OK, VU('Commands', 'DMA_UNMAP: a failed unmap cancels nothing'), 'the program runs to its end', sink=a, bytes=3 * PAGE)
        mem.unmap(m)
        mem.maps.remove(m)
    vu.attempt(um, 'a failed unmap', failed_unmap)


def unmap_race(d, mode, direction='read', tries=4):
    """A 16 MiB transfer through 4096 shuffled IDAWs into its own memfd mapping, unmapped while
    it runs. A first run without an unmap measures how long the transfer takes here; the tries
    then unmap after a fraction of that (a guess, never judged). Every outcome the doc allows is
    accepted and its invariants are checked."""
    mem, c = d.mem, d.c
    um = CC(S_UNMAP)
    ref = '%s [%s]' % (um, mode)
    count = 16 * MiB
    src = pattern(count, 91)
    d.store_write(0, src if direction == 'read' else bytes(count))
    order = list(range(4096))
    random.Random(92).shuffle(order)
    lst = d.alloc(8)
    mem.write(lst, idaws([BIG_MAP + i * PAGE for i in order]))
    cmd = C_READ if direction == 'read' else C_WRITE
    p = d.prog([ccw(cmd, F_IDA, count, lst)])
    p1 = d.prog([ccw(C_NOP, 0, 0)])
    seen = {}
    took = None
    for attempt_no in range(tries + 1):
        m = mem.map_fd(BIG_MAP, count + PAGE)
        if direction == 'write':
            for k, i in enumerate(order):
                m.buf[i * PAGE:(i + 1) * PAGE] = src[k * PAGE:(k + 1) * PAGE]
        st = d.status_area()
        t0 = time.monotonic()
        d.start(0, p, st)
        if took is None:
            r = d.finish(0, st, 'unmap race calibration')
            took = time.monotonic() - t0
            R.check(r['reason'] == OK, ref, '[%s] the 16 MiB %s through 4096 shuffled IDAWs runs' % (mode, direction.upper()), r.show())
            mem.unmap(m)
            mem.maps.remove(m)
            m.buf.close()
            os.close(m.fd)
            if direction == 'write':
                d.store_write(0, bytes(count))
            continue
        time.sleep(took * [0.4, 0.2, 0.6, 0.05][(attempt_no - 1) % 4])
        err = 0
        try:
            c.dma_unmap(BIG_MAP, count + PAGE)
        except VfioErr as e:
            err = e.errno
        m.mapped = False
        d.start(1, p1, 0)
        r1 = d.finish(1, 0, 'other during unmap')
        r = d.finish(0, st, 'unmap race %s' % mode)
        R.check(err == 0, both(CC(S_UNMAP, 'Timing'), VU('Commands', 'DMA_UNMAP')),
                '[%s] DMA_UNMAP of a mapping a 16 MiB %s is using: succeeds, without EBUSY (try %d)' % (mode, direction.upper(), attempt_no),
                errname(err))
        R.check(r1['reason'] == OK, CC(S_UNMAP, 'Other programs'), '[%s] another subchannel\'s program runs meanwhile' % mode, r1.show())
        reason = r['reason']
        name = REASONS[reason] if reason < len(REASONS) else str(reason)
        seen[name] = seen.get(name, 0) + 1
        R.check(reason in (OK, UNMAPPED, DATA_UNMAPPED) and status_ok(r, reason), ref,
                '[%s] the program ends Ok (the unmap came after it), Unmapped (unit exception) or DataUnmapped (before its pin)' % mode, r.show())
        moved = r['bytes']
        R.check(moved + r['residual'] == count and moved % PAGE == 0 and (reason != DATA_UNMAPPED or moved == 0)
                and (reason != OK or moved == count), CC(S_PART, 'BYTES + residual = count'),
                '[%s] BYTES + residual = count, whole blocks' % mode, r.show())
        k = moved // PAGE
        if direction == 'read':
            bad = [j for j, i in enumerate(order)
                   if bytes(m.buf[i * PAGE:(i + 1) * PAGE]) != (src[j * PAGE:(j + 1) * PAGE] if j < k else bytes(PAGE))]
            R.check(not bad, CC(S_PART, 'exactly the blocks before that point have reached ... guest memory (READ), in IDAW order'),
                    '[%s] exactly the first %d blocks in IDAW order reached guest memory, none after' % (mode, k),
                    'wrong blocks (IDAW index) %s' % bad[:5])
        else:
            got = d.store_read(0, count)
            R.check(got is not None and got[:moved] == src[:moved] and got[moved:] == bytes(count - moved),
                    CC(S_PART, 'exactly the blocks before that point have reached the store (WRITE)'),
                    '[%s] exactly the first %d blocks reached the store, nothing after' % (mode, k), '')
            d.store_write(0, bytes(count))
        mem.maps.remove(m)
        try:
            m.buf.close()
        except (BufferError, ValueError):
            pass
        os.close(m.fd)
        if reason == UNMAPPED:
            break
    if 'Unmapped' not in seen:
        R.note(ref, '[%s] the unmap never landed mid-transfer in %d tries (outcomes %s): the Unmapped path of a pinned CCW was not exercised'
               % (mode, tries, seen))
    else:
        R.info('[%s] unmap race outcomes: %s (a full transfer took %.1f ms here)' % (mode, seen, took * 1000))


# ######################################################################
# Memory the client truncated (ccw.md § Reason codes: DeviceError, § A CCW that stops partway)
# ######################################################################
def t_trunc(env):
    R.sec('Memory the client truncated (ccw.md § Reason codes: DeviceError)')
    d = Dev(env.server('main'))
    try:
        _trunc(d, 'track')
    finally:
        teardown(d)


def _trunc(d, mode):
    mem = d.mem
    de = CC(S_RC, 'DeviceError')
    T = EXTRA + 0x400000
    t = mem.map_fd(T, 64 * 1024)
    mem.write(T, pattern(4 * PAGE, 95))
    good = pattern(4 * PAGE, 95)
    os.ftruncate(t.fd, 16 * 1024)     # pages 4-15 of the mapping now lie past the end of the file
    r = d.runp([ccw(C_WRITE, 0, PAGE, T + PAGE)], what='untruncated first')
    R.check(r['reason'] == OK and d.store_read(0, PAGE) == good[PAGE:2 * PAGE], de,
            'the memfd truncated to 16 KiB: a WRITE from a page still inside it works', r.show())
    d.store_write(0, bytes(4 * PAGE))
    r = d.runp([ccw(C_WRITE, 0, PAGE, T + 8 * PAGE)], what='trunc write')
    expect_reason(r, DEVICE_ERROR, de, 'WRITE from memory the client truncated: unit check, residual = count', residual=PAGE, bytes=0)
    r = d.runp([ccw(C_READ, 0, PAGE, T + 8 * PAGE)], what='trunc read')
    expect_reason(r, DEVICE_ERROR, de, 'READ into memory the client truncated', residual=PAGE, bytes=0)
    lst = d.alloc(1)
    mem.write(lst, idaws([T, T + PAGE, T + 8 * PAGE, T + 2 * PAGE]))
    r = d.runp([ccw(C_WRITE, F_IDA, 4 * PAGE, lst)], what='trunc partway')
    moved = r['bytes']
    R.check(r['reason'] == DEVICE_ERROR and status_ok(r, DEVICE_ERROR) and moved + r['residual'] == 4 * PAGE and moved in (0, 2 * PAGE),
            both(de, CC(S_PART, 'when a copy fails mid-way (DeviceError: memory the client truncated)')),
            'WRITE through [ok, ok, truncated, ok]: DeviceError, BYTES 0 (pin refused) or 8192 (stopped at the 3rd block), BYTES + residual = count',
            r.show())
    got = d.store_read(0, 4 * PAGE)
    R.check(got is not None and got[:moved] == good[:moved] and got[moved:] == bytes(4 * PAGE - moved), CC(S_PART, 'exactly the blocks before'),
            '... exactly BYTES (%d) bytes reached the store' % moved, '')
    r = d.run(T + 9 * PAGE, what='trunc ccw')
    expect_reason(r, DEVICE_ERROR, de, 'a CCW in memory the client truncated: DeviceError', ccws=0)
    r = d.runp([ccw(C_WRITE, F_IDA, PAGE, T + 10 * PAGE)], what='trunc list')
    expect_reason(r, DEVICE_ERROR, de, 'an IDAW list in memory the client truncated: DeviceError', residual=PAGE)
    r = d.runp([ccw(C_SEEK, 0, 8, T + 11 * PAGE)], what='trunc seek')
    expect_reason(r, DEVICE_ERROR, de, 'a SEEK operand in memory the client truncated: DeviceError')
    p = d.prog([ccw(C_NOP, 0, 0)])
    d.start(0, p, T + 12 * PAGE)
    r = d.finish(0, 0, 'trunc status')
    R.check(r['reason'] == OK, CC(S_SB, 'Writing the status block'), 'a status block in truncated memory: the program still ends normally', r.show())
    poison = both(de, VU('Commands', 'DMA_MAP: If the client later truncates the file under a mapping'))
    r = d.runp([ccw(C_WRITE, 0, PAGE, T + PAGE)], what='untruncated part')
    os.ftruncate(t.fd, 64 * 1024)
    mem.write(T + 8 * PAGE, pattern(PAGE, 96))
    r2 = d.runp([ccw(C_WRITE, 0, PAGE, T + 8 * PAGE)], what='regrown')
    if mode == 'track':
        expect_reason(r, DEVICE_ERROR, poison, '[track] after a copy met a missing page, the whole mapping is poisoned: '
                      'a WRITE from a page still inside the file ends DeviceError too')
        expect_reason(r2, DEVICE_ERROR, poison, '[track] the memfd grown back: the poisoned mapping still fails until it is mapped again')
    else:
        R.check(r['reason'] == OK, poison, '[%s] after those DeviceErrors (pins refused, nothing poisoned), a WRITE from a page still '
                'inside the file works' % mode, r.show())
        R.check(r2['reason'] == OK, poison, '[%s] the memfd grown back: the missing pages work again' % mode, r2.show())
    mem.unmap(t)
    mem.maps.remove(t)
    t = mem.map_fd(T, 64 * 1024)
    mem.write(T + 8 * PAGE, pattern(PAGE, 97))
    r = d.runp([ccw(C_WRITE, 0, PAGE, T + 8 * PAGE)], what='mapped again')
    R.check(r['reason'] == OK and d.store_read(0, PAGE) == pattern(PAGE, 97), poison,
            '[%s] unmapped and mapped again (a whole memfd): WRITEs from it work' % mode, r.show())
    mem.unmap(t)
    mem.maps.remove(t)

# ######################################################################
# Reset and disconnect (ccw.md § Registers (BAR0): Reset)
# ######################################################################
def t_reset(env):
    R.sec('Reset and disconnect (ccw.md § Registers (BAR0): Reset; vfio-user.md § Connections: Disconnect)')
    sock = env.server('main')
    d0 = Dev(sock, irq=None, bme=False)
    cfg0 = d0.c.region_read(CONFIG, 0, 256)
    d0.close()
    d = Dev(sock)
    try:
        nofd_maps(d)
        _reset_idle(d, cfg0)
        _reset_mid(d)
    finally:
        teardown(d)
    _disconnect(env, sock, cfg0)


def all_sc_regs(d):
    return [d.sr(n, o) for n in range(d.nsc) for o in range(0, 0x40, 4)] + [d.r(IRQ_STATUS)]


def _reset_idle(d, cfg0):
    mem, c = d.mem, d.c
    rs = CC(S_REG, 'Reset')
    d.intx_on()
    src = d.alloc(1)
    mem.write(src, pattern(PAGE, 100))
    for n in range(4):
        d.runp([ccw(C_WRITE, F_CC, 100, src), ccw(C_SEEK, 0, 8, src)], n=n, what='dirty %d' % n)
    d.start(1, d.prog([ccw(C_NOP, 0, 0)]), d.status_area())
    d.finish(1, 0, 'pending', ack=False)
    d.sw(2, CPA_LO, 0x1234)
    d.sw(2, ST_LO, 0x5678)
    d.cfg_wr(0x10, 0xfebf0000, 4)
    d.cfg_wr(0x3c, 0x0b, 1)
    d.msi_on(wire=False)
    before = sum(1 for v in all_sc_regs(d) if v)
    R.check(before > 10 and d.r(IRQ_STATUS) == 2, rs, '(before the reset: registers set, subchannel 1 pending)', before)
    c.reset()
    R.eq(all_sc_regs(d), [0] * 65, rs, 'DEVICE_RESET: every subchannel register 0 (CPA, STATUS, STATE, REASON, PROGRAMS, ...), IRQ_STATUS 0')
    R.eq([d.r(ID), d.r(SUBCHANNELS), d.r(PIN_MODE), d.r64(STORE_LO)], [CCW_ID, 4, 0, 64 * MiB], rs, 'ID, SUBCHANNELS, PIN_MODE, STORE_SIZE unchanged')
    cfg = c.region_read(CONFIG, 0, 256)
    diff = [(hex(i), cfg0[i], cfg[i]) for i in range(256) if cfg[i] != cfg0[i]]
    R.check(not diff, rs, 'config space back to its power-on state (COMMAND, MSI/MSI-X enables, BAR0, INTERRUPT_LINE, MSI address/data)', diff[:8])
    ctl = [c.rd(BAR0, MSIX_TABLE + 16 * n + 12, 4) & 1 for n in range(4)]
    R.eq(ctl, [1] * 4, rs, 'the MSI-X table masked')
    R.eq(c.rd(BAR0, MSIX_PBA, 8), 0, rs, 'no MSI-X message pending after the reset')
    # COMMAND is 0: a program now ends BusMasterOff
    p = d.prog([ccw(C_NOP, 0, 0)])
    d.start(0, p, 0)
    d.wait_pending(0)
    R.eq(d.sr(0, REASON), BUS_MASTER_OFF, rs, 'after DEVICE_RESET a program started before setting COMMAND again ends BusMasterOff')
    R.check(no_signal(d, d.intx), rs, 'the INTx eventfd wired before the reset is dropped: no signal for that completion', '')
    d.sw(0, ACK, 1)
    # the eventfds were dropped: re-enabling MSI-X without SET_IRQS signals nothing
    d.command(0x0006)
    d.msix_on(wire=False)
    d.start(0, p, 0)
    d.wait_pending(0)
    R.check(no_signal(d, d.ev[0]), rs, 'the MSI-X eventfds wired before the reset are dropped (MSI-X re-enabled without SET_IRQS: no signal)', '')
    d.sw(0, ACK, 1)
    d.msix_on()
    r = d.runp([ccw(C_NOP, 0, 0)], what='after reset')
    expect_reason(r, OK, rs, 'wired again (as the VMM does), programs run and interrupt', ccws=1)
    R.eq(d.sr(0, PROGRAMS), 3, rs, 'PROGRAMS counts from 0 again: 3 after the three programs since the reset')
    got = d.store_read(0, 100)
    R.check(got == pattern(PAGE, 100)[:100], CC(S_REG, 'Reset: The store keeps its data'), 'DEVICE_RESET keeps the store\'s data',
            fmt_b(got) if got != pattern(PAGE, 100)[:100] else '')


def fmt_b(b):
    return 'None' if b is None else b[:8].hex()


def _reset_mid(d):
    mem, c = d.mem, d.c
    rs = CC(S_REG, 'Reset')
    N = NOFD_IOVA

    def mid(a):
        mem.fill(N, 3 * PAGE, 0x66)
        s1 = d.status_area()
        p = d.prog([ccw(C_READ, 0, 3 * PAGE, N)])
        if not held_start(d, a, 0, p, s1):
            return
        h = call_async(c.reset)
        h.done.wait(vu.HOLD_LIMIT)
        if not h.done.is_set():
            release(d, a)
            h.done.wait(vu.WAIT)
            a.void = 'DEVICE_RESET was not answered within the 4 s this client may hold the device\'s DMA request'
            return
        a.check(h.error is None, rs, 'DEVICE_RESET with a program running (its DMA held by this client): answered while the program is held',
                repr(h.error))
        a.check(all_sc_regs(d) == [0] * 65, rs, 'right after the reset: the subchannel reads idle with every register 0', '')
        d.command(0x0006)
        d.msix_on()
        s2 = d.status_area()
        p2 = d.prog([ccw(C_NOP, 0, 5)])
        d.start(0, p2, s2)
        release(d, a)
        r = d.finish(0, s2, 'after reset mid')
        expect(r, dict(reason=OK, ccws=1, cpa_out=p2 + 16, programs=1), rs,
               'a start right after the reset is accepted and runs once the stopped program lets go; PROGRAMS 1', sink=a)
        a.check(mem.read(s1, 32) == b'\xee' * 32, rs, 'the stopped program reports nothing: no status block', '')
        a.check(no_signal(d, d.ev[0]), rs, '... and no interrupt of its own', '')
        a.check(mem.read(N + PAGE, 2 * PAGE) == b'\x66' * 2 * PAGE, rs, '... and nothing after the block under way reached guest memory', '')
    vu.attempt(rs, 'reset mid-program', mid)


def _disconnect(env, sock, cfg0):
    rs = CC(S_REG, 'Reset')
    dc = both(rs, VU('Connections', 'Disconnect'))
    N = NOFD_IOVA
    d = Dev(sock)
    nofd_maps(d)
    d.store_write(0, pattern(PAGE, 101))
    d.cfg_wr(0x10, 0xfebf0000, 4)
    d.cfg_wr(0x3c, 0x0b, 1)
    s1 = d.status_area()
    d.c.dma_policy = 'hold'
    d.start(0, d.prog([ccw(C_READ, 0, 3 * PAGE, N)]), s1)
    held = d.c.wait_held(1)
    d.sw(1, CPA_LO, 0x4444)
    d.c.close()
    d2 = Dev(sock, irq=None, bme=False)
    try:
        R.check(held, dc, '(a program held mid-transfer when the client disconnected)', '')
        R.eq(all_sc_regs(d2), [0] * 65, dc, 'the next client finds every subchannel idle with every register 0')
        cfg = d2.c.region_read(CONFIG, 0, 256)
        diff = [(hex(i), cfg0[i], cfg[i]) for i in range(256) if cfg[i] != cfg0[i]]
        R.check(not diff, dc, 'the next client finds config space in its power-on state (COMMAND, MSI-X enable, BAR0, INTERRUPT_LINE)', diff[:8])
        R.eq(d.mem.read(s1, 32), b'\xee' * 32, dc, 'the program stopped by the disconnect wrote no status block')
        d2.command(0x0006)
        d2.msix_on()
        r = d2.runp([ccw(C_NOP, 0, 0)], what='after disconnect')
        expect_reason(r, OK, dc, 'the next client runs programs', ccws=1)
        got = d2.store_read(0, PAGE)
        R.check(got == pattern(PAGE, 101), CC(S_REG, 'Reset: The store keeps its data'), 'the next client reads the store as the last one left it',
                fmt_b(got) if got != pattern(PAGE, 101) else '')
        # a disconnect during a large pinned transfer
        src = pattern(16 * MiB, 102)
        d2.mem.write(BIG_SRC, src)
        d2.start(0, d2.prog([ccw(C_WRITE, 0, 16 * MiB, BIG_SRC)]), 0)
        d2.c.close()
        d3 = Dev(sock)
        R.eq(all_sc_regs(d3), [0] * 65, dc, 'a client that left during a 16 MiB WRITE: the next finds every register 0')
        r = d3.runp([ccw(C_NOP, 0, 0)], what='after disconnect 2')
        expect_reason(r, OK, dc, '... and runs programs')
        d3.close()
    finally:
        d.mem.close()
        teardown(d2)

# ######################################################################
# Stores (ccw.md § Instance options)
# ######################################################################
F_OFD_GETLK = 36


def ofd_locked(path):
    """True if some process holds a lock on any byte of path (F_OFD_GETLK)."""
    fd = os.open(path, os.O_RDWR)
    try:
        fl = struct.pack('hhqqi4x', fcntl.F_WRLCK, 0, 0, 0, 0)
        res = fcntl.fcntl(fd, F_OFD_GETLK, fl)
        return struct.unpack('hhqqi4x', res)[0] != fcntl.F_UNLCK
    finally:
        os.close(fd)


def t_store(env):
    R.sec('Stores: RAM sizes, files, the older spellings (ccw.md § Instance options)')
    opt = CC(S_OPT)
    for opts, size, what in ((['store=ram:5000'], 5000, 'store=ram:5000 (bytes, no suffix)'), (['store=ram:4K'], 4096, 'store=ram:4K'),
                             (['size=3M'], 3 * MiB, 'size=3M (the older spelling)'), (['store=ram:64G'], 64 * GiB, 'store=ram:64G (the largest)')):
        p, out = env.try_start(opts)
        if p is None:
            R.check(False, opt, '%s starts' % what, out)
            continue
        d = Dev(p.sock)
        try:
            R.eq(d.r64(STORE_LO), size, opt, '%s: STORE_SIZE' % what)
            edge(d, size, what)
        finally:
            teardown(d)
            env.stop(p)
    # files
    path = env.path('store.img')
    content = pattern(64 * 1024, 110)
    with open(path, 'wb') as f:
        f.write(content)
    p, out = env.try_start(['store=file:' + path])
    if p is None:
        R.check(False, opt, 'store=file:/PATH starts', out)
        return
    d = Dev(p.sock)
    try:
        R.eq(d.r64(STORE_LO), 64 * 1024, opt, 'store=file: STORE_SIZE is the file\'s size')
        got = d.store_read(0, 64 * 1024)
        R.check(got == content, opt, 'store=file: a READ returns the file\'s bytes', fmt_b(got))
        data = pattern(10000, 111)
        d.store_write(4096 + 7, data)
        with open(path, 'rb') as f:
            f.seek(4096 + 7)
            ondisk = f.read(10000)
        R.check(ondisk == data, opt, 'store=file: a WRITE is in the file (read through the page cache) once its status came', '')
        edge(d, 64 * 1024, 'store=file (64 KiB)')
        R.check(ofd_locked(path), both(opt, cite('nvme.md', 'Backing files', 'A regular file is locked')),
                'the store file is locked (an open-file-description lock) while the device runs', '')
        ok, out = env.refused(['store=file:' + path])
        R.check(ok and 'in use' in out, both(opt, cite('nvme.md', 'Backing files')), 'a second device on the same file is refused ("in use")', out)
    finally:
        teardown(d)
    rc = env.stop(p)
    R.check(not ofd_locked(path), cite('nvme.md', 'Backing files', 'The lock and the claim are let go when the device stops'),
            'the lock is let go when the device stops', rc)
    with open(path, 'rb') as f:
        f.seek(4096 + 7)
        R.check(f.read(10000) == data, opt, 'the file keeps the data after the device stops', '')
    small = env.path('small5000.img')
    with open(small, 'wb') as f:
        f.write(pattern(5000, 112))
    p, out = env.try_start(['file=' + path])
    R.check(p is not None, cite('nvme.md', 'Backing files', 'a device started next on the same file gets it at once'),
            'file=/PATH (the older spelling) on the same file, right after: starts', out)
    if p is not None:
        d = Dev(p.sock)
        try:
            got = d.store_read(4096 + 7, 10000)
            R.check(got == data, opt, 'file=/PATH: the same store', fmt_b(got))
        finally:
            teardown(d)
            env.stop(p)
    p, out = env.try_start(['store=file:' + small])
    R.check(p is not None, opt, 'a store file of 5000 bytes (at least 4 KiB) starts', out)
    if p is not None:
        d = Dev(p.sock)
        try:
            R.eq(d.r64(STORE_LO), 5000, opt, 'a 5000-byte store file: STORE_SIZE 5000')
            R.eq(d.store_read(0, 5000), pattern(5000, 112), opt, 'a 5000-byte store file: READ of all of it')
            edge(d, 5000, '5000-byte file')
        finally:
            teardown(d)
            env.stop(p)
    R.note(opt, 'block-device stores (store=file:/dev/...) were not exercised (no spare block device)')
    os.unlink(path)
    os.unlink(small)


def edge(d, size, what):
    """The store's edges: a WRITE/READ of its last bytes, one byte more, SEEK to size and past."""
    mem = d.mem
    n = min(size, 4096)
    data = pattern(n, size & 0xffff)
    src = d.alloc(2)
    mem.write(src, data)
    opnd = d.alloc(1)
    mem.write(opnd, struct.pack('<Q', size - n))
    r = d.runp([ccw(C_SEEK, F_CC, 8, opnd), ccw(C_WRITE, 0, n, src)], what='edge')
    got = d.store_read(size - n, n)
    R.check(r['reason'] == OK and got == data, CC(S_RC, 'EndOfStore'), '%s: WRITE and READ of the last %d bytes' % (what, n), r.show())
    r = d.runp([ccw(C_SEEK, F_CC, 8, opnd), ccw(C_WRITE, 0, n + 1, src)], what='edge+1')
    expect_reason(r, END_OF_STORE, CC(S_RC, 'EndOfStore'), '%s: one byte more' % what, residual=n + 1)
    mem.write(opnd, struct.pack('<Q', size))
    r = d.runp([ccw(C_SEEK, F_CC, 8, opnd), ccw(C_READ, 0, 1, src)], what='edge size')
    expect_reason(r, END_OF_STORE, CC(S_RC, 'SEEK'), '%s: SEEK to the size accepted, READ there EndOfStore' % what, ccws=2)
    mem.write(opnd, struct.pack('<Q', size + 1))
    r = d.runp([ccw(C_SEEK, 0, 8, opnd)], what='edge size+1')
    expect_reason(r, SEEK_OUT_OF_RANGE, CC(S_RC, 'SEEK'), '%s: SEEK to size + 1' % what)


# ######################################################################
# Pin modes (ccw.md § Instance options: --pin-mode; § DMA unmap during I/O)
# ######################################################################
def t_modes(env):
    for i, mode in enumerate(('track', 'lock', 'kernel')):
        R.sec('Pin mode %s (ccw.md § Instance options, § DMA unmap during I/O)' % mode)
        p, out = env.try_start(extra=['--pin-mode', mode], name='mode-' + mode)
        if p is None:
            if mode == 'kernel' and 'io_uring' in out:
                R.note(CC(S_OPT), '--pin-mode kernel could not start here (io_uring refused): %s' % out[-200:])
            else:
                R.check(False, CC(S_OPT), '--pin-mode %s starts' % mode, out[-300:])
            continue
        d = Dev(p.sock)
        try:
            R.eq(d.r(PIN_MODE), i, CC(S_REG, 'PIN_MODE'), '[%s] PIN_MODE' % mode)
            area = d.alloc(12)
            pages = [area + k * PAGE for k in range(12)]
            scatter_write_read(d, [pages[k] for k in (1, 5, 6, 7, 9)], 0x10, 5 * PAGE - 0x10, PAGE, 120 + i,
                               '[%s] pages [1,5,6,7,9]' % mode, both(CC(S_IDAW), CC(S_EXEC, 'Guest memory')))
            scatter_write_read(d, [pages[2] + 0x800, pages[2], pages[11] + 0x800, pages[0]], 0, 4 * 2048, 2048, 130 + i,
                               '[%s] IDA_2K, one page\'s two halves reversed' % mode, CC(S_IDAW, 'Pinning'))
            unmap_race(d, mode)
            if mode == 'lock':
                unmap_race(d, mode + ', write', direction='write')
            _trunc(d, mode)
        finally:
            teardown(d)
            env.stop(p)


# ######################################################################
# Many subchannels (ccw.md § Instance options: subchannels)
# ######################################################################
def t_multi(env):
    R.sec('16 subchannels at once, and 1 (ccw.md § Instance options, § Registers (BAR0))')
    d = Dev(env.server('s16'))
    try:
        _multi(d)
    finally:
        teardown(d)
    p, out = env.try_start(['subchannels=1'])
    if p is None:
        R.check(False, CC(S_OPT), 'subchannels=1 starts', out)
        return
    d = Dev(p.sock)
    try:
        R.eq(d.r(SUBCHANNELS), 1, CC(S_OPT), 'subchannels=1: SUBCHANNELS 1')
        R.eq(d.c.irq_info(MSIX)[3], 1, CC(S_PCI), 'subchannels=1: MSI-X has 1 vector')
        nop = d.prog([ccw(C_NOP, 0, 0)])
        d.sw(1, CPA_LO, nop)
        d.sw(1, DOORBELL, DB_START)
        R.check(no_signal(d, d.ev[0]) and [d.sr(1, o) for o in range(0, 0x40, 4)] == [0] * 16 and d.r(IRQ_STATUS) == 0,
                CC(S_REG, 'Access widths: Writes ... to absent subchannels are ignored'), 'subchannels=1: a start on subchannel 1 is ignored, its block reads 0', '')
        r = d.run(nop, what='sc0 of 1')
        expect_reason(r, OK, CC(S_OPT), 'subchannels=1: subchannel 0 runs', ccws=1)
    finally:
        teardown(d)
        env.stop(p)


def _multi(d):
    mem = d.mem
    R.eq(d.r(SUBCHANNELS), 16, CC(S_OPT), 'subchannels=16: SUBCHANNELS 16')
    R.eq(d.c.irq_info(MSIX)[3], 16, CC(S_PCI), 'MSI-X: 16 vectors')
    R.eq((d.cfg_rd(d.caps[0x11] + 2, 2) & 0x7ff) + 1, 16, CC(S_PCI), 'MSI-X table size 16')
    datas, sts, progs = [], [], []
    rng = random.Random(140)
    pool = list(range(16 * 16))
    rng.shuffle(pool)
    base = d.alloc(16 * 16)
    for n in range(16):
        data = pattern(16 * PAGE - 100, 141 + n)
        blocks = [base + k * PAGE for k in pool[n * 16:(n + 1) * 16]]
        mem.write(blocks[0] + 100, data[:PAGE - 100])
        for k in range(1, 16):
            mem.write(blocks[k], data[PAGE - 100 + (k - 1) * PAGE:PAGE - 100 + k * PAGE])
        lst = d.alloc(1)
        mem.write(lst, idaws([blocks[0] + 100] + blocks[1:]))
        opnd = d.alloc(1)
        mem.write(opnd, struct.pack('<Q', n * 16 * PAGE + n))
        datas.append(data)
        sts.append(d.status_area())
        progs.append(d.prog([ccw(C_SEEK, F_CC, 8, opnd), ccw(C_WRITE, F_IDA, len(data), lst)]))
    for n in range(16):
        d.start(n, progs[n], sts[n])
    got = [d.ev[n].take(1) for n in range(16)]
    R.eq(got, [1] * 16, CC(S_REG, 'Interrupts'), '16 programs started together: each subchannel\'s vector signalled once')
    wait_until(lambda: d.r(IRQ_STATUS) == 0xffff)
    R.eq(d.r(IRQ_STATUS), 0xffff, CC(S_REG, 'IRQ_STATUS'), 'IRQ_STATUS: all 16 bits set')
    res = [d.finish(n, sts[n], 'multi %d' % n, irq=False) for n in range(16)]
    R.check(all(r['reason'] == OK and r['bytes'] == len(datas[0]) for r in res), CC(S_OPT, 'subchannels=N'),
            'all 16 programs (SEEK + scattered 16-IDAW WRITE) ended Ok', [r.show() for r in res if r['reason'] != OK][:2])
    bad = [n for n in range(16) if d.store_read(n * 16 * PAGE + n, len(datas[n]), n=n) != datas[n]]
    R.check(not bad, CC(S_OPT, 'subchannels=N'), 'each subchannel\'s data is in the store at its own position, byte for byte (read back on each subchannel)', bad)

# ######################################################################
# The doc's `umdev start` example, through a daemon (ccw.md § Instance options; README.md)
# ######################################################################
def t_daemon(env):
    R.sec('The doc\'s example through a daemon (ccw.md § Instance options; README.md § Serving devices to QEMU)')
    run, state = env.path('run'), env.path('dstate')
    env.daemon = env.spawn(['daemon', '--run-dir', run, '--state-dir', state], 'daemon')
    out = {}

    def started():
        if env.daemon.poll() is not None:
            return True
        p = subprocess.run([env.bin, 'start', '--type', 'ccw', '--opt', 'store=ram:1G', '--opt', 'subchannels=8', '--pin-mode', 'lock',
                            '--run-dir', run, '--state-dir', state], capture_output=True, text=True, timeout=vu.WAIT + 30)
        out['o'] = p.stdout + p.stderr
        return p.returncode == 0
    wait_until(started, step=0.05)
    mu = re.search(r'[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}', out.get('o', ''))
    ms = re.search(r'(/\S+\.sock)', out.get('o', ''))
    ex = CC(S_OPT, 'For example')
    if not (mu and ms):
        R.check(False, ex, '`umdev start --type ccw --opt store=ram:1G --opt subchannels=8 --pin-mode lock` starts an instance', out.get('o', '')[:300])
        return
    uuid, sock = mu.group(0), ms.group(1)
    d = Dev(sock)
    try:
        R.eq([d.r(SUBCHANNELS), d.r(PIN_MODE), d.r64(STORE_LO)], [8, 1, GiB], ex,
             'the doc\'s example instance: SUBCHANNELS 8, PIN_MODE 1 (lock), STORE_SIZE 1 GiB')
        area = d.alloc(10)
        scatter_write_read(d, [area + k * PAGE for k in (1, 5, 6, 7, 9)], 0, 5 * PAGE, PAGE, 150, 'daemon instance, pages [1,5,6,7,9]', ex, n=7)
        rc, so, se = env.umdev('stats', '-u', uuid, '--run-dir', run)
        try:
            js = json.loads(so)
        except ValueError:
            js = None
        R.check(rc == 0 and isinstance(js, dict) and uuid in json.dumps(js), RM('Serving devices to QEMU', 'umdev stats'),
                '`umdev stats -u UUID` gives JSON naming the instance', '' if js else (so + se)[:200].replace('\n', ' '))
    finally:
        teardown(d)
    rc, so, se = env.umdev('stop', '-u', uuid, '--run-dir', run)
    ok = wait_until(lambda: env.umdev('stop', '-u', uuid, '--run-dir', run)[0] == 0 or not os.path.exists(sock), step=0.05) if rc else True
    R.check(ok, RM('Serving devices to QEMU', 'umdev stop'), '`umdev stop -u UUID` stops the instance once its client left', (so + se)[:200])
    env.stop(env.daemon)

# ######################################################################
# Over the whole run
# ######################################################################
def t_whole_run(env):
    R.sec('Over the whole run')
    R.check(not vu.BAD_REPLIES, VU('Commands', 'error replies'), 'every reply well-formed', vu.BAD_REPLIES[:5])
    R.check(not OBS['irq_not_one'], CC(S_REG, 'Interrupts'),
            'every program awaited by its interrupt raised exactly one (%d programs)' % OBS['programs'], OBS['irq_not_one'][:5])
    R.check(not OBS['irq_state'], CC(S_REG, 'Interrupts'),
            'at every interrupt: STATE pending and the subchannel\'s IRQ_STATUS bit set (steps 2 before 3)', OBS['irq_state'][:5])
    R.check(not OBS['sb_vs_regs'], both(CC(S_SB), CC(S_REG, 'Interrupts')),
            'every status block, read at the interrupt, matches the registers (%d blocks; step 1 before 3)' % OBS['sb_checked'],
            OBS['sb_vs_regs'][:3])
    R.check(not OBS['dma_outside'], CC(S_EXEC, 'No access outside the mappings'),
            'no server DMA_READ/DMA_WRITE outside this client\'s fd-less mappings (%d requests)' % OBS['dma_reqs'], OBS['dma_outside'][:5])
    R.check(not OBS['dma_into_ro'], CC(S_EXEC, 'No access outside the mappings'),
            'no server DMA_WRITE into memory mapped read-only', OBS['dma_into_ro'][:5])
    seen = OBS['status_seen']
    # ccw.md § Status block: each class is exactly these bits (device status, subchannel status)
    cls = {'normal end': {(0x0c, 0), (0x0c, 0x40)}, 'program check': {(0, 0x20)}, 'protection check': {(0, 0x10)},
           'channel-control check': {(0, 0x04)}, 'unit check': {(0x02, 0)}, 'unit exception': {(0x01, 0)}}
    of = {0: 'normal end', 13: 'protection check', 19: 'channel-control check', 4: 'unit check', 14: 'unit check',
          15: 'unit check', 18: 'unit check', 16: 'unit exception', 17: 'unit exception'}
    wrong = ['%s: %s' % (REASONS[k] if k < len(REASONS) else k, ','.join('%02x/%02x' % x for x in sorted(v - cls[of.get(k, 'program check')])))
             for k, v in sorted(seen.items()) if v - cls[of.get(k, 'program check')]]
    R.check(not wrong, CC(S_SB, 'Each status class in the table below is exactly these bits'),
            'every program ended with exactly its reason\'s status bits (%d reasons seen)' % len(seen), wrong[:5])


# ######################################################################
# Running it
# ######################################################################
def on_dev(title, server, body):
    """A test group: `body(d)` with a fresh client of server `server`, under section `title`."""
    def group(env):
        R.sec(title)
        d = Dev(env.server(server))
        try:
            body(d)
        finally:
            teardown(d)
    group.__name__ = 't' + body.__name__
    return group


t_prog = on_dev('Programs: data, commands, the status block (ccw.md § Channel programs, § Status block, § A program, laid out)', 'main', _prog)
t_chain = on_dev('Chains: CC, TIC, limits, CCWS, CPA out, residual, refusals (ccw.md § CCW, § Execution, § Reason codes, § Order of the checks)', 'main', _chain)
t_idaw = on_dev('IDAW lists: 4K and 2K blocks, scatter, mappings, 16 MiB (ccw.md § IDAW lists, § Limits)', 'main', _idaw)
t_seek = on_dev('SEEK (ccw.md § CCW: SEEK, § Reason codes: SEEK, § Order of the checks)', 'small', _seek)
t_status = on_dev('Where the status block goes (ccw.md § Status block)', 'main', _status)
t_fdless = on_dev('Memory mapped without an fd: through DMA_READ/DMA_WRITE (ccw.md § Execution, § A CCW that stops partway)', 'main', _fdless)


GROUPS = [
    ('cli', [t_cli]),
    ('pci', [t_pci]),
    ('regs', [t_regs]),
    ('prog', [t_prog]),
    ('chain', [t_chain]),
    ('idaw', [t_idaw]),
    ('errors', [t_errors]),
    ('seek', [t_seek]),
    ('status', [t_status]),
    ('fdless', [t_fdless]),
    ('start', [t_start]),
    ('irq', [t_irq]),
    ('bme', [t_bme]),
    ('unmap', [t_unmap]),
    ('trunc', [t_trunc]),
    ('reset', [t_reset]),
    ('store', [t_store]),
    ('modes', [t_modes]),
    ('multi', [t_multi]),
    ('daemon', [t_daemon]),
]


def main():
    def after_each(env, fn):
        for key, p in list(env.servers.items()):
            if p.poll() is not None:
                R.check(False, 'harness', 'server %s exited (status %s) during %s' % (key, p.returncode, fn.__name__), env.log_tail(p.name))
                del env.servers[key]

    def at_end(env):
        t_whole_run(env)
        for key, p in list(env.servers.items()):
            rc = env.stop(p)
            R.check(rc == 0 and not os.path.exists(p.sock), RM('Serving devices to QEMU', 'Stopping'),
                    'server %s: SIGTERM stops it (status 0) and removes its socket' % key, 'rc %s' % rc)
    return vu.contract_main('ccw', 'Contract test of umdev\'s ccw device, written from the docs alone (see the module docstring).',
                            GROUPS, Env, after_each=after_each, at_end=at_end)


if __name__ == '__main__':
    sys.exit(main())
