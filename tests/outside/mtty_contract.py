#!/usr/bin/env python3
"""mtty_contract.py: a contract test of umdev's `mtty` serial card, from the outside.

What it is
    An independent serial driver for `umdev run --type mtty-1|mtty-2` (Python 3, standard
    library only), written from umdev's documentation alone: docs/mtty.md, docs/vfio-user.md
    and README.md, plus public 16550A documentation (the PC16550D datasheet, Linux's 8250
    driver) for what the docs name but do not spell out. It reads none of the server's code.
    The vfio-user client itself (framing, VERSION, SET_IRQS, eventfds, the harness) is
    imported from testdev_contract.py, the docs-only client next to this file.

    It starts its own servers (`umdev run` for every type and port backend mtty.md lists:
    loopback, null, pty, socket; and one `umdev daemon` for the port pool, `umdev list
    --json` and the per-port counters), drives each port as a serial driver would, and
    checks about 880 documented behaviours (about 13 s on a 2-CPU machine). Each check cites
    the doc file and section it pins, e.g.
    "mtty.md § Receiver: FIFO, overrun, character timeout"; "a + b" cites both.

What it checks (one test group per doc area; --list shows them)
    cli       Instance options: every refusal at `umdev run` and `umdev define`, mdevctl JSON
    config    Identity, config space (writable fields, BAR sizing, the MSI capability)
    regions   DEVICE_GET_INFO, regions, IRQ indexes, access sizes and offsets, wide accesses
    regs      every register of every port: power-on values, read/write, DLAB and divisor
    rx        16450 and FIFO mode receivers, overrun, FCR, trigger levels, word length
    timeout   the character timeout (fires, clears, restarts; never before 4 char times)
    lsr       breaks: BI, LSR bit 7, SBC held, MCR loopback
    iir       IIR identification and priorities, THRE semantics
    modem     MCR, MSR, MCR loopback wiring and deltas
    intx      INTx: level, automask, unmask, INTx disable, timer-driven interrupts
    msi       MSI: one message per new condition, bus mastering, eventfd wiring, wide accesses
    reset     DEVICE_RESET and client disconnect, one client at a time
    null      the null backend
    socket    the socket backend: both directions, flow control, stalls, half-close, queues
    pty       the pty backend: raw mode, reopen, both directions
    daemon    the port pool, `umdev start`/`list --json`, counters, an ignored receiver

Speed independence (as testdev_contract.py)
    - Nothing asserts that something happened within a time. Every wait is for an event (a
      register or counter reaching a value, an interrupt, bytes on a host socket) with a
      generous bound (--timeout, 30 s).
    - "Nothing happens" checks make a round trip first, then look for a short window.
    - Where the docs give a time (the character timeout: four character times; an ignored
      receiver: 1 s, then the line rate), only LOWER bounds are checked ("not before"),
      measured from a moment this client knows precedes the server's (the send of the
      request): a slow machine can only hide a violation, never invent one. A check that
      needs something NOT to have happened yet (e.g. the timeout has not fired yet) is
      judged only if this client's reply came before the bound; otherwise it is void and
      a NOTE says so.

How to run
    python3 mtty_contract.py --bin target/release/umdev
    python3 mtty_contract.py --bin /path/to/umdev --socket-dir /tmp --only rx,timeout

    --bin PATH         the umdev binary (default: $UMDEV_BIN, else target/release/umdev)
    --socket-dir DIR   where this run makes its own fresh directory (sockets, logs, the
                       daemon's dirs); removed at exit, whatever happened
    --only A,B         run only these groups (--list shows them)
    --timeout S        the bound on every wait for an event (default 30)
    -q, --quiet        print only FAIL and NOTE lines and the summary

    Exit status: 0 when every check passed; 1 when one failed; 2 when it could not start;
    130 when interrupted. Servers are stopped and files removed on every exit path.
"""
import errno as E
import fcntl
import json
import os
import re
import select
import signal
import socket
import stat as stmod
import struct
import subprocess
import sys
import termios
import threading
import time
import tty

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import testdev_contract as vu  # noqa: E402
from testdev_contract import (  # noqa: E402
    R, Ev, Closed, SetupError, wait_until, connect, new_session, errname, both, cite, VU, RM,
    BAR0, BAR1, BAR2, BAR3, BAR4, BAR5, ROM, CONFIG, VGA, INTX, MSI, MSIX, ERR, REQ,
    REGION_READ, REGION_WRITE, REGION_WRITE_MULTI, SET_IRQS, DEVICE_RESET,
    DATA_NONE, DATA_BOOL, DATA_EVENTFD, ACTION_MASK, ACTION_UNMASK, ACTION_TRIGGER,
    RI_READ, RI_WRITE, II_EVENTFD, II_MASKABLE, II_AUTOMASKED)

POLL = 0.002


def MT(section, item=None):
    return cite('mtty.md', section, item)


# mtty.md sections
S_TYPES = 'Types and the port pool'
S_OPTS = 'Instance options'
S_ID = 'Identity'
S_CFG = 'Config space'
S_REG = 'Regions and IRQs'
S_REGS = 'Registers (per port)'
S_RX = 'Receiver: FIFO, overrun, character timeout'
S_PRIO = 'Interrupt conditions and priority'
S_TX = 'The transmitter and the line'
S_BE = 'Port backends'
S_IRQ = 'Interrupts'
S_RST = 'Reset and detach'
S_DIFF = 'Differences from the kernel sample'

# 16550A registers and bits (mtty.md § Registers (per port))
RBR = THR = DLL = 0
IER = DLM = 1
IIR = FCR = 2
LCR, MCR, LSR, MSR, SCR = 3, 4, 5, 6, 7
IER_RDI, IER_THRI, IER_RLSI, IER_MSI = 1, 2, 4, 8
LSR_DR, LSR_OE, LSR_PE, LSR_FE, LSR_BI, LSR_THRE, LSR_TEMT, LSR_FIFOE = 1, 2, 4, 8, 0x10, 0x20, 0x40, 0x80
IIR_NONE, IIR_RLS, IIR_RDA, IIR_TIMEOUT, IIR_THRE, IIR_MODEM = 0x01, 0x06, 0x04, 0x0c, 0x02, 0x00
MCR_DTR, MCR_RTS, MCR_OUT1, MCR_OUT2, MCR_LOOP = 1, 2, 4, 8, 0x10
LCR_DLAB, LCR_SBC = 0x80, 0x40
CLOCK = 1843200.0

LSR_SEEN = [0]          # OR of every LSR value read in the run (PE/FE must never show)
MULTI_ERRORS = []       # REGION_WRITE_MULTI failures while sending bulk data


def char_time(lcr, divisor):
    """mtty.md § Receiver: (1 start + data + parity + stop) bits x 16 x divisor / 1.8432 MHz."""
    data = 5 + (lcr & 3)
    parity = 1 if lcr & 8 else 0
    stop = (1.5 if data == 5 else 2) if lcr & 4 else 1
    return (1 + data + parity + stop) * 16 * (divisor or 65536) / CLOCK


class Port:
    """One UART, reached through its BAR (port i is BAR i)."""

    def __init__(self, c, index):
        self.c = c
        self.bar = BAR0 + index
        self.index = index

    def rd(self, off, n=1):
        v = self.c.rd(self.bar, off, n)
        if n == 1 and off == LSR:
            LSR_SEEN[0] |= v
        return v

    def wr(self, off, v, n=1):
        self.c.wr(self.bar, off, v, n)

    def lsr(self):
        return self.rd(LSR)

    def iir(self):
        return self.rd(IIR)

    def msr(self):
        return self.rd(MSR)

    def rbr(self):
        return self.rd(RBR)

    def thr(self, b):
        self.wr(THR, b)

    def set_div(self, d):
        lcr = self.rd(LCR)
        self.wr(LCR, lcr | LCR_DLAB)
        self.wr(DLL, d & 0xff)
        self.wr(DLM, (d >> 8) & 0xff)
        self.wr(LCR, lcr & ~LCR_DLAB & 0xff)

    def get_div(self):
        lcr = self.rd(LCR)
        self.wr(LCR, lcr | LCR_DLAB)
        d = self.rd(DLL) | self.rd(DLM) << 8
        self.wr(LCR, lcr)
        return d

    def setup(self, fcr=0x07, lcr=0x03, ier=0, div=None, mcr=0):
        """A driver's open: line settings, FIFOs, modem control, interrupts."""
        if div is not None:
            self.wr(LCR, LCR_DLAB)
            self.wr(DLL, div & 0xff)
            self.wr(DLM, (div >> 8) & 0xff)
        self.wr(LCR, lcr)
        self.wr(FCR, fcr)
        self.wr(MCR, mcr)
        self.wr(IER, ier)

    def send(self, data):
        """Transmit bytes: REGION_WRITE_MULTI, 200 THR writes per message."""
        data = bytes(data)
        for i in range(0, len(data), 200):
            chunk = data[i:i + 200]
            payload = struct.pack('<Q', len(chunk)) + b''.join(
                struct.pack('<QII', THR, self.bar, 1) + bytes([b]).ljust(8, b'\0') for b in chunk)
            m = self.c.request(REGION_WRITE_MULTI, payload)
            if m.is_error:
                MULTI_ERRORS.append(errname(m.error))
                for b in chunk:
                    self.thr(b)

    def pop6(self):
        """A 6-byte read at 0: pops RBR, then IER, IIR, LCR, MCR and LSR (mtty.md § Regions
        and IRQs: Access sizes); returns (byte, LSR after the pop). Not for use while THRE
        matters (the IIR read may clear it)."""
        v = self.c.region_read(self.bar, 0, 6)
        LSR_SEEN[0] |= v[5]
        return v[0], v[5]

    def recv(self, n, timeout=None, fast=True, stop_when_empty=False):
        """Read up to n bytes, waiting for them (at most `timeout`, default WAIT).
        Returns (bytes, OR of the LSR values seen)."""
        out = bytearray()
        seen = 0
        deadline = time.monotonic() + (vu.WAIT if timeout is None else timeout)
        self.last_pop = None
        while len(out) < n:
            lsr = self.lsr()
            seen |= lsr
            if not lsr & LSR_DR:
                if stop_when_empty or time.monotonic() > deadline:
                    break
                time.sleep(POLL)
                continue
            while len(out) < n:
                self.last_pop = time.monotonic()
                if fast:
                    b, lsr = self.pop6()
                else:
                    b = self.rbr()
                    lsr = self.lsr()
                out.append(b)
                seen |= lsr
                if not lsr & LSR_DR:
                    break
        return bytes(out), seen

    def drain(self):
        return self.recv(1 << 20, stop_when_empty=True)[0]


def quiet():
    time.sleep(vu.QUIET)


def void_or_check(t_send, bound, ok, ref, what, got):
    """A check that something has NOT happened yet, `bound` seconds after t_send (a time
    before the server acted): judged only if this client's reply came before the bound."""
    if time.monotonic() - t_send < bound:
        return R.check(ok, ref, what, got)
    R.note(ref, '%s: not judged (this client took %.3f s, over the %.3f s bound)' % (what, time.monotonic() - t_send, bound))
    return True


# ======================================================================
# The harness
# ======================================================================
class Env(vu.Harness):
    def __init__(self, binary, socket_dir):
        super().__init__(binary, socket_dir)
        self.servers = {}
        self.n = 0

    def spawn(self, args, log):
        """stdout to LOG.out, stderr to LOG.log (the docs say which stream carries what)."""
        with open(self.path(log + '.log'), 'ab') as errf, open(self.path(log + '.out'), 'ab') as outf:
            p = subprocess.Popen([self.bin] + args, stdin=subprocess.DEVNULL, stdout=outf, stderr=errf)
        self.procs.append(p)
        return p

    def start_mtty(self, typ, opts=(), name=None, want_ptys=0):
        """`umdev run --type typ --opt ...`; returns (proc, socket path, {port: pty path})."""
        self.n += 1
        name = name or '%s-%d' % (typ, self.n)
        sock = self.path(name + '.sock')
        args = ['run', '--type', typ, '--socket', sock]
        for o in opts:
            args += ['--opt', o]
        p = self.spawn(args, name)
        if not wait_until(lambda: p.poll() is not None or os.path.exists(sock)) or p.poll() is not None:
            raise SetupError('mtty server %s did not start (rc %s): %s' % (name, p.poll(), self.log_tail(name)))
        ptys = {}

        def got_ptys():
            ptys.clear()
            for m in re.finditer(r'^  port (\d+): pty (/dev/\S+)$', self.log_text(name), re.M):
                ptys[int(m.group(1))] = m.group(2)
            return len(ptys) >= want_ptys
        wait_until(got_ptys)
        return p, sock, ptys

    def log_text(self, name):
        try:
            with open(self.path(name + '.log'), errors='replace') as f:
                return f.read()
        except OSError:
            return ''

    def server(self, key):
        """Shared servers: m1 (mtty-1 loopback), m2 (mtty-2 loopback), null (mtty-1 null)."""
        if key not in self.servers:
            typ, opts = {'m1': ('mtty-1', ()), 'm2': ('mtty-2', ()), 'null': ('mtty-1', ('backend=null',))}[key]
            self.servers[key] = self.start_mtty(typ, opts, name=key)
        p, sock, _ = self.servers[key]
        if p.poll() is not None:
            raise SetupError('server %s exited (status %s)' % (key, p.returncode))
        return sock

    def umdev(self, *args, timeout=None):
        p = subprocess.run([self.bin] + list(args), capture_output=True, text=True, timeout=(timeout or vu.WAIT) + 30)
        return p.returncode, p.stdout, p.stderr


def session(sock):
    c = new_session(sock)
    c.wm = True
    return c


def ports_of(typ):
    return 1 if typ == 'mtty-1' else 2


# ######################################################################
# mtty.md § Instance options
# ######################################################################
def t_cli(env):
    R.sec('Instance options and types (mtty.md § Instance options, § Types and the port pool)')
    opts = MT(S_OPTS)
    run_dir = env.path('norun')
    rc, out1, err = env.umdev('types', 'mtty-1', '--run-dir', run_dir)
    R.check(rc == 0 and re.search(r'Available instances: 24\b', out1), MT(S_TYPES),
            '`umdev types mtty-1` with no daemon: 24 available (24 free ports)', (out1 + err).strip()[:200])
    rc, out2, err = env.umdev('types', 'mtty-2', '--run-dir', run_dir)
    R.check(rc == 0 and re.search(r'Available instances: 12\b', out2), MT(S_TYPES),
            '`umdev types mtty-2` with no daemon: 12 available (half of 24)', (out2 + err).strip()[:200])
    R.check('port1' in out2 and 'backend' in out2 and 'port0' in out2, opts,
            '`umdev types mtty-2` lists backend, port0 and port1', out2.strip()[-300:])
    R.check('port1' not in out1 and 'port0' in out1, opts, '`umdev types mtty-1` lists port0, no port1', out1.strip()[-300:])

    bad = [
        ('mtty-1', ['backend=bogus'], 'an unknown backend'),
        ('mtty-1', ['backend=socket:relative/path.sock'], 'a relative socket path'),
        ('mtty-1', ['backend=socket:'], 'an empty socket path'),
        ('mtty-1', ['backend='], 'an empty SPEC'),
        ('mtty-1', ['port1=null'], 'port1 on mtty-1'),
        ('mtty-2', ['port2=null'], 'port2 on mtty-2'),
        ('mtty-1', ['speed=9600'], 'an unknown option'),
        ('mtty-2', ['backend=socket:%s' % env.path('both.sock')], 'backend=socket:PATH alone on mtty-2 (two ports, one path)'),
        ('mtty-2', ['port0=socket:%s' % env.path('same.sock'), 'port1=socket:%s' % env.path('same.sock')],
         'port0 and port1 on the same socket path'),
    ]
    for typ, o, what in bad:
        sock = env.path('bad.sock')
        args = ['run', '--type', typ, '--socket', sock]
        for x in o:
            args += ['--opt', x]
        p = subprocess.Popen([env.bin] + args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        env.procs.append(p)
        wait_until(lambda: p.poll() is not None or os.path.exists(sock))
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            out, err = p.communicate(timeout=vu.WAIT)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        R.check(p.returncode not in (0, None) and not os.path.exists(sock), opts,
                '`umdev run --type %s --opt %s` refused (%s), no socket left' % (typ, ' --opt '.join(o), what),
                'rc %s: %s' % (p.returncode, (out + err).strip()[:160]))
        for x in o:
            if x.startswith(('backend=socket:', 'port0=socket:', 'port1=socket:')):
                path = x.split(':', 1)[1]
                if path.startswith('/'):
                    R.check(not os.path.exists(path), MT(S_BE, 'socket:PATH'),
                            'a refused instance leaves no socket at %s' % os.path.basename(path))
    state = env.path('state-cli')
    for typ, o, what in bad:
        args = ['define', '-t', typ, '--state-dir', state]
        for x in o:
            args += ['--opt', x]
        rc, out, err = env.umdev(*args)
        R.check(rc != 0, opts, '`umdev define -t %s --opt %s` refused at define (%s)' % (typ, ' --opt '.join(o), what),
                'rc %s: %s' % (rc, (out + err).strip()[:160]))
    for spec in ('PTY', 'Null', 'LoopBack', 'Socket:%s' % env.path('Case.sock')):
        rc, out, err = env.umdev('define', '-t', 'mtty-1', '--state-dir', state, '--opt', 'backend=' + spec)
        R.check(rc == 0, opts, '`umdev define -t mtty-1 --opt backend=%s` accepted (the words in any case)' % spec,
                'rc %s: %s' % (rc, (out + err).strip()[:160]))
    rc, out, err = env.umdev('run', '--type', 'mtty-1', '--socket', env.path('dup.sock'), '--opt', 'backend=null', '--opt', 'backend=null')
    R.check(rc != 0 and 'option backend given twice' in err + out, opts, 'a key given twice: "option backend given twice"',
            (out + err).strip()[:160])
    rc, out, err = env.umdev('define', '-t', 'mtty-1', '--state-dir', state, '--opt', 'backend=null', '--opt', 'backend=null')
    R.check(rc != 0 and 'option backend given twice' in err + out, opts, 'define: a key given twice: "option backend given twice"',
            (out + err).strip()[:160])
    jf = env.path('dup.json')
    with open(jf, 'w') as f:
        json.dump({'mdev_type': 'mtty-2', 'start': 'manual', 'attrs': [{'backend': 'null'}, {'backend': 'null'}]}, f)
    rc, out, err = env.umdev('define', '--jsonfile', jf, '--state-dir', state)
    R.check(rc != 0, opts, 'an mdevctl JSON with a repeated key is refused', (out + err).strip()[:160])
    good = [
        ('mtty-1', ['backend=pty']), ('mtty-1', ['backend=null']), ('mtty-1', ['port0=loopback']),
        ('mtty-1', ['backend=socket:%s' % env.path('g1.sock')]),
        ('mtty-2', ['port0=socket:%s' % env.path('g2a.sock'), 'port1=socket:%s' % env.path('g2b.sock')]),
        ('mtty-2', ['backend=socket:%s' % env.path('g3.sock'), 'port1=null']),
        ('mtty-2', ['backend=null', 'port1=pty']),
    ]
    for typ, o in good:
        args = ['define', '-t', typ, '--state-dir', state]
        for x in o:
            args += ['--opt', x]
        rc, out, err = env.umdev(*args)
        R.check(rc == 0, opts, '`umdev define -t %s --opt %s` accepted' % (typ, ' --opt '.join(o)), (out + err).strip()[:160])
        mu = re.search(r'[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}', out)
        if mu:
            env.umdev('undefine', '-u', mu.group(0), '--state-dir', state)


# ######################################################################
# mtty.md § Identity, § Config space
# ######################################################################
def walk_caps(cfg):
    caps = []
    p = cfg[0x34] & 0xfc
    seen = set()
    while p and p not in seen:
        seen.add(p)
        caps.append((cfg[p], p))
        p = cfg[p + 1] & 0xfc
    return caps


def t_config(env):
    for key, typ in (('m1', 'mtty-1'), ('m2', 'mtty-2')):
        R.sec('Identity and config space of %s (mtty.md § Identity, § Config space)' % typ)
        ident = MT(S_ID)
        cs = MT(S_CFG)
        c = session(env.server(key))
        cfg = c.region_read(CONFIG, 0, 256)
        u16 = lambda o: struct.unpack_from('<H', cfg, o)[0]
        u32 = lambda o: struct.unpack_from('<I', cfg, o)[0]
        R.eq((u16(0), u16(2)), (0x4348, 0x3253), ident, 'vendor/device')
        R.eq((u16(0x2c), u16(0x2e)), (0x4348, 0x3253), ident, 'subsystem vendor/subsystem')
        R.eq(cfg[8], 0x10, ident, 'revision')
        R.eq((cfg[0xb], cfg[0xa], cfg[9]), (0x07, 0x00, 0x02), ident, 'class/subclass/prog-if')
        R.eq(cfg[0xe], 0, ident, 'header type 0')
        R.eq(cfg[0x3d], 1, ident, 'interrupt pin 1 (INTA#)')
        R.eq(len(cfg), 256, both(ident, MT(S_REG)), 'config space reads 256 bytes')
        R.errno(c.errno_of(REGION_READ, struct.pack('<QII', 0, CONFIG, 257)), E.EINVAL, both(MT(S_REG), VU('Commands', 'REGION_READ')),
                'config read of 257 bytes')
        R.errno(c.errno_of(REGION_READ, struct.pack('<QII', 255, CONFIG, 2)), E.EINVAL, both(MT(S_REG), VU('Commands', 'REGION_READ')),
                'config read of 2 bytes at 255 (past 256)')
        caps = walk_caps(cfg)
        R.check(u16(6) & 0x10, cs, 'STATUS capabilities-list bit set (a capability exists)', hex(u16(6)))
        R.eq(caps, [(0x05, 0x40)], cs, 'capabilities: exactly one, MSI (ID 0x05) at 0x40')
        ctl = u16(0x42)
        R.eq((ctl >> 1) & 7, 0, cs, 'MSI: 1 vector (Multiple Message Capable 0)')
        R.check(ctl & 0x80, cs, 'MSI: 64-bit address', hex(ctl))
        R.eq(ctl & 0x100, 0, cs, 'MSI: no per-vector masking')
        R.eq(ctl & 1, 0, cs, 'MSI disabled at power-on')
        # BARs
        R.eq(u32(0x10) & 1, 1, cs, 'BAR0 is an I/O BAR (bit 0)')
        for bar, want in ((0, 0xfffffff9), (1, 0xfffffff9 if typ == 'mtty-2' else 0), (2, 0), (3, 0), (4, 0), (5, 0)):
            c.wr(CONFIG, 0x10 + 4 * bar, 0xffffffff, 4)
            R.eq(c.rd(CONFIG, 0x10 + 4 * bar, 4), want, cs, 'BAR%d all-ones sizing' % bar)
            c.wr(CONFIG, 0x10 + 4 * bar, 0, 4)
        c.wr(CONFIG, 0x30, 0xffffffff, 4)
        R.eq(c.rd(CONFIG, 0x30, 4), 0, cs, 'ROM BAR (absent) reads 0 after all-ones')
        c.wr(CONFIG, 0x10, 0xc000, 4)
        R.eq(c.rd(CONFIG, 0x10, 4), 0xc001, cs, 'BAR0 address bits writable (0xc000 -> 0xc001)')
        c.wr(CONFIG, 0x10, 0xc006, 4)
        R.eq(c.rd(CONFIG, 0x10, 4), 0xc001, cs, 'BAR0 bits 1-2 (below the 8-byte size) not writable')
        if typ == 'mtty-2':
            c.wr(CONFIG, 0x14, 0xc008, 4)
            R.eq(c.rd(CONFIG, 0x14, 4), 0xc009, cs, 'BAR1 address bits writable (0xc008 -> 0xc009)')
        # writable fields
        c.wr(CONFIG, 4, 0xffff, 2)
        R.eq(c.rd(CONFIG, 4, 2), 0x0407, cs, 'COMMAND after writing 0xffff: bits 0, 1, 2 and 10 only')
        c.wr(CONFIG, 4, 0, 2)
        R.eq(c.rd(CONFIG, 4, 2), 0, cs, 'COMMAND bits clear again')
        st0 = c.rd(CONFIG, 6, 2)
        c.wr(CONFIG, 6, 0xffff, 2)
        R.eq(c.rd(CONFIG, 6, 2), st0, cs, 'STATUS after writing 0xffff (no error bit set; nothing else writable)')
        c.wr(CONFIG, 0x0c, 0x10, 1)
        R.eq(c.rd(CONFIG, 0x0c, 1), 0x10, cs, 'cache line size writable')
        c.wr(CONFIG, 0x3c, 0x0b, 1)
        R.eq(c.rd(CONFIG, 0x3c, 1), 0x0b, cs, 'INTERRUPT_LINE writable')
        c.wr(CONFIG, 0x44, 0xfee01000, 4)
        c.wr(CONFIG, 0x48, 0x12345678, 4)
        c.wr(CONFIG, 0x4c, 0x4055, 2)
        R.eq((c.rd(CONFIG, 0x44, 4), c.rd(CONFIG, 0x48, 4), c.rd(CONFIG, 0x4c, 2)), (0xfee01000, 0x12345678, 0x4055), cs,
             'MSI address (low, high) and data writable')
        c.wr(CONFIG, 0x42, 0x0001, 2)
        R.eq(c.rd(CONFIG, 0x42, 2) & 1, 1, cs, 'MSI enable writable')
        c.wr(CONFIG, 0x42, 0x0071, 2)
        R.eq(c.rd(CONFIG, 0x42, 2), 0x0081, cs, 'MSI control after writing enable | Multiple Message Enable 7: MME reads 0 (1 vector), 64-bit')
        c.wr(CONFIG, 0x42, 0, 2)
        R.eq(c.rd(CONFIG, 0x42, 2) & 1, 0, cs, 'MSI disable')
        # read-only fields
        ro = [(0, 4, 'vendor/device'), (8, 4, 'revision/class'), (0x0e, 1, 'header type'), (0x2c, 4, 'subsystem IDs'),
              (0x34, 1, 'capability pointer'), (0x3d, 1, 'interrupt pin'), (0x40, 2, 'MSI ID/next'), (0x0d, 1, 'latency timer'),
              (0x0f, 1, 'BIST'), (0x3e, 2, 'min grant/max latency'), (0x80, 4, 'an unused dword at 0x80'),
              (0xfc, 4, 'the last dword')]
        for off, n, what in ro:
            before = c.rd(CONFIG, off, n)
            c.wr(CONFIG, off, (1 << (8 * n)) - 1 ^ before, n)
            R.eq(c.rd(CONFIG, off, n), before, cs, '%s read-only (at %#x)' % (what, off))
        # I/O bit not checked by the device
        c.wr(CONFIG, 4, 0, 2)
        p = Port(c, 0)
        p.wr(SCR, 0x5a)
        R.eq(p.rd(SCR), 0x5a, cs, 'registers reached with COMMAND\'s I/O bit clear')
        c.close()


# ######################################################################
# mtty.md § Regions and IRQs
# ######################################################################
def t_regions(env):
    for key, typ in (('m1', 'mtty-1'), ('m2', 'mtty-2')):
        R.sec('Regions, IRQ indexes, access sizes of %s (mtty.md § Regions and IRQs)' % typ)
        reg = MT(S_REG)
        acc = MT(S_REG, 'Access sizes')
        c = session(env.server(key))
        R.eq(c.device_info(), (16, 3, 9, 5), both(reg, VU('Commands', 'DEVICE_GET_INFO')),
             'DEVICE_GET_INFO: argsz, flags PCI|RESET, 9 regions, 5 IRQ indexes')
        nports = ports_of(typ)
        for idx, name in ((BAR0, 'BAR0'), (BAR1, 'BAR1'), (BAR2, 'BAR2'), (BAR3, 'BAR3'), (BAR4, 'BAR4'), (BAR5, 'BAR5'),
                          (ROM, 'ROM'), (CONFIG, 'config'), (VGA, 'VGA')):
            ri = c.region_info(idx)
            for fd in ri['fds']:
                os.close(fd)
            if idx < nports:
                want = (8, RI_READ | RI_WRITE)
            elif idx == CONFIG:
                want = (256, RI_READ | RI_WRITE)
            else:
                want = (0, 0)
            R.eq((ri['size'], ri['flags']), want, reg, '%s: size and flags (R|W, no mmap; absent: 0, neither)' % name)
        R.eq(c.irq_info(INTX)[1:], (II_EVENTFD | II_MASKABLE | II_AUTOMASKED, INTX, 1), reg, 'INTx: EVENTFD|MASKABLE|AUTOMASKED, 1 vector')
        R.eq(c.irq_info(MSI)[1:], (II_EVENTFD, MSI, 1), reg, 'MSI: EVENTFD, 1 vector')
        R.eq(c.irq_info(MSIX)[3], 0, reg, 'MSI-X: none (0 vectors)')
        R.eq(c.irq_info(MSIX)[1], II_EVENTFD | II_MASKABLE, VU('Commands', 'GET_IRQ_INFO'), 'MSI-X index flags (EVENTFD, MASKABLE) with 0 vectors')
        R.eq(c.irq_info(ERR)[1:], (II_EVENTFD, ERR, 1), both(reg, VU('Commands', 'GET_IRQ_INFO')), 'ERR: the framework\'s (EVENTFD, 1)')
        R.eq(c.irq_info(REQ)[1:], (II_EVENTFD, REQ, 1), both(reg, VU('Commands', 'GET_IRQ_INFO')), 'REQ: the framework\'s (EVENTFD, 1)')
        ev = Ev()
        R.errno(c.errno_of(SET_IRQS, struct.pack('<IIIII', 20, DATA_EVENTFD | ACTION_TRIGGER, MSIX, 0, 1), fds=[ev.dup()]),
                E.EINVAL, both(reg, VU('Commands', 'SET_IRQS')), 'SET_IRQS on MSI-X (an index with no vectors)')
        R.errno(c.errno_of(SET_IRQS, struct.pack('<IIIII', 20, DATA_NONE | ACTION_MASK, MSI, 0, 1)), E.EINVAL,
                VU('Commands', 'SET_IRQS'), 'SET_IRQS MASK on MSI (mtty: no per-vector masking)')
        R.errno(c.errno_of(SET_IRQS, struct.pack('<IIIII', 20, DATA_NONE | ACTION_UNMASK, MSI, 0, 1)), E.EINVAL,
                VU('Commands', 'SET_IRQS'), 'SET_IRQS UNMASK on MSI (mtty)')
        R.errno(c.errno_of(SET_IRQS, struct.pack('<IIIII', 20, DATA_EVENTFD | ACTION_TRIGGER, MSI, 1, 1), fds=[ev.dup()]), E.EINVAL,
                VU('Commands', 'SET_IRQS'), 'SET_IRQS on MSI vector 1 (1 vector)')
        R.errno(c.errno_of(SET_IRQS, struct.pack('<IIIII', 20, DATA_EVENTFD | ACTION_TRIGGER, INTX, 0, 2), fds=[ev.dup(), ev.dup()]),
                E.EINVAL, VU('Commands', 'SET_IRQS'), 'SET_IRQS on INTx vectors 0-1 (1 vector)')
        ev.close()

        for b in range(nports):
            p = Port(c, b)
            # every offset and size within the BAR: accepted, returning count bytes
            bad = []
            for off in range(8):
                for n in range(1, 9 - off):
                    m = c.request(REGION_READ, struct.pack('<QII', off, p.bar, n))
                    if m.is_error or len(m.payload) != 16 + n:
                        bad.append('read %d@%d: %s' % (n, off, errname(m.error) if m.is_error else len(m.payload)))
            R.check(not bad, acc, 'BAR%d: reads of 1-8 bytes at every offset within the BAR accepted (36 shapes)' % b, bad[:6])
            bad = []
            for off in range(8):
                for n in range(1, 9 - off):
                    m = c.request(REGION_WRITE, struct.pack('<QII', off, p.bar, n) + bytes(n))
                    if m.is_error:
                        bad.append('write %d@%d: %s' % (n, off, errname(m.error)))
            R.check(not bad, acc, 'BAR%d: writes of 1-8 bytes (zeros) at every offset within the BAR accepted' % b, bad[:6])
            c.reset()
            # refusals touch nothing
            p.setup(fcr=0x07)
            p.wr(SCR, 0x5a)
            p.thr(ord('Q'))
            refusals = [
                (REGION_READ, 0, 0, b'', 'read of 0 bytes at 0'), (REGION_READ, 7, 0, b'', 'read of 0 bytes at 7'),
                (REGION_READ, 8, 0, b'', 'read of 0 bytes at 8 (the end)'),
                (REGION_READ, 0, 9, b'', 'read of 9 bytes at 0'), (REGION_READ, 0, 16, b'', 'read of 16 bytes at 0'),
                (REGION_READ, 7, 2, b'', 'read of 2 bytes at 7 (past the end)'), (REGION_READ, 8, 1, b'', 'read at 8'),
                (REGION_READ, 1 << 40, 1, b'', 'read at 2^40'), (REGION_READ, (1 << 64) - 1, 2, b'', 'read wrapping the offset'),
                (REGION_WRITE, 0, 0, b'', 'write of 0 bytes at 0'), (REGION_WRITE, 7, 0, b'', 'write of 0 bytes at 7'),
                (REGION_WRITE, 0, 9, b'\x41' * 7 + b'\x11\x11', 'write of 9 bytes at 0'),
                (REGION_WRITE, 6, 3, b'\x00\x11\x11', 'write of 3 bytes at 6 (past the end)'),
                (REGION_WRITE, 8, 1, b'\x11', 'write at 8'),
            ]
            for cmd, off, n, data, what in refusals:
                payload = struct.pack('<QII', off, p.bar, n) + (data if cmd == REGION_WRITE else b'')
                R.errno(c.errno_of(cmd, payload), E.EINVAL, both(acc, VU('Commands', 'REGION_READ')), 'BAR%d: %s' % (b, what))
            lsr = p.lsr()
            R.eq((p.rd(SCR), lsr & LSR_DR), (0x5a, 1), acc, 'BAR%d: the refused accesses touched no register (SCR kept, RX byte kept)' % b)
            got, _ = p.recv(2, stop_when_empty=True)
            R.eq(got, b'Q', acc, 'BAR%d: the refused reads popped nothing and the refused writes transmitted nothing' % b)
            c.reset()
        # absent regions
        absent = [(BAR1, 'BAR1')] if typ == 'mtty-1' else []
        absent += [(BAR2, 'BAR2'), (BAR3, 'BAR3'), (BAR4, 'BAR4'), (BAR5, 'BAR5'), (ROM, 'ROM'), (VGA, 'VGA')]
        for idx, name in absent:
            R.errno(c.errno_of(REGION_READ, struct.pack('<QII', 0, idx, 1)), E.EPERM, acc, 'read of 1 byte at 0 of absent %s' % name)
            R.errno(c.errno_of(REGION_WRITE, struct.pack('<QII', 0, idx, 1) + b'\0'), E.EPERM, acc, 'write of 1 byte at 0 of absent %s' % name)
        R.errno(c.errno_of(REGION_READ, struct.pack('<QII', 0, 9, 1)), E.EINVAL, VU('Commands', 'REGION_READ'), 'read of region 9 (bad region)')

        # wide accesses: byte accesses lowest address first, each with its side effects
        p = Port(c, nports - 1)
        c.reset()
        p.setup(fcr=0x07, ier=IER_RDI | IER_RLSI)
        p.send(b'AB')
        v = c.region_read(p.bar, 0, 2)
        R.eq(bytes(v), b'A\x05', acc, '2-byte read at 0: pops RBR, then reads IER')
        R.eq(p.rbr(), ord('B'), acc, '... and popped exactly one byte')
        c.reset()
        p.wr(SCR, 0x5a)
        v = c.region_read(p.bar, 0, 8)
        R.eq(list(v), [0, 0, 0x01, 0, 0, 0x60, 0xb3, 0x5a], acc, '8-byte read at 0 after a reset: RBR IER IIR LCR MCR LSR MSR SCR')
        R.eq(p.msr(), 0xb0, acc, '... the MSR byte of the wide read cleared the deltas')
        c.reset()
        p.wr(LCR, 0x83)
        c.region_write(p.bar, 0, bytes([0x34, 0x12, 0x00, 0x03]))
        R.eq((p.rd(LCR), p.get_div()), (0x03, 0x1234), acc,
             '4-byte write at 0 with DLAB set, LCR byte 0x03: DLL, DLM written before LCR clears DLAB')
        p.wr(FCR, 0x07)
        c.region_write(p.bar, 0, bytes([0x41, 0x00, 0x01, 0x83]))
        lcr = p.rd(LCR)
        p.wr(LCR, 0x03)
        R.eq((lcr, p.get_div(), p.rbr()), (0x83, 0x1234, 0x41), acc,
             '4-byte write at 0 with DLAB clear, LCR byte 0x83: THR transmits (loopback) before LCR sets DLAB; divisor untouched')
        c.region_write(p.bar, 5, bytes([0xff, 0xff, 0x77]))
        R.eq((p.lsr(), p.msr(), p.rd(SCR)), (0x60, 0xb3, 0x77), acc, '3-byte write at 5: LSR and MSR ignored, SCR written (MSR: first read after the reset)')
        R.eq(c.rd(p.bar, 5, 2), 0x60 | 0xb0 << 8, acc, '2-byte read at 5: LSR, MSR')
        p.setup(fcr=0x07, ier=IER_THRI)
        v = c.region_read(p.bar, 0, 3)
        R.eq((v[2], p.iir()), (0xc2, 0xc1), acc, '3-byte read at 0 with THRE pending: its IIR byte reports THRE and clears it')
        p.wr(IER, 0)
        p.send(bytes(17))
        v = c.region_read(p.bar, 4, 2)
        R.eq((v[1] & LSR_OE, p.lsr() & LSR_OE), (LSR_OE, 0), acc, '2-byte read at 4 after an overrun: its LSR byte shows OE and clears it')
        p.drain()
        for b in b'posted':
            c.region_write(p.bar, THR, bytes([b]), posted=True)
        c.region_write(p.bar, SCR, b'\x99', posted=True)
        R.eq((p.rd(SCR), p.drain()), (0x99, b'posted'), VU('Commands', 'REGION_WRITE'),
             'posted (NO_REPLY) THR and SCR writes: applied in order before the next request')
        c.reset()
        c.close()


# ######################################################################
# mtty.md § Registers (per port)
# ######################################################################
def each_port(env):
    for key, typ in (('m1', 'mtty-1'), ('m2', 'mtty-2')):
        for i in range(ports_of(typ)):
            yield key, typ, i


def t_regs(env):
    regs = MT(S_REGS)
    for key, typ, i in each_port(env):
        R.sec('Registers of %s port %d (mtty.md § Registers (per port))' % (typ, i))
        c = session(env.server(key))
        p = Port(c, i)
        tag = '%s p%d: ' % (typ, i)
        # a new client finds the device as after a reset
        vals = [p.rd(o) for o in (IER, IIR, LCR, MCR, LSR, MSR, MSR, SCR, RBR)]
        R.eq(vals, [0, 0x01, 0, 0, 0x60, 0xb3, 0xb0, 0, 0], both(regs, MT(S_RST)),
             tag + 'power-on IER IIR LCR MCR LSR MSR(first) MSR(second) SCR RBR(empty)')
        R.eq(p.get_div(), 0, both(regs, MT(S_RST)), tag + 'divisor 0 at power-on')
        for v in (0xff, 0x00, 0xa5, 0x5a):
            p.wr(SCR, v)
            R.eq(p.rd(SCR), v, regs, tag + 'SCR read-write %#x' % v)
        p.wr(IER, 0xff)
        R.eq(p.rd(IER), 0x0f, regs, tag + 'IER after writing 0xff: 4 bits, the upper 4 read 0')
        p.wr(IER, 0x00)
        R.eq(p.rd(IER), 0, regs, tag + 'IER 0')
        for v in (0x3f, 0x1b, 0xbf, 0x03):
            p.wr(LCR, v)
            R.eq(p.rd(LCR), v, regs, tag + 'LCR stores all 8 bits (%#x)' % v)
        p.wr(MCR, 0xef)
        R.eq(p.rd(MCR), 0x0f, regs, tag + 'MCR after writing 0xef: bits 0-3, bits 5-7 read 0')
        p.wr(MCR, 0xff)
        R.eq(p.rd(MCR), 0x1f, regs, tag + 'MCR after writing 0xff: bits 0-4 (LOOP)')
        p.wr(MCR, 0)
        p.msr()
        p.wr(LSR, 0xff)
        R.eq(p.lsr(), 0x60, regs, tag + 'a write to LSR is ignored (0xff)')
        p.wr(LSR, 0x00)
        R.eq(p.lsr(), 0x60, regs, tag + 'a write to LSR is ignored (0x00)')
        p.wr(MSR, 0xff)
        R.eq(p.msr(), 0xb0, regs, tag + 'a write to MSR is ignored')
        p.wr(MSR, 0x00)
        R.eq(p.msr(), 0xb0, regs, tag + 'a write to MSR is ignored (0x00)')
        p.wr(FCR, 0x01)
        R.eq(p.iir(), 0xc1, regs, tag + 'offset 2 reads IIR (FCR is write-only): 0xc1 with FIFOs on')
        p.wr(FCR, 0x00)
        R.eq(p.iir(), 0x01, regs, tag + 'IIR 0x01 with FIFOs off')
        # DLAB and the divisor latch
        p.wr(LCR, 0x83)
        p.wr(DLL, 0x0f)
        p.wr(DLM, 0xf0)
        R.eq((p.rd(DLL), p.rd(DLM)), (0x0f, 0xf0), regs, tag + 'DLL/DLM read-write with DLAB')
        p.wr(DLL, 0xf0)
        p.wr(DLM, 0x0f)
        R.eq((p.rd(DLL), p.rd(DLM)), (0xf0, 0x0f), both(regs, MT(S_DIFF)), tag + 'DLL/DLM writes replace their byte (no OR)')
        p.wr(LCR, 0x03)
        R.eq((p.rd(IER), p.rd(RBR)), (0, 0), regs, tag + 'DLAB clear: offsets 0/1 are RBR/IER again (divisor bytes not seen)')
        p.wr(LCR, 0x83)
        R.eq((p.rd(DLL), p.rd(DLM)), (0xf0, 0x0f), regs, tag + 'clearing and setting DLAB leaves the divisor')
        p.wr(LCR, 0x80)
        R.eq((p.rd(DLL), p.rd(DLM)), (0xf0, 0x0f), both(regs, MT(S_DIFF)), tag + 'an LCR write with DLAB set leaves the divisor')
        # DLAB=1: offsets 2-7 as DLAB=0
        p.wr(LCR, 0x83)
        p.wr(FCR, 0x01)
        R.eq(p.iir(), 0xc1, regs, tag + 'DLAB=1: FCR writable and IIR readable at offset 2')
        p.wr(SCR, 0x3c)
        p.wr(MCR, 0x03)
        R.eq((p.rd(SCR), p.rd(MCR), p.rd(LSR), p.rd(LCR)), (0x3c, 0x03, 0x60, 0x83), regs, tag + 'DLAB=1: SCR, MCR, LSR, LCR as DLAB=0')
        p.wr(DLM, 0x0f)
        p.wr(DLL, 0x41)     # not a transmission
        p.wr(LCR, 0x03)
        R.eq((p.rd(IER), p.lsr() & LSR_DR), (0, 0), regs, tag + 'DLAB=1: writing offset 0/1 sets DLL/DLM, not THR (nothing received) or IER')
        p.thr(ord('Z'))
        p.wr(LCR, 0x83)
        R.eq(p.rd(DLL), 0x41, regs, tag + 'DLAB=1: offset 0 reads DLL')
        p.wr(LCR, 0x03)
        R.eq(p.rbr(), ord('Z'), regs, tag + '... and did not pop the received byte')
        # empty RBR: the last byte read
        R.eq((p.rbr(), p.rbr()), (ord('Z'), ord('Z')), regs, tag + 'an empty receiver returns the last byte read')
        c.reset()
        R.eq(p.rbr(), 0, both(regs, MT(S_RST)), tag + 'an empty receiver returns 0 after a reset')
        if typ == 'mtty-2':
            q = Port(c, 1 - i)
            p.wr(SCR, 0x11)
            q.wr(SCR, 0x22)
            p.setup(fcr=0x07)
            q.setup(fcr=0x07)
            p.thr(ord('x'))
            R.eq((p.rd(SCR), q.rd(SCR), p.lsr() & 1, q.lsr() & 1), (0x11, 0x22, 1, 0), both(regs, MT(S_BE, 'Loopback')),
                 tag + 'ports are independent: own SCR; a byte loops back to its own port only')
            c.reset()
        c.close()


# ######################################################################
# mtty.md § Receiver, § Registers: FCR, THR, LCR word length
# ######################################################################
def t_rx(env):
    rx = MT(S_RX)
    regs = MT(S_REGS)
    for key, typ, i in each_port(env):
        R.sec('Receiver and FCR of %s port %d, loopback (mtty.md § Receiver, § Registers: FCR, THR, LCR)' % (typ, i))
        c = session(env.server(key))
        p = Port(c, i)
        tag = '%s p%d: ' % (typ, i)
        # 16450 mode
        p.setup(fcr=0x00)
        p.thr(ord('A'))
        R.eq(p.lsr(), 0x61, both(rx, MT(S_BE, 'Loopback')), tag + '16450: a byte transmitted is received: LSR DR|THRE|TEMT')
        R.eq(p.rbr(), ord('A'), rx, tag + '16450: RBR returns it')
        R.eq(p.lsr(), 0x60, rx, tag + '16450: LSR DR clear once read')
        p.thr(ord('A'))
        p.thr(ord('B'))
        R.eq(p.lsr(), 0x63, rx, tag + '16450: a second unread byte overruns (OE) -- capacity 1')
        R.eq(p.lsr(), 0x61, rx, tag + 'OE reported once (cleared by the LSR read)')
        R.eq(p.rbr(), ord('B'), rx, tag + '16450: the new byte overwrote the unread one')
        R.eq(p.iir(), 0x01, regs, tag + '16450: IIR bits 7:6 clear')
        for lcr, want in ((0x00, 0x1f), (0x01, 0x3f), (0x02, 0x7f), (0x03, 0xff), (0x1e, 0x7f), (0x3c, 0x1f)):
            p.wr(LCR, lcr)
            p.thr(0xff)
            R.eq(p.rbr(), want, regs, tag + 'LCR %#04x: THR 0xff masked to the word length -> %#x' % (lcr, want))
        p.wr(LCR, 0x03)
        # FCR ignored without bit 0
        p.thr(ord('C'))
        p.wr(FCR, 0x02)
        p.wr(FCR, 0xc6)
        R.eq((p.lsr() & LSR_DR, p.iir()), (1, 0x01), regs, tag + 'FCR without bit 0 (0x02, 0xc6) ignored: the byte stays, 16450 mode')
        p.wr(FCR, 0x01)
        R.eq((p.lsr() & LSR_DR, p.iir()), (0, 0xc1), regs, tag + 'FCR bit 0 set: FIFO mode (IIR 0xc1), the receiver emptied')
        # FIFO mode
        data = bytes(range(0x30, 0x40))
        p.send(data)
        R.eq(p.lsr(), 0x61, rx, tag + 'FIFO: 16 bytes held, no overrun')
        p.thr(ord('!'))
        R.eq(p.lsr(), 0x63, rx, tag + 'FIFO: the 17th byte overruns (OE)')
        got, seen = p.recv(32, stop_when_empty=True)
        R.eq(got, data, rx, tag + 'FIFO: the 16 bytes kept, in order; the new byte lost')
        p.send(data + b'xyz')
        R.eq(p.lsr() & LSR_OE, LSR_OE, rx, tag + 'three bytes lost: OE')
        R.eq(p.lsr() & LSR_OE, 0, rx, tag + '... reported once however many were lost')
        p.thr(ord('w'))
        R.eq(p.lsr() & LSR_OE, LSR_OE, rx, tag + 'a loss after that read sets OE again')
        R.eq(p.drain(), data, rx, tag + 'the FIFO kept its first 16 bytes')
        p.send(b'abc')
        p.wr(FCR, 0x03)
        R.eq((p.lsr(), p.iir()), (0x60, 0xc1), regs, tag + 'FCR bit 1 clears the RX FIFO (loopback characters discarded)')
        p.send(b'abc')
        p.wr(FCR, 0x05)
        R.eq(p.drain(), b'abc', regs, tag + 'FCR bit 2 (TX clear) leaves the RX FIFO')
        p.send(b'abc')
        p.wr(FCR, 0x00)
        R.eq((p.lsr(), p.iir()), (0x60, 0x01), regs, tag + 'clearing FCR bit 0 empties the receiver (16450 mode)')
        p.thr(ord('d'))
        p.wr(FCR, 0x01)
        R.eq(p.lsr(), 0x60, regs, tag + 'setting FCR bit 0 empties the receiver')
        p.send(b'ef')
        p.wr(FCR, 0x01)
        R.eq(p.drain(), b'ef', regs, tag + 'FCR rewritten with bit 0 unchanged and no clear bits keeps the FIFO')
        # trigger levels: divisor 0 (4 character times = 22.8 s), so no timeout meanwhile
        p.set_div(0)
        ct4 = 4 * char_time(0x03, 0)
        for bits, lvl in ((0, 1), (1, 4), (2, 8), (3, 14)):
            p.wr(IER, 0)
            p.wr(FCR, 0x07 | bits << 6)
            p.wr(IER, IER_RDI)
            t0 = time.monotonic()
            p.send(bytes(range(0x61, 0x61 + lvl - 1)))
            iir = p.iir()
            void_or_check(t0, ct4, iir == 0xc1, rx, tag + 'trigger %d: %d byte(s) below it: no RDA, no timeout yet (IIR 0xc1)' % (lvl, lvl - 1), hex(iir))
            t0 = time.monotonic()
            p.thr(0x61 + lvl - 1)
            R.eq(p.iir(), 0xc4, both(rx, MT(S_PRIO)), tag + 'trigger %d: the %dth byte raises RDA (IIR 0xc4)' % (lvl, lvl))
            t0 = time.monotonic()
            b = p.rbr()
            iir = p.iir()
            void_or_check(t0, ct4, iir == 0xc1 and b == 0x61, MT(S_PRIO), tag + 'trigger %d: reading RBR below the level clears RDA (IIR 0xc1)' % lvl,
                          (hex(iir), b))
            p.drain()
        p.wr(IER, 0)
        p.wr(FCR, 0x09)
        p.wr(IER, IER_RDI)
        p.thr(ord('q'))
        R.eq(p.iir(), 0xc4, regs, tag + 'FCR 0x09 (DMA mode bit) behaves as 0x01: trigger 1')
        p.wr(IER, 0)
        R.eq(p.iir(), 0xc1, MT(S_PRIO), tag + 'RDA pending but RDI clear: IIR shows nothing (0xc1)')
        p.wr(IER, IER_RDI)
        R.eq(p.iir(), 0xc4, MT(S_PRIO), tag + '... and RDA again once RDI is set')
        p.drain()
        p.wr(FCR, 0)
        p.thr(ord('r'))
        R.eq(p.iir(), 0x04, MT(S_PRIO), tag + '16450 mode: one byte raises RDA (IIR 0x04)')
        p.rbr()
        R.eq(p.iir(), 0x01, MT(S_PRIO), tag + '16450 mode: reading RBR clears it')
        c.reset()
        c.close()


# ######################################################################
# mtty.md § Receiver: character timeout
# ######################################################################
def first_timeout(p, t0, limit=None):
    """Poll IIR until it reads the timeout (0xcc); returns the monotonic time its reply came
    (None if it never came)."""
    deadline = time.monotonic() + (vu.WAIT if limit is None else limit)
    while time.monotonic() < deadline:
        if p.iir() == 0xcc:
            return time.monotonic()
        time.sleep(0.001)
    return None


def t_timeout(env):
    R.sec('Character timeout (mtty.md § Receiver: FIFO, overrun, character timeout)')
    to = MT(S_RX, 'Character timeout')
    c = session(env.server('m1'))
    p = Port(c, 0)
    # fires (divisor 1: 347 us)
    p.setup(fcr=0x47, ier=IER_RDI, div=1)       # trigger 4
    p.thr(ord('a'))
    t = first_timeout(p, time.monotonic())
    R.check(t is not None, to, 'FIFO mode, 1 byte below trigger 4, RDI set: the timeout fires (IIR 0xcc)')
    R.eq(p.iir(), 0xcc, MT(S_PRIO), 'reading IIR does not clear the timeout')
    R.eq(p.lsr(), 0x61, MT(S_PRIO), 'LSR read (DR)')
    R.eq(p.iir(), 0xcc, MT(S_PRIO), 'reading LSR does not clear the timeout')
    R.eq(p.rbr(), ord('a'), to, 'RBR')
    R.eq(p.iir(), 0xc1, to, 'reading RBR (the receiver now empty): no timeout')
    p.wr(IER, 0)
    p.thr(ord('b'))
    c.barrier()
    time.sleep(0.01)
    R.eq(p.iir(), 0xc1, MT(S_PRIO), 'RDI clear: the timeout is not shown')
    p.wr(IER, IER_RDI)
    R.check(wait_until(lambda: p.iir() == 0xcc), MT(S_PRIO), 'RDI set again with data below the trigger: the timeout is shown')
    p.wr(IER, 0)
    p.wr(FCR, 0x07)     # trigger 1
    p.wr(IER, IER_RDI)
    p.thr(ord('c'))
    c.barrier()
    time.sleep(0.01)
    R.eq(p.iir(), 0xc4, to, 'at the trigger level (1): RDA, never the timeout (after 28 character times)')
    p.drain()
    p.wr(FCR, 0x00)
    p.thr(ord('d'))
    c.barrier()
    time.sleep(0.01)
    R.eq(p.iir(), 0x04, to, '16450 mode: no timeout (RDA 0x04 after 28 character times)')
    p.drain()

    # divisor 0 divides by 65536: 4 character times are 22.8 s
    p.setup(fcr=0x47, ier=IER_RDI, div=0)
    t0 = time.monotonic()
    p.thr(ord('z'))
    time.sleep(0.1)
    iir = p.iir()
    void_or_check(t0, 4 * char_time(0x03, 0), iir == 0xc1, both(to, MT(S_REGS, 'DLL/DLM')),
                  'divisor 0 (65536): no timeout 0.1 s after a byte (4 character times are 22.8 s)', hex(iir))
    p.drain()
    # clearing: RBR read, receiving a byte, any FCR write (divisor 576: 4 character times 0.2 s at 8N1)
    d = 576
    p.setup(fcr=0x87, ier=IER_RDI, div=d)     # trigger 8
    ct4 = 4 * char_time(0x03, d)
    p.send(b'123')
    wait_until(lambda: p.iir() == 0xcc)
    t0 = time.monotonic()
    b = p.rbr()
    iir = p.iir()
    void_or_check(t0, ct4, iir == 0xc1 and b == ord('1'), to, 'reading RBR clears the timeout (IIR 0xc1 at once)', (hex(iir), b))
    t = first_timeout(p, t0)
    R.check(t is not None and t - t0 >= ct4, to, 'reading RBR restarts the timer: the timeout again, not before 4 character times (%.3f s)' % ct4,
            None if t is None else '%.3f s' % (t - t0))
    t0 = time.monotonic()
    p.thr(ord('4'))
    iir = p.iir()
    void_or_check(t0, ct4, iir == 0xc1, to, 'receiving a byte clears the timeout ("as does receiving a byte")', hex(iir))
    t = first_timeout(p, t0)
    R.check(t is not None and t - t0 >= ct4, to, 'receiving a byte restarts the timer (not before 4 character times)',
            None if t is None else '%.3f s' % (t - t0))
    t0 = time.monotonic()
    p.wr(FCR, 0x81)     # changes nothing
    iir = p.iir()
    void_or_check(t0, ct4, iir == 0xc1, to, 'an FCR write that changes nothing clears the timeout', hex(iir))
    R.eq(p.lsr() & LSR_DR, 1, to, '... and keeps the data')
    t = first_timeout(p, t0)
    R.check(t is not None and t - t0 >= ct4, to, 'an FCR write restarts the timer (not before 4 character times)',
            None if t is None else '%.3f s' % (t - t0))
    p.drain()
    # lower bounds at three line settings
    for lcr in (0x03, 0x1f, 0x00, 0x04):
        p.wr(LCR, lcr)
        p.wr(FCR, 0x87)
        ct4 = 4 * char_time(lcr, d)
        t0 = time.monotonic()
        p.thr(ord('5'))
        t = first_timeout(p, t0)
        R.check(t is not None and t - t0 >= ct4, to, 'LCR %#04x divisor %d: the timeout fires, not before 4 character times (%.3f s)' % (lcr, d, ct4),
                None if t is None else '%.3f s' % (t - t0))
        # a second byte during the count restarts it
        p.drain()
        t0 = time.monotonic()
        p.thr(ord('6'))
        time.sleep(ct4 / 2)
        t1 = time.monotonic()
        p.thr(ord('7'))
        t = first_timeout(p, t0)
        R.check(t is not None and t - t1 >= ct4, to, 'LCR %#04x: a byte received during the count restarts it (not before 4 character times after it)' % lcr,
                None if t is None else '%.3f s after the second byte' % (t - t1))
        p.drain()
    c.reset()
    c.close()


# ######################################################################
# mtty.md § Registers: LCR (break), LSR
# ######################################################################
def t_lsr(env):
    R.sec('Breaks, LSR BI and bit 7 (mtty.md § Registers (per port): LCR, LSR)')
    lcr_ref = MT(S_REGS, 'LCR (Break)')
    lsr_ref = MT(S_REGS, 'LSR')
    c = session(env.server('m1'))
    p = Port(c, 0)
    p.setup(fcr=0x07, ier=IER_RLSI)
    p.wr(LCR, 0x43)
    R.eq(p.iir(), 0xc6, MT(S_PRIO), 'a break at the top of the FIFO with RLSI: IIR 0xc6')
    R.eq(p.lsr(), 0xf1, both(lcr_ref, lsr_ref), 'break on loopback: LSR DR|BI|bit 7|THRE|TEMT (0xf1)')
    R.check(p.iir() != 0xc6, MT(S_PRIO), 'reading LSR clears the line status interrupt', hex(p.iir()))
    lsr2 = p.lsr()
    R.eq(lsr2 & (LSR_BI | LSR_DR), LSR_DR, lsr_ref, 'reading LSR cleared the BI of the top character (DR stays)')
    R.note(lsr_ref, 'LSR bit 7 after the LSR read cleared the only break\'s BI: %s (the doc does not say whether that character still counts as "a break")'
           % ('set' if lsr2 & 0x80 else 'clear'))
    R.eq(p.rbr(), 0, lsr_ref, 'the next RBR read still returns the break\'s zero byte')
    R.eq(p.lsr(), 0x60, lsr_ref, 'the receiver empty, no bit 7')
    p.thr(ord('X'))
    c.barrier()
    R.eq(p.lsr(), 0x60, lcr_ref, 'while SBC stays set, a byte written to THR is lost on the line (THRE as usual)')
    p.wr(LCR, 0x43)
    R.eq(p.lsr(), 0x60, lcr_ref, 'writing LCR with SBC still set sends no new break')
    p.wr(LCR, 0x03)
    p.thr(ord('a'))
    p.wr(LCR, 0x43)
    R.eq(p.lsr(), 0xe1, lsr_ref, 'a break behind a byte: DR and bit 7, BI clear (the top is the byte)')
    R.eq(p.rbr(), ord('a'), lsr_ref, 'the byte first')
    R.eq(p.lsr(), 0xf1, lsr_ref, 'then the break at the top: BI, bit 7')
    R.eq(p.rbr(), 0, lsr_ref, 'its zero byte')
    p.wr(LCR, 0x03)
    p.wr(LCR, 0x43)
    p.wr(LCR, 0x03)
    p.wr(LCR, 0x43)
    got, seen = p.recv(4, stop_when_empty=True, fast=False)
    R.eq(got, b'\0\0', lcr_ref, 'clear the bit and set it again: another break (two breaks, two zero bytes)')
    p.wr(LCR, 0x03)
    p.wr(FCR, 0)
    p.wr(LCR, 0x43)
    R.eq(p.lsr(), 0x71, lsr_ref, '16450 mode: break -> DR|BI|THRE|TEMT, no bit 7 (FIFO mode only)')
    p.rbr()
    p.wr(LCR, 0x03)
    # MCR loopback: bytes still arrive under SBC
    p.wr(FCR, 0x07)
    p.wr(MCR, MCR_LOOP)
    p.wr(LCR, 0x43)
    p.thr(ord('Y'))
    got, seen = p.recv(4, stop_when_empty=True, fast=False)
    R.eq(got, b'\0Y', both(lcr_ref, MT(S_TX, 'MCR loopback')), 'MCR loopback: a break character, and bytes written under SBC still arrive')
    p.wr(LCR, 0x03)
    p.wr(MCR, 0)
    # OE + break: RLS for both
    p.send(bytes(17))
    R.eq(p.iir(), 0xc6, MT(S_PRIO), 'OE with RLSI: IIR 0xc6')
    p.lsr()
    R.eq(p.iir(), 0xc1, MT(S_PRIO), 'reading LSR clears it')
    p.drain()
    c.reset()
    c.close()
    # null backend: no break arrives
    c = session(env.server('null'))
    p = Port(c, 0)
    p.setup(fcr=0x07)
    p.wr(LCR, 0x43)
    c.barrier()
    R.eq(p.lsr(), 0x60, both(lcr_ref, MT(S_BE)), 'null backend: a break arrives nowhere (no BI, no DR)')
    c.reset()
    c.close()


# ######################################################################
# mtty.md § Interrupt conditions and priority; IER; THRE
# ######################################################################
def t_iir(env):
    R.sec('IIR priorities, THRE (mtty.md § Interrupt conditions and priority, § Registers: IER, IIR, THR)')
    prio = MT(S_PRIO)
    regs = MT(S_REGS)
    c = session(env.server('m2'))
    for i in (0, 1):
        p = Port(c, i)
        tag = 'p%d: ' % i
        c.reset()
        p.setup(fcr=0x00)
        p.wr(IER, IER_THRI)
        R.eq(p.iir(), 0x02, regs, tag + 'enabling THRI with the transmitter empty raises THRE at once (IIR 0x02)')
        R.eq(p.iir(), 0x01, regs, tag + 'reading IIR when it reports THRE clears THRE')
        p.thr(ord('a'))
        R.eq(p.iir(), 0x02, both(regs, MT(S_TX)), tag + 'a THR write: THRE again (the byte left at once)')
        p.wr(IER, 0)
        p.wr(IER, IER_THRI)
        R.eq(p.iir(), 0x02, regs, tag + 'THRI cleared and set again: THRE raised again')
        p.wr(IER, 0)
        R.eq(p.iir(), 0x01, regs, tag + 'clearing THRI: no THRE shown')
        p.rbr()
        # the full chain, FIFO mode, trigger 1
        c.reset()
        p.setup(fcr=0x07, ier=0x0f)
        p.send(bytes(range(0x40, 0x51)))            # 17 bytes: 16 + 1 overrun
        R.eq(p.iir(), 0xc6, prio, tag + 'OE, RDA, THRE and modem status pending: IIR 0xc6 (line status first)')
        R.eq(p.iir(), 0xc6, prio, tag + 'reading IIR does not clear line status')
        R.eq(p.lsr(), 0x63, prio, tag + 'LSR: OE')
        R.eq(p.iir(), 0xc4, prio, tag + 'then RDA (0xc4)')
        got = bytes(p.rbr() for _ in range(15))
        R.eq(p.iir(), 0xc4, prio, tag + 'RDA while a byte remains (trigger 1)')
        got += bytes([p.rbr()])
        R.eq(got, bytes(range(0x40, 0x50)), MT(S_RX), tag + 'the 16 bytes in order')
        R.eq(p.iir(), 0xc2, prio, tag + 'the receiver empty: THRE (0xc2) -- not cleared by the earlier IIR reads')
        R.eq(p.iir(), 0xc0, prio, tag + 'THRE cleared by that read: modem status (0xc0, power-on deltas)')
        R.eq(p.msr(), 0xb3, regs, tag + 'MSR 0xb3 (first read after the reset)')
        R.eq(p.iir(), 0xc1, prio, tag + 'reading MSR clears modem status: none (0xc1)')
        # 16450 chain
        c.reset()
        p.setup(fcr=0x00, ier=0x0f)
        p.send(b'AB')
        R.eq(p.iir(), 0x06, prio, tag + '16450: line status (OE) first (0x06)')
        p.lsr()
        R.eq(p.iir(), 0x04, prio, tag + '16450: RDA (0x04)')
        R.eq(p.rbr(), ord('B'), MT(S_RX), tag + '16450: the later byte')
        R.eq(p.iir(), 0x02, prio, tag + '16450: THRE (0x02)')
        R.eq(p.iir(), 0x00, prio, tag + '16450: modem status (0x00)')
        p.msr()
        R.eq(p.iir(), 0x01, prio, tag + '16450: none (0x01)')
        # the other port sees none of this
        q = Port(c, 1 - i)
        p.wr(IER, 0x0f)
        R.eq(q.iir(), 0x01, prio, tag + 'the other port\'s IIR shows none of this port\'s conditions')
    c.reset()
    c.close()


# ######################################################################
# mtty.md § Registers: MCR, MSR; § The transmitter and the line: MCR loopback
# ######################################################################
def t_modem(env):
    msr_ref = MT(S_REGS, 'MSR')
    loop = MT(S_TX, 'MCR loopback')
    for key in ('m1', 'null'):
        R.sec('MCR and MSR on %s (mtty.md § Registers: MCR, MSR; § The transmitter and the line)' % key)
        c = session(env.server(key))
        p = Port(c, 0)
        c.reset()
        R.eq([p.msr() for _ in range(3)], [0xb3, 0xb0, 0xb0], msr_ref, 'MSR after a reset: 0xb3 once, then 0xb0')
        p.wr(IER, IER_MSI)
        for mcr in (0x0f, 0x01, 0x02, 0x04, 0x08, 0x00):
            p.wr(MCR, mcr)
            R.eq((p.msr(), p.iir()), (0xb0, 0x01), both(msr_ref, MT(S_DIFF)),
                 'outside loopback, MCR %#04x: a ready peer (0xb0), no delta, no modem interrupt' % mcr)
        steps = [(0x10, 0x0b, 'LOOP, outputs off: CTS, DSR, DCD fall (deltas), RI stays low'),
                 (0x12, 0x11, 'LOOP|RTS: CTS rises'),
                 (0x11, 0x23, 'LOOP|DTR: CTS falls, DSR rises'),
                 (0x14, 0x42, 'LOOP|OUT1: DSR falls, RI rises (no TERI on a rise)'),
                 (0x18, 0x8c, 'LOOP|OUT2: RI falls (TERI), DCD rises'),
                 (0x1f, 0xf3, 'LOOP, all outputs: CTS, DSR, RI rise'),
                 (0x1b, 0xb4, 'LOOP without OUT1: RI falls (TERI)'),
                 (0x1f, 0xf0, 'LOOP, all outputs again: RI rises (no delta bit for a rise)'),
                 (0x00, 0xb4, 'leaving loopback: a ready peer again; RI falls (TERI)')]
        for mcr, want, what in steps:
            p.wr(MCR, mcr)
            iir = p.iir()
            R.eq(p.msr(), want, both(msr_ref, loop), 'MCR %#04x: %s' % (mcr, what))
            R.eq(iir, 0x00 if want & 0x0f else 0x01, both(MT(S_PRIO), msr_ref), 'MCR %#04x: modem status interrupt iff a delta' % mcr)
            R.eq(p.msr(), want & 0xf0, msr_ref, 'MCR %#04x: reading MSR cleared the deltas' % mcr)
        p.wr(IER, 0)
        p.setup(fcr=0x07, mcr=MCR_LOOP)
        p.msr()
        p.send(b'loop')
        R.eq(p.drain(), b'loop', loop, 'MCR loopback on the %s backend: transmitted bytes arrive on the receiver' % key)
        p.wr(MCR, 0)
        p.msr()
        p.send(b'line')
        c.barrier()
        if key == 'null':
            R.eq(p.lsr(), 0x60, MT(S_BE), 'null backend: transmitted bytes vanish, nothing received')
        else:
            R.eq(p.drain(), b'line', MT(S_BE, 'Loopback'), 'loopback backend: transmitted bytes arrive on the same port')
        # OUT2 does not gate the interrupt
        p.wr(MCR, 0)
        p.wr(IER, IER_THRI)
        R.check(c.rd(CONFIG, 6, 2) & 8, both(MT(S_REGS, 'MCR'), MT(S_CFG, 'STATUS bit 3')), 'OUT2 clear: THRE still asserts INTx (PCI card)',
                hex(c.rd(CONFIG, 6, 2)))
        p.iir()
        R.eq(c.rd(CONFIG, 6, 2) & 8, 0, MT(S_CFG, 'STATUS bit 3'), 'STATUS bit 3 clear once no condition is pending')
        c.reset()
        c.close()


# ######################################################################
# mtty.md § Interrupts: INTx
# ######################################################################
def status_int(c):
    return bool(c.rd(CONFIG, 6, 2) & 8)


def msi_enable(c, command=0x0007):
    c.wr(CONFIG, 4, command, 2)
    c.wr(CONFIG, 0x44, 0xfee00000, 4)
    c.wr(CONFIG, 0x48, 0, 4)
    c.wr(CONFIG, 0x4c, 0x4021, 2)
    c.wr(CONFIG, 0x42, 0x0001, 2)


def unmask(c):
    c.set_irqs(INTX, DATA_NONE | ACTION_UNMASK, 0, 1)


def t_intx(env):
    R.sec('INTx (mtty.md § Interrupts, § Config space: STATUS bit 3)')
    intx = MT(S_IRQ, 'INTx')
    st3 = MT(S_CFG, 'STATUS bit 3')
    c = session(env.server('m2'))
    c.reset()
    p0, p1 = Port(c, 0), Port(c, 1)
    R.eq(status_int(c), False, st3, 'STATUS bit 3 clear at power-on')
    p0.wr(IER, IER_THRI)
    R.eq(status_int(c), True, st3, 'STATUS bit 3 reads 1 while a condition is pending (no eventfd wired)')
    p0.iir()
    R.eq(status_int(c), False, st3, 'STATUS bit 3 clear once the condition is cleared')
    ev = Ev()
    c.set_irqs(INTX, DATA_EVENTFD | ACTION_TRIGGER, 0, 1, fds=[ev.fd])
    R.eq(ev.take(0), 0, intx, 'wiring INTx with nothing pending: no signal')
    p0.wr(IER, 0)
    p0.wr(IER, IER_THRI)
    R.eq(ev.take(1), 1, intx, 'a condition becomes pending: one INTx signal')
    p1.wr(IER, IER_THRI)
    R.eq(ev.take(0), 0, intx, 'a second port\'s condition while asserted and automasked: no signal (one per assertion)')
    p0.iir()
    R.eq(status_int(c), True, both(intx, st3), 'the line is the OR of both ports: still asserted after port 0 was serviced')
    unmask(c)
    R.eq(ev.take(1), 1, intx, 'UNMASK while still asserted: fires again')
    p1.iir()
    R.eq(status_int(c), False, both(intx, st3), 'both ports serviced: deasserted')
    unmask(c)
    R.eq(ev.take(0), 0, intx, 'UNMASK with the line low: no signal')
    p0.wr(IER, 0)
    p0.setup(fcr=0x07, ier=IER_THRI)
    R.eq(ev.take(1), 1, intx, 'THRE again (THRI enabled by a driver\'s open): a signal')
    p0.iir()
    unmask(c)
    p0.wr(FCR, 0x05)
    iir = p0.iir()
    R.eq((iir, ev.take(0)), (0xc1, 0), both(MT(S_PRIO), MT(S_BE, 'FIFO resets keep host bytes')),
         'a TX FIFO clear (FCR 0x05) of an already-empty transmitter, THRE already read: no new THR-empty (IIR 0xc1, no signal)')
    p0.iir()
    unmask(c)
    p0.thr(ord('a'))
    R.eq(ev.take(1), 1, intx, 'a THR write re-raises THRE: a signal')
    p0.iir()
    unmask(c)
    cmd = c.rd(CONFIG, 4, 2)
    c.wr(CONFIG, 4, cmd | 0x400, 2)
    p0.thr(ord('b'))
    R.eq(ev.take(0), 0, intx, 'COMMAND INTx disable set: the signal is held back')
    R.eq(status_int(c), True, st3, 'STATUS bit 3 reads the level under INTx disable')
    c.wr(CONFIG, 4, cmd, 2)
    R.eq(ev.take(1), 1, intx, 'INTx disable cleared: the signal comes')
    p0.iir()
    unmask(c)
    c.region_write(p0.bar, 0, b'\x41\x00')
    R.eq((ev.take(0), status_int(c)), (0, False), both(intx, MT(S_REG, 'Access sizes')),
         'a 2-byte write at 0 (THR raises THRE, IER=0 drops it) within one access: no INTx signal, line low')
    p0.wr(IER, 0)
    p0.drain()
    # a timer-driven condition: the character timeout
    p1.setup(fcr=0x47, ier=IER_RDI, div=1)
    ev.take(0)
    p1.thr(ord('t'))
    R.eq(ev.take(1), 1, both(intx, MT(S_RX, 'Character timeout')), 'a character timeout expiring asserts INTx (no register access)')
    R.eq(p1.iir(), 0xcc, MT(S_RX), 'port 1 IIR: the timeout')
    p1.rbr()
    unmask(c)
    p1.wr(IER, 0)
    # a Linux 8250-style driver: INTx-driven, FIFO trigger 8, at most 16 bytes per THRE, drain on RDA/timeout
    p1.setup(fcr=0x81 | 0x06, ier=IER_RDI | IER_THRI | IER_RLSI, div=1)
    unmask(c)
    msg = pattern(2000, 21)
    sent, got, lsr_or, rounds = 0, bytearray(), 0, 0
    while len(got) < len(msg) and rounds < 100000:
        if not ev.take(1):
            break
        rounds += 1
        while True:
            iir = p1.iir()
            if iir & 1:
                break
            ident = iir & 0x0f
            if ident == IIR_RLS:
                lsr_or |= p1.lsr()
            elif ident in (IIR_RDA, IIR_TIMEOUT):
                b, _ = p1.recv(16, stop_when_empty=True, fast=False)
                got += b
            elif ident == IIR_THRE and sent < len(msg):
                p1.send(msg[sent:sent + 16])
                sent += min(16, len(msg) - sent)
            elif ident == IIR_MODEM:
                p1.msr()
        unmask(c)
    R.check(bytes(got) == msg and not lsr_or & LSR_OE, both(MT(S_BE, 'Loopback'), intx),
            'an 8250-style INTx driver (16 bytes per THRE, drain on RDA/timeout): 2000 bytes looped back in order, no overrun',
            '%d bytes in %d interrupts, OE %s' % (len(got), rounds, bool(lsr_or & LSR_OE)))
    p1.wr(IER, 0)
    ev.take(0)
    unmask(c)
    # INTx under MSI
    mev = Ev()
    c.set_irqs(MSI, DATA_EVENTFD | ACTION_TRIGGER, 0, 1, fds=[mev.fd])
    msi_enable(c)
    p0.wr(IER, IER_THRI)
    R.eq(mev.take(1), 1, MT(S_IRQ, 'MSI'), 'MSI enabled: the condition sends MSI')
    R.eq(ev.take(0), 0, intx, 'MSI enabled: INTx is not signalled')
    R.eq(status_int(c), True, both(intx, st3), 'STATUS bit 3 reads the INTx level under MSI too')
    c.wr(CONFIG, 0x42, 0, 2)
    R.eq(ev.take(1), 1, intx, 'MSI turned off with a condition pending: the INTx signal at once')
    p0.iir()
    unmask(c)
    c.set_irqs(INTX, DATA_EVENTFD | ACTION_TRIGGER, 0, 1)
    p0.thr(ord('c'))
    R.eq(ev.take(0), 0, VU('Commands', 'SET_IRQS'), 'INTx trigger de-assigned (zero-fd EVENTFD): no signal')
    c.reset()
    ev.close()
    mev.close()
    c.close()


# ######################################################################
# mtty.md § Interrupts: MSI
# ######################################################################
def t_msi(env):
    R.sec('MSI (mtty.md § Interrupts: MSI)')
    ms = MT(S_IRQ, 'MSI')
    c = session(env.server('m2'))
    c.reset()
    p0, p1 = Port(c, 0), Port(c, 1)
    ev = Ev()
    c.set_irqs(MSI, DATA_EVENTFD | ACTION_TRIGGER, 0, 1, fds=[ev.fd])
    msi_enable(c)
    R.eq(ev.take(0), 0, ms, 'enabling MSI with nothing pending: no message')
    p0.setup(fcr=0x07)
    p1.setup(fcr=0x07)
    R.eq(ev.take(0), 0, ms, 'a driver\'s open with IER 0: no message')
    p0.wr(IER, IER_THRI)
    R.eq(ev.take(1), 1, ms, 'THRE becomes pending: one message')
    R.eq(ev.take(0), 0, ms, '... exactly one')
    p0.rd(SCR)
    p0.lsr()
    R.eq(ev.take(0), 0, ms, 'accesses while the condition stays pending: nothing more')
    p0.thr(ord('a'))
    R.eq(ev.take(1), 1, ms, 'a THR write counts as new (clears THRE, the transmitter sets it): one message')
    p0.iir()
    R.eq(ev.take(0), 0, ms, 'reading IIR clears THRE: no message')
    p0.thr(ord('b'))
    R.eq(ev.take(1), 1, ms, 'THR write after the clear: one message')
    p1.wr(IER, IER_THRI)
    R.eq(ev.take(1), 1, ms, 'a new condition on the other port while port 0\'s is pending: one message')
    p1.iir()
    p1.wr(IER, 0)
    p0.msr()            # the power-on deltas
    p0.wr(IER, IER_THRI | IER_MSI)
    R.eq(ev.take(0), 0, ms, 'IER MSI enabled with no delta, THRE still pending: nothing')
    p0.wr(MCR, MCR_LOOP)
    R.eq(ev.take(1), 1, ms, 'a new condition (modem status: MCR loopback deltas) on a port whose THRE is pending: one message')
    p0.wr(MCR, 0)
    p0.msr()
    p0.wr(IER, IER_THRI)
    ev.take(0)
    p0.iir()
    c.region_write(p0.bar, 0, b'\x41\x00')
    R.eq(ev.take(0), 0, both(ms, MT(S_REG, 'Access sizes')),
         'a 2-byte write at 0 (THR raises THRE, IER=0 drops it) within one access: no message')
    p0.wr(IER, IER_THRI)
    R.eq(ev.take(1), 1, ms, '(control: enabling THRI again sends one)')
    p0.iir()
    p0.drain()
    # received data: loopback RDA
    p0.wr(IER, IER_RDI)
    p0.thr(ord('r'))
    R.eq(ev.take(1), 1, ms, 'RDA (a looped-back byte at trigger 1): one message')
    p0.rbr()
    p0.wr(IER, 0)
    # timer: the character timeout
    p1.setup(fcr=0x47, ier=IER_RDI, div=1)
    p1.thr(ord('t'))
    R.eq(ev.take(1), 1, both(ms, MT(S_RX, 'Character timeout')), 'a character timeout (timer) sends one message')
    R.eq(p1.iir(), 0xcc, MT(S_RX), '(IIR 0xcc)')
    p1.rbr()
    p1.wr(IER, 0)
    # bus mastering
    p0.wr(IER, IER_THRI)
    ev.take(1)
    c.wr(CONFIG, 4, 0x0001, 2)
    p0.thr(ord('c'))
    R.eq(ev.take(0), 0, ms, 'bus master clear: the message is held')
    c.wr(CONFIG, 4, 0x0005, 2)
    R.eq(ev.take(1), 1, ms, 'bus master set: the held message is sent')
    c.wr(CONFIG, 4, 0x0001, 2)
    p0.thr(ord('d'))
    p0.thr(ord('e'))
    c.wr(CONFIG, 4, 0x0005, 2)
    n = ev.take(1)
    n += ev.take(0)
    R.eq(n, 1, ms, 'two messages due while bus mastering was off: one sent when it is set')
    p0.drain()
    # no eventfd wired: lost, not held
    c.set_irqs(MSI, DATA_EVENTFD | ACTION_TRIGGER, 0, 1)
    p0.thr(ord('f'))
    c.set_irqs(MSI, DATA_EVENTFD | ACTION_TRIGGER, 0, 1, fds=[ev.fd])
    R.eq(ev.take(0), 0, ms, 'a message due with no eventfd wired is lost; wiring the eventfd sends nothing for the pending THRE')
    p0.thr(ord('g'))
    R.eq(ev.take(1), 1, ms, '(control: the next new condition sends one)')
    # MSI off, condition pending, MSI on: nothing
    c.wr(CONFIG, 0x42, 0, 2)
    p0.thr(ord('h'))
    c.wr(CONFIG, 0x42, 1, 2)
    R.eq(ev.take(0), 0, ms, 'turning MSI on with THRE already pending sends nothing')
    p0.drain()
    # SET_IRQS TRIGGER from the client signals the eventfd (vfio-user.md)
    c.set_irqs(MSI, DATA_NONE | ACTION_TRIGGER, 0, 1)
    R.eq(ev.take(1), 1, VU('Commands', 'SET_IRQS'), 'SET_IRQS TRIGGER DATA_NONE on MSI signals its eventfd')
    c.set_irqs(MSI, DATA_BOOL | ACTION_TRIGGER, 0, 1, data=b'\x01')
    R.eq(ev.take(1), 1, VU('Commands', 'SET_IRQS'), 'SET_IRQS TRIGGER DATA_BOOL true on MSI signals its eventfd')
    c.set_irqs(MSI, DATA_BOOL | ACTION_TRIGGER, 0, 1, data=b'\x00')
    R.eq(ev.take(0), 0, VU('Commands', 'SET_IRQS'), 'SET_IRQS TRIGGER DATA_BOOL false: no signal')
    c.set_irqs(MSI, DATA_NONE | ACTION_TRIGGER, 0, 0)
    p0.iir()
    p0.thr(ord('i'))
    R.eq(ev.take(0), 0, VU('Commands', 'SET_IRQS'), 'MSI index disabled (TRIGGER DATA_NONE count 0): no message')
    c.reset()
    ev.close()
    c.close()


# ######################################################################
# mtty.md § Reset and detach; vfio-user.md § Connections
# ######################################################################
def dirty(c, nports):
    """Set every register to something other than its power-on value."""
    for i in range(nports):
        p = Port(c, i)
        p.setup(fcr=0xc1, lcr=0x1b, div=0x1234, mcr=0x0f)
        p.msr()
        p.send(b'xyz')          # 5 data bits... still loops back
        p.wr(LCR, 0x03)
        p.rbr()
        p.send(bytes(20))       # overrun pending
        p.wr(SCR, 0x77)
        p.wr(IER, 0x0f)
        p.wr(MCR, 0x1f)
    c.wr(CONFIG, 4, 0x0407, 2)
    c.wr(CONFIG, 0x0c, 0x10, 1)
    c.wr(CONFIG, 0x3c, 0x0b, 1)
    c.wr(CONFIG, 0x10, 0xc000, 4)
    msi_enable(c)


def power_on_checks(c, nports, cfg0, ref, tag):
    for i in range(nports):
        p = Port(c, i)
        vals = [p.rd(o) for o in (IER, IIR, LCR, MCR, SCR, LSR, MSR, MSR)]
        R.eq(vals, [0, 0x01, 0, 0, 0, 0x60, 0xb3, 0xb0], ref, '%s port %d: IER IIR LCR MCR SCR LSR MSR MSR' % (tag, i))
        R.eq(p.get_div(), 0, ref, '%s port %d: divisor 0' % (tag, i))
        R.eq(p.rbr(), 0, both(ref, MT(S_REGS, 'RBR')), '%s port %d: an empty RBR reads 0 (the last byte read is reset)' % (tag, i))
        p.wr(IER, IER_RDI | IER_RLSI)
        R.eq(p.iir(), 0x01, ref, '%s port %d: no OE, data or timeout pending (IER RDI|RLSI: IIR 0x01)' % (tag, i))
        p.wr(IER, 0)
    cfg = c.region_read(CONFIG, 0, 256)
    diff = ['%#x: %#x != %#x' % (i, cfg[i], cfg0[i]) for i in range(256) if cfg[i] != cfg0[i]]
    R.check(not diff, ref, '%s: config space back to its power-on state' % tag, diff[:8])


def t_reset(env):
    R.sec('DEVICE_RESET, disconnect, one client (mtty.md § Reset and detach; vfio-user.md § Connections)')
    rst = MT(S_RST, 'DEVICE_RESET')
    sock = env.server('m2')
    c = session(sock)
    cfg0 = c.region_read(CONFIG, 0, 256)
    dirty(c, 2)
    ev = Ev()
    c.set_irqs(INTX, DATA_EVENTFD | ACTION_TRIGGER, 0, 1, fds=[ev.fd])
    mev = Ev()
    c.set_irqs(MSI, DATA_EVENTFD | ACTION_TRIGGER, 0, 1, fds=[mev.fd])
    ev.take(0)
    mev.take(0)
    m = c.request(DEVICE_RESET)
    R.check(not m.is_error and len(m.payload) == 0, both(rst, VU('Commands', 'DEVICE_RESET')), 'DEVICE_RESET succeeds, empty reply', m)
    R.errno(c.errno_of(DEVICE_RESET, b'\0\0\0\0'), E.EINVAL, VU('Commands', 'DEVICE_RESET'), 'DEVICE_RESET with a payload')
    power_on_checks(c, 2, cfg0, rst, 'after DEVICE_RESET')
    p0 = Port(c, 0)
    p0.wr(IER, IER_THRI)
    R.eq(status_int(c), True, rst, 'after the reset, THRI raises INTx (STATUS bit 3)...')
    R.eq(ev.take(0), 0, rst, '... but the INTx eventfd was dropped by the reset')
    msi_enable(c)
    p0.thr(ord('a'))
    R.eq(mev.take(0), 0, rst, '... and so was the MSI eventfd')
    c.reset()
    # disconnect
    dirty(c, 2)
    c.set_irqs(INTX, DATA_EVENTFD | ACTION_TRIGGER, 0, 1, fds=[ev.fd])
    c2 = connect(sock)
    R.check(c2.wait_eof() and c2.eof_kind() in ('EOF', 'ECONNRESET'), VU('Connections', 'One client per instance'),
            'a second client while one is connected is closed', c2.eof_kind())
    c2.close()
    R.check(c.alive(), VU('Connections', 'One client per instance'), 'the first client is still served')
    c.close()
    c = session(sock)
    power_on_checks(c, 2, cfg0, MT(S_RST, 'A client disconnect'), 'after a disconnect')
    Port(c, 1).wr(IER, IER_THRI)
    R.eq(ev.take(0), 0, MT(S_RST, 'A client disconnect'), 'the previous client\'s INTx eventfd gets nothing')
    c.reset()
    c.close()
    ev.close()
    mev.close()


# ######################################################################
# mtty.md § Port backends: null
# ######################################################################
def t_null(env):
    R.sec('The null backend (mtty.md § Port backends)')
    be = MT(S_BE)
    c = session(env.server('null'))
    p = Port(c, 0)
    for fcr in (0x07, 0x00):
        p.setup(fcr=fcr, ier=IER_THRI | IER_RDI)
        p.iir()
        p.send(bytes(range(40)))
        c.barrier()
        R.eq(p.lsr(), 0x60, both(be, MT(S_TX)), 'null, FCR %#x: 40 bytes transmitted vanish: THRE|TEMT, nothing received' % fcr)
        R.eq(p.iir(), 0xc2 if fcr else 0x02, MT(S_TX), 'null, FCR %#x: THR-empty raised by the last write' % fcr)
    c.reset()
    c.close()
    proc, sock, _ = env.start_mtty('mtty-2', ['backend=null', 'port1=loopback'], name='override')
    c = session(sock)
    p0, p1 = Port(c, 0), Port(c, 1)
    p0.setup(fcr=0x07)
    p1.setup(fcr=0x07)
    p0.send(b'gone')
    p1.send(b'back')
    c.barrier()
    R.eq((p0.lsr(), p1.drain()), (0x60, b'back'), MT(S_OPTS), 'mtty-2 backend=null port1=loopback: port 0 null, port 1 loopback (portN overrides backend)')
    c.close()
    env.stop(proc)
    proc, sock, _ = env.start_mtty('mtty-1', ['backend=null', 'port0=loopback'], name='override1')
    c = session(sock)
    p0 = Port(c, 0)
    p0.setup(fcr=0x07)
    p0.send(b'back')
    R.eq(p0.drain(), b'back', MT(S_OPTS), 'mtty-1 backend=null port0=loopback: port 0 loops back')
    c.close()
    env.stop(proc)


# ######################################################################
# Host peers: a socket client, a pty
# ######################################################################
class Host:
    """A host program on a port's socket."""

    def __init__(self, path):
        self.path = path
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        deadline = time.monotonic() + vu.WAIT
        while True:
            try:
                self.s.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        self.eof = False
        self.buf = bytearray()

    def _pull(self, timeout):
        r, _, _ = select.select([self.s], [], [], max(0.0, timeout))
        if not r:
            return False
        try:
            d = self.s.recv(65536)
        except (ConnectionResetError, OSError):
            d = b''
        if not d:
            self.eof = True
            return False
        self.buf += d
        return True

    def read(self, n, timeout=None):
        """Up to n bytes: waits until n arrived, EOF, or the bound."""
        deadline = time.monotonic() + (vu.WAIT if timeout is None else timeout)
        while len(self.buf) < n and not self.eof and time.monotonic() < deadline:
            self._pull(deadline - time.monotonic())
        out, self.buf = bytes(self.buf[:n]), self.buf[n:]
        return out

    def read_quiet(self):
        """What arrives within QUIET (for "nothing arrives", after a round trip)."""
        deadline = time.monotonic() + vu.QUIET
        while time.monotonic() < deadline and not self.eof:
            self._pull(deadline - time.monotonic())
        out, self.buf = bytes(self.buf), bytearray()
        return out

    def send(self, data):
        self.s.sendall(data)

    def send_bg(self, data):
        t = threading.Thread(target=self.s.sendall, args=(data,), daemon=True)
        t.start()
        return t

    def close(self):
        try:
            self.s.close()
        except OSError:
            pass


def served_host(path, timeout=None):
    """A host client that the port serves: one closed at once (the previous one not yet seen
    gone) is replaced. Proof of being served: it is not closed within QUIET."""
    deadline = time.monotonic() + (vu.WAIT if timeout is None else timeout)
    while True:
        h = Host(path)
        h._pull(vu.QUIET)
        if not h.eof:
            return h
        h.close()
        if time.monotonic() > deadline:
            raise Closed('no host connection served on %s' % path)
        time.sleep(0.02)


def host_for(path, p, marker=b'\xa5\x5a\xc3'):
    """A host client proved served: the guest port p transmits a marker and this client
    receives it. A client turned away (the previous one not yet seen gone) sees end-of-file
    before any byte; the marker stays queued for the next (mtty.md § Port backends: the
    queues belong to the port). Returns the client and what came before the marker."""
    p.send(marker)
    deadline = time.monotonic() + vu.WAIT
    while True:
        h = Host(path)
        while marker not in h.buf and not h.eof and time.monotonic() < deadline:
            h._pull(deadline - time.monotonic())
        if marker in h.buf:
            i = h.buf.index(marker)
            before, h.buf = bytes(h.buf[:i]), h.buf[i + len(marker):]
            return h, before
        h.close()
        if time.monotonic() > deadline:
            raise Closed('no host connection on %s received the marker' % path)
        time.sleep(0.02)


def read_served(path, n):
    """Connect and read n bytes; a connection closed before its first byte (turned away) is
    replaced. Returns the client and the bytes."""
    deadline = time.monotonic() + vu.WAIT
    while True:
        h = Host(path)
        got = h.read(n, max(0.0, deadline - time.monotonic()))
        if got or not h.eof or time.monotonic() > deadline:
            return h, got
        h.close()
        time.sleep(0.02)


def pattern(n, seed):
    return bytes((i * 7 + seed + (i >> 8)) & 0xff for i in range(n))


def t_socket(env):
    R.sec('The socket backend (mtty.md § Port backends: socket, Host backends)')
    be = MT(S_BE)
    hb = MT(S_BE, 'Host backends')
    sk = MT(S_BE, 'socket:PATH')
    p0path = env.path('port0.sock')
    proc, sock, _ = env.start_mtty('mtty-2', ['port0=socket:%s' % p0path], name='sockdev')
    st = os.stat(p0path)
    R.check(stmod.S_ISSOCK(st.st_mode) and st.st_mode & 0o777 == 0o600, sk, 'the port\'s socket exists, a socket, mode 0600',
            oct(st.st_mode))
    h = served_host(p0path)
    h2 = Host(p0path)
    h2._pull(vu.WAIT)
    R.check(h2.eof, sk, 'a second host client is closed at once')
    h2.close()
    c = session(sock)
    p0, p1 = Port(c, 0), Port(c, 1)
    p0.setup(fcr=0x07)
    data = bytes(range(256)) + b'hello, host\n'
    p0.send(data)
    R.eq(h.read(len(data)), data, both(be, hb), 'guest to host: 268 bytes, in order')
    R.eq(p0.lsr(), 0x60, MT(S_TX), 'THRE|TEMT after the transmissions')
    p0.wr(LCR, 0x00)
    p0.thr(0xff)
    p0.wr(LCR, 0x03)
    R.eq(h.read(1), b'\x1f', MT(S_REGS, 'THR'), 'a 5-bit word on a host line: 0xff arrives as 0x1f')
    h.send(b'from host')
    got, seen = p0.recv(9)
    R.eq(got, b'from host', both(be, hb), 'host to guest: in order')
    # interrupts driven by the host thread
    ev = Ev()
    c.set_irqs(INTX, DATA_EVENTFD | ACTION_TRIGGER, 0, 1, fds=[ev.fd])
    p0.wr(IER, IER_RDI)
    R.eq(ev.take(0), 0, MT(S_IRQ), 'RDI set with the receiver empty: no INTx')
    h.send(b'!')
    R.eq(ev.take(1), 1, MT(S_IRQ), 'a host byte arriving (no register access) asserts INTx (RDA)')
    R.eq((p0.iir(), p0.rbr()), (0xc4, ord('!')), MT(S_PRIO), 'IIR RDA, the byte')
    unmask(c)
    # bulk host -> guest, beyond HOST_QUEUE, while the guest reads: nothing lost
    bulk = pattern(6000, 1)
    t = h.send_bg(bulk)
    got, seen = p0.recv(len(bulk))
    t.join(vu.WAIT)
    R.check(got == bulk and not seen & LSR_OE, hb, 'host to guest, 6000 bytes (over HOST_QUEUE) while the guest reads: all, in order, no OE',
            '%d bytes, first difference at %s, OE %s' % (len(got), next((i for i in range(min(len(got), len(bulk))) if got[i] != bulk[i]), None),
                                                         bool(seen & LSR_OE)))
    ev.take(0)
    unmask(c)
    p0.wr(IER, 0)
    # bulk guest -> host
    bulk = pattern(6000, 2)
    res = {}
    rt = threading.Thread(target=lambda: res.setdefault('got', h.read(len(bulk))), daemon=True)
    rt.start()
    p0.send(bulk)
    rt.join(vu.WAIT + 5)
    R.eq(res.get('got'), bulk, hb, 'guest to host, 6000 bytes: all, in order')
    # MCR loopback on a host line
    p0.wr(MCR, MCR_LOOP)
    p0.send(b'inloop')
    R.eq(p0.drain(), b'inloop', MT(S_TX, 'MCR loopback'), 'MCR loopback on a socket port: the bytes arrive on the receiver')
    h.send(b'wait')
    time.sleep(vu.QUIET)
    c.barrier()
    R.eq(p0.lsr() & LSR_DR, 0, MT(S_TX, 'MCR loopback'), 'MCR loopback: nothing from the line arrives')
    p0.wr(MCR, 0)
    got, _ = p0.recv(4)
    R.eq(got, b'wait', MT(S_TX, 'MCR loopback'), 'leaving loopback: the host bytes that waited in the queue arrive')
    p0.thr(ord('M'))
    R.eq(h.read(1), b'M', MT(S_TX, 'MCR loopback'), 'the line saw none of the looped-back bytes (next byte on the host: the marker)')
    # breaks are not carried
    p0.wr(LCR, 0x43)
    p0.thr(ord('L'))
    p0.wr(LCR, 0x03)
    p0.thr(ord('Z'))
    R.eq(h.read(1), b'Z', both(MT(S_REGS, 'LCR (Break)'), hb), 'a break is not carried to the host, and a byte written under SBC is lost')
    h.send(b'.')
    got, seen = p0.recv(1)
    R.eq((got, seen & LSR_BI), (b'.', 0), hb, 'the host line carries no break into the guest either')
    # FIFO resets give host bytes back
    p0.setup(fcr=0x87, ier=IER_RDI)
    h.send(b'hello12345')
    R.check(wait_until(lambda: p0.iir() == 0xc4), hb, 'host bytes reach the trigger level (8)')
    p0.wr(FCR, 0x83)
    got, _ = p0.recv(10)
    R.eq(got, b'hello12345', MT(S_BE, 'FIFO resets keep host bytes'), 'an RX clear gives the unread host bytes back, in order')
    h.send(b'ABCDEFGHIJ')
    wait_until(lambda: p0.iir() == 0xc4)
    p0.wr(FCR, 0x00)
    got, _ = p0.recv(10)
    R.eq(got, b'ABCDEFGHIJ', MT(S_BE, 'FIFO resets keep host bytes'), 'FIFO mode turned off: the host bytes come back, in order (16450 mode)')
    p0.setup(fcr=0x87, ier=IER_RDI)
    p0.wr(MCR, MCR_LOOP)
    p0.send(b'ml')
    p0.wr(MCR, 0)
    h.send(b'HHHHHH')
    R.check(wait_until(lambda: p0.iir() == 0xc4), hb, '2 looped-back bytes and 6 host bytes in the receiver (trigger 8)')
    p0.wr(FCR, 0x83)
    got, _ = p0.recv(8, timeout=vu.QUIET)
    R.eq(got, b'HHHHHH', MT(S_BE, 'FIFO resets keep host bytes'),
         'an RX clear with MCR-looped and host bytes held: the host bytes come back, the looped-back characters are discarded')
    p0.setup(fcr=0x07)
    # half-close: the host shuts down its writing side, still gets output
    h.s.shutdown(socket.SHUT_WR)
    time.sleep(vu.QUIET)
    p0.send(b'after-shutdown')
    R.eq(h.read(14), b'after-shutdown', sk, 'a client that shut down its writing side still gets the guest\'s output')
    h.close()
    # what a client sent before closing is delivered whole
    h, _ = host_for(p0path, p0)
    last = pattern(300, 3)
    h.send(last)
    h.close()
    got, seen = p0.recv(300)
    R.check(got == last and not seen & LSR_OE, sk, 'what a client sent before closing is delivered whole (300 bytes, in order)', '%d bytes' % len(got))
    # a peer that goes away and comes back loses nothing queued
    p0.send(b'queued-while-away')
    R.eq(p0.lsr(), 0x60, hb, 'no client: bytes go to the queue (it has room): THRE|TEMT')
    h, got = read_served(p0path, 17)
    R.eq(got, b'queued-while-away', hb, 'a client that comes back gets what was queued')
    h.close()

    # stalls (no client): the queue fills, then the TX FIFO, then bytes are lost
    def stall(seed, extra):
        s = pattern(4096 + extra, seed)
        p0.send(s[:4096])
        full = p0.lsr()
        p0.send(s[4096:])
        return s, full
    p0.setup(fcr=0x07, ier=IER_THRI)
    p0.iir()
    ev.take(0)
    unmask(c)
    s, full = stall(4, 20)
    R.eq(full, 0x60, hb, 'no client: 4096 bytes (HOST_QUEUE) fill the queue, the TX FIFO still empty (THRE|TEMT)')
    R.eq(p0.lsr() & 0x60, 0, hb, 'the transmitter stalls: THRE and TEMT read 0')
    R.eq(p0.iir(), 0xc1, hb, 'stalled: no THR-empty condition (IIR 0xc1)')
    p0.wr(IER, 0)
    p0.wr(IER, IER_THRI)
    R.eq(p0.iir(), 0xc1, MT(S_REGS, 'IER'), 'THRI enabled while the transmitter is not empty (stalled): no THRE')
    ev.take(0)          # the THRE of each write that reached the queue
    unmask(c)
    R.eq(ev.take(0), 0, hb, 'stalled: no THR-empty interrupt (INTx quiet after an unmask)')
    p1.setup(fcr=0x07)
    p1.send(b'p1 ok')
    R.eq((p1.drain(), p1.lsr()), (b'p1 ok', 0x60), hb, 'only that port slows: port 1 transmits and receives')
    h, got = read_served(p0path, 4096 + 16)
    R.eq(len(got), 4112, hb, 'the client that comes gets the queue and the TX FIFO (4096 + 16 bytes)')
    R.check(got == s[:4112], hb, 'those bytes in order (the 4 written while the TX FIFO was full were lost)',
            next((i for i in range(min(len(got), 4112)) if got[i] != s[i]), len(got)))
    R.check(wait_until(lambda: p0.lsr() & 0x60 == 0x60), hb, 'the peer read: THRE and TEMT read 1')
    R.eq(ev.take(1), 1, hb, 'the peer read: the THR-empty interrupt comes (INTx)')
    R.eq(p0.iir(), 0xc2, hb, 'IIR THRE')
    unmask(c)
    p0.send(b'END1')
    R.eq(h.read(4), b'END1', hb, 'then the next bytes (nothing of the lost ones)')
    h.close()
    # stall + TX clear
    s, _ = stall(5, 5)
    p0.iir()
    p0.wr(FCR, 0x05)
    R.eq((p0.lsr() & 0x60, status_int(c)), (0x60, True), both(hb, MT(S_PRIO)),
         'FCR TX clear on a stalled transmitter: its bytes discarded (THRE|TEMT), THRE raised (INTx level)')
    p0.thr(ord('+'))
    R.eq((status_int(c), p0.iir(), p0.lsr() & 0x60), (False, 0xc1, 0), both(MT(S_PRIO), MT(S_REGS, 'THR')),
         'a THR write clears THRE; the queue still full, the byte waits in the TX FIFO')
    h, got = read_served(p0path, 4097)
    p0.send(b'END2')
    got2 = h.read(4)
    R.eq((got == s[:4096] + b'+', got2), (True, b'END2'), MT(S_BE, 'FIFO resets keep host bytes'),
         'after a TX clear the peer gets the 4096 queued bytes and the later byte, then the next (the 5 discarded never come)')
    h.close()
    # stall + MCR loopback
    s, _ = stall(6, 3)
    p0.wr(MCR, MCR_LOOP)
    R.eq(p0.drain(), s[4096:], MT(S_TX, 'MCR loopback'), 'entering MCR loopback: the bytes a stalled transmitter held go to the receiver')
    R.eq(p0.lsr(), 0x60, MT(S_TX, 'MCR loopback'), '... and the transmitter is empty')
    p0.wr(MCR, 0)
    h, got = read_served(p0path, 4096)
    p0.send(b'END3')
    R.eq((got == s[:4096], h.read(4)), (True, b'END3'), hb, 'the peer then gets the queue only')
    h.close()
    # stall + DEVICE_RESET: the queue is kept
    s, _ = stall(7, 3)
    c.reset()
    h, got = read_served(p0path, 4096)
    p0.setup(fcr=0x07)
    p0.send(b'END4')
    got2 = h.read(4)
    R.check(got == s[:4096], MT(S_RST, 'The lines'), 'DEVICE_RESET keeps the host queue: the peer gets the 4096 queued bytes', len(got))
    R.eq(got2, b'END4', MT(S_RST), 'the TX FIFO was emptied by the reset (its 3 bytes never come)')
    # DEVICE_RESET gives the receiver's host bytes back
    p0.setup(fcr=0x07, ier=IER_RDI)
    h.send(b'rst')
    R.check(wait_until(lambda: p0.lsr() & LSR_DR), hb, 'host bytes in the receiver')
    c.reset()
    p0.setup(fcr=0x07, ier=IER_RDI)
    got, _ = p0.recv(3)
    R.eq(got, b'rst', MT(S_RST, 'DEVICE_RESET'), 'DEVICE_RESET gives the host bytes the receiver held back to the queue (they come again, in order)')
    h.close()
    # 16450 mode: a 1-byte holding register
    p0.setup(fcr=0x00)
    s = pattern(4096 + 3, 8)
    p0.send(s[:4096])
    full = p0.lsr()
    p0.thr(s[4096])
    one = p0.lsr()
    p0.send(s[4097:])
    R.eq((full, one & 0x60), (0x60, 0), both(hb, MT(S_REGS, 'THR')), '16450 mode: 4096 bytes fill the queue, the next stalls in the holding register')
    h, got = read_served(p0path, 4097)
    p0.setup(fcr=0x07)
    p0.send(b'END5')
    R.check(got == s[:4097] and h.read(4) == b'END5', both(hb, MT(S_REGS, 'THR')),
            '16450 mode: the peer gets the queue and the 1 held byte (4097), the 2 written while it was full were lost', len(got))
    # vfio-user client disconnect: host client and queued bytes kept
    p0.setup(fcr=0x07, ier=IER_RDI)
    h.send(b'keepme')
    R.check(wait_until(lambda: p0.lsr() & LSR_DR), hb, 'host bytes in the receiver')
    c.close()
    c = session(sock)
    p0 = Port(c, 0)
    p0.setup(fcr=0x07, ier=IER_RDI)
    got, _ = p0.recv(6)
    R.eq(got, b'keepme', MT(S_RST, 'The lines'), 'after a client disconnect the host bytes the receiver held come again, in order')
    p0.send(b'still')
    R.eq(h.read(5), b'still', MT(S_RST, 'The lines'), 'the host client stayed connected across the disconnect')
    h.close()
    c.close()
    ev.close()
    rc = env.stop(proc)
    R.check(not os.path.exists(p0path) and not os.path.exists(sock), sk, 'the port socket is removed when the instance stops',
            'rc %s' % rc)

    # socket checks at start
    stale = env.path('stale.sock')
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(stale)
    s.close()
    ok = 'not started'
    try:
        proc, sock, _ = env.start_mtty('mtty-1', ['backend=socket:%s' % stale], name='stalesrv')
        h = served_host(stale)
        c = session(sock)
        p = Port(c, 0)
        p.setup()
        p.send(b'st')
        ok = h.read(2) == b'st'
        c.close()
        h.close()
        env.stop(proc)
    except SetupError as ex:
        ok = str(ex)[:200]
    R.check(ok is True, sk, 'a stale socket file at PATH is replaced', ok)
    live = env.path('live.sock')
    ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ls.bind(live)
    ls.listen(1)
    notsock = env.path('plain-file')
    with open(notsock, 'w') as f:
        f.write('keep')
    for path, what in ((live, 'a live socket'), (notsock, 'a non-socket')):
        isock = env.path('refused.sock')
        p = subprocess.Popen([env.bin, 'run', '--type', 'mtty-1', '--socket', isock, '--opt', 'backend=socket:%s' % path],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        env.procs.append(p)
        try:
            out, err = p.communicate(timeout=vu.WAIT)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        R.check(p.returncode not in (0, None) and not os.path.exists(isock), sk,
                '%s at PATH: the instance fails to start, leaving no socket of its own' % what,
                'rc %s: %s' % (p.returncode, (out + err).strip()[:160]))
    t = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        t.connect(live)
        R.check(True, sk, 'the live socket is left to its owner')
    except OSError as ex:
        R.check(False, sk, 'the live socket is left to its owner', repr(ex))
    t.close()
    ls.close()
    with open(notsock) as f:
        R.eq(f.read(), 'keep', sk, 'the non-socket file is left alone')


def t_pty(env):
    R.sec('The pty backend (mtty.md § Port backends: pty)')
    pt = MT(S_BE, 'pty')
    proc, sock, ptys = env.start_mtty('mtty-2', ['backend=pty'], name='ptydev', want_ptys=2)
    err = env.log_text('ptydev')
    R.check(re.search(r'^  port 0: pty /dev/pts/\d+$', err, re.M) and re.search(r'^  port 1: pty /dev/pts/\d+$', err, re.M), pt,
            '`umdev run` prints "  port N: pty /dev/pts/M" on stderr for each port', err.strip()[-200:])
    R.check(len(set(ptys.values())) == 2, pt, 'a pseudo-terminal per port', ptys)
    if 0 not in ptys:
        env.stop(proc)
        return
    path = ptys[0]

    def open_pty():
        return os.open(path, os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK)
    def is_raw(iflag, oflag, cflag, lflag):
        return (not lflag & (termios.ICANON | termios.ECHO | termios.ISIG | termios.IEXTEN) and not oflag & termios.OPOST
                and not iflag & (termios.ICRNL | termios.IXON | termios.INLCR) and cflag & termios.CSIZE == termios.CS8)
    fd = open_pty()
    iflag, oflag, cflag, lflag = termios.tcgetattr(fd)[:4]
    R.check(is_raw(iflag, oflag, cflag, lflag), pt,
            'the terminal is in raw mode (no ICANON, ECHO, ISIG, OPOST, ICRNL, IXON; CS8)', 'iflag %#x oflag %#x lflag %#x' % (iflag, oflag, lflag))

    def pread(n, timeout=None):
        buf = bytearray()
        deadline = time.monotonic() + (vu.WAIT if timeout is None else timeout)
        while len(buf) < n and time.monotonic() < deadline:
            r, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if r:
                try:
                    d = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                except OSError:
                    break
                buf += d
        return bytes(buf)
    c = session(sock)
    p = Port(c, 0)
    p.setup(fcr=0x07)
    data = b'a\nb\r\x03\x7f\x00\x1a\x11\x13' + bytes(range(256))
    p.send(data)
    R.eq(pread(len(data)), data, pt, 'guest to pty: control characters and all 256 values, unchanged, in order')
    os.write(fd, b'x\ny\r\n\x03\x04\x7f')
    got, _ = p.recv(8)
    R.eq(got, b'x\ny\r\n\x03\x04\x7f', pt, 'pty to guest: unchanged (no ONLCR, no ICRNL, no signals)')
    R.eq(pread(1, vu.QUIET), b'', pt, 'no echo of what the host wrote')
    bulk = pattern(3000, 9)
    res = {}
    rt = threading.Thread(target=lambda: res.setdefault('got', pread(len(bulk))), daemon=True)
    rt.start()
    p.send(bulk)
    rt.join(vu.WAIT + 5)
    R.eq(res.get('got'), bulk, pt, 'guest to pty, 3000 bytes: in order')
    os.close(fd)
    p.send(b'while-closed')
    R.eq(p.lsr(), 0x60, pt, 'no program on the pty: the transmitter goes on')
    fd = open_pty()
    R.eq(pread(12), b'while-closed', both(pt, MT(S_BE, 'Host backends')), 'a program that comes back reads what was written while it was away')
    os.write(fd, b'back')
    got, _ = p.recv(4)
    R.eq(got, b'back', pt, 'and writes to the guest again')
    # the line survives a client disconnect
    c.close()
    c = session(sock)
    p = Port(c, 0)
    p.setup(fcr=0x07)
    p.send(b'again')
    R.eq(pread(5), b'again', MT(S_RST, 'The lines'), 'the pty survives a client disconnect (same terminal, still open)')
    # host programs set their own mode: umdev does not fight it
    tty.setraw(fd)
    os.write(fd, b'raw2')
    got, _ = p.recv(4)
    R.eq(got, b'raw2', pt, 'after the program sets its own (raw) mode the line still works')
    # a program hangs the terminal up (TIOCVHANGUP): umdev keeps it and carries on
    try:
        fcntl.ioctl(fd, 0x5437)     # TIOCVHANGUP
        hung = True
    except OSError as ex:
        hung = ex
    os.close(fd)
    if hung is True:
        # The hang-up reset the modes to cooked ones; umdev opens the terminal again and
        # makes it raw: wait for that (an event, bounded), then use it.
        modes = [None]
        def raw_again():
            f = open_pty()
            try:
                modes[0] = termios.tcgetattr(f)[:4]
            finally:
                os.close(f)
            return is_raw(*modes[0])
        wait_until(raw_again)
        fd = open_pty()
        iflag, oflag, cflag, lflag = termios.tcgetattr(fd)[:4]
        R.check(is_raw(iflag, oflag, cflag, lflag), pt, 'after a program hung the pty up (TIOCVHANGUP): raw again (no program set another mode)',
                'iflag %#x oflag %#x lflag %#x' % (iflag, oflag, lflag))
        p.send(b'after-hangup\n')
        got1 = pread(13)
        echo, _ = p.recv(64, timeout=vu.QUIET)
        os.write(fd, b'hu')
        got2, _ = p.recv(2)
        R.eq(got1, b'after-hangup\n', pt, 'after the hangup the pty carries guest bytes to the host, unchanged')
        R.eq(echo, b'', pt, 'after the hangup nothing the guest sent comes back to the guest (no echo)')
        R.eq(got2, b'hu', pt, 'after the hangup the host\'s bytes reach the guest')
        os.close(fd)
    else:
        R.note(pt, 'hangup not tried: TIOCVHANGUP refused (%r)' % hung)
    if 1 in ptys:
        fd = os.open(ptys[1], os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK)
        q = Port(c, 1)
        q.setup(fcr=0x07)
        q.send(b'port1')
        R.eq(pread(5), b'port1', pt, 'port 1\'s pty carries port 1\'s bytes')
        os.close(fd)
    c.close()
    env.stop(proc)


# ######################################################################
# The daemon: port pool, umdev start/list --json, counters, an ignored receiver
# ######################################################################
class Daemon:
    def __init__(self, env):
        self.env = env
        self.run, self.state = env.path('run'), env.path('state')
        self.proc = env.spawn(['daemon', '--run-dir', self.run, '--state-dir', self.state], 'daemon')
        ok = wait_until(lambda: self.proc.poll() is not None or self.cli('list')[0] == 0, step=0.05)
        if not ok or self.proc.poll() is not None:
            raise SetupError('the daemon did not start: %s' % env.log_tail('daemon'))

    def cli(self, *args):
        rd = ['--run-dir', self.run] if args[0] in ('types', 'start', 'stop', 'list', 'stats') else []
        sd = ['--state-dir', self.state] if args[0] in ('start', 'list', 'define') else []
        return self.env.umdev(*(list(args) + rd + sd))

    def avail(self):
        rc, out, err = self.cli('types')
        got = {}
        for typ in ('mtty-1', 'mtty-2'):
            m = re.search(r'^%s\n\s+Available instances: (\d+)' % typ, out, re.M)
            got[typ] = int(m.group(1)) if m else None
        return got['mtty-1'], got['mtty-2']

    def start(self, typ, *opts):
        args = ['start', '-t', typ]
        for o in opts:
            args += ['--opt', o]
        rc, out, err = self.cli(*args)
        mu = re.search(r'[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}', out)
        ms = re.search(r'(/\S+\.sock)', out)
        return rc, (mu.group(0) if mu else None), (ms.group(1) if ms else None), out, err

    def stop(self, uuid):
        res = {}

        def stopped():
            rc, out, err = self.cli('stop', '-u', uuid)
            res['out'] = (out + err).strip()
            return rc == 0
        ok = wait_until(stopped, step=0.05)
        return ok, res.get('out')

    def info(self, uuid):
        rc, out, err = self.cli('list', '--json', '-u', uuid)
        try:
            lst = json.loads(out)
        except ValueError:
            return None
        for inst in lst if isinstance(lst, list) else []:
            if inst.get('uuid') == uuid:
                return inst
        return None

    def port(self, uuid, i):
        inst = self.info(uuid)
        try:
            return inst['device']['ports'][i]
        except (TypeError, KeyError, IndexError):
            return None

    def stats(self, uuid, i):
        p = self.port(uuid, i)
        return dict(p.get('stats', {})) if p else {}


def wait_stats(d, uuid, i, pred):
    last = [None]

    def ok():
        last[0] = d.stats(uuid, i)
        return pred(last[0])
    wait_until(ok, step=0.01)
    return last[0]


def delta(a, b):
    return {k: b.get(k, 0) - a.get(k, 0) for k in ('tx', 'rx', 'dropped', 'overruns', 'breaks')}


def t_daemon(env):
    R.sec('The port pool, umdev start/list, counters (mtty.md § Types and the port pool, § Port backends)')
    pool = MT(S_TYPES)
    d = Daemon(env)
    try:
        _daemon(env, d, pool)
    finally:
        env.stop(d.proc)


def _daemon(env, d, pool):
    R.eq(d.avail(), (24, 12), pool, 'a fresh daemon: mtty-1 24, mtty-2 12 available')
    rc, u2, s2, out, err = d.start('mtty-2')
    R.check(rc == 0 and u2, pool, 'start mtty-2', (out + err).strip()[:160])
    R.eq(d.avail(), (22, 11), pool, 'one mtty-2 reserves 2 ports: 22 and 11')
    rc, u1, s1, out, err = d.start('mtty-1')
    R.eq(d.avail(), (21, 10), pool, 'one mtty-1 more: 21 and 10 (half, rounded down)')
    d.stop(u1)
    R.eq(d.avail(), (22, 11), pool, 'stopping the mtty-1 returns its port')
    more = []
    for _ in range(11):
        rc, u, s, out, err = d.start('mtty-2')
        if u:
            more.append(u)
    R.eq((len(more), d.avail()), (11, (0, 0)), pool, '11 more mtty-2 take every port: 0 and 0')
    rc, u, s, out, err = d.start('mtty-1')
    R.check(rc != 0 and not u, pool, 'no port left: start mtty-1 fails (Exhausted)', (out + err).strip()[:160])
    R.note(pool, 'exhausted start says: %r (the doc names errno EUSERS; the CLI shows no errno)' % (out + err).strip()[:120])
    d.stop(more.pop())
    R.eq(d.avail(), (2, 1), pool, 'one mtty-2 stopped: 2 and 1')
    rc, u, s, out, err = d.start('mtty-1')
    more.append(u)
    R.eq(d.avail(), (1, 0), pool, 'an mtty-1 on them: 1 and 0')
    rc, u, s, out, err = d.start('mtty-2')
    R.check(rc != 0 and not u, pool, 'one port left: start mtty-2 fails', (out + err).strip()[:160])
    for u in more + [u2]:
        d.stop(u)
    R.eq(d.avail(), (24, 12), pool, 'everything stopped: 24 and 12 again')
    # start refuses what define refuses, with the same message
    rc, u, s, out, err = d.start('mtty-1', 'backend=bogus')
    rcd, outd, errd = d.cli('define', '-t', 'mtty-1', '--opt', 'backend=bogus')
    R.check(rc != 0 and rcd != 0 and (out + err).strip() == (outd + errd).strip(), both(MT(S_OPTS), RM('Serving devices to QEMU')),
            'a bad SPEC: refused at start and at define, with the same message', ((out + err).strip()[:100], (outd + errd).strip()[:100]))
    # pty through umdev start: printed on stdout, shown by list and list --json
    rc, up, sp, out, err = d.start('mtty-1', 'backend=pty')
    m = re.search(r'^  port 0: pty (/dev/pts/\d+)$', out, re.M)
    R.check(rc == 0 and m, MT(S_BE, 'pty'), '`umdev start` prints "  port 0: pty /dev/pts/N" on stdout', out.strip()[:200])
    if up:
        rc, lout, _ = d.cli('list', '-v')
        R.check(m and m.group(1) in lout, MT(S_BE, 'pty'), '`umdev list -v` shows the pty path', lout.strip()[:200])
        rc, lout, _ = d.cli('list')
        R.check(m and m.group(1) not in lout and up in lout and not any(line.startswith(' ') for line in lout.splitlines()),
                MT(S_BE, 'pty'), '`umdev list` (without -v) keeps one line per device: no port lines', lout.strip()[:200])
        port = d.port(up, 0) or {}
        R.check(m and port.get('path') == m.group(1), MT(S_BE, 'pty'), '`umdev list --json`: device.ports[0].path', port)
        R.check('host_connected' not in port, MT(S_BE, 'socket:PATH'), 'host_connected is for sockets only (absent on a pty port)', port)
        d.stop(up)
    # counters and host_connected: mtty-2, port 0 loopback, port 1 socket
    p1path = env.path('dport1.sock')
    rc, u, s, out, err = d.start('mtty-2', 'port1=socket:%s' % p1path)
    R.check(rc == 0 and u and s, MT(S_BE), 'start mtty-2 with port1=socket:PATH', (out + err).strip()[:160])
    if not (u and s):
        return
    sk = MT(S_BE, 'socket:PATH')
    port1 = d.port(u, 1) or {}
    R.eq(port1.get('host_connected'), False, sk, 'list --json: device.ports[1].host_connected false with no client')
    h = served_host(p1path)
    R.check(wait_until(lambda: (d.port(u, 1) or {}).get('host_connected') is True, step=0.02), sk,
            'host_connected true once a client connected')
    c = session(s)
    p0, p1 = Port(c, 0), Port(c, 1)
    cnt = MT(S_BE, 'Counters')
    p0.setup(fcr=0x07)
    s0 = d.stats(u, 0)
    R.eq(sorted(s0), ['breaks', 'dropped', 'overruns', 'rx', 'tx'], cnt, 'stats: tx, rx, dropped, overruns, breaks')
    p0.send(b'12345')
    st = wait_stats(d, u, 0, lambda x: x.get('tx', 0) - s0.get('tx', 0) >= 5 and x.get('rx', 0) - s0.get('rx', 0) >= 5)
    R.eq(delta(s0, st), dict(tx=5, rx=5, dropped=0, overruns=0, breaks=0), cnt, 'loopback, 5 bytes: tx 5, rx 5')
    p0.drain()
    s0 = st
    p0.send(bytes(20))
    st = wait_stats(d, u, 0, lambda x: x.get('dropped', 0) - s0.get('dropped', 0) >= 4)
    R.eq(delta(s0, st), dict(tx=20, rx=16, dropped=4, overruns=1, breaks=0), cnt,
         'loopback, 20 bytes into an empty 16-byte FIFO: rx 16, dropped 4, one overrun')
    p0.lsr()
    p0.send(bytes(2))
    p0.lsr()
    p0.send(bytes(1))
    st2 = wait_stats(d, u, 0, lambda x: x.get('dropped', 0) - st.get('dropped', 0) >= 3)
    R.eq(delta(st, st2), dict(tx=3, rx=0, dropped=3, overruns=2, breaks=0), cnt,
         'two more losses, each after an LSR read: dropped 3, overruns 2 (OE conditions)')
    p0.drain()
    s0 = st2
    p0.wr(LCR, 0x43)
    st = wait_stats(d, u, 0, lambda x: x.get('breaks', 0) > s0.get('breaks', 0))
    dl = delta(s0, st)
    R.eq(dl['breaks'], 1, cnt, 'a break: breaks 1')
    R.eq((dl['rx'], dl['tx']), (1, 0), cnt, 'a break character on loopback counts in rx (and breaks), not in tx')
    p0.wr(LCR, 0x03)
    p0.drain()
    s0 = d.stats(u, 0)
    c.reset()
    R.eq(d.stats(u, 0), s0, cnt, 'counters kept across DEVICE_RESET')
    c.close()
    c = session(s)
    R.eq(d.stats(u, 0), s0, cnt, 'counters kept across a client disconnect')
    p1 = Port(c, 1)
    p1.setup(fcr=0x07, ier=IER_RDI)
    t0 = d.stats(u, 1)
    p1.send(b'0123456789')
    R.eq(h.read(10), b'0123456789', MT(S_BE), 'socket port: the host gets the bytes')
    h.send(b'abcdefg')
    got, _ = p1.recv(7)
    R.eq(got, b'abcdefg', MT(S_BE), 'socket port: the guest gets the host\'s bytes')
    st = wait_stats(d, u, 1, lambda x: x.get('rx', 0) - t0.get('rx', 0) >= 7)
    R.eq(delta(t0, st), dict(tx=10, rx=7, dropped=0, overruns=0, breaks=0), cnt, 'socket port counters: tx 10, rx 7')
    c.close()
    h.close()
    R.check(wait_until(lambda: (d.port(u, 1) or {}).get('host_connected') is False, step=0.02), sk,
            'host_connected false once the client left')
    ok, msg = d.stop(u)
    R.check(ok and not os.path.exists(p1path), sk, 'umdev stop removes the port socket', msg)

    t_ignored(env, d)


def t_ignored(env, d):
    R.sec('Host to guest pacing: an untouched and an ignored receiver (mtty.md § Port backends: Host backends)')
    hb = MT(S_BE, 'Host backends')
    path = env.path('ign.sock')
    rc, u, s, out, err = d.start('mtty-1', 'backend=socket:%s' % path)
    if not R.check(rc == 0 and u and s, hb, 'start mtty-1 backend=socket:PATH', (out + err).strip()[:160]):
        return
    h = served_host(path)
    wait_until(lambda: (d.port(u, 0) or {}).get('host_connected') is True, step=0.02)
    b1 = pattern(40, 11)
    h.send(b1)
    st = wait_stats(d, u, 0, lambda x: x.get('rx', 0) >= 1)
    R.eq(st.get('rx'), 1, hb, 'untouched port, no VMM connected: the receiver (16450 mode) takes one byte')
    time.sleep(1.2)
    st = d.stats(u, 0)
    R.eq((st.get('rx'), st.get('dropped')), (1, 0), hb, 'untouched: 1.2 s later (over IGNORED_AFTER) the rest still waits, nothing dropped')
    c = session(s)
    p = Port(c, 0)
    p.wr(IER, IER_RDI)                    # the first access: the port is touched, RDI set
    p.wr(LCR, 0x03)
    p.wr(FCR, 0x07)
    got, seen = p.recv(40)
    R.check(got == b1 and not seen & LSR_OE, both(hb, MT(S_BE, 'FIFO resets keep host bytes')),
            'the guest sets up (FIFO on gives the held byte back) and reads all 40, in order, no OE', (len(got), hex(seen)))
    st = d.stats(u, 0)
    R.eq(st.get('rx'), 40, MT(S_BE, 'Counters'), 'rx 40 for 40 bytes read: the first, taken, given back by the FIFO change and taken again, counts once')
    # ignored: RDI clear (other bits set), 1 s after the last RBR read
    div = 48
    ct = char_time(0x03, div)
    p.set_div(div)
    p.wr(IER, IER_RLSI | IER_MSI)
    t_last = p.last_pop
    s0 = d.stats(u, 0)
    b2 = pattern(40, 12)
    h.send(b2)
    early = []
    too_fast = []

    def all_dropped():
        x = d.stats(u, 0)
        now = time.monotonic()     # after the reply: the count is of a moment before it
        lost = x.get('dropped', 0) - s0.get('dropped', 0)
        if lost > 0 and now < t_last + 1.0:
            early.append(('%.3f s after the last RBR read' % (now - t_last), x))
        # Ignored from 1 s after the last RBR read (which came after t_last), then one byte
        # lost per character time at most: a slow machine only makes `now` later.
        allowed = int(max(0.0, now - t_last - 1.0) / ct) + 1
        if lost > allowed:
            too_fast.append(('%d lost %.3f s after the last RBR read (at most %d)' % (lost, now - t_last, allowed)))
        return lost >= 24 and x
    st = wait_until(all_dropped, step=0.01)
    t_done = time.monotonic()
    R.check(not early, hb, 'ignored port: no byte lost before IGNORED_AFTER (1 s) since the last RBR read', early[:2])
    R.eq(delta(s0, st or {}) if st else None, dict(tx=0, rx=16, dropped=24, overruns=1, breaks=0), hb,
         'ignored port (RDI clear, RLSI|MSI set), 40 host bytes: 16 received, 24 lost to one overrun')
    R.check(not too_fast, hb, 'the 24 bytes that waited when the port became ignored are lost at the line rate from then, not at once',
            too_fast[:2])
    # steady state: the port stays ignored (no RBR read); new host bytes can come no faster than the line rate
    s1 = d.stats(u, 0)
    b2b = pattern(60, 14)
    t_s = time.monotonic()
    h.send(b2b)
    st = wait_until(lambda: (lambda x: x.get('dropped', 0) - s1.get('dropped', 0) >= 60 and x)(d.stats(u, 0)), step=0.01)
    t_done = time.monotonic()
    R.eq(delta(s1, st or {}) if st else None, dict(tx=0, rx=0, dropped=60, overruns=0, breaks=0), hb,
         'still ignored, FIFO full, OE not yet read: 60 more host bytes all lost, no new OE condition (OE once)')
    R.check(st and t_done - t_s >= 59 * ct, hb, 'those 60 came at the line rate: the last not before 59 character times (%.3f s) after the host sent them' % (59 * ct),
            '%.3f s' % (t_done - t_s))
    R.eq(p.lsr() & LSR_OE, LSR_OE, hb, 'the guest sees OE')
    R.eq(p.lsr() & LSR_OE, 0, hb, 'once')
    got, _ = p.recv(16, stop_when_empty=True)
    R.eq(got, b2[:16], hb, 'the FIFO holds the first 16 of them')
    # RDI set: never ignored, however long the guest waits
    p.wr(IER, IER_RDI)
    s0 = d.stats(u, 0)
    b3 = pattern(40, 13)
    h.send(b3)
    time.sleep(1.2)
    R.eq(delta(s0, d.stats(u, 0))['dropped'], 0, hb, 'RDI set, no RBR read for 1.2 s: nothing dropped (not ignored)')
    got, seen = p.recv(40)
    R.check(got == b3 and not seen & LSR_OE, hb, 'then the guest reads all 40, in order', (len(got), hex(seen)))
    # after a reset: ignored 1 s after the first access when the guest has read nothing; 16450 mode overwrites
    c.reset()
    s0 = d.stats(u, 0)
    b4 = pattern(20, 15)
    h.send(b4)
    wait_stats(d, u, 0, lambda x: x.get('rx', 0) - s0.get('rx', 0) >= 1)
    t_a = time.monotonic()
    p.wr(LCR, LCR_DLAB)        # the first access since the reset; RDI clear; no RBR read
    p.wr(DLL, 1)
    p.wr(LCR, 0x03)
    early = []

    def overwritten():
        x = d.stats(u, 0)
        if x.get('dropped', 0) > s0.get('dropped', 0) and time.monotonic() < t_a + 1.0:
            early.append(x)
        return x.get('dropped', 0) - s0.get('dropped', 0) >= 19 and x
    st = wait_until(overwritten, step=0.01)
    R.check(not early, hb, 'after a reset, RDI clear, no RBR read: nothing lost before 1 s after the first access', early[:2])
    dl = delta(s0, st or {})
    R.eq((dl['dropped'], dl['overruns']) if st else None, (19, 1), hb,
         'then ignored: 20 host bytes into the 16450 holding register: each overwrites the last (dropped 19, one OE)')
    R.eq(dl['rx'], 1, MT(S_BE, 'Counters'), '16450 overwrites: each character counts once, rx 1 (the first, which found room) and dropped 19')
    R.eq((p.lsr() & (LSR_OE | LSR_DR), p.rbr()), (LSR_OE | LSR_DR, b4[-1]), both(hb, MT(S_RX, 'Overrun')),
         '16450 mode on a host line: OE, and the receiver holds the newest byte')
    c.close()
    h.close()
    d.stop(u)


# ######################################################################
# Over the whole run
# ######################################################################
def t_whole_run(env):
    R.sec('Over the whole run')
    R.eq(LSR_SEEN[0] & (LSR_PE | LSR_FE), 0, MT(S_REGS, 'LSR'), 'PE and FE never set in any LSR read of the run')
    R.check(not vu.BAD_REPLIES, VU('Commands', 'error replies'), 'every reply well-formed', vu.BAD_REPLIES[:5])
    R.check(not MULTI_ERRORS, VU('Commands', 'REGION_WRITE_MULTI'), 'every REGION_WRITE_MULTI of THR bytes accepted', MULTI_ERRORS[:5])


GROUPS = [
    ('cli', [t_cli]),
    ('config', [t_config]),
    ('regions', [t_regions]),
    ('regs', [t_regs]),
    ('rx', [t_rx]),
    ('timeout', [t_timeout]),
    ('lsr', [t_lsr]),
    ('iir', [t_iir]),
    ('modem', [t_modem]),
    ('intx', [t_intx]),
    ('msi', [t_msi]),
    ('reset', [t_reset]),
    ('null', [t_null]),
    ('socket', [t_socket]),
    ('pty', [t_pty]),
    ('daemon', [t_daemon]),
]


def main():
    def after_each(env, fn):
        for key, (p, _, _) in list(env.servers.items()):
            if p.poll() is not None:
                raise SetupError('server %s exited (status %s) during %s' % (key, p.returncode, fn.__name__))

    def at_end(env):
        t_whole_run(env)
        for key, (p, sock, _) in env.servers.items():
            rc = env.stop(p)
            R.check(rc == 0 and not os.path.exists(sock), RM('Serving devices to QEMU', 'Stopping'),
                    'server %s: SIGTERM stops it (status 0) and removes its socket' % key, 'rc %s' % rc)
    return vu.contract_main('mtty', 'Contract test of umdev\'s mtty device, written from the docs alone (see the module docstring).',
                            GROUPS, Env, after_each=after_each, at_end=at_end)


if __name__ == '__main__':
    sys.exit(main())
