#!/usr/bin/env python3
"""nvme_contract.py: a contract test of `umdev run --type nvme`, from the outside.

What it is
    An independent NVMe driver over vfio-user (Python 3, standard library only), written from
    umdev's documentation alone: README.md, docs/nvme.md and docs/vfio-user.md, plus the
    public NVMe base specification 1.3 (command, completion, log page and Identify layouts)
    and the public vfio-user specification (QEMU's docs/interop/vfio-user.rst). It reads none
    of the server's code. Its vfio-user transport is testdev_contract.py's (imported, not
    copied: Client, Ev, Results, wait_until, memfd, ...). It starts its own `umdev run --type
    nvme` servers (and one `umdev daemon` for the live statistics), maps memfd guest memory
    with DMA_MAP, and drives the controller as a host NVMe driver does: config space and BAR0
    registers, enable/disable/shutdown, admin and I/O queues, Identify, features, log pages,
    asynchronous events, Doorbell Buffer Config (shadow doorbells and event indices),
    doorbells as messages and through the mapped doorbell page, NVM commands with PRP1/PRP2
    and PRP lists (chained, with offsets, scattered pages), every byte verified, MSI-X, MSI
    and INTx, every documented error status, namespace backings and their options, the
    statistics, reset/disable/unmap with I/O in flight, disconnect and reconnect. Each check
    cites the doc file and section it pins, e.g. "nvme.md § Doorbells" or
    "vfio-user.md § Commands: GET_REGION_INFO"; "NVMe 1.3 § x" where the doc defers to the
    specification; "a + b" cites both.

What it checks (one group per doc area; --list names them)
    pci        nvme.md PCI identity: IDs, class, capabilities, BAR0/BAR1, MSI-X size, IRQ info
    regs       Registers (every field, RW1S/RW1C, read-only, widths and EINVAL), doorbell widths
    enable     CC.EN checks and CSTS.CFS, 4096- and 2-entry admin queues, CC.SHN and SHST,
               IOSQES/IOCQES, an admin ring outside the mappings
    identify   Identify CNS 00h-03h and the rest, every controller field listed, NGUID/UUID
               derivation, admin opcodes, fused/SGL refusals, admin PRP checks
    features   every FID: defaults, Set/Get, SEL, SV, refusals, Number of Queues, reset to defaults
    logs       Error Information (entries, wrap, LBAs), SMART, Firmware Slot, Commands Supported
               and Effects, offsets, NUMD, unknown LIDs; the debug log of failed commands
    queues     Create/Delete I/O SQ/CQ and every refusal, shared CQs, SQHD, phase tag, full CQ
    abort      Abort (pending, limit, the prefetch hint), Delete SQ with commands waiting, AERL
    prp        PRP1/PRP2/lists: offsets, scattered pages, chained and offset lists, 1 MiB
    nvm        Read/Write/Flush/Compare/Write Zeroes/DSM and every documented status
    lba4k      lba=4096
    intr       MSI-X per CQ, depth-1 and burst interrupts, coalescing, masking, IEN 0, MSI, INTx
    aer        every asynchronous event, RAE, waiting events, SQHD, SMART warning, disable
    doorbells  the mapped doorbell page (auto and mmap), its sparse-mmap info, values read from it,
               message mode and its warning, per-client choice, max_msg_fds 0
    shadow     Doorbell Buffer Config: refusals, the values it writes, event indices, CQ room,
               BME, replacement, unmap, disable; random-depth runs with poll_us and the page
    reset      disable / DEVICE_RESET / disconnect with I/O in flight; SMART counters
    unmap      DMA_UNMAP under I/O, truncated memory, unmapped and fd-less rings (CFS), BME
    files      file namespaces (writeback, O_DIRECT, io_uring, sync), locks, persistence, identity,
               pin modes and fixed buffers, ram_pages, option refusals, umdev define
    stats      the describe JSON through a daemon instance (umdev stats, umdev list --json)
    stress     PRPs across adjacent mappings, repeated pages, list-in-data; 4095-entry bursts,
               64 queue pairs, two SQs on a 2-entry CQ
    filestress file transfers in flight at disable, unmap and disconnect

Speed independence (the CI rule: a busy machine makes a test slower, never red)
    - Nothing asserts on elapsed time. Every wait is for an event (a completion's phase tag,
      an interrupt, a register or a counter reaching a value) with a generous bound
      (--timeout, 30 s), and fails only if the event never happens.
    - A check that something does NOT happen (no completion, no interrupt, no event) first
      makes a round trip (the server handles a connection's messages in arrival order), then
      looks for a short window: a slow machine can only make it miss a violation.
    - Where the docs give a worker time to act on its own (a mapped doorbell page looked at
      every 10 us to 1 ms, 10 ms at the admin queue, shadow doorbells, event indices), the
      check waits for the effect.
    - Not checked, because they need a wall-clock window or a misbehaving host: poll_us and
      interrupt-coalescing TIME, the 2 s/5 s/1.5 s waits of resets and deletes, max_held and
      Namespace Not Ready (a backing that stops answering), Capacity Exceeded (a full
      filesystem), Internal Error (a bug), fixed buffers (need --pin-mode kernel and 6.13).

How to run
    python3 nvme_contract.py --bin target/release/umdev
    python3 nvme_contract.py --bin /path/to/umdev --socket-dir /tmp --only io,prp

    --bin PATH         the umdev binary (default: $UMDEV_BIN, else target/release/umdev)
    --socket-dir DIR   where this run makes its own fresh directory (sockets, logs, image
                       files, the daemon's dirs); removed at exit, whatever happened
    --only A,B         run only these test groups (--list shows them)
    --timeout S        the bound on every wait for an event (default 30)
    -q, --quiet        print only FAIL and NOTE lines and the summary

    Exit status: 0 when every check passed; 1 when a check failed (the FAIL lines are repeated
    after the summary, with the last lines of the servers' logs); 2 when it could not start;
    130 when interrupted. NOTE lines never fail a run. Servers are stopped and files removed
    on every exit path, Ctrl-C and SIGTERM included.
"""
import errno as E
import json
import mmap
import os
import random
import re
import signal
import struct
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import testdev_contract as vu  # noqa: E402  (the docs-only vfio-user client; used, never modified)
from testdev_contract import (R, Ev, VfioErr, wait_until, memfd, new_session,  # noqa: E402
                              BAR0, CONFIG, INTX, MSI, MSIX, REGION_READ, REGION_WRITE,
                              DMA_R, DMA_W, DATA_NONE, DATA_EVENTFD, ACTION_MASK, ACTION_UNMASK, ACTION_TRIGGER,
                              RI_READ, RI_WRITE, RI_MMAP, RI_CAPS, II_EVENTFD, II_MASKABLE, II_AUTOMASKED, both)

PAGE = 4096
QUIET = 0.15


# ======================================================================
# Citations
# ======================================================================
def NV(section, item=None):
    return vu.cite('nvme.md', section, item)


def VU(section, item=None):
    return vu.cite('vfio-user.md', section, item)


def RM(section, item=None):
    return vu.cite('README.md', section, item)


def SPEC(section):
    return 'NVMe 1.3 § ' + section


# ======================================================================
# NVMe constants (NVMe base specification 1.3)
# ======================================================================
# registers
CAP, VS, INTMS, INTMC, CC, CSTS, NSSR, AQA, ASQ, ACQ, CMBLOC, CMBSZ = \
    0x00, 0x08, 0x0c, 0x10, 0x14, 0x1c, 0x20, 0x24, 0x28, 0x30, 0x38, 0x3c
DB = 0x1000
MSIX_TABLE, MSIX_PBA = 0x2000, 0x3000
CC_EN = 1
CC_IOQES = (6 << 16) | (4 << 20)
# admin opcodes
A_DEL_SQ, A_CRE_SQ, A_LOG, A_DEL_CQ, A_CRE_CQ, A_IDENT, A_ABORT, A_SETF, A_GETF, A_AER, A_DBBC = \
    0x00, 0x01, 0x02, 0x04, 0x05, 0x06, 0x08, 0x09, 0x0a, 0x0c, 0x7c
ADMIN_OPS = [A_DEL_SQ, A_CRE_SQ, A_LOG, A_DEL_CQ, A_CRE_CQ, A_IDENT, A_ABORT, A_SETF, A_GETF, A_AER, A_DBBC]
# I/O opcodes
IO_FLUSH, IO_WRITE, IO_READ, IO_COMPARE, IO_WZ, IO_DSM = 0x00, 0x01, 0x02, 0x05, 0x08, 0x09
IO_OPS = [IO_FLUSH, IO_WRITE, IO_READ, IO_COMPARE, IO_WZ, IO_DSM]
# statuses: (SCT, SC)
OK = (0, 0x00)
INVALID_OPCODE = (0, 0x01)
INVALID_FIELD = (0, 0x02)
DATA_XFER_ERR = (0, 0x04)
ABORT_REQUESTED = (0, 0x07)
ABORT_SQ_DELETED = (0, 0x08)
INVALID_NS = (0, 0x0b)
CMD_SEQ_ERR = (0, 0x0c)
PRP_OFFSET = (0, 0x13)
LBA_RANGE = (0, 0x80)
CQ_INVALID = (1, 0x00)
INVALID_QID = (1, 0x01)
INVALID_QSIZE = (1, 0x02)
ABORT_LIMIT = (1, 0x03)
AER_LIMIT = (1, 0x05)
INVALID_IV = (1, 0x08)
INVALID_LOG = (1, 0x09)
INVALID_QDEL = (1, 0x0c)
NOT_SAVEABLE = (1, 0x0d)
COMPARE_FAIL = (2, 0x85)
ST_NAMES = {OK: 'Success', INVALID_OPCODE: 'Invalid Opcode', INVALID_FIELD: 'Invalid Field', DATA_XFER_ERR: 'Data Transfer Error',
            ABORT_REQUESTED: 'Command Abort Requested', ABORT_SQ_DELETED: 'Aborted: SQ Deletion', INVALID_NS: 'Invalid Namespace',
            CMD_SEQ_ERR: 'Command Sequence Error', PRP_OFFSET: 'PRP Offset Invalid', LBA_RANGE: 'LBA Out of Range',
            CQ_INVALID: 'Completion Queue Invalid', INVALID_QID: 'Invalid Queue Identifier', INVALID_QSIZE: 'Invalid Queue Size',
            ABORT_LIMIT: 'Abort Command Limit Exceeded', AER_LIMIT: 'AER Limit Exceeded', INVALID_IV: 'Invalid Interrupt Vector',
            INVALID_LOG: 'Invalid Log Page', INVALID_QDEL: 'Invalid Queue Deletion', NOT_SAVEABLE: 'Feature Not Saveable',
            COMPARE_FAIL: 'Compare Failure'}


def stname(st):
    return '%s %d/%02xh' % (ST_NAMES.get(st, '?'), st[0], st[1])


class Cqe:
    def __init__(self, raw):
        self.raw = bytes(raw)
        self.dw0, self.dw1, dw2, dw3 = struct.unpack('<IIII', raw)
        self.sqhd, self.sqid = dw2 & 0xffff, dw2 >> 16
        self.cid, self.p = dw3 & 0xffff, (dw3 >> 16) & 1
        sf = dw3 >> 17
        self.sf = sf
        self.sc, self.sct, self.crd, self.more, self.dnr = sf & 0xff, (sf >> 8) & 7, (sf >> 11) & 3, (sf >> 13) & 1, (sf >> 14) & 1

    @property
    def st(self):
        return (self.sct, self.sc)

    def __repr__(self):
        return '<cqe sq%d cid %#x %s%s dw0 %#x sqhd %d>' % (self.sqid, self.cid, stname(self.st), ' DNR' if self.dnr else '',
                                                             self.dw0, self.sqhd)


def sqe(opc, cid=0, nsid=0, prp1=0, prp2=0, cdw10=0, cdw11=0, cdw12=0, cdw13=0, cdw14=0, cdw15=0, fuse=0, psdt=0, mptr=0):
    b = bytearray(64)
    struct.pack_into('<II', b, 0, opc | (fuse << 8) | (psdt << 14) | (cid << 16), nsid)
    struct.pack_into('<QQQ', b, 16, mptr, prp1, prp2)
    struct.pack_into('<6I', b, 40, cdw10, cdw11, cdw12, cdw13, cdw14, cdw15)
    return b


def st_check(cqe, want, ref, what, dnr=None):
    """A completion's status (and DNR when the doc names it)."""
    if cqe is None:
        return R.check(False, ref, '%s -> %s' % (what, stname(want)), 'no completion within %.0f s' % vu.WAIT)
    ok = cqe.st == want and (dnr is None or cqe.dnr == dnr)
    wanted = stname(want) + ('' if dnr is None else (', DNR' if dnr else ', DNR clear'))
    return R.check(ok, ref, '%s -> %s' % (what, wanted), '%s%s' % (stname(cqe.st), ' DNR' if cqe.dnr else ''))


# ======================================================================
# Guest memory: a memfd mapped here and with DMA_MAP
# ======================================================================
class Guest:
    def __init__(self, c, size=32 << 20, iova=0x10000000, flags=DMA_R | DMA_W, fd=None):
        self.c, self.size, self.iova = c, size, iova
        self.fd = memfd(size) if fd is None else fd
        self.mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.next = 0
        self.mapped = False
        self.map(flags)

    def map(self, flags=DMA_R | DMA_W):
        self.c.dma_map(self.iova, self.size, flags=flags, fd=self.fd)
        self.mapped = True

    def unmap(self):
        self.mapped = False
        return self.c.dma_unmap(self.iova, self.size)

    def alloc(self, npages=1):
        if self.next + npages * PAGE > self.size:
            self.next = 0          # wrap: groups use far less than a wrap's worth at a time
        a = self.iova + self.next
        self.next += npages * PAGE
        self.mm[a - self.iova: a - self.iova + npages * PAGE] = bytes(npages * PAGE)
        return a

    def has(self, a, n=1):
        return self.iova <= a and a + n <= self.iova + self.size

    def write(self, a, data):
        o = a - self.iova
        self.mm[o:o + len(data)] = data

    def read(self, a, n):
        o = a - self.iova
        return bytes(self.mm[o:o + n])

    def u32(self, a):
        return struct.unpack_from('<I', self.mm, a - self.iova)[0]

    def w32(self, a, v):
        struct.pack_into('<I', self.mm, a - self.iova, v)

    def close(self):
        try:
            self.mm.close()
        except (BufferError, ValueError):
            pass
        try:
            os.close(self.fd)
        except OSError:
            pass


# ======================================================================
# The driver
# ======================================================================
class SQ:
    def __init__(self, qid, iova, size, cqid, g):
        self.qid, self.iova, self.size, self.cqid, self.g = qid, iova, size, cqid, g
        self.tail = 0
        self.cid = 0


class CQ:
    def __init__(self, qid, iova, size, g, iv=0, ien=True):
        self.qid, self.iova, self.size, self.g, self.iv, self.ien = qid, iova, size, g, iv, ien
        self.head = 0
        self.phase = 1
        self.seen = []


class Ctrl:
    """One controller, driven over one vfio-user connection."""

    def __init__(self, c, g, dbpage=None, posted=False):
        self.c, self.g = c, g
        self.dbpage = dbpage               # the mapped doorbell page (mmap mode), or None
        self.dbv = memoryview(dbpage).cast('I') if dbpage is not None else None
        self.posted = posted
        self.sqs, self.cqs = {}, {}
        self.done = {}                     # (sqid, cid) -> Cqe
        self.shadow = None                 # (shadow page iova, eventidx page iova, Guest) when DBBC is on
        self.auto_head = True
        self.msgs = 0                      # doorbell writes sent as messages
        self.admins = 0                    # admin commands submitted (for describe's admin_commands)

    # ---- registers ----
    def r32(self, off):
        return self.c.rd(BAR0, off, 4)

    def r64(self, off):
        return self.c.rd(BAR0, off, 8)

    def w32(self, off, v):
        self.c.wr(BAR0, off, v, 4)

    def w64(self, off, v):
        self.c.wr(BAR0, off, v, 8)

    def cfg16(self, off):
        return self.c.rd(CONFIG, off, 2)

    def bus_master(self, on=True):
        cmd = self.c.rd(CONFIG, 4, 2)
        self.c.wr(CONFIG, 4, (cmd | 0x6) if on else ((cmd | 0x2) & ~0x4), 2)

    def cap(self, cid):
        return walk_caps(self.c)[1].get(cid)

    def msix_on(self, evs=None, mask=False):
        """Enable MSI-X (as a host driver does before it creates I/O queues), unmask every
        table entry, and wire the eventfds given."""
        m = self.cap(0x11)
        n = (self.c.rd(CONFIG, m + 2, 2) & 0x7ff) + 1
        self.c.wr(CONFIG, m + 2, 0x8000, 2)
        for v in range(n):
            self.w32(MSIX_TABLE + 16 * v + 12, 1 if mask else 0)
        if evs:
            self.c.set_irqs(MSIX, DATA_EVENTFD | ACTION_TRIGGER, 0, len(evs), fds=[e.fd for e in evs])
        return n

    def msix_off(self):
        m = self.cap(0x11)
        self.c.wr(CONFIG, m + 2, 0, 2)

    def ring(self, idx, val, via=None):
        """Doorbell idx (2y: SQ y tail, 2y+1: CQ y head)."""
        via = via or ('page' if self.dbv is not None else 'msg')
        if via == 'page':
            self.dbv[idx] = val
        else:
            self.msgs += 1
            self.c.region_write(BAR0, DB + 4 * idx, struct.pack('<I', val), posted=self.posted)

    # ---- enable / disable ----
    def enable(self, aq=32, cc=CC_EN | CC_IOQES, wait=True):
        self.bus_master(True)
        self.sqs, self.cqs, self.done = {}, {}, {}
        self.shadow = None
        pages_sq = (aq * 64 + PAGE - 1) // PAGE
        pages_cq = (aq * 16 + PAGE - 1) // PAGE
        asq, acq = self.g.alloc(pages_sq), self.g.alloc(pages_cq)
        self.sqs[0] = SQ(0, asq, aq, 0, self.g)
        self.cqs[0] = CQ(0, acq, aq, self.g)
        self.w32(AQA, (aq - 1) | ((aq - 1) << 16))
        self.w64(ASQ, asq)
        self.w64(ACQ, acq)
        self.w32(CC, cc)
        if wait:
            return wait_until(lambda: self.r32(CSTS) & 3 != 0) and self.r32(CSTS) & 3 == 1
        return None

    def disable(self):
        self.w32(CC, self.r32(CC) & ~1)
        return wait_until(lambda: self.r32(CSTS) & 1 == 0)

    # ---- submission ----
    def next_cid(self, sqid):
        sq = self.sqs[sqid]
        sq.cid = (sq.cid + 1) & 0xffff
        if sq.cid == 0xffff:
            sq.cid = 1
        return sq.cid

    def put(self, sqid, entry, cid=None):
        """Write an entry at the SQ tail (the doorbell not rung); returns its cid."""
        sq = self.sqs[sqid]
        if cid is None:
            cid = self.next_cid(sqid)
        entry = bytearray(entry)
        struct.pack_into('<H', entry, 2, cid)
        sq.g.write(sq.iova + sq.tail * 64, entry)
        sq.tail = (sq.tail + 1) % sq.size
        if sqid == 0:
            self.admins += 1
        return cid

    def ring_sq(self, sqid):
        sq = self.sqs[sqid]
        if self.shadow is not None and sqid != 0:
            sh, ev, sg = self.shadow
            old = sg.u32(sh + 8 * sqid)
            sg.w32(sh + 8 * sqid, sq.tail)
            evi = sg.u32(ev + 8 * sqid)
            if need_event(evi, sq.tail, old):
                self.ring(2 * sqid, sq.tail)
            return
        self.ring(2 * sqid, sq.tail)

    def submit(self, sqid, entry, cid=None, ring=True):
        cid = self.put(sqid, entry, cid)
        if ring:
            self.ring_sq(sqid)
        return cid

    # ---- completion ----
    def peek(self, cqid):
        cq = self.cqs[cqid]
        a = cq.iova + cq.head * 16
        dw3 = cq.g.u32(a + 12)
        if (dw3 >> 16) & 1 != cq.phase:
            return None
        return Cqe(cq.g.read(a, 16))

    def reap(self, cqid, ring=None):
        """Consume every posted entry of CQ cqid; returns them. Rings the CQ head once."""
        cq = self.cqs[cqid]
        got = []
        while True:
            e = self.peek(cqid)
            if e is None:
                break
            got.append(e)
            cq.head += 1
            if cq.head == cq.size:
                cq.head = 0
                cq.phase ^= 1
        for e in got:
            self.done[(e.sqid, e.cid)] = e
            cq.seen.append(e)
        if got and (self.auto_head if ring is None else ring):
            self.ring_cq(cqid)
        return got

    def ring_cq(self, cqid):
        cq = self.cqs[cqid]
        if self.shadow is not None and cqid != 0:
            sh, ev, sg = self.shadow
            old = sg.u32(sh + 8 * cqid + 4)
            sg.w32(sh + 8 * cqid + 4, cq.head)
            evi = sg.u32(ev + 8 * cqid + 4)
            if need_event(evi, cq.head, old):
                self.ring(2 * cqid + 1, cq.head)
            return
        self.ring(2 * cqid + 1, cq.head)

    def wait(self, sqid, cid, timeout=None):
        cqid = self.sqs[sqid].cqid if sqid in self.sqs else 0
        key = (sqid, cid)

        def got():
            if key in self.done:
                return True
            self.reap(cqid)
            return key in self.done
        wait_until(got, timeout=timeout, step=0.0003)
        return self.done.pop(key, None)

    def wait_all(self, sqid, cids, timeout=None):
        return [self.wait(sqid, cid, timeout) for cid in cids]

    def cmd(self, sqid, entry, timeout=None):
        cid = self.submit(sqid, entry)
        return self.wait(sqid, cid, timeout)

    def admin(self, opc, **kw):
        return self.cmd(0, sqe(opc, **kw))

    # ---- queues ----
    def create_cq(self, qid, size, iv=0, ien=True, pc=True, iova=None, g=None):
        g = g or self.g
        if iova is None:
            iova = g.alloc((size * 16 + PAGE - 1) // PAGE)
        e = self.admin(A_CRE_CQ, prp1=iova, cdw10=qid | ((size - 1) << 16), cdw11=int(pc) | (int(ien) << 1) | (iv << 16))
        if e is not None and e.st == OK:
            self.cqs[qid] = CQ(qid, iova, size, g, iv, ien)
        return e

    def create_sq(self, qid, size, cqid, pc=True, iova=None, g=None, prio=0):
        g = g or self.g
        if iova is None:
            iova = g.alloc((size * 64 + PAGE - 1) // PAGE)
        e = self.admin(A_CRE_SQ, prp1=iova, cdw10=qid | ((size - 1) << 16), cdw11=int(pc) | (prio << 1) | (cqid << 16))
        if e is not None and e.st == OK:
            self.sqs[qid] = SQ(qid, iova, size, cqid, g)
        return e

    def io_pair(self, qid, size=64, cqsize=None, iv=None, ien=True):
        e1 = self.create_cq(qid, cqsize or size, iv=qid if iv is None else iv, ien=ien)
        e2 = self.create_sq(qid, size, qid)
        return e1 is not None and e2 is not None and e1.st == OK and e2.st == OK

    def delete_sq(self, qid):
        e = self.admin(A_DEL_SQ, cdw10=qid)
        if e is not None and e.st == OK:
            self.sqs.pop(qid, None)
        return e

    def delete_cq(self, qid):
        e = self.admin(A_DEL_CQ, cdw10=qid)
        if e is not None and e.st == OK:
            self.cqs.pop(qid, None)
        return e

    # ---- admin helpers ----
    def identify(self, cns, nsid=0, cntid=0):
        buf = self.g.alloc(1)
        self.g.write(buf, b'\xa5' * PAGE)
        e = self.admin(A_IDENT, nsid=nsid, prp1=buf, cdw10=cns | (cntid << 16))
        return e, self.g.read(buf, PAGE)

    def get_log(self, lid, nbytes, offset=0, rae=0, nsid=0xffffffff, lsp=0, fill=b'\xa5', numd=None):
        npages = (nbytes + PAGE - 1) // PAGE + 1
        pages = [self.g.alloc(1) for _ in range(npages)]
        for p in pages:
            self.g.write(p, fill * PAGE)
        numd = nbytes // 4 - 1 if numd is None else numd
        prp1, prp2 = build_prp(self.g, pages, 0, nbytes)
        e = self.admin(A_LOG, nsid=nsid, prp1=prp1, prp2=prp2,
                       cdw10=lid | (lsp << 8) | (rae << 15) | ((numd & 0xffff) << 16), cdw11=numd >> 16,
                       cdw12=offset & 0xffffffff, cdw13=offset >> 32)
        return e, gather(self.g, pages, 0, nbytes)

    def getf(self, fid, cdw11=0, sel=0):
        return self.admin(A_GETF, cdw10=fid | (sel << 8), cdw11=cdw11)

    def setf(self, fid, cdw11, sv=0, nsid=0):
        return self.admin(A_SETF, nsid=nsid, cdw10=fid | (sv << 31), cdw11=cdw11)

    # ---- NVM ----
    def rw(self, sqid, opc, slba, nlb, prp1, prp2=0, nsid=1, cdw12=0, cdw13=0, fuse=0, psdt=0):
        return self.cmd(sqid, sqe(opc, nsid=nsid, prp1=prp1, prp2=prp2, cdw10=slba & 0xffffffff, cdw11=slba >> 32,
                                  cdw12=((nlb - 1) & 0xffff) | cdw12, cdw13=cdw13, fuse=fuse, psdt=psdt))


def need_event(event_idx, new, old):
    """Linux's nvme_dbbuf_need_event (virtio's vring_need_event), 16-bit arithmetic."""
    return ((new - event_idx - 1) & 0xffff) < ((new - old) & 0xffff)


def build_prp(g, pages, offset, length, list_off=0, list_page=None):
    """PRP1/PRP2 for `length` bytes starting at pages[0] + offset (nvme.md § NVM commands: Data
    pointer). Beyond two pages, PRP2 points at a list in fresh pages (the first at list_off,
    qword aligned), chained through the last entry of each full list page."""
    n = (offset + length + PAGE - 1) // PAGE
    assert len(pages) >= n, (len(pages), n)
    prp1 = pages[0] + offset
    if n <= 1:
        return prp1, 0
    if n == 2:
        return prp1, pages[1]
    entries = list(pages[1:n])
    lp = list_page if list_page is not None else g.alloc(1)
    pos = lp + list_off
    prp2 = pos
    i = 0
    while True:
        slots = (PAGE - pos % PAGE) // 8
        left = len(entries) - i
        if left <= slots:
            for k in range(left):
                g.write(pos + 8 * k, struct.pack('<Q', entries[i + k]))
            break
        for k in range(slots - 1):
            g.write(pos + 8 * k, struct.pack('<Q', entries[i + k]))
        i += slots - 1
        nxt = g.alloc(1)
        g.write(pos + 8 * (slots - 1), struct.pack('<Q', nxt))
        pos = nxt
    return prp1, prp2


def scatter(g, pages, offset, data):
    pos, i, off = 0, 0, offset
    while pos < len(data):
        n = min(PAGE - off, len(data) - pos)
        g.write(pages[i] + off, data[pos:pos + n])
        pos += n
        i += 1
        off = 0


def gather(g, pages, offset, length):
    out = bytearray()
    i, off = 0, offset
    while len(out) < length:
        n = min(PAGE - off, length - len(out))
        out += g.read(pages[i] + off, n)
        i += 1
        off = 0
    return bytes(out)


def scattered_pages(g, n):
    """n pages no two of which are adjacent, in shuffled order."""
    base = g.alloc(2 * n)
    pages = [base + 2 * PAGE * i for i in range(n)]
    random.shuffle(pages)
    return pages


def rand_bytes(n, seed):
    return random.Random(seed).randbytes(n)


# ======================================================================
# Servers
# ======================================================================
class Env:
    def __init__(self, h):
        self.h = h
        self.n = 0
        self.daemon = None

    def start(self, opts=(), extra=(), name=None, expect_ok=True):
        """`umdev run --type nvme` with --opt for each of opts; returns (proc, socket)."""
        self.n += 1
        name = name or 'nvme%d' % self.n
        sock = self.h.path(name + '.sock')
        args = ['run', '--type', 'nvme', '--socket', sock] + list(extra)
        for o in opts:
            args += ['--opt', o]
        p = self.h.spawn(args, name)
        if not wait_until(lambda: p.poll() is not None or os.path.exists(sock)) or p.poll() is not None:
            raise vu.SetupError('nvme server %s did not start (rc %s): %s' % (opts, p.poll(), self.h.log_tail(name)))
        p.sock, p.name = sock, name
        return p

    def refused(self, opts, extra=()):
        """Run a server that must refuse to start: (refused?, its output)."""
        self.n += 1
        sock = self.h.path('r%d.sock' % self.n)
        args = [self.h.bin, 'run', '--type', 'nvme', '--socket', sock] + list(extra)
        for o in opts:
            args += ['--opt', o]
        p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out = ''
        # a server that starts serves until stopped: stop it once its socket exists
        ok = wait_until(lambda: p.poll() is not None or os.path.exists(sock))
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            out = p.communicate(timeout=vu.WAIT)[0]
        except subprocess.TimeoutExpired:
            p.kill()
            out = p.communicate()[0]
        started = os.path.exists(sock) or 'serving a nvme device' in out
        if os.path.exists(sock):
            os.unlink(sock)
        return (not started and p.returncode != 0 and ok), out.strip().replace('\n', ' | ')[:240]

    def stop(self, p):
        """Stop a server; returns its exit statistics (the JSON it prints), or None."""
        self.h.stop(p)
        m = None
        for line in open(self.h.path(p.name + '.log'), errors='replace'):
            if 'nvme on exit:' in line:
                m = line.split('nvme on exit:', 1)[1].strip()
        try:
            return json.loads(m) if m else None
        except ValueError:
            return None

    def log(self, p):
        with open(self.h.path(p.name + '.log'), errors='replace') as f:
            return f.read()

    # ---- a daemon instance, for the live statistics ----
    def dstart(self, opts):
        run, state = self.h.path('run'), self.h.path('state')
        if self.daemon is None:
            self.daemon = self.h.spawn(['daemon', '--run-dir', run, '--state-dir', state], 'daemon')
        out = {}

        def started():
            if self.daemon.poll() is not None:
                return True
            args = [self.h.bin, 'start', '-t', 'nvme', '--run-dir', run, '--state-dir', state]
            for o in opts:
                args += ['--opt', o]
            p = subprocess.run(args, capture_output=True, text=True, timeout=vu.WAIT + 30)
            out['o'] = p.stdout + p.stderr
            return p.returncode == 0
        wait_until(started, step=0.05)
        mu = re.search(r'[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}', out.get('o', ''))
        ms = re.search(r'(/\S+\.sock)', out.get('o', ''))
        if not (mu and ms):
            raise vu.SetupError('umdev start -t nvme failed: %s' % out.get('o', '').strip()[:300])
        return mu.group(0), ms.group(1)

    def stats(self, uuid):
        p = subprocess.run([self.h.bin, 'stats', '-u', uuid, '--run-dir', self.h.path('run')], capture_output=True, text=True,
                           timeout=vu.WAIT + 30)
        try:
            return json.loads(p.stdout)['device']
        except (ValueError, KeyError, TypeError):
            return None

    def dstop(self, uuid):
        def stopped():
            p = subprocess.run([self.h.bin, 'stop', '-u', uuid, '--run-dir', self.h.path('run')], capture_output=True,
                               text=True, timeout=vu.WAIT + 30)
            return p.returncode == 0
        wait_until(stopped, step=0.05)


def session(sock, caps=None, nocaps=False, minor=0):
    """A negotiated session; nocaps: a VERSION without JSON (as SPDK's initiator sends)."""
    if nocaps:
        def first(c):
            m = c.version(None, minor=minor)
            if m.is_error:
                raise VfioErr(m.error, m)
        return vu._served(sock, first)
    return new_session(sock, caps)


def bring_up(sock, mem=32 << 20, nocaps=False, caps=None, aq=32, posted=False, map_page=None, msix=True):
    """Connect, map guest memory, enable MSI-X (as Linux does before its I/O queues), enable
    the controller. Returns (client, guest, ctrl). map_page: None maps the doorbell page when
    BAR0 offers it (mmap mode), False never."""
    c = session(sock, caps=caps, nocaps=nocaps)
    g = Guest(c, mem)
    dbpage = None
    if map_page is not False:
        ri = c.region_info(BAR0, argsz=256)
        if ri['flags'] & RI_MMAP and ri['fds']:
            dbpage = map_doorbells(ri)
        for fd in ri['fds']:
            os.close(fd)
    ctl = Ctrl(c, g, dbpage=dbpage, posted=posted)
    if msix:
        ctl.msix_on()
    ok = ctl.enable(aq=aq)
    if not ok:
        raise vu.SetupError('the controller did not become ready (CSTS %#x)' % ctl.r32(CSTS))
    return c, g, ctl


def map_doorbells(ri):
    areas = ri['caps'][0]['areas'] if ri['caps'] and 'areas' in ri['caps'][0] else []
    if not areas:
        return None
    off = areas[0][0]
    return mmap.mmap(ri['fds'][0], 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=ri['offset'] + off)


def teardown(*objs):
    for o in objs:
        try:
            if isinstance(o, vu.Client):
                o.close()
            elif isinstance(o, Guest):
                o.close()
            elif isinstance(o, mmap.mmap):
                o.close()
        except Exception:
            pass


def quiet_cq(ctl, cqid):
    """Nothing more is posted on cqid: a round trip, then a short window."""
    ctl.c.barrier()
    deadline = time.monotonic() + QUIET
    while time.monotonic() < deadline:
        if ctl.peek(cqid) is not None:
            return False
        time.sleep(0.002)
    return ctl.peek(cqid) is None


def fnv1a(data, h=0xcbf29ce484222325):
    for b in data:
        h ^= b
        h = (h * 0x100000001b3) & 0xffffffffffffffff
    return h


def nguid_from_seed(seed):
    out = b''
    for i in range(2):
        out += struct.pack('<Q', fnv1a(bytes([i]), seed))
    return out


def uuid_from_nguid(ng):
    b = bytearray(ng)
    b[6] = (b[6] & 0x0f) | 0x40
    b[8] = (b[8] & 0x3f) | 0x80
    return bytes(b)


def default_serial(paths):
    h = 0xcbf29ce484222325
    for p in paths:
        h = fnv1a(p.encode() + b'\0', h)
    return 'UMDEV%012X' % (h & 0xffffffffffff)


def file_nguid(path, serial_opt=b''):
    return nguid_from_seed(fnv1a(b'file\0' + serial_opt + b'\0' + path.encode()))


def ram_nguid(serial, nsid):
    return nguid_from_seed(fnv1a(serial.encode() + b'\0' + struct.pack('<I', nsid)))


# ######################################################################
# nvme.md § PCI identity
# ######################################################################
def walk_caps(c):
    cfg = c.region_read(CONFIG, 0, 256)
    caps = {}
    p = cfg[0x34] & 0xfc
    seen = set()
    while p and p not in seen:
        seen.add(p)
        caps[cfg[p]] = p
        p = cfg[p + 1] & 0xfc
    return cfg, caps


def t_pci(env):
    R.sec('PCI identity and config space (nvme.md § PCI identity; vfio-user.md § Commands)')
    ident = NV('PCI identity')
    p = env.start(['ns1=ram:16M', 'queues=4'])
    c = new_session(p.sock)
    try:
        flags, nreg, nirq = c.device_info()[1:]
        R.eq((flags, nreg, nirq), (3, 9, 5), VU('Commands', 'DEVICE_GET_INFO'), 'DEVICE_GET_INFO: flags PCI|RESET, 9 regions, 5 IRQ indexes')
        cfg, caps = walk_caps(c)
        u16 = lambda o: struct.unpack_from('<H', cfg, o)[0]
        u32 = lambda o: struct.unpack_from('<I', cfg, o)[0]
        R.eq((u16(0), u16(2)), (0x1234, 0x75e0), ident, 'vendor / device')
        R.eq((u16(0x2c), u16(0x2e)), (0x1234, 0x75e0), ident, 'subsystem vendor / subsystem')
        R.eq((cfg[0xb], cfg[0xa], cfg[9]), (0x01, 0x08, 0x02), ident, 'class / subclass / prog-if (mass storage, NVM, NVM Express)')
        R.eq(cfg[8], 1, ident, 'revision')
        R.eq(cfg[0x3d], 1, ident, 'interrupt pin INTA')
        R.eq(sorted(caps), [0x01, 0x05, 0x10, 0x11], ident, 'capabilities: power management, MSI, PCI Express, MSI-X')
        if 0x05 in caps:
            ctl = u16(caps[5] + 2)
            R.eq((ctl >> 1) & 7, 0, ident, 'MSI: 1 vector (Multiple Message Capable 0)')
            R.check(ctl & 0x80, ident, 'MSI: 64-bit', hex(ctl))
            R.check(ctl & 0x100, ident, 'MSI: per-vector masking', hex(ctl))
        if 0x11 in caps:
            m = caps[0x11]
            R.eq(u16(m + 2) & 0x7ff, 4, ident, 'MSI-X: queues + 1 = 5 vectors (table size N-1 = 4)')
            R.eq(u32(m + 4), 0x2000, ident, 'MSI-X table in BAR0 at 0x2000 (BIR 0)')
            R.eq(u32(m + 8), 0x3000, ident, 'MSI-X PBA in BAR0 at 0x3000 (BIR 0)')
        if 0x10 in caps:
            R.eq((u16(caps[0x10] + 2) >> 4) & 0xf, 0, ident, 'PCI Express capability: device/port type 0 (endpoint)')
        ri = c.region_info(CONFIG)
        R.eq(ri['size'], 4096, ident, 'config space region: 4 KiB (PCI Express)')
        R.eq(len(c.region_read(CONFIG, 0x100, 0x100)), 0x100, ident, 'extended config space (0x100-0x1ff) reads')
        ri = c.region_info(BAR0, argsz=256)
        R.eq(ri['size'], 0x4000, ident, 'BAR0 region: 16 KiB')
        R.eq(ri['flags'] & (RI_READ | RI_WRITE | RI_MMAP), RI_READ | RI_WRITE,
             NV('Doorbells', 'message: BAR0 has no mmap area'), 'a client with capabilities (auto -> message): BAR0 readable, writable, no MMAP')
        R.eq(len(ri['fds']), 0, NV('Doorbells', 'message'), '... and no fd')
        for fd in ri['fds']:
            os.close(fd)
        c.wr(CONFIG, 0x10, 0xffffffff, 4)
        c.wr(CONFIG, 0x14, 0xffffffff, 4)
        lo, hi = c.rd(CONFIG, 0x10, 4), c.rd(CONFIG, 0x14, 4)
        R.eq(lo & 0xfffffff0, 0xffffc000, ident, 'BAR0 sizing: 16 KiB')
        R.eq(lo & 0x7, 0x4, ident, 'BAR0: 64-bit memory BAR (type 10b, memory space)')
        R.eq(hi, 0xffffffff, ident, 'BAR1 is BAR0\'s upper half (all ones writable)')
        c.wr(CONFIG, 0x10, 0, 4)
        c.wr(CONFIG, 0x14, 0, 4)
        for idx, want_n, name in ((INTX, 1, 'INTx'), (MSI, 1, 'MSI'), (MSIX, 5, 'MSI-X')):
            info = c.irq_info(idx)
            R.eq(info[3], want_n, both(ident, VU('Commands', 'GET_IRQ_INFO')), '%s vectors' % name)
        R.eq(c.irq_info(MSI)[1] & (II_EVENTFD | II_MASKABLE), II_EVENTFD | II_MASKABLE, VU('Commands', 'GET_IRQ_INFO'),
             'MSI flags EVENTFD | MASKABLE (per-vector masking)')
        R.eq(c.irq_info(INTX)[1] & 7, II_EVENTFD | II_MASKABLE | II_AUTOMASKED, VU('Commands', 'GET_IRQ_INFO'), 'INTx flags')
    finally:
        c.close()
        env.stop(p)
    serials = []
    p = env.start(['ns1=ram:4K', 'queues=1'])
    c = new_session(p.sock)
    try:
        cfg, caps = walk_caps(c)
        if 0x11 in caps:
            R.eq(struct.unpack_from('<H', cfg, caps[0x11] + 2)[0] & 0x7ff, 1, NV('Instance options', 'queues'),
                 'queues=1: MSI-X has 2 vectors')
        R.eq(c.irq_info(MSIX)[3], 2, NV('Instance options', 'queues'), 'queues=1: GET_IRQ_INFO MSI-X count 2')
    finally:
        c.close()
        serials.append(env.stop(p))
    p = env.start(['ns1=ram:4K'])
    serials.append(env.stop(p))
    R.check(all(serials), RM('Serving devices to QEMU'), '`umdev run` prints the device\'s statistics when it stops ("nvme on exit: {json}")')
    ss = [x and x.get('serial') for x in serials]
    R.check(all(x and re.fullmatch(r'UMDEV[0-9A-F]{12}', x) for x in ss) and ss[0] != ss[1], NV('Namespaces', 'Identity: With no file namespace, the 48 bits are random'),
            'two RAM-only devices: serials UMDEV + 12 hex digits, different', ss)


# ######################################################################
# nvme.md § Registers
# ######################################################################
def t_regs(env):
    R.sec('BAR0 registers and access widths (nvme.md § Registers, § Doorbells)')
    regs = NV('Registers')
    widths = NV('Registers', 'Widths')
    p = env.start(['ns1=ram:16M', 'entries=256'])
    c = new_session(p.sock)
    ctl = Ctrl(c, None)
    try:
        cap = ctl.r64(CAP)
        want = 255 | (1 << 16) | (10 << 24) | (1 << 37)
        R.eq(cap, want, regs, 'CAP: MQES 255 (entries 256), CQR 1, AMS 0, TO 10, DSTRD 0, NSSRS 0, CSS NVM only (bit 37), BPS 0, MPSMIN = MPSMAX = 0, PMRS/CMBS 0')
        R.eq(ctl.r32(CAP) | (ctl.r32(CAP + 4) << 32), cap, widths, 'CAP as two 32-bit reads (low first) = the 64-bit read')
        R.eq(ctl.r32(VS), 0x00010300, regs, 'VS 1.3.0')
        ctl.w64(CAP, 0)
        ctl.w32(VS, 0)
        R.eq((ctl.r64(CAP), ctl.r32(VS)), (cap, 0x00010300), regs, 'CAP and VS read-only')
        R.eq((ctl.r32(CC), ctl.r32(CSTS), ctl.r32(AQA), ctl.r64(ASQ), ctl.r64(ACQ)), (0, 0, 0, 0, 0), NV('Registers', 'power-on value (0)'),
             'CC, CSTS, AQA, ASQ, ACQ 0 at power-on')
        R.eq((ctl.r32(INTMS), ctl.r32(INTMC)), (0, 0), regs, 'INTMS/INTMC read 0 (no mask) at start')
        ctl.w32(INTMS, 1)
        R.eq((ctl.r32(INTMS), ctl.r32(INTMC)), (1, 1), regs, 'INTMS write 1 sets the mask; both read the mask')
        ctl.w32(INTMS, 0)
        R.eq(ctl.r32(INTMS), 1, regs, 'INTMS is RW1S: writing 0 changes nothing')
        ctl.w32(INTMC, 1)
        R.eq((ctl.r32(INTMS), ctl.r32(INTMC)), (0, 0), regs, 'INTMC write 1 clears the mask')
        v = 0xa5f03ffe
        ctl.w32(CC, v)
        R.eq(ctl.r32(CC), v, regs, 'CC reads back exactly what was written (EN 0, every other field)')
        R.eq(ctl.r32(CSTS), 0, regs, '... CSTS unchanged by a CC write without EN or SHN')
        ctl.w32(CC, 0)
        ctl.w32(CSTS, 0xffffffff)
        R.eq(ctl.r32(CSTS), 0, regs, 'CSTS read-only')
        ctl.w32(NSSR, 0x4e564d65)
        R.eq(ctl.r32(NSSR), 0, regs, 'NSSR: "NVMe" written is ignored, reads 0')
        R.eq(ctl.r32(CSTS), 0, regs, '... no reset (CSTS.NSSRO stays 0)')
        ctl.w32(AQA, 0x00ff00ff)
        R.eq(ctl.r32(AQA), 0x00ff00ff, regs, 'AQA read-write (ASQS 11:0, ACQS 27:16)')
        ctl.w64(ASQ, 0x123456789abc)
        R.eq(ctl.r64(ASQ), 0x123456789000, regs, 'ASQ 64-bit: bits 11:0 read 0')
        ctl.w32(ACQ, 0x87654fff)
        ctl.w32(ACQ + 4, 0x42)
        R.eq(ctl.r64(ACQ), 0x4287654000, both(regs, widths), 'ACQ by two 32-bit writes, bits 11:0 read 0')
        R.eq((ctl.r32(CMBLOC), ctl.r32(CMBSZ)), (0, 0), regs, 'CMBLOC, CMBSZ 0')
        for off in (0x18, 0x40, 0x50, 0xe00, 0xffc):
            ctl.w32(off, 0xffffffff)
            R.eq(ctl.r32(off), 0, widths, 'offset %#x (no register) reads 0 after a write' % off)
        for off, n, what in ((0x00, 1, '1-byte'), (0x08, 2, '2-byte'), (0x02, 4, 'unaligned 4-byte'), (0x04, 8, '8-byte at 4 (not 8-aligned)'),
                             (0x00, 16, '16-byte'), (0x14, 3, '3-byte'), (0x00, 0, '0-byte')):
            R.errno(c.errno_of(REGION_READ, struct.pack('<QII', off, BAR0, n)), E.EINVAL, widths, 'BAR0 %s read at %#x' % (what, off))
        ctl.w32(CC, 0x00460000)
        for off, n, what in ((CC, 1, '1-byte'), (CC, 2, '2-byte'), (CC + 1, 4, 'unaligned 4-byte'), (AQA, 8, '8-byte at 0x24')):
            R.errno(c.errno_of(REGION_WRITE, struct.pack('<QII', off, BAR0, n) + b'\xff' * n), E.EINVAL, widths,
                    'BAR0 %s write at %#x' % (what, off))
        R.eq(ctl.r32(CC), 0x00460000, widths, 'the refused writes changed nothing (CC)')
        ctl.w32(CC, 0)
        dbs = NV('Doorbells')
        R.eq(ctl.r32(DB), 0, dbs, 'a doorbell reads 0')
        R.eq(ctl.r32(DB + 0xffc), 0, dbs, 'the last doorbell dword (0x1ffc) reads 0')
        m = c.request(REGION_READ, struct.pack('<QII', DB, BAR0, 8))
        R.check(m.is_error and m.error == E.EINVAL, dbs, 'an 8-byte read of the doorbells: EINVAL (aligned 32-bit accesses only, reads too)',
                vu.errname(m.error) if m.is_error else 'accepted')
        for off, n, what in ((DB, 2, '2-byte'), (DB + 2, 4, 'unaligned 4-byte'), (DB, 1, '1-byte')):
            R.errno(c.errno_of(REGION_READ, struct.pack('<QII', off, BAR0, n)), E.EINVAL, dbs, 'doorbell %s read' % what)
        for off, n, what in ((DB, 2, '2-byte'), (DB, 8, '8-byte'), (DB + 2, 4, 'unaligned 4-byte'), (DB, 1, '1-byte')):
            R.errno(c.errno_of(REGION_WRITE, struct.pack('<QII', off, BAR0, n) + bytes(n)), E.EINVAL, dbs, 'doorbell %s write' % what)
        R.errno(c.errno_of(REGION_WRITE, struct.pack('<QII', DB + 8, BAR0, 4) + bytes(4)), 0, dbs,
                'a doorbell write to a queue that does not exist (controller not ready) is accepted')
        R.eq(ctl.r32(CSTS), 0, dbs, '... and changes nothing')
        R.errno(c.errno_of(REGION_READ, struct.pack('<QII', 0x3ffc, BAR0, 8)), E.EINVAL, VU('Commands', 'REGION_READ'), 'read past BAR0\'s end')
    finally:
        c.close()
        env.stop(p)


# ######################################################################
# nvme.md § Registers: CC.EN, CC.SHN, CSTS.CFS
# ######################################################################
def t_enable(env):
    R.sec('Enable, disable, shutdown (nvme.md § Registers: CC.EN, CC.SHN, CSTS.CFS)')
    en = NV('Registers', 'CC.EN 0 -> 1 (enable)')
    dis = NV('Registers', 'CC.EN 1 -> 0 (disable)')
    shn = NV('Registers', 'CC.SHN (shutdown notification)')
    p = env.start(['ns1=ram:1M', 'entries=16'])
    c = new_session(p.sock)
    g = Guest(c, 8 << 20)
    ctl = Ctrl(c, g)
    try:
        ctl.bus_master(True)
        asq, acq = g.alloc(64), g.alloc(16)
        ctl.w64(ASQ, asq)
        ctl.w64(ACQ, acq)
        base = CC_EN | CC_IOQES
        for what, cc, aqa in (('CSS = 1', base | (1 << 4), 0x001f001f), ('CSS = 7 (admin only, 1.4)', base | (7 << 4), 0x001f001f),
                              ('MPS = 1 (8 KiB)', base | (1 << 7), 0x001f001f), ('AMS = 1 (WRR)', base | (1 << 11), 0x001f001f),
                              ('AQA.ASQS = 0 (1 entry)', base, 0x001f0000), ('AQA.ACQS = 0 (1 entry)', base, 0x0000001f)):
            ctl.w32(AQA, aqa)
            ctl.w32(CC, cc)
            st = ctl.r32(CSTS)
            R.eq(st & 3, 2, en, 'enable with %s: CSTS.CFS set, RDY clear' % what)
            ctl.w32(CC, cc & ~1)
            R.eq(ctl.r32(CSTS) & 0xf, 0, dis, '... a disable clears CFS')
        ctl.w32(AQA, 0x0fff0fff)
        ctl.w32(CC, base)
        R.eq(ctl.r32(CSTS) & 0xf, 1, en, 'enable with 4096-entry admin queues (AQA 0fff0fffh) on entries=16: RDY set at once (the write\'s reply)')
        ctl.sqs[0], ctl.cqs[0] = SQ(0, asq, 4096, 0, g), CQ(0, acq, 4096, g)
        e, data = ctl.identify(1)
        st_check(e, OK, NV('Instance options', 'entries: the admin queues are not bounded by it'), 'Identify on the 4096-entry admin queue')
        # SHN with the controller enabled
        for shv, name in ((1, 'normal'), (2, 'abrupt')):
            ctl.w32(CC, base | (shv << 14))
            R.check(wait_until(lambda: (ctl.r32(CSTS) >> 2) & 3 == 2), shn, 'SHN %s -> CSTS.SHST = 10b (complete)' % name, hex(ctl.r32(CSTS)))
            R.eq(ctl.r32(CSTS) & 1, 1, shn, '... RDY stays set')
            ctl.w32(CC, base)
        R.eq((ctl.r32(CSTS) >> 2) & 3, 2, shn, 'SHST stays 10b after SHN is written back to 00b while enabled')
        ctl.w32(CC, base & ~1)
        R.eq(ctl.r32(CSTS) & 0xf, 0, dis, 'disable: RDY, CFS and SHST clear')
        ctl.w32(CC, base)
        ctl.w32(CC, base | (1 << 14))
        wait_until(lambda: (ctl.r32(CSTS) >> 2) & 3 == 2)
        ctl.w32(CC, (base | (1 << 14)) & ~1)
        R.eq(ctl.r32(CSTS) & 0xf, 0, dis, 'disable after a shutdown (SHN still 01b): RDY and SHST clear')
        ctl.w32(AQA, 0x001f001f)
        ctl.w32(CC, base)
        R.eq(ctl.r32(CSTS) & 0xf, 1, en, 'enable clears SHST (RDY only)')
        ctl.w32(CC, 0)
        # IOSQES / IOCQES at enable: the admin queue works; Create I/O SQ/CQ refuse
        ctl.enable(aq=16, cc=CC_EN)
        e, _ = ctl.identify(1)
        st_check(e, OK, NV('Queues'), 'CC.IOSQES = IOCQES = 0: the admin queue works')
        st_check(ctl.create_cq(1, 8), INVALID_FIELD, NV('Admin commands', 'Create I/O CQ: CC.IOCQES != 4'), 'Create I/O CQ with CC.IOCQES 0', dnr=1)
        ctl.disable()
        ctl.enable(aq=16, cc=CC_EN | (4 << 20))
        st_check(ctl.create_cq(1, 8), OK, NV('Queues'), 'Create I/O CQ with IOCQES 4 (IOSQES 0)')
        st_check(ctl.create_sq(1, 8, 1), INVALID_FIELD, NV('Admin commands', 'Create I/O SQ: CC.IOSQES != 6'), 'Create I/O SQ with CC.IOSQES 0', dnr=1)
        ctl.disable()
        # the smallest admin queues: 2 entries each (one command at a time), wrapping
        R.check(ctl.enable(aq=2), en, 'enable with 2-entry admin queues (AQA 00010001h)')
        res = [ctl.getf(0x01) for _ in range(5)]
        R.check(all(e and e.st == OK for e in res) and [e.sqhd for e in res] == [1, 0, 1, 0, 1] and [e.p for e in res] == [1, 1, 0, 0, 1], en,
                '5 admin commands on 2-entry queues: each completes, SQHD wraps, the phase inverts at each wrap', res)
        ctl.disable()
        # an admin SQ outside the client's mappings: fatal when used
        ctl.enable()
        ctl.disable()
        ctl.w64(ASQ, 0x7f000000)
        ctl.w32(CC, base)
        R.eq(ctl.r32(CSTS) & 3, 1, en, 'enable with ASQ outside the mappings: ready (the ring is pinned on first use)')
        ctl.ring(0, 1)
        R.check(wait_until(lambda: ctl.r32(CSTS) & 2), NV('Registers', 'CSTS.CFS: when a queue\'s ring cannot be reached'),
                'its first doorbell: CSTS.CFS set', hex(ctl.r32(CSTS)))
        ctl.disable()
        R.eq(ctl.r32(CSTS) & 3, 0, en, 'a disable clears it')
        # SHN without EN, and SHN in the same write as EN
        ctl.w32(AQA, 0x001f001f)
        ctl.w64(ASQ, asq)
        ctl.w32(CC, CC_IOQES | (1 << 14))
        R.check(wait_until(lambda: (ctl.r32(CSTS) >> 2) & 3 == 2), shn, 'SHN 01b written while disabled: SHST 10b', hex(ctl.r32(CSTS)))
        ctl.w32(CC, 0)
        ctl.w32(CC, base | (1 << 14))
        R.check(wait_until(lambda: ctl.r32(CSTS) & 1), en, 'CC written with EN and SHN 01b at once (from disabled): ready', hex(ctl.r32(CSTS)))
        R.eq(ctl.r32(CSTS), 1, both(shn, en), 'CC written with EN and SHN 01b at once (from disabled): the enable clears SHST (CSTS RDY only)')
        ctl.w32(CC, 0)
    finally:
        teardown(c, g)
        env.stop(p)


# ######################################################################
# nvme.md § Admin commands: Identify
# ######################################################################
def ascii_field(b):
    return b.decode('ascii', 'replace')


def t_identify(env):
    R.sec('Identify (nvme.md § Identify; § Namespaces: Identity)')
    idf = NV('Identify')
    version = subprocess.run([env.h.bin, '--version'], capture_output=True, text=True).stdout.split()[-1]
    p = env.start(['ns1=ram:16M', 'ns3=ram:1M', 'serial=CONTRACT-1', 'queues=3'])
    c, g, ctl = bring_up(p.sock)
    try:
        e, d = ctl.identify(1)
        st_check(e, OK, idf, 'Identify controller (CNS 01h)')
        u8 = lambda o: d[o]
        u16 = lambda o: struct.unpack_from('<H', d, o)[0]
        u32 = lambda o: struct.unpack_from('<I', d, o)[0]
        R.eq((u16(0), u16(2)), (0x1234, 0x1234), idf, 'VID / SSVID 1234h')
        R.eq(ascii_field(d[4:24]), 'CONTRACT-1'.ljust(20), idf, 'SN: the serial option, space padded')
        R.eq(ascii_field(d[24:64]), 'umdev NVMe controller'.ljust(40), idf, 'MN "umdev NVMe controller", space padded')
        R.eq(ascii_field(d[64:72]).rstrip(), version, idf, 'FR: umdev\'s version (`umdev --version`)')
        R.eq(u8(72), 6, idf, 'RAB 6')
        R.eq(u8(76), 0, NV('Not implemented', 'CMIC 0'), 'CMIC 0')
        R.eq(u8(77), 8, idf, 'MDTS 8 (1 MiB)')
        R.eq(u16(78), 1, idf, 'CNTLID 1')
        R.eq(u32(80), 0x00010300, idf, 'VER 1.3.0')
        R.eq(u32(92), 0, idf, 'OAES 0')
        R.eq(u32(96), 0, idf, 'CTRATT 0')
        R.eq(u16(256), 0x0100, idf, 'OACS 0100h (Doorbell Buffer Config)')
        R.eq((u8(258), u8(259)), (3, 3), idf, 'ACL 3, AERL 3')
        R.eq(u8(260), 0x03, idf, 'FRMW 03h')
        R.eq(u8(261), 0x06, idf, 'LPA 06h')
        R.eq(u8(262), 15, idf, 'ELPE 15')
        R.eq(u8(263), 0, idf, 'NPSS 0')
        R.eq(u8(264), 1, idf, 'AVSCC 1')
        R.eq((u16(266), u16(268)), (343, 358), idf, 'WCTEMP 343 K, CCTEMP 358 K')
        R.eq((u8(512), u8(513)), (0x66, 0x44), idf, 'SQES 66h, CQES 44h')
        R.eq(u32(516), 3, idf, 'NN: the highest configured NSID (ns1, ns3: 3)')
        R.eq(u16(520), 0x0d, idf, 'ONCS 0Dh (Compare, Dataset Management, Write Zeroes)')
        R.eq(u16(522), 0, idf, 'FUSES 0')
        R.eq(u8(525), 1, idf, 'VWC 1')
        R.eq(u8(530), 1, idf, 'NVSCC 1')
        R.eq(u32(536), 0, idf, 'SGLS 0')
        nqn = d[768:1024].split(b'\0')[0].decode('ascii', 'replace')
        R.eq(nqn, 'nqn.2026-12.dev.umdev:nvme:CONTRACT-1', idf, 'SUBNQN nqn.2026-12.dev.umdev:nvme:<serial>')
        mp, flags = u16(2048), d[2048 + 3]
        R.eq((mp, flags & 1), (2500, 0), idf, 'PSD0: 25 W (MP 2500 centiwatts, MXPS 0)')
        # Identify namespace
        e, d = ctl.identify(0, nsid=1)
        st_check(e, OK, idf, 'Identify namespace 1 (CNS 00h)')
        nsze, ncap, nuse = struct.unpack_from('<QQQ', d, 0)
        R.eq((nsze, ncap, nuse), (32768, 32768, 32768), idf, 'NSZE = NCAP = NUSE = blocks (16 MiB / 512)')
        R.eq((d[25], d[26]), (0, 0), idf, 'NLBAF 0, FLBAS 0')
        lbaf0 = struct.unpack_from('<I', d, 128)[0]
        R.eq(((lbaf0 >> 16) & 0xff, lbaf0 & 0xffff), (9, 0), idf, 'LBAF0: LBADS 9, no metadata (MS 0)')
        R.eq(d[33], 0x09, idf, 'DLFEAT 09h')
        R.eq(d[27], 0, NV('Not implemented', 'metadata'), 'MC 0 (no metadata)')
        R.eq(d[28:30], b'\0\0', NV('Not implemented', 'protection information'), 'DPC, DPS 0')
        ng1 = d[104:120]
        R.eq(ng1, ram_nguid('CONTRACT-1', 1), NV('Namespaces', 'Identity: a RAM namespace\'s seed'),
             'NGUID of RAM namespace 1: FNV-1a over the serial, 00h, NSID LE')
        e, d3 = ctl.identify(0, nsid=3)
        R.eq(struct.unpack_from('<Q', d3, 0)[0], 2048, idf, 'namespace 3: NSZE 2048 (1 MiB)')
        R.eq(d3[104:120], ram_nguid('CONTRACT-1', 3), NV('Namespaces', 'Identity'), 'NGUID of RAM namespace 3')
        e, d2 = ctl.identify(0, nsid=2)
        st_check(e, OK, idf, 'Identify namespace 2 (inactive, up to NN)')
        R.check(d2 == bytes(PAGE), idf, 'inactive NSID up to NN: all zeroes', d2[:16].hex())
        for nsid in (0, 4, 0xffffffff):
            e, _ = ctl.identify(0, nsid=nsid)
            st_check(e, INVALID_NS, idf, 'Identify namespace NSID %#x' % nsid, dnr=1)
        # CNS 02h
        for nsid, want in ((0, [1, 3]), (1, [3]), (2, [3]), (3, []), (0xfffffffd, [])):
            e, d = ctl.identify(2, nsid=nsid)
            ids = [x for x in struct.unpack_from('<1024I', d) if x]
            R.check(e is not None and e.st == OK and ids == want and d.count(0) == PAGE - 4 * len(want) or (ids == want and e.st == OK and
                    all(x == 0 for x in struct.unpack_from('<1024I', d)[len(want):])), idf,
                    'CNS 02h above NSID %#x: %s, then zeroes' % (nsid, want), (e, ids))
        for nsid in (0xfffffffe, 0xffffffff):
            e, _ = ctl.identify(2, nsid=nsid)
            st_check(e, INVALID_NS, idf, 'CNS 02h with NSID %#x' % nsid)
        # CNS 03h
        e, d = ctl.identify(3, nsid=1)
        st_check(e, OK, idf, 'CNS 03h (identification descriptors) of namespace 1')
        descs, o = {}, 0
        while o + 4 <= PAGE and d[o] != 0:
            t, ln = d[o], d[o + 1]
            descs[t] = d[o + 4:o + 4 + ln]
            o += 4 + ln
        R.eq(sorted(descs), [2, 3], idf, 'descriptor types: NGUID (2) and UUID (3)')
        R.eq(descs.get(2), ng1, idf, 'the NGUID descriptor is Identify namespace\'s NGUID')
        R.eq(descs.get(3), uuid_from_nguid(ng1), NV('Namespaces', 'Identity: A UUID'), 'the UUID: the NGUID, byte 6 (b & 0Fh) | 40h, byte 8 (b & 3Fh) | 80h')
        R.check(all(x == 0 for x in d[o:]), idf, 'the list ends with zeroes', d[o:o + 8].hex())
        for nsid in (2, 0, 4, 0xffffffff):
            e, _ = ctl.identify(3, nsid=nsid)
            st_check(e, INVALID_NS, idf, 'CNS 03h NSID %#x (inactive or invalid)' % nsid)
        for cns in (0x04, 0x06, 0x10, 0x11, 0x12, 0x13, 0x15, 0xff):
            e, _ = ctl.identify(cns, nsid=1)
            st_check(e, INVALID_FIELD, idf, 'Identify CNS %02xh' % cns, dnr=1)
        # admin opcodes, fused, SGL
        ac = NV('Admin commands')
        for opc in (0x03, 0x07, 0x0b, 0x0d, 0x10, 0x11, 0x14, 0x15, 0x18, 0x19, 0x1a, 0x1c, 0x7f, 0x80, 0x81, 0x82, 0x84, 0xc0, 0xff):
            st_check(ctl.admin(opc, nsid=1, prp1=g.alloc(1)), INVALID_OPCODE, both(ac, NV('Not implemented')), 'admin opcode %02xh' % opc, dnr=1)
        st_check(ctl.admin(A_IDENT, prp1=g.alloc(1), cdw10=1, fuse=1), INVALID_FIELD, ac, 'Identify with FUSE 01b')
        st_check(ctl.admin(A_GETF, cdw10=1, psdt=1), INVALID_FIELD, ac, 'Get Features with PSDT 01b (SGL)')
        st_check(ctl.admin(0x80, fuse=2), INVALID_FIELD, ac, 'an unknown opcode (80h) with FUSE set: Invalid Field (before the opcode is looked at)')
        st_check(ctl.admin(0xff, psdt=2), INVALID_FIELD, ac, 'an unknown opcode (FFh) with PSDT set: Invalid Field')
        # the data pointer: an offset in PRP1 and PRP2's page
        a, b = g.alloc(1), g.alloc(3) + 2 * PAGE
        g.write(a, b'\x5a' * PAGE)
        g.write(b, b'\x5a' * PAGE)
        e = ctl.admin(A_IDENT, prp1=a + 0x800, prp2=b, cdw10=1)
        st_check(e, OK, NV('NVM commands', 'Data pointer'), 'Identify controller into PRP1 + 800h and PRP2 (another page)')
        whole = g.read(a + 0x800, 0x800) + g.read(b, 0x800)
        _, ref = ctl.identify(1)
        R.check(whole == ref and g.read(a, 0x800) == b'\x5a' * 0x800 and g.read(b + 0x800, 0x800) == b'\x5a' * 0x800,
                NV('NVM commands', 'Data pointer'), 'the 4 KiB land split across the two pages, nothing around them touched')
        e = ctl.admin(A_IDENT, prp1=g.iova + g.size + PAGE, cdw10=1)
        st_check(e, DATA_XFER_ERR, NV('NVM commands', 'Statuses: Data Transfer Error'), 'Identify into memory outside the client\'s mappings')
        st_check(ctl.admin(A_IDENT, prp1=a + 2, prp2=b, cdw10=1), PRP_OFFSET, NV('NVM commands', 'Statuses: PRP Offset Invalid'), 'Identify, PRP1 not dword aligned')
        st_check(ctl.admin(A_IDENT, prp1=a + 0x800, prp2=b + 8, cdw10=1), PRP_OFFSET, NV('NVM commands', 'Statuses: PRP Offset Invalid'), 'Identify, PRP2 not page aligned')
        c.dma_map(0x80000000, 1 << 20)
        c.mem.append((0x80000000, bytearray(1 << 20)))
        e = ctl.admin(A_IDENT, prp1=0x80000000, cdw10=1)
        st_check(e, DATA_XFER_ERR, both(NV('NVM commands', 'Statuses: Data Transfer Error (in memory mapped without an fd)'),
                                         RM('Serving devices to QEMU', 'Other RAM backings')), 'Identify into memory mapped without an fd')
    finally:
        teardown(c, g)
        env.stop(p)


# ######################################################################
# nvme.md § Admin commands: Features
# ######################################################################
def t_features(env):
    R.sec('Get/Set Features (nvme.md § Features)')
    ft = NV('Features')
    p = env.start(['ns1=ram:1M', 'queues=4'])
    c, g, ctl = bring_up(p.sock)
    try:
        defaults = {0x01: 7, 0x02: 0, 0x05: 0, 0x06: 1, 0x07: 3 | (3 << 16), 0x08: 0, 0x0a: 0, 0x0b: 0}
        for fid, want in sorted(defaults.items()):
            e = ctl.getf(fid)
            R.check(e is not None and e.st == OK and e.dw0 == want, ft, 'Get Features %02xh default: %#x' % (fid, want), e)
        e = ctl.getf(0x04, cdw11=0)
        R.check(e.st == OK and e.dw0 & 0xffff == 343, ft, 'Temperature Threshold default: over 343 K', e)
        e = ctl.getf(0x04, cdw11=1 << 20)
        R.check(e.st == OK and e.dw0 & 0xffff == 0, ft, 'Temperature Threshold default: under 0 K', e)
        e = ctl.getf(0x09, cdw11=0)
        R.check(e.st == OK and (e.dw0 >> 16) & 1 == 1, ft, 'Interrupt Vector Configuration: vector 0 CD 1', e)
        e = ctl.getf(0x09, cdw11=1)
        R.check(e.st == OK and (e.dw0 >> 16) & 1 == 0 and e.dw0 & 0xffff == 1, ft, 'Interrupt Vector Configuration: vector 1 CD 0 (IV echoed)', e)
        # sets
        for fid, val, what in ((0x01, 0x04030201, 'Arbitration AB/LPW/MPW/HPW stored'), (0x02, 0x40, 'Power Management WH stored (PS 0)'),
                               (0x05, 0x1234, 'Error Recovery TLER'), (0x06, 0, 'Volatile Write Cache WCE 0'),
                               (0x08, 0x0a03, 'Interrupt Coalescing THR 3, TIME 10'), (0x0a, 1, 'Write Atomicity Normal DN 1'),
                               (0x0b, 0x02, 'Asynchronous Event Configuration bit 1')):
            e = ctl.setf(fid, val)
            st_check(e, OK, ft, 'Set Features %02xh (%s)' % (fid, what))
            e = ctl.getf(fid)
            R.check(e.st == OK and e.dw0 == val, ft, '... Get reads it back: %#x' % val, e)
        e = ctl.getf(0x01, sel=1)
        R.check(e.st == OK and e.dw0 == 7, NV('Admin commands', 'Get Features: SEL 1 (default)'), 'SEL 1 after a Set: the default', e)
        e = ctl.getf(0x01, sel=2)
        R.check(e.st == OK and e.dw0 == 7, NV('Admin commands', 'Get Features: SEL 2 (saved = default)'), 'SEL 2: saved = default', e)
        st_check(ctl.getf(0x01, sel=3), INVALID_FIELD, NV('Admin commands', 'Get Features: SEL 3'), 'SEL 3')
        e = ctl.setf(0x0b, 0x1ff)
        e = ctl.getf(0x0b)
        R.check(e.st == OK and e.dw0 & 0xff == 0xff, ft, 'Asynchronous Event Configuration: bits 7:0 stored (other bits ignored)', e)
        ctl.setf(0x0b, 0)
        st_check(ctl.setf(0x02, 1), INVALID_FIELD, ft, 'Power Management PS 1 (one power state)')
        st_check(ctl.setf(0x04, 300 | (1 << 16)), INVALID_FIELD, ft, 'Temperature Threshold TMPSEL 1')
        st_check(ctl.setf(0x05, 1 << 16), INVALID_FIELD, ft, 'Error Recovery DULBE 1')
        e = ctl.setf(0x04, 330)
        e2 = ctl.setf(0x04, 10 | (1 << 20))
        R.check(e.st == OK and e2.st == OK and ctl.getf(0x04).dw0 & 0xffff == 330 and ctl.getf(0x04, cdw11=1 << 20).dw0 & 0xffff == 10,
                ft, 'Temperature Threshold over 330 and under 10 stored apart (THSEL)', (e, e2))
        st_check(ctl.setf(0x09, 5 | (1 << 16)), INVALID_FIELD, ft, 'Set Interrupt Vector Configuration IV 5 (5 vectors: 0-4)')
        st_check(ctl.getf(0x09, cdw11=5), INVALID_FIELD, ft, 'Get Interrupt Vector Configuration IV 5')
        e = ctl.setf(0x09, 0)
        R.check(e.st == OK and (ctl.getf(0x09, cdw11=0).dw0 >> 16) & 1 == 1, ft, 'Set vector 0 CD 0: succeeds and CD stays 1', e)
        e = ctl.setf(0x09, 2 | (1 << 16))
        R.check(e.st == OK and (ctl.getf(0x09, cdw11=2).dw0 >> 16) & 1 == 1, ft, 'Set vector 2 CD 1: reads 1', e)
        for fid in (0x03, 0x0c, 0x0d, 0x0f, 0x10, 0x80, 0xff):
            st_check(ctl.getf(fid), INVALID_FIELD, ft, 'Get Features FID %02xh (other)' % fid, dnr=1)
            st_check(ctl.setf(fid, 0), INVALID_FIELD, ft, 'Set Features FID %02xh (other)' % fid, dnr=1)
        for fid in (0x01, 0x06, 0x80):
            st_check(ctl.setf(fid, 0, sv=1), NOT_SAVEABLE, NV('Admin commands', 'Set Features: SV'), 'Set Features %02xh with SV' % fid, dnr=1)
        # Number of Queues
        nq = NV('Features', 'Number of Queues')
        st_check(ctl.setf(0x07, 0xffff), INVALID_FIELD, nq, 'NSQR FFFFh')
        st_check(ctl.setf(0x07, 0xffff << 16), INVALID_FIELD, nq, 'NCQR FFFFh')
        e = ctl.setf(0x07, 1 | (0 << 16))
        R.check(e.st == OK and e.dw0 == 1 | (0 << 16), nq, 'request 2 SQs, 1 CQ: granted as asked (DW0 = NSQA | NCQA << 16, 0\'s based)', e)
        e = ctl.setf(0x07, 99 | (99 << 16))
        R.check(e.st == OK and e.dw0 == 3 | (3 << 16), nq, 'request 100 each: granted min(requested, queues = 4)', e)
        e = ctl.setf(0x07, 1 | (2 << 16))
        R.check(e.st == OK and e.dw0 == 1 | (2 << 16), nq, 'request 2 SQs, 3 CQs: granted as asked', e)
        e = ctl.getf(0x07)
        if e.dw0 != 1 | (2 << 16):
            R.note(nq, 'Get Features Number of Queues after a Set granted 2 SQs / 3 CQs reads %#x (the doc gives only the default)' % e.dw0)
        ctl.setf(0x07, 1 | (1 << 16))
        st_check(ctl.create_cq(3, 8), INVALID_QID, both(nq, NV('Admin commands', 'Create I/O SQ: above the granted count')),
                 'Create I/O CQ 3 after 2 were granted', dnr=1)
        ctl.io_pair(1, 8)
        st_check(ctl.setf(0x07, 3 | (3 << 16)), CMD_SEQ_ERR, nq, 'Number of Queues after an I/O queue exists')
        # features return to their defaults on disable
        ctl.disable()
        ctl.enable()
        back = {f: ctl.getf(f).dw0 for f in (0x01, 0x02, 0x05, 0x06, 0x07, 0x08, 0x0a, 0x0b)}
        back_t = (ctl.getf(0x04).dw0 & 0xffff, ctl.getf(0x04, cdw11=1 << 20).dw0 & 0xffff)
        R.eq(back, {f: v for f, v in defaults.items()}, both(ft, NV('Registers', 'CC.EN 1 -> 0 (disable)')), 'after a disable every feature is back at its default')
        R.eq(back_t, (343, 0), ft, '... temperature thresholds too')
        R.eq((ctl.getf(0x09, cdw11=2).dw0 >> 16) & 1, 0, ft, '... and vector 2\'s CD')
    finally:
        teardown(c, g)
        env.stop(p)


# ######################################################################
# nvme.md § Log pages
# ######################################################################
def t_logs(env):
    R.sec('Get Log Page (nvme.md § Log pages)')
    lp = NV('Log pages')
    version = subprocess.run([env.h.bin, '--version'], capture_output=True, text=True).stdout.split()[-1]
    os.environ['RUST_LOG'] = 'debug'
    try:
        p = env.start(['ns1=ram:16M', 'queues=2'])
    finally:
        del os.environ['RUST_LOG']
    c, g, ctl = bring_up(p.sock)
    try:
        # firmware slot
        e, d = ctl.get_log(0x03, 512)
        st_check(e, OK, lp, 'Firmware Slot (03h)')
        R.eq(d[0], 1, lp, 'AFI 1')
        R.eq(d[8:16].decode('ascii', 'replace').rstrip(' \0'), version, lp, 'FRS1: umdev\'s version')
        R.check(d[16:] == bytes(512 - 16), lp, 'the other slots and the rest 0', d[16:32].hex())
        # effects
        e, d = ctl.get_log(0x05, 4096)
        st_check(e, OK, lp, 'Commands Supported and Effects (05h)')
        acs = struct.unpack_from('<256I', d, 0)
        iocs = struct.unpack_from('<256I', d, 1024)
        want_a = [1 if op in ADMIN_OPS else 0 for op in range(256)]
        want_i = [(3 if op in (IO_FLUSH, IO_WRITE, IO_WZ, IO_DSM) else 1) if op in IO_OPS else 0 for op in range(256)]
        R.eq({op: v for op, v in enumerate(acs) if v != want_a[op]}, {}, lp, 'admin dwords: CSUPP for 00 01 02 04 05 06 08 09 0A 0C 7C, 0 for the rest')
        R.eq({op: v for op, v in enumerate(iocs) if v != want_i[op]}, {}, lp, 'I/O dwords: CSUPP|LBCC for Flush, Write, Write Zeroes, DSM; CSUPP for Read, Compare; 0 for the rest')
        R.check(d[2048:] == bytes(2048), lp, 'bytes 2048-4095 zero', d[2048:2064].hex())
        # SMART
        e, d = ctl.get_log(0x02, 512)
        st_check(e, OK, lp, 'SMART / Health (02h)')
        R.eq((d[0], struct.unpack_from('<H', d, 1)[0], d[3], d[4], d[5]), (0, 313, 100, 10, 0), lp,
             'critical warning 0, composite temperature 313 K, available spare 100 %, threshold 10 %, percentage used 0')
        R.eq(struct.unpack_from('<Q', d, 112)[0], 1, lp, 'power cycles 1')
        # offsets and lengths
        e, whole = ctl.get_log(0x05, 4096)
        e, part = ctl.get_log(0x05, 1024, offset=1028)
        R.check(e.st == OK and part == whole[1028:2052], lp, 'LPOL 1028: the page from byte 1028', e)
        st_check(ctl.get_log(0x05, 64, offset=1026)[0], INVALID_FIELD, lp, 'LPOL not dword aligned')
        st_check(ctl.get_log(0x02, 64, offset=512)[0], INVALID_FIELD, lp, 'LPOL at the page\'s end (SMART: 512)')
        st_check(ctl.get_log(0x05, 64, offset=1 << 32)[0], INVALID_FIELD, lp, 'LPOU 1 (beyond the end)')
        e, d = ctl.get_log(0x02, 8192)
        R.check(e.st == OK and d[512:] == bytes(8192 - 512), lp, 'NUMD past the page\'s end (8 KiB of SMART): zeroes past 512', e)
        e, d = ctl.get_log(0x03, 4096, offset=256)
        R.check(e.st == OK and d[256:] == bytes(4096 - 256), lp, 'offset 256 of Firmware Slot, 4 KiB: zeroes past the end', e)
        # more than 1 MiB asked: the first 1 MiB, success
        n = (1 << 20) + 8192
        e, d = ctl.get_log(0x05, n)
        R.check(e.st == OK and d[:4096] == whole and d[4096:1 << 20] == bytes((1 << 20) - 4096) and d[1 << 20:] == b'\xa5' * 8192,
                lp, 'NUMD of 1 MiB + 8 KiB: success, the first 1 MiB written (zeroes past the page), nothing beyond', e)
        for nsid in (0, 1, 5, 0xffffffff):
            st_check(ctl.get_log(0x02, 512, nsid=nsid)[0], OK, lp, 'SMART with NSID %#x (any NSID accepted)' % nsid)
        for lid in (0x00, 0x04, 0x06, 0x07, 0x08, 0x70, 0x80, 0x81, 0xc0, 0xff):
            st_check(ctl.get_log(lid, 512)[0], INVALID_LOG, lp, 'unknown LID %02xh' % lid)
        # error log
        el = NV('Log pages', '01h Error Information')
        e0, d0 = ctl.get_log(0x01, 1024)
        st_check(e0, OK, el, 'Error Information (01h), 16 entries of 64 bytes')
        cnt0 = struct.unpack_from('<Q', d0, 0)[0]
        e1 = ctl.admin(0x7e)
        ctl.io_pair(1, 16)
        rbuf = g.alloc(1)
        e2 = ctl.rw(1, IO_READ, 40000, 8, rbuf)     # 16 MiB = 32768 blocks: out of range
        st_check(e2, LBA_RANGE, NV('NVM commands', 'Statuses'), 'Read at LBA 40000 of 32768 (for the log)', dnr=1)
        e, d = ctl.get_log(0x01, 1024)
        ents = [d[64 * i:64 * i + 64] for i in range(16)]
        cnt = [struct.unpack_from('<Q', x, 0)[0] for x in ents]
        R.eq((cnt[0], cnt[1]), (cnt0 + 2, cnt0 + 1), el, 'newest first: error counts n, n-1 (one entry per error completion)')
        sqid, cid, sf, pel, lba, nsid = struct.unpack_from('<HHHHQI', ents[0], 8)
        R.eq((sqid, cid, sf >> 1, pel, lba, nsid), (1, e2.cid, e2.sf, 0xffff, 40000, 1), el,
             'the Read\'s entry: SQID 1, CID, status field, PEL FFFFh, LBA 40000, NSID 1')
        sqid, cid, sf, pel = struct.unpack_from('<HHHH', ents[1], 8)
        R.eq((sqid, cid, sf >> 1, pel), (0, e1.cid, e1.sf, 0xffff), el, 'the admin error\'s entry: SQID 0, CID, status field, PEL FFFFh')
        e3 = ctl.cmd(1, sqe(IO_WZ, nsid=1, cdw10=50000, cdw12=3))
        e4 = ctl.cmd(1, sqe(IO_COMPARE, nsid=1, prp1=rbuf, cdw10=(1 << 32) - 1, cdw11=1, cdw12=0))
        e, d = ctl.get_log(0x01, 128)
        lbas = [struct.unpack_from('<Q', d, 64 * i + 16)[0] for i in range(2)]
        R.eq((e3.st, e4.st, lbas), (LBA_RANGE, LBA_RANGE, [(1 << 33) - 1, 50000]), el,
             'Write Zeroes and Compare errors: their entries carry their LBAs (newest first)')
        e, s = ctl.get_log(0x02, 512)
        R.eq(struct.unpack_from('<Q', s, 176)[0], cnt[0] + 2, lp, 'SMART error log entries = the error count')
        base_cnt = struct.unpack_from('<Q', ctl.get_log(0x01, 64)[1], 0)[0]
        for _ in range(20):
            ctl.admin(0x7f)
        e, d = ctl.get_log(0x01, 2048)
        cnts = [struct.unpack_from('<Q', d, 64 * i)[0] for i in range(32)]
        R.eq(cnts[:16], [base_cnt + 20 - i for i in range(16)], el, '20 more errors: 16 entries, newest first, error counts consecutive')
        R.check(d[1024:] == bytes(1024), el, 'the page is 16 entries (1024 bytes): zeroes past them')
        dbg = NV('NVM commands', 'Every command that completes with an error status ... is also logged at debug level')
        want = re.compile(r'DEBUG.*queue 1\b.*opcode 0x02\b.*cid %d\b.*nsid 1\b.*cdw10 0x9c40\b.*cdw11 0x0\b.*status 0/80h DNR' % e2.cid)
        R.check(wait_until(lambda: want.search(env.log(p))), dbg,
                'RUST_LOG=debug: the failed Read is logged with its queue, opcode, cid, NSID, CDW10, CDW11 and "status 0/80h DNR"',
                [l for l in env.log(p).splitlines() if 'status' in l][-1:])
        want = re.compile(r'DEBUG.*queue 0\b.*opcode 0x7e\b.*cid %d\b.*status 0/01h DNR' % e1.cid)
        R.check(want.search(env.log(p)), dbg, '... and the admin command with the unknown opcode')
    finally:
        teardown(c, g)
        env.stop(p)


# ######################################################################
# nvme.md § Queues, § Admin commands (queue management, Abort)
# ######################################################################
def t_queues(env):
    R.sec('Queue management (nvme.md § Queues; § Admin commands)')
    q = NV('Queues')
    csq = NV('Admin commands', 'Create I/O SQ')
    ccq = NV('Admin commands', 'Create I/O CQ')
    p = env.start(['ns1=ram:4M', 'queues=4', 'entries=64'])
    c, g, ctl = bring_up(p.sock)
    try:
        ctl.setf(0x07, 2 | (2 << 16))          # 3 SQs, 3 CQs
        st_check(ctl.create_cq(0, 8), INVALID_QID, ccq, 'Create I/O CQ QID 0', dnr=1)
        st_check(ctl.create_cq(4, 8), INVALID_QID, ccq, 'Create I/O CQ QID 4 (3 granted)', dnr=1)
        st_check(ctl.create_cq(1, 1), INVALID_QSIZE, ccq, 'Create I/O CQ of 1 entry', dnr=1)
        st_check(ctl.create_cq(1, 65), INVALID_QSIZE, ccq, 'Create I/O CQ of 65 entries (entries=64)', dnr=1)
        st_check(ctl.create_cq(1, 8, pc=False), INVALID_FIELD, ccq, 'Create I/O CQ with PC 0', dnr=1)
        st_check(ctl.create_cq(1, 8, iova=g.alloc(1) + 0x800), PRP_OFFSET, ccq, 'Create I/O CQ at a base not page aligned', dnr=1)
        st_check(ctl.create_cq(1, 8, iv=5), INVALID_IV, ccq, 'Create I/O CQ IV 5 (5 vectors)', dnr=1)
        st_check(ctl.create_cq(1, 8, iv=5, ien=False), OK, ccq, 'Create I/O CQ IV 5 with IEN 0 (IV checked only with IEN)')
        st_check(ctl.delete_cq(1), OK, NV('Admin commands', 'Delete I/O CQ'), 'Delete I/O CQ 1')
        st_check(ctl.create_cq(1, 2, iv=4), OK, ccq, 'Create I/O CQ 1 of 2 entries, IV 4')
        st_check(ctl.create_cq(1, 8), INVALID_QID, ccq, 'Create I/O CQ 1 again (existing)', dnr=1)
        st_check(ctl.delete_cq(1), OK, NV('Admin commands', 'Delete I/O CQ'), 'Delete I/O CQ 1')
        st_check(ctl.create_cq(1, 64), OK, ccq, 'Create I/O CQ 1 of 64 entries (entries)')
        st_check(ctl.create_sq(0, 8, 1), INVALID_QID, csq, 'Create I/O SQ QID 0', dnr=1)
        st_check(ctl.create_sq(4, 8, 1), INVALID_QID, csq, 'Create I/O SQ QID 4 (3 granted)', dnr=1)
        e = ctl.create_cq(3, 8, iv=3, iova=0x7e000000)
        st_check(e, OK, q, 'Create I/O CQ with its base outside the client\'s mappings succeeds (not checked until first use)')
        if e.st == OK:
            ctl.delete_cq(3)
        st_check(ctl.create_sq(1, 8, 0), CQ_INVALID, csq, 'Create I/O SQ on CQID 0', dnr=1)
        st_check(ctl.create_sq(1, 8, 2), CQ_INVALID, csq, 'Create I/O SQ on CQID 2 (absent)', dnr=1)
        st_check(ctl.create_sq(1, 1, 1), INVALID_QSIZE, csq, 'Create I/O SQ of 1 entry', dnr=1)
        st_check(ctl.create_sq(1, 65, 1), INVALID_QSIZE, csq, 'Create I/O SQ of 65 entries', dnr=1)
        st_check(ctl.create_sq(1, 8, 1, pc=False), INVALID_FIELD, csq, 'Create I/O SQ with PC 0', dnr=1)
        st_check(ctl.create_sq(1, 8, 1, iova=g.alloc(1) + 64), PRP_OFFSET, csq, 'Create I/O SQ at a base not page aligned', dnr=1)
        st_check(ctl.create_sq(1, 64, 1, prio=3), OK, csq, 'Create I/O SQ 1 of 64 entries on CQ 1 (QPRIO 3 ignored)')
        st_check(ctl.create_sq(1, 8, 1), INVALID_QID, csq, 'Create I/O SQ 1 again (existing)', dnr=1)
        st_check(ctl.create_sq(2, 2, 1), OK, both(csq, q), 'Create I/O SQ 2 of 2 entries on CQ 1 (several SQs share a CQ)')
        st_check(ctl.delete_cq(1), INVALID_QDEL, NV('Admin commands', 'Delete I/O CQ: an SQ still on it'), 'Delete I/O CQ 1 with SQs on it', dnr=1)
        st_check(ctl.delete_cq(0), INVALID_QID, NV('Admin commands', 'Delete I/O CQ'), 'Delete I/O CQ 0')
        st_check(ctl.delete_cq(3), INVALID_QID, NV('Admin commands', 'Delete I/O CQ'), 'Delete I/O CQ 3 (absent)')
        st_check(ctl.delete_sq(0), INVALID_QID, NV('Admin commands', 'Delete I/O SQ'), 'Delete I/O SQ 0', dnr=1)
        st_check(ctl.delete_sq(3), INVALID_QID, NV('Admin commands', 'Delete I/O SQ'), 'Delete I/O SQ 3 (absent)', dnr=1)
        # two SQs on one CQ; SQHD; the 2-entry SQ wraps
        buf = g.alloc(1)
        seen = []
        for i in range(6):
            for sqid in (1, 2):
                e = ctl.rw(sqid, IO_READ, i, 1, buf)
                seen.append((sqid, e.sqid if e else None, e.st if e else None, e.sqhd if e else None))
        R.eq([(a, b, s) for a, b, s, _ in seen], [(a, a, OK) for a, _, _, _ in seen], q, 'Reads on SQ 1 and SQ 2 sharing CQ 1: each completion names its SQ')
        R.eq([h for a, _, _, h in seen if a == 1], [1, 2, 3, 4, 5, 6], q, 'SQHD on SQ 1 (64 entries): the entry after the one fetched')
        R.eq([h for a, _, _, h in seen if a == 2], [1, 0, 1, 0, 1, 0], q, 'SQHD on SQ 2 (2 entries) wraps')
        cq1 = ctl.cqs[1]
        R.eq((cq1.head, cq1.phase), (12, 1), q, 'CQ 1 head after 12 completions; phase tag still 1')
        st_check(ctl.delete_sq(2), OK, NV('Admin commands', 'Delete I/O SQ'), 'Delete I/O SQ 2')
        st_check(ctl.setf(0x07, 0), CMD_SEQ_ERR, NV('Features', 'Number of Queues'), 'Number of Queues while I/O queues exist')
        # phase tag: a 4-entry CQ wraps 3 times
        st_check(ctl.create_cq(2, 4, iv=2), OK, ccq, 'Create I/O CQ 2 of 4 entries')
        st_check(ctl.create_sq(2, 8, 2), OK, csq, 'Create I/O SQ 2 of 8 entries on it')
        phases, ok = [], True
        for i in range(13):
            cq = ctl.cqs[2]
            phase = cq.phase
            e = ctl.rw(2, IO_READ, i, 1, buf)
            ok = ok and e is not None and e.st == OK and e.p == phase
            phases.append(e.p if e else None)
        R.check(ok and phases[:4] == [1, 1, 1, 1] and phases[4:8] == [0, 0, 0, 0] and phases[8:12] == [1, 1, 1, 1] and phases[12] == 0,
                both(q, SPEC('4.6 Completion Queue Entry: Phase Tag')), 'the phase tag starts at 1 and inverts at each wrap of a 4-entry CQ', phases)
        # admin SQHD
        e1 = ctl.getf(0x01)
        e2 = ctl.getf(0x01)
        R.eq((e2.sqhd - e1.sqhd) % 32, 1, q, 'admin SQHD advances by one entry per command')
        # a full CQ holds its SQ's worker; an entry waiting keeps its SQHD
        ctl.delete_sq(2)
        ctl.delete_cq(2)
        st_check(ctl.create_cq(2, 2, iv=2), OK, ccq, 'Create I/O CQ 2 of 2 entries (room for 1)')
        st_check(ctl.create_sq(2, 8, 2), OK, csq, 'Create I/O SQ 2 of 8 entries on it')
        ctl.auto_head = False
        cids = [ctl.submit(2, sqe(IO_READ, nsid=1, prp1=buf, cdw10=i)) for i in range(3)]
        first = []
        wait_until(lambda: first.extend(ctl.reap(2)) or first)
        R.check(len(first) == 1 and quiet_cq(ctl, 2), both(q, SPEC('4.6 full queue')), 'a CQ of 2 entries takes one completion, then stays full while the host holds its head', first)
        ctl.ring_cq(2)
        more = []
        wait_until(lambda: more.extend(ctl.reap(2)) or more)
        ctl.ring_cq(2)
        wait_until(lambda: more.extend(ctl.reap(2)) or len(more) >= 2)
        ctl.ring_cq(2)
        ctl.auto_head = True
        allc = first + more
        R.eq([(e.cid, e.st) for e in allc], [(cid, OK) for cid in cids], q, 'releasing the head lets the held completions through, in order')
        R.eq([e.sqhd for e in allc], [1, 2, 3], q, 'SQHD of each: the entry after its own (a waiting entry keeps the value it was made with)')
    finally:
        ctl.auto_head = True
        teardown(c, g)
        env.stop(p)


def t_abort(env):
    R.sec('Abort, Delete I/O SQ with commands waiting (nvme.md § Admin commands)')
    ab = NV('Admin commands', 'Abort')
    dq = NV('Admin commands', 'Delete I/O SQ')
    p = env.start(['ns1=ram:4M', 'queues=2', 'entries=64'])
    c, g, ctl = bring_up(p.sock)
    try:
        buf = g.alloc(1)
        ctl.create_cq(1, 2, iv=1)
        ctl.create_sq(1, 16, 1)
        ctl.auto_head = False
        cids = [ctl.submit(1, sqe(IO_READ, nsid=1, prp1=buf, cdw10=i)) for i in range(8)]
        first = []
        wait_until(lambda: first.extend(ctl.reap(1)) or first)
        # the CQ (room for one) holds the worker on the 2nd command: the 3rd to 8th wait unfetched
        e = ctl.admin(A_ABORT, cdw10=1 | (cids[0] << 16))
        R.check(e.st == OK and e.dw0 & 1 == 1, ab, 'Abort of a command done: DW0 bit 0 = 1', e)
        e = ctl.admin(A_ABORT, cdw10=1 | (0x7777 << 16))
        R.check(e.st == OK and e.dw0 & 1 == 1, ab, 'Abort of an unknown CID: DW0 bit 0 = 1', e)
        e = ctl.admin(A_ABORT, cdw10=0 | (0x1234 << 16))
        R.check(e.st == OK and e.dw0 & 1 == 1, ab, 'Abort on the admin queue: DW0 bit 0 = 1', e)
        e = ctl.admin(A_ABORT, cdw10=5 | (0x1 << 16))
        R.check(e.st == OK and e.dw0 & 1 == 1, ab, 'Abort naming an SQ that does not exist: DW0 bit 0 = 1', e)
        res = [ctl.admin(A_ABORT, cdw10=1 | (cid << 16)) for cid in cids[2:7]]
        R.eq([(e.st, e.dw0 & 1) for e in res[:4]], [(OK, 0)] * 4, ab, 'Abort of 4 commands still waiting in the SQ: DW0 bit 0 = 0')
        st_check(res[4], ABORT_LIMIT, ab, 'a 5th pending abort on the queue (at most 4)')
        e = ctl.admin(A_ABORT, cdw10=1 | (cids[0] << 16))
        st_check(e, ABORT_LIMIT, ab, 'with 4 aborts pending, an Abort naming that queue, even of a command already done, exceeds the limit')
        got = list(first)
        while len(got) < 8:
            ctl.ring_cq(1)
            n = len(got)
            if not wait_until(lambda: got.extend(ctl.reap(1)) or len(got) > n):
                break
        ctl.ring_cq(1)
        ctl.auto_head = True
        R.eq([(e.cid, e.st) for e in got], [(cids[0], OK), (cids[1], OK)] + [(cid, ABORT_REQUESTED) for cid in cids[2:6]] + [(cids[6], OK), (cids[7], OK)],
             ab, 'the aborted commands complete with Command Abort Requested when fetched, the others succeed, in order')
        # Delete I/O SQ with commands waiting: they complete with 08h before the Delete completes.
        # The 2nd command is a Write; a Read on another queue sees its data, so it has run (its
        # completion waits for CQ room) when the Delete comes.
        ctl.create_cq(2, 8, iv=2)
        ctl.create_sq(2, 8, 2)
        # first, the prefetch hint: a 1 MiB Read reads the next entry early; that entry still
        # counts as not fetched. (A Read: a RAM Write's entry could be held while the worker
        # runs on, Interrupts: RAM writes' entries.)
        pf = NV('Queues', 'Before it runs a Read or Write of 32 KiB or more ... until then it counts as not fetched (for SQHD and Abort)')
        big = g.alloc(256)
        bigd = rand_bytes(1 << 20, 55)
        g.write(big, bigd)
        prp1, prp2 = build_prp(g, [big + PAGE * k for k in range(256)], 0, 1 << 20)
        st_check(ctl.cmd(2, sqe(IO_WRITE, nsid=1, prp1=prp1, prp2=prp2, cdw10=4096, cdw12=2047)), OK, pf, '(setup) 1 MiB Write at LBA 4096 on SQ 2')
        rb = g.alloc(256)
        g.write(rb, b'\xee' * (1 << 20))
        rprp = build_prp(g, [rb + PAGE * k for k in range(256)], 0, 1 << 20)
        ctl.auto_head = False
        t0 = ctl.sqs[1].tail
        pc = [ctl.submit(1, sqe(IO_READ, nsid=1, prp1=buf, cdw10=0), ring=False),
              ctl.submit(1, sqe(IO_READ, nsid=1, prp1=rprp[0], prp2=rprp[1], cdw10=4096, cdw12=2047), ring=False),
              ctl.submit(1, sqe(IO_READ, nsid=1, prp1=buf, cdw10=1), ring=False),
              ctl.submit(1, sqe(IO_READ, nsid=1, prp1=buf, cdw10=2), ring=False)]
        ctl.ring_sq(1)
        first = []
        wait_until(lambda: first.extend(ctl.reap(1)) or first)
        ran = wait_until(lambda: g.read(rb, 1 << 20) == bigd, step=0.001)
        R.check(ran, pf, '(setup) the 1 MiB Read behind a full CQ has run (its data is in memory)')
        e = ctl.admin(A_ABORT, cdw10=1 | (pc[2] << 16))
        R.check(e.st == OK and e.dw0 & 1 == 0, pf, 'Abort of the entry after the 1 MiB Read (read early as a hint): DW0 bit 0 = 0 (not fetched)', e)
        got = list(first)
        while len(got) < 4:
            ctl.ring_cq(1)
            n = len(got)
            if not wait_until(lambda: got.extend(ctl.reap(1)) or len(got) > n):
                break
        ctl.ring_cq(1)
        ctl.auto_head = True
        R.eq([(e.cid, e.st) for e in got], [(pc[0], OK), (pc[1], OK), (pc[2], ABORT_REQUESTED), (pc[3], OK)], pf,
             '... it completes with Command Abort Requested; the others succeed')
        R.eq(got[1].sqhd if len(got) > 1 else None, (t0 + 2) % 16, pf, 'the 1 MiB Read\'s SQHD: the entry after it (the hinted entry not counted)')
        wbuf, rbuf = g.alloc(1), g.alloc(1)
        data = rand_bytes(512, 77)
        g.write(wbuf, data)
        ctl.auto_head = False
        cids = [ctl.submit(1, sqe(IO_READ, nsid=1, prp1=buf, cdw10=0))]
        cids.append(ctl.submit(1, sqe(IO_WRITE, nsid=1, prp1=wbuf, cdw10=100)))
        cids += [ctl.submit(1, sqe(IO_READ, nsid=1, prp1=buf, cdw10=i)) for i in range(12)]
        first = []
        wait_until(lambda: first.extend(ctl.reap(1)) or first)
        ran = wait_until(lambda: ctl.cmd(2, sqe(IO_READ, nsid=1, prp1=rbuf, cdw10=100)).st == OK and g.read(rbuf, 512) == data)
        R.check(ran, dq, '(setup) the Write held behind the full CQ has run: a Read on SQ 2 sees its data')
        dcid = ctl.submit(0, sqe(A_DEL_SQ, cdw10=1))
        got = list(first)
        de = []

        def progress():
            if ctl.peek(1) is not None:
                got.extend(ctl.reap(1))
                ctl.ring_cq(1)
            if not de:
                for e in ctl.reap(0):
                    if e.cid == dcid:
                        de.append((e, len(got) + (1 if ctl.peek(1) is not None else 0)))
            return de and ctl.peek(1) is None
        ctl.ring_cq(1)
        wait_until(progress)
        got.extend(ctl.reap(1))
        ctl.auto_head = True
        R.check(de and de[0][0].st == OK, dq, 'Delete I/O SQ 1 with 12 commands waiting succeeds', de)
        sts = [(e.cid, e.st) for e in got]
        R.eq(sts[:2], [(cids[0], OK), (cids[1], OK)], both(dq, NV('Queues', 'SQHD: an entry that then waits to be posted (its CQ full)')),
             'the Write that ran, its completion waiting for CQ room, completes with its own status (Success)')
        # the host released the CQ right after sending the Delete, so the worker may have fetched a
        # few more before it stopped: those succeed, every later one gets 08h
        k = next((i for i, x in enumerate(sts) if x[1] != OK), len(sts))
        R.check(sts[k:] == [(cid, ABORT_SQ_DELETED) for cid in cids[k:]] and len(sts) == len(cids), dq,
                'the commands still in the queue complete with Command Aborted due to SQ Deletion (08h), in order (%d ran first)' % (k - 2), sts)
        R.check(de and de[0][1] == len(cids), dq, 'all of them were posted before the Delete\'s completion', de and de[0][1])
        ctl.sqs.pop(1, None)
        # the same, the host never releasing the CQ: the aborts that do not fit are dropped
        st_check(ctl.create_sq(1, 16, 1), OK, dq, 'Create I/O SQ 1 again')
        ctl.auto_head = False
        cids = [ctl.submit(1, sqe(IO_READ, nsid=1, prp1=buf, cdw10=i)) for i in range(5)]
        first = []
        wait_until(lambda: first.extend(ctl.reap(1)) or first)
        e = ctl.admin(A_DEL_SQ, cdw10=1)
        st_check(e, OK, dq, 'Delete I/O SQ 1, its CQ full and never released: completes (after its wait for room)')
        R.check(len(first) == 1 and quiet_cq(ctl, 1), dq, 'what did not fit was dropped: nothing more on CQ 1', first)
        ctl.auto_head = True
        ctl.sqs.pop(1, None)
        ctl.ring_cq(1)
        R.check(quiet_cq(ctl, 1), dq, 'nothing is posted later either, once the host makes room')
        st_check(ctl.delete_cq(1), OK, NV('Admin commands', 'Delete I/O CQ'), 'Delete I/O CQ 1 once its SQ is gone')
        # AER limit
        aer = NV('Admin commands', 'Asynchronous Event Request')
        acids = [ctl.submit(0, sqe(A_AER)) for _ in range(5)]
        e = ctl.wait(0, acids[4])
        st_check(e, AER_LIMIT, aer, 'a 5th outstanding Asynchronous Event Request (at most 4)')
        R.check(quiet_cq(ctl, 0), aer, 'the 4 others stay outstanding (no completion)')
        e = ctl.admin(A_ABORT, cdw10=0 | (acids[0] << 16))
        R.check(e.st == OK and e.dw0 & 1 == 1 and quiet_cq(ctl, 0), ab, 'Abort of an outstanding AER (admin queue): DW0 bit 0 = 1, the AER stays', e)
    finally:
        ctl.auto_head = True
        teardown(c, g)
        env.stop(p)


# ######################################################################
# nvme.md § NVM commands: Data pointer (PRPs)
# ######################################################################
def xfer(ctl, g, sqid, opc, slba, data_or_len, pages, offset=0, list_off=0, nsid=1, lba=512, cdw12=0, prp2_override=None):
    """Write data (bytes) or read n bytes (int) through the pages given; returns (cqe, data read)."""
    n = len(data_or_len) if isinstance(data_or_len, (bytes, bytearray)) else data_or_len
    if isinstance(data_or_len, (bytes, bytearray)):
        scatter(g, pages, offset, data_or_len)
    prp1, prp2 = build_prp(g, pages, offset, n, list_off=list_off)
    if prp2_override is not None:
        prp2 = prp2_override
    e = ctl.rw(sqid, opc, slba, n // lba, prp1, prp2, nsid=nsid, cdw12=cdw12)
    return e, (gather(g, pages, offset, n) if opc == IO_READ else None)


def t_prp(env):
    R.sec('PRPs: every shape, every byte verified (nvme.md § NVM commands: Data pointer)')
    dp = NV('NVM commands', 'Data pointer (PRPs, 4 KiB pages)')
    p = env.start(['ns1=ram:16M', 'queues=2', 'entries=256'])
    c, g, ctl = bring_up(p.sock, mem=48 << 20, posted=True)     # doorbells posted (NO_REPLY), as QEMU sends them
    try:
        ctl.io_pair(1, 64)
        cases = [
            # (what, bytes, offset, list_off, scattered)
            ('512 B in one page, PRP1 page aligned', 512, 0, 0, False),
            ('512 B at PRP1 offset 0E00h, crossing into PRP2\'s page', 512, 0xe00, 0, True),
            ('4 KiB at PRP1 offset 4 (dword aligned): PRP2 holds the last 4 bytes\' page', 4096, 4, 0, True),
            ('8 KiB page aligned: PRP1 + PRP2 (two scattered pages)', 8192, 0, 0, True),
            ('12 KiB at offset 200h: PRP2 points at a list (4 pages)', 12288, 0x200, 0, True),
            ('64 KiB contiguous pages through a list', 65536, 0, 0, False),
            ('128 KiB scattered, list at offset F00h of its page: it crosses into a 2nd list page', 131072, 0, 0xf00, True),
            ('256 KiB scattered, list at offset FF8h: the first list page holds only the pointer to the next', 262144, 0, 0xff8, True),
            ('1 MiB (MDTS) scattered, offset 0', 1 << 20, 0, 0, True),
            ('1 MiB - 512 at offset 200h: 256 pages', (1 << 20) - 512, 0x200, 0, True),
            ('1 MiB at offset 4 (257 pages, the most one command names) with a list crossing pages', 1 << 20, 4, 0xfe0, True),
        ]
        slba = 0
        for i, (what, n, off, loff, scat) in enumerate(cases):
            npages = (off + n + PAGE - 1) // PAGE
            if scat:
                wp = scattered_pages(g, npages)
            else:
                base = g.alloc(npages)
                wp = [base + PAGE * k for k in range(npages)]
            data = rand_bytes(n - n % 512, 1000 + i)
            e, _ = xfer(ctl, g, 1, IO_WRITE, slba, data, wp, off, loff)
            rp = scattered_pages(g, npages) if scat else None
            if not scat:
                base = g.alloc(npages)
                rp = [base + PAGE * k for k in range(npages)]
            for pg in rp:
                g.write(pg, b'\xee' * PAGE)
            e2, back = xfer(ctl, g, 1, IO_READ, slba, len(data), rp, off, loff)
            ok = e is not None and e2 is not None and e.st == OK and e2.st == OK and back == data
            R.check(ok, dp, 'Write then Read: %s' % what, (e, e2, 'data %s' % ('equal' if back == data else 'DIFFERS')))
            if ok and off:
                R.check(g.read(rp[0], off) == b'\xee' * off, dp, '... the bytes before PRP1\'s offset untouched', g.read(rp[0], min(off, 8)).hex())
            end = (off + len(data)) % PAGE
            if ok and end:
                R.check(g.read(rp[npages - 1] + end, PAGE - end) == b'\xee' * (PAGE - end), dp, '... the bytes after the data untouched')
            slba += (n + 511) // 512
        # the data ends in PRP1's page: PRP2 ignored (garbage there)
        pg = g.alloc(1)
        data = rand_bytes(2048, 5)
        g.write(pg + 0x800, data)
        e = ctl.rw(1, IO_WRITE, 9000, 4, pg + 0x800, 0x123)
        st_check(e, OK, dp, 'data ending in PRP1\'s page: PRP2 (an unaligned garbage value) is ignored')
        g.write(pg, bytes(PAGE))
        e = ctl.rw(1, IO_READ, 9000, 4, pg + 0x800, 0xdead0007)
        R.check(e.st == OK and g.read(pg + 0x800, 2048) == data, dp, '... and reads back', e)
        # two pages: PRP2 is a page, not a list (a page of what would be list entries is data)
        pp = scattered_pages(g, 2)
        data = rand_bytes(8192, 6)
        e, _ = xfer(ctl, g, 1, IO_WRITE, 9100, data, pp)
        e2, back = xfer(ctl, g, 1, IO_READ, 9100, 8192, scattered_pages(g, 2))
        R.check(e.st == OK and e2.st == OK and back == data, dp, 'exactly two pages: PRP2 is the second data page', (e, e2))
        R.info('checked: %d PRP shapes (doorbells posted, as QEMU sends them)' % len(cases))
    finally:
        teardown(c, g)
        env.stop(p)


# ######################################################################
# nvme.md § NVM commands
# ######################################################################
def t_nvm(env):
    R.sec('NVM commands and their statuses (nvme.md § NVM commands)')
    nvm = NV('NVM commands')
    sts = NV('NVM commands', 'Statuses')
    p = env.start(['ns1=ram:16M', 'ns3=ram:1M', 'queues=2', 'entries=256'])
    c, g, ctl = bring_up(p.sock, mem=32 << 20)
    try:
        ctl.io_pair(1, 64)
        nsze = 32768
        b1, b2 = g.alloc(8), g.alloc(8)
        rd = lambda slba, nlb, nsid=1: (g.write(b2, b'\xee' * nlb * 512), ctl.rw(1, IO_READ, slba, nlb, *build_prp(g, [b2 + PAGE * k for k in range(8)], 0, nlb * 512), nsid=nsid),
                                        g.read(b2, nlb * 512))[1:]
        wr = lambda slba, data, nsid=1, cdw12=0: (g.write(b1, data), ctl.rw(1, IO_WRITE, slba, len(data) // 512,
                                                                            *build_prp(g, [b1 + PAGE * k for k in range(8)], 0, len(data)), nsid=nsid, cdw12=cdw12))[1]
        e, d = rd(100, 8)
        R.check(e.st == OK and d == bytes(4096), both(nvm, NV('Namespaces')), 'blocks never written read as zeroes', e)
        d1 = rand_bytes(4096, 11)
        st_check(wr(100, d1), OK, nvm, 'Write 8 blocks at LBA 100')
        e, d = rd(100, 8)
        R.check(e.st == OK and d == d1, nvm, 'Read returns them', e)
        d3 = rand_bytes(4096, 13)
        st_check(wr(100, d3, nsid=3), OK, nvm, 'Write the same LBAs on namespace 3')
        R.check(rd(100, 8)[1] == d1 and rd(100, 8, nsid=3)[1] == d3, nvm, 'the namespaces are separate stores')
        st_check(wr(200, d1, cdw12=1 << 30), OK, nvm, 'Write with FUA')
        st_check(wr(208, d1, cdw12=(1 << 31) | (0xf << 26) | (1 << 29)), OK, NV('NVM commands', 'Write: Other CDW12/13 bits are ignored'),
                 'Write with LR, PRINFO bits set (ignored)')
        e = ctl.rw(1, IO_READ, 100, 8, b2, b2 + PAGE, cdw12=(1 << 31) | (1 << 30) | (0xf << 26), cdw13=0xff)
        R.check(e.st == OK and g.read(b2, 4096) == d1, NV('NVM commands', 'Read: as Write'), 'Read with LR, FUA, PRINFO, DSM bits set', e)
        # a burst in one doorbell: RAM commands complete in the order they ran; held RAM writes' SQHD
        wq = g.alloc(16)
        cids = []
        t0 = ctl.sqs[1].tail
        for k in range(16):
            opc = IO_WRITE if k % 4 != 3 else IO_READ
            cids.append(ctl.submit(1, sqe(opc, nsid=1, prp1=wq + PAGE * k, cdw10=5000 + 8 * k, cdw12=7), ring=False))
        ctl.ring_sq(1)
        before = len(ctl.cqs[1].seen)
        res = ctl.wait_all(1, cids)
        order = [e.cid for e in ctl.cqs[1].seen[before:]]
        R.eq(order, cids, both(NV('Queues', 'every other command completes before the next starts'), NV('Interrupts', 'RAM writes\' entries: Entries stay in the order the commands ran')),
             '16 Writes and Reads in one doorbell complete in submission order')
        hd = [(e.sqhd - t0) % 64 for e in res]
        R.check(all(hd[k] >= k + 1 for k in range(16)) and hd == sorted(hd) and hd[-1] == 16, NV('Queues', 'SQHD (for held RAM writes\' entries, when they are written together)'),
                'their SQHDs: each past its own entry, never decreasing, the last 16', hd)
        # Flush
        fl = NV('NVM commands', 'Flush')
        st_check(ctl.cmd(1, sqe(IO_FLUSH, nsid=1)), OK, fl, 'Flush namespace 1')
        st_check(ctl.cmd(1, sqe(IO_FLUSH, nsid=0xffffffff)), OK, fl, 'Flush NSID FFFFFFFFh (every namespace)')
        for nsid in (0, 2, 4):
            st_check(ctl.cmd(1, sqe(IO_FLUSH, nsid=nsid)), INVALID_NS, sts, 'Flush NSID %d' % nsid, dnr=1)
        # Compare
        cmpr = NV('NVM commands', 'Compare')
        g.write(b1, d1)
        st_check(ctl.rw(1, IO_COMPARE, 100, 8, b1, b1 + PAGE), OK, cmpr, 'Compare of equal data')
        st_check(ctl.rw(1, IO_COMPARE, 100, 8, b1, b1 + PAGE, cdw12=1 << 30), OK, cmpr, 'Compare with FUA (ignored)')
        g.write(b1 + 4095, b'\x00' if d1[4095] else b'\x01')
        e = ctl.rw(1, IO_COMPARE, 100, 8, b1, b1 + PAGE)
        st_check(e, COMPARE_FAIL, cmpr, 'Compare with the last byte different')
        g.write(b1, d1)
        g.write(b1 + 2000, bytes([d1[2000] ^ 0x80]))
        st_check(ctl.rw(1, IO_COMPARE, 100, 8, b1, b1 + PAGE), COMPARE_FAIL, cmpr, 'Compare with a byte in the middle different')
        st_check(ctl.rw(1, IO_COMPARE, 100, 1, b1), OK, cmpr, 'Compare of the first block only (equal)')
        st_check(ctl.rw(1, IO_COMPARE, 300, 1, b1, nsid=1), COMPARE_FAIL, cmpr, 'Compare against unwritten (zero) blocks')
        # Write Zeroes
        wz = NV('NVM commands', 'Write Zeroes')
        big = rand_bytes(4096, 21)
        wr(1000, big)
        e = ctl.cmd(1, sqe(IO_WZ, nsid=1, cdw10=1002, cdw12=3))
        st_check(e, OK, wz, 'Write Zeroes of LBAs 1002-1005')
        e, d = rd(1000, 8)
        R.check(d == big[:1024] + bytes(2048) + big[3072:], wz, 'the range reads as zeroes afterwards, its neighbours intact')
        wr(1000, big)
        st_check(ctl.cmd(1, sqe(IO_WZ, nsid=1, cdw10=1000, cdw12=7 | (1 << 25) | (1 << 30))), OK, wz, 'Write Zeroes with DEAC and FUA')
        R.eq(rd(1000, 8)[1], bytes(4096), wz, 'zeroes')
        st_check(ctl.cmd(1, sqe(IO_WZ, nsid=3, cdw10=0, cdw12=2047)), OK, wz, 'Write Zeroes of all 2048 blocks of namespace 3 (beyond MDTS: no data pointer)')
        R.check(rd(100, 8, nsid=3)[1] == bytes(4096) and rd(100, 8)[1] == d1, wz, '... namespace 3 reads zeroes, namespace 1 intact')
        wr(nsze - 8, big)
        st_check(ctl.cmd(1, sqe(IO_WZ, nsid=1, cdw10=nsze - 1, cdw12=0)), OK, wz, 'Write Zeroes of the last block')
        R.eq(rd(nsze - 8, 8)[1], big[:3584] + bytes(512), wz, '... the last block zero, the ones before intact')
        # Dataset Management
        dsm = NV('NVM commands', 'Dataset Management')
        wr(2000, big)
        wr(2100, big)
        rng = g.alloc(2)
        rlist = struct.pack('<IIQ', 0, 2, 2001) + struct.pack('<IIQ', 0, 3, 2104)
        g.write(rng, rlist)
        st_check(ctl.cmd(1, sqe(IO_DSM, nsid=1, prp1=rng, cdw10=1, cdw11=0)), OK, dsm, 'DSM of 2 ranges without AD (IDR/IDW hints only)')
        R.check(rd(2000, 8)[1] == big and rd(2100, 8)[1] == big, dsm, 'without AD nothing happens')
        st_check(ctl.cmd(1, sqe(IO_DSM, nsid=1, prp1=rng, cdw10=1, cdw11=4 | 3)), OK, dsm, 'DSM of 2 ranges with AD (and IDR, IDW)')
        R.check(rd(2000, 8)[1] == big[:512] + bytes(1024) + big[1536:] and rd(2100, 8)[1] == big[:2048] + bytes(1536) + big[3584:], dsm,
                'with AD each range reads as zeroes, their neighbours intact')
        wr(2000, big)
        g.write(rng + 0xff0, struct.pack('<IIQ', 0, 8, 2000))
        g.write(rng + PAGE, struct.pack('<IIQ', 0, 1, 2100))
        st_check(ctl.cmd(1, sqe(IO_DSM, nsid=1, prp1=rng + 0xff0, prp2=rng + PAGE, cdw10=1, cdw11=4)), OK, dsm,
                 'DSM whose range list crosses a page (PRP1 + FF0h, PRP2)')
        R.check(rd(2000, 8)[1] == bytes(4096), dsm, '... both ranges deallocated')
        wr(2000, big)
        g.write(rng, struct.pack('<IIQ', 0, 4, 2000) + struct.pack('<IIQ', 0, 2, nsze - 1))
        e = ctl.cmd(1, sqe(IO_DSM, nsid=1, prp1=rng, cdw10=1, cdw11=4))
        st_check(e, LBA_RANGE, both(dsm, sts), 'DSM with AD whose 2nd range runs past the end', dnr=1)
        R.eq(rd(2000, 8)[1], big, dsm, 'every range is checked first: the valid 1st range was not deallocated')
        g.write(rng, struct.pack('<IIQ', 0, 1, nsze))
        st_check(ctl.cmd(1, sqe(IO_DSM, nsid=1, prp1=rng, cdw10=0, cdw11=4)), LBA_RANGE, sts, 'DSM with AD, a range starting at NSZE', dnr=1)
        e = ctl.cmd(1, sqe(IO_DSM, nsid=1, prp1=rng, cdw10=0, cdw11=2))
        st_check(e, OK, both(sts, dsm), 'DSM without AD (IDW only) naming a range at NSZE: no range is looked at, Success')
        g.write(rng, struct.pack('<IIQ', 0, 2, (1 << 64) - 1))
        st_check(ctl.cmd(1, sqe(IO_DSM, nsid=1, prp1=rng, cdw10=0, cdw11=4)), LBA_RANGE, sts, 'DSM range wrapping past 2^64', dnr=1)
        g.write(rng, struct.pack('<IIQ', 0, 0, 10))
        st_check(ctl.cmd(1, sqe(IO_DSM, nsid=1, prp1=rng, cdw10=0, cdw11=4)), OK, dsm, 'DSM range of 0 blocks (nothing to deallocate)')
        dl = g.alloc(2)
        g.write(dl, b''.join(struct.pack('<IIQ', 0, 1, 3000 + 2 * i) for i in range(256)))
        wr(3000, rand_bytes(4096, 3))
        st_check(ctl.cmd(1, sqe(IO_DSM, nsid=1, prp1=dl, cdw10=255, cdw11=4)), OK, dsm, 'DSM with 256 ranges (NR 255: 4 KiB of ranges)')
        d = rd(3000, 8)[1]
        R.check(all(d[512 * k:512 * k + 512] == bytes(512) for k in range(0, 8, 2)), dsm, '... the even blocks named are zero')
        # LBA Out of Range
        lor = NV('NVM commands', 'Statuses: LBA Out of Range')
        for what, opc, slba, nlb in (('Read of the last block + 1', IO_READ, nsze - 1, 2), ('Read at NSZE', IO_READ, nsze, 1),
                                     ('Write at NSZE', IO_WRITE, nsze, 1), ('Compare past the end', IO_COMPARE, nsze - 4, 8),
                                     ('Read wrapping past 2^64', IO_READ, (1 << 64) - 1, 2), ('Write Zeroes past the end', IO_WZ, nsze - 1, 2),
                                     ('Read at LBA 2^32 (CDW11)', IO_READ, 1 << 32, 1)):
            e = ctl.rw(1, opc, slba, nlb, b1, b1 + PAGE)
            st_check(e, LBA_RANGE, lor, what, dnr=1)
        st_check(ctl.rw(1, IO_READ, nsze - 1, 1, b1), OK, lor, 'Read of the last block (in range)')
        st_check(ctl.rw(1, IO_READ, 2047, 1, b1, nsid=3), OK, lor, 'namespace 3 (1 MiB): its last block')
        st_check(ctl.rw(1, IO_READ, 2048, 1, b1, nsid=3), LBA_RANGE, lor, 'namespace 3: block 2048', dnr=1)
        # Invalid Namespace
        for nsid in (0, 2, 4, 0xffffffff):
            for opc in (IO_READ, IO_WRITE):
                st_check(ctl.rw(1, opc, 0, 1, b1, nsid=nsid), INVALID_NS, sts, '%s NSID %#x' % ('Read' if opc == IO_READ else 'Write', nsid), dnr=1)
        st_check(ctl.cmd(1, sqe(IO_WZ, nsid=2, cdw10=0)), INVALID_NS, sts, 'Write Zeroes NSID 2 (inactive)', dnr=1)
        st_check(ctl.cmd(1, sqe(IO_DSM, nsid=0, prp1=rng, cdw11=4)), INVALID_NS, sts, 'DSM NSID 0', dnr=1)
        st_check(ctl.rw(1, IO_COMPARE, 0, 1, b1, nsid=4), INVALID_NS, sts, 'Compare NSID 4 (above NN)', dnr=1)
        # Invalid Opcode
        for opc in (0x03, 0x04, 0x06, 0x0c, 0x0d, 0x0e, 0x11, 0x15, 0x7f, 0x80, 0x81, 0xff):
            st_check(ctl.cmd(1, sqe(opc, nsid=1, prp1=b1)), INVALID_OPCODE, both(sts, NV('Not implemented')), 'I/O opcode %02xh' % opc, dnr=1)
        # Invalid Field: fused, SGL, > MDTS
        inv = NV('NVM commands', 'Statuses: Invalid Field')
        st_check(ctl.cmd(1, sqe(IO_COMPARE, nsid=1, prp1=b1, fuse=1)), INVALID_FIELD, both(inv, NV('Not implemented', 'fused operations')),
                 'Compare with FUSE 01b (first of Compare and Write)', dnr=1)
        st_check(ctl.cmd(1, sqe(IO_WRITE, nsid=1, prp1=b1, fuse=2)), INVALID_FIELD, inv, 'Write with FUSE 10b', dnr=1)
        st_check(ctl.cmd(1, sqe(IO_READ, nsid=1, prp1=b1, psdt=1)), INVALID_FIELD, inv, 'Read with PSDT 01b (SGL)', dnr=1)
        st_check(ctl.cmd(1, sqe(IO_READ, nsid=1, prp1=b1, psdt=2)), INVALID_FIELD, inv, 'Read with PSDT 10b', dnr=1)
        st_check(ctl.cmd(1, sqe(0x7f, nsid=1, prp1=b1, fuse=1)), INVALID_FIELD, inv, 'unknown opcode with FUSE set: Invalid Field first', dnr=1)
        st_check(ctl.rw(1, IO_READ, 0, 2049, b1, b1 + PAGE), INVALID_FIELD, inv, 'Read of 2049 blocks (1 MiB + 512 > MDTS)', dnr=1)
        st_check(ctl.rw(1, IO_WRITE, 0, 4096, b1, b1 + PAGE), INVALID_FIELD, inv, 'Write of 4096 blocks (2 MiB, in range)', dnr=1)
        st_check(ctl.rw(1, IO_COMPARE, 0, 4096, b1, b1 + PAGE), INVALID_FIELD, inv, 'Compare of 2 MiB', dnr=1)
        # PRP Offset Invalid
        po = NV('NVM commands', 'Statuses: PRP Offset Invalid')
        st_check(ctl.rw(1, IO_READ, 0, 1, b1 + 2), PRP_OFFSET, po, 'PRP1 not dword aligned (offset 2)')
        st_check(ctl.rw(1, IO_WRITE, 0, 1, b1 + 1), PRP_OFFSET, po, 'Write, PRP1 offset 1')
        st_check(ctl.rw(1, IO_READ, 0, 16, b1, b1 + PAGE + 8), PRP_OFFSET, po, '8 KiB, PRP2 (a page) offset 8')
        lst = g.alloc(1)
        g.write(lst, struct.pack('<QQ', b1 + PAGE, b1 + 2 * PAGE + 0x200))
        st_check(ctl.rw(1, IO_READ, 0, 24, b1, lst), PRP_OFFSET, po, '12 KiB, the 2nd list entry offset 200h')
        g.write(lst, struct.pack('<QQ', b1 + PAGE, b1 + 2 * PAGE))
        st_check(ctl.rw(1, IO_READ, 0, 24, b1, lst + 4), PRP_OFFSET, po, 'a list pointer (PRP2) not qword aligned')
        loop = g.alloc(1)
        g.write(loop + 0xff8, struct.pack('<Q', loop + 0xff8))
        st_check(ctl.rw(1, IO_READ, 0, 2048, b1, loop + 0xff8), PRP_OFFSET, po, 'a looping chain of list pages holding only a pointer')
        # Data Transfer Error
        dte = NV('NVM commands', 'Statuses: Data Transfer Error')
        out = g.iova + g.size + 16 * PAGE
        st_check(ctl.rw(1, IO_READ, 0, 1, out), DATA_XFER_ERR, dte, 'Read, PRP1 outside the mappings')
        st_check(ctl.rw(1, IO_WRITE, 0, 1, out), DATA_XFER_ERR, dte, 'Write, PRP1 outside the mappings')
        st_check(ctl.rw(1, IO_READ, 0, 16, b1, out), DATA_XFER_ERR, dte, 'PRP2 outside the mappings')
        st_check(ctl.rw(1, IO_READ, 0, 24, b1, out), DATA_XFER_ERR, dte, 'the PRP list outside the mappings')
        guard = g.alloc(1)
        g.write(guard, b'\x77' * PAGE)
        g.write(lst, struct.pack('<QQ', guard, out))
        st_check(ctl.rw(1, IO_READ, 100, 24, b1, lst), DATA_XFER_ERR, dte, 'a list entry outside the mappings')
        R.eq(g.read(guard, 16), b'\x77' * 16, NV('NVM commands', 'Data pointer: pinned with one call'),
             'nothing transferred: the good page named before the bad one is untouched')
        st_check(ctl.rw(1, IO_COMPARE, 0, 1, out), DATA_XFER_ERR, dte, 'Compare, data outside the mappings')
        st_check(ctl.cmd(1, sqe(IO_DSM, nsid=1, prp1=out, cdw11=4)), DATA_XFER_ERR, dte, 'DSM, ranges outside the mappings')
        # memory mapped without an fd, and read-only memory
        nofd = 0x80000000
        c.dma_map(nofd, 1 << 20)
        c.mem.append((nofd, bytearray(1 << 20)))
        st_check(ctl.rw(1, IO_WRITE, 0, 1, nofd), DATA_XFER_ERR, dte, 'Write from memory mapped without an fd')
        st_check(ctl.rw(1, IO_READ, 0, 1, nofd), DATA_XFER_ERR, dte, 'Read into memory mapped without an fd')
        ro = Guest(c, 1 << 20, iova=0x90000000, flags=DMA_R)
        ro.write(ro.iova, d1)
        st_check(ctl.rw(1, IO_WRITE, 400, 8, ro.iova, ro.iova + PAGE), OK, dte, 'Write from memory mapped read-only (the device only reads it)')
        R.eq(rd(400, 8)[1], d1, dte, '... its data written')
        st_check(ctl.rw(1, IO_READ, 400, 1, ro.iova), DATA_XFER_ERR, dte, 'Read into memory mapped read-only')
        st_check(ctl.rw(1, IO_COMPARE, 400, 8, ro.iova, ro.iova + PAGE), OK, cmpr, 'Compare from read-only memory')
        # the queue goes on after every error
        R.check(rd(100, 8)[1] == d1, sts, 'after all of them the queue still serves Reads')
        ro.close()
    finally:
        teardown(c, g)
        env.stop(p)


def t_lba4k(env):
    R.sec('4 KiB blocks (nvme.md § Instance options: lba; § Identify)')
    lb = NV('Instance options', 'lba')
    p = env.start(['ns1=ram:8M', 'lba=4096', 'queues=1'])
    c, g, ctl = bring_up(p.sock)
    try:
        e, d = ctl.identify(0, nsid=1)
        R.eq((struct.unpack_from('<Q', d, 0)[0], (struct.unpack_from('<I', d, 128)[0] >> 16) & 0xff), (2048, 12), both(lb, NV('Identify')),
             'NSZE 2048, LBADS 12')
        ctl.io_pair(1, 16)
        pages = scattered_pages(g, 256)
        data = rand_bytes(1 << 20, 44)
        e, _ = xfer(ctl, g, 1, IO_WRITE, 1792, data, pages, lba=4096)
        e2, back = xfer(ctl, g, 1, IO_READ, 1792, 1 << 20, scattered_pages(g, 256), lba=4096)
        R.check(e.st == OK and e2.st == OK and back == data, lb, 'Write and Read of 256 blocks (1 MiB) ending at the last block', (e, e2))
        pages = scattered_pages(g, 3)
        data = rand_bytes(8192, 45)
        e, _ = xfer(ctl, g, 1, IO_WRITE, 5, data, pages, offset=0x10, lba=4096)
        e2, back = xfer(ctl, g, 1, IO_READ, 5, 8192, scattered_pages(g, 3), offset=0x10, lba=4096)
        R.check(e.st == OK and e2.st == OK and back == data, lb, '2 blocks at PRP1 offset 10h (3 pages)', (e, e2))
        st_check(ctl.rw(1, IO_READ, 0, 257, g.alloc(1), g.alloc(1)), INVALID_FIELD, NV('NVM commands', 'Statuses: Invalid Field'), '257 blocks (> MDTS)', dnr=1)
        st_check(ctl.rw(1, IO_READ, 2048, 1, g.alloc(1)), LBA_RANGE, NV('NVM commands', 'Statuses'), 'block 2048', dnr=1)
        st_check(ctl.cmd(1, sqe(IO_WZ, nsid=1, cdw10=2047, cdw12=0)), OK, NV('NVM commands', 'Write Zeroes'), 'Write Zeroes of the last block')
    finally:
        teardown(c, g)
        env.stop(p)


# ######################################################################
# nvme.md § Interrupts
# ######################################################################
def count_irqs(ev, at_least):
    """Signals on ev: waits for at least `at_least`, then a round-trip-free quiet window."""
    n = ev.take(at_least) if at_least else 0
    return n + ev.take(0)


def t_intr(env):
    R.sec('Interrupts: MSI-X, coalescing, polled queues, INTx, MSI (nvme.md § Interrupts)')
    mx = NV('Interrupts', 'MSI-X')
    p = env.start(['ns1=ram:1M', 'queues=2'])
    c = new_session(p.sock)
    g = Guest(c, 8 << 20)
    ctl = Ctrl(c, g)
    evs = [Ev() for _ in range(3)]
    try:
        ctl.msix_on(evs)
        ctl.enable()
        for _ in range(5):
            ctl.getf(0x01)
        c.barrier()
        R.eq(count_irqs(evs[0], 5), 5, both(mx, NV('Interrupts', 'Bursts: a queue at depth 1 interrupts for every command')),
             'the admin CQ interrupts on vector 0, once per command at depth 1')
        R.eq((evs[1].take(0), evs[2].take(0)), (0, 0), mx, 'vectors 1 and 2 quiet')
        ctl.io_pair(1, 32, iv=1)
        ctl.create_cq(2, 32, iv=2)
        ctl.create_sq(2, 32, 2)
        evs[0].take(0)
        buf = g.alloc(1)
        for i in range(10):
            ctl.rw(1, IO_READ, i, 1, buf)
        R.eq(count_irqs(evs[1], 10), 10, mx, 'CQ 1 (IV 1): one interrupt per command at depth 1 (10)')
        for i in range(4):
            ctl.rw(2, IO_READ, i, 1, buf)
        R.eq(count_irqs(evs[2], 4), 4, mx, 'CQ 2 (IV 2) interrupts on vector 2 (4)')
        R.eq((evs[0].take(0), evs[1].take(0)), (0, 0), mx, '... the other vectors quiet')
        # a burst in one doorbell: fewer or as many interrupts as completions, never none
        cids = [ctl.submit(1, sqe(IO_READ, nsid=1, prp1=buf, cdw10=i), ring=False) for i in range(16)]
        ctl.ring_sq(1)
        ctl.wait_all(1, cids)
        n = count_irqs(evs[1], 1)
        R.check(1 <= n <= 16, NV('Interrupts', 'Bursts'), '16 commands in one doorbell: between 1 and 16 interrupts', n)
        # coalescing on vector 1: THR 3, TIME 0
        co = NV('Interrupts', 'Coalescing')
        st_check(ctl.setf(0x08, 3), OK, co, 'Set Interrupt Coalescing THR 3, TIME 0')
        e = ctl.getf(0x09, cdw11=1)
        R.check(e.st == OK and not (e.dw0 >> 16) & 1, co, 'vector 1 CD 0 (coalesced)', e)
        cids = [ctl.submit(1, sqe(IO_READ, nsid=1, prp1=buf, cdw10=i), ring=False) for i in range(8)]
        ctl.ring_sq(1)
        res = ctl.wait_all(1, cids)
        n = count_irqs(evs[1], 1)
        R.check(all(e and e.st == OK for e in res) and 1 <= n <= 2, co,
                '8 commands in one doorbell with THR 3 (4 completions), TIME 0 (out at the end): 1 or 2 interrupts', n)
        c.barrier()
        evs[0].take(0)
        for _ in range(4):
            ctl.getf(0x01)
        R.eq(count_irqs(evs[0], 4), 4, co, 'vector 0 (the admin CQ) is never coalesced: 4 admin commands, 4 interrupts')
        ctl.setf(0x09, 1 | (1 << 16))
        for i in range(5):
            ctl.rw(1, IO_READ, i, 1, buf)
        R.eq(count_irqs(evs[1], 5), 5, co, 'with CD 1 on vector 1: one interrupt per command at depth 1 again')
        ctl.setf(0x08, 0)
        # masking a vector in the MSI-X table
        ctl.w32(MSIX_TABLE + 16 + 12, 1)
        ctl.rw(1, IO_READ, 0, 1, buf)
        R.eq(evs[1].take(0), 0, mx, 'vector 1 masked in the table: no message')
        R.check(wait_until(lambda: ctl.r32(MSIX_PBA) & 2), mx, '... its PBA bit is set', hex(ctl.r32(MSIX_PBA)))
        ctl.w32(MSIX_TABLE + 16 + 12, 0)
        R.eq(evs[1].take(1), 1, mx, 'unmasking sends the pending message')
        # polled queue
        ctl.delete_sq(2)
        ctl.delete_cq(2)
        st_check(ctl.create_cq(2, 16, iv=2, ien=False), OK, NV('Interrupts', 'IEN = 0'), 'Create I/O CQ 2 with IEN 0')
        ctl.create_sq(2, 16, 2)
        c.barrier()
        for x in evs:
            x.take(0)
        for i in range(4):
            st_check(ctl.rw(2, IO_READ, i, 1, buf), OK, NV('Interrupts'), 'Read %d on the polled queue' % i) if i == 0 else ctl.rw(2, IO_READ, i, 1, buf)
        c.barrier()
        R.eq([e.take(0) for e in evs], [0, 0, 0], NV('Interrupts', 'Queues created with IEN = 0 never interrupt'), 'a polled queue never interrupts')
        # MSI-X enabled: INTMS is ignored
        ctl.w32(INTMS, 1)
        R.eq(ctl.r32(INTMS), 0, NV('Registers', 'INTMS: while MSI-X is enabled a write changes nothing'), 'under MSI-X, INTMS = 1 written: INTMS still reads 0')
        ctl.getf(0x01)
        R.eq(count_irqs(evs[0], 1), 1, NV('Registers', 'INTMS: Ignored while MSI-X is enabled'), 'INTMS bit 0 set under MSI-X: vector 0 still interrupts')
        ctl.w32(INTMC, 1)
        ctl.delete_sq(2)
        ctl.delete_cq(2)
        ctl.delete_sq(1)
        ctl.delete_cq(1)
        # MSI: one vector
        msi = NV('Interrupts', 'MSI (1 vector) and INTx')
        c.set_irqs(MSIX, DATA_NONE | ACTION_TRIGGER, 0, 0)
        ctl.msix_off()
        mcap = ctl.cap(0x05)
        c.wr(CONFIG, mcap + 2, 1, 2)
        mev = Ev()
        c.set_irqs(MSI, DATA_EVENTFD | ACTION_TRIGGER, 0, 1, fds=[mev.fd])
        ctl.getf(0x01)
        R.eq(count_irqs(mev, 1), 1, msi, 'MSI: the admin CQ\'s completion sends the one message')
        st_check(ctl.create_cq(1, 16, iv=1), INVALID_IV, msi, 'MSI: Create I/O CQ with IV 1', dnr=1)
        st_check(ctl.create_cq(1, 16, iv=0), OK, msi, 'MSI: Create I/O CQ with IV 0')
        ctl.create_sq(1, 16, 1)
        c.barrier()
        mev.take(0)
        ctl.rw(1, IO_READ, 0, 1, buf)
        R.eq(count_irqs(mev, 1), 1, msi, 'MSI: an I/O completion on IV 0 sends a message')
        ctl.w32(INTMS, 1)
        ctl.auto_head = False
        cid = ctl.submit(1, sqe(IO_READ, nsid=1, prp1=buf, cdw10=0))
        e = ctl.wait(1, cid)
        R.eq(mev.take(0), 0, NV('Interrupts', 'With MSI, INTMS bit 0 holds the message'), 'MSI with INTMS bit 0 set: no message')
        ctl.w32(INTMC, 1)
        R.eq(mev.take(1), 1, NV('Interrupts', 'With MSI, clearing it sends one if entries wait'), 'INTMC with an entry waiting: the held message is sent')
        ctl.ring_cq(1)
        ctl.auto_head = True
        ctl.w32(INTMS, 1)
        ctl.rw(1, IO_READ, 0, 1, buf)
        ctl.w32(INTMC, 1)
        R.eq(mev.take(0), 0, NV('Interrupts', 'With MSI, clearing it sends one if entries wait'), 'INTMC with no entry waiting (released): no message')
        mk = VU('Commands', 'SET_IRQS: a MASK or UNMASK of its MSI sets or clears the Mask Bits config space shows')
        c.set_irqs(MSI, DATA_NONE | ACTION_MASK, 0, 1)
        R.eq(c.rd(CONFIG, mcap + 0x10, 4) & 1, 1, mk, 'SET_IRQS MASK of MSI: Mask Bits bit 0 set (config space)')
        ctl.rw(1, IO_READ, 0, 1, buf)
        R.eq(mev.take(0), 0, both(mk, NV('PCI identity', 'MSI (per-vector masking)')), 'MSI masked: a completion sends no message')
        c.set_irqs(MSI, DATA_NONE | ACTION_UNMASK, 0, 1)
        R.eq(c.rd(CONFIG, mcap + 0x10, 4) & 1, 0, mk, 'SET_IRQS UNMASK: Mask Bits bit 0 clear')
        R.eq(mev.take(1), 1, NV('PCI identity', 'MSI (per-vector masking)'), 'unmasking sends the pending message')
        # INTx
        c.set_irqs(MSI, DATA_NONE | ACTION_TRIGGER, 0, 0)
        c.wr(CONFIG, mcap + 2, 0, 2)
        iev = Ev()
        c.set_irqs(INTX, DATA_EVENTFD | ACTION_TRIGGER, 0, 1, fds=[iev.fd])
        ix = NV('Interrupts', 'With INTx the line is a level')
        ctl.auto_head = False
        cid = ctl.submit(1, sqe(IO_READ, nsid=1, prp1=buf, cdw10=0))
        ctl.wait(1, cid)
        R.eq(iev.take(1), 1, ix, 'INTx: a completion asserts the line (the eventfd fires)')
        R.check(c.rd(CONFIG, 6, 2) & 8, ix, 'config STATUS.INTx (bit 3) set while the CQ holds an entry the host has not released', hex(c.rd(CONFIG, 6, 2)))
        ctl.ring_cq(1)
        R.check(wait_until(lambda: not c.rd(CONFIG, 6, 2) & 8), ix, 'releasing the entry (CQ head doorbell) lowers the line (STATUS bit 3 clear)')
        c.set_irqs(INTX, DATA_NONE | ACTION_UNMASK, 0, 1)
        R.eq(iev.take(0), 0, ix, 'unmasked with nothing pending: no signal')
        ctl.w32(INTMS, 1)
        cid = ctl.submit(1, sqe(IO_READ, nsid=1, prp1=buf, cdw10=0))
        ctl.wait(1, cid)
        R.eq(iev.take(0), 0, ix, 'INTMS bit 0 set: an entry waits, the line stays low')
        R.eq(c.rd(CONFIG, 6, 2) & 8, 0, ix, '... STATUS bit 3 clear')
        ctl.w32(INTMC, 1)
        R.eq(iev.take(1), 1, ix, 'INTMC: the line rises for the entry still waiting')
        ctl.ring_cq(1)
        ctl.auto_head = True
        wait_until(lambda: not c.rd(CONFIG, 6, 2) & 8)
        c.set_irqs(INTX, DATA_NONE | ACTION_UNMASK, 0, 1)
        st_check(ctl.create_cq(2, 16, iv=1), INVALID_IV, ix, 'INTx: Create I/O CQ with IV 1', dnr=1)
        st_check(ctl.create_cq(2, 16, iv=0, ien=False), OK, ix, 'INTx: Create I/O CQ 2 with IEN 0')
        ctl.create_sq(2, 16, 2)
        c.barrier()
        iev.take(0)
        ctl.auto_head = False
        cid = ctl.submit(2, sqe(IO_READ, nsid=1, prp1=buf, cdw10=0))
        ctl.wait(2, cid)
        R.check(iev.take(0) == 0 and not c.rd(CONFIG, 6, 2) & 8, NV('Interrupts', 'asserted while any CQ with interrupts enabled holds entries'),
                'INTx: an entry held on a CQ with IEN 0 does not assert the line')
        ctl.ring_cq(2)
        ctl.auto_head = True
        for x in (mev, iev):
            x.close()
    finally:
        ctl.auto_head = True
        for e in evs:
            e.close()
        teardown(c, g)
        env.stop(p)


# ######################################################################
# nvme.md § Asynchronous events
# ######################################################################
def t_aer(env):
    R.sec('Asynchronous events (nvme.md § Asynchronous events; § Doorbells)')
    ae = NV('Asynchronous events')
    p = env.start(['ns1=ram:1M', 'queues=2'])
    c, g, ctl = bring_up(p.sock)
    try:
        def aer():
            return ctl.submit(0, sqe(A_AER))

        def got(cid):
            return ctl.wait(0, cid)

        a = aer()
        R.check(quiet_cq(ctl, 0), ae, 'an Asynchronous Event Request is held until an event')
        for _ in range(3):
            ctl.getf(0x01)
        head = ctl.sqs[0].tail
        ctl.ring(2 * 5, 1)
        e = got(a)
        R.check(e and e.st == OK and e.dw0 == 0x010000, both(ae, NV('Doorbells')),
                'a doorbell of a queue that does not exist: type 0, info 00h, log page 01h (DW0 010000h)', e)
        R.eq(e.sqhd if e else None, head, NV('Queues', 'SQHD: for an Asynchronous Event Request, when its event is delivered'),
             'the AER\'s SQHD is the admin SQ head when the event came (3 commands after it)')
        a = aer()
        ctl.ring(1, 40)                        # admin CQ head 40 of 32 entries
        R.check(quiet_cq(ctl, 0), ae, 'a second error event waits while the first is not acknowledged (log 01h unread)')
        ctl.get_log(0x01, 64, rae=1)
        R.check(quiet_cq(ctl, 0), ae, 'reading log 01h with RAE 1 does not acknowledge')
        ctl.get_log(0x01, 64, rae=0)
        e = got(a)
        R.check(e and e.st == OK and e.dw0 == 0x010100, ae, 'after log 01h is read with RAE 0: the waiting event, info 01h (value at or above the size)', e)
        st_check(ctl.getf(0x01), OK, NV('Doorbells', 'change nothing'), 'the admin queue still works after its doorbell got an invalid value')
        ctl.get_log(0x01, 64)
        a = aer()
        ctl.ring(2 * 4 + 1, 0)
        e = got(a)
        R.check(e and e.dw0 == 0x010000, ae, 'a CQ head doorbell of a queue that does not exist: info 00h', e)
        ctl.get_log(0x01, 64)
        # events wait while no request is outstanding
        ctl.ring(2 * 3, 0)
        c.barrier()
        a = aer()
        e = got(a)
        R.check(e and e.dw0 == 0x010000, ae, 'an event with no request outstanding waits; the next request completes with it', e)
        # the SQ tail at or above the size
        ctl.get_log(0x01, 64)
        ctl.io_pair(1, 8)
        a = aer()
        ctl.ring(2, 8)
        e = got(a)
        R.check(e and e.dw0 == 0x010100, NV('Doorbells'), 'I/O SQ tail doorbell 8 of 8 entries: type 0 info 01h', e)
        buf = g.alloc(1)
        R.check(quiet_cq(ctl, 1), NV('Doorbells', 'change nothing'), 'nothing fetched for the invalid tail')
        st_check(ctl.rw(1, IO_READ, 0, 1, buf), OK, NV('Doorbells', 'change nothing'), 'the queue goes on from its old tail')
        ctl.get_log(0x01, 64)
        # SMART: temperature
        sm = NV('Asynchronous events', '1 (SMART) 01h')
        a = aer()
        st_check(ctl.setf(0x04, 300), OK, sm, 'over threshold 300 K (below 313) with 0Bh bit 1 clear')
        R.check(quiet_cq(ctl, 0), sm, 'no SMART event without 0Bh bit 1')
        e, d = ctl.get_log(0x02, 512, rae=1)
        R.eq(d[0] & 2, 2, NV('Log pages', '02h: critical warning bit 1'), 'SMART critical warning bit 1 (temperature above the over threshold)')
        ctl.setf(0x04, 343)
        e, d = ctl.get_log(0x02, 512)
        R.eq(d[0] & 2, 0, NV('Log pages', '02h'), 'bit 1 clear again at 343 K')
        ctl.setf(0x0b, 2)
        ctl.setf(0x04, 320 | (1 << 20))
        e = got(a)
        R.check(e and e.dw0 == 0x020101, sm, 'under threshold 320 K with 0Bh bit 1: type 1, info 01h, log page 02h (DW0 020101h)', e)
        a = aer()
        ctl.ring(2 * 6, 0)
        e = got(a)
        R.check(e and e.dw0 == 0x010000, ae, 'an error event is reported while the SMART one is unacknowledged (types apart)', e)
        a = aer()
        ctl.setf(0x04, 0 | (1 << 20))
        ctl.setf(0x04, 310)
        R.check(quiet_cq(ctl, 0), ae, 'a 2nd SMART event waits while log 02h is unread')
        ctl.get_log(0x02, 512, rae=0)
        e = got(a)
        R.check(e and e.dw0 == 0x020101, ae, 'reading log 02h with RAE 0 lets it through', e)
        ctl.get_log(0x02, 512)
        ctl.get_log(0x01, 64)
        ctl.setf(0x04, 343)
        ctl.setf(0x04, 0 | (1 << 20))
        ctl.setf(0x0b, 0)
        cw = NV('Log pages', '02h: critical warning (bit 1: the composite temperature is at or above the over threshold, or at or below the under threshold)')
        for what, cdw11, want in (('over threshold 314', 314, 0), ('over threshold 313 (= the temperature)', 313, 2),
                                  ('under threshold 312', 312 | (1 << 20), 0), ('under threshold 313 (= the temperature)', 313 | (1 << 20), 2)):
            ctl.setf(0x04, cdw11)
            R.eq(smart(ctl)['raw'][0] & 2, want, cw, 'SMART critical warning bit 1 with the %s' % what)
            ctl.setf(0x04, 343)
            ctl.setf(0x04, 0 | (1 << 20))
        ctl.get_log(0x02, 512)
        # a disable discards outstanding requests; a doorbell while not ready reports nothing
        a = aer()
        ctl.disable()
        ctl.ring(2 * 5, 1)
        ctl.enable()
        R.check(quiet_cq(ctl, 0), NV('Registers', 'CC.EN 1 -> 0: outstanding Asynchronous Event Requests are discarded'),
                'after a disable and enable, the discarded request completes nothing')
        a = aer()
        R.check(quiet_cq(ctl, 0), NV('Doorbells', 'If the controller is ready'), 'a bad doorbell written while disabled reported no event')
        ctl.ring(2 * 5, 1)
        e = got(a)
        R.check(e and e.dw0 == 0x010000, ae, 'events work after the re-enable', e)
    finally:
        teardown(c, g)
        env.stop(p)


# ######################################################################
# nvme.md § Doorbells: mmap, auto, message
# ######################################################################
def fd_target(fd):
    try:
        return os.readlink('/proc/self/fd/%d' % fd)
    except OSError:
        return ''


def io_burst(ctl, g, sqid, n, depth, seed, slba0=0):
    """n Writes then n Reads of 4 KiB at queue depth `depth`, every byte verified."""
    datas = [rand_bytes(4096, seed + i) for i in range(n)]
    wpages = [g.alloc(1) for _ in range(n)]
    for pg, d in zip(wpages, datas):
        g.write(pg, d)
    rpages = [g.alloc(1) for _ in range(n)]
    bad = []
    for opc, pages in ((IO_WRITE, wpages), (IO_READ, rpages)):
        i = 0
        while i < n:
            cids = []
            for k in range(i, min(n, i + depth)):
                cids.append(ctl.submit(sqid, sqe(opc, nsid=1, prp1=pages[k], cdw10=slba0 + 8 * k, cdw12=7), ring=False))
            ctl.ring_sq(sqid)
            for cid in cids:
                e = ctl.wait(sqid, cid)
                if e is None or e.st != OK:
                    bad.append(e)
            i += depth
    ok = not bad and all(g.read(rpages[k], 4096) == datas[k] for k in range(n))
    return ok, bad[:3]


def t_doorbells(env):
    R.sec('Doorbells: the mapped page (auto without capabilities, mmap), messages (nvme.md § Doorbells)')
    dmm = NV('Doorbells', 'mmap')
    auto = NV('Doorbells', 'auto')
    gri = VU('Commands', 'GET_REGION_INFO')
    p = env.start(['ns1=ram:4M', 'queues=2'])
    c = session(p.sock, nocaps=True, minor=1)
    g, ctl, page = None, None, None
    try:
        ri = c.region_info(BAR0, argsz=32)
        R.check(ri['flags'] & RI_MMAP and not ri['flags'] & RI_CAPS and not ri['fds'] and ri['argsz'] > 32, gri,
                'a client without capabilities (auto -> mmap), argsz 32: MMAP set, no CAPS, no fd, argsz = the size needed',
                (hex(ri['flags']), ri['argsz'], len(ri['fds'])))
        for fd in ri['fds']:
            os.close(fd)
        ri = c.region_info(BAR0, argsz=256)
        R.eq(ri['flags'] & 0xf, RI_READ | RI_WRITE | RI_MMAP | RI_CAPS, both(dmm, auto), 'BAR0 flags READ, WRITE, MMAP, CAPS')
        areas = ri['caps'][0].get('areas') if ri['caps'] else None
        R.eq(([cp['id'] for cp in ri['caps']], areas), ([1], [(0x1000, 0x1000)]), dmm, 'one sparse mmap capability, one area {0x1000, 0x1000}')
        R.eq(len(ri['fds']), 1, dmm, 'one fd')
        if len(ri['fds']) != 1 or not areas:
            return
        fd = ri['fds'][0]
        R.check('memfd:' in fd_target(fd), dmm, 'the fd is a memfd', fd_target(fd))
        R.eq(ri['offset'], 0, dmm, 'region offset 0 (so the memfd\'s offset 0x1000 is the page)')
        page = mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0x1000)
        os.close(fd)
        g = Guest(c, 16 << 20)
        ctl = Ctrl(c, g, dbpage=page)
        ctl.msix_on()
        R.check(ctl.enable(), dmm, 'enable (nothing rung yet)')
        e, d = ctl.identify(1)
        R.check(e and e.st == OK and d[24:45] == b'umdev NVMe controller', dmm, 'an admin command rung only in the mapped page completes', e)
        R.check(ctl.io_pair(1, 32), dmm, 'I/O queue pair 1 created through the page')
        ok, bad = io_burst(ctl, g, 1, 40, 8, 500)
        R.check(ok, dmm, '40 Writes and 40 Reads at depth 8, rung in the page, every byte verified', bad)
        e, _ = ctl.identify(1)
        st_check(e, OK, dmm, 'an admin command while an I/O queue exists (seen by the I/O worker\'s look or the admin worker\'s)')
        # message doorbells are honoured too
        buf = g.alloc(1)
        cid = ctl.submit(1, sqe(IO_READ, nsid=1, prp1=buf, cdw10=0), ring=False)
        ctl.ring(2, ctl.sqs[1].tail, via='msg')
        e = ctl.wait(1, cid)
        st_check(e, OK, NV('Doorbells', 'Doorbell messages that arrive anyway ... are honoured'), 'an SQ tail written as a message in mmap mode')
        ctl.dbv[2] = ctl.sqs[1].tail
        # CQ room through the page
        ctl.create_cq(2, 2, iv=2)
        ctl.create_sq(2, 8, 2)
        ctl.auto_head = False
        cids = [ctl.submit(2, sqe(IO_READ, nsid=1, prp1=buf, cdw10=i), ring=False) for i in range(3)]
        ctl.ring_sq(2)
        got = []
        for _ in range(3):
            n = len(got)
            wait_until(lambda: got.extend(ctl.reap(2)) or len(got) > n)
            ctl.ring_cq(2)
        ctl.auto_head = True
        R.eq([(e.cid, e.st) for e in got], [(cid, OK) for cid in cids], dmm,
             'a 2-entry CQ: each head written in the page is seen when the worker needs room (3 completions)')
        # an invalid SQ tail in the page: not fetched up to, reported once (01h)
        a = ctl.submit(0, sqe(A_AER))
        ctl.dbv[2] = 40
        e = ctl.wait(0, a)
        R.check(e and e.dw0 == 0x010100, NV('Doorbells', 'an SQ tail at or above the queue\'s size is not fetched up to and reports 01h once per value'),
                'SQ 1 tail 40 (of 32) in the page: event type 0, info 01h', e)
        ctl.get_log(0x01, 64)
        a = ctl.submit(0, sqe(A_AER))
        R.check(quiet_cq(ctl, 0) and quiet_cq(ctl, 1), NV('Doorbells', 'once per value'), 'the same value stays: no second event, nothing fetched')
        cid = ctl.submit(1, sqe(IO_READ, nsid=1, prp1=buf, cdw10=0))
        st_check(ctl.wait(1, cid), OK, NV('Doorbells'), 'a valid tail again: the queue goes on from where it was')
        ctl.dbv[3] = 99
        R.check(quiet_cq(ctl, 0), NV('Doorbells', 'a CQ head at or above it frees no entry ... and reports nothing'), 'CQ 1 head 99 in the page: no event')
        ctl.dbv[3] = ctl.cqs[1].head
        cid = ctl.submit(1, sqe(IO_READ, nsid=1, prp1=buf, cdw10=0))
        st_check(ctl.wait(1, cid), OK, NV('Doorbells'), 'the queue works after the bad head was replaced')
        # a value written for a queue that does not exist is not used
        ctl.delete_sq(2)
        ctl.delete_cq(2)
        ctl.dbv[4] = 5
        ctl.create_cq(2, 16, iv=2)
        sqb = g.alloc(1)
        for k in range(16):
            g.write(sqb + 64 * k, sqe(IO_READ, cid=0x4000 + k, nsid=1, prp1=buf))
        st_check(ctl.create_sq(2, 16, 2, iova=sqb), OK, dmm, 'Create I/O SQ 2 while its tail in the page reads 5 (16 valid entries in its ring)')
        R.check(quiet_cq(ctl, 2), NV('Doorbells', 'a value written to the mapped page for a queue that does not exist is not used'),
                'nothing fetched up to the stale 5')
        ctl.dbv[4] = 1
        e = ctl.wait(2, 0x4000)
        R.check(e and e.st == OK and e.sqhd == 1 and quiet_cq(ctl, 2), NV('Doorbells', 'a queue created there starts from 0'),
                'tail 1: exactly entry 0 fetched (SQHD 1)', e)
        ctl.sqs[2].tail = 1
        ctl.ring(2 * 9, 3, via='page')
        R.check(quiet_cq(ctl, 0) and (0, a) not in ctl.done, NV('Doorbells', 'Values the controller reads from memory instead ... are checked where they are used'),
                'a value in the page for a queue that does not exist reports no event')
        ctl.get_log(0x01, 64)
        # shadow doorbells with the mapped page (Linux behind a capability-less VMM uses both)
        shm = NV('Doorbells', 'Shadow doorbells (with mmap)')
        for k in range(3):
            ctl.rw(1, IO_READ, k, 1, buf)
        shp, evp = g.alloc(1), g.alloc(1)
        g.write(shp, b'\xff' * PAGE)
        st_check(ctl.admin(A_DBBC, prp1=shp, prp2=evp), OK, shm, 'Doorbell Buffer Config in mmap mode')
        R.eq((g.u32(shp + 8), g.u32(shp + 12)), (ctl.sqs[1].tail, ctl.cqs[1].head), NV('Doorbells', 'Shadow doorbells: the values its workers go by: ... the mapped page\'s'),
             'the shadow page holds SQ 1\'s tail and CQ 1\'s head taken from the mapped page')
        ctl.shadow = (shp, evp, g)
        ok, bad = io_burst(ctl, g, 1, 30, 4, 700)
        R.check(ok, shm, '30 Writes and Reads at depth 4 through the shadow page, rung in the mapped page as the event index asks', bad)
        ok = True
        for k in range(20):
            e = ctl.rw(1, IO_READ, k, 1, buf, )
            ok = ok and e is not None and e.st == OK
        R.check(ok, shm, '20 commands at depth 1 the same way (no completion lost)')
        ctl.shadow = None
        ctl.disable()
    finally:
        ctl = None
        teardown(c, g)
        if page is not None:
            teardown(page)
        st = env.stop(p)
    R.eq(st and (st.get('doorbells'), st.get('doorbells_now')), ('auto', 'mmap'), NV('Statistics'), 'exit statistics: doorbells auto, doorbells_now mmap')
    # doorbells=message with a client that sends no capabilities
    p = env.start(['ns1=ram:1M', 'doorbells=message'])
    c = session(p.sock, nocaps=True)
    try:
        ri = c.region_info(BAR0, argsz=256)
        R.eq((ri['flags'] & RI_MMAP, len(ri['fds'])), (0, 0), NV('Doorbells', 'With doorbells=message, a client that sends no capabilities'),
             'doorbells=message, client without capabilities: no mappable page')
        for fd in ri['fds']:
            os.close(fd)
        g = Guest(c, 4 << 20)
        ctl = Ctrl(c, g)
        ctl.enable()
        st_check(ctl.identify(1)[0], OK, NV('Doorbells', 'message'), '... its doorbell messages work')
        R.check(wait_until(lambda: 'doorbells=message does not offer' in env.log(p)), NV('Doorbells', 'is warned about in the log'),
                'the log warns "doorbells=message does not offer"', env.log(p)[-300:])
    finally:
        teardown(c, g)
        env.stop(p)
    # doorbells=mmap with a client that sends capabilities; and with max_msg_fds 0
    p = env.start(['ns1=ram:1M', 'doorbells=mmap'])
    c = new_session(p.sock)
    try:
        ri = c.region_info(BAR0, argsz=256)
        R.check(ri['flags'] & RI_MMAP and len(ri['fds']) == 1, NV('Doorbells', 'a polling client that sends capabilities finds no page (use doorbells=mmap)'),
                'doorbells=mmap, client with capabilities: the page is offered', (hex(ri['flags']), len(ri['fds'])))
        page = map_doorbells(ri) if ri['fds'] else None
        for fd in ri['fds']:
            os.close(fd)
        g = Guest(c, 4 << 20)
        ctl = Ctrl(c, g, dbpage=page)
        ctl.enable()
        st_check(ctl.identify(1)[0], OK, NV('Doorbells', 'mmap'), '... and works')
        ctl = None
        if page:
            page.close()
    finally:
        teardown(c, g)
    c = new_session(p.sock, caps={'max_msg_fds': 0})
    try:
        ri = c.region_info(BAR0, argsz=256)
        R.check(not ri['flags'] & (RI_MMAP | RI_CAPS) and not ri['fds'], gri,
                'doorbells=mmap, a client that negotiated max_msg_fds 0: nothing mappable offered (no MMAP, no CAPS)', hex(ri['flags']))
        g = Guest(c, 4 << 20)
        ctl = Ctrl(c, g)
        ctl.enable()
        st_check(ctl.identify(1)[0], OK, NV('Doorbells', 'Doorbell messages that arrive anyway ... are honoured'), '... its doorbell messages are served')
    finally:
        teardown(c, g)
        env.stop(p)
    p = env.start(['ns1=ram:1M'])
    try:
        for raw, want, what in ((b'{}\0', True, 'JSON without a capabilities key'), (b'{"capabilities":{}}\0', False, 'an empty capabilities object')):
            c = vu._served(p.sock, lambda c: c.version(raw=raw))
            ri = c.region_info(BAR0, argsz=256)
            for fd in ri['fds']:
                os.close(fd)
            R.eq(bool(ri['flags'] & RI_MMAP), want, auto, 'auto, VERSION with %s: the page %s' % (what, 'offered (mmap)' if want else 'not offered (message)'))
            c.close()
    finally:
        env.stop(p)
    r, out = env.refused(['ns1=ram:1M', 'doorbells=mmap', 'poll_us=100'])
    R.check(r, NV('Instance options', 'poll_us: Refused with doorbells=mmap'), 'poll_us with doorbells=mmap is refused', out)


# ######################################################################
# nvme.md § Doorbells: Shadow doorbells
# ######################################################################
def t_shadow(env):
    R.sec('Shadow doorbells and event indices (nvme.md § Doorbells: Shadow doorbells; § Admin commands: Doorbell Buffer Config)')
    sh = NV('Doorbells', 'Shadow doorbells')
    dbbc = NV('Admin commands', 'Doorbell Buffer Config')
    p = env.start(['ns1=ram:4M', 'queues=3', 'poll_us=0'])
    c, g, ctl = bring_up(p.sock)
    sg = Guest(c, 1 << 20, iova=0x70000000)
    ctl.setf(0x07, 2 | (2 << 16))
    try:
        shp, evp = sg.alloc(1), sg.alloc(1)
        st_check(ctl.admin(A_DBBC, prp1=shp, prp2=shp), INVALID_FIELD, dbbc, 'the same page twice', dnr=1)
        st_check(ctl.admin(A_DBBC, prp1=shp + 8, prp2=evp), INVALID_FIELD, dbbc, 'PRP1 not page aligned', dnr=1)
        st_check(ctl.admin(A_DBBC, prp1=shp, prp2=evp + 0x800), INVALID_FIELD, dbbc, 'PRP2 not page aligned', dnr=1)
        st_check(ctl.admin(A_DBBC, prp1=0x7fff0000, prp2=evp), DATA_XFER_ERR, dbbc, 'the shadow page outside the mappings')
        st_check(ctl.admin(A_DBBC, prp1=shp, prp2=0x7fff0000), DATA_XFER_ERR, dbbc, 'the event index page outside the mappings')
        c.dma_map(0x60000000, 1 << 16)
        st_check(ctl.admin(A_DBBC, prp1=0x60000000, prp2=evp), DATA_XFER_ERR, dbbc, 'the shadow page in memory mapped without an fd')
        # I/O first, then DBBC: the command writes the current tails and heads
        ctl.io_pair(1, 16)
        buf = g.alloc(1)
        for i in range(3):
            ctl.rw(1, IO_READ, i, 1, buf)
        sg.write(shp, b'\xde\xad\xbe\xef' * 1024)
        sg.write(evp, b'\xde\xad\xbe\xef' * 1024)
        st_check(ctl.admin(A_DBBC, prp1=shp, prp2=evp), OK, dbbc, 'Doorbell Buffer Config')
        ctl.shadow = (shp, evp, sg)
        R.eq((sg.u32(shp + 8), sg.u32(shp + 12)), (3, 3), sh, 'the command wrote SQ 1\'s tail and CQ 1\'s head (3, 3) into the shadow page')
        R.eq((sg.u32(evp + 8), sg.u32(evp + 12)), (3, 0xffffffff), sh, 'event indices: SQ 1\'s = its tail, CQ 1\'s = FFFFFFFFh')
        R.eq((sg.u32(shp + 16), sg.u32(shp + 20)), (0, 0), sh, 'a queue that does not exist: its shadow entries 0 (its "current" tail and head)')
        ok, bad = io_burst(ctl, g, 1, 60, 4, 900)
        R.check(ok, sh, '60 Writes and 60 Reads at depth 4 through the shadow tail (MMIO only when the event index asks), every byte verified', bad)
        R.check(wait_until(lambda: sg.u32(evp + 8) == ctl.sqs[1].tail), sh, 'an idle worker (poll_us=0) sets its SQ event index to the entry it fetches next',
                (sg.u32(evp + 8), ctl.sqs[1].tail))
        for i in range(30):
            st = ctl.rw(1, IO_READ, i, 1, buf)
            if st is None or st.st != OK:
                break
        R.check(st and st.st == OK, sh, '30 commands at depth 1, each rung as the event index asks (no completion lost)', st)
        # a worker waiting for CQ room sets the CQ's event index to the head it read
        ctl.create_cq(2, 4, iv=2)
        ctl.create_sq(2, 16, 2)
        R.eq((sg.u32(shp + 16), sg.u32(shp + 20)), (0, 0), sh, 'Create I/O SQ/CQ 2 while it is on: its shadow entries 0')
        ctl.auto_head = False
        cids = [ctl.submit(2, sqe(IO_READ, nsid=1, prp1=buf, cdw10=i), ring=False) for i in range(8)]
        ctl.ring_sq(2)
        got = []
        wait_until(lambda: got.extend(ctl.reap(2)) or len(got) >= 3)
        R.check(wait_until(lambda: sg.u32(evp + 20) == 0), sh, 'the worker waiting for CQ room set CQ 2\'s event index to the head it read (0)',
                hex(sg.u32(evp + 20)))
        while len(got) < 8:
            ctl.ring_cq(2)
            n = len(got)
            if not wait_until(lambda: got.extend(ctl.reap(2)) or len(got) > n):
                break
        ctl.ring_cq(2)
        ctl.auto_head = True
        R.eq([(e.cid, e.st) for e in got], [(cid, OK) for cid in cids], sh, 'CQ heads written in the shadow page (and rung as the index asks) free the room: 8 completions')
        # an SQ tail at or above the size in the shadow page: 01h once
        a = ctl.submit(0, sqe(A_AER))
        sg.w32(shp + 16, 40)
        ctl.ring(4, ctl.sqs[2].tail)
        e = ctl.wait(0, a)
        R.check(e and e.dw0 == 0x010100, NV('Doorbells', 'Values the controller reads from memory instead (the mapped page, or shadow doorbells)'),
                'shadow SQ 2 tail 40 (of 16), then a wake-up ring: event type 0 info 01h', e)
        sg.w32(shp + 16, ctl.sqs[2].tail)
        ctl.get_log(0x01, 64)
        st_check(ctl.rw(2, IO_READ, 0, 1, buf), OK, sh, 'SQ 2 goes on once its shadow tail is valid')
        # bus mastering off: the shadow tail is not read, no event index written
        bmr = NV('PCI identity', 'Bus mastering: Doorbell Buffer Config\'s pages are guest memory too')
        evbefore = sg.u32(evp + 8)
        ctl.bus_master(False)
        cid = ctl.submit(1, sqe(IO_READ, nsid=1, prp1=buf, cdw10=0), ring=False)
        sg.w32(shp + 8, ctl.sqs[1].tail)
        ctl.ring(2, ctl.sqs[1].tail)
        R.check(quiet_cq(ctl, 1) and sg.u32(evp + 8) == evbefore, bmr, 'with bus mastering off a shadow-rung command waits; the event index is not written')
        ctl.bus_master(True)
        e = ctl.wait(1, cid)
        st_check(e, OK, bmr, 'bus mastering on: the workers look at the shadow tail again and the command completes')
        # with INTx, after each completion the CQ's event index is the last entry posted
        ctl.msix_off()
        ctl.create_cq(3, 8, iv=0)
        ctl.create_sq(3, 8, 3)
        ixs = []
        for i in range(3):
            st_check(ctl.rw(3, IO_READ, i, 1, buf), OK, sh, '(INTx) Read %d on queue 3' % i) if i == 0 else ctl.rw(3, IO_READ, i, 1, buf)
            ixs.append(sg.u32(evp + 28))
        R.eq(ixs, [0, 1, 2], NV('Doorbells', 'Shadow doorbells: with INTx, after each completion the CQ\'s event index is the last entry posted'),
             'INTx: CQ 3\'s event index after each completion')
        ctl.msix_on()
        # a second DBBC replaces the pages
        shp2, evp2 = sg.alloc(1), sg.alloc(1)
        st_check(ctl.admin(A_DBBC, prp1=shp2, prp2=evp2), OK, dbbc, 'a second Doorbell Buffer Config (new pages)')
        R.eq((sg.u32(shp2 + 8), sg.u32(shp2 + 12), sg.u32(shp2 + 16)), (ctl.sqs[1].tail, ctl.cqs[1].head, ctl.sqs[2].tail), sh,
             'the new shadow page holds the current tails and heads')
        ctl.shadow = (shp2, evp2, sg)
        sg.w32(shp + 8, 0)                    # the old page is no longer read
        ok, bad = io_burst(ctl, g, 1, 10, 3, 1300)
        R.check(ok, sh, 'I/O through the new pages', bad)
        # a DMA_UNMAP of the shadow page's mapping turns it off; its last values become the registers'
        sg.unmap()
        ctl.shadow = None
        ok, bad = io_burst(ctl, g, 1, 10, 3, 1400)
        R.check(ok, sh + ' (DMA_UNMAP)', 'after a DMA_UNMAP of the shadow pages, I/O rung by MMIO from the last shadow values', bad)
        ok, bad = io_burst(ctl, g, 2, 4, 2, 1500)
        R.check(ok, sh + ' (DMA_UNMAP)', '... on queue 2 too', bad)
        # a disable turns it off
        sg.map()
        shp3, evp3 = sg.alloc(1), sg.alloc(1)
        st_check(ctl.admin(A_DBBC, prp1=shp3, prp2=evp3), OK, dbbc, 'Doorbell Buffer Config again')
        ctl.disable()
        ctl.enable()
        ctl.io_pair(1, 16)
        sg.w32(shp3 + 8, 7)
        ok, bad = io_burst(ctl, g, 1, 10, 3, 1600)
        R.check(ok, sh + ' (A disable ... turns it off)', 'after a disable: I/O by MMIO doorbells alone, the old shadow page ignored', bad)
    finally:
        teardown(c, g, sg)
        st = env.stop(p)
    R.eq(st and (st.get('shadow_doorbell_configs'), st.get('shadow_doorbells')), (3, False), NV('Statistics'),
         'exit statistics: shadow_doorbell_configs 3 (the successful ones), shadow_doorbells false')


# ######################################################################
# nvme.md § Registers: disable, DEVICE_RESET, disconnect; SMART's counters
# ######################################################################
def smart(ctl):
    e, d = ctl.get_log(0x02, 512)
    q = lambda o: int.from_bytes(d[o:o + 16], 'little')
    return dict(dur=q(32), duw=q(48), hrc=q(64), hwc=q(80), busy=q(96), cycles=q(112), hours=q(128), unsafe=q(144), media=q(160),
                errs=q(176), raw=d)


def error_entry(ctl):
    """The newest Error Information log entry, spelled out: what an unexpected one was."""
    e, d = ctl.get_log(0x01, 64)
    count, sqid, cid, sf, pel, lba, nsid = struct.unpack_from('<QHHHHQI', d, 0)
    return 'count %d, SQ %d, cid %#x, status %#x, parameter %#x, LBA %d, NSID %#x' % (
        count, sqid, cid, sf >> 1, pel, lba, nsid)


def in_flight(ctl, g, sqid, n, pages_each, opc=IO_WRITE, nsze=None):
    """Submit n transfers of pages_each pages each, all through one buffer (one doorbell);
    returns their cids."""
    base = g.alloc(pages_each)
    pages = [base + PAGE * k for k in range(pages_each)]
    prp1, prp2 = build_prp(g, pages, 0, pages_each * PAGE)
    blocks = pages_each * 8
    cids = []
    for i in range(n):
        slba = (i * blocks) % (nsze - blocks) if nsze else i * blocks
        cids.append(ctl.submit(sqid, sqe(opc, nsid=1, prp1=prp1, prp2=prp2, cdw10=slba, cdw12=blocks - 1), ring=False))
    ctl.ring_sq(sqid)
    return cids


def posted_cids(g, cq, cids):
    """The cids of cids found posted (phase 1) in a CQ's memory (first pass of a fresh CQ)."""
    found = set()
    for k in range(cq.size):
        dw3 = g.u32(cq.iova + 16 * k + 12)
        if (dw3 >> 16) & 1:
            found.add(dw3 & 0xffff)
    return found & set(cids)


def t_reset(env):
    R.sec('Disable, DEVICE_RESET and disconnect with I/O in flight (nvme.md § Registers; § Log pages: SMART)')
    dis = NV('Registers', 'CC.EN 1 -> 0 (disable) and DEVICE_RESET and a client disconnect')
    p = env.start(['ns1=ram:64M', 'queues=2'])
    c, g, ctl = bring_up(p.sock, mem=48 << 20)
    try:
        ctl.io_pair(1, 64)
        data = rand_bytes(8192, 31)
        pages = scattered_pages(g, 2)
        st_check(xfer(ctl, g, 1, IO_WRITE, 130000, data, pages)[0], OK, dis, '(setup) Write LBA 130000')
        ctl.admin(0x7e)                        # an error for the log
        s0 = smart(ctl)
        R.eq((s0['cycles'], s0['unsafe']), (1, 0), NV('Log pages', '02h'), 'SMART: power cycles 1, unsafe shutdowns 0')
        R.eq((s0['busy'], s0['media']), (0, 0), NV('Log pages', '02h: the rest 0'), 'controller busy time, media errors 0')
        R.eq((s0['dur'], s0['duw'], s0['hrc'], s0['hwc']), (0, 1, 0, 1), NV('Log pages', '02h: data units (thousands of 512 bytes, rounded up)'),
             'after one 8 KiB Write: data units read 0, written 1; host reads 0, writes 1')
        R.check(s0['raw'][6:32] == bytes(26) and s0['raw'][192:] == bytes(320), NV('Log pages', '02h: the rest 0'), 'the reserved and unused fields 0')
        du = NV('Log pages', '02h: data units read/written (thousands of 512 bytes, rounded up)')
        big = g.alloc(123)
        e1 = ctl.rw(1, IO_WRITE, 100000, 984, *build_prp(g, [big + PAGE * k for k in range(123)], 0, 984 * 512))
        R.eq((e1.st, smart(ctl)['duw']), (OK, 1), du, 'after 1000 blocks written: data units written 1')
        ctl.rw(1, IO_WRITE, 101000, 1, big)
        R.eq(smart(ctl)['duw'], 2, du, 'after 1001 blocks: 2')
        ctl.rw(1, IO_READ, 100000, 984, *build_prp(g, [big + PAGE * k for k in range(123)], 0, 984 * 512))
        R.eq(smart(ctl)['dur'], 1, du, 'after 984 blocks read: data units read 1')
        # disable with 62 x 1 MiB writes in flight
        ctl.create_cq(2, 64, iv=2)
        ctl.create_sq(2, 64, 2)
        cids = in_flight(ctl, g, 2, 62, 256, nsze=(64 << 20) // 512)
        wait_until(lambda: ctl.peek(2) is not None)          # the first done: the others are under way
        ctl.w32(CC, ctl.r32(CC) & ~1)
        R.check(wait_until(lambda: ctl.r32(CSTS) & 1 == 0), dis, 'disable with 62 x 1 MiB Writes in flight: RDY clears')
        cq = ctl.cqs[2]
        snap = g.read(cq.iova, 64 * 16)
        snap0 = g.read(ctl.cqs[0].iova, 32 * 16)
        c.barrier()
        time.sleep(QUIET)
        R.check(g.read(cq.iova, 64 * 16) == snap and g.read(ctl.cqs[0].iova, 32 * 16) == snap0, dis, 'nothing is posted after it (both CQs unchanged)')
        R.info('%d of the 62 had completed before the disable' % len(posted_cids(g, cq, cids)))
        R.eq(ctl.r32(CSTS) & 0xf, 0, dis, 'CSTS.RDY, CFS, SHST clear')
        ctl.enable()
        st_check(ctl.create_sq(1, 16, 1), CQ_INVALID, dis, 'after a disable every queue is deleted: Create I/O SQ on the old CQ 1')
        st_check(ctl.delete_sq(1), INVALID_QID, dis, 'Delete I/O SQ 1 (gone)', dnr=1)
        ctl.io_pair(1, 64)
        e, back = xfer(ctl, g, 1, IO_READ, 130000, 8192, scattered_pages(g, 2))
        R.check(e.st == OK and back == data, dis, 'namespace data stays across a disable', e)
        s1 = smart(ctl)
        R.eq(s1['unsafe'], 1, NV('Registers', 'A disable without a shutdown notification counts as an unsafe shutdown'), 'SMART unsafe shutdowns 1')
        R.eq(s1['errs'], s0['errs'] + 2, dis, 'the error log stays (SMART error entries: the earlier ones + the 2 refusals since)')
        e, el = ctl.get_log(0x01, 192)
        R.eq(struct.unpack_from('<Q', el, 128)[0], s0['errs'], dis, 'the entry logged before the disable is still there')
        s0['errs'] += 2
        R.eq(s1['cycles'], 1, NV('Log pages', '02h: power cycles 1'), 'power cycles still 1')
        # shutdown first, then disable: not unsafe
        ctl.w32(CC, ctl.r32(CC) | (1 << 14))
        wait_until(lambda: (ctl.r32(CSTS) >> 2) & 3 == 2)
        ctl.disable()
        ctl.enable()
        R.eq(smart(ctl)['unsafe'], 1, NV('Registers', 'CC.SHN'), 'a shutdown notification before the disable: unsafe shutdowns unchanged')
        # DEVICE_RESET returns every register to 0
        ctl.w32(INTMS, 1)
        ctl.io_pair(1, 64)
        cids = in_flight(ctl, g, 1, 62, 256, nsze=(64 << 20) // 512)
        c.reset()
        regs = (ctl.r32(CC), ctl.r32(CSTS), ctl.r32(AQA), ctl.r64(ASQ), ctl.r64(ACQ), ctl.r32(INTMS))
        R.eq(regs, (0, 0, 0, 0, 0, 0), NV('Registers', 'DEVICE_RESET ... return every register to its power-on value (0)'),
             'DEVICE_RESET with I/O in flight: CC, CSTS, AQA, ASQ, ACQ, INTMS all 0')
        cq = ctl.cqs[1]
        snap = g.read(cq.iova, 64 * 16)
        c.barrier()
        time.sleep(QUIET)
        R.check(g.read(cq.iova, 64 * 16) == snap, dis, 'nothing posted after the DEVICE_RESET')
        ctl.msix_on()
        ctl.enable()
        ctl.io_pair(1, 64)
        e, back = xfer(ctl, g, 1, IO_READ, 130000, 8192, scattered_pages(g, 2))
        R.check(e.st == OK and back == data, dis, 'namespace data stays across DEVICE_RESET', e)
        errs = smart(ctl)['errs']
        R.eq(errs, s0['errs'], dis, 'the error log stays across DEVICE_RESET')
        if errs != s0['errs']:
            R.note(dis, 'the newest error log entry: ' + error_entry(ctl))
        # disconnect with I/O in flight
        ctl.w32(INTMS, 1)
        cids = in_flight(ctl, g, 1, 62, 256, nsze=(64 << 20) // 512)
        c.close()
        teardown(g)
        c, g, ctl = None, None, None
        c = new_session(p.sock)
        cc = Ctrl(c, None)
        regs = (cc.r32(CC), cc.r32(CSTS), cc.r32(AQA), cc.r64(ASQ), cc.r64(ACQ), cc.r32(INTMS))
        R.eq(regs, (0, 0, 0, 0, 0, 0), NV('Registers', 'a disconnect also return[s] every register to its power-on value (0)'),
             'a new client after a disconnect with I/O in flight: every register 0')
        R.eq(c.rd(CONFIG, 4, 2) & 0x4, 0, VU('Departures from the specification', 'umdev resets the device'), 'config COMMAND bus master clear (device reset)')
        g = Guest(c, 16 << 20)
        ctl = Ctrl(c, g)
        ctl.msix_on()
        R.check(ctl.enable(), dis, 'the new client enables the controller')
        ctl.io_pair(1, 16)
        e, back = xfer(ctl, g, 1, IO_READ, 130000, 8192, scattered_pages(g, 2))
        R.check(e.st == OK and back == data, dis, 'namespace data stays across a disconnect', e)
        s2 = smart(ctl)
        R.eq((s2['errs'], s2['cycles']), (s0['errs'], 1), dis, 'error log entries and power cycles unchanged')
        R.check(s2['unsafe'] >= 2, NV('Registers', 'A disable without a shutdown notification counts as an unsafe shutdown'),
                'the reset and the disconnect (no shutdown notification) counted as unsafe shutdowns', s2['unsafe'])
        cids = in_flight(ctl, g, 1, 8, 256, nsze=(64 << 20) // 512)
        ctl.disable()
        try:
            g.unmap()
            R.check(True, both(dis, VU('Commands', 'DMA_UNMAP')), 'after a disable every pin is dropped: DMA_UNMAP of all guest memory (rings, data) succeeds')
        except VfioErr as ex:
            R.check(False, both(dis, VU('Commands', 'DMA_UNMAP')), 'after a disable every pin is dropped: DMA_UNMAP of all guest memory succeeds', vu.errname(ex.errno))
    finally:
        teardown(c, g)
        st = env.stop(p)
    R.check(st and st['io']['commands'] >= 3 and st['io']['writes'] >= 1, NV('Registers', 'the statistics stay'), 'the statistics stay across resets and clients',
            st and st['io'])


# ######################################################################
# nvme.md § NVM commands: Unmap; § Queues: rings; § PCI identity: Bus mastering; CSTS.CFS
# ######################################################################
def t_unmap(env):
    R.sec('DMA_UNMAP with I/O active, unmapped and truncated rings, bus mastering (nvme.md § NVM commands: Unmap; § Queues; § Bus mastering)')
    um = NV('NVM commands', 'Unmap')
    bm = NV('PCI identity', 'Bus mastering')
    cfs = NV('Registers', 'CSTS.CFS')
    p = env.start(['ns1=ram:16M', 'queues=3'])
    c = new_session(p.sock)
    g = Guest(c, 8 << 20)
    ctl = Ctrl(c, g)
    evs = [Ev() for _ in range(4)]
    try:
        ctl.msix_on(evs)
        ctl.enable()
        ctl.io_pair(1, 64)
        d = Guest(c, 8 << 20, iova=0x40000000)
        cids = in_flight(ctl, d, 1, 32, 32, opc=IO_READ)
        out = d.unmap()
        R.check(len(out) >= 24, both(um, VU('Commands', 'DMA_UNMAP')), 'DMA_UNMAP of memory 32 x 128 KiB Reads hold pins in: it completes')
        res = ctl.wait_all(1, cids)
        kinds = sorted(set(stname(e.st) if e else 'lost' for e in res))
        R.check(all(e is not None and e.st in (OK, DATA_XFER_ERR) for e in res), um,
                'every command completes: Success if it finished first, else Data Transfer Error (no completion lost)', kinds)
        R.info('after the unmap: %d Success, %d Data Transfer Error' % (sum(1 for e in res if e and e.st == OK), sum(1 for e in res if e and e.st == DATA_XFER_ERR)))
        st_check(ctl.rw(1, IO_READ, 0, 8, 0x40000000), DATA_XFER_ERR, um, 'a Read into the unmapped range')
        ok, bad = io_burst(ctl, g, 1, 4, 2, 2000)
        R.check(ok, um, 'the queue goes on', bad)
        d.close()
        # truncated by the client
        t = Guest(c, 1 << 20, iova=0x50000000)
        t.write(t.iova, b'x' * PAGE)
        os.ftruncate(t.fd, 0)
        st_check(ctl.rw(1, IO_WRITE, 0, 8, t.iova), DATA_XFER_ERR, NV('NVM commands', 'Statuses: Data Transfer Error (truncated by the client)'),
                 'a Write from memory the client truncated')
        st_check(ctl.rw(1, IO_READ, 0, 8, t.iova), DATA_XFER_ERR, NV('NVM commands', 'Statuses: Data Transfer Error'), 'a Read into it')
        t.unmap()
        t.close()
        # a ring unmapped and mapped again: the next use pins again
        rq = Guest(c, 1 << 20, iova=0x48000000)
        ctl.create_cq(2, 16, iv=2, g=rq)
        ctl.create_sq(2, 16, 2, g=rq)
        ok, bad = io_burst(ctl, g, 2, 3, 1, 2100)
        R.check(ok, NV('Queues', 'Rings'), 'I/O on a queue whose rings live in their own mapping', bad)
        rq.unmap()
        rq.map()
        ok, bad = io_burst(ctl, g, 2, 3, 1, 2200)
        R.check(ok, NV('Queues', 'Rings: A DMA unmap of ring memory lets go of those pins at once; the next use pins again'),
                'the rings unmapped and mapped again (same memfd, same IOVA): the queue goes on', bad)
        # the ring gone: fatal
        rq.unmap()
        buf = g.alloc(1)
        cid = ctl.submit(2, sqe(IO_READ, nsid=1, prp1=buf))
        R.check(wait_until(lambda: ctl.r32(CSTS) & 2), both(cfs, NV('Queues', 'if the memory is gone, the controller goes fatal')),
                'a doorbell for a queue whose ring was unmapped: CSTS.CFS set', hex(ctl.r32(CSTS)))
        acid = ctl.submit(0, sqe(A_GETF, cdw10=1))
        R.check(quiet_cq(ctl, 0), cfs, 'a fatal controller processes nothing (an admin command waits)')
        ctl.disable()
        R.eq(ctl.r32(CSTS) & 3, 0, cfs, 'a disable clears CFS')
        rq.close()
        ctl.enable()
        ctl.io_pair(1, 64)
        ok, bad = io_burst(ctl, g, 1, 4, 2, 2300)
        R.check(ok, cfs, 'enabled again, the controller serves I/O', bad)
        # an SQ ring that runs past the end of the mapping (its first page inside)
        ctl.create_cq(2, 256, iv=2)
        e = ctl.create_sq(2, 256, 2, iova=g.iova + g.size - PAGE)
        ctl.submit(2, sqe(IO_READ, nsid=1, prp1=buf))
        R.check(wait_until(lambda: ctl.r32(CSTS) & 2), cfs, 'an SQ of 256 entries (4 pages) whose last 3 pages are not mapped: first use sets CSTS.CFS',
                (e, hex(ctl.r32(CSTS))))
        ctl.disable()
        ctl.enable()
        ctl.io_pair(1, 64)
        # a ring in memory mapped without an fd
        c.dma_map(0x4e000000, 1 << 16)
        c.mem.append((0x4e000000, bytearray(1 << 16)))
        e = ctl.create_cq(2, 16, iv=2, iova=0x4e000000)
        ctl.create_sq(2, 16, 2)
        ctl.submit(2, sqe(IO_READ, nsid=1, prp1=buf))
        R.check(wait_until(lambda: ctl.r32(CSTS) & 2), both(cfs, NV('Queues', 'Rings are reached through the pinning engine')),
                'an I/O CQ in memory mapped without an fd: its first completion sets CSTS.CFS', (e, hex(ctl.r32(CSTS))))
        ctl.disable()
        ctl.enable()
        ctl.io_pair(1, 64)
        # a CQ ring whose memfd the client truncated
        tq = Guest(c, 1 << 20, iova=0x4c000000)
        ctl.create_cq(2, 16, iv=2, g=tq)
        ctl.create_sq(2, 16, 2)
        ok, bad = io_burst(ctl, g, 2, 2, 1, 2400)
        tq.mm.close()
        os.ftruncate(tq.fd, 0)
        ctl.cqs[2].g = g                       # (the driver can no longer look at it)
        ctl.submit(2, sqe(IO_READ, nsid=1, prp1=buf))
        R.check(ok and wait_until(lambda: ctl.r32(CSTS) & 2), both(cfs, NV('Registers', 'CSTS.CFS: or the client truncated it')),
                'a CQ ring the client truncated: the next completion sets CSTS.CFS', hex(ctl.r32(CSTS)))
        ctl.disable()
        tq.unmap()
        tq.close()
        ctl.enable()
        ctl.io_pair(1, 64)
        # bus mastering off
        for e in evs:
            e.take(0)
        ctl.bus_master(False)
        cid = ctl.submit(1, sqe(IO_READ, nsid=1, prp1=buf))
        acid = ctl.submit(0, sqe(A_GETF, cdw10=1))
        R.check(quiet_cq(ctl, 1) and quiet_cq(ctl, 0), bm, 'bus mastering off: the commands wait in their queues (no completion)')
        R.eq([e.take(0) for e in evs[:2]], [0, 0], bm, '... and no interrupt')
        ctl.bus_master(True)
        e1, e2 = ctl.wait(1, cid), ctl.wait(0, acid)
        R.check(e1 and e2 and e1.st == OK and e2.st == OK, bm, 'bus mastering on again: both commands complete', (e1, e2))
        R.eq([evs[0].take(1), evs[1].take(1)], [1, 1], bm, '... with their interrupts')
        # completion made while off: posted when on (a Flush needs no guest memory)
        ctl.bus_master(False)
        R.check(quiet_cq(ctl, 1), bm, '(nothing pending)')
        ctl.bus_master(True)
    finally:
        for e in evs:
            e.close()
        teardown(c, g)
        st = env.stop(p)


# ######################################################################
# nvme.md § Instance options, § Backing files, § Namespaces (file backings, identity)
# ######################################################################
F_OFD_GETLK = 36


def ofd_locked(path):
    fd = os.open(path, os.O_RDWR)
    try:
        import fcntl
        r = fcntl.fcntl(fd, F_OFD_GETLK, struct.pack('hhqqi4x', fcntl.F_WRLCK, 0, 0, 0, 0))
        return struct.unpack('hhqqi4x', r)[0] != fcntl.F_UNLCK
    finally:
        os.close(fd)


def t_files(env):
    R.sec('File namespaces, cache modes, locks, persistence, identity (nvme.md § Instance options; § Backing files; § Namespaces)')
    opt = NV('Instance options')
    bf = NV('Backing files')
    ident = NV('Namespaces', 'Identity')
    # the doc's own example
    R.eq(default_serial(['/var/lib/disk.img']), 'UMDEVF1B0AD6BDD64', ident, 'the doc\'s example serial from FNV-1a as described')
    ng = file_nguid('/var/lib/disk.img')
    R.eq(ng.hex(), '5a2cc902375241260d2ec90237534126', ident, 'the doc\'s example NGUID from FNV-1a as described')
    R.eq(uuid_from_nguid(ng).hex(), '5a2cc902375241268d2ec90237534126', ident, 'the doc\'s example UUID')
    d = env.h.path('img')
    os.makedirs(d, exist_ok=True)
    img1, img2 = os.path.join(d, 'disk1.img'), os.path.join(d, 'disk2.img')
    content = rand_bytes(4 << 20, 4242) + b'T' * 700
    with open(img1, 'wb') as f:
        f.write(content)
    with open(img2, 'wb') as f:
        f.truncate(1 << 20)
    link1 = os.path.join(d, 'link1')
    os.symlink('./disk1.img', link1)
    real1, real2 = os.path.realpath(img1), os.path.realpath(img2)
    p = env.start(['ns1=file:%s' % link1, 'ns2=file:%s' % img2, 'cache2=none', 'ns4=ram:1M'])
    c, g, ctl = bring_up(p.sock)
    try:
        e, idc = ctl.identify(1)
        serial = idc[4:24].decode().strip()
        R.eq(serial, default_serial([real1, real2]), ident, 'default serial: UMDEV + FNV-1a over each file\'s canonical path + 00h (the symlink resolved)')
        e, n1 = ctl.identify(0, nsid=1)
        e, n2 = ctl.identify(0, nsid=2)
        e, n4 = ctl.identify(0, nsid=4)
        R.eq(struct.unpack_from('<Q', n1, 0)[0], len(content) // 512, opt, 'file of 4 MiB + 700 bytes: NSZE rounded down to whole blocks (8193)')
        R.eq(n1[104:120], file_nguid(real1), ident, 'file namespace NGUID: FNV-1a over "file", 00h, 00h (no serial option), the canonical path')
        R.eq(n2[104:120], file_nguid(real2), ident, 'namespace 2\'s NGUID')
        R.eq(n4[104:120], ram_nguid(serial, 4), ident, 'RAM namespace 4\'s NGUID: seeded by the default serial in use and NSID 4')
        e, dd = ctl.identify(3, nsid=1)
        R.eq(dd[4:20] + dd[24:40], n1[104:120] + uuid_from_nguid(n1[104:120]), ident, 'CNS 03h: the NGUID and the UUID derived from it')
        R.eq(struct.unpack_from('<I', idc, 516)[0], 4, NV('Identify'), 'NN 4')
        R.check(ofd_locked(img1) and ofd_locked(img2), both(bf, NV('Backing files', 'A regular file is locked')), 'each file carries an OFD write lock while the device runs')
        ctl.io_pair(1, 32)
        e, back = xfer(ctl, g, 1, IO_READ, 0, 8192, scattered_pages(g, 2))
        R.check(e.st == OK and back == content[:8192], opt, 'a Read of namespace 1 returns the file\'s bytes (used in place)', e)
        e, back = xfer(ctl, g, 1, IO_READ, 8192, 512, [g.alloc(1)])
        R.check(e.st == OK and back == content[8192 * 512:8193 * 512], opt, 'the last whole block (8192) reads the file\'s bytes', e)
        st_check(ctl.rw(1, IO_READ, 8193, 1, g.alloc(1)), LBA_RANGE, opt, 'the partial tail block is not part of the namespace', dnr=1)
        w = rand_bytes(16384, 99)
        e, _ = xfer(ctl, g, 1, IO_WRITE, 16, w, scattered_pages(g, 4))
        st_check(e, OK, opt, 'Write 16 KiB to namespace 1 (writeback)')
        st_check(ctl.cmd(1, sqe(IO_FLUSH, nsid=1)), OK, NV('NVM commands', 'Flush'), 'Flush namespace 1')
        with open(img1, 'rb') as f:
            f.seek(16 * 512)
            R.eq(f.read(16384) == w, True, opt, 'the file holds the written bytes')
        w2 = rand_bytes(8192, 98)
        e, _ = xfer(ctl, g, 1, IO_WRITE, 64, w2, scattered_pages(g, 3), offset=0x100, cdw12=1 << 30)
        st_check(e, OK, opt, 'a FUA Write at a PRP1 offset (3 pages)')
        with open(img1, 'rb') as f:
            f.seek(64 * 512)
            R.eq(f.read(8192) == w2, True, opt, '... in the file')
        # O_DIRECT namespace: aligned and misaligned memory
        for what, off in (('page-aligned memory', 0), ('memory at offset 4 (misaligned for O_DIRECT: through the page cache)', 4),
                          ('memory at offset 200h', 0x200)):
            data = rand_bytes(12288, 7 + off)
            e, _ = xfer(ctl, g, 1, IO_WRITE, 8 + off, data, scattered_pages(g, 4), offset=off, nsid=2)
            e2, back = xfer(ctl, g, 1, IO_READ, 8 + off, 12288, scattered_pages(g, 4), offset=off, nsid=2)
            with open(img2, 'rb') as f:
                f.seek((8 + off) * 512)
                infile = f.read(12288)
            R.check(e.st == OK and e2.st == OK and back == data and infile == data, NV('Instance options', 'cacheN=none'),
                    'cache2=none: Write and Read of 12 KiB from %s; the file holds it' % what, (e, e2))
        data = rand_bytes(512, 8)
        e, _ = xfer(ctl, g, 1, IO_WRITE, 3, data, [g.alloc(1)], nsid=2)
        e2, back = xfer(ctl, g, 1, IO_READ, 3, 512, [g.alloc(1)], nsid=2)
        R.check(e.st == OK and e2.st == OK and back == data, NV('Instance options', 'cacheN=none: a transfer whose position, lengths ... are not aligned'),
                'cache2=none: a 512-byte transfer', (e, e2))
        # Write Zeroes and DSM on a file
        st_check(ctl.cmd(1, sqe(IO_WZ, nsid=1, cdw10=16, cdw12=15)), OK, NV('NVM commands', 'Write Zeroes'), 'Write Zeroes of 16 blocks of the file')
        with open(img1, 'rb') as f:
            f.seek(16 * 512)
            R.check(f.read(8192) == bytes(8192), NV('NVM commands', 'Write Zeroes'), 'the file reads zeroes there')
        R.eq(os.stat(img1).st_size, len(content), NV('NVM commands', 'Write Zeroes: a hole punched'), 'the file keeps its size')
        rng = g.alloc(1)
        g.write(rng, struct.pack('<IIQ', 0, 8, 64))
        st_check(ctl.cmd(1, sqe(IO_DSM, nsid=1, prp1=rng, cdw11=4)), OK, NV('NVM commands', 'Dataset Management'), 'DSM deallocate on the file')
        e, back = xfer(ctl, g, 1, IO_READ, 64, 4096, [g.alloc(1)])
        R.check(e.st == OK and back == bytes(4096), NV('NVM commands', 'Dataset Management'), 'the range reads zeroes', e)
        st_check(ctl.cmd(1, sqe(IO_WZ, nsid=2, cdw10=0, cdw12=7, cdw13=0)), OK, NV('NVM commands', 'Write Zeroes'), 'Write Zeroes on the O_DIRECT namespace')
        st_check(ctl.cmd(1, sqe(IO_FLUSH, nsid=0xffffffff)), OK, NV('NVM commands', 'Flush'), 'Flush of every namespace')
        ctl.setf(0x06, 0)
        e, _ = xfer(ctl, g, 1, IO_WRITE, 200, rand_bytes(4096, 1), [g.alloc(1)])
        st_check(e, OK, NV('Features', 'Volatile Write Cache: WCE 0'), 'a Write with WCE 0 (durable before it completes)')
        # another program's lock on one byte refuses a device
        img5 = os.path.join(d, 'disk5.img')
        with open(img5, 'wb') as f:
            f.truncate(1 << 20)
        import fcntl
        lfd = os.open(img5, os.O_RDWR)
        try:
            fcntl.fcntl(lfd, 37, struct.pack('hhqqi4x', fcntl.F_RDLCK, 0, 100, 1, 0))     # F_OFD_SETLK, a read lock on byte 100
            r, out = env.refused(['ns1=file:%s' % img5])
            R.check(r and 'in use' in out, bf, 'a file with another program\'s lock on one byte is refused ("in use")', out)
        finally:
            os.close(lfd)
        # a second device on the same file is refused
        r, out = env.refused(['ns1=file:%s' % img1])
        R.check(r and 'in use' in out, bf, 'a second server on the same file is refused ("in use")', out)
        ctl.disable()
    finally:
        teardown(c, g)
        st = env.stop(p)
    if st:
        ns = {n['nsid']: n for n in st['namespaces']}
        R.eq((ns[1]['backing'], ns[1]['cache'], ns[1]['held_by_backing']), ('file', 'writeback', 0), NV('Statistics'), 'stats: ns1 file, writeback, held_by_backing 0')
        R.eq((ns[2]['cache'], sorted((ns[2].get('direct_alignment') or {}).keys())), ('none', ['memory', 'offset']), NV('Statistics'),
             'stats: ns2 cache none, direct_alignment {memory, offset}')
        R.eq((ns[4]['backing'], ns[4]['cache'], ns[4]['path'], ns[4]['held_by_backing']), ('ram', None, None, None), NV('Statistics'), 'stats: ns4 ram, nulls')
        R.eq((ns[1]['bytes'], ns[1]['lba_size']), (8193 * 512, 512), NV('Statistics'), 'stats: ns1 bytes (whole blocks), lba_size')
        R.check(st['aio'] in ('io_uring', 'sync') and st['fixed_buffers'] == 'off' and st['workers_held_by_backing'] == 0, NV('Statistics'),
                'stats: aio io_uring (or sync where unavailable), fixed_buffers off (no --pin-mode kernel), workers_held_by_backing 0',
                (st['aio'], st['fixed_buffers'], st['workers_held_by_backing']))
        R.eq(st['serial'], default_serial([real1, real2]), NV('Statistics'), 'stats: serial, the default in use')
    R.check(not ofd_locked(img1), NV('Backing files', 'The lock and the claim are let go when the device stops'), 'the lock is gone once the server stopped')
    # persistence, and a device started next gets the file at once
    p = env.start(['ns1=file:%s' % img1, 'aio=sync', 'serial=HOST-A'])
    c, g, ctl = bring_up(p.sock)
    try:
        ctl.io_pair(1, 16)
        e, back = xfer(ctl, g, 1, IO_READ, 16, 16384, [g.alloc(1) for _ in range(4)])
        R.check(e.st == OK and back == bytes(8192) + w[8192:], NV('Backing files', 'A file namespace keeps its data across ... daemon restarts'),
                'after a restart (aio=sync): the data written before (and the zeroed range) are there', e)
        e, n1 = ctl.identify(0, nsid=1)
        R.eq(n1[104:120], file_nguid(real1, b'HOST-A'), ident, 'with serial=HOST-A the file\'s NGUID is seeded with it')
        ok, bad = io_burst(ctl, g, 1, 8, 4, 3000, slba0=1000)
        R.check(ok, NV('Instance options', 'aio=sync'), 'aio=sync: 8 Writes and Reads at depth 4 verified', bad)
    finally:
        teardown(c, g)
        st = env.stop(p)
    R.eq(st and st['aio'], 'sync', NV('Statistics'), 'stats: aio sync')
    # lba=4096 rounds down too
    img3 = os.path.join(d, 'disk3.img')
    with open(img3, 'wb') as f:
        f.truncate(3 * 4096 + 100)
    p = env.start(['ns1=file:%s' % img3, 'lba=4096', 'cache1=NONE'])
    c, g, ctl = bring_up(p.sock)
    try:
        e, n1 = ctl.identify(0, nsid=1)
        R.eq(struct.unpack_from('<Q', n1, 0)[0], 3, opt, 'lba=4096, a file of 3 x 4 KiB + 100: NSZE 3 (cache1=NONE accepted in upper case)')
    finally:
        teardown(c, g)
        env.stop(p)
    # pin modes; fixed buffers (--pin-mode kernel, O_DIRECT, io_uring)
    fb = NV('Instance options', 'fixed_buffers')
    img4 = os.path.join(d, 'disk4.img')
    with open(img4, 'wb') as f:
        f.truncate(8 << 20)
    for mode, opts in (('lock', ['ns1=ram:4M']), ('kernel', ['ns1=file:%s' % img4, 'cache1=none']),
                       ('kernel', ['ns1=file:%s' % img4, 'cache1=none', 'fixed_buffers=always']),
                       ('kernel', ['ns1=file:%s' % img4])):
        p = env.start(opts, extra=['--pin-mode', mode])
        c, g, ctl = bring_up(p.sock)
        try:
            ctl.io_pair(1, 16)
            ok, bad = io_burst(ctl, g, 1, 6, 3, 4000)
            R.check(ok, NV('Instance options', '--pin-mode'), '--pin-mode %s %s: Writes and Reads verified' % (mode, ' '.join(opts[1:])), bad)
            base = g.alloc(32)
            big = rand_bytes(131072, 5)
            e1, _ = xfer(ctl, g, 1, IO_WRITE, 2048, big, [base + PAGE * k for k in range(32)])
            e2, back = xfer(ctl, g, 1, IO_READ, 2048, 131072, scattered_pages(g, 32))
            R.check(e1.st == OK and e2.st == OK and back == big, NV('Instance options', '--pin-mode'), '... 128 KiB from one contiguous run, read back into 32 scattered pages', (e1, e2))
        finally:
            teardown(c, g)
            st = env.stop(p)
        if mode == 'kernel' and st:
            io = st['io']
            if 'fixed_buffers=always' in opts:
                R.eq((st['fixed_buffers'], io['fixed_transfers']), ('always', 13), fb,
                     'always: every O_DIRECT transfer over one pinned run went fixed (6 + 6 of 4 KiB, 1 of 128 KiB; not the 32 scattered pages)')
            elif 'cache1=none' in opts:
                R.eq((st['fixed_buffers'], io['fixed_transfers']), ('on', 1), fb,
                     'on (the default): only the 128 KiB transfer over one run went fixed (not 4 KiB ones, not 32 scattered pages)')
            else:
                R.eq((st['fixed_buffers'], io['fixed_transfers']), ('off', 0), both(fb, NV('Statistics', 'fixed_buffers is off where nothing can go fixed')),
                     'no cacheN=none namespace (the default "on" not given): fixed_buffers off, nothing fixed')
    for opts, extra, what in ((['ns1=file:%s' % img4, 'cache1=none', 'aio=sync', 'fixed_buffers=on'], ['--pin-mode', 'kernel'], 'with aio=sync'),
                              (['ns1=file:%s' % img4, 'fixed_buffers=on'], ['--pin-mode', 'kernel'], 'without a cacheN=none namespace'),
                              (['ns1=file:%s' % img4, 'cache1=none', 'fixed_buffers=always'], ['--pin-mode', 'lock'], 'without --pin-mode kernel')):
        r, out = env.refused(opts, extra)
        R.check(r, fb, 'fixed_buffers=%s given %s: refused' % (opts[-1].split('=')[1], what), out)
    # the options are checked at define exactly as at start
    r, out_run = env.refused(['ns1=ram:1M', 'cache1=none'])
    pdef = subprocess.run([env.h.bin, 'define', '-t', 'nvme', '-u', '5a1e4c36-0000-4000-8000-000000000001', '--opt', 'ns1=ram:1M', '--opt', 'cache1=none',
                           '--state-dir', env.h.path('defstate')], capture_output=True, text=True, timeout=vu.WAIT + 30)
    core = out_run.split('umdev: ', 1)[-1].split(' | ')[0].strip()
    R.check(r and pdef.returncode != 0 and core and core.split(': ', 1)[-1] in pdef.stderr + pdef.stdout, opt + ' (umdev define)',
            '`umdev define` refuses cache1=none on a RAM namespace with the message `run` gives', (core, (pdef.stderr + pdef.stdout).strip()[:200]))
    # RAM namespaces on each kind of page
    hp = NV('Instance options', 'ram_pages')
    free = 0
    try:
        with open('/proc/meminfo') as f:
            free = int(re.search(r'HugePages_Free:\s+(\d+)', f.read()).group(1))
    except (OSError, AttributeError):
        pass
    def ram_disk(pages, how):
        # 4 MiB in any pages: 1 MiB across the middle 2 MiB boundary, then zeroes by Write
        # Zeroes and by deallocation, which read back as zeroes with the rest intact
        p = env.start(['ns1=ram:4M', 'ram_pages=' + pages])
        c, g, ctl = bring_up(p.sock)
        try:
            e, n1 = ctl.identify(0, nsid=1)
            R.eq(struct.unpack_from('<Q', n1, 0)[0], 8192, hp, 'ram_pages=%s, ram:4M: 8192 blocks' % pages)
            ctl.io_pair(1, 16)
            big = rand_bytes(1 << 20, 61)
            e, _ = xfer(ctl, g, 1, IO_WRITE, 4096, big, scattered_pages(g, 256))
            e2, back = xfer(ctl, g, 1, IO_READ, 4096, 1 << 20, scattered_pages(g, 256))
            R.check(e.st == OK and e2.st == OK and back == big, hp, 'ram_pages=%s: 1 MiB Write and Read across the 2 MiB boundary' % pages, (e, e2))
            st_check(ctl.cmd(1, sqe(IO_WZ, nsid=1, cdw10=4100, cdw12=99)), OK, hp, 'ram_pages=%s: Write Zeroes (%s)' % (pages, how))
            rng = g.alloc(1)
            g.write(rng, struct.pack('<IIQ', 0, 100, 5000))
            st_check(ctl.cmd(1, sqe(IO_DSM, nsid=1, prp1=rng, cdw11=4)), OK, hp, 'ram_pages=%s: DSM deallocate (%s)' % (pages, how))
            e2, back = xfer(ctl, g, 1, IO_READ, 4096, 1 << 20, scattered_pages(g, 256))
            want = bytearray(big)
            want[4 * 512:104 * 512] = bytes(100 * 512)
            want[904 * 512:1004 * 512] = bytes(100 * 512)
            R.check(e2.st == OK and back == bytes(want), hp, 'ram_pages=%s: both ranges read as zeroes, the rest intact' % pages, e2)
        finally:
            teardown(c, g)
            env.stop(p)
    # the default, thp, and 4k take any host; upper case is accepted as for any choice
    ram_disk('thp', 'deallocated')
    ram_disk('4K', 'deallocated')
    if free >= 4:
        ram_disk('2M', 'zeroes in place')
        r, out = env.refused(['ns1=ram:1T', 'ram_pages=2m'])
        R.check(r and '524288' in out and str(free) in out, hp, 'a pool too small is refused with the pages needed (524288) and free (%d)' % free, out)
    else:
        R.note(hp, 'ram_pages=2m not exercised: the host\'s pool has %d free 2 MiB pages' % free)
    # ram_populate: by default the memory of a RAM namespace is taken with no client at all
    # (when the host can afford it); with off, only as written
    def taken_mib(p):
        kib = 0
        with open('/proc/%d/status' % p.pid) as f:
            for line in f:
                if line.startswith(('RssAnon:', 'RssShmem:')):
                    kib += int(line.split()[1])
        return kib >> 10
    hpop = NV('Instance options', 'ram_populate')
    # the pass, through a daemon's live statistics (taken_ahead) and its memory
    env.dstart(['ns1=ram:4M'])  # the daemon up, and settled
    before = taken_mib(env.daemon)
    uuid_on, _ = env.dstart(['ns1=ram:64M'])
    uuid_off, _ = env.dstart(['ns1=ram:64M', 'ram_populate=off'])
    ahead = lambda uuid: ((env.stats(uuid) or {}).get('namespaces') or [{}])[0].get('taken_ahead', 'absent')
    wait_until(lambda: not (isinstance(ahead(uuid_on), dict) and ahead(uuid_on).get('state') == 'taking'), timeout=max(vu.WAIT, 120))
    on = ahead(uuid_on)
    if isinstance(on, dict) and on.get('state') in ('unaffordable', 'stopped'):
        R.note(hpop, 'ram_populate not exercised: the pass ended %s here (the host\'s memory, or its kernel)' % on)
    else:
        R.check(on == {'bytes': 64 << 20, 'state': 'done'} and taken_mib(env.daemon) >= before + 64, hpop,
                'ram_populate=background (the default on thp): a 64 MiB RAM namespace taken with no client (taken_ahead done, the daemon\'s memory)',
                (on, taken_mib(env.daemon), before))
    R.check(ahead(uuid_off) is None, hpop, 'ram_populate=off: no pass (taken_ahead null)', ahead(uuid_off))
    r, out = env.refused(['ns1=file:%s' % img2, 'ram_populate=background'])
    R.check(r and 'ram_populate' in out, hpop, 'ram_populate=background without a thp or 4k RAM namespace: refused', out)
    r, out = env.refused(['ns1=ram:3M', 'ram_pages=2m'])
    R.check(r, hp, 'ram_pages=2m with a RAM namespace not a whole number of 2 MiB: refused', out)
    r, out = env.refused(['ns1=ram:1M', 'ram_pages=1g'])
    R.check(r and 'thp' in out and '4k' in out and '2m' in out, hp, 'ram_pages=1g refused, naming thp, 4k and 2m', out)
    # refusals
    small = os.path.join(d, 'small.img')
    with open(small, 'wb') as f:
        f.truncate(4095)
    for opts, what in ((['ns1=ram:1M', 'cache1=none'], 'cacheN for a RAM namespace'),
                       (['ns1=ram:1M', 'aio=sync'], 'aio without a file namespace'),
                       (['ns1=file:%s' % img2, 'ram_pages=2m'], 'ram_pages without a RAM namespace'),
                       (['ns1=ram:1M', 'fixed_buffers=on'], 'fixed_buffers=on without --pin-mode kernel'),
                       (['ns1=file:%s' % img2, 'cache1=none', 'fixed_buffers=always'], 'fixed_buffers=always without --pin-mode kernel'),
                       (['ns1=file:%s' % img1, 'ns2=file:%s' % link1], 'two namespaces on one file (by two paths)'),
                       (['ns1=file:%s' % small], 'a file under 4 KiB'),
                       (['ns1=file:disk.img'], 'a relative path'),
                       (['ns1=file:%s' % os.path.join(d, 'missing.img')], 'a missing file'),
                       (['ns1=ram:2K'], 'ram: under 4K'),
                       (['ns1=ram:2T'], 'ram: over 1T'),
                       (['ns1=ram:6K', 'lba=4096'], 'ram: not a whole number of 4 KiB blocks'),
                       (['ns1=ram:4100'], 'ram: not a whole number of 512-byte blocks'),
                       (['ns17=ram:1M'], 'ns17'),
                       (['ns1=ram:1M', 'ns1=ram:2M'], 'a key given twice'),
                       (['queues=0'], 'queues=0'), (['queues=65'], 'queues=65'),
                       (['entries=1'], 'entries=1'), (['entries=4097'], 'entries=4097'),
                       (['lba=1024'], 'lba=1024'), (['poll_us=10001'], 'poll_us=10001'),
                       (['max_held=0'], 'max_held=0'), (['max_held=65537'], 'max_held=65537'),
                       (['serial=has space'], 'a serial with a space'), (['serial=%s' % ('x' * 21)], 'a serial of 21 characters'),
                       (['doorbells=page'], 'doorbells=page'), (['bogus=1'], 'an unknown key')):
        r, out = env.refused(opts)
        R.check(r, opt, 'refused: %s' % what, out)
    for opts, what in ((['ns1=ram:4K'], 'ram:4K (the smallest)'), (['ns1=ram:1M', 'fixed_buffers=off'], 'fixed_buffers=off with anything'),
                       (['ns1=ram:1M', 'doorbells=MMAP', 'poll_us=0'.replace('poll_us=0', 'queues=64')], 'doorbells=MMAP (any case), queues=64'),
                       (['ns1=ram:1M', 'serial=%s' % ('x' * 20), 'max_held=65536', 'entries=4096', 'entries=2'.replace('entries=2', 'poll_us=10000')],
                        'serial of 20 characters, max_held=65536, entries=4096, poll_us=10000'),
                       (['ns16=ram:1M'], 'ns16 only (NN 16)')):
        r, out = env.refused(opts)
        R.check(not r and 'serving a nvme device' in out, opt, 'accepted: %s' % what, out)


# ######################################################################
# nvme.md § Statistics (a daemon instance: umdev stats)
# ######################################################################
def t_stats(env):
    R.sec('Statistics (nvme.md § Statistics; README.md § Serving devices to QEMU: umdev stats)')
    stt = NV('Statistics')
    uuid, sock = env.dstart(['ns1=ram:8M', 'queues=2', 'serial=STATS-1'])
    st = env.stats(uuid)
    R.check(st is not None, RM('Serving devices to QEMU', 'umdev stats'), 'umdev stats -u UUID gives the device\'s describe (key "device")')
    if st is None:
        return
    R.eq((st['state'], st['io_queues'], st['queues_live'], st['doorbells'], st['doorbells_now'], st['serial']),
         ('disabled', 2, 0, 'auto', None, 'STATS-1'), stt, 'before a client: disabled, io_queues 2, queues_live 0, doorbells auto, doorbells_now null')
    R.eq((st['aio'], st['fixed_buffers'], st['workers_held_by_backing']), (None, None, None), stt, 'no file namespace: aio, fixed_buffers, workers_held_by_backing null')
    ns = [dict(n) for n in st['namespaces']]
    ahead = ns[0].pop('taken_ahead', 'absent') if ns else 'absent'
    R.eq(ns, [{'nsid': 1, 'backing': 'ram', 'path': None, 'cache': None, 'direct_alignment': None, 'bytes': 8 << 20,
               'lba_size': 512, 'held_by_backing': None}], stt, 'namespaces: one RAM namespace')
    # the default thp disk's pass (ram_populate): bytes taken from the start, and where it is
    R.check(isinstance(ahead, dict) and set(ahead) == {'bytes', 'state'}
            and ahead['state'] in ('taking', 'done', 'unaffordable', 'stopped')
            and (ahead['state'] != 'done' or ahead['bytes'] == 8 << 20) and 0 <= ahead['bytes'] <= 8 << 20,
            stt, 'taken_ahead of a thp RAM namespace: {"bytes": N, "state": S}, all 8 MiB when done', ahead)
    lj = subprocess.run([env.h.bin, 'list', '--json', '--run-dir', env.h.path('run')], capture_output=True, text=True, timeout=vu.WAIT + 30)
    try:
        ent = [x for x in json.loads(lj.stdout) if x.get('uuid') == uuid]
    except ValueError:
        ent = []
    R.check(ent and ent[0].get('device', {}).get('serial') == 'STATS-1', both(stt, RM('Serving devices to QEMU', 'umdev list')),
            '`umdev list --json` shows the describe too', lj.stdout[:200])
    c, g, ctl = bring_up(sock)
    try:
        st = env.stats(uuid)
        R.eq((st['state'], st['queues_live'], st['doorbells_now']), ('ready', 1, 'message'), stt, 'enabled: ready, queues_live 1 (the admin SQ), doorbells_now message')
        ctl.io_pair(1, 32)
        ctl.io_pair(2, 32)
        R.eq(env.stats(uuid)['queues_live'], 3, stt, 'two I/O queue pairs: queues_live 3')
        a = g.alloc(16)
        pg = lambda k: a + PAGE * k
        d1 = rand_bytes(4096, 1)
        d2 = rand_bytes(8192, 2)
        R.check(xfer(ctl, g, 1, IO_WRITE, 0, d1, [pg(0)])[0].st == OK, stt, 'Write 1 page')
        R.check(xfer(ctl, g, 1, IO_WRITE, 8, d2, [pg(2), pg(5)])[0].st == OK, stt, 'Write 2 scattered pages')
        R.check(xfer(ctl, g, 2, IO_READ, 0, 16384, [pg(8), pg(9), pg(10), pg(11)])[0].st == OK, stt, 'Read 4 contiguous pages (a PRP list)')
        R.check(xfer(ctl, g, 2, IO_READ, 0, 20480, [pg(1), pg(5), pg(6), pg(7), pg(9)])[0].st == OK, stt, 'Read pages [1,5,6,7,9] (a list, 3 runs)')
        R.check(xfer(ctl, g, 1, IO_READ, 0, 512, [pg(12), pg(14)], offset=0xf00)[0].st == OK, stt, 'Read 512 B at offset F00h (2 pages, 2 runs)')
        s = smart(ctl)
        R.eq((s['hrc'], s['hwc'], s['dur'], s['duw']), (3, 2, 1, 1), NV('Log pages', '02h'),
             'SMART: host reads 3, writes 2; data units read 1 (73 of 512 B, rounded up), written 1')
        ctl.rw(1, IO_READ, 1 << 20, 1, pg(0))
        ctl.cmd(1, sqe(IO_FLUSH, nsid=1))
        g.write(pg(0), d1)
        ctl.rw(1, IO_COMPARE, 0, 8, pg(0))
        s2 = smart(ctl)
        R.eq(s2['hrc'], 4, NV('Log pages', '02h: host read/write commands'), 'a Compare that reached its data counts as a host read command (3 Reads and a Compare)')
        ctl.ring(2 * 7, 0)                     # a doorbell of no queue
        aer = ctl.submit(0, sqe(A_AER))
        ev = ctl.wait(0, aer)
        R.check(ev and ev.dw0 == 0x010000, NV('Asynchronous events'), '(an AER completed by an event)', ev)
        ctl.get_log(0x01, 64)
        c.barrier()
        st = env.stats(uuid)
        io = st['io']
        R.eq((io['commands'], io['reads'], io['writes'], io['errors']), (8, 3, 2, 1), stt,
             'io: commands 8 (5 transfers, a failed Read, a Flush, a Compare), reads 3, writes 2, errors 1')
        R.eq((io['bytes_read'], io['bytes_written']), (16384 + 20480 + 512, 4096 + 8192), stt, 'io: bytes_read, bytes_written')
        R.eq((io['pin_calls'], io['pages'], io['runs'], io['prp_list_pages']), (5, 14, 9, 2), stt,
             'io: pin_calls 5 (reads + writes), pages 14, runs 9, prp_list_pages 2')
        R.eq(io['pages_per_command'], {'1': 1, '2': 2, '3-4': 1, '5-8': 1}, stt, 'pages_per_command histogram')
        R.eq(io['runs_per_command'], {'1': 2, '2': 2, '3-4': 1}, stt, 'runs_per_command histogram')
        R.check(sum(io['pages_per_command'].values()) == io['pin_calls'] == sum(io['runs_per_command'].values()), stt, 'each histogram sums to pin_calls')
        R.check(abs(io['mean_pages_per_command'] - 14 / 5) < 0.01 and abs(io['mean_runs_per_command'] - 9 / 5) < 0.01, stt,
                'the means: pages / pin_calls, runs / pin_calls', (io['mean_pages_per_command'], io['mean_runs_per_command']))
        R.eq(st['admin_commands'], ctl.admins - 1, stt, 'admin_commands: every admin command completed (%d), not the AER completed by its event' % (ctl.admins - 1))
        R.eq(st['doorbell_messages'], ctl.msgs, stt, 'doorbell_messages: every doorbell write sent as a message (%d)' % ctl.msgs)
        R.eq((st['shadow_doorbells'], st['shadow_doorbell_configs']), (False, 0), stt, 'shadow doorbells off, 0 configs')
        sp = g.alloc(2)
        ctl.admin(A_DBBC, prp1=sp, prp2=sp + PAGE)
        st = env.stats(uuid)
        R.eq((st['shadow_doorbells'], st['shadow_doorbell_configs']), (True, 1), stt, 'after Doorbell Buffer Config: shadow_doorbells true, 1 config')
        # fatal
        rq = Guest(c, 1 << 20, iova=0x48000000)
        ctl.delete_sq(2)
        ctl.delete_cq(2)
        ctl.shadow = None
        ctl.disable()
        ctl.enable()
        R.eq(env.stats(uuid)['shadow_doorbells'], False, stt, 'a disable turns shadow doorbells off')
        ctl.create_cq(2, 16, iv=2, g=rq)
        ctl.create_sq(2, 16, 2, g=rq)
        rq.unmap()
        ctl.submit(2, sqe(IO_READ, nsid=1, prp1=pg(0)))
        wait_until(lambda: ctl.r32(CSTS) & 2)
        R.eq(env.stats(uuid)['state'], 'fatal', stt, 'state fatal while CSTS.CFS is set')
        ctl.disable()
        R.eq(env.stats(uuid)['state'], 'disabled', stt, 'state disabled after the disable')
        rq.close()
    finally:
        teardown(c, g)
    st = None

    def gone():
        nonlocal st
        st = env.stats(uuid)
        return st and st['queues_live'] == 0 and st['state'] == 'disabled'
    wait_until(gone, step=0.05)
    R.check(st and st['io']['commands'] == 8 and st['doorbells_now'] == 'message', stt,
            'after the client left: queues_live 0, disabled; the counters stay; doorbells_now the last client\'s mode', st and (st['queues_live'], st['io']['commands']))
    env.dstop(uuid)


# ######################################################################
# Edge shapes and load: PRPs across mappings, repeated pages, lists in the data, full queues
# ######################################################################
def t_stress(env):
    R.sec('Edge PRP shapes and full queues (nvme.md § NVM commands: Data pointer; § Queues)')
    dp = NV('NVM commands', 'Data pointer (PRPs, 4 KiB pages)')
    q = NV('Queues')
    p = env.start(['ns1=ram:64M', 'queues=64', 'entries=4096'])
    c, g, ctl = bring_up(p.sock, mem=48 << 20, aq=1024)
    try:
        ctl.io_pair(1, 4096)
        # two mappings adjacent in IOVA: a transfer whose contiguous pages straddle them
        a = Guest(c, 64 << 10, iova=0x30000000)
        b = Guest(c, 64 << 10, iova=0x30000000 + (64 << 10))
        pages = [0x30000000 + (64 << 10) - 2 * PAGE + PAGE * k for k in range(4)]
        data = rand_bytes(16384, 71)
        for k, pg in enumerate(pages):
            (a if a.has(pg) else b).write(pg, data[PAGE * k:PAGE * (k + 1)])
        lst = g.alloc(1)
        g.write(lst, struct.pack('<3Q', *pages[1:]))
        e = ctl.rw(1, IO_WRITE, 100, 32, pages[0], lst)
        e2, back = xfer(ctl, g, 1, IO_READ, 100, 16384, scattered_pages(g, 4))
        R.check(e.st == OK and e2.st == OK and back == data, dp, 'a Write from 4 contiguous IOVA pages spread over two adjacent mappings', (e, e2))
        for k, pg in enumerate(pages):
            (a if a.has(pg) else b).write(pg, b'\0' * PAGE)
        e = ctl.rw(1, IO_READ, 100, 32, pages[0], lst)
        got = b''.join((a if a.has(pg) else b).read(pg, PAGE) for pg in pages)
        R.check(e.st == OK and got == data, dp, 'a Read into them', e)
        a.close()
        b.close()
        # the same page named several times
        pg = g.alloc(1)
        blk = rand_bytes(4096, 72)
        g.write(pg, blk)
        e, _ = xfer(ctl, g, 1, IO_WRITE, 300, blk * 3, [pg, pg, pg])
        e2, back = xfer(ctl, g, 1, IO_READ, 300, 12288, scattered_pages(g, 3))
        R.check(e.st == OK and e2.st == OK and back == blk * 3, dp, 'a Write naming one page three times (PRP1 and a list of it twice)', (e, e2))
        rp = g.alloc(1)
        e, _ = xfer(ctl, g, 1, IO_READ, 300, 12288, [rp, rp, rp])
        R.check(e.st == OK and g.read(rp, PAGE) == blk, dp, 'a Read into one page named three times', e)
        # the list page is one of the data pages of a Read: the list is read before the data lands
        lp = g.alloc(1)
        d0 = g.alloc(1)
        want = rand_bytes(12288, 73)
        xfer(ctl, g, 1, IO_WRITE, 400, want, scattered_pages(g, 3))
        g.write(lp, struct.pack('<QQ', d0, lp))
        e = ctl.rw(1, IO_READ, 400, 24, g.alloc(1), lp)
        R.check(e.st == OK and g.read(lp, PAGE) == want[8192:], dp, 'a Read whose PRP list page is also its last data page: the list is read first', e)
        # 4095 commands in one doorbell on a 4096-entry queue (entries=4096)
        buf = g.alloc(1)
        cids = [ctl.submit(1, sqe(IO_READ, nsid=1, prp1=buf, cdw10=i % 1000), ring=False) for i in range(4095)]
        ctl.ring_sq(1)
        before = len(ctl.cqs[1].seen)
        res = ctl.wait_all(1, cids)
        R.check(all(e and e.st == OK for e in res) and [e.cid for e in ctl.cqs[1].seen[before:]] == cids, q,
                '4095 Reads in one doorbell on a 4096-entry queue: all complete, in order', sum(1 for e in res if e and e.st == OK))
        # 1000 admin commands in one doorbell on a 1024-entry admin queue
        cids = [ctl.submit(0, sqe(A_GETF, cdw10=0x01), ring=False) for _ in range(1000)]
        ctl.ring_sq(0)
        res = ctl.wait_all(0, cids)
        R.check(all(e and e.st == OK and e.dw0 == 7 for e in res), q, '1000 Get Features in one doorbell on the admin queue: all complete')
        # 64 queue pairs, a command on each; MSI-X has 65 vectors
        ok = all(ctl.io_pair(qid, 8, iv=qid) for qid in range(2, 65))
        R.check(ok, NV('Instance options', 'queues'), 'queues=64: 63 more I/O queue pairs, CQ n on vector n (65 vectors)')
        cids = {qid: ctl.submit(qid, sqe(IO_READ, nsid=1, prp1=buf, cdw10=qid)) for qid in range(1, 65)}
        res = [ctl.wait(qid, cid) for qid, cid in cids.items()]
        R.check(all(e and e.st == OK for e in res), NV('Instance options', 'queues'), 'one Read on each of the 64 I/O queues')
        st_check(ctl.create_cq(65, 8), INVALID_QID, NV('Instance options', 'queues'), 'CQ 65 (64 granted)', dnr=1)
        # two SQs on one 2-entry CQ, both held by it: releasing one entry at a time serves them all
        for qid in (63, 64):
            ctl.delete_sq(qid)
        ctl.delete_cq(64)
        ctl.delete_cq(63)
        st_check(ctl.create_cq(63, 2, iv=63), OK, q, 'CQ 63 of 2 entries')
        ctl.create_sq(63, 16, 63)
        ctl.create_sq(64, 16, 63)
        ctl.auto_head = False
        c63 = [ctl.submit(63, sqe(IO_READ, nsid=1, prp1=buf, cdw10=i), ring=False) for i in range(6)]
        c64 = [ctl.submit(64, sqe(IO_WRITE, nsid=1, prp1=buf, cdw10=8000 + i), ring=False) for i in range(6)]
        ctl.ring_sq(63)
        ctl.ring_sq(64)
        got = []
        for _ in range(12):
            n = len(got)
            if not wait_until(lambda: got.extend(ctl.reap(63)) or len(got) > n):
                break
            ctl.ring_cq(63)
        ctl.auto_head = True
        R.check(sorted((e.sqid, e.cid) for e in got) == sorted([(63, x) for x in c63] + [(64, x) for x in c64]) and all(e.st == OK for e in got), q,
                'two SQs (Reads, RAM Writes) sharing a 2-entry CQ, released one entry at a time: all 12 complete', len(got))
        R.eq([e.cid for e in got if e.sqid == 63], c63, q, '... each SQ\'s completions in its order (63)')
        R.eq([e.cid for e in got if e.sqid == 64], c64, q, '... each SQ\'s completions in its order (64)')
    finally:
        ctl.auto_head = True
        teardown(c, g)
        env.stop(p)


def t_filestress(env):
    R.sec('File transfers in flight at disable, unmap and disconnect (nvme.md § Namespaces; § NVM commands: Unmap)')
    ns = NV('Namespaces', 'A reset, disable or disconnect with transfers in flight')
    d = env.h.path('img')
    os.makedirs(d, exist_ok=True)
    img = os.path.join(d, 'stress.img')
    with open(img, 'wb') as f:
        f.truncate(64 << 20)
    nsze = (64 << 20) // 512
    for cache in ('writeback', 'none'):
        p = env.start(['ns1=file:%s' % img, 'cache1=%s' % cache, 'queues=2'])
        c, g, ctl = bring_up(p.sock, mem=16 << 20)
        try:
            ctl.io_pair(1, 64)
            ok, bad = io_burst(ctl, g, 1, 16, 16, 5000)
            R.check(ok, NV('Instance options', 'aio=io_uring'), '%s: 16 Writes and Reads at depth 16 through the queue\'s io_uring, verified' % cache, bad)
            # disable with 62 x 1 MiB in flight
            ctl.create_cq(2, 64, iv=2)
            ctl.create_sq(2, 64, 2)
            cids = in_flight(ctl, g, 2, 62, 256, nsze=nsze)
            wait_until(lambda: ctl.peek(2) is not None)      # the first done: the others are under way
            ctl.w32(CC, ctl.r32(CC) & ~1)
            R.check(wait_until(lambda: ctl.r32(CSTS) & 1 == 0), ns, '%s: disable with 62 x 1 MiB file Writes in flight: RDY clears' % cache)
            cq = ctl.cqs[2]
            snap = g.read(cq.iova, 64 * 16)
            c.barrier()
            time.sleep(QUIET)
            R.check(g.read(cq.iova, 64 * 16) == snap, ns, '%s: nothing posted after the disable' % cache)
            R.info('%s: %d of 62 had completed' % (cache, len(posted_cids(g, cq, cids))))
            R.check(ctl.enable(), ns, '%s: enabled again' % cache)
            ctl.io_pair(1, 64)
            ok, bad = io_burst(ctl, g, 1, 4, 4, 5100)
            R.check(ok, ns, '%s: I/O after it verified' % cache, bad)
            # unmap with file reads in flight
            dm = Guest(c, 8 << 20, iova=0x40000000)
            cids = in_flight(ctl, dm, 1, 32, 256, opc=IO_READ, nsze=nsze)
            wait_until(lambda: ctl.peek(1) is not None)
            dm.unmap()
            res = ctl.wait_all(1, cids)
            R.check(all(e is not None and e.st in (OK, DATA_XFER_ERR, ABORT_SQ_DELETED) for e in res), NV('NVM commands', 'Unmap'),
                    '%s: DMA_UNMAP under 32 x 1 MiB file Reads: every command completes (Success or Data Transfer Error)' % cache,
                    sorted(set(stname(e.st) if e else 'lost' for e in res)))
            R.info('%s unmap: %d Success, %d Data Transfer Error' % (cache, sum(1 for e in res if e and e.st == OK), sum(1 for e in res if e and e.st == DATA_XFER_ERR)))
            dm.close()
            # disconnect with transfers in flight; the next client is served
            cids = in_flight(ctl, g, 1, 62, 256, nsze=nsze)
            wait_until(lambda: ctl.peek(1) is not None)
            c.close()
            teardown(g)
            c = new_session(p.sock)
            g = Guest(c, 16 << 20)
            ctl = Ctrl(c, g)
            ctl.msix_on()
            R.check(ctl.enable(), ns, '%s: after a disconnect with 62 x 1 MiB Writes in flight, the next client enables the controller' % cache)
            ctl.io_pair(1, 16)
            ok, bad = io_burst(ctl, g, 1, 4, 4, 5200)
            R.check(ok, ns, '%s: and its I/O is verified' % cache, bad)
        finally:
            teardown(c, g)
            st = env.stop(p)
        R.check(st and st['namespaces'][0]['held_by_backing'] == 0 and st['workers_held_by_backing'] == 0, NV('Statistics'),
                '%s: nothing left held by the backing at exit' % cache, st and (st['namespaces'][0]['held_by_backing'], st['workers_held_by_backing']))


def t_shadow_watch(env):
    R.sec('Shadow doorbells with the worker\'s watch (poll_us) and with the mapped page: no lost command (nvme.md § Doorbells; § Instance options: poll_us)')
    sh = NV('Doorbells', 'Shadow doorbells: the host\'s next submission either is seen by that look or writes the doorbell register')
    rnd = random.Random(99)
    for mode, opts, nocaps in (('message, poll_us 200', ['ns1=ram:4M'], False), ('message, poll_us 30', ['ns1=ram:4M', 'poll_us=30'], False),
                               ('mapped page', ['ns1=ram:4M'], True)):
        p = env.start(opts)
        c, g, ctl = bring_up(p.sock, nocaps=nocaps)
        try:
            ctl.io_pair(1, 32)
            shp, evp = g.alloc(1), g.alloc(1)
            st_check(ctl.admin(A_DBBC, prp1=shp, prp2=evp), OK, sh, '%s: Doorbell Buffer Config' % mode)
            ctl.shadow = (shp, evp, g)
            buf = g.alloc(8)
            lost, n = 0, 0
            for i in range(150):
                depth = rnd.choice((1, 1, 1, 2, 3, 8))
                cids = [ctl.submit(1, sqe(IO_READ, nsid=1, prp1=buf + PAGE * k, cdw10=k), ring=False) for k in range(depth)]
                ctl.ring_sq(1)
                for cid in cids:
                    e = ctl.wait(1, cid, timeout=min(vu.WAIT, 10))
                    n += 1
                    if e is None or e.st != OK:
                        lost += 1
                if lost:
                    break
                time.sleep(rnd.choice((0, 0, 0.00005, 0.00015, 0.00025, 0.0004, 0.001)))
            R.check(lost == 0, sh, '%s: %d commands at random depths and gaps, rung only as the event indices ask: none lost' % (mode, n),
                    '%d without a completion (SQ 1 tail %d, shadow %d, event index %d)' % (lost, ctl.sqs[1].tail, g.u32(shp + 8), g.u32(evp + 8)))
            ctl.shadow = None
        finally:
            teardown(c, g, ctl.dbpage)
            env.stop(p)


# ######################################################################
# Running it
# ######################################################################
GROUPS = [
    ('pci', [t_pci]),
    ('regs', [t_regs]),
    ('enable', [t_enable]),
    ('identify', [t_identify]),
    ('features', [t_features]),
    ('logs', [t_logs]),
    ('queues', [t_queues]),
    ('abort', [t_abort]),
    ('prp', [t_prp]),
    ('nvm', [t_nvm]),
    ('lba4k', [t_lba4k]),
    ('intr', [t_intr]),
    ('aer', [t_aer]),
    ('doorbells', [t_doorbells]),
    ('shadow', [t_shadow, t_shadow_watch]),
    ('reset', [t_reset]),
    ('unmap', [t_unmap]),
    ('files', [t_files]),
    ('stats', [t_stats]),
    ('stress', [t_stress]),
    ('filestress', [t_filestress]),
]


def main():
    random.seed(0x75e0)

    def at_end(env):
        R.sec('Over the whole run (vfio-user.md § Commands)')
        R.check(not vu.BAD_REPLIES, VU('Commands', 'error replies'),
                'every reply: the request\'s command, the reply type, an errno only with the error flag, error replies a bare header',
                vu.BAD_REPLIES[:5])
    return vu.contract_main('nvme', 'Contract test of `umdev run --type nvme`, written from the docs alone (see the module docstring).',
                            GROUPS, vu.Harness, Env, at_end=at_end, kept='sockets, logs and images')


if __name__ == '__main__':
    sys.exit(main())
