"""What a custom reward worker does to itself before it imports the user's file (standard library
only: it runs first thing in every spawned worker).

    session      os.setsid(): the worker leads its own session and process group, so
                 `os.killpg(os.getpgid(0), SIGTERM)` (a common cleanup idiom) and a terminal's or
                 a job's group signals reach the worker's processes only, never the trainer.
    parent death prctl(PR_SET_PDEATHSIG, SIGKILL) (Linux): a trainer that dies takes its workers
                 with it, even one stuck in the user's code.
    landlock     (Linux >= 5.13, when the kernel has it on) the kernel refuses, with EACCES, every
                 write under the protected directories (the run directory: metrics.jsonl,
                 checkpoints) and the creation of new entries directly in their parent folders;
                 reads and writes elsewhere are untouched. From landlock ABI 6 (Linux 6.12) the
                 worker and its children may signal no process outside themselves (EPERM): not
                 the trainer, not another rank.
    kill guard   os.kill / os.killpg refuse a target outside the worker's own session (the
                 parent, pid -1, another process group) with a PermissionError naming the rule; a
                 guard against the idiom, not a sandbox (landlock is the barrier where present).

`enter` returns what it applied, in words; the trainer logs it once. What it cannot apply is said
too (e.g. "landlock: not available on this kernel"), and the trainer's own checks (the run
directory's files compared around every call, a SIGTERM during a call named) remain.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from pathlib import Path

_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # the same on every Linux arch
_RULE_PATH_BENEATH = 1
_CREATE_RULESET_VERSION = 1
# landlock_access_fs bits (include/uapi/linux/landlock.h); reads and execution are not handled
_WRITE_FILE, _REMOVE_DIR, _REMOVE_FILE = 1 << 1, 1 << 4, 1 << 5
_MAKE = sum(1 << b for b in range(6, 13))  # char, dir, reg, sock, fifo, block, sym
_REFER, _TRUNCATE = 1 << 13, 1 << 14        # ABI 2, ABI 3
_SCOPE_SIGNAL = 1 << 1                      # ABI 6


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def landlock_abi() -> int:
    """The kernel's landlock ABI version; 0 when it has none (not Linux, too old, or turned off)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        v = _libc().syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    except (OSError, AttributeError):
        return 0
    return max(int(v), 0)


def _siblings(protected: list[Path]) -> list[Path]:
    """Every entry of every ancestor of the protected directories that is neither protected nor
    on the way to one, nor a symbolic link: the places writes stay allowed (landlock grants, it
    never subtracts; writes through a link at these levels are refused)."""
    on_path = {a for p in protected for a in (p, *p.parents)}
    out = []
    for d in sorted({a for p in protected for a in p.parents}):
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            # not a link (it may point at an ancestor: pytest-current -> pytest-N), not on the way
            if Path(e.path) not in on_path and not e.is_symlink():
                out.append(Path(e.path))
    return out


def _landlock(protected: list[Path], abi: int) -> str:
    libc = _libc()
    fs = _WRITE_FILE | _REMOVE_DIR | _REMOVE_FILE | _MAKE | (_REFER if abi >= 2 else 0) | (_TRUNCATE if abi >= 3 else 0)
    attr = _RulesetAttr(fs, 0, _SCOPE_SIGNAL if abi >= 6 else 0)
    size = ctypes.sizeof(attr) if abi >= 6 else 8  # ABI 1-5 read handled_access_fs only
    ruleset = libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        return f"landlock: create_ruleset failed ({os.strerror(ctypes.get_errno())})"
    try:
        for entry in _siblings(protected):
            try:
                fd = os.open(entry, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue  # a dangling link, a vanished entry: nothing to write through
            try:
                allowed = fs if entry.is_dir() else fs & (_WRITE_FILE | _TRUNCATE)
                rule = _PathBeneath(allowed, fd)
                libc.syscall(_SYS_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH),
                             ctypes.byref(rule), ctypes.c_uint32(0))  # a refused rule only denies more
            finally:
                os.close(fd)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \
                libc.syscall(_SYS_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            return f"landlock: restrict_self failed ({os.strerror(ctypes.get_errno())})"
    finally:
        os.close(ruleset)
    signals = "and signals to processes outside the worker refused" if abi >= 6 else \
        f"(signals not scoped: landlock ABI {abi} < 6)"
    return f"landlock ABI {abi}: writes under {', '.join(map(str, protected))} refused, {signals}"


def _guard_kill() -> None:
    """os.kill / os.killpg refuse targets outside the worker's session (see the module doc)."""
    real_kill, real_killpg, sid = os.kill, os.killpg, os.getsid(0)

    def own(pid: int) -> bool:
        try:
            return pid > 0 and os.getsid(pid) == sid
        except OSError:
            return True  # no such process: let the real call say so

    def kill(pid: int, sig: int) -> None:
        if not (own(pid) or (pid == 0) or (pid < -1 and own(-pid))):
            raise PermissionError(f"reward worker sandbox: os.kill({pid}, {sig}) refused: a custom reward function "
                                  f"may signal only its own processes (the trainer is pid {os.getppid()})")
        real_kill(pid, sig)

    def killpg(pgid: int, sig: int) -> None:
        if not (pgid == 0 or own(pgid)):
            raise PermissionError(f"reward worker sandbox: os.killpg({pgid}, {sig}) refused: a custom reward "
                                  f"function may signal only its own process group ({os.getpgid(0)})")
        real_killpg(pgid, sig)

    os.kill, os.killpg = kill, killpg


def enter(protected: list[str], *, landlock: bool = True) -> list[str]:
    """Apply what this platform allows (module doc) and return it in words; never raises.
    `landlock=False` leaves the kernel's barrier off (tests of the trainer's own checks use it)."""
    notes = []
    try:
        os.setsid()
        notes.append("own session")
    except OSError as e:  # already a session leader
        notes.append(f"session: {e}")
    if sys.platform.startswith("linux"):
        parent = os.getppid()
        if _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
            notes.append("killed with the trainer (PDEATHSIG)")
        if os.getppid() != parent:  # the trainer died before the prctl took effect
            os._exit(1)
    dirs = [Path(os.path.realpath(p)) for p in protected]
    abi = landlock_abi() if landlock else 0
    if not dirs:
        pass
    elif abi:
        notes.append(_landlock(dirs, abi))
    else:
        notes.append(f"landlock: {'not available on this kernel' if landlock else 'off'} (the run directory is "
                     f"checked around each call)")
    _guard_kill()
    notes.append("os.kill/os.killpg limited to the worker's own processes")
    return notes
